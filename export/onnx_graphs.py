"""Trace a StageModule to an ONNX graph with a variable block length T, then merge the
projections that read the same activation (q/k/v, gate/up) into one MatMul each."""

from __future__ import annotations

import warnings
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper
from onnx.external_data_helper import ExternalDataInfo, uses_external_data
import torch
from torch import nn

from edge_spec import names, placement
from export.static_cache import StageModule


class _NamedInputs(nn.Module):
    """Presents exactly the stage's named inputs to the exporter (a head-only stage has no
    kv_len, a stage without the head has no logit_positions), mapped onto StageModule.forward."""

    def __init__(self, stage: StageModule, input_names: list[str]):
        super().__init__()
        self.stage = stage
        self.input_names = input_names

    def forward(self, *args):
        by_name = dict(zip(self.input_names, args))
        x = by_name.get(names.INPUT_IDS, by_name.get(names.HIDDEN_IN))
        past = args[len(self.input_names) - 2 * len(self.stage.layers) :] if len(self.stage.layers) else ()
        if names.SEQLENS_K in by_name:
            position = (by_name[names.SEQLENS_K], by_name[names.TOTAL_SEQ_LEN])
        elif names.POSITION_IDS in by_name:
            position = (by_name[names.POSITION_IDS], by_name[names.ATTENTION_BIAS])
        else:
            position = by_name.get(names.KV_LEN)
        return self.stage(x, position, by_name.get(names.LOGIT_POSITIONS), *past)


class _TransposedLinear(nn.Module):
    """nn.Linear with its weight stored [in, out]: traced, MatMul reads it as is. Tracing a
    Linear folds Transpose(weight) into a second copy of every matrix while the first is alive."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight_t = nn.Parameter(linear.weight.detach().t().contiguous(), requires_grad=False)  # [in, out]
        self.bias = linear.bias

    def forward(self, x):
        y = torch.matmul(x, self.weight_t)
        return y if self.bias is None else y + self.bias


def pretranspose_linears(module: nn.Module) -> None:
    """Replace, in place and one at a time, every nn.Linear under `module` by a _TransposedLinear
    (same outputs): the peak is one matrix more, not the model twice."""
    for name, child in list(module.named_children()):
        if isinstance(child, nn.Linear):
            setattr(module, name, _TransposedLinear(child))
            child.weight = None
            del child
        else:
            pretranspose_linears(child)


def trace_stage(stage: StageModule, layers: range, max_context: int, hidden_size: int, path: Path) -> None:
    """Trace one stage into `path` as torch writes it (weights inline, or one file per tensor
    beside it past 2 GB); finish_stage makes it the stage graph once the torch model is gone.
    The stage's Linear layers are pre-transposed in place first (the checkpoint's modules: the
    exporter owns them)."""
    pretranspose_linears(stage.layers)
    input_names = names.stage_inputs(stage.embed, stage.head, layers, stage.attention)
    output_names = names.stage_outputs(stage.head, layers, stage.attention)
    block = 3  # any T > 1 so the exporter keeps T symbolic
    # Fused graphs take a batch of sequences (batched decoding, one KV slot each): B > 1 keeps it symbolic too.
    batch = 2 if stage.attention == "fused" else 1
    kv_len = 2
    example = {
        names.INPUT_IDS: torch.zeros((batch, block), dtype=torch.int64),
        names.HIDDEN_IN: torch.zeros((batch, block, hidden_size), dtype=torch.float32),
        names.KV_LEN: torch.tensor([kv_len], dtype=torch.int64),
        names.SEQLENS_K: torch.tensor([kv_len + block - 1] * batch, dtype=torch.int32),
        names.TOTAL_SEQ_LEN: torch.tensor(kv_len + block, dtype=torch.int32),
        names.POSITION_IDS: torch.arange(kv_len, kv_len + block, dtype=torch.int64),
        names.ATTENTION_BIAS: torch.from_numpy(names.position_feeds([names.POSITION_IDS], kv_len, block, max_context)[names.ATTENTION_BIAS]),
        names.LOGIT_POSITIONS: torch.arange(block, dtype=torch.int64),
    }
    kv_shape = (batch, stage.n_kv_heads, max_context, stage.head_dim)
    args = []
    for name in input_names:
        args.append(example[name] if name in example else torch.zeros(kv_shape, dtype=torch.float32))
    dynamic_axes = {names.INPUT_IDS: {1: "T"}, names.HIDDEN_IN: {1: "T"}, names.LOGIT_POSITIONS: {0: "N"}, names.POSITION_IDS: {0: "T"}}
    dynamic_axes[names.ATTENTION_BIAS] = {0: "T", 1: "P_PLUS_T" if stage.dynamic_past else "MAX_PLUS_T"}
    if stage.dynamic_past:
        dynamic_axes.update({n: {2: "P"} for n in input_names if n.startswith("past_")})
    dynamic_axes.update({n: {1: "N"} for n in (names.LOGITS,)})
    dynamic_axes.update({names.HIDDEN_OUT: {1: "T"}})
    dynamic_axes.update({n: {2: "T"} for n in output_names if n.startswith("new_")})
    if batch > 1:
        for name in (names.INPUT_IDS, names.HIDDEN_IN, names.HIDDEN_OUT, names.LOGITS):
            dynamic_axes[name] = {0: "B", **dynamic_axes[name]}
        dynamic_axes[names.SEQLENS_K] = {0: "B"}
        dynamic_axes.update({n: {0: "B"} for n in (*input_names, *output_names) if n.startswith(("past_", "present_"))})
    dynamic_axes = {k: v for k, v in dynamic_axes.items() if k in input_names or k in output_names}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.no_grad():
            torch.onnx.export(
                _NamedInputs(stage, input_names).eval(),
                tuple(args),
                str(path),
                input_names=input_names,
                output_names=output_names,
                dynamic_axes=dynamic_axes,
                opset_version=20,  # ≥ 18 so reductions take axes as inputs, as the int4 quantizer (opset 21) expects
                do_constant_folding=True,
                dynamo=False,
                custom_opsets={"com.microsoft": 1},
            )


class StageWeights:
    """The initializers of a graph loaded without its external data, read one at a time when
    asked: a stage's weights are gigabytes, and holding them all while rewriting the graph is
    what set the export's peak. A merged weight is the concatenation of its sources, read then."""

    def __init__(self, folder: Path | None):
        self.folder = folder
        self.merged: dict[str, tuple[list[onnx.TensorProto], int]] = {}  # name -> (sources, axis)

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        if tensor.name in self.merged:
            sources, axis = self.merged[tensor.name]
            return np.concatenate([self.array(t) for t in sources], axis=axis)
        if not uses_external_data(tensor):
            return numpy_helper.to_array(tensor)
        info = ExternalDataInfo(tensor)
        dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
        count = int(np.prod(tensor.dims, dtype=np.int64))
        with open(self.folder / info.location, "rb") as f:
            f.seek(info.offset or 0)
            data = np.fromfile(f, dtype=dtype, count=count)
        if data.size != count:
            raise RuntimeError(f"{tensor.name}: {info.location} holds {data.size} of its {count} values")
        return data.reshape(tuple(tensor.dims))

    def tensor(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        """The initializer with its data inline."""
        return numpy_helper.from_array(self.array(tensor), tensor.name)


def _external_part(path: Path) -> onnx.ModelProto:
    """The traced part at `path` with every tensor over 1 KiB in a data file beside it (torch
    writes a graph under 2 GB inline), loaded without those bytes."""
    from onnx.external_data_helper import convert_model_to_external_data

    model = onnx.load(str(path), load_external_data=False)
    if any(t.HasField("raw_data") and len(t.raw_data) >= 1024 for t in model.graph.initializer):
        convert_model_to_external_data(model, all_tensors_to_one_file=True, location=path.name + ".data", size_threshold=1024)
        onnx.save_model(model, str(path))
        model = onnx.load(str(path), load_external_data=False)
    return model


def stitch_parts(paths: list[Path], input_names: list[str], output_names: list[str]) -> tuple[onnx.ModelProto, StageWeights]:
    """One stage graph from the parts traced in order (each in its own folder under one
    parent): part i's hidden_out feeds part i+1's hidden_in; every other name but the
    contract's inputs and outputs gets the part's prefix. A small constant that several parts
    carry (the rotary tables) is kept once. No bytes are read but those of small constants."""
    folder = paths[0].parent.parent
    weights = StageWeights(folder)
    contract = set(input_names) | set(output_names)
    nodes: list[onnx.NodeProto] = []
    initializers: list[onnx.TensorProto] = []
    inputs: dict[str, onnx.ValueInfoProto] = {}
    outputs: dict[str, onnx.ValueInfoProto] = {}
    shared: dict[tuple, str] = {}  # (unprefixed name, dims, bytes) of a small constant -> its name
    last = len(paths) - 1
    first = None
    for index, path in enumerate(paths):
        part = _external_part(path)
        first = part if first is None else first
        prefix = f"{path.parent.name}/"
        renames: dict[str, str] = {}

        def rename(name: str) -> str:
            if name == "":
                return name
            if name == names.HIDDEN_IN and index > 0:
                return f"{paths[index - 1].parent.name}/{names.HIDDEN_OUT}"
            if name == names.HIDDEN_OUT and index < last:
                return prefix + name
            if name in contract:
                return name
            return renames.get(name, prefix + name)

        for tensor in part.graph.initializer:
            entry = next((e for e in tensor.external_data if e.key == "location"), None)
            if entry is not None:
                entry.value = prefix + entry.value
            if int(np.prod(tensor.dims, dtype=np.int64)) * 4 <= 1 << 24:
                array = weights.array(tensor)
                key = (tensor.name, tuple(tensor.dims), tensor.data_type, array.tobytes())
                if key in shared:
                    renames[tensor.name] = shared[key]
                    continue
                shared[key] = prefix + tensor.name
            tensor.name = prefix + tensor.name
            initializers.append(tensor)
        for node in part.graph.node:
            if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute):
                raise RuntimeError(f"{path}: node {node.name} has a subgraph, which stitching does not rename")
            node.input[:] = [rename(n) for n in node.input]
            node.output[:] = [rename(n) for n in node.output]
            node.name = prefix + node.name
            nodes.append(node)
        for value in part.graph.input:
            if rename(value.name) in contract:
                inputs.setdefault(value.name, value)
        for value in part.graph.output:
            if rename(value.name) in contract:
                outputs[value.name] = value
    missing = [n for n in (*input_names, *output_names) if n not in inputs and n not in outputs]
    if missing:
        raise RuntimeError(f"stitched parts lack the contract's {missing}")
    graph = helper.make_graph(nodes, first.graph.name, [inputs[n] for n in input_names], [outputs[n] for n in output_names], initializers)
    model = helper.make_model(graph, opset_imports=list(first.opset_import), ir_version=first.ir_version, producer_name=first.producer_name)
    return model, weights


def finish_stage(paths: list[Path], input_names: list[str], output_names: list[str]) -> tuple[onnx.ModelProto, StageWeights]:
    """The traced parts as one stage graph: inputs checked against the contract, parallel
    projections merged. The graph comes without its weights' bytes; they stay in the parts'
    files and the returned StageWeights reads them (export/quantize.py writes the stage)."""
    model, weights = stitch_parts(paths, input_names, output_names)
    got_inputs = [i.name for i in model.graph.input]
    if got_inputs != input_names:
        raise RuntimeError(f"exported graph inputs {got_inputs} differ from the contract {input_names}")
    merge_parallel_matmuls(model, weights)
    return model, weights


def merge_parallel_matmuls(model: onnx.ModelProto, weights: StageWeights) -> int:
    """Rewrite, in place, each set of MatMuls that multiply the same activation by constant
    [K, N_i] weights into one MatMul by the concatenated [K, sum N_i] weight and a Split whose
    outputs keep the original names. The merged weight is registered with `weights` (read when
    written, from its sources) and carries no bytes itself. Returns how many MatMuls were merged away.

    Why: a decode pass streams every weight once, and one larger kernel call (q/k/v: 3 -> 1,
    gate/up: 2 -> 1 per layer) costs less than several small ones. Block quantization runs
    along K per output column, so the quantized weights are the same numbers either way.
    """
    graph = model.graph
    # Masked graphs (Core ML's, and DirectML's) keep each merged weight within the Core ML EP's
    # input limit (a kernel fact): Qwen2.5-1.5B's gate/up would be 17,920 wide. So do graphs
    # without layers, whose only parallel MatMuls are an LM head cut into slices for that limit.
    inputs = {i.name for i in graph.input}
    limited = names.ATTENTION_BIAS in inputs or not any(name.startswith("past_") for name in inputs)
    width = placement.input_dim_limit("coreml") if limited else None
    initializers = {t.name: t for t in graph.initializer}
    uses: dict[str, int] = defaultdict(int)
    for node in graph.node:
        for name in node.input:
            uses[name] += 1
    groups: dict[str, list[int]] = defaultdict(list)  # activation -> indices of its MatMuls
    for index, node in enumerate(graph.node):
        weight = initializers.get(node.input[1]) if node.op_type == "MatMul" else None
        # A weight shared with another node (tied) must stay whole where it is.
        if weight is not None and len(weight.dims) == 2 and uses[weight.name] == 1:
            groups[node.input[0]].append(index)
    replaced: dict[int, list[onnx.NodeProto]] = {}  # first member's index -> MatMul + Split
    dropped_nodes: set[int] = set()
    dropped_weights: set[str] = set()
    for x, members in groups.items():
        if len(members) < 2:
            continue
        nodes = [graph.node[i] for i in members]
        sources = [initializers[n.input[1]] for n in nodes]  # each [K, N_i]
        if len({(t.dims[0], t.data_type) for t in sources}) != 1 or (width and sum(t.dims[1] for t in sources) > width):
            continue
        stem = nodes[0].output[0] + ".merged"
        merged = onnx.TensorProto(name=stem + ".weight", data_type=sources[0].data_type, dims=[sources[0].dims[0], sum(t.dims[1] for t in sources)])
        weights.merged[merged.name] = ([onnx.TensorProto.FromString(t.SerializeToString()) for t in sources], 1)
        sizes = numpy_helper.from_array(np.array([t.dims[1] for t in sources], dtype=np.int64), stem + ".sizes")
        graph.initializer.extend([merged, sizes])
        replaced[members[0]] = [
            helper.make_node("MatMul", [x, merged.name], [stem], name=stem),
            helper.make_node("Split", [stem, sizes.name], [n.output[0] for n in nodes], name=stem + ".split", axis=-1),
        ]
        dropped_nodes.update(members)
        dropped_weights.update(n.input[1] for n in nodes)
    if not replaced:
        return 0
    # Every member reads x, which exists before the first member: the merged pair at the first
    # member's place keeps the node list topologically sorted.
    rewritten = []
    for index, node in enumerate(graph.node):
        if index in replaced:
            rewritten.extend(replaced[index])
        elif index not in dropped_nodes:
            rewritten.append(onnx.NodeProto.FromString(node.SerializeToString()))
    del graph.node[:]
    graph.node.extend(rewritten)
    # Deleted one by one, in place: a graph under 2 GB holds its weights inline, and copying the
    # kept initializers would double a stage's memory.
    for index in reversed(range(len(graph.initializer))):
        if graph.initializer[index].name in dropped_weights:
            del graph.initializer[index]
    return len(dropped_nodes) - len(replaced)
