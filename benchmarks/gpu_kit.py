"""Offline GPU kit: what a check on an NVIDIA box without a package index needs, packed to travel
in short transfers.

    python -m benchmarks gpu_kit --out gpu-kit (--download | --wheel FILE.whl | --no-wheels) [--bundle DIR]
        [--model GGUF] [--draft layer-skip:10]... [--prompts humaneval:5] [--extra-wheel FILE.whl]... [--xz-preset 6]
    python -m benchmarks gpu_kit --rehearse gpu-kit         (the transfers and the run, here, under the box's limits)

The box (the device machine this project is lent now and then): Python 3.12, torch with the CUDA
13 and cuDNN libraries, a CPU-only onnxruntime, numpy, tokenizers, onnx, jinja2; each transfer
carries the tracked tree plus at most 8 ignored paths, 64 MiB in all; files stay while the box is
warm, and it goes back after about 30 s idle; all of it, the start included, within 15 minutes.

The kit is one payload, cut into pieces that fill those transfers: two xz-compressed tar members,
first the bundle (a `--device cuda` SmolLM2-135M int4 with a layer-skip draft; lookup needs none),
the references and prompts and the runtime's source (edge_spec/, runtime/, benchmarks/), then
onnxruntime-gpu's installed tree (the only package the box lacks; its wheel unpacked, so the box
needs no pip). Transfer N is the folder KIT/carry-N (launch.py and kit.json ride in carry-1), so
one ignored path a transfer; kit.json holds the pieces, the transfers with their commands, and
the plan: the expected machine seconds of each step.
"""

from __future__ import annotations

import json
import lzma
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.gpu_kit_launch import FORMAT, MANIFEST, MIB, KitError, read_kit, sha256_file

ORT_GPU = ("onnxruntime-gpu", "1.31.1")
# edge_spec.catalog.models_dir() spelled out: the builder names its default before anything loads.
DEFAULT_MODEL = str(Path(os.environ.get("EDGE_SPEC_MODELS", "~/.cache/edge-spec/models")) / "SmolLM2-135M-Instruct.Q4_1.gguf")
SOURCE = ("edge_spec", "runtime", "benchmarks")
# Measurements and caches under the source folders: not needed to run, and benchmarks/results is large.
SOURCE_SKIP = ("__pycache__", "*.pyc", "results", "anchors", "*.png")
# kit.json and launch.py beside the first piece: room kept for them when that piece is cut.
HEAD_ROOM = 256 * 1024
LAUNCHER = Path(__file__).with_name("gpu_kit_launch.py")


@dataclass(frozen=True)
class Transport:
    """The box's limits (the device tool's, as lent to this project) and the planning rates."""
    transfer_bytes: int = 64 * MIB  # the tracked tree plus the carried paths, per transfer
    paths_per_transfer: int = 8
    files_per_transfer: int = 8  # the bound: one archive piece a transfer, or a few
    idle_release_s: float = 30.0  # idle this long, the box goes back with every file carried
    device_s: float = 900.0  # all device time of a session: start, transfers, idle and runs
    plan_limit_s: float = 720.0  # the plan with its start, so a rerun of the run fits the rest
    # Not measured (no GPU has been lent to a session that built a kit): the device tool says a
    # start takes "a minute or more"; the call and copy rates are guesses on the slow side.
    start_s: float = 150.0
    call_s: float = 10.0  # per call: the tree copied, the command started, the reply
    mib_per_s: float = 8.0
    gap_s: float = 20.0  # the caller's turn between two calls (under idle_release_s, or the box goes back)
    run_s: float = 240.0  # the launcher on the box: unpack, preload, checks (the CPU rehearsal's time is printed beside it)
    slack_bytes: int = MIB  # the tree may grow between building and carrying

    def __post_init__(self) -> None:
        if self.gap_s >= self.idle_release_s:
            raise ValueError(f"a gap of {self.gap_s} s between calls lets the box go back after {self.idle_release_s} s idle")
        if min(self.transfer_bytes, self.paths_per_transfer, self.files_per_transfer) < 1 or self.mib_per_s <= 0:
            raise ValueError("transfer limits and rates must be positive")


@dataclass(frozen=True)
class KitConfig:
    out: Path
    wheels: str = "none"  # none | download | a local onnxruntime-gpu wheel file
    extra_wheels: tuple[Path, ...] = ()  # what the box lacks beyond onnxruntime-gpu (none on the lent box)
    bundle: Path | None = None  # a --device cuda bundle already exported (else exported from model)
    model: str = DEFAULT_MODEL
    drafts: tuple[str, ...] = ("layer-skip:10",)
    quant: str = "int4"
    max_context: int = 1024
    prompts: str = "humaneval:5"
    xz_preset: int = 6
    transport: Transport = Transport()
    tree: Path | None = None  # the checkout that travels with every transfer (default: the one holding out)
    cache: Path | None = None  # compressed onnxruntime-gpu trees, by wheel hash (default ~/.cache/edge-spec/gpu-kit)

    def __post_init__(self) -> None:
        if not 0 <= self.xz_preset <= 9:
            raise ValueError(f"--xz-preset must be 0..9, got {self.xz_preset}")


REHEARSAL_STEP_S = 1800  # one transfer's command here, the launcher included (about 90 s on 2 cores)


def _run(args: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, cwd=cwd)


def checkout_of(path: Path) -> Path | None:
    """The git work tree holding `path` (or its nearest existing parent), None outside one."""
    probe = path.resolve()
    while not probe.exists():
        probe = probe.parent
    proc = _run(["git", "rev-parse", "--show-toplevel"], cwd=probe if probe.is_dir() else probe.parent)
    return Path(proc.stdout.strip()) if proc.returncode == 0 else None


def tree_files(tree: Path) -> list[Path]:
    """What travels with every transfer: tracked files and untracked ones git does not ignore."""
    proc = _run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=tree)
    if proc.returncode:
        raise KitError(f"{tree}: not a git checkout ({proc.stderr.strip()})")
    return [tree / name for name in proc.stdout.split("\0") if name and (tree / name).is_file()]


def is_ignored(tree: Path, path: Path) -> bool:
    return _run(["git", "check-ignore", "-q", str(path.resolve())], cwd=tree).returncode == 0


# -- the payload ---------------------------------------------------------------------------------


def _wheel_name(path: Path) -> tuple[str, str]:
    """(distribution, version) of a wheel file, the distribution normalized as pip compares it."""
    parts = path.name.split("-")
    return parts[0].lower().replace("_", "-").replace(".", "-"), parts[1]


def _ort_wheel(config: KitConfig, scratch: Path) -> Path | None:
    if config.wheels == "none":
        return None
    if config.wheels == "download":
        proc = _run([sys.executable, "-m", "pip", "download", "==".join(ORT_GPU), "--no-deps", "--only-binary", ":all:",
                     "--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform", "manylinux_2_28_x86_64",
                     "--dest", str(scratch / "wheels"), "--quiet"])
        if proc.returncode:
            lines = (proc.stderr or proc.stdout).strip().splitlines()
            raise KitError(f"pip download failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
        return next((scratch / "wheels").glob("onnxruntime_gpu-*.whl"))
    wheel = Path(config.wheels).expanduser()
    if not wheel.is_file() or _wheel_name(wheel) != ORT_GPU or "cp312" not in wheel.name or "x86_64" not in wheel.name:
        raise KitError(f"--wheel {wheel}: not an onnxruntime_gpu-1.31.1 cp312 x86_64 wheel file")
    return wheel


def _add_wheel(archive: tarfile.TarFile, wheel: Path) -> None:
    """A wheel's files as `pip install --target site --no-deps` lays them out (no scripts)."""
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            name = info.filename
            if info.is_dir():
                continue
            if ".data/" in name:
                head, _, rest = name.partition(".data/")
                kind, _, rest = rest.partition("/")
                if kind not in ("purelib", "platlib"):
                    continue
                name = rest
            entry = tarfile.TarInfo("site/" + name)
            entry.size = info.file_size
            entry.mode = (info.external_attr >> 16) & 0o777 or 0o644
            with z.open(info) as f:
                archive.addfile(entry, f)


def _xz_tar(path: Path, preset: int, fill) -> Path:
    with lzma.open(path, "wb", preset=preset) as raw, tarfile.open(fileobj=raw, mode="w|", format=tarfile.PAX_FORMAT) as archive:
        fill(archive)
    return path


def _site_member(config: KitConfig, wheels: list[Path], scratch: Path) -> Path | None:
    """onnxruntime-gpu's (and any extra wheel's) installed tree as one xz tar, from the cache when
    built before from the same wheels at the same preset (compression is the slow part)."""
    if not wheels:
        return None
    key = "-".join(sha256_file(w)[:16] for w in wheels) + f"-xz{config.xz_preset}"
    cache = (config.cache or Path("~/.cache/edge-spec/gpu-kit")).expanduser()
    cached = cache / f"site-{key}.tar.xz"
    if not cached.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        partial = _xz_tar(scratch / "site.tar.xz", config.xz_preset, lambda archive: [_add_wheel(archive, w) for w in wheels])
        shutil.move(partial, cached)
    return cached


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


def write_references(bundle: Path, prompts_spec: str, out: Path, scratch: Path) -> dict:
    """prompts.jsonl (the bench's text prompts) and reference.npz (prompt ids; the top-k logits at
    every position at MatMulNBits accuracy level 0, for a GPU, and as the CPU provider runs the
    bundle, for `--provider cpu`), and what they hold (benchmarks/gpu_reference.py)."""
    import numpy as np

    from benchmarks.bench import load_prompts
    from benchmarks.gpu_check import RAW_PROMPTS, TOP_K
    from benchmarks.gpu_reference import gpu_references
    from runtime.engine import Engine, EngineConfig

    bench_prompts = load_prompts(prompts_spec)
    encoder = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    ids = [encoder.encode(prompt=p) for p in RAW_PROMPTS]
    ids += [encoder.encode(messages=list(p.messages)) if p.messages else encoder.encode(prompt=p.prompt) for p in bench_prompts]
    del encoder
    gpu, cpu, meta = gpu_references(bundle, ids, scratch, TOP_K)
    with open(out / "prompts.jsonl", "w", encoding="utf-8") as f:
        for p in bench_prompts:
            body = {"messages": list(p.messages)} if p.messages else {"turns": list(p.turns)} if p.turns else {"prompt": p.prompt}
            f.write(json.dumps({"id": p.id, "category": p.category, **body}) + "\n")
    np.savez(out / "reference.npz", ids=np.concatenate([np.asarray(i, dtype=np.int64) for i in ids]),
             lengths=np.asarray([len(i) for i in ids], dtype=np.int64),
             top_ids=np.concatenate([r.ids for r in gpu]), top_logits=np.concatenate([r.logits for r in gpu]),
             cpu_top_ids=np.concatenate([r.ids for r in cpu]), cpu_top_logits=np.concatenate([r.logits for r in cpu]))
    return {**meta, "prompts": len(ids), "positions": int(sum(len(i) for i in ids)), "top_k": TOP_K, "raw_prompts": list(RAW_PROMPTS)}


def _kit_member(config: KitConfig, bundle: Path, stage: Path, scratch: Path) -> Path:
    """The bundle first (what a later transfer's loss costs least to carry again), then the
    references, the prompts and the runtime's source."""
    root = Path(__file__).resolve().parent.parent

    def fill(archive: tarfile.TarFile) -> None:
        archive.add(bundle, "bundle")
        for name in ("reference.npz", "prompts.jsonl"):
            archive.add(stage / name, name)
        for package in SOURCE:
            copied = scratch / "src" / package
            shutil.copytree(root / package, copied, ignore=shutil.ignore_patterns(*SOURCE_SKIP))
            archive.add(copied, f"src/{package}")

    return _xz_tar(scratch / "kit.tar.xz", config.xz_preset, fill)


# -- the transfers and the plan ----------------------------------------------------------------


def plan(transfers: list[dict], transport: Transport, tree_bytes: int) -> dict:
    """Expected machine seconds: the start, each transfer (its call and its bytes with the tree),
    the caller's gap before each later call, and the launcher's run in the last call."""
    steps = [{"step": "start", "seconds": transport.start_s}]
    for i, transfer in enumerate(transfers):
        sent = tree_bytes + transfer["bytes"]
        steps.append({"step": f"transfer {i + 1}", "bytes": sent,
                      "seconds": round((transport.gap_s if i else 0) + transport.call_s + sent / MIB / transport.mib_per_s, 1)})
    steps.append({"step": "run", "seconds": transport.run_s})
    total = round(sum(s["seconds"] for s in steps), 1)
    return {"steps": steps, "total_s": total, "limit_s": transport.plan_limit_s, "device_s": transport.device_s,
            "rerun_fits": total + transport.gap_s + transport.run_s <= transport.device_s,
            "assumed": {k: getattr(transport, k) for k in ("start_s", "call_s", "mib_per_s", "gap_s", "run_s")}}


def _cut(members: list[Path], first: int, rest: int, out: Path) -> tuple[list[dict], list[dict]]:
    """The members as one stream cut into pieces: carry-1/payload.000 of `first` bytes, then one
    piece of `rest` bytes in each next carry-N folder."""
    listed, pieces, offset = [], [], 0
    for path in members:
        listed.append({"name": path.name, "offset": offset, "size": path.stat().st_size, "sha256": sha256_file(path)})
        offset += path.stat().st_size
    stream = [open(path, "rb") for path in members]
    try:
        at, index, current = 0, 0, 0
        while at < offset:
            size = min(first if index == 0 else rest, offset - at)
            folder = out / f"carry-{index + 1}"
            folder.mkdir(parents=True, exist_ok=True)
            piece = folder / f"payload.{index:03d}"
            with open(piece, "wb") as f:
                left = size
                while left:
                    block = stream[current].read(min(left, 8 * MIB))
                    if not block:
                        current += 1
                        continue
                    f.write(block)
                    left -= len(block)
            pieces.append({"path": piece.relative_to(out).as_posix(), "offset": at, "size": size, "sha256": sha256_file(piece)})
            at += size
            index += 1
    finally:
        for f in stream:
            f.close()
    return listed, pieces


def build(config: KitConfig, references: tuple[Path, dict] | None = None) -> dict:
    """Writes the kit into config.out (empty or absent, and ignored by git when inside a checkout);
    returns kit.json's object. `references`: (a folder holding reference.npz and prompts.jsonl,
    their description) taken instead of computed (a kit carrying another bundle's references)."""
    out = config.out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise KitError(f"--out {out}: must be an empty folder or not exist")
    created = [p for p in (out, *out.parents) if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)  # git tells an ignored folder only once it exists
    try:
        return _build(config, references)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        for parent in created[1:]:  # the deepest first
            if parent.is_dir() and not any(parent.iterdir()):
                parent.rmdir()
        if out not in created:
            out.mkdir()
        raise


def _build(config: KitConfig, references: tuple[Path, dict] | None) -> dict:
    from edge_spec.manifest import load_manifest

    out = config.out
    tree = config.tree or checkout_of(out)
    if tree is None:
        raise KitError(f"--out {out}: not inside a git checkout, so the tree that travels beside it is unknown (give --tree)")
    if not is_ignored(tree, out):
        raise KitError(f"--out {out}: not ignored by git in {tree}, so every transfer would carry the whole kit with the tree (add it to .gitignore)")
    if config.bundle is not None and not (config.bundle / "manifest.json").is_file():
        raise KitError(f"--bundle {config.bundle}: no manifest.json (not a bundle)")
    if config.bundle is None and not Path(config.model).expanduser().is_file():
        raise KitError(f"--model {config.model}: no such file")
    for wheel in config.extra_wheels:
        if not wheel.is_file() or wheel.suffix != ".whl":
            raise KitError(f"--extra-wheel {wheel}: not a wheel file")
    from benchmarks.bench import load_prompts

    load_prompts(config.prompts)  # a bad spec fails before anything is written
    tree_bytes = sum(p.stat().st_size for p in tree_files(tree))
    budget = config.transport.transfer_bytes - tree_bytes - config.transport.slack_bytes
    if budget <= HEAD_ROOM:
        raise KitError(f"the tree that travels ({tree_bytes / MIB:.1f} MiB) leaves no room in a {config.transport.transfer_bytes / MIB:.0f} MiB transfer")
    began = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpu-kit-") as scratch_name:
        scratch = Path(scratch_name)
        wheel = _ort_wheel(config, scratch)
        bundle = config.bundle or _export_bundle(config, scratch)
        manifest = load_manifest(bundle)
        if manifest.device != "cuda":
            raise KitError(f"{bundle}: a --device {manifest.device} bundle; the kit carries a --device cuda one")
        stage = scratch / "stage"
        stage.mkdir()
        if references is None:
            reference = write_references(bundle, config.prompts, stage, scratch)
        else:
            for name in ("reference.npz", "prompts.jsonl"):
                shutil.copy2(references[0] / name, stage / name)
            reference = references[1]
        members = [_kit_member(config, bundle, stage, scratch)]
        site = _site_member(config, [w for w in (wheel, *config.extra_wheels) if w], scratch)
        members += [site] if site else []
        listed, pieces = _cut(members, budget - HEAD_ROOM, budget, out)
        keep_references = out / "references"  # beside the kit, not carried: what a kit for another bundle can reuse
        keep_references.mkdir()
        shutil.copy2(stage / "reference.npz", keep_references / "reference.npz")
        shutil.copy2(stage / "prompts.jsonl", keep_references / "prompts.jsonl")
    shutil.copy2(LAUNCHER, out / "carry-1" / "launch.py")
    kit_rel = out.resolve().relative_to(tree.resolve()).as_posix()
    transfers = []
    for i, piece in enumerate(pieces):
        folder = f"carry-{i + 1}"
        files = [p.relative_to(out).as_posix() for p in sorted((out / folder).iterdir())] + ([f"{folder}/{MANIFEST}"] if i == 0 else [])
        last = i == len(pieces) - 1
        transfers.append({"carry": [f"{kit_rel}/{folder}"], "files": sorted(set(files)),
                          "bytes": piece["size"] + (HEAD_ROOM if i == 0 else 0),
                          "command": f"python3 {kit_rel}/carry-1/launch.py" + ("" if last else " --verify-only")})
    kit = {
        "format": FORMAT,
        "created": time.strftime("%Y-%m-%d %H:%M:%S"),
        "build_seconds": round(time.perf_counter() - began, 1),
        "tree_bytes": tree_bytes,
        "transport": {k: v for k, v in vars(config.transport).items()},
        "members": listed,
        "pieces": pieces,
        "transfers": transfers,
        "plan": plan(transfers, config.transport, tree_bytes),
        "wheels": [w.name for w in (wheel, *config.extra_wheels) if w],
        "bundle": {"from": str(config.bundle or config.model), "device": manifest.device, "drafts": list(manifest.drafts())},
        "reference": reference,
    }
    text = json.dumps(kit, indent=1)
    if len(text) + LAUNCHER.stat().st_size > HEAD_ROOM:
        raise KitError(f"kit.json ({len(text)} bytes) and launch.py outgrew the room kept beside the first piece")
    (out / "carry-1" / MANIFEST).write_text(text)
    return kit


# -- the rehearsal: the transfers and the run, here, under the box's limits ------------------------


def rehearse(kit_dir: Path, tree: Path | None = None, transport: Transport | None = None, launch_args: tuple[str, ...] = ()) -> dict:
    """Carries the kit transfer by transfer into an empty folder that holds only the tree (what a
    fresh box holds), checking each transfer against the box's limits (paths, files, bytes with the
    tree), runs each transfer's command there (the last one's launcher with --provider cpu), and
    checks the plan against the device time. Returns the record; `passed` is False on any breach."""
    kit_dir = kit_dir.resolve()
    kit = read_kit(kit_dir)
    tree = (tree or checkout_of(kit_dir)).resolve()
    transport = transport or Transport(**kit["transport"])
    files = tree_files(tree)
    tree_bytes = sum(p.stat().st_size for p in files)
    breaches, steps = [], []
    planned = plan(kit["transfers"], transport, tree_bytes)
    if planned["total_s"] > transport.plan_limit_s:
        breaches.append(f"the plan takes {planned['total_s']} s with the start (at most {transport.plan_limit_s})")
    if not planned["rerun_fits"]:
        breaches.append(f"no rerun of the run fits in {transport.device_s} s of device time")
    with tempfile.TemporaryDirectory(prefix="gpu-box-") as box_name:
        box = Path(box_name)
        for path in files:
            (box / path.relative_to(tree)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, box / path.relative_to(tree))
        for i, transfer in enumerate(kit["transfers"]):
            carried = [tree / p for p in transfer["carry"]]
            sent = [f for p in carried for f in ([p] if p.is_file() else sorted(x for x in p.rglob("*") if x.is_file()))]
            size = tree_bytes + sum(f.stat().st_size for f in sent)
            step = {"transfer": i + 1, "paths": transfer["carry"], "files": len(sent), "bytes": size, "command": transfer["command"]}
            if len(carried) > transport.paths_per_transfer:
                breaches.append(f"transfer {i + 1}: {len(carried)} paths (at most {transport.paths_per_transfer})")
            if len(sent) > transport.files_per_transfer:
                breaches.append(f"transfer {i + 1}: {len(sent)} files (at most {transport.files_per_transfer})")
            if size > transport.transfer_bytes:
                breaches.append(f"transfer {i + 1}: {size / MIB:.2f} MiB with the tree (at most {transport.transfer_bytes / MIB:.0f})")
            for path in carried:
                if not path.exists():
                    breaches.append(f"transfer {i + 1}: {path} does not exist")
                elif not is_ignored(tree, path):
                    breaches.append(f"transfer {i + 1}: {path} is not ignored by git, so it travels with the tree too")
                else:
                    target = box / path.relative_to(tree)
                    shutil.rmtree(target, ignore_errors=True)  # a carried path replaces what was there
                    shutil.copytree(path, target) if path.is_dir() else shutil.copy2(path, target)
            last = i == len(kit["transfers"]) - 1
            if last and breaches:
                step.update(exit=None, seconds_here=0.0, said=["not run: a limit is broken"])
                steps.append(step)
                break
            args = transfer["command"].split()[1:] + (["--provider", "cpu", *launch_args] if last else [])
            began = time.perf_counter()
            try:
                proc = subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=box, timeout=REHEARSAL_STEP_S,
                                      env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
            except subprocess.TimeoutExpired:  # a launcher that never ends is a breach, not a rehearsal that never ends
                proc = subprocess.CompletedProcess(args, -9, "", f"still running after {REHEARSAL_STEP_S} s: killed")
            step.update(exit=proc.returncode, seconds_here=round(time.perf_counter() - began, 1),
                        said=(proc.stderr.strip() or proc.stdout.strip()).splitlines()[-1:])
            if last and proc.returncode:
                breaches.append(f"the launcher exited {proc.returncode}: {step['said']}")
            elif not last and proc.returncode not in (0, 2):
                breaches.append(f"transfer {i + 1}: `{transfer['command']}` exited {proc.returncode}")
            if last:
                run_json = box / Path(transfer["carry"][0]).parent / "run" / "kit_run.json"
                step["kit_run"] = json.loads(run_json.read_text()) if run_json.is_file() else None
            steps.append(step)
    return {"kit": str(kit_dir), "tree_bytes": tree_bytes, "transfers": steps, "plan": planned, "breaches": breaches, "passed": not breaches}


def _print_rehearsal(record: dict) -> None:
    for step in record["transfers"]:
        print(f"transfer {step['transfer']}: carry {step['paths']} ({step['files']} files), {step['bytes'] / MIB:.2f} MiB with the tree; "
              f"`{step['command']}` exit {step['exit']} in {step['seconds_here']} s here")
    planned = record["plan"]
    print("plan: " + ", ".join(f"{s['step']} {s['seconds']} s" for s in planned["steps"]) + f"; total {planned['total_s']} s "
          f"(limit {planned['limit_s']}, device time {planned['device_s']}; a rerun fits: {planned['rerun_fits']})")
    print("rehearsal " + ("passed" if record["passed"] else "FAILED: " + "; ".join(record["breaches"])))


def main(argv: list[str] | None = None) -> int:
    """`python -m benchmarks gpu_kit ...`: build (or rehearse) the kit; bad input is one `error:` line, exit 2."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m benchmarks gpu_kit", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="an empty or new folder for the kit, ignored by git (gpu-kit/ is)")
    wheels = parser.add_mutually_exclusive_group()
    wheels.add_argument("--download", action="store_true", help="pip download onnxruntime-gpu 1.31.1 (cp312 manylinux x86_64), nothing else")
    wheels.add_argument("--wheel", type=Path, help="a local onnxruntime-gpu 1.31.1 cp312 x86_64 wheel")
    wheels.add_argument("--no-wheels", action="store_true", help="no onnxruntime-gpu: a kit for --provider cpu (tests)")
    parser.add_argument("--extra-wheel", type=Path, action="append", default=[], help="a wheel the box lacks besides onnxruntime-gpu (repeatable)")
    parser.add_argument("--bundle", type=Path, help="a --device cuda bundle already exported (skips the export)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"what to export (default {DEFAULT_MODEL})")
    parser.add_argument("--draft", action="append", help="export drafts (default layer-skip:10; lookup needs none)")
    parser.add_argument("--quant", default="int4", choices=("int4", "int8", "fp16"))
    parser.add_argument("--prompts", default="humaneval:5", help="the bench's prompt spec (FILE.jsonl, humaneval:N, ...)")
    parser.add_argument("--xz-preset", type=int, default=6, help="xz compression of the payload, 0..9 (default 6)")
    parser.add_argument("--tree", type=Path, help="the checkout that travels with each transfer (default: the one holding --out)")
    parser.add_argument("--rehearse", type=Path, metavar="KIT", help="carry KIT into an empty box here under the limits, then run it with "
                        "--provider cpu; the record in KIT/rehearsal.json")
    parser.add_argument("--max-new-tokens", type=int, help="with --rehearse: the launcher's --max-new-tokens")
    args = parser.parse_args(argv)
    try:
        if args.rehearse:
            record = rehearse(args.rehearse, args.tree, launch_args=("--max-new-tokens", str(args.max_new_tokens)) if args.max_new_tokens else ())
            (args.rehearse / "rehearsal.json").write_text(json.dumps(record, indent=1, default=str))  # beside the transfers, not carried
            _print_rehearsal(record)
            return 0 if record["passed"] else 1
        if not args.out or not (args.download or args.wheel or args.no_wheels):
            parser.error("--out and one of --download, --wheel, --no-wheels are required (or --rehearse KIT)")
        source = "download" if args.download else "none" if args.no_wheels else str(args.wheel)
        config = KitConfig(out=args.out, wheels=source, extra_wheels=tuple(args.extra_wheel), bundle=args.bundle, model=args.model,
                           drafts=tuple(args.draft or KitConfig.drafts), quant=args.quant, prompts=args.prompts, xz_preset=args.xz_preset,
                           tree=args.tree)
    except ValueError as exc:
        parser.error(str(exc))
    from benchmarks.bench.prompts import PromptsError
    from edge_spec.manifest import BundleError

    try:
        kit = build(config)
    except (KitError, PromptsError, BundleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for i, transfer in enumerate(kit["transfers"]):
        print(f"transfer {i + 1}: carry {transfer['carry']}, {transfer['bytes'] / MIB:.2f} MiB + the tree {kit['tree_bytes'] / MIB:.2f} MiB; then `{transfer['command']}`")
    planned = kit["plan"]
    print("plan: " + ", ".join(f"{s['step']} {s['seconds']} s" for s in planned["steps"]) + f"; total {planned['total_s']} s of {planned['limit_s']}")
    print(json.dumps({"out": str(args.out), "payload_mib": round(sum(m["size"] for m in kit["members"]) / MIB, 1),
                      "transfers": len(kit["transfers"]), "min_top1": kit["reference"]["gpu"]["min_top1"], "build_seconds": kit["build_seconds"]}))
    return 0
