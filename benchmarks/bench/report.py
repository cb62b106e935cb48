"""results.json / micro.json in a folder, and the report.md and PNG plots drawn from them
(matplotlib, imported only when plots are drawn)."""

from __future__ import annotations

import io
import json
from collections import defaultdict
from pathlib import Path

from benchmarks.bench.stats import alpha_of
from benchmarks.bench.summary import RESULTS_FILE, save_summary
from edge_spec.verify import expected_tokens_per_pass

MICRO_FILE = "micro.json"
REPORT_FILE = "report.md"
PNG_COLORS = 64  # plots are flat colours and anti-aliased edges: a palette keeps them small


def save_results(results: dict, out: Path) -> None:
    """results.json (every run, for re-analysis; not committed) and summary.json (what
    BENCHMARKS.md cites; committed)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2))
    save_summary(results, out)


def save_micro(micro: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MICRO_FILE).write_text(json.dumps(micro, indent=2))


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _sampling(results: dict) -> str:
    sampling = results.get("sampling", "greedy")
    if sampling == "greedy":
        return "greedy"
    return f"sampled at temperature {sampling['temperature']}, top-p {sampling['top_p']}, {sampling['seeds']} seeds"


def _bench_section(results: dict) -> list[str]:
    s_all = results["summary"]
    lines = [
        f"# Bench: {results['bundle']}",
        "",
        f"{results['prompts']} prompts ({', '.join(results['categories'])}), {results['max_new_tokens']} new tokens, "
        f"{_sampling(results)}, γ {results['gamma']} (at most {results['max_gamma']}), repeat {results['repeat']}, "
        f"provider {results['provider']}, threads {results['threads'] or 'default'}; {results['started']}.",
        f"Machine: {results['machine']['platform']}, {results['machine']['processor'] or 'unknown CPU'}, "
        f"Python {results['machine']['python']}, onnxruntime {results['machine']['onnxruntime']}.",
        "",
        "Modes run one after another on each prompt (order rotated per prompt), repeats interleaved. "
        "**speedup** is the median over prompts of the per-prompt ratio to plain (each the median over "
        "repeats of ratios paired within a repeat); **ratio of medians** is median tok/s ÷ plain's median tok/s; "
        "**at the same pass speed** multiplies each run's speedup by its median 1-token target pass ÷ plain's (the "
        "same graph doing the same work), dividing out the machine's drift between the two runs, and with it any "
        "slowing of those passes the mode itself causes: read it beside speedup. "
        "Other columns are medians over runs. Prefill includes a draft model's own prefill in the modes that use one.",
        "",
        "| mode | category | decode tok/s median (q1–q3, min–max) | speedup (median of per-prompt ratios) | ratio of medians "
        "| speedup at the same pass speed | prefill ms | accepted/drafted | α | tokens/pass (E(α,γ)) | identical to plain |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, by_category in s_all.items():
        for category, s in by_category.items():
            spread = s["tokens_per_s_spread"]
            lines.append(
                f"| {mode} | {category} | {_fmt(s['tokens_per_s'], '.1f')} ({_fmt(spread['q1'], '.1f')}–{_fmt(spread['q3'], '.1f')}, "
                f"{_fmt(spread['min'], '.1f')}–{_fmt(spread['max'], '.1f')}) | {_fmt(s['speedup'])} | {_fmt(s['speedup_ratio_of_medians'])} "
                f"| {_fmt(s['speedup_same_pass_speed'])} | {_fmt(s['prefill_ms'], '.0f')} | {_fmt(s['acceptance_rate'])} | {_fmt(s['alpha'])} "
                f"| {_fmt(s['tokens_per_pass'])} ({_fmt(s['tokens_per_pass_predicted'])}) | {s['identical_to_plain']}/{s['runs']} |"
            )
    lines += [
        "",
        "## γ, draft cost and the bound",
        "",
        "c = drafting time per draft forward ÷ the median 1-token target pass of plain decoding on the same prompt; "
        "a draft model's forwards are counted at its session, so the forwards that catch up on tokens it missed "
        "(after plain rounds or lookup rounds) count as forwards; c per drafted token is what drafting cost per "
        "drafted token, catch-up included. The micro benchmark's c is one clean step. "
        "Bound = Σ E(α, γ_r) / Σ (1 + γ_r c) over the rounds as run; it counts a (γ+1)-token verify pass "
        "as one 1-token pass, so the verify-cost curve below is part of any gap. Bound (measured verify) prices each "
        "round's verify pass at the run's own median pass time for its block: speedup / that bound is what the loop "
        "itself loses.",
        "",
        "| mode | category | γ histogram (drafted: rounds) | mean γ | c | c per drafted token | bound | speedup / bound "
        "| bound (measured verify) | speedup / it | ORT ms/pass | Python overhead ms/pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for mode, by_category in s_all.items():
        for category, s in by_category.items():
            histogram = ", ".join(f"{g}: {n}" for g, n in s["gamma_histogram"].items())
            lines.append(
                f"| {mode} | {category} | {histogram} | {_fmt(s['gamma_mean'], '.1f')} | {_fmt(s['cost_ratio'], '.3f')} "
                f"| {_fmt(s['cost_ratio_per_drafted_token'], '.3f')} "
                f"| {_fmt(s['bound'])} | {_fmt(s['bound_fraction'])} | {_fmt(s['bound_measured_verify'])} "
                f"| {_fmt(s['bound_measured_verify_fraction'])} | {_fmt(s['ort_ms_per_pass'], '.2f')} "
                f"| {_fmt(s['python_overhead_ms_per_pass'], '.2f')} |"
            )
    lines += [
        "",
        "Python overhead per pass = (wall time from the end of the target's prefill to the last token − time inside "
        "ONNX Runtime session runs in it) ÷ target passes; "
        "it includes drafting code, verification, KV row copies, detokenizing and the loop itself.",
        "",
        "## Verify cost: target pass time against block length",
        "",
        "Median over runs of each run's median full target pass (layer-skip verify passes, which skip the trunk, left out).",
        "",
        "| T (block) | ms | ratio to T=1 | runs |",
        "|---|---|---|---|",
    ]
    curve = results["verify_cost"]
    base = curve.get("1", {}).get("ms")
    for block, row in curve.items():
        lines.append(f"| {block} | {row['ms']:.2f} | {_fmt(row['ms'] / base if base else None)} | {row['runs']} |")
    return lines


def _micro_section(micro: dict) -> list[str]:
    memory = micro["memory"]
    lines = [
        f"## Micro benchmark: {micro['bundle']}",
        "",
        f"One pass at kv_len {micro['kv_len']} (asked {micro['kv_len_requested']}), median of {micro['repeats']}, "
        f"provider {micro['provider']}; {micro['started']}.",
        "",
        "| T | target pass ms (min–max) | tokens/s if all T accepted |",
        "|---|---|---|",
    ]
    for row in micro["target_pass"]:
        lines.append(f"| {row['T']} | {row['ms']:.2f} ({row['ms_min']:.2f}–{row['ms_max']:.2f}) | {row['tokens_per_s']:.1f} |")
    lines += ["", "| draft role | drafter | one step ms (min–max) | c = step ÷ 1-token target pass |", "|---|---|---|---|"]
    for role, row in micro["draft_step"].items():
        lines.append(f"| {role} | {row['drafter']} | {row['ms']:.2f} ({row['ms_min']:.2f}–{row['ms_max']:.2f}) | {row['cost_ratio']:.3f} |")
    if not micro["draft_step"]:
        lines.append("| – | – | no draft role in this bundle | – |")
    lines += [
        "",
        "Memory-bandwidth floor of a 1-token pass: every weight as stored in the bundle plus the KV rows "
        "up to kv_len must be read once.",
        "",
        f"- weights {memory['weight_bytes'] / 2**20:.1f} MiB + KV {memory['kv_bytes'] / 2**20:.2f} MiB "
        f"= {memory['bytes_per_pass'] / 2**20:.1f} MiB per pass (a graph that attends over the whole static buffer "
        f"reads {memory['kv_bytes_full_buffer'] / 2**20:.2f} MiB of KV instead)",
        f"- copy bandwidth {memory['copy_gb_s']:.1f} GB/s (numpy copy of {memory['copy_mib']} MiB, read + write counted, one thread)",
        f"- floor {memory['floor_ms']:.2f} ms per pass = {memory['floor_tokens_per_s']:.1f} tok/s; measured {memory['measured_ms']:.2f} ms: "
        f"**{memory['gap']:.1f}× the floor**",
    ]
    if micro["provider"] != "cpu":
        lines.append("- the floor uses host memory bandwidth; on an accelerator the weights are read from its own memory")
    return lines


def shrink_png(source, path: Path) -> None:
    """Re-save a PNG (a path or a file object) with a palette of PNG_COLORS (Pillow, which
    matplotlib requires)."""
    from PIL import Image

    with Image.open(source) as image:
        palette = image.convert("RGB").quantize(colors=PNG_COLORS, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE)
    palette.save(path, optimize=True)


def _plots(results: dict | None, micro: dict | None, out: Path) -> list[str]:
    """PNG files drawn with matplotlib's Agg canvas (no pyplot, no display)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, dpi=110)
        shrink_png(buffer, out / name)
        written.append(name)

    if results is not None:
        summary, categories = results["summary"], results["categories"]
        modes = list(summary)
        fig = Figure(figsize=(max(6.0, 0.6 * len(categories) * len(modes) + 2), 4.5))
        ax = fig.add_subplot()
        width = 0.8 / len(modes)
        for m, mode in enumerate(modes):
            xs = [c + (m - (len(modes) - 1) / 2) * width for c in range(len(categories))]
            rows = [summary[mode][category] for category in categories]
            medians = [row["tokens_per_s"] for row in rows]
            errors = [[med - row["tokens_per_s_spread"]["min"] for med, row in zip(medians, rows)],
                      [row["tokens_per_s_spread"]["max"] - med for med, row in zip(medians, rows)]]
            ax.bar(xs, medians, width, yerr=errors, capsize=3, label=mode)
        ax.set_xticks(range(len(categories)), categories)
        ax.set_ylabel("decode tokens/s (median, min–max)")
        ax.set_title("Decode speed by mode and prompt category")
        ax.legend(fontsize="small")
        save(fig, "tokens_per_s.png")

        fig = Figure(figsize=(10, 4.2))
        ax_alpha, ax_tokens = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
        for mode in modes:
            pooled = defaultdict(lambda: [0, 0, 0, 0])  # γ drafted -> [rounds, accepted, rejections, tokens]
            for run in results["runs"]:
                if run["mode"] == mode:
                    for g, row in run["rounds_by_gamma"].items():
                        if int(g):
                            for k, key in enumerate(("rounds", "accepted", "rejections", "tokens")):
                                pooled[int(g)][k] += row[key]
            gammas = sorted(pooled)
            if not gammas:
                continue  # plain, or a mode that never drafted
            line = ax_alpha.plot(gammas, [alpha_of(pooled[g][1], pooled[g][2]) for g in gammas], "o-", label=mode)[0]
            ax_tokens.plot(gammas, [pooled[g][3] / pooled[g][0] for g in gammas], "o-", color=line.get_color(), label=f"{mode} measured")
            alpha = alpha_of(sum(row[1] for row in pooled.values()), sum(row[2] for row in pooled.values()))
            grid = list(range(0, max(results["max_gamma"], *gammas) + 1))  # E(α, γ) where γ was not tried too
            ax_tokens.plot(grid, [expected_tokens_per_pass(alpha, g) for g in grid], "--", color=line.get_color(),
                           label=f"{mode} E(α={alpha:.2f}, γ)")
        ax_alpha.set_xlabel("γ drafted")
        ax_alpha.set_ylabel("α (accepted / (accepted + rejections))")
        ax_alpha.set_ylim(0, 1.05)
        ax_alpha.set_title("Acceptance against γ")
        ax_tokens.set_xlabel("γ drafted")
        ax_tokens.set_ylabel("tokens per target pass")
        ax_tokens.set_title("Tokens per pass against γ")
        for ax in (ax_alpha, ax_tokens):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if ax.lines:
                ax.legend(fontsize="x-small")
        save(fig, "alpha_tokens_vs_gamma.png")

    fig = Figure(figsize=(6, 4))
    ax = fig.add_subplot()
    if results is not None and results["verify_cost"]:
        curve = results["verify_cost"]
        ax.plot([int(t) for t in curve], [row["ms"] for row in curve.values()], "o-", label="during the bench")
    if micro is not None:
        ax.plot([row["T"] for row in micro["target_pass"]], [row["ms"] for row in micro["target_pass"]], "s-",
                label=f"micro, kv_len {micro['kv_len']}")
        ax.axhline(micro["memory"]["floor_ms"], color="grey", linestyle=":", label="memory-bandwidth floor")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("block length T (tokens in one target pass)")
    ax.set_ylabel("target pass ms (median)")
    ax.set_ylim(bottom=0)
    ax.set_title("Verify cost")
    ax.legend(fontsize="small")
    save(fig, "verify_cost.png")
    return written


def render_report(out: Path) -> list[str]:
    """Write report.md and the plots from the results.json and/or micro.json in `out`.
    Returns warnings (the plots are skipped, not fatal, when matplotlib is missing)."""
    out = Path(out)
    results = json.loads((out / RESULTS_FILE).read_text()) if (out / RESULTS_FILE).is_file() else None
    micro = json.loads((out / MICRO_FILE).read_text()) if (out / MICRO_FILE).is_file() else None
    if results is None and micro is None:
        raise FileNotFoundError(f"neither {RESULTS_FILE} nor {MICRO_FILE} in {out}: run the bench first")
    warnings = []
    try:
        plots = _plots(results, micro, out)
    except ImportError:
        plots = []
        warnings.append("plots not drawn: matplotlib is missing (pip install 'edge-spec[bench]')")
    lines = _bench_section(results) if results is not None else [f"# Bench: {micro['bundle']}"]
    if micro is not None:
        lines += [""] + _micro_section(micro)
    if plots:
        lines += ["", "## Plots", ""] + [f"![{name[:-4]}]({name})" for name in plots]
    (out / REPORT_FILE).write_text("\n".join(lines) + "\n")
    return warnings
