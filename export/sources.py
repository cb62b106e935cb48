"""Resolve MODEL (alias, hub id, local folder, local .gguf) and load it with transformers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from edge_spec.catalog import CATALOG, models_dir


class SourceError(Exception):
    """No source could be loaded; the message lists what was tried and how to provide one."""


@dataclass(frozen=True)
class Source:
    description: str  # for messages and the manifest
    path: str  # folder or hub id given to from_pretrained
    gguf_file: str | None = None

    @property
    def kwargs(self) -> dict:
        """Extra from_pretrained arguments: the GGUF file name inside `path`, if any."""
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


@dataclass
class Checkpoint:
    source: Source
    model: object  # transformers PreTrainedModel, float32, eval mode
    tokenizer: object  # transformers tokenizer with a fast backend


def candidate_sources(spec: str) -> list[Source]:
    """Every place MODEL may come from, most local first."""
    path = Path(spec).expanduser()
    if path.suffix == ".gguf":
        return [Source(f"local GGUF {path}", str(path.parent), path.name)]
    if path.is_dir():
        return [Source(f"local folder {path}", str(path))]
    entry = CATALOG.get(spec)
    if entry is not None:
        found = []
        if entry.gguf_file:
            gguf = models_dir() / entry.gguf_file
            found.append(Source(f"catalog GGUF {gguf}", str(gguf.parent), gguf.name))
        found.append(Source(f"hub id {entry.hub_id} (Hugging Face cache or hub)", entry.hub_id))
        return found
    if "/" in spec and not spec.startswith((".", "/")):
        return [Source(f"hub id {spec} (Hugging Face cache or hub)", spec)]
    return []


def load_config(spec: str):
    """The first candidate source whose config loads, and that config (architecture checked,
    no weights read); SourceError lists every source tried."""
    sources = candidate_sources(spec)
    if not sources:
        raise SourceError(
            f"unknown model {spec!r}: not a catalog alias ({', '.join(CATALOG)}), not a local folder "
            "or .gguf file, and not a hub id of the form owner/name"
        )
    from transformers import AutoConfig

    from export.archs import arch_for

    tried = []
    for source in sources:
        if source.gguf_file and not (Path(source.path) / source.gguf_file).is_file():
            tried.append(f"{source.description}: file not found")
            continue
        if source.gguf_file is None and Path(source.path).suffix == ".gguf":
            tried.append(f"{source.description}: file not found")
            continue
        try:
            config = AutoConfig.from_pretrained(source.path, **source.kwargs)
        except (OSError, ValueError) as exc:
            tried.append(f"{source.description}: {str(exc).splitlines()[0]}")
            continue
        arch_for(config)  # refuse unsupported architectures before loading gigabytes
        return source, config
    hint = (
        "download the checkpoint (`hf download ID`) or its GGUF into $EDGE_SPEC_MODELS "
        f"(now {models_dir()}), or pass a local folder or .gguf path"
    )
    raise SourceError(f"could not load {spec!r}; tried:\n  " + "\n  ".join(tried) + f"\n{hint}")


def load_checkpoint(spec: str) -> Checkpoint:
    source, _ = load_config(spec)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
    return Checkpoint(source, model, tokenizer)


def load_tokenizer(spec: str):
    """The tokenizer alone (no weights): enough to compare a draft's vocabulary with the target's."""
    source, _ = load_config(spec)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, **source.kwargs)
