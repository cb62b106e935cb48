"""Per-run rows and per mode × category summaries of the side-by-side bench, from the rounds
the Engine ran (its Steps) and the session time the clock saw."""

from __future__ import annotations

import statistics
from collections import defaultdict

import numpy as np

from benchmarks.bench.prompts import BenchPrompt
from edge_spec.drafters import COPIERS, ROLE_DRAFTERS, SPECS
from edge_spec.verify import expected_tokens_per_pass
from runtime.stats import acceptance_alpha

DEFINITIONS = {
    "tokens_per_s": "new tokens / decode seconds (the engine's decode window: after prefill, to the last token)",
    "speedup": "median over prompts of the per-prompt ratio tokens_per_s(mode) / tokens_per_s(plain), "
    "each per-prompt ratio the median over repeats of ratios paired within one repeat",
    "speedup_ratio_of_medians": "median tokens_per_s(mode) / median tokens_per_s(plain) over the category's runs",
    "speedup_same_pass_speed": "speedup × (the run's median 1-token target pass / plain's, same prompt and repeat): the "
    "same graph does the same work in both, so this divides out the machine's drift between the two runs; it would "
    "also divide out a mode's own slowing of those passes, so read it beside speedup, not instead (None without "
    "1-token passes); summarized like speedup",
    "alpha": "per-token acceptance, accepted / (accepted + rejections): the α of E(α, γ)",
    "acceptance_rate": "accepted / drafted tokens",
    "tokens_per_pass": "new tokens / target passes",
    "tokens_per_pass_predicted": "mean over rounds of E(α, γ_round) with the run's α per drafter",
    "cost_ratio": "c = drafting seconds per draft forward / median 1-token target pass of plain decoding of the same prompt "
    "and repeat; a draft model's forwards are counted at its session (catch-up forwards over tokens it missed count as "
    "forwards), layer skip and lookup count one per drafted token",
    "cost_ratio_per_drafted_token": "drafting seconds per drafted token / the same 1-token pass: what drafting cost, catch-up included",
    "prefill_ms": "until the first round starts: the target's prefill, and a draft model's own prefill in modes that use one",
    "bound": "Σ E(α, γ_r) / Σ (1 + γ_r c) over the run's rounds (E / (1 + γc) for one fixed γ; "
    "assumes a (γ+1)-token verify pass costs a 1-token pass)",
    "bound_fraction": "speedup of the run / its bound",
    "bound_measured_verify": "Σ E(α, γ_r) / Σ (γ_r c + t(γ_r+1) / t(1)) over the run's rounds, with t(T) the run's own "
    "median T-token target pass: the bound with the verify pass at what it costs on this device",
    "bound_measured_verify_fraction": "speedup of the run / bound_measured_verify: what the loop itself loses "
    "(draft catch-up, Python, verification, drift)",
    "ort_ms_per_pass": "time inside ONNX Runtime session runs after the target's prefill, per target pass (draft passes included)",
    "python_overhead_ms_per_pass": "(seconds from the end of the target's prefill to the last token − time inside "
    "ONNX Runtime session runs in them) per target pass",
}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _spread(values: list[float]) -> dict:
    return {
        "min": min(values),
        "q1": float(np.percentile(values, 25)),
        "q3": float(np.percentile(values, 75)),
        "max": max(values),
    }


def _rounds(steps) -> dict:
    """Per-drafter acceptance, per-γ outcomes, pass times by block and draft-step times."""
    by_drafter = defaultdict(lambda: [0, 0])  # name -> [accepted, rejections]
    by_gamma = defaultdict(lambda: [0, 0, 0, 0])  # γ drafted -> [rounds, accepted, rejections, tokens]
    target_ms = defaultdict(list)  # block T -> ms, full target passes only
    draft_s = defaultdict(float)  # drafter -> seconds drafting
    drafted = defaultdict(int)  # drafter -> tokens drafted
    for step in steps:
        gamma, rejected = step.n_drafted, int(step.n_accepted < step.n_drafted)
        row = by_gamma[gamma]
        row[0] += 1
        row[1] += step.n_accepted
        row[2] += rejected
        row[3] += len(step.tokens)
        if gamma:
            by_drafter[step.drafter][0] += step.n_accepted
            by_drafter[step.drafter][1] += rejected
            draft_s[step.drafter] += step.draft_s
            drafted[step.drafter] += gamma
        # A layer-skip draft already ran the trunk for its tokens: its verify pass is partial.
        if not (step.drafter in SPECS and SPECS[step.drafter].reuses_trunk):
            target_ms[gamma + 1].append(step.target_s * 1e3)
    return {"by_drafter": by_drafter, "by_gamma": by_gamma, "target_ms": target_ms, "draft_s": draft_s, "drafted": drafted}


def _mode_cost(by_drafter: dict) -> float | None:
    """One c per mode: its model drafter's (auto: the model part), else its copier's small cost
    (a mode that never drafted with a model)."""
    names = [name for name in by_drafter if name not in COPIERS] or list(by_drafter)
    return by_drafter.get(names[0]) if names else None


alpha_of = acceptance_alpha  # the runtime's one definition of α


def _bound(steps, alphas: dict, costs: dict, verify_units: dict | None = None) -> tuple[float | None, float | None]:
    """(Predicted tokens per pass, speedup bound) for the rounds as they were run; a
    (γ+1)-token verify pass costs one 1-token pass, or verify_units[γ+1] of them when given."""
    tokens = cost_units = 0.0
    for step in steps:
        gamma = step.n_drafted
        if gamma and (alphas.get(step.drafter) is None or costs.get(step.drafter) is None):
            return None, None
        verify = 1.0 if verify_units is None or not gamma else verify_units.get(gamma + 1)
        if verify is None:
            return None, None
        tokens += expected_tokens_per_pass(alphas[step.drafter], gamma) if gamma else 1.0
        cost_units += verify + gamma * costs[step.drafter] if gamma else 1.0
    return (tokens / len(steps), tokens / cost_units) if steps else (None, None)


def run_row(mode: str, prompt: BenchPrompt, repeat: int, result, steps, window: tuple[float, float], model_forwards: int,
             plain: dict) -> dict:
    """window: (seconds from the end of prefill to the end, seconds of them inside ONNX Runtime)."""
    rounds = _rounds(steps)
    alphas = {name: alpha_of(*counts) for name, counts in rounds["by_drafter"].items()}
    plain_t1_s = plain["target_t1_ms"] / 1e3
    # model_forwards are counted at the draft role's session: they are its drafter's steps.
    step_ms = {
        name: seconds * 1e3 / (model_forwards if name == ROLE_DRAFTERS["draft"] and model_forwards else rounds["drafted"][name])
        for name, seconds in rounds["draft_s"].items()
    }
    costs = {name: ms / 1e3 / plain_t1_s for name, ms in step_ms.items()}
    per_token = {name: seconds / rounds["drafted"][name] / plain_t1_s for name, seconds in rounds["draft_s"].items()}
    predicted, bound = _bound(steps, alphas, costs)
    verify_units = {block: statistics.median(ms) / 1e3 / plain_t1_s for block, ms in rounds["target_ms"].items()}
    _, bound_verify = _bound(steps, alphas, costs, verify_units)
    stats, timings = result.stats, result.timings
    passes = stats["target_passes"]
    speedup = timings["decode_tokens_per_s"] / plain["tokens_per_s"]
    t1_ms = rounds["target_ms"].get(1)
    drafting = [s.n_drafted for s in steps if s.n_drafted]
    cost = _mode_cost(costs)
    return {
        "mode": mode,
        "category": prompt.category,
        "prompt_id": prompt.id,
        "repeat": repeat,
        "prompt_tokens": len(result.prompt_ids),
        "new_tokens": len(result.token_ids),
        "stop_reason": result.stop_reason,
        "tokens_per_s": timings["decode_tokens_per_s"],
        "decode_s": timings["decode_s"],
        "prefill_ms": timings["prefill_ms"],
        "target_passes": passes,
        "acceptance_rate": stats["acceptance_rate"],
        "alpha": stats["alpha"],
        "alpha_by_drafter": alphas,
        "tokens_per_pass": stats["tokens_per_pass"],
        "tokens_per_pass_predicted": predicted,
        "gamma_histogram": stats["gamma_histogram"],
        "gamma_mean": statistics.mean(drafting) if drafting else None,
        "rounds_by_gamma": {str(g): dict(zip(("rounds", "accepted", "rejections", "tokens"), row)) for g, row in sorted(rounds["by_gamma"].items())},
        "drafter_rounds": stats["drafter_rounds"],
        "cost_ratio": cost,
        "cost_ratio_by_drafter": costs,
        "cost_ratio_per_drafted_token": per_token,
        "draft_step_ms": step_ms,
        "draft_model_forwards": model_forwards,
        "target_pass_ms": {str(t): statistics.median(ms) for t, ms in sorted(rounds["target_ms"].items())},
        "speedup": speedup,
        "speedup_same_pass_speed": speedup * statistics.median(t1_ms) / plain["target_t1_ms"] if t1_ms else None,
        "bound": bound,
        "bound_fraction": speedup / bound if bound else None,
        "bound_measured_verify": bound_verify,
        "bound_measured_verify_fraction": speedup / bound_verify if bound_verify else None,
        "ort_ms_per_pass": window[1] * 1e3 / passes if window[1] else None,
        "python_overhead_ms_per_pass": (window[0] - window[1]) * 1e3 / passes if window[1] else None,
        "identical_to_plain": result.token_ids == plain["token_ids"],
        "time_s": stats["time_s"],
    }


def summarize_runs(runs: list[dict], modes: tuple[str, ...]) -> dict:
    summary = {}
    categories = sorted({run["category"] for run in runs})
    for mode in modes:
        summary[mode] = {}
        for category in categories:
            rows = [run for run in runs if run["mode"] == mode and run["category"] == category]
            plain_rows = [run for run in runs if run["mode"] == "plain" and run["category"] == category]
            speeds = [run["tokens_per_s"] for run in rows]
            by_prompt, same_speed = defaultdict(list), defaultdict(list)
            for run in rows:
                by_prompt[run["prompt_id"]].append(run["speedup"])
                if run["speedup_same_pass_speed"] is not None:
                    same_speed[run["prompt_id"]].append(run["speedup_same_pass_speed"])
            histogram, by_gamma, target_ms = defaultdict(int), defaultdict(lambda: defaultdict(int)), defaultdict(list)
            for run in rows:
                for gamma, n in run["gamma_histogram"].items():
                    histogram[gamma] += n
                for gamma, row in run["rounds_by_gamma"].items():
                    for key, n in row.items():
                        by_gamma[gamma][key] += n
                for block, ms in run["target_pass_ms"].items():
                    target_ms[block].append(ms)
            drafted = sum(int(g) * n for g, n in histogram.items() if int(g))
            drafting_rounds = sum(n for g, n in histogram.items() if int(g))
            summary[mode][category] = {
                "runs": len(rows),
                "tokens_per_s": _median(speeds),
                "tokens_per_s_spread": _spread(speeds),
                "speedup": _median([_median(ratios) for ratios in by_prompt.values()]),
                "speedup_ratio_of_medians": _median(speeds) / _median([run["tokens_per_s"] for run in plain_rows]),
                "speedup_same_pass_speed": _median([_median(ratios) for ratios in same_speed.values()]),
                "prefill_ms": _median([run["prefill_ms"] for run in rows]),
                "acceptance_rate": _median([run["acceptance_rate"] for run in rows]),
                "alpha": _median([run["alpha"] for run in rows]),
                "tokens_per_pass": _median([run["tokens_per_pass"] for run in rows]),
                "tokens_per_pass_predicted": _median([run["tokens_per_pass_predicted"] for run in rows]),
                "gamma_histogram": dict(sorted(histogram.items(), key=lambda kv: int(kv[0]))),
                "gamma_mean": drafted / drafting_rounds if drafting_rounds else None,
                "by_gamma": {
                    g: {
                        "rounds": row["rounds"],
                        "alpha": alpha_of(row["accepted"], row["rejections"]) if int(g) else None,
                        "tokens_per_pass": row["tokens"] / row["rounds"],
                    }
                    for g, row in sorted(by_gamma.items(), key=lambda kv: int(kv[0]))
                },
                "cost_ratio": _median([run["cost_ratio"] for run in rows]),
                "cost_ratio_per_drafted_token": _median([_mode_cost(run["cost_ratio_per_drafted_token"]) for run in rows]),
                "target_pass_ms": {t: _median(ms) for t, ms in sorted(target_ms.items(), key=lambda kv: int(kv[0]))},
                "bound": _median([run["bound"] for run in rows]),
                "bound_fraction": _median([run["bound_fraction"] for run in rows]),
                "bound_measured_verify": _median([run["bound_measured_verify"] for run in rows]),
                "bound_measured_verify_fraction": _median([run["bound_measured_verify_fraction"] for run in rows]),
                "ort_ms_per_pass": _median([run["ort_ms_per_pass"] for run in rows]),
                "python_overhead_ms_per_pass": _median([run["python_overhead_ms_per_pass"] for run in rows]),
                "identical_to_plain": sum(run["identical_to_plain"] for run in rows),
            }
    return summary

