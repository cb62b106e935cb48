"""Llama (Llama 2/3.x, SmolLM2): GQA, optional llama3 rope scaling, optionally tied embeddings."""

from export.archs import ArchSpec, register


def _check(config) -> None:
    pass  # activation, mlp_bias and partial rotary are checked for every family


SPEC = register(ArchSpec("llama", _check, rope_types=("default", "llama3")))
