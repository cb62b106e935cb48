"""Known models: short aliases, their hub ids, official GGUF files, and default drafts."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CatalogEntry:
    alias: str
    hub_id: str
    gguf_file: str | None  # official GGUF looked for in the models folder, so no hub is needed
    default_draft: str | None  # an alias of a same-tokenizer model, a layer-skip spec, or None


CATALOG = {
    entry.alias: entry
    for entry in (
        CatalogEntry("llama-3.2-3b", "meta-llama/Llama-3.2-3B-Instruct", "Llama-3.2-3B-Instruct-Q4_K_M.gguf", "llama-3.2-1b"),
        CatalogEntry("llama-3.2-1b", "meta-llama/Llama-3.2-1B-Instruct", "Llama-3.2-1B-Instruct-Q4_K_M.gguf", None),
        CatalogEntry(
            "qwen2.5-coder-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            "qwen2.5-coder-0.5b",
        ),
        CatalogEntry("qwen2.5-coder-0.5b", "Qwen/Qwen2.5-Coder-0.5B-Instruct", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", None),
        CatalogEntry("gemma-3-270m", "google/gemma-3-270m", "gemma-3-270m-q4_k_m.gguf", None),  # base model: raw prompts
        CatalogEntry("smollm2-135m", "HuggingFaceTB/SmolLM2-135M-Instruct", "SmolLM2-135M-Instruct.Q4_1.gguf", None),
        # Meta's LayerSkip checkpoints (gated, FAIR noncommercial licence; no official GGUF), trained with
        # layer dropout and an early-exit loss so that a prefix of layers agrees with the whole: their
        # default draft is that prefix. Exit layers as published: 4 for the 1B (transformers' docs), 8 for
        # the 7-8B ones (the LayerSkip repository's self-speculation examples); not measured here.
        CatalogEntry("layerskip-llama3.2-1b", "facebook/layerskip-llama3.2-1B", None, "layer-skip:4"),
        CatalogEntry("layerskip-llama3-8b", "facebook/layerskip-llama3-8B", None, "layer-skip:8"),
        CatalogEntry("layerskip-llama2-7b", "facebook/layerskip-llama2-7B", None, "layer-skip:8"),
        CatalogEntry("layerskip-codellama-7b", "facebook/layerskip-codellama-7B", None, "layer-skip:8"),
    )
}


def models_dir() -> Path:
    """Where official GGUF files are looked for: $EDGE_SPEC_MODELS, else ~/.cache/edge-spec/models."""
    return Path(os.environ.get("EDGE_SPEC_MODELS", Path.home() / ".cache" / "edge-spec" / "models"))
