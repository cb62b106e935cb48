"""android_bridge/tools/package_bundle.py on a tiny bundle (run by run_jvm_tests.sh with the traces' bundle)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import package_bundle as pb  # noqa: E402

BUNDLE = Path(os.environ.get("EDGE_SPEC_TINY_BUNDLE", Path(__file__).resolve().parents[1] / "build" / "traces" / "tiny" / "llama"))


@pytest.fixture
def bundle(tmp_path):
    if not (BUNDLE / "manifest.json").is_file():
        pytest.fail(f"{BUNDLE} missing: run android_bridge/run_jvm_tests.sh (it writes the tiny bundles)")
    copy = tmp_path / "llama"
    shutil.copytree(BUNDLE, copy)
    return copy


def test_sizes():
    assert pb.parse_size("3GB") == 3 * 10**9
    assert pb.parse_size("512MiB") == 512 * 2**20
    assert pb.parse_size("1.5gib") == int(1.5 * 2**30)
    with pytest.raises(pb.PackageError):
        pb.parse_size("lots")


def test_packages_a_valid_app_layout(bundle, tmp_path):
    dest = pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), pb.parse_size("512MiB"), ["target", "layer_skip"], "assets", log=lambda m: None)
    assert dest == tmp_path / "out" / "assets" / "llama"
    manifest = json.loads((dest / "manifest.json").read_text())
    assert set(manifest["models"]) == {"target", "layer_skip"} and manifest["default_draft"] == "layer_skip"
    assert not (dest / "draft.onnx").exists()
    index = json.loads((tmp_path / "out" / "edge-spec-package.json").read_text())
    assert index["kv_bytes"] > 0 and "tokenizer.json" in index["files"]


def test_refuses_over_budget(bundle, tmp_path):
    with pytest.raises(pb.PackageError, match="over the phone budget"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("100KB"), None, None, "assets", log=lambda m: None)
    with pytest.raises(pb.PackageError, match="KV budget"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), 1000, None, "assets", log=lambda m: None)


def test_refuses_fp16_and_fp16_kv(bundle, tmp_path):
    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    data["models"]["target"]["quant"] = "fp16"
    path.write_text(json.dumps(data))
    with pytest.raises(pb.PackageError, match="fp16"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), None, None, "assets", log=lambda m: None)
    data["models"]["target"]["quant"] = "fp32"
    for model in data["models"].values():
        model["arch"]["kv_dtype"] = "float16"
    data["device"] = "cuda"  # float16 KV is what the GPU profiles keep
    path.write_text(json.dumps(data))
    with pytest.raises(pb.PackageError, match="--device cuda"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), None, None, "assets", log=lambda m: None)


def test_refuses_missing_files_and_roles(bundle, tmp_path):
    with pytest.raises(pb.PackageError, match="no role"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), None, ["target", "nope"], "assets", log=lambda m: None)
    (bundle / "target.head.onnx.data").unlink()
    with pytest.raises(pb.BundleError, match="missing"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), None, None, "assets", log=lambda m: None)


def test_cli_exit_codes(bundle, tmp_path, capsys):
    assert pb.main([str(bundle), str(tmp_path / "o"), "--budget", "3GB", "--layout", "download"]) == 0
    assert (tmp_path / "o" / "download" / "llama" / "manifest.json").is_file()
    assert pb.main([str(bundle), str(tmp_path / "o"), "--budget", "1KB"]) == 2
    assert "over the phone budget" in capsys.readouterr().err


def test_refuses_fused_attention(bundle, tmp_path):
    from edge_spec import names

    path = bundle / "manifest.json"
    data = json.loads(path.read_text())
    stage = data["stages"]["target.trunk"]
    stage["attention"] = "fused"
    layers = range(stage["layer_start"], stage["layer_end"])
    stage["inputs"] = names.stage_inputs(stage["embed"], stage["head"], layers, "fused")
    stage["outputs"] = names.stage_outputs(stage["head"], layers, "fused")
    path.write_text(json.dumps(data))
    with pytest.raises(pb.PackageError, match="--attention portable"):
        pb.package(bundle, tmp_path / "out", pb.parse_size("3GB"), None, None, "assets", log=lambda m: None)
