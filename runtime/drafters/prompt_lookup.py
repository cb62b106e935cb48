"""Prompt lookup: copy what followed the latest earlier occurrence of the last n tokens.

Proposals are deterministic (no q), so the loop verifies them as q = one-hot, which keeps the
output exactly the target's. Drafting costs no model pass.
"""

from __future__ import annotations

import numpy as np

from runtime.drafters.base import Drafter, Proposal


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def find(self, tokens: np.ndarray, gamma: int) -> np.ndarray:
        """The continuation after the most recent match of the longest suffix n-gram."""
        tokens = np.asarray(tokens, dtype=np.int64)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            suffix = tokens[length - n :]
            # windows[i] = tokens[i:i+n] for every i whose continuation starts before the suffix.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length-n, n]
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                begin = int(hits[-1]) + n
                return tokens[begin : begin + gamma]
        return tokens[:0]

    def propose(self, tokens, gamma, sampling, rng):
        continuation = self.find(tokens, gamma)
        return Proposal(continuation, None) if len(continuation) else None
