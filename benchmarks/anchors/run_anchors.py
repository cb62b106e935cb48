"""edge-spec beside llama.cpp and onnxruntime-genai on the same prompts, interleaved per prompt.

    python benchmarks/anchors/run_anchors.py BUNDLE --prompts humaneval:20,benchmarks/prompts/edit.jsonl \
        --max-new-tokens 128 --out DIR [--anchors DIR] [--configs NAME,...] [--bundle2 BUNDLE]

Every prompt is rendered once with the bundle's chat template and the same text goes to every
runtime (llama.cpp and onnxruntime-genai parse the special tokens in it). Per prompt, every
configuration runs back to back, so machine drift spreads over all of them. Decode tokens/s is
each runtime's own decode timing: llama.cpp's `eval time` (plain) and `decoded N tokens in`
(speculative-simple), onnxruntime-genai timed around its generate loop after the prefill,
edge-spec's GenerationResult. 2 threads (the machine's cores). Greedy by default; with
`--temperature T [--top-p P] [--seeds N]` every runtime samples from softmax(top-p(logits / T))
(llama.cpp with only its temperature and top-p samplers, in that order, as edge-spec and Hugging
Face apply them), once per seed, and each ratio pairs runs of the same prompt and seed.
`--bundle2` runs a second export of the same model (edge2-plain, edge2-auto) beside the first, so an
export option is compared with the anchors in one run. The anchors are built by benchmarks/anchors/setup.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.bench import load_prompts  # noqa: E402
from edge_spec.sampling import SamplingConfig  # noqa: E402
from runtime.engine import Engine, EngineConfig, GenerateConfig  # noqa: E402
from edge_spec.catalog import models_dir  # noqa: E402

CONFIGS = ("edge-plain", "edge-auto", "edge2-plain", "edge2-auto", "llama-plain", "llama-ngram", "llama-ngram-map-k", "llama-draft", "genai-plain", "genai-ngram", "genai-draft")
BEST_LLAMA = "llama-best"  # per prompt, the fastest llama.cpp configuration run on it


def sampling_args(temperature: float = 0.0, top_p: float = 1.0, seed: int = 0) -> list[str]:
    """llama.cpp's sampling flags for edge-spec's SamplingConfig: greedy at temperature 0, else
    only the temperature and top-p samplers, temperature first (llama.cpp's default chain applies
    top-k 40, top-p and min-p before the temperature)."""
    if temperature == 0:
        return ["--temp", "0", "--seed", str(seed)]
    return ["--samplers", "temperature;top_p", "--temp", repr(float(temperature)), "--top-p", repr(float(top_p)), "--seed", str(seed)]


def _llama(anchors: Path, tool: str, args: list[str], prompt_file: Path, max_new_tokens: int, threads: int, sampling: list[str]) -> str:
    command = [str(anchors / "llama.cpp/build/bin" / tool), "-f", str(prompt_file), "-n", str(max_new_tokens), "-t", str(threads),
               "-c", "4096", *sampling, *args]
    env = dict(os.environ, LD_LIBRARY_PATH=str(anchors / "llama.cpp/build/bin"))
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout + done.stderr


def parse_completion_log(log: str) -> dict:
    """llama-completion's perf lines: `prompt eval time = X ms / N tokens` and `eval time = X ms / N runs`."""
    prompt = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", log)
    evals = re.search(r"(?<!prompt )eval time =\s*([\d.]+) ms /\s*(\d+) runs", log)
    if not evals:
        raise RuntimeError(f"llama-completion: no eval timing in its log:\n{log[-2000:]}")
    ms, runs = float(evals.group(1)), int(evals.group(2))
    # The first new token comes out of the prompt pass; `runs` are the decode passes after it.
    return {"tokens_per_s": runs / (ms / 1e3), "new_tokens": runs + 1, "prefill_ms": float(prompt.group(1)) if prompt else None,
            "acceptance_rate": None}


def parse_speculative_log(log: str) -> dict:
    """llama-speculative-simple's summary: `encoded/decoded N tokens in S seconds`, n_drafted, n_accept."""
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    encoded = re.search(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    drafted = re.search(r"n_drafted\s*=\s*(\d+)", log)
    accepted = re.search(r"n_accept\s*=\s*(\d+)", log)
    if not decoded:
        raise RuntimeError(f"llama-speculative-simple: no decode timing in its log:\n{log[-2000:]}")
    n, seconds = int(decoded.group(1)), float(decoded.group(2))
    n_drafted = int(drafted.group(1)) if drafted else 0
    return {"tokens_per_s": n / seconds, "new_tokens": n, "prefill_ms": float(encoded.group(2)) * 1e3 if encoded else None,
            "acceptance_rate": int(accepted.group(1)) / n_drafted if n_drafted else None, "drafted": n_drafted}


def llama_plain(anchors, target_gguf, prompt_file, max_new_tokens, threads, sampling: list[str]) -> dict:
    return parse_completion_log(_llama(anchors, "llama-completion", ["-m", str(target_gguf), "-no-cnv"], prompt_file, max_new_tokens, threads, sampling))


def llama_spec(anchors, target_gguf, prompt_file, max_new_tokens, threads, sampling: list[str], extra: list[str]) -> dict:
    return parse_speculative_log(_llama(anchors, "llama-speculative-simple", ["-m", str(target_gguf), *extra], prompt_file, max_new_tokens, threads, sampling))


class GenaiWorker:
    def __init__(self, anchors: Path):
        python = anchors / "genai-venv/bin/python"
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)
        self.process = subprocess.Popen([str(python), str(Path(__file__).with_name("genai_worker.py"))], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True, env=env, cwd=str(anchors))

    def run(self, **request) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError("the onnxruntime-genai worker exited (see its stderr above)")
        return json.loads(line)

    def close(self):
        self.process.stdin.close()
        self.process.wait(timeout=60)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--bundle2", help="a second bundle of the same model (another export option), run as edge2-plain and edge2-auto "
                        "beside the first on every prompt")
    parser.add_argument("--prompts", default="humaneval:20,benchmarks/prompts/edit.jsonl")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", required=True)
    parser.add_argument("--anchors", default=os.environ.get("ANCHORS", str(Path.home() / ".cache/edge-spec/anchors")))
    parser.add_argument("--configs", default=",".join(CONFIGS))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy; above 0: sampled, once per seed")
    parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature (default 1.0)")
    parser.add_argument("--seeds", type=int, default=1, help="with --temperature: runs per prompt and configuration, seeds 0..N-1")
    parser.add_argument("--llama-args", default="", help="extra flags for every llama.cpp tool, e.g. -nr where its repacked (AMX) "
                        "weights crash on the host; recorded in the results")
    args = parser.parse_args(argv)
    anchors, out = Path(args.anchors), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = [c for c in args.configs.split(",") if c]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        parser.error(f"unknown configs {unknown} (choose from {', '.join(CONFIGS)})")
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.seeds < 1:
        parser.error("--temperature must be >= 0, --top-p in (0, 1] and --seeds >= 1")
    if args.temperature == 0 and (args.seeds != 1 or args.top_p != 1):
        parser.error("greedy (temperature 0) takes no --seeds or --top-p")
    if args.temperature > 0 and any(c.startswith("genai") for c in configs):
        parser.error("the onnxruntime-genai worker decodes greedily: leave its configs out at a temperature")
    models = models_dir()
    target_gguf, draft_gguf = models / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", models / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
    prompts = load_prompts(args.prompts)

    if any(c.startswith("edge2") for c in configs) != bool(args.bundle2):
        parser.error("the edge2-plain and edge2-auto configs run --bundle2: give both or neither")
    engine = Engine(args.bundle, EngineConfig(drafter="auto", threads=args.threads))
    engines = {"edge": engine}
    if args.bundle2:
        engines["edge2"] = Engine(args.bundle2, EngineConfig(drafter="auto", threads=args.threads))
    genai = GenaiWorker(anchors) if any(c.startswith("genai") for c in configs) else None
    genai_models = {"genai-plain": anchors / "genai/qwen-1.5b", "genai-ngram": anchors / "genai/qwen-1.5b", "genai-draft": anchors / "genai/spec-1.5b-0.5b"}
    if genai:  # first-run costs (weight prepacking, allocations) stay out of the timed runs
        text = engine.tokenizer.render_chat(list(prompts[0].messages)) if prompts[0].messages else prompts[0].prompt
        for config in (c for c in configs if c.startswith("genai")):
            genai.run(model=str(genai_models[config]), prompt=text, mode=config.split("-", 1)[1], max_new_tokens=8, ngram_size=3, max_draft_tokens=4)
    for warmed in engines.values():
        warmed.generate(warmed.tokenizer.encode("warm up"), GenerateConfig(max_new_tokens=8))
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for number, (prompt, seed) in enumerate(((p, s) for p in prompts for s in range(args.seeds)), start=1):
            text = engine.tokenizer.render_chat(list(prompt.messages)) if prompt.messages else prompt.prompt
            prompt_file = Path(scratch) / "prompt.txt"
            prompt_file.write_text(text, encoding="utf-8")
            ids = engine.tokenizer.encode(text, add_special_tokens=prompt.messages is None)
            generate = GenerateConfig(max_new_tokens=args.max_new_tokens,
                                      sampling=SamplingConfig(temperature=args.temperature, top_p=args.top_p, seed=seed))
            sampling = sampling_args(args.temperature, args.top_p, seed) + shlex.split(args.llama_args)
            outputs = {}
            for config in configs:
                began = time.perf_counter()
                if config.startswith("edge"):
                    side, mode = config.split("-")
                    result = engines[side].generate(ids, generate, speculative=mode == "auto")
                    row = {"tokens_per_s": result.timings["decode_tokens_per_s"], "new_tokens": len(result.token_ids),
                           "prefill_ms": result.timings["prefill_ms"], "acceptance_rate": result.stats["acceptance_rate"],
                           "tokens_per_pass": result.stats["tokens_per_pass"]}
                    outputs[config] = result.token_ids
                elif config == "llama-plain":
                    row = llama_plain(anchors, target_gguf, prompt_file, args.max_new_tokens, args.threads, sampling)
                elif config == "llama-ngram":
                    row = llama_spec(anchors, target_gguf, prompt_file, args.max_new_tokens, args.threads, sampling, ["--spec-type", "ngram-simple"])
                elif config == "llama-ngram-map-k":
                    row = llama_spec(anchors, target_gguf, prompt_file, args.max_new_tokens, args.threads, sampling, ["--spec-type", "ngram-map-k"])
                elif config == "llama-draft":
                    row = llama_spec(anchors, target_gguf, prompt_file, args.max_new_tokens, args.threads, sampling,
                                     ["-md", str(draft_gguf), "--spec-type", "draft-simple"])
                else:
                    mode = config.split("-", 1)[1]
                    row = genai.run(model=str(genai_models[config]), prompt=text, mode=mode, max_new_tokens=args.max_new_tokens,
                                    ngram_size=3, max_draft_tokens=4 if mode == "ngram" else 8)
                    outputs[config] = row.pop("tokens")
                row.update(config=config, runtime=config.split("-")[0], category=prompt.category, prompt_id=prompt.id, seed=seed,
                           wall_s=time.perf_counter() - began)
                runs.append(row)
                print(f"[{number}/{len(prompts) * args.seeds}] {prompt.id} seed {seed} {config}: {row['tokens_per_s']:.1f} tok/s", flush=True)
            for side in engines:
                if f"{side}-plain" in outputs and f"{side}-auto" in outputs and args.temperature == 0:
                    runs[-len(configs) + configs.index(f"{side}-auto")]["identical_to_plain"] = outputs[f"{side}-auto"] == outputs[f"{side}-plain"]
    if genai:
        genai.close()
    summary = summarize(runs, configs)
    results = {"bundle": args.bundle, "bundle2": args.bundle2, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "llama_args": args.llama_args,
               "sampling": {"temperature": args.temperature, "top_p": args.top_p, "seeds": args.seeds},
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "configs": configs, "runs": runs, "summary": summary}
    (out / "anchors.json").write_text(json.dumps(results, indent=1))
    (out / "anchors.md").write_text("\n".join(report(results)) + "\n")
    print("\n".join(report(results)))
    return 0


def report(results: dict) -> list[str]:
    """A Markdown table per category: median (q1–q3) decode tokens/s, acceptance, and
    edge-auto's and edge-plain's median per-prompt ratios to each configuration."""
    lines = []
    for category, entry in results["summary"].items():
        rows = [row for row in results["runs"] if row["category"] == category]
        sampling = results.get("sampling") or {}
        pairs = "prompt-and-seed pairs" if sampling.get("temperature") else "prompts"
        at = f", temperature {sampling['temperature']}, top-p {sampling['top_p']}" if sampling.get("temperature") else ""
        lines += [f"### {category} ({entry[results['configs'][0]]['runs']} {pairs}, {results['max_new_tokens']} new tokens{at})", "",
                  "| configuration | decode tok/s median (q1–q3) | acceptance (median) | edge-auto ÷ it | edge-plain ÷ it |", "|---|---|---|---|---|"]
        plain = {(row["prompt_id"], row.get("seed", 0)): row["tokens_per_s"] for row in rows if row["config"] == "edge-plain"}
        for config in results["configs"]:
            speeds = [row["tokens_per_s"] for row in rows if row["config"] == config]
            if not speeds:
                continue
            accepted = [row["acceptance_rate"] for row in rows if row["config"] == config and row.get("acceptance_rate") is not None]
            ratios = [plain[key] / row["tokens_per_s"] for row in rows
                      if row["config"] == config and (key := (row["prompt_id"], row.get("seed", 0))) in plain]
            q1, q3 = (statistics.quantiles(speeds, n=4)[i] for i in (0, 2)) if len(speeds) > 1 else (speeds[0], speeds[0])
            auto_ratio = entry[config]["edge_auto_over_this"]
            cells = [f"{statistics.median(speeds):.1f} ({q1:.1f}–{q3:.1f})", f"{statistics.median(accepted):.2f}" if accepted else "–",
                     f"{auto_ratio:.2f}" if auto_ratio else "–", f"{statistics.median(ratios):.2f}" if ratios else "–"]
            lines.append(f"| {config} | " + " | ".join(cells) + " |")
        if BEST_LLAMA in entry:
            best = entry[BEST_LLAMA]
            lines.append(f"| best llama.cpp per prompt | {best['tokens_per_s']:.1f} | – | {best['edge_auto_over_this']:.2f} | – |")
            if best.get("edge2_auto_over_this"):
                lines.append(f"| best llama.cpp per prompt, edge2-auto ÷ it | {best['tokens_per_s']:.1f} | – | {best['edge2_auto_over_this']:.2f} | – |")
        lines.append("")
    return lines


def summarize(runs: list[dict], configs: list[str]) -> dict:
    """Median tokens/s per config and category, and edge-auto's per-prompt ratio to each."""
    by = defaultdict(dict)
    for row in runs:  # a prompt at a temperature pairs runs of the same seed
        by[(row["category"], (row["prompt_id"], row.get("seed", 0)))][row["config"]] = row["tokens_per_s"]
    summary = {}
    for category in sorted({row["category"] for row in runs}):
        prompts = {pid: rows for (cat, pid), rows in by.items() if cat == category}
        entry = {}
        for config in configs:
            values = [rows[config] for rows in prompts.values() if config in rows]
            ratios = [rows["edge-auto"] / rows[config] for rows in prompts.values() if config in rows and "edge-auto" in rows]
            entry[config] = {"tokens_per_s": statistics.median(values) if values else None, "runs": len(values),
                             "edge_auto_over_this": statistics.median(ratios) if ratios else None}
        best = {pid: max(speed for config, speed in rows.items() if config.startswith("llama-")) for pid, rows in prompts.items()
                if "edge-auto" in rows and any(config.startswith("llama-") for config in rows)}
        if best:
            entry[BEST_LLAMA] = {"tokens_per_s": statistics.median(best.values()), "runs": len(best),
                                 "edge_auto_over_this": statistics.median(prompts[pid]["edge-auto"] / speed for pid, speed in best.items())}
            second = [prompts[pid]["edge2-auto"] / speed for pid, speed in best.items() if "edge2-auto" in prompts[pid]]
            if second:
                entry[BEST_LLAMA]["edge2_auto_over_this"] = statistics.median(second)
        summary[category] = entry
    return summary


if __name__ == "__main__":
    sys.exit(main())
