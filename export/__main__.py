"""python -m export MODEL --out DIR [--quant ...] [--block-size N] [--draft-block-size N] [--max-context N] [--draft D ...] [--memory-budget SIZE]"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from edge_spec.catalog import CATALOG
from edge_spec.manifest import DEFAULT_QUANT_BLOCK, QUANT_BLOCKS, QUANTS
from edge_spec.profiles import DEVICES


def _memory_size(text: str) -> int:
    from edge_spec.budget import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _default_out(model: str, quant: str, device: str = "cpu") -> Path:
    name = Path(model).name
    name = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return Path("bundles") / f"{name}-{quant}{'' if device == 'cpu' else '-' + device}"


def _types(text: str | None) -> tuple[str, ...] | None:
    """--gguf-to-int8: None for the default, () for 'none', else the listed types."""
    if text is None:
        return None
    if text.strip().lower() == "none":
        return ()
    return tuple(t.strip() for t in text.split(",") if t.strip())


class _Refused(Exception):
    """A refusal main prints as `error: ...`, exiting with status 2."""


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        _check_sources(args)
        config = _export_config(parser, args)
        choice = None
        if args.memory_budget is not None:
            choice, config = _fit_memory_budget(args, config)
        manifest, seconds = _export(config)
    except _Refused as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _print_summary(args, config, manifest, choice, seconds)
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m export",
        description="Export a checkpoint (and its draft) to an edge-spec bundle of static-KV ONNX graphs.",
    )
    parser.add_argument("model", help=f"catalog alias ({', '.join(CATALOG)}), hub id, local HF folder or .gguf file")
    parser.add_argument("--out", type=Path, help="bundle folder to write (default: bundles/<model>-<quant>)")
    parser.add_argument("--quant", default="int4", choices=QUANTS)
    _add_weight_arguments(parser)
    parser.add_argument("--max-context", type=int, default=2048, help="KV buffer length in tokens (default 2048)")
    _add_draft_arguments(parser)
    _add_device_arguments(parser)
    parser.add_argument("--force", action="store_true", help="replace an existing bundle folder")
    parser.add_argument(
        "--format",
        default="onnx",
        help="what to write, comma-separated: onnx (stage graphs), coreml (stateful fp16 .mlpackage for the Apple "
        "Neural Engine; --max-context a multiple of 32) (default: onnx)",
    )
    parser.add_argument(
        "--memory-budget", type=_memory_size, metavar="SIZE",
        help="fit the bundle's memory plan into SIZE (3GB, 512MiB, bytes): shorten --max-context (halving, not below "
        "512), then drop the draft model (layer-skip or prompt lookup draft instead), then lower --quant",
    )
    parser.add_argument("--json", action="store_true", help="print the final summary as one JSON object")
    return parser


def _add_weight_arguments(parser: argparse.ArgumentParser) -> None:
    """--block-size to --gguf-to-int8: how int4/int8 weights are stored."""
    parser.add_argument(
        "--block-size", type=int, default=DEFAULT_QUANT_BLOCK, choices=QUANT_BLOCKS, metavar="N",
        help=f"int4/int8 weights per scale, one of {', '.join(map(str, QUANT_BLOCKS))}: larger blocks decode faster at some "
        f"precision (see docs/precision.md) (default {DEFAULT_QUANT_BLOCK})",
    )
    parser.add_argument(
        "--draft-block-size", type=int, choices=QUANT_BLOCKS, metavar="N",
        help="the draft model's own int4/int8 block: its precision sets only how often its tokens are accepted, never "
        "the output (default: --block-size)",
    )
    parser.add_argument(
        "--zero-points", action="store_true",
        help="int4/int8 MatMuls asymmetric: a uint8 zero point per block and scales fitted by least squares, which costs "
        "the CPU kernel no bytes per pass and recovers precision at larger blocks (see docs/precision.md)",
    )
    keep = parser.add_mutually_exclusive_group()
    keep.add_argument(
        "--gguf-blocks", action="store_true", default=None,
        help="from a .gguf: keep the target's quantized blocks as they are where ONNX Runtime's int4/int8 kernels hold them "
        "exactly (Q4_K, Q6_K, Q8_0, Q4_0/1, Q5_0/1, Q5_K), so the bundle runs the weights llama.cpp runs; the rest, and "
        "the draft model, are quantized as usual. The default for an int4 export of a .gguf on the CPU profile (see docs/precision.md)",
    )
    keep.add_argument(
        "--requantize", dest="gguf_blocks", action="store_false",
        help="re-quantize every weight of a .gguf (dequantized, then int4/int8 by ONNX Runtime's quantizer) instead of keeping its blocks",
    )
    parser.add_argument(
        "--gguf-to-int8", default=None, metavar="TYPES",
        help="with kept GGUF blocks: these GGUF types (comma-separated) rounded to int8 blocks of 64 instead of kept: fewer bytes "
        "per pass (9 bits per weight read instead of 12 for Q6_K) for a small, measured loss of fidelity. Default Q6_K; "
        "'none' keeps every block bit for bit",
    )


def _add_draft_arguments(parser: argparse.ArgumentParser) -> None:
    """--draft to --draft-vocab-from: the drafts and how they are chosen and trimmed."""
    parser.add_argument(
        "--draft",
        action="append",
        help="same-tokenizer draft model (alias/id/path), a layer-skip draft over the target's own layers "
        "('layer-skip:N': the first N; 'layer-skip:0-9,14-20,24-27': those kept; 'layer-skip:auto': chosen by measuring "
        "agreement on calibration text), or 'none'; repeat to add both kinds (default: the catalog's draft for MODEL)",
    )
    parser.add_argument(
        "--layer-search-tokens", type=int, default=512, metavar="N",
        help="calibration tokens layer-skip:auto scores each candidate on (standard-library code and this project's "
        "README; one forward pass of the fp32 target per candidate) (default 512)",
    )
    parser.add_argument(
        "--verify-curve", metavar="CURVE",
        help="the target pass cost layer-skip:auto chooses by, V(k) for k rows: cpu (1 + 0.4(k-1), measured here), flat "
        "(a GPU), or V(1),V(2),...,V(9) (default: cpu for --device cpu, flat otherwise)",
    )
    parser.add_argument(
        "--layer-search-stage-cost", type=float, default=0.02, metavar="SHARE",
        help="one more session run, as a share of a target pass, in layer-skip:auto's cost model (default 0.02)",
    )
    parser.add_argument(
        "--draft-vocab", type=int, metavar="N",
        help="keep only the draft model's LM-head rows for the N most frequent tokens (and every special and EOS "
        "token): a cheaper draft step, still exact (suggested 32768; default: every row)",
    )
    parser.add_argument(
        "--draft-vocab-from", default="stdlib,docs", metavar="SOURCES",
        help="text the --draft-vocab frequencies are counted on, comma-separated: stdlib (this Python's standard "
        "library sources), docs (this project's Markdown), or file/folder paths (default: stdlib,docs)",
    )


def _add_device_arguments(parser: argparse.ArgumentParser) -> None:
    """--device and --attention: the provider the graphs are built for."""
    parser.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="the provider the graphs are built for: cpu (float32), cuda and dml (float16 activations and KV, "
        "GroupQueryAttention in float16), coreml (standard ops the Core ML EP takes) (default cpu)",
    )
    parser.add_argument(
        "--attention",
        choices=("fused", "portable", "masked"),
        help="fused: ONNX Runtime's GroupQueryAttention, KV written in place (fastest; desktop ONNX Runtime); "
        "portable: standard ONNX ops only (Android/NNAPI, other ONNX backends); masked: standard ops with positions "
        "and mask from the runtime (the Core ML EP) (default: the --device's)",
    )


def _check_sources(args: argparse.Namespace) -> None:
    """Refuse a MODEL or draft no source can give, before torch is imported."""
    from export.sources import SourceError, check_source

    try:
        for spec in (args.model, *(d for d in args.draft or () if d != "none" and not d.startswith("layer-skip"))):
            check_source(spec)
    except SourceError as exc:
        raise _Refused(str(exc)) from None


def _export_config(parser: argparse.ArgumentParser, args: argparse.Namespace):
    """The export.bundle.ExportConfig the flags ask for, drafts defaulting to the catalog's."""
    from export.bundle import FORMATS, ExportConfig, ExportError, default_drafts

    drafts = tuple(args.draft) if args.draft else default_drafts(args.model)
    drafts = tuple(d for d in drafts if d != "none")
    out = args.out or _default_out(args.model, args.quant, args.device)
    blocking = next((p for p in (out, *out.parents) if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # checked before any model loads
        raise _Refused(f"--out {out}: {blocking} exists and is not a folder")
    formats = tuple(dict.fromkeys(f.strip() for f in args.format.split(",") if f.strip()))
    if not formats or set(formats) - set(FORMATS):
        parser.error(f"--format {args.format!r}: choose one or more of {', '.join(FORMATS)}, comma-separated")
    try:
        sources = tuple(x.strip() for x in args.draft_vocab_from.split(",") if x.strip())
        return ExportConfig(args.model, out, args.quant, args.max_context, drafts, args.force, formats=formats, attention=args.attention, device=args.device,
                            draft_vocab=args.draft_vocab, draft_vocab_from=sources, block_size=args.block_size,
                            draft_block_size=args.draft_block_size, zero_points=args.zero_points, gguf_blocks=args.gguf_blocks,
                            gguf_to_int8=_types(args.gguf_to_int8), layer_search_tokens=args.layer_search_tokens,
                            verify_curve=args.verify_curve, layer_search_stage_cost=args.layer_search_stage_cost)
    except ExportError as exc:
        raise _Refused(str(exc)) from None


def _fit_memory_budget(args: argparse.Namespace, config):
    """--memory-budget: the export (context, drafts, precision) that fits it, said on stderr;
    returns the choice and the config changed to it."""
    from edge_spec.budget import BudgetError
    from export.archs import UnsupportedArchitecture
    from export.bundle import LAYER_SKIP_PREFIX, ExportError, choose_for_budget
    from export.sources import SourceError

    try:
        choice = choose_for_budget(config, args.memory_budget)
    except (BudgetError, ExportError, SourceError, UnsupportedArchitecture) as exc:
        raise _Refused(str(exc)) from None
    print(choice.summary(), file=sys.stderr)
    out = args.out or _default_out(args.model, choice.quant, args.device)
    keeps_model = any(not d.startswith(LAYER_SKIP_PREFIX) for d in choice.drafts)
    # A trimmed head belongs to the draft model: none is left to trim when the budget dropped it.
    return choice, dataclasses.replace(config, out=out, quant=choice.quant, max_context=choice.max_context, drafts=choice.drafts,
                                       draft_vocab=config.draft_vocab if keeps_model else None)


def _export(config):
    """Write the bundle; returns its manifest and the seconds it took."""
    from export.archs import UnsupportedArchitecture
    from export.bundle import ExportError, export_bundle
    from export.sources import SourceError

    began = time.perf_counter()
    try:
        manifest = export_bundle(config)
    except (ExportError, SourceError, UnsupportedArchitecture) as exc:
        raise _Refused(str(exc)) from None
    return manifest, time.perf_counter() - began


def _print_summary(args: argparse.Namespace, config, manifest, choice, seconds: float) -> None:
    """The bundle written, on stdout: one line, or with --json one JSON object."""
    from export.bundle import peak_rss_bytes

    out = config.out
    peak = peak_rss_bytes()
    sizes = {f: (out / f).stat().st_size for f in manifest.files}
    if args.json:
        roles = {role: {"layers": m.arch.n_layers, "stages": list(m.stages), "source": m.source, "logit_rows": m.logit_rows} for role, m in manifest.models.items()}
        summary = {
            "bundle": str(out), "device": config.device, "quant": config.quant, "block_size": config.block_size, "draft_block_size": config.draft_block, "zero_points": config.zero_points, "gguf_blocks": manifest.target.gguf_blocks, "attention": config.attention,
            "max_context": config.max_context, "roles": roles, "bytes": sizes, "seconds": seconds,
            "peak_rss_bytes": peak,
        }
        if choice is not None:
            summary["memory"] = {"changes": list(choice.changes), "plan": choice.plan.to_dict()}
        print(json.dumps(summary))
        return
    roles = ", ".join(f"{role} ({m.arch.n_layers} layers{f', head of {m.logit_rows} tokens' if m.trimmed_head else ''})" for role, m in manifest.models.items())
    print(f"{out}: {roles}; --device {config.device}; {config.quant}{_blocks(config, manifest) if config.quant in ('int4', 'int8') else ''}; {sum(sizes.values()) / 2**20:.0f} MiB; max context {config.max_context}; {seconds:.0f} s; peak memory {peak / 2**30:.1f} GiB")


def _blocks(config, manifest) -> str:
    draft = f"; draft {config.draft_block}" if config.draft_block != config.block_size and any(not d.startswith("layer-skip:") for d in config.drafts) else ""
    kept = manifest.target.gguf_blocks
    if kept:
        return f" (the GGUF's own blocks: {', '.join(f'{n} {c / 1e6:.0f} M' for n, c in kept.items())}{draft})"
    return f" ({'asymmetric ' if config.zero_points else ''}blocks of {config.block_size}{draft})"


if __name__ == "__main__":
    sys.exit(main())
