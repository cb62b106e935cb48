"""Reading a request body: Content-Type and size checked as it arrives, then decoded and walked on
a parsing thread, with the lengths the bundle bounds refused before any walk over the items."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor

from starlette.requests import ClientDisconnect, Request

from edge_spec.sampling import SettingError
from runtime.api import Model
from runtime.requests import check_text
from runtime.server.errors import ApiError, ClientGone, value_error

MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 32  # deeper request bodies are refused (a bounded walk, after a parse the recursion limit bounds)


def check_tree(body) -> None:
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


class BodyReader:
    """Reads JSON bodies of at most max_body_bytes, with lengths bounded by the model's context."""

    def __init__(self, max_body_bytes: int, model: Model):
        self.max_body_bytes, self.model = max_body_bytes, model
        # One parsing thread: json.loads and the walks over a body grow with it (a 1 MiB list of
        # ids takes hundreds of milliseconds), so they run here and the event loop keeps answering.
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-parse")

    async def read(self, request: Request) -> dict:
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
            raise ClientGone() from None

        raw = b"".join(chunks)
        return await asyncio.get_running_loop().run_in_executor(self._parse_pool, self.decode, raw)

    def decode(self, raw: bytes) -> dict:
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
        self.check_sizes(body)
        check_tree(body)
        return body

    def check_sizes(self, body: dict) -> None:
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
            raise value_error("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if isinstance(stop, list) and any(isinstance(s, str) and len(s) > MAX_STOP_CHARS for s in stop):
            raise value_error("stop", f"each stop string must have 1 to {MAX_STOP_CHARS} characters")
        bias = body.get("logit_bias")
        if isinstance(bias, dict) and bias:
            raise value_error("logit_bias", f"logit_bias with {len(bias)} entries is not supported by this server "
                                            "(leave it out or use {})")
