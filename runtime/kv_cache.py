"""Static KV buffers and their length: the only place where rollback happens."""

from __future__ import annotations

from typing import Sequence

import numpy as np

from edge_spec import names


class ContextFullError(Exception):
    pass


# Views that grow on demand (KVCache.grow_on_demand) span a multiple of this many rows: never a
# 0-wide input (the Core ML EP refuses 0 dimensions) and few distinct shapes.
PAST_BUCKET = 64


class KVCache:
    """Preallocated keys/values for a set of layers, plus `kv_len` and the token of each row.

    Invariant: for every layer, rows [0, kv_len) hold the keys and values of the tokens
    `row_tokens[:kv_len]`, computed at those positions; rows from kv_len on are stale and
    every graph masks them, so rolling back is only moving kv_len. After `rollback_to_prefix`
    the rows are a prefix of the committed sequence; `keep` keeps any ascending rows (a tree's
    accepted path), moved into place. A writer may fill rows past kv_len for
    some layers (a layer-skip draft) before `extend` covers them for all layers.
    """

    def __init__(self, layers: range, n_kv_heads: int, max_context: int, head_dim: int, dtype: str = "float32", device: tuple[str, int] | None = None,
                 buffers: tuple[dict, dict] | None = None):
        """device: None keeps the buffers in host numpy arrays; ("cuda", id) allocates them on
        that device as ONNX Runtime OrtValues, which only fused (in-place) graphs can update.
        buffers: (keys, values) by layer, host arrays [1,KVH,MAX,D] this cache uses instead of
        allocating its own (a slot of KVSlots)."""
        shape = (1, n_kv_heads, max_context, head_dim)  # [1,KVH,MAX,D]
        self.layers = layers
        self.max_context = max_context
        self.device = device
        if buffers is not None:
            self.keys, self.values = buffers
        elif device is None:
            self.keys = {layer: np.zeros(shape, dtype=dtype) for layer in layers}
            self.values = {layer: np.zeros(shape, dtype=dtype) for layer in layers}
        else:
            import onnxruntime as ort

            def alloc():
                return ort.OrtValue.ortvalue_from_shape_and_type(shape, np.dtype(dtype).type, device[0], device[1])

            self.keys = {layer: alloc() for layer in layers}
            self.values = {layer: alloc() for layer in layers}
        self._nbytes = 2 * len(layers) * int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._ortvalues: dict[int, tuple] = {}
        self.capacity = max_context  # rows each buffer's view spans; fewer once grow_on_demand is on
        self._storage: tuple[dict, dict] | None = None  # the flat buffers behind the views, once views may grow
        self.row_tokens = np.full(max_context, -1, dtype=np.int64)  # [MAX]
        self.kv_len = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def ortvalues(self, layer: int) -> tuple:
        """(key, value) of a layer as OrtValues sharing the buffers' memory, for in-place binding."""
        if layer not in self._ortvalues:
            if self.device is None:
                import onnxruntime as ort

                self._ortvalues[layer] = (ort.OrtValue.ortvalue_from_numpy(self.keys[layer]), ort.OrtValue.ortvalue_from_numpy(self.values[layer]))
            else:
                self._ortvalues[layer] = (self.keys[layer], self.values[layer])
        return self._ortvalues[layer]

    def grow_on_demand(self) -> None:
        """Keep each buffer a contiguous [1,KVH,capacity,D] view over its memory, capacity a
        multiple of PAST_BUCKET at least the rows in use, widened in place before a pass writes
        past it (fit): a masked graph with a symbolic past width reads every row it is fed, and
        a prefix of a [1,KVH,MAX,D] buffer is not contiguous (a copy each pass costs more than
        the rows it saves). Host buffers only; the memory stays one max_context buffer per layer."""
        if self._storage is not None or self.device is not None:
            return
        self._storage = ({l: k.reshape(-1) for l, k in self.keys.items()}, {l: v.reshape(-1) for l, v in self.values.items()})
        self._relayout(max(self._bucket(self.kv_len), min(PAST_BUCKET, self.max_context)))

    @staticmethod
    def _bucket(rows: int) -> int:
        return -(-rows // PAST_BUCKET) * PAST_BUCKET

    def fit(self, rows: int) -> None:
        """Make the views span at least `rows` rows, a quarter more than they did at least (each
        move copies the rows once; a pass reads at most a quarter more than it needs); no-op
        unless grow_on_demand is on."""
        if self._storage is not None and rows > self.capacity:
            self._relayout(min(self.max_context, max(self._bucket(self.capacity + self.capacity // 4), self._bucket(rows))))

    def _relayout(self, capacity: int) -> None:
        """Re-view every buffer as [1,KVH,capacity,D], rows [0, min(old, new)) of each head kept."""
        old, kept = self.capacity, min(self.capacity, capacity)
        for buffers, flat in zip((self.keys, self.values), self._storage):
            for layer, array in buffers.items():
                heads, dim = array.shape[1], array.shape[3]
                memory = flat[layer]
                # Widening moves heads up (last head first), narrowing down (first head first), so no head overwrites one not yet moved.
                for head in (range(heads - 1, 0, -1) if capacity > old else range(1, heads)):
                    memory[head * capacity * dim : (head * capacity + kept) * dim] = memory[head * old * dim : (head * old + kept) * dim]
        self._view(capacity)

    def _view(self, capacity: int) -> None:
        """Every buffer re-viewed as [1,KVH,capacity,D] over its memory, nothing moved."""
        for buffers, flat in zip((self.keys, self.values), self._storage):
            for layer, array in buffers.items():
                heads, dim = array.shape[1], array.shape[3]
                buffers[layer] = flat[layer][: heads * capacity * dim].reshape(1, heads, capacity, dim)
        self.capacity = capacity

    def feeds(self, layers: range) -> dict[str, np.ndarray]:
        feeds = {}
        for layer in layers:
            feeds[names.past_key(layer)] = self.keys[layer]
            feeds[names.past_value(layer)] = self.values[layer]
        return feeds

    def check_room(self, start: int, block: int) -> None:
        if start + block > self.max_context:
            raise ContextFullError(f"context full: {start} + {block} tokens exceed max context {self.max_context}")

    def write_rows(self, layers: range, new_kv: Sequence[np.ndarray], start: int) -> None:
        """Copy a block's new keys/values ([1,KVH,T,D] each, key then value per layer) into
        rows [start, start+T); kv_len is left alone."""
        if self.device is not None:
            raise RuntimeError("KV buffers on a device are updated in place by fused graphs only")
        for i, layer in enumerate(layers):
            new_key, new_value = new_kv[2 * i], new_kv[2 * i + 1]
            block = new_key.shape[2]
            self.keys[layer][:, :, start : start + block] = new_key
            self.values[layer][:, :, start : start + block] = new_value

    def extend(self, token_ids: np.ndarray) -> None:
        """Mark the rows just written for all layers as holding `token_ids`."""
        block = len(token_ids)
        self.row_tokens[self.kv_len : self.kv_len + block] = token_ids
        self.kv_len += block

    def rollback_to_prefix(self, committed: Sequence[int] | np.ndarray) -> int:
        """Drop every row that is not the committed token at its position; returns kv_len.

        After a speculative round that fed [pending, d1..dγ] and accepted n drafted tokens,
        this keeps pending, d1..dn (the target cache), or everything the draft fed that was
        accepted (the draft cache, then at most one token behind).
        """
        n = min(self.kv_len, len(committed))
        committed = np.asarray(committed[:n], dtype=np.int64)
        mismatch = np.flatnonzero(self.row_tokens[:n] != committed)
        self.keep(range(int(mismatch[0]) if mismatch.size else n))
        return self.kv_len

    def keep(self, rows: Sequence[int]) -> None:
        """Keep `rows` (ascending, each below kv_len) as rows 0..len(rows)-1 and drop the rest:
        a prefix only moves kv_len; another row (a tree's accepted path) is copied down into
        place in every layer, its token with it."""
        if isinstance(rows, range) and rows.start == 0 and rows.step == 1 and rows.stop <= self.kv_len:
            self.kv_len = max(rows.stop, 0)
            return
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows[0] < 0 or rows[-1] >= self.kv_len or np.any(np.diff(rows) <= 0)):
            raise ValueError(f"keep takes ascending rows below {self.kv_len}, got {rows.tolist()}")
        moved = np.flatnonzero(rows != np.arange(rows.size))
        if moved.size:
            if self.device is not None:
                raise RuntimeError(f"KV rows on {self.device} are kept as a prefix only, not rows {rows.tolist()}")
            for buffers in (self.keys, self.values):
                for layer in self.layers:
                    buffers[layer][:, :, moved] = buffers[layer][:, :, rows[moved]]  # each source row lies at or after its target
            self.row_tokens[moved] = self.row_tokens[rows[moved]]
        self.kv_len = int(rows.size)

    def reset(self) -> None:
        self.kv_len = 0
        if self._storage is not None:  # no row is kept: narrow the views without moving any
            self._view(min(self.capacity, PAST_BUCKET))


class KVSlots:
    """N sequences' KV buffers side by side, [N,KVH,MAX,D] per layer in host memory, for batched
    decoding: slot i is a KVCache over rows [i] with its own length and rollback (what a
    sequence decoding alone uses), and a batched pass binds the first B slots' rows at once."""

    def __init__(self, n: int, layers: range, n_kv_heads: int, max_context: int, head_dim: int, dtype: str = "float32"):
        if n < 1:
            raise ValueError(f"KV slots: n must be at least 1, got {n}")
        shape = (n, n_kv_heads, max_context, head_dim)  # [N,KVH,MAX,D]
        self.keys = {layer: np.zeros(shape, dtype=dtype) for layer in layers}
        self.values = {layer: np.zeros(shape, dtype=dtype) for layer in layers}
        self.caches = tuple(
            KVCache(layers, n_kv_heads, max_context, head_dim, dtype,
                    buffers=({l: k[i : i + 1] for l, k in self.keys.items()}, {l: v[i : i + 1] for l, v in self.values.items()}))
            for i in range(n)
        )
        self._ortvalues: dict[tuple[int, int], tuple] = {}

    def __len__(self) -> int:
        return len(self.caches)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.keys.values(), *self.values.values()))

    def ortvalues(self, layer: int, batch: int) -> tuple:
        """(key, value) of the first `batch` slots as OrtValues over the buffers' memory."""
        if (layer, batch) not in self._ortvalues:
            import onnxruntime as ort

            self._ortvalues[layer, batch] = (ort.OrtValue.ortvalue_from_numpy(self.keys[layer][:batch]),
                                             ort.OrtValue.ortvalue_from_numpy(self.values[layer][:batch]))
        return self._ortvalues[layer, batch]
