"""Side-by-side decoding benchmark, and a micro benchmark of single passes.

`run_bench`: every mode on every prompt in one process, modes interleaved per prompt and
repeats interleaved, so each speedup is a ratio against plain decoding of the same prompt
measured minutes apart at most. Every target pass is kept (the rounds of each generation), so
the report can show α and tokens per pass against γ, the verify-cost curve, the measured draft
cost c, and E(α, γ) / (1 + γc), the textbook bound.

`run_micro`: one target pass for T = 1…16 at a fixed KV length, one draft step per drafter
role, and the memory-bandwidth floor of a pass (bytes it must read over measured copy
bandwidth).

Results go to results.json / micro.json in --out; `render_report` turns whichever of the two is
there into report.md and PNG plots (matplotlib, imported only then).
"""

from __future__ import annotations

import gzip
import json
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edge_spec.budget import embed_bytes_per_weight
from edge_spec.catalog import models_dir
from edge_spec.sampling import SamplingConfig
from edge_spec.verify import expected_tokens_per_pass
from runtime.engine import DRAFTERS, Engine, EngineConfig, GenerateConfig

MODES = ("plain",) + tuple(d for d in DRAFTERS if d != "none")  # a mode is a drafter, or none
HUMANEVAL_FILE = "HumanEval.jsonl.gz"
HUMANEVAL_DEFAULT_COUNT = 20
RESULTS_FILE = "results.json"
MICRO_FILE = "micro.json"
REPORT_FILE = "report.md"
# Bundle role of each drafter that runs a model (the micro benchmark times one step of each).
ROLE_DRAFTERS = {"draft": "model", "layer_skip": "layer-skip"}

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


class PromptsError(ValueError):
    """A prompts spec or file that cannot be benchmarked, with where and why."""


@dataclass(frozen=True)
class BenchPrompt:
    id: str
    category: str
    prompt: str | None = None
    messages: tuple | None = None


@dataclass(frozen=True)
class BenchConfig:
    modes: tuple[str, ...] = MODES
    max_new_tokens: int = 128
    repeat: int = 1
    gamma: int | None = None  # None: adaptive
    max_gamma: int = 8
    provider: str = "auto"
    threads: int = 0
    warmup: bool = True  # one short untimed generation per mode first (session allocations)

    def __post_init__(self):
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"unknown mode(s) {unknown} (choose from {', '.join(MODES)})")
        if "plain" not in self.modes:
            raise ValueError("modes must include plain: every speedup is measured against it")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes repeat: {list(self.modes)}")
        if self.max_new_tokens < 1 or self.repeat < 1:
            raise ValueError(f"max_new_tokens and repeat must be at least 1, got {self.max_new_tokens} and {self.repeat}")
        if self.gamma is not None and self.gamma < 1:
            raise ValueError(f"a fixed gamma must be at least 1, got {self.gamma}")


@dataclass(frozen=True)
class MicroConfig:
    kv_len: int = 512  # rows already in the cache when a pass runs (clamped to the bundle's context)
    max_block: int = 16  # target passes are timed for T = 1 … max_block
    repeats: int = 7
    copy_mib: int = 256  # well past any last-level cache, so the copy streams from memory
    provider: str = "auto"
    threads: int = 0

    def __post_init__(self):
        if self.kv_len < 1 or self.max_block < 1 or self.repeats < 1 or self.copy_mib < 1:
            raise ValueError(f"micro settings must be positive: {self}")


# -- prompts -------------------------------------------------------------------------------


def _humaneval(spec: str) -> list[BenchPrompt]:
    count = HUMANEVAL_DEFAULT_COUNT
    if spec != "humaneval":
        text = spec.split(":", 1)[1] if spec.startswith("humaneval:") else ""
        if not text.isdigit() or int(text) < 1:
            raise PromptsError(f"bad prompts spec {spec!r}: use humaneval or humaneval:N with N a positive integer")
        count = int(text)
    path = models_dir() / HUMANEVAL_FILE
    if not path.is_file():
        raise PromptsError(f"{path} not found: put {HUMANEVAL_FILE} in $EDGE_SPEC_MODELS, or pass a prompts file")
    prompts = []
    with gzip.open(path, "rt") as f:
        for line in f:
            item = json.loads(line)
            content = f"Complete this Python function. Reply with the full function only.\n\n```python\n{item['prompt']}```"
            prompts.append(BenchPrompt(item["task_id"], "code", messages=({"role": "user", "content": content},)))
            if len(prompts) == count:
                break
    if len(prompts) < count:
        raise PromptsError(f"{spec}: {path} holds only {len(prompts)} problems")
    return prompts


def _check_messages(messages, where: str) -> tuple:
    if not isinstance(messages, list) or not messages:
        raise PromptsError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or not isinstance(message.get("content"), str):
            raise PromptsError(f"{where}: messages[{i}] must be an object with string 'role' and 'content'")
    return tuple(messages)


def _prompt_from_line(line: str, where: str) -> BenchPrompt:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        raise PromptsError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise PromptsError(f"{where}: expected a JSON object with id, category and prompt or messages, got {type(item).__name__}")
    for key in ("id", "category"):
        if key not in item:
            raise PromptsError(f"{where}: missing field {key!r} (each line needs id, category, and prompt or messages)")
    if not isinstance(item["id"], (str, int)) or isinstance(item["id"], bool) or str(item["id"]) == "":
        raise PromptsError(f"{where}: 'id' must be a non-empty string or an integer")
    if not isinstance(item["category"], str) or not item["category"]:
        raise PromptsError(f"{where}: 'category' must be a non-empty string")
    has_prompt, has_messages = "prompt" in item, "messages" in item
    if has_prompt == has_messages:
        raise PromptsError(f"{where}: give exactly one of 'prompt' (raw text) or 'messages' (chat), not {'both' if has_prompt else 'neither'}")
    if has_prompt:
        if not isinstance(item["prompt"], str) or not item["prompt"]:
            raise PromptsError(f"{where}: 'prompt' must be a non-empty string")
        return BenchPrompt(str(item["id"]), item["category"], prompt=item["prompt"])
    return BenchPrompt(str(item["id"]), item["category"], messages=_check_messages(item["messages"], where))


def _prompts_file(spec: str) -> list[BenchPrompt]:
    path = Path(spec)
    if not path.is_file():
        raise PromptsError(f"prompts file {path} not found (pass FILE.jsonl or humaneval[:N])")
    prompts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            prompts.append(_prompt_from_line(line, f"{path} line {number}"))
    if not prompts:
        raise PromptsError(f"prompts file {path} has no prompts (one JSON object per line)")
    return prompts


def load_prompts(spec: str) -> list[BenchPrompt]:
    """FILE.jsonl (one object a line: id, category, and prompt or messages) or humaneval[:N]
    (chat "complete this function", category "code"); several, separated by commas."""
    prompts, seen = [], {}
    for part in (p.strip() for p in spec.split(",")):
        if not part:
            raise PromptsError(f"empty entry in prompts spec {spec!r}")
        for prompt in _humaneval(part) if part.startswith("humaneval") and not Path(part).is_file() else _prompts_file(part):
            if prompt.id in seen:
                raise PromptsError(f"prompt id {prompt.id!r} appears twice (in {seen[prompt.id]} and {part}); ids must be unique")
            seen[prompt.id] = part
            prompts.append(prompt)
    return prompts


# -- instrumentation -----------------------------------------------------------------------


class _SessionClock:
    """Wall-clock intervals spent inside ONNX Runtime session runs, by stage key."""

    def __init__(self):
        self.calls: list[tuple[float, float, str]] = []  # (start, end) perf_counter seconds, stage key

    def clear(self) -> None:
        self.calls.clear()

    def seconds_within(self, begin: float, end: float) -> float:
        return sum(max(0.0, min(e, end) - max(s, begin)) for s, e, _ in self.calls)

    def count(self, key: str, begin: float, end: float) -> int:
        return sum(1 for s, _, k in self.calls if k == key and begin <= s <= end)


class _TimedSession:
    """Stands in for an ort.InferenceSession: times run / run_with_iobinding, forwards the rest."""

    def __init__(self, session, clock: _SessionClock, key: str):
        self._session = session
        self._clock = clock
        self._key = key

    def _timed(self, method, *args, **kwargs):
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self._clock.calls.append((began, time.perf_counter(), self._key))

    def run(self, *args, **kwargs):
        return self._timed(self._session.run, *args, **kwargs)

    def run_with_iobinding(self, *args, **kwargs):
        return self._timed(self._session.run_with_iobinding, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


class _BenchEngine(Engine):
    """An Engine whose sessions are timed, which notes when the target's prefill ends (the
    rounds start right after), and which keeps the rounds of its last generation."""

    def __init__(self, bundle_path, config: EngineConfig):
        self.clock = _SessionClock()
        self.last_steps: list = []
        self.prefill_ended: float | None = None
        super().__init__(bundle_path, config)

    def _runner(self, role, *args, **kwargs):
        runner = super()._runner(role, *args, **kwargs)
        keys = self.bundle.manifest.models[role].stages
        for key in keys:
            if not isinstance(self._sessions[key], _TimedSession):
                self._sessions[key] = _TimedSession(self._sessions[key], self.clock, key)
        runner.sessions = [self._sessions[key] for key in keys]
        if role == "target":
            prefill = runner.prefill

            def timed_prefill(*args, **kwargs):
                try:
                    return prefill(*args, **kwargs)
                finally:
                    self.prefill_ended = time.perf_counter()

            runner.prefill = timed_prefill
        return runner

    def _result(self, text, prompt_ids, generated, stop_reason, steps, *times):
        self.last_steps = list(steps)
        return super()._result(text, prompt_ids, generated, stop_reason, steps, *times)

    def reset_caches(self) -> None:
        """Empty every KV buffer, so each mode prefills the whole prompt (equal prefill work)."""
        for cache in self._caches.values():
            cache.reset()


# -- the side-by-side bench ----------------------------------------------------------------


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
        if step.drafter != "layer-skip":
            target_ms[gamma + 1].append(step.target_s * 1e3)
    return {"by_drafter": by_drafter, "by_gamma": by_gamma, "target_ms": target_ms, "draft_s": draft_s, "drafted": drafted}


def _mode_cost(by_drafter: dict) -> float | None:
    """One c per mode: its model drafter's (auto: the model part; lookup: its own small cost)."""
    model_parts = [name for name in by_drafter if name != "lookup"]
    return by_drafter.get(model_parts[0]) if model_parts else by_drafter.get("lookup")


def _alpha(accepted: int, rejections: int) -> float | None:
    return accepted / (accepted + rejections) if accepted + rejections else None


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


def _run_row(mode: str, prompt: BenchPrompt, repeat: int, result, steps, window: tuple[float, float], model_forwards: int,
             plain: dict) -> dict:
    """window: (seconds from the end of prefill to the end, seconds of them inside ONNX Runtime)."""
    rounds = _rounds(steps)
    alphas = {name: _alpha(*counts) for name, counts in rounds["by_drafter"].items()}
    plain_t1_s = plain["target_t1_ms"] / 1e3
    step_ms = {
        name: seconds * 1e3 / (model_forwards if name == "model" and model_forwards else rounds["drafted"][name])
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


def _summary(runs: list[dict], modes: tuple[str, ...]) -> dict:
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
                        "alpha": _alpha(row["accepted"], row["rejections"]) if int(g) else None,
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


def _machine() -> dict:
    import onnxruntime

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def run_bench(bundle: str | Path, prompts: list[BenchPrompt], config: BenchConfig = BenchConfig(), log=lambda line: None) -> dict:
    """Decode every prompt in every mode; returns the results.json object."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    engine = _BenchEngine(bundle, EngineConfig(
        provider=config.provider, threads=config.threads, drafter="none",
        max_gamma=max(config.max_gamma, config.gamma or 0),
    ))
    encoded = []
    max_context = engine.target.cache.max_context
    for prompt in prompts:
        ids = engine.encode(messages=list(prompt.messages)) if prompt.messages else engine.encode(prompt=prompt.prompt)
        if len(ids) >= max_context:
            raise PromptsError(
                f"prompt {prompt.id!r} has {len(ids)} tokens but the bundle's max context is {max_context}: "
                "shorten it, drop it from the prompts file, or re-export with a larger --max-context"
            )
        encoded.append(ids)
    # Every drafter is built (and calibrated) before anything is timed; a missing role fails here.
    for mode in config.modes:
        engine.use_drafter("none" if mode == "plain" else mode, config.gamma)
    models = engine.bundle.manifest.models
    # Each draft-model forward runs this session once, so its calls count the forwards.
    draft_first_stage = models["draft"].stages[0] if "draft" in models else None
    sampling = SamplingConfig()  # greedy: each mode's output must equal plain decoding's
    generate = GenerateConfig(config.max_new_tokens, sampling)

    def decode(mode: str, ids: list[int], generate_config: GenerateConfig):
        engine.use_drafter("none" if mode == "plain" else mode, config.gamma)
        engine.reset_caches()
        engine.clock.clear()
        engine.prefill_ended = None
        result = engine.generate(ids, generate_config)
        ended = time.perf_counter()
        # The rounds: from the end of the target's prefill (a draft model prefills before it) to the end.
        window = (engine.prefill_ended, ended)
        window_ort_s = engine.clock.seconds_within(*window)
        forwards = engine.clock.count(draft_first_stage, *window) if draft_first_stage else 0
        return result, engine.last_steps, (ended - engine.prefill_ended, window_ort_s), forwards

    if config.warmup:
        for mode in config.modes:
            decode(mode, encoded[0], GenerateConfig(min(config.max_new_tokens, 8), sampling))
    runs = []
    for repeat in range(config.repeat):
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            # Rotate the order so no mode always runs first (warm caches, thermal drift).
            shift = (repeat * len(prompts) + i) % len(config.modes)
            order = config.modes[shift:] + config.modes[:shift]
            decoded = {mode: decode(mode, ids, generate) for mode in order}
            plain_result, plain_steps, _, _ = decoded["plain"]
            plain_t1 = [s.target_s * 1e3 for s in plain_steps]
            plain = {
                "tokens_per_s": plain_result.timings["decode_tokens_per_s"],
                "token_ids": plain_result.token_ids,
                "target_t1_ms": statistics.median(plain_t1),
            }
            for mode in config.modes:
                runs.append(_run_row(mode, prompt, repeat, *decoded[mode], plain))
                row = runs[-1]
                log(f"[{repeat + 1}/{config.repeat}] {prompt.id} {mode}: {row['tokens_per_s']:.1f} tok/s, "
                    f"{row['tokens_per_pass']:.2f} tokens/pass, ×{row['speedup']:.2f}")
    verify_cost = defaultdict(list)
    for run in runs:
        for block, ms in run["target_pass_ms"].items():
            verify_cost[block].append(ms)
    return {
        "bundle": str(bundle),
        "machine": _machine(),
        "provider": engine.provider,
        "threads": config.threads,
        "modes": list(config.modes),
        "categories": sorted({p.category for p in prompts}),
        "prompts": len(prompts),
        "max_new_tokens": config.max_new_tokens,
        "gamma": "auto" if config.gamma is None else config.gamma,
        "max_gamma": max(config.max_gamma, config.gamma or 0),
        "repeat": config.repeat,
        "sampling": "greedy",
        "started": started,
        "definitions": DEFINITIONS,
        "verify_cost": {
            block: {"ms": statistics.median(ms), "runs": len(ms)}
            for block, ms in sorted(verify_cost.items(), key=lambda kv: int(kv[0]))
        },
        "runs": runs,
        "summary": _summary(runs, config.modes),
    }


# -- micro benchmark -----------------------------------------------------------------------


def _timed_ms(action, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        action()
        times.append((time.perf_counter() - began) * 1e3)
    return times


def _ms_stats(times: list[float]) -> dict:
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes per second a numpy copy moves (read + write, as STREAM's Copy counts them)."""
    src = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # page in both buffers before timing
    median_ms = statistics.median(_timed_ms(lambda: np.copyto(dst, src), repeats))
    return 2 * src.nbytes / (median_ms / 1e3)


class PassTimer:
    """Single passes at a fixed cache length, for timing: the target's cache holds kv_len rows
    (of one repeated token: content does not change the work) and every pass starts from them."""

    def __init__(self, engine: Engine, kv_len: int, max_block: int):
        self.engine, self.kv_len = engine, kv_len
        eos = engine.bundle.manifest.tokenizer.eos_token_ids[0]
        self.tokens = np.full(kv_len + max_block, eos, dtype=np.int64)
        engine.target.cache.reset()
        engine.target.prefill(self.tokens[:kv_len])

    def target_pass(self, block: int) -> None:
        target = self.engine.target
        target.cache.rollback_to_prefix(self.tokens[:self.kv_len])
        target.forward(self.tokens[self.kv_len : self.kv_len + block])

    def draft_step(self, drafter_name: str):
        """Switch the engine to drafter_name and return a callable that runs one draft step
        from kv_len rows and takes it back."""
        engine, tokens, kv_len = self.engine, self.tokens, self.kv_len
        engine.use_drafter(drafter_name)
        drafter, greedy, rng = engine.drafter, SamplingConfig(), np.random.default_rng(0)
        engine.target.cache.rollback_to_prefix(tokens[:kv_len])
        drafter.reset(tokens[:kv_len])  # a draft model prefills its own cache here

        def step():
            drafter.propose(tokens[: kv_len + 1], 1, greedy, rng)
            drafter.accepted(tokens[: kv_len + 1], 0)  # back to kv_len rows

        return step


def run_micro(bundle: str | Path, config: MicroConfig = MicroConfig()) -> dict:
    """Target pass time for T = 1…max_block, one draft step per drafter role, and the
    memory-bandwidth floor of a 1-token pass; returns the micro.json object."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    engine = Engine(bundle, EngineConfig(provider=config.provider, threads=config.threads, drafter="none", calibrate=False))
    manifest = engine.bundle.manifest
    roles = [role for role in manifest.drafts() if role in ROLE_DRAFTERS]
    room = min(manifest.models[role].arch.max_context for role in ["target", *roles]) - config.max_block - 1
    if room < 1:
        raise ValueError(f"the bundle's max context is too small to time blocks of {config.max_block} tokens")
    kv_len = min(config.kv_len, room)
    timer = PassTimer(engine, kv_len, config.max_block)
    target_pass = timer.target_pass

    blocks = range(1, config.max_block + 1)
    times = {block: [] for block in blocks}
    for block in blocks:
        target_pass(block)  # first run of each shape: allocations, untimed
    for _ in range(config.repeats):  # blocks interleaved, so drift spreads over all of them
        for block in blocks:
            times[block] += _timed_ms(lambda: target_pass(block), 1)
    target_rows = [{"T": block, **_ms_stats(times[block]), "tokens_per_s": block * 1e3 / statistics.median(times[block])} for block in blocks]
    t1_ms = target_rows[0]["ms"]

    draft_steps = {}
    for role in roles:
        draft_step = timer.draft_step(ROLE_DRAFTERS[role])
        draft_step()
        stats = _ms_stats(_timed_ms(draft_step, config.repeats))
        draft_steps[role] = {"drafter": ROLE_DRAFTERS[role], **stats, "cost_ratio": stats["ms"] / t1_ms}

    arch = manifest.target.arch
    files = [name for key in manifest.target.stages for name in (manifest.stages[key].file, *manifest.stages[key].data_files)]
    weight_bytes = sum(engine.bundle.file(name).stat().st_size for name in files)
    # A pass reads one row of the embedding table per token, not the table.
    embed_bytes = round(arch.vocab_size * arch.hidden_size * embed_bytes_per_weight(manifest.target.quant))
    row_bytes = arch.n_layers * 2 * arch.n_kv_heads * arch.head_dim * np.dtype(arch.kv_dtype).itemsize  # K and V, all layers
    bandwidth = copy_bandwidth(config.copy_mib, config.repeats)
    bytes_per_pass = weight_bytes - embed_bytes + row_bytes * kv_len
    floor_ms = bytes_per_pass / bandwidth * 1e3
    return {
        "bundle": str(bundle),
        "machine": _machine(),
        "provider": engine.provider,
        "threads": config.threads,
        "started": started,
        "kv_len": kv_len,
        "kv_len_requested": config.kv_len,
        "repeats": config.repeats,
        "target_pass": target_rows,
        "draft_step": draft_steps,
        "memory": {
            "weight_bytes": weight_bytes,
            "embedding_table_bytes": embed_bytes,  # stored, but not read by a pass
            "kv_bytes": row_bytes * kv_len,
            "kv_bytes_full_buffer": row_bytes * arch.max_context,  # what a graph attending over every row reads
            "bytes_per_pass": bytes_per_pass,
            "copy_mib": config.copy_mib,
            "copy_gb_s": bandwidth / 1e9,
            "floor_ms": floor_ms,
            "floor_tokens_per_s": 1e3 / floor_ms,
            "measured_ms": t1_ms,
            "gap": t1_ms / floor_ms,
        },
    }


# -- results, report and plots -------------------------------------------------------------


def save_results(results: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / RESULTS_FILE).write_text(json.dumps(results, indent=2))


def save_micro(micro: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / MICRO_FILE).write_text(json.dumps(micro, indent=2))


def _fmt(value, spec: str = ".2f") -> str:
    return "–" if value is None else format(value, spec)


def _bench_section(results: dict) -> list[str]:
    s_all = results["summary"]
    lines = [
        f"# Bench: {results['bundle']}",
        "",
        f"{results['prompts']} prompts ({', '.join(results['categories'])}), {results['max_new_tokens']} new tokens, "
        f"greedy, γ {results['gamma']} (at most {results['max_gamma']}), repeat {results['repeat']}, "
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


def _plots(results: dict | None, micro: dict | None, out: Path) -> list[str]:
    """PNG files drawn with matplotlib's Agg canvas (no pyplot, no display)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    written = []

    def save(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
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
            line = ax_alpha.plot(gammas, [_alpha(pooled[g][1], pooled[g][2]) for g in gammas], "o-", label=mode)[0]
            ax_tokens.plot(gammas, [pooled[g][3] / pooled[g][0] for g in gammas], "o-", color=line.get_color(), label=f"{mode} measured")
            alpha = _alpha(sum(row[1] for row in pooled.values()), sum(row[2] for row in pooled.values()))
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
