"""Architectures the exporter accepts, keyed by Hugging Face `model_type`: one module per family.

Each module registers an `ArchSpec` saying how its family differs from the Llama layout; the one
forward pass (export.static_cache.StageModule) and the Core ML wrapper (export.coreml) read only
the spec, never the model_type. Anything not registered is refused by name before weights load.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


class UnsupportedArchitecture(Exception):
    pass


def _no_windows(config) -> tuple[int, ...]:
    return (0,) * config.num_hidden_layers


def _one_rope(config) -> tuple[str, ...]:
    return ("default",) * config.num_hidden_layers


def _rope_table(inner, kind: str):
    """(inv_freq [D/2], attention_scaling) of a model with one rotary embedding."""
    rotary = inner.rotary_emb
    return rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0))


def _head_dim_scale(config) -> float:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return head_dim**-0.5


def _no_cap(config) -> float | None:
    return None


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    check: Callable[[object], None]  # raises UnsupportedArchitecture for configs it cannot export
    rope_types: tuple[str, ...]  # rope_type values whose inv_freq the static graph reproduces
    activation_key: str = "hidden_act"  # config field naming the MLP activation (the HF MLP module applies it)
    activations: tuple[str, ...] = ("silu",)
    norm_offset: float = 0.0  # RMS norms scale by (norm_offset + weight): Gemma stores weight - 1
    qk_norm: bool = False  # per-head RMS norm of q and k before rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms on the attention and MLP outputs too (Gemma 3's four per layer)
    fused_qkv: bool = False  # one qkv_proj Linear, split into q, k, v (Phi-3)
    windows: Callable[[object], tuple[int, ...]] = _no_windows  # per layer: attend to the last W positions, 0 = all
    rope_kinds: Callable[[object], tuple[str, ...]] = _one_rope  # per layer: which rotary table it uses
    rope_table: Callable[[object, str], tuple] = _rope_table  # (inner model, kind) -> (inv_freq, scaling)
    attention_scale: Callable[[object], float] = _head_dim_scale
    logit_softcap: Callable[[object], float | None] = _no_cap  # logits = cap * tanh(logits / cap)
    max_context: Callable[[object], int | None] = lambda config: None  # longest context the static rotary tables are exact for


REGISTRY: dict[str, ArchSpec] = {}


def register(spec: ArchSpec) -> ArchSpec:
    REGISTRY[spec.model_type] = spec
    return spec


def rope_type(config) -> str:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        kinds = {p.get("rope_type", p.get("type", "default")) for p in params.values()}
        return ",".join(sorted(kinds))
    return params.get("rope_type", params.get("type", "default"))


def check_common(config, spec: ArchSpec) -> None:
    name = spec.model_type
    activation = getattr(config, spec.activation_key, spec.activations[0])
    if activation not in spec.activations:
        raise UnsupportedArchitecture(f"{name}: activation {activation!r} is not supported ({', '.join(spec.activations)})")
    params = getattr(config, "rope_parameters", None) or {}
    for p in params.values() if params and all(isinstance(v, dict) for v in params.values()) else [params]:
        if float((p or {}).get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedArchitecture(f"{name}: partial rotary (partial_rotary_factor {p['partial_rotary_factor']}) is not supported")
    if getattr(config, "mlp_bias", False):
        raise UnsupportedArchitecture(f"{name}: mlp_bias=True is not supported")


def arch_for(config) -> ArchSpec:
    model_type = getattr(config, "model_type", None)
    spec = REGISTRY.get(model_type)
    if spec is None:
        raise UnsupportedArchitecture(
            f"architecture {model_type!r} is not supported (supported: {', '.join(sorted(REGISTRY))})"
        )
    for kind in rope_type(config).split(","):
        if kind not in spec.rope_types:
            raise UnsupportedArchitecture(f"{model_type}: rope type {kind!r} is not supported ({spec.rope_types})")
    check_common(config, spec)
    spec.check(config)
    return spec


def check_context(config, max_context: int) -> None:
    """Refuse a --max-context the architecture's static rotary tables are not exact for."""
    spec = arch_for(config)
    limit = spec.max_context(config)
    if limit is not None and max_context > limit:
        raise UnsupportedArchitecture(
            f"{spec.model_type}: --max-context {max_context} is past {limit}, where {rope_type(config)} rotary switches "
            f"to other frequencies the static graph does not build; pass --max-context {limit} or less"
        )


from export.archs import gemma3, llama, mistral, phi3, qwen2, qwen3  # noqa: E402,F401  (registers the built-in architectures)
