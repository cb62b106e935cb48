"""Bodies under several clients (issue 54): a body of any accepted size is decoded off the event
loop (large ones in the parsing process, since json.loads holds the GIL), what is passed back is
bounded, errors name a field by its type and size or a short prefix (never the whole input), a
number too large for a float is a 400 / ValueError naming its field, the access log escapes control
characters, Content-Length with Transfer-Encoding closes the connection, and `cancel` takes only
an Event. A stub model stands in for a bundle where the test needs no weights.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("uvicorn")

from edge_spec.params import SettingError, params, shown  # noqa: E402
from edge_spec.sampling import SamplingConfig  # noqa: E402
from runtime.api import Model  # noqa: E402
from runtime.engine import check_prompt  # noqa: E402
from runtime.requests import Options  # noqa: E402
from runtime.server import Server, ServerConfig  # noqa: E402
from runtime.server.body import MAX_BODY_FIELDS, MAX_OTHER_VALUES, PROCESS_PARSE_BYTES  # noqa: E402
from runtime.server.errors import ApiError, echo, printable, type_error  # noqa: E402
from tests.test_server import KEY, request, serving  # noqa: E402
from tests.test_server_hardening import closed_within, model  # noqa: E402,F401 (model: the tiny bundle's Model)
from tests.test_server_limits import asgi_post  # noqa: E402
from tests.test_server_networks import asgi_get, stub_model  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CAP = 8 << 20  # the largest body the server accepts without --max-body-bytes


def parsing_model() -> SimpleNamespace:
    """The stub, plus what parsing a request reads: the engine's own prompt check (vocab 400, context 64)."""
    stub = stub_model()
    stub.check_prompt = lambda ids: check_prompt(ids, stub.vocab_size, stub.max_context)
    stub.has_chat_template = False
    stub.engine.check_speculation = lambda speculation: None
    return stub


def body_of(prefix: bytes, item: bytes, suffix: bytes, size: int = CAP) -> bytes:
    """prefix + item repeated + suffix, as close to `size` bytes as the item allows."""
    return prefix + item * ((size - len(prefix) - len(suffix)) // len(item)) + suffix


def keyed(prefix: bytes, suffix: bytes, size: int = CAP) -> bytes:
    n = (size - len(prefix) - len(suffix)) // 15
    return prefix + b",".join(b'"k%09d":1' % i for i in range(n)) + suffix


SHAPES = {  # the hostile 8 MiB bodies of issue 54
    "id_list": lambda: body_of(b'{"prompt":[1', b",1", b"]}"),
    "unknown_keys": lambda: keyed(b"{", b"}"),
    "prompt_dict": lambda: keyed(b'{"prompt":{', b"}}"),
    "list_in_another_field": lambda: body_of(b'{"prompt":[1],"speculation":[1', b",1", b"]}"),
}


@pytest.fixture(scope="module")
def served():
    """A stub server that takes 8 MiB bodies, in a thread: (server, port)."""
    server = Server(parsing_model(), api_keys=(KEY,), config=ServerConfig(max_body_bytes=CAP))
    with serving(server) as (port, _):
        yield server, port


# -- 1. bodies never block the event loop --------------------------------------------------------

def test_large_bodies_are_decoded_in_the_parsing_process(monkeypatch):
    decoded_here = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, **kw: decoded_here.append(len(s)) or loads(s, **kw))
    server = Server(parsing_model(), config=ServerConfig(max_body_bytes=CAP))
    status, body = asgi_post(server, SHAPES["id_list"]())
    assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
    assert "but the prompt has 4194298 tokens" in body["error"]["message"]
    assert not [n for n in decoded_here if n > PROCESS_PARSE_BYTES], "an 8 MiB body was decoded in the server's process"


def test_the_parsing_process_is_started_again_after_it_ends():
    import runtime.server.body as body_module

    server = Server(parsing_model(), config=ServerConfig(max_body_bytes=CAP))
    raw = body_of(b'{"prompt":[1', b",1", b"]}", PROCESS_PARSE_BYTES + 64)
    for _ in range(2):
        status, body = asgi_post(server, raw)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded", body
        child = body_module._parsing_process._proc
        child.kill()  # as the kernel's OOM killer would
        child.wait()  # the next body is parsed by a new child, not refused with a 503


@pytest.mark.parametrize("shape", list(SHAPES))
def test_health_answers_while_a_max_size_body_is_parsed(served, shape):
    _, port = served
    raw = SHAPES[shape]()
    assert CAP - 16 <= len(raw) <= CAP
    request(port, "POST", "/v1/completions", body_of(b'{"prompt":[1', b",1", b"]}", PROCESS_PARSE_BYTES + 64))  # the parsing process is up
    answer = []
    poster = threading.Thread(target=lambda: answer.append(request(port, "POST", "/v1/completions", raw, timeout=60)))
    poster.start()
    latencies = []
    while poster.is_alive():
        began = time.perf_counter()
        assert request(port, "GET", "/health", key=None, timeout=30)[0] == 200
        latencies.append(time.perf_counter() - began)
        time.sleep(0.005)
    poster.join()
    status, _, body = answer[0]
    assert 400 <= status < 500 and len(json.dumps(body)) < 400, (status, str(body)[:400])
    assert latencies and max(latencies) < 0.2, f"/health took {max(latencies) * 1e3:.0f} ms while a {shape} body was parsed"


@pytest.mark.parametrize("extra, param, status", [
    ({"speculation": {"drafter": ["x"] * (MAX_OTHER_VALUES + 1)}}, "speculation", 413),
    ({"user": list(range(MAX_OTHER_VALUES + 1))}, "user", 413),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 200}]}, "messages", 413),
    ({f"k{i}": 1 for i in range(MAX_BODY_FIELDS + 1)}, None, 400),
])
def test_what_the_parsing_process_passes_back_is_bounded(extra, param, status):
    server = Server(parsing_model())
    with pytest.raises(ApiError) as caught:
        server.bodies.decode(json.dumps({"prompt": [1], **extra}).encode())
    error = caught.value
    assert (error.status, error.param) == (status, param), error.message
    assert len(error.message) < 200 and "\n" not in error.message


# -- error messages never serialize the input ----------------------------------------------------

class Unprintable(list):
    def __repr__(self):
        raise AssertionError("the whole input was serialized")


def test_error_messages_name_a_type_and_size_never_the_input():
    assert shown(Unprintable([1, 2, 3])) == "a Unprintable of 3 items"
    assert shown({"a": 1, "b": 2}) == "a dict of 2 items"
    assert shown("x" * 10**6) == "'" + "x" * 38 + "…" and shown(10**5000).startswith("an integer of about 5001 digits")
    assert len(shown(int("9" * 4000))) == 40 and shown(int("9" * 4000)).endswith("…")
    message = type_error("prompt", "a string or a list of token ids", [object()] * 10**6).message
    assert message == "prompt must be a string or a list of token ids, got an array of 1000000 items"
    assert echo({"k": [1]}) == "an object of 1 keys" and echo("y" * 100) == '"' + "y" * 40 + '"…' and echo(None) == "null"


@pytest.mark.parametrize("extra, fragment", [
    ({"prompt": {f"k{i}": 1 for i in range(500)}}, "got an object of 500 keys"),
    ({"n": list(range(1000))}, "n=an array of 1000 items is not supported"),
    ({"speculation": list(range(1000))}, "got a list of 1000 items"),
    ({"stream_options": ["x" * 5000]}, "got an array of 1 items"),
])
def test_server_errors_quote_a_type_and_size(extra, fragment):
    status, body = asgi_post(Server(parsing_model()), json.dumps({"prompt": [1], **extra}).encode())
    assert status == 400 and fragment in body["error"]["message"], body
    assert len(json.dumps(body)) < 300


def test_a_404_and_a_token_id_echo_only_a_short_prefix():
    server = Server(parsing_model())
    status, body = asgi_get(server, "/" + "a" * 20_000, "127.0.0.1", None)
    assert status == 404 and len(body["error"]["message"]) < 130 and body["error"]["message"].endswith("…"), body
    status, body = asgi_post(server, json.dumps({"prompt": [1, int("9" * 4000)]}).encode())
    message = body["error"]["message"]
    assert status == 400 and body["error"]["param"] == "prompt" and len(message) < 120, message[:200]
    assert message.startswith("token id 999") and "…" in message and "outside the vocabulary [0, 400)" in message


# -- 2. numbers too large for a float --------------------------------------------------------------

FLOAT_SETTINGS = [name for name, p in params(Options).items() if p.kind is float]


def test_the_float_settings_are_covered():
    assert {"temperature", "top_p"} <= set(FLOAT_SETTINGS)


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_a_huge_integer_setting_is_a_400_naming_it(name):
    status, body = asgi_post(Server(parsing_model()), json.dumps({"prompt": [1], name: 10**400}).encode())
    assert status == 400 and body["error"]["param"] == name and body["error"]["code"] == "invalid_value", body
    assert len(body["error"]["message"]) < 120 and "\n" not in body["error"]["message"]


@pytest.mark.parametrize("name", FLOAT_SETTINGS)
def test_a_huge_integer_setting_is_a_value_error_naming_it_in_the_api(name):
    for build in (lambda: Options(**{name: 10**400}), lambda: SamplingConfig(**{name: -(10**400)}),
                  lambda: Model.submit(SimpleNamespace(_closed=False), "hi", **{name: 10**400})):
        with pytest.raises(ValueError) as caught:
            build()
        assert isinstance(caught.value, SettingError) and caught.value.param == name
        assert str(caught.value).startswith(f"{name} must be a number") and len(str(caught.value)) < 120


# -- 3. the small ones ---------------------------------------------------------------------------------

def test_control_characters_in_a_path_cannot_forge_an_access_log_line(served, caplog):
    _, port = served
    with caplog.at_level(logging.INFO, logger="edge_spec.access"):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /x%0d%0a127.0.0.1:1%20%22GET%20/admin%22%20200%0a HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                         b"Connection: close\r\n\r\n")
            assert closed_within(sock, 5)[1].startswith(b"HTTP/1.1 404")
        deadline = time.monotonic() + 5
        while not [r for r in caplog.records if r.name == "edge_spec.access"] and time.monotonic() < deadline:
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "edge_spec.access"]
    assert lines and not any(c in line for line in lines for c in "\r\n"), lines
    assert any('"GET /x\\r\\n127.0.0.1:1 "GET /admin" 200\\n HTTP/1.1" 404' in line for line in lines), lines
    assert printable("a\x1b[2Jb\u2028" + "z" * 500) == "a\\x1b[2Jb\\u2028" + "z" * 192 + "…"


def test_content_length_with_transfer_encoding_is_refused_and_the_connection_closed(served):
    _, port = served
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"
                     b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        closed, got = closed_within(sock, 5)
    assert closed, "the connection stayed open for another request"
    assert got.startswith(b"HTTP/1.1 400") and got.count(b"HTTP/1.1 ") == 1, got
    assert b"Connection: close" in got and b'"code": "ambiguous_framing"' in got, got


def test_cancel_takes_an_event_not_a_bool(model):  # noqa: F811 (the imported fixture)
    with pytest.raises(TypeError, match=r"^cancel must be a threading.Event \(set it to cancel\) or None, got True$"):
        model.generate("the cat", max_tokens=2, cancel=True)
    assert model.generate("the cat", max_tokens=2, cancel=threading.Event()).stop_reason in ("length", "eos")


def test_the_docs_name_the_fields_health_returns():
    _, health = asgi_get(Server(stub_model()), "/health", "127.0.0.1", None)
    row = next(line for line in (ROOT / "docs" / "serving.md").read_text().splitlines() if line.startswith("| `GET /health`"))
    documented = set(re.findall(r'"(\w+)"', re.sub(r':\s*"\w*"', "", row.split("|")[2])))  # the names, not "ok"
    assert documented == set(health), (sorted(documented), sorted(health))
