"""The drafter interface the loop speaks to."""

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
    # Layer skip only: the target's first-stage output for [pending, d1..d(γ-1)], with their
    # KV rows already written, so the verify pass does not compute them again.
    trunk_hidden: np.ndarray | None = None  # [1, γ, H]
    # Seconds spent feeding the draft tokens it had not seen (after plain steps): a one-off,
    # not part of what a draft step costs, so the cost model leaves it out.
    catch_up_seconds: float = 0.0
    catch_up_tokens: int = 0

    @classmethod
    def of(cls, tokens: list[int], draft_probs: list[np.ndarray | None], trunk_hidden: np.ndarray | None = None,
           catch_up_seconds: float = 0.0, catch_up_tokens: int = 0) -> "Proposal":
        """From per-token picks; q is None when drafted greedily (no distribution needed)."""
        probs = None if draft_probs[0] is None else np.stack(draft_probs)  # [γ,V]
        return cls(np.array(tokens, dtype=np.int64), probs, trunk_hidden, catch_up_seconds, catch_up_tokens)


class Drafter(ABC):
    name: str
    # Drafting costs model passes (a draft model, layer skip) or almost nothing (lookup).
    costs_passes: bool = True
    # Seconds, for what a drafter times itself (a draft model's replay); the loop sets its own.
    clock = staticmethod(time.perf_counter)

    @abstractmethod
    def propose(self, tokens: np.ndarray, gamma: int, sampling: SamplingConfig, rng: np.random.Generator) -> Proposal | None:
        """Up to γ tokens to follow `tokens` (committed, the last one not yet fed to the
        target), or None when there is nothing worth verifying."""

    def replay_tokens(self, tokens: np.ndarray) -> int:
        """Tokens this drafter must feed itself before it can draft after `tokens` (a draft
        model that sat out plain or copy rounds); the round that drafts next pays for them."""
        return 0

    def set_clock(self, clock) -> None:
        """Time with `clock` (the loop's), so a fake clock reaches every measurement."""
        for part in self.parts():
            part.clock = clock

    def select(self, tokens: np.ndarray) -> "Drafter":
        """The drafter that proposes this round (a mixed drafter picks one of its parts)."""
        return self

    def parts(self) -> list["Drafter"]:
        """Every drafter that can be selected, each with its own γ controller."""
        return [self]

    def accepted(self, tokens: np.ndarray, n_accepted: int) -> None:
        """Learn the outcome of the last round; `tokens` is the new committed sequence."""

    def reset(self, tokens: np.ndarray = np.zeros(0, dtype=np.int64)) -> None:
        """A new sequence starts with `tokens`: forget everything that is not a prefix of it
        (so a repeated prompt prefix is not fed again)."""


def pick_token(logits: np.ndarray, sampling: SamplingConfig, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """Draft one token from logits [V]: argmax when greedy (no q needed: greedy verification
    compares tokens), else a sample from the processed distribution q, returned with it."""
    if sampling.greedy:
        return int(np.argmax(logits)), None
    draft_probs = process_logits(logits, sampling)  # [V]
    return sample(draft_probs, rng), draft_probs
