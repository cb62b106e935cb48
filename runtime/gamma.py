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


MAX_GAMMA = 32  # start-up calibration times every verify block up to max_gamma + 1 (its cost grows with the square)


@dataclass(frozen=True)
class GammaConfig:
    fixed: int | None = None  # None: adaptive
    max_gamma: int = 8
    # Once speculation is switched off, probe (draft once) after probe_first plain steps, then
    # after twice as many each time a probe does not turn it back on, up to probe_every: a new
    # sequence learns its α within a few steps, a hopeless one costs a probe per probe_every.
    probe_first: int = 2
    probe_every: int = 32
    # Probes that fail (a drafted token rejected) in a row before the drafter stays off for the
    # rest of the sequence: a draft model must first replay every token it missed, so each
    # probe costs what it skipped.
    max_failed_probes: int = 2
    min_gain: float = 1.02  # speculate only when the model predicts at least this speedup
    decay: float = 0.98  # weight of history in the acceptance estimate (per round)
    # What this drafter's rounds may lose against plain decoding, as a fraction of the
    # sequence's plain time, before it stays off: predictions rest on α and costs estimated
    # from few rounds, the ledger on what the rounds really took (draft replay included).
    max_loss: float = 0.01
    # Pseudo-counts of acceptance evidence a new sequence starts from: what earlier sequences
    # taught, shrunk to a prior that a few rounds of a different kind of text can overturn.
    prior_weight: float = 4.0

    def __post_init__(self):
        if self.fixed is not None and not 1 <= self.fixed <= MAX_GAMMA:
            raise ValueError(f"gamma must be 1..{MAX_GAMMA} (or adaptive), got {self.fixed}; --draft none decodes without drafting")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise ValueError(f"max_gamma must be 1..{MAX_GAMMA}, got {self.max_gamma}")


class CostModel:
    """Exponential moving averages of measured seconds: target pass by block size T, and one
    draft step. Unmeasured T are interpolated linearly between measured ones."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.target: dict[int, float] = {}
        self.draft_step: dict[str, float] = {}  # by drafter name
        self.replay_token: dict[str, float] = {}  # by drafter name: seconds per token replayed

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else old + self.smoothing * (new - old)

    def record_target(self, block: int, seconds: float) -> None:
        self.target[block] = self._ema(self.target.get(block), seconds)

    def record_draft(self, drafter: str, steps: int, seconds: float) -> None:
        if steps:
            self.draft_step[drafter] = self._ema(self.draft_step.get(drafter), seconds / steps)

    def record_replay(self, drafter: str, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            self.replay_token[drafter] = self._ema(self.replay_token.get(drafter), seconds / n_tokens)

    def replay_cost(self, drafter: str, n_tokens: int) -> float:
        """Seconds to replay n_tokens the drafter missed; until measured, a draft step each
        (a block pass costs less per token, so this errs on the side of not drafting)."""
        if not n_tokens:
            return 0.0
        return n_tokens * self.replay_token.get(drafter, self.draft_step.get(drafter, 0.0))

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

    def start(self, horizon_tokens: int = 256) -> None:
        """A new sequence of up to horizon_tokens: probe soon again (α carries over as a prior,
        decayed by its rounds), and open a new loss ledger."""
        self.plain_steps = 0
        self.probe_gap = self.config.probe_first
        self.failed_probes = 0
        self.probing = False
        self.horizon_tokens = horizon_tokens
        self.loss_seconds = 0.0
        evidence = self.n_accepted + self.n_rejected
        if evidence > self.config.prior_weight:
            shrink = self.config.prior_weight / evidence
            self.n_accepted *= shrink
            self.n_rejected *= shrink

    def record_round(self, seconds: float, n_tokens: int) -> None:
        """A speculative round of this drafter took `seconds` (drafting, replay and the verify
        pass) and committed n_tokens, which plain decoding takes n_tokens 1-token passes for."""
        self.loss_seconds += seconds - n_tokens * self.costs.target_cost(1)

    def over_budget(self, at_risk: float = 0.0) -> bool:
        """The ledger: speculation with this drafter has lost, or would lose with at_risk more
        seconds (a probe's expected loss), more than max_loss of the sequence's plain time.
        Wins earn room for later rounds."""
        return self.loss_seconds + at_risk > self.config.max_loss * self.horizon_tokens * self.costs.target_cost(1)

    def round_cost(self, gamma: int, draft_step_cost: float, replay_seconds: float = 0.0) -> float:
        return replay_seconds + gamma * draft_step_cost + self.costs.target_cost(gamma + 1)

    @property
    def alpha(self) -> float:
        """Per-token acceptance: accepted / (accepted + rejections), the MLE for a geometric
        run truncated at γ (positions after a rejection are never observed)."""
        return self.n_accepted / (self.n_accepted + self.n_rejected)

    def expected_speedup(self, gamma: int, draft_step_cost: float, replay_seconds: float = 0.0) -> float:
        if gamma == 0:
            return 1.0
        tokens = expected_tokens_per_pass(self.alpha, gamma)
        return tokens * self.costs.target_cost(1) / self.round_cost(gamma, draft_step_cost, replay_seconds)

    def choose(self, draft_step_cost: float, replay_seconds: float = 0.0) -> int:
        """γ for the next round (0: a plain target step), given the seconds of one draft step
        (0 for copying drafters) and of replaying what the drafter missed before it can draft
        (a draft model after plain or copy rounds): this round pays for it."""
        if self.config.fixed is not None:
            return self.config.fixed
        if self.over_budget():
            return 0
        step = draft_step_cost
        gains = [self.expected_speedup(g, step, replay_seconds) for g in range(self.config.max_gamma + 1)]
        best = int(np.argmax(gains))
        if gains[best] >= self.config.min_gain:
            self.plain_steps = 0
            self.probe_gap = self.config.probe_first
            self.failed_probes = 0
            return best
        self.plain_steps += 1
        probe = 1 + int(np.argmax(gains[1:]))
        # A probe is expected to lose (that is why speculation is off): run it only if the
        # ledger can afford that loss, replay included.
        expected_loss = self.round_cost(probe, step, replay_seconds) * (1.0 - gains[probe])
        due = self.plain_steps >= self.probe_gap and self.failed_probes < self.config.max_failed_probes
        if due and not self.over_budget(expected_loss):
            # Conditions change (a code block starts, say): draft once to refresh α.
            self.plain_steps = 0
            self.probe_gap = min(2 * self.probe_gap, self.config.probe_every)
            self.probing = True
            return probe
        return 0

    def update(self, n_drafted: int, n_accepted: int) -> None:
        if n_drafted == 0:
            return
        if self.probing:
            # A probe fails when the target rejects a drafted token; one accepted in full is
            # evidence for the drafter even while the prior still keeps the predicted gain low.
            self.failed_probes = 0 if n_accepted == n_drafted else self.failed_probes + 1
            self.probing = False
        decay = self.config.decay
        self.n_accepted = decay * self.n_accepted + n_accepted
        self.n_rejected = decay * self.n_rejected + (1.0 if n_accepted < n_drafted else 0.0)
