"""The kernel facts' teeth, shown on tiny models: what a provider's kernel does with a node
(edge_spec/kernels/semantics.json) emulated on the CPU provider, and the tokens it changes.

Each emulation is first checked, node by node, against a numpy reference of the behaviour the
provider's kernel source shows; then a bundle's graphs run with it in place of the faithful
kernel, and the greedy tokens are compared with the faithful run's. A fact whose emulation left
the tokens unchanged would be a check without teeth.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tiny
from edge_spec import names
from runtime import sessions
from runtime.engine import Engine, EngineConfig, GenerateConfig

REAL_SESSION = ort.InferenceSession


# -- the emulations: graph rewrites and feeds that make the CPU kernels do what the provider's do --


def ignore_rotary(model: onnx.ModelProto) -> None:
    """DirectML's GroupQueryAttention never reads do_rotary or cos/sin: the CPU kernel with
    do_rotary 0 and no caches computes the same unrotated attention."""
    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            for attribute in node.attribute:
                if attribute.name == "do_rotary":
                    attribute.i = 0
            for index in (7, 8):
                if len(node.input) > index:
                    node.input[index] = ""


def _signed(nibbles: np.ndarray) -> np.ndarray:
    """A 4-bit field read as two's complement: 8..15 are -8..-1."""
    return np.where(nibbles >= 8, nibbles.astype(np.int16) - 16, nibbles.astype(np.int16))


def signed_nibble_weight(packed: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int, block: int) -> np.ndarray:
    """MatMulNBits' 4-bit weight [N, K] as the first DirectML kernel computes it (onnxruntime
    51406c1, DmlOperatorMatMulNBits.cpp: B and the zero points typed DML_TENSOR_DATA_TYPE_INT4):
    (signed(q) - signed(zero point)) x scale, the zero point 0 when absent (a signed type's)."""
    blocks = -(-k // block)
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, blocks, -1)[:, :, :block]
    if zero_points is None:
        zp = np.zeros((n, blocks), dtype=np.int16)
    else:
        rows = zero_points.reshape(n, -1)
        zp = _signed(np.stack([rows & 0x0F, rows >> 4], axis=-1).reshape(n, -1)[:, :blocks])
    steps = (_signed(q) - zp[:, :, None]).astype(np.float32)
    return (steps * scales.reshape(n, blocks)[:, :, None].astype(np.float32)).reshape(n, blocks * block)[:, :k]


def matmulnbits_as_signed_nibbles(model: onnx.ModelProto) -> None:
    """Every 4-bit MatMulNBits replaced by a MatMul on its weight as the signed-INT4 DirectML
    kernel reads it (signed_nibble_weight), in the activations' type."""
    inits = {t.name: t for t in model.graph.initializer}
    nodes = []
    for node in model.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type != "MatMulNBits" or attrs["bits"] != 4:
            nodes.append(node)
            continue
        inputs = list(node.input) + [""] * (4 - len(node.input))
        scales = numpy_helper.to_array(inits[inputs[2]])
        zero_points = numpy_helper.to_array(inits[inputs[3]]) if inputs[3] else None
        weight = signed_nibble_weight(numpy_helper.to_array(inits[inputs[1]]), scales, zero_points, attrs["K"], attrs["N"], attrs["block_size"])
        name = node.name + ".signed_weight"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T).astype(scales.dtype), name))
        nodes.append(helper.make_node("MatMul", [inputs[0], name], list(node.output[:1]), name=node.name + ".signed"))
    del model.graph.node[:]
    model.graph.node.extend(nodes)


def emulate_graphs(monkeypatch, rewrite) -> None:
    """Every session the runtime opens from here on runs `rewrite`(its graph)."""

    def session(path, *args, **kwargs):
        model = onnx.load(str(path))
        rewrite(model)
        return REAL_SESSION(model.SerializeToString(), *args, **kwargs)

    monkeypatch.setattr(sessions.ort, "InferenceSession", session)


def emulate_past_length_zero(monkeypatch) -> None:
    """DirectML's GroupQueryAttention feeds a past length of 0 to a pass of T > 1: the CPU
    kernel fed seqlens_k and total_seq_len as for a first pass does the same (it attends to the
    block alone and writes the block's rows from row 0)."""
    faithful = names.position_feeds

    def feeds(inputs, start, block, max_context=0):
        if names.SEQLENS_K in inputs and block > 1:
            start = 0
        return faithful(inputs, start, block, max_context)

    monkeypatch.setattr(names, "position_feeds", feeds)


# -- each emulation against a numpy reference of the provider's behaviour, one node ---------------


def _run_node(node, inputs: dict, initializers: list, outputs: list) -> list[np.ndarray]:
    graph_inputs = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for k, v in inputs.items()]
    graph = helper.make_graph([node], "g", graph_inputs, outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("com.microsoft", 1)])
    return REAL_SESSION(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, inputs)


def _matmulnbits_node(zero_points: bool):
    rng = np.random.default_rng(0)
    k, n, block = 64, 8, 32
    packed = rng.integers(0, 256, size=(n, k // block, block // 2), dtype=np.uint8)
    scales = rng.uniform(0.5, 1.5, size=(n * k // block,)).astype(np.float32)
    zp = rng.integers(0, 256, size=(n * (k // block) // 2,), dtype=np.uint8) if zero_points else None
    inputs = ["x", "w", "s"] + (["z"] if zero_points else [])
    node = helper.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=4, block_size=block, name="mm")
    inits = [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s")] + ([numpy_helper.from_array(zp, "z")] if zero_points else [])
    return node, inits, (packed, scales, zp, k, n, block)


def test_matmulnbits_without_a_zero_point_dequantizes_at_the_midpoint_as_directml_does():
    """DirectML's MatMulNBits (171d616 and later) runs DML_DEQUANTIZE with a scale alone when the
    zero-point slot is empty, and DirectML then takes the unsigned type's midpoint (8 for uint4:
    its developers' comment in onnxruntime#21592): the spec's default, which the CPU kernel computes."""
    node, inits, (packed, scales, _, k, n, block) = _matmulnbits_node(zero_points=False)
    x = np.random.default_rng(1).standard_normal((1, 2, k)).astype(np.float32)
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    faithful = _run_node(node, {"x": x}, inits, out)[0]
    values = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, k).astype(np.float32)
    midpoint = (values - 8) * np.repeat(scales.reshape(n, k // block), block, axis=1)  # [N,K]
    np.testing.assert_allclose(faithful, x @ midpoint.T, rtol=1e-4, atol=1e-3)
    assert not np.allclose(faithful, x @ (values * np.repeat(scales.reshape(n, k // block), block, axis=1)).T, atol=1e-2)


@pytest.mark.parametrize("zero_points", (False, True))
def test_signed_nibble_emulation_is_the_int4_reading(zero_points):
    node, inits, (packed, scales, zp, k, n, block) = _matmulnbits_node(zero_points)
    x = np.random.default_rng(1).standard_normal((1, 2, k)).astype(np.float32)
    out = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    model = helper.make_model(helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, x.shape)], out, inits))
    matmulnbits_as_signed_nibbles(model)
    emulated = _run_node(model.graph.node[0], {"x": x}, list(model.graph.initializer), out)[0]
    # The reference, nibble by nibble: two's complement fields, low nibble first, per block of 32 along K.
    low, high = packed & 0x0F, packed >> 4
    q = np.stack([low, high], axis=-1).reshape(n, k).astype(np.int16)
    q = np.where(q >= 8, q - 16, q)
    z = np.zeros((n, k // block), np.int16)
    if zp is not None:
        z = np.stack([zp & 0x0F, zp >> 4], axis=-1).reshape(n, k // block).astype(np.int16)
        z = np.where(z >= 8, z - 16, z)
    weight = (q - np.repeat(z, block, axis=1)) * np.repeat(scales.reshape(n, k // block), block, axis=1)
    np.testing.assert_allclose(emulated, x @ weight.T, rtol=1e-4, atol=1e-3)
    assert not np.allclose(emulated, _run_node(node, {"x": x}, inits, out)[0], atol=1e-2)  # not the spec's reading


def _gqa_reference(q, k, v, heads, kv_heads, scale):
    """Causal grouped-query attention over the block alone, no rotary: [1,T,H*D]."""
    t, d = q.shape[1], q.shape[2] // heads
    q = q.reshape(t, heads, d).transpose(1, 0, 2)
    k = np.repeat(k.reshape(t, kv_heads, d).transpose(1, 0, 2), heads // kv_heads, axis=0)
    v = np.repeat(v.reshape(t, kv_heads, d).transpose(1, 0, 2), heads // kv_heads, axis=0)
    scores = q @ k.transpose(0, 2, 1) * scale + np.triu(np.full((t, t), -np.inf), 1)
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    return (probs @ v).transpose(1, 0, 2).reshape(1, t, heads * d)


def test_gqa_emulations_are_unrotated_attention_over_the_block_alone():
    """Both DirectML facts on one node: a 3-token pass at kv_len 5 with rotary in the graph,
    emulated, is the reference (no rotary, no past), and the rows land at 0..2."""
    rng = np.random.default_rng(1)
    heads, kv_heads, d, t, past_len, max_len = 4, 2, 16, 3, 5, 16
    q = rng.standard_normal((1, t, heads * d)).astype(np.float32)
    k = rng.standard_normal((1, t, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((1, t, kv_heads * d)).astype(np.float32)
    past = rng.standard_normal((1, kv_heads, max_len, d)).astype(np.float32)
    angles = np.arange(max_len)[:, None] * (1.0 / 10000 ** (np.arange(0, d, 2) / d))[None, :]
    inits = [numpy_helper.from_array(np.cos(angles).astype(np.float32), "cos"), numpy_helper.from_array(np.sin(angles).astype(np.float32), "sin")]
    node = helper.make_node(
        "GroupQueryAttention", ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "cos", "sin"], ["y", "ok", "ov"],
        domain="com.microsoft", num_heads=heads, kv_num_heads=kv_heads, scale=d ** -0.5, do_rotary=1, name="gqa",
    )
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("y", "ok", "ov")]
    model = helper.make_model(helper.make_graph([node], "g", [], outs, inits))
    ignore_rotary(model)
    # Past length 0 for T > 1: the positions fed as for a first pass.
    feeds = {"q": q, "k": k, "v": v, "pk": past, "pv": past, "seqlens_k": np.array([t - 1], np.int32), "total": np.array(t, np.int32)}
    y, present_key, _ = _run_node(model.graph.node[0], feeds, list(model.graph.initializer), outs)
    np.testing.assert_allclose(y, _gqa_reference(q, k, v, heads, kv_heads, d ** -0.5), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(present_key[0, :, :t], k.reshape(t, kv_heads, d).transpose(1, 0, 2), rtol=1e-6)
    faithful = dict(feeds, seqlens_k=np.array([past_len + t - 1], np.int32), total=np.array(past_len + t, np.int32))
    assert not np.allclose(_run_node(node, faithful, inits, outs)[0], y, atol=1e-3)


# -- the old --device dml graphs under each emulation: different tokens; today's: the same ----------


@pytest.fixture(scope="module")
def prompt(hf_models):
    return hf_models["qwen2"][1](" ".join([tiny.PROMPT] * 2)).input_ids


def _tokens(bundle, ids, drafter="none", gamma=None, max_new_tokens=24) -> list[int]:
    engine = Engine(bundle, EngineConfig(provider="cpu", drafter=drafter, gamma=gamma, calibrate=False))
    return engine.generate(ids, GenerateConfig(max_new_tokens=max_new_tokens)).token_ids


@pytest.fixture(scope="module")
def faithful(old_dml_bundle, prompt):
    plain = _tokens(old_dml_bundle, prompt)
    assert _tokens(old_dml_bundle, prompt, "layer-skip", 3) == plain  # the graphs are right where the kernel is
    return plain


def test_rotary_skipped_changes_the_tokens(old_dml_bundle, prompt, faithful, monkeypatch):
    emulate_graphs(monkeypatch, ignore_rotary)
    assert _tokens(old_dml_bundle, prompt) != faithful


def test_past_length_zero_for_multi_token_passes_changes_the_tokens(old_dml_bundle, prompt, faithful, monkeypatch):
    """A prompt's first pass starts at row 0, so plain decoding is untouched; every verify pass
    (T = γ + 1 after the prompt) forgets the cache, and speculation is no longer exact."""
    emulate_past_length_zero(monkeypatch)
    assert _tokens(old_dml_bundle, prompt) == faithful
    assert _tokens(old_dml_bundle, prompt, "layer-skip", 3) != faithful


def test_matmulnbits_read_as_signed_nibbles_changes_the_tokens(old_dml_bundle, prompt, faithful, monkeypatch):
    emulate_graphs(monkeypatch, matmulnbits_as_signed_nibbles)
    assert _tokens(old_dml_bundle, prompt) != faithful


def test_todays_dml_graphs_give_the_same_tokens_under_directmls_attention(dml_fp16_bundle, prompt, monkeypatch):
    """No GroupQueryAttention left for DirectML to get wrong: with both attention emulations in
    place, plain and speculative greedy tokens are the faithful ones."""
    plain = _tokens(dml_fp16_bundle, prompt)
    assert _tokens(dml_fp16_bundle, prompt, "layer-skip", 3) == plain
    emulate_graphs(monkeypatch, ignore_rotary)
    emulate_past_length_zero(monkeypatch)
    assert _tokens(dml_fp16_bundle, prompt) == plain
    assert _tokens(dml_fp16_bundle, prompt, "layer-skip", 3) == plain


def test_todays_int4_dml_graphs_still_need_the_unsigned_matmulnbits_kernel(dml_bundle, prompt, monkeypatch):
    """The zero point written into every node satisfies 171d616's four-input check, but does not
    save the graphs from the signed-INT4 kernel DirectML's MatMulNBits began with: a zero point
    of 8 and up reads as negative, and the tokens change. The pinned onnxruntime-directml 1.24.4
    is inferred (not read) to carry an unsigned form (edge_spec/kernels/semantics.json)."""
    plain = _tokens(dml_bundle, prompt)
    assert _tokens(dml_bundle, prompt, "layer-skip", 3) == plain
    emulate_graphs(monkeypatch, matmulnbits_as_signed_nibbles)
    assert _tokens(dml_bundle, prompt) != plain
