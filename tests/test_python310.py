"""The runtime alone on Python 3.10, JetPack 6's Python, with the newest onnxruntime that has
Python 3.10 wheels (1.23.2, as pyproject's markers pick): the same tokens as this interpreter
for a --device cpu and a --device cuda bundle, speculating. The venv is made once per
pyproject.toml (pip, no torch) under $EDGE_SPEC_BUNDLES/../py310-*."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import real
import tiny

ROOT = Path(__file__).resolve().parent.parent


def _python310() -> Path:
    found = shutil.which("python3.10")
    if found is None:
        message = "needs a python3.10 interpreter on PATH (JetPack 6's Python)"
        if real.REQUIRE:  # CI has one (pyenv): there a missing interpreter fails
            pytest.fail(message)
        pytest.skip(message)
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:12]
    venv = real.bundles_root().parent / f"py310-{digest}"
    python = venv / "bin" / "python"
    if not python.is_file():
        env = dict(os.environ, PYENV_VERSION="3.10")
        subprocess.run([found, "-m", "venv", str(venv)], check=True, env=env, timeout=300)
        subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", f"{ROOT}[cpu]"], check=True, timeout=900)
    return python


def _generate(python, bundle) -> dict:
    proc = subprocess.run(
        [str(python), "-m", "runtime", "generate", str(bundle), "--provider", "cpu", "--prompt", tiny.PROMPT,
         "--max-new-tokens", "16", "--draft", "layer-skip", "--gamma", "3", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_runtime_on_python_310_gives_the_same_tokens(tiny_models, tmp_path):
    python = _python310()
    versions = subprocess.run([str(python), "-c", "import sys, onnxruntime; print(sys.version_info[:2], onnxruntime.__version__)"],
                              capture_output=True, text=True, check=True).stdout
    assert versions.startswith("(3, 10)"), versions
    for device in ("cpu", "cuda"):
        bundle = tmp_path / device
        tiny.export(tiny_models.qwen2, bundle, quant="int4", drafts=("layer-skip:1",), device=device)
        old, new = _generate(python, bundle), _generate(sys.executable, bundle)
        assert old["token_ids"] == new["token_ids"], (device, versions)
        assert old["stats"]["drafted_tokens"] > 0
