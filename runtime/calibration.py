"""Start-up calibration: time this device's target passes and draft steps before the first
round, so adaptive γ chooses from measured costs from the start."""

from __future__ import annotations

import time

import numpy as np

from edge_spec.sampling import SamplingConfig
from runtime.drafters.base import Drafter, parts
from runtime.gamma import CostModel
from runtime.model import ModelRunner


def calibrated(costs: CostModel, drafter: Drafter | None) -> bool:
    """The cost model has target passes and a draft step for every part that costs passes."""
    if drafter is None:
        return True
    return bool(costs.target) and all(p.name in costs.draft_step for p in parts(drafter) if p.costs_passes)


def calibrate(target: ModelRunner, drafter: Drafter, costs: CostModel, token: int, max_gamma: int, repeats: int = 2) -> None:
    """Time target passes for every block size γ+1 may take, one draft step and a draft model's
    replay per token, feeding `token` (any real id: an EOS). The first round warms the
    sessions up and is not recorded. Leaves the caches empty."""
    tokens = np.array([token] * (max_gamma + 2), dtype=np.int64)
    for repeat in range(repeats + 1):
        for block in range(1, max_gamma + 2):
            target.cache.reset()
            began = time.perf_counter()
            target.forward(tokens[:block])
            if repeat:
                costs.record_target(block, time.perf_counter() - began)
        for part in parts(drafter):
            if part.costs_passes:
                target.cache.reset()
                part.reset(tokens[:1])  # a draft model prefills here, outside the timing
                target.forward(tokens[:1])
                steps = 3
                began = time.perf_counter()
                part.propose(tokens[:2], steps, SamplingConfig(), np.random.default_rng(0))
                if repeat:
                    costs.record_draft(part.name, steps, time.perf_counter() - began)
                if repeat and part.catches_up:  # replay: a draft model that sat out γmax+1 committed tokens feeds them first
                    part.reset(tokens[:1])
                    if part.replay_tokens(tokens):
                        proposal = part.propose(tokens, 1, SamplingConfig(), np.random.default_rng(0))
                        costs.record_replay(part.name, proposal.catch_up_tokens, proposal.catch_up_seconds)
    target.cache.reset()
    drafter.reset()
