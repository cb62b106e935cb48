"""The offline GPU kit (`python -m benchmarks gpu_kit`, benchmarks/gpu_kit.py) built from the tiny
--device cuda bundle with stand-in wheels and a small piece limit, so every large file is split;
its launcher run as the box would run it (a subprocess, from the kit's own source) with
--provider cpu, which skips only the wheel install and the CUDA preload."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import tiny
from benchmarks.gpu_kit import KitConfig, build, main, sha256_file

PIECE = 64 * 1024  # small enough that the stand-in wheel and the bundle's weights are split
ORT_WHEEL = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
SMALL_WHEELS = ("tokenizers-0.23.3-cp310-abi3-manylinux_2_17_x86_64.whl", "onnx-1.23.2-cp312-abi3-manylinux_2_28_x86_64.whl",
                "jinja2-3.1.6-py3-none-any.whl")
NUMPY_WHEEL = "numpy-2.5.5-cp312-cp312-manylinux_2_28_x86_64.whl"


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """Stand-in wheels (random bytes): what the kit does with them is copy, split, hash and join."""
    import numpy as np

    folder = tmp_path_factory.mktemp("wheels")
    rng = np.random.default_rng(0)
    (folder / ORT_WHEEL).write_bytes(rng.bytes(3 * PIECE + 123))
    for name in (*SMALL_WHEELS, NUMPY_WHEEL):
        (folder / name).write_bytes(rng.bytes(1000))
    return folder


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(json.dumps({"id": "fox", "category": "prose", "prompt": tiny.PROMPT}) + "\n")
    return path


@pytest.fixture(scope="module")
def kit(tmp_path_factory, llama_gpu_bundle, wheels, prompts) -> Path:
    out = tmp_path_factory.mktemp("kit") / "kit"
    build(KitConfig(out=out, wheels=str(wheels / ORT_WHEEL), bundle=llama_gpu_bundle, prompts=str(prompts), piece_limit=PIECE))
    return out


def _launch(kit_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """launch.py as the box runs it: from its own folder, with the repository off sys.path."""
    return subprocess.run([sys.executable, str(kit_dir / "launch.py"), "--provider", "cpu", "--max-new-tokens", "8", *args],
                          capture_output=True, text=True, cwd=kit_dir, env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})


def test_every_kit_file_is_listed_hashed_and_within_the_piece_limit(kit, wheels):
    listed = json.loads((kit / "kit.json").read_text())
    on_disk = {p.relative_to(kit).as_posix() for p in kit.rglob("*") if p.is_file()} - {"kit.json"}
    assert {f["path"] for f in listed["files"]} == on_disk
    for item in listed["files"]:
        assert item["size"] == (kit / item["path"]).stat().st_size <= PIECE
        assert item["sha256"] == sha256_file(kit / item["path"])
    assert all(sum((kit / p).stat().st_size for p in run) <= PIECE for run in listed["carry"])
    assert sorted(p for run in listed["carry"] for p in run) == sorted(on_disk) and "launch.py" in listed["carry"][0]
    # The image's numpy is left out; the stand-in onnxruntime-gpu wheel is carried in four parts.
    assert sorted(listed["wheels"]) == sorted((ORT_WHEEL, *SMALL_WHEELS))
    split = {j["path"]: j for j in listed["joined"]}
    assert len(split[f"wheels/{ORT_WHEEL}"]["parts"]) == 4 and split[f"wheels/{ORT_WHEEL}"]["sha256"] == sha256_file(wheels / ORT_WHEEL)
    assert any(path.startswith("bundle/") for path in split)  # the bundle's weights were split too
    assert {"launch.py", "reference.npz", "prompts.jsonl", "src/benchmarks/gpu_check.py", "src/runtime/engine.py"} <= on_disk


def test_the_launcher_passes_end_to_end_on_the_cpu_provider(kit, wheels, tmp_path):
    proc = _launch(kit, "--out", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:] + proc.stdout[-2000:]
    assert sha256_file(kit / "wheels" / ORT_WHEEL) == sha256_file(wheels / ORT_WHEEL)  # joined
    record = json.loads((tmp_path / "run" / "kit_run.json").read_text())
    assert record["passed"] and record["providers"] and "libraries" not in record  # no preload on the CPU provider
    assert record["source"] == str((kit / "src").resolve())
    assert record["logits_vs_cpu_reference"]["top1_agreement"] == record["logits_vs_cpu_reference"]["top1_agreement_two_passes"] == 1.0
    assert set(record["greedy_identity"]) == {"model", "layer-skip", "lookup", "auto"}
    assert [row["T"] for row in record["micro"]["target_pass"]] == list(range(1, 17))  # the verify curve
    assert set(record["bench"]) == {"plain", "model", "layer-skip", "lookup", "auto"}
    assert all(row["prose"]["tokens_per_s"] > 0 for row in record["bench"].values())


def test_a_missing_or_corrupt_piece_is_named_in_one_line_exit_2(kit, tmp_path):
    broken = shutil.copytree(kit, tmp_path / "kit", ignore=shutil.ignore_patterns("run", "site"))
    listed = json.loads((broken / "kit.json").read_text())
    parts = [p for j in listed["joined"] for p in j["parts"]]
    (broken / parts[1]).unlink()
    data = bytearray((broken / parts[-1]).read_bytes())
    data[7] ^= 1
    (broken / parts[-1]).write_bytes(bytes(data))
    proc = _launch(broken)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"1 missing ({parts[1]})" in proc.stderr and f"1 corrupt ({parts[-1]})" in proc.stderr
    shutil.copy2(kit / parts[1], broken / parts[1])
    shutil.copy2(kit / parts[-1], broken / parts[-1])
    assert _launch(broken, "--verify-only").returncode == 0  # carried again: whole


def test_the_launcher_fails_on_a_bundle_that_computes_something_else(kit, llama_gpu_bundle, prompts, tmp_path):
    """The tiny bundle with rotary left out of its attention, carried with the right bundle's
    references: the kit is whole, and the agreement check fails it (exit 1)."""
    from test_device_profiles import _rewritten
    from test_provider_emulation import ignore_rotary

    wrong = build(KitConfig(out=tmp_path / "kit", bundle=_rewritten(llama_gpu_bundle, tmp_path / "wrong", ignore_rotary), prompts=str(prompts)))
    shutil.copy2(kit / "reference.npz", tmp_path / "kit" / "reference.npz")
    for item in wrong["files"]:
        if item["path"] == "reference.npz":
            item.update(size=(kit / "reference.npz").stat().st_size, sha256=sha256_file(kit / "reference.npz"))
    (tmp_path / "kit" / "kit.json").write_text(json.dumps(wrong))
    proc = _launch(tmp_path / "kit")
    assert proc.returncode == 1, proc.stderr[-2000:]
    record = json.loads((tmp_path / "kit" / "run" / "kit_run.json").read_text())
    assert "top-1 agreement with the CPU provider's logits on the same bundle below the floor 0.97" in record["error"]
    assert "profiled_placement" in record and "greedy_identity" not in record


def test_bad_builder_input_is_one_line_exit_2(llama_gpu_bundle, tmp_path, capsys):
    assert main(["--out", str(tmp_path / "k"), "--wheel", str(tmp_path / "onnxruntime-1.31.1.whl"), "--bundle", str(llama_gpu_bundle)]) == 2
    assert "not an onnxruntime_gpu-1.31.1 cp312 x86_64 wheel file" in capsys.readouterr().err
    assert main(["--out", str(tmp_path / "k"), "--no-wheels", "--bundle", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
