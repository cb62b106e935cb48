"""The command lines fail with exit status 2 and one clear `error:` line, never a traceback;
`generate --json` prints one JSON object."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(*args, timeout=120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, "-m", *map(str, args)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _error_line(proc: subprocess.CompletedProcess, only_line: bool = False) -> str:
    """The single `error:` line; with only_line, stderr holds nothing else (the runtime logs
    no progress, only the `provider:` line once a bundle is loaded)."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, proc.stderr
    if only_line:
        assert [line for line in proc.stderr.splitlines() if not line.startswith("provider: ")] == errors, proc.stderr
    return errors[0]


def test_export_unknown_alias(tmp_path):
    proc = _run("export", "llama-9000b", "--out", tmp_path / "b")
    line = _error_line(proc)
    assert "unknown model 'llama-9000b'" in line
    assert "llama-3.2-1b" in line  # lists the aliases it knows
    assert not (tmp_path / "b").exists()


def test_export_missing_gguf(tmp_path):
    missing = tmp_path / "models" / "tiny-Q4_K_M.gguf"
    proc = _run("export", missing, "--out", tmp_path / "b")
    line = _error_line(proc)
    assert f"could not load '{missing}'" in line
    assert "file not found" in proc.stderr and str(missing) in proc.stderr
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_export_unsupported_architecture(tiny_models, tmp_path):
    proc = _run("export", tiny_models.gemma2, "--out", tmp_path / "b", "--quant", "fp32", "--draft", "none")
    line = _error_line(proc)
    assert "architecture 'gemma2' is not supported (supported: gemma3_text, llama, mistral, phi3, qwen2, qwen3)" in line
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.partial").exists()


def test_export_draft_with_other_tokenizer(tiny_models, tmp_path):
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", "--quant", "fp32", "--max-context", "32", "--draft", tiny_models.draft_other_vocab)
    line = _error_line(proc)
    assert "does not share the target's tokenizer" in line


def test_export_existing_folder_needs_force(tmp_path, tiny_models):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "x").write_text("keep")
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", "--quant", "fp32", "--draft", "none")
    assert "--force" in _error_line(proc)
    assert (tmp_path / "b" / "x").read_text() == "keep"


@pytest.fixture
def altered_bundle(llama_bundle, tmp_path) -> Path:
    copy = tmp_path / "bundle"
    shutil.copytree(llama_bundle, copy)
    path = copy / "target.trunk.onnx.data"
    data = bytearray(path.read_bytes())
    data[100] ^= 0xFF
    path.write_bytes(bytes(data))
    return copy


def test_generate_altered_bundle(altered_bundle):
    proc = _run("runtime", "generate", altered_bundle, "--prompt", "hi")
    line = _error_line(proc, only_line=True)
    assert "bundle file altered" in line and "target.trunk.onnx.data" in line
    assert proc.stdout == ""


def test_generate_not_a_bundle(tmp_path):
    line = _error_line(_run("runtime", "generate", tmp_path, "--prompt", "hi"), only_line=True)
    assert "is not a bundle" in line


def test_generate_prompt_too_long(llama_bundle):
    proc = _run("runtime", "generate", llama_bundle, "--prompt", "the quick brown fox " * 40, "--draft", "none")
    line = _error_line(proc, only_line=True)
    assert "but the bundle's max context is 64" in line and "--max-context" in line


def test_generate_missing_provider(llama_bundle):
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this machine has CUDA")
    proc = _run("runtime", "generate", llama_bundle, "--prompt", "hi", "--provider", "cuda")
    line = _error_line(proc, only_line=True)
    assert "provider 'cuda'" in line and "onnxruntime-gpu" in line and "--allow-fallback" in line
    # With the fallback allowed it runs on the CPU.
    proc = _run("runtime", "generate", llama_bundle, "--prompt", "hi", "--provider", "cuda", "--allow-fallback", "--max-new-tokens", "3", "--draft", "none", "--json")
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) in range(1, 4)


def test_generate_unknown_provider(llama_bundle):
    assert "unknown provider 'tpu'" in _error_line(_run("runtime", "generate", llama_bundle, "--prompt", "hi", "--provider", "tpu"), only_line=True)


def test_generate_json(llama_bundle):
    proc = _run("runtime", "generate", llama_bundle, "--prompt", "hi", "--json", "--max-new-tokens", "6", "--gamma", "2")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1
    out = json.loads(lines[0])
    assert set(out) == {"text", "prompt_ids", "token_ids", "stop_reason", "provider", "timings", "stats"}
    assert isinstance(out["text"], str)
    assert out["prompt_ids"][0] == 0 and len(out["prompt_ids"]) >= 2  # BOS, then "hi"
    assert 1 <= len(out["token_ids"]) <= 6
    assert out["stop_reason"] in ("length", "eos")
    assert out["timings"]["prefill_ms"] >= 0 and out["timings"]["decode_tokens_per_s"] > 0
    stats = out["stats"]
    for key in ("target_passes", "drafted_tokens", "accepted_tokens", "acceptance_rate", "tokens_per_pass", "gamma_histogram"):
        assert key in stats
    assert stats["target_passes"] >= 1


def test_generate_json_is_greedy_and_matches_api(llama_bundle):
    """The CLI's greedy tokens are the Python API's."""
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    proc = _run("runtime", "generate", llama_bundle, "--prompt", "the cat", "--json", "--max-new-tokens", "8", "--draft", "lookup", "--chat")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    engine = Engine(llama_bundle, EngineConfig(drafter="none", calibrate=False))
    ids = engine.encode(messages=[{"role": "user", "content": "the cat"}])
    assert out["prompt_ids"] == ids
    assert out["token_ids"] == engine.generate(ids, GenerateConfig(max_new_tokens=8)).token_ids
