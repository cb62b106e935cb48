"""The Starlette app and its routes: one Server over one Model."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
import uuid

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from runtime.api import Job, Model, ModelClosedError, QueueFullError, QueueTimeoutError
from runtime.server.body import BodyLimits, BodyReader
from runtime.server.config import ServerConfig
from runtime.server.errors import ApiError, ClientGone, printable
from runtime.server.metrics import Metrics
from runtime.server.schema import Parsed, RequestParser
from runtime.server.security import Guard, KeyGate, client_identity
from runtime.server.streaming import EventStream, unless_disconnected
from runtime.server.security import access_log


class _PrintableValues(logging.Filter):
    """The access log's values as printable text: a path's %0d%0a cannot write a forged line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(printable(arg) if isinstance(arg, str) else arg for arg in record.args)
        return True


access_log.addFilter(_PrintableValues())

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
SHUTDOWN_FINISH_REASON = "abort"  # vLLM's name for a request the server ended: the text is cut short


class Server:
    def __init__(self, model: Model, model_id: str | None = None, api_key: str | None = None,
                 max_body_bytes: int | None = None, config: ServerConfig | None = None, api_keys=()):
        self.model = model
        self.model_id = model_id or model.name
        self.config = config or ServerConfig()
        if max_body_bytes is not None:
            self.config = dataclasses.replace(self.config, max_body_bytes=max_body_bytes)
        self.gate = KeyGate(([api_key] if api_key is not None else []) + list(api_keys), self.config)
        self.limits = BodyLimits.of(model, self.config.max_body_bytes)
        self.max_body_bytes = self.limits.body_bytes
        self.metrics = Metrics()
        self.created = int(time.time())
        self.bodies = BodyReader(self.limits)
        self.parser = RequestParser(model, self.model_id)
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
        self.app = Guard(inner, self.config)

    # -- plumbing ---------------------------------------------------------------------------

    @staticmethod
    def request_id(request: Request) -> str:
        return request.scope.get("edge_spec.request_id", "-")

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        path = printable(request.url.path, 100)  # a short prefix: a path may be as long as the headers allow
        message = {404: f"no route {request.method} {path}",
                   405: f"{request.method} is not allowed on {path}"}.get(exc.status_code, str(exc.detail))
        return ApiError(exc.status_code, message, code=code, headers=exc.headers).response()

    async def _internal_error(self, request: Request, exc: Exception) -> Response:
        print(f"edge-spec server: internal error on {printable(request.url.path)} (request {self.request_id(request)}): "
              f"{type(exc).__name__}: {exc}", file=sys.stderr)
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").response()

    def _submit(self, parsed: Parsed, client: str) -> Job:
        try:
            return self.model.submit(prompt_ids=parsed.prompt_ids, options=dataclasses.replace(parsed.options, client=client))
        except QueueFullError as exc:
            raise ApiError(429, f"Server busy: {exc}", type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": "1"}) from None
        except ModelClosedError:
            raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down") from None

    # -- endpoints --------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "model": self.model_id, "busy": self.model.busy,
                             "queue_depth": self.model.queue_depth, "max_queue": self.model.max_queue,
                             "running": self.model.running, "parallel": self.model.parallel})

    async def metrics_endpoint(self, request: Request) -> Response:
        try:
            self.gate.authorize(request.scope)
        except ApiError as exc:
            return exc.response()
        return PlainTextResponse(self.metrics.render(self.model), media_type="text/plain; version=0.0.4")

    def _model_card(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "edge-spec",
                "max_context": self.model.max_context}

    async def list_models(self, request: Request) -> Response:
        try:
            self.gate.authorize(request.scope)
        except ApiError as exc:
            return exc.response()
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def get_model(self, request: Request) -> Response:
        try:
            self.gate.authorize(request.scope)
            if request.path_params["model_id"] != self.model_id:
                raise ApiError(404, f"The model '{request.path_params['model_id'][:100]}' does not exist",
                               param="model", code="model_not_found")
        except ApiError as exc:
            return exc.response()
        return JSONResponse(self._model_card())

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, "completions", self.parser.completion)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, "chat.completions", self.parser.chat)

    async def _generate(self, request: Request, endpoint: str, parse) -> Response:
        began = time.perf_counter()
        status = 200
        try:
            key = self.gate.authorize(request.scope)
            if self.stopping:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            body = await self.bodies.read(request)
            parsed = await parse(body)
            client = client_identity(key, body.get("user"), (request.scope.get("client") or ("-",))[0], self.config)
            chosen, engine = parsed.options.speculation, self.model.engine.config
            request.scope["edge_spec.speculation"] = (f"drafter={(chosen and chosen.drafter) or engine.drafter} "
                                                      f"max_gamma={(chosen and chosen.max_gamma) or engine.max_gamma}")
            job = self._submit(parsed, client)
        except ApiError as exc:
            self.metrics.request(endpoint, exc.status, time.perf_counter() - began)
            return exc.response()
        except ClientGone:
            self.metrics.request(endpoint, 499, time.perf_counter() - began)
            return Response(status_code=499)
        chat = endpoint == "chat.completions"
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        try:
            # Wait for our turn here, so a queue timeout is still a proper 503 and a client
            # that leaves while waiting is noticed.
            if not await unless_disconnected(request, job, job.astart()):
                if self.stopping:
                    raise ModelClosedError()
                raise ClientGone()
            if parsed.stream:
                stream = self._events(job, parsed, ident, chat, request, endpoint, began)
                return EventStream(stream, on_disconnect=lambda: self._disconnected(job))
            result = await unless_disconnected(request, job, job.aresult())
            if result.stop_reason == "cancelled":
                if self.aborting:
                    raise ModelClosedError()
                raise ClientGone()
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
        except ClientGone:
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
        """SIGTERM: take no new generations; running and queued ones, and a chat template still
        rendering, may finish for shutdown_timeout seconds, then are cancelled (streams get a last
        chunk and [DONE]; the render's request a one-line error)."""
        if self.stopping:
            return
        self.stopping = True

        def abort() -> None:
            self.aborting = True
            self.model.cancel_all()
            self.model.engine.tokenizer.stop_renders()

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
