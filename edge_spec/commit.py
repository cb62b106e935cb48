"""What a speculative round may commit: the stopping rules, as pure functions.

A round can return more tokens than plain decoding would have produced before stopping, so
the caller cuts them (commit), in this order: the token budget, the context limit, EOS (within
what the first two keep), then stop strings in the decoded text (the earliest in the text
wins, whichever was listed first). The Python engine and the Kotlin port (Commit.kt) both call
commit; android_bridge/tools/write_traces.py locks them together. While streaming, the Python
engine also holds back the tail of the text that may still start a stop string
(stop_prefix_len), so no streamed text is later cut.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Commit:
    tokens: tuple[int, ...]  # what this round adds to the output
    piece: str  # the text those tokens add, cut before a stop string
    text: str  # all text so far, cut before a stop string
    stop_reason: str | None  # eos | length | context | stop, or None: keep decoding


def cut_tokens(step_tokens: Sequence[int], n_generated: int, max_new_tokens: int, room: int, eos_ids) -> tuple[tuple[int, ...], str | None]:
    """Budget, then context (room: positions left in it), then EOS within what is kept."""
    budget = max_new_tokens - n_generated
    new = tuple(int(t) for t in step_tokens)[: max(0, min(budget, room))]
    eos_at = next((i for i, token in enumerate(new) if token in eos_ids), None)
    if eos_at is not None:
        return new[: eos_at + 1], "eos"
    if len(new) == budget:
        return new, "length"
    if len(new) == room:
        return new, "context"
    return new, None


def find_stop(text: str, piece: str, stops: Sequence[str]) -> int | None:
    """Where text (which ends with the new piece) must be cut: the earliest occurrence of any
    stop string that reaches into the piece (earlier text was searched before)."""
    hits = [at for at in (text.find(s, max(0, len(text) - len(piece) - len(s))) for s in stops) if at >= 0]
    return min(hits) if hits else None


def commit(
    step_tokens: Sequence[int], n_generated: int, max_new_tokens: int, room: int, eos_ids,
    text: str, stops: Sequence[str], decode: Callable[[tuple[int, ...]], str],
) -> Commit:
    """text: the output so far; decode: the text the kept tokens add (the caller's stream
    decoder, which may hold back an incomplete UTF-8 sequence)."""
    tokens, reason = cut_tokens(step_tokens, n_generated, max_new_tokens, room, eos_ids)
    piece = decode(tokens)
    text += piece
    cut = find_stop(text, piece, stops) if stops else None
    if cut is not None:
        piece = piece[: max(0, len(piece) - (len(text) - cut))]
        text, reason = text[:cut], "stop"
    return Commit(tokens, piece, text, reason)


def stop_prefix_len(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of text that is a proper prefix of a stop string: text that
    must be held back from a stream until it is known not to start a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
