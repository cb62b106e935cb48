"""Exactness audit: is the speculative output distribution the target's own?

Samples the first few generated tokens N times with speculation and N times without, and
compares the two empirical distributions at each position with a permutation test on the
total-variation distance (no distributional assumption, no scipy).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PositionReport:
    position: int
    tv_distance: float
    p_value: float
    distinct_tokens: int


@dataclass(frozen=True)
class AuditReport:
    samples: int
    positions: tuple[PositionReport, ...]
    alpha: float  # family-wise significance level (Bonferroni over positions)

    @property
    def passed(self) -> bool:
        threshold = self.alpha / max(len(self.positions), 1)
        return all(p.p_value > threshold for p in self.positions)

    def to_dict(self) -> dict:
        return {
            "samples": self.samples,
            "alpha": self.alpha,
            "passed": self.passed,
            "positions": [p.__dict__ for p in self.positions],
        }


def tv_distance(a: np.ndarray, b: np.ndarray) -> float:
    """Total-variation distance between the empirical distributions of two token arrays."""
    count_a, count_b = Counter(a.tolist()), Counter(b.tolist())
    keys = set(count_a) | set(count_b)
    return 0.5 * sum(abs(count_a[k] / len(a) - count_b[k] / len(b)) for k in keys)


def permutation_p_value(a: np.ndarray, b: np.ndarray, rng: np.random.Generator, rounds: int = 500) -> tuple[float, float]:
    """(observed TV, p-value): how often a random relabelling of the pooled samples gives a
    TV at least as large as the observed one."""
    observed = tv_distance(a, b)
    pooled = np.concatenate([a, b])
    # Relabel token ids to 0..K-1 so each permutation's TV is two bincounts.
    _, codes = np.unique(pooled, return_inverse=True)
    k = int(codes.max()) + 1
    n = len(a)
    at_least = 0
    for _ in range(rounds):
        perm = rng.permutation(codes)
        tv = 0.5 * np.abs(np.bincount(perm[:n], minlength=k) / n - np.bincount(perm[n:], minlength=k) / (len(pooled) - n)).sum()
        at_least += tv >= observed - 1e-12
    return observed, (at_least + 1) / (rounds + 1)


def compare(speculative: np.ndarray, plain: np.ndarray, seed: int = 0, alpha: float = 0.01) -> AuditReport:
    """speculative, plain: [N, K] first K generated tokens of N independent samples each."""
    rng = np.random.default_rng(seed)
    positions = []
    for k in range(speculative.shape[1]):
        tv, p_value = permutation_p_value(speculative[:, k], plain[:, k], rng)
        distinct = len(set(speculative[:, k].tolist()) | set(plain[:, k].tolist()))
        positions.append(PositionReport(k, tv, p_value, distinct))
    return AuditReport(speculative.shape[0], tuple(positions), alpha)
