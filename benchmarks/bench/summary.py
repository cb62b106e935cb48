"""summary.json: what BENCHMARKS.md cites from a bench run, small enough to commit; the run's
results.json (every run and its rounds) stays beside it, out of git.

    python -m benchmarks summary DIR... (writes DIR/summary.json from DIR/results.json)
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

RESULTS_FILE = "results.json"
SUMMARY_FILE = "summary.json"

DEFINITIONS = {
    "pairs": "per mode and category (and \"all\", every category pooled), over its runs: speedup_spread (min, q1, q3, max of the per-pair ratios to plain), "
    "target_t1_ms (median, q1, q3 of each run's median 1-token target pass), pass_speed_ratio (median over runs of "
    "that pass ÷ plain's in the same prompt and repeat), sequences_under_1_1_tokens_per_pass, drafter_rounds (summed); quartiles as "
    "statistics.quantiles(method='exclusive') computes them",
    "speedup_by_prompt": "per speculative mode, per prompt id: its speedup in each repeat, in repeat order "
    "(to pool repeats across runs)",
}


def _quartiles(values: list[float]) -> dict | None:
    if not values:
        return None
    if len(values) == 1:
        return {"min": values[0], "q1": values[0], "q3": values[0], "max": values[0]}
    q1, _, q3 = statistics.quantiles(values, n=4, method="exclusive")
    return {"min": min(values), "q1": q1, "q3": q3, "max": max(values)}


def summarize(results: dict) -> dict:
    """Everything of results.json but its runs, and per mode × category the spreads and counts
    the runs held that BENCHMARKS.md cites."""
    summary = {key: value for key, value in results.items() if key != "runs"}
    summary["definitions"] = {**results.get("definitions", {}), **DEFINITIONS}
    runs = results["runs"]
    plain = {(run["prompt_id"], run["repeat"]): run for run in runs if run["mode"] == "plain"}
    grouped = defaultdict(list)
    for run in runs:
        grouped[run["mode"], run["category"]].append(run)
        grouped[run["mode"], "all"].append(run)
    pairs = defaultdict(dict)
    for (mode, category), rows in grouped.items():
        t1 = [run["target_pass_ms"]["1"] for run in rows if "1" in run["target_pass_ms"]]
        ratios = [run["target_pass_ms"]["1"] / plain[run["prompt_id"], run["repeat"]]["target_pass_ms"]["1"]
                  for run in rows if "1" in run["target_pass_ms"]]
        drafter_rounds = defaultdict(int)
        for run in rows:
            for name, n in run.get("drafter_rounds", {}).items():
                drafter_rounds[name] += n
        spread = _quartiles(t1)
        pairs[mode][category] = {
            "speedup_spread": _quartiles([run["speedup"] for run in rows]),
            "target_t1_ms": None if spread is None else {"median": statistics.median(t1), "q1": spread["q1"], "q3": spread["q3"]},
            "pass_speed_ratio": statistics.median(ratios) if ratios else None,
            "sequences_under_1_1_tokens_per_pass": sum(run["tokens_per_pass"] < 1.1 for run in rows),
            "drafter_rounds": dict(sorted(drafter_rounds.items())),
        }
    summary["pairs"] = {mode: {category: pairs[mode][category] for category in [*results["categories"], "all"] if category in pairs[mode]}
                        for mode in results["modes"] if mode in pairs}
    by_prompt = defaultdict(lambda: defaultdict(list))
    for run in sorted(runs, key=lambda run: run["repeat"]):
        if run["mode"] != "plain":
            by_prompt[run["mode"]][run["prompt_id"]].append(run["speedup"])
    summary["speedup_by_prompt"] = {mode: dict(rows) for mode, rows in by_prompt.items()}
    return summary


def save_summary(results: dict, folder: Path) -> Path:
    path = Path(folder) / SUMMARY_FILE
    path.write_text(json.dumps(summarize(results), indent=1) + "\n")
    return path


def write_summary(folder: Path) -> Path:
    """summary.json from the results.json in `folder` (runs saved before the bench wrote both)."""
    return save_summary(json.loads((Path(folder) / RESULTS_FILE).read_text()), folder)

