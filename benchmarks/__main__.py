"""python -m benchmarks bench BUNDLE --out DIR [--prompts SPEC] [--modes M] [--micro] ... (the decode bench, benchmarks/bench/)
python -m benchmarks precision MODEL BUNDLE... [--prompts N] [--out FILE.json]
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
python -m benchmarks gpu_kit --out DIR (--download | --wheel FILE | --no-wheels) [--bundle DIR] ... (benchmarks/gpu_kit.py)
python -m benchmarks load_run BUNDLE [--waves 3] [--clients 32] [--slow 10] [--oversized 4] [--disconnect 0] [--wrong-keys-from 0] [--out FILE.json]
python -m benchmarks heap_probe BUNDLE [--waves 30] [--clients 12] [--oversized 4] [--arenas N] [--out FILE.json]
python -m benchmarks serve_clients BUNDLE [--servers auto:1,none:1,none:4] [--clients 1,2,4] [--prompts SPEC] [--max-tokens 128] [--rounds 2] [--out FILE.json]
python -m benchmarks mixed_load BUNDLE [--stalls 0,50] [--parallel 4] [--others 3] [--rounds 3] [--external NAME=PORT] [--out FILE.json]
python -m benchmarks context_curve BUNDLE... [--kv-lens 128,512,1536] [--blocks 1,4] [--repeats 20] [--rounds 3] [--out FILE.json]
python -m benchmarks batch_curve BUNDLE [--batch 1,2,4,8] [--kv-len 512] [--repeats 20] [--prompts SPEC] [--decode 64] [--out FILE.json]
python -m benchmarks policy_trace BUNDLE --out FILE.json [--prompts SPEC] [--target-ms 10,1.5] [--draft-ms 2.5,0.4] | --compare A.json B.json
python -m benchmarks code_ab BUNDLE --old CHECKOUT [--blocks 1,5] [--kv-len 512] [--repeats 20] [--rounds 8] [--out FILE.json]
python -m benchmarks export_time MODEL --old CHECKOUT [--new CHECKOUT] [--repeats 2] [--out FILE.json] [-- EXPORT ARGS]
python -m benchmarks summary DIR... (summary.json from each DIR/results.json of `python -m benchmarks bench`)"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _new_folder(text: str) -> str:
    """An output folder: may exist as a folder, must not be (or lie under) a file."""
    path = Path(text)
    for part in (path, *path.parents):
        if part.exists() and not part.is_dir():
            raise argparse.ArgumentTypeError(f"{part} exists and is not a folder")
    return text


def bench_parser() -> argparse.ArgumentParser:
    """`bench`'s options. The value types are the runtime command line's own (`--gamma`,
    `--temperature`, ... are checked as `python -m runtime generate` checks them), and so is the
    parser: an argument error is one `error:` line, exit 2."""
    from runtime.__main__ import _Parser, _gamma, _integer, _setting
    from runtime.gamma import MAX_GAMMA

    bench = _Parser(prog="python -m benchmarks bench",
                    description="decode benchmark of several modes, side by side; writes JSON, Markdown and plots")
    bench.add_argument("bundle")
    bench.add_argument("--prompts", default="humaneval:20", help="FILE.jsonl, humaneval[:N], humaneval:A-B, stdlib-edit:N or stdlib-edit:A-B; several, comma-separated")
    bench.add_argument("--modes", default="plain,model,lookup,layer-skip,auto", help="comma-separated (plain is always run)")
    bench.add_argument("--max-new-tokens", type=_integer(1), default=128)
    bench.add_argument("--repeat", type=_integer(1), default=1, help="passes over all prompts, interleaved")
    bench.add_argument("--gamma", type=_gamma, default="auto", help="auto (adaptive) or a fixed draft length")
    bench.add_argument("--max-gamma", type=_integer(1, MAX_GAMMA), default=8)
    bench.add_argument("--temperature", type=_setting("temperature"), default=0.0, help="0 (default): greedy; above 0: sampled, once per seed")
    bench.add_argument("--top-p", type=_setting("top_p"), default=1.0, help="with --temperature (default 1.0)")
    bench.add_argument("--seeds", type=_integer(1), default=1, help="with --temperature: runs per prompt and mode, seeds 0..N-1")
    bench.add_argument("--provider", default="auto", help="auto|cpu|cuda|dml|coreml (default auto)")
    bench.add_argument("--threads", type=_integer(0, 1024), default=0)
    bench.add_argument("--micro", action="store_true",
                       help="time single passes instead: target T=1..16, one draft step per role, memory-bandwidth floor")
    bench.add_argument("--kv-len", type=_integer(1), default=512, help="--micro: rows already in the KV cache (default 512)")
    bench.add_argument("--quiet", action="store_true", help="no progress line per run on stderr")
    bench.add_argument("--out", required=True, type=_new_folder, help="folder for results.json + summary.json / micro.json, report.md and PNGs")
    return bench


def bench(argv: list[str]) -> int:
    """`python -m benchmarks bench ...`: the arguments checked, then the bench or the micro
    benchmark, report.md printed. A bad bundle, prompt set, provider or --out is one `error:`
    line, exit 2, as on the runtime's command line."""
    from edge_spec.manifest import BundleError
    from edge_spec.placement import PlacementError
    from runtime.engine import PromptTooLongError
    from runtime.kv_cache import ContextFullError
    from runtime.sessions import ProviderError
    from runtime.tokenizer import ChatTemplateError

    args = bench_parser().parse_args(argv)
    try:
        return _run_bench(args)
    except (BundleError, PlacementError, PromptTooLongError, ContextFullError, ProviderError, ChatTemplateError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _run_bench(args) -> int:
    from benchmarks.bench import BenchConfig, MicroConfig, load_prompts, render_report, run_bench, run_micro, save_micro, save_results

    out = Path(args.out)

    def make_out() -> None:
        """After the arguments and prompts are checked (bad input leaves no folder behind), before
        the run (a folder that cannot be made would otherwise fail only once the run is over)."""
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"cannot create --out {out}: {exc.strerror or exc}") from None

    if args.micro:
        make_out()
        save_micro(run_micro(args.bundle, MicroConfig(kv_len=args.kv_len, provider=args.provider, threads=args.threads)), out)
    else:
        modes = [m.strip() for m in args.modes.split(",") if m.strip()]
        if "plain" not in modes:
            modes.insert(0, "plain")  # every speedup is measured against plain decoding
        config = BenchConfig(
            modes=tuple(modes), max_new_tokens=args.max_new_tokens, repeat=args.repeat,
            gamma=None if args.gamma == "auto" else int(args.gamma), max_gamma=args.max_gamma,
            provider=args.provider, threads=args.threads, temperature=args.temperature, top_p=args.top_p, seeds=args.seeds,
        )
        prompts = load_prompts(args.prompts)
        make_out()
        log = (lambda line: None) if args.quiet else (lambda line: print(line, file=sys.stderr, flush=True))
        save_results(run_bench(args.bundle, prompts, config, log=log), out)
    for warning in render_report(out):
        print(f"warning: {warning}", file=sys.stderr)
    print((out / "report.md").read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench(argv[1:])
    if argv[:1] == ["gpu_check"]:
        from benchmarks.gpu_check import main as gpu_check

        return gpu_check(argv[1:])
    if argv[:1] == ["gpu_kit"]:
        from benchmarks.gpu_kit import main as gpu_kit

        return gpu_kit(argv[1:])
    if argv[:1] == ["load_run"]:
        from benchmarks.load_run import main as load_run

        return load_run(argv[1:])
    if argv[:1] == ["heap_probe"]:
        from benchmarks.heap_probe import main as heap_probe

        return heap_probe(argv[1:])
    if argv[:1] == ["mixed_load"]:
        from benchmarks.mixed_load import main as mixed_load

        return mixed_load(argv[1:])
    if argv[:1] == ["serve_clients"]:
        from benchmarks.serve_clients import main as serve_clients

        return serve_clients(argv[1:])
    if argv[:1] == ["context_curve"]:
        from benchmarks.context_curve import main as context_curve

        return context_curve(argv[1:])
    if argv[:1] == ["batch_curve"]:
        from benchmarks.batch_curve import main as batch_curve

        return batch_curve(argv[1:])
    if argv[:1] == ["policy_trace"]:
        from benchmarks.policy_trace import main as policy_trace

        return policy_trace(argv[1:])
    if argv[:1] == ["code_ab"]:
        from benchmarks.code_ab import main as code_ab

        return code_ab(argv[1:])
    if argv[:1] == ["export_time"]:
        from benchmarks.export_time import main as export_time

        return export_time(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    sub = parser.add_subparsers(dest="command", required=True)
    # Listed for --help only: main() hands `bench` to bench() before parsing.
    sub.add_parser("bench", help="the decode bench: every mode on every prompt side by side, or --micro (python -m benchmarks bench --help)")
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
    stability.add_argument("--prompts", default="humaneval:20", help="the bench's prompt spec (default humaneval:20)")
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
    args = parser.parse_args(argv)

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
