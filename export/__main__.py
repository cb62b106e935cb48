"""python -m export MODEL --out DIR [--quant ...] [--max-context N] [--draft D ...]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from edge_spec.catalog import CATALOG
from edge_spec.manifest import QUANTS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Export a checkpoint (and its draft) to an edge-spec bundle of static-KV ONNX graphs.",
    )
    parser.add_argument("model", help=f"catalog alias ({', '.join(CATALOG)}), hub id, local HF folder or .gguf file")
    parser.add_argument("--out", type=Path, help="bundle folder to write (default: bundles/<model>-<quant>)")
    parser.add_argument("--quant", default="int4", choices=QUANTS)
    parser.add_argument("--max-context", type=int, default=2048, help="KV buffer length in tokens (default 2048)")
    parser.add_argument(
        "--draft",
        action="append",
        help="same-tokenizer draft model (alias/id/path), 'layer-skip:N', or 'none'; repeat to add both kinds "
        "(default: the catalog's draft for MODEL)",
    )
    parser.add_argument(
        "--attention",
        default="fused",
        choices=("fused", "portable"),
        help="fused: ONNX Runtime's GroupQueryAttention, KV written in place (fastest; desktop ONNX Runtime); "
        "portable: standard ONNX ops only (Android/NNAPI, other ONNX backends)",
    )
    parser.add_argument("--force", action="store_true", help="replace an existing bundle folder")
    parser.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    args = parser.parse_args(argv)

    from export.archs import UnsupportedArchitecture
    from export.bundle import ExportConfig, ExportError, default_drafts, export_bundle
    from export.sources import SourceError

    drafts = tuple(args.draft) if args.draft else default_drafts(args.model)
    drafts = tuple(d for d in drafts if d != "none")
    out = args.out or Path("bundles") / f"{Path(args.model).name.removesuffix('.gguf')}-{args.quant}"
    config = ExportConfig(args.model, out, args.quant, args.max_context, drafts, args.force, args.attention)
    began = time.perf_counter()
    try:
        manifest = export_bundle(config)
    except (ExportError, SourceError, UnsupportedArchitecture) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - began
    sizes = {f: (out / f).stat().st_size for f in manifest.files}
    if args.json:
        roles = {role: {"layers": m.arch.n_layers, "stages": list(m.stages), "source": m.source} for role, m in manifest.models.items()}
        print(json.dumps({"bundle": str(out), "quant": args.quant, "max_context": args.max_context, "roles": roles, "bytes": sizes, "seconds": seconds}))
        return 0
    roles = ", ".join(f"{role} ({m.arch.n_layers} layers)" for role, m in manifest.models.items())
    print(f"{out}: {roles}; {args.quant}; {sum(sizes.values()) / 2**20:.0f} MiB; max context {args.max_context}; {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
