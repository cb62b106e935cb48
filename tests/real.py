"""Real-weight fixtures: the official files from $EDGE_SPEC_MODELS and bundles built from them.

Without the files these tests skip, naming the file and how to get it; CI sets
EDGE_SPEC_REQUIRE_MODELS=1 so that a missing file fails instead. Bundles are cached under
$EDGE_SPEC_BUNDLES (default ~/.cache/edge-spec/bundles), keyed by a hash of the code that
decides their bytes, so a change there rebuilds them. A session that will run real-weight tests
exports the missing bundles in two background processes from its start (conftest.py), and runs
those tests after the unit tests.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edge_spec.catalog import CATALOG, models_dir

ROOT = Path(__file__).resolve().parent.parent
REQUIRE = os.environ.get("EDGE_SPEC_REQUIRE_MODELS") == "1"

QWEN_TARGET = CATALOG["qwen2.5-coder-1.5b"].gguf_file
QWEN_DRAFT = CATALOG["qwen2.5-coder-0.5b"].gguf_file
SMOLLM2 = CATALOG["smollm2-135m"].gguf_file
GEMMA3 = CATALOG["gemma-3-270m"].gguf_file
HUMANEVAL = "HumanEval.jsonl.gz"
LAYER_SKIP = "layer-skip:16"


def need(*files: str) -> Path:
    folder = models_dir()
    missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        message = (
            f"needs {', '.join(missing)} in {folder} (set EDGE_SPEC_MODELS, or fetch them with "
            "shared/models/fetch.sh in this workplace)"
        )
        if REQUIRE:
            pytest.fail(message)
        pytest.skip(message)
    return folder


def _exporter_hash() -> str:
    digest = hashlib.sha256()
    # What decides a bundle's bytes: the traced module, the graph export, quantization, the
    # graph names, the device profiles, and the manifest schema version (bumped whenever its format changes).
    from edge_spec.manifest import SCHEMA_VERSION

    for name in ("export/static_cache.py", "export/onnx_graphs.py", "export/quantize.py", "export/bundle.py", "export/sources.py", "export/gguf_blocks.py", "edge_spec/names.py"):
        digest.update((ROOT / name).read_bytes())
    for path in sorted((ROOT / "export" / "archs").glob("*.py")):  # what each family computes
        digest.update(path.read_bytes())
    from edge_spec.profiles import PROFILES  # the facts of each profile that decide bytes, not its messages

    for p in PROFILES.values():
        digest.update(repr((p.name, p.activations, p.kv_dtype, p.attentions, p.quants, p.quantized_embedding)).encode())
    digest.update(str(SCHEMA_VERSION).encode())
    return digest.hexdigest()[:12]


def bundles_root() -> Path:
    return Path(os.environ.get("EDGE_SPEC_BUNDLES", Path.home() / ".cache" / "edge-spec" / "bundles"))


# name -> (model, quant, drafts, max_context, attention, device). SmolLM2 is portable: the Kotlin
# core (android_bridge) replays it, and Python checks that kind on real weights through it. The
# --device cuda bundles (float16 activations and KV) run here on the CPU provider.
REAL_BUNDLES = {
    "smollm2-fp32": ("smollm2-135m", "fp32", ("layer-skip:10",), 2048, "portable", "cpu"),
    "smollm2-cuda-fp16": ("smollm2-135m", "fp16", ("layer-skip:10",), 2048, "fused", "cuda"),
    # The offline GPU kit's bundle as README builds it (benchmarks/gpu_kit.py): rehearsed here on the CPU provider.
    "smollm2-cuda-int4": ("smollm2-135m", "int4", ("layer-skip:10",), 1024, "fused", "cuda"),
    # Its layer-skip draft is chosen by the export's search (issue 37): its exactness tests then cover a subset draft.
    "smollm2-int8": ("smollm2-135m", "int8", ("layer-skip:auto",), 1024, "fused", "cpu"),
    "qwen-pair-int4": ("qwen2.5-coder-1.5b", "int4", ("qwen2.5-coder-0.5b", LAYER_SKIP), 2048, "fused", "cpu"),
    # fp32 parity with transformers on the 0.5B: the same qwen2 loader and graph as the 1.5B, a third of its export.
    "qwen05-fp32": ("qwen2.5-coder-0.5b", "fp32", (), 1024, "fused", "cpu"),
    # The --device cuda int4 profile on the 0.5B alone: its top-1 and its memory plan (CUDA
    # speculation is checked on SmolLM2's cuda bundle and by the GPU kit).
    "qwen05-cuda-int4": ("qwen2.5-coder-0.5b", "int4", (), 1024, "fused", "cuda"),
    # Gemma 3: 1024 positions reach past its 512-token sliding window.
    "gemma3-fp32": ("gemma-3-270m", "fp32", ("layer-skip:9",), 1024, "fused", "cpu"),
    "gemma3-int4": ("gemma-3-270m", "int4", ("layer-skip:9",), 1024, "fused", "cpu"),
    "gemma3-int4-b128": ("gemma-3-270m", "int4", ("layer-skip:9",), 1024, "fused", "cpu"),
    # SmolLM2 drafting for itself at coarser blocks (export --draft-block-size 128): the cheapest real pair.
    "smollm2-pair-int4-d128": ("smollm2-135m", "int4", ("smollm2-135m",), 1024, "fused", "cpu"),
    # The same pair with the draft's LM head trimmed to a third (export --draft-vocab, counted on stdlib,docs).
    "smollm2-pair-int4-d128-trim16k": ("smollm2-135m", "int4", ("smollm2-135m",), 1024, "fused", "cpu"),
    # SmolLM2 re-quantized (export --requantize): beside the default, which keeps the file's blocks.
    "smollm2-int4-requant": ("smollm2-135m", "int4", (), 1024, "fused", "cpu"),
    # --device coreml (masked graphs, the embedding and LM head in slices within the Core ML EP's
    # 16384 limit), no draft: the smallest real bundle that meets the limit.
    "smollm2-coreml-fp32": ("smollm2-135m", "fp32", (), 1024, "masked", "coreml"),
    # --device dml int4 (masked graphs, float16 activations and KV, MatMulNBits with zero points), no draft.
    "smollm2-dml-int4": ("smollm2-135m", "int4", (), 1024, "masked", "dml"),
}
GGUF_BLOCKS = {"smollm2-int4-requant": False}  # name -> export gguf_blocks (else the default: kept where it can)
DRAFT_VOCAB = {"smollm2-pair-int4-d128-trim16k": 16384}  # name -> export --draft-vocab
BLOCK_SIZE = {"gemma3-int4-b128": 128}  # name -> export --block-size (else the default)
DRAFT_BLOCK_SIZE = {"smollm2-pair-int4-d128": 128, "smollm2-pair-int4-d128-trim16k": 128}  # name -> export --draft-block-size (else --block-size)


def _bundle_path(name: str) -> Path:
    return bundles_root() / f"{name}-{_exporter_hash()}"


def _config(name: str) -> str:
    model, quant, drafts, max_context, attention, device = REAL_BUNDLES[name]
    return (f"ExportConfig({model!r}, Path({str(_bundle_path(name))!r}), {quant!r}, {max_context}, {drafts!r}, force=True, "
            f"attention={attention!r}, device={device!r}, draft_vocab={DRAFT_VOCAB.get(name)!r}, block_size={BLOCK_SIZE.get(name, 32)!r}, "
            f"draft_block_size={DRAFT_BLOCK_SIZE.get(name)!r}, gguf_blocks={GGUF_BLOCKS.get(name)!r})")


def _export_script(names: list[str]) -> str:
    """One process exporting `names`, each model's bundles in one export_bundles call (its
    checkpoint opened once); the bundle appears whole or not at all (export writes DIR.partial)."""
    groups: dict[str, list[str]] = {}
    for n in names:
        groups.setdefault(REAL_BUNDLES[n][0], []).append(n)
    calls = "\n".join("export_bundles([" + ", ".join(_config(n) for n in group) + "])" for group in groups.values())
    return "from pathlib import Path\nfrom export.bundle import ExportConfig, export_bundles\n" + calls


def missing_bundles() -> list[str]:
    return [n for n in REAL_BUNDLES if not (_bundle_path(n) / "manifest.json").is_file()]


# Background exports this process started (start_exports). Which bundle a worker is writing is
# told through a file beside it (NAME.worker: its pid and log), since the tests import this
# module under two names (real, tests.real).
_WORKERS: list[subprocess.Popen] = []

# Rough export cost in minutes on two cores, to share the bundles between the workers.
_COST = {"qwen2.5-coder-1.5b": 6.0, "qwen2.5-coder-0.5b": 2.0, "gemma-3-270m": 1.0, "smollm2-135m": 0.3}


def start_exports(workers: int = 2) -> None:
    """Export every missing bundle in `workers` background processes while the session runs its
    other tests. An export runs on one core, so on two cores two of them (or one and the unit
    tests) finish in about half the time; bundle() waits for the one it needs."""
    if _WORKERS or not all((models_dir() / f).is_file() for f in (QWEN_TARGET, QWEN_DRAFT, SMOLLM2, GEMMA3)):
        return
    bundles_root().mkdir(parents=True, exist_ok=True)
    # pytest-xdist's workers each start a session: the first to take the lock starts the exports,
    # the others find them being exported.
    with open(bundles_root() / "start-exports.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        todo = [n for n in missing_bundles() if not _being_exported(n)]
        if todo:
            _start(todo, workers)


def _start(todo: list[str], workers: int) -> None:
    # Cheapest models first, so the tests that need them can start early; the heaviest bundles
    # go to the least loaded worker.
    todo.sort(key=lambda n: _COST.get(REAL_BUNDLES[n][0], 1.0))
    shares: list[list[str]] = [[] for _ in range(workers)]
    loads = [0.0] * workers
    for n in sorted(todo, key=lambda n: -_COST.get(REAL_BUNDLES[n][0], 1.0)):
        i = loads.index(min(loads))
        shares[i].append(n)
        loads[i] += _COST.get(REAL_BUNDLES[n][0], 1.0)
    for i, share in enumerate(s for s in shares if s):
        share.sort(key=todo.index)
        log = bundles_root() / f"export-worker-{i}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "-c", _export_script(share)], cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        _WORKERS.append(proc)
        for n in share:
            _worker_file(n).write_text(f"{proc.pid}\n{log}\n")


def _worker_file(name: str) -> Path:
    return _bundle_path(name).with_name(_bundle_path(name).name + ".worker")


def _being_exported(name: str) -> bool:
    """A live worker (of this or another session) is writing it: leave it to that one."""
    worker = _worker_file(name)
    return worker.is_file() and _alive(int(worker.read_text().split("\n")[0] or 0))


def _alive(pid: int) -> bool:
    """The export worker `pid` is still running (not exited, not a zombie, not a reused pid)."""
    try:
        status = Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0]
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False
    return status != "Z" and b"export_bundles" in command


def stop_exports(interrupted: bool) -> None:
    """End the background exports this session started (a bundle being written is left as
    DIR.partial, which the next export removes). A pytest-xdist worker that ends normally waits
    for them instead: another worker's tests may still need what they write."""
    for proc in _WORKERS:
        if proc.poll() is None and os.environ.get("PYTEST_XDIST_WORKER") and not interrupted:
            proc.wait()
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    _WORKERS.clear()


def bundle(name: str) -> Path:
    """A real bundle, exported once per exporter version through the export package, in a
    child process (its checkpoints' memory is returned before the tests load anything): the
    session's background worker's (start_exports), waited for, or else one exporting every
    missing bundle of the same target, so each checkpoint is opened once."""
    out = _bundle_path(name)
    if (out / "manifest.json").is_file():
        return out
    worker = _worker_file(name)
    if worker.is_file():
        pid, log = worker.read_text().split("\n")[:2]
        waited = False
        while _alive(int(pid)) and not (out / "manifest.json").is_file():
            waited = True
            time.sleep(2)
        worker.unlink(missing_ok=True)
        if (out / "manifest.json").is_file():
            return out
        if waited:  # else the file was left by an earlier session: export here
            tail = Path(log).read_text(errors="replace").splitlines()[-20:] if Path(log).is_file() else []
            pytest.fail(f"the background export of {name} ended without it:\n" + "\n".join(tail))
    model = REAL_BUNDLES[name][0]
    todo = [n for n in missing_bundles() if REAL_BUNDLES[n][0] == model]
    subprocess.run([sys.executable, "-c", _export_script(todo)], cwd=ROOT, check=True)
    return out


def humaneval_messages(count: int) -> list[list[dict]]:
    """The bench's HumanEval chat prompts, so tests and BENCHMARKS.md speak of the same text."""
    from benchmarks.bench import load_prompts

    return [list(p.messages) for p in load_prompts(f"humaneval:{count}")]
