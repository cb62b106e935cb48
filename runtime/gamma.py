"""Adaptive γ: measured costs and a running acceptance estimate choose the draft length.

For acceptance α, γ drafted tokens yield E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens per target
pass. A round costs γ draft steps plus one target pass over γ+1 tokens, against one 1-token
pass per token for plain decoding, so the expected speedup of γ is

    E(α, γ) · t_target(1) / (γ · t_draft + t_target(γ + 1)),

which is the textbook E / (1 + γc) when a (γ+1)-token pass costs what a 1-token pass does.
Both t_draft and the verify-cost curve t_target(T) are measured on this device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from edge_spec.verify import expected_tokens_per_pass


@dataclass(frozen=True)
class GammaConfig:
    fixed: int | None = None  # None: adaptive
    max_gamma: int = 8
    # Once speculation is switched off, probe (draft once) after probe_first plain steps, then
    # after twice as many each time a probe does not turn it back on, up to probe_every: a new
    # sequence learns its α within a few steps, a hopeless one costs a probe per probe_every.
    probe_first: int = 2
    probe_every: int = 32
    # Probes that fail in a row before the drafter stays off for the rest of the sequence: a
    # draft model must first replay every token it missed, so each probe costs what it skipped.
    max_failed_probes: int = 2
    min_gain: float = 1.02  # speculate only when the model predicts at least this speedup
    decay: float = 0.98  # weight of history in the acceptance estimate (per round)


class CostModel:
    """Exponential moving averages of measured seconds: target pass by block size T, and one
    draft step. Unmeasured T are interpolated linearly between measured ones."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.target: dict[int, float] = {}
        self.draft_step: dict[str, float] = {}  # by drafter name

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def record_target(self, block: int, seconds: float) -> None:
        self.target[block] = self._ema(self.target.get(block), seconds)

    def record_draft(self, drafter: str, steps: int, seconds: float) -> None:
        if steps:
            self.draft_step[drafter] = self._ema(self.draft_step.get(drafter), seconds / steps)

    def target_cost(self, block: int) -> float:
        if block in self.target:
            return self.target[block]
        known = sorted(self.target)
        if not known:
            return 1.0
        if block > known[-1] and len(known) > 1:
            # Past the largest measured block, extend the last segment's slope: a longer
            # verify pass costs more, never the same.
            below, top = known[-2], known[-1]
            slope = (self.target[top] - self.target[below]) / (top - below)
            return self.target[top] + max(slope, 0.0) * (block - top)
        return float(np.interp(block, known, [self.target[k] for k in known]))

    def cost_ratio(self, drafter: str) -> float | None:
        """c = draft step / 1-token target pass, as measured."""
        if drafter not in self.draft_step or 1 not in self.target:
            return None
        return self.draft_step[drafter] / self.target[1]


class GammaController:
    def __init__(self, config: GammaConfig, costs: CostModel, prior_alpha: float = 0.6):
        self.config = config
        self.costs = costs
        # Pseudo-counts: a weak prior that measured rounds quickly override.
        self.n_accepted = 2.0 * prior_alpha
        self.n_rejected = 2.0 * (1.0 - prior_alpha)
        self.start()

    def start(self) -> None:
        """A new sequence: probe soon again (α carries over as a prior, decayed by its rounds)."""
        self.plain_steps = 0
        self.probe_gap = self.config.probe_first
        self.failed_probes = 0
        self.probing = False

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), the MLE for a geometric
        run truncated at γ (positions after a rejection are never observed)."""
        return self.n_accepted / (self.n_accepted + self.n_rejected)

    def expected_speedup(self, gamma: int, draft_step_cost: float) -> float:
        if gamma == 0:
            return 1.0
        tokens = expected_tokens_per_pass(self.alpha, gamma)
        round_cost = gamma * draft_step_cost + self.costs.target_cost(gamma + 1)
        return tokens * self.costs.target_cost(1) / round_cost

    def choose(self, draft_step_cost: float) -> int:
        """γ for the next round (0: a plain target step), given the seconds of one draft step
        (0 for copying drafters)."""
        if self.config.fixed is not None:
            return self.config.fixed
        step = draft_step_cost
        gains = [self.expected_speedup(g, step) for g in range(self.config.max_gamma + 1)]
        best = int(np.argmax(gains))
        if gains[best] >= self.config.min_gain:
            self.plain_steps = 0
            self.probe_gap = self.config.probe_first
            self.failed_probes = 0
            return best
        if self.probing:  # the last round was a probe, and speculation is still not worth it
            self.failed_probes += 1
            self.probing = False
        self.plain_steps += 1
        if self.plain_steps >= self.probe_gap and self.failed_probes < self.config.max_failed_probes:
            # Conditions change (a code block starts, say): draft once to refresh α.
            self.plain_steps = 0
            self.probe_gap = min(2 * self.probe_gap, self.config.probe_every)
            self.probing = True
            return max(1, int(np.argmax(gains[1:])) + 1)
        return 0

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        decay = self.config.decay
        self.n_accepted = decay * self.n_accepted + n_accepted
        self.n_rejected = decay * self.n_rejected + (1.0 if n_accepted < n_drafted else 0.0)
