"""python -m benchmarks context_curve BUNDLE... [--kv-lens 128,512,1536] [--blocks 1,4] [--repeats 20] [--rounds 3] [--out FILE.json]

What one target pass costs as the context fills, for bundles that differ in how they read the
KV buffers (e.g. a masked graph over the whole buffer against one fed the rows in use, or two
--max-context values). Each bundle is timed in a process of its own, one after another, and
the bundles' order turns every round: two engines in one process leave each other's spinning
threads and arenas behind. Per bundle, kv_len and block: the median over rounds of each round's
median pass in ms.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.batch_curve import positive_list


def time_bundle(bundle: str, kv_lens: list[int], blocks: list[int], repeats: int) -> dict:
    """Median ms of a target pass of each block at each kv_len (kv_lens past the bundle's
    context are skipped), in this process."""
    from benchmarks.bench import PassTimer
    from runtime.engine import Engine, EngineConfig

    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    max_context = engine.target.cache.max_context
    rows = {}
    for kv_len in kv_lens:
        if kv_len + max(blocks) > max_context:
            continue
        timer = PassTimer(engine, kv_len, max(blocks))
        for block in blocks:
            timer.target_pass(block)  # the first pass of a shape allocates
            times = []
            for _ in range(repeats):
                began = time.perf_counter()
                timer.target_pass(block)
                times.append((time.perf_counter() - began) * 1e3)
            rows[f"{kv_len}/{block}"] = statistics.median(times)
    return {"max_context": max_context, "ms": rows}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks context_curve", description=__doc__.splitlines()[2])
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--kv-lens", type=positive_list, default=[128, 512, 1536])
    parser.add_argument("--blocks", type=positive_list, default=[1, 4])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", help="write the report here (JSON)")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # internal: time this bundle here and print JSON
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds must be at least 1")
    if args.one:
        print(json.dumps(time_bundle(args.one, args.kv_lens, args.blocks, args.repeats)))
        return 0
    missing = [b for b in args.bundles if not (Path(b) / "manifest.json").is_file()]
    if missing:
        parser.error(f"not a bundle (no manifest.json): {missing[0]}")
    from benchmarks.bench.run import _machine

    rounds: dict[str, list[dict]] = {b: [] for b in args.bundles}
    for index in range(args.rounds):
        order = args.bundles if index % 2 == 0 else args.bundles[::-1]
        for bundle in order:
            command = [sys.executable, "-m", "benchmarks", "context_curve", bundle, "--one", bundle, "--kv-lens",
                       ",".join(map(str, args.kv_lens)), "--blocks", ",".join(map(str, args.blocks)), "--repeats", str(args.repeats)]
            done = subprocess.run(command, capture_output=True, text=True, check=True)
            rounds[bundle].append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {"machine": _machine(), "settings": {k: v for k, v in vars(args).items() if k not in ("out", "one")}, "bundles": {}}
    for bundle, runs in rounds.items():
        keys = runs[0]["ms"]
        report["bundles"][bundle] = {"max_context": runs[0]["max_context"],
                                     "ms": {k: statistics.median(r["ms"][k] for r in runs) for k in keys},
                                     "rounds": [r["ms"] for r in runs]}
        cells = ", ".join(f"{k} {v:.1f}" for k, v in report["bundles"][bundle]["ms"].items())
        print(f"{bundle} (max context {runs[0]['max_context']}): kv_len/block ms: {cells}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, separators=(",", ":")))
    return 0
