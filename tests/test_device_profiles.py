"""Device profiles (`python -m export --device`), the placement check (`python -m runtime check`)
and what the runtime does with a bundle on a provider, on tiny random-weight checkpoints.

The cuda profile's float16 graphs run here on the CPU provider (it registers GroupQueryAttention,
MatMulNBits and SimplifiedLayerNormalization for float16); the GPU providers themselves are
checked statically against their kernel tables and their session settings, and the placement
decisions with fakes.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

import tiny
from edge_spec import names
from edge_spec.manifest import BundleError, load_manifest
from edge_spec.placement import check_bundle, check_graph, load_table
from runtime.engine import Engine, EngineConfig, GenerateConfig

from test_cli_errors import _error_line, _run


@pytest.fixture(scope="module")
def cuda_bundles(tmp_path_factory, tiny_models) -> dict[str, object]:
    """--device cuda bundles of the tiny Qwen2 (biases, untied) at fp16 and int4, with a
    layer-skip draft, and of the tiny Llama pair (target + draft model) at fp16."""
    root = tmp_path_factory.mktemp("cuda_bundles")
    out = {}
    for quant in ("fp16", "int4"):
        out[f"qwen2-{quant}"] = root / f"qwen2-{quant}"
        tiny.export(tiny_models.qwen2, out[f"qwen2-{quant}"], quant=quant, drafts=("layer-skip:1",), attention=None, device="cuda")
    out["llama-fp16"] = root / "llama-fp16"
    tiny.export(tiny_models.llama, out["llama-fp16"], quant="fp16", drafts=(str(tiny_models.draft), "layer-skip:2"), attention=None, device="cuda")
    return out


@pytest.fixture(scope="module")
def coreml_bundle(tmp_path_factory, tiny_models):
    out = tmp_path_factory.mktemp("coreml_bundle") / "llama-coreml"
    tiny.export(tiny_models.llama, out, quant="fp32", drafts=("layer-skip:2",), attention=None, device="coreml")
    return out


def _cpu_engine(bundle, drafter="none", gamma=None) -> Engine:
    return Engine(bundle, EngineConfig(provider="cpu", drafter=drafter, gamma=gamma, calibrate=False))


# -- the graphs a profile writes ---------------------------------------------------------------


def test_cuda_profile_graphs_are_float16_with_float32_logits(cuda_bundles):
    manifest = load_manifest(cuda_bundles["qwen2-int4"])
    assert manifest.device == "cuda"
    assert {m.arch.kv_dtype for m in manifest.models.values()} == {"float16"}
    float16, float32 = onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    for key, stage in manifest.stages.items():
        model = onnx.load(str(cuda_bundles["qwen2-int4"] / stage.file), load_external_data=False)
        types = {v.name: v.type.tensor_type.elem_type for v in [*model.graph.input, *model.graph.output]}
        for name, elem in types.items():
            if name.startswith(("past_", "present_", "hidden_")):
                assert elem == float16, (key, name)
        if stage.head:
            assert types[names.LOGITS] == float32
        if stage.layers:  # GroupQueryAttention's position inputs come from the runtime, not from integer nodes
            assert types[names.SEQLENS_K] == onnx.TensorProto.INT32 and names.KV_LEN not in types
        ops = {n.op_type for n in model.graph.node}
        assert not ops & {"Pow", "ReduceMean", "Sqrt"}, key  # norms are one float32-accumulating node
        assert "MatMul" not in ops, key  # every weight matrix is MatMulNBits
        for node in model.graph.node:
            if node.op_type == "MatMulNBits":
                scales = next(t for t in model.graph.initializer if t.name == node.input[2])
                assert scales.data_type == float16, node.name


@pytest.mark.parametrize("arch,quant", [("qwen2", "fp16"), ("llama", "fp16")])
def test_cuda_profile_logits_match_transformers_on_the_cpu_provider(arch, quant, cuda_bundles, hf_models):
    """float16 activations: every position within float16 rounding of transformers' float32."""
    model, tokenizer = hf_models[arch]
    ids = tokenizer(" ".join([tiny.PROMPT] * 2)).input_ids
    reference = tiny.hf_logits(model, ids)
    logits = _cpu_engine(cuda_bundles[f"{arch}-{quant}"]).target.forward(ids)
    assert logits.dtype == np.float32
    assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.95
    scale = np.abs(reference).max()
    assert np.abs(logits - reference).max() < 0.02 * scale


@pytest.mark.parametrize("name,drafters", [("qwen2-int4", ("layer-skip", "lookup")), ("llama-fp16", ("model", "layer-skip", "lookup", "auto"))])
def test_cuda_profile_speculative_greedy_equals_plain(name, drafters, cuda_bundles, hf_models):
    ids = hf_models["llama"][1](tiny.PROMPT).input_ids
    config = GenerateConfig(max_new_tokens=24)
    plain = _cpu_engine(cuda_bundles[name]).generate(ids, config).token_ids
    for drafter in drafters:
        result = _cpu_engine(cuda_bundles[name], drafter, gamma=3).generate(ids, config)
        assert result.token_ids == plain, drafter
        if drafter != "lookup":
            assert result.stats["drafted_tokens"] > 0, drafter


def test_cuda_profile_kv_is_half_in_the_plan(cuda_bundles, bundles):
    from edge_spec.budget import plan_bundle

    half = plan_bundle(load_manifest(cuda_bundles["llama-fp16"]), cuda_bundles["llama-fp16"], "none").part("KV target")
    full = plan_bundle(load_manifest(bundles["llama"]), bundles["llama"], "none").part("KV target")
    assert half * 2 == full


# -- the placement check -------------------------------------------------------------------------


def test_cpu_fused_bundle_cannot_be_placed_on_cuda(bundles):
    report = check_bundle(load_manifest(bundles["llama"]), bundles["llama"], "cuda")
    assert not report.ok
    assert "com.microsoft::GroupQueryAttention" in report.by_op()
    assert "float" in report.by_op()["com.microsoft::GroupQueryAttention"][0].reason
    assert check_bundle(load_manifest(bundles["llama"]), bundles["llama"], "cpu").ok


def test_cuda_bundles_place_on_cuda(cuda_bundles):
    for name, bundle in cuda_bundles.items():
        report = check_bundle(load_manifest(bundle), bundle, "cuda")
        assert report.ok, (name, report.summary())


def test_directml_takes_the_float16_graphs_but_not_a_quantized_embedding(cuda_bundles, old_dml_bundle):
    """DirectML registers no GatherBlockQuantized, so --device dml keeps the embedding float16
    (the MatMuls stay MatMulNBits): every node of the old fused dml graphs has a DirectML kernel by
    type, and they place on CUDA too; a --device cuda int4 bundle misses that one op on DirectML.
    Having a kernel is not computing the graph: the kernel facts name what DirectML's kernels
    would get wrong."""
    for name in ("qwen2-fp16", "llama-fp16"):
        report = check_bundle(load_manifest(cuda_bundles[name]), cuda_bundles[name], "dml")
        assert not report.misses and list(report.facts_by_op()) == ["com.microsoft::GroupQueryAttention"], name
    report = check_bundle(load_manifest(cuda_bundles["qwen2-int4"]), cuda_bundles["qwen2-int4"], "dml")
    assert list(report.by_op()) == ["com.microsoft::GatherBlockQuantized"]
    manifest = load_manifest(old_dml_bundle)
    assert manifest.device == "dml"
    assert check_bundle(manifest, old_dml_bundle, "cuda").ok
    report = check_bundle(manifest, old_dml_bundle, "dml")
    assert not report.misses and not report.ok
    assert set(report.facts_by_op()) == {"com.microsoft::GroupQueryAttention", "com.microsoft::MatMulNBits"}
    ops = {n.op_type for key in manifest.target.stages for n in onnx.load(str(old_dml_bundle / manifest.stages[key].file), load_external_data=False).graph.node}
    assert "MatMulNBits" in ops and "GatherBlockQuantized" not in ops


def test_dml_profile_writes_graphs_directml_computes_as_meant(dml_bundle, dml_fp16_bundle, hf_models):
    """--device dml: masked attention (rotary in the graph, positions and mask from the runtime, no
    GroupQueryAttention) and, at int4/int8, MatMulNBits with its zero-point input (the profile
    implies --zero-points): fp16 and int4 pass every kernel fact."""
    for bundle in (dml_fp16_bundle, dml_bundle):
        proc = _run("runtime", "check", bundle, "--provider", "dml")
        assert proc.returncode == 0, proc.stdout
    assert load_manifest(dml_bundle).target.zero_points
    for bundle in (dml_bundle, dml_fp16_bundle):
        manifest = load_manifest(bundle)
        assert {s.attention for s in manifest.stages.values()} == {"masked"} and manifest.target.arch.kv_dtype == "float16"
        ops = {n.op_type for f in bundle.glob("*.onnx") for n in onnx.load(str(f), load_external_data=False).graph.node}
        assert "GroupQueryAttention" not in ops and "GatherBlockQuantized" not in ops
    model, tokenizer = hf_models["qwen2"]
    ids = tokenizer(" ".join([tiny.PROMPT] * 2)).input_ids
    reference = tiny.hf_logits(model, ids)
    engine = _cpu_engine(dml_fp16_bundle)
    logits = engine.target.forward(ids[:7])
    logits = np.concatenate([logits, engine.target.forward(ids[7:])])  # a multi-token pass after a cache
    assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.95
    assert np.abs(logits - reference).max() < 0.02 * np.abs(reference).max()


def test_dml_masked_windows_stay_finite_in_float16(tmp_path):
    """Sliding-window layers (Qwen3's upper two here) mask by arithmetic on the positions, which
    in a float16 graph stays finite only because the float16 converter clamps MASKED to 65504
    (0 x -inf would be NaN). An 80-token prompt past the 12-token window, in two passes, matches
    transformers."""
    tok = tiny.make_tokenizer("a")
    model_dir = tiny.make_family(tmp_path / "qwen3", tok, "qwen3")
    tiny.export(model_dir, tmp_path / "b", quant="fp16", device="dml", max_context=128)
    model, tokenizer = tiny.load_hf(model_dir)
    ids = tokenizer(" ".join([tiny.PROMPT] * 8)).input_ids[:80]
    reference = tiny.hf_logits(model, ids)
    engine = _cpu_engine(tmp_path / "b")
    logits = np.concatenate([engine.target.forward(ids[:30]), engine.target.forward(ids[30:])])
    assert np.isfinite(logits).all()
    assert (logits.argmax(-1) == reference.argmax(-1)).mean() >= 0.95


def test_dml_profile_runs_on_the_cpu_provider(dml_bundle, dml_fp16_bundle, cuda_bundles, hf_models):
    ids = hf_models["qwen2"][1](tiny.PROMPT).input_ids
    config = GenerateConfig(max_new_tokens=16)
    for bundle in (dml_bundle, dml_fp16_bundle):
        plain = _cpu_engine(bundle).generate(ids, config).token_ids
        assert _cpu_engine(bundle, "layer-skip", 3).generate(ids, config).token_ids == plain


def test_coreml_bundle_places_on_coreml(coreml_bundle, bundles):
    manifest = load_manifest(coreml_bundle)
    assert manifest.device == "coreml" and {s.attention for s in manifest.stages.values()} == {"masked"}
    assert check_bundle(manifest, coreml_bundle, "coreml").ok
    assert not check_bundle(load_manifest(bundles["llama"]), bundles["llama"], "coreml").ok  # fused: contrib ops


def test_coreml_masked_graphs_match_transformers_and_speculate_exactly(coreml_bundle, hf_models):
    """The masked graphs (positions and mask from the runtime) compute what portable ones do."""
    model, tokenizer = hf_models["llama"]
    ids = tokenizer(" ".join([tiny.PROMPT] * 2)).input_ids
    np.testing.assert_allclose(_cpu_engine(coreml_bundle).target.forward(ids), tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    config = GenerateConfig(max_new_tokens=24)
    plain = _cpu_engine(coreml_bundle).generate(ids[:12], config).token_ids
    for drafter in ("layer-skip", "lookup"):
        assert _cpu_engine(coreml_bundle, drafter, 3).generate(ids[:12], config).token_ids == plain, drafter
    ops = {n.op_type for f in coreml_bundle.glob("*.onnx") for n in onnx.load(str(f), load_external_data=False).graph.node}
    assert not ops & {"Range", "Less", "LessOrEqual", "Expand", "Neg", "ConstantOfShape", "Cos", "Sin"}, ops


def test_coreml_passes_read_the_rows_in_use_not_the_whole_buffer(tiny_models, hf_models, tmp_path, monkeypatch):
    """The masked graphs' past width is symbolic and each pass is fed names.past_width rows, so its
    cost follows the context, not --max-context; the logits stay transformers'."""
    bundle = tmp_path / "llama-coreml-512"
    tiny.export(tiny_models.llama, bundle, quant="fp32", max_context=512, device="coreml")
    for stage in load_manifest(bundle).stages.values():
        if stage.layers:
            graph = onnx.load(str(bundle / stage.file), load_external_data=False).graph
            past = next(i for i in graph.input if i.name.startswith("past_"))
            assert past.type.tensor_type.shape.dim[2].dim_param == "P", stage.file
    engine = _cpu_engine(bundle)
    widths = []
    for session in engine.target.sessions:
        run = session.run

        def spy(output_names, feeds, *args, run=run, **kwargs):
            widths.extend(v.shape[2] for k, v in feeds.items() if k.startswith("past_"))
            return run(output_names, feeds, *args, **kwargs)

        monkeypatch.setattr(session, "run", spy)
    model, tokenizer = hf_models["llama"]
    ids = tokenizer(" ".join([tiny.PROMPT] * 2)).input_ids
    logits = engine.target.forward(ids[:-3])
    logits = np.concatenate([logits, engine.target.forward(ids[-3:])])
    np.testing.assert_allclose(logits, tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-4)
    assert widths and set(widths) == {64}  # the rows in use, to the bucket: not the 512 of --max-context
    engine.target.forward(ids * 8)  # past 128 rows: the views widen (in place, the rows kept)
    assert engine.target.cache.capacity == widths[-1] == -(-len(ids) * 9 // 64) * 64
    np.testing.assert_allclose(engine.target.forward(ids[:3]), tiny.hf_logits(model, ids * 9 + ids[:3])[-3:], atol=1e-4, rtol=1e-4)
    engine.target.cache.reset()
    assert engine.target.cache.capacity == 64
    # Block-stable passes pad a 1-token block to 2 rows: the views widen for the padding too.
    stable = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False, block_stable=True))
    longer = (ids * 10)[:64]
    stable.target.forward(longer[:63], n_logits=1)
    np.testing.assert_allclose(stable.target.forward(longer[63:]), tiny.hf_logits(model, longer)[-1:], atol=1e-4, rtol=1e-4)
    assert stable.target.cache.capacity == 128 and stable.target.cache.kv_len == 64


def test_an_op_the_table_lacks_fails_the_check(tmp_path):
    """A graph with one op no table lists, and one with a known op at a type the kernel lacks."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    for op, domain, expected in (("NoSuchOp", "com.example", "no cuda kernel"), ("Sigmoid", "", None)):
        graph = helper.make_graph([helper.make_node(op, ["x"], ["y"], domain=domain)], "g", [x], [y])
        opsets = [helper.make_opsetid("", 20)] + ([helper.make_opsetid(domain, 1)] if domain else [])
        path = tmp_path / f"{op}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=opsets), str(path))
        report = check_graph(path, "cuda")
        if expected:
            assert not report.ok and report.misses[0].reason == expected
        else:
            assert report.ok
    bad_type = tmp_path / "sigmoid-int.onnx"
    xi = helper.make_tensor_value_info("x", TensorProto.INT32, [2])
    yi = helper.make_tensor_value_info("y", TensorProto.INT32, [2])
    onnx.save(helper.make_model(helper.make_graph([helper.make_node("Sigmoid", ["x"], ["y"])], "g", [xi], [yi]), opset_imports=[helper.make_opsetid("", 20)]), str(bad_type))
    report = check_graph(bad_type, "cuda")
    assert not report.ok and "int32" in report.misses[0].reason


def test_cpu_table_is_the_installed_builds_own_registry():
    """edge_spec/kernels/cpu.json was read from the pinned onnxruntime; the installed one must
    still register what it lists for the ops the exporter emits."""
    import onnxruntime
    from onnxruntime.capi import _pybind_state as C

    table = load_table("cpu")
    assert table["onnxruntime"] == onnxruntime.__version__
    live = {f"{k.domain or 'ai.onnx'}::{k.op_name}" for k in C.get_all_opkernel_def() if k.provider == "CPUExecutionProvider"}
    assert set(table["kernels"]) <= live


def test_check_cli(bundles, cuda_bundles, tmp_path):
    proc = _run("runtime", "check", bundles["llama"], "--provider", "cuda")
    assert proc.returncode == 1, proc.stderr
    assert "GroupQueryAttention" in proc.stdout and "--device cpu" in proc.stdout
    proc = _run("runtime", "check", cuda_bundles["qwen2-int4"], "--provider", "cuda", "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["ok"] and report["device"] == "cuda" and report["nodes"] > 0
    (tmp_path / "notabundle").mkdir()
    line = _error_line(_run("runtime", "check", tmp_path / "notabundle", "--provider", "cuda"), only_line=True)
    assert "is not a bundle" in line


# -- kernel facts: a kernel that exists but computes something else -----------------------------


@pytest.fixture(scope="module")
def wide_coreml(tmp_path_factory, tiny_models) -> dict:
    """A two-layer Llama as wide as the real ones where the Core ML EP stops: 16,400-wide merged
    gate/up (Qwen2.5-1.5B's is 17,920) and a vocabulary past 16,384 rows (SmolLM2's 49,152), as
    --device coreml graphs before the limit was a kernel fact ("old") and today ("new")."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    root = tmp_path_factory.mktemp("wide")
    tok = AutoTokenizer.from_pretrained(tiny_models.llama)
    config = tiny.llama_config(16500, n_layers=2)
    config.intermediate_size = 8200
    torch.manual_seed(0)
    tiny._save(LlamaForCausalLM(config).eval(), tok, root / "model")
    with tiny.coreml_graphs_without_slices():
        tiny.export(root / "model", root / "old", quant="fp32", attention=None, device="coreml")
    tiny.export(root / "model", root / "new", quant="fp32", drafts=("layer-skip:1",), attention=None, device="coreml")
    return {"model": root / "model", "old": root / "old", "new": root / "new"}


def test_check_names_what_directmls_kernels_would_compute_wrong(old_dml_bundle):
    """The fused --device dml bundle (the profile before the kernel facts) has a DirectML kernel for every node's types, but
    GroupQueryAttention there skips rotary and forgets the cache for T > 1, and MatMulNBits (at
    171d616) takes no node without its zero-point input: runtime check exits 1 naming each, with
    the kernel source it was read from."""
    proc = _run("runtime", "check", old_dml_bundle, "--provider", "dml")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert "have no dml kernel" not in out
    assert "do_rotary" in out and "cos/sin" in out and "(do_rotary=1)" in out
    assert "past length of 0" in out and "more than one token" in out
    assert "zero-point input" in out and "is refused" in out and "(the node has 3 inputs)" in out
    assert "DmlOperatorGroupQueryAttention.cpp@076c3788a" in out and "DmlOperatorMatMulNBits.cpp@171d61606" in out
    report = json.loads(_run("runtime", "check", old_dml_bundle, "--provider", "dml", "--json").stdout)
    assert not report["ok"] and not report["missing"]
    facts = report["kernel_facts"]
    attention = facts["com.microsoft::GroupQueryAttention"]
    layers = sum(len(load_manifest(old_dml_bundle).stages[k].layers) for k in load_manifest(old_dml_bundle).target.stages)
    assert len({f["node"] for f in attention}) == layers and len(attention) == 2 * layers  # rotary and past length, each layer
    assert all(len(f["source"]) > 10 for f in facts["com.microsoft::MatMulNBits"])


def test_coreml_check_names_the_dimension_limit_and_the_nodes(wide_coreml, coreml_bundle):
    old = wide_coreml["old"]
    proc = _run("runtime", "check", old, "--provider", "coreml")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "dimension above 16384" in proc.stdout and "helper.cc@01960e769" in proc.stdout
    report = check_bundle(load_manifest(old), old, "coreml")
    assert not report.misses
    by_input = {f.detail.split(" is ")[-1] for f in report.facts}
    # The embedding's Gather (16500x64 table), the LM head's MatMul (64x16500), the merged gate/up
    # MatMul (64x16400) and the Split of its output.
    assert {"16500x64", "64x16500", "64x16400", "1x?x16400"} <= by_input
    assert {f.op for f in report.facts} == {"ai.onnx::Gather", "ai.onnx::MatMul", "ai.onnx::Split"}
    assert all(f"{f.node} (input " in proc.stdout for f in report.facts)
    assert check_bundle(load_manifest(coreml_bundle), coreml_bundle, "coreml").ok  # narrow tensors: every node placed


def test_coreml_graphs_slice_what_is_wider_than_the_limit(wide_coreml):
    """Today's --device coreml graphs: the table and the head in slices of at most 16384, gate/up
    unmerged; every node places, and the logits are transformers' (a multi-token pass after a
    cache included), speculation exact."""
    new = wide_coreml["new"]
    proc = _run("runtime", "check", new, "--provider", "coreml")
    assert proc.returncode == 0, proc.stdout
    model, tokenizer = tiny.load_hf(wide_coreml["model"])
    ids = tokenizer(" ".join([tiny.PROMPT] * 2)).input_ids + [16499, 16384, 8250, 8249]  # ids in every slice, at the edges
    reference = tiny.hf_logits(model, ids)
    engine = _cpu_engine(new)
    logits = np.concatenate([engine.target.forward(ids[:9]), engine.target.forward(ids[9:])])
    np.testing.assert_allclose(logits, reference, atol=1e-4, rtol=1e-4)
    config = GenerateConfig(max_new_tokens=16)
    plain = _cpu_engine(new).generate(ids[:12], config).token_ids
    assert _cpu_engine(new, "layer-skip", 3).generate(ids[:12], config).token_ids == plain


def test_coreml_fp16_casts_the_head_slice_by_slice(wide_coreml, tmp_path):
    """--device coreml --quant fp16 keeps float32 logits: the converter's one Cast of the whole
    row (16,500 wide) would fall to the CPU EP, so each head slice is cast and the slices are
    concatenated in float32. Every node places; the logits are the fp32 bundle's within float16
    rounding."""
    fp16 = tmp_path / "wide-fp16"
    tiny.export(wide_coreml["model"], fp16, quant="fp16", device="coreml")
    report = check_bundle(load_manifest(fp16), fp16, "coreml")
    assert report.ok, report.summary()
    graph = onnx.load(str(fp16 / "target.onnx"), load_external_data=False).graph
    head = next(n for n in graph.node if names.LOGITS in n.output)
    producers = {o: n for n in graph.node for o in n.output}
    assert head.op_type == "Concat" and [producers[i].op_type for i in head.input] == ["Cast", "Cast"]
    model, tokenizer = tiny.load_hf(wide_coreml["model"])
    ids = tokenizer(tiny.PROMPT).input_ids + [16499, 16384]
    np.testing.assert_allclose(_cpu_engine(fp16).target.forward(ids), _cpu_engine(wide_coreml["new"]).target.forward(ids), atol=2e-2)


def test_cuda_gather_block_quantized_needs_onnxruntime_1_23(cuda_bundles):
    """NVIDIA's older Jetson builds have no CUDA GatherBlockQuantized: checked for the
    onnxruntime the bundle will run on; a version that is not one is refused at parse time."""
    bundle = cuda_bundles["qwen2-int4"]
    manifest = load_manifest(bundle)
    assert check_bundle(manifest, bundle, "cuda").ok and check_bundle(manifest, bundle, "cuda", "1.23.0").ok
    old = check_bundle(manifest, bundle, "cuda", "1.22.2")
    assert list(old.facts_by_op()) == ["com.microsoft::GatherBlockQuantized"] and "1.23.0" in old.summary()
    assert check_bundle(load_manifest(cuda_bundles["qwen2-fp16"]), cuda_bundles["qwen2-fp16"], "cuda", "1.20.0").ok  # float16 embedding
    proc = _run("runtime", "check", bundle, "--provider", "cuda", "--onnxruntime", "1.22.0")
    assert proc.returncode == 1 and "GatherBlockQuantized" in proc.stdout and "gather_block_quantized.cc" in proc.stdout
    assert "not an onnxruntime version" in _error_line(_run("runtime", "check", bundle, "--provider", "cuda", "--onnxruntime", "latest"))


def test_cuda_refuses_an_int4_bundle_on_an_onnxruntime_without_its_kernel(cuda_bundles, monkeypatch):
    """The loader checks against the installed release (a Jetson's 1.22 here, faked); an odd
    version string is no reason to refuse."""
    import runtime.loader as loader_module
    from runtime.sessions import ProviderChoice

    monkeypatch.setattr(loader_module, "resolve_provider", lambda name, allow: ProviderChoice("cuda", "cuda", ("CUDAExecutionProvider",)))
    monkeypatch.setattr(loader_module, "open_session", lambda *a, **k: pytest.fail("a session was opened"))
    monkeypatch.setattr(loader_module.ort, "__version__", "1.22.0")
    with pytest.raises(BundleError, match=r"cannot run on cuda: .*GatherBlockQuantized.*onnxruntime 1\.23\.0"):
        Engine(cuda_bundles["qwen2-int4"], EngineConfig(provider="cuda", drafter="none", calibrate=False))
    assert check_bundle(load_manifest(cuda_bundles["qwen2-int4"]), cuda_bundles["qwen2-int4"], "cuda", "nightly").ok


def test_directml_refuses_the_bundle_its_kernels_would_compute_wrong(old_dml_bundle, monkeypatch):
    """On DirectML (faked as available) the loader refuses the fused dml bundle before any session."""
    import runtime.loader as loader_module
    from runtime.sessions import ProviderChoice

    monkeypatch.setattr(loader_module, "resolve_provider", lambda name, allow: ProviderChoice("dml", "dml", ("DmlExecutionProvider",)))
    monkeypatch.setattr(loader_module, "open_session", lambda *a, **k: pytest.fail("a session was opened"))
    with pytest.raises(BundleError, match=r"cannot run on dml: .*would not run as the graph means.*do_rotary"):
        Engine(old_dml_bundle, EngineConfig(provider="dml", drafter="none", calibrate=False))


def test_kernel_facts_are_data_with_their_source():
    from edge_spec.placement import FACT_RULES, KernelFact, PlacementError, load_facts

    facts = [f for p in ("cpu", "cuda", "dml", "coreml") for f in load_facts(p)]
    assert {f.rule for f in facts} == set(FACT_RULES)
    assert all(len(f.source["commit"]) == 40 and f.source["file"].startswith("onnxruntime/") and f.source["reads"] for f in facts)
    good = dict(provider="dml", op="com.microsoft::MatMulNBits", rule="input_required", input=3, reason="r",
                source={"file": "onnxruntime/x.cc", "commit": "0" * 40})
    KernelFact(**good)
    for bad, message in ((dict(rule="guess"), "unknown rule"), (dict(source={"file": "x"}), "40-digit commit"),
                         (dict(input=-1), "parameters are missing"), (dict(provider="tpu"), "unknown provider")):
        with pytest.raises(PlacementError, match=message):
            KernelFact(**{**good, **bad})


# -- refusals and warnings -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args,message",
    [
        (("--device", "cuda", "--quant", "fp32"), "--device cuda --quant fp32"),
        (("--device", "dml", "--attention", "portable"), "--device dml --attention portable"),
        (("--device", "coreml", "--quant", "int4"), "--device coreml --quant int4"),
        (("--device", "coreml", "--quant", "fp32", "--attention", "fused"), "--device coreml --attention fused"),
        (("--device", "cuda", "--format", "onnx,coreml"), "Core ML packages run on Apple devices"),
        (("--device", "coreml", "--quant", "fp32", "--max-context", "32768"), "no input dimension above 16384"),
    ],
)
def test_export_refuses_what_a_profile_cannot_express(args, message, tiny_models, tmp_path):
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", *args)
    assert message in _error_line(proc)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_cpu_profile_fp16_still_exports_and_runs(tiny_models, hf_models, tmp_path):
    """The CPU provider casts the float16 nodes it has no kernel for, so the export's check must
    not refuse an fp16 --device cpu bundle for them."""
    tiny.export(tiny_models.qwen2, tmp_path / "b", quant="fp16")
    ids = hf_models["qwen2"][1](tiny.PROMPT).input_ids
    assert (_cpu_engine(tmp_path / "b").target.forward(ids).argmax(-1) == tiny.hf_logits(hf_models["qwen2"][0], ids).argmax(-1)).mean() >= 0.95


def test_export_refuses_an_unknown_device(tiny_models, tmp_path):
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", "--device", "tpu")
    assert proc.returncode == 2 and "invalid choice: 'tpu'" in proc.stderr


def test_gpu_providers_refuse_a_bundle_they_cannot_place(bundles, monkeypatch):
    """On CUDA (faked as available) a --device cpu fused bundle is refused before any session,
    in one line naming the right --device."""
    import runtime.loader as loader_module
    from runtime.sessions import ProviderChoice

    monkeypatch.setattr(loader_module, "resolve_provider", lambda name, allow: ProviderChoice("cuda", "cuda", ("CUDAExecutionProvider",)))
    monkeypatch.setattr(loader_module, "open_session", lambda *a, **k: pytest.fail("a session was opened"))
    with pytest.raises(BundleError, match=r"cannot run on cuda: .*GroupQueryAttention.*re-export it with --device cuda"):
        Engine(bundles["llama"], EngineConfig(provider="cuda", drafter="none", calibrate=False))


def test_auto_provider_falls_back_to_the_cpu_for_a_bundle_cuda_cannot_place(bundles, monkeypatch):
    import runtime.loader as loader_module
    from runtime.sessions import ProviderChoice

    monkeypatch.setattr(loader_module, "resolve_provider", lambda name, allow: ProviderChoice("cuda", "auto", ("CUDAExecutionProvider", "CPUExecutionProvider")))
    engine = Engine(bundles["llama"], EngineConfig(provider="auto", drafter="none", calibrate=False))
    assert engine.provider == "cpu" and engine.provider_report()["target"]["fallback_from"] == "cuda"
    assert any("cannot run on cuda" in w and "--device cuda" in w for w in engine.warnings)


def test_float16_bundle_on_the_cpu_warns(cuda_bundles):
    engine = _cpu_engine(cuda_bundles["llama-fp16"])
    assert len(engine.warnings) == 1 and "--device cuda" in engine.warnings[0] and "--device cpu bundles" in engine.warnings[0]


def test_manifest_kv_dtype_must_follow_the_profile(cuda_bundles, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(cuda_bundles["qwen2-fp16"], copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["device"] = "cpu"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BundleError, match="keeps a float16 KV cache; --device cpu bundles keep float32"):
        load_manifest(copy)


# -- sessions and KV on the device ---------------------------------------------------------------


@pytest.mark.parametrize("provider", ["cuda", "dml"])
def test_gpu_sessions_disable_cpu_fallback(provider):
    from runtime.sessions import SessionConfig, session_options

    options = session_options(provider, SessionConfig(provider))
    assert options.get_session_config_entry("session.disable_cpu_ep_fallback") == "1"
    cpu = session_options("cpu", SessionConfig("cpu"))
    with pytest.raises(RuntimeError, match="does not have configuration"):
        cpu.get_session_config_entry("session.disable_cpu_ep_fallback")


def test_gpu_sessions_list_no_cpu_provider(monkeypatch):
    """ORT refuses disable_cpu_ep_fallback beside an explicitly listed CPU EP."""
    import runtime.sessions as sessions

    seen = {}

    def fake_session(path, sess_options, providers, provider_options, enable_fallback):
        seen["providers"] = providers
        raise RuntimeError("stop here")

    monkeypatch.setattr(sessions.ort, "InferenceSession", fake_session)
    for provider, expected in (("cuda", ["CUDAExecutionProvider"]), ("dml", ["DmlExecutionProvider"]), ("coreml", ["CoreMLExecutionProvider", "CPUExecutionProvider"])):
        with pytest.raises(RuntimeError):
            sessions._create("x.onnx", provider, sessions.SessionConfig(provider))
        assert seen["providers"] == expected


class _FakeSession:
    def __init__(self, provider, device_id=0):
        self.provider, self.device_id = provider, device_id

    def get_providers(self):
        return [self.provider]

    def get_provider_options(self):
        return {self.provider: {"device_id": str(self.device_id)}}

    def io_binding(self):  # pragma: no cover - only its presence is read
        raise AssertionError


@pytest.mark.parametrize(
    "provider,attention,expected",
    [
        ("CUDAExecutionProvider", "fused", ("cuda", 1)),
        ("DmlExecutionProvider", "fused", ("dml", 1)),
        ("CUDAExecutionProvider", "portable", None),  # row copies need host buffers
        ("CPUExecutionProvider", "fused", None),
    ],
)
def test_kv_lives_on_the_gpu_for_fused_gpu_sessions(provider, attention, expected, cuda_bundles):
    from runtime.sessions import kv_device

    manifest = load_manifest(cuda_bundles["qwen2-fp16"])
    stages = [manifest.stages[k] for k in manifest.target.stages]
    import dataclasses

    stages = [dataclasses.replace(s, attention=attention) for s in stages]
    device = kv_device(stages, [_FakeSession(provider, 1) for _ in stages])
    assert (tuple(device) if device else None) == expected


def test_float16_kv_as_device_ortvalues_match_host(cuda_bundles, hf_models):
    """The CUDA path (float16 KV as OrtValues bound in place) with the CPU as the device."""
    from runtime.kv_cache import KVCache
    from runtime.model import ModelRunner

    ids = hf_models["qwen2"][1](tiny.PROMPT).input_ids
    host = _cpu_engine(cuda_bundles["qwen2-fp16"]).target
    arch = host.info.arch
    cache = KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, "float16", device=("cpu", 0))
    runner = ModelRunner("target", host.info, host.stages, host.sessions, cache)
    reference = host.forward(ids)
    first = runner.forward(ids[:4])
    runner.forward([5, 6])
    cache.rollback_to_prefix(ids)
    # Same rows, computed in other blocks: equal to float16 rounding, not bit for bit.
    np.testing.assert_allclose(np.concatenate([first, runner.forward(ids[4:])]), reference, atol=0.05 * np.abs(reference).max())


# -- the GPU check script, dry run on the CPU provider -------------------------------------------


@pytest.fixture(scope="module")
def gpu_check_bundles(tmp_path_factory, tiny_models) -> tuple:
    """A --device cuda fp16 bundle (draft model and layer-skip) and its float32 reference."""
    root = tmp_path_factory.mktemp("gpu_check")
    bundle, reference = root / "cuda", root / "reference"
    tiny.export(tiny_models.llama, bundle, quant="fp16", drafts=(str(tiny_models.draft), "layer-skip:2"), max_context=512, device="cuda")
    tiny.export(tiny_models.llama, reference, quant="fp32", max_context=512)
    return bundle, reference


def _rewritten(bundle, out, rewrite):
    """A copy of `bundle` whose target graphs went through rewrite(model), hashes updated."""
    from edge_spec.manifest import sha256_file

    shutil.copytree(bundle, out)
    data = json.loads((out / "manifest.json").read_text())
    manifest = load_manifest(out, check_hashes=False)
    for key in manifest.target.stages:
        path = out / manifest.stages[key].file
        model = onnx.load(str(path), load_external_data=False)
        rewrite(model)
        onnx.save(model, str(path))
        data["files"][path.name] = sha256_file(path)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def test_gpu_check_runs_every_step_on_the_cpu_provider(gpu_check_bundles, tmp_path):
    """benchmarks/gpu_check.py with --provider cpu: export skipped (bundles given), placement
    read from ONNX Runtime's own profile, agreement, identity, micro and bench, one JSON."""
    import real
    from benchmarks.gpu_check import run

    real.need(real.HUMANEVAL)
    bundle, reference = gpu_check_bundles
    record = run(tmp_path / "out", "unused", bundle, reference, "fp16", 1, 8, provider="cpu")
    assert record["passed"], record.get("error")
    placement = record["profiled_placement"]["node_events_per_stage"]
    assert placement and all(set(c) == {"CPUExecutionProvider"} and sum(c.values()) > 0 for c in placement.values())
    assert {k.split(".")[0] for k in placement} == {"target", "draft"}  # the draft model's graphs ran too
    agreement = record["logits_vs_fp32_cpu"]
    assert agreement["top1_agreement"] >= agreement["floor"] == 0.97 and agreement["top1_agreement_two_passes"] >= 0.97
    assert set(record["greedy_identity"]["block_stable"]) == {"model", "layer-skip", "lookup", "auto"}
    assert all(row["identical"] == row["prompts"] for row in record["greedy_identity"]["block_stable"].values())
    assert set(record["greedy_identity"]["default"]) == {"model", "layer-skip", "lookup", "auto"}  # reported, not required
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text())["passed"]


def test_gpu_check_fails_on_a_bundle_that_computes_something_else(gpu_check_bundles, tmp_path):
    """The same bundle with rotary left out of its attention (what DirectML's kernel would do):
    every step but agreement passes, and the check exits 1 on it."""
    import real
    from benchmarks.gpu_check import main
    from test_provider_emulation import ignore_rotary

    real.need(real.HUMANEVAL)
    bundle, reference = gpu_check_bundles
    wrong = _rewritten(bundle, tmp_path / "wrong", ignore_rotary)
    args = ["--out", str(tmp_path / "out"), "--bundle", str(wrong), "--reference", str(reference), "--quant", "fp16", "--prompts", "1",
            "--max-new-tokens", "8", "--provider", "cpu"]
    assert main(args) == 1
    record = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert not record["passed"] and "top-1 agreement with the float32 CPU reference below the floor 0.97" in record["error"]
    assert "profiled_placement" in record and "greedy_identity" not in record


def test_gpu_check_fails_when_passes_over_the_cache_are_wrong(gpu_check_bundles, tmp_path, monkeypatch):
    """Passes of more than one token that forget the cache (DirectML's GroupQueryAttention,
    emulated): the agreement with the prompt split over two passes fails the check. (Greedy
    identity, required in block-stable mode where every pass has two rows or more, can hold
    there with plain and speculative decoding wrong alike: the agreement is what catches it.)"""
    import real
    from benchmarks.gpu_check import run
    from test_provider_emulation import emulate_past_length_zero

    real.need(real.HUMANEVAL)
    bundle, reference = gpu_check_bundles
    emulate_past_length_zero(monkeypatch)
    record = run(tmp_path / "out", "unused", bundle, reference, "fp16", 1, 8, provider="cpu")
    assert not record["passed"] and "top1_agreement_two_passes" in record["error"] and "greedy_identity" not in record
    assert record["logits_vs_fp32_cpu"]["error"]


def test_gpu_check_fails_when_block_stable_speculation_is_not_exact(gpu_check_bundles, tmp_path, monkeypatch):
    """A verify pass whose rows beyond the first are scored one position late (a wrong kernel
    that only multi-row passes of more than two rows meet): greedy identity fails the check."""
    import real
    from benchmarks.gpu_check import run
    from edge_spec import names

    real.need(real.HUMANEVAL)
    bundle, reference = gpu_check_bundles
    faithful = names.position_feeds

    def feeds(inputs, start, block, max_context=0):
        return faithful(inputs, start + (block > 2), block, max_context)

    monkeypatch.setattr(names, "position_feeds", feeds)
    record = run(tmp_path / "out", "unused", bundle, reference, "fp16", 1, 8, provider="cpu")
    assert not record["passed"] and "greedy speculative differs from greedy plain in block-stable mode" in record["error"]


def test_gpu_check_takes_the_drafters_the_bundle_has(cuda_bundles):
    """A bundle without a draft model (SmolLM2 with layer-skip, say) is checked with what it has."""
    from benchmarks.gpu_check import bundle_drafters

    assert bundle_drafters(load_manifest(cuda_bundles["qwen2-int4"])) == ("layer-skip", "lookup", "auto")
    assert bundle_drafters(load_manifest(cuda_bundles["llama-fp16"])) == ("model", "layer-skip", "lookup", "auto")


def test_memcpy_nodes_do_not_count_as_running_on_the_gpu(tmp_path):
    """ONNX Runtime runs its copies between providers on the CUDA EP: counted apart, they fail the check."""
    from benchmarks.gpu_check import check_profiled_placement, node_providers

    cuda = "CUDAExecutionProvider"
    events = [{"cat": "Node", "name": f"n{i}_kernel_time", "args": {"op_name": op, "provider": cuda}}
              for i, op in enumerate(("MatMulNBits", "MemcpyToHost", "GroupQueryAttention", "MemcpyFromHost"))]
    events.append({"cat": "Session", "name": "model_run", "args": {}})
    (tmp_path / "profile.json").write_text(json.dumps(events))
    counts = node_providers(str(tmp_path / "profile.json"))
    assert counts == {cuda: 2, "Memcpy": 2}
    with pytest.raises(AssertionError, match="'Memcpy': 2"):
        check_profiled_placement({"target": counts}, cuda)
    check_profiled_placement({"target": {cuda: 2}}, cuda)
    with pytest.raises(AssertionError, match="none were profiled"):
        check_profiled_placement({"target": {}}, cuda)


def test_gpu_check_fails_without_the_provider(tmp_path):
    from benchmarks.gpu_check import run

    record = run(tmp_path, "unused", None, None, "int4", 1, 8, provider="cuda")
    assert not record["passed"] and "onnxruntime-gpu" in record["error"]
