"""The pass contract between the loop (and its drafters) and a model, whatever engine runs it.

A pass scores a `Block`: tokens with their positions and parents after the rows the model keeps
(a chain is each token's parent the one before it; a tree branches). It returns `Scored`: logits
for the last rows asked, and the outputs of the layers a drafter reads (EAGLE-style features).
The KV rows a pass writes are the block's, in block order, after the kept ones; `keep(rows)` then
keeps some of them (moved into place), and a prefix rollback is `keep(range(n))`.

    block = Block.chain(tokens, start=model.kept)          # or Block(tokens, positions, parents)
    scored = model.score(block)                            # scored.logits [N,V], scored.hidden {layer: [T,H]}
    model.keep(range(model.kept - len(tokens) + n + 1))    # what verification accepted
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

import numpy as np

from runtime.kv_cache import KVCache


@dataclass(frozen=True)
class Block:
    tokens: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64: each token's position in its sequence (its rotary angle)
    parents: np.ndarray  # [T] int64: the block index of each token's parent, -1 for the last kept row
    n_logits: int  # the last n_logits rows get logits
    hidden: tuple[int, ...] = ()  # layers whose outputs (the residual stream after them) come back
    chain_made: bool = field(default=False, repr=False, compare=False)  # built by chain(): a chain by construction

    def __post_init__(self) -> None:
        size = len(self.tokens)
        if not size:
            raise ValueError("a block takes at least one token")
        if self.chain_made:  # every pass of a chain builds one: only what a caller chose is checked
            if not 0 < self.n_logits <= size:
                raise ValueError(f"n_logits must be 1..{size}, got {self.n_logits}")
            return
        if len(self.positions) != size or len(self.parents) != size:
            raise ValueError(f"a block takes one position and one parent per token, got {size} tokens, "
                             f"{len(self.positions)} positions, {len(self.parents)} parents")
        if np.any(self.parents >= np.arange(size)) or np.any(self.parents < -1):
            raise ValueError(f"each token's parent must come before it in the block (or be -1), got parents {self.parents.tolist()}")
        # A token sits one position after its parent: the position is the path's length.
        expected = np.where(self.parents < 0, self.positions[0], self.positions[np.maximum(self.parents, 0)] + 1)
        if np.any(self.parents[0] != -1) or np.any(self.positions != expected):
            raise ValueError(f"positions must be the parent's plus one from the first token's, got {self.positions.tolist()} "
                             f"for parents {self.parents.tolist()}")
        if not 0 < self.n_logits <= size:
            raise ValueError(f"n_logits must be 1..{size}, got {self.n_logits}")

    @classmethod
    def chain(cls, tokens: Sequence[int] | np.ndarray, start: int, n_logits: int | None = None, hidden: Sequence[int] = ()) -> Block:
        """Tokens one after another from position `start` (the rows kept before them)."""
        tokens = np.asarray(tokens, dtype=np.int64)
        size = len(tokens)
        return cls(tokens, np.arange(start, start + size, dtype=np.int64), np.arange(-1, size - 1, dtype=np.int64),
                   size if n_logits is None else n_logits, tuple(hidden), chain_made=True)

    @property
    def is_chain(self) -> bool:
        return self.chain_made or bool(np.array_equal(self.parents, np.arange(-1, len(self.tokens) - 1)))

    def visible(self) -> np.ndarray:
        """[T,T] bool: row i attends to block row j (j is i or one of its ancestors)."""
        size = len(self.tokens)
        seen = np.eye(size, dtype=bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                seen[i] |= seen[parent]
        return seen

    def path(self, leaf: int) -> list[int]:
        """The block rows from the root to `leaf`, in order."""
        rows = [leaf]
        while self.parents[rows[-1]] >= 0:
            rows.append(int(self.parents[rows[-1]]))
        return rows[::-1]


@dataclass(frozen=True)
class Scored:
    logits: np.ndarray  # [N,V] float32: the block's last N rows
    hidden: dict[int, np.ndarray] = field(default_factory=dict)  # layer -> [T,H] host array, each block row

    def rows(self, rows: Sequence[int]) -> dict[int, np.ndarray]:
        """The hidden states of some block rows (the ones a round kept), by layer."""
        return {layer: h[list(rows)] for layer, h in self.hidden.items()}


class CacheRows:
    """The contract's rows over a KVCache held as `self.cache` (ModelRunner, and the tests' toy models)."""

    cache: KVCache

    @property
    def kept(self) -> int:
        return self.cache.kv_len

    @property
    def max_context(self) -> int:
        return self.cache.max_context

    def keep(self, rows: Sequence[int]) -> None:
        self.cache.keep(rows)

    def keep_prefix(self, committed: np.ndarray) -> int:
        return self.cache.rollback_to_prefix(committed)


class Model(Protocol):
    """What the loop and drafters ask of a model: ModelRunner (ONNX Runtime, and Core ML through
    its session adapter) answers it; engine types stay behind it."""

    max_context: int

    @property
    def kept(self) -> int:
        """Rows kept: the sequence's positions 0..kept-1 hold their KV."""

    def score(self, block: Block, trunk_hidden: np.ndarray | None = None) -> Scored:
        """One pass over `block` after the kept rows: its KV rows written after them."""

    def keep(self, rows: Sequence[int]) -> None:
        """Keep these rows (ascending), moved to 0..len(rows)-1; every other row is dropped."""

    def keep_prefix(self, committed: np.ndarray) -> int:
        """Keep the longest prefix of rows that hold `committed`'s tokens; returns it."""

    def hidden_layers(self) -> tuple[int, ...]:
        """The layers whose outputs a pass can return."""
