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
from export.gguf_blocks import MINIMUM_BLOCK, concat, to_int8

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


def _blocks_tensors(base: str, blocks, made: set[str], gather: bool = False) -> tuple[list[str], list[onnx.TensorProto]]:
    """The q, scale and (unless the kernel's default) zero-point initializers of `blocks`: q as
    MatMulNBits reads it, [N, K/block, block bytes], or (gather) as GatherBlockQuantized does,
    [N, K bytes], the same bytes."""
    n, k = blocks.shape
    nb = k // blocks.block
    q = blocks.q.reshape(n, nb, blocks.block)
    data = _pack4(q) if blocks.bits == 4 else q
    data = data.reshape(n, -1) if gather else data
    tensors = [numpy_helper.from_array(data, f"{base}_Q{blocks.bits}"), numpy_helper.from_array(blocks.scale, f"{base}_scales")]
    if blocks.zero != 2 ** (blocks.bits - 1):
        zero = np.full((n, nb), blocks.zero, np.uint8)
        tensors.append(numpy_helper.from_array(_pack4(zero) if blocks.bits == 4 else zero, f"{base}_zero_points"))
    made.update(t.name for t in tensors)
    return [t.name for t in tensors], tensors


def _constant(name: str, value: np.ndarray, made: set[str]) -> list[onnx.TensorProto]:
    """A small shared constant, written once however many nodes read it."""
    if name in made:
        return []
    made.add(name)
    return [numpy_helper.from_array(value, name)]


def blocks_matmul(node: onnx.NodeProto, parts: list, made: set[str]) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """MatMul(A, W [K, N]) from the GGUF's own blocks (export.gguf_blocks): one MatMulNBits per
    run of sources of one form (a merged projection whose v is Q6_K and q, k Q4_K is two),
    concatenated along N; a form with a minimum per 32 adds A's sums over each 32 times the
    [K/32, N] minimum matrix (float32, as the GGUF's d * m is exact there). The sums are taken
    as means (ReduceMean, which every provider's kernel table has) against the matrix times 32,
    a power of two, so still exact."""
    runs: list[list] = []
    for part in parts:
        if runs and runs[-1][0].same_form(part):
            runs[-1].append(part)
        else:
            runs.append([part])
    x, out = node.input[0], node.output[0]
    nodes, tensors = [], []
    outputs = []
    for index, run in enumerate(runs):
        blocks = concat(run)
        n, k = blocks.shape
        base = f"{node.input[1]}.gguf{index}" if len(runs) > 1 else node.input[1]
        y = out if len(runs) == 1 else f"{out}.gguf{index}"
        main = y if blocks.minimum is None else f"{y}.blocks"
        names_, made_tensors = _blocks_tensors(base, blocks, made)
        tensors += made_tensors
        nodes.append(helper.make_node("MatMulNBits", [x] + names_, [main], name=f"{base}_gguf", domain="com.microsoft",
                                      K=k, N=n, bits=blocks.bits, block_size=blocks.block, accuracy_level=ACCURACY_LEVEL))
        if blocks.minimum is not None:
            shape, axes = f"gguf_sums_shape_{k}", "gguf_sums_axes"
            tensors += _constant(shape, np.array([0, 0, k // MINIMUM_BLOCK, MINIMUM_BLOCK], np.int64), made)
            tensors += _constant(axes, np.array([-1], np.int64), made)
            minimum = numpy_helper.from_array(np.ascontiguousarray(blocks.minimum.T * np.float32(MINIMUM_BLOCK)), f"{base}_minimum")
            tensors.append(minimum)
            nodes += [
                helper.make_node("Reshape", [x, shape], [f"{y}.grouped"], name=f"{base}_group"),
                helper.make_node("ReduceMean", [f"{y}.grouped", axes], [f"{y}.sums"], name=f"{base}_sums", keepdims=0),
                helper.make_node("MatMul", [f"{y}.sums", minimum.name], [f"{y}.minimum"], name=f"{base}_minimum"),
                helper.make_node("Add", [main, f"{y}.minimum"], [y], name=f"{base}_add_minimum"),
            ]
        outputs.append(y)
    if len(runs) > 1:
        nodes.append(helper.make_node("Concat", outputs, [out], name=f"{node.name}_gguf_concat", axis=-1))
    return nodes, tensors


def blocks_gather(node: onnx.NodeProto, blocks, made: set[str]) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """Gather(table [V, H], ids) from the GGUF's own blocks: GatherBlockQuantized on q (uint8,
    `bits` saying whether packed), and for a form with a minimum the ids' rows of the [V, H/32]
    minimum matrix added per 32."""
    v, h = blocks.shape
    base, out = node.input[0], node.output[0]
    main = out if blocks.minimum is None else f"{out}.blocks"
    names_, tensors = _blocks_tensors(base, blocks, made, gather=True)
    nodes = [helper.make_node("GatherBlockQuantized", [names_[0], node.input[1]] + names_[1:], [main], name=f"{node.name}_gguf", domain="com.microsoft",
                              gather_axis=0, quantize_axis=1, block_size=blocks.block, bits=blocks.bits)]
    if blocks.minimum is not None:
        grouped, flat = f"gguf_gather_grouped_{h}", f"gguf_gather_flat_{h}"
        tensors += _constant(grouped, np.array([0, 0, h // MINIMUM_BLOCK, MINIMUM_BLOCK], np.int64), made)
        tensors += _constant(flat, np.array([0, 0, h], np.int64), made)
        tensors += _constant("gguf_last_axis", np.array([-1], np.int64), made)
        minimum = numpy_helper.from_array(blocks.minimum, f"{base}_minimum")
        tensors.append(minimum)
        nodes += [
            helper.make_node("Gather", [minimum.name, node.input[1]], [f"{out}.minimum"], name=f"{base}_gather_minimum", axis=0),
            helper.make_node("Unsqueeze", [f"{out}.minimum", "gguf_last_axis"], [f"{out}.minimum_col"], name=f"{base}_minimum_col"),
            helper.make_node("Reshape", [main, grouped], [f"{out}.grouped"], name=f"{base}_group"),
            helper.make_node("Add", [f"{out}.grouped", f"{out}.minimum_col"], [f"{out}.with_minimum"], name=f"{base}_add_minimum"),
            helper.make_node("Reshape", [f"{out}.with_minimum", flat], [out], name=f"{base}_ungroup"),
        ]
    return nodes, tensors


CHECK_ROWS = 16384  # rows compared at a time: the head's float32 copies stay under 200 MB each


def same_weights(parts: list, weight: np.ndarray, gather: bool) -> bool:
    """Whether the blocks dequantize, bit for bit, to the float32 weight the traced graph holds
    ([K, N] for a MatMul, [V, H] for a Gather): the one proof that names, row order and decoding
    all line up."""
    rows = weight if gather else weight.T
    start = 0
    for blocks in parts:
        n = blocks.shape[0]
        if blocks.shape[1] != rows.shape[1] or start + n > rows.shape[0]:
            return False
        for r in range(0, n, CHECK_ROWS):
            stop = min(n, r + CHECK_ROWS)
            if not np.array_equal(blocks.dequantized(r, stop), rows[start + r : start + stop]):
                return False
        start += n
    return start == rows.shape[0]


def write_stage(model: onnx.ModelProto, weights, dst: Path, matmul_bits: int | None, gather_bits: int | None,
                block_size: int = DEFAULT_QUANT_BLOCK, asymmetric: bool = False, gguf=None, gguf_to_int8: tuple[str, ...] = ()) -> dict[str, int]:
    """Write the stage graph `model` (its weights read from `weights`, an
    export.onnx_graphs.StageWeights) to dst + dst.data, one initializer at a time: each MatMul by
    a constant 2-D weight becomes MatMulNBits at `matmul_bits`, each Gather from a constant
    table GatherBlockQuantized at `gather_bits` (None: left as is), through ONNX Runtime's own
    per-node quantizer (what MatMulNBitsQuantizer runs over a whole graph in memory); with
    `asymmetric`, the MatMuls through asymmetric_matmul instead. `gguf`: initializer -> the
    export.gguf_blocks.Blocks it was read from (one per merged source) or None; a weight whose
    blocks dequantize to it exactly is written as those blocks (those of a type in
    `gguf_to_int8` rounded to int8 first: gguf_blocks.to_int8), any other quantized as above.
    Returns the weights written per GGUF type, and "requantized" for the rest."""
    graph = model.graph
    kept_as: dict[str, int] = {}
    written: set[str] = set()  # names of the kept blocks' initializers and their shared constants
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
            parts = gguf(weight) if gguf is not None else None
            if parts and same_weights(parts, weights.array(weight), node.op_type == "Gather"):
                parts = [to_int8(p) if p.type in gguf_to_int8 else p for p in parts]
                built, tensors = (blocks_gather(node, parts[0], written) if node.op_type == "Gather" and len(parts) == 1 else
                                  blocks_matmul(node, parts, written))
                nodes.extend(built)
                made.extend(writer.add(t) for t in tensors)
                for p in parts:
                    kept_as[p.type] = kept_as.get(p.type, 0) + p.q.size
                continue
            kept_as["requantized"] = kept_as.get("requantized", 0) + int(np.prod(weight.dims))
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
    return kept_as


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
                   block_size: int = DEFAULT_QUANT_BLOCK, asymmetric: bool = False, gguf=None, gguf_to_int8: tuple[str, ...] = ()) -> dict[str, int]:
    """Write the merged stage graph (export.onnx_graphs.finish_stage) into dst (+ dst.data) at
    `quant`. int4/int8 and fp32 stream weight by weight. fp16 weights and float16 activations
    convert a whole graph in memory: the fp32 one for fp16 weights, the already quantized (small)
    one for int4/int8 with float16 activations. quantized_embedding False: int4/int8 quantize the
    MatMuls only (a provider without GatherBlockQuantized). block_size: weights per int4/int8 scale.
    asymmetric: MatMul weights with fitted scales and uint8 zero points (write_stage). gguf: the
    GGUF's own blocks where they dequantize to a weight exactly (write_stage; float32 scales, so
    float32 activations only). Returns write_stage's count of weights per GGUF type."""
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    if quant not in ("int4", "int8", "fp16", "fp32"):
        raise ValueError(f"unknown quantization {quant!r} (int4, int8, fp16, fp32)")
    if activations == "float16" and quant == "fp32":
        raise ValueError(f"float16 activations need fp16, int8 or int4 weights, not {quant!r}")
    bits = {"int4": 4, "int8": 8}.get(quant)
    # The embedding table is 4-bit at int8 too: ONNX Runtime's Gather quantizer has only 4 bits.
    gather_bits = 4 if bits and quantized_embedding else None
    if gguf is not None and (activations == "float16" or quant not in ("int4", "int8")):
        raise ValueError("the GGUF's own blocks need int4 or int8 weights and float32 activations")
    if activations != "float16" and quant != "fp16":
        return write_stage(model, weights, dst, bits, gather_bits, block_size, asymmetric, gguf, gguf_to_int8)
    scratch = dst.with_name(dst.stem + ".unconverted.onnx")
    kept_as = write_stage(model, weights, scratch, bits, gather_bits, block_size, asymmetric)
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
        cast_before_concat(converted)
    save(converted, dst)
    return kept_as


def cast_before_concat(model: onnx.ModelProto) -> None:
    """A graph output cast back to float32 from a Concat (the coreml profile's LM head, in slices
    no wider than the Core ML EP's limit) is cast slice by slice and concatenated in float32: the
    same values, and no node input as wide as the vocabulary (a single Cast of the whole row
    would fall to the CPU EP)."""
    outputs = {o.name for o in model.graph.output}
    producers = {out: node for node in model.graph.node for out in node.output}
    for cast in [n for n in model.graph.node if n.op_type == "Cast" and n.output[0] in outputs]:
        concat = producers.get(cast.input[0])
        if concat is None or concat.op_type != "Concat" or sum(1 for n in model.graph.node if cast.input[0] in n.input) != 1:
            continue
        to = next(a for a in cast.attribute if a.name == "to")
        casts = [onnx.helper.make_node("Cast", [x], [f"{x}_as_output_type"], name=f"{cast.name}_{i}", to=to.i) for i, x in enumerate(concat.input)]
        index = list(model.graph.node).index(concat)
        for offset, node in enumerate(casts):
            model.graph.node.insert(index + offset, node)
        del concat.input[:]
        concat.input.extend(c.output[0] for c in casts)
        concat.output[0] = cast.output[0]
        model.graph.node.remove(cast)
