"""python -m runtime generate|audit|serve|chat|plan|check|handoff BUNDLE ...: the command line. generate, serve and
chat go through runtime.api.Model (its scheduler owns concurrency); audit drives a runtime.Engine alone.
(The decode bench is `python -m benchmarks bench`; `python -m runtime bench` only says so.)"""

from __future__ import annotations

import argparse
import json
import math
import sys

from edge_spec.drafters import DRAFTERS, TABLE, drafter_help
from runtime.gamma import MAX_GAMMA
from runtime.sessions import COREML_COMPUTE_UNITS




def _integer(low: int | None = None, high: int | None = None):
    """An argparse type: an integer in [low, high], checked at parse time (before any load)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if (low is not None and value < low) or (high is not None and value > high):
            bounds = f"{low}..{high}" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"{value} is out of range (allowed: {bounds})")
        return value

    return parse


def _stall(ms: float) -> float | None:
    """--prefill-stall-ms: 0 prefills a prompt whole (EngineConfig's None)."""
    return ms or None


def _number(low: float, high: float | None = None, low_open: bool = False):
    """An argparse type: a finite number in [low, high] (or (low, high] with low_open)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value) or value < low or (low_open and value == low) or (high is not None and value > high):
            bounds = f"{'(' if low_open else '['}{low:g}, {high:g}]" if high is not None else f"{'>' if low_open else '>='} {low:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range (allowed: {bounds})")
        return value

    return parse


def _setting(name: str):
    """An argparse type for the request setting `name` (runtime.requests.Options): parsed as its
    Param's kind, refused with the range it declares or the request type's own check (a
    temperature too small to scale the logits, ...) at parse time, before any load."""
    from runtime.requests import Options, params

    p = params(Options)[name]

    def parse(text: str):
        try:
            value = p.kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if p.kind is int else 'a number'}") from None
        if (p.kind is float and not math.isfinite(value)) or not p.within(value):
            raise argparse.ArgumentTypeError(f"{text} is out of range (allowed: {p.bounds()})")
        try:
            Options(**{name: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse


def _request_args(parser: argparse.ArgumentParser, *names: str, **defaults) -> None:
    """The flags of request settings `names`, generated from their declarations (edge_spec.params
    Param on runtime.requests.Options); `defaults` where the command's differ from the API's."""
    import dataclasses

    from runtime.requests import Options, params

    declared, fields = params(Options), {f.name: f for f in dataclasses.fields(Options)}
    for name in names:
        p, default = declared[name], defaults.get(name, fields[name].default)
        shown_default = "" if default is None else f" (default {default})"
        flag = p.cli or "--" + name.replace("_", "-")
        parser.add_argument(flag, dest=name, type=_setting(name), default=default, metavar=flag[2:].replace("-", "_").upper(),
                            help=p.help + shown_default)
    parser.set_defaults(request_settings=(parser.get_default("request_settings") or ()) + names)


def _options(args, **fields):
    """The request the command's setting flags (_request_args) describe, plus `fields`."""
    from runtime.requests import Options

    return Options(**{name: getattr(args, name) for name in args.request_settings}, **fields)


def _server_field(name: str):
    """An argparse type: an integer for ServerConfig's `name`, refused with ServerConfig's own
    message at parse time (before any load)."""
    integer = _integer()

    def parse(text: str) -> int:
        from runtime.server.config import ServerConfig

        value = integer(text)
        try:
            ServerConfig(**{name: value})
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        return value

    return parse


def _text(text: str) -> str:
    """An argparse type: text that was UTF-8 on the command line (Python keeps other bytes as lone
    surrogates, which no tokenizer takes)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"is not UTF-8 text (it starts {text.encode('utf-8', 'surrogateescape')[:16]!r})") from None
    return text


def _gamma(text: str) -> str:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be auto or an integer 1..{MAX_GAMMA}, got {text!r}") from None
    if not 1 <= value <= MAX_GAMMA:
        raise argparse.ArgumentTypeError(f"must be auto or an integer 1..{MAX_GAMMA}, got {value}")
    return text


def _sha256(text: str) -> str:
    from edge_spec.manifest import check_sha256

    try:
        return check_sha256(text, "the bundle SHA-256")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


class _Parser(argparse.ArgumentParser):
    """Argument errors as one `error:` line (exit 2), like every other error of the command."""

    def error(self, message: str):
        self.exit(2, f"error: {message} (see {self.prog} --help)\n")


def _engine_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("bundle", help="bundle folder written by `python -m export`")
    parser.add_argument("--provider", default="auto", help="auto|cpu|cuda|dml|coreml (default auto: cuda, dml, coreml, cpu, the first available)")
    parser.add_argument("--draft-provider", help="provider for the draft model (default: --provider)")
    parser.add_argument("--allow-fallback", action="store_true", help="use the CPU when the provider is missing or fails to start")
    parser.add_argument("--device-id", type=_integer(0, 255), default=0, help="CUDA / DirectML device index (default 0)")
    parser.add_argument("--coreml-compute-units", default="ALL", choices=COREML_COMPUTE_UNITS, help="where Core ML may run (default ALL)")
    parser.add_argument("--coreml-static-shapes", action="store_true", help="Core ML EP takes only nodes with static input shapes")
    parser.add_argument("--threads", type=_integer(0, 1024), default=0, help="intra-op threads (0: ONNX Runtime's default)")
    parser.add_argument("--draft", default="auto", choices=DRAFTERS, help=drafter_help())
    parser.add_argument("--suffix-cache-tokens", type=_integer(1), default=1 << 16,
                        help=f"--draft {' / '.join(s.name for s in TABLE if s.remembers)}: tokens of earlier requests kept to copy from (default 65536)")
    parser.add_argument("--gamma", type=_gamma, default="auto", help=f"draft length: auto (adaptive) or 1..{MAX_GAMMA}")
    parser.add_argument("--max-gamma", type=_integer(1, MAX_GAMMA), default=8, help=f"longest draft for auto (1..{MAX_GAMMA}, default 8)")
    parser.add_argument("--block-stable", action="store_true",
                        help="every target pass scores at least 2 positions: greedy output independent of drafter and gamma at any quantization (plain steps cost more)")
    parser.add_argument("--bundle-sha256", type=_sha256, metavar="HEX",
                        help="refuse the bundle unless manifest.json has this SHA-256 (printed by export and `check`); it covers every file")


def _memory_size(text: str) -> int:
    from edge_spec.budget import parse_size

    try:
        value = parse_size(text)
    except (ValueError, OverflowError) as exc:
        raise argparse.ArgumentTypeError(str(exc) if isinstance(exc, ValueError) else f"{text[:40]!r} is too large") from None
    if value >= 1 << 63:
        raise argparse.ArgumentTypeError(f"{text[:40]!r} is too large (at most 8 EiB)")
    return value


def _memory_budget_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-budget", type=_memory_size, metavar="SIZE",
        help="refuse, before loading anything, when the memory plan exceeds SIZE (3GB, 512MiB, bytes); see `plan`",
    )


def _prompt_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt", required=True, type=_text)
    parser.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    _request_args(parser, "temperature", "top_k", "top_p")


def _engine_config(args):
    """The EngineConfig the command runs with: every check before loading reads it, not args."""
    from runtime.engine import EngineConfig

    return EngineConfig(
        provider=args.provider,
        draft_provider=args.draft_provider,
        threads=args.threads,
        drafter=args.draft,
        gamma=None if args.gamma == "auto" else int(args.gamma),
        max_gamma=args.max_gamma,
        allow_fallback=args.allow_fallback,
        device_id=args.device_id,
        coreml_compute_units=args.coreml_compute_units,
        coreml_static_shapes=args.coreml_static_shapes,
        memory_budget=getattr(args, "memory_budget", None),
        block_stable=args.block_stable, suffix_cache_tokens=args.suffix_cache_tokens,
        bundle_sha256=args.bundle_sha256, suffix_cache=getattr(args, "suffix_cache", "per-client"),
        prefill_stall_ms=_stall(getattr(args, "prefill_stall_ms", 50.0)),
    )


def _engine(args):
    from runtime.engine import Engine

    engine = Engine(args.bundle, _engine_config(args))
    print(engine.provider_line(), file=sys.stderr, flush=True)
    for warning in engine.warnings:
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    return engine


def _prompt_ids(encoder, args) -> list[int]:
    """encoder: an Engine or a Model (the same encode)."""
    if args.chat:
        return encoder.encode(messages=[{"role": "user", "content": args.prompt}])
    return encoder.encode(prompt=args.prompt)


def cmd_generate(args) -> int:
    from runtime.api import Model

    model = Model(_engine(args), max_queue=0)
    options = _options(args, stop=tuple(args.stop or ()))
    prompt_ids = _prompt_ids(model, args)
    result = None
    for chunk in model.stream(prompt_ids=prompt_ids, options=options):
        result = chunk.result or result
        if chunk.text and not args.json:
            sys.stdout.write(chunk.text)
            sys.stdout.flush()
    if args.json:
        print(json.dumps({
            "text": result.text,
            "prompt_ids": result.prompt_ids,
            "token_ids": result.token_ids,
            "stop_reason": result.stop_reason,
            "provider": model.engine.provider_report(),
            # One request, nothing queued before it: queue_s says nothing here.
            "timings": {k: v for k, v in result.timings.items() if k != "queue_s"},
            "stats": result.stats.to_dict(),
        }))
    else:
        print(
            f"\n[stop: {result.stop_reason}; {len(result.token_ids)} tokens; prefill {result.timings['prefill_ms']:.0f} ms; "
            f"{result.timings['decode_tokens_per_s']:.1f} tok/s; {result.stats.tokens_per_pass:.2f} tokens/pass]",
            file=sys.stderr,
        )
    return 0


def cmd_audit(args) -> int:
    from runtime import audit

    if args.temperature <= 0:
        print("error: the audit tests sampled distributions: pass --temperature > 0", file=sys.stderr)
        return 2
    if args.draft == "none":
        print("error: the audit tests speculation: pick a drafter other than none", file=sys.stderr)
        return 2
    config = audit.AuditConfig(args.samples, args.positions, args.alpha, args.simulations, args.seed)  # ValueError: exit 2
    sampling = _options(args).sampling()
    engine = _engine(args)
    prompt_ids = _prompt_ids(engine, args)
    if args.self_test:
        positions, detectable = audit.self_test(engine, prompt_ids, sampling, config)
        detected = any(p.p_value <= config.threshold for p in positions)
        report = {"self_test": True, "detected": detected, "threshold": config.threshold, "detectable_tv": detectable,
                  "positions": [p.__dict__ for p in positions]}
        if args.json:
            print(json.dumps(report))
        else:
            for p in positions:
                print(f"position {p.position}: TV {p.tv:.4f}, p-value {p.p_value:.4f}")
            print(f"SELF-TEST {'OK: the test tells the draft' if detected else 'FAILED: the test cannot tell the draft'}'s samples from the target's law")
        return 0 if detected else 1
    gamma = args.gamma
    run = audit.speculative_samples(engine, prompt_ids, sampling, config)
    if args.against == "plain":
        plain = audit.speculative_samples(engine, prompt_ids, sampling, config, speculative=False, seed_offset=10**6)
        positions = audit.two_sample(run.tokens, plain.tokens, config)
        report = audit.AuditReport("plain", args.draft, gamma, config.samples, config.alpha, config.n_simulations, tuple(positions),
                                   run.drafted_tokens, run.samples_drafted, run.rejections, run.residual_tokens, None)
    else:
        law = audit.ExactLaw(engine.target, prompt_ids, sampling).rows(run.tokens)
        report = audit.audit_exact(run.tokens, run, law, config, args.draft, gamma)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print("\n".join(report.lines()))
    return 0 if report.passed else 1


def bench_moved(argv: list[str]) -> int:
    """`python -m runtime bench ...`, the bench's old place: one `error:` line naming the new
    command with the same arguments, exit 2 (the runtime imports nothing from benchmarks/)."""
    import shlex

    print(f"error: the bench moved out of the runtime: run `python -m benchmarks {shlex.join(argv)}` "
          "from the repository's root (same options)", file=sys.stderr)
    return 2


def cmd_serve(args) -> int:
    import os

    from runtime.api import Model
    from runtime.server import check_bind, serve

    from runtime.server import ServerConfig, check_api_keys, read_api_key_file

    # Everything is checked before the (slow) load, on the config the engine will run with.
    engine_config = _engine_config(args)
    if args.parallel > 1 and args.block_stable:
        raise ValueError("--parallel above 1 is not block-stable (a batched pass computes one row per sequence, block-stable "
                         "passes two; docs/batching.md): drop one of them")
    if args.parallel > 1 and args.memory_budget is not None:
        from edge_spec.budget import check_parallel
        from runtime.bundle import open_bundle

        bundle = open_bundle(args.bundle, check_hashes=False)
        check_parallel(bundle.manifest, bundle.path, args.draft, args.memory_budget, args.parallel, engine_config.max_gamma)
    keys = []
    if args.api_key is not None:
        keys.append(args.api_key)
    elif os.environ.get("EDGE_SPEC_API_KEY") is not None and args.api_key_file is None:
        keys.append(os.environ["EDGE_SPEC_API_KEY"])
    if args.api_key_file:
        keys += read_api_key_file(args.api_key_file)
    check_api_keys(keys)
    check_bind(args.host, keys, args.insecure)
    config = ServerConfig(
        host=args.host, allowed_hosts=tuple(args.allowed_host), allowed_origins=tuple(args.allowed_origin),
        header_timeout=args.header_timeout, body_timeout=args.body_timeout, idle_timeout=args.idle_timeout,
        max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client,
        client_prefix_v4=args.client_prefix_v4, client_prefix_v6=args.client_prefix_v6,
        auth_failures_global=args.auth_failures_global, max_body_bytes=args.max_body_bytes,
        shutdown_timeout=args.shutdown_timeout, access_log=not args.no_access_log,
    )
    from runtime import heap

    heap.bound_arenas()  # before the sessions start their thread pools, so those share the two arenas too
    # Half the places by default: one client cannot hold the whole queue, yet can fill the batch.
    per_client = args.max_per_client or max(args.parallel, (args.parallel + args.max_queue + 1) // 2)
    model = Model(_engine(args), max_queue=args.max_queue, queue_timeout=args.queue_timeout or None, name=args.model_name,
                  parallel=args.parallel, max_per_client=per_client)
    try:
        serve(model, args.host, args.port, None, args.insecure, log_level=args.log_level,
              announce=lambda line: print(line, flush=True), config=config, api_keys=keys)
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled gracefully
        return 0
    return 0


def cmd_chat(args) -> int:
    from runtime.api import Model
    from runtime.chat import run_chat

    model = Model(_engine(args), max_queue=0)
    return run_chat(model, system=args.system, options=_options(args))


def cmd_plan(args) -> int:
    from edge_spec.budget import plan_bundle
    from runtime.bundle import open_bundle

    bundle = open_bundle(args.bundle, check_hashes=False)
    max_context = bundle.manifest.target.arch.max_context
    if args.context is not None and args.context > max_context:
        raise ValueError(f"--context {args.context} is more than the bundle's max context of {max_context} tokens")
    plan = plan_bundle(bundle.manifest, bundle.path, args.draft, args.memory_budget, args.max_gamma, args.context, args.parallel)
    print(json.dumps(plan.to_dict()) if args.json else plan.table())
    return 0 if plan.fits else 1


def _ort_version(text: str) -> str:
    """An argparse type: an onnxruntime version such as 1.23.0, checked at parse time."""
    from edge_spec.placement import PlacementError, version_key

    try:
        version_key(text)
    except PlacementError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def cmd_check(args) -> int:
    from edge_spec.placement import check_bundle
    from runtime.bundle import open_bundle

    bundle = open_bundle(args.bundle, check_hashes=False)
    report = check_bundle(bundle.manifest, bundle.path, args.provider, args.onnxruntime)
    if args.json:
        print(json.dumps({"bundle": str(bundle.path), "bundle_sha256": bundle.digest, "device": bundle.manifest.device, **report.to_dict()}))
        return 0 if report.ok else 1
    print(f"{bundle.path} (--device {bundle.manifest.device}) on {args.provider}: {report.summary()}")
    print(f"  bundle SHA-256 (pin with --bundle-sha256): {bundle.digest}")
    for op, misses in report.by_op().items():
        stages = sorted({m.stage for m in misses})
        print(f"  {op}: {len(misses)} node(s) in {', '.join(stages)}: {misses[0].reason}")
    # A node a kernel fact matches would compute something else (or not be taken): name each.
    for op, found in report.facts_by_op().items():
        for reason in dict.fromkeys(m.reason for m in found):
            nodes = [m for m in found if m.reason == reason]
            print(f"  {op}: {len(nodes)} node(s): {reason} [{nodes[0].source}]")
            for m in nodes[:8]:
                print(f"    {m.stage}: {m.node}" + (f" ({m.detail})" if m.detail else ""))
            if len(nodes) > 8:
                print(f"    ... and {len(nodes) - 8} more")
    print(f"  kernel table: {report.table_source}")
    return 0 if report.ok else 1


def cmd_handoff(args) -> int:
    from runtime.bundle import open_bundle
    from runtime.handoff import bench_mode, measured_alpha, plan

    alphas = measured_alpha(args.bench_results) if args.alpha is None and args.bench_results else None
    bundle = open_bundle(args.bundle, check_hashes=False)
    alpha = args.alpha
    if alphas is not None:
        mode = bench_mode(bundle.manifest, args.method)
        if mode not in alphas:
            raise ValueError(f"{args.bench_results} has no α for mode {mode!r} (it has: {', '.join(alphas) or 'none'})")
        alpha = alphas[mode]
    handoff = plan(bundle.manifest, args.engine, args.method, alpha, args.port)
    if args.json:
        print(json.dumps(handoff.to_dict()))
    else:
        print(handoff.command())
        for note in handoff.notes:
            print(f"# {note}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The command line, every subcommand and its options."""
    parser = _Parser(prog="python -m runtime", description="Run edge-spec bundles.")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text from a prompt")
    _engine_args(gen)
    _prompt_args(gen)
    _request_args(gen, "max_tokens", "seed")
    gen.add_argument("--stop", action="append", type=_text, help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _memory_budget_arg(gen)
    gen.set_defaults(func=cmd_generate)

    audit = sub.add_parser("audit", help="check that speculation leaves the output distribution unchanged")
    _engine_args(audit)
    _prompt_args(audit)
    audit.set_defaults(gamma="4")  # a fixed γ drafts in every sample; auto may draft in few
    audit.add_argument("--samples", type=_integer(20, 10**7), default=600, help="speculative samples (default 600)")
    audit.add_argument("--positions", type=_integer(1, 32), default=3, help="first K generated tokens tested (default 3)")
    audit.add_argument("--alpha", type=_number(0.0, 0.5, low_open=True), default=0.01, help="family-wise significance level (default 0.01)")
    audit.add_argument("--simulations", type=_integer(1, 10**7), help="draws for each p-value (default: 10 / (alpha / K))")
    audit.add_argument("--against", default="exact", choices=("exact", "plain"),
                       help="exact: the target's own law (default); plain: a two-sample test against plain samples")
    audit.add_argument("--self-test", action="store_true", help="draw the samples from the draft's q instead: the test must reject them")
    audit.add_argument("--seed", type=_integer(0, 2**32), default=0)
    audit.add_argument("--json", action="store_true")
    audit.set_defaults(func=cmd_audit)

    # Listed for --help only: main() answers `bench` before parsing (bench_moved).
    sub.add_parser("bench", help="moved: python -m benchmarks bench BUNDLE --out DIR ... (same options)")

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)")
    _engine_args(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (default loopback only)")
    serve.add_argument("--port", type=_integer(0, 65535), default=8000, help="port (0: any free port; the chosen one is printed)")
    serve.add_argument("--api-key", help="require 'Authorization: Bearer KEY' (default: $EDGE_SPEC_API_KEY)")
    serve.add_argument("--api-key-file", help="file of accepted keys, one per line (blank lines and # comments skipped)")
    serve.add_argument("--insecure", action="store_true", help="allow a non-loopback --host without an API key")
    serve.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                       help="also answer requests whose Host is NAME (*.example.com, or * for any); repeatable")
    serve.add_argument("--allowed-origin", action="append", default=[], metavar="URL",
                       help="let browser pages from this origin call the server (CORS), e.g. http://localhost:3000; repeatable")
    serve.add_argument("--max-queue", type=_integer(0, 100_000), default=16, help="requests that may wait for the engine; more get 429")
    serve.add_argument("--parallel", type=_integer(1, 256), default=1,
                       help="requests decoding at once (default 1): above 1, those decoding plainly (--draft none, or a request's "
                       "speculation drafter none) share each target pass, one KV slot each; a request with a drafter decodes "
                       "beside them, one at a time (docs/batching.md)")
    serve.add_argument("--max-per-client", type=_integer(1), metavar="N",
                       help="requests one client (its API key and `user` field, else its address) may have running or waiting; "
                       "more get 429 (default: half of --parallel plus --max-queue, at least --parallel)")
    serve.add_argument("--prefill-stall-ms", type=_number(0.0), default=50.0, metavar="MS",
                       help="--parallel above 1: a new prompt enters beside running requests in chunks priced at most MS "
                       "milliseconds each, one a step (default 50; 0: whole, the running requests wait for it)")
    serve.add_argument("--suffix-cache", choices=("per-client", "shared"), default="per-client",
                       help="--draft suffix / auto+suffix: copy only from the requesting client's earlier text (default), or "
                       "from every client's (shared: what a request drafts then tells whether others sent that text)")
    serve.add_argument("--queue-timeout", type=_number(0.0), default=300.0, help="seconds a request may wait before a 503 (0: no limit)")
    serve.add_argument("--header-timeout", type=_number(0.0, low_open=True), default=10.0, help="seconds to send request headers (default 10)")
    serve.add_argument("--body-timeout", type=_number(0.0, low_open=True), default=30.0, help="seconds to send a request body (default 30)")
    serve.add_argument("--idle-timeout", type=_number(0.0, low_open=True), default=5.0, help="seconds a keep-alive connection may idle (default 5)")
    serve.add_argument("--max-connections", type=_integer(1), default=512, help="open connections in all (default 512)")
    serve.add_argument("--max-connections-per-client", type=_integer(1), default=64,
                       help="open connections per client network: an IPv4 /24 and an IPv6 /64 unless --client-prefix-v4/-v6 say "
                       "otherwise, all of loopback as one (default 64)")
    serve.add_argument("--client-prefix-v4", type=_server_field("client_prefix_v4"), default=24, metavar="BITS",
                       help="an IPv4 client counts by this many leading bits for the connection cap and the wrong-key throttle (1..32, default 24)")
    serve.add_argument("--client-prefix-v6", type=_server_field("client_prefix_v6"), default=64, metavar="BITS",
                       help="an IPv6 client counts by this many leading bits for the connection cap and the wrong-key throttle (1..128, default 64)")
    serve.add_argument("--auth-failures-global", type=_server_field("auth_failures_global"), default=100, metavar="N",
                       help="wrong API keys per minute from all networks together; past it only networks that sent a right key are answered (default 100)")
    serve.add_argument("--max-body-bytes", type=_server_field("max_body_bytes"), metavar="N",
                       help="largest request body (default: the most a request to the bundle can need, from its context and tokens)")
    serve.add_argument("--shutdown-timeout", type=_number(0.0, low_open=True), default=10.0,
                       help="seconds running generations may finish after SIGTERM before they are cancelled (default 10)")
    serve.add_argument("--no-access-log", action="store_true", help="no access-log line per request on stderr")
    serve.add_argument("--model-name", help="model id clients use (default: the bundle folder's name)")
    serve.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"))
    _memory_budget_arg(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="chat in the terminal, with the bundle's chat template and history")
    _engine_args(chat)
    chat.add_argument("--system", type=_text, help="system prompt")
    _request_args(chat, "max_tokens", "temperature", "top_k", "top_p", "seed", max_tokens=512, temperature=0.7)
    chat.set_defaults(func=cmd_chat)

    plan = sub.add_parser("plan", help="memory plan of a bundle, part by part; exits 1 when it exceeds --memory-budget")
    plan.add_argument("bundle")
    plan.add_argument("--draft", default="auto", choices=DRAFTERS, help="the drafter to plan for (its roles are loaded)")
    plan.add_argument("--max-gamma", type=_integer(1, MAX_GAMMA), default=8, help="longest draft: verify blocks take max-gamma+1 tokens")
    plan.add_argument("--context", type=_integer(1), help="plan for this many tokens in use (default: the full max context)")
    plan.add_argument("--parallel", type=_integer(1, 256), default=1, help="sequences decoding at once (serve --parallel; default 1)")
    _memory_budget_arg(plan)
    plan.add_argument("--json", action="store_true", help="one JSON object: parts, total_bytes, budget_bytes, fits")
    plan.set_defaults(func=cmd_plan)

    check = sub.add_parser("check", help="does a provider have a kernel for every node of the bundle's graphs? exits 1 if not")
    check.add_argument("bundle")
    check.add_argument("--provider", required=True, choices=("cpu", "cuda", "dml", "coreml"))
    check.add_argument("--json", action="store_true",
                       help="one JSON object: nodes, ok, missing and kernel_facts (per op: stage, node, reason)")
    check.add_argument("--onnxruntime", metavar="VERSION", type=_ort_version,
                       help="the onnxruntime release the bundle will run on (e.g. NVIDIA's Jetson build), for kernels "
                       "that exist only from a later one (default: the kernel table's own release)")
    check.set_defaults(func=cmd_check)

    handoff = sub.add_parser("handoff", help="print the vLLM or SGLang serve command for the same target and draft")
    handoff.add_argument("bundle")
    handoff.add_argument("--engine", required=True, choices=("vllm", "sglang"))
    handoff.add_argument("--method", default="auto", choices=("auto", "draft", "lookup"),
                         help="draft model or n-gram lookup (auto: the draft model when the bundle has one)")
    handoff.add_argument("--alpha", type=_number(0.0, 0.999), help="per-token acceptance α measured on this device")
    handoff.add_argument("--bench-results", metavar="FILE", help="results.json of `benchmarks bench`: α is its median")
    handoff.add_argument("--port", type=_integer(1, 65535), default=8000)
    handoff.add_argument("--json", action="store_true")
    handoff.set_defaults(func=cmd_handoff)

    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:
        return bench_moved(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    from edge_spec.manifest import BundleError
    from edge_spec.placement import PlacementError
    from runtime.engine import PromptTooLongError
    from runtime.kv_cache import ContextFullError
    from runtime.sessions import ProviderError
    from runtime.tokenizer import ChatTemplateError

    try:
        return args.func(args)
    except (BundleError, PlacementError, PromptTooLongError, ContextFullError, ProviderError, ChatTemplateError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
