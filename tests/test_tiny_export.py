"""End to end on tiny random-weight checkpoints: HF folder -> export -> bundle -> runtime.

The runtime must reproduce transformers' float32 logits and greedy tokens, tokenize like the
HF tokenizer, and speculate exactly (every drafter gives plain greedy's tokens).
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import tiny
from edge_spec.sampling import SamplingConfig
from runtime.engine import Engine, EngineConfig, GenerateConfig

ARCHS = ("llama", "qwen2")
DRAFTERS = ("model", "layer-skip", "lookup", "auto")


def _engine(bundle, drafter="none", gamma=None, calibrate=False) -> Engine:
    return Engine(bundle, EngineConfig(drafter=drafter, gamma=gamma, calibrate=calibrate))


@pytest.fixture(scope="module")
def plain_engines(bundles):
    return {arch: _engine(bundles[arch]) for arch in ARCHS}


def _prompt_ids(hf_models, arch, text=tiny.PROMPT) -> list[int]:
    return hf_models[arch][1](text).input_ids


# -- logits ------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_match_transformers(arch, plain_engines, hf_models):
    model, tok = hf_models[arch]
    ids = _prompt_ids(hf_models, arch)
    engine = plain_engines[arch]
    engine.target.cache.reset()
    got = engine.target.forward(ids)  # [T, V]
    ref = tiny.hf_logits(model, ids)  # [T, V]
    assert got.shape == ref.shape == (len(ids), len(tok))
    np.testing.assert_allclose(got, ref, atol=1e-4, rtol=1e-5)
    assert engine.target.cache.kv_len == len(ids)


def test_logits_match_past_original_rope_window(plain_engines, hf_models):
    """llama3 rope scaling (original window 32): positions past 32 still match."""
    model, tok = hf_models["llama"]
    ids = _prompt_ids(hf_models, "llama", " ".join([tiny.PROMPT] * 4))[:60]
    assert len(ids) > 40
    engine = plain_engines["llama"]
    engine.target.cache.reset()
    got = engine.target.forward(ids)
    np.testing.assert_allclose(got, tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_incremental_feeding_equals_one_shot(arch, plain_engines, hf_models):
    ids = _prompt_ids(hf_models, arch)
    runner = plain_engines[arch].target
    runner.cache.reset()
    one_shot = runner.forward(ids)
    runner.cache.reset()
    pieces = [runner.forward(ids[:5]), runner.forward(ids[5:9])]
    pieces += [runner.forward(ids[i : i + 1]) for i in range(9, len(ids))]
    np.testing.assert_allclose(np.concatenate(pieces), one_shot, atol=1e-4, rtol=1e-5)
    # Chunked prefill (logits only for each chunk's end), then the last token alone.
    runner.cache.reset()
    runner.prefill(ids[:-1], chunk=4)
    assert runner.cache.kv_len == len(ids) - 1
    assert list(runner.cache.row_tokens[: len(ids) - 1]) == ids[:-1]
    np.testing.assert_allclose(runner.forward(ids[-1:])[-1], one_shot[-1], atol=1e-4, rtol=1e-5)
    # n_logits: only the last rows of a block.
    runner.cache.reset()
    last_two = runner.forward(ids, n_logits=2)
    assert last_two.shape == (2, one_shot.shape[1])
    np.testing.assert_allclose(last_two, one_shot[-2:], atol=1e-4, rtol=1e-5)


# -- greedy generation -------------------------------------------------------------------------


def _hf_greedy(model, ids, n):
    import torch

    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=n, min_new_tokens=0)
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_tokens_match_transformers(arch, plain_engines, hf_models):
    model, tok = hf_models[arch]
    ids = _prompt_ids(hf_models, arch)
    ref = _hf_greedy(model, ids, 20)
    result = plain_engines[arch].generate(ids, GenerateConfig(max_new_tokens=20))
    eos = tok.convert_tokens_to_ids(tiny.EOS)
    # Both stop right after an EOS (and include it); otherwise both run 20 tokens.
    assert result.token_ids == ref
    assert result.prompt_ids == ids
    assert result.stop_reason == ("eos" if ref and ref[-1] == eos else "length")
    text = tok.decode(ref, skip_special_tokens=True)
    if "\ufffd" not in text:
        assert result.text == text


@pytest.mark.parametrize("arch", ARCHS)
def test_runtime_tokenizer_matches_hf(arch, plain_engines, hf_models):
    _, tok = hf_models[arch]
    engine = plain_engines[arch]
    for text in (tiny.PROMPT, "Hello, wörld! 123 ✓ def f(x): return x", "  two  spaces\nnewline\t tab", "<|user|>x</s>"):
        assert engine.encode(prompt=text) == tok(text).input_ids, text
    assert engine.encode(prompt="the cat")[0] == tok.convert_tokens_to_ids(tiny.BOS)  # BOS is added
    messages = [{"role": "user", "content": "the cat sat on the mat"}, {"role": "assistant", "content": "dog"}, {"role": "user", "content": "fox?"}]
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    got = engine.encode(messages=messages)
    assert got == list(expected)
    assert got.count(tok.convert_tokens_to_ids(tiny.BOS)) == 1  # the template's BOS only
    assert got[-1] == tok.convert_tokens_to_ids(tiny.ASSISTANT)
    assert engine.tokenizer.decode(got, skip_special_tokens=False) == tok.decode(got, skip_special_tokens=False)
    with pytest.raises(ValueError):
        engine.encode(prompt="x", messages=messages)


def test_chat_template_tojson_matches_hf(plain_engines, hf_models):
    """runtime/tokenizer.py promises Hugging Face's rendering rules; HF's `tojson` keeps key
    order and does not HTML-escape (json.dumps(ensure_ascii=False)). Templates use it for
    tool calls (Llama 3.x, Qwen2.5)."""
    from edge_spec.manifest import TokenizerInfo
    from runtime.tokenizer import BundleTokenizer

    _, tok = hf_models["llama"]
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
    engine = plain_engines["llama"]
    info = TokenizerInfo(**{**engine.tokenizer.info.__dict__, "chat_template": template})
    runtime_tok = BundleTokenizer(engine.bundle.file(info.file), info)
    messages = [{"role": "user", "content": {"name": "f", "args": "a<b & 'c'"}}]
    expected = tok.apply_chat_template(messages, chat_template=template, tokenize=False)
    assert runtime_tok.render_chat(messages, add_generation_prompt=False) == expected


# -- speculative decoding is exact -------------------------------------------------------------


@pytest.fixture(scope="module")
def greedy_reference(bundles, plain_engines, hf_models):
    refs = {}
    for arch in ARCHS:
        ids = _prompt_ids(hf_models, arch)
        refs[arch] = (ids, plain_engines[arch].generate(ids, GenerateConfig(max_new_tokens=30)).token_ids)
    return refs


@pytest.mark.parametrize("gamma", [3, None], ids=["gamma3", "adaptive"])
@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_greedy_equals_plain(arch, drafter, gamma, bundles, greedy_reference):
    ids, plain = greedy_reference[arch]
    engine = _engine(bundles[arch], drafter, gamma, calibrate=gamma is None)
    result = engine.generate(ids, GenerateConfig(max_new_tokens=30))
    assert result.token_ids == plain
    stats = result.stats
    if gamma is not None and drafter in ("model", "layer-skip"):
        # Model drafters always propose γ tokens: every round verifies a block.
        assert stats["drafted_tokens"] == 3 * stats["target_passes"]
        assert set(stats["gamma_histogram"]) == {"3"}
    assert stats["accepted_tokens"] <= stats["drafted_tokens"]
    assert stats["tokens_per_pass"] == pytest.approx(len(plain) / stats["target_passes"])
    # Second generation on the same engine (caches hold the first one's rows): same tokens.
    assert engine.generate(ids, GenerateConfig(max_new_tokens=30)).token_ids == plain


def test_lookup_drafter_accepts_on_repetitive_text(bundles, hf_models):
    """A repeated prompt makes the target repeat it (almost surely, even untrained): lookup
    drafts get accepted, and the output is still plain greedy's."""
    _, tok = hf_models["llama"]
    ids = tok("red blue green red blue green red blue green red blue green").input_ids
    plain = _engine(bundles["llama"]).generate(ids, GenerateConfig(max_new_tokens=24))
    spec = _engine(bundles["llama"], "lookup", 4).generate(ids, GenerateConfig(max_new_tokens=24))
    assert spec.token_ids == plain.token_ids
    assert spec.stats["drafted_tokens"] > 0
    assert spec.stats["target_passes"] <= len(plain.token_ids)


@pytest.mark.parametrize("drafter", ["none", "model", "layer-skip", "lookup"])
def test_generation_stops_at_context(drafter, bundles, greedy_reference):
    ids, plain = greedy_reference["llama"]
    engine = _engine(bundles["llama"], drafter, 3 if drafter != "none" else None)
    result = engine.generate(ids, GenerateConfig(max_new_tokens=500))
    # The tiny model is seeded and never emits EOS within its 64-token context.
    assert result.stop_reason == "context"
    # A speculative round may commit past the end; the engine cuts where plain decoding stops.
    assert len(ids) + len(result.token_ids) == tiny.MAX_CONTEXT
    assert result.token_ids[: len(plain)] == plain


def test_prefix_reuse_across_generations(bundles, greedy_reference, hf_models):
    """A second prompt sharing a prefix with the first reuses rows; output as a fresh engine."""
    ids, plain = greedy_reference["llama"]
    _, tok = hf_models["llama"]
    other = ids[:6] + tok(" river stone", add_special_tokens=False).input_ids
    fresh = _engine(bundles["llama"]).generate(other, GenerateConfig(max_new_tokens=15)).token_ids
    for drafter in ("none", "model", "layer-skip"):
        engine = _engine(bundles["llama"], drafter, 2 if drafter != "none" else None)
        assert engine.generate(ids, GenerateConfig(max_new_tokens=15)).token_ids == plain[:15]
        assert engine.generate(other, GenerateConfig(max_new_tokens=15)).token_ids == fresh, drafter


@pytest.mark.parametrize("drafter", ["none", "model", "layer-skip", "lookup"])
def test_seeded_sampling_is_reproducible(drafter, bundles, greedy_reference):
    ids, _ = greedy_reference["llama"]
    engine = _engine(bundles["llama"], drafter, 3 if drafter != "none" else None)
    runs = [
        engine.generate(ids, GenerateConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.8, seed=seed))).token_ids
        for seed in (11, 11, 12)
    ]
    assert runs[0] == runs[1]
    assert len(runs[0]) == 20
    assert runs[0] != runs[2]  # the seed matters (20 tokens at temperature 0.8)


# -- quantized bundles -------------------------------------------------------------------------


@pytest.mark.parametrize("quant,min_agreement", [("int8", 0.8), ("int4", 0.6)])
def test_quantized_bundle_runs_and_agrees(quant, min_agreement, quant_bundles, hf_models):
    """Loads on ONNX Runtime, and its logits stay close to the fp32 bundle's: high
    correlation and the same top-1 token on most positions."""
    ids = _prompt_ids(hf_models, "llama", " ".join([tiny.PROMPT] * 3))[:48]
    ref = _engine(quant_bundles["fp32"]).target.forward(ids)
    engine = _engine(quant_bundles[quant])
    got = engine.target.forward(ids)
    assert got.shape == ref.shape
    assert np.isfinite(got).all()
    assert not np.allclose(got, ref, atol=1e-4)  # really quantized
    agreement = float((got.argmax(-1) == ref.argmax(-1)).mean())
    assert agreement >= min_agreement, f"{quant}: top-1 agreement {agreement:.2f}"
    correlation = float(np.mean([np.corrcoef(a, b)[0, 1] for a, b in zip(got, ref)]))
    assert correlation >= 0.97, f"{quant}: logit correlation {correlation:.3f}"
    result = engine.generate(ids[:10], GenerateConfig(max_new_tokens=8))
    assert len(result.token_ids) == 8 or result.stop_reason == "eos"
    manifest = json.loads((quant_bundles[quant] / "manifest.json").read_text())
    assert manifest["models"]["target"]["quant"] == quant
    fp32_bytes = sum(p.stat().st_size for p in quant_bundles["fp32"].glob("*.data"))
    assert sum(p.stat().st_size for p in quant_bundles[quant].glob("*.data")) < 0.6 * fp32_bytes


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_bundle_embedding_table_is_quantized(quant, quant_bundles):
    """export/quantize.py: int4 -> GatherBlockQuantized embedding; int8 -> "an 8-bit
    block-quantized embedding table". No float32 [vocab, hidden] table may remain."""
    import onnx

    manifest = json.loads((quant_bundles[quant] / "manifest.json").read_text())
    arch = manifest["models"]["target"]["arch"]
    graph = onnx.load(str(quant_bundles[quant] / "target.onnx"), load_external_data=False).graph
    float_tables = [
        init.name
        for init in graph.initializer
        if init.data_type == onnx.TensorProto.FLOAT and sorted(init.dims) == sorted([arch["vocab_size"], arch["hidden_size"]])
    ]
    assert float_tables == [], f"{quant}: float32 embedding/head tables left unquantized: {float_tables}"
    assert any(node.op_type == "GatherBlockQuantized" for node in graph.node)


def _weight_matmul_widths(graph) -> list[int]:
    """Output width N of every MatMul / MatMulNBits that multiplies by a constant weight."""
    weights = {init.name: init for init in graph.initializer}
    widths = []
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            widths.append(next(a.i for a in node.attribute if a.name == "N"))
        elif node.op_type == "MatMul" and node.input[1] in weights:
            widths.append(weights[node.input[1]].dims[1])
    return widths


@pytest.mark.parametrize("which", ["llama", "qwen2", "portable", "int4"])
def test_projections_are_merged(which, bundles, portable_bundle, quant_bundles):
    """export/onnx_graphs.merge_parallel_matmuls: per layer one q/k/v and one gate/up
    projection (4 weight MatMuls per layer, not 7), whatever the attention kind or precision."""
    import onnx

    bundle = {"portable": portable_bundle, "int4": quant_bundles["int4"]}.get(which) or bundles[which]
    manifest = json.loads((bundle / "manifest.json").read_text())
    checked = 0
    for model in manifest["models"].values():
        arch = model["arch"]
        qkv = (arch["n_heads"] + 2 * arch["n_kv_heads"]) * arch["head_dim"]
        gate_up = 2 * (2 * arch["hidden_size"])  # tiny.py: intermediate_size = 2 * hidden_size
        for key in model["stages"]:
            stage = manifest["stages"][key]
            n_layers = stage["layer_end"] - stage["layer_start"]
            widths = _weight_matmul_widths(onnx.load(str(bundle / stage["file"]), load_external_data=False).graph)
            assert len(widths) == 4 * n_layers + int(stage["head"]), (key, widths)
            assert widths.count(qkv) == n_layers and widths.count(gate_up) == n_layers, (key, widths)
            checked += n_layers
    assert checked


def test_merge_parallel_matmuls_keeps_outputs_and_tied_weights(tmp_path):
    """Three MatMuls on x merge into one MatMul + Split with the same outputs; a weight that
    another node also reads stays whole, and MatMuls on other activations are left alone. The
    merged weight has no bytes until the stage is written (export/quantize.write_stage)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    from export.onnx_graphs import StageWeights, merge_parallel_matmuls
    from export.quantize import write_stage

    rng = np.random.default_rng(0)
    w = {name: rng.standard_normal((8, n)).astype(np.float32) for name, n in (("wq", 8), ("wk", 4), ("wv", 4), ("wt", 6), ("wo", 5))}
    nodes = [
        helper.make_node("MatMul", ["x", "wq"], ["q"], name="q"),
        helper.make_node("MatMul", ["x", "wk"], ["k"], name="k"),
        helper.make_node("MatMul", ["x", "wt"], ["t"], name="t"),  # wt is also read by the Add below
        helper.make_node("MatMul", ["x", "wv"], ["v"], name="v"),
        helper.make_node("MatMul", ["q", "wo"], ["o"], name="o"),
        helper.make_node("Add", ["wt", "wt"], ["tt"], name="tt"),
    ]
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, "T", width]) for n, width in (("q", 8), ("k", 4), ("v", 4), ("t", 6), ("o", 5))]
    outputs.append(helper.make_tensor_value_info("tt", TensorProto.FLOAT, [8, 6]))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", 8])], outputs,
                              [numpy_helper.from_array(a, n) for n, a in w.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])
    x = rng.standard_normal((1, 3, 8)).astype(np.float32)
    before = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})

    weights = StageWeights(None)
    assert merge_parallel_matmuls(model, weights) == 2
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("MatMul") == 3 and ops.count("Split") == 1  # merged q/k/v, t, o
    assert {i.name for i in model.graph.initializer} >= {"wt", "wo"} and not {"wq", "wk", "wv"} & {i.name for i in model.graph.initializer}
    merged = next(t for t in model.graph.initializer if t.name.endswith(".merged.weight"))
    assert list(merged.dims) == [8, 16] and not merged.raw_data
    write_stage(model, weights, tmp_path / "g.onnx", None, None)
    onnx.checker.check_model(str(tmp_path / "g.onnx"))
    after = ort.InferenceSession(str(tmp_path / "g.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert merge_parallel_matmuls(onnx.load(str(tmp_path / "g.onnx"), load_external_data=False), StageWeights(tmp_path)) == 0  # nothing left to merge


def _traced_stage(folder, tmp_path, hidden=64):
    """A tiny checkpoint's whole stage traced by the exporter, weights forced into one
    external file per tensor as torch writes a stage past 2 GB (what the streaming reads)."""
    import onnx

    from edge_spec import names
    from export.onnx_graphs import trace_stage
    from export.static_cache import StageModule

    model, _ = tiny.load_hf(folder)
    n = model.config.num_hidden_layers
    stage = StageModule(model, 0, n, True, True, model.config.vocab_size, "fused", tiny.MAX_CONTEXT)
    traced = tmp_path / "traced" / "stage.onnx"
    traced.parent.mkdir()
    trace_stage(stage, range(n), tiny.MAX_CONTEXT, model.config.hidden_size, traced)
    split = onnx.load(str(traced))
    onnx.save_model(split, str(traced), save_as_external_data=True, all_tensors_to_one_file=False, size_threshold=1024)
    return traced, names.stage_inputs(True, True, range(n), "fused"), names.stage_outputs(True, range(n), "fused")


@pytest.mark.parametrize("quant,block", [("int4", 32), ("int8", 32), ("int4", 64)])
def test_streamed_quantization_equals_the_whole_graph_quantizer(quant, block, tiny_models, tmp_path):
    """export/quantize.write_stage quantizes one weight at a time through ONNX Runtime's node
    quantizer; the result must be what MatMulNBitsQuantizer gives over the whole fp32 graph
    held in memory (the exporter's earlier path): same nodes, same initializer bytes."""
    import onnx
    from onnx import numpy_helper
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    from export.onnx_graphs import finish_stage
    from export.quantize import ACCURACY_LEVEL, quantize_stage, write_stage

    traced, inputs, outputs = _traced_stage(tiny_models.llama, tmp_path)
    graph, weights = finish_stage([traced], inputs, outputs)
    write_stage(graph, weights, tmp_path / "fp32.onnx", None, None)
    graph, weights = finish_stage([traced], inputs, outputs)
    quantize_stage(graph, weights, tmp_path / "q.onnx", quant, block_size=block)

    reference = onnx.load(str(tmp_path / "fp32.onnx"))
    for bits, ops in ((8, ("MatMul",)), (4, ("Gather",))) if quant == "int8" else ((4, ("MatMul", "Gather")),):
        q = MatMulNBitsQuantizer(reference, bits=bits, block_size=block, is_symmetric=True, accuracy_level=ACCURACY_LEVEL,
                                 op_types_to_quantize=ops, quant_axes=(("MatMul", 0), ("Gather", 1)))
        q.process()
        reference = q.model.model
    got = onnx.load(str(tmp_path / "q.onnx"))
    assert [n.SerializeToString() for n in got.graph.node] == [n.SerializeToString() for n in reference.graph.node]
    expected = {t.name: numpy_helper.to_array(t) for t in reference.graph.initializer}
    actual = {t.name: numpy_helper.to_array(t) for t in got.graph.initializer}
    assert sorted(actual) == sorted(expected)
    for name, array in expected.items():
        assert actual[name].dtype == array.dtype and actual[name].tobytes() == array.tobytes(), name
    assert {(o.domain, o.version) for o in got.opset_import} == {(o.domain, o.version) for o in reference.opset_import}
    assert got.ir_version == reference.ir_version
    ops = {n.op_type for n in got.graph.node}
    assert {"MatMulNBits", "GatherBlockQuantized"} <= ops and "MatMul" not in ops


def test_stage_weights_read_each_tensor_from_its_file(tiny_models, tmp_path):
    """StageWeights reads a tensor from torch's per-tensor file (offset 0, no length) and from a
    shared file at an offset, and refuses a file that is too short instead of padding it."""
    import onnx
    from onnx import numpy_helper

    from export.onnx_graphs import StageWeights

    traced, _, _ = _traced_stage(tiny_models.llama, tmp_path)
    whole = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(traced)).graph.initializer}
    lazy = onnx.load(str(traced), load_external_data=False)
    weights = StageWeights(traced.parent)
    external = [t for t in lazy.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert len(external) > 10
    for t in lazy.graph.initializer:
        np.testing.assert_array_equal(weights.array(t), whole[t.name])
    victim = external[0]
    path = traced.parent / next(e.value for e in victim.external_data if e.key == "location")
    path.write_bytes(path.read_bytes()[:-4])
    with pytest.raises(RuntimeError, match="holds"):
        weights.array(victim)


# -- refusals and the padded-head path ---------------------------------------------------------


def test_draft_with_other_vocabulary_is_refused(tiny_models, tmp_path):
    from export.bundle import ExportError

    out = tmp_path / "bundle"
    with pytest.raises(ExportError) as info:
        tiny.export(tiny_models.llama, out, drafts=(str(tiny_models.draft_other_vocab),))
    message = str(info.value)
    assert "does not share the target's tokenizer" in message
    assert str(tiny_models.draft_other_vocab) in message
    assert "only in the target" in message and "only in the draft" in message
    assert not out.exists() and not (tmp_path / "bundle.partial").exists()


def test_draft_with_padded_head_is_accepted(tiny_models, hf_models, tmp_path):
    out = tmp_path / "bundle"
    manifest = tiny.export(tiny_models.llama, out, drafts=(str(tiny_models.draft_padded),))
    n_real = manifest.tokenizer.n_real_tokens
    assert manifest.models["draft"].arch.vocab_size == manifest.models["target"].arch.vocab_size == n_real
    model, tok = hf_models["llama"]
    ids = tok(tiny.PROMPT).input_ids
    plain = _engine(out)
    plain_tokens = plain.generate(ids, GenerateConfig(max_new_tokens=12)).token_ids
    assert plain_tokens == _hf_greedy(model, ids, 12)
    spec = _engine(out, "model", 3).generate(ids, GenerateConfig(max_new_tokens=12))
    assert spec.token_ids == plain_tokens
    assert spec.stats["drafted_tokens"] > 0
    draft_engine = _engine(out, "model", 3)
    draft_logits = draft_engine.drafter.runner.forward(ids)
    assert draft_logits.shape == (len(ids), n_real)


@pytest.mark.parametrize("kind", ["gemma2", "gpt2"])
def test_unsupported_architecture_refused_before_weights(kind, tiny_models, tmp_path):
    """The folders hold no weights at all: refusing by model_type must come first."""
    from export.archs import UnsupportedArchitecture

    folder = getattr(tiny_models, kind)
    assert not any(p.suffix in (".safetensors", ".bin") for p in folder.iterdir())
    out = tmp_path / "bundle"
    with pytest.raises(UnsupportedArchitecture, match=f"'{kind}' is not supported.*llama.*qwen2"):
        tiny.export(folder, out)
    assert not out.exists() and not (tmp_path / "bundle.partial").exists()


def test_unsupported_config_variants_refused():
    from transformers import Qwen2Config

    from export.archs import UnsupportedArchitecture, arch_for

    arch_for(tiny.llama_config(300))  # the supported baseline
    yarn = tiny.llama_config(300)
    yarn.rope_parameters = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "original_max_position_embeddings": 32}
    with pytest.raises(UnsupportedArchitecture, match="yarn"):
        arch_for(yarn)
    bias = tiny.llama_config(300)
    bias.mlp_bias = True
    with pytest.raises(UnsupportedArchitecture, match="mlp_bias"):
        arch_for(bias)
    with pytest.raises(UnsupportedArchitecture, match="sliding"):
        arch_for(Qwen2Config(vocab_size=300, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True))


def test_export_refuses_bad_config(tiny_models, tmp_path):
    from export.bundle import ExportError

    with pytest.raises(ExportError, match="layer count between 1 and 3"):
        tiny.export(tiny_models.llama, tmp_path / "a", drafts=("layer-skip:4",))
    with pytest.raises(ExportError, match="too small"):
        tiny.export(tiny_models.llama, tmp_path / "b", max_context=8)
    with pytest.raises(ExportError, match="unknown quantization"):
        tiny.export(tiny_models.llama, tmp_path / "c", quant="int3")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "keep.txt").write_text("x")
    with pytest.raises(ExportError, match="--force"):
        tiny.export(tiny_models.llama, tmp_path / "d")
    assert (tmp_path / "d" / "keep.txt").read_text() == "x"


# -- layer skip shares the target's stages -----------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_layer_skip_shares_target_stages(arch, bundles):
    from edge_spec.manifest import load_manifest

    bundle = bundles[arch]
    manifest = load_manifest(bundle)
    target, skip = manifest.models["target"], manifest.models["layer_skip"]
    assert skip.shares_kv_with == "target"
    assert set(skip.stages) <= set(target.stages)
    assert skip.stages[0] == target.stages[0] and skip.stages[-1] == target.stages[-1]
    assert skip.arch.n_layers < target.arch.n_layers
    # On disk: the manifest, the tokenizer, and one graph + one data file per stage; the
    # layer-skip role adds none.
    stage_files = {f for s in manifest.stages.values() for f in (s.file, *s.data_files)}
    assert {p.name for p in bundle.iterdir()} == stage_files | {"manifest.json", "tokenizer.json"}
    assert set(manifest.stages) == set(target.stages) | set(manifest.models["draft"].stages)
    target_data = {f for key in target.stages for f in manifest.stages[key].data_files}
    skip_data = {f for key in skip.stages for f in manifest.stages[key].data_files}
    assert skip_data <= target_data
    # At run time the drafter reuses the target's sessions and KV cache.
    engine = _engine(bundle, "layer-skip", 2)
    runner = engine.drafter.runner
    assert runner.cache is engine.target.cache
    assert runner.sessions[0] is engine.target.sessions[0]
    assert runner.sessions[-1] is engine.target.sessions[-1]
    assert len(engine.loader.sessions) == len(target.stages)


def test_export_cli_writes_a_loadable_bundle(tiny_models, tmp_path, bundles):
    """`python -m export FOLDER` in process (argument parsing, drafts 'none')."""
    from edge_spec.manifest import load_manifest
    from export.__main__ import main

    out = tmp_path / "cli-bundle"
    assert main([str(tiny_models.llama), "--out", str(out), "--quant", "fp32", "--max-context", "32", "--draft", "none"]) == 0
    manifest = load_manifest(out)
    assert list(manifest.models) == ["target"] and manifest.default_draft is None
    assert manifest.target.arch.max_context == 32
    # Same weights, same graphs: the logits equal the session bundle's.
    ids = list(range(5, 15))
    a = _engine(out).target.forward(ids)
    b = _engine(bundles["llama"]).target.forward(ids)
    np.testing.assert_allclose(a, b, atol=1e-5)
    shutil.rmtree(out)


# -- portable attention (standard ONNX ops; the runtime copies the new rows in) ---------------------


def test_portable_graphs_use_standard_ops_only(portable_bundle, bundles):
    import onnx

    for bundle, expect_fused in ((portable_bundle, False), (bundles["llama"], True)):
        manifest = Engine(bundle, EngineConfig(drafter="none", calibrate=False)).bundle.manifest
        for key, stage in manifest.stages.items():
            domains = {node.domain for node in onnx.load(str(bundle / stage.file), load_external_data=False).graph.node}
            fused = bool(stage.layers) and "com.microsoft" in domains
            assert fused == (expect_fused and bool(stage.layers)), key
            assert stage.attention == ("fused" if expect_fused else "portable")


def test_portable_logits_match_transformers(portable_bundle, hf_models):
    model, _ = hf_models["llama"]
    ids = _prompt_ids(hf_models, "llama")
    engine = _engine(portable_bundle)
    np.testing.assert_allclose(engine.target.forward(ids), tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("drafter", ("model", "layer-skip"))
def test_portable_speculative_greedy_equals_fused_plain(drafter, portable_bundle, greedy_reference):
    ids, plain = greedy_reference["llama"]
    assert _engine(portable_bundle, drafter, 3).generate(ids, GenerateConfig(max_new_tokens=30)).token_ids == plain


def test_kv_buffers_as_device_ortvalues_match_host(bundles, hf_models):
    """The path a CUDA session takes (KV as OrtValues on the device, bound in place), run with
    the CPU as the device: same logits as host numpy buffers, across a rollback."""
    from runtime.kv_cache import KVCache
    from runtime.model import ModelRunner

    model, _ = hf_models["llama"]
    ids = _prompt_ids(hf_models, "llama")
    host = _engine(bundles["llama"]).target
    arch = host.info.arch
    cache = KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, device=("cpu", 0))
    runner = ModelRunner("target", host.info, host.stages, host.sessions, cache)
    ref = tiny.hf_logits(model, ids)
    first = runner.forward(ids[:5])
    rest = runner.forward([7, 8, 9])  # a wrong continuation, rolled back below
    cache.rollback_to_prefix(ids)
    assert cache.kv_len == 5 and rest.shape[0] == 3
    np.testing.assert_allclose(np.concatenate([first, runner.forward(ids[5:])]), ref, atol=1e-4, rtol=1e-5)
    with pytest.raises(RuntimeError, match="in place"):
        cache.write_rows(range(1), [np.zeros((1, arch.n_kv_heads, 1, arch.head_dim), np.float32)] * 2, 0)


def test_hidden_states_stay_on_the_device_between_stages(bundles, greedy_reference):
    """KV on a device (the CPU standing in for CUDA): a pass hands each stage's hidden state to
    the next as a device OrtValue and copies back only the logits; the layer-skip draft brings
    back its one trunk row per drafted token (the verify pass reuses them), and the answers are
    the host path's."""
    from edge_spec.sampling import SamplingConfig
    from runtime.drafters.layer_skip import LayerSkipDrafter
    from runtime.kv_cache import KVCache
    from runtime.model import ModelRunner

    ids, _ = greedy_reference["llama"]
    host = _engine(bundles["llama"], "layer-skip", 3)
    assert len(host.target.stages) >= 3 and host.target.device is None
    arch = host.target.info.arch
    cache = KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, device=("cpu", 0))
    runner = ModelRunner("target", host.target.info, host.target.stages, host.target.sessions, cache)
    assert runner.device == ("cpu", 0)
    np.testing.assert_allclose(runner.forward(ids), host.target.forward(ids), atol=1e-5)
    runner.forward([5])
    assert runner.copies == {"hidden_to_host": 0, "hidden_to_device": 0, "logits_to_host": 2, "passes": 2}
    skip = host.loader.runner("layer_skip")
    drafter = LayerSkipDrafter(ModelRunner("layer_skip", skip.info, skip.stages, skip.sessions, cache))
    proposal = drafter.propose(list(ids) + [5, 6], 3, SamplingConfig(), np.random.default_rng(0))
    assert drafter.runner.copies["hidden_to_host"] == 3 and proposal.trunk_hidden.shape[1] == 3
