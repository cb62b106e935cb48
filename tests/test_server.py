"""The OpenAI-compatible server, driven by the official `openai` client on 127.0.0.1.

Two servers: `python -m runtime serve` in a child process (the CLI as users run it; its RSS is
watched under load), and one in a thread of this process over a Model the tests can steer
(hold the engine, slow it down) so queueing, timeouts and disconnects are deterministic.
Every count and wait is bounded; nothing listens beyond loopback.
"""

from __future__ import annotations

import http.client
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

from edge_spec.sampling import SamplingConfig  # noqa: E402
from runtime.api import Model  # noqa: E402
from runtime.engine import Engine, EngineConfig, GenerateConfig  # noqa: E402
from runtime.server import Server, bind, check_bind, is_loopback, make_uvicorn  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
KEY = "sk-edge-spec-test-key"
WORDS = ("the a cat dog sat on mat and ran fast slow red blue green tree house river stone quick brown fox jumps "
         "over lazy bird sings song morning night light dark water fire print def return import class self value").split()


# -- servers --------------------------------------------------------------------------------------

@dataclass
class Served:
    base_url: str
    port: int
    model_id: str
    proc: subprocess.Popen | None = None
    model: Model | None = None

    def client(self, key: str | None = KEY, timeout: float = 30.0):
        return openai.OpenAI(base_url=self.base_url, api_key=key or "none", max_retries=0, timeout=timeout)

    def raw(self, method: str, path: str, body=None, key: str | None = KEY, headers: dict | None = None, timeout=30.0):
        """(status, parsed JSON or text) of one plain HTTP request."""
        status, _, parsed = request(self.port, method, path, body, headers, key, timeout)
        return status, parsed

    def metric(self, name: str, labels: str = "") -> float:
        status, text = self.raw("GET", "/metrics")
        assert status == 200
        for line in text.splitlines():
            if line.startswith(f"edge_spec_{name}{labels} "):
                return float(line.split()[-1])
        raise AssertionError(f"no metric edge_spec_{name}{labels} in /metrics")


def request(port, method, path, body=None, headers=None, key=KEY, timeout=10.0):
    """(status, headers, parsed JSON or text) of one plain HTTP request to 127.0.0.1:port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
        sent = {"Content-Type": "application/json", **(headers or {})}
        if key:
            sent["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=data, headers=sent)
        response = conn.getresponse()
        text = response.read().decode()
        try:
            parsed = json.loads(text)
        except ValueError:
            parsed = text
        return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed
    finally:
        conn.close()


def _child_env() -> dict:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    env.pop("EDGE_SPEC_API_KEY", None)
    return env


def start_child(bundle: Path, log: Path, *args: str, ready_s: float = 120.0) -> Served:
    cmd = [sys.executable, "-m", "runtime", "serve", str(bundle), "--provider", "cpu", "--threads", "1", "--port", "0", *args]
    err = open(log, "w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_child_env(), stdout=subprocess.PIPE, stderr=err, text=True)
    err.close()
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
    deadline = time.monotonic() + ready_s
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            stop_child(proc)
            pytest.fail(f"server did not start in {ready_s:.0f} s; stderr:\n{log.read_text()[-3000:]}")
        if "serving" in line:
            break
    port = int(line.split("http://127.0.0.1:")[1].split("/")[0])
    model_id = line.split("'")[1]
    served = Served(f"http://127.0.0.1:{port}/v1", port, model_id, proc=proc)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the socket listens before uvicorn accepts: wait for /health
        try:
            if served.raw("GET", "/health", timeout=2)[0] == 200:
                return served
        except OSError:
            time.sleep(0.1)
    stop_child(proc)
    pytest.fail(f"server never answered /health; stderr:\n{log.read_text()[-3000:]}")


def stop_child(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@contextmanager
def serving(server: Server):
    """server on 127.0.0.1, any free port, in a thread: yields (port, uvicorn server)."""
    sock = bind("127.0.0.1", 0)
    uv = make_uvicorn(server)
    thread = threading.Thread(target=uv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not uv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "in-thread server did not start"
        time.sleep(0.02)
    try:
        yield sock.getsockname()[1], uv
    finally:
        uv.should_exit = True
        thread.join(timeout=20)
        sock.close()


@contextmanager
def in_thread(model: Model, key: str | None = KEY):
    server = Server(model, api_key=key)
    with serving(server) as (port, _):
        yield Served(f"http://127.0.0.1:{port}/v1", port, server.model_id, model=model)


@contextmanager
def slow_target(model: Model, seconds: float):
    """Every target pass takes at least `seconds` longer (an instance attribute shadows score)."""
    runner = model.engine.target
    original = runner.score

    def slow(*args, **kwargs):
        time.sleep(seconds)
        return original(*args, **kwargs)

    runner.score = slow
    try:
        yield
    finally:
        del runner.score


def wait_until(condition, timeout: float, what: str) -> float:
    began = time.monotonic()
    while not condition():
        if time.monotonic() - began > timeout:
            pytest.fail(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - began


# -- fixtures -------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(llama_bundle, tmp_path_factory):
    server = start_child(llama_bundle, tmp_path_factory.mktemp("serve") / "stderr.log", "--api-key", KEY, "--max-queue", "8")
    yield server
    stop_child(server.proc)


@pytest.fixture(scope="module")
def reference(llama_bundle):
    """Plain greedy decoding in this process: what every server answer must equal."""
    engine = Engine(llama_bundle, EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False))

    def greedy(prompt=None, messages=None, max_tokens=16, stop=()):
        ids = engine.encode(prompt=prompt, messages=messages)
        return engine.generate(ids, GenerateConfig(max_tokens, SamplingConfig(), tuple(stop)))

    greedy.engine = engine
    return greedy


@pytest.fixture(scope="module")
def clean(reference):
    """Prompts whose greedy answer starts with 8 plain printable characters (so stop strings
    can be picked from it and streamed pieces are easy to compare)."""
    found = []
    for i in range(200):
        prompt = " ".join(WORDS[(i * 7 + j * 5) % len(WORDS)] for j in range(3 + i % 3))
        text = reference(prompt=prompt, max_tokens=16).text
        if len(text) >= 8 and text[:8].isascii() and text[:8].isprintable():
            found.append((prompt, text))
        if len(found) == 3:
            return found
    pytest.fail("no prompt with a printable greedy answer among 200")


@pytest.fixture(scope="module")
def steerable(llama_bundle):
    model = Model.load(llama_bundle, engine_config=EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False),
                       max_queue=1, queue_timeout=1.0)
    with in_thread(model) as server:
        yield server
    model.close()


# -- the API surface ------------------------------------------------------------------------------

def test_models_list_and_retrieve(served):
    client = served.client()
    models = client.models.list()
    assert [m.id for m in models.data] == [served.model_id] == ["llama-fp32"]
    assert client.models.retrieve(served.model_id).id == served.model_id
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_completion_equals_greedy_with_usage(served, reference, clean):
    client = served.client()
    for prompt, _ in clean:
        expected = reference(prompt=prompt, max_tokens=12)
        r = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=12, temperature=0)
        assert r.object == "text_completion" and r.model == served.model_id
        assert r.choices[0].text == expected.text
        assert r.choices[0].finish_reason == ("length" if expected.stop_reason == "length" else "stop")
        assert r.usage.prompt_tokens == len(expected.prompt_ids)
        assert r.usage.completion_tokens == len(expected.token_ids) == 12
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        spec = r.model_extra["speculative"]
        assert spec["stop_reason"] == expected.stop_reason
        assert spec["target_passes"] >= 1 and spec["drafted_tokens"] >= spec["accepted_tokens"] >= 0
        assert "timings" in spec


def test_chat_completion_equals_greedy_with_usage(served, reference):
    client = served.client()
    messages = [{"role": "user", "content": "the quick brown fox"}]
    expected = reference(messages=messages, max_tokens=10)
    r = client.chat.completions.create(model=served.model_id, messages=messages, max_tokens=10, temperature=0)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expected.prompt_ids), len(expected.token_ids))
    # max_completion_tokens (the newer name) and content parts work too
    r2 = client.chat.completions.create(
        model=served.model_id, messages=[{"role": "user", "content": [{"type": "text", "text": "the quick brown fox"}]}],
        max_completion_tokens=10, temperature=0,
    )
    assert r2.choices[0].message.content == expected.text


def test_streams_equal_the_greedy_answer(served, reference, clean):
    client = served.client()
    prompt, _ = clean[0]
    expected = reference(prompt=prompt, max_tokens=14)
    chunks = list(client.completions.create(model=served.model_id, prompt=prompt, max_tokens=14, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chunks[-1].model_extra["speculative"]["stop_reason"] == "length"
    assert len({c.id for c in chunks}) == 1

    messages = [{"role": "user", "content": prompt}]
    expected = reference(messages=messages, max_tokens=14)
    stream = client.chat.completions.create(model=served.model_id, messages=messages, max_tokens=14, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices carries usage
    assert chunks[-1].choices == []
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(expected.prompt_ids), len(expected.token_ids))
    non_streamed = client.chat.completions.create(model=served.model_id, messages=messages, max_tokens=14, temperature=0)
    assert non_streamed.choices[0].message.content == expected.text


def test_stop_strings(served, reference, clean):
    client = served.client()
    for prompt, text in clean:
        stop = text[3:5]
        cut = text.index(stop)
        r = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=16, temperature=0, stop=[stop, "@@@@"])
        assert r.choices[0].text == text[:cut]
        assert r.choices[0].finish_reason == "stop"
        assert r.model_extra["speculative"]["stop_reason"] == "stop"
        streamed = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=16, temperature=0, stop=stop,
                                             stream=True)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:cut]


def test_max_tokens(served, reference, clean):
    client = served.client()
    prompt, text = clean[1]
    for n in (1, 3, 7):
        r = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=n, temperature=0)
        assert r.usage.completion_tokens == n
        assert r.choices[0].finish_reason == "length"
        assert r.choices[0].text == reference(prompt=prompt, max_tokens=n).text
    # /v1/completions without max_tokens: OpenAI's default of 16
    r = client.completions.create(model=served.model_id, prompt=prompt, temperature=0)
    assert r.usage.completion_tokens == 16 and r.choices[0].text == text
    # chat without a limit runs to the end of the context at most
    r = client.chat.completions.create(model=served.model_id, messages=[{"role": "user", "content": prompt}], temperature=0)
    assert r.usage.prompt_tokens + r.usage.completion_tokens <= 64


def test_seeded_sampling_is_reproducible(steerable):
    # The seed fixes the random stream; with adaptive γ how many draws a round takes depends on
    # measured costs, so the repeatable case is a server whose γ choices are fixed (here: no drafter).
    client = steerable.client()
    kwargs = dict(model=steerable.model_id, prompt="the cat sat on", max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    a = client.completions.create(**kwargs).choices[0].text
    assert all(client.completions.create(**kwargs).choices[0].text == a for _ in range(3))
    texts = {client.completions.create(**{**kwargs, "seed": seed}).choices[0].text for seed in range(6)}
    assert len(texts) > 1  # and the seed does matter


# -- bad requests ---------------------------------------------------------------------------------

MESSAGES = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [
    # (path, body, status, code, param)
    ("/v1/completions", b"{not json", 400, "invalid_json", None),
    ("/v1/completions", b'{"prompt": "a", "temperature": NaN}', 400, "invalid_json", None),
    ("/v1/completions", b"[1, 2]", 400, "invalid_json", None),
    ("/v1/completions", b"\xff\xfe", 400, "invalid_json", None),
    ("/v1/completions", {}, 400, "missing_required_parameter", "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "invalid_type", "prompt"),
    ("/v1/completions", {"prompt": ["a", "b"]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": [1, 99999]}, 400, "invalid_value", "prompt"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 2.5}, 400, "invalid_type", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 1e300}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**12}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "invalid_value", "max_tokens"),
    ("/v1/completions", {"prompt": "a", "temperature": "hot"}, 400, "invalid_type", "temperature"),
    ("/v1/completions", {"prompt": "a", "temperature": 5}, 400, "invalid_value", "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 2}, 400, "invalid_value", "top_p"),
    ("/v1/completions", {"prompt": "a", "seed": -1}, 400, "invalid_value", "seed"),
    ("/v1/completions", {"prompt": "a", "stream": "yes"}, 400, "invalid_type", "stream"),
    ("/v1/completions", {"prompt": "a", "stop": 5}, 400, "invalid_type", "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c", "d", "e"]}, 400, "invalid_value", "stop"),
    ("/v1/completions", {"prompt": "a", "bogus": 1}, 400, "unknown_parameter", "bogus"),
    ("/v1/completions", {"prompt": "a", "n": 2}, 400, "invalid_value", "n"),
    ("/v1/completions", {"prompt": "a", "echo": True}, 400, "invalid_value", "echo"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "a"}, 404, "model_not_found", "model"),
    ("/v1/completions", {"model": 3, "prompt": "a"}, 400, "invalid_type", "model"),
    ("/v1/completions", {"prompt": "dog " * 200}, 400, "context_length_exceeded", "prompt"),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "invalid_type", "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "invalid_type", "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "invalid_value", "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, 400, "invalid_type", "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "x": 1}]}, 400, "unknown_parameter", "messages[0].x"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**9}, 400, "invalid_value", "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, 400, "invalid_value", "tools"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": 3}, 400, "invalid_type", "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "dog " * 200}]}, 400, "context_length_exceeded", "messages"),
    ("/v1/chat/completions", {"messages": MESSAGES, "prompt": "x"}, 400, "unknown_parameter", "prompt"),
    ("/v1/chat/completions", b"{" + b" " * ((1 << 20) + 1024) + b"}", 413, "request_too_large", None),
]


def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(served, reference, clean):
    for path, body, status, code, param in BAD_REQUESTS:
        got_status, got = served.raw("POST", path, body)
        assert got_status == status, (path, body if len(str(body)) < 200 else "...", got)
        error = got["error"]
        assert set(error) == {"message", "type", "param", "code"}, got
        assert error["code"] == code and error["param"] == param, (body, got)
        assert error["type"] == "invalid_request_error" and error["message"]
    assert served.raw("GET", "/v1/nothing")[0] == 404
    status, got = served.raw("GET", "/v1/completions")
    assert status == 405 and got["error"]["code"] == "method_not_allowed"
    # the official client maps them to its exception types
    client = served.client()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=served.model_id, prompt="a", max_tokens=10**6)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=MESSAGES)
    # and it still serves
    prompt, text = clean[0]
    assert client.completions.create(model=served.model_id, prompt=prompt, max_tokens=16, temperature=0).choices[0].text == text
    assert served.raw("GET", "/health")[1]["status"] == "ok"


def test_api_key_missing_or_wrong(served, clean):
    for key in (None, "sk-wrong", KEY + "x", KEY[:-1]):
        status, got = served.raw("POST", "/v1/completions", {"prompt": "a", "max_tokens": 1}, key=key)
        assert status == 401 and got["error"]["code"] == "invalid_api_key", key
    status, _ = served.raw("POST", "/v1/completions", {"prompt": "a"}, key=None, headers={"Authorization": "Basic abc"})
    assert status == 401
    for path in ("/v1/models", "/metrics"):
        assert served.raw("GET", path, key="sk-wrong")[0] == 401
    with pytest.raises(openai.AuthenticationError):
        served.client(key="sk-wrong").models.list()
    with pytest.raises(openai.AuthenticationError):
        served.client(key="sk-wrong").chat.completions.create(model=served.model_id, messages=MESSAGES, stream=True)
    assert served.raw("GET", "/health", key=None)[0] == 200  # liveness needs no key
    prompt, text = clean[0]
    r = served.client().completions.create(model=served.model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text


def test_health_and_metrics(served):
    status, health = served.raw("GET", "/health")
    assert status == 200 and health["status"] == "ok" and health["model"] == served.model_id
    served.client().completions.create(model=served.model_id, prompt="the dog", max_tokens=4, temperature=0)
    status, text = served.raw("GET", "/metrics")
    assert status == 200
    for name in ("http_requests_total", "prompt_tokens_total", "completion_tokens_total", "drafted_tokens_total",
                 "accepted_tokens_total", "acceptance_rate", "queue_depth", "queue_capacity", "generations_rejected_total"):
        assert f"# TYPE edge_spec_{name} " in text, name
    assert served.metric("http_requests_total", '{endpoint="completions",code="200"}') >= 1
    assert served.metric("completion_tokens_total") >= 4
    assert served.metric("queue_capacity") == 8
    assert 0.0 <= served.metric("acceptance_rate") <= 1.0


# -- load -----------------------------------------------------------------------------------------

def _load_round(served: Served, prompts: dict[str, str], n_clients: int, leave_every: int) -> list[tuple]:
    """n_clients streaming completions at once; every leave_every-th reads two chunks and hangs up."""
    client = served.client(timeout=60.0)
    barrier = threading.Barrier(n_clients, timeout=30)
    outcomes: list = [None] * n_clients
    names = list(prompts)

    def one(i: int) -> None:
        prompt = names[i % len(names)]
        leave = leave_every and i % leave_every == leave_every - 1
        try:
            barrier.wait()
            stream = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=12, temperature=0, stream=True)
            text, n = "", 0
            for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                    n += 1
                if leave and n >= 2:
                    stream.close()
                    outcomes[i] = ("left", None)
                    return
            outcomes[i] = ("ok", text == prompts[prompt], prompt, text)
        except (openai.RateLimitError, openai.InternalServerError) as exc:
            body = exc.body if isinstance(exc.body, dict) else {}
            outcomes[i] = (str(exc.status_code), body.get("code"), body.get("type"))
        except Exception as exc:  # any other outcome fails the test below
            outcomes[i] = ("error", repr(exc))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n_clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a client hung"
    client.close()  # its pooled keep-alive connections too
    return outcomes


def test_32_concurrent_streaming_clients(served, reference):
    prompts = {}
    for i in range(8):
        prompt = " ".join(WORDS[(i * 11 + j * 3) % len(WORDS)] for j in range(4))
        prompts[prompt] = reference(prompt=prompt, max_tokens=12).text
    process = psutil.Process(served.proc.pid)
    client = served.client()
    for prompt in list(prompts)[:2]:  # warm up
        client.completions.create(model=served.model_id, prompt=prompt, max_tokens=12, temperature=0)
    rss = [process.memory_info().rss]
    counts = []
    for _ in range(3):
        outcomes = _load_round(served, prompts, 32, leave_every=8)
        bad = [o for o in outcomes if o is None or o[0] not in ("ok", "left", "429", "503")]
        assert not bad, bad
        mixed = [o for o in outcomes if o[0] == "ok" and not o[1]]
        assert not mixed, f"answers differ from the greedy answer of their own prompt: {mixed}"
        rejected = [o for o in outcomes if o[0] in ("429", "503")]
        unclean = [o for o in rejected if o[1] not in ("queue_full", "queue_timeout") or o[2] not in ("rate_limit_error", "server_error")]
        assert not unclean, unclean
        assert any(o[0] == "ok" for o in outcomes)
        counts.append({k: sum(o[0] == k for o in outcomes) for k in ("ok", "left", "429", "503")})
        # clients that hung up mid-stream freed the engine: it is idle again, and serves at once
        wait_until(lambda: (lambda h: not h["busy"] and h["queue_depth"] == 0)(served.raw("GET", "/health")[1]), 10,
                   "the engine to be idle after the round")
        began = time.monotonic()
        prompt = next(iter(prompts))
        r = client.completions.create(model=served.model_id, prompt=prompt, max_tokens=12, temperature=0)
        assert r.choices[0].text == prompts[prompt]
        assert time.monotonic() - began < 10
        rss.append(process.memory_info().rss)
    mib = [r / 2**20 for r in rss]
    print(f"outcomes per round: {counts}; server RSS MiB: {[f'{m:.0f}' for m in mib]}")
    assert mib[3] - mib[1] < 48, f"server RSS grew under repeated load: {mib}"
    assert mib[3] - mib[0] < 160, f"server RSS grew under load: {mib}"
    assert served.metric("queue_depth") == 0


# -- queueing and disconnects, deterministic (in-thread server, engine held or slowed) ------------

def _hold_engine(model: Model):
    """Start a generation and keep it suspended: it holds the engine until closed."""
    it = iter(model.submit(prompt="the cat", max_tokens=40))
    next(it)
    assert model.busy
    return it


def test_queue_full_gets_429_and_a_long_wait_503(steerable, clean):
    model = steerable.model
    client = steerable.client(timeout=20)
    prompt, text = clean[0]
    held = _hold_engine(model)
    try:
        waiting: dict = {}

        def wait_in_queue():
            try:
                client.completions.create(model=steerable.model_id, prompt=prompt, max_tokens=16, temperature=0)
                waiting["outcome"] = "completed"
            except openai.APIStatusError as exc:
                waiting["outcome"] = (exc.status_code, exc.body)

        thread = threading.Thread(target=wait_in_queue, daemon=True)
        thread.start()
        wait_until(lambda: model.queue_depth == 1, 5, "the request to wait in the queue")
        assert steerable.metric("queue_depth") == 1
        with pytest.raises(openai.RateLimitError) as info:
            client.completions.create(model=steerable.model_id, prompt=prompt, max_tokens=4)
        assert info.value.status_code == 429
        assert info.value.body["code"] == "queue_full" and info.value.body["type"] == "rate_limit_error"
        assert "busy" in info.value.body["message"]
        assert info.value.response.headers.get("retry-after")
        status, body = steerable.raw("POST", "/v1/chat/completions", {"messages": MESSAGES, "stream": True})
        assert status == 429 and body["error"]["code"] == "queue_full"  # a stream is refused the same way
        thread.join(timeout=10)
        assert waiting["outcome"][0] == 503 and waiting["outcome"][1]["code"] == "queue_timeout"
        assert steerable.metric("generations_rejected_total") >= 2
    finally:
        held.close()
    assert not model.busy and model.queue_depth == 0
    r = client.completions.create(model=steerable.model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text


def test_client_leaving_the_queue_cancels_its_request(steerable, clean):
    model = steerable.model
    before = model.counters()["finished_cancelled"]
    gone_before = steerable.metric("client_disconnects_total")
    held = _hold_engine(model)
    try:
        for stream in (False, True):
            with pytest.raises(openai.APITimeoutError):
                steerable.client(timeout=0.5).chat.completions.create(
                    model=steerable.model_id, messages=MESSAGES, max_tokens=5, stream=stream)
        wait_until(lambda: model.queue_depth == 0, 5, "the abandoned requests to leave the queue")
    finally:
        held.close()
    assert model.counters()["finished_cancelled"] == before + 2
    assert steerable.metric("client_disconnects_total") == gone_before + 2
    prompt, text = clean[0]
    r = steerable.client().completions.create(model=steerable.model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text


@pytest.mark.parametrize("stream", [True, False])
def test_disconnect_mid_generation_frees_the_engine(steerable, clean, stream):
    model = steerable.model
    prompt, text = clean[0]
    before = model.counters()["finished_cancelled"]
    with slow_target(model, 0.1):  # 40 tokens would take over 4 s
        began = time.monotonic()
        if stream:
            response = steerable.client().completions.create(model=steerable.model_id, prompt=prompt, max_tokens=40,
                                                             temperature=0, stream=True)
            for chunk in response:
                if chunk.choices and chunk.choices[0].text:
                    break
            response.close()
        else:
            with pytest.raises(openai.APITimeoutError):
                steerable.client(timeout=0.6).completions.create(model=steerable.model_id, prompt=prompt, max_tokens=40,
                                                                 temperature=0)
        waited = wait_until(lambda: model.counters()["finished_cancelled"] == before + 1 and not model.busy, 3,
                            "the generation to be cancelled")
        assert time.monotonic() - began < 3.0, "the engine ran on after the client left"
        assert waited < 1.5
    r = steerable.client().completions.create(model=steerable.model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text


def test_engine_failure_is_a_500_and_the_server_keeps_serving(steerable, clean):
    model = steerable.model
    prompt, text = clean[0]
    runner = model.engine.target

    def broken(*args, **kwargs):
        raise RuntimeError("simulated device failure")

    runner.score = broken
    try:
        client = steerable.client()
        with pytest.raises(openai.InternalServerError) as info:
            client.completions.create(model=steerable.model_id, prompt=prompt, max_tokens=8, temperature=0)
        assert info.value.body["type"] == "server_error" and "simulated device failure" in info.value.body["message"]
        with pytest.raises(openai.APIError):  # mid-stream: an error event in the stream
            list(client.completions.create(model=steerable.model_id, prompt=prompt, max_tokens=8, temperature=0, stream=True))
    finally:
        del runner.score
    assert not model.busy and model.queue_depth == 0
    r = steerable.client().completions.create(model=steerable.model_id, prompt=prompt, max_tokens=16, temperature=0)
    assert r.choices[0].text == text


# -- binding rules --------------------------------------------------------------------------------

def test_loopback_rules():
    for host in ("127.0.0.1", "localhost", "::1", "[::1]", "127.0.0.2"):
        assert is_loopback(host), host
        check_bind(host, None, False)
    for host in ("0.0.0.0", "::", "192.168.1.10", "example.com"):
        assert not is_loopback(host), host
        with pytest.raises(ValueError, match="--api-key"):
            check_bind(host, None, False)
        check_bind(host, "key", False)
        check_bind(host, None, True)


def test_serve_refuses_a_public_host_without_a_key(llama_bundle):
    began = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "runtime", "serve", str(llama_bundle), "--host", "0.0.0.0", "--port", "0"],
                          cwd=ROOT, env=_child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "--api-key" in proc.stderr and "--insecure" in proc.stderr
    assert time.monotonic() - began < 30


def test_runtime_server_imports_no_torch():
    code = ("import sys, runtime.server, runtime.api, runtime.chat; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_child_env(), check=True, timeout=60)


# -- real weights ---------------------------------------------------------------------------------

@pytest.mark.real_weights
def test_real_weights_chat_stream_equals_greedy(tmp_path):
    from tests import real

    real.need(real.SMOLLM2)
    bundle = real.bundle("smollm2-fp32")
    messages = [{"role": "user", "content": "Name three colors."}]
    engine = Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))
    expected = engine.generate(engine.encode(messages=messages), GenerateConfig(24))
    del engine
    server = start_child(bundle, tmp_path / "stderr.log")
    try:
        client = server.client(key=None, timeout=120)
        r = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=24, temperature=0)
        assert r.choices[0].message.content == expected.text
        assert r.usage.completion_tokens == len(expected.token_ids)
        stream = client.chat.completions.create(model=server.model_id, messages=messages, max_tokens=24, temperature=0,
                                                stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == expected.text
    finally:
        stop_child(server.proc)
