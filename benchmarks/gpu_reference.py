"""References a correct GPU can meet, computed on the CPU provider from the bundle a GPU will run.

The CPU provider runs MatMulNBits at the bundle's accuracy level 4 (int8 activations); CUDA's
kernel never reads accuracy_level (contrib_ops/cuda/quantization/matmul_nbits.h; the string is
absent from onnxruntime-gpu 1.31.1's CUDA provider library) and multiplies float16 activations.
So the reference is the same bundle with every MatMulNBits at accuracy level 0 (float activations,
the weights as stored), and the floor on agreement with it comes from an emulation of CUDA's
MatMulNBits for up to 16 rows (matmul_4bits_common.cuh, matmul_4bits_batched_impl.cuh): weights
dequantized in float16 arithmetic (q x scale - scale x zero point), the result rounded to float16
once. CUDA also sums in float16 (half2 accumulators over K/256 products per lane for one row,
K/64 in the batched kernel, then float32 across lanes); the emulation sums in float32 (a MatMul,
which the CPU provider runs between two float16 casts), and EMULATION_MARGIN stands for that and
for attention.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

# What the emulation leaves out (CUDA's float16 sums, its attention kernels) may move a few
# near-ties more: the floor sits this far under the emulated agreement.
EMULATION_MARGIN = 0.02


def rewritten(bundle: Path, out: Path, rewrite) -> Path:
    """A copy of `bundle` whose stage graphs went through rewrite(model, path) (which saves them),
    the manifest's hashes updated."""
    import onnx

    from edge_spec.manifest import load_manifest, sha256_file

    shutil.copytree(bundle, out)
    data = json.loads((out / "manifest.json").read_text())
    for stage in load_manifest(out, check_hashes=False).stages.values():
        path = out / stage.file
        rewrite(onnx.load(str(path), load_external_data=False), path)
        for name in (path.name, path.name + ".data"):
            if name in data["files"]:
                data["files"][name] = sha256_file(out / name)
    (out / "manifest.json").write_text(json.dumps(data))
    return out


def accuracy_level_zero(model, path: Path) -> None:
    """Every MatMulNBits at accuracy level 0: float activations, no int8 quantization of A."""
    from onnx import helper

    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            kept = [a for a in node.attribute if a.name != "accuracy_level"]
            del node.attribute[:]
            node.attribute.extend([*kept, helper.make_attribute("accuracy_level", 0)])
    import onnx

    onnx.save(model, str(path))  # the external data file is unchanged


def dequantize_matmulnbits(b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, k: int, n: int, bits: int, block: int,
                           dtype=np.float16) -> np.ndarray:
    """MatMulNBits' weight [N, K] as `dtype` arithmetic computes it, (q - zero point) x scale
    rounded once (CUDA forms q x scale + (-scale x zero point) in half2 arithmetic: the same when
    the compiler fuses it, one rounding more when not), with the packed zero points (default 2^(bits-1)) and low nibbles first,
    as the contrib spec defines."""
    blocks = -(-k // block)
    raw = b.reshape(n, blocks, -1)
    if bits == 4:
        q = np.stack([raw & 0x0F, raw >> 4], axis=-1).reshape(n, blocks, -1)[:, :, :block]
    else:
        q = raw[:, :, :block]
    if zero_points is None:
        zp = np.full((n, blocks), 2 ** (bits - 1), dtype=np.int16)
    elif zero_points.dtype == np.uint8:
        packed = zero_points.reshape(n, -1)
        zp = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, -1)[:, :blocks] if bits == 4 else packed[:, :blocks]
    else:
        raise ValueError("float zero points are not emulated")
    steps = (q.astype(np.int16) - zp.astype(np.int16)[:, :, None]).astype(dtype)
    weight = steps * scales.reshape(n, blocks)[:, :, None].astype(dtype)  # rounded once, in dtype
    return weight.reshape(n, blocks * block)[:, :k]


def cuda_matmulnbits(model, path: Path) -> None:
    """Every MatMulNBits replaced by a MatMul on its weights dequantized in float16 (CUDA's kernel,
    module docstring); the rest of the graph untouched. Saves the graph with its data."""
    import onnx
    from onnx import helper, numpy_helper

    onnx.load_external_data_for_model(model, str(path.parent))
    inits = {t.name: t for t in model.graph.initializer}
    nodes, dropped = [], set()
    for node in model.graph.node:
        if node.op_type != "MatMulNBits":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        inputs = list(node.input) + [""] * (6 - len(node.input))
        zp = numpy_helper.to_array(inits[inputs[3]]) if inputs[3] else None
        scales = numpy_helper.to_array(inits[inputs[2]])
        weight = dequantize_matmulnbits(numpy_helper.to_array(inits[inputs[1]]), scales, zp, attrs["K"], attrs["N"], attrs["bits"],
                                        attrs["block_size"], dtype=scales.dtype)
        name = node.name + ".dequantized"
        model.graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(weight.T), name))
        out = node.output[0] if not inputs[5] else node.output[0] + ".nobias"
        nodes.append(helper.make_node("MatMul", [inputs[0], name], [out], name=node.name + ".matmul"))
        if inputs[5]:
            nodes.append(helper.make_node("Add", [out, inputs[5]], [node.output[0]], name=node.name + ".bias"))
        dropped.update(i for i in inputs[1:4] if i)
    used = {i for node in nodes for i in node.input}
    kept = [t for t in model.graph.initializer if t.name not in dropped or t.name in used]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    data = path.with_name(path.name + ".data")
    data.unlink(missing_ok=True)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024)


def top1_agreement(bundle: Path, prompts: list[list[int]], reference_top1: list[np.ndarray]) -> dict:
    """Top-1 agreement of `bundle` on the CPU provider with reference ids, every position, the
    prompt in one pass and in two (the second reads the first's cache)."""
    from runtime.engine import Engine, EngineConfig

    engine = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    agree = agree_split = total = 0
    for ids, ref in zip(prompts, reference_top1, strict=True):
        engine.target.cache.reset()
        agree += int((engine.target.forward(ids).argmax(-1) == ref).sum())
        engine.target.cache.reset()
        half = max(1, len(ids) // 2)
        split = np.concatenate([engine.target.forward(ids[:half]), engine.target.forward(ids[half:])])
        agree_split += int((split.argmax(-1) == ref).sum())
        total += len(ids)
    return {"top1_agreement": agree / total, "top1_agreement_two_passes": agree_split / total, "positions": total}


def gpu_references(bundle: Path, prompts: list[list[int]], scratch: Path, top_k: int) -> tuple[list, list, dict]:
    """(references at accuracy level 0, the CPU provider's references as the bundle stands, what
    they are): the first for a GPU, with the floor from the CUDA emulation; the second for a run of
    the kit on the CPU provider, which computes the bundle's own int8-activation path."""
    from benchmarks.gpu_check import reference_top

    level0 = rewritten(bundle, scratch / "accuracy-level-0", accuracy_level_zero)
    gpu = reference_top(level0, prompts, top_k)
    cpu = reference_top(bundle, prompts, top_k)
    emulated = top1_agreement(rewritten(bundle, scratch / "cuda-matmulnbits", cuda_matmulnbits), prompts, [r.ids[:, 0] for r in gpu])
    as_shipped = top1_agreement(bundle, prompts, [r.ids[:, 0] for r in gpu])
    low = min(emulated["top1_agreement"], emulated["top1_agreement_two_passes"])
    floor = float(np.floor((low - EMULATION_MARGIN) * 100) / 100)
    meta = {
        "gpu": {"describe": "the CPU provider's logits on the same bundle at MatMulNBits accuracy level 0",
                "min_top1": floor, "emulated": emulated, "margin": EMULATION_MARGIN,
                "emulation": "MatMulNBits with CUDA's float16 dequantized weights and float32 sums (CUDA sums in float16), the rest on the CPU provider",
                "cpu_accuracy_level_4_vs_this": as_shipped},
        "cpu": {"describe": "the CPU provider's logits on the same bundle", "min_top1": 0.97},
    }
    return gpu, cpu, meta
