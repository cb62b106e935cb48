"""Static placement: does a provider have a kernel for every node of a bundle's stage graphs?

For each node: its domain and op type, its schema version at the graph's opset, and the element
type of each input and output, checked against the provider's kernel table (edge_spec/kernels/*.json:
the CPU and CUDA ones read from the pinned ONNX Runtime builds' own registries, DirectML from
ONNX Runtime's published OperatorKernels.md for its pinned release, Core ML from its EP's
documented operator list and the builders in its pinned build; each file records its source). A node without a kernel would run on the CPU, or,
with CPU fallback disabled as the runtime does on GPUs, fail the session.

Types are read from the graph (inputs, initializers, value_info) and carried through the ops
the exporter emits by the rules below, because ONNX's own inference does not know the
com.microsoft ops.

A kernel that exists for the types is not one that computes what the graph means: the kernel
facts (edge_spec/kernels/semantics.json, each read from the kernel's source, file and commit
recorded) name the nodes a provider would run but compute something else for (DirectML's
GroupQueryAttention skips rotary), would not take (the Core ML EP's shape limits), or has no
kernel for before some onnxruntime release. Those nodes are the report's `facts`, apart from
the `misses` (no kernel for the types), and fail the check as they do.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
TABLES = {"cpu": "cpu.json", "cuda": "cuda.json", "dml": "dml.json", "coreml": "coreml.json"}
FACTS_FILE = "semantics.json"
FACT_RULES = ("attribute_ignored", "multi_token_with_past", "input_required", "input_shape", "min_onnxruntime")


class PlacementError(Exception):
    """The graph or the table cannot be read."""


@dataclass(frozen=True)
class Miss:
    stage: str
    node: str
    op: str  # domain::op_type
    reason: str
    source: str = ""  # a kernel fact's source: file@commit
    detail: str = ""  # what in this node a kernel fact matched


@dataclass(frozen=True)
class KernelFact:
    """What one provider's kernel does with a node, read from the kernel's source (one entry
    of edge_spec/kernels/semantics.json; its `about` describes the rules)."""

    provider: str
    op: str  # domain::op_type, or * for every node
    rule: str  # FACT_RULES
    reason: str
    source: dict  # file, commit, reads, pinned
    attribute: str = ""  # attribute_ignored
    default: int = 0  # attribute_ignored: the value the kernel behaves as if set
    past_input: int = -1  # multi_token_with_past
    input: int = -1  # input_required
    max_dim: int = 0  # input_shape
    max_rank: int = 0  # input_shape
    version: str = ""  # min_onnxruntime

    def __post_init__(self):
        where = f"kernel fact {self.provider} {self.op} {self.rule}"
        if self.provider not in TABLES:
            raise PlacementError(f"{where}: unknown provider (tables: {', '.join(TABLES)})")
        if self.rule not in FACT_RULES:
            raise PlacementError(f"{where}: unknown rule (rules: {', '.join(FACT_RULES)})")
        if not self.reason or not self.source.get("file") or len(self.source.get("commit", "")) != 40:
            raise PlacementError(f"{where}: needs a reason and its source file and 40-digit commit")
        needs = {"attribute_ignored": self.attribute, "multi_token_with_past": self.past_input >= 0, "input_required": self.input >= 0,
                 "input_shape": self.max_dim > 0 and self.max_rank > 0, "min_onnxruntime": version_key(self.version) if self.version else ()}
        if not needs[self.rule]:
            raise PlacementError(f"{where}: the rule's parameters are missing")

    def cites(self) -> str:
        return f"{self.source['file'].rsplit('/', 1)[-1]}@{self.source['commit'][:9]}"


def version_key(version: str) -> tuple[int, ...]:
    """'1.23.0' -> (1, 23, 0); a local or dev suffix ('1.22.0+jp6', '1.23.0.dev1') is ignored."""
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
        if not digits:
            raise PlacementError(f"{version!r} is not an onnxruntime version (like 1.23.0)")
        parts.append(int(digits))
    return tuple(parts)


@dataclass
class PlacementReport:
    provider: str
    table_source: str
    nodes: int = 0
    misses: list[Miss] = field(default_factory=list)  # no kernel for the node's op and types
    facts: list[Miss] = field(default_factory=list)  # a kernel exists but a kernel fact says it is wrong here

    @property
    def ok(self) -> bool:
        return not self.misses and not self.facts

    def by_op(self) -> dict[str, list[Miss]]:
        return _grouped(self.misses)

    def facts_by_op(self) -> dict[str, list[Miss]]:
        return _grouped(self.facts)

    def summary(self) -> str:
        if self.ok:
            return f"all {self.nodes} nodes have a {self.provider} kernel that computes what the graph means"
        parts = []
        if self.misses:
            groups = [f"{op.split('::')[-1]} x{len(ms)} ({ms[0].reason})" for op, ms in self.by_op().items()]
            parts.append(f"{len(self.misses)} of {self.nodes} nodes have no {self.provider} kernel: " + "; ".join(groups))
        if self.facts:
            reasons = _grouped(self.facts, key=lambda m: (m.op, m.reason))
            groups = [f"{op.split('::')[-1]} x{len(ms)} ({reason})" for (op, reason), ms in reasons.items()]
            parts.append(f"{len({m.node for m in self.facts})} nodes would not run as the graph means on {self.provider}: " + "; ".join(groups))
        return "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "provider": self.provider, "table_source": self.table_source, "nodes": self.nodes, "ok": self.ok,
            "missing": {op: [{"stage": m.stage, "node": m.node, "reason": m.reason} for m in ms] for op, ms in self.by_op().items()},
            "kernel_facts": {op: [{"stage": m.stage, "node": m.node, "reason": m.reason, "detail": m.detail, "source": m.source} for m in ms]
                             for op, ms in self.facts_by_op().items()},
        }


def _grouped(misses: list[Miss], key=lambda m: m.op) -> dict:
    groups: dict = defaultdict(list)
    for miss in misses:
        groups[key(miss)].append(miss)
    return dict(sorted(groups.items()))


@lru_cache(maxsize=None)
def load_table(provider: str) -> dict:
    if provider not in TABLES:
        raise PlacementError(f"no kernel table for provider {provider!r} (tables: {', '.join(TABLES)})")
    return json.loads((KERNELS_DIR / TABLES[provider]).read_text())


@lru_cache(maxsize=None)
def load_facts(provider: str) -> tuple[KernelFact, ...]:
    """The kernel facts recorded for `provider` (none for the CPU)."""
    data = json.loads((KERNELS_DIR / FACTS_FILE).read_text())
    facts = []
    for entry in data["facts"]:
        try:
            fact = KernelFact(**entry)
        except TypeError as exc:
            raise PlacementError(f"{FACTS_FILE}: an entry for {entry.get('provider')} {entry.get('op')}: {exc}") from None
        if fact.provider == provider:
            facts.append(fact)
    return tuple(facts)


def input_dim_limit(provider: str) -> int | None:
    """The largest dimension a node input may have on `provider` (its input_shape kernel fact), or None."""
    return next((f.max_dim for f in load_facts(provider) if f.rule == "input_shape"), None)


def _elem_names() -> dict[int, str]:
    from onnx import TensorProto

    return {value: name.lower() for name, value in TensorProto.DataType.items()}


_SAME_AS_FIRST = {
    "Add", "Sub", "Mul", "Div", "Pow", "Neg", "Sqrt", "Sigmoid", "Tanh", "Erf", "Cos", "Sin", "Softmax", "ReduceMean",
    "ReduceMax", "Max", "Min", "Reshape", "Transpose", "Unsqueeze", "Squeeze", "Expand", "Tile", "Slice", "Split",
    "Concat", "Identity", "Trilu", "Range", "MatMul", "Gather", "MatMulNBits", "SimplifiedLayerNormalization",
    "SkipSimplifiedLayerNormalization", "LayerNormalization", "RMSNormalization", "RotaryEmbedding", "FastGelu",
    "Gelu", "QuickGelu",
}
_BOOL_OUT = {"Less", "LessOrEqual", "Greater", "GreaterOrEqual", "Equal", "Not", "And", "Or"}


def _output_types(node, types: list[str | None], elem: dict[int, str]) -> list[str | None]:
    """Element types of a node's outputs from its inputs' (None where unknown)."""
    op, n = node.op_type, len(node.output)
    attrs = {a.name: a for a in node.attribute}
    if op == "Cast":
        return [elem[attrs["to"].i]]
    if op in ("Shape", "ArgMax", "Size"):
        return ["int64"] * n
    if op in _BOOL_OUT:
        return ["bool"] * n
    if op == "Constant":
        return [elem[attrs["value"].t.data_type]] if "value" in attrs else [None]
    if op == "ConstantOfShape":
        return [elem[attrs["value"].t.data_type] if "value" in attrs else "float"]
    if op == "Where":
        return [types[1]]
    if op == "GatherBlockQuantized":
        return [types[2]]  # the scales' type
    if op == "GroupQueryAttention":
        return [types[0], types[3], types[4]][:n]
    if op in ("SimplifiedLayerNormalization", "LayerNormalization"):
        return [types[0]] + ["float"] * (n - 1)
    if op in _SAME_AS_FIRST:
        return [types[0]] * n
    return [None] * n


def _op_version(domain: str, op_type: str, opset: int) -> int:
    """The op's schema since-version at this opset, which kernels are registered by (Add in an
    opset-20 graph is Add-14); ONNX Runtime's own ops, unknown to onnx, keep the opset."""
    from onnx import defs

    try:
        return defs.get_schema(op_type, opset, "" if domain == "ai.onnx" else domain).since_version
    except defs.SchemaError:
        return opset


def _matches(kernel: dict, version: int, in_types: list[str | None], out_types: list[str | None], constant: list[bool]) -> str | None:
    """None if the kernel takes these types at this op version, else why not."""
    until = kernel.get("until")
    if version < kernel["since"] or (until is not None and version > until):
        return f"op version {version} outside {kernel['since']}..{until if until is not None else ''}"
    for i in kernel.get("constant_inputs", ()):
        if i < len(constant) and not constant[i]:
            return f"input {i} must be a constant initializer"
    for kind, slots, actual in (("input", kernel["inputs"], in_types), ("output", kernel["outputs"], out_types)):
        for i, dtype in enumerate(actual):
            if i < len(slots):
                slot = slots[i]
            elif kernel.get(f"variadic_last_{kind}") and slots:
                slot = slots[-1]
            else:
                continue
            if dtype is None:
                continue
            allowed = [slot[1:]] if slot.startswith("=") else kernel["types"].get(slot)
            if allowed is not None and dtype not in allowed:
                return f"{kind} {i} is {dtype}, kernels take {'/'.join(allowed)}"
    return None


def _merged(reasons: list[str]) -> str:
    """One reason for a node no kernel entry takes: the entries of its op version that refuse
    the same input or output, with the types they take together."""
    typed = [r for r in reasons if ", kernels take " in r]
    if not typed:
        return reasons[0]
    slot = typed[0].split(", kernels take ")[0]
    allowed = []
    for reason in typed:
        head, types = reason.split(", kernels take ")
        if head == slot:
            allowed += [t for t in types.split("/") if t not in allowed]
    return f"{slot}, kernels take {'/'.join(allowed)}"


def _shapes(model) -> dict[str, tuple]:
    """Each value's shape as far as ONNX's inference knows it (None for a symbolic dimension);
    values after an op onnx does not know (the com.microsoft ones) stay unknown."""
    from onnx import shape_inference

    try:
        graph = shape_inference.infer_shapes(model).graph
    except Exception:  # onnx's inference errors have no common type; fall back to the declared shapes
        graph = model.graph
    shapes: dict[str, tuple] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.HasField("shape"):
            shapes[value.name] = tuple(d.dim_value if d.HasField("dim_value") else None for d in value.type.tensor_type.shape.dim)
    for init in graph.initializer:
        shapes[init.name] = tuple(init.dims)
    for node in graph.node:
        if node.op_type == "Constant":
            value = next((a.t for a in node.attribute if a.name == "value"), None)
            if value is not None:
                shapes[node.output[0]] = tuple(value.dims)
    return shapes


def _fact_applies(fact: KernelFact, node, shapes: dict[str, tuple], onnxruntime: str | None) -> str | None:
    """What in this node the fact matched ("" when the op alone says it), or None if it does not apply."""
    from onnx import helper

    if fact.rule == "attribute_ignored":
        value = next((helper.get_attribute_value(a) for a in node.attribute if a.name == fact.attribute), fact.default)
        return f"{fact.attribute}={value}" if value != fact.default else None
    if fact.rule == "multi_token_with_past":
        has_past = len(node.input) > fact.past_input and node.input[fact.past_input]
        query = shapes.get(node.input[0], ())
        # The runtime's verify passes and prefill chunks are T > 1 unless the graph fixes T at 1.
        return "" if has_past and not (len(query) > 1 and query[1] == 1) else None
    if fact.rule == "input_required":
        present = len(node.input) > fact.input and node.input[fact.input]
        return None if present else f"the node has {len([i for i in node.input if i])} inputs"
    if fact.rule == "input_shape":
        for name in node.input:
            shape = shapes.get(name) if name else None
            if shape is None:
                continue
            known = [d for d in shape if d is not None]
            if any(d > fact.max_dim for d in known) or 0 in known or len(shape) > fact.max_rank:
                dims = "x".join("?" if d is None else str(d) for d in shape) or "scalar"
                return f"input {name} is {dims}"
        return None
    if fact.rule == "min_onnxruntime":
        try:
            older = bool(onnxruntime) and version_key(onnxruntime) < version_key(fact.version)
        except PlacementError:  # an installed build's odd version string: nothing to compare
            older = False
        return f"onnxruntime {onnxruntime}" if older else None
    raise PlacementError(f"no check for kernel fact rule {fact.rule!r}")


def check_graph(path: Path, provider: str, stage: str = "", onnxruntime: str | None = None) -> PlacementReport:
    """Every node of one ONNX graph (no weights loaded) against `provider`'s kernel table and
    kernel facts; `onnxruntime`: the release the graph will run on (default: the table's own),
    for the facts that name the first release a kernel exists in."""
    import onnx

    table = load_table(provider)
    facts = load_facts(provider)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # a truncated or foreign file: protobuf's own error types
        raise PlacementError(f"{path} is not an ONNX graph ({type(exc).__name__})") from None
    elem = _elem_names()
    opsets = {(o.domain or "ai.onnx"): o.version for o in model.opset_import}
    graph = model.graph
    types: dict[str, str | None] = {}
    for value in [*graph.input, *graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            types[value.name] = elem[value.type.tensor_type.elem_type]
    for init in graph.initializer:
        types[init.name] = elem[init.data_type]
    constants = {init.name for init in graph.initializer}
    shapes = _shapes(model) if any(f.rule in ("input_shape", "multi_token_with_past") for f in facts) else {}
    report = PlacementReport(provider, table.get("source", ""))
    kernels = table["kernels"]
    for node in graph.node:
        domain = node.domain or "ai.onnx"
        if (domain, node.op_type) == ("ai.onnx", "Constant"):
            # ONNX Runtime turns Constant nodes into initializers at load: no provider runs one.
            types[node.output[0]] = _output_types(node, [], elem)[0]
            constants.add(node.output[0])
            continue
        report.nodes += 1
        key = f"{domain}::{node.op_type}"
        in_types = [types.get(name) if name else None for name in node.input]
        inferred = _output_types(node, in_types, elem)
        for name, dtype in zip(node.output, inferred):
            if name and name not in types:
                types[name] = dtype
        out_types = [types.get(name) for name in node.output]
        registered = kernels.get(key)
        if not registered:
            report.misses.append(Miss(stage, node.name, key, f"no {provider} kernel"))
            continue
        version = _op_version(domain, node.op_type, opsets.get(domain, 1))
        constant = [name in constants for name in node.input]
        reasons = [_matches(k, version, in_types, out_types, constant) for k in registered]
        if all(reasons):
            report.misses.append(Miss(stage, node.name, key, _merged(reasons)))
            continue
        for fact in facts:
            if fact.op in (key, "*"):
                detail = _fact_applies(fact, node, shapes, onnxruntime)
                if detail is not None:
                    report.facts.append(Miss(stage, node.name, key, fact.reason, fact.cites(), detail))
    return report


def check_bundle(manifest, bundle_dir: Path, provider: str, onnxruntime: str | None = None) -> PlacementReport:
    """Every stage graph of a bundle (Core ML-only stages have none) against `provider`."""
    total = PlacementReport(provider, load_table(provider).get("source", ""))
    for key, stage in manifest.stages.items():
        if not stage.file:
            continue
        part = check_graph(Path(bundle_dir) / stage.file, provider, key, onnxruntime)
        total.nodes += part.nodes
        total.misses += part.misses
        total.facts += part.facts
    return total
