"""Write a bundle: stage graphs for each role, the tokenizer, and a manifest with hashes."""

from __future__ import annotations

import dataclasses
import gc
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edge_spec import layer_subset as ls
from edge_spec import manifest as mf
from edge_spec import names
from edge_spec.budget import PREFILL_CHUNK, ExportChoice, ModelFacts, choose_export, matmul_bytes_per_weight, predict_weights
from edge_spec.catalog import CATALOG
from edge_spec.placement import check_bundle, input_dim_limit
from edge_spec.profiles import PROFILES, DeviceProfile
from export.archs import arch_for, check_context
from export.onnx_graphs import finish_stage, trace_stage
from export.quantize import quantize_stage
from export.sources import Checkpoint, gguf_read_once, load_config, load_tokenizer, open_checkpoint
from export.vocab_trim import DEFAULT_SOURCES, SUGGESTED_DRAFT_VOCAB

LAYER_SKIP_PREFIX = ls.PREFIX
FORMATS = ("onnx", "coreml")  # ONNX stage graphs; Core ML packages for the Apple Neural Engine


class ExportError(Exception):
    pass


@dataclass(frozen=True)
class ExportConfig:
    model: str
    out: Path
    quant: str = "int4"
    max_context: int = 2048
    drafts: tuple[str, ...] = ()  # same-tokenizer models and/or "layer-skip:N"; () = none
    force: bool = False  # replace an existing bundle folder
    formats: tuple[str, ...] = ("onnx",)  # FORMATS to write, one or both
    attention: str | None = None  # edge_spec.names.ATTENTION_KINDS; None: the device profile's default
    device: str = "cpu"  # edge_spec.profiles.DEVICES: the provider the graphs are built for
    draft_vocab: int | None = None  # the draft model's LM head keeps this many rows (export.vocab_trim); None: all
    draft_vocab_from: tuple[str, ...] = DEFAULT_SOURCES  # the text its token frequencies are counted on
    trace_layers: int | None = None  # layers traced at once (then stitched); None: as many as TRACE_BYTES of fp32 weights
    block_size: int = mf.DEFAULT_QUANT_BLOCK  # weights per int4/int8 scale (mf.QUANT_BLOCKS)
    draft_block_size: int | None = None  # the draft model's own block; None: block_size
    zero_points: bool = False  # int4/int8 MatMuls asymmetric, scales and uint8 zero points fitted (export.quantize)
    # The target's weights as its GGUF's own blocks where exact (export.gguf_blocks); None: so
    # whenever the target is read from a GGUF and the recipe allows it (keeps_gguf_blocks).
    gguf_blocks: bool | None = None
    # GGUF types rounded to int8 blocks of 64 instead of kept (gguf_blocks.to_int8); None: DEFAULT_GGUF_TO_INT8
    # wherever blocks may be kept, () where none are.
    gguf_to_int8: tuple[str, ...] | None = None
    # layer-skip:auto's search (export.layer_search): calibration tokens, the verify curve V(k) it
    # assumes (None: the device profile's: cpu on the CPU, flat elsewhere), one more session run's cost.
    layer_search_tokens: int = 512
    verify_curve: str | None = None
    layer_search_stage_cost: float = 0.02

    def __post_init__(self):
        if self.trace_layers is not None and (isinstance(self.trace_layers, bool) or not isinstance(self.trace_layers, int) or self.trace_layers <= 0):
            raise ExportError(f"trace_layers {self.trace_layers!r}: give a positive number of layers, or None")
        if self.draft_vocab is not None:
            if isinstance(self.draft_vocab, bool) or not isinstance(self.draft_vocab, int) or self.draft_vocab <= 0:
                raise ExportError(f"--draft-vocab {self.draft_vocab!r}: give a positive number of tokens (suggested {SUGGESTED_DRAFT_VOCAB})")
            if all(d.startswith(LAYER_SKIP_PREFIX) for d in self.drafts):
                raise ExportError("--draft-vocab trims a draft model's LM head: add --draft MODEL (a layer-skip draft runs the target's head, which scores every token)")
        if isinstance(self.block_size, bool) or self.block_size not in mf.QUANT_BLOCKS:
            raise ExportError(f"--block-size {self.block_size!r}: choose one of {', '.join(map(str, mf.QUANT_BLOCKS))} (weights per int4/int8 scale)")
        if self.draft_block_size is not None:
            if isinstance(self.draft_block_size, bool) or self.draft_block_size not in mf.QUANT_BLOCKS:
                raise ExportError(f"--draft-block-size {self.draft_block_size!r}: choose one of {', '.join(map(str, mf.QUANT_BLOCKS))} (weights per int4/int8 scale)")
            if all(d.startswith(LAYER_SKIP_PREFIX) for d in self.drafts):
                raise ExportError("--draft-block-size quantizes a draft model and this export has none: add --draft MODEL (a layer-skip "
                                  "draft runs the target's own weights, set by --block-size)")
        for flag, block in (("--block-size", self.block_size), ("--draft-block-size", self.draft_block)):
            if block == mf.DEFAULT_QUANT_BLOCK:
                continue
            if self.quant in ("fp16", "fp32"):
                raise ExportError(f"{flag} {block} sets int4/int8 scales; --quant {self.quant} has none")
            if "coreml" in self.formats:
                raise ExportError(f"{flag} {block} sets the ONNX graphs' blocks; Core ML packages quantize int4 per block of "
                                  f"{mf.DEFAULT_QUANT_BLOCK}: drop --format coreml or {flag}")
        if self.zero_points and (self.quant in ("fp16", "fp32") or "onnx" not in self.formats):
            raise ExportError(f"--zero-points sets the ONNX graphs' int4/int8 MatMul blocks; --quant {self.quant} --format {','.join(self.formats)} has none")
        if self.device not in PROFILES:
            raise ExportError(f"unknown --device {self.device!r}; choose one of {', '.join(PROFILES)}")
        if self.gguf_blocks and not self.gguf_blocks_possible:
            raise ExportError(f"--gguf-blocks keeps a GGUF's blocks in int4/int8 ONNX graphs with float32 scales (--device cpu), without --zero-points; "
                              f"not --quant {self.quant} --device {self.device}{' --zero-points' if self.zero_points else ''}")
        if self.gguf_to_int8 is None:
            keeps = self.gguf_blocks if self.gguf_blocks is not None else self.quant == "int4" and self.gguf_blocks_possible
            object.__setattr__(self, "gguf_to_int8", DEFAULT_GGUF_TO_INT8 if keeps else ())
        elif self.gguf_to_int8:
            from export.gguf_blocks import FORMS

            if self.gguf_blocks is False or (self.gguf_blocks is None and not self.gguf_blocks_possible):
                raise ExportError("--gguf-to-int8 rounds some of the GGUF's kept blocks to int8, and this export keeps none (--requantize, "
                                  "or a recipe that re-quantizes: --quant int8/fp16/fp32, --zero-points, --block-size, a float16 device)")
            unknown = [t for t in self.gguf_to_int8 if t not in FORMS]
            if unknown:
                raise ExportError(f"--gguf-to-int8 {','.join(unknown)}: not a GGUF type with a block form; choose from {', '.join(sorted(FORMS))}")
        for spec in self.drafts:
            if spec.startswith(LAYER_SKIP_PREFIX):
                try:
                    ls.parse(spec)
                except ls.LayerSpecError as exc:
                    raise ExportError(str(exc)) from None
        if self.verify_curve is None:
            object.__setattr__(self, "verify_curve", "cpu" if self.device == "cpu" else "flat")
        try:
            self.search_config()
        except ValueError as exc:
            raise ExportError(str(exc)) from None
        if self.attention is None:
            object.__setattr__(self, "attention", PROFILES[self.device].attentions[0])
        if PROFILES[self.device].zero_points and self.quant in ("int4", "int8"):
            object.__setattr__(self, "zero_points", True)
        known = self.quant in mf.QUANTS and self.attention in names.ATTENTION_KINDS  # else export_bundle names the unknown one
        refusal = PROFILES[self.device].refusal(self.quant, self.attention) if known else None
        if refusal:
            raise ExportError(refusal)
        limit = input_dim_limit(self.device)
        if limit and self.max_context + PREFILL_CHUNK > limit:
            # The masked graphs' past and mask widths are symbolic, so the placement check cannot see them.
            raise ExportError(f"--max-context {self.max_context}: --device {self.device} attends over up to that many past rows plus a "
                              f"block of up to {PREFILL_CHUNK}, and the provider takes no input dimension above {limit} "
                              f"(choose at most {limit - PREFILL_CHUNK})")
        if "coreml" in self.formats and self.device not in ("cpu", "coreml"):
            raise ExportError(f"--device {self.device} --format coreml: Core ML packages run on Apple devices; export them with --device coreml or cpu")

    @property
    def gguf_blocks_possible(self) -> bool:
        """Whether the GGUF's blocks can be kept: int4 ONNX graphs with float32 scales and
        activations (the blocks keep float32 scales), none of the re-quantizing options."""
        return (self.quant in ("int4", "int8") and self.formats == ("onnx",) and PROFILES[self.device].activations == "float32"
                and not self.zero_points and self.block_size == mf.DEFAULT_QUANT_BLOCK)

    def keeps_gguf_blocks(self, from_gguf: bool) -> bool:
        """Whether this export keeps the target's GGUF blocks, its source read from a GGUF or not;
        by default for int4 (int8 asks for more bits than a 4-bit file's blocks)."""
        if self.gguf_blocks is not None:
            return self.gguf_blocks
        return from_gguf and self.quant == "int4" and self.gguf_blocks_possible

    def search_config(self):
        """layer-skip:auto's search settings (export.layer_search.SearchConfig), checked."""
        from export.layer_search import SearchConfig

        return SearchConfig(self.layer_search_tokens, ls.verify_curve(self.verify_curve), self.layer_search_stage_cost)

    @property
    def profile(self) -> DeviceProfile:
        return PROFILES[self.device]

    @property
    def draft_block(self) -> int:
        """The draft model's weights per scale: its precision sets only α, never an output token."""
        return self.block_size if self.draft_block_size is None else self.draft_block_size


# Q6_K (a quarter of Qwen2.5's Q4_K_M weights: its LM head, half of attn_v and ffn_down) read at
# 9 bits per weight instead of 12, still closer to the checkpoint than llama.cpp (BENCHMARKS.md).
DEFAULT_GGUF_TO_INT8 = ("Q6_K",)


def default_drafts(model: str) -> tuple[str, ...]:
    entry = CATALOG.get(model)
    return (entry.default_draft,) if entry and entry.default_draft else ()


@gguf_read_once()
def model_facts(spec: str, export: ExportConfig | None = None) -> ModelFacts:
    """A model's shape from its config alone (no weights), to plan memory before exporting; with
    `export`, a GGUF whose blocks it keeps is planned at the bytes of its own tensor types."""
    source, config = load_config(spec)
    kept = {}
    if export is not None and source.gguf_file and export.keeps_gguf_blocks(from_gguf=True):
        from export.gguf_blocks import stored_gguf

        stored = stored_gguf(str(Path(source.path) / source.gguf_file), export.gguf_to_int8, matmul_bytes_per_weight(export.quant, export.block_size))
        kept = {"kept_quant": export.quant, "kept_bytes": stored.total, "kept_head_row": stored.head_row}
    heads = config.num_attention_heads
    return ModelFacts(
        config.model_type, config.num_hidden_layers, config.hidden_size, heads, config.num_key_value_heads,
        getattr(config, "head_dim", None) or config.hidden_size // heads, config.intermediate_size, config.vocab_size,
        qkv_bias=bool(getattr(config, "attention_bias", False)) or config.model_type == "qwen2", **kept,
    )


def _fp32_bytes(config) -> int:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    weights = predict_weights(
        "fp32", config.num_hidden_layers, config.hidden_size, heads, config.num_key_value_heads, head_dim,
        config.intermediate_size, config.vocab_size, config.vocab_size,
    )
    return weights.layers + weights.head + weights.embed


@gguf_read_once()
def choose_for_budget(config: ExportConfig, budget: int) -> ExportChoice:
    """The export (context, drafts, precision) that fits `budget`, by edge_spec.budget's order."""
    if "onnx" not in config.formats:
        raise ExportError("--memory-budget plans ONNX Runtime's memory: add onnx to --format")
    facts = {spec: model_facts(spec, config if spec == config.model else None) for spec in (config.model, *config.drafts) if not spec.startswith(LAYER_SKIP_PREFIX)}
    return choose_export(facts[config.model], config.quant, config.max_context, config.drafts, facts, budget, str(config.out), config.attention, config.device,
                         config.draft_vocab, config.block_size, config.draft_block)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux and macOS report it in different units)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


class Progress:
    """Timestamped steps with the peak memory so far and, once a share of the planned work is
    done, the time left at the rate so far (work counted in fp32 weight bytes per step)."""

    def __init__(self, log: Callable[[str], None]):
        self.log, self.start = log, time.perf_counter()
        self.total = self.done = 0.0

    def plan(self, total: float) -> None:
        self.total, self.done = float(total), 0.0

    def advance(self, work: float) -> None:
        self.done += work

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        left = ""
        if self.total and 0 < self.done < self.total:
            left = f"; about {elapsed * (self.total - self.done) / self.done:.0f} s left"
        self.log(f"[{elapsed:7.1f}s {peak_rss_bytes() / 2**30:5.1f} GiB peak] {message}{left}")


def _arch_info(model, max_context: int, vocab_rows: int, kv_dtype: str = "float32") -> mf.ArchInfo:
    config = model.config
    n_heads = config.num_attention_heads
    windows = tuple(arch_for(config).windows(config))
    return mf.ArchInfo(
        model_type=config.model_type,
        n_layers=config.num_hidden_layers,
        n_heads=n_heads,
        n_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // n_heads,
        hidden_size=config.hidden_size,
        vocab_size=vocab_rows,
        max_context=max_context,
        kv_dtype=kv_dtype,
        layer_windows=windows if any(windows) else (),
    )


TRACE_BYTES = 1 << 29  # fp32 layer weights traced at once: torch holds a traced graph about three times over


def _module_paths(layers: range, embed: bool, head: bool) -> list[str]:
    """The checkpoint modules a stage over `layers` reads its weights from."""
    return [*(["model.embed_tokens"] if embed else []), *(f"model.layers.{i}" for i in layers), *(["model.norm", "lm_head"] if head else [])]


def _module(model, path: str):
    for part in path.split("."):
        model = model[int(part)] if part.isdigit() else getattr(model, part)
    return model


def _trace_parts(model, layers: range, embed: bool, head: bool, per_part: int | None) -> list[tuple[range, bool, bool]]:
    """The stage cut into consecutive parts, traced one at a time and stitched: the embedding
    alone, then `per_part` layers a part or (None) as many as keep a part's fp32 weights under
    TRACE_BYTES, then the final norm and head alone (the tables are the largest tensors)."""
    if not layers:
        return [(layers, embed, head)]
    cuts, start, total = [], layers.start, 0
    for i in layers:
        size = 4 * sum(p.numel() for p in model.model.layers[i].parameters())
        count = i - start
        if count and ((per_part and count >= per_part) or (not per_part and total + size > TRACE_BYTES)):
            cuts.append(range(start, i))
            start, total = i, 0
        total += size
    cuts.append(range(start, layers.stop))
    parts = [(part, False, False) for part in cuts]
    if embed:
        parts.insert(0, (range(layers.start, layers.start), True, False))
    if head:
        parts.append((range(layers.stop, layers.stop), False, True))
    return parts


def _trace_stage(
    checkpoint: Checkpoint, key: str, layers: range, embed: bool, head: bool, config: ExportConfig, tmp: Path, scratch: Path, vocab_rows: int,
    progress: Progress, packages: dict[str, mf.CoreMLPackageInfo], head_tokens=None, origins: dict[str, int] | None = None,
) -> tuple[mf.StageInfo, list[Path] | None]:
    """Trace one stage to fp32 graphs in `scratch`, part by part (_trace_parts), each part's
    weights read from the checkpoint only while it is traced; returns its manifest entry and the
    traced parts, which _quantize_stage stitches and writes as the bundle's file. `origins` gets
    each part's first layer (its graph names count layers from there)."""
    origins = {} if origins is None else origins
    from export.static_cache import StageModule

    model = checkpoint.model
    float16 = config.profile.activations == "float16"

    def stage_module(part: range, part_embed: bool, part_head: bool) -> StageModule:
        return StageModule(model, part.start, part.stop, part_embed, part_head, vocab_rows, config.attention, config.max_context, fused_norm=float16, head_tokens=head_tokens)

    span = f"layers {layers.start}..{layers.stop - 1}" if layers else "no layers"
    if "coreml" in config.formats:
        from export.coreml import write_package

        progress(f"{key}: converting {span} to a Core ML package ({config.quant} weights, fp16)")
        with checkpoint.loaded(_module_paths(layers, embed, head)):
            packages[key] = write_package(stage_module(layers, embed, head), key, layers, config.max_context, config.quant, tmp, model.config.hidden_size)
    if "onnx" not in config.formats:
        # No ONNX graph (file ""): the entry still describes the stage; its Core ML package runs it
        # and, like a portable graph, returns the block's new KV rows.
        inputs, outputs = tuple(names.stage_inputs(embed, head, layers, "portable")), tuple(names.stage_outputs(head, layers, "portable"))
        return mf.StageInfo("", (), embed, head, layers.start, layers.stop, inputs, outputs, attention="portable"), None
    file = f"{key}.onnx"
    parts = _trace_parts(model, layers, embed, head, config.trace_layers)
    traced = []
    origins.update({f"part{index}": part.start for index, (part, _, _) in enumerate(parts)})
    for index, (part, part_embed, part_head) in enumerate(parts):
        part_span = f"layers {part.start}..{part.stop - 1}" if part else "no layers"
        progress(f"{key}: tracing {part_span}{' + embedding' if part_embed else ''}{' + head' if part_head else ''} (part {index + 1} of {len(parts)})")
        path = scratch / key / f"part{index}" / file  # a folder each: past 2 GB torch writes one file per tensor beside it
        path.parent.mkdir(parents=True)
        with checkpoint.loaded(_module_paths(part, part_embed, part_head)):
            stage = stage_module(part, part_embed, part_head)
        # Traced outside the block: what the stage copied (the transposed head) need not sit beside its source.
        trace_stage(stage, part, config.max_context, model.config.hidden_size, path)
        del stage
        gc.collect()
        traced.append(path)
        progress.advance(4 * sum(p.numel() for m in _module_paths(part, part_embed, part_head) for p in _module(model, m).parameters()))
    info = mf.StageInfo(
        file=file,
        data_files=(),
        embed=embed,
        head=head,
        layer_start=layers.start,
        layer_end=layers.stop,
        inputs=tuple(names.stage_inputs(embed, head, layers, config.attention)),
        outputs=tuple(names.stage_outputs(head, layers, config.attention)),
        attention=config.attention,
    )
    return info, traced


_LAYER_WEIGHT = re.compile(r"stage\.layers\.(\d+)\.(.+)\.weight_t")


def _checkpoint_name(name: str, origins: dict[str, int]) -> str | None:
    """The checkpoint parameter a traced initializer was read from ("part3/stage.layers.1.mlp.
    down_proj.weight_t" -> "model.layers.7.mlp.down_proj.weight" when part 3 starts at layer 6)."""
    part, _, local = name.rpartition("/")
    if local == "stage.embed_tokens.weight":
        return "model.embed_tokens.weight"
    if local == "stage.lm_head_parts.0":  # the whole head unless a provider's width limit cut it (then no match)
        return "lm_head.weight"
    match = _LAYER_WEIGHT.fullmatch(local)
    if match is None or (part or "part0") not in origins:
        return None
    return f"model.layers.{origins[part or 'part0'] + int(match[1])}.{match[2]}.weight"


def _gguf_resolver(checkpoint_weights, stage_weights, origins: dict[str, int], head_rows: np.ndarray):
    """Initializer -> the GGUF blocks of each of its sources (a merged weight has several), or
    None; write_stage keeps them only where they dequantize to the traced weight exactly."""

    def resolve(initializer):
        sources = stage_weights.merged.get(initializer.name, ([initializer], 1))[0]
        parts = []
        for source in sources:
            name = _checkpoint_name(source.name, origins)
            blocks = checkpoint_weights.blocks(name) if name else None
            if blocks is None:
                return None
            parts.append(blocks.rows(head_rows) if name == "lm_head.weight" and len(head_rows) != blocks.shape[0] else blocks)
        return parts

    return resolve


def _quantize_stage(key: str, info: mf.StageInfo, traced: list[Path] | None, config: ExportConfig, tmp: Path, progress: Progress,
                    gguf=None) -> tuple[mf.StageInfo, dict[str, int]]:
    """Stitch the traced parts, merge the projections and quantize into the bundle, weight by
    weight. gguf: (checkpoint weights, part origins, head rows) to keep the GGUF's own blocks.
    Returns the stage's entry and its weights per GGUF type (export.quantize.write_stage)."""
    if traced is None:
        return info, {}
    progress(f"{key}: {'stitching ' + str(len(traced)) + ' parts, ' if len(traced) > 1 else ''}merging parallel projections")
    graph, weights = finish_stage(traced, list(info.inputs), list(info.outputs))
    float16 = config.profile.activations == "float16"
    progress(f"{key}: {'keeping the GGUF blocks, else ' if gguf else ''}quantizing to {config.quant}{', float16 activations' if float16 else ''}")
    block = config.draft_block if key == "draft" else config.block_size
    resolver = _gguf_resolver(gguf[0], weights, gguf[1], gguf[2]) if gguf else None
    kept_as = quantize_stage(graph, weights, tmp / info.file, config.quant, config.profile.activations, config.profile.quantized_embedding, block, config.zero_points, resolver,
                             config.gguf_to_int8 if gguf else ())
    del graph, weights
    shutil.rmtree(traced[0].parent.parent)  # the parts' files, as large as the fp32 model
    data = info.file + ".data"
    return dataclasses.replace(info, data_files=(data,) if (tmp / data).exists() else ()), kept_as


def _vocab_difference(target_tok, draft_tok) -> str | None:
    target_vocab, draft_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if target_vocab == draft_vocab:
        return None
    only_target = sorted(set(target_vocab) - set(draft_vocab))
    only_draft = sorted(set(draft_vocab) - set(target_vocab))
    moved = sorted(t for t in set(target_vocab) & set(draft_vocab) if target_vocab[t] != draft_vocab[t])
    parts = [f"target has {len(target_vocab)} tokens, draft {len(draft_vocab)}"]
    if only_target:
        parts.append(f"{len(only_target)} only in the target (e.g. {only_target[0]!r})")
    if only_draft:
        parts.append(f"{len(only_draft)} only in the draft (e.g. {only_draft[0]!r})")
    if moved:
        parts.append(f"{len(moved)} with other ids (e.g. {moved[0]!r}: {target_vocab[moved[0]]} vs {draft_vocab[moved[0]]})")
    return "; ".join(parts)


def _tokenizer_info(checkpoint: Checkpoint, tmp: Path) -> mf.TokenizerInfo:
    tok, model = checkpoint.tokenizer, checkpoint.model
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None:
        raise ExportError("the checkpoint's tokenizer has no fast (tokenizers) backend to ship in the bundle")
    backend.save(str(tmp / mf.TOKENIZER_FILE))
    eos = []
    for value in (getattr(model.generation_config, "eos_token_id", None), model.config.eos_token_id, tok.eos_token_id):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and token not in eos:
                eos.append(int(token))
    special = {k: v for k, v in tok.special_tokens_map.items() if isinstance(v, str)}
    template = tok.chat_template if isinstance(tok.chat_template, str) else None
    return mf.TokenizerInfo(
        file=mf.TOKENIZER_FILE,
        chat_template=template,
        bos_token_id=tok.bos_token_id,
        eos_token_ids=tuple(eos),
        n_real_tokens=len(tok),
        special_tokens=special,
    )


@dataclass(frozen=True)
class HeadTokens:
    rows: np.ndarray  # int32 [N] ascending: the token ids the trimmed draft head keeps
    description: str  # the manifest's counted_from


def _draft_head_tokens(config: ExportConfig, tokenizer, info: mf.TokenizerInfo, text, progress: Progress) -> HeadTokens:
    """The draft head's kept rows: the shared tokenizer's most frequent tokens in `text`
    (export.vocab_trim.Corpus) and every added token, EOS and BOS the manifest names."""
    from export.vocab_trim import TrimError, always_kept, choose_rows, count_tokens, kept_mass

    progress(f"counting token frequencies for the draft head in {len(text.files)} files: {text.description}")
    counts, read = count_tokens(tokenizer.backend_tokenizer, text.files, info.n_real_tokens)
    try:
        rows = choose_rows(counts, config.draft_vocab, always_kept(tokenizer, info.eos_token_ids, info.bos_token_id))
    except TrimError as exc:
        raise ExportError(str(exc)) from None
    mass = f"{100 * kept_mass(counts, rows):.2f}%"
    progress(f"draft head keeps {len(rows)} of {info.n_real_tokens} tokens, {mass} of the {int(counts.sum())} counted")
    return HeadTokens(rows, f"{text.description}; {int(counts.sum())} tokens counted in {read} text files, {mass} of them kept")


def _log_stderr(message: str) -> None:
    print(message, file=sys.stderr)


@gguf_read_once()
def export_bundles(configs: list[ExportConfig], log: Callable[[str], None] = _log_stderr) -> list[mf.Manifest]:
    """Several bundles (say int4 and int8 of one pair) loading each checkpoint only once."""
    loaded: dict[str, Checkpoint] = {}

    def load(spec: str) -> Checkpoint:
        if spec not in loaded:
            loaded[spec] = open_checkpoint(spec)
        return loaded[spec]

    return [export_bundle(config, log, load) for config in configs]


@gguf_read_once()
def export_bundle(config: ExportConfig, log: Callable[[str], None] = _log_stderr, load: Callable[[str], Checkpoint] = open_checkpoint) -> mf.Manifest:
    if config.quant not in mf.QUANTS:
        raise ExportError(f"unknown quantization {config.quant!r}; choose one of {', '.join(mf.QUANTS)}")
    if config.attention not in names.ATTENTION_KINDS:
        raise ExportError(f"unknown attention {config.attention!r}; choose one of {', '.join(names.ATTENTION_KINDS)}")
    if config.max_context < 16:
        raise ExportError(f"--max-context {config.max_context} is too small (at least 16)")
    if not config.formats or set(config.formats) - set(FORMATS):
        raise ExportError(f"unknown format(s) in {','.join(config.formats) or '(none)'}; choose from {', '.join(FORMATS)}")
    if "coreml" in config.formats:
        from export.coreml import CoreMLExportError, CoreMLOptions, check_options

        try:
            check_options(CoreMLOptions(), config.max_context)
        except CoreMLExportError as exc:
            raise ExportError(str(exc)) from None
    out = Path(config.out)
    if out.exists() and any(out.iterdir()) and not config.force:
        raise ExportError(f"{out} exists and is not empty; pass --force to replace it")
    layer_skips = [d for d in config.drafts if d.startswith(LAYER_SKIP_PREFIX)]
    model_drafts = [d for d in config.drafts if not d.startswith(LAYER_SKIP_PREFIX)]
    if len(layer_skips) > 1 or len(model_drafts) > 1:
        raise ExportError("at most one draft model and one layer-skip draft per bundle")
    progress = Progress(log)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        manifest = _export_into(config, tmp, layer_skips, model_drafts, progress, load)
        # The bundle appears whole or not at all; a replaced one is removed only afterwards.
        old = out.with_name(out.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    progress(f"bundle written to {out}")
    progress(f"bundle SHA-256 (to pin it: --bundle-sha256): {mf.bundle_digest(out)}")
    return manifest


def _export_into(config: ExportConfig, tmp: Path, layer_skips, model_drafts, progress: Progress, load) -> mf.Manifest:
    # Everything refusable is refused from configs and tokenizers, before any weights load.
    target_config, draft_config, skip_spec = _read_configs(config, layer_skips, model_drafts)
    vocab_rows = _shared_vocab_rows(config, target_config, model_drafts, draft_config)
    text = _draft_vocab_text(config)

    # Each role costs about its fp32 size twice over: tracing (counted part by part) and writing.
    costs = {"target": _fp32_bytes(target_config), "draft": _fp32_bytes(draft_config) if draft_config is not None else 0}
    progress.plan(2 * sum(costs.values()))
    # One role at a time: the target is loaded, traced, freed and quantized before the draft loads.
    target = _load_target(config, target_config.vocab_size, progress, load)
    tokenizer = _tokenizer_info(target, tmp)
    head_tokens = _draft_head_tokens(config, target.tokenizer, tokenizer, text, progress) if text is not None else None
    target_arch = _arch_info(target.model, config.max_context, vocab_rows, config.profile.kv_dtype)
    plan, models = _target_roles(config, target, target_arch, skip_spec, target_config.num_hidden_layers, progress)
    packages: dict[str, mf.CoreMLPackageInfo] = {}
    with tempfile.TemporaryDirectory(dir=tmp) as scratch:
        origins = {key: {} for key, *_ in plan}
        traced = {key: _trace_stage(target, key, layers, embed, head, config, tmp, Path(scratch), vocab_rows, progress, packages, origins=origins[key])
                  for key, layers, embed, head in plan}
        target_blocks = _kept_gguf_blocks(config, target)
        del target  # the torch weights go before quantizing (the caller's cache may still hold them)
        gc.collect()
        progress(f"target written as fp32 graphs; peak memory so far {peak_rss_bytes() / 2**30:.1f} GiB")
        stages, gguf_blocks = _quantize_target(config, traced, origins, target_blocks, vocab_rows, tmp, progress)
        if gguf_blocks is not None:  # a layer-skip draft runs the target's weights, so its blocks too
            for role in [r for r in ("target", "layer_skip") if r in models]:
                models[role] = dataclasses.replace(models[role], gguf_blocks=dict(gguf_blocks))
        progress.advance(costs["target"])
        if model_drafts:
            stages["draft"], models["draft"] = _write_draft(config, model_drafts[0], draft_config, vocab_rows, head_tokens, tmp, Path(scratch), progress, packages, load)
            progress.advance(costs["draft"])

    manifest = _write_manifest(config, tmp, stages, models, tokenizer, packages, progress)
    if "onnx" in config.formats:
        _check_placement(config, manifest, tmp, progress)
    return manifest


def _read_configs(config: ExportConfig, layer_skips, model_drafts):
    """The target's and the draft model's configs (None without one) and the layer-skip spec
    (None without one), each checked against this export's context and the target's layers."""
    _, target_config = load_config(config.model)
    check_context(target_config, config.max_context)
    draft_config = None
    if model_drafts:
        _, draft_config = load_config(model_drafts[0])
        check_context(draft_config, config.max_context)
    skip_spec = None
    if layer_skips:
        try:
            skip_spec = ls.parse(layer_skips[0], target_config.num_hidden_layers)
        except ls.LayerSpecError as exc:
            raise ExportError(str(exc)) from None
    return target_config, draft_config, skip_spec


def _shared_vocab_rows(config: ExportConfig, target_config, model_drafts, draft_config) -> int:
    """The LM-head rows every role scores: the target's, or only the real tokens where a draft
    model's head is padded otherwise. Refuses a draft model with another tokenizer."""
    target_rows = target_config.vocab_size
    if not model_drafts:
        return target_rows
    target_tokenizer = load_tokenizer(config.model)
    difference = _vocab_difference(target_tokenizer, load_tokenizer(model_drafts[0]))
    if difference:
        raise ExportError(f"draft {model_drafts[0]!r} does not share the target's tokenizer: {difference}")
    vocab_rows = target_rows
    draft_rows = draft_config.vocab_size
    if draft_rows != target_rows:
        # Same real tokens, differently padded heads: score only the real tokens in both.
        if min(target_rows, draft_rows) < len(target_tokenizer):
            raise ExportError("the draft's LM head is smaller than the shared tokenizer")
        vocab_rows = len(target_tokenizer)
    if config.draft_vocab is not None:
        _check_draft_vocab(config.draft_vocab, target_tokenizer)
    return vocab_rows


def _check_draft_vocab(draft_vocab: int, tokenizer) -> None:
    """Refuse a --draft-vocab above the tokenizer's size or below the tokens a trimmed head always keeps."""
    from export.vocab_trim import always_kept

    if draft_vocab > len(tokenizer):
        raise ExportError(f"--draft-vocab {draft_vocab} is more than the {len(tokenizer)} tokens of the tokenizer")
    eos = [t for t in (tokenizer.eos_token_id,) if t is not None]
    forced = always_kept(tokenizer, eos, tokenizer.bos_token_id)
    if len(forced) > draft_vocab:
        raise ExportError(f"--draft-vocab {draft_vocab} is smaller than the {len(forced)} special and EOS tokens a trimmed head always keeps")


def _draft_vocab_text(config: ExportConfig):
    """The text --draft-vocab counts token frequencies on (export.vocab_trim.corpus), or None without it."""
    if config.draft_vocab is None:
        return None
    from export.vocab_trim import TrimError, corpus

    try:
        return corpus(tuple(config.draft_vocab_from))
    except TrimError as exc:
        raise ExportError(str(exc)) from None


def _load_target(config: ExportConfig, target_rows: int, progress: Progress, load) -> Checkpoint:
    """The target checkpoint, its architecture supported and its LM head as long as its config says."""
    progress(f"loading {config.model}")
    target = load(config.model)
    arch_for(target.model.config)
    if target.model.lm_head.weight.shape[0] != target_rows:
        raise ExportError(f"{config.model!r}: LM head has {target.model.lm_head.weight.shape[0]} rows, its config says {target_rows}")
    return target


def _target_roles(config: ExportConfig, target: Checkpoint, target_arch: mf.ArchInfo, skip_spec, n_layers: int,
                  progress: Progress) -> tuple[list[tuple[str, range, bool, bool]], dict[str, mf.ModelInfo]]:
    """The target's stages to write (key, layers, embedding, head) and the manifest's roles they
    serve: the target whole, or with a layer-skip draft the target cut where the draft skips."""
    if skip_spec is None:
        plan = [("target", range(n_layers), True, True)]
        return plan, {"target": mf.ModelInfo(target.source.description, target_arch, config.quant, ("target",), block_size=config.block_size, zero_points=config.zero_points)}
    kept, search = skip_spec.kept, None
    if skip_spec.auto:
        from export.layer_search import search as search_layers

        progress(f"searching the layers a layer-skip draft keeps ({config.layer_search_tokens} tokens, verify curve {config.verify_curve})")
        with target.loaded(_module_paths(range(n_layers), True, True)):
            kept, search = search_layers(target.model, target.tokenizer, config.search_config(), progress)
    # The target runs every segment, then the head; the draft runs the kept segments, then the
    # head: every weight is stored once, and the draft writes its KV rows into the target's cache.
    plan, draft_stages = [], []
    pieces = ls.segments(kept, n_layers)
    for index, (layers, is_kept) in enumerate(pieces):
        key = "target.trunk" if index == 0 else ("target.rest" if len(pieces) == 2 else f"target.s{index}")
        plan.append((key, layers, index == 0, False))
        if is_kept:
            draft_stages.append(key)
    plan.append(("target.head", range(0, 0), False, True))
    models = {"target": mf.ModelInfo(target.source.description, target_arch, config.quant, tuple(k for k, *_ in plan), block_size=config.block_size, zero_points=config.zero_points)}
    windows = tuple(target_arch.layer_windows[i] for i in kept) if target_arch.layer_windows else ()
    kept_words = f"first {len(kept)}" if kept == tuple(range(len(kept))) else f"layers {ls.describe(kept)}"
    models["layer_skip"] = mf.ModelInfo(
        f"layer skip: {kept_words} of {n_layers} layers of the target{', chosen by layer-skip:auto' if search else ''}",
        dataclasses.replace(target_arch, n_layers=len(kept), layer_windows=windows),
        config.quant,
        (*draft_stages, "target.head"),
        shares_kv_with="target",
        block_size=config.block_size,
        zero_points=config.zero_points,
        layer_search=search,
    )
    return plan, models


def _kept_gguf_blocks(config: ExportConfig, target: Checkpoint):
    """The target's GGUF weights when this export keeps their blocks, else None; refuses
    --gguf-blocks for a target read from no .gguf file."""
    # The blocks are read from the GGUF's memory map when written; the torch weights can go.
    from_gguf = target.weights is not None and bool(target.weights.blocks_read)
    if config.gguf_blocks and not from_gguf:
        raise ExportError(f"--gguf-blocks keeps a GGUF's own blocks: {config.model!r} is not read from a .gguf file")
    return target.weights if config.keeps_gguf_blocks(from_gguf) else None


def _quantize_target(config: ExportConfig, traced, origins, target_blocks, vocab_rows: int, tmp: Path,
                     progress: Progress) -> tuple[dict[str, mf.StageInfo], dict[str, int] | None]:
    """Write the target's traced stages into the bundle; returns their entries and, where the
    GGUF's blocks are kept, the weights kept per GGUF type (None where none are)."""
    stages: dict[str, mf.StageInfo] = {}
    kept: dict[str, int] = {}
    for key, (info, path) in traced.items():
        gguf = (target_blocks, origins[key], np.arange(vocab_rows)) if target_blocks is not None else None
        stages[key], stage_kept = _quantize_stage(key, info, path, config, tmp, progress, gguf)
        for name, count in stage_kept.items():
            kept[name] = kept.get(name, 0) + count
    if target_blocks is None:
        return stages, None
    progress("target weights: " + ", ".join(f"{count / 1e6:.1f} M {name}" for name, count in sorted(kept.items())))
    return stages, dict(sorted(kept.items()))


def _write_draft(config: ExportConfig, spec: str, draft_config, vocab_rows: int, head_tokens: HeadTokens | None, tmp: Path, scratch: Path,
                 progress: Progress, packages: dict[str, mf.CoreMLPackageInfo], load) -> tuple[mf.StageInfo, mf.ModelInfo]:
    """Load, trace, free and quantize the draft model (one stage); returns its stage entry and role."""
    progress(f"loading draft {spec}")
    draft = load(spec)
    if draft.model.lm_head.weight.shape[0] != draft_config.vocab_size:
        raise ExportError(f"draft {spec!r}: LM head has {draft.model.lm_head.weight.shape[0]} rows, its config says {draft_config.vocab_size}")
    draft_layers = draft.model.config.num_hidden_layers
    draft_arch = _arch_info(draft.model, config.max_context, vocab_rows, config.profile.kv_dtype)
    info, path = _trace_stage(draft, "draft", range(draft_layers), True, True, config, tmp, scratch, vocab_rows, progress, packages, None if head_tokens is None else head_tokens.rows)
    source = draft.source.description
    del draft  # the torch weights go before quantizing, as the target's do
    gc.collect()
    stage, _ = _quantize_stage("draft", info, path, config, tmp, progress)
    trimmed = None
    if head_tokens is not None:
        trimmed = mf.TrimmedHead("draft" + mf.HEAD_TOKENS_SUFFIX, len(head_tokens.rows), head_tokens.description)
        np.save(tmp / trimmed.file, head_tokens.rows)
    return stage, mf.ModelInfo(source, draft_arch, config.quant, ("draft",), trimmed_head=trimmed, block_size=config.draft_block, zero_points=config.zero_points)


def _write_manifest(config: ExportConfig, tmp: Path, stages: dict[str, mf.StageInfo], models: dict[str, mf.ModelInfo], tokenizer: mf.TokenizerInfo,
                    packages: dict[str, mf.CoreMLPackageInfo], progress: Progress) -> mf.Manifest:
    """Hash every file written, then write and validate the manifest that lists them."""
    progress("hashing files")
    files = {p.name: mf.sha256_file(p) for p in sorted(tmp.iterdir()) if p.is_file()}
    # An .mlpackage is a folder: every file inside it is listed and hashed on its own.
    files.update({rel: mf.sha256_file(tmp / rel) for package in packages.values() for rel in mf.package_files(tmp, package.file)})
    default_draft = "draft" if "draft" in models else ("layer_skip" if "layer_skip" in models else None)
    from edge_spec import __version__

    manifest = mf.Manifest(
        schema_version=mf.SCHEMA_VERSION,
        stages=stages,
        models=models,
        tokenizer=tokenizer,
        files=files,
        created_by=f"edge-spec {__version__}",
        default_draft=default_draft,
        coreml=packages,
        device=config.device,
    )
    (tmp / mf.MANIFEST_FILE).write_text(manifest.to_json())
    mf.validate(manifest, tmp, check_hashes=False)
    return manifest


def _check_placement(config: ExportConfig, manifest: mf.Manifest, tmp: Path, progress: Progress) -> None:
    """Refuse graphs with a node the device's provider has no kernel for."""
    progress(f"checking every node has a {config.profile.provider} kernel")
    report = check_bundle(manifest, tmp, config.profile.provider)
    # The CPU provider is the fallback itself: it casts float16 nodes it has no kernel for to
    # float32 (an fp16 --device cpu bundle), so there only an op it lacks outright fails.
    misses = report.misses if config.profile.provider != "cpu" else [m for m in report.misses if m.reason.startswith("no ")]
    if misses:
        raise ExportError(f"the --device {config.device} graphs would not run on {config.profile.provider}: {report.summary()}")
