"""Package a bundle for an Android app: validate, check it fits a phone, copy it into an app layout.

    python android_bridge/tools/package_bundle.py BUNDLE OUT --budget 3GB [--kv-budget 512MiB]
        [--roles target,layer_skip] [--layout assets|download] [--no-hash-check]

Refuses (exit 2, naming the reason) a bundle that edge_spec.manifest.load_manifest rejects (missing
or altered files, bad schema), precisions the phone path does not run (fp16 weights or an fp16 KV
cache: the Kotlin core keeps float32 KV buffers and the ORT Android CPU/NNAPI path has no fp16 win
here), a model type the Kotlin tokenizer/loop was not checked on, and a bundle whose weights plus
static KV buffers exceed --budget. Writes OUT/<layout>/<bundle name>/ with the manifest, graphs,
external data and tokenizer (only files of the chosen roles), plus OUT/edge-spec-package.json
describing sizes and SHA-256s so an app can verify a download.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from edge_spec.manifest import MANIFEST_FILE, BundleError, Manifest, load_manifest, manifest_from_dict  # noqa: E402

PHONE_QUANTS = ("fp32", "int8", "int4")  # what the Kotlin core runs (ORT CPU kernels; int4 = MatMulNBits)
PHONE_KV = ("float32",)
PHONE_MODEL_TYPES = ("llama", "qwen2")  # the families the JVM conformance tests cover
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


class PackageError(Exception):
    pass


def parse_size(text: str) -> int:
    """'3GB', '512MiB', '1.5gib', '1000000' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise PackageError(f"cannot read size {text!r}: use a number with B, KB, MB, GB, KiB, MiB or GiB (e.g. 3GB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2).lower()])


def human(n: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        scale = {"GiB": 2**30, "MiB": 2**20, "KiB": 2**10}[unit]
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def kv_bytes(manifest: Manifest, role: str) -> int:
    arch = manifest.models[role].arch
    width = 4 if arch.kv_dtype == "float32" else 2
    return 2 * arch.n_layers * arch.n_kv_heads * arch.max_context * arch.head_dim * width


def plan(bundle: Path, roles: list[str] | None, check_hashes: bool = True) -> dict:
    manifest = load_manifest(bundle, check_hashes=check_hashes)
    roles = roles or list(manifest.models)
    unknown = [r for r in roles if r not in manifest.models]
    if unknown:
        raise PackageError(f"the bundle has no role(s) {unknown} (it has {list(manifest.models)})")
    if "target" not in roles:
        raise PackageError("the target role must be packaged")
    if manifest.device != "cpu":
        raise PackageError(f"the bundle was exported for --device {manifest.device}: the phone path runs --device cpu bundles; re-export with --device cpu --attention portable")
    for role in roles:
        model = manifest.models[role]
        if model.quant not in PHONE_QUANTS:
            raise PackageError(f"model {role!r} is {model.quant}: the phone path runs {', '.join(PHONE_QUANTS)} only; re-export with --quant int8 or int4")
        if model.arch.kv_dtype not in PHONE_KV:
            raise PackageError(f"model {role!r} keeps a {model.arch.kv_dtype} KV cache: the Kotlin core keeps float32 KV buffers only")
        if model.arch.model_type not in PHONE_MODEL_TYPES:
            raise PackageError(f"model {role!r} is a {model.arch.model_type!r}: the phone path is verified for {', '.join(PHONE_MODEL_TYPES)}")
        if model.trimmed_head is not None:
            raise PackageError(f"model {role!r} has a trimmed LM head: the Kotlin core does not run trimmed draft heads yet; re-export without --draft-vocab")
        fused = [key for key in model.stages if manifest.stages[key].layers and manifest.stages[key].attention != "portable"]
        if fused:
            raise PackageError(f"model {role!r} has fused-attention stages {fused}: the phone path runs portable graphs; re-export with --attention portable")
        owner = model.shares_kv_with
        if owner is not None and owner not in roles:
            raise PackageError(f"model {role!r} shares KV with {owner!r}, which is not packaged")
    files = {manifest.tokenizer.file}
    for role in roles:
        for key in manifest.models[role].stages:
            stage = manifest.stages[key]
            files.add(stage.file)
            files.update(stage.data_files)
    weights = sum((bundle / f).stat().st_size for f in files if f != manifest.tokenizer.file)
    kv = sum(kv_bytes(manifest, r) for r in roles if manifest.models[r].shares_kv_with is None)
    return {"manifest": manifest, "roles": roles, "files": sorted(files), "weight_bytes": weights, "kv_bytes": kv,
            "tokenizer_bytes": (bundle / manifest.tokenizer.file).stat().st_size}


def package(bundle: Path, out: Path, budget: int, kv_budget: int | None, roles: list[str] | None, layout: str,
            check_hashes: bool = True, log=print) -> Path:
    p = plan(bundle, roles, check_hashes)
    manifest: Manifest = p["manifest"]
    total = p["weight_bytes"] + p["kv_bytes"] + p["tokenizer_bytes"]
    log(f"weights {human(p['weight_bytes'])}, KV buffers {human(p['kv_bytes'])} (max context "
        f"{manifest.target.arch.max_context}), tokenizer {human(p['tokenizer_bytes'])}: {human(total)} of {human(budget)}")
    if kv_budget is not None and p["kv_bytes"] > kv_budget:
        raise PackageError(f"KV buffers need {human(p['kv_bytes'])}, over the KV budget {human(kv_budget)}; re-export with a smaller --max-context")
    if total > budget:
        raise PackageError(f"the bundle needs {human(total)} (weights + KV + tokenizer), over the phone budget {human(budget)}; "
                           "use a smaller quantization, fewer roles (--roles target,layer_skip) or a smaller max context")
    dest = out / layout / bundle.name
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    for rel in p["files"]:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(bundle / rel, dest / rel)
    # A manifest that lists only the packaged roles, so the phone validates exactly what it has.
    data = json.loads((bundle / MANIFEST_FILE).read_text())
    data["models"] = {r: m for r, m in data["models"].items() if r in p["roles"]}
    keep_stages = {k for r in p["roles"] for k in data["models"][r]["stages"]}
    data["stages"] = {k: s for k, s in data["stages"].items() if k in keep_stages}
    data["files"] = {f: h for f, h in data["files"].items() if f in p["files"]}
    if data.get("default_draft") not in data["models"]:
        data["default_draft"] = next((r for r in data["models"] if r != "target"), None)
    manifest_from_dict(data)  # schema check before writing
    (dest / MANIFEST_FILE).write_text(json.dumps(data, indent=2, sort_keys=True))
    load_manifest(dest, check_hashes=check_hashes)  # the packaged copy is itself a valid bundle
    index = {"bundle": bundle.name, "layout": layout, "roles": p["roles"], "budget_bytes": budget,
             "weight_bytes": p["weight_bytes"], "kv_bytes": p["kv_bytes"], "tokenizer_bytes": p["tokenizer_bytes"],
             "files": {f: {"bytes": (dest / f).stat().st_size, "sha256": data["files"].get(f)} for f in p["files"]}}
    index["files"][MANIFEST_FILE] = {"bytes": (dest / MANIFEST_FILE).stat().st_size, "sha256": None}
    (out / "edge-spec-package.json").write_text(json.dumps(index, indent=2))
    log(f"packaged {len(p['files']) + 1} files into {dest}")
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle")
    parser.add_argument("out")
    parser.add_argument("--budget", required=True, help="phone memory budget for weights + KV + tokenizer, e.g. 3GB or 1536MiB")
    parser.add_argument("--kv-budget", help="separate cap on the static KV buffers, e.g. 512MiB")
    parser.add_argument("--roles", help="comma-separated roles to ship (default: all); target is required")
    parser.add_argument("--layout", choices=("assets", "download"), default="assets",
                        help="assets: OUT/assets/<name>/ for src/main/assets; download: OUT/download/<name>/ to host")
    parser.add_argument("--no-hash-check", action="store_true")
    args = parser.parse_args(argv)
    try:
        budget = parse_size(args.budget)
        kv_budget = parse_size(args.kv_budget) if args.kv_budget else None
        roles = [r.strip() for r in args.roles.split(",")] if args.roles else None
        package(Path(args.bundle), Path(args.out), budget, kv_budget, roles, args.layout, not args.no_hash_check)
    except (PackageError, BundleError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
