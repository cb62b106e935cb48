"""The side-by-side decoding bench and the micro benchmark of single passes.

`run_bench`: every mode on every prompt in one process, modes interleaved per prompt and
repeats interleaved, so each speedup is a ratio against plain decoding of the same prompt
measured minutes apart at most. Every target pass is kept (the rounds of each generation), so
the report can show α and tokens per pass against γ, the verify-cost curve, the measured draft
cost c, and E(α, γ) / (1 + γc), the textbook bound.

`run_micro`: one target pass for T = 1…16 at a fixed KV length, one draft step per drafter
role, and the memory-bandwidth floor of a pass (bytes it must read over measured copy
bandwidth).
"""

from __future__ import annotations

import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.bench.prompts import BenchPrompt, PromptsError
from benchmarks.bench.stats import DEFINITIONS, run_row, summarize_runs
from benchmarks.bench.timing import PassTimer, SessionClock, copy_bandwidth, ms_stats, timed_ms
from edge_spec.budget import embed_bytes_per_weight
from edge_spec.drafters import DRAFTERS, ROLE_DRAFTERS
from edge_spec.sampling import SamplingConfig
from runtime.engine import Engine, EngineConfig, GenerateConfig

MODES = ("plain",) + tuple(d for d in DRAFTERS if d != "none")  # a mode is a drafter, or none


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
    # Sampling: temperature 0 is greedy (every mode's output must equal plain's); above 0 each
    # prompt runs once per seed, and a mode's speedup is over plain at the same settings and seed.
    temperature: float = 0.0
    top_p: float = 1.0
    seeds: int = 1

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
        if not self.temperature >= 0 or not 0 < self.top_p <= 1 or self.seeds < 1:
            raise ValueError(f"temperature must be >= 0, top_p in (0, 1] and seeds >= 1, got {self.temperature}, {self.top_p}, {self.seeds}")
        if self.temperature == 0 and (self.seeds != 1 or self.top_p != 1):
            raise ValueError("greedy decoding (temperature 0) has no seeds or top-p: pass --temperature T to sample")

    def sampling(self, seed: int) -> SamplingConfig:
        return SamplingConfig(temperature=self.temperature, top_p=self.top_p, seed=seed) if self.temperature else SamplingConfig()


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


# The CPU features that decide how fast a multi-token int4 pass runs: the same bundle's
# verify-cost curve and draft cost differ between hosts with and without AVX-512 VNNI.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_int8", "asimddp", "i8mm", "sve")


def cpu_features(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and which of ISA_FLAGS it has, from /proc/cpuinfo (empty elsewhere)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {}
    fields = {}
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    return {"cpu": fields.get("model name", ""), "isa": [flag for flag in ISA_FLAGS if flag in flags]}


def _machine() -> dict:
    import onnxruntime

    return {
        "platform": platform.platform(),
        "processor": platform.processor(),
        **cpu_features(),
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
    }


def run_bench(bundle: str | Path, prompts: list[BenchPrompt], config: BenchConfig = BenchConfig(), log=lambda line: None) -> dict:
    """Decode every prompt in every mode; returns the results.json object."""
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    clock = SessionClock()
    engine = Engine(bundle, EngineConfig(
        provider=config.provider, threads=config.threads, drafter="none",
        max_gamma=max(config.max_gamma, config.gamma or 0),
    ), session_hook=clock)
    clock.follow(engine.target.cache)
    max_context = engine.target.cache.max_context

    def encode(prompt: BenchPrompt) -> list[int]:
        ids = engine.encode(messages=list(prompt.messages)) if prompt.messages else engine.encode(prompt=prompt.prompt)
        if len(ids) >= max_context:
            raise PromptsError(
                f"prompt {prompt.id!r} has {len(ids)} tokens but the bundle's max context is {max_context}: "
                "shorten it, drop it from the prompts file, or re-export with a larger --max-context"
            )
        return ids

    def first_turn(prompt: BenchPrompt) -> BenchPrompt:
        if prompt.turns is None:
            return prompt
        return BenchPrompt(f"{prompt.id}#1", prompt.category, messages=({"role": "user", "content": prompt.turns[0]},))

    encoded = [encode(first_turn(prompt)) for prompt in prompts]  # later turns are encoded once their history exists
    # Every drafter is built (and calibrated) before anything is timed; a missing role fails here.
    for mode in config.modes:
        engine.use_drafter("none" if mode == "plain" else mode, config.gamma)
    models = engine.bundle.manifest.models
    # Each draft-model forward runs this session once, so its calls count the forwards.
    draft_first_stage = models["draft"].stages[0] if "draft" in models else None
    seeds = range(config.seeds)

    def decode(mode: str, ids: list[int], generate_config: GenerateConfig):
        engine.use_drafter("none" if mode == "plain" else mode, config.gamma)
        # Every KV buffer emptied, so each mode prefills the whole prompt (equal prefill work).
        engine.target.cache.reset()
        if engine.drafter is not None:
            engine.drafter.reset()
        clock.clear()
        began = time.perf_counter()
        result = engine.generate(ids, generate_config)
        ended = time.perf_counter()
        # The rounds: from the end of the target's prefill (a draft model prefills before it) to the end.
        window = (clock.prefill_ended(len(ids), began), ended)
        window_ort_s = clock.seconds_within(*window)
        forwards = clock.count(draft_first_stage, *window) if draft_first_stage else 0
        return result, result.steps, (ended - window[0], window_ort_s), forwards

    if config.warmup:
        for mode in config.modes:
            decode(mode, encoded[0], GenerateConfig(min(config.max_new_tokens, 8), config.sampling(0)))
        for mode in config.modes:  # what the warm-up generated must not be copied from later
            engine.use_drafter("none" if mode == "plain" else mode, config.gamma)
            engine.forget()
    runs = []

    def run_modes(prompt: BenchPrompt, ids: list[int], repeat: int, shift: int) -> str:
        """Every mode on one prompt (once per seed); returns plain decoding's reply to the first seed."""
        reply = None
        for seed in seeds:
            generate = GenerateConfig(config.max_new_tokens, config.sampling(seed))
            # Rotate the order so no mode always runs first (warm caches, thermal drift).
            order = config.modes[(shift + seed) % len(config.modes):] + config.modes[: (shift + seed) % len(config.modes)]
            decoded = {mode: decode(mode, ids, generate) for mode in order}
            plain_result, plain_steps, _, _ = decoded["plain"]
            reply = plain_result.text if reply is None else reply
            plain_t1 = [s.target_s * 1e3 for s in plain_steps]
            plain = {
                "tokens_per_s": plain_result.timings["decode_tokens_per_s"],
                "token_ids": plain_result.token_ids,
                "target_t1_ms": statistics.median(plain_t1),
            }
            for mode in config.modes:
                runs.append({**run_row(mode, prompt, repeat, *decoded[mode], plain), "seed": seed if config.temperature else None})
                row = runs[-1]
                log(f"[{repeat + 1}/{config.repeat}] {prompt.id} {mode}{f' seed {seed}' if config.temperature else ''}: "
                    f"{row['tokens_per_s']:.1f} tok/s, {row['tokens_per_pass']:.2f} tokens/pass, ×{row['speedup']:.2f}")
        return reply

    for repeat in range(config.repeat):
        for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
            shift = (repeat * len(prompts) + i) % len(config.modes)
            if prompt.turns is None:
                run_modes(prompt, ids, repeat, shift)
                continue
            history: list[dict] = []
            for turn, text in enumerate(prompt.turns, start=1):
                history.append({"role": "user", "content": text})
                asked = BenchPrompt(f"{prompt.id}#{turn}", prompt.category, messages=tuple(history))
                # Every mode answers the same history: plain decoding's replies to the earlier turns.
                history.append({"role": "assistant", "content": run_modes(asked, ids if turn == 1 else encode(asked), repeat, shift + turn)})
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
        "sampling": {"temperature": config.temperature, "top_p": config.top_p, "seeds": config.seeds} if config.temperature else "greedy",
        "started": started,
        "definitions": DEFINITIONS,
        "verify_cost": {
            block: {"ms": statistics.median(ms), "runs": len(ms)}
            for block, ms in sorted(verify_cost.items(), key=lambda kv: int(kv[0]))
        },
        "runs": runs,
        "summary": summarize_runs(runs, config.modes),
    }


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
            times[block] += timed_ms(lambda: target_pass(block), 1)
    target_rows = [{"T": block, **ms_stats(times[block]), "tokens_per_s": block * 1e3 / statistics.median(times[block])} for block in blocks]
    t1_ms = target_rows[0]["ms"]

    draft_steps = {}
    for role in roles:
        draft_step = timer.draft_step(ROLE_DRAFTERS[role])
        draft_step()
        stats = ms_stats(timed_ms(draft_step, config.repeats))
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
