"""Resolve MODEL (alias, hub id, local folder, local .gguf) and load it with transformers."""

from __future__ import annotations

import copy
import functools
import os
from contextlib import contextmanager
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
    # None: `model` holds every weight. Else `model`'s parameters are on the meta device and
    # loaded() reads the ones a step needs from the checkpoint's files, one module at a time.
    weights: "LazyWeights | None" = None

    @contextmanager
    def loaded(self, paths: list[str]):
        """Within the block, the modules at `paths` (e.g. "model.layers.3", "lm_head") hold
        their weights; after it they are the meta modules again and the weights are freed."""
        if self.weights is None:
            yield
            return
        saved = []
        try:
            for path in paths:
                parent, leaf = _parent(self.model, path)
                module = _child(parent, leaf)
                saved.append((parent, leaf, module))
                _set_child(parent, leaf, self.weights.materialized(module, path))
            yield
        finally:
            for parent, leaf, module in reversed(saved):
                _set_child(parent, leaf, module)


def _parent(model, path: str):
    *head, leaf = path.split(".")
    parent = model
    for part in head:
        parent = _child(parent, part)
    return parent, leaf


def _child(parent, leaf: str):
    return parent[int(leaf)] if leaf.isdigit() else getattr(parent, leaf)


def _set_child(parent, leaf: str, module) -> None:
    if leaf.isdigit():
        parent[int(leaf)] = module
    else:
        setattr(parent, leaf, module)


class LazyWeights:
    """A checkpoint's float32 tensors by transformers' parameter name, each read (and, from a
    GGUF, dequantized and processed by transformers' own GGUF tensor processor) only when
    asked: an fp32 1.5B model is 6.6 GiB, more than an 8 GB export can hold beside its graph."""

    def __init__(self, read: dict, tied: dict[str, str], blocks: dict | None = None):
        self.read = read  # parameter name -> () -> float32 numpy array or torch tensor
        self.tied = tied  # parameter name -> the name it is read as (a tied LM head)
        self.blocks_read = blocks or {}  # parameter name -> () -> export.gguf_blocks.Blocks or None (a GGUF)

    def blocks(self, name: str):
        """The GGUF's own blocks of parameter `name`, rows in the model's order; None when the
        checkpoint is not a GGUF or the tensor's type has no exact block form."""
        read = self.blocks_read.get(self.tied.get(name, name))
        return read() if read else None

    def tensor(self, name: str):
        import numpy as np
        import torch

        value = self.read[self.tied.get(name, name)]()
        tensor = torch.from_numpy(np.ascontiguousarray(value)) if isinstance(value, np.ndarray) else value
        return tensor.to(torch.float32).contiguous()

    def materialized(self, module, path: str):
        """A copy of the meta `module` (at `path` in the model) holding its weights."""
        import copy

        import torch
        from torch import nn

        module = copy.deepcopy(module)
        for name, param in list(module.named_parameters(recurse=True)):
            owner, leaf = _parent(module, name) if "." in name else (module, name)
            value = self.tensor(f"{path}.{name}")
            if tuple(value.shape) != tuple(param.shape):
                raise SourceError(f"{path}.{name}: the checkpoint holds shape {tuple(value.shape)}, the model {tuple(param.shape)}")
            owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
        for name, buffer in module.named_buffers():
            if buffer.is_meta:
                raise SourceError(f"{path}.{name}: a buffer left on the meta device")
        return module


@functools.cache
def _gguf_file_class():
    """gguf's GGUFReader over plain ndarray views of the mapped file. Over numpy.memmap every
    view runs memmap's Python __array_finalize__, and a 151,936-token vocabulary parses into
    millions of views: 3x the time and twice the memory (BENCHMARKS.md, "Export time")."""
    import numpy as np
    from gguf import GGUFReader

    class GGUFFile(GGUFReader):
        @property
        def data(self):
            return self._data

        @data.setter
        def data(self, mapped):
            self._data = mapped.view(np.ndarray)  # the memmap stays alive as the view's base

    return GGUFFile


def gguf_reader(path):
    return _gguf_file_class()(str(path))


@contextmanager
def gguf_read_once():
    """Within the block every GGUF read, ours and transformers' (config, tokenizer, weights),
    goes through gguf_reader, and transformers' metadata parse of a file (load_gguf_checkpoint
    without tensors) runs once per file: one export asks for a file's config and tokenizer
    several times. Re-entrant; everything is restored on exit."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    if getattr(hf_gguf.load_gguf_checkpoint, "reads_once", False):
        yield
        return
    plain_reader, plain_load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    parsed: dict[tuple, dict] = {}

    def load_once(path, return_tensors=False, **kwargs):
        if return_tensors or kwargs:
            return plain_load(path, return_tensors, **kwargs)
        stat = os.stat(path)
        key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns)
        if key not in parsed:
            parsed[key] = plain_load(path, False)
        return copy.deepcopy(parsed[key])  # callers may change what they are given

    load_once.reads_once = True
    gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = _gguf_file_class(), load_once
    try:
        yield
    finally:
        gguf.GGUFReader, hf_gguf.load_gguf_checkpoint = plain_reader, plain_load


def _gguf_weights(path: Path, model) -> dict:
    """Parameter name -> reader of that tensor in the GGUF, through transformers' own name map
    and tensor processor (what from_pretrained(gguf_file=) runs over every tensor at once)."""
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map, read_field

    reader = gguf_reader(path)
    architecture = read_field(reader, "general.architecture")[0]
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    mapping = get_gguf_hf_weights_map(model, processor)

    def reader_of(tensor):
        def read():
            result = processor.process(weights=_dequantized(tensor, dequantize), name=tensor.name, tensor_key_mapping=mapping, parsed_parameters={"tensors": {}, "config": {}})
            return result.weights

        return read

    def blocks_of(tensor):
        def read():
            from export.gguf_blocks import decode

            if len(tensor.data.shape) != 2:
                return None
            order = _row_order(processor, tensor, mapping)
            blocks = decode(tensor.tensor_type.name, tensor.data, int(tensor.shape[0]))
            return None if blocks is None or order is None else blocks.rows(order)

        return read

    read = {mapping[t.name]: reader_of(t) for t in reader.tensors if t.name in mapping}
    blocks = {mapping[t.name]: blocks_of(t) for t in reader.tensors if t.name in mapping}
    return read, blocks


def _row_order(processor, tensor, mapping):
    """The GGUF row each of the model's rows is read from, found by running the processor over
    the row numbers (a Llama q/k un-permutation moves whole rows); None if it does more than
    reorder rows."""
    import numpy as np

    rows = tensor.data.shape[0]
    index = np.arange(rows, dtype=np.float32)[:, None]
    try:
        moved = processor.process(weights=index, name=tensor.name, tensor_key_mapping=mapping, parsed_parameters={"tensors": {}, "config": {}}).weights
    except (ValueError, IndexError, TypeError, RuntimeError):  # a processor that needs the real width: no row order
        return None
    moved = np.asarray(moved)
    if moved.shape != (rows, 1) or not np.array_equal(np.sort(moved[:, 0]), index[:, 0]):
        return None
    return moved[:, 0].astype(np.int64)


def _dequantized(tensor, dequantize, chunk_values: int = 1 << 22):
    """gguf's dequantize, a block of rows at a time into one float32 array: over a whole
    151,936-row table its temporaries are several times the table."""
    import numpy as np

    data = tensor.data
    first = dequantize(data[:1], tensor.tensor_type)
    out = np.empty((data.shape[0], *first.shape[1:]), dtype=np.float32)
    rows = max(1, chunk_values // max(1, first.size))
    for start in range(0, data.shape[0], rows):
        out[start : start + rows] = dequantize(data[start : start + rows], tensor.tensor_type)
    return out


def _safetensors_weights(path: str) -> dict | None:
    """Parameter name -> reader, from the checkpoint's safetensors files (a folder or the HF
    cache); None when it has none (then the model loads whole)."""
    import json

    from safetensors import safe_open
    from transformers.utils import cached_file

    index = cached_file(path, "model.safetensors.index.json", _raise_exceptions_for_missing_entries=False)
    if index:
        files = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
        files = [cached_file(path, f) for f in files]
    else:
        single = cached_file(path, "model.safetensors", _raise_exceptions_for_missing_entries=False)
        if not single:
            return None
        files = [single]

    def reader_of(file, name):
        def read():
            with safe_open(file, framework="pt") as f:
                return f.get_tensor(name)

        return read

    read = {}
    for file in files:
        with safe_open(file, framework="pt") as f:
            read.update({name: reader_of(file, name) for name in f.keys()})
    return read


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


def _missing(source: Source) -> str | None:
    """Why a local source cannot be read ("...: file not found"); None when it may be."""
    local = Path(source.path) / source.gguf_file if source.gguf_file else Path(source.path)
    if (source.gguf_file or local.suffix == ".gguf") and not local.is_file():
        return f"{source.description}: file not found"
    return None


def _not_loaded(spec: str, tried: list[str]) -> SourceError:
    hint = (
        "download the checkpoint (`hf download ID`) or its GGUF into $EDGE_SPEC_MODELS "
        f"(now {models_dir()}), or pass a local folder or .gguf path"
    )
    return SourceError(f"could not load {spec!r}; tried:\n  " + "\n  ".join(tried) + f"\n{hint}")


def check_source(spec: str) -> None:
    """SourceError for a MODEL no source can give (an unknown name, local files that are not
    there), without importing torch or transformers: the command line refuses it at once;
    load_config tries the sources that remain."""
    sources = candidate_sources(spec)
    if not sources:
        raise SourceError(
            f"unknown model {spec!r}: not a catalog alias ({', '.join(CATALOG)}), not a local folder "
            "or .gguf file, and not a hub id of the form owner/name"
        )
    missing = [_missing(source) for source in sources]
    if all(missing):
        raise _not_loaded(spec, missing)


@gguf_read_once()
def load_config(spec: str):
    """The first candidate source whose config loads, and that config (architecture checked,
    no weights read); SourceError lists every source tried."""
    check_source(spec)
    from transformers import AutoConfig

    from export.archs import arch_for

    tried = []
    for source in candidate_sources(spec):
        why = _missing(source)
        if why:
            tried.append(why)
            continue
        try:
            config = AutoConfig.from_pretrained(source.path, **source.kwargs)
        except (OSError, ValueError) as exc:
            tried.append(f"{source.description}: {str(exc).splitlines()[0]}")
            continue
        arch_for(config)  # refuse unsupported architectures before loading gigabytes
        return source, config
    raise _not_loaded(spec, tried)


@gguf_read_once()
def load_checkpoint(spec: str) -> Checkpoint:
    source, _ = load_config(spec)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=torch.float32, **source.kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
    return Checkpoint(source, model, tokenizer)


@gguf_read_once()
def load_tokenizer(spec: str):
    """The tokenizer alone (no weights): enough to compare a draft's vocabulary with the target's."""
    source, _ = load_config(spec)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.path, **source.kwargs)


@gguf_read_once()
def open_checkpoint(spec: str) -> Checkpoint:
    """The checkpoint with its weights left in their files (Checkpoint.loaded reads them),
    when they are a GGUF or safetensors whose names are the model's; else loaded whole."""
    source, config = load_config(spec)
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    with init_empty_weights(include_buffers=False):  # parameters on meta; rotary tables computed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    blocks = None
    if source.gguf_file:
        read, blocks = _gguf_weights(Path(source.path) / source.gguf_file, model)
    else:
        read = _safetensors_weights(source.path)
        try:
            model.generation_config = GenerationConfig.from_pretrained(source.path)
        except OSError:
            pass
    names = [name for name, _ in model.named_parameters(remove_duplicate=False)]
    tied = {}
    if read is not None and getattr(config, "tie_word_embeddings", False) and "lm_head.weight" not in read:
        tied["lm_head.weight"] = "model.embed_tokens.weight"
    if read is None or any(tied.get(n, n) not in read for n in names):
        return load_checkpoint(spec)
    tokenizer = AutoTokenizer.from_pretrained(source.path, **source.kwargs)
    return Checkpoint(source, model, tokenizer, LazyWeights(read, tied, blocks))
