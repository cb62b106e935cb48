"""Request limits that scale with the bundle (runtime/server/body.py, BodyLimits): the body size,
checked before parsing, and the lengths of prompt ids, messages and stop strings, checked before
any walk, all from the bundle's max context, vocabulary and longest token; each refusal is one
line naming the limit. A stub model stands in for a bundle (no sessions), so this file is fast.
"""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("uvicorn")

from runtime.server import BodyLimits, Server, ServerConfig  # noqa: E402
from runtime.server.body import MAX_DERIVED_BODY_BYTES, MAX_STOP_CHARS  # noqa: E402
from runtime.server.errors import ApiError  # noqa: E402
from tests.test_server_networks import _serve_config, stub_model  # noqa: E402


def asgi_post(server: Server, body: bytes, declare_length: bool = True, chunk: int = 1 << 16) -> tuple[int, dict]:
    """(status, JSON body) of POST /v1/completions from loopback, the body sent in chunks."""
    headers = [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")]
    if declare_length:
        headers.append((b"content-length", str(len(body)).encode()))
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
             "headers": headers, "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000)}
    parts = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    sent = []

    async def receive():
        return {"type": "http.request", "body": parts.pop(0), "more_body": bool(parts)}

    async def send(message):
        sent.append(message)

    asyncio.run(server.app(scope, receive, send))
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, json.loads(b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body"))


def refused(server: Server, body: dict) -> ApiError:
    """The error BodyReader.decode raises for `body` (the parsing thread's check, called directly)."""
    with pytest.raises(ApiError) as caught:
        server.bodies.decode(json.dumps(body).encode())
    return caught.value


def test_limits_scale_with_the_bundle():
    small, large = BodyLimits(64, 400, 8), BodyLimits(4096, 151_936, 8)
    assert (small.prompt_ids, small.messages, small.text_bytes) == (63, 64, 512)
    assert (large.prompt_ids, large.messages, large.text_bytes) == (4095, 4096, 32_768)
    assert small.body_bytes < 128 << 10 < large.body_bytes < 1 << 20
    assert BodyLimits(16, 400, 4).stop_chars == 64 and small.stop_chars == MAX_STOP_CHARS
    assert BodyLimits(1 << 20, 1 << 20, 256).body_bytes == MAX_DERIVED_BODY_BYTES
    assert BodyLimits(64, 400, 8, max_body_bytes=5000).body_bytes == 5000
    for bad in ({"max_context": 0}, {"vocab_size": True}, {"token_bytes": "8"}, {"max_body_bytes": 0}):
        with pytest.raises(ValueError, match="must be an integer >= 1"):
            BodyLimits(**{"max_context": 64, "vocab_size": 400, "token_bytes": 8, **bad})


@pytest.mark.parametrize("context, vocab, token_bytes", [(64, 400, 8), (2048, 49_152, 16), (512, 262_144, 64),
                                                       (4096, 10**200, 1)])  # ids' digits dominate
def test_the_largest_request_the_bundle_can_take_fits_in_the_body_limit(context, vocab, token_bytes):
    limits = BodyLimits(context, vocab, token_bytes)
    text = "\x01" * limits.text_bytes  # what the context can hold, as JSON's longest escape
    per_message = "\x01" * (limits.text_bytes // limits.messages)
    stop = ["\x01" * limits.stop_chars] * 4
    for body in ({"prompt": text, "stop": stop, "max_tokens": 1, "user": "u" * 256, "model": "m" * 256},
                 {"prompt": [vocab - 1] * limits.prompt_ids, "stop": stop},
                 {"messages": [{"role": "assistant", "content": per_message, "name": "n" * 64}] * limits.messages, "stop": stop}):
        assert len(json.dumps(body)) <= limits.body_bytes, (list(body), len(json.dumps(body)), limits.body_bytes)


def test_a_body_over_the_bundle_s_limit_is_a_413_naming_it_before_parsing():
    server = Server(stub_model())
    limit = server.limits.body_bytes
    assert limit == BodyLimits(64, 400, 8).body_bytes < 128 << 10  # the tiny bundle needs far less than 1 MiB
    over = b'{"prompt": "' + b"x" * limit + b'"}'
    for declare in (True, False):  # refused by Content-Length, and as the body arrives without one
        status, body = asgi_post(server, over, declare_length=declare)
        message = body["error"]["message"]
        assert status == 413 and body["error"]["code"] == "request_too_large", body
        assert f"over {limit} bytes" in message and "max context 64 tokens of up to 8 bytes, 400 token ids" in message
        assert "\n" not in message
    status, body = asgi_post(server, json.dumps({"prompt": [1] * 64, "padding": " " * (limit - 400)}).encode())
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body  # at the limit: parsed


def test_prompt_ids_messages_and_stop_strings_are_bounded_by_the_context():
    server = Server(stub_model())
    for body, param, fragment in (
        ({"prompt": [1] * 64}, "prompt", "maximum context length is 64 tokens, but the prompt has 64 tokens"),
        ({"prompt": [[1] * 64]}, "prompt", "the prompt has 64 tokens"),
        ({"messages": [{"role": "user", "content": "a"}] * 65}, "messages", "65 messages cannot fit"),
        ({"stop": ["a"] * 5}, "stop", "at most 4 strings, got 5"),
        ({"stop": ["a", "b" * (MAX_STOP_CHARS + 1)]}, "stop", f"1 to {MAX_STOP_CHARS} characters"),
        ({"stop": "b" * (MAX_STOP_CHARS + 1)}, "stop", f"1 to {MAX_STOP_CHARS} characters"),
    ):
        error = refused(server, body)
        assert error.param == param and fragment in error.message and "\n" not in error.message, (body, error.message)
    for body in ({"prompt": [1] * 63}, {"prompt": [[1] * 63]}, {"messages": [{"role": "user", "content": "a"}] * 64},
                 {"stop": ["a"] * 4}, {"stop": "b" * MAX_STOP_CHARS}):
        assert server.bodies.decode(json.dumps(body).encode()) == body


def test_max_body_bytes_sets_the_limit_from_the_command_line(monkeypatch, capsys):
    import runtime.__main__ as cli

    assert _serve_config(monkeypatch).max_body_bytes is None  # the default: derived from the bundle
    config = _serve_config(monkeypatch, "--max-body-bytes", "4096")
    assert config.max_body_bytes == 4096
    status, body = asgi_post(Server(stub_model(), config=config), b'{"prompt": "' + b"x" * 4096 + b'"}')
    assert status == 413 and body["error"]["message"] == "request body is over 4096 bytes (the server's --max-body-bytes)"
    with pytest.raises(SystemExit) as exited:
        cli.main(["serve", "bundle", "--max-body-bytes", "0"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "max_body_bytes must be an integer >= 1" in err
    with pytest.raises(ValueError, match="max_body_bytes must be an integer >= 1"):
        ServerConfig(max_body_bytes=True)
