"""python -m benchmarks heap_probe BUNDLE [--waves 30] [--clients 12] [--oversized 4] [--arenas N] [--out FILE.json]

Where a server's memory goes wave after wave: the server runs in this process (uvicorn on a
thread, as `serve` runs it) with tracemalloc on, and each wave sends streaming greedy clients
(every sixth leaves after its first event) and ~1 MiB bodies of each kind in turn
(load_run's). After each wave: the Python heap tracemalloc sees, after a gc, and the process's
RSS. A flat Python heap under a growing RSS puts the growth in native memory (the C heap, ONNX
Runtime, the Rust tokenizer); --arenas N bounds glibc's malloc arenas first, as `serve` does.
"""

from __future__ import annotations

import argparse
import gc
import json
import threading
import time
import tracemalloc
from pathlib import Path

from benchmarks.load_run import OVERSIZED_KINDS, _oversized_body, _post, _post_raw


def run(args: argparse.Namespace) -> dict:
    import psutil

    from runtime import heap
    from runtime.api import Model
    from runtime.engine import EngineConfig
    from runtime.server import Server
    from runtime.server.run import bind, make_uvicorn

    arenas = heap.bound_arenas(args.arenas) if args.arenas else None
    model = Model.load(args.bundle, engine_config=EngineConfig(drafter=args.draft, block_stable=True), max_queue=64)
    server = Server(model, api_key=None)
    sock = bind("127.0.0.1", 0)
    uv = make_uvicorn(server)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.02)
    port = sock.getsockname()[1]
    bodies = [json.dumps(_oversized_body(kind)) for kind in OVERSIZED_KINDS]
    tracemalloc.start()
    waves = []
    try:
        for wave in range(args.waves):
            clients = [threading.Thread(target=_post, args=(port, {"prompt": f"Write a short note, number {i}, for wave {wave}",
                                                                   "max_tokens": args.max_tokens, "temperature": 0, "stream": True}),
                                        kwargs={"leave_after_first": i % 6 == 5}) for i in range(args.clients)]
            clients += [threading.Thread(target=_post_raw, args=(port, bodies[i % len(bodies)], None)) for i in range(args.oversized)]
            for client in clients:
                client.start()
            for client in clients:
                client.join()
            while model.busy:
                time.sleep(0.05)
            time.sleep(0.5)
            gc.collect()
            waves.append({"wave": wave + 1, "python_heap_mib": round(tracemalloc.get_traced_memory()[0] / 2**20, 3),
                          "rss_mib": round(psutil.Process().memory_info().rss / 2**20, 1)})
            print(json.dumps(waves[-1]), flush=True)
    finally:
        tracemalloc.stop()
        uv.should_exit = True
        thread.join(timeout=30)
        sock.close()
        model.close()
    half = waves[len(waves) // 2:]
    per_wave = lambda key: round((half[-1][key] - half[0][key]) / max(1, len(half) - 1), 3)  # noqa: E731
    return {"bundle": args.bundle, "settings": {k: v for k, v in vars(args).items() if k != "out"}, "arenas_bounded": arenas,
            "waves": waves, "second_half_growth_per_wave": {"python_heap_mib": per_wave("python_heap_mib"), "rss_mib": per_wave("rss_mib")}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks heap_probe", description=__doc__.splitlines()[2])
    parser.add_argument("bundle")
    parser.add_argument("--waves", type=int, default=30)
    parser.add_argument("--clients", type=int, default=12, help="streaming clients per wave")
    parser.add_argument("--oversized", type=int, default=4, help="~1 MiB bodies per wave")
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--arenas", type=int, default=0, help="bound glibc's malloc arenas to N first (0: leave them)")
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)
    for name in ("waves", "clients", "max_tokens"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.oversized < 0 or args.arenas < 0:
        parser.error("--oversized and --arenas must be >= 0")
    report = run(args)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    print(json.dumps(report["second_half_growth_per_wave"]))
    return 0
