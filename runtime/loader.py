"""Loading a bundle for the Engine: the bundle opened and checked, providers resolved and the
graphs' placement checked, one session per stage graph, KV buffers, runners and drafters.

Providers are per role group: "target" (the target and the layer-skip draft, which share its
sessions) and "draft" (the draft model).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from dataclasses import dataclass
from typing import Callable

from edge_spec.budget import one_arena, plan_bundle
from edge_spec.drafters import DrafterSpec, drafter_spec
from edge_spec.manifest import BundleError, check_declared_io, check_sha256, load_head_tokens
from edge_spec.params import shown
from edge_spec.placement import check_bundle
from edge_spec.profiles import load_verdict
from runtime.bundle import open_bundle
from runtime.drafters import BUILDERS, ROLE_BUILDERS, Build
from runtime.drafters.base import Drafter
from runtime.kv_cache import KVCache
from runtime.model import ModelRunner
from runtime.sessions import NO_CPU_FALLBACK, ProviderChoice, SessionConfig, kv_device, open_session, ort, resolve_provider
from runtime.tokenizer import BundleTokenizer

@dataclass(frozen=True)
class LoadConfig:
    """What loading a bundle reads: where each role group runs, which drafter to load (and plan
    for), what to trust and check, and the memory budget. runtime.engine.EngineConfig adds the
    γ policy's settings to it."""

    provider: str = "auto"
    draft_provider: str | None = None  # None: same as provider
    device_id: int = 0  # CUDA / DirectML adapter, for every role on a GPU provider
    coreml_compute_units: str = "ALL"  # ALL | CPUAndNeuralEngine | CPUAndGPU | CPUOnly
    coreml_static_shapes: bool = False
    threads: int = 0
    drafter: str = "auto"  # auto: copy when the text repeats, else the bundle's default draft
    max_gamma: int = 8  # verify blocks take max_gamma + 1 tokens (the memory plan counts them)
    allow_fallback: bool = False
    check_hashes: bool = True
    # The bundle digest (SHA-256 of manifest.json) its user trusts: any other bundle, or an edited
    # manifest or chat template, is refused at load. None: the bundle is trusted as it is.
    bundle_sha256: str | None = None
    memory_budget: int | None = None  # bytes: refuse, before loading, a plan (edge_spec.budget) that exceeds it
    profile_prefix: str | None = None  # ONNX Runtime profiling into files with this prefix (which provider ran each node)
    # Every target pass scores at least 2 positions, so no logit depends on whether its token
    # was drafted: greedy output is the same for every drafter and γ (measured at int8 and int4)
    # (runtime/model.py; the cost is in BENCHMARKS.md).
    block_stable: bool = False
    # Tokens of earlier sequences the suffix drafters (suffix, auto+suffix) keep to copy from.
    suffix_cache_tokens: int = 1 << 16  # about 20 MB of index at most (docs/decoding.md: suffix cache)

    def __post_init__(self):
        for name in ("threads", "device_id"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {shown(value)}")
        if self.suffix_cache_tokens < 1:
            raise ValueError(f"suffix_cache_tokens must be at least 1, got {self.suffix_cache_tokens}")
        if self.bundle_sha256 is not None:
            object.__setattr__(self, "bundle_sha256", check_sha256(self.bundle_sha256))
            if not self.check_hashes:
                raise ValueError("bundle_sha256 needs check_hashes=True: the digest covers the other files through their hashes")


class Loader:
    """Opens what it can check before any session exists (bundle, memory plan, providers,
    placement, tokenizer); sessions, caches and runners come on demand and are shared."""

    def __init__(self, bundle_path: str | Path, config: LoadConfig, session_hook: Callable[[str, object], object] | None = None):
        """session_hook: for measurement tools (benchmarks/bench/timing.py), None in the product.
        Called once per stage session as it opens, with the stage key and the session (an ONNX
        Runtime InferenceSession or a Core ML stand-in); what it returns runs in its place and
        must answer everything the session does (run, run_with_iobinding, io_binding,
        get_inputs, ...), typically by forwarding to it."""
        drafter_spec(config.drafter)  # an unknown name fails before the bundle is opened
        self.config = config
        self.session_hook = session_hook
        self.bundle = open_bundle(bundle_path, check_hashes=config.check_hashes, expected_sha256=config.bundle_sha256)
        manifest = self.bundle.manifest
        if config.memory_budget is not None:
            plan_bundle(manifest, self.bundle.path, config.drafter, config.memory_budget, config.max_gamma).check()
        self.provider_choices: dict[str, ProviderChoice] = {
            "target": resolve_provider(config.provider, config.allow_fallback),
            "draft": resolve_provider(config.draft_provider or config.provider, config.allow_fallback),
        }
        self.session_config(self.provider_choices["target"])  # bad provider options fail before loading
        self.warnings = self._check_placement()
        self.tokenizer = BundleTokenizer(self.bundle.file(manifest.tokenizer.file), manifest.tokenizer)
        self.sessions: dict[str, object] = {}  # by stage key
        self.caches: dict[str, KVCache] = {}  # by the role that owns the rows

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
                # The installed release: NVIDIA's Jetson builds lag the wheel the kernel tables were read from.
                report = check_bundle(dataclasses.replace(manifest, stages=stages), self.bundle.path, provider, ort.__version__)
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

    def session_config(self, choice: ProviderChoice) -> SessionConfig:
        c = self.config
        # auto means the best provider that works: one that fails to start gives way to the CPU.
        allow_fallback = c.allow_fallback or choice.requested == "auto"
        return SessionConfig(choice.provider, c.threads, allow_fallback, c.device_id, c.coreml_compute_units, c.coreml_static_shapes,
                             c.profile_prefix, one_arena(self.bundle.manifest))

    def _runs_coreml_package(self, key: str, stage, group: str) -> bool:
        """A stage runs its Core ML package when the bundle has no ONNX graph for it, or when the
        role group's provider is coreml and the bundle ships a package (the Neural Engine path)."""
        if key not in self.bundle.manifest.coreml:
            return False
        return not stage.file or self.provider_choices[group].provider == "coreml"

    def _open_session(self, key: str, stage, group: str, arch, logit_rows: int | None = None):
        """One stage's session, wrapped by the session hook if there is one."""
        session = self._open_stage(key, stage, group, arch, logit_rows)
        return session if self.session_hook is None else self.session_hook(key, session)

    def _open_stage(self, key: str, stage, group: str, arch, logit_rows: int | None):
        """Its Core ML package, or an ONNX Runtime session on the group's provider checked against
        the manifest (arch: the facts of the role owning the KV; logit_rows: a trimmed head's)."""
        manifest = self.bundle.manifest
        if self._runs_coreml_package(key, stage, group):
            from runtime.coreml_backend import load_session

            package = manifest.coreml[key]
            return load_session(self.bundle.file(package.file), stage, package, self.config.coreml_compute_units)
        choice = self.provider_choices[group]
        session, reason = open_session(self.bundle.file(stage.file), choice.provider, self.session_config(choice))
        if hasattr(session, "get_inputs"):  # the manifest's facts against what the graph declares
            check_declared_io(arch, key, stage, [(v.name, v.type, v.shape) for v in (*session.get_inputs(), *session.get_outputs())], logit_rows)
        if reason:  # later stages of the group go straight to the CPU
            self.provider_choices[group] = dataclasses.replace(choice, provider="cpu", fallback_from=choice.provider, reason=reason)
        return session

    def runner(self, role: str, group: str = "target") -> ModelRunner:
        manifest = self.bundle.manifest
        self.bundle.require_role(role)
        info = manifest.models[role]
        owner = info.shares_kv_with or role
        stages = [manifest.stages[key] for key in info.stages]
        rows = info.logit_rows if info.trimmed_head is not None else None
        for key, stage in zip(info.stages, stages):
            if key not in self.sessions:
                self.sessions[key] = self._open_session(key, stage, group, manifest.models[owner].arch, rows if stage.head else None)
        if owner not in self.caches:
            arch = manifest.models[owner].arch
            owner_stages = [manifest.stages[key] for key in manifest.models[owner].stages]
            device = kv_device(owner_stages, [self.sessions[key] for key in manifest.models[owner].stages])
            self.caches[owner] = KVCache(range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, arch.kv_dtype, device)
        min_rows = 2 if self.config.block_stable and role == "target" else 1
        head_tokens = load_head_tokens(self.bundle.path, manifest, role) if info.trimmed_head is not None else None
        return ModelRunner(role, info, stages, [self.sessions[key] for key in info.stages], self.caches[owner], min_rows, head_tokens)

    def drafter(self, kind: str) -> Drafter | None:
        """The drafter `kind` names (edge_spec/drafters.py), built by its BUILDERS entry over this
        loader's runners."""
        spec = drafter_spec(kind)
        return BUILDERS[kind](Build(lambda: self._model_drafter(spec), self.config.suffix_cache_tokens))

    def _model_drafter(self, spec: DrafterSpec) -> Drafter | None:
        role = spec.draft_role(self.bundle.manifest.default_draft)
        if role is None:
            return None
        self.bundle.require_role(role)
        return ROLE_BUILDERS[role](self.runner)

