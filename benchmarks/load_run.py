"""python -m benchmarks load_run BUNDLE [--waves 3] [--clients 32] [--slow 10] [--oversized 4] [--body-bytes N] [--max-body-bytes N] [--disconnect 0] [--wrong-keys-from 0] [--out FILE.json]

Starts `python -m runtime serve BUNDLE` on 127.0.0.1 and sends it, per wave and all at once: N
streaming greedy clients, slow clients (headers at one byte per second, or a body that stalls),
large bodies (~1 MiB, --body-bytes) of each kind in turn (text, token ids, a stop list, logit_bias), and streaming
clients that disconnect after their first event, while /health is polled every 50 ms. Before the
waves each prompt is sent alone; every streamed answer must equal its solo answer. With
--wrong-keys-from N the server requires a key (every other client sends it) and, after the
waves, N addresses (127.0.0.2 ...) send wrong keys in turn until each has had a 429 (loopback
addresses are one client network, so this phase comes last: it throttles the right key too).
Reports as JSON: status counts and 5xx per wave, /health latency percentiles, answers identical
to solo, each oversized body's kind and status, disconnects the server cancelled, server RSS after
each wave (and its spread), what happened to the slow clients, and which addresses got a 429.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import queue
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("def return import class value list dict for while if else print the a cat dog sat on mat and ran fast slow red "
         "blue green tree house river stone quick brown fox jumps over lazy bird sings").split()


def _prompts(n: int) -> list[str]:
    return [" ".join(WORDS[(i * 7 + j * 3) % len(WORDS)] for j in range(6 + i % 5)) for i in range(n)]


def start_server(bundle: str, args: argparse.Namespace, extra: list[str] = ()) -> tuple[subprocess.Popen, int]:
    cmd = [sys.executable, "-m", "runtime", "serve", bundle, "--provider", args.provider, "--port", "0",
           "--max-queue", str(args.max_queue), "--queue-timeout", "600", "--draft", args.draft, "--no-access-log",
           *(["--block-stable"] if args.block_stable else []), "--header-timeout", str(args.header_timeout), "--body-timeout", str(args.body_timeout),
           *(["--api-key", args.key] if args.key else [])]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    cmd += list(extra)
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + 600
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            raise RuntimeError(f"server did not start: {proc.stderr.read()[-2000:]}") from None
        if "serving" in line:
            return proc, int(line.split("http://127.0.0.1:")[1].split("/")[0])


def stop_servers(servers: list[dict]) -> None:
    """Ends the servers this process started (`proc` None: an external one, left running)."""
    for server in servers:
        if server["proc"] is not None:
            server["proc"].terminate()
            server["proc"].wait(30)


def _headers(key: str | None) -> dict:
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _post(port: int, body: dict, timeout: float = 600, key: str | None = None, leave_after_first: bool = False) -> tuple[int, str]:
    """(status, streamed text) of one streaming completion; leave_after_first: close the
    connection once the first event arrives (a client that goes away mid-stream)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(), headers=_headers(key))
        response = conn.getresponse()
        if leave_after_first and response.status == 200:
            response.readline()
            return 200, "left"
        if response.status != 200 or not body.get("stream"):
            payload = response.read().decode()
            if response.status == 200:
                return 200, json.loads(payload)["choices"][0]["text"]
            return response.status, payload[:200]
        text = []
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                event = json.loads(line[6:])
                if event.get("choices"):
                    text.append(event["choices"][0].get("text") or "")
        return 200, "".join(text)
    except OSError as exc:
        return -1, f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()


def _post_raw(port: int, raw: str, key: str | None) -> int:
    """The status of one non-streamed completion whose body is `raw` (already JSON)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/completions", body=raw.encode(), headers=_headers(key))
        response = conn.getresponse()
        response.read()
        return response.status
    except OSError:
        return -1
    finally:
        conn.close()


def _slow_client(port: int, kind: str, limit_s: float, key: str | None = None) -> dict:
    """Dribbles headers (1 byte/s) or stalls a body; returns how long the server kept the socket."""
    began = time.monotonic()
    auth = f"Authorization: Bearer {key}\r\n".encode() if key else b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
            if kind == "headers":
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
            else:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + auth
                             + b"Content-Length: 1000\r\n\r\n{\"prompt\": ")
            sock.settimeout(1.0)
            while time.monotonic() - began < limit_s:
                try:
                    if kind == "headers":
                        sock.sendall(b"X")
                    if sock.recv(4096) == b"":
                        break
                except socket.timeout:
                    continue
                except OSError:
                    break
            else:
                return {"kind": kind, "closed_by_server": False, "held_s": round(time.monotonic() - began, 2)}
    except OSError:
        pass
    return {"kind": kind, "closed_by_server": True, "held_s": round(time.monotonic() - began, 2)}


def _health_poller(port: int, stop: threading.Event, out: list) -> None:
    while not stop.is_set():
        began = time.perf_counter()
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
            conn.request("GET", "/health")
            status = conn.getresponse().status
            conn.close()
        except OSError:
            status = -1
        out.append((status, (time.perf_counter() - began) * 1e3))
        stop.wait(0.05)


# ~1 MiB bodies, one kind each: what the bundle-derived limits refuse (413 before parsing, or 400 by a
# field's length before any walk); none may be a 5xx or hold up /health.
OVERSIZED_KINDS = ("text", "token_ids", "stop_list", "logit_bias")


def _oversized_body(kind: str, size: int = 2**20) -> dict:
    """A body of about `size` bytes of JSON (1 MiB by default) of one kind."""
    if kind == "text":
        return {"prompt": "word " * (size // 5), "max_tokens": 1}
    if kind == "token_ids":
        return {"prompt": [1] * (size // 3), "max_tokens": 1}
    if kind == "stop_list":
        return {"prompt": "hi", "max_tokens": 1, "stop": ["x"] * (size // 5)}
    return {"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1 for i in range(size // 13)}}


def _metric(port: int, name: str, key: str | None) -> float | None:
    """A counter's value from /metrics (None if the route or the metric is missing)."""
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics", headers=_headers(key))
        text = conn.getresponse().read().decode()
        conn.close()
    except OSError:
        return None
    values = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ") or line.startswith(name + "{")]
    return sum(values) if values else None


def _wrong_keys(port: int, addresses: int, per_address: int) -> dict:
    """Wrong keys from 127.0.0.2 ... in turn until every address has had a 429 (at most
    per_address tries each): which got one, after how many tries in all, and any 5xx."""
    sources = [f"127.0.0.{2 + i}" for i in range(addresses)]
    first_429: dict[str, int] = {}
    statuses: dict[str, int] = {}
    tries = 0
    for _ in range(per_address):
        for source in sources:
            if source in first_429:
                continue
            tries += 1
            try:
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
                conn.request("GET", "/v1/models", headers={"Authorization": f"Bearer wrong-{tries}"})
                status = conn.getresponse().status
                conn.close()
            except OSError:
                status = -1
            statuses[str(status)] = statuses.get(str(status), 0) + 1
            if status == 429:
                first_429[source] = tries
        if len(first_429) == len(sources):
            break
    return {"addresses": len(sources), "tries": tries, "status": statuses, "addresses_throttled": len(first_429),
            "first_429_after_tries": min(first_429.values()) if first_429 else None,
            "server_errors_5xx": sum(n for s, n in statuses.items() if s.startswith("5"))}


def _rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / 2**20


def _percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def run(args: argparse.Namespace) -> dict:
    args.key = secrets.token_urlsafe(18) if args.wrong_keys_from else None
    key = args.key
    proc, port = start_server(args.bundle, args, extra=["--max-body-bytes", str(args.max_body_bytes)] if args.max_body_bytes else [])
    try:
        prompts = _prompts(args.clients)
        request = {"max_tokens": args.max_tokens, "temperature": 0}
        solo = {}
        for p in prompts:
            status, text = _post(port, {**request, "prompt": p}, key=key)
            if status != 200:
                raise RuntimeError(f"solo request failed: {status} {text}")
            solo[p] = text
        oversized_bodies = [(kind, json.dumps(_oversized_body(kind, args.body_bytes))) for kind in OVERSIZED_KINDS]
        waves = []
        for wave in range(args.waves):
            results: dict[str, list] = {"stream": [], "slow": [], "oversized": [], "disconnect": []}
            cancelled_before = _metric(port, "edge_spec_client_disconnects_total", key)
            health: list = []
            stop = threading.Event()
            poller = threading.Thread(target=_health_poller, args=(port, stop, health), daemon=True)
            poller.start()
            workers = []
            for p in prompts:
                workers.append(threading.Thread(target=lambda p=p: results["stream"].append((p, *_post(port, {**request, "prompt": p, "stream": True}, key=key)))))
            for i in range(args.slow):
                kind = "headers" if i % 2 == 0 else "body"
                workers.append(threading.Thread(target=lambda kind=kind: results["slow"].append(_slow_client(port, kind, args.slow_limit, key))))
            for i in range(args.oversized):
                kind, raw = oversized_bodies[i % len(oversized_bodies)]
                workers.append(threading.Thread(target=lambda kind=kind, raw=raw: results["oversized"].append((kind, _post_raw(port, raw, key)))))
            for i in range(args.disconnect):
                body = {**request, "prompt": prompts[i % len(prompts)], "stream": True}
                workers.append(threading.Thread(target=lambda body=body: results["disconnect"].append(_post(port, body, key=key, leave_after_first=True)[0])))
            began = time.monotonic()
            for w in workers:
                w.start()
            for w in workers:
                w.join(timeout=1800)
            elapsed = time.monotonic() - began
            stop.set()
            poller.join(timeout=15)
            statuses: dict[str, int] = {}
            for _, status, _ in results["stream"]:
                statuses[str(status)] = statuses.get(str(status), 0) + 1
            oversized = [s for _, s in results["oversized"]]
            time.sleep(0.5)  # the server notices the last disconnects at its next target pass
            cancelled_after = _metric(port, "edge_spec_client_disconnects_total", key)
            latencies = [ms for status, ms in health if status == 200]
            waves.append({
                "wave": wave + 1,
                "seconds": round(elapsed, 2),
                "stream_status": statuses,
                "server_errors_5xx": sum(1 for _, s, _ in results["stream"] if s >= 500) + sum(1 for s in oversized if s >= 500)
                + sum(1 for s, _ in health if s >= 500) + sum(1 for s in results["disconnect"] if s >= 500),
                "identical_to_solo": sum(1 for p, s, t in results["stream"] if s == 200 and t == solo[p]),
                "served": sum(1 for _, s, _ in results["stream"] if s == 200),
                "oversized_status": oversized,
                "oversized": [{"kind": k, "status": s} for k, s in results["oversized"]],
                "disconnected": len(results["disconnect"]),
                "disconnects_cancelled": None if cancelled_after is None or cancelled_before is None else cancelled_after - cancelled_before,
                "slow_clients": results["slow"],
                "health": {"polls": len(health), "failed": sum(1 for s, _ in health if s != 200),
                           "p50_ms": _percentile(latencies, 0.5), "p99_ms": _percentile(latencies, 0.99),
                           "max_ms": max(latencies) if latencies else None},
                "server_rss_mb": round(_rss_mb(proc.pid), 1),
            })
            print(json.dumps(waves[-1]), file=sys.stderr, flush=True)
        wrong_keys = _wrong_keys(port, args.wrong_keys_from, args.wrong_key_tries) if args.wrong_keys_from else None
        rss = [w["server_rss_mb"] for w in waves]
        summary = {
            "server_errors_5xx": sum(w["server_errors_5xx"] for w in waves),
            "all_identical_to_solo": all(w["identical_to_solo"] == w["served"] == args.clients for w in waves),
            "health_p99_ms_max": max((w["health"]["p99_ms"] or 0) for w in waves),
            "rss_spread_pct": round(100 * (max(rss) - min(rss)) / statistics.median(rss), 2) if rss else None,
            "slow_clients_all_closed": all(c["closed_by_server"] for w in waves for c in w["slow_clients"]),
            "oversized_all_4xx": all(400 <= s < 500 for w in waves for s in w["oversized_status"]),
            "every_wrong_key_address_throttled": None if wrong_keys is None else wrong_keys["addresses_throttled"] == wrong_keys["addresses"],
        }
        if wrong_keys is not None:
            summary["server_errors_5xx"] += wrong_keys["server_errors_5xx"]
        return {"bundle": args.bundle, "settings": {k: v for k, v in vars(args).items() if k not in ("out", "key")}, "waves": waves,
                "wrong_keys": wrong_keys, "summary": summary}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks load_run", description=__doc__.splitlines()[0])
    parser.add_argument("bundle")
    parser.add_argument("--waves", type=int, default=3)
    parser.add_argument("--clients", type=int, default=32, help="concurrent streaming clients per wave")
    parser.add_argument("--slow", type=int, default=10, help="slow clients per wave (half dribble headers, half stall a body)")
    parser.add_argument("--oversized", type=int, default=4, help="large bodies per wave, the kinds in turn: text, token ids, stop list, logit_bias")
    parser.add_argument("--body-bytes", type=int, default=2**20, help="the large bodies' size, about (default 1 MiB)")
    parser.add_argument("--max-body-bytes", type=int, help="serve --max-body-bytes (to send bodies the server reads whole, up to its 8 MiB cap)")
    parser.add_argument("--disconnect", type=int, default=0, help="streaming clients per wave that leave after their first event")
    parser.add_argument("--wrong-keys-from", type=int, default=0, metavar="N",
                        help="serve with a key; after the waves, wrong keys from N loopback addresses until each gets a 429 (at most 254)")
    parser.add_argument("--wrong-key-tries", type=int, default=30, help="wrong keys per address at most (default 30)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-queue", type=int, default=64, help="serve --max-queue (all clients are admitted)")
    parser.add_argument("--header-timeout", type=float, default=10.0)
    parser.add_argument("--body-timeout", type=float, default=30.0)
    parser.add_argument("--slow-limit", type=float, default=60.0, help="a slow client gives up after this many seconds")
    parser.add_argument("--provider", default="cpu")
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--draft", default="auto")
    parser.add_argument("--block-stable", action="store_true",
                        help="serve --block-stable: greedy answers then cannot depend on how requests interleave (docs/decoding.md, Exactness)")
    parser.add_argument("--out", help="write the report here (JSON)")
    args = parser.parse_args(argv)
    for name in ("waves", "clients", "max_tokens", "wrong_key_tries"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    for name in ("slow", "oversized", "disconnect"):
        if getattr(args, name) < 0:
            parser.error(f"--{name} must be >= 0")
    if not 0 <= args.wrong_keys_from <= 254:
        parser.error("--wrong-keys-from must be 0..254 (loopback addresses 127.0.0.2 ...)")
    report = run(args)
    text = json.dumps(report, indent=2)
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    s = report["summary"]
    ok = s["server_errors_5xx"] == 0 and s["all_identical_to_solo"] and s["slow_clients_all_closed"] and s["oversized_all_4xx"]
    return 0 if ok and s["every_wrong_key_address_throttled"] in (None, True) else 1
