"""Would fusing q/k/v and gate/up into one MatMulNBits each speed up a pass? A synthetic
28-layer graph with the Qwen2.5-1.5B shapes (hidden 1536, intermediate 8960, 2 KV heads of 128),
int4 block 32, accuracy level 4, random weights, MatMulNBits only (no attention), timed for
T = 1 and 4 with both graphs alternating; 2 threads, spinning off (as the runtime ran when this was measured).

    python -m benchmarks.fused_projections
"""

import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, INTERMEDIATE, KV = 1536, 8960, 256
LAYERS, BLOCK = 28, 32


def _matmul(name, x, k, n, inits, nodes, rng):
    blocks = k // BLOCK
    inits += [numpy_helper.from_array(rng.integers(0, 255, size=(n, blocks, BLOCK // 2), dtype=np.uint8), name + ".w"),
              numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 1e-3, name + ".s")]
    nodes.append(helper.make_node("MatMulNBits", [x, name + ".w", name + ".s"], [name], domain="com.microsoft",
                                  K=k, N=n, bits=4, block_size=BLOCK, accuracy_level=4))
    return name


def _slice(name, x, begin, end, inits, nodes):
    inits += [numpy_helper.from_array(np.array([v], np.int64), f"{name}.{key}") for key, v in (("b", begin), ("e", end), ("a", 2))]
    nodes.append(helper.make_node("Slice", [x, name + ".b", name + ".e", name + ".a"], [name]))
    return name


def build(fused: bool):
    rng, inits, nodes, h = np.random.default_rng(0), [], [], "x"
    for layer in range(LAYERS):
        p = f"l{layer}."
        if fused:
            qkv = _matmul(p + "qkv", h, HIDDEN, HIDDEN + 2 * KV, inits, nodes, rng)
            q, k, v = (_slice(p + n, qkv, b, e, inits, nodes) for n, b, e in (("q", 0, HIDDEN), ("k", HIDDEN, HIDDEN + KV), ("v", HIDDEN + KV, HIDDEN + 2 * KV)))
        else:
            q, k, v = (_matmul(p + n, h, HIDDEN, width, inits, nodes, rng) for n, width in (("q", HIDDEN), ("k", KV), ("v", KV)))
        # k and v feed the next op, so no graph optimization drops them.
        nodes += [helper.make_node("ReduceMean", [k], [p + "km"], keepdims=1, axes=[2]), helper.make_node("ReduceMean", [v], [p + "vm"], keepdims=1, axes=[2]),
                  helper.make_node("Add", [q, p + "km"], [p + "qk"]), helper.make_node("Add", [p + "qk", p + "vm"], [p + "attn"])]
        o = _matmul(p + "o", p + "attn", HIDDEN, HIDDEN, inits, nodes, rng)
        if fused:
            gate_up = _matmul(p + "gu", o, HIDDEN, 2 * INTERMEDIATE, inits, nodes, rng)
            gate, up = _slice(p + "g", gate_up, 0, INTERMEDIATE, inits, nodes), _slice(p + "u", gate_up, INTERMEDIATE, 2 * INTERMEDIATE, inits, nodes)
        else:
            gate, up = (_matmul(p + n, o, HIDDEN, INTERMEDIATE, inits, nodes, rng) for n in ("g", "u"))
        nodes.append(helper.make_node("Mul", [gate, up], [p + "m"]))
        h = _matmul(p + "d", p + "m", INTERMEDIATE, HIDDEN, inits, nodes, rng)
    graph = helper.make_graph(nodes, "projections", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", HIDDEN])],
                              [helper.make_tensor_value_info(h, TensorProto.FLOAT, None)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


def main(repeats: int = 12) -> None:
    sessions = {}
    for fused in (False, True):
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        sessions[fused] = ort.InferenceSession(build(fused).SerializeToString(), options, providers=["CPUExecutionProvider"])
    times = {(fused, block): [] for fused in (False, True) for block in (1, 4)}
    for repeat in range(repeats + 1):
        for block in (1, 4):
            x = np.random.default_rng(repeat).standard_normal((1, block, HIDDEN)).astype(np.float32)
            for fused in (False, True):
                began = time.perf_counter()
                sessions[fused].run(None, {"x": x})
                if repeat:  # the first run of each shape allocates and prepacks
                    times[(fused, block)].append(time.perf_counter() - began)
    for block in (1, 4):
        separate, fused = (statistics.median(times[(f, block)]) for f in (False, True))
        print(f"T={block}: separate {separate * 1e3:.1f} ms, fused {fused * 1e3:.1f} ms, fused / separate {fused / separate:.3f}")


if __name__ == "__main__":
    main()
