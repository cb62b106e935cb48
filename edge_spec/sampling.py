"""Logit processing and single-token sampling shared by target and draft models.

Speculative decoding is only lossless if the target distribution p and the draft
distribution q are produced by the *same* processing (temperature, top-k, top-p),
so both sides must go through `process_logits` with one `SamplingConfig`.

Random stream definition: every draw consumes exactly one uniform double from
`rng.random()` and maps it through the inverse CDF. A Kotlin port replicates this
stream bit for bit, so do not change how many uniforms a draw consumes or the
order of floating-point operations in `sample`.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass

import numpy as np


def _as_int(value, message: str) -> int:
    """value as an int; bools and non-integers raise ValueError(message)."""
    if isinstance(value, bool):
        raise ValueError(f"{message}, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{message}, got {value!r}") from None


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a token distribution; shared verbatim by target and draft."""

    temperature: float = 0.0  # 0 means greedy (argmax)
    top_k: int = 0  # 0 disables top-k
    top_p: float = 1.0  # 1.0 disables top-p
    seed: int | None = None  # seeds the caller's np.random.Generator; never used globally

    def __post_init__(self) -> None:
        # Reject bad values here so a misconfigured run fails at construction, not mid-decode.
        if not isinstance(self.temperature, numbers.Real) or isinstance(self.temperature, bool):
            raise ValueError(f"temperature must be a number, got {self.temperature!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if _as_int(self.top_k, "top_k must be an int") < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, numbers.Real) or isinstance(self.top_p, bool):
            raise ValueError(f"top_p must be a number, got {self.top_p!r}")
        if not (0.0 < self.top_p <= 1.0):  # also rejects NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            if _as_int(self.seed, "seed must be an int or None") < 0:
                raise ValueError(f"seed must be >= 0 (numpy seeding rule), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        """Temperature 0 means deterministic argmax decoding."""
        return self.temperature == 0.0


def _softmax(logits: np.ndarray) -> np.ndarray:
    # Subtracting the row max keeps exp() from overflowing; -inf entries become exactly 0.
    shifted = logits - np.max(logits, axis=-1, keepdims=True)  # [..., V]
    weights = np.exp(shifted)  # [..., V]
    return weights / np.sum(weights, axis=-1, keepdims=True)  # [..., V]


_TOP_P_CANDIDATES = 2048


def _top_p_removal_sorted(scaled: np.ndarray, top_p: float) -> np.ndarray:
    """Top-p removal mask [..., V] by a full stable sort (Hugging Face's rule)."""
    order = np.argsort(scaled, axis=-1, kind="stable")  # [..., V] ascending
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)  # [..., V]
    cumulative = np.cumsum(_softmax(sorted_logits), axis=-1)  # [..., V]
    remove_sorted = cumulative <= 1.0 - top_p  # [..., V]
    remove_sorted[..., -1] = False  # the most likely token always survives
    remove = np.empty_like(remove_sorted)  # [..., V]
    np.put_along_axis(remove, order, remove_sorted, axis=-1)  # back to vocab order
    return remove


def _top_p_removal_large(row: np.ndarray, top_p: float) -> np.ndarray | None:
    """Top-p removal mask for one large-vocabulary row [V] without sorting all of it.

    A token survives iff the mass of the tokens ranked above it is < top_p, ranking by
    descending logit and, among equal logits, descending id (the order in which the stable
    ascending sort below drops the lower id first). When the cut falls strictly inside the
    most likely candidates, everything outside them is removed too; otherwise returns None
    and the caller sorts the whole row, which costs several times more (BENCHMARKS.md, "Sampling").
    """
    vocab_size = row.shape[0]
    candidates = np.argpartition(-row, _TOP_P_CANDIDATES)[:_TOP_P_CANDIDATES]  # [C]
    ranked = candidates[np.lexsort((-candidates, -row[candidates]))]  # [C] most likely first
    probs = _softmax(row)  # [V]
    mass_above = np.cumsum(probs[ranked]) - probs[ranked]  # [C]
    if not mass_above[-1] >= top_p:
        return None
    remove = np.ones(vocab_size, dtype=bool)  # [V]
    remove[ranked[mass_above < top_p]] = False
    return remove


def process_logits(logits: np.ndarray, config: SamplingConfig) -> np.ndarray:
    """Turn logits [..., V] into float64 probabilities [..., V].

    Order matches Hugging Face's warpers: temperature, top-k, top-p, softmax.
    - top-k keeps every logit >= the k-th largest one, so ties at the cut survive
      (HF masks `logits < topk_min`).
    - top-p sorts ascending (stable, so among equal logits the lower token id is
      dropped first), removes tokens whose cumulative probability is <= 1 - top_p and
      always keeps the most likely token: the smallest most-likely set with mass >= top_p.
    - temperature 0 returns the one-hot of argmax (first index on ties, as np.argmax);
      top-k/top-p can never remove the argmax, so they are skipped.
    Vectorized over all leading dims. Raises ValueError on NaN, +inf, or a row with
    no finite logit.
    """
    logits = np.asarray(logits, dtype=np.float64)  # [..., V]
    if logits.ndim == 0 or logits.shape[-1] == 0:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {logits.shape}")
    if np.isnan(logits).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(logits).any():
        raise ValueError("logits contain +inf")
    if logits.size and not np.isfinite(np.max(logits, axis=-1)).all():
        raise ValueError("every row of logits needs at least one finite value")

    if config.greedy:
        winner = np.argmax(logits, axis=-1)  # [...]
        one_hot = np.zeros_like(logits)  # [..., V]
        np.put_along_axis(one_hot, winner[..., None], 1.0, axis=-1)
        return one_hot

    scaled = logits / config.temperature  # [..., V]
    if np.isposinf(scaled).any():
        raise ValueError(f"temperature {config.temperature!r} overflows the logits to +inf")
    vocab_size = scaled.shape[-1]

    if 0 < config.top_k < vocab_size:
        cut = vocab_size - config.top_k
        # The k-th largest value per row; comparing against the value (not an index) keeps ties.
        kth_largest = np.partition(scaled, cut, axis=-1)[..., cut : cut + 1]  # [..., 1]
        scaled = np.where(scaled < kth_largest, -np.inf, scaled)  # [..., V]

    if config.top_p < 1.0 and scaled.shape[-1] > 4 * _TOP_P_CANDIDATES:
        rows = scaled.reshape(-1, vocab_size)  # [R, V]
        # Row by row, so a row's p never depends on which other rows share the call.
        removals = [_top_p_removal_large(row, config.top_p) for row in rows]
        removals = [r if r is not None else _top_p_removal_sorted(row, config.top_p) for r, row in zip(removals, rows)]
        return _softmax(np.where(np.stack(removals).reshape(scaled.shape), -np.inf, scaled))

    if config.top_p < 1.0:
        scaled = np.where(_top_p_removal_sorted(scaled, config.top_p), -np.inf, scaled)  # [..., V]

    return _softmax(scaled)


def sample(probs: np.ndarray, rng: np.random.Generator) -> int:
    """Draw one index from a 1-D probability vector [V] by inverse CDF.

    Random stream definition (a Kotlin port replicates it exactly): one uniform
    double u = rng.random() per draw; cdf = left-to-right running float64 sum of
    probs; return the first index j with cdf[j] > u * cdf[-1] (so the vector need
    not be normalized and zero-probability tokens are never returned); if rounding
    pushes past the end, clamp to the last index with nonzero probability.
    """
    probs = np.asarray(probs, dtype=np.float64)  # [V]
    if probs.ndim != 1 or probs.shape[0] == 0:
        raise ValueError(f"probs must be a non-empty 1-D vector, got shape {probs.shape}")
    # Validate before drawing so a rejected call leaves the random stream untouched.
    if probs.min() < 0.0:
        raise ValueError("probs must be non-negative")
    cumulative = probs.cumsum()  # [V]
    total = float(cumulative[-1])
    if not (math.isfinite(total) and total > 0.0):
        raise ValueError(f"probs must have positive finite total mass, got {total!r}")
    u = rng.random()
    index = int(cumulative.searchsorted(u * total, side="right"))
    if index >= probs.shape[0]:
        index = int(np.flatnonzero(probs)[-1])
    return index
