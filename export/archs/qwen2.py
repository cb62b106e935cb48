"""Qwen2 / Qwen2.5: Llama's layout plus q/k/v biases (carried by the Linear modules)."""

from export.archs import ArchSpec, UnsupportedArchitecture, register


def _check(config) -> None:
    # Qwen2's windowed layers (max_window_layers) are not verified against a checkpoint here.
    if getattr(config, "use_sliding_window", False):
        raise UnsupportedArchitecture("qwen2: use_sliding_window=True is not supported")


SPEC = register(ArchSpec("qwen2", _check, rope_types=("default",)))
