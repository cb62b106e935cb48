"""Offline GPU kit: everything a ten-minute check on an NVIDIA machine without a package index needs.

    python -m benchmarks gpu_kit --out DIR (--download | --wheel FILE.whl | --no-wheels) [--bundle DIR]
        [--model GGUF] [--draft layer-skip:10]... [--prompts humaneval:5] [--piece-mib 60]

Built here, carried in pieces, run there with `python3 DIR/launch.py [--provider cuda|cpu]`.
The kit holds: onnxruntime-gpu 1.31.1 (cp312, manylinux x86_64) and the small wheels it and the
runtime need beside the box's numpy and torch; a `--device cuda` bundle (SmolLM2-135M int4 with
layer-skip; lookup needs nothing); the prompts, their ids and the CPU provider's top-k logits on
that bundle; edge_spec/, runtime/ and benchmarks/; this file again as launch.py; kit.json, listing
every file with its size and SHA-256. No file is larger than the piece limit: bigger ones are
split into NAME.part000, NAME.part001... and joined by the launcher.

The launcher (stdlib until the checks start, then numpy and the carried source):
 1. verifies every file of kit.json by size and SHA-256 (missing or corrupt ones named in one
    line, exit 2) and joins the split ones (checked again);
 2. cuda: installs the carried wheels with pip, offline and without dependencies, into DIR/site
    (first on sys.path, so onnxruntime-gpu shadows the preinstalled CPU build and torch is left
    alone), imports torch (its CUDA 13 libraries load) and calls onnxruntime.preload_dlls();
 3. runs benchmarks/gpu_check.py's checks on the carried bundle against the carried references
    (static placement, every node on the provider and no Memcpy node, top-1 agreement in one pass
    and in two passes over a cache, greedy speculative = greedy plain per drafter, the verify
    curve T = 1..16, tok/s plain and per drafter) and writes DIR/run/kit_run.json; exit 1 unless
    every check passed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

MIB = 2**20
PIECE_LIMIT = 60 * MIB  # what one transfer to the box carries (64 MiB a run, some left for the command)
MANIFEST = "kit.json"
ORT_GPU = ("onnxruntime-gpu", "1.31.1")
# The runtime's own dependencies (pyproject.toml) pinned as there; the box has numpy and torch.
REQUIREMENTS = ("onnxruntime-gpu==1.31.1", "tokenizers==0.23.3", "onnx==1.23.2", "jinja2==3.1.6")
# On the box already (torch's image): their wheels are left out, and pip never replaces them.
PREINSTALLED = ("numpy",)
# Installed at their pins even where the box has another version; other carried wheels only where it has none.
FORCED = ("onnxruntime-gpu", "tokenizers", "onnx")
# The box's interpreter and platform; manylinux_2_28 is onnxruntime-gpu's tag, the rest accept older.
PIP_TARGET = ("--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--abi", "abi3", "--abi", "none",
              "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64")
SOURCE = ("edge_spec", "runtime", "benchmarks")
# Measurements and caches under the source folders: not needed to run, and benchmarks/results is large.
SOURCE_SKIP = ("__pycache__", "*.pyc", "results", "anchors", "*.png")
# edge_spec.catalog.models_dir() spelled with the standard library: launch.py (a copy) runs before edge_spec imports.
DEFAULT_MODEL = str(Path(os.environ.get("EDGE_SPEC_MODELS", "~/.cache/edge-spec/models")) / "SmolLM2-135M-Instruct.Q4_1.gguf")
# The reference is the CPU provider on the same weights, so only float16 arithmetic differs: the
# floor gpu_check holds fp16 graphs to against float32 ones; a wrong kernel costs tens of points.
SAME_WEIGHTS_FLOOR = 0.97


class KitError(Exception):
    """Bad input or an incomplete kit: one line, exit 2."""


@dataclass(frozen=True)
class KitConfig:
    out: Path
    wheels: str = "none"  # none | download | a local onnxruntime-gpu wheel (its folder holds the small ones)
    bundle: Path | None = None  # a --device cuda bundle already exported (else exported from model)
    model: str = DEFAULT_MODEL
    drafts: tuple[str, ...] = ("layer-skip:10",)
    quant: str = "int4"
    max_context: int = 1024
    prompts: str = "humaneval:5"
    piece_limit: int = PIECE_LIMIT
    min_top1: float = SAME_WEIGHTS_FLOOR


@dataclass(frozen=True)
class LaunchConfig:
    kit: Path
    provider: str = "cuda"
    out: Path | None = None  # default: KIT/run
    max_new_tokens: int = 64
    min_top1: float | None = None  # default: the kit's
    verify_only: bool = False  # after each carried run: which pieces are still missing


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


# -- building the kit, here --------------------------------------------------------------------


def _wheel_name(path: Path) -> tuple[str, str]:
    """(distribution, version) of a wheel file, the distribution normalized as pip compares it."""
    parts = path.name.split("-")
    return parts[0].lower().replace("_", "-").replace(".", "-"), parts[1]


def _collect_wheels(config: KitConfig, scratch: Path) -> list[Path]:
    """The wheels to carry: onnxruntime-gpu and what it and the runtime need beyond PREINSTALLED."""
    if config.wheels == "none":
        return []
    if config.wheels == "download":
        folder = scratch / "wheels"
        proc = subprocess.run([sys.executable, "-m", "pip", "download", *REQUIREMENTS, "--only-binary", ":all:", *PIP_TARGET,
                               "--dest", str(folder), "--quiet"], capture_output=True, text=True)
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise KitError(f"pip download failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    else:
        wheel = Path(config.wheels).expanduser()
        if not wheel.is_file() or _wheel_name(wheel) != ORT_GPU or "cp312" not in wheel.name or "x86_64" not in wheel.name:
            raise KitError(f"--wheel {wheel}: not an onnxruntime_gpu-1.31.1 cp312 x86_64 wheel file")
        folder = wheel.parent
    found = sorted(p for p in folder.glob("*.whl") if _wheel_name(p)[0] not in PREINSTALLED)
    names = {_wheel_name(p)[0] for p in found}
    missing = [r.split("==")[0] for r in REQUIREMENTS if r.split("==")[0] not in names]
    if missing:
        raise KitError(f"no wheel for {', '.join(missing)} in {folder} (pip download them there, with their dependencies, or use --download)")
    return found


def _export_bundle(config: KitConfig, scratch: Path) -> Path:
    from benchmarks.gpu_check import _export

    out = scratch / "bundle"
    drafts = [arg for draft in config.drafts for arg in ("--draft", draft)]
    try:
        _export(str(Path(config.model).expanduser()), out, "--device", "cuda", "--quant", config.quant,
                "--max-context", str(config.max_context), *drafts)
    except RuntimeError as exc:
        raise KitError(f"export of {config.model} failed: {exc}") from None
    return out


def _write_references(bundle: Path, prompts_spec: str, out: Path) -> dict:
    """prompts.jsonl (the bench's text prompts), reference.npz (prompt ids and the CPU provider's
    top-k logits on the bundle, every position), and what they hold."""
    import numpy as np

    from benchmarks.bench import load_prompts
    from benchmarks.gpu_check import RAW_PROMPTS, TOP_K, reference_top
    from runtime.engine import Engine, EngineConfig

    bench_prompts = load_prompts(prompts_spec)
    encoder = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    ids = [encoder.encode(prompt=p) for p in RAW_PROMPTS]
    ids += [encoder.encode(messages=list(p.messages)) if p.messages else encoder.encode(prompt=p.prompt) for p in bench_prompts]
    del encoder
    references = reference_top(bundle, ids, TOP_K)
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in bench_prompts:
            body = {"messages": list(p.messages)} if p.messages else {"turns": list(p.turns)} if p.turns else {"prompt": p.prompt}
            f.write(json.dumps({"id": p.id, "category": p.category, **body}) + "\n")
    np.savez(out / "reference.npz", ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
             lengths=np.asarray([len(i) for i in ids], dtype=np.int64),
             top_ids=np.concatenate([r.ids for r in references]), top_logits=np.concatenate([r.logits for r in references]))
    return {"prompts": len(ids), "positions": int(sum(len(i) for i in ids)), "top_k": TOP_K, "raw_prompts": list(RAW_PROMPTS)}


def _split(path: Path, limit: int) -> list[Path]:
    """NAME.part000, NAME.part001... of at most `limit` bytes each, the whole file removed."""
    parts = []
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(limit), b""):
            part = path.with_name(f"{path.name}.part{len(parts):03d}")
            part.write_bytes(block)
            parts.append(part)
    path.unlink()
    return parts


def _carry_runs(files: list[dict], limit: int) -> list[list[str]]:
    """Files grouped into transfers of at most `limit` bytes each: launch.py in the first (so
    `--verify-only` can say what is still missing after any run), the rest largest first, first fit."""
    first = [f for f in files if f["path"] == "launch.py"]
    runs: list[tuple[int, list[str]]] = [(sum(f["size"] for f in first), [f["path"] for f in first])]
    for item in sorted((f for f in files if f not in first), key=lambda f: -f["size"]):
        for i, (size, names) in enumerate(runs):
            if size + item["size"] <= limit:
                runs[i] = (size + item["size"], names + [item["path"]])
                break
        else:
            runs.append((item["size"], [item["path"]]))
    return [names for _, names in runs]


def build(config: KitConfig) -> dict:
    """Writes the kit into config.out (which must be empty or absent); returns kit.json's object."""
    from edge_spec.manifest import load_manifest

    out = config.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KitError(f"--out {out}: must be an empty folder or not exist")
    if config.bundle is not None and not (config.bundle / "manifest.json").is_file():
        raise KitError(f"--bundle {config.bundle}: no manifest.json (not a bundle)")
    if config.bundle is None and not Path(config.model).expanduser().is_file():
        raise KitError(f"--model {config.model}: no such file")
    from benchmarks.bench import load_prompts

    load_prompts(config.prompts)  # a bad spec fails before anything is written
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch_name:
        scratch = Path(scratch_name)
        wheels = _collect_wheels(config, scratch)
        bundle = config.bundle or _export_bundle(config, scratch)
        manifest = load_manifest(bundle)
        if manifest.device != "cuda":
            raise KitError(f"{bundle}: a --device {manifest.device} bundle; the kit carries a --device cuda one")
        out.mkdir(parents=True, exist_ok=True)
        (out / "wheels").mkdir()
        for wheel in wheels:
            shutil.copy2(wheel, out / "wheels" / wheel.name)
        shutil.copytree(bundle, out / "bundle")
        references = _write_references(out / "bundle", config.prompts, out)
    root = Path(__file__).resolve().parent.parent
    for package in SOURCE:
        shutil.copytree(root / package, out / "src" / package, ignore=shutil.ignore_patterns(*SOURCE_SKIP))
    shutil.copy2(Path(__file__), out / "launch.py")
    joined = []
    for path in sorted(p for p in out.rglob("*") if p.is_file() and p.stat().st_size > config.piece_limit):
        entry = {"path": path.relative_to(out).as_posix(), "size": path.stat().st_size, "sha256": sha256_file(path)}
        entry["parts"] = [p.relative_to(out).as_posix() for p in _split(path, config.piece_limit)]
        joined.append(entry)
    files = [{"path": p.relative_to(out).as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(out.rglob("*")) if p.is_file()]
    kit = {
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "piece_limit": config.piece_limit,
        "total_bytes": sum(f["size"] for f in files),
        "wheels": [w.name for w in wheels],
        "bundle": {"from": str(config.bundle or config.model), "device": manifest.device, "drafts": list(manifest.drafts())},
        "reference": {**references, "from": "the CPU provider on the carried bundle", "min_top1": config.min_top1},
        "files": files,
        "joined": joined,
        # Transfers of at most one piece limit each; kit.json (a few KiB) fits beside any of them.
        "carry": _carry_runs(files, config.piece_limit),
    }
    (out / MANIFEST).write_text(json.dumps(kit, indent=1))
    return kit


# -- running the kit, there --------------------------------------------------------------------


def verify(kit_dir: Path) -> dict:
    """Every file of kit.json present with its size and SHA-256, then the split ones joined and
    checked; raises KitError naming every missing or corrupt piece."""
    path = kit_dir / MANIFEST
    if not path.is_file():
        raise KitError(f"{path} not found: copy the kit's {MANIFEST} beside launch.py")
    kit = json.loads(path.read_text())
    missing, corrupt = [], []
    for item in kit["files"]:
        file = kit_dir / item["path"]
        if not file.is_file():
            missing.append(item["path"])
        elif file.stat().st_size != item["size"] or sha256_file(file) != item["sha256"]:
            corrupt.append(item["path"])
    if missing or corrupt:
        named = [f"{len(missing)} missing ({', '.join(missing)})"] * bool(missing) + [f"{len(corrupt)} corrupt ({', '.join(corrupt)})"] * bool(corrupt)
        raise KitError(f"kit {kit_dir} incomplete: {'; '.join(named)}; carry them again")
    for entry in kit["joined"]:
        whole = kit_dir / entry["path"]
        if whole.is_file() and whole.stat().st_size == entry["size"] and sha256_file(whole) == entry["sha256"]:
            continue
        with open(whole, "wb") as f:
            for part in entry["parts"]:
                with open(kit_dir / part, "rb") as piece:
                    shutil.copyfileobj(piece, f, MIB)
        if sha256_file(whole) != entry["sha256"]:
            raise KitError(f"{entry['path']} joined from {len(entry['parts'])} parts does not match its SHA-256")
    return kit


def _to_install(wheels: list[str]) -> tuple[list[str], list[str]]:
    """The carried wheels pip installs, and those left out: a distribution the box already has
    (torch's filelock, fsspec, typing_extensions...) stays the box's, so torch keeps what it was
    built with; FORCED ones are installed at their pins whatever is there."""
    from importlib import metadata

    install, kept = [], []
    for name in wheels:
        dist = _wheel_name(Path(name))[0]
        try:
            present = dist not in FORCED and bool(metadata.version(dist))
        except metadata.PackageNotFoundError:
            present = False
        (kept if present else install).append(name)
    return install, kept


def _install(kit_dir: Path, kit: dict) -> dict:
    """The carried wheels into KIT/site with pip, offline and without dependencies (the carried set
    is the closure beside the box's numpy); skipped when that set is installed already."""
    site = kit_dir / "site"
    stamp = site / ".kit-wheels"
    if not kit["wheels"]:
        raise KitError("this kit carries no wheels (built with --no-wheels): run it with --provider cpu")
    install, kept = _to_install(kit["wheels"])
    record = {"site": str(site), "installed": install, "kept_the_box's": kept}
    if stamp.is_file() and stamp.read_text() == "\n".join(install):
        return record
    shutil.rmtree(site, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(site),
                           *[str(kit_dir / "wheels" / name) for name in install]], capture_output=True, text=True)
    if proc.returncode:
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        raise KitError(f"pip install of the carried wheels failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    stamp.write_text("\n".join(install))
    return record


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


def _carried_references(kit_dir: Path):
    import numpy as np

    from benchmarks.gpu_check import TopLogits

    data = np.load(kit_dir / "reference.npz")
    bounds = np.cumsum(np.concatenate([[0], data["lengths"]]))
    spans = list(zip(bounds[:-1], bounds[1:]))
    prompts = [data["ids"][a:b].tolist() for a, b in spans]
    return prompts, [TopLogits(data["top_ids"][a:b], data["top_logits"][a:b]) for a, b in spans]


def launch(config: LaunchConfig) -> dict:
    """Verify, join, install (cuda), preload (cuda), check; returns the kit_run.json object
    (raises KitError before any check when the kit or the install is not whole)."""
    kit_dir = config.kit.resolve()
    kit = verify(kit_dir)
    installed = _install(kit_dir, kit) if config.provider == "cuda" else None
    sys.path.insert(0, str(kit_dir / "src"))
    if installed:
        sys.path.insert(0, installed["site"])
    out = config.out or kit_dir / "run"
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"provider": config.provider, "kit_created": kit["created"], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    if installed:
        record["wheels"] = installed
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
        record["providers"] = ort.get_available_providers()
        if PROVIDERS[config.provider].ort_name not in record["providers"]:
            raise RuntimeError(f"this ONNX Runtime build ({ort.__file__}) has no {PROVIDERS[config.provider].ort_name}")
        bundle = kit_dir / "bundle"
        _step(record, "static_check", lambda: static_check(bundle, config.provider))
        prompts, references = _carried_references(kit_dir)
        bench_prompts = load_prompts(str(kit_dir / "prompts.jsonl"))
        floor = kit["reference"]["min_top1"] if config.min_top1 is None else config.min_top1
        n_raw = len(kit["reference"]["raw_prompts"])
        plan = CheckPlan(bundle, prompts, references, prompts[n_raw:], bench_prompts, floor, config.max_new_tokens, config.provider,
                         agreement_step="logits_vs_cpu_reference", reference="the CPU provider's logits on the same bundle")
        run_checks(record, plan, out)
        record["passed"] = True
    except Exception as exc:
        record["passed"] = False
        record["error"] = f"{type(exc).__name__}: {exc}"
    record["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    (out / "kit_run.json").write_text(json.dumps(record, indent=2, default=str))
    return record


def _parse_launch(argv: list[str] | None) -> LaunchConfig:
    import argparse

    parser = argparse.ArgumentParser(prog="python3 launch.py", description="verify, join, install and run the offline GPU kit")
    parser.add_argument("--kit", type=Path, default=Path(__file__).resolve().parent, help="the kit folder (default: this file's)")
    parser.add_argument("--provider", default="cuda", choices=("cuda", "cpu"),
                        help="cpu: the same checks on the CPU provider, without the wheel install and preload")
    parser.add_argument("--out", type=Path, help="where kit_run.json and the profiles go (default KIT/run)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--min-top1", type=float, help="the floor on top-1 agreement (default: the kit's)")
    parser.add_argument("--verify-only", action="store_true", help="verify and join the pieces, nothing more (exit 0 when the kit is whole)")
    args = parser.parse_args(argv)
    if args.min_top1 is not None and not 0.0 <= args.min_top1 <= 1.0:
        parser.error(f"--min-top1 must be a fraction from 0 to 1, got {args.min_top1}")
    return LaunchConfig(args.kit, args.provider, args.out, args.max_new_tokens, args.min_top1, args.verify_only)


def launch_main(argv: list[str] | None = None) -> int:
    config = _parse_launch(argv)
    try:
        if config.verify_only:
            kit = verify(config.kit.resolve())
            print(f"kit {config.kit} whole: {len(kit['files'])} files, {len(kit['joined'])} joined")
            return 0
        record = launch(config)
    except KitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps({k: v for k, v in record.items() if not isinstance(v, dict) or "error" in v}, default=str))
    return 0 if record["passed"] else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks gpu_kit ...`: build the kit; bad input is one `error:` line, exit 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu_kit", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="an empty or new folder for the kit")
    wheels = parser.add_mutually_exclusive_group(required=True)
    wheels.add_argument("--download", action="store_true", help="pip download onnxruntime-gpu 1.31.1 and the small wheels (cp312 manylinux x86_64)")
    wheels.add_argument("--wheel", type=Path, help="a local onnxruntime-gpu 1.31.1 cp312 wheel; the small wheels are taken from its folder")
    wheels.add_argument("--no-wheels", action="store_true", help="no wheels: a kit for --provider cpu (tests)")
    parser.add_argument("--bundle", type=Path, help="a --device cuda bundle already exported (skips the export)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"what to export (default {DEFAULT_MODEL})")
    parser.add_argument("--draft", action="append", help="export drafts (default layer-skip:10; lookup needs none)")
    parser.add_argument("--quant", default="int4", choices=("int4", "int8", "fp16"))
    parser.add_argument("--prompts", default="humaneval:5", help="the bench's prompt spec (FILE.jsonl, humaneval:N, ...)")
    parser.add_argument("--piece-mib", type=float, default=PIECE_LIMIT / MIB, help="the largest file carried, in MiB (default 60)")
    args = parser.parse_args(argv)
    if args.piece_mib <= 0 or args.piece_mib > 60:
        parser.error(f"--piece-mib must be above 0 and at most 60, got {args.piece_mib}")
    source = "download" if args.download else "none" if args.no_wheels else str(args.wheel)
    config = KitConfig(out=args.out, wheels=source, bundle=args.bundle, model=args.model, drafts=tuple(args.draft or KitConfig.drafts),
                       quant=args.quant, prompts=args.prompts, piece_limit=int(args.piece_mib * MIB))
    from benchmarks.bench.prompts import PromptsError
    from edge_spec.manifest import BundleError

    try:
        kit = build(config)
    except (KitError, PromptsError, BundleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    largest = max(f["size"] for f in kit["files"])
    print(json.dumps({"out": str(args.out), "files": len(kit["files"]), "total_mib": round(kit["total_bytes"] / MIB, 1),
                      "largest_mib": round(largest / MIB, 1), "carry_runs": len(kit["carry"]), "split": [j["path"] for j in kit["joined"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(launch_main())
