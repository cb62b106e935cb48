"""The speculative decoding loop: choose a plan, draft, verify in one target pass, accept, roll
back, report the round to the policy with its plan.

It prints nothing and decides no stopping: it yields one Step per target pass and the
caller stops consuming when it has enough. What to draft and how much is the policy's
(runtime/policy.py), and so is everything learned from the rounds.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from edge_spec.sampling import SamplingConfig, process_logits
from edge_spec.verify import verify_deterministic, verify_greedy, verify_stochastic
from runtime.drafters.base import Drafter, Proposal, reads_hidden, use_clock
from runtime.passes import Block, Model
from runtime.policy import Plan, Round, RoundPolicy


@dataclass(frozen=True)
class Step:
    tokens: tuple[int, ...]  # newly committed: the accepted drafted tokens, then one from the target
    gamma: int  # γ asked of the drafter (0: plain step)
    n_drafted: int
    n_accepted: int
    draft_s: float
    target_s: float
    drafter: str | None


def verify(logits: np.ndarray, proposal: Proposal | None, sampling: SamplingConfig, rng) -> tuple[int, int]:
    """Pick the verifier from what the drafter reported: greedy, deterministic tokens, or
    tokens with their q. logits [γ+1, V]."""
    draft_tokens = proposal.tokens if proposal is not None else np.zeros(0, dtype=np.int64)
    if sampling.greedy:
        return verify_greedy(logits, draft_tokens)
    target_probs = process_logits(logits, sampling)  # [γ+1,V]
    if proposal is None or proposal.draft_probs is None:
        return verify_deterministic(target_probs, draft_tokens, rng)
    return verify_stochastic(target_probs, proposal.draft_probs, draft_tokens, rng)


def decode_steps(
    target: Model,
    drafter: Drafter | None,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    rng: np.random.Generator,
    policy: RoundPolicy,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Step]:
    """policy: started for this drafter and sequence (RoundPolicy.start); it plans each round
    (drafter and γ) and learns from each round, handed back with its plan. clock: seconds, read
    for every timing the policy learns from (the drafters' too), so a fake clock makes adaptive
    γ deterministic."""
    tokens = np.asarray(prompt_ids, dtype=np.int64)
    # Rows that already hold a prefix of this prompt (a previous turn of a chat) are kept, unless
    # the drafter reads hidden states: their features were not kept, so the prompt is fed again.
    target.keep_prefix(tokens[:-1] if not reads_hidden(drafter) else tokens[:0])
    if drafter is not None:
        use_clock(drafter, clock)
        drafter.reset(tokens[:-1])
    first = target.kept
    seen = target.prefill(tokens[first:-1], hidden=reads_hidden(drafter))  # the last prompt token stays pending: every round feeds it first
    if seen is not None:
        drafter.seen(first, seen)
    while True:
        began = clock()
        tokens, step = play_round(target, drafter, policy.choose(tokens), tokens, sampling, rng, policy, began, clock)
        yield step


def play_round(target: Model, drafter: Drafter | None, plan: Plan, tokens: np.ndarray, sampling: SamplingConfig,
               rng: np.random.Generator, policy: RoundPolicy, began: float, clock: Callable[[], float] = time.perf_counter,
               ) -> tuple[np.ndarray, Step]:
    """One round on `plan` (the policy chose it at `began`): draft, verify in one target pass,
    accept, roll back, report the round to the policy. tokens: committed, the last one pending
    (no row yet); returns them extended by the round's tokens, and its Step."""
    active = plan.drafter
    gamma = min(plan.gamma, target.max_context - len(tokens))
    proposal = active.propose(tokens, gamma, sampling, rng) if gamma > 0 else None
    drafted_at = clock()
    start = target.kept
    block = Block.chain(tokens[-1:] if proposal is None else np.concatenate([tokens[-1:], proposal.tokens]), start,
                        hidden=reads_hidden(drafter))
    scored = target.score(block, None if proposal is None else proposal.trunk_hidden)  # logits [γ+1,V]
    verified_at = clock()
    n_accepted, next_token = verify(scored.logits, proposal, sampling, rng)
    new_tokens = np.append(block.tokens[1 : 1 + n_accepted], next_token)
    tokens = np.concatenate([tokens, new_tokens])
    # tokens[:-1]: the pending token never keeps a row, even if it equals a rejected draft.
    target.keep_prefix(tokens[:-1])
    if drafter is not None:
        drafter.accepted(tokens, n_accepted)
        if block.hidden:  # the target's features of the rows it kept: the pending token and the accepted drafts
            drafter.seen(start, scored.rows(range(target.kept - start)))
    done = Round.of(active, gamma, proposal, n_accepted, len(new_tokens), began, drafted_at, verified_at)
    policy.observe(plan, done)
    return tokens, Step(tuple(int(t) for t in new_tokens), gamma, done.n_drafted, n_accepted, done.draft_s, done.target_s, done.drafter)
