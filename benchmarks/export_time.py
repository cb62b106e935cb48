"""python -m benchmarks export_time MODEL --old CHECKOUT [--new CHECKOUT] [--repeats 2] [--out FILE.json] [-- EXPORT ARGS]

One export command run from two checkouts of this repository, alternately (old, new, old, new,
...), each in a fresh process, into the same scratch folder: wall seconds, CPU seconds, peak
RSS (the export's own --json summary) and the written bundle's SHA-256, so a change to the
exporter's speed is measured side by side and shown not to change the bundle. Also the time one
GGUF metadata parse takes with gguf's own reader and with export.sources.gguf_reader."""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _export(checkout: Path, model: str, out: Path, extra: list[str]) -> dict:
    """One `python -m export` from `checkout` (its own packages first on the path)."""
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-m", "export", model, "--out", str(out), "--force", "--json", *extra],
                         cwd=checkout, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if run.returncode != 0:
        raise SystemExit(f"export from {checkout} failed (exit {run.returncode}):\n{run.stderr[-2000:]}")
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    digest = next((line.rsplit(" ", 1)[-1] for line in run.stderr.splitlines() if "bundle SHA-256" in line), None)
    return {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime, "sys_s": after.ru_stime - before.ru_stime,
            "export_s": summary["seconds"], "peak_rss_bytes": summary["peak_rss_bytes"], "bundle_sha256": digest}


def _parse_times(model: str) -> dict:
    """Seconds for one metadata parse of the model's GGUF, gguf's reader against ours."""
    import gguf

    from export.sources import candidate_sources, gguf_reader

    source = next((s for s in candidate_sources(model) if s.gguf_file), None)
    if source is None:
        return {}
    path = Path(source.path) / source.gguf_file
    began = time.perf_counter()
    gguf.GGUFReader(path)
    plain = time.perf_counter() - began
    began = time.perf_counter()
    gguf_reader(path)
    return {"file": path.name, "gguf_reader_s": plain, "edge_spec_reader_s": time.perf_counter() - began}


def main(argv: list[str]) -> int:
    from benchmarks.bench.run import _machine

    parser = argparse.ArgumentParser(prog="python -m benchmarks export_time")
    parser.add_argument("model")
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code (git worktree add DIR COMMIT)")
    parser.add_argument("--new", type=Path, default=ROOT, help="the new code's checkout (default: this one)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args, extra = parser.parse_known_args(argv)
    extra = [a for a in extra if a != "--"]
    for checkout in (args.old, args.new):
        if not (checkout / "export" / "__main__.py").is_file():
            parser.error(f"{checkout} is not a checkout of this repository (no export/__main__.py)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.repeats):
            for name, checkout in (("old", args.old), ("new", args.new)):
                runs[name].append(_export(checkout, args.model, Path(scratch) / "bundle", extra))
                print(f"{name} {i + 1}/{args.repeats}: {runs[name][-1]['wall_s']:.0f} s", file=sys.stderr)
    median = {name: statistics.median(r["wall_s"] for r in rows) for name, rows in runs.items()}
    result = {
        "machine": _machine(), "model": args.model, "export_args": extra, "old": str(args.old), "new": str(args.new),
        "runs": runs, "median_wall_s": median, "new_over_old": median["new"] / median["old"],
        "same_bundle": len({r["bundle_sha256"] for rows in runs.values() for r in rows}) == 1,
        "one_parse": _parse_times(args.model),
    }
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(text)
    return 0
