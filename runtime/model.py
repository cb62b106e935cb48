"""One forward pass of a role over a block of tokens: its stage graphs in order, KV written."""

from __future__ import annotations

import numpy as np

from edge_spec import names
from edge_spec.manifest import ModelInfo, StageInfo
from runtime.kv_cache import KVCache
from runtime.passes import Block, CacheRows, Scored


def full_vocab_logits(trimmed: np.ndarray, head_tokens: np.ndarray, vocab_size: int) -> np.ndarray:
    """A trimmed head's logits [N, K] at their token ids in [N, vocab_size], -inf elsewhere: the
    draft's q is then exactly 0 on every dropped token, whatever sampling does to the row."""
    full = np.full((trimmed.shape[0], vocab_size), -np.inf, dtype=trimmed.dtype)  # [N,V]
    full[:, head_tokens] = trimmed
    return full


def tree_feeds(tree: Block, start: int, capacity: int) -> dict[str, np.ndarray]:
    """A masked graph's positions and mask for a tree block after `start` kept rows: each token at
    its own position (its path's length), seeing the kept rows, itself and its ancestors."""
    rows = len(tree.tokens)
    bias = np.full((rows, capacity + rows), names.MASKED, dtype=np.float32)  # [T, P+T]
    bias[:, :start] = 0.0
    bias[:, capacity:][tree.visible()] = 0.0
    return {names.POSITION_IDS: tree.positions.astype(np.int64), names.ATTENTION_BIAS: bias}


class ModelRunner(CacheRows):
    """Runs a role's stages (embed ... head) on a block at position cache.kv_len.

    Sessions are shared between roles (a layer-skip draft runs the target's trunk and head
    sessions); the cache is the role's own, or the target's for a layer-skip draft.
    """

    def __init__(self, role: str, info: ModelInfo, stages: list[StageInfo], sessions: list, cache: KVCache, min_rows: int = 1,
                 head_tokens: np.ndarray | None = None):
        self.role = role
        # A trimmed draft head (manifest.load_head_tokens): the token id of each logit column.
        self.head_tokens = head_tokens
        # Block-stable mode (min_rows 2): ONNX Runtime's CPU kernels compute a row differently
        # in a 1-row pass than in a pass of 2 or more, and quantized activations amplify that;
        # rows of any pass of 2 or more agree bit for bit, so every pass gets at least 2.
        self.min_rows = min_rows
        self.info = info
        self.stages = stages
        self.sessions = sessions
        self.cache = cache
        self.vocab_size = info.arch.vocab_size
        self._bindings = [self._bind_in_place(stage, session, cache.device is not None) for stage, session in zip(stages, sessions)]
        # KV on a GPU (runtime.sessions.kv_device): the hidden states between stages stay there too,
        # bound as device OrtValues from one stage's output to the next one's input; only logits come back.
        self.device = cache.device if cache.device is not None and all(b is not None for b in self._bindings) else None
        # Host copies of activations (hidden states and logits), for the GPU check's count per pass.
        self.copies = {"hidden_to_host": 0, "hidden_to_device": 0, "logits_to_host": 0, "passes": 0}
        # A session without I/O binding (a Core ML package) takes kv_len and returns the new rows,
        # as portable graphs do.
        self._input_names = [
            list(stage.inputs) if hasattr(session, "io_binding") else names.stage_inputs(stage.embed, stage.head, stage.layers, "portable")
            for stage, session in zip(stages, sessions)
        ]
        self._output_names = [
            list(stage.outputs) if hasattr(session, "io_binding") else names.stage_outputs(stage.head, stage.layers, "portable")
            for stage, session in zip(stages, sessions)
        ]
        # Masked graphs with a symbolic past width (all of a role's stages or none: the exporter
        # decides per model) read the buffers as wide as the rows in use.
        if any(stage.attention == "masked" and hasattr(session, "get_inputs")
               and any(i.name.startswith("past_") and not isinstance(i.shape[2], int) for i in session.get_inputs())
               for stage, session in zip(stages, sessions)):
            cache.grow_on_demand()
        # float16 masked graphs (--device dml) take the mask in float16, MASKED clamped to its range.
        self._float16_bias = [
            any(i.name == names.ATTENTION_BIAS and i.type == "tensor(float16)" for i in session.get_inputs()) if hasattr(session, "get_inputs") else False
            for session in sessions
        ]

    def _bind_in_place(self, stage: StageInfo, session, on_device: bool):
        """A fused stage reads and writes the KV buffers in place: bind each past_* input and its
        present_* output to the same cache array once; they never move. With the KV on a device,
        a stage without layers (the head) is bound too, to take its input there."""
        if not hasattr(session, "io_binding") or not (on_device or (stage.attention == "fused" and stage.layers)):
            return None
        binding = session.io_binding()
        binding.bind_output(stage.outputs[0], "cpu")  # bound first, so get_outputs()[0] is it
        for layer in stage.layers:
            key, value = self.cache.ortvalues(layer)
            binding.bind_ortvalue_input(names.past_key(layer), key)
            binding.bind_ortvalue_output(names.present_key(layer), key)
            binding.bind_ortvalue_input(names.past_value(layer), value)
            binding.bind_ortvalue_output(names.present_value(layer), value)
        return binding

    def run_stage(self, index: int, x, start: int, logit_positions: np.ndarray | None = None, tree: Block | None = None):
        """Run stage `index` on x (ids [1,T] or hidden [1,T,H]) at position `start`, write its
        KV rows, and return its first output (hidden [1,T,H] or logits [1,N,V]). On a device
        (self.device) a hidden state comes and goes as a device OrtValue; `to_host` reads one.
        tree: a block that is not a chain, its positions and ancestry fed (masked graphs)."""
        stage = self.stages[index]
        binding = self._bindings[index]
        rows = x.shape[1] if isinstance(x, np.ndarray) else x.shape()[1]  # an OrtValue's shape is a method
        positions = names.position_feeds(self._input_names[index], start, rows, self.cache.capacity)
        if tree is not None and names.POSITION_IDS in positions:
            positions.update(tree_feeds(tree, start, self.cache.capacity))
        if self._float16_bias[index]:
            positions[names.ATTENTION_BIAS] = np.maximum(positions[names.ATTENTION_BIAS], np.finfo(np.float16).min).astype(np.float16)
        if binding is not None:
            if isinstance(x, np.ndarray):
                binding.bind_cpu_input(stage.inputs[0], np.ascontiguousarray(x))
                self.copies["hidden_to_device"] += self.device is not None and index > 0
            else:
                binding.bind_ortvalue_input(stage.inputs[0], x)
            for name, value in positions.items():
                binding.bind_cpu_input(name, value)
            if stage.head:
                binding.bind_cpu_input(names.LOGIT_POSITIONS, logit_positions)
            on_device = self.device is not None and not stage.head
            # Unallocated again each run: its shape varies with T.
            binding.bind_output(stage.outputs[0], *(self.device if on_device else ("cpu",)))
            self.sessions[index].run_with_iobinding(binding)
            if on_device:
                return binding.get_outputs()[0]
            self.copies["logits_to_host" if stage.head else "hidden_to_host"] += self.device is not None
            return binding.get_outputs()[0].numpy()
        feeds = {stage.inputs[0]: x, **positions}
        if stage.layers:
            feeds.update(self.cache.feeds(stage.layers))
        if stage.head:
            feeds[names.LOGIT_POSITIONS] = logit_positions
        outputs = self.sessions[index].run(self._output_names[index], feeds)
        if stage.layers:
            self.cache.write_rows(stage.layers, outputs[1:], start)
        return outputs[0]

    # The pass contract (runtime/passes.py); kept, keep and keep_prefix come from CacheRows.

    def hidden_layers(self) -> tuple[int, ...]:
        """The residual stream after each stage but the last: what a stage boundary hands on."""
        return tuple(stage.layers.stop - 1 for stage in self.stages[:-1] if stage.layers)

    def trees(self) -> bool:
        """Whether a pass takes a tree block: every layered stage is fed positions and a mask."""
        return all(names.POSITION_IDS in inputs for stage, inputs in zip(self.stages, self._input_names) if stage.layers)

    def score(self, block: Block, trunk_hidden: np.ndarray | None = None) -> Scored:
        """One pass over `block` after the kept rows (runtime/passes.py): its KV rows written
        after them and kept, logits for its last n_logits rows, the hidden states it asks for.

        trunk_hidden [1,P,H]: the first stage's output for the block's first P tokens, already
        computed (and their KV rows written) by a layer-skip draft, so the first stage runs only the rest.
        """
        start = self.cache.kv_len
        size = len(block.tokens)
        if block.positions[0] != start:
            raise ValueError(f"the block starts at position {int(block.positions[0])}, after {start} kept rows")
        tree = None if block.is_chain else block
        if tree is not None and trunk_hidden is not None:
            raise ValueError("a layer-skip draft's trunk rows are a chain's: a tree block recomputes its trunk")
        if tree is not None and not self.trees():
            raise ValueError(f"the {self.role}'s graphs take a chain only (a tree needs positions and a mask fed: --attention masked)")
        missing = sorted(set(block.hidden) - set(self.hidden_layers())) if block.hidden else ()
        if missing:
            raise ValueError(f"the {self.role} returns the outputs of layers {list(self.hidden_layers())}, not {missing}")
        self.cache.check_room(start, size)
        logit_positions = np.arange(size - block.n_logits, size, dtype=np.int64)
        token_ids = block.tokens
        # A padded row (the last token again, after it) is computed and dropped; at the context's end there is no room for it.
        pad = min(max(self.min_rows - size, 0), self.cache.max_context - start - size)
        if self.min_rows > 1:
            trunk_hidden = None  # a layer-skip draft computed those trunk rows in 1-row passes
            token_ids = np.concatenate([token_ids, np.repeat(token_ids[-1:], pad)])
            if pad and tree is not None:
                tree = Block(token_ids, np.append(tree.positions, tree.positions[-1] + 1), np.append(tree.parents, size - 1), block.n_logits)
        self.cache.fit(start + len(token_ids))  # the rows this pass writes, padding included
        n_trunk_done = 0 if trunk_hidden is None else trunk_hidden.shape[1]
        x = token_ids[None, n_trunk_done:]
        hidden = {}
        self.copies["passes"] += 1
        for index, stage in enumerate(self.stages):
            if index == 0 and n_trunk_done:
                x = np.concatenate([trunk_hidden, self.to_host(self.run_stage(0, x, start + n_trunk_done))], axis=1)  # [1,T,H]
            else:
                x = self.run_stage(index, x, start, logit_positions, tree)
            if stage.layers and stage.layers.stop - 1 in block.hidden:
                hidden[stage.layers.stop - 1] = self.to_host(x)[0, :size]  # [T,H]
        self.cache.extend(token_ids)
        self.cache.kv_len -= len(token_ids) - size
        logits = x[0] if self.head_tokens is None else full_vocab_logits(x[0], self.head_tokens, self.vocab_size)  # [N,V]
        return Scored(logits, hidden)

    def forward(self, token_ids, n_logits: int | None = None, trunk_hidden: np.ndarray | None = None) -> np.ndarray:
        """Feed token_ids [T] after the cache's kv_len as a chain; returns logits [N, V] for the
        last N positions (all T by default) and extends the cache by T rows."""
        return self.score(Block.chain(token_ids, self.cache.kv_len, n_logits), trunk_hidden).logits

    def to_host(self, x) -> np.ndarray:
        """A stage's output as a numpy array: a device OrtValue is copied back (and counted)."""
        if isinstance(x, np.ndarray):
            return x
        self.copies["hidden_to_host"] += 1
        return x.numpy()

    def prefill(self, token_ids, chunk: int = 256, hidden: tuple[int, ...] = ()) -> dict[int, np.ndarray] | None:
        """Feed a long prompt in chunks (bounded activation memory) without asking for logits
        beyond the last position of each chunk; returns the `hidden` layers' outputs of every
        row fed ([T,H] each), None when none were asked or nothing was fed."""
        parts = [self.score(Block.chain(token_ids[begin : begin + chunk], self.cache.kv_len, 1, hidden)).hidden
                 for begin in range(0, len(token_ids), chunk)]
        if not hidden or not parts:
            return None
        return {layer: np.concatenate([part[layer] for part in parts]) for layer in hidden}
