"""Prompt lookup: copy what followed the latest earlier occurrence of the longest suffix match.

Proposals are deterministic (no q), so the loop verifies them as q = one-hot, which keeps the
output exactly the target's. Drafting costs no model pass. How far back the match reaches is
the evidence the policy reads (`evidence`): a long match is accepted far more often than a
two-token one, so each match length class has its own α and earns its own γ.
"""

from __future__ import annotations

import numpy as np

from runtime.drafters.base import Drafter, Proposal


def match_class(match_length: int) -> int:
    """0 for no match, then 1 for a 2-token match, 2 for 3–4 tokens, 3 for 5–8, 4 for 9–16, …"""
    return (match_length - 1).bit_length() if match_length > 0 else 0


class PromptLookupDrafter(Drafter):
    name = "lookup"

    def __init__(self, max_match: int = 32, min_ngram: int = 2):
        self.max_match = max_match
        self.min_ngram = min_ngram
        # A round asks for the same tokens' match up to three times (the mixed drafter's
        # candidates, the policy's evidence, the proposal): the last answer is kept.
        self._last: tuple[bytes, tuple[int, int]] | None = None

    def match(self, tokens: np.ndarray) -> tuple[int, int]:
        """(where the copied continuation starts, how many tokens the match covers) for the
        latest earlier occurrence of the longest suffix of at least min_ngram tokens, extended
        back up to max_match; (0, 0) when there is none."""
        tokens = np.asarray(tokens, dtype=np.int64)
        key = tokens.tobytes()
        if self._last is None or self._last[0] != key:
            self._last = (key, self._longest_match(tokens))
        return self._last[1]

    def _longest_match(self, tokens: np.ndarray) -> tuple[int, int]:
        length, n = len(tokens), self.min_ngram
        if length <= n:
            return 0, 0
        # windows[i] = tokens[i:i+n] for every i whose continuation starts before the suffix.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length-n, n]
        starts = np.flatnonzero((windows == tokens[length - n :]).all(axis=1)) + n
        if not starts.size:
            return 0, 0
        lengths = np.full(starts.size, n)
        alive = np.arange(starts.size)
        for back in range(n, min(self.max_match, length)):
            alive = alive[starts[alive] - 1 - back >= 0]
            alive = alive[tokens[starts[alive] - 1 - back] == tokens[length - 1 - back]]
            if not alive.size:
                break
            lengths[alive] += 1
        best = int(lengths.max())
        return int(starts[lengths == best][-1]), best

    def find(self, tokens: np.ndarray, gamma: int) -> np.ndarray:
        """The continuation (up to γ tokens) after the match."""
        tokens = np.asarray(tokens, dtype=np.int64)
        start, matched = self.match(tokens)
        return tokens[start : start + gamma] if matched else tokens[:0]

    def evidence(self, tokens) -> int:
        return match_class(self.match(tokens)[1])

    def propose(self, tokens, gamma, sampling, rng):
        continuation = self.find(tokens, gamma)
        return Proposal(continuation, None) if len(continuation) else None
