"""Layer-skip drafts over a subset of the target's layers (issue 37): the spec forms, the search
that chooses the subset (layer-skip:auto), the cut bundle, and exactness through the runtime.

Two tiny 7-layer llamas: one whose layers 2 and 4 leave the residual stream unchanged (their
o_proj and down_proj zeroed, as a checkpoint trained for early exit would nearly do), which the
search must find skippable with α = 1; and a plain random one for an explicit subset.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tiny
from edge_spec import layer_subset as ls
from edge_spec.manifest import BundleError, LayerCandidate, LayerSearch, load_manifest, manifest_from_dict, validate
from runtime.engine import Engine, EngineConfig, GenerateConfig

ZEROED = (2, 4)  # the early-exit model's layers that change nothing
SEARCH_TOKENS = 64


def _export(folder: Path, out: Path, drafts: tuple[str, ...], attention: str | None = None):
    from export.bundle import ExportConfig, export_bundle

    config = ExportConfig(model=str(folder), out=out, quant="fp32", max_context=tiny.MAX_CONTEXT, drafts=drafts, attention=attention,
                          layer_search_tokens=SEARCH_TOKENS)
    return export_bundle(config, log=lambda message: None)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    import torch
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("subset_models")
    tok = tiny.make_tokenizer("a")
    early = tiny.make_llama(root / "early_exit", tok, n_layers=7, seed=11)
    model = AutoModelForCausalLM.from_pretrained(str(early)).eval()
    with torch.no_grad():
        for i in ZEROED:
            model.model.layers[i].self_attn.o_proj.weight.zero_()
            model.model.layers[i].mlp.down_proj.weight.zero_()
    model.save_pretrained(early)
    return {"early_exit": early, "random": tiny.make_llama(root / "random", tok, n_layers=7, seed=12)}


@pytest.fixture(scope="module")
def auto_bundle(folders, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("subset_bundles") / "auto"
    _export(folders["early_exit"], out, ("layer-skip:auto",))
    return out


SUBSET = "layer-skip:0,2-3,5-6"  # skips layer 1 and layer 4: a kept segment between two skipped runs


@pytest.fixture(scope="module", params=["fused", "portable"])
def subset_bundle(request, folders, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("subset_bundles") / f"subset-{request.param}"
    _export(folders["random"], out, (SUBSET,), attention=request.param)
    return out


def _engine(bundle, drafter="none", gamma=None, block_stable=False) -> Engine:
    return Engine(bundle, EngineConfig(drafter=drafter, gamma=gamma, calibrate=False, block_stable=block_stable))


# -- the spec -----------------------------------------------------------------------------------


def test_spec_forms():
    assert ls.parse("layer-skip:3", 7).kept == (0, 1, 2)
    assert ls.parse("layer-skip:0-9,14-20,24-27", 28).kept == (*range(10), *range(14, 21), *range(24, 28))
    assert ls.parse("layer-skip:0,2-3,5-6", 7).kept == (0, 2, 3, 5, 6)
    assert ls.parse("layer-skip:auto", 7).auto and ls.parse("layer-skip:auto").kept is None
    assert ls.describe((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert ls.parse("layer-skip:" + ls.describe((0, 1, 2, 5, 7, 8)), 10).kept == (0, 1, 2, 5, 7, 8)


@pytest.mark.parametrize("spec,n_layers,words", [
    ("layer-skip:7", 7, "between 1 and 6"),
    ("layer-skip:0", None, "between 1"),
    ("layer-skip:2-5", 7, "keep layer 0"),
    ("layer-skip:0-3,2-5", 7, "ascending order without overlap"),
    ("layer-skip:0,x", 7, "'x' is not a layer"),
    ("layer-skip:0-6", 7, "keeps all 7 layers"),
    ("layer-skip:0-8", 7, "past the model's last layer 6"),
    ("layer-skip:0,2,4,6,8", 10, "5 skipped runs; at most 3"),
    ("layer-skip:fast", 7, "'fast' is not a layer"),
])
def test_spec_refusals(spec, n_layers, words):
    with pytest.raises(ls.LayerSpecError, match=words.replace("(", r"\(")) as caught:
        ls.parse(spec, n_layers)
    assert "\n" not in str(caught.value)


def test_segments_cut_at_the_skipped_runs():
    assert ls.segments((0, 2, 3, 5, 6), 7) == [(range(0, 1), True), (range(1, 2), False), (range(2, 4), True), (range(4, 5), False), (range(5, 7), True)]
    assert ls.segments((0, 1, 2), 7) == [(range(0, 3), True), (range(3, 7), False)]  # layer-skip:3: trunk and rest, as before
    assert ls.skipped_runs((0, 2, 3, 5, 6), 7) == [range(1, 2), range(4, 5)]


def test_the_least_influential_layers_form_few_runs_and_spare_the_ends():
    from export.layer_search import least_influential

    influence = [0.0, 0.1, 0.9, 0.1, 0.9, 0.1, 0.9, 0.1, 0.0]
    assert least_influential(influence, 2, 3) == (1, 3)
    assert least_influential(influence, 4, 3) is not None and 0 not in least_influential(influence, 4, 3)
    # One run only: the cheapest contiguous pair, never the first or last layer.
    assert least_influential(influence, 2, 1) in ((1, 2), (2, 3), (3, 4), (4, 5), (5, 6), (6, 7))
    assert least_influential(influence, 3, 1) == (1, 2, 3)
    assert least_influential(influence, 8, 3) is None  # layers 0 and 8 are never skipped


def test_speedup_model():
    assert ls.expected_tokens(1.0, 3) == 4.0
    assert ls.expected_tokens(0.5, 1) == pytest.approx(1.5)
    flat, cpu = ls.verify_curve("flat"), ls.verify_curve("cpu")
    assert flat[0] == cpu[0] == 1.0 and cpu[3] == pytest.approx(2.2)  # a 4-row pass: 2.1-2.5 one-row passes measured
    speedup, gamma = ls.best_speedup(0.9, 0.3, flat)
    assert speedup > 1.5 and gamma > 1
    assert ls.best_speedup(0.9, 0.3, cpu)[0] < speedup  # the same α pays less where the verify pass grows
    assert ls.best_speedup(0.0, 0.3, flat)[0] < 1.0
    with pytest.raises(ls.LayerSpecError, match="never fall"):
        ls.verify_curve("1,2,1,2,3,4,5,6,7")


# -- the search ------------------------------------------------------------------------------------


def test_auto_finds_the_layers_that_change_nothing(auto_bundle):
    manifest = load_manifest(auto_bundle)
    skip = manifest.models["layer_skip"]
    search = skip.layer_search
    kept = tuple(i for i in range(7) if i not in ZEROED)
    assert search.chosen == ls.describe(kept) == "0-1,3,5-6"
    assert search.influence[2] == search.influence[4] == 0.0 and min(search.influence[i] for i in kept) > 0
    for candidate in search.candidates:
        skipped = set(range(7)) - set(ls.parse(ls.PREFIX + candidate.kept, 7).kept)
        # α = 1 exactly where only zeroed layers are skipped.
        assert (candidate.alpha == 1.0) == (skipped <= set(ZEROED)), candidate
    assert search.tokens == SEARCH_TOKENS and len(search.calibration_sha256) == 64 and "standard library" in search.calibration
    assert search.verify_curve == ls.verify_curve("cpu")
    assert skip.stages == ("target.trunk", "target.s2", "target.s4", "target.head") and skip.arch.n_layers == 5
    assert manifest.target.stages == ("target.trunk", "target.s1", "target.s2", "target.s3", "target.s4", "target.head")
    assert "chosen by layer-skip:auto" in skip.source


def test_search_that_ignored_the_skip_would_choose_otherwise(folders, monkeypatch):
    """The auto test's teeth: with the identity replacement undone (every candidate runs the whole
    model), every candidate agrees fully and the search keeps fewer layers than the zeroed ones allow."""
    import contextlib

    import export.layer_search as search_module
    from export.layer_search import SearchConfig, search

    model, tok = tiny.load_hf(folders["early_exit"])
    kept, record = search(model, tok, SearchConfig(tokens=SEARCH_TOKENS), lambda m: None)
    assert record.chosen == "0-1,3,5-6"
    monkeypatch.setattr(search_module, "_Skipping", lambda *args: contextlib.nullcontext())
    kept, record = search(model, tok, SearchConfig(tokens=SEARCH_TOKENS), lambda m: None)
    assert all(c.alpha == 1.0 for c in record.candidates)
    assert record.chosen != "0-1,3,5-6" and len(kept) < 5


def test_early_exit_draft_is_accepted_in_full(auto_bundle):
    ids = _engine(auto_bundle).encode(prompt=tiny.PROMPT)
    plain = _engine(auto_bundle).generate(ids, GenerateConfig(max_new_tokens=30)).token_ids
    result = _engine(auto_bundle, "layer-skip", 3).generate(ids, GenerateConfig(max_new_tokens=30))
    assert result.token_ids == plain
    assert result.stats["drafted_tokens"] > 0 and result.stats["accepted_tokens"] == result.stats["drafted_tokens"]


def test_catalog_layerskip_checkpoints_default_to_their_exit_layer(folders, tmp_path, monkeypatch):
    from edge_spec import catalog
    from export.bundle import default_drafts

    for alias in ("layerskip-llama3.2-1b", "layerskip-llama3-8b", "layerskip-llama2-7b", "layerskip-codellama-7b"):
        entry = catalog.CATALOG[alias]
        assert entry.hub_id.startswith("facebook/layerskip-") and ls.parse(entry.default_draft).kept
    # A catalog entry of this kind loads through the same path: its alias, its default draft.
    entry = catalog.CatalogEntry("tiny-layerskip", str(folders["early_exit"]), None, "layer-skip:2")
    monkeypatch.setitem(catalog.CATALOG, "tiny-layerskip", entry)
    assert default_drafts("tiny-layerskip") == ("layer-skip:2",)
    from export.bundle import ExportConfig, export_bundle

    manifest = export_bundle(ExportConfig(model="tiny-layerskip", out=tmp_path / "b", quant="fp32", max_context=tiny.MAX_CONTEXT,
                                          drafts=default_drafts("tiny-layerskip")), log=lambda m: None)
    assert manifest.models["layer_skip"].stages == ("target.trunk", "target.head") and manifest.models["layer_skip"].arch.n_layers == 2


# -- the cut bundle and the runtime ----------------------------------------------------------------------


def test_subset_bundle_shares_every_weight(subset_bundle):
    manifest = load_manifest(subset_bundle)
    target, skip = manifest.target, manifest.models["layer_skip"]
    assert target.stages == ("target.trunk", "target.s1", "target.s2", "target.s3", "target.s4", "target.head")
    assert skip.stages == ("target.trunk", "target.s2", "target.s4", "target.head") and skip.arch.n_layers == 5
    assert skip.layer_search is None and skip.source.startswith("layer skip: layers 0,2-3,5-6 of 7")
    stage_files = {f for s in manifest.stages.values() for f in (s.file, *s.data_files)}
    assert {p.name for p in subset_bundle.iterdir()} == stage_files | {"manifest.json", "tokenizer.json"}
    engine = _engine(subset_bundle, "layer-skip", 3)
    runner = engine.drafter.runner
    assert runner.cache is engine.target.cache
    assert [s for s in runner.sessions] == [engine.target.sessions[i] for i in (0, 2, 4, 5)]


def test_subset_plan_adds_no_weights(subset_bundle):
    from edge_spec.budget import plan_bundle

    manifest = load_manifest(subset_bundle)
    skip, plain = plan_bundle(manifest, subset_bundle, "layer-skip"), plan_bundle(manifest, subset_bundle, "none")
    assert skip.part("weights layer_skip") == 0 and skip.part("KV layer_skip") == 0
    assert skip.part("weights target") == plain.part("weights target") and skip.stored_bytes == plain.stored_bytes


def test_export_plan_reads_every_form(folders):
    from edge_spec.budget import plan_export
    from export.bundle import model_facts

    facts = model_facts(str(folders["random"]))
    plans = {spec: plan_export(facts, "fp32", 64, (spec,), {}) for spec in ("layer-skip:3", SUBSET, "layer-skip:auto")}
    for plan in plans.values():
        assert plan.part("weights layer_skip") == 0 and plan.part("KV layer_skip") == 0
    # The stages share one arena: a subset's extra sessions add no workspace.
    assert len({plan.part("workspace") for plan in plans.values()}) == 1
    assert "one arena for 5 session(s)" in next(p.note for p in plans[SUBSET].parts if p.name == "workspace")
    with pytest.raises(ls.LayerSpecError, match="keep layer 0"):
        plan_export(facts, "fp32", 64, ("layer-skip:1-3",), {})


def test_verify_overwrites_the_rows_the_draft_wrote(subset_bundle):
    """The draft writes KV rows of the later kept layers (2, 3, 5, 6) computed without layers 1
    and 4; the verify pass recomputes those stages for every row it scores, so afterwards the
    cache and the logits are those of a target pass that never saw a draft."""
    from edge_spec.sampling import SamplingConfig

    drafting, plain = _engine(subset_bundle, "layer-skip", 3), _engine(subset_bundle)
    ids = drafting.encode(prompt=tiny.PROMPT)
    for engine in (drafting, plain):
        engine.target.cache.reset()
        engine.target.prefill(ids[:-1])
    start = drafting.target.cache.kv_len
    proposal = drafting.drafter.propose(np.asarray(ids), 3, SamplingConfig(), np.random.default_rng(0))
    block = [ids[-1], *proposal.tokens[:-1]]
    reference = plain.target.forward(block)
    rows = slice(start, start + len(block) - 1)
    later = (2, 3, 5, 6)

    def keys(engine, layer):
        return np.asarray(engine.target.cache.keys[layer])[0, :, rows]

    # Before verifying, the draft's rows of the later kept layers differ from the target's (layer 1 was skipped).
    assert not np.allclose(keys(drafting, 2), keys(plain, 2), atol=1e-3)
    logits = drafting.target.forward(block, trunk_hidden=proposal.trunk_hidden[:, : len(block) - 1])
    np.testing.assert_allclose(logits, reference, atol=1e-4)
    for layer in (0, *later):
        np.testing.assert_allclose(keys(drafting, layer), keys(plain, layer), atol=1e-4)


@pytest.mark.parametrize("block_stable", [False, True], ids=["plain", "block-stable"])
def test_subset_greedy_equals_plain(subset_bundle, block_stable):
    ids = _engine(subset_bundle).encode(prompt=tiny.PROMPT)
    config = GenerateConfig(max_new_tokens=30)
    plain = _engine(subset_bundle, block_stable=block_stable).generate(ids, config, speculative=False).token_ids
    for gamma in (1, 3):
        result = _engine(subset_bundle, "layer-skip", gamma, block_stable=block_stable).generate(ids, config)
        assert result.token_ids == plain
        assert result.stats["drafted_tokens"] > 0


@pytest.mark.law
def test_audit_passes_on_a_subset_draft(subset_bundle):
    prompt = "the cat sat on the mat the cat sat on the"
    result = subprocess.run([sys.executable, "-m", "runtime", "audit", str(subset_bundle), "--prompt", prompt, "--temperature", "1.0",
                             "--draft", "layer-skip", "--gamma", "3", "--samples", "1500", "--positions", "2", "--json"],
                            capture_output=True, text=True, timeout=600)
    report = json.loads(result.stdout)
    assert report["samples_drafted"] == 1500 and report["rejections"] > 0, report
    assert report["verdict"] == "PASS" and result.returncode == 0, report


# -- the manifest ------------------------------------------------------------------------------------


def _search_record(chosen="0-1,3,5-6") -> LayerSearch:
    return LayerSearch("text", "0" * 64, 64, (0.5,) * 7, ls.verify_curve("cpu"), 0.02,
                       (LayerCandidate("0-1,3,5-6", 1.0, 0.8, 1, 0.85), LayerCandidate("0-3,5-6", 1.0, 0.9, 1, 0.8)), chosen)


def test_layer_search_round_trips_through_json(auto_bundle):
    manifest = load_manifest(auto_bundle)
    again = manifest_from_dict(json.loads(manifest.to_json()))
    assert again == manifest and isinstance(again.models["layer_skip"].layer_search.candidates[0], LayerCandidate)
    with pytest.raises(BundleError, match="chosen 'x' is none of its candidates"):
        _search_record("x")
    with pytest.raises(BundleError, match="alpha must be in"):
        LayerCandidate("0-2", 1.5, 0.5, 1, 1.0)


def test_manifest_refuses_a_draft_running_the_target_out_of_order(subset_bundle):
    manifest = load_manifest(subset_bundle)
    skip = manifest.models["layer_skip"]
    shuffled = dataclasses.replace(skip, stages=("target.trunk", "target.s4", "target.s2", "target.head"))
    with pytest.raises(BundleError, match="starts at layer 2, expected 7"):
        validate(dataclasses.replace(manifest, models={**manifest.models, "layer_skip": shuffled}), subset_bundle, check_hashes=False)
    wrong_count = dataclasses.replace(skip, arch=dataclasses.replace(skip.arch, n_layers=4))
    with pytest.raises(BundleError, match="stages run 5 layers, arch says 4"):
        validate(dataclasses.replace(manifest, models={**manifest.models, "layer_skip": wrong_count}), subset_bundle, check_hashes=False)
    owned = dataclasses.replace(manifest.target, layer_search=_search_record())
    with pytest.raises(BundleError, match="only a layer-skip draft"):
        validate(dataclasses.replace(manifest, models={**manifest.models, "target": owned}), subset_bundle, check_hashes=False)


# -- the CLI refuses before loading --------------------------------------------------------------------


@pytest.mark.parametrize("extra,words", [
    (["--draft", "layer-skip:2-5"], "keep layer 0"),
    (["--draft", "layer-skip:0-9"], "past the model's last layer 6"),
    (["--draft", "layer-skip:auto", "--layer-search-tokens", "5"], "--layer-search-tokens 5"),
    (["--draft", "layer-skip:auto", "--verify-curve", "gpu"], "verify curve 'gpu'"),
])
def test_export_cli_refuses_bad_layer_skip_specs(folders, tmp_path, extra, words):
    result = subprocess.run([sys.executable, "-m", "export", str(folders["random"]), "--out", str(tmp_path / "b"), "--quant", "fp32", *extra],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert not (tmp_path / "b").exists()


def test_phone_packaging_takes_a_portable_subset_draft(subset_bundle):
    """The Kotlin core runs a subset draft's kept stages (its golden traces replay one), so packaging
    takes a portable subset bundle with no file of its own for the draft and KV for the target
    only, and refuses a fused one for its attention, as any fused bundle."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "android_bridge" / "tools"))
    import package_bundle as pb

    if subset_bundle.name.endswith("fused"):
        with pytest.raises(pb.PackageError, match="fused-attention stages"):
            pb.plan(subset_bundle, ["layer_skip", "target"])
        return
    both, alone = pb.plan(subset_bundle, ["layer_skip", "target"]), pb.plan(subset_bundle, ["target"])
    manifest = both["manifest"]
    assert {manifest.stages[key].file for key in manifest.models["layer_skip"].stages} <= set(alone["files"])
    assert (both["files"], both["weight_bytes"], both["kv_bytes"]) == (alone["files"], alone["weight_bytes"], alone["kv_bytes"])


def _config_entry(session, key: str) -> str | None:
    try:
        return session.get_session_options().get_session_config_entry(key)
    except RuntimeError:  # ORT raises for a key never set
        return None


def test_a_cut_target_shares_one_arena(subset_bundle, folders, tmp_path):
    """The CPU sessions of a cut target take their activations from one arena (one stage's peak,
    as the plan counts); an uncut target's keep one each, ONNX Runtime's default."""
    from edge_spec.budget import one_arena, plan_bundle

    uncut = tmp_path / "uncut"
    _export(folders["random"], uncut, ())
    for bundle, shared in ((subset_bundle, True), (uncut, False)):
        manifest = load_manifest(bundle)
        assert one_arena(manifest) is shared
        engine = _engine(bundle)
        entries = {_config_entry(s, "session.use_env_allocators") for s in engine.target.sessions}
        assert entries == ({"1"} if shared else {None}), entries
        note = next(p.note for p in plan_bundle(manifest, bundle, "none").parts if p.name == "workspace")
        assert ("one arena" in note) is shared, note
