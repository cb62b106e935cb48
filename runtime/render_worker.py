"""Chat templates rendered in a child process that can always be stopped.

A bundle's chat template is code from whoever made the bundle. jinja2's sandbox stops attribute
tricks and the checks below stop `*`, `%`, `**`, range() and width arguments early with a specific
error, but a loop over a long string or a chain of `~`/`+` concatenations does none of those. So
templates render in one long-lived child process per tokenizer (RenderWorker), where the parent
kills the child at the deadline and the child's address space is capped for each render
(RLIMIT_AS, Linux); a killed child is replaced on the next render.

This file runs both as `runtime.render_worker` (the parent side) and, loaded by path, as the
child's whole program: it imports only the standard library and jinja2, so the child starts in
about 0.1 s. Frames on the child's stdin/stdout: an 8-byte big-endian length, then UTF-8 JSON.
"""

from __future__ import annotations

import functools
import json
import math
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import weakref
from datetime import datetime

try:
    import resource
except ImportError:  # Windows: the parent's deadline still applies, the memory cap does not
    resource = None

MAX_POWER_BITS = 1 << 16  # an integer ** result larger than this is refused before it is computed
KILL_MARGIN_SECONDS = 1.0  # past the deadline, so the child's own check names the operation first
CPU_MARGIN_SECONDS = 5  # the child's CPU limit (SIGXCPU), for a child whose parent died mid-render
START_SECONDS = 60.0  # to start the child and compile the template, on a loaded machine
EXIT_MEMORY = 3  # the child's exit status after a MemoryError outside a render
_HEADER = 8


class RenderFailed(Exception):
    """The template failed or was stopped: the bundle's fault (or a shutdown), not the server's."""


class RenderLimit(RenderFailed):
    """The template went past a limit: deadline, memory, size."""


class RenderCompileError(RenderFailed):
    """The template does not compile."""


class RenderProcessError(RuntimeError):
    """The render process could not be started or broke the protocol."""


def _frame(value) -> bytes:
    body = json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8", "surrogatepass")
    return len(body).to_bytes(_HEADER, "big") + body


def _unframe(body: bytes):
    return json.loads(body.decode("utf-8", "surrogatepass"))


def _one_line(text, limit: int = 200) -> str:
    return (str(text).splitlines() or [""])[0][:limit]


# -- the child: the sandbox with per-operation limits ---------------------------------------------

class _Budget:
    deadline = math.inf
    chars = 1 << 20
    seconds = 5.0


class TemplateLimit(Exception):
    pass


class TemplateRaised(Exception):
    pass


def _raise(message: str):
    raise TemplateRaised(message)


def _bounded_environment_class():
    from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox plus per-render limits: no string or list over the render's character budget
        from `*`, `%` or an integer argument of a call or filter, no huge `**`, and a deadline checked
        at every such operation, range() and piece of output."""

        intercepted_binops = frozenset(("*", "**", "%"))

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.budget = _Budget()
            self.globals["range"] = self._range
            self.filters = {name: self._bounded_filter(f) for name, f in self.filters.items()}

        def check_time(self) -> None:
            if time.monotonic() > self.budget.deadline:
                raise TemplateLimit(f"the bundle's chat template took longer than {self.budget.seconds:g} s to render")

        def check_size(self, n: int, what: str) -> None:
            if n > self.budget.chars:
                raise TemplateLimit(f"the bundle's chat template asked for {what} of {n} items, over its limit of "
                                    f"{self.budget.chars} characters")

        def check_arguments(self, args, kwargs) -> None:
            self.check_time()
            for value in (*args, *kwargs.values()):
                if isinstance(value, int) and not isinstance(value, bool) and abs(value) > self.budget.chars:
                    self.check_size(abs(value), "a width or count")

        def _range(self, *args):
            self.check_arguments(args, {})
            return safe_range(*args)

        def _bounded_filter(self, f):
            skip = 2 if getattr(f, "jinja_pass_arg", None) else 1  # the context/environment, then the value filtered

            @functools.wraps(f)  # keeps jinja's pass_context/pass_environment marks
            def bounded(*args, **kwargs):
                self.check_arguments(args[skip:], kwargs)
                return f(*args, **kwargs)

            return bounded

        def call_binop(self, context, operator, left, right):
            self.check_time()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and not isinstance(n, bool):
                        self.check_size(len(seq) * n, "a repeated string or list")
            elif operator == "**":
                if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                    if abs(left).bit_length() * right > MAX_POWER_BITS:
                        raise TemplateLimit(f"the bundle's chat template computes a power with over {MAX_POWER_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                self.check_arguments(right if isinstance(right, tuple) else (right,), {})
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
            __self.check_arguments(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    return BoundedEnvironment


def make_environment():
    """The same rendering rules Hugging Face applies to chat templates: a sandbox, trimmed blocks,
    loop controls, and raise_exception / strftime_now helpers; plus the limits above."""
    env = _bounded_environment_class()(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # Templates serialize tool calls with tojson: keep key order and raw characters,
    # as Hugging Face does, not jinja2's HTML-safe, key-sorted default.
    env.filters["tojson"] = env._bounded_filter(lambda value, indent=None, separators=None, sort_keys=False: json.dumps(
        value, ensure_ascii=False, indent=indent, separators=separators, sort_keys=sort_keys))
    return env


def compile_template(env, source: str):
    """The compiled template, or RenderFailed naming why it does not compile."""
    import jinja2

    try:
        return env.from_string(source)
    except Exception as exc:  # whatever the source holds: a syntax error, nesting past the recursion limit
        reason = str(exc) if isinstance(exc, jinja2.TemplateError) else f"{type(exc).__name__}: {exc}"
        raise RenderFailed(f"the bundle's chat template does not compile: {_one_line(reason)}; fix tokenizer.chat_template "
                           "in manifest.json or re-export the bundle") from None


def render(env, template, variables: dict, request: dict) -> dict:
    """One render under the sandbox's limits: {"text": ...} or {"kind", "error"}."""
    budget = env.budget
    budget.chars, budget.seconds = int(request["chars"]), float(request["seconds"])
    budget.deadline = time.monotonic() + budget.seconds
    pieces, size = [], 0
    try:
        for piece in template.generate(messages=request["messages"], add_generation_prompt=request["add_generation_prompt"],
                                       **variables):
            size += len(piece)
            env.check_size(size, "output")
            env.check_time()
            pieces.append(piece)
        return {"text": "".join(pieces)}
    except TemplateLimit as exc:
        return {"kind": "limit", "error": str(exc)}
    except TemplateRaised as exc:  # the template's own refusal, word for word
        return {"kind": "template", "error": _one_line(exc, 500)}
    except MemoryError:
        return {"kind": "memory", "error": f"the bundle's chat template went past its memory limit of "
                                           f"{int(request['memory']) >> 20} MiB"}
    except Exception as exc:  # whatever the template did (OverflowError from range(), a type error): one line
        return {"kind": "template", "error": f"the bundle's chat template failed: {type(exc).__name__}: {_one_line(exc)}"}
    finally:
        budget.deadline = math.inf


def _address_space() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _set_soft_limit(which, soft: float):
    """Sets the soft limit (as far as the hard limit allows); returns what to restore, or None."""
    try:
        old_soft, hard = resource.getrlimit(which)
        soft = int(soft)
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(which, (soft, hard))
        return old_soft, hard
    except (ValueError, OSError):
        return None


def _limited(request: dict):
    """Caps this process for one render: its address space grows at most request["memory"] bytes
    (where /proc tells its size), its CPU time past the deadline ends it even with no parent."""
    restore = []
    if resource is None:
        return restore
    size = _address_space()
    if size is not None:
        restore.append((resource.RLIMIT_AS, _set_soft_limit(resource.RLIMIT_AS, size + int(request["memory"]))))
    used = resource.getrusage(resource.RUSAGE_SELF)
    cpu = math.ceil(used.ru_utime + used.ru_stime + float(request["seconds"]) + CPU_MARGIN_SECONDS)
    restore.append((resource.RLIMIT_CPU, _set_soft_limit(resource.RLIMIT_CPU, cpu)))
    return restore


def _unlimited(restore) -> None:
    for which, old in restore:
        if old is not None:
            resource.setrlimit(which, old)


def _read_frame(stream):
    head = stream.read(_HEADER)
    if len(head) < _HEADER:
        return None
    n = int.from_bytes(head, "big")
    body = stream.read(n)
    return _unframe(body) if len(body) == n else None


def main() -> None:
    """The child: one init frame {"template", "variables"}, then render requests until stdin closes."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if resource is not None:
        _set_soft_limit(resource.RLIMIT_CORE, 0)  # SIGXCPU would otherwise dump a core
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything printed goes to stderr, never into the protocol
    inp = os.fdopen(0, "rb")
    try:
        init = _read_frame(inp)
        if init is None:
            return
        env = make_environment()
        try:
            template = compile_template(env, init["template"])
        except RenderFailed as exc:
            out.write(_frame({"kind": "compile", "error": str(exc)}))
            out.flush()
            return
        out.write(_frame({"ready": True}))
        out.flush()
        variables = init["variables"]
        while True:
            request = _read_frame(inp)
            if request is None:
                return
            restore = _limited(request)
            try:
                reply = render(env, template, variables, request)
            finally:
                _unlimited(restore)
            out.write(_frame(reply))
            out.flush()
            if reply.get("kind") == "memory":
                return  # a fresh process takes the next render, not one whose heap a template filled
    except MemoryError:
        os._exit(EXIT_MEMORY)
    except (BrokenPipeError, KeyboardInterrupt):
        return


# -- the parent -------------------------------------------------------------------------------------

# Loads this file by path in the child, with the parent's sys.path (the same jinja2): importing the
# `runtime` package would load onnxruntime, and -I keeps the working directory off sys.path.
_BOOT = ("import sys, json\nsys.path[:] = json.loads(sys.argv[1])\nimport importlib.util as u\n"
         "spec = u.spec_from_file_location('edge_spec_render_worker', sys.argv[2])\n"
         "module = u.module_from_spec(spec)\nspec.loader.exec_module(module)\nmodule.main()\n")


_LIVE: weakref.WeakSet = weakref.WeakSet()  # every child not yet collected, for stop_all


def stop_all() -> None:
    """Kill every render process of this process now (before an exit that skips finalizers)."""
    for child in list(_LIVE):
        child.kill()


class _Child:
    """One child process and the daemon thread that reads its replies into a queue."""

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, json.dumps(sys.path), os.path.abspath(__file__)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, close_fds=True,
                                     start_new_session=os.name == "posix")
        self.replies: queue.Queue = queue.Queue()
        self.max_reply = 1 << 20
        self.stopped = False
        _LIVE.add(self)
        threading.Thread(target=self._read, name="edge-spec-render-reader", daemon=True).start()

    def _read(self) -> None:
        stream = self.proc.stdout
        try:
            while True:
                head = stream.read(_HEADER)
                if len(head) < _HEADER:
                    break
                n = int.from_bytes(head, "big")
                if n > self.max_reply:
                    self.replies.put(("too_big", n))
                    break
                body = stream.read(n)
                if len(body) < n:
                    break
                self.replies.put(("reply", body))
        except (OSError, ValueError):
            pass
        finally:
            self.replies.put(("eof", None))
            try:
                stream.close()
            except OSError:
                pass

    def send(self, frame: bytes) -> None:
        self.proc.stdin.write(frame)
        self.proc.stdin.flush()

    def receive(self, seconds: float):
        try:
            kind, value = self.replies.get(timeout=seconds)
        except queue.Empty:
            return "timeout", None
        if kind == "reply":
            try:
                return kind, _unframe(value)
            except ValueError:
                return "garbled", None
        return kind, value

    def kill(self) -> None:
        try:
            self.proc.kill()
        except OSError:
            pass

    def reap(self) -> None:
        """Kill and wait for it; the reader thread closes stdout as it reads the end."""
        self.kill()
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


class RenderWorker:
    """Renders one template in a child process, one render at a time; the child stays up between
    renders and is replaced after a kill."""

    def __init__(self, source: str, variables: dict):
        self._init = _frame({"template": source, "variables": dict(variables)})
        self._lock = threading.Lock()
        self._child: _Child | None = None
        self._closed = False
        self.starts = 0  # children started so far (a restart after a kill counts)

    @property
    def pid(self) -> int | None:
        child = self._child
        return None if child is None else child.proc.pid

    def _start(self) -> _Child:
        try:
            child = _Child()
        except OSError as exc:
            raise RenderProcessError(f"cannot start the chat template's render process: {exc}") from None
        self.starts += 1
        try:
            child.send(self._init)
            kind, reply = child.receive(START_SECONDS)
        except OSError:
            kind, reply = "eof", None
        if kind == "reply" and reply.get("ready"):
            self._child = child
            return child
        child.reap()
        if kind == "reply" and reply.get("kind") == "compile":
            raise RenderCompileError(reply["error"])
        if kind == "timeout":
            raise RenderLimit(f"the bundle's chat template did not compile within {START_SECONDS:g} s")
        raise RenderProcessError(f"the chat template's render process ended as it started "
                                 f"(exit status {child.proc.returncode}); see its message above")

    def render(self, messages, add_generation_prompt: bool, seconds: float, chars: int, memory: int) -> str:
        """The rendered text; RenderLimit past the deadline (`seconds`), `memory` bytes of address
        space or `chars` characters; RenderFailed for the template's own errors."""
        try:
            request = _frame({"messages": messages, "add_generation_prompt": bool(add_generation_prompt),
                              "seconds": seconds, "chars": chars, "memory": memory})
        except (TypeError, ValueError) as exc:
            raise RenderFailed(f"chat messages must be JSON values to render: {_one_line(exc)}") from None
        with self._lock:
            if self._closed:
                raise RenderFailed("the chat template's render process was closed")
            for attempt in (1, 2):
                child = self._child
                if child is None or child.stopped or child.proc.poll() is not None:
                    if child is not None:
                        child.reap()
                        self._child = None
                    child = self._start()
                child.max_reply = 6 * chars + (1 << 16)  # JSON writes a control character in 6 bytes
                try:
                    child.send(request)
                    break
                except OSError:  # it ended while idle (killed from outside): one fresh start
                    child.reap()
                    self._child = None
                    if attempt == 2:
                        raise RenderProcessError("the chat template's render process ended before it could render") from None
            kind, reply = child.receive(seconds + KILL_MARGIN_SECONDS)
            if kind == "reply" and "text" in reply:
                return reply["text"]
            self._child = None if kind != "reply" or reply.get("kind") == "memory" else child
            if self._child is None:
                child.reap()
            if child.stopped:
                raise RenderFailed("the chat template's render was stopped before it finished")
            if kind == "reply":
                raise (RenderFailed if reply.get("kind") == "template" else RenderLimit)(reply["error"])
            if kind == "timeout":
                raise RenderLimit(f"the bundle's chat template took longer than {seconds:g} s to render; it was stopped")
            if kind == "too_big":
                raise RenderLimit(f"the bundle's chat template wrote {reply} bytes, over its limit of {chars} characters")
            if kind == "garbled":
                raise RenderProcessError("the chat template's render process sent a reply that is not JSON")
            status = child.proc.returncode
            if status == EXIT_MEMORY:
                raise RenderLimit(f"the bundle's chat template went past its memory limit of {memory >> 20} MiB")
            if status is not None and status < 0 and -status == getattr(signal, "SIGXCPU", None):
                raise RenderLimit(f"the bundle's chat template took longer than {seconds:g} s to render; it was stopped")
            raise RenderFailed(f"the bundle's chat template ended its render process (exit status {status})")

    def stop(self) -> None:
        """Kill the child now: a render in flight fails with RenderFailed; the next one starts another."""
        child = self._child
        if child is not None:
            child.stopped = True
            child.kill()

    def close(self) -> None:
        """Kill the child; later renders fail."""
        self._closed = True
        self.stop()


if __name__ == "__main__":
    main()
