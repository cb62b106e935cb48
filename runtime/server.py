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
import hmac
import ipaddress
import json
import math
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.api import Job, Model, ModelClosedError, Options, QueueFullError, QueueTimeoutError
from runtime.engine import PromptTooLongError
from runtime.tokenizer import ChatTemplateError

MAX_BODY_BYTES = 1 << 20  # 1 MiB of JSON is far more than any prompt a bundle's context holds
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the context left
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}

# Accepted for compatibility, but only with the value that means "off" (or null).
_COMMON_INERT = {
    "n": (1,),
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "best_of": (1,),
}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "user"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "logprobs"} | set(_COMMON_INERT)
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "response_format",
                         "tools", "tool_choice", "parallel_tool_calls"} | (set(_COMMON_INERT) - {"best_of"})
CHAT_ROLES = ("system", "developer", "user", "assistant")


def is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


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


# -- metrics ------------------------------------------------------------------------------------

class Metrics:
    """Counters for /metrics, in Prometheus' text exposition format."""

    def __init__(self):
        self._lock = threading.Lock()
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
        return "\n".join(lines) + "\n"


# -- request validation -------------------------------------------------------------------------

def _type_error(name: str, expected: str, value) -> ApiError:
    return ApiError(400, f"{name} must be {expected}, got {json.dumps(value)[:80]}", param=name, code="invalid_type")


def _value_error(name: str, message: str) -> ApiError:
    return ApiError(400, message, param=name, code="invalid_value")


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
        raise _value_error(name, f"{name} must be >= {low}, got {value}")
    if high is not None and value > high:
        raise _value_error(name, high_message or f"{name} must be <= {high}, got {value}")
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


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"Unrecognized request argument supplied: {', '.join(unknown)}", param=unknown[0],
                       code="unknown_parameter")
    for name, values in _COMMON_INERT.items():
        if name in body and body[name] is not None and body[name] not in values:
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
    prompt_ids: list[int]
    options: Options
    stream: bool
    include_usage: bool


class Server:
    def __init__(self, model: Model, model_id: str | None = None, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES):
        self.model = model
        self.model_id = model_id or model.name
        self._key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics()
        self.created = int(time.time())
        self.app = Starlette(
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

    # -- plumbing ---------------------------------------------------------------------------

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, code=code, headers=exc.headers).response()

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        print(f"edge-spec server: internal error on {request.url.path}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def _authorize(self, request: Request) -> None:
        if self._key is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if not header or scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "Missing API key: send it as 'Authorization: Bearer KEY'", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})
        if not hmac.compare_digest(token.strip().encode(), self._key):
            raise ApiError(401, "Incorrect API key provided", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _json_body(self, request: Request) -> dict:
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

        def no_constants(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            body = json.loads(b"".join(chunks), parse_constant=no_constants)
        except (ValueError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"We could not parse the JSON body of your request ({exc}); send a JSON object "
                                "with Content-Type: application/json", code="invalid_json") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
        return body

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
                                  f"{name} is too large: {body.get(name)}. This model's context holds {context} tokens, "
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
        return Options(max_tokens=max_tokens, temperature=temperature, top_k=max(top_k, 0), top_p=top_p, seed=seed,
                       stop=_stop(body))

    def _stream_flags(self, body: dict) -> tuple[bool, bool]:
        stream = _boolean(body, "stream", False)
        options = body.get("stream_options")
        include_usage = False
        if options is not None:
            if not isinstance(options, dict) or set(options) - {"include_usage"}:
                raise _type_error("stream_options", 'an object like {"include_usage": true}', options)
            include_usage = _boolean(options, "include_usage", False)
        return stream, include_usage

    def _check_prompt_ids(self, ids: list[int], param: str) -> None:
        try:
            self.model.check_prompt(ids)
        except PromptTooLongError:
            raise ApiError(400, f"This model's maximum context length is {self.model.max_context} tokens, but the "
                                f"prompt has {len(ids)} tokens; shorten the prompt", param=param,
                           code="context_length_exceeded") from None
        except ValueError as exc:
            raise _value_error(param, str(exc)) from None

    def _parse_completion(self, body: dict) -> Parsed:
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
        if isinstance(prompt, str):
            if len(prompt) > self.max_body_bytes:
                raise _value_error("prompt", "the prompt is too long")
            ids = self.model.encode(prompt=prompt)
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            vocab = self.model.engine.bundle.manifest.tokenizer.n_real_tokens
            if any(not 0 <= t < vocab for t in prompt):
                raise _value_error("prompt", f"token ids must be in [0, {vocab})")
            ids = list(prompt)
        elif prompt is None:
            raise ApiError(400, "prompt is required", param="prompt", code="missing_required_parameter")
        elif isinstance(prompt, list):
            raise _value_error("prompt", "this server takes one prompt per request (a string or a list of token ids)")
        else:
            raise _type_error("prompt", "a string or a list of token ids", prompt)
        self._check_prompt_ids(ids, "prompt")
        options = self._options(body, len(ids), DEFAULT_COMPLETION_TOKENS, ("max_tokens",))
        stream, include_usage = self._stream_flags(body)
        return Parsed(ids, options, stream, include_usage)

    def _parse_chat(self, body: dict) -> Parsed:
        _check_fields(body, CHAT_FIELDS)
        self._check_model(body)
        if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
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
        if not isinstance(messages, list) or not messages:
            raise _type_error("messages", "a non-empty list of messages", messages)
        clean = []
        for i, message in enumerate(messages):
            where = f"messages[{i}]"
            if not isinstance(message, dict):
                raise _type_error(where, "an object", message)
            role, content = message.get("role"), message.get("content")
            if role not in CHAT_ROLES:
                raise _value_error(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {json.dumps(role)[:40]}")
            if isinstance(content, list):  # content parts: text only
                parts = []
                for part in content:
                    if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                        raise _value_error(f"{where}.content", "only text content parts are supported")
                    parts.append(part["text"])
                content = "".join(parts)
            if not isinstance(content, str):
                raise _type_error(f"{where}.content", "a string", content)
            extra = set(message) - {"role", "content", "name"}
            if extra:
                raise ApiError(400, f"Unrecognized argument in {where}: {', '.join(sorted(extra))}",
                               param=f"{where}.{sorted(extra)[0]}", code="unknown_parameter")
            clean.append({"role": "system" if role == "developer" else role, "content": content})
        if not self.model.has_chat_template:
            raise ApiError(400, "this bundle's tokenizer has no chat template; use /v1/completions with a raw prompt",
                           param="messages", code="no_chat_template")
        total_chars = sum(len(m["content"]) for m in clean)
        if total_chars > self.max_body_bytes:
            raise _value_error("messages", "the messages are too long")
        try:
            ids = self.model.encode(messages=clean)
        except ChatTemplateError as exc:
            raise _value_error("messages", str(exc)) from None
        self._check_prompt_ids(ids, "messages")
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
            body = await self._json_body(request)
            parsed = parse(body)
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
                raise _ClientGone()
            if parsed.stream:
                stream = self._events(job, parsed, ident, chat, request, endpoint, began)
                return _EventStream(stream, on_disconnect=lambda: self._disconnected(job))
            result = await _unless_disconnected(request, job, job.aresult())
            if result.stop_reason == "cancelled":
                raise _ClientGone()
            return JSONResponse(self._final_body(result, ident, chat))
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
        return {"stop_reason": result.stop_reason, **result.stats, "timings": result.timings}

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
                    if result.stop_reason == "cancelled":
                        status = 499
                        return
                    yield event(choice(None, FINISH_REASONS[result.stop_reason]), speculative=self._speculative(result))
                    if parsed.include_usage:
                        yield event(None, usage=self._usage(result))
            yield b"data: [DONE]\n\n"
        except asyncio.CancelledError:
            status = 499
            self._disconnected(job)
            raise
        except Exception as exc:  # mid-stream: the status line is sent, so report in-band
            status = 500
            print(f"edge-spec server: error mid-stream: {type(exc).__name__}: {exc}", file=sys.stderr)
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

def check_bind(host: str, api_key: str | None, insecure: bool) -> None:
    if not is_loopback(host) and not api_key and not insecure:
        raise ValueError(
            f"--host {host} is reachable from other machines: pass --api-key KEY (or set EDGE_SPEC_API_KEY), "
            "or --insecure to serve it without a key"
        )


def bind(host: str, port: int) -> socket.socket:
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


def make_uvicorn(server: Server, log_level: str = "warning"):
    import uvicorn

    config = uvicorn.Config(
        server.app, http="h11", lifespan="off", log_level=log_level, access_log=log_level in ("info", "debug", "trace"),
        # limit_concurrency is a last guard against connection floods (idle keep-alive connections
        # count too); the request queue is what bounds the work.
        timeout_keep_alive=5, timeout_graceful_shutdown=5, limit_concurrency=max(1024, 4 * (server.model.max_queue + 1)),
    )
    return uvicorn.Server(config)


def serve(model: Model, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None, insecure: bool = False,
          model_id: str | None = None, log_level: str = "warning", announce=print) -> None:
    """Serve until interrupted (SIGINT/SIGTERM); cancels what is left in the queue on the way out."""
    check_bind(host, api_key, insecure)
    server = Server(model, model_id=model_id, api_key=api_key)
    sock = bind(host, port)
    shown = f"[{host.strip('[]')}]" if ":" in host else host
    announce(f"edge-spec: serving {server.model_id!r} on http://{shown}:{sock.getsockname()[1]}/v1 "
             f"(queue {model.max_queue}, {'API key required' if api_key else 'no API key'}); Ctrl-C stops")
    try:
        make_uvicorn(server, log_level).run(sockets=[sock])
    finally:
        model.close()
        sock.close()


__all__ = ["ApiError", "Server", "check_bind", "is_loopback", "serve", "bind", "make_uvicorn"]
