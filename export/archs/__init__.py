"""Architectures the exporter accepts, keyed by Hugging Face `model_type`.

Each module registers an `ArchSpec`; anything not registered is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class UnsupportedArchitecture(Exception):
    pass


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    check: Callable[[object], None]  # raises UnsupportedArchitecture for configs it cannot export
    rope_types: tuple[str, ...]  # rope_type values whose inv_freq the static graph reproduces


REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    REGISTRY[spec.model_type] = spec
    return spec


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return params.get("rope_type", params.get("type", "default"))


def arch_for(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    spec = REGISTRY.get(model_type)
    if spec is None:
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported (supported: {', '.join(sorted(REGISTRY))})"
        )
    kind = rope_type(config)
    if kind not in spec.rope_types:
        raise UnsupportedArchitecture(f"{model_type}: rope type {kind!r} is not supported ({spec.rope_types})")
    spec.check(config)
    return spec


from export.archs import llama, qwen2  # noqa: E402,F401  (registers the built-in architectures)
