"""Golden traces from the Python runtime (the reference) for the Kotlin conformance tests.

    python android_bridge/tools/write_traces.py OUT_DIR [--no-real | --pure]

Writes JSON files into OUT_DIR:
  rng.json         np.random.default_rng(seed).random() streams (the uniform stream definition)
  sampling.json    process_logits / sample cases: logits, config, probabilities, drawn tokens
  verify.json      verify_greedy / verify_stochastic / verify_deterministic cases
  policy.json      RoundPolicy plans (drafter, γ, evidence, probe, whole replay) and its ledgers, costs and α,
                   driven through choose/observe over scripted drafter parts and simulated rounds
  commit.json      edge_spec/commit.py on hand-made and random rounds (budget, context, EOS, stop strings)
  cost_model.json  CostModel target_cost / replay_cost / cost_ratio after recorded measurements
  loop.json        decode_steps on fake models (logits recorded per prefix): the empty-residual fallback,
                   adaptive γ with a fake clock (its readings recorded), round by round
  drafter.json     DraftModelDrafter's cache length after each reset / propose / accepted
  tok_<name>.json  tokenizer cases: text -> ids (with and without special tokens) -> decoded text,
                   plus decodes of random id sequences; the tokenizer.json beside it
  model_<name>.json  a bundle path, prompt ids, logits, and generations per (drafter, γ, sampling):
                   emitted tokens, per-round drafted/accepted counts, the uniforms consumed; adaptive-γ
                   runs with the fake clock's readings; Engine.generate with stop strings
The pure traces (rng .. drafter) drive the production runtime code on numpy fakes: they import
nothing from tests/ and need no torch (--pure writes only them). The model traces need bundles:
tiny random-weight ones built with tests/tiny.py (llama with a draft model and layer skip, qwen2;
torch, through the exporter), the real one tests/real.py's smollm2-fp32 (SmolLM2-135M from
$EDGE_SPEC_MODELS). The Qwen2 tokenizer comes from any qwen bundle present, else from the
official GGUF.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import time
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import numpy as np  # noqa: E402

from edge_spec.sampling import SamplingConfig, process_logits, sample  # noqa: E402
from edge_spec.verify import verify_deterministic, verify_greedy, verify_stochastic  # noqa: E402
from runtime.passes import CacheRows, Scored  # noqa: E402


def bundle_builders():
    """tests/tiny.py and tests/real.py, which build and find the bundles the model traces need
    (only those: the pure traces import nothing from tests/)."""
    if str(ROOT / "tests") not in sys.path:
        sys.path.insert(0, str(ROOT / "tests"))
    import real
    import tiny

    return tiny, real


def log(message: str) -> None:
    print(f"write_traces: {message}", file=sys.stderr, flush=True)


def dump(path: Path, data) -> None:
    path.write_text(json.dumps(data, ensure_ascii=False, separators=(",", ":")))


class RecordingRng:
    """np.random.default_rng(seed) that records every uniform drawn (the loop only calls random())."""

    def __init__(self, seed):
        self.inner = np.random.default_rng(seed)
        self.drawn: list[float] = []

    def random(self):
        u = float(self.inner.random())
        self.drawn.append(u)
        return u


# -- pure functions -----------------------------------------------------------------------------


def rng_traces() -> list[dict]:
    seeds = [0, 1, 7, 42, 123456789, 2**32 - 1, 2**32, 2**63 - 1]
    return [{"seed": str(s), "uniforms": np.random.default_rng(s).random(64).tolist()} for s in seeds]


def sampling_traces() -> list[dict]:
    gen = np.random.default_rng(2024)
    configs = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 1.0), (0.8, 0, 0.9), (0.8, 40, 0.95), (1.0, 1, 1.0), (2.0, 0, 0.5)]
    cases = []
    for vocab in (7, 50, 400, 10000):
        for temperature, top_k, top_p in configs:
            logits = (gen.standard_normal(vocab) * 3.0).astype(np.float32)
            if vocab <= 50:
                logits[3] = logits[1]  # ties at the cut
            config = SamplingConfig(temperature, top_k, top_p)
            probs = process_logits(logits, config)
            seed = int(gen.integers(0, 2**31))
            rng = np.random.default_rng(seed)
            draws = [sample(probs, rng) for _ in range(20)]
            nonzero = np.flatnonzero(probs)
            cases.append({
                "logits": logits.tolist(), "temperature": temperature, "top_k": top_k, "top_p": top_p, "seed": seed,
                "nonzero": nonzero.tolist(), "probs": probs[nonzero].tolist(), "draws": draws,
            })
    return cases


def verify_traces() -> list[dict]:
    gen = np.random.default_rng(99)
    cases = []
    for i in range(60):
        vocab, gamma = int(gen.integers(3, 40)), int(gen.integers(0, 6))
        sharp = 1.0 + 3.0 * gen.random()
        p = process_logits(gen.standard_normal((gamma + 1, vocab)) * sharp, SamplingConfig(1.0))
        q = process_logits(gen.standard_normal((gamma, vocab)) * sharp, SamplingConfig(1.0)) if gamma else np.zeros((0, vocab))
        if i % 3 == 0 and gamma:
            q = 0.5 * q + 0.5 * p[:gamma]  # closer draft: more acceptances
        seed = int(gen.integers(0, 2**31))
        draft = np.array([sample(q[j], np.random.default_rng(seed + j)) for j in range(gamma)], dtype=np.int64)
        logits = gen.standard_normal((gamma + 1, vocab)).astype(np.float32)
        # The greedy case drafts the argmax for a prefix, then diverges.
        greedy_draft = np.argmax(logits[:gamma], axis=-1) if gamma else np.zeros(0, dtype=np.int64)
        if gamma and i % 2:
            greedy_draft[int(gen.integers(0, gamma))] = (greedy_draft[0] + 1) % vocab
        cases.append({
            "p": p.tolist(), "q": q.tolist(), "draft": draft.tolist(), "seed": seed,
            "stochastic": list(verify_stochastic(p, q, draft, np.random.default_rng(seed))),
            "deterministic": list(verify_deterministic(p, draft, np.random.default_rng(seed))),
            "logits": logits.tolist(), "greedy_draft": greedy_draft.tolist(), "greedy": list(verify_greedy(logits, greedy_draft)),
        })
    return cases


def policy_traces() -> list[dict]:
    """The production RoundPolicy (runtime/policy.py), choose → plan → observe(plan, round), over
    scripted drafter parts and simulated rounds: adaptive γ, probes, the loss ledger with a draft
    model's replay held by its share (or whole for a probe), a mixed drafter's choice of part by
    evidence class, α carried into a second sequence. Each round records what the parts reported
    (candidates, evidence, tokens to replay), the plan and the Round given back; the JVM replays
    the parts and Rounds through its own RoundPolicy and must make the same plans."""
    from runtime.drafters.base import CatchesUp, Drafter, Selects
    from runtime.gamma import GammaConfig
    from runtime.policy import Round, RoundPolicy

    class Scripted(Drafter):
        """A part whose reports come from the script for the round keyed by tokens[0]."""

        def __init__(self, name, script):
            self.name, self.script = name, script

        def evidence(self, tokens):
            return self.script[int(tokens[0])]["evidence"].get(self.name, 0)

        def propose(self, tokens, gamma, sampling, rng):
            raise AssertionError("the policy trace drafts nothing")

    class ScriptedModel(Scripted, CatchesUp):
        def replay_tokens(self, tokens):
            return self.script[int(tokens[0])]["replay"]

    class ScriptedMixed(Scripted, Selects):
        def __init__(self, script, members):
            super().__init__("auto", script)
            self.members = members

        def parts(self):
            return self.members

        def candidates(self, tokens):
            return [m for m in self.members if m.name in self.script[int(tokens[0])]["candidates"]]

    def target_s(block, gen):
        return (0.010 + 0.001 * block) * float(gen.uniform(0.9, 1.2))

    cases = []
    runs = (  # drafter, γ config, model α by phase (rounds 0-39, 40-99, 100+), replay seconds per token, seed
        ("model", dict(max_gamma=6, max_loss=0.05, max_failed_probes=3, probe_every=8, decay=0.9), (0.85, 0.02, 0.9), 0.0008, 1),
        ("model", dict(max_gamma=6, max_loss=0.02), (0.45, 0.35, 0.5), 0.0008, 2),
        ("auto", dict(max_gamma=8, max_loss=0.05, max_failed_probes=4, probe_every=8), (0.8, 0.3, 0.85), 0.0008, 3),
        ("auto", dict(max_gamma=6, max_loss=0.01), (0.5, 0.6, 0.4), 0.0008, 4),
        ("lookup", dict(max_gamma=8, max_loss=0.03), (0.0, 0.0, 0.0), 0.0008, 5),
        ("auto", dict(fixed=3, max_gamma=6), (0.7, 0.7, 0.7), 0.0008, 6),
        # A dear replay (a large draft model) after copy streaks: its share decides which rounds the ledger affords.
        ("auto", dict(max_gamma=6, max_loss=0.02, probe_every=8), (0.6, 0.4, 0.6), 0.004, 7),
    )
    for kind, knobs, model_alpha, replay_per_token, seed in runs:
        gen = np.random.default_rng(seed)
        script: list[dict] = []
        copier, model = Scripted("lookup", script), ScriptedModel("model", script)
        drafter = {"model": model, "lookup": copier, "auto": ScriptedMixed(script, [copier, model])}[kind]
        config = GammaConfig(**knobs)
        policy = RoundPolicy()
        seeded = {block: target_s(block, gen) for block in range(1, config.max_gamma + 2)}  # as start-up calibration seeds it
        for block, seconds in seeded.items():
            policy.costs.record_target(block, seconds)
        seeded_step = 0.002 if kind != "lookup" else None
        if seeded_step is not None:
            policy.costs.record_draft("model", 1, seeded_step)
        sequences = []
        for horizon, n_rounds in ((160, 150), (96, 60)):
            policy.start(drafter, horizon, config)
            lag, rounds = 0, []
            for r in range(n_rounds):
                key = len(script)
                match = kind == "lookup" or (kind == "auto" and gen.random() < 0.45)
                evidence = int(gen.integers(1, 6)) if match else 0
                script.append({"candidates": (["lookup"] if match else []) + (["model"] if kind != "lookup" else []),
                               "evidence": {"lookup": evidence}, "replay": lag})
                plan = policy.choose(np.array([key]))
                gamma, part = plan.gamma, plan.drafter
                catch_up_tokens, catch_up_s, draft_s, n_drafted, n_accepted = 0, 0.0, 0.0, 0, 0
                if gamma:
                    if part.name == "model":
                        alpha = model_alpha[0 if r < 40 else 1 if r < 100 else 2]
                        catch_up_tokens, catch_up_s = lag, lag * replay_per_token * float(gen.uniform(0.9, 1.1))
                        n_drafted = gamma
                        draft_s = catch_up_s + gamma * 0.002 * float(gen.uniform(0.9, 1.2))
                    else:
                        alpha = 0.3 + 0.12 * plan.evidence
                        n_drafted = int(gen.integers(1, gamma + 1))  # a copy may find fewer tokens than γ
                        draft_s = 0.00005
                    while n_accepted < n_drafted and gen.random() < alpha:
                        n_accepted += 1
                verify_s = target_s(n_drafted + 1, gen)
                done = Round(part.name if n_drafted else None, gamma, n_drafted, n_accepted, n_accepted + 1, draft_s, verify_s,
                             draft_s + verify_s + 0.0001, catch_up_tokens, catch_up_s)
                policy.observe(plan, done)
                lag = 0 if done.drafter == "model" else lag + done.n_committed
                rounds.append({"key": key, "plan": {"drafter": part.name if part is not None else None, "gamma": gamma,
                                                    "evidence": plan.evidence, "probe": plan.probe, "whole_replay": plan.whole_replay,
                                                    "draft_step_s": plan.draft_step_s, "replay_s": plan.replay_s},
                               "round": {"drafter": done.drafter, "gamma": done.gamma, "n_drafted": done.n_drafted,
                                         "n_accepted": done.n_accepted, "n_committed": done.n_committed, "draft_s": done.draft_s,
                                         "target_s": done.target_s, "round_s": done.round_s,
                                         "catch_up_tokens": done.catch_up_tokens, "catch_up_s": done.catch_up_s},
                               "loss": {name: p.ledger.loss_seconds for name, p in policy.parts.items()}})
            sequences.append({"horizon": horizon, "rounds": rounds})
        state = {name: {"loss_seconds": p.ledger.loss_seconds, "tokens": p.ledger.tokens, "taken": p.ledger.taken,
                        "plain_steps": p.probes.plain_steps, "gap": p.probes.gap, "failed": p.probes.failed,
                        "alpha": {str(k): [e.n_accepted, e.n_rejected] for k, e in p.estimates.items()}}
                 for name, p in policy.parts.items()}
        plans = [r["plan"] for seq in sequences for r in seq["rounds"]]
        log(f"policy {kind} {knobs}: {len(plans)} rounds, γ {sorted({p['gamma'] for p in plans})}, "
            f"probes {sum(p['probe'] for p in plans)} ({sum(p['whole_replay'] for p in plans)} whole), "
            f"replayed rounds {sum(r['round']['catch_up_tokens'] > 0 for seq in sequences for r in seq['rounds'])}")
        cases.append({"name": f"{kind} {knobs}", "drafter": kind, "config": knobs, "script": script, "sequences": sequences,
                      "seeded_target": {str(k): v for k, v in seeded.items()}, "seeded_draft_step": seeded_step, "state": state,
                      "costs": {"target": {str(k): v for k, v in policy.costs.target.items()}, "draft_step": policy.costs.draft_step,
                                "replay_token": policy.costs.replay_token}})
    plans = [r for case in cases for seq in case["sequences"] for r in seq["rounds"]]
    # The trace has teeth only if the policy's every branch shows in it: check they do.
    assert any(r["plan"]["probe"] and r["plan"]["whole_replay"] for r in plans), "no probe paid its replay whole"
    assert any(r["plan"]["probe"] and not r["plan"]["whole_replay"] and r["round"]["catch_up_tokens"] for r in plans), "no probe replay by share"
    assert any(not r["plan"]["probe"] and r["round"]["catch_up_tokens"] for r in plans), "no round on merit replayed"
    assert len({r["plan"]["gamma"] for r in plans}) >= 5 and any(r["plan"]["drafter"] == "lookup" and r["plan"]["evidence"] for r in plans)
    return cases


class RecordingClock:
    """A fake clock for decode_steps: time moves only when `advance` is called (by the fake or
    wrapped models, as their passes would take), and every reading is recorded for the JVM."""

    def __init__(self):
        self.now = 0.0
        self.readings: list[float] = []

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        self.readings.append(self.now)
        return self.now


class ScriptedRng(RecordingRng):
    """Hands out the given uniforms first, then numpy's stream; records all of them."""

    def __init__(self, first: list[float], seed: int):
        super().__init__(seed)
        self.first = list(first)

    def random(self):
        if self.first:
            u = self.first.pop(0)
            self.drawn.append(u)
            return u
        return super().random()


def commit_traces() -> list[dict]:
    """The commit policy (edge_spec/commit.py) on hand-made and random rounds; decoding is
    the concatenation of a small piece table."""
    from edge_spec.commit import commit

    pieces = ["a", "b", "c", "ab", "\n", "END", "E", "ND", " ", "x", "😀", "yz", "<", "/s>", "é", "stop"]
    eos = [1, 5]
    fixed = [
        # (step tokens, generated so far, max new, room, text before, stops)
        ([0, 1], 2, 4, 100, "ab", []),  # EOS exactly at the budget: eos
        ([0, 2, 1], 2, 4, 100, "ab", []),  # EOS beyond the budget: cut at the budget, no EOS
        ([0, 2, 3, 1], 0, 10, 2, "", []),  # EOS beyond the context: context
        ([0, 1, 2], 0, 2, 100, "", []),  # EOS inside the budget, then more
        ([9, 0, 11, 2], 0, 20, 100, "", ["yz", "xa"]),  # the later-listed stop occurs earlier
        ([3, 12, 13], 0, 20, 100, "x", ["</s>", "ab<"]),  # two stops overlap: the earliest start wins
        ([6, 7], 0, 20, 100, "ab", ["END"]),  # a stop split across two tokens
        ([7, 2], 1, 20, 100, "aE", ["END", "c"]),  # a stop that began in the earlier text
        ([10, 15, 0], 0, 20, 100, "😀", ["stop", "😀s"]),  # astral characters before the cut
        ([15, 1], 0, 20, 100, "", ["stop"]),  # EOS and a stop string in one round: stop
        ([0, 0, 0], 0, 3, 3, "", []),  # budget and context at once: length
    ]
    gen = random.Random(19)
    cases = []
    for i in range(300):
        if i < len(fixed):
            step, n_generated, max_new, room, before, stops = fixed[i]
        else:
            step = [gen.randrange(len(pieces)) for _ in range(gen.randint(1, 6))]
            max_new = gen.randint(1, 12)
            n_generated = gen.randint(0, max_new - 1)
            room = gen.randint(1, 10)
            before = "".join(gen.choice(pieces[:4] + pieces[8:]) for _ in range(gen.randint(0, 3)))
            stops = [gen.choice(["b", "ab", "END", "x", "c\n", "😀", "ND", "zz", "stop", "/s", "b a"]) for _ in range(gen.randint(0, 3))]
            stops = [s for s in stops if s not in before]  # earlier text held no stop: decoding went on
        result = commit(step, n_generated, max_new, room, eos, before, stops, lambda kept: "".join(pieces[t] for t in kept))
        cases.append({"step": step, "n_generated": n_generated, "max_new_tokens": max_new, "room": room, "eos": eos,
                      "text": before, "stops": stops, "kept": list(result.tokens), "piece": result.piece,
                      "text_after": result.text, "stop_reason": result.stop_reason})
    return [{"pieces": pieces, "cases": cases}]


def cost_model_traces() -> list[dict]:
    """CostModel.target_cost (interpolation, and the slope extended past the largest block),
    replay_cost and cost_ratio for EMA-recorded tables."""
    from runtime.gamma import CostModel

    gen = np.random.default_rng(21)
    cases = []
    for i in range(16):
        costs = CostModel()
        records = []
        blocks = sorted(gen.choice(np.arange(1, 10), size=int(gen.integers(1, 5)), replace=False).tolist())
        for _ in range(int(gen.integers(1, 4))):
            for b in blocks:
                seconds = float(0.01 * (1 + 0.1 * b) * gen.uniform(0.7, 1.3))
                costs.record_target(b, seconds)
                records.append(["target", b, seconds])
        if i % 2:
            steps, seconds = int(gen.integers(1, 5)), float(gen.uniform(0.001, 0.01))
            costs.record_draft("model", steps, seconds)
            records.append(["draft", steps, seconds])
        if i % 4 == 3:
            n, seconds = int(gen.integers(1, 30)), float(gen.uniform(0.001, 0.02))
            costs.record_replay("model", n, seconds)
            records.append(["replay", n, seconds])
        cases.append({"records": records,
                      "target_cost": [costs.target_cost(b) for b in range(1, 14)],
                      "replay_cost": [costs.replay_cost("model", n) for n in (0, 1, 5, 40)],
                      "cost_ratio": costs.cost_ratio("model")})
    return cases


class FakeRunner(CacheRows):
    """A stand-in ModelRunner without weights: logits [V] are a fixed function of the tokens
    before each position (numpy-seeded from their hash), read from the cache's row tokens, so
    a rollback that keeps a wrong row asks for a prefix Python never did. Every row served is
    recorded (prefix -> logits) for the JVM's table model; passes advance the fake clock."""

    def __init__(self, role: str, vocab: int, max_context: int, seed: int, clock: RecordingClock | None,
                 cost: tuple[float, float], base: "FakeRunner | None" = None, agree: float = 1.0):
        from runtime.kv_cache import KVCache

        self.role, self.vocab, self.seed, self.clock, self.cost = role, vocab, seed, clock, cost
        self.base, self.agree = base, agree  # a draft: the base's logits where it agrees, else its own
        self.cache = KVCache(range(0), 1, max_context, 1)
        self.table: dict[str, list[float]] = {}
        self.overrides: dict[tuple[int, ...], np.ndarray] = {}

    def logits(self, prefix: tuple[int, ...]) -> np.ndarray:
        if prefix in self.overrides:
            return self.overrides[prefix]
        key = hash_tokens(prefix[-3:]) * 1000 + len(prefix)
        if self.base is not None and np.random.default_rng([key, 77]).random() < self.agree:
            return self.base.logits(prefix) + np.float32(0.25) * np.random.default_rng([key, self.seed]).standard_normal(self.vocab).astype(np.float32)
        return (np.random.default_rng([key, self.seed]).standard_normal(self.vocab) * 2.5).astype(np.float32)

    def forward(self, token_ids, n_logits=None, trunk_hidden=None) -> np.ndarray:
        token_ids = [int(t) for t in np.asarray(token_ids).reshape(-1)]
        start = self.cache.kv_len
        self.cache.check_room(start, len(token_ids))
        prefix = tuple(int(t) for t in self.cache.row_tokens[:start])
        rows = []
        for token in token_ids:
            prefix = prefix + (token,)
            row = self.logits(prefix)
            self.table[",".join(map(str, prefix))] = row.tolist()
            rows.append(row)
        self.cache.extend(np.asarray(token_ids, dtype=np.int64))
        if self.clock is not None:
            self.clock.advance(self.cost[0] + self.cost[1] * len(token_ids))
        n = len(token_ids) if n_logits is None else n_logits
        return np.stack(rows[len(rows) - n :])

    def score(self, block, trunk_hidden=None) -> Scored:
        """The pass contract (runtime/passes.py) on chains: what the loop calls."""
        assert block.is_chain and block.positions[0] == self.kept and not block.hidden
        return Scored(self.forward(block.tokens, block.n_logits, trunk_hidden))

    def prefill(self, token_ids, chunk: int = 256, hidden=()) -> None:
        for begin in range(0, len(token_ids), chunk):
            self.forward(token_ids[begin : begin + chunk], n_logits=1)


def hash_tokens(tokens) -> int:
    h = 17
    for t in tokens:
        h = (h * 31 + int(t)) % 1_000_003
    return h


def loop_traces() -> list[dict]:
    """decode_steps on fake models, round by round: the empty-residual fallback that re-draws
    the rejected token, and adaptive γ under a fake clock (draft model, auto, greedy and sampled)."""
    from runtime.drafters.base import Drafter, Proposal
    from runtime.drafters.draft_model import DraftModelDrafter
    from runtime.drafters.mixed import MixedDrafter
    from runtime.drafters.prompt_lookup import PromptLookupDrafter
    from runtime.gamma import GammaConfig
    from runtime.loop import decode_steps
    from runtime.policy import RoundPolicy

    class ScriptedDrafter(Drafter):
        """Proposes fixed tokens with given q, recorded per call for the JVM to replay."""
        name = "scripted"

        def __init__(self, script):
            self.script, self.calls = script, []

        def propose(self, tokens, gamma, sampling, rng):
            drafted, probs = self.script(tokens, gamma)
            self.calls.append({"tokens": [int(t) for t in tokens], "gamma": gamma, "draft": drafted, "q": probs.tolist()})
            return Proposal(np.array(drafted, dtype=np.int64), probs)

    cases = []
    vocab = 6
    # 1. The fallback: p = [0, 0, ½, 0, ½, 0] where q exceeds it by one ulp at the drafted token 2
    #    (p == q up to rounding), u rejects it, the residual is empty, and p re-draws token 2.
    prompt = [1, 3, 0, 2]
    target = FakeRunner("target", vocab, 64, 3, None, (0.0, 0.0))
    tie = np.full(vocab, -1e30, dtype=np.float32)
    tie[[2, 4]] = 0.0
    target.overrides[tuple(prompt)] = tie
    sampling = SamplingConfig(temperature=1.0, seed=5)

    def script(tokens, gamma):
        p = process_logits(target.logits(tuple(int(t) for t in tokens)), sampling)
        if len(tokens) == len(prompt):
            q = np.stack([p, np.full(vocab, 1.0 / vocab)])
            q[0, 2] = np.nextafter(p[2], 1.0)
            return [2, 5], q
        first = int(np.argmax(p))
        q = np.stack([0.5 * p + 0.5 / vocab, np.full(vocab, 1.0 / vocab)])
        return [first, (first + int(tokens[-1])) % vocab], q

    drafter = ScriptedDrafter(script)
    rng = ScriptedRng([1.0 - 2.0**-53, 0.25], 5)
    policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=2))
    rounds = []
    for step in decode_steps(target, drafter, prompt, sampling, rng, policy):
        rounds.append({"tokens": list(step.tokens), "gamma": step.gamma, "drafted": step.n_drafted, "accepted": step.n_accepted,
                       "drafter": step.drafter, "target_kv": target.cache.kv_len})
        if len(rounds) == 8:
            break
    assert rounds[0]["accepted"] == 0 and rounds[0]["tokens"] == [2], rounds[0]  # the case exists only if this holds
    cases.append({"name": "fallback re-draws the rejected token", "vocab": vocab, "max_context": 64, "prompt": prompt,
                  "temperature": 1.0, "top_k": 0, "top_p": 1.0, "seed": 5, "drafter": "scripted", "gamma": 2,
                  "target_table": target.table, "calls": drafter.calls, "uniforms": rng.drawn, "rounds": rounds})

    # 2. Adaptive γ with a fake clock: target pass 10 ms + 1 ms/token, draft 2 ms + 0.3 ms/token.
    prompt = [3, 7, 1, 9, 4, 7, 1, 9, 2, 5, 11, 3, 7, 1]
    runs = (("model", 0.8, 0.0, None, 0.01, 2), ("model", 0.5, 0.9, 3, 0.5, 50), ("auto", 0.7, 0.8, 4, 0.01, 2),
            ("model", 0.15, 0.0, None, 0.01, 2), ("auto", 0.95, 1.0, 8, 0.01, 2), ("model", 0.6, 0.0, None, 1.0, 100))
    for kind, agree, temperature, seed, max_loss, max_failed_probes in runs:
        vocab, max_context = 16, 160
        clock = RecordingClock()
        target = FakeRunner("target", vocab, max_context, 11, clock, (0.010, 0.001))
        draft = FakeRunner("draft", vocab, max_context, 12, clock, (0.002, 0.0003), base=target, agree=agree)
        model = DraftModelDrafter(draft)
        drafter = model if kind == "model" else MixedDrafter([PromptLookupDrafter()], model)
        sampling = SamplingConfig(temperature=temperature, seed=seed)
        rng = RecordingRng(seed)
        config = GammaConfig(max_gamma=6, max_loss=max_loss, max_failed_probes=max_failed_probes)
        policy = RoundPolicy().start(drafter, 96, config)
        costs = policy.costs
        rounds, total = [], 0
        for step in decode_steps(target, drafter, prompt, sampling, rng, policy, clock=clock):
            rounds.append({"tokens": list(step.tokens), "gamma": step.gamma, "drafted": step.n_drafted, "accepted": step.n_accepted,
                           "drafter": step.drafter, "target_kv": target.cache.kv_len, "draft_kv": draft.cache.kv_len,
                           "draft_s": step.draft_s, "target_s": step.target_s})
            total += len(step.tokens)
            if total >= 96 or len(prompt) + total + 8 >= max_context:
                break
        gammas = [r["gamma"] for r in rounds]
        log(f"loop adaptive {kind} agree={agree} T={temperature}: {len(rounds)} rounds, γ {sorted(set(gammas))}, "
            f"plain rounds {gammas.count(0)}")
        cases.append({"name": f"adaptive {kind} agree={agree} T={temperature}", "vocab": vocab, "max_context": max_context,
                      "prompt": prompt, "temperature": temperature, "top_k": 0, "top_p": 1.0, "seed": seed, "drafter": kind,
                      "gamma": None, "max_gamma": 6, "max_loss": max_loss, "max_failed_probes": max_failed_probes, "horizon": 96, "target_table": target.table, "draft_table": draft.table,
                      "clock": clock.readings, "uniforms": rng.drawn, "rounds": rounds,
                      "costs": {"target": {str(k): v for k, v in costs.target.items()}, "draft_step": costs.draft_step,
                                "replay_token": costs.replay_token}})
    return cases


def drafter_traces() -> list[dict]:
    """DraftModelDrafter's cache bookkeeping, call by call: prefill at reset, replay after
    sitting out rounds, and rollback when the pending token equals the rejected draft."""
    from runtime.drafters.draft_model import DraftModelDrafter

    vocab = 16
    target = FakeRunner("target", vocab, 64, 11, None, (0.0, 0.0))
    draft = FakeRunner("draft", vocab, 64, 12, None, (0.0, 0.0), base=target, agree=0.8)
    drafter = DraftModelDrafter(draft)
    prompt = [3, 7, 1, 9, 4]
    sampling = SamplingConfig()
    ops = []

    def record(op, **kw):
        ops.append({"op": op, **kw, "kv_len": draft.cache.kv_len})

    def propose(tokens, gamma):
        replay = drafter.replay_tokens(np.array(tokens))
        proposal = drafter.propose(np.array(tokens), gamma, sampling, None)
        record("propose", tokens=tokens, gamma=gamma, replay=replay, draft=proposal.tokens.tolist(), catch_up_tokens=proposal.catch_up_tokens)
        return proposal.tokens.tolist()

    drafter.reset(np.array(prompt[:-1]))
    record("reset", tokens=prompt[:-1])
    tokens = list(prompt)
    drafted = propose(tokens, 3)
    # The target rejects d1 and its fallback draws d1 again: the pending token equals the rejected draft.
    tokens = tokens + drafted[:1]
    drafter.accepted(np.array(tokens), 0)
    record("accepted", tokens=tokens, n_accepted=0)
    drafted = propose(tokens, 2)
    tokens = tokens + drafted + [5]
    drafter.accepted(np.array(tokens), 2)
    record("accepted", tokens=tokens, n_accepted=2)
    # Five plain rounds the draft sat out: it replays them before drafting.
    tokens = tokens + [1, 2, 3, 4, 6]
    propose(tokens, 2)
    drafter.reset(np.array([3, 7, 1, 2, 8, 6]))  # a new prompt sharing three tokens: the rest is prefilled
    record("reset", tokens=[3, 7, 1, 2, 8, 6])
    return [{"vocab": vocab, "max_context": 64, "draft_table": draft.table, "ops": ops}]


# -- tokenizers ----------------------------------------------------------------------------------


def tokenizer_strings() -> list[str]:
    fixed = [
        "", " ", "  ", "\n", "\n\n\n", "\t", " \t \n ", "\r\n", "a\r\nb\r\n\r\n", "hello", " hello", "Hello world!",
        "The quick brown fox jumps over the lazy dog.", "I'm sure you've heard they'll say it's 'fine' — we'd've.",
        "DON'T SHOUT: IT'S LOUD, WE'LL SEE", "numbers 1234567890 and 3.14159 and 1,000,000 and ٣٤٥ and ①②",
        "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
        "class Foo:\n\tdef __init__(self):\n\t\tself.x = {'a': [1, 2, 3]}\n",
        "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }  // dot",
        "    indented\n        more\n            most   \n", "trailing spaces    ", "   leading", "a    b     c      d",
        "x = 1;;\ny=2 ;  \n\n\tz   =   3", "#include <stdio.h>\nint main(void) { printf(\"%d\\n\", 42); }",
        "SELECT * FROM t WHERE id = 5 AND name LIKE '%ab%';", "<div class=\"x\">&amp; &lt;tag&gt;</div>",
        "https://example.com/path?q=1&r=two#frag", "email: someone@example.org", "emoji 😀👍🏽🇫🇷 family 👨‍👩‍👧‍👦",
        "中文分词测试：你好，世界！", "日本語のテキスト、カタカナとひらがな。", "한국어 문장입니다.", "Ελληνικά κείμενα", "Русский текст, ёлка.",
        "العربية نص", "עברית טקסט", "हिन्दी पाठ", "ไทยภาษา", "café naïve résumé Ångström", "e\u0301 combining accent, n\u0303",
        "nbsp\u00a0here and\u3000ideographic space", "zero\u200bwidth\u200djoiner", "line\u2028sep\u2029para", "\u0085next line",
        "tab\tand\u000bvertical\u000cform feed", "mixed 中文 and English 123 ！？", "ALLCAPS lower MiXeD", "snake_case camelCase kebab-case",
        "....!!!???,,,;;;", "$$$ %%% ^^^ &&& *** ((( )))", "a'b'c 's 't 're", "'S 'T 'RE 'VE 'M 'LL 'D", "'ſ long s",
        "\u001c\u001d\u001e\u001f unit separators", "\x00\x01\x02 controls", "\U0001F600\U0001F9E0\U00010348 astral",
        "<|endoftext|>", "before<|im_start|>user\nhi<|im_end|>after", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>assistant\n",
        "<s>hi</s><pad>", "<|fim_prefix|>def f():<|fim_suffix|>\n<|fim_middle|>", "2024-01-01T12:34:56Z",
        "      \n      \n", "\n \n \n", " \n\n ", "  \t\t  \n\n  x", "ends with newline\n", "ends with spaces   \n   ",
    ]
    rng = random.Random(1234)
    pieces = [
        "the", " cat", " sat", "Hello", "世界", "😀", " ", "  ", "\n", "\t", "def", "(", ")", ":", "    ", "123", "4", "'s", "'ll",
        "é", "ß", "Ω", "ж", "ع", "\u00a0", "\u3000", "{", "}", "[", "]", "=", "==", "->", "//", "#", "\"", "'", "\r\n", "x", "_",
        "<|im_end|>", "ŉ", "İ", "ﬁ", "①", "٣", "Ⅻ", "🇫🇷", "\u200b", "…", "—", "«", "»", "¿", "¡",
    ]
    generated = ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 14))) for _ in range(200)]
    alphabet = [chr(c) for c in list(range(32, 127)) + list(range(0xA0, 0x250)) + list(range(0x370, 0x400)) + list(range(0x4E00, 0x4E80))]
    noise = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 30))) for _ in range(60)]
    whitespace = ["".join(rng.choice([" ", "\t", "\n", "\r", "\u00a0", "a", "1"]) for _ in range(rng.randint(1, 20))) for _ in range(40)]
    return fixed + generated + noise + whitespace


def tokenizer_trace(name: str, tokenizer_json: Path, out: Path) -> None:
    from tokenizers import Tokenizer

    shutil.copyfile(tokenizer_json, out / f"tok_{name}.tokenizer.json")
    tok = Tokenizer.from_file(str(tokenizer_json))
    cases = []
    for text in tokenizer_strings():
        with_special = tok.encode(text, add_special_tokens=True).ids
        plain = tok.encode(text, add_special_tokens=False).ids
        cases.append({
            "text": text, "ids": with_special, "ids_plain": plain,
            "decoded": tok.decode(with_special, skip_special_tokens=True),
            "decoded_special": tok.decode(with_special, skip_special_tokens=False),
        })
    rng = random.Random(7)
    vocab = tok.get_vocab_size()
    decodes = []
    for _ in range(100):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        decodes.append({"ids": ids, "text": tok.decode(ids, skip_special_tokens=True)})
    dump(out / f"tok_{name}.json", {"tokenizer": f"tok_{name}.tokenizer.json", "cases": cases, "decodes": decodes})
    log(f"tokenizer {name}: {len(cases)} strings, {len(decodes)} random decodes")


def qwen_tokenizer_json(out: Path) -> Path:
    _, real = bundle_builders()
    bundles_root = real.bundles_root

    for root in (bundles_root(), Path("/work/bundles")):
        for candidate in sorted(root.glob("qwen*/tokenizer.json")) if root.is_dir() else []:
            if (candidate.parent / "manifest.json").is_file():
                return candidate
    from transformers import AutoTokenizer

    from edge_spec.catalog import CATALOG, models_dir

    gguf = CATALOG["qwen2.5-coder-0.5b"].gguf_file
    if not (models_dir() / gguf).is_file():
        raise SystemExit(f"write_traces: needs a qwen bundle or {gguf} in {models_dir()} (shared/models/fetch.sh)")
    log("building the Qwen2 tokenizer from the GGUF")
    backend = AutoTokenizer.from_pretrained(str(models_dir()), gguf_file=gguf).backend_tokenizer
    path = out / "qwen-from-gguf.tokenizer.json"
    backend.save(str(path))
    return path


# -- models --------------------------------------------------------------------------------------


# Adaptive γ on real graphs: a loose ledger, so random-weight drafts keep being probed (and replay).
ADAPTIVE_CONFIG = dict(max_gamma=6, max_loss=0.3, max_failed_probes=6)
# Fake seconds per stage pass of T tokens, by role, for adaptive-γ traces on real graphs.
STAGE_COST = {"target": (0.010, 0.001), "draft": (0.002, 0.0003), "layer_skip": (0.004, 0.0005)}


@contextmanager
def fake_stage_time(clock: RecordingClock):
    """Every ModelRunner stage pass advances the fake clock as STAGE_COST says."""
    from runtime.model import ModelRunner

    original = ModelRunner.run_stage

    def timed(self, index, x, start, *args, **kwargs):
        fixed, per_token = STAGE_COST[self.role]
        clock.advance(fixed + per_token * x.shape[1])
        return original(self, index, x, start, *args, **kwargs)

    ModelRunner.run_stage = timed
    try:
        yield
    finally:
        ModelRunner.run_stage = original


def generation_trace(engine, prompt_ids, drafter: str, gamma: int | None, sampling: SamplingConfig, max_new: int) -> dict:
    """Python's engine loop. γ None: adaptive, from a fresh cost model and controllers, timed
    by a fake clock that stage passes advance (its readings go into the trace)."""
    from runtime.gamma import GammaConfig
    from runtime.loop import decode_steps
    from runtime.policy import RoundPolicy

    ADAPTIVE = GammaConfig(**ADAPTIVE_CONFIG)
    engine.use_drafter(drafter, gamma or None)  # γ 0 names plain decoding, which the config calls drafter "none"
    engine.target.cache.reset()
    if engine.drafter is not None:
        engine.drafter.reset()
    rng = RecordingRng(sampling.seed)
    eos = engine.tokenizer.eos_token_ids
    steps, generated = [], []
    clock = RecordingClock()
    if gamma is None:
        policy = RoundPolicy().start(engine.drafter, max_new, ADAPTIVE)
    else:
        policy = engine.policy.start(engine.drafter, max_new, engine.config.gamma_for())
    with fake_stage_time(clock):
        for step in decode_steps(engine.target, engine.drafter, prompt_ids, sampling, rng, policy, clock=clock):
            steps.append({"tokens": list(step.tokens), "gamma": step.gamma, "drafted": step.n_drafted, "accepted": step.n_accepted,
                          "drafter": step.drafter})
            new = list(step.tokens)
            hit = next((i for i, t in enumerate(new) if t in eos), None)
            if hit is not None:
                new = new[: hit + 1]
            generated += new[: max_new - len(generated)]
            if hit is not None or len(generated) >= max_new:
                break
    expected = generated  # what Engine.generate returns for these settings (no stop strings)
    return {"drafter": drafter, "gamma": gamma, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "seed": sampling.seed, "max_new_tokens": max_new, "token_ids": expected,
            "steps": steps, "uniforms": rng.drawn, "clock": clock.readings if gamma is None else None,
            "max_gamma": ADAPTIVE.max_gamma, "max_loss": ADAPTIVE.max_loss, "max_failed_probes": ADAPTIVE.max_failed_probes}


def stop_trace(engine, prompt_ids, drafter: str, sampling: SamplingConfig, max_new: int) -> dict:
    """Engine.generate with two stop strings inside one piece of the output (so one round
    brings both), the later-listed one starting first: the earliest in the text must win."""
    from runtime.engine import GenerateConfig

    engine.use_drafter(drafter, 3)
    text, stops = "", ()
    for piece, _ in engine.stream(prompt_ids, GenerateConfig(max_new, sampling)):
        first, second = piece[1:3], piece[:2]
        # Some text first, so the cut lands inside a later round.
        if not stops and len(text) >= 8 and len(piece) >= 3 and first != second and first not in text + piece[0] and second not in text:
            stops = (first, second)
        text += piece
    if not stops:
        raise SystemExit(f"write_traces: no piece of 3+ characters to take stop strings from ({drafter}: {text!r})")
    result = engine.generate(prompt_ids, GenerateConfig(max_new, sampling, stops))
    return {"drafter": drafter, "gamma": 3, "temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
            "seed": sampling.seed, "max_new_tokens": max_new, "stop": list(stops), "text": result.text,
            "token_ids": result.token_ids, "stop_reason": result.stop_reason}


def model_trace(name: str, bundle: Path, prompt: str, runs: list[tuple[str, bool]], out: Path, max_new: int, full_logits: bool,
                adaptive: list[tuple[str, bool]] = (), stop_runs: list[tuple[str, bool]] = ()) -> None:
    from runtime.engine import Engine, EngineConfig

    began = time.perf_counter()
    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    prompt_ids = engine.encode(prompt)
    engine.target.cache.reset()
    logits = engine.target.forward(prompt_ids)  # [T, V]
    rows = list(range(len(prompt_ids))) if full_logits else [len(prompt_ids) - 1]
    stride = 1 if full_logits else 97
    samples = {"rows": rows, "stride": stride, "values": [logits[r, ::stride].tolist() for r in rows]}
    engine.target.cache.reset()
    gens = []
    greedy = SamplingConfig()
    sampled = SamplingConfig(temperature=0.8, top_k=50, top_p=0.9, seed=1234)
    for drafter, stochastic in runs:
        gens.append(generation_trace(engine, prompt_ids, drafter, 3, sampled if stochastic else greedy, max_new))
    gens.append(generation_trace(engine, prompt_ids, "none", 0, SamplingConfig(temperature=1.0, seed=7), max_new))
    for drafter, stochastic in adaptive:
        gens.append(generation_trace(engine, prompt_ids, drafter, None, sampled if stochastic else greedy, max_new))
    stops = [stop_trace(engine, prompt_ids, d, sampled if stochastic else greedy, max_new) for d, stochastic in stop_runs]
    dump(out / f"model_{name}.json", {"bundle": str(bundle), "prompt": prompt, "prompt_ids": prompt_ids, "logits": samples,
                                      "generations": gens, "stops": stops})
    log(f"model {name}: {len(gens)} generations in {time.perf_counter() - began:.1f}s")


def tiny_bundles(out: Path) -> dict[str, Path]:
    import torch

    tiny, _ = bundle_builders()

    torch.set_num_threads(1)
    root = out / "tiny"
    if root.exists():
        shutil.rmtree(root)
    tok = tiny.make_tokenizer("a")
    llama = tiny.make_llama(root / "hf-llama", tok, n_layers=4, seed=0)
    qwen2 = tiny.make_qwen2(root / "hf-qwen2", tok, n_layers=3, seed=1)
    draft = tiny.make_llama(root / "hf-draft", tok, n_layers=2, seed=5)
    bundles = {"llama": root / "llama", "qwen2": root / "qwen2"}
    # Portable graphs: the Kotlin core runs standard ONNX ops and copies new KV rows itself.
    tiny.export(llama, bundles["llama"], drafts=(str(draft), "layer-skip:1"), attention="portable")
    tiny.export(qwen2, bundles["qwen2"], drafts=(str(draft), "layer-skip:0,2"), attention="portable")
    return bundles


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--no-real", action="store_true", help="skip the SmolLM2/Qwen parts (says so in index.json)")
    parser.add_argument("--pure", action="store_true", help="only the traces that need no bundle (no tests/ import, no torch)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    dump(out / "rng.json", rng_traces())
    dump(out / "sampling.json", sampling_traces())
    dump(out / "verify.json", verify_traces())
    dump(out / "policy.json", policy_traces())
    dump(out / "commit.json", commit_traces())
    dump(out / "cost_model.json", cost_model_traces())
    dump(out / "loop.json", loop_traces())
    dump(out / "drafter.json", drafter_traces())
    log(f"pure traces in {time.perf_counter() - began:.1f}s")
    if args.pure:
        dump(out / "index.json", {"tiny": False, "real": False})
        return 0

    tiny, real = bundle_builders()
    bundles = tiny_bundles(out)
    log(f"tiny bundles in {time.perf_counter() - began:.1f}s")
    tokenizer_trace("tiny", bundles["llama"] / "tokenizer.json", out)
    prompt = tiny.PROMPT + " the quick brown fox jumps over the"
    both = lambda drafters: [(d, s) for d in drafters for s in (False, True)]  # noqa: E731
    model_trace("tiny_llama", bundles["llama"], prompt, both(["none", "model", "layer-skip", "lookup", "auto"]), out, 24, True,
                adaptive=both(["model", "layer-skip", "auto"]), stop_runs=[("none", False), ("auto", False), ("model", True)])
    model_trace("tiny_qwen2", bundles["qwen2"], prompt, both(["model", "layer-skip", "auto"]), out, 24, True,
                adaptive=[("model", True), ("auto", False)], stop_runs=[("layer-skip", True)])
    index = {"tiny": True, "real": not args.no_real}
    if not args.no_real:
        smollm2 = real.bundle("smollm2-fp32")
        tokenizer_trace("smollm2", smollm2 / "tokenizer.json", out)
        tokenizer_trace("qwen2", qwen_tokenizer_json(out), out)
        code = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n"
        # A 135M model on a 2-core CI box: few, short runs (greedy plain/layer-skip/auto, sampled layer-skip).
        runs = [("none", False), ("layer-skip", False), ("auto", False), ("layer-skip", True)]
        model_trace("smollm2", smollm2, code, runs, out, 12, False, adaptive=[("auto", False)], stop_runs=[("layer-skip", False)])
    dump(out / "index.json", index)
    log(f"done in {time.perf_counter() - began:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
