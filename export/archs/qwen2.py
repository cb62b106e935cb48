"""Qwen2 / Qwen2.5: Llama's layout plus q/k/v biases (carried by the Linear modules)."""

from export.archs import ArchSpec, UnsupportedArchitecture, register


def _check(config) -> None:
    # Sliding-window layers would need a banded mask the static graph does not build.
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedArchitecture("qwen2: use_sliding_window=True is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(f"qwen2: activation {config.hidden_act!r} is not supported")


SPEC = register(ArchSpec("qwen2", _check, rope_types=("default",)))
