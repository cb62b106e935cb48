"""The speculative decoding loop: draft, verify in one target pass, accept, roll back.

It prints nothing and decides no stopping: it yields one Step per target pass and the
caller stops consuming when it has enough.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from edge_spec.sampling import SamplingConfig, process_logits
from edge_spec.verify import verify_deterministic, verify_greedy, verify_stochastic
from runtime.drafters.base import Drafter, Proposal
from runtime.gamma import CostModel, GammaController
from runtime.model import ModelRunner


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
    target: ModelRunner,
    drafter: Drafter | None,
    prompt_ids: list[int],
    sampling: SamplingConfig,
    rng: np.random.Generator,
    controllers: dict[str, GammaController],
    costs: CostModel,
    clock: Callable[[], float] = time.perf_counter,
) -> Iterator[Step]:
    """controllers: one γ controller per drafter in drafter.parts(), by name. clock: seconds,
    read for every timing the cost model and γ controllers learn from (the drafters' too), so
    a fake clock makes adaptive γ deterministic."""
    tokens = np.asarray(prompt_ids, dtype=np.int64)
    # Rows that already hold a prefix of this prompt (a previous turn of a chat) are kept.
    target.cache.rollback_to_prefix(tokens[:-1])
    if drafter is not None:
        drafter.set_clock(clock)
        drafter.reset(tokens[:-1])
    target.prefill(tokens[target.cache.kv_len : -1])  # the last prompt token stays pending: every round feeds it first
    while True:
        began = clock()
        active = drafter.select(tokens) if drafter is not None else None
        n_gamma = 0
        if active is not None:
            step_cost = costs.draft_step.get(active.name, 0.0) if active.costs_passes else 0.0
            replay_cost = costs.replay_cost(active.name, active.replay_tokens(tokens))
            n_gamma = min(controllers[active.name].choose(step_cost, replay_cost), target.cache.max_context - len(tokens))
        proposal = active.propose(tokens, n_gamma, sampling, rng) if n_gamma > 0 else None
        drafted_at = clock()
        n_drafted = 0 if proposal is None else len(proposal.tokens)
        block = tokens[-1:] if proposal is None else np.concatenate([tokens[-1:], proposal.tokens])
        logits = target.forward(block, trunk_hidden=None if proposal is None else proposal.trunk_hidden)  # [γ+1,V]
        verified_at = clock()
        n_accepted, next_token = verify(logits, proposal, sampling, rng)
        new_tokens = np.append(block[1 : 1 + n_accepted], next_token)
        tokens = np.concatenate([tokens, new_tokens])
        # tokens[:-1]: the pending token never keeps a row, even if it equals a rejected draft.
        target.cache.rollback_to_prefix(tokens[:-1])
        if drafter is not None:
            drafter.accepted(tokens, n_accepted)
        costs.record_target(len(block), verified_at - drafted_at)
        if n_drafted:
            controllers[active.name].update(n_drafted, n_accepted)
            controllers[active.name].record_round(verified_at - began, len(new_tokens))
            if active.costs_passes:
                costs.record_draft(active.name, n_drafted, drafted_at - began - proposal.catch_up_seconds)
                costs.record_replay(active.name, proposal.catch_up_tokens, proposal.catch_up_seconds)
        name = active.name if n_drafted else None
        yield Step(tuple(int(t) for t in new_tokens), n_gamma, n_drafted, n_accepted, drafted_at - began, verified_at - drafted_at, name)
