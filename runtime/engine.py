"""The public Python API: load a bundle once, then generate or stream from it.

One Engine holds sessions and KV buffers for one sequence at a time; a lock serializes
generations, so an Engine may be shared between threads (callers wait their turn).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from edge_spec.budget import plan_bundle
from edge_spec.commit import commit
from edge_spec.manifest import BundleError, check_declared_io, load_head_tokens
from edge_spec.placement import check_bundle
from edge_spec.profiles import load_verdict
from edge_spec.sampling import SamplingConfig
from runtime.bundle import open_bundle
from runtime.drafters.base import Drafter
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.layer_skip import LayerSkipDrafter
from runtime.drafters.mixed import MixedDrafter
from runtime.drafters.prompt_lookup import PromptLookupDrafter
from runtime.calibration import calibrate, calibrated
from runtime.gamma import CostModel, GammaConfig
from runtime.kv_cache import KVCache
from runtime.loop import Step, decode_steps
from runtime.model import ModelRunner
from runtime.policy import RoundPolicy
from runtime.sessions import NO_CPU_FALLBACK, ProviderChoice, SessionConfig, kv_device, open_session, resolve_provider
from runtime.tokenizer import BundleTokenizer, StreamDecoder

DRAFTERS = ("auto", "model", "layer-skip", "lookup", "none")


class PromptTooLongError(ValueError):
    pass


def check_token_ids(ids, vocab: int) -> None:
    """Every id an int in [0, vocab): ids past the tokenizer would index past embeddings."""
    for i in ids:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            raise ValueError(f"token ids must be integers, got {i!r}")
        if not 0 <= i < vocab:
            raise ValueError(f"token id {i} is outside the vocabulary [0, {vocab})")


@dataclass(frozen=True)
class EngineConfig:
    provider: str = "auto"
    draft_provider: str | None = None  # None: same as provider
    device_id: int = 0  # CUDA / DirectML adapter, for every role on a GPU provider
    coreml_compute_units: str = "ALL"  # ALL | CPUAndNeuralEngine | CPUAndGPU | CPUOnly
    coreml_static_shapes: bool = False
    threads: int = 0
    drafter: str = "auto"  # auto: copy when the text repeats, else the bundle's default draft
    gamma: int | None = None  # None: adaptive
    max_gamma: int = 8
    allow_fallback: bool = False
    check_hashes: bool = True
    calibrate: bool = True  # time target and draft passes at load, to seed the cost model
    memory_budget: int | None = None  # bytes: refuse, before loading, a plan (edge_spec.budget) that exceeds it
    profile_prefix: str | None = None  # ONNX Runtime profiling into files with this prefix (which provider ran each node)
    # Every target pass scores at least 2 positions, so no logit depends on whether its token
    # was drafted: greedy output is the same for every drafter and γ at any quantization
    # (runtime/model.py; the cost is in BENCHMARKS.md).
    block_stable: bool = False

    def __post_init__(self):
        GammaConfig(fixed=self.gamma, max_gamma=self.max_gamma)  # raises ValueError on a γ it cannot run


@dataclass(frozen=True)
class GenerateConfig:
    max_new_tokens: int = 256
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")


@dataclass
class GenerationResult:
    text: str
    prompt_ids: list[int]
    token_ids: list[int]
    stop_reason: str  # eos | stop | length | context | cancelled
    timings: dict
    stats: dict
    rounds: tuple[tuple[int, int], ...] = ()  # (drafted, accepted) per target pass, in order
    steps: tuple[Step, ...] = ()  # what the loop yielded, one per target pass, in order


class Engine:
    def __init__(self, bundle_path: str | Path, config: EngineConfig = EngineConfig(),
                 session_hook: Callable[[str, object], object] | None = None):
        """session_hook: for measurement tools (benchmarks/bench/timing.py), None in the product.
        Called once per stage session as it opens, with the stage key and the session (an ONNX
        Runtime InferenceSession or a Core ML stand-in); the Engine runs what it returns in its
        place, which must answer everything the session does (run, run_with_iobinding,
        io_binding, get_inputs, ...), typically by forwarding to it."""
        self._session_hook = session_hook
        if config.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {config.drafter!r} (choose from {', '.join(DRAFTERS)})")
        self.config = config
        self.bundle = open_bundle(bundle_path, check_hashes=config.check_hashes)
        manifest = self.bundle.manifest
        if config.memory_budget is not None:
            plan_bundle(manifest, self.bundle.path, config.drafter, config.memory_budget, config.max_gamma).check()
        # Per role group: "target" (target and layer-skip, which share sessions) and "draft".
        self.provider_choices: dict[str, ProviderChoice] = {
            "target": resolve_provider(config.provider, config.allow_fallback),
            "draft": resolve_provider(config.draft_provider or config.provider, config.allow_fallback),
        }
        self._session_config(self.provider_choices["target"])  # bad provider options fail before loading
        self.warnings = self._check_placement()
        self.tokenizer = BundleTokenizer(self.bundle.file(manifest.tokenizer.file), manifest.tokenizer)
        self._sessions: dict[str, object] = {}
        self._caches: dict[str, KVCache] = {}
        self.target = self._runner("target")
        self.drafter = self._make_drafter(config.drafter)
        self._drafters = {config.drafter: self.drafter}
        self.costs = CostModel()
        self.policy = RoundPolicy(self.costs)  # α per drafter and γ config for the engine's life
        self._lock = threading.Lock()
        self._owner: int | None = None  # thread id of the generation holding _lock
        if config.calibrate and self.drafter is not None:
            self.calibrate()

    # -- loading ---------------------------------------------------------------------------

    @property
    def provider(self) -> str:
        return self.provider_choices["target"].provider

    @property
    def draft_provider(self) -> str:
        return self.provider_choices["draft"].provider

    def provider_report(self) -> dict:
        """Per role group: the provider that runs, what was asked for, and why they differ."""
        return {group: choice.to_dict() for group, choice in self.provider_choices.items()}

    def provider_line(self) -> str:
        target, draft = self.provider_choices["target"], self.provider_choices["draft"]
        line = f"provider: {target.describe()}"
        return line if draft == target else f"{line}; draft provider: {draft.describe()}"

    def _check_placement(self) -> list[str]:
        """Refuse, before any session exists, a bundle whose graphs a GPU provider cannot place
        node for node (its sessions run without CPU fallback); warn when it would only be slow."""
        manifest, warnings = self.bundle.manifest, []
        for group, roles in (("target", ("target", "layer_skip")), ("draft", ("draft",))):
            choice = self.provider_choices[group]
            provider = choice.provider
            keys = [k for role in roles if role in manifest.models for k in manifest.models[role].stages]
            if provider in NO_CPU_FALLBACK:
                stages = {k: manifest.stages[k] for k in dict.fromkeys(keys) if manifest.stages[k].file and k not in manifest.coreml}
                report = check_bundle(dataclasses.replace(manifest, stages=stages), self.bundle.path, provider)
                if not report.ok:
                    why = f"bundle {self.bundle.path} (--device {manifest.device}) cannot run on {provider}: {report.summary()}"
                    fix = f"re-export it with --device {provider} (`python -m runtime check BUNDLE --provider {provider}` lists the nodes)"
                    if not (self.config.allow_fallback or choice.requested == "auto"):
                        raise BundleError(f"{why}; {fix}")
                    # auto (or --allow-fallback) means the best provider that works: here the CPU.
                    self.provider_choices[group] = dataclasses.replace(choice, provider="cpu", fallback_from=provider, reason=report.summary())
                    warnings.append(f"{why}; running on the CPU instead; {fix}")
                    provider = "cpu"
            verdict = load_verdict(manifest.device, provider) if keys and (group == "target" or "draft" in manifest.models) else None
            if verdict and verdict not in warnings:
                warnings.append(verdict)
        return warnings

    def _session_config(self, choice: ProviderChoice) -> SessionConfig:
        c = self.config
        # auto means the best provider that works: one that fails to start gives way to the CPU.
        allow_fallback = c.allow_fallback or choice.requested == "auto"
        return SessionConfig(choice.provider, c.threads, allow_fallback, c.device_id, c.coreml_compute_units, c.coreml_static_shapes, c.profile_prefix)

    def _runs_coreml_package(self, key: str, stage, group: str) -> bool:
        """A stage runs its Core ML package when the bundle has no ONNX graph for it, or when the
        role group's provider is coreml and the bundle ships a package (the Neural Engine path)."""
        if key not in self.bundle.manifest.coreml:
            return False
        return not stage.file or self.provider_choices[group].provider == "coreml"

    def _runner(self, role: str, group: str = "target") -> ModelRunner:
        manifest = self.bundle.manifest
        self.bundle.require_role(role)
        info = manifest.models[role]
        stages = [manifest.stages[key] for key in info.stages]
        sessions = []
        for key, stage in zip(info.stages, stages):
            opening = key not in self._sessions
            if key not in self._sessions and self._runs_coreml_package(key, stage, group):
                from runtime.coreml_backend import load_session

                package = manifest.coreml[key]
                self._sessions[key] = load_session(self.bundle.file(package.file), stage, package, self.config.coreml_compute_units)
            if key not in self._sessions:
                choice = self.provider_choices[group]
                session, reason = open_session(self.bundle.file(stage.file), choice.provider, self._session_config(choice))
                if hasattr(session, "get_inputs"):  # the manifest's facts against what the graph declares
                    owner_arch = manifest.models[info.shares_kv_with or role].arch
                    rows = info.logit_rows if stage.head and info.trimmed_head is not None else None
                    check_declared_io(owner_arch, key, stage, [(v.name, v.type, v.shape) for v in (*session.get_inputs(), *session.get_outputs())], rows)
                if reason:  # later stages of the group go straight to the CPU
                    self.provider_choices[group] = dataclasses.replace(choice, provider="cpu", fallback_from=choice.provider, reason=reason)
                self._sessions[key] = session
            if opening and self._session_hook is not None:
                self._sessions[key] = self._session_hook(key, self._sessions[key])
            sessions.append(self._sessions[key])
        owner = info.shares_kv_with or role
        if owner not in self._caches:
            arch = manifest.models[owner].arch
            owner_stages = [manifest.stages[key] for key in manifest.models[owner].stages]
            device = kv_device(owner_stages, [self._sessions[key] for key in manifest.models[owner].stages])
            self._caches[owner] = KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, arch.kv_dtype, device)
        min_rows = 2 if self.config.block_stable and role == "target" else 1
        head_tokens = load_head_tokens(self.bundle.path, manifest, role) if info.trimmed_head is not None else None
        return ModelRunner(role, info, stages, sessions, self._caches[owner], min_rows, head_tokens)

    def _model_drafter(self, kind: str) -> Drafter | None:
        models = self.bundle.manifest.models
        role = {"model": "draft", "layer-skip": "layer_skip"}.get(kind) or self.bundle.manifest.default_draft
        if role is None:
            return None
        if role not in models:
            self.bundle.require_role(role)
        if role == "layer_skip":
            return LayerSkipDrafter(self._runner("layer_skip"))
        return DraftModelDrafter(self._runner(role, group="draft"))

    def _make_drafter(self, kind: str) -> Drafter | None:
        if kind == "none":
            return None
        if kind == "lookup":
            return PromptLookupDrafter()
        if kind == "auto":
            return MixedDrafter(PromptLookupDrafter(), self._model_drafter("auto"))
        return self._model_drafter(kind)

    def use_drafter(self, kind: str, gamma: int | None = None) -> None:
        """Switch drafter (and γ policy) without reloading: sessions and buffers are reused."""
        if kind not in DRAFTERS:
            raise ValueError(f"unknown drafter {kind!r} (choose from {', '.join(DRAFTERS)})")
        with self._lock:
            self.config = dataclasses.replace(self.config, drafter=kind, gamma=gamma)
            if kind not in self._drafters:
                self._drafters[kind] = self._make_drafter(kind)
            self.drafter = self._drafters[kind]
            if self.config.calibrate and not calibrated(self.costs, self.drafter):
                self.calibrate()

    def calibrate(self, repeats: int = 2) -> None:
        """Seed the cost model with this device's pass times (runtime/calibration.py)."""
        eos = self.bundle.manifest.tokenizer.eos_token_ids[0]
        calibrate(self.target, self.drafter, self.costs, eos, self.config.max_gamma, repeats)

    # -- generation ------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of a raw prompt or of chat messages. Special-token strings in message content
        are always text; in a raw prompt they are control tokens unless parse_special=False."""
        if (prompt is None) == (messages is None):
            raise ValueError("pass exactly one of prompt or messages")
        if messages is not None:
            return self.tokenizer.encode_chat(messages)
        return self.tokenizer.encode(prompt, parse_special=parse_special)

    def _check_prompt(self, prompt_ids: list[int]) -> None:
        max_context = self.target.cache.max_context
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        check_token_ids(prompt_ids, self.bundle.manifest.tokenizer.n_real_tokens)
        if len(prompt_ids) >= max_context:
            raise PromptTooLongError(
                f"prompt has {len(prompt_ids)} tokens but the bundle's max context is {max_context}; "
                "shorten the prompt or re-export with a larger --max-context"
            )

    def stream(
        self, prompt_ids: list[int], config: GenerateConfig = GenerateConfig(), speculative: bool = True,
        cancel: threading.Event | None = None,
    ) -> Iterator[tuple[str, GenerationResult | None]]:
        """Yields (text piece, None) as tokens are accepted, then ("", result) once.
        speculative=False decodes plainly with the same sessions (for comparisons).
        cancel: an Event another thread may set; generation then stops after the current
        target pass and the result's stop_reason is "cancelled"."""
        self._check_prompt(prompt_ids)
        if self._owner == threading.get_ident():
            raise RuntimeError("this Engine is already generating on this thread (generate or stream inside a stream "
                               "of the same Engine would wait for itself forever); finish or close that stream first")
        with self._lock:
            self._owner = threading.get_ident()
            try:
                yield from self._stream_locked(list(prompt_ids), config, self.drafter if speculative else None, cancel)
            finally:
                self._owner = None

    def _stream_locked(self, prompt_ids: list[int], config: GenerateConfig, drafter: Drafter | None, cancel: threading.Event | None = None):
        rng = np.random.default_rng(config.sampling.seed)
        max_context = self.target.cache.max_context
        eos = self.tokenizer.eos_token_ids
        decoder = StreamDecoder(self.tokenizer)
        generated: list[int] = []
        steps: list[Step] = []
        stop_reason = None
        began = time.perf_counter()
        first_step_at = None
        policy = self.policy.start(drafter, config.max_new_tokens, GammaConfig(fixed=self.config.gamma, max_gamma=self.config.max_gamma))
        text = ""
        for step in decode_steps(self.target, drafter, prompt_ids, config.sampling, rng, policy):
            if first_step_at is None:
                first_step_at = time.perf_counter()
            steps.append(step)
            # A round may commit tokens past where plain decoding would have stopped.
            room = max_context - len(prompt_ids) - len(generated)
            kept = commit(step.tokens, len(generated), config.max_new_tokens, room, eos, text, config.stop, decoder.push)
            generated += kept.tokens
            piece, text, stop_reason = kept.piece, kept.text, kept.stop_reason
            if piece:
                yield piece, None
            if stop_reason is None and cancel is not None and cancel.is_set():
                stop_reason = "cancelled"
            if stop_reason is not None:
                break
        ended = time.perf_counter()
        yield "", self._result(text, prompt_ids, generated, stop_reason, steps, began, first_step_at, ended)

    def generate(
        self, prompt_ids: list[int], config: GenerateConfig = GenerateConfig(), speculative: bool = True,
        cancel: threading.Event | None = None,
    ) -> GenerationResult:
        result = None
        for _, result in self.stream(prompt_ids, config, speculative, cancel):
            pass
        return result

    def _result(self, text, prompt_ids, generated, stop_reason, steps: list[Step], began, first_step_at, ended) -> GenerationResult:
        first = steps[0] if steps else None
        # Prefill ends where the first round begins; the first round counts as decoding.
        prefill_s = (first_step_at - began - first.draft_s - first.target_s) if first else 0.0
        decode_s = max(ended - began - prefill_s, 1e-9)
        n_drafted = sum(s.n_drafted for s in steps)
        n_accepted = sum(s.n_accepted for s in steps)
        n_rejections = sum(1 for s in steps if s.n_accepted < s.n_drafted)
        draft_s = sum(s.draft_s for s in steps)
        target_s = sum(s.target_s for s in steps)
        stats = {
            "target_passes": len(steps),
            "drafted_tokens": n_drafted,
            "accepted_tokens": n_accepted,
            "acceptance_rate": n_accepted / n_drafted if n_drafted else None,
            # Per-token acceptance α: the MLE for runs truncated at γ, the α of E(α, γ).
            "alpha": n_accepted / (n_accepted + n_rejections) if n_drafted else None,
            "tokens_per_pass": len(generated) / len(steps) if steps else 0.0,
            "gamma_histogram": {str(k): v for k, v in sorted(Counter(s.n_drafted for s in steps).items())},  # γ as drafted
            "drafter_rounds": dict(Counter(s.drafter or "none" for s in steps)),
            "cost_ratio": {name: self.costs.cost_ratio(name) for name in self.costs.draft_step},
            "time_s": {"draft": draft_s, "target": target_s, "other": max(decode_s - draft_s - target_s, 0.0)},
        }
        timings = {
            "prefill_ms": prefill_s * 1e3,
            "decode_s": decode_s,
            "decode_tokens_per_s": len(generated) / decode_s,
        }
        rounds = tuple((s.n_drafted, s.n_accepted) for s in steps)
        return GenerationResult(text, list(prompt_ids), generated, stop_reason or "length", timings, stats, rounds, tuple(steps))


__all__ = ["Engine", "EngineConfig", "GenerateConfig", "GenerationResult", "BundleError", "PromptTooLongError"]
