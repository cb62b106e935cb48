"""Where one pass's time goes: ONNX Runtime's own profile of target passes of T tokens (and one
draft-model step), grouped by op and, for MatMulNBits, by matrix, with the bytes each op reads
and the rate it reads them at.

    python -m benchmarks op_profile BUNDLE [--blocks 1,2,4,8] [--kv-len 512] [--repeats 20] [--out FILE.json]

Bytes are those the CPU kernel reads per pass, from the graph's node attributes: MatMulNBits reads
its packed weights (bits per weight), one float32 scale and one float32 block sum per block
(MLAS's CompInt8 layout on x86, `PackedQuantBDataStruct`; zero points are folded into the block
sums at load); GroupQueryAttention reads the cache rows it attends over; every other op reads
activations only, counted as zero. The time outside `session.run` (binding, numpy, Python) is
the pass's wall time less the profile's `model_run`.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

# The matrices of a layer, by the traced module names the exporter keeps in node names.
ROLES = (("q_proj", "qkv"), ("o_proj", "o"), ("gate_proj", "gate_up"), ("down_proj", "down"), ("lm_head", "lm_head"))


def matmul_label(node_name: str, n: int) -> str:
    role = next((label for key, label in ROLES if key in node_name), None)
    if role is None and n > 32768:
        role = "lm_head"  # the head's node carries no module name once merged
    return role or "other"


def matmulnbits_bytes(attrs: dict) -> int:
    """Bytes one MatMulNBits call reads: the packed weights, and a float32 scale and block sum per
    block; for a float32 MatMul by a constant (a GGUF block minimum matrix), the matrix."""
    if attrs.get("dense"):
        return attrs["K"] * attrs["N"] * 4
    blocks = -(-attrs["K"] // attrs["block_size"])
    return attrs["N"] * blocks * (attrs["block_size"] * attrs["bits"] // 8 + 8)


def matmul_nodes(path: Path) -> dict[str, dict]:
    """Node name -> its MatMulNBits attributes (K, N, bits, block_size), and for a float32 MatMul
    by a constant matrix {K, N, dense: True}, in one stage graph (names repeat across a bundle's
    stage graphs)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    constants = {t.name: list(t.dims) for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) == 2}
    nodes = {}
    for node in graph.node:
        if node.op_type == "MatMulNBits":
            nodes[node.name] = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        elif node.op_type == "MatMul" and node.input[1] in constants:
            k, n = constants[node.input[1]]
            nodes[node.name] = {"K": k, "N": n, "dense": True}
    return nodes


def _merge(into: dict, row: dict) -> None:
    """Add one stage's row to a pass's row: a pass of a split target runs each stage once."""
    into["run_ms"] += row["run_ms"]
    for key, g in row["groups"].items():
        if key not in into["groups"]:
            into["groups"][key] = dict(g)
            continue
        merged = into["groups"][key]
        for field in ("ms", "calls", "bytes"):
            merged[field] += g[field]
        merged["gb_per_s"] = merged["bytes"] / (merged["ms"] * 1e6) if merged["ms"] and merged["bytes"] else None


def account(events: list[dict], labels: list[str], matmuls: dict[str, dict], attended_bytes: int = 0) -> dict:
    """Per label (one per session.run, in order, the last len(labels) runs of the profile): the
    median run time and, per op group, the median time, the bytes read and GB/s."""
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    runs = runs[len(runs) - len(labels):]
    nodes = sorted((e for e in events if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time")), key=lambda e: e["ts"])
    per_label: dict[str, list[dict]] = defaultdict(list)
    i = 0
    for label, run in zip(labels, runs):
        start, end = run["ts"], run["ts"] + run["dur"]
        groups: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "bytes": 0, "calls": 0})
        while i < len(nodes) and nodes[i]["ts"] < start:
            i += 1
        while i < len(nodes) and nodes[i]["ts"] <= end:
            event = nodes[i]
            op = event["args"].get("op_name", "?")
            key, nbytes = op, 0
            attrs = matmuls.get(event["name"][: -len("_kernel_time")]) if op in ("MatMulNBits", "MatMul") else None
            if attrs:
                nbytes = matmulnbits_bytes(attrs)
                form = "float32 minimum" if attrs.get("dense") else f"int{attrs['bits']}/{attrs['block_size']}"
                key = f"{op} {matmul_label(event['name'], attrs['N'])} {attrs['K']}x{attrs['N']} {form}"
            elif op == "GroupQueryAttention":
                nbytes = attended_bytes
            group = groups[key]
            group["us"] += event["dur"]
            group["bytes"] += nbytes
            group["calls"] += 1
            i += 1
        per_label[label].append({"run_us": run["dur"], "groups": dict(groups)})
    out = {}
    for label, samples in per_label.items():
        keys = {k for s in samples for k in s["groups"]}
        groups = {}
        for key in keys:
            us = statistics.median(s["groups"].get(key, {"us": 0.0})["us"] for s in samples)
            first = next(s["groups"][key] for s in samples if key in s["groups"])
            groups[key] = {"ms": us / 1e3, "calls": first["calls"], "bytes": first["bytes"],
                           "gb_per_s": first["bytes"] / (us * 1e3) if us and first["bytes"] else None}
        out[label] = {"run_ms": statistics.median(s["run_us"] for s in samples) / 1e3,
                      "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["ms"]))}
    return out


def profile(bundle: str, blocks: list[int], kv_len: int = 512, repeats: int = 20, threads: int | None = None) -> dict:
    from benchmarks.bench import PassTimer
    from benchmarks.bench.run import cpu_features
    from runtime.engine import Engine, EngineConfig

    tmp = Path(tempfile.mkdtemp(prefix="op-profile-"))
    extra = {"threads": threads} if threads else {}
    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False, profile_prefix=str(tmp / "ort"), **extra))
    timer = PassTimer(engine, kv_len, max(blocks))
    arch = engine.bundle.manifest.target.arch
    kv_row = 2 * arch.n_kv_heads * arch.head_dim * 4  # K and V, float32, one layer
    labels, wall = [], defaultdict(list)
    for repeat in range(repeats + 1):
        for block in blocks:
            began = time.perf_counter()
            timer.target_pass(block)
            if repeat:
                wall[f"T={block}"].append((time.perf_counter() - began) * 1e3)
            labels.append(f"T={block}" if repeat else "warm-up")  # each stage's session runs once a pass
    draft_labels = []
    if "draft" in engine.bundle.manifest.drafts():
        step = timer.draft_step("model")
        for repeat in range(repeats + 1):
            began = time.perf_counter()
            step()
            if repeat:
                wall["draft"].append((time.perf_counter() - began) * 1e3)
            draft_labels.append("draft" if repeat else "warm-up")
    result = {"bundle": bundle, "kv_len": kv_len, "repeats": repeats, "machine": cpu_features(),
              "threads": engine.config.threads, "passes": {}}
    stages = engine.bundle.manifest.stages
    for key, session in engine.loader.sessions.items():
        events = json.loads(Path(session.end_profiling()).read_text())
        names = draft_labels if key == "draft" else labels if key.startswith("target") else []
        if not names:
            continue
        for label, row in account(events, names, matmul_nodes(Path(bundle) / stages[key].file), kv_row * kv_len).items():
            if label == "warm-up":
                continue
            if label in result["passes"]:
                _merge(result["passes"][label], row)
            else:
                result["passes"][label] = row
    for label, row in result["passes"].items():
        row["groups"] = dict(sorted(row["groups"].items(), key=lambda kv: -kv[1]["ms"]))
        row["wall_ms"] = statistics.median(wall[label])
        row["outside_run_ms"] = row["wall_ms"] - row["run_ms"]
        row["bytes"] = sum(g["bytes"] for g in row["groups"].values())
    return result


def table(result: dict) -> list[str]:
    """Markdown: one column per pass, one row per op group (ms, and GB/s where bytes are known)."""
    passes = list(result["passes"])
    keys = []
    for p in passes:
        keys += [k for k in result["passes"][p]["groups"] if k not in keys]
    lines = ["| op | " + " | ".join(passes) + " |", "|---|" + "---|" * len(passes)]
    for key in keys:
        cells = []
        for p in passes:
            g = result["passes"][p]["groups"].get(key)
            cells.append("" if g is None else f"{g['ms']:.2f} ms" + (f", {g['gb_per_s']:.1f} GB/s" if g["gb_per_s"] else ""))
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    for name, field in (("session.run", "run_ms"), ("outside session.run", "outside_run_ms"), ("wall", "wall_ms")):
        lines.append(f"| {name} | " + " | ".join(f"{result['passes'][p][field]:.2f} ms" for p in passes) + " |")
    lines.append("| MiB read | " + " | ".join(f"{result['passes'][p]['bytes'] / 2**20:.0f}" for p in passes) + " |")
    return lines
