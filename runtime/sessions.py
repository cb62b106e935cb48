"""ONNX Runtime sessions: provider choice and session options, one session per stage graph.

Providers are chosen per role group: the target (and the layer-skip draft, which runs the
target's own sessions) on one, the draft model on another (`--draft-provider`), because the
best place for a small draft is not always the target's.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import asdict, dataclass
from typing import NamedTuple

try:
    import onnxruntime as ort
except ImportError as exc:
    if exc.name != "onnxruntime":  # installed but broken (a missing shared library): keep ORT's own message
        raise
    raise ImportError(
        "edge-spec's runtime needs ONNX Runtime and no onnxruntime package is installed; install exactly one: "
        'pip install "edge-spec[cpu]" (onnxruntime: CPU everywhere, Core ML on macOS), '
        'pip install "edge-spec[cuda]" (onnxruntime-gpu: NVIDIA GPUs, Linux and Windows), or '
        'pip install "edge-spec[directml]" (onnxruntime-directml: DirectX 12 GPUs, Windows)'
    ) from None


@dataclass(frozen=True)
class Provider:
    key: str  # the --provider value
    ort_name: str  # ONNX Runtime's execution provider name
    install: str  # what brings it, for the error when it is missing
    device_type: str  # where its inputs and outputs live: an OrtValue device_type


PROVIDERS = {
    "cpu": Provider("cpu", "CPUExecutionProvider", 'onnxruntime (pip install "edge-spec[cpu]")', "cpu"),
    "cuda": Provider(
        "cuda", "CUDAExecutionProvider",
        'onnxruntime-gpu in place of onnxruntime (pip uninstall onnxruntime, then pip install "edge-spec[cuda]"; '
        "it needs the CUDA and cuDNN versions its release names)",
        "cuda",
    ),
    "dml": Provider(
        "dml", "DmlExecutionProvider",
        'onnxruntime-directml in place of onnxruntime, on Windows (pip uninstall onnxruntime, then pip install "edge-spec[directml]")',
        "dml",
    ),
    # The Core ML EP reads and writes CPU memory: Core ML moves data to the GPU/ANE itself.
    "coreml": Provider(
        "coreml", "CoreMLExecutionProvider",
        'onnxruntime on macOS, whose wheels include the Core ML EP (pip install "edge-spec[cpu]" on a Mac)',
        "cpu",
    ),
}
# auto: a discrete NVIDIA GPU first, then any DirectX 12 GPU (Windows), then Core ML (Apple
# GPU/Neural Engine), then the CPU, which every build has.
AUTO_ORDER = ("cuda", "dml", "coreml", "cpu")
COREML_COMPUTE_UNITS = ("ALL", "CPUAndNeuralEngine", "CPUAndGPU", "CPUOnly")
# Providers whose sessions run with CPU fallback disabled (session.disable_cpu_ep_fallback).
NO_CPU_FALLBACK = ("cuda", "dml")
# Distributions that install the `onnxruntime` module; only one may be installed at a time.
ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu", "onnxruntime-directml", "onnxruntime-openvino", "onnxruntime-qnn")
# What brings a provider's shared libraries, for the line naming the one that failed to load.
LIBRARY_HINT = {
    "cuda": 'onnxruntime-gpu 1.31.1 loads the CUDA 13 and cuDNN 9 libraries: pip install "edge-spec[cuda]" brings them '
            "(its cuda and cudnn extras), or put them on the library path",
}
# A shared library the loader could not open, in ONNX Runtime's message or preload_dlls' report.
_MISSING_LIBRARY = (
    re.compile(r"([\w.+-]+\.so[.\d]*): cannot open shared object file"),
    re.compile(r"Failed to load (?:\S*[/\\])?([\w.+-]+\.(?:so[.\d]*|dll))"),
)
_PRELOADED: dict[str, str] = {}  # provider -> the first library its preload could not load ("" if none)


class ProviderError(Exception):
    pass


@dataclass(frozen=True)
class SessionConfig:
    provider: str = "auto"
    threads: int = 0  # 0: one per physical core, as ONNX Runtime chooses by default
    allow_fallback: bool = False
    device_id: int = 0  # CUDA / DirectML adapter index
    coreml_compute_units: str = "ALL"
    # RequireStaticInputShapes: the block (T) and logit (N) axes of bundle graphs are dynamic,
    # so with it the Core ML EP takes only the nodes whose inputs are all static (few).
    coreml_static_shapes: bool = False
    profile_prefix: str | None = None  # ONNX Runtime profiling on, files named PREFIX_<date>.json
    # CPU sessions take their activations from one arena of the process instead of one each:
    # the stages of a split target run in turn, so they need one stage's peak, not the sum
    # (edge_spec.budget.one_arena says when; benchmarks/notes/2026-12-06-one-arena.md).
    shared_arena: bool = False


    def __post_init__(self):
        if self.device_id < 0:
            raise ValueError(f"device id must be 0 or more, got {self.device_id}")
        if self.coreml_compute_units not in COREML_COMPUTE_UNITS:
            raise ValueError(
                f"unknown Core ML compute units {self.coreml_compute_units!r} (choose from {', '.join(COREML_COMPUTE_UNITS)})"
            )


@dataclass(frozen=True)
class ProviderChoice:
    """What a role group runs on, what was asked for, and why they differ."""

    provider: str  # the key that runs: cpu | cuda | dml | coreml
    requested: str  # auto or a key
    available: tuple[str, ...]  # ONNX Runtime provider names this build lists
    fallback_from: str | None = None  # the key that could not be used
    reason: str = ""  # why it could not

    def describe(self) -> str:
        if self.fallback_from:
            how = f"fell back from {self.fallback_from}: {self.reason}"
        elif self.requested == "auto":
            how = "auto"
        else:
            how = "requested"
        return f"{self.provider} ({how}; available: {', '.join(self.available)})"

    def to_dict(self) -> dict:
        return {**asdict(self), "available": list(self.available)}


class Device(NamedTuple):
    """Where a provider's inputs live, as OrtValue.ortvalue_from_numpy(array, type, id) and
    IOBinding.bind_output(name, type, id) take it: KV kept there needs no copy per pass."""

    type: str  # cpu | cuda | dml
    id: int


def installed_runtimes() -> list[str]:
    """The ONNX Runtime distributions installed, as 'name version'."""
    from importlib import metadata

    found = []
    for name in ORT_DISTRIBUTIONS:
        try:
            found.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            pass
    return found


def _installed_note() -> str:
    found = installed_runtimes()
    note = f"installed: {', '.join(found) or 'no onnxruntime distribution found'}"
    if len(found) > 1:
        note += " (these overwrite each other's onnxruntime module: uninstall all of them, then install one)"
    return note


def resolve_provider(name: str, allow_fallback: bool = False) -> ProviderChoice:
    """Map a --provider value to an available ONNX Runtime provider, or say what is missing."""
    available = tuple(ort.get_available_providers())
    if name == "auto":
        key = next(key for key in AUTO_ORDER if PROVIDERS[key].ort_name in available or key == "cpu")
        return ProviderChoice(key, "auto", available)
    if name not in PROVIDERS:
        raise ProviderError(f"unknown provider {name!r} (auto, {', '.join(PROVIDERS)})")
    spec = PROVIDERS[name]
    if spec.ort_name in available:
        return ProviderChoice(name, name, available)
    if allow_fallback:
        return ProviderChoice("cpu", name, available, name, f"{spec.ort_name} is not in this ONNX Runtime build")
    raise ProviderError(
        f"provider {name!r} ({spec.ort_name}) is not available in this ONNX Runtime build "
        f"({_installed_note()}; available: {', '.join(available)}); install {spec.install}, "
        "or pass --allow-fallback to run on the CPU"
    )


def provider_options(provider: str, config: SessionConfig) -> dict[str, str]:
    """The options each execution provider's documentation asks for, as ORT's strings."""
    if provider in ("cuda", "dml"):
        return {"device_id": str(config.device_id)}
    if provider == "coreml":
        return {
            # ML Program: the newer Core ML format, with more operators and fp32 compute; the
            # older NeuralNetwork format is the EP's default.
            "ModelFormat": "MLProgram",
            "MLComputeUnits": config.coreml_compute_units,
            "RequireStaticInputShapes": "1" if config.coreml_static_shapes else "0",
        }
    return {}


_CPU_ARENA: list = []  # the shared arena's OrtMemoryInfo, registered once per process


def _shared_cpu_arena() -> None:
    if not _CPU_ARENA:
        info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
        ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, -1, -1, -1))  # ORT's defaults
        _CPU_ARENA.append(info)


def session_options(provider: str, config: SessionConfig) -> ort.SessionOptions:
    options = ort.SessionOptions()
    if provider == "cpu" and config.shared_arena:
        _shared_cpu_arena()
        options.add_session_config_entry("session.use_env_allocators", "1")
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    # DirectML requires sequential execution; it is ORT's default for the other providers too.
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if config.threads:
        options.intra_op_num_threads = config.threads
    # Each session owns a pool, and stages and roles run one after another on the same cores.
    # Spinning inside a run wakes the workers fast for each of a pass's parallel kernels;
    # stopping it when the run returns keeps a pool from stealing the cores from the next
    # session (measured: benchmarks/notes/2026-11-30-performance-push.md, the two spinning rows).
    options.add_session_config_entry("session.intra_op.allow_spinning", "1")
    options.add_session_config_entry("session.force_spinning_stop", "1")
    # Static KV: inputs keep their shapes, so ORT's memory-pattern planner helps on CPU; the
    # DirectML EP does not support memory patterns and fails session creation with them on.
    options.enable_mem_pattern = provider != "dml"
    if config.profile_prefix:
        options.enable_profiling = True
        options.profile_file_prefix = config.profile_prefix
    if provider in NO_CPU_FALLBACK:
        # A node without a GPU kernel fails session creation instead of running on the CPU,
        # where it would copy its inputs (a layer's KV cache, for attention) over the bus.
        options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
    return options


def missing_library(text: str) -> str:
    """The first shared library `text` says could not be loaded, or ""."""
    for pattern in _MISSING_LIBRARY:
        found = pattern.search(text)
        if found:
            return found.group(1)
    return ""


def preload_libraries(provider: str) -> str:
    """Before the first CUDA session, load the CUDA and cuDNN libraries from the nvidia-* wheels
    (onnxruntime-gpu's cuda and cudnn extras) or a compatible torch: onnxruntime's own
    preload_dlls(), where the build has it (NVIDIA's Jetson builds rely on the system's). It
    reports failures with print(), kept off stdout (generate --json writes there) and returned:
    the first library it could not load, or ""."""
    if provider != "cuda" or not hasattr(ort, "preload_dlls"):
        return ""
    if provider not in _PRELOADED:
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            try:
                ort.preload_dlls()
            except Exception as exc:  # a broken nvidia-* install: name it when the provider fails
                print(f"preload_dlls: {exc}")
        _PRELOADED[provider] = missing_library(printed.getvalue())
    return _PRELOADED[provider]


def _start_failure(provider: str, exc: BaseException) -> str:
    """Why an execution provider did not start, in one line, naming the shared library it could
    not load where ONNX Runtime's message or the CUDA preload names one."""
    ort_name = PROVIDERS[provider].ort_name
    library = missing_library(str(exc)) or _PRELOADED.get(provider, "")
    if library:
        hint = f" ({LIBRARY_HINT[provider]})" if provider in LIBRARY_HINT else ""
        return f"{ort_name} failed to start: cannot load {library}{hint}"
    return f"{ort_name} failed to start ({_first_line(exc)})"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _create(path, provider: str, config: SessionConfig) -> ort.InferenceSession:
    preload_libraries(provider)
    providers, options = [PROVIDERS[provider].ort_name], [provider_options(provider, config)]
    # Core ML hands what it cannot take to the CPU by design; on GPUs the CPU EP must not be
    # listed at all: ORT refuses disable_cpu_ep_fallback beside an explicit CPU EP.
    if provider not in ("cpu", *NO_CPU_FALLBACK):
        providers.append("CPUExecutionProvider")
        options.append({})
    # enable_fallback=0: ORT's own fallback prints to stdout and retries silently; fallback is
    # decided here, where --allow-fallback is known and the choice is reported.
    options_for_file = session_options(provider, config)
    if config.profile_prefix:  # one trace per graph: ORT names its files by the second they start
        options_for_file.profile_file_prefix = f"{config.profile_prefix}-{os.path.basename(os.fspath(path))}"
    return ort.InferenceSession(
        os.fspath(path), sess_options=options_for_file, providers=providers,
        provider_options=options, enable_fallback=0,
    )


def open_session(path, provider: str, config: SessionConfig) -> tuple[ort.InferenceSession, str | None]:
    """Open one stage graph on `provider`; returns the session and, when the provider's EP
    failed to start and config.allow_fallback let the CPU take over, the reason."""
    from edge_spec.manifest import BundleError

    try:
        session = _create(path, provider, config)
    except Exception as exc:  # ORT raises its own pybind types; name the file and the cause
        if provider == "cpu":
            raise BundleError(f"ONNX Runtime cannot load {path}: {_first_line(exc)}") from None
        reason = _start_failure(provider, exc)
        try:  # if the CPU loads the file, the provider failed, not the bundle
            session = _create(path, "cpu", config)
        except Exception as cpu_exc:
            raise BundleError(f"ONNX Runtime cannot load {path}: {_first_line(cpu_exc)}") from None
    else:
        if session.get_providers()[0] == PROVIDERS[provider].ort_name:
            return session, None
        reason = f"{PROVIDERS[provider].ort_name} did not register"  # the session runs on the CPU alone
    if config.allow_fallback:
        return session, reason
    raise ProviderError(
        f"provider {provider!r}: {reason} for {os.path.basename(os.fspath(path))} ({_installed_note()}); "
        "check the requirements ONNX Runtime lists for this provider, or pass --allow-fallback to run on the CPU"
    )


def ort_device(provider: str, device_id: int = 0) -> Device:
    """The device a provider's tensors live on, for OrtValue buffers and I/O binding."""
    device_type = PROVIDERS[provider].device_type
    return Device(device_type, device_id if device_type != "cpu" else 0)


def session_provider(session) -> str:
    """The --provider key of the first execution provider a session registered."""
    first = session.get_providers()[0]
    return next((key for key, spec in PROVIDERS.items() if spec.ort_name == first), "cpu")


def session_device(session) -> Device:
    """Where a session's main provider wants inputs: its type and, for GPUs, the device id
    the session was created with."""
    provider = session_provider(session)
    options = session.get_provider_options().get(PROVIDERS[provider].ort_name, {})
    return ort_device(provider, int(options.get("device_id", 0)))


def kv_device(stages, sessions) -> Device | None:
    """Where a role's KV buffers should live: on the GPU when every stage that has layers is a
    fused graph on one CUDA or DirectML session device (written in place there, never copied
    to the host); else in host memory (None), which the CPU reads directly and portable graphs
    need for row copies."""
    layered = [(stage, session) for stage, session in zip(stages, sessions) if stage.layers]
    if not all(stage.attention == "fused" and hasattr(session, "io_binding") for stage, session in layered):
        return None  # portable graphs or Core ML packages: host buffers
    devices = {session_device(session) for _, session in layered}
    if len(devices) == 1:
        (device,) = devices
        if device.type in ("cuda", "dml"):
            return device
    return None

