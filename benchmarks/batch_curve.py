"""python -m benchmarks batch_curve BUNDLE [--batch 1,2,4,8] [--kv-len 512] [--repeats 20] [--prompts SPEC] [--decode 64] [--out FILE.json]

What batched plain decoding (runtime/batch.py) buys on this machine, in two parts, each side by
side with today's one-sequence-at-a-time plain decoding in the same process:

- passes: every slot holds --kv-len rows; a pass feeding B slots one token each, timed --repeats
  times for each B, interleaved with the loop's own 1-token pass of one sequence. Cost in
  one-token passes and the throughput it implies (B tokens per pass).
- decode: for each B > 1, the first B prompts of --prompts decoded greedily for --decode tokens, all
  at once (one pass per token of every sequence) and one after another with the loop's runner,
  --decode-repeats times each, alternating; tokens/s of each (decode only, prefill excluded) and
  how many sequences came out token for token the same (int4: a 1-row pass takes other kernels
  than a batched one).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def positive_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated whole numbers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected numbers of at least 1, got {text!r}")
    return sorted(set(values))


def _filler(engine, n: int) -> list[int]:
    """n tokens of this repository's own source, for KV rows that hold real text."""
    text = Path(__file__).with_name("batch_curve.py").read_text() * 8
    ids = engine.encode(prompt=text, parse_special=False)
    if len(ids) < n:
        raise ValueError(f"--kv-len {n} is more than the {len(ids)} tokens of filler text")
    return ids[:n]


def passes(engine, target, batches: list[int], kv_len: int, repeats: int) -> dict:
    filler = _filler(engine, kv_len)
    solo = engine.target
    solo.cache.reset()
    solo.prefill(filler)
    for slot in range(max(batches)):
        target.slots.caches[slot].reset()
        target.runner(slot).prefill(filler)
    token = filler[-1]
    times: dict[str, list[float]] = {"solo": [], **{str(b): [] for b in batches}}

    def timed(key, run, caches):
        began = time.perf_counter()
        run()
        times[key].append(time.perf_counter() - began)
        for cache in caches:
            cache.kv_len -= 1  # the row just written is dropped: every pass sees kv_len rows

    for warm in range(2):
        timed("solo", lambda: solo.forward([token]), [solo.cache])
        for b in batches:
            timed(str(b), lambda b=b: target.step(list(range(b)), [token] * b), target.slots.caches[:b])
    times = {k: [] for k in times}
    for _ in range(repeats):
        timed("solo", lambda: solo.forward([token]), [solo.cache])
        for b in batches:
            timed(str(b), lambda b=b: target.step(list(range(b)), [token] * b), target.slots.caches[:b])
    solo_ms = statistics.median(times["solo"]) * 1e3
    rows = []
    for b in batches:
        ms = statistics.median(times[str(b)]) * 1e3
        rows.append({"batch": b, "pass_ms": round(ms, 2), "one_token_passes": round(ms / solo_ms, 3),
                     "tokens_per_s": round(b / ms * 1e3, 2), "throughput_vs_solo": round(b * solo_ms / ms, 3)})
    return {"kv_len": kv_len, "repeats": repeats, "solo_pass_ms": round(solo_ms, 2), "rows": rows}


def _batched_decode(engine, prompts, n: int) -> tuple[float, list[list[int]]]:
    from runtime.engine import GenerateConfig

    config = GenerateConfig(max_new_tokens=n, speculation={"drafter": "none"})
    sequences = [engine.slot_sequence(slot, prompt, config) for slot, prompt in enumerate(prompts)]
    engine.advance_slots(sequences)  # every prompt is prefilled before the first pass: not timed
    began = time.perf_counter()
    for _ in range(n - 1):
        engine.advance_slots(sequences)
    took = time.perf_counter() - began
    return took, [s.out.generated for s in sequences]


def _solo_decode(runner, prompts, n: int) -> tuple[float, list[list[int]]]:
    from edge_spec.sampling import SamplingConfig
    from runtime.loop import verify

    greedy, took, tokens = SamplingConfig(), 0.0, []
    for prompt in prompts:
        runner.cache.reset()
        runner.prefill(prompt[:-1])
        out = [int(verify(runner.forward([prompt[-1]]), None, greedy, None)[1])]
        began = time.perf_counter()
        for _ in range(n - 1):
            out.append(int(verify(runner.forward([out[-1]]), None, greedy, None)[1]))
        took += time.perf_counter() - began
        tokens.append(out)
    return took, tokens


def decode(engine, prompts: list[list[int]], n: int, repeats: int) -> dict:
    """Both ways `repeats` times, the order alternating (this host drifts by 10-30% within
    minutes); tokens/s from the medians, the speedup as the median of the repeats' ratios."""
    runs = {"batched": [], "solo": []}
    for r in range(repeats):
        for way in (("batched", "solo") if r % 2 == 0 else ("solo", "batched")):
            runs[way].append(_batched_decode(engine, prompts, n) if way == "batched" else _solo_decode(engine.target, prompts, n))
    total = len(prompts) * (n - 1)
    batched, solo = runs["batched"][0][1], runs["solo"][0][1]
    return {"sequences": len(prompts), "tokens_each": n, "repeats": repeats,
            "batched_tokens_per_s": round(total / statistics.median(t for t, _ in runs["batched"]), 2),
            "one_at_a_time_tokens_per_s": round(total / statistics.median(t for t, _ in runs["solo"]), 2),
            "speedup": round(statistics.median(s / b for (b, _), (s, _) in zip(runs["batched"], runs["solo"])), 3),
            "speedups": [round(s / b, 3) for (b, _), (s, _) in zip(runs["batched"], runs["solo"])],
            "identical_sequences": sum(a == b for a, b in zip(batched, solo)),
            "first_difference": [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(batched, solo)]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks batch_curve", description=__doc__.splitlines()[2])
    parser.add_argument("bundle")
    parser.add_argument("--batch", type=positive_list, default=[1, 2, 4, 8], help="batch sizes, comma-separated")
    parser.add_argument("--kv-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--prompts", default="humaneval:30-34,stdlib-edit:8-12", help="as bench's --prompts; the first max(--batch) are decoded")
    parser.add_argument("--decode", type=int, default=64, help="tokens per sequence in the decode part (0: skip it)")
    parser.add_argument("--decode-repeats", type=int, default=3, help="decode part: both ways this many times, alternating")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)
    if args.kv_len < 1 or args.repeats < 1 or args.decode_repeats < 1 or args.decode < 0 or args.threads < 0:
        parser.error("--kv-len, --repeats and --decode-repeats must be >= 1, --decode and --threads >= 0")
    from benchmarks.bench.prompts import load_prompts
    from benchmarks.bench.run import _machine
    from runtime.engine import Engine, EngineConfig

    prompts = load_prompts(args.prompts)[: max(args.batch)]
    engine = Engine(args.bundle, EngineConfig(drafter="none", threads=args.threads, calibrate=False))
    target = engine.batched(max(max(args.batch), len(prompts)))
    report = {"bundle": args.bundle, "machine": _machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
              "passes": passes(engine, target, args.batch, args.kv_len, args.repeats)}
    if args.decode:
        encoded = [engine.encode(messages=list(p.messages)) if p.messages else engine.encode(prompt=p.prompt) for p in prompts]
        report["decode"] = [decode(engine, encoded[:b], args.decode, args.decode_repeats) for b in args.batch if 1 < b <= len(encoded)]
    if args.out:
        Path(args.out).write_text(json.dumps(report, separators=(",", ":")))
    print(json.dumps({"passes": report["passes"]["rows"], "decode": report.get("decode")}, indent=1))
    return 0
