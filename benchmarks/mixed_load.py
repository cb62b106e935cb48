"""python -m benchmarks mixed_load BUNDLE [--stalls 0,50] [--parallel 4] [--stream-tokens 150] [--prompt-words 200]
    [--others 3] [--rounds 3] [--external NAME=PORT]... [--out FILE.json]

One client streaming while others send long prompts, against `python -m runtime serve BUNDLE
--parallel N --draft none --prefill-stall-ms MS`, one server per --stalls value (0: a prompt goes in
whole, the running streams wait), and each --external OpenAI-compatible server (llama-server -np N
on the same GGUF). Each round, per server: the streaming client alone (a greedy completion of
--stream-tokens tokens), then the same with --others clients sending prompts of about
--prompt-words words each (a fresh start every time, so no prompt cache helps), each again as soon
as its answer (8 tokens) ends, until the stream ends. Recorded: the stream's gaps between
tokens (p50, p99, max) and its wall time, alone and beside the others.
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import threading
import time
from pathlib import Path

STREAM_PROMPT = "Here is a long story about a lighthouse keeper and the sea. Once upon a time"
WORDS = ("river", "stone", "lantern", "orchard", "signal", "harbor", "copper", "meadow", "engine", "winter", "ledger", "canyon",
         "violet", "anchor", "thistle", "beacon", "marble", "falcon", "garden", "spindle")


def _stream(port: int, prompt: str, max_tokens: int, extra: dict) -> list[float]:
    """Arrival times of a streaming greedy completion's content events."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True, **extra}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    times = []
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"status {response.status}: {response.read()[:300]!r}")
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                event = json.loads(line[6:])
                if any(c.get("text") for c in event.get("choices") or ()):
                    times.append(time.perf_counter())
    finally:
        conn.close()
    return times


def _long_prompt(rng: random.Random, words: int) -> str:
    return f"Note {rng.randrange(10**9)}: " + " ".join(rng.choice(WORDS) for _ in range(words)) + ". Summary:"


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def _measure(port: int, extra: dict, args: argparse.Namespace, others: int, seed: int) -> dict:
    done = threading.Event()
    sent = [0]

    def other(index: int) -> None:
        rng = random.Random(seed * 100 + index)
        while not done.is_set():
            _stream(port, _long_prompt(rng, args.prompt_words), 8, extra)
            sent[0] += 1

    threads = [threading.Thread(target=other, args=(i,), daemon=True) for i in range(others)]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    times = _stream(port, STREAM_PROMPT, args.stream_tokens, extra)
    done.set()
    for thread in threads:
        thread.join(600)
    gaps = [b - a for a, b in zip(times, times[1:])] or [float("nan")]  # a stream of one token has no gap
    return {"tokens": len(times), "wall_s": round(times[-1] - began, 3), "first_s": round(times[0] - began, 3),
            "gap_p50_ms": round(_percentile(gaps, 0.5) * 1000, 1), "gap_p99_ms": round(_percentile(gaps, 0.99) * 1000, 1),
            "gap_max_ms": round(max(gaps) * 1000, 1), "other_requests": sent[0]}


def run(args: argparse.Namespace) -> dict:
    from benchmarks.load_run import start_server, stop_servers

    servers = []
    try:
        for stall in args.stalls:
            options = argparse.Namespace(provider="cpu", max_queue=64, draft="none", block_stable=False, header_timeout=10.0,
                                         body_timeout=30.0, key=None, threads=args.threads)
            proc, port = start_server(args.bundle, options, extra=["--parallel", str(args.parallel), "--prefill-stall-ms", str(stall)])
            servers.append({"server": f"edge-spec stall {stall:g} ms", "proc": proc, "port": port, "extra": {}})
        for name, port in args.external:
            # llama-server's ignore_eos keeps its stream as long as asked; edge-spec's server refuses unknown fields.
            servers.append({"server": name, "proc": None, "port": port, "extra": {"ignore_eos": True}})
        rows = {(s["server"], mode): [] for s in servers for mode in ("alone", "beside")}
        for r in range(args.rounds):
            for server in (servers if r % 2 == 0 else servers[::-1]):
                rows[server["server"], "alone"].append(_measure(server["port"], server["extra"], args, 0, r))
                rows[server["server"], "beside"].append(_measure(server["port"], server["extra"], args, args.others, r))
    finally:
        stop_servers(servers)
    table = []
    for (server, mode), runs in rows.items():
        median = lambda key: sorted(run[key] for run in runs)[len(runs) // 2]  # noqa: E731
        table.append({"server": server, "mode": mode, "rounds": len(runs), **{k: median(k) for k in runs[0] if k != "tokens"},
                      "gap_p99_ms_by_round": [run["gap_p99_ms"] for run in runs], "wall_s_by_round": [run["wall_s"] for run in runs],
                      "tokens": [run["tokens"] for run in runs]})
    from benchmarks.bench.run import _machine

    return {"bundle": args.bundle, "machine": _machine(), "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": table}


def _external(text: str) -> tuple[str, int]:
    name, _, port = text.rpartition("=")
    if not name or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=PORT, got {text!r}")
    return name, int(port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks mixed_load", description=__doc__.splitlines()[3])
    parser.add_argument("bundle")
    parser.add_argument("--stalls", type=lambda t: [float(v) for v in t.split(",")], default=[0.0, 50.0],
                        help="--prefill-stall-ms of each edge-spec server (0: prompts go in whole)")
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--stream-tokens", type=int, default=150)
    parser.add_argument("--prompt-words", type=int, default=200)
    parser.add_argument("--others", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--external", action="append", default=[], type=_external, metavar="NAME=PORT",
                        help="also an OpenAI-compatible server on 127.0.0.1:PORT (llama-server -np N); repeatable")
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)
    if min(args.parallel, args.stream_tokens, args.prompt_words, args.rounds) < 1 or args.others < 0 or min(args.stalls) < 0:
        parser.error("--parallel, --stream-tokens, --prompt-words and --rounds must be >= 1, --others and --stalls >= 0")
    report = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["rows"], indent=1))
    return 0
