"""What adaptive γ is configured with and what it measures: GammaConfig, and the CostModel of
target passes by block size, draft steps and replay on this device (runtime/policy.py chooses γ
from them)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


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
        for name in ("fixed", "max_gamma", "probe_first", "probe_every", "max_failed_probes"):
            value = getattr(self, name)
            if not (value is None and name == "fixed") and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if self.fixed is not None and not 1 <= self.fixed <= MAX_GAMMA:
            raise ValueError(f"gamma must be 1..{MAX_GAMMA} (or adaptive), got {self.fixed}; --draft none decodes without drafting")
        if not 1 <= self.max_gamma <= MAX_GAMMA:
            raise ValueError(f"max_gamma must be 1..{MAX_GAMMA}, got {self.max_gamma}")
        if self.probe_first < 1 or self.probe_every < 1:
            raise ValueError(f"probe_first and probe_every must be >= 1, got {self.probe_first} and {self.probe_every}")
        if self.max_failed_probes < 0:
            raise ValueError(f"max_failed_probes must be >= 0, got {self.max_failed_probes}")
        for name in ("min_gain", "max_loss", "prior_weight"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.decay <= 1:
            raise ValueError(f"decay must be in (0, 1], got {self.decay!r}")


class CostModel:
    """Exponential moving averages of measured seconds: target pass by block size T, and one
    draft step. Unmeasured T are interpolated linearly between measured ones."""

    def __init__(self, smoothing: float = 0.2):
        self.smoothing = smoothing
        self.target: dict[int, float] = {}
        self.draft_step: dict[str, float] = {}  # by drafter name
        self.replay_token: dict[str, float] = {}  # by drafter name: seconds per token replayed
        self.batch: dict[int, float] = {}  # by rows: a batched pass feeding one token to each of that many sequences
        self.prefill_token: float | None = None  # seconds per prompt token in a prefill chunk beside a batch

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

    def record_batch(self, rows: int, seconds: float) -> None:
        self.batch[rows] = self._ema(self.batch.get(rows), seconds)

    def record_prefill(self, n_tokens: int, seconds: float) -> None:
        if n_tokens:
            self.prefill_token = self._ema(self.prefill_token, seconds / n_tokens)

    def prefill_chunk(self, seconds: float, smallest: int, largest: int) -> int:
        """The most prompt tokens a prefill chunk may take to cost at most `seconds`, within
        [smallest, largest]: priced per token as measured, until then as the longest measured
        target pass (a verify block costs more than a prefill chunk: it returns every row's logits)."""
        per_token = self.prefill_token
        if per_token is None:
            block = max(self.target, default=1)
            per_token = self.target_cost(block) / block
        return int(min(largest, max(smallest, seconds // per_token if per_token > 0 else largest)))

    def batch_cost(self, rows: int) -> float | None:
        """Seconds of a batched pass over `rows` sequences (0 for none, a 1-token pass for one),
        interpolated between measured row counts; None past the largest measured: the pass
        grows with its rows by an amount only a measurement tells."""
        if rows <= 1:
            return rows * self.target_cost(1)
        if rows in self.batch:
            return self.batch[rows]
        known = {1: self.target_cost(1), **self.batch}
        if rows > max(known):
            return None
        ks = sorted(known)
        return float(np.interp(rows, ks, [known[k] for k in ks]))

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
