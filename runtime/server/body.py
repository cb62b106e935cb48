"""Reading a request body: Content-Type and size checked as it arrives, then decoded and walked off
the event loop (a parsing thread for small bodies, a parsing process for large ones), with the
lengths the bundle bounds refused before any walk over the items."""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import pickle
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from starlette.requests import ClientDisconnect, Request

from edge_spec.params import SettingError
from runtime.api import Model
from runtime.requests import check_text
from runtime.server.errors import ApiError, ClientGone, printable, value_error

MAX_STOP_STRINGS = 4  # OpenAI's
MAX_STOP_CHARS = 256
MAX_JSON_DEPTH = 32  # deeper request bodies are refused (a bounded walk, after a parse the recursion limit bounds)
JSON_BYTES_PER_TEXT_BYTE = 6  # the most JSON one byte of text becomes: a control character as \u0001
MESSAGE_JSON_BYTES = 128  # a message's JSON around its text: {"role": "assistant", "content": "", "name": ...}
OTHER_FIELDS_BYTES = 64 << 10  # every other field at its largest accepted size (stop strings, model, user...)
MAX_DERIVED_BODY_BYTES = 8 << 20  # a bound even for a huge context: a body is held whole while it arrives
# Larger bodies are decoded in the parsing process: json.loads holds the GIL from start to end
# (an 8 MiB list of ids, 200-300 ms), which a thread cannot hide from the event loop.
PROCESS_PARSE_BYTES = 256 << 10
MAX_BODY_FIELDS = 64  # top-level fields: every endpoint takes fewer than 40
VALUES_PER_TOKEN = 8  # JSON values under prompt or messages per context token: a message is 4, a text part 3
MAX_OTHER_VALUES = 1024  # JSON values under any other field (stop strings, speculation, stream_options...)


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
    def values(self) -> int:
        """The most JSON values `prompt` or `messages` may hold: a body the parsing process passes
        back is bounded by this, not by its size in bytes."""
        return VALUES_PER_TOKEN * self.max_context

    @property
    def body_bytes(self) -> int:
        return self.derived_body_bytes if self.max_body_bytes is None else self.max_body_bytes

    def too_large(self) -> str:
        """The one-line 413 message, naming the limit and where it comes from."""
        if self.max_body_bytes is not None:
            return f"request body is over {self.body_bytes} bytes (the server's --max-body-bytes)"
        return (f"request body is over {self.body_bytes} bytes, the most a request to this model can need (max context "
                f"{self.max_context} tokens of up to {self.token_bytes} bytes, {self.vocab_size} token ids)")


def check_tree(body) -> dict[str, int]:
    """Walks the parsed body without recursion: refuses nesting deeper than MAX_JSON_DEPTH and
    strings that are not Unicode text (a lone surrogate escape such as "\\ud800"). Returns the
    number of JSON values under each top-level field."""
    stack = [(body, 1, "body", None)]
    values: dict[str, int] = {}
    while stack:
        value, depth, where, field = stack.pop()
        if field is not None:
            values[field] = values.get(field, 0) + 1
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"the JSON body is nested too deeply (at most {MAX_JSON_DEPTH} levels)", code="invalid_json")
        if isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, where)
                stack.append((item, depth + 1, key if where == "body" else f"{where}.{key}", key if field is None else field))
        elif isinstance(value, list):
            stack.extend((item, depth + 1, f"{where}[{i}]", field) for i, item in enumerate(value))
        elif isinstance(value, str):
            _check_text(value, where)
    return values


def _check_text(value: str, where: str) -> None:
    if value.isascii():
        return  # ASCII is always text: most strings skip the call
    where = printable(where, 80)  # a path through the body names keys the client chose
    try:
        check_text(value, where)  # the API's own check
    except SettingError as exc:
        raise ApiError(400, str(exc), param=None if where == "body" else where, code=exc.code) from None


def decode_body(raw: bytes, limits: BodyLimits) -> dict:
    """The body as a checked JSON object, on the parsing thread or in the parsing process. Fields
    whose size the bundle bounds are refused by their length before anything walks their items,
    and a body is returned only if it holds few enough values to pass back cheaply."""

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
    check_sizes(body, limits)
    for field, count in check_tree(body).items():
        _check_values(field, count, limits.values if field in ("prompt", "messages") else MAX_OTHER_VALUES)
    return body


def _check_values(field: str, count: int, bound: int) -> None:
    if count > bound:
        name = printable(field, 40)
        raise ApiError(413, f"{name} holds {count} JSON values, more than a request to this model can need (at most "
                            f"{bound})", param=name, code="request_too_large")


def check_sizes(body: dict, limits: BodyLimits) -> None:
    """Lengths the bundle and the API bound (BodyLimits), checked before any walk over the
    items: token ids no more than the context holds, no more messages than it has tokens, at
    most MAX_STOP_STRINGS stop strings of limits.stop_chars, logit_bias only empty (the one value
    accepted), at most MAX_BODY_FIELDS fields and MAX_OTHER_VALUES items in any other array or object."""
    if len(body) > MAX_BODY_FIELDS:
        raise ApiError(400, f"the body has {len(body)} fields; a request takes at most {MAX_BODY_FIELDS}",
                       code="unknown_parameter")
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
    for field, value in body.items():
        if isinstance(value, (list, dict)):
            _check_values(field, len(value), limits.values if field in ("prompt", "messages") else MAX_OTHER_VALUES)


def _write_frame(stream, data: bytes) -> None:
    stream.write(len(data).to_bytes(8, "big"))
    stream.write(data)
    stream.flush()


def _read_frame(stream) -> bytes:
    head = stream.read(8)
    data = stream.read(int.from_bytes(head, "big")) if len(head) == 8 else b""
    if len(head) < 8 or len(data) < int.from_bytes(head, "big"):
        raise EOFError("the parsing process's pipe ended")
    return data


def serve_parsing() -> None:
    """The parsing process's loop: a pickled (raw, limits) in, ("ok", body) or ("error",
    exception) out, each as a length-prefixed frame, until its input ends (the server is gone)."""
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print goes to stderr, never into a reply
    while True:
        try:
            raw, limits = pickle.loads(_read_frame(sys.stdin.buffer))
        except EOFError:
            return
        try:
            reply = ("ok", decode_body(raw, limits))
        except ApiError as exc:
            reply = ("error", exc)
        except Exception as exc:  # reported to the request as a 500, and the process keeps parsing
            reply = ("error", RuntimeError(f"parsing process: {type(exc).__name__}: {str(exc)[:200]}"))
        _write_frame(replies, pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))


class ParsingProcess:
    """A child interpreter that decodes bodies over PROCESS_PARSE_BYTES: json.loads holds the GIL
    from start to end, so only another process keeps it from the event loop. A plain
    `python -c` child, not multiprocessing's spawn, which would run an unguarded main script
    again; started on first use, restarted after it ends. Where no interpreter can be started
    (an embedded Python), bodies are decoded in the calling thread instead."""

    CHILD = "import sys; sys.path.insert(0, sys.argv[1]); from runtime.server.body import serve_parsing; serve_parsing()"

    def __init__(self):
        self._lock = threading.Lock()  # one body at a time through the pipes
        self._proc: subprocess.Popen | None = None
        self._unavailable = False

    def decode(self, raw: bytes, limits: BodyLimits) -> dict:
        """decode_body(raw, limits), run in the child (call from a worker thread: this blocks)."""
        payload = pickle.dumps((raw, limits), pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._unavailable:
                return decode_body(raw, limits)
            if self._proc is not None and self._proc.poll() is not None:
                _end(self._proc)  # ended since the last body (killed, out of memory): start a new one
                self._proc = None
            if self._proc is None:
                root = str(Path(__file__).resolve().parents[2])  # where `runtime` is imported from
                try:
                    self._proc = subprocess.Popen([sys.executable, "-c", self.CHILD, root], stdin=subprocess.PIPE,
                                                  stdout=subprocess.PIPE)
                except OSError as exc:
                    self._unavailable = True
                    print(f"edge-spec server: no parsing process ({exc}); large bodies are decoded on the parsing "
                          "thread", file=sys.stderr)
                    return decode_body(raw, limits)
            proc = self._proc
            try:
                _write_frame(proc.stdin, payload)
                kind, value = pickle.loads(_read_frame(proc.stdout))
            except (OSError, EOFError):
                self._proc = None  # the next body starts a new one
                _end(proc)
                raise ApiError(503, "the body parsing process ended (out of memory?); retry the request", type="server_error",
                               code="parser_restarted", headers={"Retry-After": "1"}) from None
        if kind == "ok":
            return value
        raise value

    def close(self) -> None:
        with self._lock:
            proc, self._proc = self._proc, None
        if proc is not None:
            _end(proc)


def _end(proc: subprocess.Popen) -> None:
    """Ends the child: its input closes (its loop returns), else it is killed."""
    try:
        proc.stdin.close()
    except OSError:
        pass  # a child that died mid-frame: what was left unwritten goes nowhere
    try:
        proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.stdout.close()


_parsing_process = ParsingProcess()  # one per server process, shared by its BodyReaders
atexit.register(_parsing_process.close)


class BodyReader:
    """Reads JSON bodies of at most limits.body_bytes, with lengths bounded by the bundle (BodyLimits)."""

    def __init__(self, limits: BodyLimits):
        self.limits = limits
        # One parsing thread for bodies up to PROCESS_PARSE_BYTES (json.loads of those holds the
        # GIL for milliseconds); larger ones wait for the parsing process on a thread of their own,
        # so small bodies never queue behind them.
        self._parse_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-parse")
        self._process_pool = ThreadPoolExecutor(1, thread_name_prefix="edge-spec-parse-process")

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
        loop = asyncio.get_running_loop()
        if len(raw) <= PROCESS_PARSE_BYTES:
            return await loop.run_in_executor(self._parse_pool, self.decode, raw)
        return await loop.run_in_executor(self._process_pool, _parsing_process.decode, raw, self.limits)

    def decode(self, raw: bytes) -> dict:
        """decode_body with this reader's limits (on the parsing thread)."""
        return decode_body(raw, self.limits)
