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
from dataclasses import dataclass

import numpy as np

from edge_spec.params import SettingError, check_params, param


# The smallest temperature above 0: every finite float32 logit (what every graph returns)
# divided by it stays finite in float64 (3.4e38 / 1.8e308 = 1.9e-270), so no row overflows.
MIN_TEMPERATURE = 1e-269


@dataclass(frozen=True)
class SamplingConfig:
    """How logits become a token distribution; shared verbatim by target and draft. Each field's
    Param (edge_spec/params.py) is its one declaration: the API, the command line and the
    server read their checks, flags and help from it."""

    temperature: float = param(0.0, float, "0 is greedy (argmax); above it, logits are divided by it", low=0.0,
                               server_default=1.0, server_high=2.0)  # OpenAI's default and range
    top_k: int = param(0, int, "keep the k most likely tokens (0: all)", low=0, server_off=(-1,))  # -1: llama.cpp's off
    top_p: float = param(1.0, float, "keep the most likely tokens whose mass reaches p (1: all)", low=0.0, high=1.0, low_open=True)
    seed: int | None = param(None, int, "seeds this request's random stream (default: fresh randomness)", low=0, high=2**63 - 1)

    def __post_init__(self) -> None:
        # Reject bad values here so a misconfigured run fails at construction, not mid-decode.
        check_params(self)
        if 0.0 < self.temperature < MIN_TEMPERATURE:
            raise SettingError("temperature", f"temperature {self.temperature!r} is too small (the logits would overflow): "
                                              f"use 0 for greedy or at least {MIN_TEMPERATURE:g}")

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
# Tokens this far below the row's most likely one (in temperature-scaled logits) each carry
# less than e^-20 of its probability; top-p ranks only the tokens above it first.
_TOP_P_MARGIN = 20.0


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


def _above_kth(row: np.ndarray, among: np.ndarray, k: int) -> np.ndarray:
    """The tokens of `among` [C] whose logit is above the k-th largest there (all of them when
    C <= k). A tie at that logit is left out whole, so a prefix of the ranking stays one."""
    if among.shape[0] <= k:
        return among
    values = row[among]  # [C]
    kth = np.partition(values, among.shape[0] - k)[among.shape[0] - k]
    return among[values > kth]


def _top_p_survivors_large(row: np.ndarray, top_p: float) -> np.ndarray | None:
    """The token ids [S] that survive top-p in one large-vocabulary row [V], without sorting it.

    A token survives iff the mass of the tokens ranked above it is < top_p, ranking by
    descending logit and, among equal logits, descending id (the order in which the stable
    ascending sort drops the lower id first). Only a prefix of that ranking is sorted: the
    tokens within _TOP_P_MARGIN of the most likely one (at most _TOP_P_CANDIDATES of them),
    then, if the cut is not among those, up to _TOP_P_CANDIDATES of the whole row. When the cut
    falls strictly inside the prefix, everything below it is removed too (it ranks lower, so it
    has at least as much mass above it); otherwise returns None and the caller sorts the whole
    row, which costs several times more (benchmarks/notes/2026-12-02-sampling.md).
    """
    top = np.max(row)
    weights = np.exp(row - top)  # [V] every token counts toward the mass
    total = np.sum(weights)
    near = _above_kth(row, np.flatnonzero(row >= top - _TOP_P_MARGIN), _TOP_P_CANDIDATES)  # [C]
    for candidates in (near, None):
        if candidates is None:
            candidates = _above_kth(row, np.arange(row.shape[0]), _TOP_P_CANDIDATES)  # [C]
            if candidates.shape[0] <= near.shape[0]:
                break  # no longer than the prefix already tried
        if not candidates.shape[0]:
            continue  # a tie at the cap's logit left nothing
        ranked = candidates[np.lexsort((-candidates, -row[candidates]))]  # [C] most likely first
        probs = weights[ranked] / total  # [C] as softmax(row)[ranked]
        mass_above = np.cumsum(probs) - probs  # [C]
        if mass_above[-1] >= top_p:
            return ranked[mass_above < top_p]
    return None


def _softmax_over(row: np.ndarray, survivors: np.ndarray) -> np.ndarray:
    """softmax of row [V] with every token outside survivors [S] at -inf, computed on the
    survivors alone: the same float64 values as masking the row and taking _softmax of it."""
    weights = np.zeros(row.shape[0], dtype=np.float64)  # [V]
    weights[survivors] = np.exp(row[survivors] - np.max(row[survivors]))
    return weights / np.sum(weights)


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
    # One pass checks every row: a row's max is NaN if it holds a NaN, +inf if it holds +inf.
    row_max = np.max(logits, axis=-1)  # [...]
    if np.isnan(row_max).any():
        raise ValueError("logits contain NaN")
    if np.isposinf(row_max).any():
        raise ValueError("logits contain +inf")
    if np.isneginf(row_max).any():
        raise ValueError("every row of logits needs at least one finite value")

    if config.greedy:
        winner = np.argmax(logits, axis=-1)  # [...]
        one_hot = np.zeros_like(logits)  # [..., V]
        np.put_along_axis(one_hot, winner[..., None], 1.0, axis=-1)
        return one_hot

    scaled = logits / config.temperature  # [..., V]
    if np.isposinf(row_max / config.temperature).any():  # division keeps the order, so this is scaled's max
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
        out = np.empty_like(rows)  # [R, V]
        for index, row in enumerate(rows):
            survivors = _top_p_survivors_large(row, config.top_p)
            if survivors is None:
                out[index] = _softmax(np.where(_top_p_removal_sorted(row, config.top_p), -np.inf, row))
            else:
                out[index] = _softmax_over(row, survivors)
        return out.reshape(scaled.shape)

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
    # Adding a zero leaves a running sum unchanged, so the cdf over the nonzero entries holds the
    # same values, and the first entry past u * total is always one of them.
    support = np.flatnonzero(probs)  # [S]
    cumulative = (probs[support] if support.shape[0] < probs.shape[0] else probs).cumsum()  # [S]
    total = float(cumulative[-1]) if support.shape[0] else 0.0
    if not (math.isfinite(total) and total > 0.0):
        raise ValueError(f"probs must have positive finite total mass, got {total!r}")
    u = rng.random()
    index = int(cumulative.searchsorted(u * total, side="right"))
    return int(support[min(index, support.shape[0] - 1)])
