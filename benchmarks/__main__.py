"""python -m benchmarks precision MODEL BUNDLE... [--prompts N] [--out FILE.json]
python -m benchmarks ab OLD_BUNDLE NEW_BUNDLE [--blocks 1,5] [--kv-len 512] [--repeats 40] [--out FILE.json]
python -m benchmarks op_profile BUNDLE [--blocks 1,2,4,8] [--kv-len 512] [--repeats 20] [--threads N] [--out FILE.json]
python -m benchmarks fidelity MODEL BUNDLE... [--text FILE] [--ctx 512] [--out FILE.json]
python -m benchmarks gguf_types FILE.gguf [--out FILE.json]
python -m benchmarks sensitivity MODEL [--schemes int4/128,int4/64,int8/128] [--chunks 2] [--out FILE.json]
python -m benchmarks spinning BUNDLE [--repeats 120] [--kv-len 512] [--out FILE.json]
python -m benchmarks activations MODEL [--out FILE.json]
python -m benchmarks greedy_stability BUNDLE... [--prompts SPEC] [--tokens N] [--modes M] [--out FILE.json]
python -m benchmarks block_stable_cost BUNDLE [--prompts SPEC] [--tokens N] [--drafters none,auto] [--out FILE.json]
python -m benchmarks gpu_check --out DIR [--bundle DIR] [--reference DIR] ... (benchmarks/gpu_check.py)
python -m benchmarks load_run BUNDLE [--waves 3] [--clients 32] [--slow 10] [--oversized 4] [--out FILE.json]
python -m benchmarks summary DIR... (summary.json from each DIR/results.json of `python -m runtime bench`)

The decode bench itself is `python -m runtime bench` (benchmarks/bench/)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> int:
    if sys.argv[1:2] == ["gpu_check"]:
        from benchmarks.gpu_check import main as gpu_check

        return gpu_check(sys.argv[2:])
    if sys.argv[1:2] == ["load_run"]:
        from benchmarks.load_run import main as load_run

        return load_run(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    precision = sub.add_parser("precision", help="bundle logits against transformers fp32")
    precision.add_argument("model", help="what the bundles were exported from (alias, folder, .gguf)")
    precision.add_argument("bundles", nargs="+")
    precision.add_argument("--prompts", type=int, default=5, help="HumanEval chat prompts, besides two raw ones")
    precision.add_argument("--out", help="write the rows as JSON here")
    ab = sub.add_parser("ab", help="one target pass and one draft step of two bundles, timed alternately")
    ab.add_argument("old")
    ab.add_argument("new")
    ab.add_argument("--blocks", default="1,5", help="target block lengths T, comma-separated")
    ab.add_argument("--kv-len", type=int, default=512, help="rows already in the KV cache")
    ab.add_argument("--repeats", type=int, default=40)
    ab.add_argument("--out", help="write the result as JSON here")
    activations = sub.add_parser("activations", help="largest |activation| per kind (does float16 hold it?)")
    activations.add_argument("model")
    activations.add_argument("--out", help="write the result as JSON here")
    spinning = sub.add_parser("spinning", help="intra-op spinning off against spin-and-stop, timed alternately")
    spinning.add_argument("bundle")
    spinning.add_argument("--repeats", type=int, default=120)
    spinning.add_argument("--kv-len", type=int, default=512, help="rows already in the KV cache")
    spinning.add_argument("--out", help="write the result as JSON here")
    stability = sub.add_parser("greedy_stability", help="1-row vs block logits, and greedy identity with block-stable mode off and on")
    stability.add_argument("bundles", nargs="+")
    stability.add_argument("--prompts", default="humaneval:20", help="runtime bench's prompt spec (default humaneval:20)")
    stability.add_argument("--tokens", type=int, default=128, help="greedy tokens per run (default 128)")
    stability.add_argument("--modes", default="default,block_stable", help="greedy identity runs: default, block_stable, or none")
    stability.add_argument("--out", help="write the rows as JSON here")
    cost = sub.add_parser("block_stable_cost", help="decode speed with block-stable mode off and on, alternately")
    cost.add_argument("bundle")
    cost.add_argument("--prompts", default="humaneval:10")
    cost.add_argument("--tokens", type=int, default=128)
    cost.add_argument("--drafters", default="none,auto", help="comma-separated: none (plain), auto, model, lookup, layer-skip")
    cost.add_argument("--out", help="write the result as JSON here")
    ops = sub.add_parser("op_profile", help="one pass's time by op and matrix, with bytes read and GB/s (ONNX Runtime's profile)")
    ops.add_argument("bundle")
    ops.add_argument("--blocks", default="1,2,4,8", help="target block lengths T, comma-separated")
    ops.add_argument("--kv-len", type=int, default=512, help="rows already in the KV cache")
    ops.add_argument("--repeats", type=int, default=20)
    ops.add_argument("--threads", type=int, help="intra-op threads (default: the runtime's)")
    ops.add_argument("--out", help="write the result as JSON here")
    fidelity = sub.add_parser("fidelity", help="KL divergence and same-top-1 against transformers fp32 on a fixed text")
    fidelity.add_argument("model", help="what the bundles were exported from (alias, folder, .gguf)")
    fidelity.add_argument("bundles", nargs="+")
    fidelity.add_argument("--text", type=Path, help="the text (default benchmarks/prompts/fidelity.txt)")
    fidelity.add_argument("--ctx", type=int, default=512, help="tokens per chunk; the second half of each is scored")
    fidelity.add_argument("--chunks", type=int, default=8)
    fidelity.add_argument("--out", help="write the result as JSON here")
    types = sub.add_parser("gguf_types", help="which of a GGUF's tensor types MatMulNBits holds exactly, and the bytes it reads then")
    types.add_argument("gguf")
    types.add_argument("--out", help="write the result as JSON here")
    sens = sub.add_parser("sensitivity", help="KL of each role's matrices alone quantized (fitted blocks, emulated in float32)")
    sens.add_argument("model", help="alias, folder or .gguf")
    sens.add_argument("--schemes", default="int4/128,int4/64,int8/128", help="comma-separated intBITS/BLOCK")
    sens.add_argument("--chunks", type=int, default=2)
    sens.add_argument("--ctx", type=int, default=512)
    sens.add_argument("--out", help="write the result as JSON here")
    summary = sub.add_parser("summary", help="summary.json (what BENCHMARKS.md cites) from each DIR/results.json")
    summary.add_argument("folders", nargs="+", metavar="DIR")
    args = parser.parse_args()

    if args.command == "summary":
        from benchmarks.bench.summary import RESULTS_FILE, write_summary

        missing = [folder for folder in args.folders if not (Path(folder) / RESULTS_FILE).is_file()]
        if missing:
            parser.error(f"no {RESULTS_FILE} in {', '.join(missing)}")
        for folder in args.folders:
            print(write_summary(Path(folder)))
        return 0
    if args.command == "activations":
        from benchmarks.activations import measure

        rows = measure(args.model)
        print(json.dumps(rows))
    elif args.command == "spinning":
        from benchmarks.spinning import compare as compare_spinning

        rows = compare_spinning(args.bundle, args.repeats, args.kv_len)
    elif args.command == "greedy_stability":
        from benchmarks.greedy_stability import run as run_stability

        modes = tuple(m for m in args.modes.split(",") if m and m != "none")
        bad = set(modes) - {"default", "block_stable"}
        if bad:
            parser.error(f"unknown --modes {sorted(bad)} (default, block_stable, none)")
        rows = run_stability(args.bundles, args.prompts, args.tokens, modes)
    elif args.command == "block_stable_cost":
        from benchmarks.block_stable_cost import run as run_cost

        rows = run_cost(args.bundle, args.prompts, args.tokens, [d for d in args.drafters.split(",") if d])
    elif args.command == "op_profile":
        from benchmarks.op_profile import profile, table

        rows = profile(args.bundle, [int(b) for b in args.blocks.split(",")], args.kv_len, args.repeats, args.threads)
        print("\n".join(table(rows)))
    elif args.command == "fidelity":
        from benchmarks.fidelity import DEFAULT_TEXT, measure

        rows = measure(args.model, args.bundles, args.text or DEFAULT_TEXT, args.ctx, args.chunks)
    elif args.command == "gguf_types":
        from benchmarks.gguf_types import analyse, table as types_table

        rows = analyse(args.gguf)
        print("\n".join(types_table(rows)))
    elif args.command == "sensitivity":
        from benchmarks.sensitivity import parse_scheme, run as run_sensitivity

        schemes = [x for x in args.schemes.split(",") if x]
        try:
            for scheme in schemes:
                parse_scheme(scheme)
        except ValueError as exc:
            parser.error(str(exc))
        rows = run_sensitivity(args.model, schemes, args.chunks, args.ctx)
    elif args.command == "ab":
        from benchmarks.ab_passes import compare as compare_passes

        rows = compare_passes(args.old, args.new, [int(b) for b in args.blocks.split(",")], args.kv_len, args.repeats)
    else:
        from benchmarks.precision import compare

        rows = compare(args.model, args.bundles, args.prompts)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
