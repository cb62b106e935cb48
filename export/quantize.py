"""Weight quantization of a stage graph with ONNX Runtime's own quantizers.

int4: MatMulNBits (4 bits, block 32, symmetric, accuracy level 4 = int8 activations on CPU)
      and GatherBlockQuantized for the embedding table.
int8: MatMulNBits with 8 bits (block 32, accuracy level 4) and a 4-bit block-quantized
      embedding table (ONNX Runtime's Gather quantizer supports only 4 bits; a float32 table
      would be the largest tensor of a small model). Not quantize_dynamic: its per-tensor
      activation scale is ruined by the outlier channels these models have (SmolLM2 logits
      went to noise), while MatMulNBits quantizes activations per block of 32.
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

import onnx

from edge_spec import names

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4


def save(model: onnx.ModelProto, path: Path) -> None:
    """One graph file plus one external-data file named after it. Tensors under 1 KiB (shape
    arguments such as a Split's sizes) stay inline: ONNX Runtime's shape inference reads them
    from the graph file and cannot follow them into the data file."""
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data", size_threshold=1024)


def _block_quantize(model: onnx.ModelProto | str, bits: int, op_types: tuple[str, ...]) -> onnx.ModelProto:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(
        model,
        bits=bits,
        block_size=BLOCK_SIZE,
        is_symmetric=True,
        accuracy_level=ACCURACY_LEVEL,
        op_types_to_quantize=op_types,
        quant_axes=(("MatMul", 0), ("Gather", 1)),
    )
    quantizer.process()
    return quantizer.model.model


def to_float16(model: onnx.ModelProto) -> onnx.ModelProto:
    """Every float tensor float16, the logits output excepted (float32 for the sampler)."""
    from onnxruntime.transformers.float16 import convert_float_to_float16

    keep = [o.name for o in model.graph.output if o.name == names.LOGITS]
    return convert_float_to_float16(model, keep_io_types=keep, disable_shape_infer=True)


def quantize_file(src: Path, dst: Path, quant: str, activations: str = "float32", quantized_embedding: bool = True) -> None:
    """Quantize the float32 graph at src (+ src.data, written by save) into dst (+ dst.data),
    in the same folder: fp32 is a move. activations float16: then convert to float16.
    quantized_embedding False: int4/int8 quantize the MatMuls only (a provider without
    GatherBlockQuantized)."""
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    if activations == "float16":
        if quant == "fp16":
            model = onnx.load(str(src), load_external_data=True)
        elif quant in ("int4", "int8"):
            model = _quantized(str(src), quant, quantized_embedding)
        else:
            raise ValueError(f"float16 activations need fp16, int8 or int4 weights, not {quant!r}")
        save(to_float16(model), dst)
        return
    if quant == "fp32":
        # save() named the data file after the graph file, so a move keeps the reference valid.
        src.rename(dst)
        Path(str(src) + ".data").rename(str(dst) + ".data")
    elif quant == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = onnx.load(str(src), load_external_data=True)
        # GroupQueryAttention stays float32: its past/present must be the float32 graph inputs
        # themselves (in place), not float16 casts of them. Its outputs' recorded types go: the
        # converter would retype them float16 and the blocked node's casts would then mismatch.
        blocked = {o for n in model.graph.node if n.op_type == "GroupQueryAttention" for o in n.output}
        kept = [v for v in model.graph.value_info if v.name not in blocked]
        del model.graph.value_info[:]
        model.graph.value_info.extend(kept)
        model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True, op_block_list=["GroupQueryAttention"])
        save(model, dst)
    elif quant in ("int4", "int8"):
        save(_quantized(str(src), quant), dst)
    else:
        raise ValueError(f"unknown quantization {quant!r} (int4, int8, fp16, fp32)")


def _quantized(src: str, quant: str, embedding: bool = True) -> onnx.ModelProto:
    bits = 4 if quant == "int4" else 8
    model = _block_quantize(src, bits, ("MatMul",) if bits == 8 or not embedding else ("MatMul", "Gather"))
    return _block_quantize(model, 4, ("Gather",)) if bits == 8 and embedding else model
