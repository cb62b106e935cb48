"""Who may talk to the server: API keys and the wrong-key throttle, the Host/Origin guard (with the
request id and the access log every request passes through), and the connection counts the
HTTP protocol admits by."""

from __future__ import annotations

import hmac
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict, deque

from runtime.server.config import ServerConfig
from runtime.server.errors import ApiError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's X-Request-Id is echoed only if it looks like one
access_log = logging.getLogger("edge_spec.access")


def check_api_keys(keys) -> tuple[bytes, ...]:
    """Keys as UTF-8 bytes; a blank key, or one with spaces or control characters (it could not be
    sent as a Bearer token), is refused: with it nothing could authenticate."""
    out = []
    for key in keys:
        if not isinstance(key, str) or not key.strip():
            raise ValueError("an API key is empty or blank: every key needs at least one visible character")
        if any(c.isspace() or not c.isprintable() for c in key):
            raise ValueError("an API key contains spaces or control characters; a Bearer token cannot carry them")
        out.append(key.encode("utf-8"))
    return tuple(out)


def read_api_key_file(path: str) -> list[str]:
    """One key per line; blank lines and lines starting with # are skipped."""
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read --api-key-file {path}: {getattr(exc, 'strerror', None) or exc}") from None
    keys = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith("#")]
    if not keys:
        raise ValueError(f"--api-key-file {path} holds no key (one per line)")
    return keys


class AuthThrottle:
    """Wrong keys in a sliding window, per client network and from all networks together. Past a
    network's limit, that network gets 429 until the window slides; past the global limit, so does
    every network that has not sent a right key (networks known good keep being served, so a
    flood of wrong keys cannot lock their clients out)."""

    MAX_NETWORKS = 10_000  # remembered networks, failed and known good (the oldest are forgotten first)

    def __init__(self, limit: int, window: float, global_limit: int):
        self.limit, self.window, self.global_limit = limit, window, global_limit
        self._failures: dict[str, deque] = {}
        self._all: deque = deque(maxlen=global_limit)
        self._known_good: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def _slide(self, failures: deque, now: float) -> None:
        while failures and failures[0] <= now - self.window:
            failures.popleft()

    def retry_after(self, network: str) -> tuple[int, str] | None:
        """None when `network` may try a key, else (seconds to wait, what is throttled)."""
        with self._lock:
            now = time.monotonic()
            failures = self._failures.get(network)
            if failures is not None:
                self._slide(failures, now)
                if not failures:
                    del self._failures[network]
                elif len(failures) >= self.limit:
                    return max(1, math.ceil(failures[0] + self.window - now)), network
            self._slide(self._all, now)
            if len(self._all) >= self.global_limit and network not in self._known_good:
                return max(1, math.ceil(self._all[0] + self.window - now)), "all clients"
            return None

    def fail(self, network: str) -> None:
        with self._lock:
            if network not in self._failures and len(self._failures) >= self.MAX_NETWORKS:
                del self._failures[next(iter(self._failures))]
            self._failures.setdefault(network, deque(maxlen=self.limit)).append(time.monotonic())
            self._all.append(time.monotonic())

    def succeed(self, network: str) -> None:
        with self._lock:
            self._known_good[network] = None
            self._known_good.move_to_end(network)
            if len(self._known_good) > self.MAX_NETWORKS:
                self._known_good.popitem(last=False)


class KeyGate:
    """The API keys and the throttle in front of them; no keys means every request passes."""

    def __init__(self, keys, config: ServerConfig):
        self.keys = check_api_keys(keys)
        self.config = config
        self.throttle = AuthThrottle(config.auth_failures, config.auth_window, config.auth_failures_global)

    def authorize(self, scope) -> None:
        if not self.keys:
            return
        network = self.config.client_network((scope.get("client") or ("-",))[0])
        throttled = self.throttle.retry_after(network)
        if throttled is not None:
            wait, who = throttled
            raise ApiError(429, f"Too many wrong API keys from {who}; retry in {wait} s", type="rate_limit_error",
                           code="auth_throttled", headers={"Retry-After": str(wait)})
        # The raw header bytes: a key is compared as the UTF-8 bytes the client sent.
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        if not header or scheme.lower() != b"bearer" or not token:
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        matched = False
        for key in self.keys:  # every key is compared: the time taken does not say which matched
            matched |= hmac.compare_digest(token, key)
        if not matched:
            self.throttle.fail(network)
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        self.throttle.succeed(network)


class Guard:
    """ASGI middleware for every HTTP request: a request id (echoed in X-Request-Id), the Host and
    Origin policy, and one access-log line."""

    def __init__(self, inner, config: ServerConfig):
        self.inner, self.config = inner, config

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.inner(scope, receive, send)
        began = time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", ())}
        given = headers.get("x-request-id", "")
        rid = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope["edge_spec.request_id"] = rid
        status = [0]

        async def tagged(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            origin = headers.get("origin")
            if not self.config.host_allowed(headers.get("host")):
                error = ApiError(403, f"Host {headers.get('host', '')[:100]!r} is not allowed: this server answers loopback "
                                      "names and its own address (serve --allowed-host NAME allows others)", code="host_not_allowed")
                await error.response()(scope, receive, tagged)
            elif origin is not None and not self.config.origin_allowed(origin):
                error = ApiError(403, f"Origin {origin[:100]!r} is not allowed: browsers may call this server only from "
                                      "an allowed origin (serve --allowed-origin URL)", code="origin_not_allowed")
                await error.response()(scope, receive, tagged)
            else:
                await self.inner(scope, receive, tagged)
        finally:
            if self.config.access_log and access_log.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s HTTP/%s" %s %.1fms id=%s%s', client[0], client[1], scope["method"], scope["path"],
                                scope.get("http_version", "1.1"), status[0] or 499, (time.perf_counter() - began) * 1e3, rid,
                                f" {scope['edge_spec.speculation']}" if "edge_spec.speculation" in scope else "")


class Connections:
    """Open connections per client network and in all, for the guarded protocol."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.total, self.per_client = config.max_connections, config.max_connections_per_client
        self.count = 0
        self.by_network: dict[str, int] = {}

    def admit(self, network: str) -> tuple[int, str] | None:
        """None when admitted (then leave() must follow), else (status, reason)."""
        if self.count >= self.total:
            return 503, f"the server holds its limit of {self.total} connections"
        if self.by_network.get(network, 0) >= self.per_client:
            return 429, f"this client's network ({network}) holds its limit of {self.per_client} connections"
        self.count += 1
        self.by_network[network] = self.by_network.get(network, 0) + 1
        return None

    def leave(self, network: str) -> None:
        self.count -= 1
        left = self.by_network.get(network, 1) - 1
        if left:
            self.by_network[network] = left
        else:
            self.by_network.pop(network, None)
