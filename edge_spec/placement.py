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
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parent / "kernels"
TABLES = {"cpu": "cpu.json", "cuda": "cuda.json", "dml": "dml.json", "coreml": "coreml.json"}


class PlacementError(Exception):
    """The graph or the table cannot be read."""


@dataclass(frozen=True)
class Miss:
    stage: str
    node: str
    op: str  # domain::op_type
    reason: str


@dataclass
class PlacementReport:
    provider: str
    table_source: str
    nodes: int = 0
    misses: list[Miss] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.misses

    def by_op(self) -> dict[str, list[Miss]]:
        groups: dict[str, list[Miss]] = defaultdict(list)
        for miss in self.misses:
            groups[miss.op].append(miss)
        return dict(sorted(groups.items()))

    def summary(self) -> str:
        if self.ok:
            return f"all {self.nodes} nodes have a {self.provider} kernel"
        parts = [f"{op.split('::')[-1]} x{len(ms)} ({ms[0].reason})" for op, ms in self.by_op().items()]
        return f"{len(self.misses)} of {self.nodes} nodes have no {self.provider} kernel: " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "provider": self.provider, "table_source": self.table_source, "nodes": self.nodes, "ok": self.ok,
            "missing": {op: [{"stage": m.stage, "node": m.node, "reason": m.reason} for m in ms] for op, ms in self.by_op().items()},
        }


@lru_cache(maxsize=None)
def load_table(provider: str) -> dict:
    if provider not in TABLES:
        raise PlacementError(f"no kernel table for provider {provider!r} (tables: {', '.join(TABLES)})")
    return json.loads((KERNELS_DIR / TABLES[provider]).read_text())


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


def check_graph(path: Path, provider: str, stage: str = "") -> PlacementReport:
    """Every node of one ONNX graph (no weights loaded) against `provider`'s kernel table."""
    import onnx

    table = load_table(provider)
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
    return report


def check_bundle(manifest, bundle_dir: Path, provider: str) -> PlacementReport:
    """Every stage graph of a bundle (Core ML-only stages have none) against `provider`."""
    total = PlacementReport(provider, load_table(provider).get("source", ""))
    for key, stage in manifest.stages.items():
        if not stage.file:
            continue
        part = check_graph(Path(bundle_dir) / stage.file, provider, key)
        total.nodes += part.nodes
        total.misses += part.misses
    return total
