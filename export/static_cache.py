"""The torch module every architecture is exported through: one stage over static KV buffers.

A stage takes a block of T new tokens (or their hidden states) at position kv_len and attends
to the valid rows (< kv_len) of the fixed-size past buffer plus, causally, the block itself.
Two attention kinds (edge_spec.names.ATTENTION_KINDS), never copying the cache:
- fused: one ONNX Runtime GroupQueryAttention node per layer (rotary inside), which writes the
  block's rows into the past buffer in place when the runtime binds present_* to past_*;
- portable: standard ops, a masked pass over the past buffer and a causal pass over the block,
  returning only the block's new rows for the runtime to copy in;
- masked: the same with the positions and the mask as inputs from the runtime and constant
  shapes only (the Core ML EP's ops).
What differs between families (norms, q/k norm, fused projections, rotary tables per layer,
sliding windows, attention scale, logit soft-cap) comes from the model's export.archs spec.
Windowed layers mask keys older than W positions over the full-size buffer, so rollback by
length is unchanged. The module is traced in float32; a float16 device profile (edge_spec.profiles) converts the graph
afterwards and asks here for RMS norms as one SimplifiedLayerNormalization node, which
accumulates in float32: squaring a float16 residual overflows (Qwen2.5's reaches 4.4e3, its
square 1.9e7, past float16's 6.5e4; BENCHMARKS.md).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from edge_spec import names, placement


class _GroupQueryAttention(torch.autograd.Function):
    """Traces to com.microsoft GroupQueryAttention; forward computes the same thing in torch.

    q [B,T,H*D], k/v [B,T,KVH*D] before rotary; past [B,KVH,MAX,D]; seqlens_k int32 [B] =
    kv_len+T-1; total_len int32 scalar = kv_len+T; cos/sin [MAX,D/2]; window W > 0 keeps the
    last W positions (the node's local_window_size is W: matched against transformers in tests).
    Returns the attention output [B,T,H*D] and the past buffers with rows kv_len..kv_len+T-1
    replaced (present). forward (the trace) gives every sequence of the batch the same kv_len;
    the node takes each one's from seqlens_k (one token per sequence when B > 1 with a past).
    """

    @staticmethod
    def forward(ctx, q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache, n_heads, n_kv_heads, scale, window):
        batch, block = q.shape[0], q.shape[1]
        head_dim = past_key.shape[-1]
        kv_len = int(total_len) - block
        cos = torch.cat([cos_cache, cos_cache], dim=-1)[kv_len : kv_len + block][None, None]  # [1,1,T,D]
        sin = torch.cat([sin_cache, sin_cache], dim=-1)[kv_len : kv_len + block][None, None]
        q = q.view(batch, block, n_heads, head_dim).transpose(1, 2)  # [B,H,T,D]
        k = k.view(batch, block, n_kv_heads, head_dim).transpose(1, 2)  # [B,KVH,T,D]
        v = v.view(batch, block, n_kv_heads, head_dim).transpose(1, 2)
        q = q * cos + StageModule._rotate_half(q) * sin
        k = k * cos + StageModule._rotate_half(k) * sin
        present_key, present_value = past_key.clone(), past_value.clone()
        present_key[:, :, kv_len : kv_len + block] = k
        present_value[:, :, kv_len : kv_len + block] = v
        group = n_heads // n_kv_heads
        keys = present_key[:, :, : kv_len + block].repeat_interleave(group, dim=1)  # [B,H,L,D]
        values = present_value[:, :, : kv_len + block].repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [B,H,T,L]
        query_pos = (kv_len + torch.arange(block))[:, None]
        key_pos = torch.arange(kv_len + block)[None, :]
        visible = key_pos <= query_pos  # [T,L]
        if window:
            visible = visible & (query_pos - key_pos < window)
        probs = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), dim=-1)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(batch, block, n_heads * head_dim)  # [B,T,H*D]
        return out, present_key, present_value

    @staticmethod
    def symbolic(g, q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache, n_heads, n_kv_heads, scale, window):
        out, present_key, present_value = g.op(
            "com.microsoft::GroupQueryAttention",
            q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache,
            num_heads_i=n_heads, kv_num_heads_i=n_kv_heads, scale_f=scale, do_rotary_i=1, rotary_interleaved_i=0,
            local_window_size_i=window if window else -1,
            outputs=3,
        )
        out.setType(q.type())
        present_key.setType(past_key.type())
        present_value.setType(past_value.type())
        return out, present_key, present_value


class _SimplifiedLayerNorm(torch.autograd.Function):
    """Traces to ONNX Runtime's SimplifiedLayerNormalization (RMS norm, float32 statistics
    whatever the input type: stash_type 1); forward is the same norm in torch."""

    @staticmethod
    def forward(ctx, x, weight, epsilon):
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + epsilon)).to(x.dtype)

    @staticmethod
    def symbolic(g, x, weight, epsilon):
        return g.op("SimplifiedLayerNormalization", x, weight, axis_i=-1, epsilon_f=epsilon, stash_type_i=1)


class StageModule(nn.Module):
    """Layers [layer_start, layer_end) of a Hugging Face decoder model of a registered
    architecture (export.archs), with optional embedding in front and final norm + LM head behind.

    forward(x, position, logit_positions, *past) -> (logits | hidden, KV outputs ...)
    position is kv_len [1] (portable), (seqlens_k [B], total_seq_len []) int32 (fused) or
    (position_ids [T], attention_bias [T, P+T]) (masked); past is
    past_key.i, past_value.i for each layer i, each [B, kv_heads, max_context, head_dim] (masked
    without windows: [1, kv_heads, P, head_dim], P <= max_context the rows the runtime feeds). B is 1
    but in fused graphs, which take a batch of sequences (one slot of KV buffers each).
    fused_norm: RMS norms as one SimplifiedLayerNormalization node (float16 profiles).
    head_tokens: the LM-head rows to keep, in order (a trimmed draft head); None: the first vocab_rows.
    """

    def __init__(self, hf_model, layer_start: int, layer_end: int, embed: bool, head: bool, vocab_rows: int, attention: str = "fused", max_context: int = 2048, fused_norm: bool = False,
                 head_tokens=None):
        super().__init__()
        from export.archs import arch_for

        self.attention = attention
        self.fused_norm = fused_norm
        # Masked float32 graphs are the Core ML EP's, which takes no node input wider than its
        # limit (a kernel fact): the embedding and the LM head are written in slices within it.
        self.width = placement.input_dim_limit("coreml") if attention == "masked" and not fused_norm else None
        # Its --quant fp16 graphs compute norms in float16 on the GPU/ANE: squares kept in range (_scaled_rms_norm).
        self.scaled_norm = attention == "masked" and not fused_norm
        config = hf_model.config
        self.spec = spec = arch_for(config)
        inner = hf_model.model
        self.embed, self.head = embed, head
        self.layers = nn.ModuleList(inner.layers[layer_start:layer_end])
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.scale = float(spec.attention_scale(config))
        self.softcap = spec.logit_softcap(config)
        self.windows = tuple(spec.windows(config)[layer_start:layer_end])  # per layer of this stage, 0 = global
        # Masked graphs take the past buffers cut to the rows in use (width P, symbolic), so a pass
        # costs in proportion to the context, not --max-context; windowed layers find a key's
        # position from the full buffer's row number, which needs the constant width. Decided per
        # model, not per stage: every stage of a role reads the same buffers.
        self.dynamic_past = attention == "masked" and not any(spec.windows(config))
        layer_kinds = spec.rope_kinds(config)[layer_start:layer_end]
        # One rotary table per kind the stage's layers use (Gemma 3: local and global); the
        # first is named as a single-table model's always was.
        self.rope_kinds = sorted(set(layer_kinds))
        self.layer_rope = tuple(self.rope_kinds.index(kind) for kind in layer_kinds)
        self.rope_scaling = []
        for index, kind in enumerate(self.rope_kinds):
            inv_freq, scaling = spec.rope_table(inner, kind)
            suffix = "" if index == 0 else f"_{index}"
            # inv_freq already carries llama3/linear scaling; attention_scaling is long-RoPE's factor (else 1.0).
            inv_freq = inv_freq.detach().float().clone()
            self.register_buffer("inv_freq" + suffix, inv_freq, persistent=False)
            self.rope_scaling.append(float(scaling))
            if attention in ("fused", "masked"):
                angles = torch.arange(max_context, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [MAX,D/2]
                if attention == "masked":  # full-width tables, gathered by position: no Cos/Sin in the graph
                    angles = torch.cat((angles, angles), dim=-1)  # [MAX,D]
                self.register_buffer("cos_cache" + suffix, angles.cos() * scaling, persistent=False)
                self.register_buffer("sin_cache" + suffix, angles.sin() * scaling, persistent=False)
        if embed:
            self.embed_tokens = inner.embed_tokens  # transformers' module: Gemma's sqrt(hidden) scale included
            self.embed_slices = self.embed_height = 0
            table = self.embed_tokens.weight.detach()
            if self.width and table.shape[0] > self.width:
                # The table in row slices of equal height (the last padded with zero rows), as
                # parameters: traced as initializers of their own (a slice taken in forward is not
                # folded right by the tracer); a one-hot row choosing each, as a small buffer.
                self.embed_slices = -(-table.shape[0] // self.width)
                self.embed_height = height = -(-table.shape[0] // self.embed_slices)
                tables = []
                for k, pick in enumerate(torch.eye(self.embed_slices)):
                    rows = table[k * height : (k + 1) * height]
                    if rows.shape[0] < height:
                        rows = torch.cat([rows, rows.new_zeros(height - rows.shape[0], rows.shape[1])])
                    tables.append(nn.Parameter(rows, requires_grad=False))
                    self.register_buffer(f"embed_pick_{k}", pick.clone(), persistent=False)
                self.embed_tables = nn.ParameterList(tables)
        if head:
            self.norm = inner.norm
            # A separate, pre-transposed copy so the graph has MatMul(h, W) with W an initializer
            # of its own (quantizable), even when the checkpoint ties it to the embedding.
            weight = hf_model.lm_head.weight.detach()
            # Gathered, not sliced, for a trimmed head; a tied embedding keeps every row for the input side.
            weight = weight[:vocab_rows] if head_tokens is None else weight[torch.as_tensor(head_tokens, dtype=torch.int64)]  # [vocab | kept, hidden]
            # [hidden, vocab]: a copy (a transpose is not contiguous); past the width limit, column
            # slices of equal width, each its own MatMul (a slice taken in forward folds wrong).
            size = -(-weight.shape[0] // -(-weight.shape[0] // self.width)) if self.width and weight.shape[0] > self.width else weight.shape[0]
            self.lm_head_parts = nn.ParameterList(
                nn.Parameter(weight[start : start + size].t().contiguous(), requires_grad=False) for start in range(0, weight.shape[0], size)
            )

    def rope_table(self, index: int, name: str) -> torch.Tensor:
        return getattr(self, name + ("" if index == 0 else f"_{index}"))

    def norm_params(self, norm: nn.Module) -> tuple[torch.Tensor, float]:
        """(scale, epsilon) of an RMS norm module: Gemma's weight is stored as scale - 1."""
        eps = getattr(norm, "variance_epsilon", None)
        eps = float(norm.eps if eps is None else eps)
        weight = norm.weight if not self.spec.norm_offset else norm.weight + self.spec.norm_offset
        return weight, eps

    def _rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        weight, eps = self.norm_params(norm)
        if self.fused_norm:
            return _SimplifiedLayerNorm.apply(x, weight, eps)
        if self.scaled_norm:
            return self._scaled_rms_norm(x, weight, eps)
        variance = x.pow(2).mean(-1, keepdim=True)
        return weight * (x * torch.rsqrt(variance + eps))

    @staticmethod
    def _scaled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """The RMS norm in a form whose every float16 step stays finite: --device coreml --quant
        fp16 graphs are float16 throughout, the Core ML EP's MLProgram op list takes Pow in
        float32 only, and its table (edge_spec/kernels/coreml.json) has no ReduceMax or Abs, so
        only Mul, Div, Add, Sqrt and ReduceMean are used.

        The norm is scale invariant, x / rms(x) = (x / s) / rms(x / s). A coarse pass on
        x / bound (bound a power of two, an exact division, of at least 256 * sqrt(n)) keeps every
        square and their sum under 65504 for any finite float16 x; s = bound * that rms + 1, the
        1 standing in where the coarse squares underflow (small rows, which square safely as they
        are). On x / s each square is at most about n and the mean about 1; eps enters as
        (sqrt(eps) / s)^2, which underflows only where it is negligible beside that mean.
        """
        n = x.shape[-1]
        bound = float(2 ** math.ceil(math.log2(256.0 * math.sqrt(n))))
        coarse = x * (1.0 / bound)
        scale = torch.sqrt((coarse * coarse).mean(-1, keepdim=True)) * bound + 1.0  # [..,1]
        u = x / scale
        floor = torch.tensor(math.sqrt(eps), dtype=scale.dtype) / scale  # a constant tensor numerator: Div, not Reciprocal (not in the table)
        return weight * (u / torch.sqrt((u * u).mean(-1, keepdim=True) + floor * floor))

    def project(self, layer, x, norm=None):
        """q [B,T,H*D], k and v [B,T,KVH*D] before rotary, q/k normed per head where the family does."""
        attn = layer.self_attn
        q_size, kv_size = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        if self.spec.fused_qkv:
            qkv = attn.qkv_proj(x)
            q, k, v = qkv[..., :q_size], qkv[..., q_size : q_size + kv_size], qkv[..., q_size + kv_size :]
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        if self.spec.qk_norm:
            norm = norm or self._rms_norm
            # Fused graphs take a batch of sequences (its size traced as a shape); the others one.
            batch = x.shape[0] if self.attention == "fused" else 1
            q = norm(attn.q_norm, q.view(batch, -1, self.n_heads, self.head_dim)).reshape(batch, -1, q_size)
            k = norm(attn.k_norm, k.view(batch, -1, self.n_kv_heads, self.head_dim)).reshape(batch, -1, kv_size)
        return q, k, v

    def layer_block(self, layer, h, attend, norm=None):
        """One decoder layer around `attend(normed h) -> (attn_out, k, v)`: pre-norms, and
        Gemma's norms on both sublayer outputs. Returns (h, k, v)."""
        norm = norm or self._rms_norm
        attn_out, k, v = attend(norm(layer.input_layernorm, h))
        if self.spec.sandwich_norms:
            h = h + norm(layer.post_attention_layernorm, attn_out)
            return h + norm(layer.post_feedforward_layernorm, self.mlp(layer, norm(layer.pre_feedforward_layernorm, h))), k, v
        h = h + attn_out
        return h + self.mlp(layer, norm(layer.post_attention_layernorm, h)), k, v

    def mlp(self, layer, x):
        if self.spec.activations != ("gelu_pytorch_tanh",):
            return layer.mlp(x)  # transformers' module: SiLU-gated, fused gate_up for Phi-3
        # GELU (tanh form) written out: the CPU provider has no kernel for ONNX's Gelu here.
        mlp = layer.mlp
        gate = mlp.gate_proj(x)
        gelu = 0.5 * gate * (1.0 + torch.tanh(0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)))
        return mlp.down_proj(gelu * mlp.up_proj(x))

    def logits(self, h, norm=None):
        """[1,N,vocab]: one MatMul (and soft-cap) per slice of the head, concatenated."""
        h = (norm or self._rms_norm)(self.norm, h)
        parts = [torch.matmul(h, w if w.dtype == h.dtype else w.to(h.dtype)) for w in self.lm_head_parts]
        if self.softcap:
            parts = [torch.tanh(p / self.softcap) * self.softcap for p in parts]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)

    def embedding(self, x):
        """transformers' embedding of ids [1,T], or, from the table's slices, each row taken from
        slice id // height at id % height and kept by a one-hot gather of the slice index (the
        Core ML EP builds no comparison)."""
        if not self.embed_slices:
            return self.embed_tokens(x)
        part = torch.div(x, self.embed_height, rounding_mode="trunc")  # [1,T]: ids are never negative
        local = x - part * self.embed_height
        h = 0
        for k in range(self.embed_slices):
            pick = getattr(self, f"embed_pick_{k}").to(self.embed_tokens.weight.dtype)
            h = h + nn.functional.embedding(local, self.embed_tables[k]) * pick[part].unsqueeze(-1)
        scale = getattr(self.embed_tokens, "embed_scale", None)  # Gemma's sqrt(hidden)
        return h if scale is None else h * scale.to(h.dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _attention(self, layer, x, cos, sin, past_valid, causal, past_key, past_value):
        attn = layer.self_attn
        batch, block, _ = x.shape
        group = self.n_heads // self.n_kv_heads
        q, k, v = self.project(layer, x)
        q = q.view(1, block, self.n_heads, self.head_dim).transpose(1, 2)  # [1,H,T,D]
        k = k.view(1, block, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [1,KVH,T,D]
        v = v.view(1, block, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [1,KVH,T,D]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        # Query head h uses KV head h // group: fold the group into the row axis instead of
        # repeating the cache, so the past buffer is read once per KV head.
        q = q.reshape(1, self.n_kv_heads, group * block, self.head_dim)  # [1,KVH,G*T,D]
        scores_past = torch.matmul(q, past_key.transpose(2, 3)) * self.scale  # [1,KVH,G*T,MAX]
        scores_new = torch.matmul(q, k.transpose(2, 3)) * self.scale  # [1,KVH,G*T,T]
        lowest = torch.finfo(scores_past.dtype).min
        scores_past = torch.where(past_valid, scores_past, lowest)
        scores_new = torch.where(causal, scores_new, lowest)
        probs = torch.softmax(torch.cat([scores_past, scores_new], dim=-1), dim=-1)
        max_context = past_key.shape[2]
        out = torch.matmul(probs[..., :max_context], past_value) + torch.matmul(probs[..., max_context:], v)
        out = out.reshape(1, self.n_heads, block, self.head_dim).transpose(1, 2).reshape(1, block, -1)  # [1,T,H*D]
        return attn.o_proj(out), k, v

    def _masked_attention(self, layer, x, cos, sin, bias, past_key, past_value):
        """The portable computation with every reshape to a constant shape, the mask added as
        the runtime's bias, and rotate-half without Neg: ops the Core ML EP builds. The block's
        scores and values are appended to the past's, so nothing is sliced at the past's width,
        which the runtime may cut to the rows in use (dynamic_past)."""
        attn = layer.self_attn
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        q, k, v = self.project(layer, x)
        q = q.view(1, -1, heads, dim).transpose(1, 2)  # [1,H,T,D]
        k = k.view(1, -1, kv_heads, dim).transpose(1, 2)  # [1,KVH,T,D]
        v = v.view(1, -1, kv_heads, dim).transpose(1, 2)
        half = dim // 2
        q = q * cos + torch.cat((q[..., half:] * -1.0, q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((k[..., half:] * -1.0, k[..., :half]), dim=-1) * sin
        q = q.reshape(1, kv_heads, -1, dim)  # [1,KVH,G*T,D]: rows ordered (group, position), as the bias
        # Scores against the past and the block apart (ONNX Runtime fuses each transpose and scale
        # into its MatMul), then one Concat of the values: appending the keys too costs more.
        scores = torch.cat([torch.matmul(q, past_key.transpose(2, 3)) * self.scale,
                            torch.matmul(q, k.transpose(2, 3)) * self.scale], dim=-1) + bias  # [1,KVH,G*T,P+T]
        values = torch.cat([past_value, v], dim=2)  # [1,KVH,P+T,D]
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [1,KVH,G*T,D]
        out = out.reshape(1, heads, -1, dim).transpose(1, 2).reshape(1, -1, heads * dim)  # [1,T,H*D]
        return attn.o_proj(out), k, v

    def _fused_attention(self, layer, x, seqlens_k, total_len, past_key, past_value, rope: int, window: int):
        attn = layer.self_attn
        q, k, v = self.project(layer, x)
        out, present_key, present_value = _GroupQueryAttention.apply(
            q, k, v, past_key, past_value, seqlens_k, total_len,
            self.rope_table(rope, "cos_cache"), self.rope_table(rope, "sin_cache"), self.n_heads, self.n_kv_heads, self.scale, window,
        )
        return attn.o_proj(out), present_key, present_value

    def forward(self, x, position, logit_positions, *past):
        h = self.embedding(x) if self.embed else x  # [1,T,hidden]
        block = h.shape[1]
        new_kv = []
        if len(self.layers) and self.attention == "fused":
            seqlens_k, total_len = position  # int32 [1] = kv_len + T - 1, int32 [] = kv_len + T
            for i, layer in enumerate(self.layers):
                attend = lambda y, i=i: self._fused_attention(
                    self.layers[i], y, seqlens_k, total_len, past[2 * i], past[2 * i + 1], self.layer_rope[i], self.windows[i]
                )
                h, present_key, present_value = self.layer_block(layer, h, attend)
                new_kv += [present_key, present_value]
        elif len(self.layers) and self.attention == "masked":
            position_ids, bias = position  # int64 [T], float32 [T, P+T]
            tables = [
                (torch.index_select(self.rope_table(r, "cos_cache"), 0, position_ids)[None, None],  # [1,1,T,D]
                 torch.index_select(self.rope_table(r, "sin_cache"), 0, position_ids)[None, None])
                for r in range(len(self.rope_kinds))
            ]
            group = self.n_heads // self.n_kv_heads
            biases = {}
            for window in sorted(set(self.windows)):
                windowed = bias
                if window:
                    # Keys W or more positions behind the query are masked too (past row j holds
                    # position j), in float arithmetic: the Core ML EP builds no comparison, Max or
                    # Relu, so relu(x) = (x + sqrt(x * x)) / 2, exact on these whole numbers.
                    positions = position_ids.float()
                    key_pos = torch.cat([torch.arange(past[0].shape[2], dtype=torch.float32), positions])  # [MAX+T]
                    behind = positions[:, None] - key_pos[None, :] - (window - 1)  # [T,MAX+T]: > 0 outside the window
                    windowed = bias + (behind + torch.sqrt(behind * behind)) * (0.5 * names.MASKED)
                biases[window] = torch.cat([windowed] * group, dim=0)[None, None]  # [1,1,G*T,P+T]: Concat, not repeat's Expand
            for i, layer in enumerate(self.layers):
                cos, sin = tables[self.layer_rope[i]]
                attend = lambda y, i=i, cos=cos, sin=sin, b=biases[self.windows[i]]: self._masked_attention(
                    self.layers[i], y, cos, sin, b, past[2 * i], past[2 * i + 1]
                )
                h, k, v = self.layer_block(layer, h, attend)
                new_kv += [k, v]
        elif len(self.layers):
            kv_len = position
            positions = (kv_len + torch.arange(block, dtype=torch.int64)).float()  # [T]
            tables = []
            for r in range(len(self.rope_kinds)):
                freqs = positions[:, None] * self.rope_table(r, "inv_freq")[None, :]  # [T,D/2]
                emb = torch.cat((freqs, freqs), dim=-1)
                tables.append(((emb.cos() * self.rope_scaling[r])[None, None], (emb.sin() * self.rope_scaling[r])[None, None]))  # [1,1,T,D]
            max_context = past[0].shape[2]
            columns = torch.arange(max_context, dtype=torch.int64)
            past_valid = (columns < kv_len)[None, None, None, :]  # [1,1,1,MAX]
            rows = torch.arange(block, dtype=torch.int64)
            group = self.n_heads // self.n_kv_heads
            causal = (rows[None, :] <= rows[:, None]).repeat(group, 1)[None, None]  # [1,1,G*T,T]
            masks = {0: (past_valid, causal)}
            for window in sorted(set(self.windows) - {0}):
                # Block row t (position kv_len + t) sees the keys less than `window` positions behind it.
                query_pos = (kv_len + rows).repeat(group)[:, None]  # [G*T,1]
                past_near = (query_pos - columns[None, :]) < window  # [G*T,MAX]
                new_near = (rows[:, None] - rows[None, :] < window).repeat(group, 1)  # [G*T,T]
                masks[window] = (past_valid & past_near[None, None], causal & new_near[None, None])
            for i, layer in enumerate(self.layers):
                cos, sin = tables[self.layer_rope[i]]
                valid, causal_i = masks[self.windows[i]]
                attend = lambda y, i=i, cos=cos, sin=sin, valid=valid, causal_i=causal_i: self._attention(
                    self.layers[i], y, cos, sin, valid, causal_i, past[2 * i], past[2 * i + 1]
                )
                h, k, v = self.layer_block(layer, h, attend)
                new_kv += [k, v]
        if self.head:
            h = torch.index_select(h, 1, logit_positions)  # [1,N,hidden]
            h = self.logits(h)
        return (h, *new_kv)
