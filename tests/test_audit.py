"""The exactness audit's statistics (runtime/audit.py) on known laws, its refusals, and the
audit and block-stable mode on tiny bundles."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from edge_spec.sampling import SamplingConfig
from runtime import audit

V = 8


def _law(seed: int = 0, peak: float = 2.0):
    """A random Markov law over V tokens: p(· | prefix) depends on the prefix's last token."""
    rng = np.random.default_rng(seed)
    table = rng.dirichlet(np.full(V, 1.0 / peak), size=V + 1)  # row V: the empty prefix
    return lambda prefix: table[prefix[-1] if prefix else V]


def _draw(law, n: int, k: int, rng, tilt=None) -> np.ndarray:
    rows = []
    for _ in range(n):
        prefix = ()
        for _ in range(k):
            p = law(prefix) if tilt is None else tilt(law(prefix))
            prefix += (int(rng.choice(V, p=p)),)
        rows.append(prefix)
    return np.array(rows, dtype=np.int64)


def _rows(law, samples):
    drawn = [set(samples[:, k].tolist()) for k in range(samples.shape[1])]
    return {prefix: audit.Row.of(law(prefix), drawn[len(prefix)]) for prefix in audit.observed_prefixes(samples)}


def _report(samples, law, positions, drafted=True):
    config = audit.AuditConfig(len(samples), positions, 0.01, seed=3)
    run = audit.SampleRun(samples, 4 * len(samples), len(samples) if drafted else len(samples) - 1, 10, 5)
    return audit.audit_exact(samples, run, _rows(law, samples), config, "model", "4")


def test_samples_from_the_exact_law_fail_at_most_at_the_level():
    """Family-wise alpha 0.01: of 30 independent audits of exact samples about 0.3 fail."""
    law = _law()
    failed = sum(not _report(_draw(law, 400, 3, np.random.default_rng(seed)), law, 3).passed for seed in range(30))
    assert failed <= 2


def test_samples_from_a_shifted_law_fail():
    """Mass 0.08 moved from each position's most likely token to its second: TV 0.08."""
    law = _law()

    def tilt(p):
        q = p.copy()
        first, second = np.argsort(-p)[:2]
        moved = min(0.08, q[first])
        q[first] -= moved
        q[second] += moved
        return q

    report = _report(_draw(law, 800, 3, np.random.default_rng(0), tilt), law, 3)
    assert not report.passed, report.lines()
    assert report.verdict == "FAIL"


def test_the_reported_power_is_real():
    """At the detectable TV the report prints, the same shift is caught in about 80% of runs."""
    law = _law(1)
    n = 400
    detectable = _report(_draw(law, n, 1, np.random.default_rng(0)), law, 1).detectable_tv
    assert detectable is not None and 0.0 < detectable < 0.5

    def tilt(p):
        q = p.copy()
        first, second = np.argsort(-p)[:2]
        q[first] -= detectable
        q[second] += detectable
        return q

    caught = sum(not _report(_draw(law, n, 1, np.random.default_rng(100 + i), tilt), law, 1).passed for i in range(40))
    assert 24 <= caught <= 40  # 80% of 40 is 32; a power near 5% would catch about 2


def test_six_positions_can_still_fail():
    """The old permutation audit's p-value floor (1/501) sat above 0.01/K from K = 6: two
    sample sets with TV 1.0 passed. Both modes now have a floor below the threshold."""
    config = audit.AuditConfig(100, 6)
    assert 1 / (config.n_simulations + 1) < config.threshold / 5
    a, b = np.zeros((100, 6), dtype=np.int64), np.ones((100, 6), dtype=np.int64)
    assert all(p.p_value <= config.threshold for p in audit.two_sample(a, b, config))
    law = _law()
    report = _report(np.array([[int(np.argmin(law(())))] * 6] * 100), law, 6)
    assert not report.passed


def test_an_impossible_token_fails_outright():
    law = lambda prefix: np.array([0.5, 0.5] + [0.0] * (V - 2))  # noqa: E731
    samples = np.array([[0]] * 99 + [[5]], dtype=np.int64)
    report = _report(samples, law, 1)
    assert report.positions[0].impossible == 1 and report.positions[0].p_value == 0.0 and not report.passed


def test_samples_that_stop_early_are_judged_only_where_they_drew():
    """Token 0 stops a generation: the sample is padded with ENDED and draws nothing after it.
    Exact samples that stop pass; before, the pads were counted as draws of an unlikely token."""
    law = _law(2)
    stops = lambda p: np.append(0.3, 0.7 * p[1:] / p[1:].sum())  # noqa: E731

    def draw(rng, tilt=None):
        rows = _draw(lambda prefix: stops(law(prefix)), 400, 3, rng, tilt)
        for row in rows:
            ended = np.flatnonzero(row == 0)
            if ended.size:
                row[ended[0] + 1 :] = audit.ENDED
        return rows

    failed = 0
    for seed in range(10):
        samples = draw(np.random.default_rng(seed))
        assert (samples == audit.ENDED).sum() > 100
        report = _report(samples, lambda prefix: stops(law(prefix)), 3)
        assert all(p.impossible == 0 for p in report.positions), report.lines()
        failed += not report.passed
    assert failed <= 1
    assert audit.observed_prefixes(np.array([[0, audit.ENDED, audit.ENDED]])) == [()]


def test_without_drafting_in_every_sample_it_is_not_exercised():
    law = _law()
    report = _report(_draw(law, 200, 2, np.random.default_rng(0)), law, 2, drafted=False)
    assert report.verdict == "NOT EXERCISED" and not report.passed
    assert "not tested" in report.lines()[-1]


@pytest.mark.parametrize("kwargs", [{"samples": 0}, {"samples": 10}, {"positions": 0}, {"alpha": 0.0}, {"samples": 50, "simulations": 10}])
def test_bad_audit_config_is_refused(kwargs):
    with pytest.raises(ValueError):
        audit.AuditConfig(**kwargs)


def _cli(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "runtime", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("extra,message", [
    (["--samples", "0"], "--samples: 0 is out of range (allowed: 20..10000000)"),
    (["--samples", "50", "--simulations", "10"], "cannot give a p-value below"),
    (["--gamma", "0"], "must be auto or an integer 1..32"),
    (["--gamma", "-2"], "must be auto or an integer 1..32"),
    (["--draft", "none"], "pick a drafter other than none"),
    (["--temperature", "0"], "--temperature > 0"),
])
def test_audit_refuses_bad_arguments_before_loading(tmp_path, extra, message):
    args = ["audit", str(tmp_path / "no-bundle"), "--prompt", "x", "--temperature", "0.8", *extra]
    result = _cli(*args)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.law
@pytest.mark.parametrize("drafter", ["model", "layer-skip", "lookup", "auto"])
def test_audit_passes_on_a_tiny_bundle(llama_bundle, drafter):
    prompt = "the cat sat on the mat the cat sat on the"  # repeats, so lookup drafts
    result = _cli("audit", str(llama_bundle), "--prompt", prompt, "--temperature", "1.0", "--draft", drafter,
                  "--gamma", "3", "--samples", "1500", "--positions", "2", "--json", timeout=600)
    report = json.loads(result.stdout)
    assert report["samples_drafted"] == 1500 and report["rejections"] > 0, report
    assert report["verdict"] == "PASS" and result.returncode == 0, report


def test_audit_that_cannot_exercise_the_verifier_exits_non_zero(llama_bundle):
    """A prompt with nothing to copy: lookup drafts in few samples, so the audit says it
    could not test speculation and exits 1 instead of passing."""
    result = _cli("audit", str(llama_bundle), "--prompt", "one two three four five six seven", "--temperature", "1.0",
                  "--draft", "lookup", "--gamma", "3", "--samples", "100", "--positions", "2", "--json", timeout=300)
    report = json.loads(result.stdout)
    assert report["samples_drafted"] < 100 and report["verdict"] == "NOT EXERCISED", report
    assert result.returncode == 1, report


@pytest.mark.law
def test_audit_self_test_tells_the_draft_from_the_target(llama_bundle):
    result = _cli("audit", str(llama_bundle), "--prompt", "the cat sat on the", "--temperature", "1.0", "--draft", "model",
                  "--samples", "1500", "--positions", "2", "--self-test", "--json", timeout=600)
    report = json.loads(result.stdout)
    assert report["detected"] and result.returncode == 0, report


def test_block_stable_mode_pads_single_rows(llama_bundle):
    """Every target pass scores at least two positions: a 1-token pass returns the row a
    2-token pass gives, and the cache holds only the real token."""
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    plain = Engine(llama_bundle, EngineConfig(drafter="none", calibrate=False))
    stable = Engine(llama_bundle, EngineConfig(drafter="lookup", calibrate=False, block_stable=True))
    ids = plain.encode(prompt="the cat sat on the mat")
    for engine in (plain, stable):
        engine.target.cache.reset()
        engine.target.prefill(ids[:-2])
    pair = plain.target.forward(ids[-2:])  # [2,V]
    plain.target.cache.rollback_to_prefix(np.asarray(ids[:-2]))
    one = stable.target.forward(ids[-2:-1])  # [1,V], padded to 2 rows
    assert stable.target.cache.kv_len == len(ids) - 1
    assert np.array_equal(one[0], pair[0])
    assert stable.target.forward(ids[-1:]).shape[0] == 1 and stable.target.cache.kv_len == len(ids)
    config = GenerateConfig(max_new_tokens=24, sampling=SamplingConfig())
    reference = stable.generate(ids, config, speculative=False).token_ids
    stable.use_drafter("layer-skip", gamma=3)
    assert stable.generate(ids, config).token_ids == reference
