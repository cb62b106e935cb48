"""Weight quantization of a stage graph with ONNX Runtime's own quantizers.

int4: MatMulNBits (4 bits, block 32, symmetric, accuracy level 4 = int8 activations on CPU)
      and GatherBlockQuantized for the embedding table.
int8: dynamic int8 MatMul (cheapest multi-token verify blocks on CPU) and a 4-bit block-
      quantized embedding table (ONNX Runtime's GatherBlockQuantized quantizer supports only
      4 bits; a float32 table would be the largest tensor of a small model).
fp16: float16 weights, float32 graph inputs and outputs.
fp32: unchanged.
"""

from __future__ import annotations

import logging

import onnx

BLOCK_SIZE = 32
ACCURACY_LEVEL = 4


def _block_quantize(model: onnx.ModelProto, bits: int, op_types: tuple[str, ...]) -> onnx.ModelProto:
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


def _dynamic_int8(model: onnx.ModelProto) -> onnx.ModelProto:
    import tempfile
    from pathlib import Path

    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.onnx", Path(tmp) / "out.onnx"
        onnx.save_model(model, src, save_as_external_data=True, location="in.onnx.data")
        quantize_dynamic(
            src,
            dst,
            weight_type=QuantType.QInt8,
            op_types_to_quantize=["MatMul"],
            per_channel=True,
            use_external_data_format=True,
        )
        return onnx.load(str(dst), load_external_data=True)


def quantize(model: onnx.ModelProto, quant: str) -> onnx.ModelProto:
    logging.getLogger("onnxruntime.quantization").setLevel(logging.WARNING)
    if quant == "fp32":
        return model
    if quant == "fp16":
        from onnxruntime.transformers.float16 import convert_float_to_float16

        return convert_float_to_float16(model, keep_io_types=True, disable_shape_infer=True)
    if quant == "int4":
        return _block_quantize(model, 4, ("MatMul", "Gather"))
    if quant == "int8":
        model = _dynamic_int8(model)
        return _block_quantize(model, 4, ("Gather",))
    raise ValueError(f"unknown quantization {quant!r} (int4, int8, fp16, fp32)")
