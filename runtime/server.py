"""An OpenAI-compatible HTTP server over one bundle: `python -m runtime serve BUNDLE`.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (stream: true sends
server-sent events as OpenAI clients expect), GET /health, GET /metrics (Prometheus text).
Responses carry `usage` and, as an extra field, `speculative` (the engine's stats for that
generation). Errors are OpenAI-style objects: {"error": {"message", "type", "param", "code"}}.

One generation runs at a time; up to --max-queue more wait in arrival order and the rest get
429 at once (503 when a request waited past --queue-timeout). A client that disconnects, while
waiting or mid-stream, cancels its generation and frees the engine.

Built on starlette + uvicorn (h11); imports no torch/transformers.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import math
import re
import socket
import sys
import threading
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from edge_spec.sampling import SettingError, shown
from runtime.api import Job, Model, ModelClosedError, Options, QueueFullError, QueueTimeoutError
from runtime.engine import Prompt, PromptTooLongError
from runtime.requests import check_messages, check_text
from runtime.tokenizer import ChatTemplateError

MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON is far more than any prompt a bundle's context holds
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
SHUTDOWN_FINISH_REASON = "abort"  # vLLM's name for a request the server ended: the text is cut short
MAX_JSON_DEPTH = 32  # deeper request bodies are refused (a bounded walk, after a parse the recursion limit bounds)
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")  # a client's X-Request-Id is echoed only if it looks like one
access_log = logging.getLogger("edge_spec.access")

# Accepted for compatibility, but only with the value that means "off" (or null).
_COMMON_INERT = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
}
# speculation (an extension): {"drafter": ..., "max_gamma": N} for this request; absent: the server's.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user",
           "speculation"}
# parse_special (an extension, as in llama.cpp's server): special-token strings in a raw prompt are
# control tokens only when the caller asks; by default they are text.
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "logprobs", "parse_special"} | set(_COMMON_INERT)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls"} | (set(_COMMON_INERT) - {"best_of"})


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _host_name(header: str) -> str | None:
    """The name in a Host header, without the port; None when it is not a host[:port]."""
    try:
        parts = urlsplit("//" + header)
        return parts.hostname if parts.port is None or 0 <= parts.port <= 65535 else None
    except ValueError:
        return None


def _origin(value: str) -> str:
    """An Origin (scheme://host[:port]) normalized for comparison."""
    return value.strip().rstrip("/").lower()


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


@dataclass(frozen=True)
class ServerConfig:
    """Limits and policies of the HTTP server; every field is a --flag of `serve`.

    Host policy: a Host header must name loopback (localhost, 127.0.0.0/8, ::1), the address the
    server is bound to, any IP address when it is bound to all interfaces, or an allowed_hosts
    entry ("*" allows every name). Origin policy: a request with an Origin header (a browser)
    is refused unless the origin is in allowed_origins, which also get CORS headers."""

    host: str = "127.0.0.1"
    allowed_hosts: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()
    max_body_bytes: int = MAX_BODY_BYTES
    header_timeout: float = 10.0  # seconds to send a request's line and headers
    body_timeout: float = 30.0  # seconds to send its body
    idle_timeout: float = 5.0  # seconds a keep-alive connection may sit idle between requests
    max_connections: int = 512
    max_connections_per_client: int = 64
    shutdown_timeout: float = 10.0  # seconds running generations may go on after SIGTERM
    auth_failures: int = 10  # wrong keys a client may send per auth_window before a 429
    auth_window: float = 60.0
    access_log: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "allowed_hosts", tuple(h.strip().lower() for h in self.allowed_hosts))
        object.__setattr__(self, "allowed_origins", tuple(_origin(o) for o in self.allowed_origins))
        for name in ("header_timeout", "body_timeout", "idle_timeout", "shutdown_timeout", "auth_window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        for name in ("max_body_bytes", "max_connections", "max_connections_per_client", "auth_failures"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for h in self.allowed_hosts:
            if not h or (h != "*" and not re.fullmatch(r"(\*\.)?[a-z0-9._\-\[\]:]+", h)):
                raise ValueError(f"--allowed-host {h!r} is not a host name (example.com, *.example.com, or *)")
        for o in self.allowed_origins:
            parts = urlsplit(o)
            if o != "*" and (parts.scheme not in ("http", "https") or not parts.netloc or parts.path):
                raise ValueError(f"--allowed-origin {o!r} is not an origin like https://app.example.com[:port] (or *)")

    def host_allowed(self, header: str | None) -> bool:
        if not header:
            return False
        name = _host_name(header)
        if name is None:
            return False
        if is_loopback(name) or name == self.host.strip("[]").lower():
            return True
        try:
            ipaddress.ip_address(name)
            if _is_wildcard(self.host):  # an IP address is no DNS-rebinding vector
                return True
        except ValueError:
            pass
        for allowed in self.allowed_hosts:
            if allowed == "*" or name == allowed or (allowed.startswith("*.") and name.endswith(allowed[1:])):
                return True
        return False

    def origin_allowed(self, origin: str) -> bool:
        return "*" in self.allowed_origins or _origin(origin) in self.allowed_origins


class ApiError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _ClientGone(Exception):
    pass


def _check_tree(body) -> None:
    """Walks the parsed body without recursion: refuses nesting deeper than MAX_JSON_DEPTH and
    strings that are not Unicode text (a lone surrogate escape such as "\\ud800")."""
    stack = [(body, 1, "body")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                stack.append((item, depth + 1, key if where == "body" else f"{where}.{key}"))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]") for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)


def _check_text(value: str, where: str) -> None:
    try:
        check_text(value, where)  # the API's own check
    except SettingError as exc:
        raise ApiError(400, str(exc), param=None if where == "body" else where, code=exc.code) from None


# -- metrics ------------------------------------------------------------------------------------

class Histogram:
    """A Prometheus histogram: cumulative bucket counts, sum and count."""

    def __init__(self, buckets: tuple[float, ...]):
        self.buckets = buckets
        self.counts = [0] * len(buckets)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.sum += value
        self.count += 1

    def lines(self, name: str) -> list[str]:
        out = [f'{name}_bucket{{le="{bound:g}"}} {n}' for bound, n in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]


_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
HISTOGRAMS = {
    # name: (help, buckets)
    "time_to_first_token_seconds": ("Request arrival to its first generated token.", _SECONDS),
    "time_per_output_token_seconds": ("Decode time per generated token after the first, per request.",
                                      (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)),
    "queue_time_seconds": ("Time a request waited for the engine.", _SECONDS),
    "request_acceptance_alpha": ("Per-token draft acceptance alpha of each speculative request.",
                                 tuple(i / 10 for i in range(1, 11))),
    "request_tokens_per_pass": ("Tokens committed per target pass, per request.", (1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)),
}


class Metrics:
    """Counters and histograms for /metrics, in Prometheus' text exposition format."""

    def __init__(self):
        self._lock = threading.Lock()
        self._histograms = {name: Histogram(buckets) for name, (_, buckets) in HISTOGRAMS.items()}
        self._requests: dict[tuple[str, int], int] = {}
        self._cancelled_by_disconnect = 0
        self._seconds_sum = 0.0
        self._seconds_count = 0

    def request(self, endpoint: str, status: int, seconds: float) -> None:
        with self._lock:
            key = (endpoint, status)
            self._requests[key] = self._requests.get(key, 0) + 1
            self._seconds_sum += seconds
            self._seconds_count += 1

    def disconnect(self) -> None:
        with self._lock:
            self._cancelled_by_disconnect += 1

    def generation(self, began: float, first_token_at: float | None, ended: float, result) -> None:
        """One finished generation: began is the request's arrival (perf_counter)."""
        n = len(result.token_ids)
        with self._lock:
            h = self._histograms
            h["queue_time_seconds"].observe(result.timings.get("queue_s", 0.0))
            if first_token_at is not None and n:
                h["time_to_first_token_seconds"].observe(first_token_at - began)
                if n > 1:
                    h["time_per_output_token_seconds"].observe((ended - first_token_at) / (n - 1))
            if result.stats.alpha is not None:
                h["request_acceptance_alpha"].observe(result.stats.alpha)
            if result.stats.target_passes:
                h["request_tokens_per_pass"].observe(result.stats.tokens_per_pass)

    def render(self, model: Model) -> str:
        c = model.counters()
        lines = []

        def metric(name, kind, help_text, samples):
            lines.append(f"# HELP edge_spec_{name} {help_text}")
            lines.append(f"# TYPE edge_spec_{name} {kind}")
            for labels, value in samples:
                label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
                lines.append(f"edge_spec_{name}{label_text} {value}")

        with self._lock:
            requests = sorted(self._requests.items())
            disconnects = self._cancelled_by_disconnect
            seconds_sum, seconds_count = self._seconds_sum, self._seconds_count
        metric("http_requests_total", "counter", "HTTP requests answered, by endpoint and status code.",
               [({"endpoint": e, "code": str(s)}, n) for (e, s), n in requests])
        metric("http_request_seconds", "summary", "Time to answer API requests (whole stream included).",
               [])
        lines.append(f"edge_spec_http_request_seconds_sum {seconds_sum:.6f}")
        lines.append(f"edge_spec_http_request_seconds_count {seconds_count}")
        metric("generations_admitted_total", "counter", "Generation requests admitted to the queue.", [({}, c["requests"])])
        metric("generations_rejected_total", "counter", "Generation requests refused because the queue was full.",
               [({}, c["rejected"])])
        metric("generations_queue_timeouts_total", "counter", "Generation requests that waited past the queue timeout.",
               [({}, c["queue_timeouts"])])
        metric("generations_finished_total", "counter", "Generations ended, by stop reason.",
               [({"reason": r}, v) for k, v in sorted(c.items()) if k.startswith("finished_") for r in [k[len("finished_"):]]])
        metric("client_disconnects_total", "counter", "Generations cancelled because the client went away.", [({}, disconnects)])
        metric("prompt_tokens_total", "counter", "Prompt tokens processed.", [({}, c["prompt_tokens"])])
        metric("completion_tokens_total", "counter", "Tokens generated.", [({}, c["completion_tokens"])])
        metric("target_passes_total", "counter", "Target model passes (each verifies a draft block).", [({}, c["target_passes"])])
        metric("drafted_tokens_total", "counter", "Draft tokens proposed.", [({}, c["drafted_tokens"])])
        metric("accepted_tokens_total", "counter", "Draft tokens accepted by the target.", [({}, c["accepted_tokens"])])
        rate = c["accepted_tokens"] / c["drafted_tokens"] if c["drafted_tokens"] else 0.0
        metric("acceptance_rate", "gauge", "Accepted / drafted tokens since start.", [({}, f"{rate:.6f}")])
        metric("queue_depth", "gauge", "Requests waiting for the engine.", [({}, model.queue_depth)])
        metric("queue_capacity", "gauge", "Requests that may wait (--max-queue).", [({}, model.max_queue)])
        metric("generation_running", "gauge", "1 while a generation holds the engine.", [({}, int(model.busy))])
        with self._lock:
            for name, (help_text, _) in HISTOGRAMS.items():
                lines.append(f"# HELP edge_spec_{name} {help_text}")
                lines.append(f"# TYPE edge_spec_{name} histogram")
                lines.extend(self._histograms[name].lines(f"edge_spec_{name}"))
        return "\n".join(lines) + "\n"


# -- request validation -------------------------------------------------------------------------

def _type_error(name: str, expected: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name, code="invalid_type")


def _value_error(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="invalid_value")


def _setting_error(exc: SettingError) -> ApiError:
    return ApiError(400, str(exc), param=exc.param, code=exc.code)


def _integer(body: dict, name: str, default, low: int | None = None, high: int | None = None, high_message: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer() and math.isfinite(value):
            value = int(value)
        else:
            raise _type_error(name, "an integer", value)
    if low is not None and value < low:
        raise _value_error(name, f"{name} must be >= {low}, got {shown(value)}")
    if high is not None and value > high:
        raise _value_error(name, high_message or f"{name} must be <= {high}, got {shown(value)}")
    return value


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _type_error(name, "a number", value)
    if not low <= value <= high:
        raise _value_error(name, f"{name} must be between {low:g} and {high:g}, got {value}")
    return float(value)


def _boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _type_error(name, "a boolean", value)
    return value


def _neutral(value, values) -> bool:
    """value is one of values, of the same type: true is not 1 (as in Python) here."""
    return any(value == v and isinstance(value, bool) == isinstance(v, bool) for v in values)


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)[:80]}",
                       param=unknown[0][:40], code="unknown_parameter")
    for name, values in _COMMON_INERT.items():
        if name in body and body[name] is not None and not _neutral(body[name], values):
            raise _value_error(name, f"{name}={json.dumps(body[name])[:40]} is not supported by this server "
                                     f"(leave it out or use {json.dumps(values[0])})")


def _stop(body: dict) -> tuple[str, ...]:
    value = body.get("stop")
    if value is None:
        return ()
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not all(isinstance(s, str) for s in values):
        raise _type_error("stop", "a string or a list of strings", value)
    if len(values) > MAX_STOP_STRINGS:
        raise _value_error("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(values)}")
    if any(not s or len(s) > MAX_STOP_CHARS for s in values):
        raise _value_error("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
    return tuple(values)


@dataclass
class Parsed:
    prompt_ids: Prompt  # checked once, in _check_prompt_ids
    options: Options
    stream: bool
    include_usage: bool


class _AuthThrottle:
    """Wrong keys per client address in a sliding window; past the limit, 429 until it slides."""

    MAX_CLIENTS = 10_000  # remembered addresses (the oldest are forgotten first)

    def __init__(self, limit: int, window: float):
        self.limit, self.window = limit, window
        self._failures: dict[str, deque] = {}
        self._lock = threading.Lock()

    def _recent(self, client: str, now: float) -> deque:
        failures = self._failures.get(client)
        if failures is None:
            return deque()
        while failures and failures[0] <= now - self.window:
            failures.popleft()
        if not failures:
            del self._failures[client]
        return failures

    def retry_after(self, client: str) -> int | None:
        with self._lock:
            now = time.monotonic()
            failures = self._recent(client, now)
            if len(failures) < self.limit:
                return None
            return max(1, math.ceil(failures[0] + self.window - now))

    def fail(self, client: str) -> None:
        with self._lock:
            if client not in self._failures and len(self._failures) >= self.MAX_CLIENTS:
                del self._failures[next(iter(self._failures))]
            self._failures.setdefault(client, deque()).append(time.monotonic())


class Server:
    def __init__(self, model: Model, model_id: str | None = None, api_key: str | None = None,
                 max_body_bytes: int | None = None, config: ServerConfig | None = None, api_keys=()):
        self.model = model
        self.model_id = model_id or model.name
        self.config = config or ServerConfig()
        if max_body_bytes is not None:
            self.config = dataclasses.replace(self.config, max_body_bytes=max_body_bytes)
        keys = ([api_key] if api_key is not None else []) + list(api_keys)
        self._keys = check_api_keys(keys)
        self.max_body_bytes = self.config.max_body_bytes
        self.metrics = Metrics()
        self.created = int(time.time())
        self._throttle = _AuthThrottle(self.config.auth_failures, self.config.auth_window)
        # One tokenizing thread: a huge prompt is tokenized off the event loop (the tokenizer
        # releases the GIL) and several at once queue there instead of taking every core.
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-tokenize")
        # One parsing thread: json.loads and the walks over a body grow with it (a 1 MiB list of
        # ids takes hundreds of milliseconds), so they run here and the event loop keeps answering.
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-parse")
        self.stopping = False  # SIGTERM: no new generations
        self.aborting = False  # the shutdown deadline passed: running generations were cancelled
        inner = Starlette(
            routes=[
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/v1/models", self.list_models, methods=["GET"]),
                Route("/v1/models/{model_id:path}", self.get_model, methods=["GET"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._http_error, Exception: self._internal_error},
        )
        if self.config.allowed_origins:
            inner = CORSMiddleware(inner, allow_origins=list(self.config.allowed_origins), allow_methods=["GET", "POST"],
                                   allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                                   expose_headers=["X-Request-Id", "Retry-After"], max_age=600)
        self._inner = inner
        self.app = self._guard

    # -- plumbing ---------------------------------------------------------------------------

    async def _guard(self, scope, receive, send) -> None:
        """Every HTTP request: a request id (echoed in X-Request-Id), the Host and Origin policy,
        and one access-log line."""
        if scope["type"] != "http":
            return await self._inner(scope, receive, send)
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
                await self._inner(scope, receive, tagged)
        finally:
            if self.config.access_log and access_log.isEnabledFor(logging.INFO):
                client = scope.get("client") or ("-", 0)
                access_log.info('%s:%s "%s %s HTTP/%s" %s %.1fms id=%s%s', client[0], client[1], scope["method"], scope["path"],
                                scope.get("http_version", "1.1"), status[0] or 499, (time.perf_counter() - began) * 1e3, rid,
                                f" {scope['edge_spec.speculation']}" if "edge_spec.speculation" in scope else "")

    @staticmethod
    def request_id(request: Request) -> str:
        return request.scope.get("edge_spec.request_id", "-")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, code=code, headers=exc.headers).response()

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        print(f"edge-spec server: internal error on {request.url.path} (request {self.request_id(request)}): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def _authorize(self, request: Request) -> None:
        if not self._keys:
            return
        client = (request.scope.get("client") or ("-",))[0]
        wait = self._throttle.retry_after(client)
        if wait is not None:
            raise ApiError(429, f"Too many wrong API keys from {client}; retry in {wait} s", type="rate_limit_error",
                           code="auth_throttled", headers={"Retry-After": str(wait)})
        # The raw header bytes: a key is compared as the UTF-8 bytes the client sent.
        header = next((v for k, v in request.scope.get("headers", ()) if k.lower() == b"authorization"), b"")
        scheme, _, token = header.strip().partition(b" ")
        token = token.strip()
        if not header or scheme.lower() != b"bearer" or not token:
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        matched = False
        for key in self._keys:  # every key is compared: the time taken does not say which matched
            matched |= hmac.compare_digest(token, key)
        if not matched:
            self._throttle.fail(client)
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _json_body(self, request: Request) -> dict:
        media, _, parameters = request.headers.get("content-type", "").partition(";")
        charset = re.search(r"charset\s*=\s*\"?([^\";\s]+)", parameters, re.IGNORECASE)
        if media.strip().lower() != "application/json" or (charset and charset.group(1).lower() not in ("utf-8", "utf8")):
            raise ApiError(415, f"send the body as Content-Type: application/json (UTF-8), not "
                                f"{request.headers.get('content-type', 'none')[:60]!r}", code="unsupported_media_type")
        if request.headers.get("content-encoding", "identity").strip().lower() != "identity":
            raise ApiError(415, f"Content-Encoding {request.headers['content-encoding'][:40]!r} is not accepted: send the "
                                "body uncompressed", code="unsupported_media_type")
        declared = request.headers.get("content-length")
        if declared and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"request body is over {self.max_body_bytes} bytes", code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.max_body_bytes:
                    raise ApiError(413, f"request body is over {self.max_body_bytes} bytes", code="request_too_large")
                chunks.append(chunk)
        except ClientDisconnect:
            raise _ClientGone() from None

        raw = b"".join(chunks)
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, self._decode_body, raw)

    def _decode_body(self, raw: bytes) -> dict:
        """The body as a checked JSON object (on the parsing thread). Fields whose size the
        bundle bounds are refused by their length before anything walks their items."""

        def no_constants(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            # Decoded here: json.loads would take UTF-16 and UTF-32 bytes as well.
            body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
        except RecursionError:
            raise ApiError(400, f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)",
                           code="invalid_json") from None
        except UnicodeDecodeError:
            raise ApiError(400, "the request body is not UTF-8 text; send a JSON object encoded as UTF-8",
                           code="invalid_json") from None
        except ValueError as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request ({str(exc)[:120]}); send a JSON "
                                "object with Content-Type: application/json", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        self._check_sizes(body)
        _check_tree(body)
        return body

    def _check_sizes(self, body: dict) -> None:
        """Lengths the bundle and the API bound, checked before any walk over the items: a list of
        token ids no longer than the context, at most MAX_STOP_STRINGS stop strings of
        MAX_STOP_CHARS, logit_bias only empty (the one value accepted)."""
        context = self.model.max_context
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and len(prompt) >= context:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                                f"{len(prompt)} tokens; shorten the prompt", param="prompt", code="context_length_exceeded")
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > context:  # each message takes at least a token
            raise ApiError(400, f"This model's maximum context length is {context} tokens: {len(messages)} messages "
                                "cannot fit", param="messages", code="context_length_exceeded")
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise _value_error("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if isinstance(stop, list) and any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
            raise _value_error("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        bias = body.get("logit_bias")
        if isinstance(bias, dict) and bias:
            raise _value_error("logit_bias", f"logit_bias with {len(bias)} entries is not supported by this server "
                                             "(leave it out or use {})")

    def _check_model(self, body: dict) -> None:
        name = body.get("model")
        if name is None:
            return  # one model is served: leaving it out means that one
        if not isinstance(name, str):
            raise _type_error("model", "a string", name)
        if name != self.model_id:
            raise ApiError(404, f"The model '{name[:100]}' does not exist; this server serves '{self.model_id}'",
                           param="model", code="model_not_found")

    def _options(self, body: dict, prompt_len: int, default_tokens: int, token_names: tuple[str, ...]) -> Options:
        context = self.model.max_context
        max_tokens = None
        for name in token_names:
            max_tokens = _integer(body, name, None, 1, context,
                                  f"{name} is too large: {shown(body.get(name))}. This model's context holds {context} tokens, "
                                  "prompt included")
            if max_tokens is not None:
                break
        if max_tokens is None:
            max_tokens = default_tokens
        temperature = _number(body, "temperature", 1.0, 0.0, 2.0)  # OpenAI's default; 0 is greedy
        top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
        top_k = _integer(body, "top_k", 0, -1, None)
        seed = _integer(body, "seed", None, 0, 2**63 - 1)
        if top_p == 0.0:  # the smallest nucleus: only the most likely token
            temperature, top_p = 0.0, 1.0
        try:  # Options is the API's own check (a temperature too small to scale the logits, ...)
            options = Options(max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p, seed=seed,
                              stop=_stop(body), speculation=body.get("speculation"))
            self.model.engine.check_speculation(options.speculation)  # against the drafters this bundle has
            return options
        except SettingError as exc:
            raise _setting_error(exc) from None

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _boolean(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise _type_error("stream_options", 'an object like {"include_usage": true}', options)
            include_usage = _boolean(options, "include_usage", False)
        return stream, include_usage

    def _check_prompt_ids(self, ids: list[int], param: str) -> Prompt:
        """The prompt check, once per request (submit takes the Prompt as checked), with the
        errors in OpenAI's shape."""
        try:
            return self.model.check_prompt(ids)
        except PromptTooLongError:
            raise ApiError(400, f"This model's maximum context length is {self.model.max_context} tokens, but the "
                                f"prompt has {len(ids)} tokens; shorten the prompt", param=param,
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise _value_error(param, str(exc)) from None

    def _cheap_length_check(self, n_bytes: int, param: str) -> None:
        """Refuse, without tokenizing, text that cannot fit: no token stands for more than
        max_token_bytes bytes, so it needs more tokens than the context holds."""
        bound = self.model.max_context * self.model.engine.tokenizer.max_token_bytes
        if n_bytes > bound:
            raise ApiError(400, f"This model's maximum context length is {self.model.max_context} tokens, and the "
                                f"{param} has {n_bytes} bytes, more than that many tokens can hold; shorten it",
                           param=param, code="context_length_exceeded")

    async def _encode(self, **kwargs) -> list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenize_pool, lambda: self.model.encode(**kwargs))

    async def _parse_completion(self, body: dict) -> Parsed:
        _check_fields(body, COMPLETION_FIELDS)
        self._check_model(body)
        if _boolean(body, "echo", False):
            raise _value_error("echo", "echo is not supported by this server")
        if body.get("suffix") not in (None, ""):
            raise _value_error("suffix", "suffix is not supported by this server")
        if body.get("logprobs") not in (None, 0, False):
            raise _value_error("logprobs", "logprobs are not supported by this server")
        _boolean(body, "stream", False)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        parse_special = _boolean(body, "parse_special", False)
        if isinstance(prompt, str):
            self._cheap_length_check(len(prompt.encode("utf-8")), "prompt")
            ids = await self._encode(prompt=prompt, parse_special=parse_special)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif prompt is None:
            raise ApiError(400, "prompt is required", param="prompt", code="missing_required_parameter")
        elif isinstance(prompt, list):
            raise _value_error("prompt", "this server takes one prompt per request (a string or a list of token ids)")
        else:
            raise _type_error("prompt", "a string or a list of token ids", prompt)
        ids = self._check_prompt_ids(ids, "prompt")
        options = self._options(body, len(ids), DEFAULT_COMPLETION_TOKENS, ("max_tokens",))
        stream, include_usage = self._stream_flags(body)
        return Parsed(ids, options, stream, include_usage)

    async def _parse_chat(self, body: dict) -> Parsed:
        _check_fields(body, CHAT_FIELDS)
        self._check_model(body)
        if body.get("logprobs") not in (None, False) or not _neutral(body.get("top_logprobs"), (None, 0)):
            raise _value_error("logprobs", "logprobs are not supported by this server")
        if body.get("tools") not in (None, []) or body.get("tool_choice") not in (None, "none"):
            raise _value_error("tools", "tool calls are not supported by this server")
        if body.get("parallel_tool_calls") is not None:
            _boolean(body, "parallel_tool_calls", False)
        response_format = body.get("response_format")
        if response_format is not None and response_format != {"type": "text"}:
            raise _value_error("response_format", 'only {"type": "text"} is supported by this server')
        messages = body.get("messages")
        if messages is None:
            raise ApiError(400, "messages is required", param="messages", code="missing_required_parameter")
        try:
            clean = check_messages(messages)  # the API's own check
        except SettingError as exc:
            raise _setting_error(exc) from None
        if not self.model.has_chat_template:
            raise ApiError(400, "this bundle's tokenizer has no chat template; use /v1/completions with a raw prompt",
                           param="messages", code="no_chat_template")
        self._cheap_length_check(sum(len(m["content"].encode("utf-8")) for m in clean), "messages")
        try:
            ids = await self._encode(messages=clean)
        except ChatTemplateError as exc:
            raise _value_error("messages", str(exc)) from None
        ids = self._check_prompt_ids(ids, "messages")
        options = self._options(body, len(ids), self.model.max_context - len(ids),
                                ("max_completion_tokens", "max_tokens"))
        stream, include_usage = self._stream_flags(body)
        return Parsed(ids, options, stream, include_usage)

    def _submit(self, parsed: Parsed) -> Job:
        try:
            return self.model.submit(prompt_ids=parsed.prompt_ids, options=parsed.options)
        except QueueFullError as exc:
            raise ApiError(429, f"Server busy: {exc}", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except ModelClosedError:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None

    # -- endpoints --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, "busy": self.model.busy,
                             "queue_depth": self.model.queue_depth, "max_queue": self.model.max_queue})

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        return PlainTextResponse(self.metrics.render(self.model), media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "edge-spec",
                "max_context": self.model.max_context}

    async def list_models(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        try:
            self._authorize(request)
            if request.path_params["model_id"] != self.model_id:
                raise ApiError(404, f"The model '{request.path_params['model_id'][:100]}' does not exist",
                               param="model", code="model_not_found")
        except ApiError as exc:
            return exc.response()
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", self._parse_completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat.completions", self._parse_chat)

    async def _generate(self, request: Request, endpoint: str, parse) -> Response:
        began = time.perf_counter()
        status = 200
        try:
            self._authorize(request)
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            body = await self._json_body(request)
            parsed = await parse(body)
            chosen, engine = parsed.options.speculation, self.model.engine.config
            request.scope["edge_spec.speculation"] = (f"drafter={(chosen and chosen.drafter) or engine.drafter} "
                                                      f"max_gamma={(chosen and chosen.max_gamma) or engine.max_gamma}")
            job = self._submit(parsed)
        except ApiError as exc:
            self.metrics.request(endpoint, exc.status, time.perf_counter() - began)
            return exc.response()
        except _ClientGone:
            self.metrics.request(endpoint, 499, time.perf_counter() - began)
            return Response(status_code=499)
        chat = endpoint == "chat.completions"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            # Wait for our turn here, so a queue timeout is still a proper 503 and a client
            # that leaves while waiting is noticed.
            if not await _unless_disconnected(request, job, job.astart()):
                if self.stopping:
                    raise ModelClosedError()
                raise _ClientGone()
            if parsed.stream:
                stream = self._events(job, parsed, ident, chat, request, endpoint, began)
                return _EventStream(stream, on_disconnect=lambda: self._disconnected(job))
            result = await _unless_disconnected(request, job, job.aresult())
            if result.stop_reason == "cancelled":
                if self.aborting:
                    raise ModelClosedError()
                raise _ClientGone()
            self.metrics.generation(began, job.first_token_at, time.perf_counter(), result)
            return JSONResponse(self._final_body(result, ident, chat))
        except ModelClosedError:
            status = 503
            return ApiError(503, "the server is shutting down; the generation was cancelled", type="server_error",
                            code="shutting_down").response()
        except QueueTimeoutError as exc:
            status = 503
            return ApiError(503, f"Server busy: {exc}", type="server_error", code="queue_timeout",
                            headers={"Retry-After": "5"}).response()
        except _ClientGone:
            status = 499
            self._disconnected(job)
            return Response(status_code=499)
        except Exception as exc:  # the engine failed: say so, cancel, keep serving
            status = 500
            job.cancel()
            return await self._internal_error(request, exc)
        finally:
            if not parsed.stream or status != 200:
                self.metrics.request(endpoint, status, time.perf_counter() - began)

    def begin_shutdown(self, loop: asyncio.AbstractEventLoop) -> None:
        """SIGTERM: take no new generations; running and queued ones may finish for
        shutdown_timeout seconds, then are cancelled (streams get a last chunk and [DONE])."""
        if self.stopping:
            return
        self.stopping = True

        def abort() -> None:
            self.aborting = True
            self.model.cancel_all()

        loop.call_later(self.config.shutdown_timeout, abort)

    def _disconnected(self, job: Job) -> None:
        """The client went away: cancel its generation (once), unless it had already finished."""
        if getattr(job, "_client_gone", False):
            return
        job._client_gone = True
        if job.done and job.final.stop_reason != "cancelled":
            return
        job.cancel()
        self.metrics.disconnect()

    def _usage(self, result) -> dict:
        prompt, completion = len(result.prompt_ids), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _speculative(result) -> dict:
        return {"stop_reason": result.stop_reason, **result.stats.to_dict(), "timings": result.timings,
                "speculation": result.speculation}

    def _final_body(self, result, ident: str, chat: bool) -> dict:
        finish = FINISH_REASONS[result.stop_reason]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}, "logprobs": None,
                      "finish_reason": finish}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish}
        return {"id": ident, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.model_id, "choices": [choice], "usage": self._usage(result),
                "speculative": self._speculative(result)}

    async def _events(self, job: Job, parsed: Parsed, ident: str, chat: bool, request: Request, endpoint: str, began: float):
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def event(choice: dict | None, **extra) -> bytes:
            body = {"id": ident, "object": kind, "created": created, "model": self.model_id,
                    "choices": [] if choice is None else [choice], **extra}
            return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"

        def choice(text: str | None, finish: str | None) -> dict:
            if chat:
                delta = {} if text is None else {"content": text}
                return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
            return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}

        status = 200
        try:
            if chat:
                yield event({"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
            async for chunk in job:
                if chunk.text:
                    yield event(choice(chunk.text, None))
                if chunk.result is not None:
                    result = chunk.result
                    if result.stop_reason == "cancelled" and not self.aborting:
                        status = 499
                        return
                    # Cancelled by the shutdown deadline: the client still gets a last chunk and [DONE].
                    finish = SHUTDOWN_FINISH_REASON if result.stop_reason == "cancelled" else FINISH_REASONS[result.stop_reason]
                    if result.stop_reason != "cancelled":
                        self.metrics.generation(began, job.first_token_at, time.perf_counter(), result)
                    yield event(choice(None, finish), speculative=self._speculative(result))
                    if parsed.include_usage:
                        yield event(None, usage=self._usage(result))
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            status = 499
            self._disconnected(job)
            raise
        except Exception as exc:  # mid-stream: the status line is sent, so report in-band
            status = 500
            print(f"edge-spec server: error mid-stream (request {self.request_id(request)}): {type(exc).__name__}: {exc}",
                  file=sys.stderr)
            yield b"data: " + json.dumps(ApiError(500, f"internal error: {exc}", type="server_error").body()).encode() + b"\n\n"
        finally:
            if not job.done:
                self._disconnected(job)
            self.metrics.request(endpoint, status, time.perf_counter() - began)


async def _unless_disconnected(request: Request, job: Job, awaitable):
    """Await `awaitable`, but cancel the job and raise _ClientGone if the client disconnects."""
    task = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        job.cancel()
        raise _ClientGone()
    finally:
        watch.cancel()
        if not task.done():
            job.cancel()
            try:
                await task  # lets the job settle (it stops after the current target pass)
            except BaseException:
                pass


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class _EventStream(StreamingResponse):
    """Server-sent events that always watch for the client going away (whatever the ASGI
    server's spec version) and then cancel the generation."""

    media_type = "text/event-stream"

    def __init__(self, content, on_disconnect):
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_disconnect = on_disconnect

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self._send_all(send))
        watch = asyncio.ensure_future(_until_disconnect(receive))
        try:
            done, _ = await asyncio.wait({streaming, watch}, return_when=asyncio.FIRST_COMPLETED)
            if streaming not in done:
                self._on_disconnect()
                streaming.cancel()
            try:
                await streaming
            except (asyncio.CancelledError, OSError):
                pass
        finally:
            watch.cancel()
            if not streaming.done():
                streaming.cancel()

    async def _send_all(self, send) -> None:
        try:
            await self.stream_response(send)
        finally:
            await self.body_iterator.aclose()


# -- running ------------------------------------------------------------------------------------

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


class _Connections:
    """Open connections per client address and in all, for the guarded protocol."""

    def __init__(self, total: int, per_client: int):
        self.total, self.per_client = total, per_client
        self.count = 0
        self.by_client: dict[str, int] = {}

    def admit(self, client: str) -> tuple[int, str] | None:
        """None when admitted (then leave() must follow), else (status, reason)."""
        if self.count >= self.total:
            return 503, f"the server holds its limit of {self.total} connections"
        if self.by_client.get(client, 0) >= self.per_client:
            return 429, f"this client holds its limit of {self.per_client} connections"
        self.count += 1
        self.by_client[client] = self.by_client.get(client, 0) + 1
        return None

    def leave(self, client: str) -> None:
        self.count -= 1
        left = self.by_client.get(client, 1) - 1
        if left:
            self.by_client[client] = left
        else:
            self.by_client.pop(client, None)


def _raw_response(status: int, code: str, message: str, retry_after: int | None = None) -> bytes:
    body = json.dumps(ApiError(status, message, type="server_error" if status >= 500 else "invalid_request_error",
                               code=code).body()).encode()
    reason = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}[status]
    head = [f"HTTP/1.1 {status} {reason}", "Content-Type: application/json", f"Content-Length: {len(body)}", "Connection: close"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


def guarded_protocol(config: ServerConfig):
    """uvicorn's h11 protocol plus what uvicorn lacks: a deadline for a request's headers (which
    also bounds a connection that sends nothing), a deadline for its body, and connection limits
    per client and in all. The keep-alive idle timeout is uvicorn's own."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    connections = _Connections(config.max_connections, config.max_connections_per_client)

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._deadline = None
            self._reading = None
            self._client_key = self.client[0] if self.client else "-"
            refusal = connections.admit(self._client_key)
            self._admitted = refusal is None
            if refusal is not None:
                status, reason = refusal
                transport.write(_raw_response(status, "too_many_connections", f"{reason}; retry later", retry_after=1))
                transport.close()
                return
            self._arm("headers")

        def connection_lost(self, exc) -> None:
            if self._admitted:
                self._admitted = False
                connections.leave(self._client_key)
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch(arrived=True)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch(arrived=False)

        def _watch(self, arrived: bool) -> None:
            if self.transport.is_closing():
                return self._disarm()
            state = self.conn.their_state
            if state is h11.SEND_BODY:
                if self._reading != "body":
                    self._arm("body")
            elif state is h11.IDLE:
                if arrived and self._reading != "headers":
                    self._arm("headers")  # the next request began: its headers have a deadline
                elif not arrived:
                    self._disarm()  # between requests: uvicorn's keep-alive timeout applies
            else:
                self._disarm()

        def _arm(self, what: str) -> None:
            self._disarm()
            seconds = config.header_timeout if what == "headers" else config.body_timeout
            self._reading = what
            self._deadline = self.loop.call_later(seconds, self._expired, what, seconds)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
            self._deadline, self._reading = None, None

        def _expired(self, what: str, seconds: float) -> None:
            self._deadline, self._reading = None, None
            if self.transport.is_closing():
                return
            if self.cycle is None or not self.cycle.response_started:
                self.transport.write(_raw_response(408, "request_timeout", f"the request's {what} took longer than {seconds:g} s"))
            self.transport.close()

    GuardedH11Protocol.connections = connections
    return GuardedH11Protocol


def make_uvicorn(server: Server, log_level: str = "warning"):
    import uvicorn

    config = uvicorn.Config(
        server.app, http=guarded_protocol(server.config), interface="asgi3", lifespan="off", log_level=log_level,
        access_log=False, proxy_headers=False,  # X-Forwarded-For from loopback must not pick the throttled address
        timeout_keep_alive=server.config.idle_timeout,
        # uvicorn cancels what is left only after our own deadline has ended every generation.
        timeout_graceful_shutdown=server.config.shutdown_timeout + 10,
    )

    class _Uvicorn(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            super().handle_exit(sig, frame)
            self._captured_signals.clear()  # a handled SIGTERM/SIGINT ends the process with status 0

        async def shutdown(self, sockets=None) -> None:
            server.begin_shutdown(asyncio.get_running_loop())
            await super().shutdown(sockets)

    return _Uvicorn(config)


def serve(model: Model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, insecure: bool = False,
          model_id: str | None = None, log_level: str = "warning", announce=print, config: ServerConfig | None = None,
          api_keys=()) -> None:
    """Serve until SIGINT/SIGTERM; running generations get config.shutdown_timeout to finish."""
    config = dataclasses.replace(config or ServerConfig(), host=host)
    check_bind(host, api_key or list(api_keys), insecure)
    server = Server(model, model_id=model_id, api_key=api_key, api_keys=api_keys, config=config)
    if config.access_log and not access_log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s edge-spec access: %(message)s"))
        access_log.addHandler(handler)
        access_log.setLevel(logging.INFO)
        access_log.propagate = False
    sock = bind(host, port)
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    keyed = bool(server._keys)
    announce(f"edge-spec: serving {server.model_id!r} on http://{shown}:{sock.getsockname()[1]}/v1 "
             f"(queue {model.max_queue}, {'API key required' if keyed else 'no API key'}); Ctrl-C stops")
    try:
        make_uvicorn(server, log_level).run(sockets=[sock])
    finally:
        model.close()
        sock.close()


__all__ = ["ApiError", "Server", "ServerConfig", "check_api_keys", "check_bind", "is_loopback", "read_api_key_file", "serve",
           "bind", "make_uvicorn"]
