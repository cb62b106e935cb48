"""Asymmetric (zero-point) MatMulNBits weights, the per-op account of a pass, and the fidelity
measure: the pieces the bytes-per-token work is decided with (benchmarks/notes/2026-12-04-bytes-per-token.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import tiny
from export.quantize import asymmetric_matmul, fit_blocks


def _matmul_graph(weight: np.ndarray, bits: int, block: int, accuracy_level: int):
    from onnx import TensorProto, helper

    node = helper.make_node("MatMul", ["A", "W"], ["Y"], name="mm")
    quantized, tensors = asymmetric_matmul(node, weight, bits, block)
    for attribute in quantized.attribute:
        if attribute.name == "accuracy_level":
            attribute.i = accuracy_level
    k, n = weight.shape
    graph = helper.make_graph([quantized], "g", [helper.make_tensor_value_info("A", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [None, n])], tensors)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


@pytest.mark.parametrize("bits,k,n,block", [(4, 96, 40, 32), (4, 200, 17, 64), (8, 256, 33, 128)])
def test_zero_point_nodes_compute_what_fit_blocks_fitted(bits, k, n, block):
    """ONNX Runtime's MatMulNBits (float activations, accuracy level 0) reproduces
    (q - zero point) * scale exactly as fit_blocks fitted it, K padded to whole blocks."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((k, n)).astype(np.float32)
    session = ort.InferenceSession(_matmul_graph(weight, bits, block, 0).SerializeToString(), providers=["CPUExecutionProvider"])
    padded = np.zeros((n, -(-k // block) * block), np.float32)
    padded[:, :k] = weight.T
    q, scales, zeros = fit_blocks(padded, bits, block)
    dequantized = ((q.astype(np.float32) - zeros[..., None]) * scales[..., None]).reshape(n, -1)[:, :k]
    a = rng.standard_normal((3, k)).astype(np.float32)
    np.testing.assert_allclose(session.run(None, {"A": a})[0], a @ dequantized.T, rtol=1e-4, atol=1e-4)
    assert 0 < np.linalg.norm(dequantized - weight.T) / np.linalg.norm(weight) < (0.1 if bits == 4 else 0.01)


def test_fitted_blocks_beat_the_min_max_quantizer():
    """The least-squares fit lowers the weight error below ONNX Runtime's asymmetric min/max
    quantizer at the same block, and a larger fitted block is no worse than ORT's symmetric one
    at half its size would suggest it must be (the reason it is offered)."""
    import onnxruntime.capi._pybind_state as C

    rng = np.random.default_rng(1)
    w = (rng.standard_normal((64, 512)) * rng.uniform(0.5, 2.0, (64, 1))).astype(np.float32)  # [N, K]

    def ort_dequantized(block: int, symmetric: bool) -> np.ndarray:
        n, k = w.shape
        blocks = k // block
        packed = np.zeros((n, blocks, block // 2), np.uint8)
        scales = np.zeros(n * blocks, np.float32)
        zeros = np.zeros(n * ((blocks + 1) // 2), np.uint8)
        C.quantize_matmul_4bits(packed, np.ascontiguousarray(w.T), scales, zeros, block, n, k, symmetric)
        q = np.stack([packed & 15, packed >> 4], -1).reshape(n, blocks, block).astype(np.float32)
        zp = np.full((n, blocks), 8.0) if symmetric else np.stack([zeros.reshape(n, -1) & 15, zeros.reshape(n, -1) >> 4], -1).reshape(n, -1)[:, :blocks]
        return ((q - zp[..., None]) * scales.reshape(n, blocks)[..., None]).reshape(n, k)

    def fitted(block: int) -> np.ndarray:
        q, s, z = fit_blocks(w, 4, block)
        return ((q.astype(np.float32) - z[..., None]) * s[..., None]).reshape(w.shape)

    def error(x):
        return np.linalg.norm(x - w) / np.linalg.norm(w)

    for block in (32, 64, 128):
        assert error(fitted(block)) < 0.97 * error(ort_dequantized(block, symmetric=False)), block
    assert error(fitted(64)) < error(ort_dequantized(32, symmetric=True)) * 1.05


@pytest.fixture(scope="module")
def zero_point_bundle(tiny_models, tmp_path_factory) -> Path:
    from export.bundle import ExportConfig, export_bundle

    out = tmp_path_factory.mktemp("zp") / "llama-int4-zp"
    export_bundle(ExportConfig(model=str(tiny_models.llama_quant), out=out, quant="int4", max_context=tiny.MAX_CONTEXT, drafts=(str(tiny_models.draft), "layer-skip:2"),
                               block_size=64, zero_points=True), log=lambda message: None)
    return out


def test_zero_point_bundle_records_and_carries_its_zero_points(zero_point_bundle, quant_bundles):
    import onnx

    from runtime.engine import Engine, EngineConfig

    manifest = json.loads((zero_point_bundle / "manifest.json").read_text())
    assert {role: m["zero_points"] for role, m in manifest["models"].items()} == {"target": True, "draft": True, "layer_skip": True}
    assert {m["block_size"] for m in manifest["models"].values()} == {64}
    matmuls = [n for f in zero_point_bundle.glob("*.onnx") for n in onnx.load(str(f), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    assert matmuls and all(len(n.input) == 4 and n.input[3].endswith("_zero_points") for n in matmuls)
    ids = list(range(3, 40))
    ref = Engine(str(quant_bundles["fp32"]), EngineConfig(drafter="none", calibrate=False)).target.forward(ids)
    got = Engine(str(zero_point_bundle), EngineConfig(drafter="none", calibrate=False)).target.forward(ids)
    assert float((got.argmax(-1) == ref.argmax(-1)).mean()) >= 0.6
    assert np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(got, ref)]) >= 0.97


def test_zero_point_bundle_speculates_exactly(zero_point_bundle):
    """Greedy speculation with the zero-point draft equals greedy plain decoding in block-stable mode."""
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    prompt = list(range(5, 25))
    plain = Engine(str(zero_point_bundle), EngineConfig(drafter="none", calibrate=False, block_stable=True)).generate(prompt, GenerateConfig(max_new_tokens=24))
    spec = Engine(str(zero_point_bundle), EngineConfig(drafter="model", calibrate=False, block_stable=True)).generate(prompt, GenerateConfig(max_new_tokens=24))
    assert spec.token_ids == plain.token_ids


def test_zero_points_refused_where_there_are_no_int_blocks(tiny_models, tmp_path):
    from export.bundle import ExportConfig, ExportError

    with pytest.raises(ExportError, match="--zero-points"):
        ExportConfig(model=str(tiny_models.llama), out=tmp_path / "b", quant="fp16", zero_points=True)


def test_manifest_refuses_a_zero_points_field_that_is_not_a_boolean(zero_point_bundle, tmp_path):
    import shutil

    from edge_spec.manifest import BundleError, load_manifest

    copy = tmp_path / "b"
    shutil.copytree(zero_point_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["models"]["target"]["zero_points"] = 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="zero_points 1 is not true or false"):
        load_manifest(copy, check_hashes=False)


def test_op_profile_accounts_every_matmul_with_its_bytes(zero_point_bundle):
    """Every MatMulNBits of the target, over all of its stage graphs (this one is split for its
    layer-skip draft), shows up once a pass in a labelled group with the bytes the kernel layout
    implies, the groups add up to no more than the sessions' runs, and the draft is profiled."""
    import onnx

    from benchmarks.op_profile import matmulnbits_bytes, profile, table

    result = profile(str(zero_point_bundle), [1, 3], kv_len=16, repeats=2, threads=1)
    assert set(result["passes"]) == {"T=1", "T=3", "draft"}
    manifest = json.loads((zero_point_bundle / "manifest.json").read_text())
    files = [manifest["stages"][key]["file"] for key in manifest["models"]["target"]["stages"]]
    assert len(files) == 3
    attrs = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for f in files
             for n in onnx.load(str(zero_point_bundle / f), load_external_data=False).graph.node if n.op_type == "MatMulNBits"]
    expected = sum(matmulnbits_bytes(a) for a in attrs)
    for name in ("T=1", "T=3"):
        row = result["passes"][name]
        groups = {k: g for k, g in row["groups"].items() if k.startswith("MatMulNBits ")}
        assert sum(g["calls"] for g in groups.values()) == len(attrs)
        assert sum(g["bytes"] for g in groups.values()) == expected
        assert {k.split()[1] for k in groups} >= {"qkv", "o", "gate_up", "down"}
        assert sum(g["ms"] for g in row["groups"].values()) <= row["run_ms"] * 1.01
    assert any(line.startswith("| MatMulNBits gate_up") for line in table(result))


def test_matmulnbits_bytes_follow_the_kernel_layout():
    """4 bits per weight plus a float32 scale and a float32 block sum per block."""
    from benchmarks.op_profile import matmulnbits_bytes

    assert matmulnbits_bytes({"K": 1536, "N": 2048, "bits": 4, "block_size": 32}) == 2048 * 48 * (16 + 8)
    assert matmulnbits_bytes({"K": 8960, "N": 1536, "bits": 4, "block_size": 128}) == 1536 * 70 * (64 + 8)
    assert matmulnbits_bytes({"K": 100, "N": 2, "bits": 8, "block_size": 64}) == 2 * 2 * (64 + 8)


def test_fidelity_measures_kl_and_top1():
    from benchmarks.fidelity import compare_logits, summarize

    rng = np.random.default_rng(0)
    reference = rng.standard_normal((20, 50)) * 3
    targets = rng.integers(0, 50, 20)
    same = summarize([compare_logits(reference, reference.copy(), targets)])
    assert same["kl_mean"] == pytest.approx(0, abs=1e-12) and same["same_top1"] == 1.0 and same["ppl_ratio"] == pytest.approx(1.0)
    noisy = summarize([compare_logits(reference, reference + rng.standard_normal((20, 50)), targets)])
    assert noisy["kl_mean"] > 0.05 and noisy["same_top1"] < 1.0
    # KL(p || q) by hand for one row
    p = np.exp(reference[0] - reference[0].max()); p /= p.sum()
    q = np.exp(reference[0] + 1 - (reference[0] + 1).max()); q /= q.sum()
    assert compare_logits(reference[:1], reference[:1] + 1, targets[:1])["kl"][0] == pytest.approx(float((p * np.log(p / q)).sum()), abs=1e-9)


@pytest.mark.real_weights
def test_gguf_types_says_which_official_types_map_exactly():
    """The official Qwen 0.5B and SmolLM2 files: every block type in them has an exact form
    (Q4_K and Q4_1 with their minimum term), only the float norms and biases do not, and the
    shares add up."""
    import real
    from benchmarks.gguf_types import analyse, table

    folder = real.need(real.QWEN_DRAFT, real.SMOLLM2)
    qwen = analyse(str(folder / real.QWEN_DRAFT))
    assert {t for t, r in qwen["types"].items() if r["exact"]} == {"Q5_0", "Q8_0", "Q6_K", "Q4_K"}
    assert qwen["types"]["Q6_K"]["exact_form"] == {"bits": 8, "block": 16, "zero_point": 32, "minimum_term": False}
    assert qwen["types"]["Q4_K"]["exact_form"] == {"bits": 4, "block": 32, "zero_point": 0, "minimum_term": True}
    assert qwen["types"]["Q4_K"]["exact_kernel_bits_per_weight"] == 7.0
    assert sum(r["share"] for r in qwen["types"].values()) == pytest.approx(1.0)
    assert 0.99 < qwen["share_exact"] < 1.0  # F32 norms and biases are the rest
    smol = analyse(str(folder / real.SMOLLM2))
    assert smol["types"]["Q4_1"]["exact"] and smol["types"]["Q8_0"]["exact"] and not smol["types"]["F32"]["exact"]
    assert any(line.startswith("| Q4_1 |") and "minimum term" in line for line in table(smol))


@pytest.mark.real_weights
def test_gguf_blocks_bundle_runs_the_files_weights():
    """SmolLM2's default int4 export keeps every matrix as the file's Q4_1 and Q8_0 blocks (its
    draft is re-quantized), and its next-token distributions are far closer to the file's own
    weights in float32 than those of the same export with --requantize, which rounds them twice."""
    import real
    from benchmarks.fidelity import measure

    folder = real.need(real.SMOLLM2)
    kept, requantized = real.bundle("smollm2-pair-int4-d128"), real.bundle("smollm2-int4-requant")
    models = json.loads((kept / "manifest.json").read_text())["models"]
    assert set(models["target"]["gguf_blocks"]) == {"Q4_1", "Q8_0"} and models["target"]["gguf_blocks"]["Q4_1"] > 1e8
    assert models["draft"]["gguf_blocks"] is None
    assert json.loads((requantized / "manifest.json").read_text())["models"]["target"]["gguf_blocks"] is None
    result = measure(str(folder / real.SMOLLM2), [str(kept), str(requantized)], ctx=256, chunks=2, log=lambda line: None)
    exact, default = (result["bundles"][str(b)] for b in (kept, requantized))
    assert exact["kl_mean"] < 0.2 * default["kl_mean"], (exact["kl_mean"], default["kl_mean"])
    assert exact["same_top1"] > default["same_top1"] + 0.1


def test_sensitivity_ranks_each_roles_error(tiny_models):
    """Every role is measured alone at each scheme; 8 bits cost less KL than 4 at the same block,
    and the bytes per pass follow the scheme."""
    from benchmarks.sensitivity import run

    result = run(str(tiny_models.llama_quant), ["int4/32", "int8/32"], chunks=1, ctx=64, log=lambda line: None)
    rows = result["rows"]
    assert {r["role"] for r in rows.values()} == {"qkv", "o", "gate_up", "down", "lm_head"}
    for role in ("qkv", "o", "gate_up", "down", "lm_head"):
        four, eight = rows[f"{role} int4/32"], rows[f"{role} int8/32"]
        assert 0 < eight["kl_mean"] < four["kl_mean"], role
        assert eight["mib_per_pass"] == pytest.approx(four["mib_per_pass"] * 10 / 6)
    assert sum(rows[f"{r} int4/32"]["share"] for r in ("qkv", "o", "gate_up", "down", "lm_head")) == pytest.approx(1.0)
