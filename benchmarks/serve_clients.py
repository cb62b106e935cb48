"""python -m benchmarks serve_clients BUNDLE [--servers auto:1,none:1,none:4] [--clients 1,2,4] [--prompts SPEC] [--max-tokens 128] [--rounds 2] [--out FILE.json]

Several clients at once against `python -m runtime serve`, one server per --servers entry
(DRAFT:PARALLEL: `--draft DRAFT --parallel PARALLEL`) and each --external server (llama-server),
all started first and measured in turn,
round by round, the order of the servers alternating: each round sends C streaming greedy chat
requests at once (C from --clients; prompts taken in turn from --prompts) and records the total
completion tokens over the round's wall time, each request's time to its first token and its
tokens. Answers are compared across servers: with --parallel above 1, a plain request shares its
passes with the others (docs/batching.md).
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import threading
import time
from pathlib import Path


def _server_spec(text: str) -> list[tuple[str, int]]:
    specs = []
    for part in text.split(","):
        draft, _, parallel = part.partition(":")
        if not draft or not parallel.isdigit() or int(parallel) < 1:
            raise argparse.ArgumentTypeError(f"each server is DRAFT:PARALLEL such as auto:1 or none:4, got {part!r}")
        specs.append((draft, int(parallel)))
    return specs


def _external(text: str) -> tuple[str, int]:
    name, _, port = text.rpartition("=")
    if not name or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PORT, got {text!r}")
    return name, int(port)


def _chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streaming greedy chat completion: seconds to the first content, tokens, text."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    began = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1800)
    first, text, tokens = None, [], 0
    try:
        conn.request("POST", "/v1/chat/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            return {"status": response.status, "error": response.read().decode()[:300]}
        for line in response:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or ():
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and first is None:
                    first = time.perf_counter() - began
                text.append(piece)
    finally:
        conn.close()
    return {"status": 200, "first_token_s": first, "tokens": tokens, "text": "".join(text), "s": time.perf_counter() - began}


def _round(port: int, prompts: list[list[dict]], max_tokens: int) -> dict:
    out = [None] * len(prompts)
    threads = [threading.Thread(target=lambda i=i: out.__setitem__(i, _chat(port, prompts[i], max_tokens))) for i in range(len(prompts))]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - began
    failed = [r for r in out if r["status"] != 200]
    if failed:
        raise RuntimeError(f"a request failed: {failed[0]}")
    return {"wall_s": wall, "tokens": sum(r["tokens"] for r in out), "first_token_s": [r["first_token_s"] for r in out],
            "texts": [r["text"] for r in out]}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.bench.prompts import load_prompts
    from benchmarks.load_run import _percentile, start_server, stop_servers

    prompts = [list(p.messages) for p in load_prompts(args.prompts) if p.messages]
    if not prompts:
        raise SystemExit("error: --prompts has no chat prompts")
    servers = []
    try:
        for draft, parallel in args.servers:
            options = argparse.Namespace(provider=args.provider, max_queue=64, draft=draft, block_stable=False, header_timeout=10.0,
                                         body_timeout=30.0, key=None, threads=args.threads)
            proc, port = start_server(args.bundle, options, extra=["--parallel", str(parallel)])
            servers.append({"server": f"{draft}:{parallel}", "proc": proc, "port": port})
        for name, port in args.external:
            servers.append({"server": name, "proc": None, "port": port})
        rows = {(s["server"], c): [] for s in servers for c in args.clients}
        offset = 0
        for r in range(args.rounds):
            for clients in args.clients:
                batch = [prompts[(offset + i) % len(prompts)] for i in range(clients)]
                offset += clients
                for server in (servers if r % 2 == 0 else servers[::-1]):
                    rows[server["server"], clients].append(_round(server["port"], batch, args.max_tokens))
    finally:
        stop_servers(servers)
    table = []
    for (server, clients), runs in rows.items():
        firsts = [t for run in runs for t in run["first_token_s"] if t is not None]
        table.append({"server": server, "clients": clients, "rounds": len(runs),
                      "tokens_per_s": round(statistics.median(run["tokens"] / run["wall_s"] for run in runs), 2),
                      "tokens_per_s_by_round": [round(run["tokens"] / run["wall_s"], 2) for run in runs],
                      "first_token_p50_s": round(_percentile(firsts, 0.5), 3), "first_token_p95_s": round(_percentile(firsts, 0.95), 3)})
    names = [s["server"] for s in servers]
    same = {}
    for clients in args.clients:
        texts = {name: [t for run in rows[name, clients] for t in run["texts"]] for name in names}
        same[str(clients)] = {f"{a}={b}": f"{sum(x == y for x, y in zip(texts[a], texts[b]))}/{len(texts[a])}"
                              for i, a in enumerate(names) for b in names[i + 1 :]}
    from benchmarks.bench.run import _machine

    return {"bundle": args.bundle, "machine": _machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"},
            "rows": table, "answers_equal": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks serve_clients", description=__doc__.splitlines()[2])
    parser.add_argument("bundle")
    parser.add_argument("--servers", type=_server_spec, default=_server_spec("auto:1,none:1,none:4"))
    parser.add_argument("--clients", type=lambda t: [int(v) for v in t.split(",")], default=[1, 2, 4])
    parser.add_argument("--prompts", default="humaneval:30-34", help="as bench's --prompts (chat prompts)")
    parser.add_argument("--external", action="append", default=[], type=_external, metavar="NAME=PORT",
                        help="also measure an OpenAI-compatible server already listening on 127.0.0.1:PORT (llama-server); repeatable")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)
    if min(args.clients) < 1 or args.max_tokens < 1 or args.rounds < 1:
        parser.error("--clients, --max-tokens and --rounds must be >= 1")
    report = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, separators=(",", ":")))
    print(json.dumps(report["rows"], indent=1))
    print(json.dumps(report["answers_equal"]))
    return 0
