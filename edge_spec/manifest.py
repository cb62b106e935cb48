"""The bundle manifest: a versioned description of every file in a bundle, validated up front.

A bundle is a folder holding `manifest.json`, stage graphs (`*.onnx` with external data), and
`tokenizer.json`, optionally with Core ML packages (`*.mlpackage` folders) for the same stages.
Every problem a bundle can have is found by `load_manifest`, so nothing is checked inside the
decode loop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from edge_spec import names
from edge_spec.profiles import PROFILES

SCHEMA_VERSION = 3  # 2: StageInfo.attention (fused graphs write KV in place); 3: Manifest.device, fused position inputs
# Not bumped for ModelInfo.trimmed_head or ModelInfo.block_size: absent means the old full head and
# blocks of 32, and a reader without the field refuses it by name.
MANIFEST_FILE = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
QUANTS = ("int4", "int8", "fp16", "fp32")
# Weights per scale of an int4/int8 matrix (MatMulNBits' and GatherBlockQuantized's block_size:
# a power of two from 16). Larger blocks store fewer scales and run faster, at some precision.
QUANT_BLOCKS = (16, 32, 64, 128, 256)
DEFAULT_QUANT_BLOCK = 32
KV_DTYPES = ("float32", "float16")


class BundleError(Exception):
    """A bundle that cannot be used, with the reason and what to do about it."""


@dataclass(frozen=True)
class ArchInfo:
    """What the runtime needs to allocate KV buffers and interpret logits."""

    model_type: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int  # rows of the LM head (may be padded past the tokenizer's real tokens)
    max_context: int
    kv_dtype: str = "float32"
    # Per layer: the layer attends to keys less than W positions behind the query, 0 = to all;
    # () = no windowed layer. The graphs mask by window over full-size buffers, so every layer
    # still holds max_context rows and rollback by length is unchanged.
    layer_windows: tuple[int, ...] = ()

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)


@dataclass(frozen=True)
class StageInfo:
    """One ONNX graph: layers [layer_start, layer_end), plus the embedding and/or the head."""

    file: str
    data_files: tuple[str, ...]
    embed: bool
    head: bool
    layer_start: int
    layer_end: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attention: str = "fused"  # names.ATTENTION_KINDS: how the graph updates the KV buffers

    @property
    def layers(self) -> range:
        return range(self.layer_start, self.layer_end)


@dataclass(frozen=True)
class TrimmedHead:
    """A draft's LM head cut to the rows of its most frequent tokens (FR-Spec / VocabTrim).

    `file` (int32 .npy [rows], ascending) names the token each logit column scores; the runtime
    puts them back at those ids and -inf elsewhere, so the draft's q is exactly 0 outside them and
    verification stays exact: a proposal never names a dropped token, the residual covers its mass.
    """

    file: str  # "<role>.head_tokens.npy" at the top of the bundle
    rows: int  # kept tokens: the graph's logits width
    counted_from: str = ""  # the text the frequencies were counted on, in words


HEAD_TOKENS_SUFFIX = ".head_tokens.npy"


@dataclass(frozen=True)
class LayerCandidate:
    """One kept-layer set the layer-skip search measured (export.layer_search)."""

    kept: str  # the kept layers as layer-skip's explicit form, "0-9,14-20,24-27"
    alpha: float  # teacher-forced top-1 agreement with the full model on the calibration text
    cost_share: float  # a draft step's cost in full target passes (kept weights, head, session runs)
    gamma: int  # the draft length the cost model gives the best speedup at
    speedup: float  # that expected speedup over plain decoding, on the search's verify curve

    def __post_init__(self):
        for name in ("alpha", "cost_share", "speedup"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1e6:
                raise BundleError(f"layer search candidate {self.kept!r}: {name} {json.dumps(value)[:40]} is not a number >= 0")
        if self.alpha > 1 or isinstance(self.gamma, bool) or not isinstance(self.gamma, int) or self.gamma < 1:
            raise BundleError(f"layer search candidate {self.kept!r}: alpha must be in [0, 1] and gamma a positive integer")


@dataclass(frozen=True)
class LayerSearch:
    """What `--draft layer-skip:auto` searched and found, recorded in the layer_skip role."""

    calibration: str  # the text, in words (its sources and the Python version that supplied it)
    calibration_sha256: str  # of the calibration token ids (int64 little-endian): the text's id
    tokens: int  # calibration tokens the search scored
    influence: tuple[float, ...]  # per layer: 1 - mean cosine of its input and output hidden states
    verify_curve: tuple[float, ...]  # V(k), k = 1.. rows, the target pass cost the speedup assumed
    stage_cost: float  # one more session run, in full target passes
    candidates: tuple[LayerCandidate, ...]
    chosen: str  # the candidate kept (its `kept`)

    def __post_init__(self):
        if not any(c.kept == self.chosen for c in self.candidates):
            raise BundleError(f"layer search: chosen {self.chosen!r} is none of its candidates")
        if not self.verify_curve or self.verify_curve[0] != 1.0:
            raise BundleError("layer search: verify_curve must start at V(1) = 1.0")


@dataclass(frozen=True)
class ModelInfo:
    """A role (`target`, `draft`, `layer_skip`): the stages it runs in order, and its KV needs.

    A role with `shares_kv_with` set runs some of that role's stages, in its order, its first and
    last among them, and reads and writes that role's KV buffers instead of owning any (layer-skip
    self-speculation); its arch counts the layers it runs.
    """

    source: str
    arch: ArchInfo
    quant: str
    stages: tuple[str, ...]
    shares_kv_with: str | None = None
    trimmed_head: TrimmedHead | None = None  # None: the head scores every one of arch.vocab_size rows
    block_size: int = DEFAULT_QUANT_BLOCK  # QUANT_BLOCKS: weights per scale at int4/int8; unused at fp16/fp32
    zero_points: bool = False  # int4/int8 MatMuls carry a uint8 zero point per block (asymmetric)
    # Weights kept as a GGUF's own blocks (export --gguf-blocks), parameters per GGUF type, and
    # "requantized" for those that were not; None: every weight quantized by the exporter.
    gguf_blocks: dict[str, int] | None = None
    layer_search: LayerSearch | None = None  # a layer_skip role exported as layer-skip:auto

    @property
    def logit_rows(self) -> int:
        """The width of the logits its head graph returns."""
        return self.arch.vocab_size if self.trimmed_head is None else self.trimmed_head.rows


# Core ML names: feature names cannot hold "." (coremltools would rename them), so the package's
# inputs and outputs are the edge_spec names with "_"; each layer's KV is a pair of states.
COREML_COMPRESSIONS = ("none", "int8-per-channel", "int4-per-block32")
COREML_STATE_MULTIPLE = 32  # state lengths the Neural Engine tiles without padding


def coreml_feature(name: str) -> str:
    return name.replace(".", "_")


def coreml_inputs(embed: bool, layers: range) -> list[str]:
    """No logit_positions: Core ML enumerates the shape of one input only, so the head scores
    every row of the block and the runtime keeps the rows it asked for."""
    return [coreml_feature(names.INPUT_IDS if embed else names.HIDDEN_IN)] + ([coreml_feature(names.KV_LEN)] if layers else [])


def coreml_outputs(head: bool, layers: range) -> list[str]:
    """Like a portable graph, a package returns the block's new KV rows (new_key_i ...)."""
    return [coreml_feature(name) for name in names.stage_outputs(head, layers, "portable")]


def coreml_state(kind: str, layer: int) -> str:
    return f"{kind}_cache_{layer}"  # fp16 [1, kv_heads, state_length, head_dim]


def coreml_state_names(layers: range) -> list[str]:
    return [coreml_state(kind, layer) for layer in layers for kind in ("key", "value")]


@dataclass(frozen=True)
class CoreMLPackageInfo:
    """A stage as a stateful Core ML ML program (iOS 18 / macOS 15), keyed like `stages`.

    `file` is a folder: `files` lists (and hashes) every file inside it by its relative path,
    and a bundle whose package holds a file the manifest does not list is refused.
    """

    file: str  # "<stage>.mlpackage"
    inputs: tuple[str, ...]  # coreml_inputs(): input_ids int32 [1,T] | hidden_in fp16 [1,T,hidden], kv_len int32 [1]
    outputs: tuple[str, ...]  # coreml_outputs(): logits [1,T,vocab] | hidden_out, new_key_i, new_value_i [1,KVH,T,D]
    states: tuple[str, ...]  # coreml_state_names(): the KV buffers, written at kv_len, masked by kv_len
    block_lengths: tuple[int, ...]  # the enumerated T (decode 1, verify γ+1, prefill chunk)
    state_length: int  # KV rows per state, a multiple of COREML_STATE_MULTIPLE; 0 without layers
    compression: str  # COREML_COMPRESSIONS: weights; activations and KV are fp16
    compute_precision: str = "float16"
    minimum_deployment_target: str = "iOS18"


@dataclass(frozen=True)
class TokenizerInfo:
    file: str
    chat_template: str | None
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    n_real_tokens: int  # tokens the tokenizer can produce; LM-head rows past this are padding
    special_tokens: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Manifest:
    schema_version: int
    stages: dict[str, StageInfo]
    models: dict[str, ModelInfo]
    tokenizer: TokenizerInfo
    files: dict[str, str]  # relative path -> SHA-256
    created_by: str = ""
    default_draft: str | None = None
    coreml: dict[str, CoreMLPackageInfo] = field(default_factory=dict)  # stage key -> package
    device: str = "cpu"  # edge_spec.profiles.DEVICES: the provider the graphs were built for

    @property
    def target(self) -> ModelInfo:
        return self.models["target"]

    def drafts(self) -> list[str]:
        return [role for role in self.models if role != "target"]

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _build(cls, data: dict[str, Any], where: str):
    """Construct a frozen dataclass from JSON, naming the missing or unknown field."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known
    if unknown:
        raise BundleError(f"manifest {where}: unknown field(s) {sorted(unknown)}")
    try:
        obj = cls(**data)
    except TypeError as exc:
        raise BundleError(f"manifest {where}: {exc}") from None
    return obj


def _object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise BundleError(f"manifest {where} must be a JSON object, not {type(value).__name__}")
    return value


def manifest_from_dict(data: dict[str, Any]) -> Manifest:
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise BundleError(
            f"manifest schema version {version!r} is not supported by this runtime "
            f"(it reads version {SCHEMA_VERSION}); re-export the bundle with this edge-spec version"
        )
    stages = {}
    for key, raw in _object(data.get("stages", {}), "stages").items():
        raw = dict(_object(raw, f"stage {key!r}"))
        for tuple_field in ("data_files", "inputs", "outputs"):
            raw[tuple_field] = tuple(raw.get(tuple_field, ()))
        stages[key] = _build(StageInfo, raw, f"stage {key!r}")
    models = {}
    for role, raw in _object(data.get("models", {}), "models").items():
        raw = dict(_object(raw, f"model {role!r}"))
        arch = dict(_object(raw.get("arch", {}), f"model {role!r} arch"))
        if "layer_windows" in arch:
            arch["layer_windows"] = tuple(arch["layer_windows"])
        raw["arch"] = _build(ArchInfo, arch, f"model {role!r} arch")
        raw["stages"] = tuple(raw.get("stages", ()))
        if raw.get("trimmed_head") is not None:
            raw["trimmed_head"] = _build(TrimmedHead, dict(_object(raw["trimmed_head"], f"model {role!r} trimmed_head")), f"model {role!r} trimmed_head")
        if raw.get("layer_search") is not None:
            raw["layer_search"] = _layer_search(_object(raw["layer_search"], f"model {role!r} layer_search"), f"model {role!r} layer_search")
        models[role] = _build(ModelInfo, raw, f"model {role!r}")
    _object(data.get("files", {}), "files")
    tok = dict(_object(data.get("tokenizer", {}), "tokenizer"))
    tok["eos_token_ids"] = tuple(tok.get("eos_token_ids", ()))
    tokenizer = _build(TokenizerInfo, tok, "tokenizer")
    coreml = {}
    for key, raw in _object(data.get("coreml", {}), "coreml").items():
        raw = dict(_object(raw, f"Core ML package {key!r}"))
        for tuple_field in ("inputs", "outputs", "states", "block_lengths"):
            raw[tuple_field] = tuple(raw.get(tuple_field, ()))
        coreml[key] = _build(CoreMLPackageInfo, raw, f"Core ML package {key!r}")
    rest = {k: v for k, v in data.items() if k not in ("stages", "models", "tokenizer", "coreml")}
    return _build(Manifest, dict(rest, stages=stages, models=models, tokenizer=tokenizer, coreml=coreml), "top level")


def _layer_search(raw: dict[str, Any], where: str) -> LayerSearch:
    raw = dict(raw)
    for name in ("influence", "verify_curve"):
        raw[name] = tuple(raw.get(name, ()))
    raw["candidates"] = tuple(_build(LayerCandidate, dict(_object(c, f"{where} candidate")), f"{where} candidate") for c in raw.get("candidates", ()))
    return _build(LayerSearch, raw, where)


def validate(manifest: Manifest, bundle_dir: Path, check_hashes: bool = True) -> None:
    """Every check a bundle gets; raises BundleError naming the first problem found."""
    check_fact_types(manifest)
    if "target" not in manifest.models:
        raise BundleError("manifest has no 'target' model")
    if manifest.default_draft is not None and (manifest.default_draft not in manifest.models or manifest.default_draft == "target"):
        raise BundleError(f"manifest default_draft {manifest.default_draft!r} is not one of its models (other than the target)")
    if not manifest.tokenizer.eos_token_ids:
        raise BundleError("manifest tokenizer lists no EOS token id")
    vocab = manifest.tokenizer.n_real_tokens
    for name, ids in (("eos_token_ids", manifest.tokenizer.eos_token_ids), ("bos_token_id", (manifest.tokenizer.bos_token_id,))):
        outside = [i for i in ids if i is not None and i >= vocab]
        if outside:  # an EOS the model can never emit would let every generation run to its limit
            raise BundleError(f"manifest tokenizer.{name} {json.dumps(outside[0])[:40]} is outside the vocabulary "
                              f"[0, {vocab}) (tokenizer.n_real_tokens); fix the manifest or re-export the bundle")
    target = manifest.target
    profile = PROFILES.get(manifest.device)
    if profile is None:
        raise BundleError(f"manifest device {manifest.device!r} is not a device profile this runtime knows ({', '.join(PROFILES)})")
    for role, model in manifest.models.items():
        if model.quant not in QUANTS:
            raise BundleError(f"model {role!r}: unknown quantization {model.quant!r} (known: {QUANTS})")
        if isinstance(model.block_size, bool) or not isinstance(model.block_size, int) or model.block_size not in QUANT_BLOCKS:
            raise BundleError(f"model {role!r}: block_size {json.dumps(model.block_size)[:40]} is not one of {list(QUANT_BLOCKS)}")
        if not isinstance(model.zero_points, bool):
            raise BundleError(f"model {role!r}: zero_points {json.dumps(model.zero_points)[:40]} is not true or false")
        if model.gguf_blocks is not None and (not isinstance(model.gguf_blocks, dict) or not model.gguf_blocks or any(
                not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, int) or v < 0 for k, v in model.gguf_blocks.items())):
            raise BundleError(f"model {role!r}: gguf_blocks {json.dumps(model.gguf_blocks)[:60]} is not a table of GGUF types to parameter counts")
        if model.arch.kv_dtype not in KV_DTYPES:
            raise BundleError(f"model {role!r}: unknown KV dtype {model.arch.kv_dtype!r}")
        windows = model.arch.layer_windows
        if windows and (len(windows) != model.arch.n_layers or any(not isinstance(w, int) or w < 0 for w in windows)):
            raise BundleError(f"model {role!r}: layer_windows must list a window >= 0 for each of its {model.arch.n_layers} layers")
        if model.arch.kv_dtype != profile.kv_dtype:
            raise BundleError(f"model {role!r} keeps a {model.arch.kv_dtype} KV cache; --device {manifest.device} bundles keep {profile.kv_dtype}")
        if model.arch.vocab_size < manifest.tokenizer.n_real_tokens:
            raise BundleError(
                f"vocabulary mismatch: model {role!r} has {model.arch.vocab_size} LM-head rows but the "
                f"tokenizer has {manifest.tokenizer.n_real_tokens} tokens"
            )
        if role != "target" and model.arch.vocab_size != target.arch.vocab_size:
            raise BundleError(
                f"vocabulary mismatch: draft {role!r} scores {model.arch.vocab_size} tokens, target "
                f"scores {target.arch.vocab_size}; export with a draft that shares the target's tokenizer"
            )
        if model.shares_kv_with is not None:
            owner = manifest.models.get(model.shares_kv_with)
            if owner is None or owner.shares_kv_with is not None:
                raise BundleError(f"model {role!r} shares KV with {model.shares_kv_with!r}, which owns none")
            for fact in ("max_context", "n_kv_heads", "head_dim", "kv_dtype"):
                if getattr(owner.arch, fact) != getattr(model.arch, fact):
                    raise BundleError(f"model {role!r} and {model.shares_kv_with!r} disagree on {fact.replace('_', ' ')}")
        _validate_stages(manifest, role, model)
        _validate_trimmed_head(manifest, role, model)
    for role, model in manifest.models.items():
        owner = manifest.models.get(model.shares_kv_with or role)
        if model.stages[0] != owner.stages[0] or model.stages[-1] != owner.stages[-1]:
            raise BundleError(f"model {role!r} must run {model.shares_kv_with!r}'s first and last stages")
        # Its own stages in the owner's order: the layers it skips are whole stages of the owner.
        order = [owner.stages.index(key) if key in owner.stages else -1 for key in model.stages]
        if -1 in order or order != sorted(set(order)):
            raise BundleError(f"model {role!r} must run some of {model.shares_kv_with!r}'s stages, in its order")
        if model.layer_search is not None and model.shares_kv_with is None:
            raise BundleError(f"model {role!r} has a layer_search: only a layer-skip draft (sharing the target's KV) is searched")
    _validate_coreml(manifest)
    _validate_files(manifest, bundle_dir, check_hashes)
    for role, model in manifest.models.items():
        if model.trimmed_head is not None:
            load_head_tokens(bundle_dir, manifest, role)


def _validate_trimmed_head(manifest: Manifest, role: str, model: ModelInfo) -> None:
    trimmed = model.trimmed_head
    if trimmed is None:
        return
    if role == "target" or model.shares_kv_with is not None:
        # p must cover every token, and a layer-skip draft runs the target's own head stage.
        raise BundleError(f"model {role!r} has a trimmed LM head: only a draft model with a head of its own may (re-export the bundle)")
    if not isinstance(trimmed.file, str) or Path(trimmed.file).name != trimmed.file or not trimmed.file.endswith(HEAD_TOKENS_SUFFIX):
        raise BundleError(f"model {role!r}: trimmed_head file {trimmed.file!r} must be a {HEAD_TOKENS_SUFFIX} file at the top of the bundle")
    if isinstance(trimmed.rows, bool) or not isinstance(trimmed.rows, int) or not 1 <= trimmed.rows <= manifest.tokenizer.n_real_tokens:
        raise BundleError(f"model {role!r}: trimmed_head rows must be an integer 1..{manifest.tokenizer.n_real_tokens} (the tokenizer's tokens), got {json.dumps(trimmed.rows)[:40]}")
    if not isinstance(trimmed.counted_from, str):
        raise BundleError(f"model {role!r}: trimmed_head counted_from must be a string")


def load_head_tokens(bundle_dir: str | Path, manifest: Manifest, role: str):
    """The token ids a trimmed head scores, int64 [rows], checked: a .npy of distinct ascending
    real token ids, as many as the manifest says, every EOS id among them."""
    import numpy as np

    trimmed = manifest.models[role].trimmed_head
    path = Path(bundle_dir) / trimmed.file
    where = f"model {role!r} trimmed head {trimmed.file}"
    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise BundleError(f"{where} is not a readable .npy array ({exc}); re-export the bundle") from None
    if ids.dtype.kind not in "iu" or ids.shape != (trimmed.rows,):
        raise BundleError(f"{where}: expected {trimmed.rows} integer token ids, found {ids.dtype} {list(ids.shape)}; re-export the bundle")
    ids = ids.astype(np.int64)
    if ids.size and (ids[0] < 0 or ids[-1] >= manifest.tokenizer.n_real_tokens or np.any(np.diff(ids) <= 0)):
        raise BundleError(f"{where}: token ids must be distinct, ascending and in [0, {manifest.tokenizer.n_real_tokens}); re-export the bundle")
    missing = sorted(set(manifest.tokenizer.eos_token_ids) - set(ids.tolist()))
    if missing:
        raise BundleError(f"{where} drops EOS token(s) {missing}: the draft could never propose the end; re-export the bundle")
    return ids


def _validate_stages(manifest: Manifest, role: str, model: ModelInfo) -> None:
    if not model.stages:
        raise BundleError(f"model {role!r} has no stages")
    next_layer = run = 0
    for i, key in enumerate(model.stages):
        stage = manifest.stages.get(key)
        if stage is None:
            raise BundleError(f"model {role!r} names stage {key!r}, which the manifest does not list")
        if stage.embed != (i == 0) or stage.head != (i == len(model.stages) - 1):
            raise BundleError(f"model {role!r}: stage {key!r} is out of place (embed first, head last)")
        # A role sharing another's KV (a layer-skip draft) may skip layers between its stages.
        skips = model.shares_kv_with is not None and i > 0 and stage.layer_start > next_layer
        if stage.layers and stage.layer_start != next_layer and not skips:
            raise BundleError(f"model {role!r}: stage {key!r} starts at layer {stage.layer_start}, expected {next_layer}")
        next_layer = stage.layer_end if stage.layers else next_layer
        run += len(stage.layers)
        if stage.attention not in names.ATTENTION_KINDS:
            raise BundleError(f"stage {key!r}: unknown attention kind {stage.attention!r} (known: {names.ATTENTION_KINDS})")
        expected_in = names.stage_inputs(stage.embed, stage.head, stage.layers, stage.attention)
        expected_out = names.stage_outputs(stage.head, stage.layers, stage.attention)
        if list(stage.inputs) != expected_in or list(stage.outputs) != expected_out:
            raise BundleError(f"stage {key!r}: graph input/output names do not follow edge_spec.names")
    if run != model.arch.n_layers:
        raise BundleError(f"model {role!r}: stages run {run} layers, arch says {model.arch.n_layers}")


def _validate_coreml(manifest: Manifest) -> None:
    """A stage's `file` may be "" (a --format coreml bundle ships no ONNX graph) only when a Core
    ML package stands in for it; packages, when present, cover every stage."""
    for key, stage in manifest.stages.items():
        if key not in manifest.coreml and not stage.file:
            raise BundleError(f"stage {key!r} has neither an ONNX graph nor a Core ML package; re-export the bundle")
        if key not in manifest.coreml and manifest.coreml:
            raise BundleError(f"stage {key!r} has no Core ML package while other stages have one; re-export the bundle")
    for key, package in manifest.coreml.items():
        stage = manifest.stages.get(key)
        if stage is None:
            raise BundleError(f"Core ML package {key!r} is for a stage the manifest does not list")
        where = f"Core ML package {key!r}"
        if not package.file.endswith(".mlpackage") or Path(package.file).name != package.file:
            raise BundleError(f"{where}: file {package.file!r} must be an .mlpackage folder at the top of the bundle")
        expected = (coreml_inputs(stage.embed, stage.layers), coreml_outputs(stage.head, stage.layers), coreml_state_names(stage.layers))
        if (list(package.inputs), list(package.outputs), list(package.states)) != expected:
            raise BundleError(f"{where}: inputs/outputs/states do not follow the Core ML names for its stage")
        lengths = package.block_lengths
        if not lengths or lengths[0] != 1 or any(b <= a for a, b in zip(lengths, lengths[1:])):
            raise BundleError(f"{where}: block lengths {list(lengths)} must rise from 1 (every block then splits into them exactly)")
        if package.compression not in COREML_COMPRESSIONS or package.compute_precision != "float16":
            raise BundleError(f"{where}: unknown compression {package.compression!r} or precision {package.compute_precision!r}")
        for role, model in manifest.models.items():
            if key in model.stages and stage.layers and package.state_length != model.arch.max_context:
                raise BundleError(f"{where}: KV states hold {package.state_length} rows, model {role!r} has max context {model.arch.max_context}")
        if package.state_length % COREML_STATE_MULTIPLE or (package.state_length == 0) != (not stage.layers):
            raise BundleError(f"{where}: state length {package.state_length} is not a positive multiple of {COREML_STATE_MULTIPLE}")


def package_files(bundle_dir: Path, package: str) -> list[str]:
    """Every file inside an .mlpackage folder, as sorted bundle-relative POSIX paths: the
    manifest hashes these one by one, like any other bundle file."""
    root = Path(bundle_dir) / package
    return sorted(p.relative_to(bundle_dir).as_posix() for p in root.rglob("*") if p.is_file())


def _validate_files(manifest: Manifest, bundle_dir: Path, check_hashes: bool) -> None:
    referenced = {manifest.tokenizer.file}
    for stage in manifest.stages.values():
        if stage.file:
            referenced.add(stage.file)
        referenced.update(stage.data_files)
    referenced.update(m.trimmed_head.file for m in manifest.models.values() if m.trimmed_head is not None)
    for package in manifest.coreml.values():
        listed = {rel for rel in manifest.files if rel.startswith(package.file + "/")}
        if not listed:
            referenced.add(package.file)
        elif (bundle_dir / package.file).is_dir():
            extra = sorted(set(package_files(bundle_dir, package.file)) - listed)
            if extra:
                raise BundleError(f"Core ML package {package.file} holds files the manifest does not list: {extra} (re-export the bundle)")
    unlisted = referenced - set(manifest.files)
    if unlisted:
        raise BundleError(f"manifest lists no hash for {sorted(unlisted)}")
    root = bundle_dir.resolve()
    for rel, expected in manifest.files.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise BundleError(f"manifest file {rel!r} points outside the bundle folder")
        path = bundle_dir / rel
        if not path.is_file():
            raise BundleError(f"bundle file missing: {path} (the bundle is incomplete; re-export it)")
        _inside(path, root)
        if check_hashes:
            actual = sha256_file(path)
            if actual != expected:
                raise BundleError(
                    f"bundle file altered: {path} has SHA-256 {actual[:16]}…, manifest says "
                    f"{expected[:16]}… (re-export the bundle, or restore the file)"
                )


def _inside(path: Path, root: Path) -> None:
    """A bundle file must be inside the bundle folder once every symlink is followed: a link out of
    it would let a copied bundle read (and, unhashed, feed the runtime) any file on the machine."""
    if not path.resolve().is_relative_to(root):
        raise BundleError(f"bundle file {path} is a link to {path.resolve()}, outside the bundle folder {root}; "
                          "copy the file into the bundle instead")


def check_sha256(value, what: str = "bundle_sha256") -> str:
    """A SHA-256 as 64 lowercase hex digits; anything else is a one-line ValueError naming `what`."""
    if not isinstance(value, str) or not re.fullmatch(r"[0-9a-fA-F]{64}", value.strip()):
        raise ValueError(f"{what} must be 64 hexadecimal digits (the SHA-256 of the bundle's {MANIFEST_FILE}), "
                         f"got {json.dumps(value)[:24] if isinstance(value, str) else type(value).__name__}")
    return value.strip().lower()


def bundle_digest(bundle_dir: str | Path) -> str:
    """The bundle's one hash: the SHA-256 of manifest.json's bytes. The manifest lists every other
    file's SHA-256 (checked at load), so this covers the whole bundle, manifest and template included."""
    return hashlib.sha256(_manifest_bytes(Path(bundle_dir))).hexdigest()


def _manifest_bytes(bundle_dir: Path) -> bytes:
    path = bundle_dir / MANIFEST_FILE
    if not bundle_dir.is_dir():
        raise BundleError(f"bundle folder not found: {bundle_dir}")
    if not path.is_file():
        raise BundleError(f"{bundle_dir} is not a bundle: it has no {MANIFEST_FILE} (run `python -m export` first)")
    _inside(path, bundle_dir.resolve())
    return path.read_bytes()


def read_manifest(bundle_dir: str | Path, check_hashes: bool = True, expected_sha256: str | None = None) -> tuple[Manifest, str]:
    """The checked manifest and the bundle's digest (bundle_digest). With expected_sha256, a
    manifest whose bytes hash otherwise is refused before it is parsed; the bytes hashed are
    the bytes parsed, so the file cannot change in between."""
    bundle_dir = Path(bundle_dir)
    if expected_sha256 is not None:
        expected_sha256 = check_sha256(expected_sha256)
        if not check_hashes:  # the digest vouches for the other files only through their hashes
            raise BundleError("a pinned bundle SHA-256 needs the file hashes checked (check_hashes=True)")
    raw = _manifest_bytes(bundle_dir)
    digest = hashlib.sha256(raw).hexdigest()
    path = bundle_dir / MANIFEST_FILE
    if expected_sha256 is not None and digest != expected_sha256:
        raise BundleError(f"{path} has SHA-256 {digest[:16]}…, the pinned bundle SHA-256 is {expected_sha256[:16]}…: "
                          "the manifest was edited or this is another bundle (refused)")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path} must hold a JSON object")
    manifest = manifest_from_dict(data)
    validate(manifest, bundle_dir, check_hashes)
    return manifest, digest


def load_manifest(bundle_dir: str | Path, check_hashes: bool = True, expected_sha256: str | None = None) -> Manifest:
    return read_manifest(bundle_dir, check_hashes, expected_sha256)[0]


def check_fact_types(manifest: Manifest) -> None:
    """Numbers are integers (a hand-edited "400" or 64.5 would otherwise fail deep inside a
    comparison or ONNX Runtime), sizes positive, the KV dtype a string."""

    def whole(value, where: str, low: int = 1) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BundleError(f"manifest {where} must be an integer >= {low}, got {json.dumps(value)[:40]}")

    for role, model in manifest.models.items():
        arch = model.arch
        for fact in ("n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_context"):
            whole(getattr(arch, fact), f"models.{role}.arch.{fact}")
        if not isinstance(arch.kv_dtype, str):
            raise BundleError(f"manifest models.{role}.arch.kv_dtype must be a string, got {json.dumps(arch.kv_dtype)[:40]}")
    tok = manifest.tokenizer
    whole(tok.n_real_tokens, "tokenizer.n_real_tokens")
    if not isinstance(tok.eos_token_ids, (list, tuple)):
        raise BundleError("manifest tokenizer.eos_token_ids must be a list of token ids")
    for i in tok.eos_token_ids:
        whole(i, "tokenizer.eos_token_ids[]", low=0)
    if tok.bos_token_id is not None:
        whole(tok.bos_token_id, "tokenizer.bos_token_id", low=0)
    if tok.chat_template is not None and not isinstance(tok.chat_template, str):
        raise BundleError("manifest tokenizer.chat_template must be a string or null")


_KV_TYPES = {"tensor(float)": "float32", "tensor(float16)": "float16"}  # ONNX Runtime's names of KV element types


def check_declared_io(arch: ArchInfo, key: str, stage: StageInfo, declared, logit_rows: int | None = None) -> None:
    """The manifest's facts against the inputs and outputs a stage's graph declares, as
    (name, type, shape) with ONNX Runtime's type names ("tensor(float)") and None or a string
    for a symbolic dimension: KV heads, rows (max context, fused attention), head size and
    dtype, hidden size, LM-head rows (logit_rows: a trimmed head's, else arch.vocab_size).
    Only static dimensions are compared."""

    def differs(where: str, fact: str, manifest_value, graph_value) -> None:
        static = isinstance(graph_value, int) and not isinstance(graph_value, bool)
        if (static or (fact == "kv_dtype" and isinstance(graph_value, str))) and graph_value != manifest_value:
            raise BundleError(f"manifest says {fact} {manifest_value} but stage {key!r} ({stage.file}) declares "
                              f"{where} with {graph_value}; the manifest was edited or belongs to another export")

    for name, type_name, shape in declared:
        shape = list(shape or [])
        if name.startswith(("past_key", "past_value", "present_key", "present_value")) and len(shape) == 4:
            differs(name, "n_kv_heads", arch.n_kv_heads, shape[1])
            if name.startswith("past_") and stage.attention == "fused":
                differs(name, "max_context", arch.max_context, shape[2])
            differs(name, "head_dim", arch.head_dim, shape[3])
            differs(name, "kv_dtype", arch.kv_dtype, _KV_TYPES.get(type_name, type_name))
        elif name == "logits" and shape:
            differs("logits", "vocab_size" if logit_rows is None else "trimmed_head rows", arch.vocab_size if logit_rows is None else logit_rows, shape[-1])
        elif name in ("hidden_in", "hidden_out") and shape:
            differs(name, "hidden_size", arch.hidden_size, shape[-1])
