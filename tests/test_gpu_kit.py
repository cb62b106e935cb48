"""The offline GPU kit (`python -m benchmarks gpu_kit`, benchmarks/gpu_kit.py and gpu_kit_launch.py):
built inside a git checkout that stands for the repository (its tracked tree travels with every
transfer), rehearsed as the box would take it: each transfer under the limits, carried into an
empty folder that holds only the tree, the launcher run there with --provider cpu, which skips
only onnxruntime-gpu and the CUDA preload."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

import tiny
from benchmarks.gpu_kit import MIB, KitConfig, Transport, build, main, rehearse

ORT_WHEEL = "onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl"
HUMANEVAL_2 = "humaneval:2"


def _checkout(root: Path) -> Path:
    """A git checkout with a few tracked files (the tree that travels) and the kit's folder ignored."""
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    (root / ".gitignore").write_text("/kit/\n")
    (root / "README.md").write_text("a checkout\n")
    (root / "blob.bin").write_bytes(np.random.default_rng(1).bytes(100_000))
    subprocess.run(["git", "-C", str(root), "add", "."], check=True)
    return root


def _stand_in_wheel(folder: Path, size: int) -> Path:
    """A real wheel file named as onnxruntime-gpu's, holding random bytes (incompressible, as the
    CUDA libraries nearly are): the kit unpacks it into site/, which --provider cpu never imports."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / ORT_WHEEL
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("onnxruntime/capi/libonnxruntime_providers_cuda.so", np.random.default_rng(0).bytes(size))
        z.writestr("onnxruntime_gpu-1.31.1.dist-info/METADATA", "Name: onnxruntime-gpu\nVersion: 1.31.1\n")
    return path


def _small(tree: Path, transfer_kib: int) -> Transport:
    """Transfers as small as the tree plus `transfer_kib`, so the tiny kit takes several."""
    from benchmarks.gpu_kit import tree_files

    tree_bytes = sum(p.stat().st_size for p in tree_files(tree))
    return Transport(transfer_bytes=tree_bytes + transfer_kib * 1024, slack_bytes=0)


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    path.write_text(json.dumps({"id": "fox", "category": "prose", "prompt": tiny.PROMPT}) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_kit(tmp_path_factory, llama_gpu_bundle, prompts) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("kit")
    tree = _checkout(root / "repo")
    wheel = _stand_in_wheel(root / "wheels", 200_000)
    config = KitConfig(out=tree / "kit", wheels=str(wheel), bundle=llama_gpu_bundle, prompts=str(prompts), xz_preset=0,
                       transport=_small(tree, 400), cache=root / "cache")
    build(config)
    return tree, tree / "kit"


def test_every_transfer_is_one_ignored_folder_of_few_files_within_the_limit(tiny_kit):
    tree, kit_dir = tiny_kit
    kit = json.loads((kit_dir / "carry-1" / "kit.json").read_text())
    assert len(kit["transfers"]) >= 3  # the small limit splits the payload over several transfers
    carried = [f for t in kit["transfers"] for f in t["files"]]
    assert sorted(carried) == sorted(p.relative_to(kit_dir).as_posix() for p in kit_dir.glob("carry-*/*"))
    for i, transfer in enumerate(kit["transfers"]):
        assert transfer["carry"] == [f"kit/carry-{i + 1}"] and len(transfer["files"]) <= 3
        assert kit["tree_bytes"] + transfer["bytes"] <= kit["transport"]["transfer_bytes"]
        assert transfer["command"].startswith("python3 kit/carry-1/launch.py")
    assert kit["transfers"][-1]["command"] == "python3 kit/carry-1/launch.py"  # the last transfer runs the checks
    assert {"launch.py", "kit.json", "payload.000"} == {p.name for p in (kit_dir / "carry-1").iterdir()}
    # The pieces are the members' bytes in order, the bundle's member first.
    stream = b"".join((kit_dir / p["path"]).read_bytes() for p in kit["pieces"])
    assert [m["name"] for m in kit["members"]] == ["kit.tar.xz", "site-" + kit["members"][1]["name"][5:]]
    for member in kit["members"]:
        import hashlib

        assert hashlib.sha256(stream[member["offset"] : member["offset"] + member["size"]]).hexdigest() == member["sha256"]
    planned = kit["plan"]
    assert planned["steps"][0]["step"] == "start" and planned["steps"][-1]["step"] == "run"
    assert planned["total_s"] == round(sum(s["seconds"] for s in planned["steps"]), 1)
    reference = kit["reference"]
    assert reference["gpu"]["min_top1"] <= reference["gpu"]["emulated"]["top1_agreement"] - reference["gpu"]["margin"]


def test_the_rehearsal_carries_the_kit_and_the_launcher_passes_on_the_cpu_provider(tiny_kit):
    tree, kit_dir = tiny_kit
    record = rehearse(kit_dir, tree, launch_args=("--max-new-tokens", "8"))
    assert record["passed"], record["breaches"]
    steps = record["transfers"]
    assert [s["exit"] for s in steps] == [2] * (len(steps) - 1) + [0]  # --verify-only names what is missing until the last
    run = steps[-1]["kit_run"]
    assert run["passed"] and run["provider"] == "cpu" and "libraries" not in run
    assert run["source"].endswith("kit/unpacked/src")  # the kit's own copy of the runtime
    assert run["logits_vs_cpu_reference"]["top1_agreement"] == run["logits_vs_cpu_reference"]["top1_agreement_two_passes"] == 1.0
    assert run["reference"]["describe"] == "the CPU provider's logits on the same bundle"
    assert set(run["greedy_identity"]["block_stable"]) == {"model", "layer-skip", "lookup", "auto"}
    assert [row["T"] for row in run["micro"]["target_pass"]] == list(range(1, 17))  # the verify curve
    assert set(run["bench"]) == {"plain", "model", "layer-skip", "lookup", "auto"}


def test_the_rehearsal_fails_a_kit_that_breaks_a_limit(tiny_kit):
    tree, kit_dir = tiny_kit
    kit = json.loads((kit_dir / "carry-1" / "kit.json").read_text())
    tight = Transport(**{**kit["transport"], "transfer_bytes": kit["transport"]["transfer_bytes"] - 300 * 1024})
    record = rehearse(kit_dir, tree, tight)
    assert not record["passed"] and any("MiB with the tree" in b for b in record["breaches"])
    slow = Transport(**{**kit["transport"], "start_s": 700.0})
    assert any("the plan takes" in b for b in rehearse(kit_dir, tree, slow)["breaches"])


def test_a_missing_or_corrupt_piece_is_named_in_one_line_exit_2(tiny_kit, tmp_path):
    _, kit_dir = tiny_kit
    broken = shutil.copytree(kit_dir, tmp_path / "kit", ignore=shutil.ignore_patterns("run", "unpacked", "joined"))
    kit = json.loads((broken / "carry-1" / "kit.json").read_text())
    gone, bad = kit["pieces"][1]["path"], kit["pieces"][-1]["path"]
    (broken / gone).unlink()
    data = bytearray((broken / bad).read_bytes())
    data[7] ^= 1
    (broken / bad).write_bytes(bytes(data))
    proc = subprocess.run([sys.executable, str(broken / "carry-1" / "launch.py"), "--provider", "cpu"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and f"1 missing ({gone})" in proc.stderr and f"1 corrupt ({bad})" in proc.stderr
    shutil.copy2(kit_dir / gone, broken / gone)
    shutil.copy2(kit_dir / bad, broken / bad)
    assert subprocess.run([sys.executable, str(broken / "carry-1" / "launch.py"), "--verify-only"], capture_output=True, cwd=tmp_path).returncode == 0


def test_the_launcher_fails_on_a_bundle_that_computes_something_else(tiny_kit, llama_gpu_bundle, prompts, tmp_path):
    """The tiny bundle with rotary left out of its attention, carried with the right bundle's
    references: the kit is whole, and the agreement check fails it (exit 1)."""
    from test_device_profiles import _rewritten
    from test_provider_emulation import ignore_rotary

    tree, kit_dir = tiny_kit
    right = json.loads((kit_dir / "carry-1" / "kit.json").read_text())
    wrong_tree = _checkout(tmp_path / "repo")
    wrong = _rewritten(llama_gpu_bundle, tmp_path / "wrong", ignore_rotary)
    build(KitConfig(out=wrong_tree / "kit", bundle=wrong, prompts=str(prompts), xz_preset=0), references=(kit_dir / "references", right["reference"]))
    proc = subprocess.run([sys.executable, str(wrong_tree / "kit" / "carry-1" / "launch.py"), "--provider", "cpu", "--max-new-tokens", "8"],
                          capture_output=True, text=True, cwd=wrong_tree)
    assert proc.returncode == 1, proc.stderr[-2000:]
    record = json.loads((wrong_tree / "kit" / "run" / "kit_run.json").read_text())
    assert "top-1 agreement with the CPU provider's logits on the same bundle below the floor 0.97" in record["error"]
    assert "profiled_placement" in record and "greedy_identity" not in record


def test_bad_builder_input_is_one_line_exit_2(llama_gpu_bundle, tmp_path, capsys):
    tree = _checkout(tmp_path / "repo")
    assert main(["--out", str(tree / "k"), "--no-wheels", "--bundle", str(llama_gpu_bundle)]) == 2
    assert "not ignored by git" in capsys.readouterr().err  # it would travel with the tree in every transfer
    assert main(["--out", str(tree / "kit"), "--wheel", str(tmp_path / "onnxruntime-1.31.1.whl"), "--bundle", str(llama_gpu_bundle)]) == 2
    assert "not an onnxruntime_gpu-1.31.1 cp312 x86_64 wheel file" in capsys.readouterr().err
    assert main(["--out", str(tree / "kit"), "--no-wheels", "--bundle", str(tmp_path)]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert not (tree / "kit").exists()


def test_the_box_lacking_a_runtime_dependency_is_named(monkeypatch):
    from importlib import metadata

    from benchmarks import gpu_kit_launch

    box = {"numpy": "2.5.2", "tokenizers": "0.23.2", "onnx": "1.23.1", "jinja2": "3.1.6"}  # the lent box's image: taken
    monkeypatch.setattr(metadata, "version", lambda name: box[name])
    assert gpu_kit_launch.box_requirements() == box
    box["onnx"] = "1.22.0"
    with pytest.raises(gpu_kit_launch.KitError, match=r"onnx 1\.22\.0 \(the runtime takes 1\.23 up to below 1\.24\)"):
        gpu_kit_launch.box_requirements()


def test_the_reference_emulation_dequantizes_as_the_contrib_spec_says():
    """MatMulNBits' 4-bit weight: low nibble first, the default zero point 8, a packed uint8 zero point."""
    from benchmarks.gpu_reference import dequantize_matmulnbits

    q = np.array([[3, 12, 0, 15]], dtype=np.uint8)  # one row, one block of 4
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(1, 1, 2)
    scale = np.array([0.5], dtype=np.float16)
    np.testing.assert_array_equal(dequantize_matmulnbits(packed, scale, None, 4, 1, 4, 4), [[-2.5, 2.0, -4.0, 3.5]])
    zero = np.array([5], dtype=np.uint8)  # one block: the low nibble
    np.testing.assert_array_equal(dequantize_matmulnbits(packed, scale, zero, 4, 1, 4, 4), [[-1.0, 3.5, -2.5, 5.0]])


# -- on real weights: README's kit, SmolLM2-135M int4 --device cuda with layer-skip ----------------


@pytest.mark.real_weights
def test_real_kit_rehearses_within_the_box_limits(tmp_path):
    """The kit README builds (the SmolLM2 --device cuda int4 bundle with layer-skip:10, lookup and
    auto beside it), with a stand-in wheel of onnxruntime-gpu's size class, rehearsed under the
    box's limits against this repository's own tree, then one piece lost, then a wrong bundle."""
    import real

    real.need(real.SMOLLM2, real.HUMANEVAL)
    bundle = real.bundle("smollm2-cuda-int4")
    tree = Path(__file__).resolve().parent.parent
    out = tree / "gpu-kit" / f"test-{tmp_path.name}"  # under the ignored gpu-kit/, where README builds it
    wheel = _stand_in_wheel(tmp_path / "wheels", 40 * MIB)
    try:
        kit = build(KitConfig(out=out, wheels=str(wheel), bundle=bundle, prompts=HUMANEVAL_2, xz_preset=0, cache=tmp_path / "cache"))
        assert len(kit["transfers"]) >= 2 and kit["plan"]["total_s"] <= 720
        reference = kit["reference"]["gpu"]
        assert reference["emulated"]["top1_agreement"] >= 0.97 and reference["min_top1"] >= 0.95
        record = rehearse(out, tree, launch_args=("--max-new-tokens", "16"))
        assert record["passed"], record["breaches"]
        assert all(s["bytes"] <= 64 * MIB and len(s["paths"]) == 1 and s["files"] <= 3 for s in record["transfers"])
        run = record["transfers"][-1]["kit_run"]
        assert run["greedy_identity"]["block_stable"]["layer-skip"]["identical"] == 2
        assert set(run["greedy_identity"]["block_stable"]) == {"layer-skip", "lookup", "auto"}
        (out / kit["pieces"][-1]["path"]).unlink()
        proc = subprocess.run([sys.executable, str(out / "carry-1" / "launch.py"), "--provider", "cpu"], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 2 and kit["pieces"][-1]["path"] in proc.stderr
        # The same bundle with rotary left out of its attention, carried with the right references: exit 1.
        from test_device_profiles import _rewritten
        from test_provider_emulation import ignore_rotary

        wrong = tree / "gpu-kit" / f"wrong-{tmp_path.name}"
        build(KitConfig(out=wrong, bundle=_rewritten(bundle, tmp_path / "wrong", ignore_rotary), prompts=HUMANEVAL_2, xz_preset=0),
              references=(out / "references", kit["reference"]))
        proc = subprocess.run([sys.executable, str(wrong / "carry-1" / "launch.py"), "--provider", "cpu"], capture_output=True, text=True, timeout=900)
        assert proc.returncode == 1, proc.stderr[-2000:]
        assert "below the floor 0.97" in json.loads((wrong / "run" / "kit_run.json").read_text())["error"]
    finally:
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(tree / "gpu-kit" / f"wrong-{tmp_path.name}", ignore_errors=True)
