"""The memory planner (edge_spec.budget): sizes, the parts of a plan against what the runtime
allocates, `python -m runtime plan`, refusal before any session exists, and export's choices
under `--memory-budget`."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import io
import json
from pathlib import Path

import pytest

from edge_spec import budget
from edge_spec.budget import BudgetError, parse_size, plan_bundle
from edge_spec.manifest import load_manifest

# -- sizes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("3GB", 3 * 10**9),
        ("512MiB", 512 * 2**20),
        ("1.5GiB", 3 * 2**29),
        (" 2 gb ", 2 * 10**9),
        ("750kb", 750_000),
        ("1500000000", 1_500_000_000),
        ("4096B", 4096),
        (123456, 123456),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "not a number"),
        ("lots", "not a number"),
        ("GB", "not a number"),
        ("-1GB", "not a number"),
        ("3XB", "unknown unit 'XB'"),
        ("3G", "unknown unit 'G'"),
        ("0", "more than 0"),
        ("0.0GB", "more than 0"),
        ("1.5", "whole number"),
    ],
)
def test_parse_size_refuses_bad_strings(text, words):
    with pytest.raises(ValueError) as err:
        parse_size(text)
    assert words in str(err.value) and repr(text) in str(err.value)


# -- the plan's parts against the runtime ------------------------------------------------


def test_block_sizes_follow_the_runtime():
    from runtime.engine import EngineConfig
    from runtime.model import ModelRunner

    assert budget.PREFILL_CHUNK == inspect.signature(ModelRunner.prefill).parameters["chunk"].default
    assert budget.DEFAULT_MAX_GAMMA == EngineConfig().max_gamma
    from edge_spec.manifest import ArchInfo

    arch = ArchInfo("llama", 2, 4, 2, 16, 64, 400, max_context=4096)
    assert budget.largest_block(arch, max_gamma=8) == budget.PREFILL_CHUNK  # prefill chunk beats γ+1
    assert budget.largest_block(arch, max_gamma=300) == 301  # a verify block of γ+1
    assert budget.largest_block(dataclasses.replace(arch, max_context=64)) == 64  # never past the context


def test_quantization_facts_follow_the_exporter():
    from export.bundle import LAYER_SKIP_PREFIX, ExportConfig
    from export.quantize import quantize_stage

    assert budget.DEFAULT_QUANT_BLOCK == ExportConfig("m", Path("o")).block_size == inspect.signature(quantize_stage).parameters["block_size"].default
    assert budget.LAYER_SKIP_PREFIX == LAYER_SKIP_PREFIX


def _engine(bundle: Path, drafter: str, **kwargs):
    from runtime.engine import Engine, EngineConfig

    return Engine(bundle, EngineConfig(provider="cpu", drafter=drafter, calibrate=False, **kwargs))


def test_kv_parts_equal_the_allocated_buffers(llama_bundle):
    manifest = load_manifest(llama_bundle)
    engine = _engine(llama_bundle, "model")
    plan = plan_bundle(manifest, llama_bundle, "model")
    assert plan.part("KV target") == engine.target.cache.nbytes > 0
    assert plan.part("KV draft") == engine.drafter.runner.cache.nbytes > 0
    arch = manifest.target.arch
    assert engine.target.cache.nbytes == arch.n_layers * 2 * arch.n_kv_heads * arch.max_context * arch.head_dim * 4

    engine = _engine(llama_bundle, "layer-skip")
    plan = plan_bundle(manifest, llama_bundle, "layer-skip")
    assert engine.drafter.runner.cache is engine.target.cache  # the layer-skip role owns no buffers
    assert plan.part("KV layer_skip") == 0 and plan.part("KV target") == engine.target.cache.nbytes


def test_plan_for_a_partial_context(llama_bundle):
    manifest = load_manifest(llama_bundle)
    full = plan_bundle(manifest, llama_bundle, "model")
    arch = manifest.target.arch
    quarter = plan_bundle(manifest, llama_bundle, "model", context=arch.max_context // 4)
    assert quarter.part("KV target") * 4 == full.part("KV target") and quarter.part("KV draft") * 4 == full.part("KV draft")
    assert quarter.part("workspace") == full.part("workspace") and quarter.context == arch.max_context // 4
    assert plan_bundle(manifest, llama_bundle, "model", context=10 * arch.max_context).total_bytes == full.total_bytes
    rc, out, _ = _main(["plan", llama_bundle, "--draft", "model", "--context", arch.max_context // 4, "--json"])
    assert rc == 0 and json.loads(out)["total_bytes"] == quarter.total_bytes


def _stage_bytes(bundle: Path, manifest, keys) -> int:
    return sum((bundle / f).stat().st_size for key in keys for f in (manifest.stages[key].file, *manifest.stages[key].data_files))


@pytest.mark.parametrize(
    "drafter, roles",
    [("none", ("target",)), ("lookup", ("target",)), ("model", ("target", "draft")), ("layer-skip", ("target", "layer_skip")), ("auto", ("target", "draft"))],
)
def test_plan_loads_the_drafters_roles(drafter, roles, llama_bundle):
    manifest = load_manifest(llama_bundle)
    assert manifest.default_draft == "draft"
    plan = plan_bundle(manifest, llama_bundle, drafter, budget=10**12)
    assert plan.roles == roles and plan.fits
    assert plan.total_bytes == sum(p.bytes for p in plan.parts)
    assert plan.part("runtime") == budget.RUNTIME_BYTES
    tokenizer = (llama_bundle / manifest.tokenizer.file).stat().st_size
    assert plan.part("tokenizer") == round(tokenizer * budget.TOKENIZER_FACTOR)
    # Weights on disk are exactly the files of the stages the roles run, each stage once.
    stages = {key for role in roles for key in manifest.models[role].stages}
    assert plan.stored_bytes == _stage_bytes(llama_bundle, manifest, stages)
    if "layer_skip" in roles:
        assert plan.part("weights layer_skip") == 0
        assert plan.stored_bytes == plan_bundle(manifest, llama_bundle, "none").stored_bytes
    if "draft" in roles:
        assert plan.part("weights draft") > 0


def test_plan_splits_stage_files_into_layers_head_and_embedding(llama_bundle):
    manifest = load_manifest(llama_bundle)
    arch = manifest.target.arch
    for key in manifest.models["target"].stages:
        stage = manifest.stages[key]
        weights = budget._stage_weights(manifest, llama_bundle, key, "fp32", arch)
        assert weights.stored == _stage_bytes(llama_bundle, manifest, [key])
        assert weights.embed == (arch.vocab_size * arch.hidden_size * 4 if stage.embed else 0)
        assert weights.head == (arch.vocab_size * arch.hidden_size * 4 if stage.head else 0)
        assert weights.layers > 0 if stage.layers else weights.layers < 4096  # a head-only graph: norm and graph bytes


def test_plan_refuses_a_role_the_bundle_lacks(llama_bundle):
    from edge_spec.manifest import BundleError

    manifest = load_manifest(llama_bundle)
    no_draft = dataclasses.replace(manifest, models={k: v for k, v in manifest.models.items() if k != "draft"}, default_draft="layer_skip")
    with pytest.raises(BundleError, match="has no 'draft' model"):
        plan_bundle(no_draft, llama_bundle, "model")
    assert plan_bundle(no_draft, llama_bundle, "auto").roles == ("target", "layer_skip")
    with pytest.raises(ValueError, match="unknown drafter 'fast'"):
        plan_bundle(manifest, llama_bundle, "fast")


def test_loaded_weight_factors():
    # MatMulNBits: data + 3x scales, the head one more scales' worth; the table only by use.
    w = budget.StoredWeights("int4", layers=625_000, head=62_500, embed=1_000_000)
    assert w.packed == round(687_500 * 1.4 + 62_500 * 0.2)
    assert w.embed_in_use(max_context=8) == 8 * budget.EMBED_BYTES_PER_POSITION
    assert w.embed_in_use(max_context=10**6) == 1_000_000
    assert budget.StoredWeights("int8", 1_125_000).packed == round(1_125_000 * 1.375 / 1.125)
    assert budget.StoredWeights("fp32", 4_000_000, 400_000).load_transient == 400_000
    assert budget.StoredWeights("int4", 0, 625_000).load_transient == 500_000  # the unpacked 4-bit data


# -- python -m runtime plan --------------------------------------------------------------


def _main(argv) -> tuple[int, str, str]:
    from runtime.__main__ import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = main([str(a) for a in argv])
        except SystemExit as exc:
            rc = exc.code
    return rc, out.getvalue(), err.getvalue()


def test_plan_cli_table_and_json(llama_bundle):
    expected = plan_bundle(load_manifest(llama_bundle), llama_bundle, "model")
    rc, out, _ = _main(["plan", llama_bundle, "--draft", "model"])
    assert rc == 0
    for name in ("runtime", "tokenizer", "weights target", "weights draft", "KV target", "KV draft", "logits", "workspace", "total"):
        assert name in out
    assert budget.format_size(expected.total_bytes) in out

    rc, out, _ = _main(["plan", llama_bundle, "--draft", "model", "--json", "--memory-budget", "1GiB"])
    data = json.loads(out)
    assert rc == 0 and data["fits"] is True and data["budget_bytes"] == 2**30
    assert data["total_bytes"] == expected.total_bytes == sum(p["bytes"] for p in data["parts"])
    assert data["roles"] == ["target", "draft"] and data["drafter"] == "model"

    rc, out, _ = _main(["plan", llama_bundle, "--draft", "model", "--json", "--memory-budget", str(expected.total_bytes - 1)])
    assert rc == 1 and json.loads(out)["fits"] is False
    rc, out, _ = _main(["plan", llama_bundle, "--draft", "model", "--memory-budget", str(expected.total_bytes - 1)])
    assert rc == 1 and "does NOT fit (over by 1 B)" in out
    rc, out, _ = _main(["plan", llama_bundle, "--draft", "lookup", "--memory-budget", str(expected.total_bytes - 1)])
    assert rc == 0  # the target alone fits where the pair does not


def test_plan_cli_bad_size(llama_bundle):
    rc, _, err = _main(["plan", llama_bundle, "--memory-budget", "3 bananas"])
    assert rc == 2 and "unknown unit 'bananas'" in err


# -- refusal before loading --------------------------------------------------------------


@pytest.fixture
def counted_sessions(monkeypatch):
    """Every ONNX Runtime session anyone tries to make is counted, then refused."""
    import onnxruntime

    made = []

    def refuse(*args, **kwargs):
        made.append(args)
        raise RuntimeError("a session was made")

    monkeypatch.setattr(onnxruntime, "InferenceSession", refuse)
    return made


def test_too_small_budget_refused_before_any_session(llama_bundle, counted_sessions):
    plan = plan_bundle(load_manifest(llama_bundle), llama_bundle, "model")
    with pytest.raises(BudgetError) as err:
        _engine(llama_bundle, "model", memory_budget=plan.total_bytes - 1)
    assert counted_sessions == []
    message = str(err.value)
    assert "is too small" in message and "KV draft" in message and "total" in message
    assert err.value.plan.total_bytes == plan.total_bytes
    # A budget the plan fits goes on to load: the first session is attempted.
    with pytest.raises(Exception):
        _engine(llama_bundle, "model", memory_budget=plan.total_bytes)
    assert len(counted_sessions) >= 1


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_refuses_too_small_budget_before_loading(command, llama_bundle, counted_sessions):
    extra = ["--prompt", "the cat"] if command == "generate" else ["--port", "0"]
    rc, out, err = _main([command, llama_bundle, "--provider", "cpu", "--draft", "model", "--memory-budget", "1MB", *extra])
    assert rc == 2 and counted_sessions == []
    assert err.startswith("error: memory budget 976.56 KiB is too small")
    assert "weights draft" in err and "does NOT fit" in err and "Traceback" not in err


# -- export --memory-budget --------------------------------------------------------------


@pytest.fixture(scope="module")
def facts(tiny_models):
    from export.bundle import model_facts

    return {str(tiny_models.llama): model_facts(str(tiny_models.llama)), str(tiny_models.draft): model_facts(str(tiny_models.draft))}


def test_predicted_weights_match_written_files(quant_bundles, tiny_models):
    from export.bundle import model_facts

    f = model_facts(str(tiny_models.llama_quant))
    assert (f.n_layers, f.hidden_size, f.intermediate_size, f.vocab_size) == (4, 64, 128, load_manifest(quant_bundles["fp32"]).target.arch.vocab_size)
    import onnx

    for quant, bundle in quant_bundles.items():
        manifest = load_manifest(bundle)
        data = sum((bundle / f).stat().st_size for s in manifest.stages.values() for f in s.data_files)
        # Tensors under 1 KiB (norm weights, biases, shape arguments) stay inside the graph files.
        for stage in manifest.stages.values():
            graph = onnx.load(str(bundle / stage.file), load_external_data=False).graph
            data += sum(len(t.raw_data) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
        predicted = f.weights(quant, manifest.target.arch.vocab_size).stored
        assert abs(predicted - data) <= 0.02 * data, (quant, predicted, data)


def test_a_larger_block_is_written_recorded_and_planned(tiny_models, tmp_path):
    """export --block-size 64: every MatMulNBits and GatherBlockQuantized node quantizes blocks
    of 64, the manifest records it, and the planner predicts the files from it (the default
    block's prediction would miss them)."""
    import onnx

    import tiny
    from export.bundle import model_facts

    bundle = tmp_path / "b64"
    tiny.export(tiny_models.llama_quant, bundle, quant="int4", block_size=64)
    manifest = load_manifest(bundle)
    assert manifest.target.block_size == 64
    blocks = []
    data = 0
    for stage in manifest.stages.values():
        data += sum((bundle / f).stat().st_size for f in stage.data_files)
        graph = onnx.load(str(bundle / stage.file), load_external_data=False).graph
        data += sum(len(t.raw_data) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
        blocks += [onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized") for a in n.attribute if a.name == "block_size"]
    assert blocks and set(blocks) == {64}
    f = model_facts(str(tiny_models.llama_quant))
    rows = manifest.target.arch.vocab_size
    assert abs(f.weights("int4", rows, 64).stored - data) <= 0.02 * data
    assert abs(f.weights("int4", rows).stored - data) > 0.05 * data
    # The written bundle's plan splits its files by the recorded block: its embedding is the 4-bit table at blocks of 64.
    weights = budget._stage_weights(manifest, bundle, "target", "int4", manifest.target.arch, None, manifest.target.block_size)
    assert weights.block == 64 and weights.embed == round(rows * f.hidden_size * (0.5 + 4 / 64))


def test_a_draft_block_of_its_own_is_written_recorded_and_planned(tiny_models, tmp_path):
    """export --draft-block-size 128: the draft model's nodes have blocks of 128, the target's
    keep the default, the manifest records each role's, and the plan prices the draft's files at
    its own block (the target's block would miss them), whole blocks: this draft's 64-wide rows
    fill half a block of 128."""
    import onnx

    import tiny
    from export.bundle import model_facts

    bundle = tmp_path / "d128"
    tiny.export(tiny_models.llama_quant, bundle, quant="int4", drafts=(str(tiny_models.draft),), draft_block_size=128)
    manifest = load_manifest(bundle)
    assert (manifest.target.block_size, manifest.models["draft"].block_size) == (32, 128)

    def written(role):
        data, blocks = 0, set()
        for key in manifest.models[role].stages:
            stage = manifest.stages[key]
            data += sum((bundle / f).stat().st_size for f in stage.data_files)
            graph = onnx.load(str(bundle / stage.file), load_external_data=False).graph
            data += sum(len(t.raw_data) for t in graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)
            blocks |= {onnx.helper.get_attribute_value(a) for n in graph.node if n.op_type in ("MatMulNBits", "GatherBlockQuantized") for a in n.attribute if a.name == "block_size"}
        return data, blocks

    assert written("target")[1] == {32}
    data, blocks = written("draft")
    assert blocks == {128}
    facts = {str(m): model_facts(str(m)) for m in (tiny_models.llama_quant, tiny_models.draft)}
    rows = manifest.models["draft"].arch.vocab_size
    assert abs(facts[str(tiny_models.draft)].weights("int4", rows, 128).stored - data) <= 0.02 * data
    assert abs(facts[str(tiny_models.draft)].weights("int4", rows).stored - data) > 0.05 * data
    # The export plan prices the draft at its own block, the target at the shared one.
    drafts = (str(tiny_models.draft),)
    own, shared = (budget.plan_export(facts[str(tiny_models.llama_quant)], "int4", 128, drafts, facts, draft_block=b) for b in (128, None))
    # (Here the draft's is the larger: half-empty blocks of 128 hold float32 scales for 64 weights.)
    assert own.part("weights draft") > shared.part("weights draft") and own.part("weights target") == shared.part("weights target")


def _attention() -> str:
    """The attention kind export writes by default (configs without the field write portable)."""
    from export.bundle import ExportConfig

    return getattr(ExportConfig("m", Path("o")), "attention", "portable")


def _export_plan(facts, model, quant, context, drafts):
    return budget.plan_export(facts[str(model)], quant, context, drafts, facts, attention=_attention())


def test_export_shortens_context_first(tiny_models, facts, tmp_path):
    from export.__main__ import main

    drafts = (str(tiny_models.draft), "layer-skip:1")
    full = _export_plan(facts, tiny_models.llama, "fp32", 2048, drafts)
    half = _export_plan(facts, tiny_models.llama, "fp32", 1024, drafts)
    assert half.total_bytes < full.total_bytes
    out = tmp_path / "b"
    args = [str(tiny_models.llama), "--out", str(out), "--quant", "fp32", "--max-context", "2048", "--json",
            "--draft", drafts[0], "--draft", drafts[1], "--memory-budget", str(half.total_bytes)]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        assert main(args) == 0
    assert "max context 1024 (asked 2048)" in stderr.getvalue()
    summary = json.loads(stdout.getvalue())
    assert summary["max_context"] == 1024 and summary["quant"] == "fp32"
    assert summary["memory"]["changes"] == ["max context 1024 (asked 2048)"]
    # The export's own peak memory: at least what this process holds now, read from the OS.
    import resource
    assert summary["peak_rss_bytes"] >= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 * 0.99
    assert "GiB peak] loading" in stderr.getvalue() and "s left" in stderr.getvalue()
    manifest = load_manifest(out)
    assert manifest.target.arch.max_context == 1024 and set(manifest.models) == {"target", "draft", "layer_skip"}
    # The prediction made before writing agrees with the plan of the files written.
    written = plan_bundle(manifest, out, "auto")
    assert abs(written.total_bytes - half.total_bytes) <= 0.02 * half.total_bytes
    data = sum((out / f).stat().st_size for s in manifest.stages.values() for f in s.data_files)  # weights, not graphs
    assert abs(data - half.stored_bytes) <= 0.02 * data


def test_export_drops_the_draft_model_after_the_context(tiny_models, facts):
    from export.bundle import ExportConfig, choose_for_budget

    drafts = (str(tiny_models.draft), "layer-skip:1")
    config = ExportConfig(str(tiny_models.llama), Path("unused"), "fp32", 1024, drafts)
    at_512 = _export_plan(facts, tiny_models.llama, "fp32", 512, drafts)
    lighter = _export_plan(facts, tiny_models.llama, "fp32", 1024, drafts[1:])
    # A budget both fit: the context goes before the draft model.
    choice = choose_for_budget(config, max(at_512.total_bytes, lighter.total_bytes))
    assert (choice.max_context, choice.drafts, choice.quant) == (512, drafts, "fp32")
    # Below every context with the draft model: the draft model goes, and the context is the
    # longest that fits without it, from the requested one down again.
    limit = at_512.total_bytes - 1
    lighter_512 = _export_plan(facts, tiny_models.llama, "fp32", 512, drafts[1:])
    assert lighter_512.total_bytes <= limit
    choice = choose_for_budget(config, limit)
    context = 1024 if lighter.total_bytes <= limit else 512
    assert (choice.max_context, choice.drafts, choice.quant) == (context, drafts[1:], "fp32")
    assert choice.changes[-1] == "no draft model (" + drafts[0] + " dropped; drafts by layer-skip:1)"
    # Without a layer-skip draft, dropping the draft model leaves prompt lookup.
    solo_512 = _export_plan(facts, tiny_models.llama, "fp32", 512, drafts[:1])
    choice = choose_for_budget(dataclasses.replace(config, drafts=drafts[:1]), solo_512.total_bytes - 1)
    assert choice.drafts == () and "drafts by prompt lookup" in choice.summary()


def test_export_lowers_precision_last(tmp_path):
    import tiny
    from export.bundle import ExportConfig, choose_for_budget, model_facts

    # Wide enough that weights, not the runtime, decide: 4 layers of hidden 512, 8400 tokens.
    folder = tiny.make_llama(tmp_path / "wide", tiny.make_tokenizer("a"), n_layers=4, hidden=512, extra_rows=8000)
    f = {str(folder): model_facts(str(folder))}
    config = ExportConfig(str(folder), Path("unused"), "fp32", 1024, ())
    int8 = budget.plan_export(f[str(folder)], "int8", 1024, (), f, attention=_attention())
    for quant in ("fp32", "fp16"):
        assert budget.plan_export(f[str(folder)], quant, 512, (), f, attention=_attention()).total_bytes > int8.total_bytes
    choice = choose_for_budget(config, int8.total_bytes)
    assert (choice.quant, choice.max_context) == ("int8", 1024)
    assert choice.changes == ("int8 weights (asked fp32)",)


def test_export_refuses_when_nothing_fits(tiny_models, tmp_path):
    from export.__main__ import main

    out = tmp_path / "b"
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        rc = main([str(tiny_models.llama), "--out", str(out), "--quant", "fp32", "--draft", str(tiny_models.draft), "--memory-budget", "50MB"])
    assert rc == 2 and not out.exists()
    text = stderr.getvalue()
    assert text.startswith("error: nothing fits a memory budget of 47.68 MiB: even int4 weights, max context 512")
    assert "weights target" in text and "total" in text


def test_export_bad_budget_string(tiny_models, tmp_path):
    from export.__main__ import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), pytest.raises(SystemExit) as exit_:
        main([str(tiny_models.llama), "--out", str(tmp_path / "b"), "--memory-budget", "3 GBs"])
    assert exit_.value.code == 2 and "unknown unit 'GBs'" in stderr.getvalue()


def test_serve_parallel_plans_memory_with_the_gamma_the_engine_runs(llama_bundle, monkeypatch):
    """γ declared once: `serve --parallel` checks memory before loading for the max_gamma its engine
    will run (a fixed --gamma above --max-gamma raises it), not for --max-gamma as typed."""
    import runtime.engine
    from runtime import __main__ as cli

    seen = {}

    class Loaded(Exception):
        pass

    class Engine:
        def __init__(self, bundle, config):
            seen["runs"] = config.max_gamma
            raise Loaded

    monkeypatch.setattr(budget, "check_parallel", lambda *args: seen.setdefault("planned", args[-1]))
    monkeypatch.setattr(runtime.engine, "Engine", Engine)
    with pytest.raises(Loaded):
        cli.main(["serve", str(llama_bundle), "--parallel", "2", "--memory-budget", "64GB", "--gamma", "12", "--max-gamma", "8",
                  "--draft", "layer-skip", "--port", "0"])
    assert seen == {"planned": 12, "runs": 12}
