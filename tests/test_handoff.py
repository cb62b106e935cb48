"""`python -m runtime handoff`: serve commands for vLLM and SGLang with the bundle's target and draft.

Argument names are checked against the sets those engines document (facts from their docs, see
runtime/handoff.py); neither engine is installed or run here."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.bundle import open_bundle
from runtime.handoff import draft_length, hub_id, plan

ROOT = Path(__file__).resolve().parent.parent
VLLM_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
VLLM_FLAGS = {"--host", "--port", "--max-model-len", "--speculative-config"}
SGLANG_FLAGS = {"--model-path", "--host", "--port", "--context-length", "--speculative-algorithm",
                "--speculative-draft-model-path", "--speculative-num-steps", "--speculative-eagle-topk",
                "--speculative-num-draft-tokens", "--speculative-ngram-min-match-window-size",
                "--speculative-ngram-max-match-window-size"}


def _flags(argv) -> set[str]:
    return {a for a in argv if a.startswith("--")}


@pytest.mark.parametrize("method", ["draft", "lookup"])
def test_vllm_and_sglang_commands_use_documented_names(llama_bundle, method):
    manifest = open_bundle(llama_bundle, check_hashes=False).manifest
    v = plan(manifest, "vllm", method, alpha=0.8)
    assert v.argv[:2] == ("vllm", "serve") and _flags(v.argv) <= VLLM_FLAGS
    spec = json.loads(v.argv[v.argv.index("--speculative-config") + 1])
    assert set(spec) <= VLLM_SPEC_KEYS and spec["method"] == ("draft_model" if method == "draft" else "ngram")
    assert v.argv[v.argv.index("--max-model-len") + 1] == str(manifest.target.arch.max_context)
    s = plan(manifest, "sglang", method, alpha=0.8)
    assert s.argv[:3] == ("python", "-m", "sglang.launch_server") and _flags(s.argv) <= SGLANG_FLAGS
    algorithm = s.argv[s.argv.index("--speculative-algorithm") + 1]
    assert algorithm == ("STANDALONE" if method == "draft" else "NGRAM")
    if method == "draft":
        steps = int(s.argv[s.argv.index("--speculative-num-steps") + 1])
        assert int(s.argv[s.argv.index("--speculative-num-draft-tokens") + 1]) == steps + 1
        assert spec["num_speculative_tokens"] == steps  # the same draft length on both engines


def test_draft_length_follows_alpha_and_cost():
    assert draft_length(0.3, 0.3) <= draft_length(0.7, 0.3) <= draft_length(0.95, 0.3)
    assert draft_length(0.8, 0.02) > draft_length(0.8, 0.5)
    assert draft_length(0.1, 0.5) == 1


def test_sources_map_to_hub_ids():
    assert hub_id("hub id Qwen/Qwen2.5-Coder-1.5B-Instruct (Hugging Face cache or hub)")[0] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    repo, note = hub_id("catalog GGUF /m/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    assert repo == "Qwen/Qwen2.5-Coder-0.5B-Instruct" and "GGUF" in note
    path, note = hub_id("local folder /data/my-model")
    assert path == "/data/my-model" and "no hub id" in note


def test_cli_prints_a_command_and_refuses_bad_values(llama_bundle, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "runtime", "handoff", str(llama_bundle), "--engine", "vllm", "--json"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert shlex.split(data["command"]) == data["argv"]
    assert any("not a measurement" in n for n in data["notes"])
    bad = subprocess.run([sys.executable, "-m", "runtime", "handoff", str(llama_bundle), "--engine", "vllm", "--alpha", "1.5"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.startswith("error: argument --alpha")
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [{"mode": "model", "alpha": 0.9}, {"mode": "model", "alpha": 0.7}, {"mode": "plain", "alpha": None}]}))
    out = subprocess.run([sys.executable, "-m", "runtime", "handoff", str(llama_bundle), "--engine", "sglang", "--bench-results",
                          str(results)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "α=0.800" in out.stdout, out.stderr
    (tmp_path / "broken.json").write_text("{not json")
    for bad_file in (tmp_path / "missing.json", tmp_path / "broken.json"):
        out = subprocess.run([sys.executable, "-m", "runtime", "handoff", str(llama_bundle), "--engine", "vllm", "--bench-results",
                              str(bad_file)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 2 and out.stderr.startswith(f"error: --bench-results {bad_file}"), out.stderr
        assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.real_weights
def test_real_weights_qwen_pair_hands_off_to_hub_ids():
    from tests import real

    real.need(real.QWEN_TARGET, real.QWEN_DRAFT)
    manifest = open_bundle(real.bundle("qwen-pair-int4"), check_hashes=False).manifest
    v = plan(manifest, "vllm", "draft", alpha=0.7)
    assert v.argv[2] == "Qwen/Qwen2.5-Coder-1.5B-Instruct"
    assert json.loads(v.argv[-1])["model"] == "Qwen/Qwen2.5-Coder-0.5B-Instruct"
