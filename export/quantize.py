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

Graphs go from file to file: a 1.5B-parameter stage is gigabytes in float32, and holding the
float32 and the quantized copy in memory at once is what a 24 GB machine cannot afford.
"""

from __future__ import annotations

import logging
from pathlib import Path

import onnx

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


def quantize_file(src: Path, dst: Path, quant: str) -> None:
    """Quantize the float32 graph at src (+ src.data, written by save) into dst (+ dst.data),
    in the same folder: fp32 is a move."""
    logging.getLogger("onnxruntime.quantization").setLevel(logging.ERROR)
    if quant == "fp32":
        # save() named the data file after the graph file, so a move keeps the reference valid.
        src.rename(dst)
        Path(str(src) + ".data").rename(str(dst) + ".data")
    elif quant == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        model = onnx.load(str(src), load_external_data=True)
        # GroupQueryAttention stays float32: its past/present must be the float32 graph inputs
        # themselves (in place), not float16 casts of them.
        model = convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True, op_block_list=["GroupQueryAttention"])
        save(model, dst)
    elif quant == "int4":
        save(_block_quantize(str(src), 4, ("MatMul", "Gather")), dst)
    elif quant == "int8":
        save(_block_quantize(_block_quantize(str(src), 8, ("MatMul",)), 4, ("Gather",)), dst)
    else:
        raise ValueError(f"unknown quantization {quant!r} (int4, int8, fp16, fp32)")
