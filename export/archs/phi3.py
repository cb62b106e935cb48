"""Phi-3 / Phi-4-mini: fused qkv_proj and gate_up_proj, optional sliding window on every layer,
long-RoPE scaling exact up to original_max_position_embeddings (the short factors)."""

from export.archs import ArchSpec, UnsupportedArchitecture, rope_type, register


def _windows(config) -> tuple[int, ...]:
    return (int(config.sliding_window or 0),) * config.num_hidden_layers


def _max_context(config) -> int | None:
    # Past original_max_position_embeddings transformers swaps the short factors for the long ones
    # for the whole sequence, a switch on the sequence length the static tables do not make.
    if rope_type(config) == "longrope":
        params = getattr(config, "rope_parameters", None) or {}
        return int(params.get("original_max_position_embeddings") or config.original_max_position_embeddings)
    return None


def _check(config) -> None:
    if getattr(config, "attention_bias", False):
        raise UnsupportedArchitecture("phi3: attention_bias=True is not supported")


SPEC = register(ArchSpec("phi3", _check, rope_types=("default", "longrope"), fused_qkv=True, windows=_windows, max_context=_max_context))
