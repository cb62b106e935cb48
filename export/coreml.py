"""Core ML packages for the Apple Neural Engine: one stateful `.mlpackage` per stage.

The Neural Engine runs fp16 programs of fixed shapes; open `RangeDim` shapes and odd sizes send
work back to the CPU. So every stage is converted with:
- the block input (input_ids [1,T] int32, or hidden_in [1,T,hidden] fp16) enumerated over a few
  lengths T: decode 1, verify γ+1 for every γ up to the max, and one prefill chunk. Core ML takes
  enumerated shapes on one input only, so there is no logit_positions input: the head scores every
  row of the block and the runtime keeps the rows it asked for;
- the KV cache as fixed-size fp16 states (iOS 18 / macOS 15 `ct.StateType`), one key and one value
  buffer per layer, written by slice assignment at kv_len and masked by kv_len, so rolling back is
  still only moving kv_len; the block's new rows are also returned, as the ONNX graphs return them;
- fp16 compute, with weights compressed per the bundle's --quant (int8 per channel, int4 per block).
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from edge_spec import manifest as mf
from export.static_cache import StageModule

# The Neural Engine tiles the KV axis in multiples of 32 fp16 elements (64 bytes); other state
# lengths are padded or sent to another compute unit.
STATE_MULTIPLE = mf.COREML_STATE_MULTIPLE
INT4_BLOCK = 32
ROPE_TABLES = ("cos_table", "sin_table")  # buffer names, and the converted consts' name prefix
# Scores of masked rows: representable in fp16, so the converted graph holds no -inf.
MASKED = torch.finfo(torch.float16).min


class CoreMLExportError(Exception):
    pass


@dataclass(frozen=True)
class CoreMLOptions:
    max_gamma: int = 8  # verify blocks γ+1 for γ = 1..max_gamma
    prefill_chunk: int = 64  # one more enumerated length for prompts

    @property
    def block_lengths(self) -> tuple[int, ...]:
        return tuple(sorted(set(range(1, self.max_gamma + 2)) | {self.prefill_chunk}))


def check_options(options: CoreMLOptions, max_context: int) -> None:
    if max_context % STATE_MULTIPLE:
        upper = -(-max_context // STATE_MULTIPLE) * STATE_MULTIPLE
        raise CoreMLExportError(
            f"--max-context {max_context} cannot size Core ML KV states: the Neural Engine wants state lengths in "
            f"multiples of {STATE_MULTIPLE}; pass a multiple such as {upper}"
        )
    if options.max_gamma < 1 or options.prefill_chunk < 1:
        raise CoreMLExportError(f"Core ML block lengths must be positive (max_gamma {options.max_gamma}, prefill_chunk {options.prefill_chunk})")
    if max(options.block_lengths) > max_context:
        raise CoreMLExportError(f"Core ML block length {max(options.block_lengths)} exceeds --max-context {max_context}")


@contextlib.contextmanager
def _quiet():
    """coremltools draws progress bars on stderr and warns about its untested torch version and
    the macOS-only runtime missing here; the exporter's own log says what is happening."""
    logger = logging.getLogger("coremltools")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def compression_for(quant: str) -> str:
    return {"int8": "int8-per-channel", "int4": f"int4-per-block{INT4_BLOCK}"}.get(quant, "none")


class StatefulStage(nn.Module):
    """A stage over KV states: forward(x, kv_len) -> (logits | hidden, new_key.i, new_value.i, ...).

    x is input_ids [1,T] or hidden [1,T,hidden]; kv_len [1] int32. Logits cover all T rows. The
    weights, layers and norms are the StageModule's; the attention differs: the block's keys and
    values are written into the states first, then one masked pass attends over the whole buffer.
    state_dtype float32 gives an unrounded reference in torch; the converted package keeps fp16.
    """

    def __init__(self, stage: StageModule, layers: range, state_length: int, state_dtype: torch.dtype = torch.float16):
        super().__init__()
        self.stage = stage
        self.layer_ids = list(layers)
        self.state_length = state_length
        shape = (1, stage.n_kv_heads, state_length, stage.head_dim)  # [1,KVH,S,D]
        for layer in self.layer_ids:
            self.register_buffer(mf.coreml_state("key", layer), torch.zeros(shape, dtype=state_dtype))
            self.register_buffer(mf.coreml_state("value", layer), torch.zeros(shape, dtype=state_dtype))
        if self.layer_ids:
            # Rotary tables per position, computed in float32: fp16 angles of positions in the
            # thousands would be off by radians. Rows are gathered at kv_len..kv_len+T. One pair
            # per rotary kind of the stage (Gemma 3: local and global).
            positions = torch.arange(state_length, dtype=torch.float32)
            for index in range(len(stage.rope_kinds)):
                freqs = positions[:, None] * stage.rope_table(index, "inv_freq")[None, :]  # [S,D/2]
                emb = torch.cat((freqs, freqs), dim=-1)  # [S,D]
                suffix = "" if index == 0 else f"_{index}"
                self.register_buffer(ROPE_TABLES[0] + suffix, emb.cos() * stage.rope_scaling[index], persistent=False)
                self.register_buffer(ROPE_TABLES[1] + suffix, emb.sin() * stage.rope_scaling[index], persistent=False)

    def reset_states(self) -> None:
        for layer in self.layer_ids:
            getattr(self, mf.coreml_state("key", layer)).zero_()
            getattr(self, mf.coreml_state("value", layer)).zero_()

    def _rms_norm(self, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        # Same value as StageModule._rms_norm, computed on x / max|x|: squares of residual
        # activations in the hundreds overflow fp16 (SmolLM2's reach 25000), scaled ones stay
        # below 1. Where scale² overflows, eps / scale² is 0, as it nearly is in fp32.
        weight, eps = self.stage.norm_params(norm)
        scale = x.abs().amax(-1, keepdim=True).clamp(min=1.0)  # [1,T,1]
        xs = x / scale
        variance = xs.pow(2).mean(-1, keepdim=True)
        return weight * (xs * torch.rsqrt(variance + eps / (scale * scale)))

    def _rotate_half(self, x: torch.Tensor) -> torch.Tensor:
        # StageModule's, with the half width a Python constant: a width read off the traced
        # shape becomes a shape-[1] value the Core ML converter cannot turn into an int.
        half = self.stage.head_dim // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _attention(self, layer_id, layer, x, cos, sin, start, mask):
        stage = self.stage
        attn = layer.self_attn
        block = x.shape[1]
        # Reshapes name T as -1, never as a value read off the traced shape: symbolic reshape
        # targets cost the converter minutes of shape solving on a real model.
        q, k, v = stage.project(layer, x, self._rms_norm)
        q = q.view(1, -1, stage.n_heads, stage.head_dim).transpose(1, 2)  # [1,H,T,D]
        k = k.view(1, -1, stage.n_kv_heads, stage.head_dim).transpose(1, 2)  # [1,KVH,T,D]
        v = v.view(1, -1, stage.n_kv_heads, stage.head_dim).transpose(1, 2)  # [1,KVH,T,D]
        q = q * cos + self._rotate_half(q) * sin
        k = k * cos + self._rotate_half(k) * sin
        key_state = getattr(self, mf.coreml_state("key", layer_id))  # [1,KVH,S,D]
        value_state = getattr(self, mf.coreml_state("value", layer_id))
        key_state[:, :, start : start + block] = k.to(key_state.dtype)
        value_state[:, :, start : start + block] = v.to(value_state.dtype)
        keys, values = key_state.to(q.dtype), value_state.to(q.dtype)
        # Scale q before the product so fp16 scores stay small; fold the query group into the
        # row axis (as StageModule does) so each KV head's buffer is read once.
        q = (q * stage.scale).reshape(1, stage.n_kv_heads, -1, stage.head_dim)  # [1,KVH,G*T,D]
        scores = torch.matmul(q, keys.transpose(2, 3))  # [1,KVH,G*T,S]
        scores = torch.where(mask, scores, torch.tensor(MASKED, dtype=scores.dtype))
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values)  # [1,KVH,G*T,D]
        out = out.reshape(1, stage.n_heads, -1, stage.head_dim).transpose(1, 2).reshape(1, -1, stage.n_heads * stage.head_dim)  # [1,T,H*D]
        return attn.o_proj(out), k, v

    def forward(self, x, kv_len=None):
        stage = self.stage
        h = stage.embed_tokens(x) if stage.embed else x  # [1,T,hidden]
        block = h.shape[1]
        new_kv = []
        if self.layer_ids:
            start = kv_len[0]
            rows = kv_len + torch.arange(block, dtype=kv_len.dtype)  # [T] absolute positions
            tables = []
            for index in range(len(stage.rope_kinds)):
                suffix = "" if index == 0 else f"_{index}"
                cos = torch.index_select(getattr(self, ROPE_TABLES[0] + suffix), 0, rows).to(h.dtype)[None, None]  # [1,1,T,D]
                sin = torch.index_select(getattr(self, ROPE_TABLES[1] + suffix), 0, rows).to(h.dtype)[None, None]
                tables.append((cos, sin))
            group = stage.n_heads // stage.n_kv_heads
            columns = torch.arange(self.state_length, dtype=kv_len.dtype)  # [S]
            # Row g*T+t of the folded queries is block row t: it sees state rows <= kv_len+t,
            # and on a windowed layer only those less than W positions behind it.
            query_rows = rows.repeat(group)[:, None]  # [G*T,1]
            masks = {0: (columns[None, :] <= query_rows)[None, None]}  # [1,1,G*T,S]
            for window in sorted(set(stage.windows) - {0}):
                masks[window] = masks[0] & ((query_rows - columns[None, :]) < window)[None, None]
            for index, (layer_id, layer) in enumerate(zip(self.layer_ids, stage.layers)):
                cos, sin = tables[stage.layer_rope[index]]
                mask = masks[stage.windows[index]]
                attend = lambda y, layer_id=layer_id, layer=layer, cos=cos, sin=sin, mask=mask: self._attention(layer_id, layer, y, cos, sin, start, mask)
                h, k, v = stage.layer_block(layer, h, attend, self._rms_norm)
                new_kv += [k, v]
        if stage.head:
            h = stage.logits(h, self._rms_norm)  # [1,T,vocab]
        return (h, *new_kv)


def _example(stage: StageModule, layers: range, hidden_size: int, block: int):
    x = torch.zeros((1, block), dtype=torch.int32) if stage.embed else torch.zeros((1, block, hidden_size), dtype=torch.float32)
    return (x, torch.tensor([0], dtype=torch.int32)) if layers else (x,)


def convert_stage(stage: StageModule, layers: range, state_length: int, options: CoreMLOptions, hidden_size: int):
    """Trace the stateful wrapper and convert it to an fp16 ML program (not yet compressed)."""
    wrapper = StatefulStage(stage, layers, state_length).eval()
    lengths = options.block_lengths
    with _quiet(), torch.no_grad():
        import coremltools as ct

        # Any T > 1 keeps the block axis symbolic in the trace.
        traced = torch.jit.trace(wrapper, _example(stage, layers, hidden_size, 2), check_trace=False)
        wrapper.reset_states()
        if stage.embed:
            shapes, dtype = [(1, t) for t in lengths], np.int32
        else:
            shapes, dtype = [(1, t, hidden_size) for t in lengths], np.float16
        block_input, *kv_len = mf.coreml_inputs(stage.embed, layers)
        inputs = [ct.TensorType(name=block_input, shape=ct.EnumeratedShapes(shapes, default=shapes[0]), dtype=dtype)]
        inputs += [ct.TensorType(name=name, shape=(1,), dtype=np.int32) for name in kv_len]
        kv_shape = (1, stage.n_kv_heads, state_length, stage.head_dim)  # [1,KVH,S,D]
        states = [
            ct.StateType(wrapped_type=ct.TensorType(shape=kv_shape, dtype=np.float16), name=name)
            for name in mf.coreml_state_names(layers)
        ]
        outputs = [ct.TensorType(name=name, dtype=np.float16) for name in mf.coreml_outputs(stage.head, layers)]
        return ct.convert(
            traced,
            inputs=inputs,
            outputs=outputs,
            states=states or None,
            minimum_deployment_target=ct.target.iOS18,
            compute_precision=ct.precision.FLOAT16,
            convert_to="mlprogram",
            skip_model_load=True,  # loading needs macOS; the spec and weights are all we write
        )


def compress(model, quant: str):
    """Weight compression per the bundle's --quant: int8 per output channel, int4 per block of
    32 input channels (both symmetric); fp16 and fp32 bundles keep fp16 weights."""
    with _quiet():
        import coremltools.optimize.coreml as cto

    if quant == "int8":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8", granularity="per_channel")
    elif quant == "int4":
        op = cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4", granularity="per_block", block_size=INT4_BLOCK)
    else:
        return model
    # The rotary tables stay fp16: a sine quantized to 4 bits is off by a tenth.
    keep = {name: None for name in _const_names(model) if name.startswith(ROPE_TABLES)}  # every kind's tables
    with _quiet():
        return cto.linear_quantize_weights(model, config=cto.OptimizationConfig(global_config=op, op_name_configs=keep))


def _const_names(model) -> list[str]:
    spec = model.get_spec()
    found = []
    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            found += [op.outputs[0].name for op in block.operations if op.type == "const"]
    return found


def write_package(
    stage: StageModule, key: str, layers: range, max_context: int, quant: str, out_dir: Path, hidden_size: int,
    options: CoreMLOptions = CoreMLOptions(),
) -> mf.CoreMLPackageInfo:
    """Convert, compress and save `<key>.mlpackage` into out_dir; returns its manifest entry."""
    check_options(options, max_context)
    state_length = max_context if layers else 0
    model = compress(convert_stage(stage, layers, state_length, options, hidden_size), quant)
    file = f"{key}.mlpackage"
    with _quiet():
        model.save(str(Path(out_dir) / file))
    return mf.CoreMLPackageInfo(
        file=file,
        inputs=tuple(mf.coreml_inputs(stage.embed, layers)),
        outputs=tuple(mf.coreml_outputs(stage.head, layers)),
        states=tuple(mf.coreml_state_names(layers)),
        block_lengths=options.block_lengths,
        state_length=state_length,
        compression=compression_for(quant),
    )
