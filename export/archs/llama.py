"""Llama (Llama 2/3.x, SmolLM2): GQA, optional llama3 rope scaling, optionally tied embeddings."""

from export.archs import ArchSpec, UnsupportedArchitecture, register


def _check(config) -> None:
    if getattr(config, "mlp_bias", False):
        raise UnsupportedArchitecture("llama: mlp_bias=True is not supported")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise UnsupportedArchitecture(f"llama: activation {config.hidden_act!r} is not supported")


SPEC = register(ArchSpec("llama", _check, rope_types=("default", "llama3")))
