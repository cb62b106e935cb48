"""The memory plan of the real Qwen pair against the peak resident memory of `python -m runtime
generate` (VmHWM of the child, written by the child at exit), and refusal under a budget too small.

The prompt fills about half the context (a full one takes minutes to prefill on two cores), so
the run is compared with the plan for the tokens it used: the KV rows and embedding rows it
never touched are not backed yet. The budget it runs under is the full-context plan."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import real
from edge_spec.budget import format_size, plan_bundle
from edge_spec.manifest import load_manifest

pytestmark = pytest.mark.real_weights

TOLERANCE = 0.10
PROMPT_TOKENS = 900
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def pair() -> Path:
    real.need(real.QWEN_TARGET, real.QWEN_DRAFT)
    return real.bundle("qwen-pair-int4")


@pytest.fixture(scope="module", params=[("qwen-pair-int4", "model"), ("qwen05-cuda-int4", "none")], ids=lambda p: p[0])
def planned_pair(request) -> tuple[Path, str]:
    """The CPU profile's pair with its draft model, and a --device cuda target (float16 KV:
    half the KV bytes) decoding plain."""
    real.need(real.QWEN_TARGET, real.QWEN_DRAFT)
    return real.bundle(request.param[0]), request.param[1]


def _prompt(bundle: Path, n_tokens: int) -> str:
    """n_tokens of this repository's own code, as text (varied tokens, like a coding prompt)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(bundle / "tokenizer.json"))
    text = "".join((real.ROOT / f).read_text() for f in ("runtime/engine.py", "runtime/server/app.py", "runtime/api.py"))
    return tokenizer.decode(tokenizer.encode(text).ids[:n_tokens])


# Runs the CLI and writes its peak resident memory (VmHWM of its own address space) at exit.
# Not wait4's ru_maxrss: a child forked from this test process inherits the parent's high-water
# mark, which is gigabytes once other real-weight tests have loaded transformers models here.
_WRITE_PEAK_AT_EXIT = """
import atexit, os, runpy, sys
def _write_peak():
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    with open(os.environ["EDGE_SPEC_PEAK_FILE"], "w") as out:
        out.write(str(kib * 1024))
atexit.register(_write_peak)
"""
_PEAK_WRAPPER = _WRITE_PEAK_AT_EXIT + """
sys.argv = ["runtime", *sys.argv[1:]]
runpy.run_module("runtime", run_name="__main__", alter_sys=True)
"""


def _generate(bundle: Path, tmp_path: Path, *args) -> tuple[int, int, float, str]:
    """Run `python -m runtime generate`; returns (exit status, peak RSS bytes, seconds, stderr)."""
    peak_file = tmp_path / "peak"
    env = dict(os.environ, PYTHONPATH=str(real.ROOT), TOKENIZERS_PARALLELISM="false", EDGE_SPEC_PEAK_FILE=str(peak_file))
    stdout, stderr = tmp_path / "stdout", tmp_path / "stderr"
    began = time.perf_counter()
    with open(stdout, "w") as out, open(stderr, "w") as err:
        returncode = subprocess.call(
            [sys.executable, "-c", _PEAK_WRAPPER, "generate", str(bundle), "--provider", "cpu", *map(str, args)],
            cwd=real.ROOT, env=env, stdout=out, stderr=err,
        )
    return returncode, int(peak_file.read_text()), time.perf_counter() - began, stderr.read_text()


def test_plan_matches_peak_resident_memory(planned_pair, tmp_path):
    pair, drafter = planned_pair
    manifest = load_manifest(pair, check_hashes=False)
    full = plan_bundle(manifest, pair, drafter)
    budget = round(full.total_bytes * (1 + TOLERANCE))
    prompt = _prompt(pair, PROMPT_TOKENS)
    rc, peak, seconds, stderr = _generate(
        pair, tmp_path, "--draft", drafter, "--prompt", prompt, "--max-new-tokens", NEW_TOKENS, "--memory-budget", budget,
    )
    assert rc == 0, stderr
    from tokenizers import Tokenizer

    used = len(Tokenizer.from_file(str(pair / "tokenizer.json")).encode(prompt).ids) + NEW_TOKENS
    planned = plan_bundle(manifest, pair, drafter, context=used)
    report = (
        f"peak RSS {format_size(peak)}; plan at {used} tokens {format_size(planned.total_bytes)} "
        f"({planned.total_bytes / peak - 1:+.1%}); full-context plan {format_size(full.total_bytes)}, "
        f"budget {format_size(budget)}; {seconds:.0f} s"
    )
    print(report)
    assert abs(planned.total_bytes - peak) <= TOLERANCE * peak, report
    assert peak <= budget, report  # a run under the plan (+ tolerance) stays under it
    if manifest.device == "cuda":  # float16 KV: half the float32 bytes for the same shape
        float32 = plan_bundle(dataclasses.replace(manifest, device="cpu", models={
            r: dataclasses.replace(m, arch=dataclasses.replace(m.arch, kv_dtype="float32")) for r, m in manifest.models.items()
        }), pair, drafter)
        assert full.part("KV target") * 2 == float32.part("KV target")


# Four sequences decoded together in one process (Engine.generate_batch: the first holds the draft
# model), its peak written at exit (_WRITE_PEAK_AT_EXIT). argv: bundle, budget, prompt files.
_BATCH_WRAPPER = _WRITE_PEAK_AT_EXIT + """
from runtime.engine import Engine, EngineConfig, GenerateConfig
engine = Engine(sys.argv[1], EngineConfig(provider="cpu", drafter="model", calibrate=False, memory_budget=int(sys.argv[2])))
prompts = [engine.encode(prompt=open(path).read()) for path in sys.argv[3:]]
n = int(os.environ["EDGE_SPEC_NEW_TOKENS"])
configs = [GenerateConfig(max_new_tokens=n, speculation={"drafter": "model"})] + [GenerateConfig(max_new_tokens=n)] * (len(prompts) - 1)
engine.generate_batch(prompts, configs)
"""


def test_plan_of_four_batched_sequences_matches_peak_resident_memory(pair, tmp_path):
    """`runtime plan --parallel 4` against a process that decodes four sequences in KV slots."""
    from tokenizers import Tokenizer

    manifest = load_manifest(pair, check_hashes=False)
    budget = round(plan_bundle(manifest, pair, "model", parallel=4).total_bytes * (1 + TOLERANCE))
    tokenizer = Tokenizer.from_file(str(pair / "tokenizer.json"))
    code = tokenizer.encode("".join((real.ROOT / f).read_text() for f in ("runtime/engine.py", "runtime/server/app.py", "runtime/api.py"))).ids
    files, length = [], PROMPT_TOKENS // 4  # four prefills of a quarter-length prompt: the plan's slots, at a quarter of the prefill
    for k in range(4):
        files.append(tmp_path / f"prompt{k}.txt")
        files[-1].write_text(tokenizer.decode(code[k * length : (k + 1) * length]))
    used = max(len(tokenizer.encode(f.read_text()).ids) for f in files) + NEW_TOKENS
    peak_file = tmp_path / "peak"
    env = dict(os.environ, PYTHONPATH=str(real.ROOT), TOKENIZERS_PARALLELISM="false", EDGE_SPEC_PEAK_FILE=str(peak_file),
               EDGE_SPEC_NEW_TOKENS=str(NEW_TOKENS))
    began = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _BATCH_WRAPPER, str(pair), str(budget), *map(str, files)], cwd=real.ROOT, env=env,
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    peak = int(peak_file.read_text())
    planned = plan_bundle(manifest, pair, "model", context=used, parallel=4)
    report = (f"peak RSS {format_size(peak)}; plan --parallel 4 at {used} tokens {format_size(planned.total_bytes)} "
              f"({planned.total_bytes / peak - 1:+.1%}), of which KV slots {format_size(planned.part('KV slots'))}; "
              f"{time.perf_counter() - began:.0f} s")
    print(report)
    assert abs(planned.total_bytes - peak) <= TOLERANCE * peak, report


def test_too_small_budget_is_refused_quickly(pair, tmp_path):
    full = plan_bundle(load_manifest(pair, check_hashes=False), pair, "model")
    rc, peak, seconds, stderr = _generate(pair, tmp_path, "--draft", "model", "--prompt", "def f():", "--memory-budget", full.total_bytes // 2)
    assert rc == 2, stderr
    assert stderr.startswith("error: memory budget") and "is too small" in stderr
    assert "weights target" in stderr and "KV draft" in stderr and "does NOT fit" in stderr
    # Refused before loading: hashing the files is all it did, and no weights became resident.
    assert seconds < 60, seconds
    assert peak < 300 * 2**20, format_size(peak)


@pytest.mark.parametrize("name,spec,files", [("qwen-pair-int4", "qwen2.5-coder-1.5b", (real.QWEN_TARGET, real.QWEN_DRAFT)),
                                             ("smollm2-pair-int4-d128", "smollm2-135m", (real.SMOLLM2,))])
def test_export_plan_of_kept_gguf_blocks_matches_the_written_target(name, spec, files):
    """export --memory-budget plans a GGUF whose blocks it keeps at the bytes of its own tensor types
    (Q6_K at 8 bits per 16, the float minimum per 32), read from the file's tensor table: within 2%
    of the target the export wrote, where the re-quantized formula is far off."""
    from export.bundle import ExportConfig, model_facts

    real.need(*files)
    bundle = real.bundle(name)
    manifest = load_manifest(bundle, check_hashes=False)
    assert manifest.target.gguf_blocks, "the default int4 export of a GGUF keeps its blocks"
    stages = [manifest.stages[key] for key in manifest.target.stages]
    written = sum((bundle / f).stat().st_size for stage in stages for f in (stage.file, *stage.data_files))
    vocab = manifest.target.arch.vocab_size
    kept = model_facts(spec, ExportConfig(spec, bundle)).weights("int4", vocab).stored
    formula = model_facts(spec).weights("int4", vocab).stored
    report = f"written {format_size(written)}, planned {format_size(kept)} (re-quantized formula {format_size(formula)})"
    assert abs(kept / written - 1) < 0.02, report
    assert abs(formula / written - 1) > 0.1, report
