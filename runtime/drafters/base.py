"""The drafter interface the loop speaks to, with the capabilities some drafters add.

Every drafter proposes, learns the outcome, and resets for a new sequence. What only some do is
a capability on `Drafter` with a default the others keep, so the loop, policy and calibration
ask the drafter rather than its type: `costs_passes` (drafting runs model passes, which the cost
model prices), `catches_up` with `replay_tokens` (a draft model with its own cache replays what
it missed before it drafts), `parts` / `candidates` (a mixed drafter picks one of its parts per
round), `forget` (it keeps what earlier sequences said, to copy from: the suffix cache),
`reads_hidden` with `seen` (it drafts from the target's features: the target's passes return
those layers' outputs and the drafter is shown the rows each kept, as llama.cpp's drafters see
each target batch). The bases `CostsPasses`, `CatchesUp` and `Selects` set them; a proposal's
`trunk_hidden` (layer skip) and catch-up fields (a draft model) default to nothing.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

import numpy as np

from edge_spec.sampling import SamplingConfig, process_logits, sample


@dataclass(frozen=True)
class Proposal:
    tokens: np.ndarray  # [γ] int64
    # q for each drafted token, processed exactly like p; None for a deterministic proposal
    # (prompt lookup), which the loop verifies as q = one-hot.
    draft_probs: np.ndarray | None  # [γ, V]
    # What only some proposals carry (TrunkProposal, CatchUpProposal): class defaults, not fields.
    trunk_hidden = None
    catch_up_seconds = 0.0
    catch_up_tokens = 0

    @classmethod
    def of(cls, tokens: list[int], draft_probs: list[np.ndarray | None], **extra) -> "Proposal":
        """From per-token picks; q is None when drafted greedily (no distribution needed)."""
        probs = None if draft_probs[0] is None else np.stack(draft_probs)  # [γ,V]
        return cls(np.array(tokens, dtype=np.int64), probs, **extra)


@dataclass(frozen=True)
class TrunkProposal(Proposal):
    # The target's first-stage output for [pending, d1..d(γ-1)], with their KV rows already
    # written, so the verify pass does not compute them again.
    trunk_hidden: np.ndarray  # [1, γ, H]


@dataclass(frozen=True)
class CatchUpProposal(Proposal):
    # Seconds spent feeding the tokens the drafter had not seen (after plain steps): a one-off,
    # not part of what a draft step costs, so the cost model prices it apart.
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0


class Drafter(ABC):
    name: str
    costs_passes = False  # drafting runs model passes: the cost model times its steps
    catches_up = False  # it must feed itself what it missed before drafting (replay_tokens)
    reads_hidden: tuple[int, ...] = ()  # the target's layers whose outputs it drafts from

    @abstractmethod
    def propose(self, tokens: np.ndarray, gamma: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal | None:
        """Up to γ tokens to follow `tokens` (committed, the last one not yet fed to the
        target), or None when there is nothing worth verifying."""

    def accepted(self, tokens: np.ndarray, n_accepted: int) -> None:
        """Learn the outcome of the last round; `tokens` is the new committed sequence."""

    def reset(self, tokens: np.ndarray = np.zeros(0, dtype=np.int64), prefill: bool = True) -> None:
        """A new sequence starts with `tokens`: forget everything that is not a prefix of it
        (so a repeated prompt prefix is not fed again). prefill: a drafter that catches up feeds
        itself `tokens` now (timed as prefill); else it does so in the first round it drafts,
        where the policy prices that as replay."""

    def seen(self, first_row: int, hidden: dict[int, np.ndarray]) -> None:
        """The target kept rows first_row.. with these outputs of its reads_hidden layers
        ([rows, H] each): the prompt's after prefill, then each round's pending and accepted
        tokens. Only a drafter that reads hidden states is told."""

    def evidence(self, tokens: np.ndarray) -> int:
        """The class of situation a round after `tokens` drafts in, when acceptance differs by
        class (a copying drafter's match length): the policy keeps an α per class."""
        return 0

    def replay_tokens(self, tokens: np.ndarray) -> int:
        """Tokens this drafter must feed itself before it can draft after `tokens`."""
        return 0

    def parts(self) -> list[Drafter]:
        """Every drafter a round can draft with, each with its own γ policy: itself."""
        return [self]

    def candidates(self, tokens: np.ndarray) -> list[Drafter]:
        """The parts able to propose after `tokens`, preferred first; the policy picks one."""
        return [self]

    def forget(self) -> None:
        """Keep nothing from earlier sequences (only a drafter that copies from them keeps any)."""

    def use_clock(self, clock) -> None:
        """Time what it times itself (replay) with `clock`: only a drafter that catches up does."""


class CostsPasses(Drafter):
    """Drafting runs model passes (a draft model, layer skip): the cost model times its steps.
    Other drafters (lookup) draft for almost nothing and are priced at zero."""

    costs_passes = True


class CatchesUp(CostsPasses):
    """A drafter with its own cache that sits out plain and copy rounds, so it must first feed
    itself what it missed; the round that drafts next pays for that replay. It times the replay
    with `clock` (the loop sets its own) and reports it in a CatchUpProposal."""

    catches_up = True
    clock = staticmethod(time.perf_counter)

    def use_clock(self, clock) -> None:
        self.clock = clock

    @abstractmethod
    def replay_tokens(self, tokens: np.ndarray) -> int:
        """Tokens this drafter must feed itself before it can draft after `tokens`."""


class Selects(Drafter):
    """A drafter made of parts, one of which drafts each round (the policy asks which). It is a
    selection, not a proposer: the loop calls propose on the part the policy's plan names."""

    def propose(self, tokens, gamma, sampling, rng):
        # Drafting with a fixed part here would bypass the policy's choice and its α per part.
        raise TypeError(f"{self.name!r} selects one of its parts per round (RoundPolicy.choose); "
                        "call propose on the chosen part (Plan.drafter), not on the selection")

    @abstractmethod
    def parts(self) -> list[Drafter]:
        """Every drafter that can be selected, each with its own γ policy."""

    @abstractmethod
    def candidates(self, tokens: np.ndarray) -> list[Drafter]:
        """The parts able to propose after `tokens`, preferred first; the policy picks one."""


def parts(drafter: Drafter | None) -> list[Drafter]:
    """The drafters a round can draft with: a mixed drafter's parts, else the drafter itself."""
    return [] if drafter is None else drafter.parts()


def reads_hidden(drafter: Drafter | None) -> tuple[int, ...]:
    """The target layers any part of `drafter` reads: every pass returns them, whichever part drafts."""
    return tuple(sorted({layer for part in parts(drafter) for layer in part.reads_hidden}))


def use_clock(drafter: Drafter | None, clock) -> None:
    """Drafters that time themselves (replay) read `clock`, so a fake clock reaches every measurement."""
    for part in parts(drafter):
        part.use_clock(clock)


def pick_token(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """Draft one token from logits [V]: argmax when greedy (no q needed: greedy verification
    compares tokens), else a sample from the processed distribution q, returned with it."""
    if sampling.greedy:
        return int(np.argmax(logits)), None
    draft_probs = process_logits(logits, sampling)  # [V]
    return sample(draft_probs, rng), draft_probs
