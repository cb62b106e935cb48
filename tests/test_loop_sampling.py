"""The loop under sampling, without model files: the joint law of the first tokens that
`decode_steps` emits, per drafter, sampling setting and γ, against the exact law of the toy
target, tested with the audit's statistics (runtime/audit.py). The same tests fail when the
loop is given a known-wrong verifier.

Toy models (tests/test_loop_toy.py) read their context from a real KVCache, so a loop that
rolls back wrongly changes the law too. The draft model is the target with noise on its
logits: similar enough to accept often, different enough to reject often.
"""

from __future__ import annotations

import numpy as np
import pytest

import runtime.loop
from edge_spec.sampling import SamplingConfig, process_logits, sample
from runtime import audit
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.layer_skip import LayerSkipDrafter
from runtime.drafters.mixed import MixedDrafter
from runtime.drafters.prompt_lookup import PromptLookupDrafter
from runtime.gamma import GammaConfig
from runtime.kv_cache import KVCache
from runtime.loop import decode_steps
from runtime.policy import RoundPolicy
from tests.test_loop_toy import VOCAB, ToyLM, ToyRunner

POSITIONS = 2
SAMPLES = 19000  # enough that a TV of 0.02 at the first position is caught (detectable_tv below)
WRONG_SAMPLES = 6000  # a known-wrong verifier is far off the law: fewer samples show it
ALPHA = 0.002  # per test: 24 tests of the law and a handful of wrong verifiers stay under 5% together
CONFIGS = {
    "T1": SamplingConfig(1.0),
    "T0.7-topk20": SamplingConfig(0.7, top_k=20),
    "T0.9-topp0.8": SamplingConfig(0.9, top_p=0.8),
}


class NoisyLM(ToyLM):
    """The target's logits plus a fixed per-(last token, next token) perturbation."""

    def __init__(self, target: ToyLM, scale: float = 1.5, seed: int = 11):
        self.target = target
        self.noise = np.random.default_rng(seed).normal(0, scale, size=(VOCAB, VOCAB))

    def logits(self, context):
        return self.target.logits(context) + self.noise[int(context[-1])]


class ToyTrunkRunner(ToyRunner):
    """A target split as a layer-skip bundle is: stage 0 (the trunk) writes the KV rows and
    returns a hidden state, here the whole context each position sees; the last stage is the
    draft's head on that hidden state (the noisy model); `forward` finishes the target from the
    trunk rows a draft already computed, so a stale or misplaced trunk row changes the target's law.

    subset: a kept segment between trunk and head (layer-skip over a subset of layers), with KV
    rows of its own in cache layer 1 that the target's law reads. The draft computes them without
    the skipped layers (here: wrong tokens); the verify pass must overwrite every one it scores."""

    def __init__(self, lm: ToyLM, draft_head: ToyLM, subset: bool = False):
        super().__init__(lm)
        self.draft_head = draft_head
        self.subset = subset
        self.stages = ["trunk", "segment", "head"] if subset else ["trunk", "head"]
        if subset:
            self.cache = KVCache(range(2), n_kv_heads=1, max_context=self.cache.max_context, head_dim=1)

    def _rows(self, end: int, layer: int = 0) -> list[int]:
        return self.cache.keys[layer][0, 0, :end, 0].astype(np.int64).tolist()

    def _write_segment(self, ids, start: int, offset: int = 0) -> None:
        new = ((np.asarray(ids, dtype=np.int64) + offset) % VOCAB).astype(np.float32).reshape(1, 1, len(ids), 1)
        self.cache.write_rows(range(1, 2), [new, new], start)

    def run_stage(self, index, x, start, logit_positions=None):
        if self.subset and index == 1:  # the draft's later kept segment: its KV rows as the skipped layers left them
            self._write_segment([c[-1] for c in x[0, :, 0]], start, offset=7)
            return x
        if index == 0:  # [1,T] ids -> [1,T,1] contexts; KV rows written, the cache's length untouched
            ids = np.asarray(x[0], dtype=np.int64)
            past = self._rows(start)
            new = ids.astype(np.float32).reshape(1, 1, len(ids), 1)
            self.cache.write_rows(range(1), [new, new], start)
            contexts = np.empty((1, len(ids), 1), dtype=object)
            for i in range(len(ids)):
                contexts[0, i, 0] = tuple(past + ids[: i + 1].tolist())
            return contexts
        rows = np.stack([self.draft_head.logits(list(c)) for c in x[0, :, 0]])  # the draft's head
        return rows[None, logit_positions]  # [1,N,V]

    def forward(self, token_ids, n_logits=None, trunk_hidden=None):
        token_ids = np.asarray(token_ids, dtype=np.int64)
        block, start = len(token_ids), self.cache.kv_len
        self.cache.check_room(start, block)
        done = 0 if trunk_hidden is None else trunk_hidden.shape[1]
        contexts = [] if trunk_hidden is None else list(trunk_hidden[0, :, 0])
        if done < block:
            contexts += list(self.run_stage(0, token_ids[None, done:], start + done)[0, :, 0])
        if self.subset:  # every later stage runs on the whole block: the segment's rows the draft wrote are replaced
            self._write_segment(token_ids, start)
            past = self._rows(start, layer=1)
            contexts = [tuple(past + token_ids[: i + 1].tolist()) for i in range(block)]
        self.cache.extend(token_ids)
        self.fed.append(block)
        n_logits = block if n_logits is None else n_logits
        return np.stack([self.lm.logits(list(c)) for c in contexts])[block - n_logits :]  # [N,V]


def _copy_prompt(lm: ToyLM) -> list[int]:
    """[7, 21, y, 4, 9, 33, 7, 21]: prompt lookup proposes y, and y is the toy target's most
    likely next token there, so copies are accepted often and rejected often."""
    best = max(range(VOCAB), key=lambda y: (int(np.argmax(lm.logits([7, 21, y, 4, 9, 33, 7, 21]))) == y,
                                            float(process_logits(lm.logits([7, 21, y, 4, 9, 33, 7, 21]), SamplingConfig(1.0))[y])))
    return [7, 21, best, 4, 9, 33, 7, 21]


PROMPT = _copy_prompt(ToyLM(5))


def _target_and_drafter(kind: str, lm: ToyLM):
    if kind in ("layer-skip", "layer-skip-subset"):  # the draft runs the target's own trunk and writes its cache
        target = ToyTrunkRunner(lm, NoisyLM(lm), subset=kind == "layer-skip-subset")
        return target, LayerSkipDrafter(target)
    if kind == "lookup":
        return ToyRunner(lm), PromptLookupDrafter()
    model = DraftModelDrafter(ToyRunner(NoisyLM(lm)))
    return ToyRunner(lm), model if kind == "model" else MixedDrafter([PromptLookupDrafter()], model)


def loop_samples(kind: str, sampling: SamplingConfig, gamma: int, n: int = SAMPLES, seed: int = 0):
    """n runs of decode_steps at fixed γ; the first POSITIONS tokens of each and what the
    rounds that produced them did."""
    lm = ToyLM(5)
    target, drafter = _target_and_drafter(kind, lm)
    policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=gamma))
    rows, drafted, samples_drafted, rejections, residual = [], 0, 0, 0, 0
    for i in range(n):
        out, sample_drafted = [], 0
        steps = decode_steps(target, drafter, PROMPT, sampling, np.random.default_rng(seed + i), policy)
        for step in steps:
            sample_drafted += step.n_drafted
            rejected = step.n_accepted < step.n_drafted
            rejections += rejected
            out += step.tokens
            residual += rejected and len(out) <= POSITIONS
            if len(out) >= POSITIONS:
                break
        rows.append(out[:POSITIONS])
        drafted += sample_drafted
        samples_drafted += sample_drafted > 0
    samples = np.array(rows, dtype=np.int64)
    return samples, audit.SampleRun(samples, drafted, samples_drafted, rejections, residual), lm


def exact_law(lm: ToyLM, samples: np.ndarray, sampling: SamplingConfig) -> dict:
    drawn = [set(samples[:, k].tolist()) for k in range(samples.shape[1])]
    return {prefix: audit.Row.of(process_logits(lm.logits(PROMPT + list(prefix)), sampling), drawn[len(prefix)])
            for prefix in audit.observed_prefixes(samples)}


def run_audit(kind: str, sampling: SamplingConfig, gamma: int, n: int = SAMPLES) -> audit.AuditReport:
    samples, run, lm = loop_samples(kind, sampling, gamma, n)
    config = audit.AuditConfig(n, POSITIONS, ALPHA, seed=1)
    return audit.audit_exact(samples, run, exact_law(lm, samples, sampling), config, kind, str(gamma))


# Every sampling config at γ 3; γ 1 (one draft, then the bonus) with the plain config only, since
# the processing of p and q does not depend on γ. Layer-skip over a prefix is the subset draft
# without its later segment (the same drafter, the same q), so it runs at γ 1 and the subset at γ 3.
# The processing of p and q is one function for every drafter (the model's q runs it under every
# config), so prompt lookup and the subset draft, whose verify paths differ, run the plain config;
# auto, whose rounds are lookup's or the model's, runs lookup's one-hot q under the others.
LAW_CASES = [pytest.param(kind, config, gamma, id=f"{kind}-{config}-{gamma}")
             for kind in ("model", "layer-skip", "layer-skip-subset", "lookup", "auto") for config in CONFIGS
             for gamma in ((1,) if kind == "layer-skip" else (3,) if kind == "layer-skip-subset" else (1, 3))
             if (gamma == 3 or config == "T1") and (kind in ("model", "auto") or config == "T1")]


@pytest.mark.law
@pytest.mark.parametrize("kind, config, gamma", LAW_CASES)
def test_loop_samples_follow_the_target_law(kind, config, gamma):
    report = run_audit(kind, CONFIGS[config], gamma)
    assert report.exercised, report.lines()
    assert report.detectable_tv is not None and report.detectable_tv <= 0.02, report.lines()
    assert report.passed, report.lines()


# Known-wrong verifiers: each must make the same test fail.

def _resample_from_p(target_probs, draft_probs, draft_tokens, rng):
    """Rejection draws the correction from p itself, not from norm(max(0, p − q))."""
    for position, token in enumerate(draft_tokens.tolist()):
        p, q = float(target_probs[position, token]), float(draft_probs[position, token])
        if not (p >= q or rng.random() * q < p):
            return position, sample(target_probs[position], rng)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], rng)


def _residual_without_clamp(target_probs, draft_probs, draft_tokens, rng):
    """The residual |p − q|: max(0, ·) dropped, mass where q > p counted too."""
    for position, token in enumerate(draft_tokens.tolist()):
        p, q = float(target_probs[position, token]), float(draft_probs[position, token])
        if not (p >= q or rng.random() * q < p):
            return position, sample(np.abs(target_probs[position] - draft_probs[position]), rng)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], rng)


def _greedy_acceptance(target_probs, draft_probs, draft_tokens, rng):
    """Accept a drafted token only when it is p's argmax, then sample from p."""
    for position, token in enumerate(draft_tokens.tolist()):
        if token != int(np.argmax(target_probs[position])):
            return position, sample(target_probs[position], rng)
    return len(draft_tokens), sample(target_probs[len(draft_tokens)], rng)


@pytest.mark.law
@pytest.mark.parametrize("wrong", [_resample_from_p, _residual_without_clamp, _greedy_acceptance], ids=lambda f: f.__name__.strip("_"))
def test_a_wrong_verifier_fails_the_test(monkeypatch, wrong):
    monkeypatch.setattr(runtime.loop, "verify_stochastic", wrong)
    report = run_audit("model", CONFIGS["T1"], 3, WRONG_SAMPLES)
    assert report.exercised
    assert not report.passed, report.lines()


@pytest.mark.law
def test_q_processed_unlike_p_fails_the_test(monkeypatch):
    """Draft tokens sampled from q processed like p (T 0.7, top-k 20), but the verifier
    handed q at temperature 1 without top-k."""
    import runtime.drafters.draft_model as draft_model

    def pick(logits, sampling, rng):
        token = sample(process_logits(logits, sampling), rng)
        return token, process_logits(logits, SamplingConfig(1.0))

    monkeypatch.setattr(draft_model, "pick_token", pick)
    report = run_audit("model", CONFIGS["T0.7-topk20"], 3, WRONG_SAMPLES)
    assert report.exercised
    assert not report.passed, report.lines()


@pytest.mark.law
def test_lookup_resampling_the_rejected_token_fails_the_test(monkeypatch):
    """q is one-hot for lookup: a rejection must never re-draw the rejected token."""

    def wrong(target_probs, draft_tokens, rng):
        for position, token in enumerate(draft_tokens.tolist()):
            if not rng.random() < float(target_probs[position, token]):
                return position, sample(target_probs[position], rng)
        return len(draft_tokens), sample(target_probs[len(draft_tokens)], rng)

    monkeypatch.setattr(runtime.loop, "verify_deterministic", wrong)
    report = run_audit("lookup", CONFIGS["T1"], 3, WRONG_SAMPLES)
    assert report.exercised
    assert not report.passed, report.lines()


@pytest.mark.law
def test_layer_skip_verify_reusing_a_stale_trunk_row_fails_the_test(monkeypatch):
    """The verify pass must finish the target from the trunk rows of the drafted tokens: reusing
    the first drafted position's trunk output for every one of them changes the law."""
    original = LayerSkipDrafter.propose

    def stale(self, tokens, gamma, sampling, rng):
        proposal = original(self, tokens, gamma, sampling, rng)
        if proposal is not None:
            for i in range(1, proposal.trunk_hidden.shape[1]):
                proposal.trunk_hidden[0, i, 0] = proposal.trunk_hidden[0, 0, 0]
        return proposal

    monkeypatch.setattr(LayerSkipDrafter, "propose", stale)
    report = run_audit("layer-skip", CONFIGS["T1"], 3, WRONG_SAMPLES)
    assert report.exercised
    assert not report.passed, report.lines()


@pytest.mark.law
def test_layer_skip_subset_verify_keeping_the_drafts_segment_rows_fails_the_test(monkeypatch):
    """A verify pass that recomputed only the rows the draft had not written, leaving the later
    kept segment's rows as the draft wrote them, changes the law."""
    original = ToyTrunkRunner._write_segment

    def keep_drafted(self, ids, start, offset=0):
        if offset == 0 and len(ids) > 1:  # the verify pass: only its last row, past the drafted ones
            return original(self, ids[-1:], start + len(ids) - 1)
        return original(self, ids, start, offset)

    monkeypatch.setattr(ToyTrunkRunner, "_write_segment", keep_drafted)
    report = run_audit("layer-skip-subset", CONFIGS["T1"], 3, WRONG_SAMPLES)
    assert report.exercised
    assert not report.passed, report.lines()
