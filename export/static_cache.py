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
The module is traced in float32; a float16 device profile (edge_spec.profiles) converts the graph
afterwards and asks here for RMS norms as one SimplifiedLayerNormalization node, which
accumulates in float32: squaring a float16 residual overflows (Qwen2.5's reaches 4.4e3, its
square 1.9e7, past float16's 6.5e4; BENCHMARKS.md).
"""

from __future__ import annotations

import torch
from torch import nn


class _GroupQueryAttention(torch.autograd.Function):
    """Traces to com.microsoft GroupQueryAttention; forward computes the same thing in torch.

    q [1,T,H*D], k/v [1,T,KVH*D] before rotary; past [1,KVH,MAX,D]; seqlens_k int32 [1] =
    kv_len+T-1; total_len int32 scalar = kv_len+T; cos/sin [MAX,D/2]. Returns the attention
    output [1,T,H*D] and the past buffers with rows kv_len..kv_len+T-1 replaced (present).
    """

    @staticmethod
    def forward(ctx, q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache, n_heads, n_kv_heads, scale):
        block = q.shape[1]
        head_dim = past_key.shape[-1]
        kv_len = int(total_len) - block
        cos = torch.cat([cos_cache, cos_cache], dim=-1)[kv_len : kv_len + block][None, None]  # [1,1,T,D]
        sin = torch.cat([sin_cache, sin_cache], dim=-1)[kv_len : kv_len + block][None, None]
        q = q.view(1, block, n_heads, head_dim).transpose(1, 2)  # [1,H,T,D]
        k = k.view(1, block, n_kv_heads, head_dim).transpose(1, 2)  # [1,KVH,T,D]
        v = v.view(1, block, n_kv_heads, head_dim).transpose(1, 2)
        q = q * cos + StageModule._rotate_half(q) * sin
        k = k * cos + StageModule._rotate_half(k) * sin
        present_key, present_value = past_key.clone(), past_value.clone()
        present_key[:, :, kv_len : kv_len + block] = k
        present_value[:, :, kv_len : kv_len + block] = v
        group = n_heads // n_kv_heads
        keys = present_key[:, :, : kv_len + block].repeat_interleave(group, dim=1)  # [1,H,L,D]
        values = present_value[:, :, : kv_len + block].repeat_interleave(group, dim=1)
        scores = torch.matmul(q, keys.transpose(2, 3)) * scale  # [1,H,T,L]
        visible = torch.arange(kv_len + block)[None, :] <= (kv_len + torch.arange(block))[:, None]  # [T,L]
        probs = torch.softmax(scores.masked_fill(~visible, torch.finfo(scores.dtype).min), dim=-1)
        out = torch.matmul(probs, values).transpose(1, 2).reshape(1, block, n_heads * head_dim)  # [1,T,H*D]
        return out, present_key, present_value

    @staticmethod
    def symbolic(g, q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache, n_heads, n_kv_heads, scale):
        out, present_key, present_value = g.op(
            "com.microsoft::GroupQueryAttention",
            q, k, v, past_key, past_value, seqlens_k, total_len, cos_cache, sin_cache,
            num_heads_i=n_heads, kv_num_heads_i=n_kv_heads, scale_f=scale, do_rotary_i=1, rotary_interleaved_i=0,
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
    """Layers [layer_start, layer_end) of a Hugging Face Llama-family model, with optional
    embedding in front and final norm + LM head behind.

    forward(x, position, logit_positions, *past) -> (logits | hidden, KV outputs ...)
    position is kv_len [1] (portable), (seqlens_k [1], total_seq_len []) int32 (fused) or
    (position_ids [T], attention_bias [T, MAX+T]) (masked); past is
    past_key.i, past_value.i for each layer i, each [1, kv_heads, max_context, head_dim].
    fused_norm: RMS norms as one SimplifiedLayerNormalization node (float16 profiles).
    """

    def __init__(self, hf_model, layer_start: int, layer_end: int, embed: bool, head: bool, vocab_rows: int, attention: str = "fused", max_context: int = 2048, fused_norm: bool = False):
        super().__init__()
        self.attention = attention
        self.fused_norm = fused_norm
        config = hf_model.config
        inner = hf_model.model
        self.embed, self.head = embed, head
        self.layers = nn.ModuleList(inner.layers[layer_start:layer_end])
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5
        # inv_freq already carries llama3 scaling; attention_scaling is 1.0 for default/llama3.
        self.register_buffer("inv_freq", inner.rotary_emb.inv_freq.detach().float().clone(), persistent=False)
        self.rope_scaling = float(getattr(inner.rotary_emb, "attention_scaling", 1.0))
        if attention in ("fused", "masked"):
            angles = torch.arange(max_context, dtype=torch.float32)[:, None] * self.inv_freq[None, :]  # [MAX,D/2]
            if attention == "masked":  # full-width tables, gathered by position: no Cos/Sin in the graph
                angles = torch.cat((angles, angles), dim=-1)  # [MAX,D]
            self.register_buffer("cos_cache", angles.cos() * self.rope_scaling, persistent=False)
            self.register_buffer("sin_cache", angles.sin() * self.rope_scaling, persistent=False)
        if embed:
            self.embed_tokens = inner.embed_tokens
        if head:
            self.norm = inner.norm
            # A separate, pre-transposed copy so the graph has MatMul(h, W) with W an initializer
            # of its own (quantizable), even when the checkpoint ties it to the embedding.
            weight = hf_model.lm_head.weight.detach()[:vocab_rows]  # [vocab, hidden]
            self.lm_head_t = nn.Parameter(weight.t().contiguous().clone(), requires_grad=False)  # [hidden, vocab]

    def _rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        if self.fused_norm:
            return _SimplifiedLayerNorm.apply(x, norm.weight, float(norm.variance_epsilon))
        variance = x.pow(2).mean(-1, keepdim=True)
        return norm.weight * (x * torch.rsqrt(variance + norm.variance_epsilon))

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _attention(self, layer, x, cos, sin, past_valid, causal, past_key, past_value):
        attn = layer.self_attn
        batch, block, _ = x.shape
        group = self.n_heads // self.n_kv_heads
        q = attn.q_proj(x).view(1, block, self.n_heads, self.head_dim).transpose(1, 2)  # [1,H,T,D]
        k = attn.k_proj(x).view(1, block, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [1,KVH,T,D]
        v = attn.v_proj(x).view(1, block, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [1,KVH,T,D]
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

    def _masked_attention(self, layer, x, cos, sin, past_bias, new_bias, past_key, past_value):
        """The portable computation with every reshape to a constant shape, the mask added as
        the runtime's bias, and rotate-half without Neg: ops the Core ML EP builds."""
        attn = layer.self_attn
        heads, kv_heads, dim = self.n_heads, self.n_kv_heads, self.head_dim
        q = attn.q_proj(x).view(1, -1, heads, dim).transpose(1, 2)  # [1,H,T,D]
        k = attn.k_proj(x).view(1, -1, kv_heads, dim).transpose(1, 2)  # [1,KVH,T,D]
        v = attn.v_proj(x).view(1, -1, kv_heads, dim).transpose(1, 2)
        half = dim // 2
        q = q * cos + torch.cat((q[..., half:] * -1.0, q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((k[..., half:] * -1.0, k[..., :half]), dim=-1) * sin
        q = q.reshape(1, kv_heads, -1, dim)  # [1,KVH,G*T,D]: rows ordered (group, position), as the bias
        scores_past = torch.matmul(q, past_key.transpose(2, 3)) * self.scale + past_bias  # [1,KVH,G*T,MAX]
        scores_new = torch.matmul(q, k.transpose(2, 3)) * self.scale + new_bias  # [1,KVH,G*T,T]
        probs = torch.softmax(torch.cat([scores_past, scores_new], dim=-1), dim=-1)
        max_context = past_key.shape[2]
        out = torch.matmul(probs[..., :max_context], past_value) + torch.matmul(probs[..., max_context:], v)
        out = out.reshape(1, heads, -1, dim).transpose(1, 2).reshape(1, -1, heads * dim)  # [1,T,H*D]
        return attn.o_proj(out), k, v

    def _fused_attention(self, layer, x, seqlens_k, total_len, past_key, past_value):
        attn = layer.self_attn
        out, present_key, present_value = _GroupQueryAttention.apply(
            attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), past_key, past_value, seqlens_k, total_len,
            self.cos_cache, self.sin_cache, self.n_heads, self.n_kv_heads, self.scale,
        )
        return attn.o_proj(out), present_key, present_value

    def forward(self, x, position, logit_positions, *past):
        h = self.embed_tokens(x) if self.embed else x  # [1,T,hidden]
        block = h.shape[1]
        new_kv = []
        if len(self.layers) and self.attention == "fused":
            seqlens_k, total_len = position  # int32 [1] = kv_len + T - 1, int32 [] = kv_len + T
            for i, layer in enumerate(self.layers):
                attn_out, present_key, present_value = self._fused_attention(
                    layer, self._rms_norm(layer.input_layernorm, h), seqlens_k, total_len, past[2 * i], past[2 * i + 1]
                )
                h = h + attn_out
                h = h + layer.mlp(self._rms_norm(layer.post_attention_layernorm, h))
                new_kv += [present_key, present_value]
        elif len(self.layers) and self.attention == "masked":
            position_ids, bias = position  # int64 [T], float32 [T, MAX+T]
            cos = torch.index_select(self.cos_cache, 0, position_ids)[None, None]  # [1,1,T,D]
            sin = torch.index_select(self.sin_cache, 0, position_ids)[None, None]
            max_context = past[0].shape[2]
            bias = torch.cat([bias] * (self.n_heads // self.n_kv_heads), dim=0)[None, None]  # [1,1,G*T,MAX+T]: Concat, not repeat's Expand
            past_bias, new_bias = bias[..., :max_context], bias[..., max_context:]
            for i, layer in enumerate(self.layers):
                attn_out, k, v = self._masked_attention(
                    layer, self._rms_norm(layer.input_layernorm, h), cos, sin, past_bias, new_bias, past[2 * i], past[2 * i + 1]
                )
                h = h + attn_out
                h = h + layer.mlp(self._rms_norm(layer.post_attention_layernorm, h))
                new_kv += [k, v]
        elif len(self.layers):
            kv_len = position
            positions = (kv_len + torch.arange(block, dtype=torch.int64)).float()  # [T]
            freqs = positions[:, None] * self.inv_freq[None, :]  # [T,D/2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos = (emb.cos() * self.rope_scaling)[None, None]  # [1,1,T,D]
            sin = (emb.sin() * self.rope_scaling)[None, None]
            max_context = past[0].shape[2]
            past_valid = (torch.arange(max_context, dtype=torch.int64) < kv_len)[None, None, None, :]  # [1,1,1,MAX]
            rows = torch.arange(block, dtype=torch.int64)
            group = self.n_heads // self.n_kv_heads
            causal = (rows[None, :] <= rows[:, None]).repeat(group, 1)[None, None]  # [1,1,G*T,T]
            for i, layer in enumerate(self.layers):
                residual = h
                attn_out, k, v = self._attention(
                    layer,
                    self._rms_norm(layer.input_layernorm, h),
                    cos,
                    sin,
                    past_valid,
                    causal,
                    past[2 * i],
                    past[2 * i + 1],
                )
                h = residual + attn_out
                h = h + layer.mlp(self._rms_norm(layer.post_attention_layernorm, h))
                new_kv += [k, v]
        if self.head:
            h = torch.index_select(h, 1, logit_positions)  # [1,N,hidden]
            h = torch.matmul(self._rms_norm(self.norm, h), self.lm_head_t)  # [1,N,vocab]
        return (h, *new_kv)
