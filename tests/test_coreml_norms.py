"""--device coreml --quant fp16: the RMS norms as the Core ML GPU/ANE would compute them, in
float16 throughout. The CPU provider cannot show it (it casts float16 nodes it lacks kernels for
to float32), so the exported norm nodes are evaluated here by a numpy reference that rounds every
node's result to float16, and in the pessimistic mode every partial sum of the mean too.
"""

from __future__ import annotations


import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import tiny

NORM_OPS = {"Constant", "Pow", "Mul", "Div", "Add", "Sub", "Sqrt", "ReduceMean", "Cast"}
F16_MAX = float(np.finfo(np.float16).max)


def _f16(values) -> np.ndarray:
    with np.errstate(over="ignore", invalid="ignore"):
        return np.asarray(values, dtype=np.float64).astype(np.float16)


def _reduce_mean(x: np.ndarray, axes, accumulate: str) -> np.ndarray:
    axis = int(axes[0])
    if accumulate == "exact":  # the sum unrounded, the mean rounded once
        return _f16(x.astype(np.float64).mean(axis=axis, keepdims=True))
    # A float16 sum by halves, rounded at each add: a reduction tree, as GPUs and the ANE reduce.
    n, parts = x.shape[axis], np.moveaxis(x, axis, -1)
    while parts.shape[-1] > 1:
        if parts.shape[-1] % 2:
            parts = np.concatenate([parts, np.zeros_like(parts[..., :1])], axis=-1)
        parts = _f16(parts[..., 0::2].astype(np.float64) + parts[..., 1::2].astype(np.float64))
    return np.moveaxis(_f16(parts.astype(np.float64) / n), -1, axis)


def evaluate_float16(nodes, constants: dict, feeds: dict, accumulate: str = "exact") -> tuple[dict, bool]:
    """Every node computed from float16 inputs, exactly, then rounded to float16 (what an IEEE
    float16 unit does per op). Returns the values and whether any of them was inf or nan."""
    values = {**constants, **{k: _f16(v) for k, v in feeds.items()}}
    finite = True
    for node in nodes:
        args = [values[name] for name in node.input]
        wide = [a.astype(np.float64) if a.dtype == np.float16 else a for a in args]
        op = node.op_type
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            if op == "Constant":
                out = numpy_helper.to_array(node.attribute[0].t)
            elif op == "Cast":
                out = _f16(wide[0])
            elif op == "ReduceMean":
                out = _reduce_mean(args[0], args[1], accumulate)
            else:
                out = _f16({"Pow": np.power, "Mul": np.multiply, "Div": np.divide, "Add": np.add, "Sub": np.subtract, "Sqrt": np.sqrt}[op](*wide))
        if out.dtype == np.float16:
            finite &= bool(np.isfinite(out).all())
        values[node.output[0]] = out
    return values, finite


def norm_nodes(graph: onnx.GraphProto, weight_name: str):
    """The nodes of the norm whose scale is the initializer `weight_name`: walked back from the
    Mul by that scale through norm ops only. Returns (nodes in order, constants, input, output)."""
    producer = {o: n for n in graph.node for o in n.output}
    initializers = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    last = next(n for n in graph.node if n.op_type == "Mul" and weight_name in n.input)
    keep, todo, leaves = set(), [last], set()
    while todo:
        node = todo.pop()
        if id(node) in keep:
            continue
        keep.add(id(node))
        for name in node.input:
            source = producer.get(name)
            if source is not None and source.op_type in NORM_OPS:
                todo.append(source)
            elif name not in initializers:
                leaves.add(name)
    nodes = [n for n in graph.node if id(n) in keep]
    assert len(leaves) == 1, leaves  # one input: the residual
    return nodes, {k: initializers[k] for n in nodes for k in n.input if k in initializers}, leaves.pop(), last.output[0]


def reference_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return weight.astype(np.float64) * x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def residual_rows(hidden: int, seed: int = 0) -> np.ndarray:
    """[1, 5, hidden] float16 rows of the magnitudes real residuals have (BENCHMARKS.md): an
    attention-sink row with SmolLM2's 25k outlier (mean square ~1e6), a Qwen-like row (4.4e3), a
    plain row, an embedding-sized row (rms 0.02) and a row of zeros."""
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((5, hidden))
    rows[0] *= 1000.0
    rows[0, 3] = 25000.0
    rows[1] *= 300.0
    rows[1, 7] = -4400.0
    rows[3] *= 0.02
    rows[4] = 0.0
    return _f16(rows)[None]


def assert_matches_float32_norm(y: np.ndarray, x: np.ndarray, weight: np.ndarray, eps: float, rtol: float) -> None:
    ref = reference_norm(x, weight, eps)
    scale = np.abs(ref).max(-1, keepdims=True) + 1e-6
    # Within float16 rounding: relative to each element and, for elements far below the row's
    # largest, to the row (float16 keeps ~11 bits of the row's scale, not of every tiny element).
    err = np.abs(y.astype(np.float64) - ref) / (np.abs(ref) + 1e-2 * scale)
    assert err.max() <= rtol, err.max()


@pytest.fixture(scope="module")
def fp16_norm_graphs(tmp_path_factory, tiny_models) -> dict[str, onnx.GraphProto]:
    """A tiny llama's --device coreml --quant fp16 target graph, with the norm as exported before
    this fix ("old": Pow, ReduceMean in float16) and today ("new")."""
    root = tmp_path_factory.mktemp("coreml_fp16_norms")
    with tiny.coreml_norms_squared_in_float16():
        tiny.export(tiny_models.llama, root / "old", quant="fp16", attention=None, device="coreml")
    tiny.export(tiny_models.llama, root / "new", quant="fp16", attention=None, device="coreml")
    return {k: root / k for k in ("old", "new")}


def _layer0_norm(bundle):
    graph = onnx.load(str(bundle / "target.onnx")).graph
    name = next(t.name for t in graph.initializer if t.name.endswith("layers.0.input_layernorm.weight"))
    return norm_nodes(graph, name), name


@pytest.mark.parametrize("accumulate", ["exact", "float16"])
def test_coreml_fp16_norm_stays_finite_where_the_old_one_overflowed(fp16_norm_graphs, accumulate):
    from edge_spec.manifest import load_manifest
    from edge_spec.placement import check_bundle

    new = fp16_norm_graphs["new"]
    assert check_bundle(load_manifest(new), new, "coreml").ok  # every node still places on the Core ML EP
    for kind in ("old", "new"):
        (nodes, constants, x_name, y_name), weight_name = _layer0_norm(fp16_norm_graphs[kind])
        assert {n.op_type for n in nodes} <= NORM_OPS
        assert all(v.dtype == np.float16 for v in constants.values())  # nothing kept in float32
        x = residual_rows(64)
        values, finite = evaluate_float16(nodes, constants, {x_name: x}, accumulate)
        y = values[y_name]
        if kind == "old":
            # Squares of the 25k row overflow to inf: the norm's scale becomes 0 and the row is lost.
            assert not finite and np.abs(y[0, 0]).max() == 0.0
            continue
        assert finite
        assert "Pow" not in {n.op_type for n in nodes}  # the Core ML EP's MLProgram Pow builder takes float32 only
        assert_matches_float32_norm(y, x, constants[weight_name], 1e-5, rtol=1e-2 if accumulate == "float16" else 4e-3)


def test_scaled_norm_bound_holds_at_the_float16_extremes():
    """Every float16 value at the limit: the largest finite one in every position, and one
    largest value among zeros (a row the coarse pass sees as one square)."""
    import torch

    from export.static_cache import StageModule

    for hidden in (64, 576, 896, 1536):
        rows = np.zeros((3, hidden))
        rows[0] = F16_MAX
        rows[1, 0] = -F16_MAX
        rows[2] = 1e-4  # below the coarse pass's underflow: only the + 1 floor scales it
        graph = _norm_graph(StageModule._scaled_rms_norm, hidden, 1e-5, torch)
        x = _f16(rows)[None]
        values, finite = evaluate_float16(graph.node, {}, {"x": x, "w": np.ones(hidden, np.float16)}, "float16")
        assert finite, hidden
        assert_matches_float32_norm(values[graph.output[0].name], x, np.ones(hidden), 1e-5, rtol=1e-2)


def _norm_graph(norm, hidden: int, eps: float, torch) -> onnx.GraphProto:
    """`norm(x, weight, eps)` traced as the stage graphs are (TorchScript exporter, opset 20) and
    converted to float16 by ONNX Runtime's converter, which the fp16 export uses."""
    import io

    from onnxruntime.transformers.float16 import convert_float_to_float16

    class Probe(torch.nn.Module):
        def forward(self, x, w):
            return norm(x, w, eps)

    buffer = io.BytesIO()
    torch.onnx.export(Probe(), (torch.ones(1, 2, hidden), torch.ones(hidden)), buffer, input_names=["x", "w"], output_names=["y"],
                      opset_version=20, dynamo=False)
    model = convert_float_to_float16(onnx.load_from_string(buffer.getvalue()), disable_shape_infer=True)
    return model.graph

