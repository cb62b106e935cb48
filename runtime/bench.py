"""Side-by-side decoding benchmark: every mode on every prompt, interleaved, in one process.

Speedups are ratios measured in the same run (plain decodes each prompt right before the
other modes do), so machine noise hits both sides alike. Writes results.json and report.md into --out.
"""

from __future__ import annotations

import gzip
import json
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

from edge_spec.catalog import models_dir
from edge_spec.sampling import SamplingConfig
from edge_spec.verify import expected_tokens_per_pass
from runtime.engine import DRAFTERS, Engine, GenerateConfig

MODES = ("plain",) + tuple(d for d in DRAFTERS if d != "none")  # a mode is a drafter, or none
HUMANEVAL_FILE = "HumanEval.jsonl.gz"


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: tuple | None = None


def load_prompts(spec: str) -> list[BenchPrompt]:
    """FILE.jsonl (id, category, prompt|messages) or humaneval[:N] (chat 'complete this function')."""
    if spec.startswith("humaneval"):
        count = int(spec.split(":", 1)[1]) if ":" in spec else 20
        path = models_dir() / HUMANEVAL_FILE
        if not path.is_file():
            raise FileNotFoundError(f"{path} not found: put HumanEval.jsonl.gz in $EDGE_SPEC_MODELS or pass a prompts file")
        prompts = []
        with gzip.open(path, "rt") as f:
            for line in f:
                item = json.loads(line)
                content = f"Complete this Python function. Reply with the full function only.\n\n```python\n{item['prompt']}```"
                prompts.append(BenchPrompt(item["task_id"], "code", messages=({"role": "user", "content": content},)))
                if len(prompts) == count:
                    break
        return prompts
    prompts = []
    for line in Path(spec).read_text().splitlines():
        if line.strip():
            item = json.loads(line)
            messages = tuple(item["messages"]) if "messages" in item else None
            prompts.append(BenchPrompt(str(item["id"]), item.get("category", "default"), item.get("prompt"), messages))
    return prompts


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _predicted(gamma_histogram: dict, alpha: float | None, cost: float | None) -> tuple[float | None, float | None]:
    """Tokens per target pass that E(α, γ) predicts for the rounds as they were run, and the
    speedup bound Σ E(α, γ_r) / Σ (1 + γ_r c) (the textbook E / (1 + γc) for one fixed γ)."""
    if alpha is None or cost is None:
        return None, None
    alpha = min(alpha, 1 - 1e-9)
    rounds = {int(g): n for g, n in gamma_histogram.items()}
    tokens = sum(n * expected_tokens_per_pass(alpha, g) for g, n in rounds.items())
    passes = sum(rounds.values())
    cost_units = sum(n * (1 + g * cost) for g, n in rounds.items())
    return tokens / passes, tokens / cost_units


def run_bench(bundle: str, prompts: list[BenchPrompt], modes: list[str], max_new_tokens: int, repeat: int, threads: int = 0, gamma: int | None = None) -> dict:
    from runtime.engine import EngineConfig

    engine = Engine(bundle, EngineConfig(drafter="none", threads=threads))
    config = GenerateConfig(max_new_tokens, SamplingConfig())
    runs = []
    for r in range(repeat):
        for i, prompt in enumerate(prompts):
            ids = engine.encode(messages=list(prompt.messages)) if prompt.messages else engine.encode(prompt=prompt.prompt)
            # Rotate the order so no mode always runs first (warm caches, thermal drift).
            order = modes[i % len(modes) :] + modes[: i % len(modes)]
            plain = None
            results = {}
            for mode in ["plain"] + [m for m in order if m != "plain"]:
                engine.use_drafter("none" if mode == "plain" else mode, gamma)
                engine.target.cache.reset()  # no prefix reuse between modes: equal prefill work
                result = engine.generate(ids, config)
                results[mode] = result
                if mode == "plain":
                    plain = result
            for mode in modes:
                result = results[mode]
                stats = result.stats
                alpha = stats["alpha"]
                # c of this mode's own drafter; auto mixes a free copier with its model drafter.
                cost = stats["cost_ratio"].get(mode) if mode in ("model", "layer-skip") else None if mode == "auto" else 0.0
                predicted, bound = _predicted(stats["gamma_histogram"], alpha, cost)
                speedup = result.timings["decode_tokens_per_s"] / plain.timings["decode_tokens_per_s"]
                runs.append({
                    "mode": mode,
                    "category": prompt.category,
                    "prompt_id": prompt.id,
                    "repeat": r,
                    "new_tokens": len(result.token_ids),
                    "tokens_per_s": result.timings["decode_tokens_per_s"],
                    "prefill_ms": result.timings["prefill_ms"],
                    "acceptance_rate": stats["acceptance_rate"],
                    "alpha": alpha,
                    "tokens_per_pass": stats["tokens_per_pass"],
                    "tokens_per_pass_predicted": predicted,
                    "gamma_histogram": stats["gamma_histogram"],
                    "cost_ratio": cost,
                    "speedup": speedup,
                    "bound": bound,
                    "bound_fraction": speedup / bound if bound else None,
                    "identical_to_plain": result.token_ids == plain.token_ids,
                    "time_s": stats["time_s"],
                })
    summary = {}
    for mode in modes:
        summary[mode] = {}
        for category in sorted({run["category"] for run in runs}):
            rows = [run for run in runs if run["mode"] == mode and run["category"] == category]
            speeds = [run["tokens_per_s"] for run in rows]
            summary[mode][category] = {
                "tokens_per_s": _median(speeds),
                "tokens_per_s_min": min(speeds),
                "tokens_per_s_max": max(speeds),
                "speedup": _median([run["speedup"] for run in rows]),
                "acceptance_rate": _median([run["acceptance_rate"] for run in rows]),
                "alpha": _median([run["alpha"] for run in rows]),
                "tokens_per_pass": _median([run["tokens_per_pass"] for run in rows]),
                "tokens_per_pass_predicted": _median([run["tokens_per_pass_predicted"] for run in rows]),
                "cost_ratio": _median([run["cost_ratio"] for run in rows]),
                "bound_fraction": _median([run["bound_fraction"] for run in rows]),
                "prefill_ms": _median([run["prefill_ms"] for run in rows]),
                "identical_to_plain": sum(run["identical_to_plain"] for run in rows),
                "runs": len(rows),
            }
    return {
        "bundle": str(bundle),
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": platform.python_version()},
        "max_new_tokens": max_new_tokens,
        "gamma": "auto" if gamma is None else gamma,
        "repeat": repeat,
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": runs,
        "summary": summary,
    }


def write_report(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    lines = [
        f"# Bench: {results['bundle']}",
        "",
        f"{results['max_new_tokens']} new tokens, greedy, γ {results['gamma']}, repeat {results['repeat']}; medians over prompts.",
        "",
        "| mode | category | tok/s (min–max) | speedup vs plain | accepted/drafted | α | tokens/pass (E(α,γ)) | c | speedup / bound | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]

    def fmt(value, spec=".2f"):
        return "–" if value is None else format(value, spec)

    for mode, by_category in results["summary"].items():
        for category, s in by_category.items():
            lines.append(
                f"| {mode} | {category} | {fmt(s['tokens_per_s'], '.1f')} ({fmt(s['tokens_per_s_min'], '.1f')}–{fmt(s['tokens_per_s_max'], '.1f')}) "
                f"| {fmt(s['speedup'])} | {fmt(s['acceptance_rate'])} | {fmt(s['alpha'])} | {fmt(s['tokens_per_pass'])} ({fmt(s['tokens_per_pass_predicted'])}) | {fmt(s['cost_ratio'])} "
                f"| {fmt(s['bound_fraction'])} | {s['identical_to_plain']}/{s['runs']} |"
            )
    (out / "report.md").write_text("\n".join(lines) + "\n")
