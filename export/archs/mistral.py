"""Mistral: Llama's layout with an explicit head_dim and, when set, one sliding window on every layer."""

from export.archs import ArchSpec, register


def _windows(config) -> tuple[int, ...]:
    return (int(config.sliding_window or 0),) * config.num_hidden_layers


def _check(config) -> None:
    pass


SPEC = register(ArchSpec("mistral", _check, rope_types=("default",), windows=_windows))
