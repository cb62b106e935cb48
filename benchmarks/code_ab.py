"""python -m benchmarks code_ab BUNDLE --old CHECKOUT [--blocks 1,5] [--kv-len 512] [--repeats 20] [--rounds 8] [--out FILE.json]

One target pass of T tokens (and one draft step per drafter the bundle has) under two versions
of the runtime's code on the same bundle: this checkout's and CHECKOUT's (a `git worktree` of
another commit). Each side is one long-lived process with the bundle loaded; the rounds alternate
between them (the order reversed every other round), each round timing `--repeats` passes of every
action, so host drift falls on both sides alike. For restructurings of the runtime that must not
make a pass slower. Only the API both sides keep is used (Engine, benchmarks.bench.PassTimer).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Runs inside each side's checkout: loads the bundle, then times every action `n` times per line read.
_WORKER = """
import json, sys, time
from benchmarks.bench import PassTimer
from runtime.engine import Engine, EngineConfig
bundle, kv_len, blocks = sys.argv[1], int(sys.argv[2]), [int(b) for b in sys.argv[3].split(",")]
engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
timer = PassTimer(engine, kv_len, max(blocks))
actions = {f"T={b}": (lambda b=b: timer.target_pass(b)) for b in blocks}
roles = engine.bundle.manifest.drafts()
for name, role in (("model", "draft"), ("layer-skip", "layer_skip")):
    if role in roles:
        actions[f"draft:{name}"] = timer.draft_step(name)
print(json.dumps(sorted(actions)), flush=True)
for line in sys.stdin:
    out = {}
    for name, act in actions.items():
        act()  # one untimed pass after the other side ran: caches warm again
        times = []
        for _ in range(int(line)):
            began = time.perf_counter()
            act()
            times.append((time.perf_counter() - began) * 1e3)
        out[name] = times
    print(json.dumps(out), flush=True)
"""


def _start(checkout: Path, bundle: str, kv_len: int, blocks: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    cmd = [sys.executable, "-c", _WORKER, bundle, str(kv_len), blocks]
    return subprocess.Popen(cmd, cwd=checkout, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run(bundle: str, old: Path, blocks: str, kv_len: int, repeats: int, rounds: int) -> dict:
    sides = {"old": _start(old, bundle, kv_len, blocks), "new": _start(ROOT, bundle, kv_len, blocks)}
    try:
        actions = {name: json.loads(proc.stdout.readline()) for name, proc in sides.items()}
        if actions["old"] != actions["new"]:
            raise SystemExit(f"the two sides time different actions: {actions}")
        times = {side: {a: [] for a in actions["new"]} for side in sides}
        for r in range(rounds):
            for side in (("old", "new") if r % 2 == 0 else ("new", "old")):
                proc = sides[side]
                proc.stdin.write(f"{repeats}\n")
                proc.stdin.flush()
                for name, values in json.loads(proc.stdout.readline()).items():
                    times[side][name] += values
    finally:
        for proc in sides.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    medians = {side: {a: statistics.median(v) for a, v in per.items()} for side, per in times.items()}
    return {"bundle": bundle, "old": str(old), "kv_len": kv_len, "repeats": repeats, "rounds": rounds,
            "median_ms": medians, "new_over_old": {a: medians["new"][a] / medians["old"][a] for a in medians["new"]}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks code_ab", description=__doc__.splitlines()[2])
    parser.add_argument("bundle")
    parser.add_argument("--old", required=True, help="a checkout of the other commit (git worktree add DIR REV)")
    parser.add_argument("--blocks", default="1,5")
    parser.add_argument("--kv-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    old = Path(args.old)
    if not (old / "runtime" / "engine.py").is_file():
        parser.error(f"--old {args.old}: not an edge-spec checkout (no runtime/engine.py)")
    if not (Path(args.bundle) / "manifest.json").is_file():
        parser.error(f"{args.bundle}: not a bundle (no manifest.json)")
    if args.repeats < 1 or args.rounds < 2:
        parser.error("--repeats must be >= 1 and --rounds >= 2")
    try:
        blocks = [int(b) for b in args.blocks.split(",")]
    except ValueError:
        parser.error(f"--blocks: comma-separated integers, got {args.blocks!r}")
    if min(blocks) < 1:
        parser.error("--blocks must be >= 1")
    result = run(args.bundle, old, args.blocks, args.kv_len, args.repeats, args.rounds)
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
