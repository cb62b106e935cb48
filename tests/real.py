"""Real-weight fixtures: the official files from $EDGE_SPEC_MODELS and bundles built from them.

Without the files these tests skip, naming the file and how to get it; CI sets
EDGE_SPEC_REQUIRE_MODELS=1 so that a missing file fails instead. Bundles are cached under
$EDGE_SPEC_BUNDLES (default ~/.cache/edge-spec/bundles), keyed by a hash of the code that
decides their bytes, so a change there rebuilds them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
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

    for name in ("export/static_cache.py", "export/onnx_graphs.py", "export/quantize.py", "export/bundle.py", "export/sources.py", "edge_spec/names.py"):
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
    "smollm2-int8": ("smollm2-135m", "int8", ("layer-skip:10",), 1024, "fused", "cpu"),
    "qwen-pair-int4": ("qwen2.5-coder-1.5b", "int4", ("qwen2.5-coder-0.5b", LAYER_SKIP), 2048, "fused", "cpu"),
    "qwen-pair-int8": ("qwen2.5-coder-1.5b", "int8", ("qwen2.5-coder-0.5b", LAYER_SKIP), 2048, "fused", "cpu"),
    "qwen-pair-cuda-int4": ("qwen2.5-coder-1.5b", "int4", ("qwen2.5-coder-0.5b", LAYER_SKIP), 2048, "fused", "cuda"),
    "qwen15-fp32": ("qwen2.5-coder-1.5b", "fp32", (), 1024, "fused", "cpu"),
    # Gemma 3: 1024 positions reach past its 512-token sliding window.
    "gemma3-fp32": ("gemma-3-270m", "fp32", ("layer-skip:9",), 1024, "fused", "cpu"),
    "gemma3-int8": ("gemma-3-270m", "int8", ("layer-skip:9",), 1024, "fused", "cpu"),
    "gemma3-int4": ("gemma-3-270m", "int4", ("layer-skip:9",), 1024, "fused", "cpu"),
    # The int4 pair with the draft's LM head trimmed (export --draft-vocab, counted on stdlib,docs).
    "qwen-pair-int4-trim32k": ("qwen2.5-coder-1.5b", "int4", ("qwen2.5-coder-0.5b",), 2048, "fused", "cpu"),
}
DRAFT_VOCAB = {"qwen-pair-int4-trim32k": 32768}  # name -> export --draft-vocab


def _bundle_path(name: str) -> Path:
    return bundles_root() / f"{name}-{_exporter_hash()}"


def bundle(name: str) -> Path:
    """A real bundle, exported once per exporter version through the export package, in a
    child process (its checkpoints' memory is returned before the tests load anything).
    Every missing bundle of the same target is built in that one process, so each
    checkpoint is loaded once."""
    out = _bundle_path(name)
    if not (out / "manifest.json").is_file():
        model = REAL_BUNDLES[name][0]
        todo = [n for n, spec in REAL_BUNDLES.items() if spec[0] == model and not (_bundle_path(n) / "manifest.json").is_file()]
        configs = [
            f"ExportConfig({REAL_BUNDLES[n][0]!r}, Path({str(_bundle_path(n))!r}), {REAL_BUNDLES[n][1]!r}, {REAL_BUNDLES[n][3]}, {REAL_BUNDLES[n][2]!r}, force=True, attention={REAL_BUNDLES[n][4]!r}, device={REAL_BUNDLES[n][5]!r}, draft_vocab={DRAFT_VOCAB.get(n)!r})"
            for n in todo
        ]
        script = "from pathlib import Path\nfrom export.bundle import ExportConfig, export_bundles\nexport_bundles([" + ", ".join(configs) + "])"
        subprocess.run([sys.executable, "-c", script], cwd=ROOT, check=True)
    return out


def humaneval_messages(count: int) -> list[list[dict]]:
    """The bench's HumanEval chat prompts, so tests and BENCHMARKS.md speak of the same text."""
    from benchmarks.bench import load_prompts

    return [list(p.messages) for p in load_prompts(f"humaneval:{count}")]
