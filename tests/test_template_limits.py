"""A bundle's chat template can cost a request, never the server: it renders in a child process
(runtime/render_worker.py) that is killed at the deadline and whose address space is capped, and
SIGTERM ends a `serve` process within its grace period whatever is still running.

Servers run on 127.0.0.1 only (in a thread, or `python -m runtime serve` as a subprocess); every
wait has a bound several times what it needs on two loaded cores.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")

import runtime.tokenizer as tokenizer_module  # noqa: E402
from edge_spec.manifest import load_manifest  # noqa: E402
from runtime.api import Model  # noqa: E402
from runtime.engine import EngineConfig  # noqa: E402
from runtime.tokenizer import BundleTokenizer, ChatTemplateError, TemplateLimitError  # noqa: E402
from tests.test_server import KEY, request  # noqa: E402
from tests.test_server_hardening import _serving_port, _wait_healthy, serving  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20

# 10**10 steps of a loop over a string, behind a trigger word so the load-time probe passes: no
# operation inside it is one the sandbox checks, so only a kill stops it.
SPIN = ("{% set s = 'x' * 100000 %}{% for m in messages %}{% if m['content'] == 'spin' %}"
        "{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")
# Doubles a 1 MB string ten times (1 GB) with `~` or `+`, neither of which the sandbox sees.
GROW = ("{% for m in messages %}{% if m['content'] == 'grow' %}{% set s = 'x' * 1000000 %}"
        + "{% set s = s OP s %}" * 10 + "{{ s | length }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:")


def _with_template(llama_bundle: Path, tmp_path: Path, template: str) -> Path:
    bundle = tmp_path / "bundle"
    shutil.copytree(llama_bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = template
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    return bundle


def _rss(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


class _PeakRss(threading.Thread):
    """The highest RSS of each pid that `pids()` names, sampled every few milliseconds."""

    def __init__(self, pids):
        super().__init__(daemon=True)
        self.pids, self.peaks, self.done = pids, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.003):
            for pid in self.pids():
                rss = _rss(pid)
                if rss is not None:
                    self.peaks[pid] = max(self.peaks.get(pid, 0), rss)

    def stop(self) -> dict:
        self.done.set()
        self.join(timeout=10)
        return self.peaks


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the address-space cap and /proc are Linux's")
@pytest.mark.parametrize("op", ["~", "+"])
def test_a_concatenation_past_the_memory_limit_is_refused_and_the_server_process_does_not_grow(llama_bundle, op):
    info = load_manifest(llama_bundle).tokenizer
    info = dataclasses.replace(info, chat_template=GROW.replace("OP", op))
    tok = BundleTokenizer(llama_bundle / info.file, info)
    renderer = getattr(tok, "_renderer", None)
    me = os.getpid()
    before = _rss(me)
    sampler = _PeakRss(lambda: [me] + ([renderer.pid] if renderer is not None and renderer.pid else []))
    sampler.start()
    try:
        tok.render_chat([{"role": "user", "content": "grow"}])
        error = None
    except ChatTemplateError as exc:
        error = exc
    finally:
        peaks = sampler.stop()
    assert peaks[me] - before < 256 * MIB, (peaks[me] - before) / MIB  # the 1 GB string never reached this process
    assert isinstance(error, TemplateLimitError) and re.fullmatch(
        r"the bundle's chat template went past its memory limit of \d+ MiB", str(error)), error
    chars = tokenizer_module.RENDER_BASE_CHARS + 2 * len("grow")
    limit = tokenizer_module.RENDER_MEMORY_BYTES + tokenizer_module.RENDER_BYTES_PER_CHAR * chars
    worker = [peak for pid, peak in peaks.items() if pid != me]
    assert worker and max(worker) < limit + 128 * MIB, [p / MIB for p in worker]  # the cap, over the child's idle size
    assert tok.render_chat([{"role": "user", "content": "hi"}]) == "user: hi\nassistant:"
    tok.close()


def test_a_nested_loop_is_cut_off_at_the_deadline_while_the_server_keeps_answering(llama_bundle, tmp_path):
    model = Model.load(_with_template(llama_bundle, tmp_path, SPIN),
                       engine_config=EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False))
    deadline = tokenizer_module.RENDER_SECONDS
    got: dict = {}

    def post(name: str, path: str, body: dict) -> None:
        began = time.monotonic()
        got[name] = (*request(port, "POST", path, body, timeout=deadline + 60), time.monotonic() - began)

    try:
        with serving(model) as (_, port, _uv):
            spin = threading.Thread(target=post, args=("spin", "/v1/chat/completions",
                                                       {"messages": [{"role": "user", "content": "spin"}], "max_tokens": 2}),
                                    daemon=True)
            spin.start()
            time.sleep(0.5)  # the render is under way
            text = threading.Thread(target=post, args=("text", "/v1/completions", {"prompt": "the cat", "max_tokens": 2}),
                                    daemon=True)
            text.start()
            assert request(port, "GET", "/health", timeout=30)[0] == 200
            status, _, body = request(port, "POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2}, timeout=30)
            assert status == 200, body
            assert spin.is_alive()  # answered while the template was still spinning
            spin.join(timeout=deadline + 90)
            text.join(timeout=60)
            assert "spin" in got, "the hostile chat request got no answer"
            assert "text" in got, "the text completion sent during the render got no answer"
            status, _, body, took = got["spin"]
            assert status == 400 and body["error"]["param"] == "messages", body
            assert f"took longer than {deadline:g} s to render" in body["error"]["message"], body
            assert "\n" not in body["error"]["message"]
            assert took < deadline + 30, took
            assert got["text"][0] == 200, got["text"]  # the tokenizing thread was freed
            status, _, body = request(port, "POST", "/v1/chat/completions",
                                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=60)
            assert status == 200, body  # on a fresh render process
    finally:
        model.close()
        model.engine.tokenizer.close()


def _serve(bundle: Path, *, code: str | None = None) -> subprocess.Popen:
    head = [sys.executable, "-m", "runtime"] if code is None else [sys.executable, "-c", code]
    cmd = head + ["serve", str(bundle), "--provider", "cpu", "--threads", "1", "--port", "0", "--draft", "none",
                  "--api-key", KEY, "--shutdown-timeout", "1"]
    env = {"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# `serve` from the real command line (runtime.server.run.grace_period: --shutdown-timeout + 15 s).
GRACE = 1 + 15


def test_sigterm_during_a_hostile_render_ends_the_server_within_its_grace_period(llama_bundle, tmp_path):
    proc = _serve(_with_template(llama_bundle, tmp_path, SPIN))
    try:
        port = _serving_port(proc)
        _wait_healthy(port)
        got: list = []

        def spin() -> None:
            try:
                got.append(request(port, "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "spin"}]},
                                   timeout=120))
            except OSError:  # the server closed the connection as it stopped
                pass

        client = threading.Thread(target=spin, daemon=True)
        client.start()
        time.sleep(1.0)  # the render is under way
        signalled = time.monotonic()
        proc.terminate()
        try:
            status = proc.wait(timeout=GRACE + 10)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running {GRACE + 10} s after SIGTERM")
        assert status == 0
        assert time.monotonic() - signalled < GRACE
        client.join(timeout=10)
        assert got and got[0][0] == 400, got  # cut off at the shutdown deadline, in one line
        assert got[0][2]["error"]["message"] == "the chat template's render was stopped before it finished", got
        assert "Traceback" not in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)


# The real command line with a non-daemon thread that never ends, started where the server cannot see it.
_STUCK_SERVE = """
import sys, threading
threading.Thread(target=threading.Event().wait, name="stuck-elsewhere").start()
from runtime.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_ends_the_server_within_its_grace_period_even_with_a_thread_stuck_elsewhere(llama_bundle):
    proc = _serve(llama_bundle, code=_STUCK_SERVE)
    try:
        _wait_healthy(_serving_port(proc))
        signalled = time.monotonic()
        proc.terminate()
        try:
            status = proc.wait(timeout=GRACE + 15)
        except subprocess.TimeoutExpired:
            pytest.fail(f"serve still running {GRACE + 15} s after SIGTERM")
        assert status == 0
        assert time.monotonic() - signalled < GRACE + 5  # the timer fires at GRACE; the rest is the exit itself
        err = proc.stderr.read()
        assert "still running 16 s after the signal (threads: stuck-elsewhere)" in err, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
