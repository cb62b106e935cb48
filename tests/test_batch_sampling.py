"""Batched decoding under sampling, without model files: the joint law of the first tokens that
`runtime.batch.batch_round` gives a sequence holding the drafter and a plain neighbour, while
sequences join and leave the batch, against the toy target's exact law (the audit's statistics,
as tests/test_loop_sampling.py tests the solo loop). The same tests fail when the batch hands a
sequence another one's row, or when the drafting sequence's verifier is wrong.

The scenario, each sample: A (drafting) and B share the first pass, B leaves; C and D join for
the second (prefilled then), C leaves after it. The batched-pass costs are fixed so that beside
one neighbour A's own round pays only while its α is high, and beside two it pays: A's tokens
come from batched rows and from its own rounds, D's from passes of 2 and 3 rows and alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

import runtime.loop
from edge_spec.sampling import SamplingConfig, process_logits
from runtime import audit
from runtime.batch import batch_round
from runtime.drafters.base import use_clock
from runtime.gamma import CostModel, GammaConfig
from runtime.policy import RoundPolicy
from tests.test_loop_sampling import PROMPT, SAMPLES, WRONG_SAMPLES, _resample_from_p, _target_and_drafter
from tests.test_loop_toy import ToyLM, ToyRunner

POSITIONS = 2
ALPHA = 0.002
SAMPLING = SamplingConfig(1.0)
PROMPTS = {"B": [3, 8, 1], "C": [11, 12], "D": [40, 2, 9, 30]}
BATCH_COST = {1: 1.0, 2: 1.9, 3: 5.0}  # seconds of a batched pass by rows (the fake clock's)


class ToyBatch:
    """BatchedTarget's surface over toy runners, one KV cache per slot: a batched row is what the
    sequence's own 1-token pass computes (what the ONNX graphs are tested to give)."""

    def __init__(self, lm: ToyLM, n: int, swap_rows: bool = False):
        self.runners = [ToyRunner(lm) for _ in range(n)]
        self.swap_rows = swap_rows

    def runner(self, slot: int) -> ToyRunner:
        return self.runners[slot]

    def step(self, slots, tokens) -> np.ndarray:
        rows = np.stack([self.runners[slot].forward([token])[0] for slot, token in zip(slots, tokens)])  # [B,V]
        return rows[::-1] if self.swap_rows else rows  # known-wrong: each sequence gets another's row


@dataclass(eq=False)
class Seq:
    slot: int
    tokens: np.ndarray
    rng: np.random.Generator
    config: object = field(default_factory=lambda: type("Config", (), {"sampling": SAMPLING})())


class Clock:
    """Each read one second later: the policy and cost model learn the same times every run."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def _joined(batch: ToyBatch, slot: int, prompt, rng) -> Seq:
    runner = batch.runner(slot)
    runner.cache.reset()
    runner.prefill(prompt[:-1])
    return Seq(slot, np.asarray(prompt, dtype=np.int64), rng)


def batch_samples(kind: str, n: int, swap_rows: bool = False, seed: int = 0):
    """n runs of the scenario: A's and D's first POSITIONS tokens, A's rounds as the audit counts
    them, and how often A drafted its own round beside the others (pass 1, pass 2)."""
    lm = ToyLM(5)
    _, drafter = _target_and_drafter(kind, lm)
    batch = ToyBatch(lm, 4, swap_rows)
    costs = CostModel()
    costs.batch_cost = BATCH_COST.get
    costs.target = {1: 1.0, 4: 1.3}
    policy = RoundPolicy(costs)
    clock = Clock()
    use_clock(drafter, clock)
    rows = {"A": [], "D": []}
    drafted = samples_drafted = rejections = residual = 0
    own_rounds = [0, 0]
    for i in range(n):
        rng = np.random.default_rng(seed + i)
        a = _joined(batch, 0, PROMPT, np.random.default_rng(rng.integers(2**63)))
        b = _joined(batch, 1, PROMPTS["B"], np.random.default_rng(rng.integers(2**63)))
        policy.start(drafter, config=GammaConfig(fixed=3))
        drafter.reset(a.tokens[:-1])
        first = batch_round(batch, [a, b], a, drafter, policy, costs, clock)[0]
        c = _joined(batch, 2, PROMPTS["C"], np.random.default_rng(rng.integers(2**63)))
        d = _joined(batch, 3, PROMPTS["D"], np.random.default_rng(rng.integers(2**63)))
        second = batch_round(batch, [a, c, d], a, drafter, policy, costs, clock)[0]
        while len(d.tokens) - len(PROMPTS["D"]) < POSITIONS:
            batch_round(batch, [d], None, None, policy, costs, clock)
        before = 0
        for k, step in enumerate((first, second)):
            own_rounds[k] += step.n_drafted > 0
            rejected = step.n_accepted < step.n_drafted
            rejections += rejected
            residual += rejected and before + step.n_accepted < POSITIONS
            drafted += step.n_drafted
            before += len(step.tokens)
        samples_drafted += first.n_drafted + second.n_drafted > 0
        rows["A"].append(a.tokens[len(PROMPT) : len(PROMPT) + POSITIONS].tolist())
        rows["D"].append(d.tokens[len(PROMPTS["D"]) : len(PROMPTS["D"]) + POSITIONS].tolist())
    samples = {k: np.array(v, dtype=np.int64) for k, v in rows.items()}
    return samples, audit.SampleRun(samples["A"], drafted, samples_drafted, rejections, residual), lm, own_rounds


def _law(lm: ToyLM, prompt, samples: np.ndarray) -> dict:
    drawn = [set(samples[:, k].tolist()) for k in range(samples.shape[1])]
    return {prefix: audit.Row.of(process_logits(lm.logits(list(prompt) + list(prefix)), SAMPLING), drawn[len(prefix)])
            for prefix in audit.observed_prefixes(samples)}


def run_audits(kind: str, n: int = SAMPLES, swap_rows: bool = False):
    """A's report (its rounds counted as the audit counts a drafter's), D's (plain), and A's own rounds by pass."""
    samples, run, lm, own_rounds = batch_samples(kind, n, swap_rows)
    config = audit.AuditConfig(n, POSITIONS, ALPHA, seed=1)
    reports = {"A": audit.audit_exact(samples["A"], run, _law(lm, PROMPT, samples["A"]), config, kind, "3")}
    plain = audit.SampleRun(samples["D"], 0, 0, 0, 0)
    reports["D"] = audit.audit_exact(samples["D"], plain, _law(lm, PROMPTS["D"], samples["D"]), config, "none", "0")
    return reports, own_rounds


def fits(report: audit.AuditReport) -> bool:
    """Every position's goodness of fit above the threshold (`passed` less `exercised`: D never
    drafts, and A drafts in most samples, not all)."""
    return all(p.p_value > report.threshold for p in report.positions)


# auto selects between prompt lookup's deterministic proposals and the model's sampled ones, so
# it covers both verifiers beside the batch (the model's alone: tests/test_loop_sampling.py).
@pytest.mark.law
@pytest.mark.parametrize("kind", ["auto"])
def test_batched_sequences_follow_the_target_law(kind):
    reports, own_rounds = run_audits(kind)
    for name, report in reports.items():
        assert report.detectable_tv is not None and report.detectable_tv <= 0.02, (name, report.lines())
        assert fits(report), (name, report.lines())
    a = reports["A"]
    assert a.rejections > 0 and a.samples_drafted > SAMPLES // 3, a.lines()
    assert 0 < own_rounds[0] < SAMPLES and own_rounds[1] > SAMPLES // 3, own_rounds  # beside one both ways, beside two its own


@pytest.mark.law
def test_a_batch_that_hands_a_sequence_another_ones_row_fails_the_test():
    reports, _ = run_audits("model", WRONG_SAMPLES, swap_rows=True)
    assert not fits(reports["D"]), reports["D"].lines()


@pytest.mark.law
def test_a_wrong_verifier_in_the_drafting_sequences_rounds_fails_the_test(monkeypatch):
    monkeypatch.setattr(runtime.loop, "verify_stochastic", _resample_from_p)
    reports, _ = run_audits("model", WRONG_SAMPLES)
    assert reports["A"].rejections > 0
    assert not fits(reports["A"]), reports["A"].lines()
