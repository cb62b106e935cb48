"""A GGUF's blocks kept as they are (export --gguf-blocks): decoding against gguf-py's own
dequantizers, the graphs against ONNX Runtime, the name and row mapping, the refusals."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from export.gguf_blocks import FORMS, concat, decode, to_int8
from export.quantize import blocks_gather, blocks_matmul, same_weights

ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent


def _random_blocks(type_name: str, rows: int, k: int, seed: int = 0) -> np.ndarray:
    """A tensor's bytes [rows, bytes per row] of `type_name`: gguf-py's quantizer where it has one,
    else random bytes with small finite float16 d and dmin (every other bit pattern is valid)."""
    qtype = gguf.GGMLQuantizationType[type_name]
    rng = np.random.default_rng(seed)
    try:
        return gguf.quantize(rng.standard_normal((rows, k), dtype=np.float32), qtype)
    except NotImplementedError:
        pass
    block_weights, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, k // block_weights, type_size), dtype=np.uint8)
    halves = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}[type_name]
    for offset in halves:
        raw[..., offset : offset + 2] = rng.uniform(1e-3, 2e-2, raw.shape[:2]).astype(np.float16)[..., None].view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(FORMS))
def test_decode_is_bit_exact_against_gguf_dequantize(type_name):
    data = _random_blocks(type_name, 6, 512)
    blocks = decode(type_name, data, 512)
    reference = gguf.dequantize(data, gguf.GGMLQuantizationType[type_name])
    assert blocks.q.max() < 2**blocks.bits
    assert np.array_equal(blocks.dequantized(), reference)


def test_float_types_have_no_block_form():
    assert decode("F16", np.zeros((2, 64), np.uint8), 32) is None


def _run(nodes, initializers, x, out_name, k):
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, None, k])],
                              [helper.make_tensor_value_info(out_name, TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_matmul_of_mixed_forms_computes_the_dequantized_product():
    """q and k Q4_K (a minimum term) and v Q6_K (8-bit blocks of 16) in one merged projection."""
    k = 512
    parts = [decode("Q4_K", _random_blocks("Q4_K", 48, k, 1), k), decode("Q4_K", _random_blocks("Q4_K", 16, k, 2), k),
             decode("Q6_K", _random_blocks("Q6_K", 16, k, 3), k)]
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    nodes, tensors = blocks_matmul(node, parts, set())
    assert [n.op_type for n in nodes].count("MatMulNBits") == 2 and nodes[-1].op_type == "Concat"
    x = np.random.default_rng(4).standard_normal((1, 3, k), dtype=np.float32)
    y = _run(nodes, tensors, x, "y", k)
    w = np.concatenate([p.dequantized() for p in parts])  # [N, K]
    expected = x @ w.T
    def error(z):
        return float(np.linalg.norm(z - expected) / np.linalg.norm(expected))

    # int8 activations (accuracy level 4) are the only rounding
    assert error(y) < 0.005, error(y)
    # the minimum term carries Q4_K's offsets: without it the product is many times further off
    without = x @ np.concatenate([p.dequantized() - (0 if p.minimum is None else np.repeat(p.minimum, 32, axis=1)) for p in parts]).T
    assert error(without) > 5 * error(y), (error(without), error(y))


def test_gather_with_a_minimum_is_exact():
    k = 256
    blocks = decode("Q4_K", _random_blocks("Q4_K", 40, k, 5), k)
    node = helper.make_node("Gather", ["table", "ids"], ["e"], name="g", axis=0)
    nodes, tensors = blocks_gather(node, blocks, set())
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1, None])],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)], tensors)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    ids = np.array([[0, 39, 7, 7]])
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    np.testing.assert_allclose(got[0], blocks.dequantized()[ids[0]], rtol=1e-6, atol=1e-7)


def test_same_weights_refuses_moved_rows_and_other_shapes():
    k = 256
    blocks = decode("Q6_K", _random_blocks("Q6_K", 8, k, 6), k)
    weight = np.ascontiguousarray(blocks.dequantized().T)  # a MatMul's [K, N]
    assert same_weights([blocks], weight, gather=False)
    assert not same_weights([blocks], weight[:, ::-1], gather=False)
    assert not same_weights([blocks.rows(np.arange(7))], weight, gather=False)
    assert same_weights([blocks.rows(np.arange(3)), blocks.rows(np.arange(3, 8))], weight, gather=False)
    assert same_weights([blocks], blocks.dequantized(), gather=True)


def test_to_int8_rounds_a_six_bit_type_finely():
    """Q6_K re-rounded to int8 blocks of 64: within a small fraction of its own rounding step,
    and runs through the same MatMulNBits path as the kept blocks."""
    k = 512
    blocks = decode("Q6_K", _random_blocks("Q6_K", 32, k, 7), k)
    recoded = to_int8(blocks)
    assert (recoded.bits, recoded.block, recoded.zero, recoded.type) == (8, 64, 128, "Q6_K as int8/64")
    w = blocks.dequantized()
    step = np.repeat(np.abs(blocks.scale), 16, axis=1)  # Q6_K's own step per weight
    assert np.sqrt(np.mean(np.square(recoded.dequantized() - w))) < 0.3 * np.sqrt(np.mean(np.square(step)))
    node = helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")
    nodes, tensors = blocks_matmul(node, [recoded], set())
    x = np.random.default_rng(8).standard_normal((1, 2, k), dtype=np.float32)
    y = _run(nodes, tensors, x, "y", k)
    expected = x @ recoded.dequantized().T
    assert np.linalg.norm(y - expected) / np.linalg.norm(expected) < 0.01  # int8 activations per block of 64


def test_concat_refuses_different_forms():
    k = 256
    with pytest.raises(ValueError):
        concat([decode("Q4_K", _random_blocks("Q4_K", 2, k), k), decode("Q6_K", _random_blocks("Q6_K", 2, k), k)])


def test_checkpoint_names_follow_the_parts_first_layers():
    from export.bundle import _checkpoint_name

    origins = {"part0": 0, "part1": 0, "part2": 6}
    assert _checkpoint_name("part2/stage.layers.1.mlp.down_proj.weight_t", origins) == "model.layers.7.mlp.down_proj.weight"
    assert _checkpoint_name("part1/stage.layers.0.self_attn.q_proj.weight_t", origins) == "model.layers.0.self_attn.q_proj.weight"
    assert _checkpoint_name("part0/stage.embed_tokens.weight", origins) == "model.embed_tokens.weight"
    assert _checkpoint_name("part3/stage.lm_head_parts.0", origins) == "lm_head.weight"
    assert _checkpoint_name("part9/stage.layers.0.mlp.up_proj.weight_t", origins) is None  # a part it was not told about
    assert _checkpoint_name("part1/stage.layers.0.input_layernorm.weight", origins) is None


def test_gguf_blocks_refuses_what_it_cannot_keep():
    from export.bundle import ExportConfig, ExportError

    for kwargs in ({"quant": "fp16"}, {"device": "cuda"}, {"zero_points": True}):
        with pytest.raises(ExportError, match="--gguf-blocks"):
            ExportConfig("m.gguf", ROOT / "x", gguf_blocks=True, **kwargs)
    for kwargs in ({"gguf_blocks": False}, {"zero_points": True}, {"device": "cuda"}):
        with pytest.raises(ExportError, match="keeps none"):
            ExportConfig("m.gguf", ROOT / "x", gguf_to_int8=("Q6_K",), **kwargs)
    assert ExportConfig("m.gguf", ROOT / "x", gguf_to_int8=("Q5_0",)).gguf_to_int8 == ("Q5_0",)
    # By default Q6_K is rounded to int8 wherever blocks are kept, and nothing where none are.
    assert ExportConfig("m.gguf", ROOT / "x").gguf_to_int8 == ("Q6_K",)
    assert ExportConfig("m.gguf", ROOT / "x", gguf_to_int8=()).gguf_to_int8 == ()
    for kwargs in ({"gguf_blocks": False}, {"quant": "int8"}, {"device": "cuda"}):
        assert ExportConfig("m.gguf", ROOT / "x", **kwargs).gguf_to_int8 == (), kwargs
    with pytest.raises(ExportError, match="Q7_K"):
        ExportConfig("m.gguf", ROOT / "x", gguf_blocks=True, gguf_to_int8=("Q6_K", "Q7_K"))
    run = subprocess.run([sys.executable, "-m", "export", "smollm2-135m", "--gguf-blocks", "--quant", "fp32", "--out", str(ROOT / "never")],
                         capture_output=True, text=True, cwd=ROOT)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "--gguf-blocks" in run.stderr


def test_the_default_keeps_gguf_blocks_only_where_it_can():
    from export.bundle import ExportConfig

    default = ExportConfig("m.gguf", ROOT / "x")
    assert default.keeps_gguf_blocks(from_gguf=True) and not default.keeps_gguf_blocks(from_gguf=False)
    for kwargs in ({"quant": "int8"}, {"quant": "fp32"}, {"block_size": 64}, {"zero_points": True}, {"device": "cuda"}, {"gguf_blocks": False}):
        assert not ExportConfig("m.gguf", ROOT / "x", **kwargs).keeps_gguf_blocks(from_gguf=True), kwargs
    assert ExportConfig("m.gguf", ROOT / "x", quant="int8", gguf_blocks=True).keeps_gguf_blocks(from_gguf=True)


def test_manifest_checks_gguf_blocks(quant_bundles, tmp_path):
    import json
    import shutil

    from edge_spec.manifest import BundleError, load_manifest

    copy = tmp_path / "b"
    shutil.copytree(quant_bundles["int4"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    for value, ok in (({"Q4_K": 10, "requantized": 0}, True), ({}, False), ({"Q4_K": -1}, False), ({"Q4_K": True}, False), ([1], False), ({"Q4_K": 1.5}, False)):
        manifest["models"]["target"]["gguf_blocks"] = value
        (copy / "manifest.json").write_text(json.dumps(manifest))
        if ok:
            assert load_manifest(copy, check_hashes=False).target.gguf_blocks == value
        else:
            with pytest.raises(BundleError, match="gguf_blocks"):
                load_manifest(copy, check_hashes=False)
