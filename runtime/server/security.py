"""Who may talk to the server: API keys and the wrong-key throttle, the Host/Origin guard (with the
request id and the access log every request passes through), and the connection counts the
HTTP protocol admits by."""

from __future__ import annotations

import hashlib
import hmac
import logging
import math
import os
import re
import threading
import time
import uuid
from collections import OrderedDict, deque

from runtime.server.config import ServerConfig, client_network
from runtime.server.errors import ApiError, type_error

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
    network's limit, that network gets 429 until the window slides, except for a key already
    accepted from it: a client known good is not locked out by another client's wrong keys on its
    network (another local process, on loopback). Past the global limit, so does every network
    that has not sent a right key (networks known good keep being served, so a flood of wrong
    keys cannot lock their clients out).

    A key never accepted from a throttled network gets the same 429 as a wrong one, so such a
    network cannot probe. One with a key accepted can tell that key's answer from a wrong one's,
    so its wrong keys keep counting while it is throttled, and past hard_limit of them in a window
    the accepted key is refused too: the guesses one network can check stay bounded."""

    MAX_NETWORKS = 10_000  # remembered networks, failed and known good (the oldest are forgotten first)

    def __init__(self, limit: int, window: float, global_limit: int):
        self.limit, self.window, self.global_limit = limit, window, global_limit
        self.hard_limit = max(limit, global_limit)
        self._failures: dict[str, deque] = {}
        self._all: deque = deque(maxlen=global_limit)
        self._known_good: OrderedDict[str, set[str]] = OrderedDict()  # network -> ids of the keys accepted from it
        self._lock = threading.Lock()

    def _slide(self, failures: deque, now: float) -> None:
        while failures and failures[0] <= now - self.window:
            failures.popleft()

    def check(self, network: str, key: str | None, wrong: bool) -> tuple[int, str] | None:
        """None when a request from `network` may be answered, else (seconds to wait, what is
        throttled). key: the id of the right key it presents (None: it presents none); wrong: it
        presents a wrong key, counted here."""
        with self._lock:
            now = time.monotonic()
            failures = self._failures.get(network)
            if failures is not None:
                self._slide(failures, now)
                if not failures:
                    del self._failures[network]
            accepted = self._known_good.get(network, set())
            if failures and len(failures) >= self.limit:
                if key in accepted and len(failures) < self.hard_limit:
                    return None
                if wrong and accepted:
                    failures.append(now)  # a guess this network can tell apart from the accepted key's answer
                over = self.limit if key not in accepted else self.hard_limit
                return max(1, math.ceil(failures[max(0, len(failures) - over)] + self.window - now)), network
            self._slide(self._all, now)
            if len(self._all) >= self.global_limit and network not in self._known_good:
                return max(1, math.ceil(self._all[0] + self.window - now)), "all clients"
            if wrong:
                if network not in self._failures and len(self._failures) >= self.MAX_NETWORKS:
                    del self._failures[next(iter(self._failures))]
                maxlen = self.hard_limit if accepted else self.limit
                self._failures.setdefault(network, deque(maxlen=maxlen)).append(now)
                self._all.append(now)
            return None

    def succeed(self, network: str, key: str) -> None:
        with self._lock:
            self._known_good.setdefault(network, set()).add(key)
            self._known_good.move_to_end(network)
            if len(self._known_good) > self.MAX_NETWORKS:
                self._known_good.popitem(last=False)
            failures = self._failures.get(network)
            if failures is not None and failures.maxlen < self.hard_limit:
                self._failures[network] = deque(failures, maxlen=self.hard_limit)


class KeyGate:
    """The API keys and the throttle in front of them; no keys means every request passes."""

    def __init__(self, keys, config: ServerConfig):
        self.keys = check_api_keys(keys)
        self.config = config
        self.throttle = AuthThrottle(config.auth_failures, config.auth_window, config.auth_failures_global)
        salt = os.urandom(16)  # a key's id cannot be checked against guesses outside this process
        self._ids = tuple(hashlib.blake2b(key, key=salt, digest_size=8).hexdigest() for key in self.keys)

    def authorize(self, scope) -> str | None:
        """ApiError (401, 429) unless the request may go on; else the id of the key it presented
        (a salted hash, never the key), or None when the server has no keys."""
        if not self.keys:
            return None
        network = self.config.client_network((scope.get("client") or ("-",))[0])
        # The raw header bytes: a key is compared as the UTF-8 bytes the client sent.
        header = next((v for k, v in scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        presented = bool(header) and scheme.lower() == b"bearer" and bool(token)
        found = None
        if presented:
            for key, key_id in zip(self.keys, self._ids):  # every key is compared: the time taken does not say which matched
                found = key_id if hmac.compare_digest(token, key) else found
        throttled = self.throttle.check(network, found, wrong=presented and found is None)
        if throttled is not None:
            wait, who = throttled
            raise ApiError(429, f"Too many wrong API keys from {who}; retry in {wait} s", type="rate_limit_error",
                           code="auth_throttled", headers={"Retry-After": str(wait)})
        if not presented:
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if found is None:
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        self.throttle.succeed(network, found)
        return found


def client_identity(key: str | None, user, address: str, config: ServerConfig) -> str:
    """Who a request counts as for the suffix cache and the scheduler's turns: the id of its API
    key (KeyGate.authorize), else its address (every loopback address as one, an IPv6 address by
    its /client_prefix_v6 network, which one host holds whole); and with a `user` field, that user
    of the key or address, so one key shared by an app's users still separates them. ApiError
    (400) for a `user` that is not a string."""
    if user is not None and not isinstance(user, str):
        raise type_error("user", "a string", user)
    who = f"key:{key}" if key is not None else f"address:{client_network(address, 32, config.client_prefix_v6)}"
    if user:
        # Hashed: an identity has a bounded size, whatever the client sent.
        who += "/user:" + hashlib.blake2b(user.encode("utf-8", "surrogatepass"), digest_size=12).hexdigest()
    return who


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
