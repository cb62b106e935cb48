"""`python -m runtime chat BUNDLE` driven in a real terminal: tmux send-keys / capture-pane.

Checks that replies stream and finish, that history goes into the next prompt through the
chat template (the second turn's prompt length equals the template rendered over both turns),
and that /history, /reset and /exit work. tmux runs on its own socket and is killed at the end.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from runtime.api import Model
from runtime.engine import EngineConfig

ROOT = Path(__file__).resolve().parent.parent
TMUX = shutil.which("tmux")
pytestmark = pytest.mark.skipif(TMUX is None, reason="tmux is not installed (apt-get install -y tmux) to drive the terminal chat")
STATUS = re.compile(r"\[(\d+) tokens, stop: (\w+), prompt (\d+) tokens")
MAX_NEW = 8


class Pane:
    def __init__(self, socket: str, name: str):
        self.base = [TMUX, "-L", socket]
        self.name = name

    def tmux(self, *args: str, check: bool = True) -> str:
        return subprocess.run([*self.base, *args], capture_output=True, text=True, check=check, timeout=20).stdout

    def send(self, text: str) -> None:
        self.tmux("send-keys", "-t", self.name, "-l", text)
        self.tmux("send-keys", "-t", self.name, "Enter")

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", self.name)

    def wait_for(self, predicate, timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.1)
        pytest.fail(f"timed out waiting for {what}; the pane shows:\n{self.screen()}")


@pytest.fixture
def chat_pane(llama_bundle):
    socket = f"edge-spec-test-{os.getpid()}"
    pane = Pane(socket, "chat")
    env = f"OMP_NUM_THREADS=1 PYTHONPATH={shlex.quote(str(ROOT))} LANG=C.UTF-8 LC_ALL=C.UTF-8"
    command = (f"cd {shlex.quote(str(ROOT))} && env {env} {shlex.quote(sys.executable)} -m runtime chat "
               f"{shlex.quote(str(llama_bundle))} --provider cpu --threads 1 --temperature 0 --max-new-tokens {MAX_NEW}; "
               "echo CHAT-EXITED $?; sleep 30")
    subprocess.run([TMUX, "-L", socket, "new-session", "-d", "-s", "chat", "-x", "160", "-y", "50", command],
                   check=True, timeout=20)
    try:
        yield pane
    finally:
        subprocess.run([TMUX, "-L", socket, "kill-server"], capture_output=True, timeout=20)


def _statuses(text: str) -> list[tuple[int, str, int]]:
    return [(int(a), b, int(c)) for a, b, c in STATUS.findall(text)]


def test_terminal_chat_in_tmux(chat_pane, llama_bundle):
    # What the chat must do, computed here with the same template and greedy decoding.
    model = Model.load(llama_bundle, engine_config=EngineConfig(provider="cpu", threads=1, drafter="none", calibrate=False))
    first = [{"role": "user", "content": "hello there"}]
    reply = model.generate(messages=first, max_tokens=MAX_NEW)
    second = first + [{"role": "assistant", "content": reply.text}, {"role": "user", "content": "and the cat"}]
    second_prompt = len(model.encode(messages=second))
    assert second_prompt < model.max_context - MAX_NEW  # the history fits: nothing is dropped

    pane = chat_pane
    pane.wait_for(lambda s: "you> " in s, 90, "the chat prompt")
    assert "edge-spec chat" in pane.screen()
    pane.send("hello there")
    screen = pane.wait_for(lambda s: len(_statuses(s)) >= 1, 30, "the first reply")
    assert _statuses(screen)[0] == (len(reply.token_ids), reply.stop_reason, len(reply.prompt_ids))
    assert "bot> " in screen

    pane.send("and the cat")
    screen = pane.wait_for(lambda s: len(_statuses(s)) >= 2, 30, "the second reply")
    assert _statuses(screen)[1][2] == second_prompt  # the first exchange is in the prompt

    pane.send("/history")
    screen = pane.wait_for(lambda s: "[4 messages]" in s, 10, "/history")
    assert "user: hello there" in screen and "user: and the cat" in screen

    pane.send("/reset")
    pane.wait_for(lambda s: "[conversation cleared]" in s, 10, "/reset")
    pane.send("hello there")
    screen = pane.wait_for(lambda s: len(_statuses(s)) >= 3, 30, "the reply after /reset")
    assert _statuses(screen)[2] == _statuses(screen)[0]  # a fresh conversation: the same first turn

    pane.send("/exit")
    pane.wait_for(lambda s: "CHAT-EXITED 0" in s, 10, "the chat to exit")
