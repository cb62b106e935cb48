"""ONNX Runtime sessions: provider choice and session options, one session per stage graph."""

from __future__ import annotations

import os
from dataclasses import dataclass

import onnxruntime as ort

# What each --provider value means, and the package that brings it.
PROVIDERS = {
    "cpu": ("CPUExecutionProvider", "onnxruntime"),
    "cuda": ("CUDAExecutionProvider", "onnxruntime-gpu in place of onnxruntime"),
    "dml": ("DmlExecutionProvider", "onnxruntime-directml in place of onnxruntime, on Windows"),
    "coreml": ("CoreMLExecutionProvider", "onnxruntime on macOS"),
}
AUTO_ORDER = ("cuda", "dml", "coreml", "cpu")


class ProviderError(Exception):
    pass


@dataclass(frozen=True)
class SessionConfig:
    provider: str = "auto"
    threads: int = 0  # 0: one per physical core, as ONNX Runtime chooses by default
    allow_fallback: bool = False


def resolve_provider(name: str, allow_fallback: bool = False) -> str:
    """Map a --provider value to an available ONNX Runtime provider, or say what is missing."""
    available = ort.get_available_providers()
    if name == "auto":
        for key in AUTO_ORDER:
            if PROVIDERS[key][0] in available:
                return key
    if name not in PROVIDERS:
        raise ProviderError(f"unknown provider {name!r} (auto, {', '.join(PROVIDERS)})")
    if PROVIDERS[name][0] in available:
        return name
    if allow_fallback:
        return "cpu"
    raise ProviderError(
        f"provider {name!r} ({PROVIDERS[name][0]}) is not available in this onnxruntime build "
        f"(available: {', '.join(available)}); install {PROVIDERS[name][1]}, or pass --allow-fallback"
    )


def make_session(path, provider: str, config: SessionConfig) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.log_severity_level = 3
    if config.threads:
        options.intra_op_num_threads = config.threads
    # Stages and roles run one after another on the same cores: a pool that spins after its
    # run steals them from the next session (measured 7.7 -> 12.6 tok/s, Qwen 1.5B int4, 2 cores).
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    # Static KV: inputs keep their shapes, so ORT's memory-pattern planner helps on CPU.
    options.enable_mem_pattern = provider != "dml"
    providers = [PROVIDERS[provider][0]]
    if provider != "cpu":
        providers.append("CPUExecutionProvider")
    try:
        return ort.InferenceSession(os.fspath(path), sess_options=options, providers=providers)
    except Exception as exc:  # ORT raises its own pybind types; name the file and the cause
        from edge_spec.manifest import BundleError

        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BundleError(f"ONNX Runtime cannot load {path}: {first_line}") from None
