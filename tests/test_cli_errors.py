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


# -- value ranges at parse time, and manifest facts checked against the graphs ----------------------

@pytest.mark.parametrize("args, fragment", [
    (("serve", "--port", "-1"), "--port: -1 is out of range"),
    (("serve", "--port", "70000"), "--port: 70000 is out of range"),
    (("serve", "--gamma", "0"), "--gamma: must be auto or an integer"),
    (("serve", "--gamma", "-2"), "--gamma: must be auto or an integer"),
    (("serve", "--max-gamma", "0"), "--max-gamma: 0 is out of range"),
    (("serve", "--max-gamma", "100000"), "--max-gamma: 100000 is out of range"),
    (("serve", "--threads", "-1"), "--threads: -1 is out of range"),
    (("serve", "--queue-timeout", "-5"), "--queue-timeout: -5 is out of range"),
    (("serve", "--queue-timeout", "nan"), "--queue-timeout: nan is out of range"),
    (("serve", "--header-timeout", "0"), "--header-timeout: 0 is out of range"),
    (("serve", "--max-connections", "0"), "--max-connections: 0 is out of range"),
    (("serve", "--parallel", "0"), "--parallel: 0 is out of range"),
    (("serve", "--parallel", "2", "--block-stable"), "--parallel above 1 is not block-stable"),
    (("serve", "--client-prefix-v4", "33"), "--client-prefix-v4: client_prefix_v4 must be a prefix length from 1 to 32"),
    (("serve", "--client-prefix-v6", "0"), "--client-prefix-v6: client_prefix_v6 must be a prefix length from 1 to 128"),
    (("serve", "--auth-failures-global", "0"), "--auth-failures-global: auth_failures_global must be an integer >= 1"),
    (("serve", "--memory-budget", "9" * 400), "--memory-budget"),
    (("serve", "--api-key", "   "), "API key is empty or blank"),
    (("serve", "--allowed-origin", "attacker"), "is not an origin"),
    (("generate", "--prompt", "x", "--top-p", "0"), "--top-p: 0 is out of range"),
    (("generate", "--prompt", "x", "--max-new-tokens", "0"), "--max-new-tokens: 0 is out of range"),
    (("chat", "--temperature", "-1"), "--temperature: -1 is out of range"),
    (("generate", "--prompt", "x", "--temperature", "1e-310"), "at least 1e-269"),
    (("chat", "--temperature", "5e-324"), "at least 1e-269"),
])
def test_bad_values_fail_before_any_load(llama_bundle, args, fragment):
    import time

    began = time.monotonic()
    proc = _run("runtime", args[0], llama_bundle, *args[1:], timeout=60)
    line = _error_line(proc, only_line=True)
    assert fragment in line, line
    assert "provider:" not in proc.stderr  # nothing was loaded
    assert time.monotonic() - began < 20


def test_api_key_file_blank_or_missing(tmp_path, llama_bundle):
    (tmp_path / "keys").write_text("\n   \n# only comments\n")
    assert "holds no key" in _error_line(_run("runtime", "serve", llama_bundle, "--api-key-file", tmp_path / "keys"), only_line=True)
    assert "cannot read --api-key-file" in _error_line(_run("runtime", "serve", llama_bundle, "--api-key-file", tmp_path / "nope"), only_line=True)


def test_bench_out_an_existing_file(tmp_path, llama_bundle):
    (tmp_path / "f").write_text("keep")
    for out in (tmp_path / "f", tmp_path / "f" / "sub"):
        assert "exists and is not a folder" in _error_line(_run("benchmarks", "bench", llama_bundle, "--out", out), only_line=True)
    assert (tmp_path / "f").read_text() == "keep"


def test_runtime_bench_names_its_new_command(tmp_path, llama_bundle):
    """`python -m runtime bench` was the bench's old place: one `error:` line naming `python -m
    benchmarks bench` with the same arguments, exit 2, nothing run or written; the same from an
    installed runtime, which has no benchmarks/ folder to import."""
    out = tmp_path / "out"
    expected = f"run `python -m benchmarks bench {llama_bundle} --out {out} --quiet` from the repository's root"
    assert expected in _error_line(_run("runtime", "bench", llama_bundle, "--out", out, "--quiet"), only_line=True)
    installed = tmp_path / "site"
    installed.mkdir()
    for package in ("edge_spec", "runtime"):
        (installed / package).symlink_to(ROOT / package)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(installed))
    proc = subprocess.run([sys.executable, "-m", "runtime", "bench", str(llama_bundle), "--out", str(out), "--quiet"],
                          cwd=installed, env=env, capture_output=True, text=True, timeout=120)
    assert expected in _error_line(proc, only_line=True)
    assert not out.exists()


def _edited(llama_bundle, tmp_path, edit) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(llama_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def _set_arch(fact, value):
    def edit(manifest):
        for model in manifest["models"].values():
            model["arch"][fact] = value
    return edit


@pytest.mark.parametrize("edit, fragment", [
    (_set_arch("max_context", 128), "manifest says max_context 128 but stage"),
    (_set_arch("n_kv_heads", 4), "manifest says n_kv_heads 4 but stage"),
    (_set_arch("kv_dtype", "float16"), "float16"),
    (_set_arch("vocab_size", "400"), "vocab_size must be an integer"),
    (_set_arch("max_context", 64.5), "max_context must be an integer"),
    (lambda m: m["tokenizer"].update(chat_template="{% for m in messages %}{{ m['content'] }"), "chat template does not compile"),
    (lambda m: m["models"]["target"].update(block_size=48), "block_size 48 is not one of [16, 32, 64, 128, 256]"),
])
def test_manifest_facts_that_contradict_the_graphs(llama_bundle, tmp_path, edit, fragment):
    bundle = _edited(llama_bundle, tmp_path, edit)
    line = _error_line(_run("runtime", "generate", bundle, "--prompt", "x", "--provider", "cpu", "--max-new-tokens", "2"))
    assert fragment in line, line


@pytest.mark.parametrize("args, fragment", [
    (("--quant", "fp32", "--block-size", "128"), "--block-size 128 sets int4/int8 scales; --quant fp32 has none"),
    (("--block-size", "64", "--format", "onnx,coreml"), "Core ML packages quantize int4 per block of 32"),
])
def test_export_block_size_it_cannot_apply(tiny_models, tmp_path, args, fragment):
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", "--draft", "none", *args, timeout=60)
    assert fragment in _error_line(proc)
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("args, fragment", [
    (("--draft", "none", "--draft-block-size", "128"), "--draft-block-size quantizes a draft model and this export has none"),
    (("--draft", "layer-skip:1", "--draft-block-size", "128"), "a layer-skip draft runs the target's own weights"),
    (("--quant", "fp16", "--draft-block-size", "64"), "--draft-block-size 64 sets int4/int8 scales; --quant fp16 has none"),
    (("--draft-block-size", "64", "--format", "onnx,coreml"), "drop --format coreml or --draft-block-size"),
])
def test_export_draft_block_size_it_cannot_apply(tiny_models, tmp_path, args, fragment):
    drafts = () if "--draft" in args else ("--draft", tiny_models.draft)
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", *drafts, *args, timeout=60)
    assert fragment in _error_line(proc)
    assert not (tmp_path / "b").exists()


def test_export_block_size_not_offered(tiny_models, tmp_path):
    for flag in ("--block-size", "--draft-block-size"):
        proc = _run("export", tiny_models.llama, "--out", tmp_path / "b", flag, "48", timeout=60)
        assert proc.returncode == 2 and f"{flag}: invalid choice: 48 (choose from 16, 32, 64, 128, 256)" in proc.stderr
        assert not (tmp_path / "b").exists()


def test_export_out_under_a_file(tmp_path, tiny_models):
    (tmp_path / "f").write_text("keep")
    proc = _run("export", tiny_models.llama, "--out", tmp_path / "f" / "b", "--quant", "fp32", "--draft", "none", timeout=60)
    assert "exists and is not a folder" in _error_line(proc)
    assert (tmp_path / "f").read_text() == "keep"


@pytest.mark.real_weights
def test_real_weights_manifest_max_context_checked_against_the_graphs(tmp_path):
    from edge_spec.manifest import BundleError
    from runtime.engine import Engine, EngineConfig
    from tests import real

    real.need(real.QWEN_TARGET, real.QWEN_DRAFT)
    source = real.bundle("qwen-pair-int4")
    copy = tmp_path / "edited"
    copy.mkdir()
    for f in source.iterdir():
        if f.name != "manifest.json":
            try:  # hard links: a bundle refuses files that are symlinks out of its folder
                os.link(f, copy / f.name)
            except OSError:
                shutil.copy2(f, copy / f.name)
    manifest = json.loads((source / "manifest.json").read_text())
    for model in manifest["models"].values():
        model["arch"]["max_context"] *= 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match="manifest says max_context"):
        Engine(copy, EngineConfig(provider="cpu", drafter="none", calibrate=False, check_hashes=False))


def test_plan_context_beyond_the_bundle(llama_bundle):
    line = _error_line(_run("runtime", "plan", llama_bundle, "--context", str(10**12)), only_line=True)
    assert "--context 1000000000000 is more than the bundle's max context of 64 tokens" in line


def test_prompt_that_is_not_utf8(llama_bundle):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    for flag in ("--prompt", "--stop"):
        args = [b"--prompt", b"x", flag, b"\xff\xfe"] if flag == "--stop" else [flag, b"\xff\xfe"]
        proc = subprocess.run([sys.executable.encode(), b"-m", b"runtime", b"generate", str(llama_bundle).encode(), *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert f"{flag}: is not UTF-8 text" in _error_line(proc, only_line=True)


def test_bench_out_that_cannot_be_made(llama_bundle):
    line = _error_line(_run("benchmarks", "bench", llama_bundle, "--out", "/proc/x", "--quiet"), only_line=True)
    assert "cannot create --out /proc/x" in line
