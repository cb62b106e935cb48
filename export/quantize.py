"""Weight quantization of a stage graph with ONNX Runtime's own quantizers.

int4: MatMulNBits (4 bits, symmetric, one scale per block of 32 weights by default,
      accuracy level 4 = int8 activations on CPU) and GatherBlockQuantized for the embedding table.
      A larger block (export --block-size 64/128) stores fewer scales and the kernel runs faster,
      at some precision (BENCHMARKS.md).
int8: MatMulNBits with 8 bits (the same blocks, accuracy level 4) and a 4-bit block-quantized
      embedding table (ONNX Runtime's Gather quantizer supports only 4 bits; a float32 table
      would be the largest tensor of a small model). Not quantize_dynamic: its per-tensor
      activation scale is ruined by the outlier channels these models have (SmolLM2 logits
      went to noise), while MatMulNBits quantizes activations per block of 32.
      With zero points (`asymmetric`), each MatMul block gets a uint8 zero point and its scale and
      zero point are fitted by least squares (fit_blocks) instead of taken from the block's
      extremes: the CPU kernel folds zero points into the block sums it keeps anyway, so they cost
      no bytes per pass, and at a larger block they recover much of the precision a larger block
      loses (BENCHMARKS.md, "Bytes per token").
fp16: float16 weights, float32 graph inputs and outputs.
fp32: unchanged.
A float16-activation device profile (cuda, dml) converts the quantized graph after that: every
float tensor, the KV inputs and GroupQueryAttention included, becomes float16, MatMulNBits and
GatherBlockQuantized take float16 scales, and only the logits stay float32 (a Cast on the rows
asked for).

Graphs go from file to file: a 1.5B-parameter stage is gigabytes in float32, and holding the
float32 and the quantized copy in memory at once is what a 24 GB machine cannot afford.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from edge_spec import names
from edge_spec.manifest import DEFAULT_QUANT_BLOCK

ACCURACY_LEVEL = 4


def save(model: onnx.ModelProto, path: Path) -> None:
    """One graph file plus one external-data file named after it. Tensors under 1 KiB (shape
    arguments such as a Split's sizes) stay inline: ONNX Runtime's shape inference reads them
    from the graph file and cannot follow them into the data file."""
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data", size_threshold=INLINE_BYTES)


INLINE_BYTES = 1024


class DataWriter:
    """Appends tensors to `path`.data as they are made, leaving in the graph only a reference:
    what save() writes, one tensor in memory at a time."""

    def __init__(self, path: Path):
        self.location = path.name + ".data"
        self.file = open(path.with_name(self.location), "wb")

    def add(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """A new, small message: a protobuf message keeps the bytes of the message it came from
        (its arena) alive for as long as any part of it is referenced, cleared fields included."""
        if not tensor.HasField("raw_data") or len(tensor.raw_data) < INLINE_BYTES:
            return onnx.TensorProto.FromString(tensor.SerializeToString())
        offset = self.file.tell()  # back to back, as onnx.save_model writes them
        self.file.write(tensor.raw_data)
        ref = onnx.TensorProto(name=tensor.name, data_type=tensor.data_type, dims=list(tensor.dims), data_location=onnx.TensorProto.EXTERNAL)
        for key, value in (("location", self.location), ("offset", str(offset)), ("length", str(len(tensor.raw_data)))):
            entry = ref.external_data.add()
            entry.key, entry.value = key, value
        return ref

    def close(self) -> None:
        self.file.close()


def _node_quantizer(bits: int, block_size: int):
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, DefaultWeightOnlyQuantizer

    return DefaultWeightOnlyQuantizer(DefaultWeightOnlyQuantConfig(
        block_size=block_size,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL,
        op_types_to_quantize=("MatMul", "Gather"),
        quant_axes=(("MatMul", 0), ("Gather", 1)),
        bits=bits,
    ))


FIT_ITERATIONS = 4  # least-squares refits after the min/max start; more changed the error by < 0.2%
FIT_ROWS = 8192  # output rows fitted at a time: the LM head's float32 temporaries stay under 1 GB


def fit_blocks(w: np.ndarray, bits: int, block: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric block quantization of w [N, K] (K a multiple of block): q [N, K/block, block] and
    zero points [N, K/block] in 0..2^bits-1, scales [N, K/block], with w ≈ (q - zp) * scale. Starts
    from each block's min and max, then alternates rounding with a least-squares fit of the scale
    and offset (the offset rounded to an integer zero point), keeping each block's best."""
    qmax = 2**bits - 1
    wb = w.reshape(w.shape[0], -1, block).astype(np.float32)
    lo, hi = wb.min(-1, keepdims=True), wb.max(-1, keepdims=True)
    scale = np.maximum((hi - lo) / qmax, np.float32(1e-12))
    zero = np.clip(np.round(-lo / scale), 0, qmax)
    best = None
    for iteration in range(FIT_ITERATIONS + 1):
        q = np.clip(np.round(wb / scale + zero), 0, qmax)
        err = np.square((q - zero) * scale - wb).sum(-1, keepdims=True)
        if best is None:
            best = [err, scale, zero]
        else:
            better = err < best[0]
            best = [np.where(better, err, best[0]), np.where(better, scale, best[1]), np.where(better, zero, best[2])]
        if iteration == FIT_ITERATIONS:
            break
        # w ≈ scale * q - offset, both free, then the offset rounded to a zero point and the scale refitted
        sq, sqq, sw, sqw = q.sum(-1, keepdims=True), np.square(q).sum(-1, keepdims=True), wb.sum(-1, keepdims=True), (q * wb).sum(-1, keepdims=True)
        det = block * sqq - sq * sq
        fitted = np.where(det > 0, (block * sqw - sq * sw) / np.where(det > 0, det, 1), scale)
        fitted = np.where(fitted > 1e-12, fitted, scale)
        zero = np.clip(np.round((fitted * sq - sw) / block / fitted), 0, qmax)
        d = q - zero
        dd = np.square(d).sum(-1, keepdims=True)
        scale = np.maximum(np.where(dd > 0, (wb * d).sum(-1, keepdims=True) / np.maximum(dd, 1e-20), fitted), np.float32(1e-12))
    _, scale, zero = best
    q = np.clip(np.round(wb / scale + zero), 0, qmax).astype(np.uint8)
    return q, scale[..., 0].astype(np.float32), zero[..., 0].astype(np.uint8)


def _pack4(values: np.ndarray) -> np.ndarray:
    """Pairs of 4-bit values along the last axis into bytes, the first in the low nibble."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], -1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def asymmetric_matmul(node: onnx.NodeProto, weight: np.ndarray, bits: int, block: int) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    """MatMul(A, weight [K, N]) as MatMulNBits with fitted scales and uint8 zero points."""
    k, n = weight.shape
    padded = -(-k // block) * block
    w = np.zeros((n, padded), np.float32)
    w[:, :k] = weight.T
    parts = [fit_blocks(w[r : r + FIT_ROWS], bits, block) for r in range(0, n, FIT_ROWS)]
    q, scales, zeros = (np.concatenate(x) for x in zip(*parts))
    data = _pack4(q) if bits == 4 else q
    zp = _pack4(zeros) if bits == 4 else zeros
    base = node.input[1]
    tensors = [numpy_helper.from_array(data, f"{base}_Q{bits}"), numpy_helper.from_array(scales, f"{base}_scales"), numpy_helper.from_array(zp, f"{base}_zero_points")]
    quantized = helper.make_node("MatMulNBits", [node.input[0]] + [t.name for t in tensors], list(node.output), name=f"{node.name}_Q{bits}",
                                 domain="com.microsoft", K=k, N=n, bits=bits, block_size=block, accuracy_level=ACCURACY_LEVEL)
    return quantized, tensors


def write_stage(model: onnx.ModelProto, weights, dst: Path, matmul_bits: int | None, gather_bits: int | None,
                block_size: int = DEFAULT_QUANT_BLOCK, asymmetric: bool = False) -> None:
    """Write the stage graph `model` (its weights read from `weights`, an
    export.onnx_graphs.StageWeights) to dst + dst.data, one initializer at a time: each MatMul by
    a constant 2-D weight becomes MatMulNBits at `matmul_bits`, each Gather from a constant
    table GatherBlockQuantized at `gather_bits` (None: left as is), through ONNX Runtime's own
    per-node quantizer (what MatMulNBitsQuantizer runs over a whole graph in memory); with
    `asymmetric`, the MatMuls through asymmetric_matmul instead."""
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    quantizers = {op: _node_quantizer(bits, block_size) for op, bits in (("MatMul", matmul_bits), ("Gather", gather_bits)) if bits}
    writer = DataWriter(dst)
    made: list[onnx.TensorProto] = []
    nodes: list[onnx.NodeProto] = []
    try:
        for node in graph.node:
            weight = initializers.get(node.input[1] if node.op_type == "MatMul" else node.input[0]) if node.op_type in quantizers else None
            if weight is None or weight.data_type != onnx.TensorProto.FLOAT or (node.op_type == "MatMul" and len(weight.dims) != 2):
                nodes.append(node)
                continue
            if asymmetric and node.op_type == "MatMul":
                quantized, tensors = asymmetric_matmul(node, weights.array(weight), matmul_bits, block_size)
                nodes.append(quantized)
                made.extend(writer.add(t) for t in tensors)
                continue
            scope = onnx.GraphProto(initializer=[weights.tensor(weight)])
            nodes.extend(quantizers[node.op_type].quantize(node, [scope]))
            made.extend(writer.add(t) for t in scope.initializer[1:])
            del scope
        used = {name for node in nodes for name in node.input} | {o.name for o in graph.output}
        kept = [writer.add(weights.tensor(t)) for t in graph.initializer if t.name in used]
    finally:
        writer.close()
    del graph.node[:]
    graph.node.extend(nodes)
    del graph.initializer[:]
    graph.initializer.extend(kept + made)
    if quantizers:
        _set_opset(model, "com.microsoft", 1)
    if gather_bits:
        # Int4 tensors need opset 21 and IR version 10 (what the whole-graph quantizer sets too).
        _set_opset(model, "", max(21, _opset(model, "")))
        model.ir_version = max(model.ir_version, 10)
    onnx.save_model(model, dst)


def _opset(model: onnx.ModelProto, domain: str) -> int:
    return next((o.version for o in model.opset_import if o.domain in (domain, "ai.onnx" if domain == "" else domain)), 0)


def _set_opset(model: onnx.ModelProto, domain: str, version: int) -> None:
    for opset in model.opset_import:
        if opset.domain == domain:
            opset.version = version
            return
    model.opset_import.append(onnx.helper.make_opsetid(domain, version))


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float tensor float16, the logits output excepted (float32 for the sampler)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = [o.name for o in model.graph.output if o.name == names.LOGITS]
    return convert_float_to_float16(model, keep_io_types=keep, disable_shape_infer=True)


def quantize_stage(model: onnx.ModelProto, weights, dst: Path, quant: str, activations: str = "float32", quantized_embedding: bool = True,
                   block_size: int = DEFAULT_QUANT_BLOCK, asymmetric: bool = False) -> None:
    """Write the merged stage graph (export.onnx_graphs.finish_stage) into dst (+ dst.data) at
    `quant`. int4/int8 and fp32 stream weight by weight. fp16 weights and float16 activations
    convert a whole graph in memory: the fp32 one for fp16 weights, the already quantized (small)
    one for int4/int8 with float16 activations. quantized_embedding False: int4/int8 quantize the
    MatMuls only (a provider without GatherBlockQuantized). block_size: weights per int4/int8 scale.
    asymmetric: MatMul weights with fitted scales and uint8 zero points (write_stage)."""
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    if quant not in ("int4", "int8", "fp16", "fp32"):
        raise ValueError(f"unknown quantization {quant!r} (int4, int8, fp16, fp32)")
    if activations == "float16" and quant == "fp32":
        raise ValueError(f"float16 activations need fp16, int8 or int4 weights, not {quant!r}")
    bits = {"int4": 4, "int8": 8}.get(quant)
    # The embedding table is 4-bit at int8 too: ONNX Runtime's Gather quantizer has only 4 bits.
    gather_bits = 4 if bits and quantized_embedding else None
    if activations != "float16" and quant != "fp16":
        write_stage(model, weights, dst, bits, gather_bits, block_size, asymmetric)
        return
    scratch = dst.with_name(dst.stem + ".unconverted.onnx")
    write_stage(model, weights, scratch, bits, gather_bits, block_size, asymmetric)
    converted = onnx.load(str(scratch), load_external_data=True)
    scratch.unlink()
    scratch.with_name(scratch.name + ".data").unlink()
    if activations == "float16":
        converted = to_float16(converted)
    else:
        from onnxruntime.transformers.float16 import convert_float_to_float16

        # GroupQueryAttention stays float32: its past/present must be the float32 graph inputs
        # themselves (in place), not float16 casts of them. Its outputs' recorded types go: the
        # converter would retype them float16 and the blocked node's casts would then mismatch.
        blocked = {o for n in converted.graph.node if n.op_type == "GroupQueryAttention" for o in n.output}
        kept = [v for v in converted.graph.value_info if v.name not in blocked]
        del converted.graph.value_info[:]
        converted.graph.value_info.extend(kept)
        converted = convert_float_to_float16(converted, keep_io_types=True, disable_shape_infer=True, op_block_list=["GroupQueryAttention"])
    save(converted, dst)
