"""The offline GPU kit's launcher, run on the box: `python3 KIT/carry-1/launch.py [--provider cuda|cpu]`.

This file travels as KIT/carry-1/launch.py beside kit.json and the first payload piece; it uses the
standard library until the checks start, then numpy and the runtime's source unpacked from the kit.
 1. verifies every payload piece of kit.json by size and SHA-256 (missing or corrupt ones named in
    one line, exit 2); `--verify-only` stops here (after each carried transfer: what is still missing);
 2. joins the pieces into the payload's members (each checked by SHA-256) and unpacks them into
    KIT/unpacked: the bundle, the references, the prompts, the runtime's source and, for cuda,
    onnxruntime-gpu's installed tree (site/, first on sys.path, so it shadows the box's CPU build
    and torch is left alone);
 3. checks that the box has the runtime's own dependencies (numpy, tokenizers, jinja2, onnx) at the
    pins' major.minor (exit 2 naming the ones it lacks);
 4. cuda: imports torch (its CUDA 13 and cuDNN libraries load) and calls onnxruntime.preload_dlls();
 5. runs benchmarks/gpu_check.py's checks on the carried bundle against the carried references and
    writes KIT/run/kit_run.json; exit 1 unless every check passed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
MANIFEST = "kit.json"
FORMAT = 2
# The runtime's dependencies the box must have, as [lowest, below) major.minor: pyproject.toml's
# pins' series (patch releases differ only in fixes), numpy any 2.x from the Python 3.10 pin on.
RUNTIME_REQUIREMENTS = {"numpy": ("2.2", "3.0"), "tokenizers": ("0.23", "0.24"), "jinja2": ("3.1", "3.2"), "onnx": ("1.23", "1.24")}


class KitError(Exception):
    """An incomplete kit or a box without what it needs: one line, exit 2."""


@dataclass(frozen=True)
class LaunchConfig:
    kit: Path
    provider: str = "cuda"
    out: Path | None = None  # default: KIT/run
    max_new_tokens: int = 64
    min_top1: float | None = None  # default: the kit's
    verify_only: bool = False  # after each carried transfer: which pieces are still missing

    def __post_init__(self) -> None:
        if self.provider not in ("cuda", "cpu"):
            raise ValueError(f"provider must be cuda or cpu, got {self.provider!r}")
        if self.min_top1 is not None and not 0.0 <= self.min_top1 <= 1.0:
            raise ValueError(f"--min-top1 must be a fraction from 0 to 1, got {self.min_top1}")
        if self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be 1 or more, got {self.max_new_tokens}")


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def read_kit(kit_dir: Path) -> dict:
    path = kit_dir / "carry-1" / MANIFEST
    if not path.is_file():
        raise KitError(f"{path} not found: carry the kit's first transfer (carry-1) first")
    kit = json.loads(path.read_text())
    if kit.get("format") != FORMAT:
        raise KitError(f"{path}: kit format {kit.get('format')}, this launcher reads {FORMAT}: rebuild the kit")
    return kit


def verify_pieces(kit_dir: Path, kit: dict) -> None:
    """Every payload piece present with its size and SHA-256; raises KitError naming every missing
    or corrupt one and the transfer that carries it."""
    missing, corrupt = [], []
    for piece in kit["pieces"]:
        file = kit_dir / piece["path"]
        if not file.is_file():
            missing.append(piece["path"])
        elif file.stat().st_size != piece["size"] or sha256_file(file) != piece["sha256"]:
            corrupt.append(piece["path"])
    if missing or corrupt:
        named = [f"{len(missing)} missing ({', '.join(missing)})"] * bool(missing) + [f"{len(corrupt)} corrupt ({', '.join(corrupt)})"] * bool(corrupt)
        raise KitError(f"kit {kit_dir} incomplete: {'; '.join(named)}; carry their transfers (carry-N) again")


def unpack(kit_dir: Path, kit: dict) -> Path:
    """Joins the pieces into the payload's members, checks each, and unpacks them into
    KIT/unpacked (skipped when that set is unpacked already); returns that folder."""
    unpacked = kit_dir / "unpacked"
    stamp = unpacked / ".members"
    expected = "\n".join(m["sha256"] for m in kit["members"])
    if stamp.is_file() and stamp.read_text() == expected:
        return unpacked
    shutil.rmtree(unpacked, ignore_errors=True)
    unpacked.mkdir(parents=True)
    joined = kit_dir / "joined"
    joined.mkdir(exist_ok=True)
    outputs = [open(joined / m["name"], "wb") for m in kit["members"]]
    try:
        for piece in kit["pieces"]:
            with open(kit_dir / piece["path"], "rb") as f:
                data = f.read()
            at = piece["offset"]
            for member, out in zip(kit["members"], outputs):
                lo, hi = max(at, member["offset"]), min(at + len(data), member["offset"] + member["size"])
                if lo < hi:
                    out.write(data[lo - at : hi - at])
    finally:
        for out in outputs:
            out.close()
    for member in kit["members"]:
        path = joined / member["name"]
        if sha256_file(path) != member["sha256"]:
            raise KitError(f"{member['name']} joined from the pieces does not match its SHA-256: rebuild the kit")
        with tarfile.open(path, "r:*") as archive:
            # The "data" filter refuses absolute paths and links out of the folder (Python 3.12; 3.11.4+).
            archive.extractall(unpacked, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
        path.unlink()
    stamp.write_text(expected)
    return unpacked


def box_requirements() -> dict:
    """The box's versions of the runtime's dependencies; KitError naming those it lacks or has
    outside RUNTIME_REQUIREMENTS."""
    from importlib import metadata

    def minor(version: str) -> tuple[int, ...]:
        return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in version.split(".")[:2])

    found, wrong = {}, []
    for name, (lowest, below) in RUNTIME_REQUIREMENTS.items():
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name} (absent)")
            continue
        if not minor(lowest) <= minor(found[name]) < minor(below):
            wrong.append(f"{name} {found[name]} (the runtime takes {lowest} up to below {below})")
    if wrong:
        raise KitError(f"the box lacks the runtime's dependencies: {', '.join(wrong)}; build the kit with --extra-wheel for each")
    return found


def _preload() -> dict:
    """torch first (its CUDA 13 and cuDNN libraries load into the process), then ONNX Runtime's
    preload_dlls(), which reports what it could not load with print()."""
    import contextlib
    import io

    record = {}
    try:
        import torch

        record["torch"] = torch.__version__
        record["torch_cuda"] = torch.version.cuda
        record["torch_sees_gpu"] = torch.cuda.is_available()
    except ImportError as exc:
        record["torch"] = f"not importable: {exc}"
    import onnxruntime as ort

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        ort.preload_dlls()
    record["preload_dlls"] = printed.getvalue().strip()
    record["onnxruntime_file"] = ort.__file__
    return record


def _carried_references(unpacked: Path, provider: str):
    """The prompts' ids and the references a provider is held to: a GPU to the float-activation
    ones (accuracy level 0), the CPU provider to its own computation of the bundle."""
    import numpy as np

    from benchmarks.gpu_check import TopLogits

    data = np.load(unpacked / "reference.npz")
    prefix = "cpu_" if provider == "cpu" else ""
    bounds = np.cumsum(np.concatenate([[0], data["lengths"]]))
    spans = list(zip(bounds[:-1], bounds[1:]))
    prompts = [data["ids"][a:b].tolist() for a, b in spans]
    return prompts, [TopLogits(data[prefix + "top_ids"][a:b], data[prefix + "top_logits"][a:b]) for a, b in spans]


def launch(config: LaunchConfig) -> dict:
    """Verify, unpack, check the box, preload (cuda), run the checks; returns the kit_run.json
    object (raises KitError before any check when the kit or the box is not whole)."""
    kit_dir = config.kit.resolve()
    kit = read_kit(kit_dir)
    began = time.perf_counter()
    verify_pieces(kit_dir, kit)
    unpacked = unpack(kit_dir, kit)
    unpack_s = round(time.perf_counter() - began, 1)
    requirements = box_requirements()
    sys.path.insert(0, str(unpacked / "src"))
    if config.provider == "cuda":
        if not (unpacked / "site" / "onnxruntime").is_dir():
            raise KitError("this kit carries no onnxruntime-gpu (built with --no-wheels): run it with --provider cpu")
        sys.path.insert(0, str(unpacked / "site"))
    out = config.out or kit_dir / "run"
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"provider": config.provider, "kit_created": kit["created"], "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                    "verify_and_unpack_seconds": unpack_s, "box_requirements": requirements}
    try:
        if config.provider == "cuda":
            record["libraries"] = _preload()
        import onnxruntime as ort

        from benchmarks.bench import load_prompts
        from benchmarks.gpu_check import CheckPlan, _step, run_checks, static_check
        from runtime.sessions import PROVIDERS

        import runtime

        record["source"] = str(Path(runtime.__file__).resolve().parent.parent)  # the kit's copy, not an installed one
        record["onnxruntime"] = ort.__version__
        record["onnxruntime_file"] = ort.__file__
        record["providers"] = ort.get_available_providers()
        if PROVIDERS[config.provider].ort_name not in record["providers"]:
            raise RuntimeError(f"this ONNX Runtime build ({ort.__file__}) has no {PROVIDERS[config.provider].ort_name}")
        bundle = unpacked / "bundle"
        _step(record, "static_check", lambda: static_check(bundle, config.provider))
        prompts, references = _carried_references(unpacked, config.provider)
        bench_prompts = load_prompts(str(unpacked / "prompts.jsonl"))
        reference = kit["reference"]["cpu" if config.provider == "cpu" else "gpu"]
        floor = reference["min_top1"] if config.min_top1 is None else config.min_top1
        record["reference"] = {**reference, "min_top1": floor}
        n_raw = len(kit["reference"]["raw_prompts"])
        plan = CheckPlan(bundle, prompts, references, prompts[n_raw:], bench_prompts, floor, config.max_new_tokens, config.provider,
                         agreement_step="logits_vs_cpu_reference", reference=reference["describe"])
        run_checks(record, plan, out)
        record["passed"] = True
    except Exception as exc:
        record["passed"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    record["seconds"] = round(time.perf_counter() - began, 1)
    (out / "kit_run.json").write_text(json.dumps(record, indent=2, default=str))
    return record


def _parse(argv: list[str] | None) -> LaunchConfig:
    import argparse

    parser = argparse.ArgumentParser(prog="python3 launch.py", description="verify, unpack and run the offline GPU kit")
    parser.add_argument("--kit", type=Path, default=Path(__file__).resolve().parent.parent, help="the kit folder (default: this file's folder's parent)")
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same checks on the box's CPU build, without onnxruntime-gpu and the preload")
    parser.add_argument("--out", type=Path, help="where kit_run.json and the profiles go (default KIT/run)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-top1", type=float, help="the floor on top-1 agreement (default: the kit's)")
    parser.add_argument("--verify-only", action="store_true", help="check the pieces carried so far (exit 0 when all are here, 2 naming the missing)")
    args = parser.parse_args(argv)
    try:
        return LaunchConfig(args.kit, args.provider, args.out, args.max_new_tokens, args.min_top1, args.verify_only)
    except ValueError as exc:
        parser.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    config = _parse(argv)
    try:
        if config.verify_only:
            kit_dir = config.kit.resolve()
            kit = read_kit(kit_dir)
            verify_pieces(kit_dir, kit)
            print(f"kit {config.kit} whole: {len(kit['pieces'])} pieces in {len(kit['transfers'])} transfers")
            return 0
        record = launch(config)
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in record.items() if not isinstance(v, dict) or "error" in v}, default=str))
    return 0 if record["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
