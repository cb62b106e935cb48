"""A trimmed draft LM head (export --draft-vocab N): the draft scores only its N most frequent
tokens, the runtime puts those logits back at their ids with -inf elsewhere, and speculation
stays exact: greedy output is plain's, sampled output follows the target's law (the residual
covers the dropped tokens' mass), with the verifier unchanged."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import tests.test_loop_sampling as loop_sampling
import tiny
from edge_spec import manifest as mf
from edge_spec.budget import ModelFacts, _stage_weights, plan_bundle, plan_export
from edge_spec.sampling import SamplingConfig, process_logits, sample
from runtime import audit
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.engine import Engine, EngineConfig, GenerateConfig
from runtime.model import full_vocab_logits
from tests.test_loop_toy import VOCAB, ToyLM, ToyRunner

KEPT = 120  # of the tiny tokenizer's 400


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(tiny._corpus(tiny._WORDS_A, 200, seed=4)))
    return path


@pytest.fixture(scope="module")
def pair(tmp_path_factory, tiny_models, corpus):
    """The llama target with its 2-layer draft, exported with the draft head whole and trimmed."""
    from export.bundle import ExportConfig, export_bundle

    root = tmp_path_factory.mktemp("trimmed")
    bundles = {}
    for name, vocab in (("full", None), ("trimmed", KEPT)):
        config = ExportConfig(str(tiny_models.llama), root / name, "fp32", tiny.MAX_CONTEXT, (str(tiny_models.draft),),
                              draft_vocab=vocab, draft_vocab_from=(str(corpus),))
        export_bundle(config, log=lambda message: None)
        bundles[name] = root / name
    return bundles


def _kept(bundle: Path) -> np.ndarray:
    manifest = mf.load_manifest(bundle)
    return mf.load_head_tokens(bundle, manifest, "draft")


def test_manifest_records_the_kept_tokens(pair, corpus, tiny_models):
    manifest = mf.load_manifest(pair["trimmed"])
    trimmed = manifest.models["draft"].trimmed_head
    assert trimmed.rows == KEPT and trimmed.file == "draft.head_tokens.npy" and str(corpus) in trimmed.counted_from
    assert manifest.models["target"].trimmed_head is None and mf.load_manifest(pair["full"]).models["draft"].trimmed_head is None
    kept = set(_kept(pair["trimmed"]).tolist())
    _, tok = tiny.load_hf(tiny_models.llama)
    assert {tok.convert_tokens_to_ids(t) for t in tiny.SPECIAL_TOKENS} <= kept  # every added token, EOS and BOS
    # The most frequent corpus token is kept, and the graph's logits are KEPT wide.
    counts = np.bincount(tok(corpus.read_text(), add_special_tokens=False).input_ids, minlength=len(tok))
    assert int(np.argmax(counts)) in kept
    import onnx

    graph = onnx.load(str(pair["trimmed"] / "draft.onnx"), load_external_data=False).graph
    assert graph.output[0].type.tensor_type.shape.dim[-1].dim_value == KEPT


def test_trimmed_logits_are_the_untrimmed_on_kept_rows_and_minus_inf_elsewhere(pair, tiny_models):
    kept = _kept(pair["trimmed"])
    engines = {name: Engine(path, EngineConfig(drafter="model", gamma=3, calibrate=False)) for name, path in pair.items()}
    ids = engines["full"].encode(prompt=tiny.PROMPT)
    logits = {}
    for name, engine in engines.items():
        runner = engine.drafter.runner
        runner.cache.reset()
        logits[name] = runner.forward(ids)  # [T, V]
    vocab = mf.load_manifest(pair["full"]).models["draft"].arch.vocab_size
    assert logits["trimmed"].shape == logits["full"].shape == (len(ids), vocab)
    np.testing.assert_allclose(logits["trimmed"][:, kept], logits["full"][:, kept], atol=1e-5, rtol=1e-5)
    dropped = np.setdiff1d(np.arange(vocab), kept)
    assert np.isneginf(logits["trimmed"][:, dropped]).all()
    # The target is untouched: same logits from both bundles.
    for engine in engines.values():
        engine.target.cache.reset()
    np.testing.assert_array_equal(engines["trimmed"].target.forward(ids), engines["full"].target.forward(ids))


@pytest.mark.parametrize("drafter,gamma", [("model", 3), ("model", None), ("auto", 2)])
def test_greedy_speculation_with_a_trimmed_draft_equals_plain(pair, drafter, gamma):
    plain = Engine(pair["trimmed"], EngineConfig(drafter="none", calibrate=False))
    spec = Engine(pair["trimmed"], EngineConfig(drafter=drafter, gamma=gamma, calibrate=False))
    kept = set(_kept(pair["trimmed"]).tolist())
    for prompt in (tiny.PROMPT, "print def return import class self value"):
        ids = plain.encode(prompt=prompt)
        want = plain.generate(ids, GenerateConfig(max_new_tokens=24)).token_ids
        got = spec.generate(ids, GenerateConfig(max_new_tokens=24))
        assert got.token_ids == want
        assert gamma is None or sum(drafted for drafted, _ in got.rounds) > 0  # adaptive γ may switch a slow draft off
    # Greedy drafting proposes the argmax among the kept rows only.
    runner = spec.drafter.runner if drafter == "model" else spec.drafter.parts()[1].runner
    runner.cache.reset()
    assert int(np.argmax(runner.forward(ids)[-1])) in kept


@pytest.mark.law
def test_audit_passes_on_a_trimmed_draft(pair):
    """Sampling through the ONNX bundle: the first two tokens follow the target's law."""
    result = subprocess.run(
        [sys.executable, "-m", "runtime", "audit", str(pair["trimmed"]), "--prompt", "the cat sat on the", "--temperature", "1.0",
         "--draft", "model", "--gamma", "3", "--samples", "1500", "--positions", "2", "--json"],
        capture_output=True, text=True, timeout=600,
    )
    report = json.loads(result.stdout)
    assert report["samples_drafted"] == 1500 and report["rejections"] > 0, report
    assert report["verdict"] == "PASS" and result.returncode == 0, report


# -- the law under sampling, on the loop's toy models ---------------------------------------------

_P1 = process_logits(ToyLM(5).logits(loop_sampling.PROMPT), SamplingConfig(1.0))
# The draft never names the target's second and third choices after the prompt (0.29 and 0.07 of
# p at T = 1) nor 13 other tokens: only the residual can emit them.
_FAVOURED = [int(t) for t in np.argsort(-_P1)[1:3]]
_OTHERS = [int(t) for t in np.random.default_rng(3).permutation(np.setdiff1d(np.arange(VOCAB), np.argsort(-_P1)[:3]))[:13]]
TOY_KEPT = np.setdiff1d(np.arange(VOCAB), _FAVOURED + _OTHERS)


class TrimmedRunner(ToyRunner):
    """The noisy toy draft with a head of TOY_KEPT rows, mapped back by the runtime's function."""

    def __init__(self, lm: ToyLM):
        super().__init__(lm)
        self.untrimmed = None  # the last rows before trimming, for the wrong drafter below

    def forward(self, token_ids, n_logits=None, trunk_hidden=None):
        self.untrimmed = super().forward(token_ids, n_logits, trunk_hidden)  # [N, V]
        return full_vocab_logits(self.untrimmed[:, TOY_KEPT], TOY_KEPT, VOCAB)


@pytest.fixture
def trimmed_draft(monkeypatch):
    runners = []

    def make(kind, lm):
        runners.append(TrimmedRunner(loop_sampling.NoisyLM(lm)))
        return loop_sampling.ToyRunner(lm), DraftModelDrafter(runners[-1])

    monkeypatch.setattr(loop_sampling, "_target_and_drafter", make)
    return runners


@pytest.mark.law
@pytest.mark.parametrize("config,gamma", [("T1", 3), ("T0.9-topp0.8", 1), ("T0.7-topk20", 3)])
def test_trimmed_draft_samples_follow_the_target_law(trimmed_draft, config, gamma):
    sampling = loop_sampling.CONFIGS[config]
    samples, run, lm = loop_sampling.loop_samples("model", sampling, gamma)
    assert not np.isin(samples[:, 0], TOY_KEPT).all()  # the residual emitted tokens the draft cannot name
    audit_config = audit.AuditConfig(loop_sampling.SAMPLES, loop_sampling.POSITIONS, loop_sampling.ALPHA, seed=1)
    report = audit.audit_exact(samples, run, loop_sampling.exact_law(lm, samples, sampling), audit_config, "model", str(gamma))
    assert report.exercised, report.lines()
    assert report.passed, report.lines()


@pytest.mark.law
def test_q_over_the_untrimmed_support_fails_the_test(trimmed_draft, monkeypatch):
    """Tokens drawn among the kept rows, but the verifier handed the untrimmed draft's q, which
    puts mass on the dropped tokens: the law is wrong and the audit must see it."""
    import runtime.drafters.draft_model as draft_model

    def pick(logits, sampling, rng):
        untrimmed = trimmed_draft[-1].untrimmed[-1]
        return sample(process_logits(logits, sampling), rng), process_logits(untrimmed, sampling)

    monkeypatch.setattr(draft_model, "pick_token", pick)
    report = loop_sampling.run_audit("model", loop_sampling.CONFIGS["T1"], 3)
    assert report.exercised
    assert not report.passed, report.lines()


# -- refusals ----------------------------------------------------------------------------------


def _export_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "export", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def weightless(tmp_path_factory, tiny_models) -> tuple[Path, Path]:
    """The tiny pair without weight files: a refusal that loaded weights would fail otherwise."""
    root = tmp_path_factory.mktemp("weightless")
    folders = []
    for src in (tiny_models.llama, tiny_models.draft):
        dest = root / src.name
        shutil.copytree(src, dest, ignore=shutil.ignore_patterns("*.safetensors"))
        folders.append(dest)
    return folders[0], folders[1]


@pytest.mark.parametrize("extra,message", [
    (["--draft-vocab", "0"], "--draft-vocab 0: give a positive number of tokens (suggested 32768)"),
    (["--draft-vocab", "100000"], "--draft-vocab 100000 is more than the"),
    (["--draft-vocab", "64", "--draft", "layer-skip:1"], "trims a draft model's LM head: add --draft MODEL"),
])
def test_bad_draft_vocab_exits_2_before_weights_load(weightless, tmp_path, extra, message):
    target, draft = weightless
    drafts = [] if "--draft" in extra else ["--draft", str(draft)]
    result = _export_cli(str(target), "--out", str(tmp_path / "b"), "--quant", "fp32", *drafts, *extra)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


@pytest.mark.parametrize("vocab,drafts,sources,message", [
    (-5, "model", ("docs",), "--draft-vocab -5: give a positive number"),
    (True, "model", ("docs",), "--draft-vocab True: give a positive number"),
    (64, "none", ("docs",), "trims a draft model's LM head"),
    (3, "model", ("docs",), "smaller than the 6 special and EOS tokens"),
    (64, "model", ("/no/such/text",), "no such file or folder"),
    (64, "model", (), "names no source"),
])
def test_bad_draft_vocab_is_refused_before_weights_load(weightless, tmp_path, vocab, drafts, sources, message):
    from export.bundle import ExportConfig, ExportError, export_bundle

    target, draft = weightless
    with pytest.raises(ExportError) as caught:
        config = ExportConfig(str(target), tmp_path / "b", "fp32", 64, (str(draft),) if drafts == "model" else (),
                              draft_vocab=vocab, draft_vocab_from=sources)
        export_bundle(config, log=lambda message: None)
    assert message in str(caught.value)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_export_cli_trims_and_runs(tiny_models, corpus, tmp_path):
    out = tmp_path / "cli"
    result = _export_cli(str(tiny_models.llama), "--out", str(out), "--quant", "fp32", "--max-context", "64", "--draft", str(tiny_models.draft),
                         "--draft-vocab", "100", "--draft-vocab-from", str(corpus), "--json", timeout=300)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["roles"]["draft"]["logit_rows"] == 100
    assert summary["roles"]["target"]["logit_rows"] == mf.load_manifest(out).target.arch.vocab_size


def _edited(bundle: Path, tmp_path: Path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(bundle, copy)
    data = json.loads((copy / mf.MANIFEST_FILE).read_text())
    edit(data, copy)
    (copy / mf.MANIFEST_FILE).write_text(json.dumps(data))
    return copy


def _rehash(data, folder: Path, name: str) -> None:
    data["files"][name] = mf.sha256_file(folder / name)


@pytest.mark.parametrize("edit,message", [
    (lambda d, f: d["models"]["target"].update(trimmed_head=d["models"]["draft"]["trimmed_head"]), "only a draft model with a head of its own"),
    (lambda d, f: d["models"]["draft"]["trimmed_head"].update(rows=7), "expected 7 integer token ids"),
    (lambda d, f: d["models"]["draft"]["trimmed_head"].update(rows=0), "rows must be an integer 1.."),
    (lambda d, f: d["models"]["draft"]["trimmed_head"].update(file="../x.head_tokens.npy"), "at the top of the bundle"),
    (lambda d, f: d["models"]["draft"]["trimmed_head"].update(extra=1), "unknown field(s) ['extra']"),
    (lambda d, f: (np.save(f / "draft.head_tokens.npy", np.load(f / "draft.head_tokens.npy")[::-1].copy()), _rehash(d, f, "draft.head_tokens.npy")), "distinct, ascending"),
    (lambda d, f: (np.save(f / "draft.head_tokens.npy", np.setdiff1d(np.load(f / "draft.head_tokens.npy"), d["tokenizer"]["eos_token_ids"])),
                   d["models"]["draft"]["trimmed_head"].update(rows=KEPT - 1), _rehash(d, f, "draft.head_tokens.npy")), "drops EOS token(s)"),
    (lambda d, f: ((f / "draft.head_tokens.npy").write_bytes(b"\0" * 4), _rehash(d, f, "draft.head_tokens.npy")), "not a readable .npy"),
    (lambda d, f: (f / "draft.head_tokens.npy").unlink(), "bundle file missing"),
])
def test_bad_trimmed_head_is_refused(pair, tmp_path, edit, message):
    with pytest.raises(mf.BundleError) as caught:
        mf.load_manifest(_edited(pair["trimmed"], tmp_path, edit))
    assert message in str(caught.value)


def test_memory_plan_counts_the_smaller_head(pair):
    manifest = {name: mf.load_manifest(path) for name, path in pair.items()}
    plans = {name: plan_bundle(manifest[name], path, "model") for name, path in pair.items()}
    arch = manifest["full"].models["draft"].arch
    saved = (arch.vocab_size - KEPT) * arch.hidden_size * 4  # fp32
    stored = plans["full"].stored_bytes - plans["trimmed"].stored_bytes
    assert abs(stored - saved) < 0.01 * saved
    assert plans["trimmed"].part("weights target") == plans["full"].part("weights target")
    # The files' bytes split into layers and a head of KEPT rows (what packing and loading cost differs by).
    draft = manifest["trimmed"].models["draft"]
    weights = _stage_weights(manifest["trimmed"], pair["trimmed"], "draft", draft.quant, draft.arch, draft.logit_rows)
    assert weights.head == KEPT * arch.hidden_size * 4
    # Planned before export: the draft's head shrinks by the same rows.
    qwen = ModelFacts("qwen2", 24, 896, 14, 2, 64, 4864, 151936, qkv_bias=True)
    whole, trimmed = (plan_export(qwen, "int4", 2048, ("d",), {"d": qwen}, draft_vocab=v) for v in (None, 32768))
    assert 0 < whole.stored_bytes - trimmed.stored_bytes == pytest.approx((151936 - 32768) * 896 * (0.5 + 4 / 32), rel=1e-6)
