"""Qwen3: Llama's layout without q/k/v biases, plus a per-head RMS norm of q and k before rotary."""

from export.archs import ArchSpec, UnsupportedArchitecture, register


def _windows(config) -> tuple[int, ...]:
    types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
    return tuple(int(config.sliding_window) if t == "sliding_attention" and config.sliding_window else 0 for t in types)


def _check(config) -> None:
    if getattr(config, "attention_bias", False):
        raise UnsupportedArchitecture("qwen3: attention_bias=True is not supported")


SPEC = register(ArchSpec("qwen3", _check, rope_types=("default",), qk_norm=True, windows=_windows))
