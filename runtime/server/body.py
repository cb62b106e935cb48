"""Reading a request body: Content-Type and size checked as it arrives, then decoded and walked on
a parsing thread, with the lengths the bundle bounds refused before any walk over the items."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from starlette.requests import ClientDisconnect, Request

from edge_spec.params import SettingError
from runtime.api import Model
from runtime.requests import check_text
from runtime.server.errors import ApiError, ClientGone, value_error

MAX_STOP_STRINGS = 4  # OpenAI's
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 32  # deeper request bodies are refused (a bounded walk, after a parse the recursion limit bounds)
JSON_BYTES_PER_TEXT_BYTE = 6  # the most JSON one byte of text becomes: a control character as \u0001
MESSAGE_JSON_BYTES = 128  # a message's JSON around its text: {"role": "assistant", "content": "", "name": ...}
OTHER_FIELDS_BYTES = 64 << 10  # every other field at its largest accepted size (stop strings, model, user...)
MAX_DERIVED_BODY_BYTES = 8 << 20  # a bound even for a huge context: a body is held whole while it arrives


@dataclass(frozen=True)
class BodyLimits:
    """What one request to a bundle can need, from its max context, vocabulary and longest token:
    larger bodies (413) and fields (400) are refused before anything is parsed or walked.
    max_body_bytes, when set (ServerConfig / --max-body-bytes), replaces the derived body size."""

    max_context: int
    vocab_size: int
    token_bytes: int  # the most bytes of text one token stands for (BundleTokenizer.max_token_bytes)
    max_body_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_context", "vocab_size", "token_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.max_body_bytes is not None and (isinstance(self.max_body_bytes, bool) or not isinstance(self.max_body_bytes, int)
                                                or self.max_body_bytes < 1):
            raise ValueError(f"max_body_bytes must be an integer >= 1, got {self.max_body_bytes!r}")

    @classmethod
    def of(cls, model: Model, max_body_bytes: int | None = None) -> "BodyLimits":
        return cls(model.max_context, model.vocab_size, model.engine.tokenizer.max_token_bytes, max_body_bytes)

    @property
    def prompt_ids(self) -> int:
        return self.max_context - 1  # a prompt must leave room for one generated token

    @property
    def messages(self) -> int:
        return self.max_context  # each message takes at least one token

    @property
    def text_bytes(self) -> int:
        return self.max_context * self.token_bytes

    @property
    def stop_chars(self) -> int:
        return min(MAX_STOP_CHARS, self.text_bytes)  # a longer stop string could never be generated

    @property
    def derived_body_bytes(self) -> int:
        """The larger of a prompt's ids (digits and ", " each) and its text at the longest JSON
        escape with a message's JSON per context token, plus the other fields."""
        ids = self.prompt_ids * (len(str(self.vocab_size - 1)) + 2)
        text = self.text_bytes * JSON_BYTES_PER_TEXT_BYTE + self.messages * MESSAGE_JSON_BYTES
        return min(max(ids, text) + OTHER_FIELDS_BYTES, MAX_DERIVED_BODY_BYTES)

    @property
    def body_bytes(self) -> int:
        return self.derived_body_bytes if self.max_body_bytes is None else self.max_body_bytes

    def too_large(self) -> str:
        """The one-line 413 message, naming the limit and where it comes from."""
        if self.max_body_bytes is not None:
            return f"request body is over {self.body_bytes} bytes (the server's --max-body-bytes)"
        return (f"request body is over {self.body_bytes} bytes, the most a request to this model can need (max context "
                f"{self.max_context} tokens of up to {self.token_bytes} bytes, {self.vocab_size} token ids)")


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
    """Reads JSON bodies of at most limits.body_bytes, with lengths bounded by the bundle (BodyLimits)."""

    def __init__(self, limits: BodyLimits):
        self.limits = limits
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
        limit = self.limits.body_bytes
        if declared and declared.isdigit() and int(declared) > limit:
            raise ApiError(413, self.limits.too_large(), code="request_too_large")
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, self.limits.too_large(), code="request_too_large")
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
        """Lengths the bundle and the API bound (BodyLimits), checked before any walk over the
        items: token ids no more than the context holds, no more messages than it has tokens, at
        most MAX_STOP_STRINGS stop strings of limits.stop_chars, logit_bias only empty (the one value accepted)."""
        limits = self.limits
        context = limits.max_context
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list) and len(prompt) > limits.prompt_ids:
            raise ApiError(400, f"This model's maximum context length is {context} tokens, but the prompt has "
                                f"{len(prompt)} tokens; shorten the prompt", param="prompt", code="context_length_exceeded")
        messages = body.get("messages")
        if isinstance(messages, list) and len(messages) > limits.messages:
            raise ApiError(400, f"This model's maximum context length is {context} tokens: {len(messages)} messages "
                                "cannot fit", param="messages", code="context_length_exceeded")
        stop = body.get("stop")
        if isinstance(stop, list) and len(stop) > MAX_STOP_STRINGS:
            raise value_error("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stop)}")
        if any(isinstance(s, str) and len(s) > limits.stop_chars for s in (stop if isinstance(stop, list) else [stop])):
            raise value_error("stop", f"each stop string must have 1 to {limits.stop_chars} characters")
        bias = body.get("logit_bias")
        if isinstance(bias, dict) and bias:
            raise value_error("logit_bias", f"logit_bias with {len(bias)} entries is not supported by this server "
                                            "(leave it out or use {})")
