"""Would fusing q/k/v and gate/up into one MatMulNBits each speed up a pass, and would a larger
quantization block? A synthetic 28-layer graph with the Qwen2.5-1.5B shapes (hidden 1536,
intermediate 8960, 2 KV heads of 128), int4, accuracy level 4, random weights, MatMulNBits only
(no attention), timed for T = 1 and 4 with the graphs alternating; 2 threads.

    python -m benchmarks.fused_projections            # separate against fused, block 32, spinning off
    python -m benchmarks.fused_projections --blocks 32,64,128   # fused, by block size, spinning as the runtime runs
"""

import statistics
import time
from functools import partial

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, INTERMEDIATE, KV = 1536, 8960, 256
LAYERS, BLOCK = 28, 32


def _matmul(name, x, k, n, inits, nodes, rng, block=BLOCK):
    blocks = -(-k // block)
    inits += [numpy_helper.from_array(rng.integers(0, 255, size=(n, blocks, block // 2), dtype=np.uint8), name + ".w"),
              numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) * 1e-3, name + ".s")]
    nodes.append(helper.make_node("MatMulNBits", [x, name + ".w", name + ".s"], [name], domain="com.microsoft",
                                  K=k, N=n, bits=4, block_size=block, accuracy_level=4))
    return name


def _slice(name, x, begin, end, inits, nodes):
    inits += [numpy_helper.from_array(np.array([v], np.int64), f"{name}.{key}") for key, v in (("b", begin), ("e", end), ("a", 2))]
    nodes.append(helper.make_node("Slice", [x, name + ".b", name + ".e", name + ".a"], [name]))
    return name


def build(fused: bool, block: int = BLOCK):
    rng, inits, nodes, h = np.random.default_rng(0), [], [], "x"
    matmul = partial(_matmul, block=block)
    for layer in range(LAYERS):
        p = f"l{layer}."
        if fused:
            qkv = matmul(p + "qkv", h, HIDDEN, HIDDEN + 2 * KV, inits, nodes, rng)
            q, k, v = (_slice(p + n, qkv, b, e, inits, nodes) for n, b, e in (("q", 0, HIDDEN), ("k", HIDDEN, HIDDEN + KV), ("v", HIDDEN + KV, HIDDEN + 2 * KV)))
        else:
            q, k, v = (matmul(p + n, h, HIDDEN, width, inits, nodes, rng) for n, width in (("q", HIDDEN), ("k", KV), ("v", KV)))
        # k and v feed the next op, so no graph optimization drops them.
        nodes += [helper.make_node("ReduceMean", [k], [p + "km"], keepdims=1, axes=[2]), helper.make_node("ReduceMean", [v], [p + "vm"], keepdims=1, axes=[2]),
                  helper.make_node("Add", [q, p + "km"], [p + "qk"]), helper.make_node("Add", [p + "qk", p + "vm"], [p + "attn"])]
        o = matmul(p + "o", p + "attn", HIDDEN, HIDDEN, inits, nodes, rng)
        if fused:
            gate_up = matmul(p + "gu", o, HIDDEN, 2 * INTERMEDIATE, inits, nodes, rng)
            gate, up = _slice(p + "g", gate_up, 0, INTERMEDIATE, inits, nodes), _slice(p + "u", gate_up, INTERMEDIATE, 2 * INTERMEDIATE, inits, nodes)
        else:
            gate, up = (matmul(p + n, o, HIDDEN, INTERMEDIATE, inits, nodes, rng) for n in ("g", "u"))
        nodes.append(helper.make_node("Mul", [gate, up], [p + "m"]))
        h = matmul(p + "d", p + "m", INTERMEDIATE, HIDDEN, inits, nodes, rng)
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


def by_block(blocks: list[int], repeats: int = 12) -> dict:
    """The fused graph at each block size, spinning as the runtime runs it (on within a run,
    stopped when it returns); medians in ms by block size and T."""
    sessions = {}
    for block in blocks:
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        sessions[block] = ort.InferenceSession(build(True, block).SerializeToString(), options, providers=["CPUExecutionProvider"])
    times = {(block, t): [] for block in blocks for t in (1, 4)}
    for repeat in range(repeats + 1):
        for t in (1, 4):
            x = np.random.default_rng(repeat).standard_normal((1, t, HIDDEN)).astype(np.float32)
            for block in blocks:
                began = time.perf_counter()
                sessions[block].run(None, {"x": x})
                if repeat:
                    times[(block, t)].append(time.perf_counter() - began)
    result = {f"block {block}": {f"T={t}": round(statistics.median(times[(block, t)]) * 1e3, 2) for t in (1, 4)} for block in blocks}
    for name, row in result.items():
        print(name, ", ".join(f"{t}: {ms} ms" for t, ms in row.items()))
    return result


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--blocks"]:
        by_block([int(b) for b in sys.argv[2].split(",")])
    else:
        main()
