"""Running the server: the bind check, the listening socket, uvicorn, and `serve`."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket
import sys
import threading

from runtime import heap, render_worker
from runtime.api import Model
from runtime.server.app import Server
from runtime.server.config import ServerConfig, is_loopback
from runtime.server.protocol import guarded_protocol
from runtime.server.security import access_log


def check_bind(host: str, api_key, insecure: bool) -> None:
    if not is_loopback(host) and not api_key and not insecure:
        raise ValueError(
            f"--host {host} is reachable from other machines: pass --api-key KEY or --api-key-file FILE (or set "
            "EDGE_SPEC_API_KEY), or --insecure to serve it without a key"
        )


def bind(host: str, port: int) -> socket.socket:
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"--port must be 0..65535, got {port!r}")
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; pick another --port") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


UVICORN_GRACE_SECONDS = 10.0  # after our own deadline has ended every generation, for the connections to close
EXIT_MARGIN_SECONDS = 5.0  # after uvicorn's, for the last teardown


def grace_period(config: ServerConfig) -> float:
    """Seconds from SIGTERM/SIGINT to the end of a `serve` process, at the latest."""
    return config.shutdown_timeout + UVICORN_GRACE_SECONDS + EXIT_MARGIN_SECONDS


def _exit_after(seconds: float) -> None:
    """Ends the process `seconds` from now if it has not ended by then: a thread stuck anywhere
    (a non-daemon thread is joined at exit) must not keep a stopped server alive."""

    def end() -> None:
        stuck = sorted(t.name for t in threading.enumerate() if not t.daemon and t is not threading.main_thread())
        print(f"edge-spec server: still running {seconds:g} s after the signal (threads: {', '.join(stuck) or 'main'}); "
              "exiting", file=sys.stderr, flush=True)
        render_worker.stop_all()
        os._exit(0)

    timer = threading.Timer(seconds, end)
    timer.daemon = True
    timer.start()


def make_uvicorn(server: Server, log_level: str = "warning", hard_exit: bool = False):
    """hard_exit: the first signal also bounds the whole process's life to grace_period (for `serve`,
    which owns its process; not for a server run inside another program)."""
    import uvicorn

    config = uvicorn.Config(
        server.app, http=guarded_protocol(server.config), interface="asgi3", lifespan="off", log_level=log_level,
        access_log=False, proxy_headers=False,  # X-Forwarded-For from loopback must not pick the throttled address
        timeout_keep_alive=server.config.idle_timeout,
        # uvicorn cancels what is left only after our own deadline has ended every generation.
        timeout_graceful_shutdown=server.config.shutdown_timeout + UVICORN_GRACE_SECONDS,
    )

    class _Uvicorn(uvicorn.Server):
        armed = False

        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a handled SIGTERM/SIGINT ends the process with status 0
            if hard_exit and not self.armed:
                self.armed = True
                _exit_after(grace_period(server.config))

        async def shutdown(self, sockets=None) -> None:
            server.begin_shutdown(asyncio.get_running_loop())
            await super().shutdown(sockets)

    return _Uvicorn(config)


def serve(model: Model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, insecure: bool = False,
          model_id: str | None = None, log_level: str = "warning", announce=print, config: ServerConfig | None = None,
          api_keys=()) -> None:
    """Serve until SIGINT/SIGTERM; running generations get config.shutdown_timeout to finish, and
    the process ends within grace_period(config) of the signal whatever is still running."""
    config = dataclasses.replace(config or ServerConfig(), host=host)
    check_bind(host, api_key or list(api_keys), insecure)
    heap.bound_arenas()  # the event loop, parsing and worker threads share two malloc arenas
    server = Server(model, model_id=model_id, api_key=api_key, api_keys=api_keys, config=config)
    if config.access_log and not access_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s edge-spec access: %(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
    sock = bind(host, port)
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    keyed = bool(server.gate.keys)
    announce(f"edge-spec: serving {server.model_id!r} on http://{shown}:{sock.getsockname()[1]}/v1 "
             f"(queue {model.max_queue}, {'API key required' if keyed else 'no API key'}); Ctrl-C stops")
    try:
        make_uvicorn(server, log_level, hard_exit=True).run(sockets=[sock])
    finally:
        model.close()
        sock.close()
