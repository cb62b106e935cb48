"""The memory planner: every byte a bundle needs in host memory, part by part, before it loads.

It models ONNX Runtime's CPU execution provider (weights, KV buffers and activations all in
host memory) from facts alone: the manifest and the files' sizes for a written bundle, or the
architecture and the quantization for a bundle export has not written yet.

Every factor below was measured from /proc/self/status (VmRSS, VmHWM, RssAnon, RssFile) before
and after each step of a load and of forward passes, on Linux x86-64 with Python 3.11, numpy
2.4.6, onnxruntime 1.32.0 and tokenizers 0.23.3, for Qwen2.5-Coder 1.5B + 0.5B (int4, int8;
portable and fused attention), SmolLM2-135M (fp32) and a random 4-layer hidden-1024 Llama
(fp32, fp16, int8, int4); the measurements are in benchmarks/notes/2026-11-30-memory-issue-7.md,
"The planner's factors". The plan is the peak of a full context: the OS backs the KV buffers
lazily, so a short conversation stays below it.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from edge_spec import layer_subset
from edge_spec.drafters import drafter_spec
from edge_spec.manifest import DEFAULT_QUANT_BLOCK, ArchInfo, BundleError, Manifest
from edge_spec.profiles import PROFILES

KiB, MiB, GiB = 2**10, 2**20, 2**30

# Python + numpy + onnxruntime + tokenizers + the runtime package (and the server's starlette
# and uvicorn) imported, plus ONNX Runtime's environment and thread pools (BENCHMARKS.md).
RUNTIME_BYTES = 78 * MiB
# tokenizers holds tokenizer.json as Rust maps of its vocabulary and merges (BENCHMARKS.md).
TOKENIZER_FACTOR = 9.5
TOKENIZER_BYTES_PER_TOKEN = 720  # the same, per vocabulary entry, for export (no file yet)

PREFILL_CHUNK = 256  # ModelRunner.prefill's chunk (runtime/model.py): the longest block a pass takes
DEFAULT_MAX_GAMMA = 8  # EngineConfig.max_gamma: verify passes take γ+1 tokens, γ ≤ max_gamma
_BITS = {"int4": 4, "int8": 8}
_FLOAT_BYTES = {"fp16": 2, "fp32": 4}
KV_ITEM_BYTES = {"float32": 4, "float16": 2}

# fp32 MatMul weights are packed by MLAS into column panels and the original released (BENCHMARKS.md).
_FP32_PACKING = 1.02
# The CPU provider has no float16 MatMul on x86: ORT folds the Casts into float32 copies of the
# weights at load (BENCHMARKS.md), so fp16 loads heavier than fp32 on the CPU.
_FP16_LAYERS, _FP16_HEAD = 2.7, 2.0
# The embedding table stays memory-mapped: a row is read in only when a token uses it, with
# the 64 KiB around it (the kernel's fault-around), in the data and in the scales; per position
# as measured on a context of code (BENCHMARKS.md). These pages are clean: the kernel may drop them.
EMBED_BYTES_PER_POSITION = 16 * KiB
# Activations one stage session keeps in its arena after passes of T tokens, per pass shape:
# about 10 hidden-size tensors, 0.9 of an MLP intermediate and 1.3 of the block's own
# [heads, T, T] scores (fitted, BENCHMARKS.md). Portable attention also materializes scores over
# the whole static buffer, [heads, T, max_context] float32, about 3.2 times at once. Doubled:
# ORT's arena keeps the first pass's buffers and the second pass of a shape allocates its
# memory pattern as one block of its own; a third adds nothing.
_HIDDEN_COPIES, _MLP_COPIES, _BLOCK_SCORE_COPIES, _PAST_SCORE_COPIES, _PATTERN_COPIES = 10, 0.9, 1.3, 3.2, 2
# float16-activation graphs (--device cuda/dml) on the CPU provider, which computes them through
# float32 conversions: MatMulNBits packs float16 scales as float32 beside the stored ones, and
# each session's arena keeps the conversion buffers. Fitted on the int4 Qwen pair (BENCHMARKS.md).
_FP16_ACTIVATION_WEIGHTS, _FP16_ACTIVATION_WORKSPACE = 1.13, 2.3


class BudgetError(ValueError):
    """A plan that does not fit its budget; `plan` holds the breakdown."""

    def __init__(self, message: str, plan: "Plan"):
        super().__init__(message)
        self.plan = plan


_UNITS = {
    "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """"3GB" (10^9), "512MiB" (2^20), "1.5GiB", or a plain byte count, into bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = _SIZE.fullmatch(str(text))
        if match is None:
            raise ValueError(f"memory size {text!r} is not a number with an optional unit; write e.g. 3GB, 512MiB or 1500000000")
        number, unit = match.group(1), match.group(2).lower()
        if unit not in _UNITS and unit:
            raise ValueError(
                f"memory size {text!r}: unknown unit {match.group(2)!r} (use B, KB, MB, GB, TB for powers of 1000 "
                "or KiB, MiB, GiB, TiB for powers of 1024)"
            )
        scaled = float(number) * _UNITS[unit or "b"]
        if not unit and "." in number:
            raise ValueError(f"memory size {text!r}: a plain byte count must be a whole number")
        value = int(scaled)
    if value <= 0:
        raise ValueError(f"memory size {text!r} must be more than 0 bytes")
    return value


def format_size(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# -- weights -----------------------------------------------------------------------------


def scale_bytes_per_weight(block: int = DEFAULT_QUANT_BLOCK) -> float:
    """One float32 scale per block of weights."""
    return 4 / block


def matmul_bytes_per_weight(quant: str, block: int = DEFAULT_QUANT_BLOCK) -> float:
    """Stored bytes per weight of a quantized matrix: MatMulNBits data plus its block scales."""
    if quant in _BITS:
        return _BITS[quant] / 8 + scale_bytes_per_weight(block)
    return _FLOAT_BYTES[quant]


def embed_bytes_per_weight(quant: str, block: int = DEFAULT_QUANT_BLOCK) -> float:
    """The embedding table: 4-bit GatherBlockQuantized for int4 and int8 (ORT's Gather
    quantizer has only 4 bits), float otherwise."""
    return 0.5 + scale_bytes_per_weight(block) if quant in _BITS else _FLOAT_BYTES[quant]


@dataclass(frozen=True)
class StoredWeights:
    """Weight bytes on disk, split by how ONNX Runtime holds them once loaded."""

    quant: str
    layers: int  # decoder layers: MatMul weights, norms, biases (and each graph's own bytes)
    head: int = 0  # the LM head matrix (and the final norm)
    embed: int = 0  # the embedding table
    block: int = DEFAULT_QUANT_BLOCK  # weights per scale at int4/int8 (export --block-size)

    @property
    def stored(self) -> int:
        return self.layers + self.head + self.embed

    @property
    def packed(self) -> int:
        """Resident bytes of the layers and the head once their sessions are made.

        MatMulNBits (int4/int8): the data is prepacked and the original released; the block
        scales are copied into the packed weight, block sums are added beside them, and the
        original scales stay memory-mapped (the kernel reads them): data + 3x scales, 1.40x
        the stored int4 bytes and 1.22x int8 at blocks of 32 (what was measured: BENCHMARKS.md;
        other blocks by their own count of scales, not measured). The head's
        prepack scratch, one more scales' worth, stays in its session's arena."""
        if self.quant in _BITS:
            per_weight = matmul_bytes_per_weight(self.quant, self.block)
            scale = scale_bytes_per_weight(self.block)
            factor = (per_weight + 2 * scale) / per_weight
            head_scratch = self.head * scale / per_weight
            return round((self.layers + self.head) * factor + head_scratch)
        if self.quant == "fp16":
            return round(self.layers * _FP16_LAYERS + self.head * _FP16_HEAD)
        return round((self.layers + self.head) * _FP32_PACKING)

    def embed_in_use(self, max_context: int) -> int:
        """The mapped embedding rows a full context reads in."""
        return min(self.embed, max_context * EMBED_BYTES_PER_POSITION)

    @property
    def load_transient(self) -> int:
        """Bytes held only while the head's session is made: its unpacked weight (float32 for
        fp16) beside the packed copy (measured: the head's full data size)."""
        if self.quant in _BITS:
            return round(self.head * (_BITS[self.quant] / 8) / matmul_bytes_per_weight(self.quant, self.block))
        return self.head * (2 if self.quant == "fp16" else 1)

    def __add__(self, other: "StoredWeights") -> "StoredWeights":
        return StoredWeights(self.quant, self.layers + other.layers, self.head + other.head, self.embed + other.embed, self.block)


def predict_weights(
    quant: str, n_layers: int, hidden_size: int, n_heads: int, n_kv_heads: int, head_dim: int,
    intermediate_size: int, embed_rows: int, head_rows: int, qkv_bias: bool = False, block: int = DEFAULT_QUANT_BLOCK,
) -> StoredWeights:
    """What export will write for a Llama-family model: per layer q,k,v,o and gate,up,down
    matrices (quantized), two norms and the optional q/k/v biases (float); the embedding
    table; an LM head of its own (export stores one even when the checkpoint ties it). A
    quantized matrix (not the embedding table) stores whole blocks along its input dimension, the
    last one padded."""

    def k(n: int) -> int:
        return -(-n // block) * block if quant in _BITS else n

    attention = n_heads * head_dim
    matrix = k(hidden_size) * (attention + 2 * n_kv_heads * head_dim + 2 * intermediate_size) + k(attention) * hidden_size + k(intermediate_size) * hidden_size
    small = 2 * hidden_size + (attention + 2 * n_kv_heads * head_dim if qkv_bias else 0)
    float_bytes = 2 if quant == "fp16" else 4
    layers = n_layers * (matrix * matmul_bytes_per_weight(quant, block) + small * float_bytes)
    head = head_rows * k(hidden_size) * matmul_bytes_per_weight(quant, block) + hidden_size * float_bytes
    embed = embed_rows * hidden_size * embed_bytes_per_weight(quant, block)
    return StoredWeights(quant, round(layers), round(head), round(embed), block)


# -- buffers -----------------------------------------------------------------------------


def kv_bytes(arch: ArchInfo, context: int | None = None) -> int:
    """The role's preallocated KV: layers x (key, value) x [1, KV heads, max context, head dim];
    with `context`, only the rows that many tokens fill (the OS backs the rest lazily).
    Sliding-window layers (arch.layer_windows) are masked over full buffers: they hold as many rows."""
    rows = arch.max_context if context is None else min(context, arch.max_context)
    return arch.n_layers * 2 * arch.n_kv_heads * rows * arch.head_dim * KV_ITEM_BYTES[arch.kv_dtype]


def largest_block(arch: ArchInfo, max_gamma: int = DEFAULT_MAX_GAMMA) -> int:
    """Most tokens one pass feeds: a prefill chunk, or a verify block of γ+1."""
    return min(max(PREFILL_CHUNK, max_gamma + 1), arch.max_context)


def workspace_bytes(arch: ArchInfo, intermediate_size: int, attention: str = "fused", max_gamma: int = DEFAULT_MAX_GAMMA) -> int:
    """Activation memory one session with layers keeps in its arena after its largest block."""
    block = largest_block(arch, max_gamma)
    per_pass = 4 * block * (  # float32 rows of the block
        _HIDDEN_COPIES * arch.hidden_size + _MLP_COPIES * intermediate_size + _BLOCK_SCORE_COPIES * arch.n_heads * block
    )
    if attention in ("portable", "masked"):
        per_pass += _PAST_SCORE_COPIES * arch.n_heads * block * arch.max_context * 4  # [1,KVH,G*T,MAX]
    return round(_PATTERN_COPIES * per_pass)


def intermediate_from_layers(arch: ArchInfo, layer_bytes: int, quant: str, block: int = DEFAULT_QUANT_BLOCK) -> int:
    """A role's MLP width, which the manifest does not record, from its stored layer bytes:
    each layer holds q,o [hidden, heads*D], k,v [hidden, KV heads*D] and 3 [hidden, I]."""
    per_layer = layer_bytes / max(arch.n_layers, 1) / matmul_bytes_per_weight(quant, block)
    attention = arch.hidden_size * (2 * arch.n_heads + 2 * arch.n_kv_heads) * arch.head_dim
    return max(round((per_layer - attention) / (3 * arch.hidden_size)), 0)


def logits_bytes(vocab_size: int, max_gamma: int = DEFAULT_MAX_GAMMA, draft_model: bool = False) -> int:
    """The target's [γ+1, V] float32 logits (in the head session's arena and as numpy), the
    float64 probabilities and a temporary sampling makes of them; a draft model adds one row
    of each and keeps γ float64 distributions for verification."""
    rows = max_gamma + 1
    per_row = vocab_size * (4 + 4 + 8 + 8)
    return rows * per_row + ((per_row + max_gamma * vocab_size * 8) if draft_model else 0)


# -- plans -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Part:
    name: str
    bytes: int
    note: str = ""


@dataclass(frozen=True)
class RolePlan:
    """A loaded role: the weights its own sessions bring (None: it runs another role's
    sessions), how many of those sessions run layers, and its KV needs."""

    role: str
    arch: ArchInfo
    weights: StoredWeights | None
    layer_sessions: int
    shares_kv_with: str | None = None
    intermediate_size: int = 0
    attention: str = "fused"
    float16_activations: bool = False  # a --device cuda/dml graph, planned on the CPU provider

    @property
    def packed_weights(self) -> int:
        return round(self.weights.packed * (_FP16_ACTIVATION_WEIGHTS if self.float16_activations else 1))

    def session_workspace(self, max_gamma: int) -> int:
        """What one of its sessions with layers keeps in its arena at its largest block."""
        per_session = workspace_bytes(self.arch, self.intermediate_size, self.attention, max_gamma)
        return round(per_session * (_FP16_ACTIVATION_WORKSPACE if self.float16_activations else 1))


def one_arena(manifest: Manifest) -> bool:
    """Whether the runtime's CPU sessions share one arena: where the target is cut in more than one
    stage with layers (a layer-skip draft's cut). Those stages run in turn, so one arena needs one
    stage's activations where an arena each keeps every stage's; elsewhere sharing saved little
    and it costs a little decode time (benchmarks/notes/2026-12-06-one-arena.md)."""
    return _cut(sum(1 for key in manifest.target.stages if manifest.stages[key].layers))


def _cut(target_layer_sessions: int) -> bool:
    """The one rule both the runtime (one_arena) and the plan (plan_roles) read."""
    return target_layer_sessions > 1


@dataclass(frozen=True)
class Plan:
    drafter: str
    roles: tuple[str, ...]
    parts: tuple[Part, ...]
    budget: int | None = None
    source: str = ""  # the bundle folder, or what export was asked to write
    stored_bytes: int = 0  # the loaded roles' weights on disk
    context: int | None = None  # tokens in use; None: the full max context, which a budget must hold

    @property
    def total_bytes(self) -> int:
        return sum(part.bytes for part in self.parts)

    @property
    def fits(self) -> bool:
        return self.budget is None or self.total_bytes <= self.budget

    def part(self, name: str) -> int:
        for p in self.parts:
            if p.name == name:
                return p.bytes
        raise KeyError(f"the plan has no part {name!r} (it has: {', '.join(p.name for p in self.parts)})")

    def table(self) -> str:
        width = max(len(p.name) for p in self.parts)
        context = "full context" if self.context is None else f"{self.context} tokens of context"
        head = f"memory plan for {self.source or 'bundle'} (drafter {self.drafter}: {' + '.join(self.roles)}; {context}; CPU provider)"
        lines = [head]
        for p in self.parts:
            lines.append(f"  {p.name:<{width}}  {format_size(p.bytes):>11}  {p.note}".rstrip())
        lines.append(f"  {'total':<{width}}  {format_size(self.total_bytes):>11}")
        if self.budget is not None:
            verdict = "fits" if self.fits else f"does NOT fit (over by {format_size(self.total_bytes - self.budget)})"
            lines.append(f"  {'budget':<{width}}  {format_size(self.budget):>11}  {verdict}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "drafter": self.drafter,
            "roles": list(self.roles),
            "context": self.context,
            "parts": [{"name": p.name, "bytes": p.bytes, "note": p.note} for p in self.parts],
            "total_bytes": self.total_bytes,
            "stored_weight_bytes": self.stored_bytes,
            "budget_bytes": self.budget,
            "fits": self.fits,
        }

    def check(self) -> "Plan":
        """Raise BudgetError with the breakdown unless the plan fits its budget."""
        if not self.fits:
            raise BudgetError(
                f"memory budget {format_size(self.budget)} is too small: drafter {self.drafter!r} needs "
                f"{format_size(self.total_bytes)}\n{self.table()}\n"
                "raise --memory-budget, choose a lighter --draft (lookup and none load only the target), "
                "or re-export with a shorter --max-context or a smaller --quant",
                self,
            )
        return self


def plan_roles(
    roles: list[RolePlan], tokenizer_bytes: int, drafter: str, budget: int | None = None,
    max_gamma: int = DEFAULT_MAX_GAMMA, source: str = "", tokenizer_note: str = "", context: int | None = None,
) -> Plan:
    """Add up the parts: runtime, tokenizer, each role's weights and KV, logits, workspace.

    Peak is the largest of two moments: loading (every weight plus the head being prepacked)
    and running (every weight plus KV, logits and workspace). Loading's extra shows as a part
    only where it is the larger."""
    parts = [
        Part("runtime", RUNTIME_BYTES, "Python, numpy, onnxruntime, tokenizers, ORT environment (measured)"),
        Part("tokenizer", tokenizer_bytes, tokenizer_note),
    ]
    for r in roles:
        if r.weights is None:
            parts.append(Part(f"weights {r.role}", 0, "runs the target's sessions: no weights of its own"))
        else:
            w, in_use = r.weights, r.weights.embed_in_use(min(context or r.arch.max_context, r.arch.max_context))
            parts.append(Part(
                f"weights {r.role}", r.packed_weights + in_use,
                f"{w.quant}{', float16 activations' if r.float16_activations else ''}, {format_size(w.stored)} on disk: "
                f"{format_size(r.packed_weights)} packed + embedding rows in use "
                f"{format_size(in_use)} (of {format_size(w.embed)} mapped)",
            ))
    for r in roles:
        if r.shares_kv_with is not None:
            parts.append(Part(f"KV {r.role}", 0, f"writes the {r.shares_kv_with} role's buffers"))
        else:
            a = r.arch
            rows = a.max_context if context is None else min(context, a.max_context)
            parts.append(Part(
                f"KV {r.role}", kv_bytes(a, context),
                f"{a.n_layers} layers x 2 x {a.n_kv_heads} KV heads x {rows} x {a.head_dim} x {a.kv_dtype}",
            ))
    target = roles[0].arch
    draft_model = any(r.weights is not None for r in roles[1:])
    logits = logits_bytes(target.vocab_size, max_gamma, draft_model)
    parts.append(Part("logits", logits, f"[{max_gamma + 1}, {target.vocab_size}] float32 + float64 probabilities"))
    loaded = [r for r in roles if r.weights is not None and r.layer_sessions]
    sessions = sum(r.layer_sessions for r in loaded)
    shared = _cut(roles[0].layer_sessions)  # as one_arena decides for the runtime
    if shared:
        workspace = max(r.session_workspace(max_gamma) for r in loaded)
    else:
        workspace = sum(r.layer_sessions * r.session_workspace(max_gamma) for r in loaded)
    kinds = "/".join(sorted({r.attention for r in loaded}))
    arenas = f"one arena for {sessions} session(s)" if shared else f"{sessions} session(s)"
    parts.append(Part("workspace", workspace, f"blocks of {largest_block(target, max_gamma)} tokens, {arenas} with layers, {kinds} attention"))
    running = sum(p.bytes for p in parts if p.name.startswith("KV ")) + logits + workspace
    transient = max((r.weights.load_transient for r in roles if r.weights is not None), default=0)
    if transient > running:
        parts.append(Part("loading", transient - running, "the head's unpacked weight while it is prepacked, beyond the above"))
    stored = sum(r.weights.stored for r in roles if r.weights is not None)
    return Plan(drafter, tuple(r.role for r in roles), tuple(parts), budget, source, stored, context)


def drafter_roles(manifest: Manifest, drafter: str) -> tuple[str, ...]:
    """The roles a drafter loads: the target, and the draft role the drafter runs, if any."""
    role = drafter_spec(drafter).draft_role(manifest.default_draft)
    if role is not None and role not in manifest.models:
        raise BundleError(f"the bundle has no {role!r} model (it has: {', '.join(manifest.models)}); re-export with the draft you want")
    return ("target",) if role is None else ("target", role)


def _stage_weights(manifest: Manifest, bundle_dir: Path, key: str, quant: str, arch: ArchInfo, head_rows: int | None = None,
                   block: int = DEFAULT_QUANT_BLOCK) -> StoredWeights:
    stage = manifest.stages[key]
    if not stage.file:
        raise BundleError(
            f"stage {key!r} has no ONNX graph (a Core ML-only bundle): the memory planner models ONNX Runtime; "
            "re-export with --format onnx to plan it"
        )
    size = sum((bundle_dir / name).stat().st_size for name in (stage.file, *stage.data_files))
    return split_stored(size, quant, arch.vocab_size, arch.hidden_size, head_rows, block, stage.embed, stage.head)


def split_stored(size: int, quant: str, vocab_rows: int, hidden_size: int, head_rows: int | None = None, block: int = DEFAULT_QUANT_BLOCK,
                 embed: bool = True, head: bool = True) -> StoredWeights:
    """`size` stored bytes of a stage split as the planner holds them: the embedding and the head
    by their formulas, the rest as the layers (and the graph itself)."""
    embed_bytes = round(vocab_rows * hidden_size * embed_bytes_per_weight(quant, block)) if embed else 0
    # A trimmed draft head (ModelInfo.trimmed_head) stores only its kept rows.
    head_bytes = round((head_rows or vocab_rows) * hidden_size * matmul_bytes_per_weight(quant, block)) if head else 0
    embed_bytes = min(embed_bytes, size)
    head_bytes = min(head_bytes, size - embed_bytes)
    return StoredWeights(quant, size - embed_bytes - head_bytes, head_bytes, embed_bytes, block)


def plan_bundle(
    manifest: Manifest, bundle_dir: str | Path, drafter: str = "auto", budget: int | None = None,
    max_gamma: int = DEFAULT_MAX_GAMMA, context: int | None = None, parallel: int = 1,
) -> Plan:
    """The plan for running a written bundle with a drafter (none, lookup, model, layer-skip,
    auto), from its manifest and the sizes of its files; nothing is loaded. context: plan for
    that many tokens in use instead of the full max context (KV rows and embedding rows are
    backed as they are used). parallel: sequences decoding at once; above 1 the target's KV
    slots for them (runtime/batch.py: a KV slot per sequence beside the Engine's own buffers)
    and their batched logits rows."""
    bundle_dir = Path(bundle_dir)
    roles, seen = [], set()
    for role in drafter_roles(manifest, drafter):
        info = manifest.models[role]
        own = [key for key in info.stages if key not in seen]
        seen.update(own)
        weights = None
        for key in own:
            stage_weights = _stage_weights(manifest, bundle_dir, key, info.quant, info.arch, info.logit_rows, info.block_size)
            weights = stage_weights if weights is None else weights + stage_weights
        layered = [manifest.stages[key] for key in own if manifest.stages[key].layers]
        # Bundles from before the fused kind have no `attention` field: they are portable.
        attention = getattr(layered[0], "attention", "portable") if layered else "fused"
        intermediate = intermediate_from_layers(info.arch, weights.layers, info.quant, info.block_size) if weights else 0
        float16 = PROFILES[manifest.device].activations == "float16"
        roles.append(RolePlan(role, info.arch, weights, len(layered), info.shares_kv_with, intermediate, attention, float16))
    tokenizer_file = bundle_dir / manifest.tokenizer.file
    tokenizer_size = tokenizer_file.stat().st_size
    note = f"{manifest.tokenizer.file} {format_size(tokenizer_size)} x {TOKENIZER_FACTOR} (measured)"
    plan = plan_roles(roles, round(tokenizer_size * TOKENIZER_FACTOR), drafter, budget, max_gamma, str(bundle_dir), note, context)
    if parallel > 1:
        arch = manifest.target.arch
        rows = arch.max_context if context is None else min(context, arch.max_context)
        slots = Part("KV slots", parallel * kv_bytes(arch, context),
                     f"{parallel} sequences batched x {arch.n_layers} layers x 2 x {arch.n_kv_heads} KV heads x {rows} x {arch.head_dim} x {arch.kv_dtype}")
        logits = Part("batched logits", parallel * arch.vocab_size * (4 + 4), f"[{parallel}, {arch.vocab_size}] float32, in the head session's arena and as numpy")
        plan = dataclasses.replace(plan, parts=(*plan.parts, slots, logits))
    return plan


def check_parallel(manifest: Manifest, bundle_dir: str | Path, drafter: str, budget: int | None, parallel: int,
                   max_gamma: int = DEFAULT_MAX_GAMMA) -> None:
    """BudgetError unless `parallel` sequences at once fit `budget`, naming the most that do."""
    if budget is None or parallel <= 1:
        return
    plan = plan_bundle(manifest, bundle_dir, drafter, budget, max_gamma, parallel=parallel)
    if not plan.fits:
        most = largest_parallel(manifest, bundle_dir, drafter, budget, max_gamma, limit=parallel)
        raise BudgetError(f"memory budget {format_size(budget)} is too small for {parallel} sequences at once "
                          f"({format_size(plan.total_bytes)}); the most that fit: {most}", plan)


def largest_parallel(manifest: Manifest, bundle_dir: str | Path, drafter: str, budget: int, max_gamma: int = DEFAULT_MAX_GAMMA, limit: int = 256) -> int:
    """The most sequences decoding at once whose plan fits `budget` (0: not even one)."""
    best = 0
    for n in range(1, limit + 1):
        if not plan_bundle(manifest, bundle_dir, drafter, budget, max_gamma, parallel=n).fits:
            break
        best = n
    return best


# -- planning an export ------------------------------------------------------------------

LAYER_SKIP_PREFIX = layer_subset.PREFIX  # export's draft spec for a layer-skip draft
QUANT_ORDER = ("fp32", "fp16", "int8", "int4")  # the order export --memory-budget steps down
MIN_BUDGET_CONTEXT = 512  # export --memory-budget halves the context down to this, no further


@dataclass(frozen=True)
class ModelFacts:
    """A checkpoint's shape, as export reads it from the Hugging Face config."""

    model_type: str
    n_layers: int
    hidden_size: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    qkv_bias: bool = False
    # A GGUF whose own blocks export keeps: at kept_quant, the target stores kept_bytes (its
    # tensor table's kept forms, export.gguf_blocks.stored_gguf), kept_head_row per LM head row.
    kept_quant: str | None = None
    kept_bytes: int = 0
    kept_head_row: int = 0

    def arch(self, max_context: int, vocab_rows: int, kv_dtype: str = "float32") -> ArchInfo:
        return ArchInfo(self.model_type, self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.hidden_size, vocab_rows, max_context, kv_dtype)

    def weights(self, quant: str, vocab_rows: int, block: int = DEFAULT_QUANT_BLOCK) -> StoredWeights:
        if quant == self.kept_quant:
            size = self.kept_bytes - (self.vocab_size - vocab_rows) * self.kept_head_row
            return split_stored(size, quant, vocab_rows, self.hidden_size, block=block)
        return predict_weights(
            quant, self.n_layers, self.hidden_size, self.n_heads, self.n_kv_heads, self.head_dim,
            self.intermediate_size, self.vocab_size, vocab_rows, self.qkv_bias, block,
        )


def plan_export(
    target: ModelFacts, quant: str, max_context: int, drafts: tuple[str, ...], draft_facts: dict[str, ModelFacts],
    budget: int | None = None, source: str = "", attention: str = "fused", device: str = "cpu", draft_vocab: int | None = None,
    block: int = DEFAULT_QUANT_BLOCK, draft_block: int | None = None,
) -> Plan:
    """The plan of the bundle export would write, run with the runtime's default drafter
    (auto: the draft model if there is one, else the layer-skip draft), before anything is
    written. drafts: export's specs, model specs (keys of draft_facts) and/or "layer-skip:N".
    draft_vocab: the rows a trimmed draft head keeps (export --draft-vocab); block: weights per
    int4/int8 scale (export --block-size); draft_block: the draft model's (None: block)."""
    profile = PROFILES[device]
    float16 = profile.activations == "float16"
    layer_skips = [d for d in drafts if d.startswith(LAYER_SKIP_PREFIX)]
    models = [draft_facts[d] for d in drafts if not d.startswith(LAYER_SKIP_PREFIX)]
    vocab_rows = min([target.vocab_size] + [m.vocab_size for m in models])
    target_arch = target.arch(max_context, vocab_rows, profile.kv_dtype)
    weights = target.weights(quant, vocab_rows, block)
    sessions = 1
    if layer_skips:
        # One session per segment of the cut target; auto's cut is chosen later: planned at its most.
        kept = layer_subset.parse(layer_skips[0], target.n_layers).kept
        sessions = len(layer_subset.segments(kept, target.n_layers)) if kept else 2 * layer_subset.MAX_SKIPPED_RUNS + 1
    roles = [RolePlan("target", target_arch, weights, sessions, None, target.intermediate_size, attention, float16)]
    if models:
        draft = models[0]
        roles.append(RolePlan(
            "draft", draft.arch(max_context, vocab_rows, profile.kv_dtype), draft.weights(quant, min(draft_vocab or vocab_rows, vocab_rows), block if draft_block is None else draft_block), 1, None,
            draft.intermediate_size, attention, float16,
        ))
    elif layer_skips:
        # Its layers are the target's (auto's are chosen later): it adds no weights and shares the KV.
        roles.append(RolePlan("layer_skip", dataclasses.replace(target_arch, n_layers=len(kept) if kept else target.n_layers), None, 0, "target"))
    tokenizer = target.vocab_size * TOKENIZER_BYTES_PER_TOKEN
    note = f"{target.vocab_size} tokens x {TOKENIZER_BYTES_PER_TOKEN} B (measured)"
    return plan_roles(roles, tokenizer, "auto", budget, source=source, tokenizer_note=note)


@dataclass(frozen=True)
class ExportChoice:
    quant: str
    max_context: int
    drafts: tuple[str, ...]
    plan: Plan
    changes: tuple[str, ...]  # what differs from the request, in words; () when it fits as asked

    def summary(self) -> str:
        chosen = "; ".join(self.changes) if self.changes else "the request fits as asked"
        return f"memory budget {format_size(self.plan.budget)}: {chosen} (plan {format_size(self.plan.total_bytes)})"


def choose_export(
    target: ModelFacts, quant: str, max_context: int, drafts: tuple[str, ...], draft_facts: dict[str, ModelFacts],
    budget: int, source: str = "", attention: str = "fused", device: str = "cpu", draft_vocab: int | None = None,
    block: int = DEFAULT_QUANT_BLOCK, draft_block: int | None = None,
) -> ExportChoice:
    """The first export that fits the budget, giving up the least-valued thing first: the
    longest context (halved, not below MIN_BUDGET_CONTEXT), then the draft model (a
    layer-skip draft, if asked for, adds no weights; without one the runtime drafts by prompt
    lookup), then precision (fp32 -> fp16 -> int8 -> int4). Each lighter draft or precision is
    tried from the requested context down again. Raises BudgetError with the lightest plan."""
    contexts = [max_context]
    while contexts[-1] // 2 >= MIN_BUDGET_CONTEXT:
        contexts.append(contexts[-1] // 2)
    lighter = tuple(d for d in drafts if d.startswith(LAYER_SKIP_PREFIX))
    draft_options = [drafts] + ([lighter] if lighter != drafts else [])
    quants = [q for q in QUANT_ORDER[QUANT_ORDER.index(quant) :] if q in PROFILES[device].quants]
    plan = None
    for q in quants:
        for option in draft_options:
            for context in contexts:
                plan = plan_export(target, q, context, option, draft_facts, budget, source, attention, device, draft_vocab, block, draft_block)
                if plan.fits:
                    changes = []
                    if context != max_context:
                        changes.append(f"max context {context} (asked {max_context})")
                    if option != drafts:
                        dropped = ", ".join(d for d in drafts if d not in option)
                        kept = f"drafts by {', '.join(option)}" if option else "drafts by prompt lookup"
                        changes.append(f"no draft model ({dropped} dropped; {kept})")
                    if q != quant:
                        changes.append(f"{q} weights (asked {quant})")
                    return ExportChoice(q, context, option, plan, tuple(changes))
    raise BudgetError(
        f"nothing fits a memory budget of {format_size(budget)}: even {quants[-1]} weights, max context "
        f"{contexts[-1]} and {', '.join(draft_options[-1]) or 'no draft model'} need {format_size(plan.total_bytes)}\n"
        f"{plan.table()}\nraise --memory-budget or export a smaller model",
        plan,
    )
