"""The embedding API: load a bundle once, then generate or stream from any thread or event loop.

    from runtime.api import Model

    model = Model.load("bundles/smollm2", provider="cpu", max_queue=8)
    result = model.generate("The capital of France is", max_tokens=16)
    print(result.text, result.stop_reason, result.stats.acceptance_rate)

    for chunk in model.stream(messages=[{"role": "user", "content": "Hi!"}], stop=["\\n\\n"]):
        print(chunk.text, end="", flush=True)

    async for chunk in model.astream("def add(a, b):", max_tokens=64, temperature=0.7, seed=1):
        ...
    result = await model.agenerate(messages=[...])

Concurrency: one Model runs one generation at a time (its ONNX sessions and KV buffers hold one
sequence). Other requests wait their turn in arrival order in a bounded queue: `submit` (and so
every generate/stream call) raises QueueFullError at once when `max_queue` requests already
wait, and a request that waited longer than `queue_timeout` seconds raises QueueTimeoutError.
Calls may come from any number of threads and event loops at once.

Cancellation: pass `cancel=threading.Event()` and set it from anywhere, or call `Job.cancel()`.
A waiting request leaves the queue at once; a running one stops after the current target pass
and frees the engine. Either way the last chunk's result has stop_reason "cancelled". Leaving
an async stream early (break, an exception, a cancelled task) cancels its generation too; a
sync stream is released when its iterator is closed (CPython does that as soon as the loop
that held it lets go of it; `Job.close()` does it explicitly).

Imports no torch/transformers: onnxruntime, numpy, tokenizers and jinja2 only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

from edge_spec.sampling import SamplingConfig, SettingError, shown
from runtime.engine import Engine, EngineConfig, GenerateConfig, GenerationResult, Prompt, PromptTooLongError, Speculation
from runtime.stats import summarize

STOP_REASONS = ("eos", "stop", "length", "context", "cancelled")


class QueueFullError(RuntimeError):
    """The engine is busy and `max_queue` requests already wait: retry later."""


class QueueTimeoutError(TimeoutError):
    """The request waited longer than the model's queue_timeout for its turn."""


class ModelClosedError(RuntimeError):
    """The Model was closed; no new requests are taken."""


@dataclass(frozen=True)
class Options:
    """Per-request settings. temperature 0 is greedy; top_k 0 and top_p 1 disable those filters;
    seed None draws fresh randomness; stop strings end the text before their first occurrence."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Which drafter and γ cap this request decodes with (a Speculation or {"drafter", "max_gamma"});
    # None: the Model's own. Checked against the bundle at submit.
    speculation: Speculation | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise SettingError("max_tokens", f"max_tokens must be an integer >= 1, got {shown(self.max_tokens)}")
        if self.stop is None or isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,) if self.stop else ())
        stop = tuple(self.stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise SettingError("stop", f"stop must be non-empty strings, got {shown(self.stop)}")
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "speculation", Speculation.of(self.speculation))
        self.sampling()  # validates temperature, top_k, top_p, seed

    def sampling(self) -> SamplingConfig:
        return SamplingConfig(self.temperature, self.top_k, self.top_p, self.seed)

    def generate_config(self) -> GenerateConfig:
        return GenerateConfig(self.max_tokens, self.sampling(), self.stop, self.speculation)


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text. The last chunk of every stream has text "" and the result."""

    text: str
    result: GenerationResult | None = None


def _empty_result(prompt_ids: list[int], stop_reason: str) -> GenerationResult:
    stats = summarize((), 0, {}, 0.0, None, 0.0)
    return GenerationResult("", list(prompt_ids), [], stop_reason, stats.timings(), stats)


class _TurnQueue:
    """Admission and turn-taking: at most 1 + max_queue admitted requests; turns in arrival order."""

    def __init__(self, max_queue: int):
        if max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {max_queue}")
        self.max_queue = max_queue
        self.cond = threading.Condition()
        self._admitted: set[int] = set()
        self._order: deque[int] = deque()
        self._running: int | None = None
        self.running_thread: int | None = None  # thread that took the running ticket
        self._next = 0
        self.on_wait = None  # called (under the lock) while a request waits: releases abandoned streams

    def reserve(self) -> int:
        with self.cond:
            if len(self._admitted) >= self.max_queue + 1:
                raise QueueFullError(
                    f"the engine is busy and {self.max_queue} request(s) already wait; retry later"
                )
            self._next += 1
            self._admitted.add(self._next)
            return self._next

    def unreserve(self, ticket: int) -> None:
        with self.cond:
            self._admitted.discard(ticket)
            if ticket in self._order:
                self._order.remove(ticket)
            if self._running == ticket:
                self._running, self.running_thread = None, None
            self.cond.notify_all()

    def acquire(self, ticket: int, cancel: threading.Event, timeout: float | None) -> bool:
        """Waits for this ticket's turn. False if cancelled first; QueueTimeoutError on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cond:
            self._order.append(ticket)
            try:
                while self._running is not None or self._order[0] != ticket:
                    if cancel.is_set():
                        return False
                    wait = 0.05  # also polls a caller's own cancel Event
                    if deadline is not None:
                        left = deadline - time.monotonic()
                        if left <= 0:
                            raise QueueTimeoutError(f"waited {timeout:g} s for the engine; retry later")
                        wait = min(wait, left)
                    self.cond.wait(wait)
                    if self.on_wait is not None and self._running is not None:
                        self.on_wait()
                if cancel.is_set():
                    return False
                self._running = ticket
                self.running_thread = threading.get_ident()
                return True
            finally:
                self._order.remove(ticket)
                self.cond.notify_all()

    def release(self, ticket: int) -> None:
        with self.cond:
            if self._running == ticket:
                self._running, self.running_thread = None, None
            self.cond.notify_all()

    def wake(self) -> None:
        with self.cond:
            self.cond.notify_all()

    @property
    def running(self) -> bool:
        return self._running is not None

    @property
    def depth(self) -> int:
        """Admitted requests that do not hold the engine (waiting, or not started yet)."""
        with self.cond:
            return len(self._admitted) - (1 if self._running is not None else 0)


_END = object()


class _SyncStream:
    """A Job's synchronous iterator. It records when it was last left waiting for its caller, so
    a stream that still holds the engine but is no longer advanced (abandoned while referenced)
    can be closed by a waiting request after the Model's stream_idle_timeout."""

    def __init__(self, job: "Job", generator: Iterator[Chunk]):
        self._job = job
        self._generator = generator
        self._lock = threading.Lock()  # held while advancing: a stream being advanced is never closed
        self.idle_since: float | None = None

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        with self._lock:
            if self._job._abandoned:
                raise RuntimeError(
                    f"this stream was not advanced for {self._job.model.stream_idle_timeout:g} s while other requests "
                    "waited, so it was closed and its engine given to them (Model(stream_idle_timeout=...))"
                )
            self.idle_since = None
            try:
                return next(self._generator)
            finally:
                self.idle_since = time.monotonic()

    def close(self) -> None:
        with self._lock:
            self._generator.close()

    def abandon_if_idle(self, idle_s: float) -> bool:
        if self.idle_since is None or time.monotonic() - self.idle_since < idle_s or not self._lock.acquire(blocking=False):
            return False
        try:
            self._job._abandoned = True
            self._job.cancel()
            self._generator.close()
        finally:
            self._lock.release()
        return True


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Job:
    """One admitted request. Iterate it once, either synchronously (runs on the calling thread)
    or asynchronously (runs on a worker thread), or call result() / await aresult()."""

    def __init__(self, model: "Model", prompt: Prompt, options: Options, cancel: threading.Event | None):
        self.model = model
        self.prompt = prompt
        self.prompt_ids = list(prompt)
        self.options = options
        self._cancel = cancel if cancel is not None else threading.Event()
        self._ticket = model._queue.reserve()
        self._release = weakref.finalize(self, model._queue.unreserve, self._ticket)
        self._iterated = False
        self._iterator_ref = None  # weak: a dropped sync stream must close (and free the engine) at once
        self._on_start = None  # called once this job holds the engine
        self._async_queue: asyncio.Queue | None = None
        self._async_started: asyncio.Future | None = None
        self.final: GenerationResult | None = None  # set once the generation has ended
        self.submitted_at = time.perf_counter()
        self.first_token_at: float | None = None  # perf_counter when the first round committed tokens
        self._stream: _SyncStream | None = None  # the sync iterator, once there is one
        self._abandoned = False

    # -- control ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop this request: it leaves the queue, or stops after the current target pass."""
        self._cancel.set()
        self.model._queue.wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.final is not None

    def close(self) -> None:
        """Cancel, and release the engine and the queue slot now (for abandoned sync streams)."""
        self.cancel()
        iterator = self._iterator_ref() if self._iterator_ref is not None else None
        if iterator is not None:
            iterator.close()
        self._release()

    # -- synchronous ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Chunk]:
        if self._iterated:
            raise RuntimeError("a Job can be iterated only once")
        self._iterated = True
        iterator = _SyncStream(self, self._run())
        self._iterator_ref = weakref.ref(iterator)
        self._stream = weakref.proxy(iterator)
        return iterator

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return self.final

    def _run(self) -> Iterator[Chunk]:
        queue = self.model._queue
        try:
            waited_since = time.perf_counter()
            if not self._cancel.is_set() and queue.running_thread == threading.get_ident():
                raise RuntimeError("this thread is iterating a stream of this Model: a request made inside that loop "
                                   "would wait for it forever; finish or close() the stream first")
            if not queue.acquire(self._ticket, self._cancel, self.model.queue_timeout):
                self._finish(_empty_result(self.prompt_ids, "cancelled"), time.perf_counter() - waited_since)
                yield Chunk("", self.final)
                return
            self.model._holder = weakref.ref(self)
            if self._on_start is not None:
                self._on_start()
            try:
                yield from self._decode(time.perf_counter() - waited_since)
            finally:
                queue.release(self._ticket)
        except QueueTimeoutError:
            self.model._count("queue_timeouts")
            raise
        finally:
            self._release()

    def _decode(self, queue_s: float) -> Iterator[Chunk]:
        stream = self.model.engine.stream(self.prompt, self.options.generate_config(), cancel=self._cancel)
        try:
            for piece, result in stream:
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()  # the first text (or the result) arrived
                if result is None:
                    yield Chunk(piece)
                    continue
                self._finish(result, queue_s)
                yield Chunk("", result)
        finally:
            stream.close()

    def _finish(self, result: GenerationResult, queue_s: float) -> None:
        result.timings["queue_s"] = queue_s
        self.final = result
        self.model._record(result)

    # -- asynchronous -----------------------------------------------------------------------

    async def astart(self) -> bool:
        """Start the generation on a worker thread and wait until it holds the engine.
        Returns False if it was cancelled while waiting; raises QueueTimeoutError."""
        if self._async_queue is None:
            if self._iterated:
                raise RuntimeError("a Job can be iterated only once")
            if self.model._queue.running_thread == threading.get_ident():
                # An event loop run inside a sync stream's loop body (asyncio.run(model.agenerate(...))):
                # the stream cannot advance until this await returns, so it would wait for itself.
                self.close()
                raise RuntimeError("this thread is iterating a stream of this Model: an event loop run inside that loop "
                                   "would wait for it forever; finish or close() the stream first")
            self._iterated = True
            loop = asyncio.get_running_loop()
            self._async_queue = asyncio.Queue()
            self._async_started = loop.create_future()
            # Retrieve a failure even when nobody awaits it any more (no "never retrieved" noise).
            self._async_started.add_done_callback(lambda f: f.cancelled() or f.exception())
            threading.Thread(target=self._work, args=(loop,), name=f"edge-spec-job-{self._ticket}", daemon=True).start()
        return await asyncio.shield(self._async_started)

    def _work(self, loop: asyncio.AbstractEventLoop) -> None:
        def put(item) -> None:
            try:
                loop.call_soon_threadsafe(self._async_queue.put_nowait, item)
            except RuntimeError:  # the loop is gone: nobody listens any more
                self.cancel()

        def started(value) -> None:
            def settle():
                if not self._async_started.done():
                    if isinstance(value, BaseException):
                        self._async_started.set_exception(value)
                    else:
                        self._async_started.set_result(value)
            try:
                loop.call_soon_threadsafe(settle)
            except RuntimeError:
                self.cancel()

        self._on_start = lambda: started(True)
        try:
            for chunk in self._run():
                put(chunk)
        except BaseException as exc:  # handed to the awaiting side
            started(exc)
            put(_Failure(exc))
        else:
            started(False)
        finally:
            put(_END)

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._aiterate()

    async def _aiterate(self) -> AsyncIterator[Chunk]:
        try:
            await self.astart()
        except QueueTimeoutError:
            raise
        except BaseException:
            self.cancel()
            raise
        try:
            while True:
                item = await self._async_queue.get()
                if item is _END:
                    return
                if isinstance(item, _Failure):
                    if isinstance(item.exc, QueueTimeoutError):
                        continue  # already raised by astart
                    raise item.exc
                yield item
        finally:
            if self.final is None:
                self.cancel()

    async def aresult(self) -> GenerationResult:
        async for _ in self:
            pass
        return self.final


def _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout) -> None:
    for label, seconds in (("queue_timeout", queue_timeout), ("stream_idle_timeout", stream_idle_timeout)):
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"{label} must be a number of seconds > 0, or None, got {shown(seconds)}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be an integer >= 0, got {shown(max_queue)}")


@dataclass
class _Counters:
    values: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Model:
    """A loaded bundle with a bounded request queue. Thread-safe; see the module docstring."""

    def __init__(self, engine: Engine, *, max_queue: int = 16, queue_timeout: float | None = None, name: str | None = None,
                 stream_idle_timeout: float | None = 60.0):
        _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout)
        self.engine = engine
        self.name = name or Path(engine.bundle.path).resolve().name
        self.queue_timeout = queue_timeout
        # A sync stream holding the engine but not advanced for this long, while another request
        # waits, is closed: a stream abandoned but still referenced cannot block everyone.
        self.stream_idle_timeout = stream_idle_timeout
        self._holder = None  # weak reference to the Job holding the engine
        self._queue = _TurnQueue(max_queue)
        self._queue.on_wait = self._release_abandoned
        self._closed = False
        self._jobs: weakref.WeakSet[Job] = weakref.WeakSet()
        self._counters = _Counters()
        for key in ("requests", "rejected", "queue_timeouts", "prompt_tokens", "completion_tokens", "target_passes",
                    "drafted_tokens", "accepted_tokens", *(f"finished_{r}" for r in STOP_REASONS)):
            self._counters.values[key] = 0

    @classmethod
    def load(
        cls,
        bundle: str | Path,
        *,
        provider: str = "auto",
        threads: int = 0,
        drafter: str = "auto",
        gamma: int | None = None,
        max_gamma: int = 8,
        allow_fallback: bool = False,
        max_queue: int = 16,
        queue_timeout: float | None = None,
        name: str | None = None,
        engine_config: EngineConfig | None = None,
        stream_idle_timeout: float | None = 60.0,
        bundle_sha256: str | None = None,
    ) -> "Model":
        """Open a bundle (validates it, loads the sessions, calibrates γ costs). engine_config,
        when given, replaces the provider..allow_fallback keywords. bundle_sha256: refuse the
        bundle unless its manifest.json has this SHA-256 (EngineConfig.bundle_sha256)."""
        _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout)  # before the (slow) load
        config = engine_config or EngineConfig(
            provider=provider, threads=threads, drafter=drafter, gamma=gamma,
            max_gamma=max(max_gamma, gamma or 0), allow_fallback=allow_fallback,
        )
        if bundle_sha256 is not None:
            config = dataclasses.replace(config, bundle_sha256=bundle_sha256)
        return cls(Engine(bundle, config), max_queue=max_queue, queue_timeout=queue_timeout, name=name,
                   stream_idle_timeout=stream_idle_timeout)

    def _release_abandoned(self) -> None:
        job = self._holder() if self._holder is not None else None
        if job is None or self.stream_idle_timeout is None or job._stream is None:
            return
        try:
            job._stream.abandon_if_idle(self.stream_idle_timeout)
        except ReferenceError:  # the stream was dropped meanwhile (and so closed)
            pass

    # -- facts ------------------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.engine.target.cache.max_context

    @property
    def has_chat_template(self) -> bool:
        return self.engine.tokenizer.has_chat_template

    @property
    def max_queue(self) -> int:
        return self._queue.max_queue

    @property
    def queue_depth(self) -> int:
        """Requests admitted but not holding the engine."""
        return self._queue.depth

    @property
    def busy(self) -> bool:
        return self._queue.running

    def counters(self) -> dict:
        """Totals since load: requests, rejected, queue_timeouts, prompt/completion tokens,
        target passes, drafted/accepted tokens, and finished_<stop reason>."""
        with self._counters.lock:
            return dict(self._counters.values)

    def _count(self, key: str, n: int = 1) -> None:
        with self._counters.lock:
            self._counters.values[key] = self._counters.values.get(key, 0) + n

    def _record(self, result: GenerationResult) -> None:
        s = result.stats
        with self._counters.lock:
            v = self._counters.values
            v["prompt_tokens"] += len(result.prompt_ids)
            v["completion_tokens"] += len(result.token_ids)
            v["target_passes"] += s.target_passes
            v["drafted_tokens"] += s.drafted_tokens
            v["accepted_tokens"] += s.accepted_tokens
            key = f"finished_{result.stop_reason}"
            v[key] = v.get(key, 0) + 1

    # -- requests ---------------------------------------------------------------------------

    def encode(self, prompt: str | None = None, messages: list[dict] | None = None, parse_special: bool = True) -> list[int]:
        """Token ids of a raw prompt (the tokenizer adds BOS if it does) or of chat messages
        rendered with the bundle's chat template and its generation prompt. Special-token
        strings in message content are always text; in a raw prompt, with parse_special=False."""
        return self.engine.encode(prompt=prompt, messages=messages, parse_special=parse_special)

    @property
    def vocab_size(self) -> int:
        """Token ids a prompt may hold: [0, vocab_size)."""
        return self.engine.bundle.manifest.tokenizer.n_real_tokens

    def check_prompt(self, prompt_ids: list[int]) -> Prompt:
        """The engine's prompt check; the Prompt it returns is not checked again by submit."""
        return self.engine.check_prompt(prompt_ids)

    def submit(
        self,
        prompt: str | None = None,
        *,
        messages: list[dict] | None = None,
        prompt_ids: list[int] | None = None,
        options: Options | None = None,
        cancel: threading.Event | None = None,
        **settings,
    ) -> Job:
        """Admit one request: exactly one of prompt, messages, prompt_ids; settings are Options'
        fields (max_tokens, temperature, top_k, top_p, seed, stop) or a whole `options`.
        Raises ValueError (bad settings), PromptTooLongError, ChatTemplateError or
        QueueFullError right away; otherwise returns a Job that has not started."""
        if self._closed:
            raise ModelClosedError("the model is closed")
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("pass exactly one of prompt, messages or prompt_ids")
        if options is not None and settings:
            raise ValueError("pass either options or individual settings, not both")
        if options is None:
            options = Options(**settings)
        self.engine.check_speculation(options.speculation)
        checked = self.check_prompt(prompt_ids if prompt_ids is not None else self.encode(prompt=prompt, messages=messages))
        try:
            job = Job(self, checked, options, cancel)
        except QueueFullError:
            self._count("rejected")
            raise
        self._count("requests")
        self._jobs.add(job)
        return job

    def generate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Blocks until done (waiting its turn first). See submit for the arguments."""
        return self.submit(prompt, **kwargs).result()

    def stream(self, prompt: str | None = None, **kwargs) -> Iterator[Chunk]:
        """Text chunks as tokens are accepted; the last chunk carries the result."""
        return iter(self.submit(prompt, **kwargs))

    async def agenerate(self, prompt: str | None = None, **kwargs) -> GenerationResult:
        """Async generate: the decoding runs on a worker thread; the event loop stays free."""
        return await self.submit(prompt, **kwargs).aresult()

    def astream(self, prompt: str | None = None, **kwargs) -> Job:
        """Async stream (`async for chunk in model.astream(...)`). Admission errors are raised
        here, before iteration starts."""
        return self.submit(prompt, **kwargs)

    def cancel_all(self) -> None:
        """Cancel every admitted request (waiting or running); new ones are still taken."""
        for job in list(self._jobs):
            job.cancel()

    def close(self) -> None:
        """Take no new requests and cancel those admitted."""
        self._closed = True
        self.cancel_all()


__all__ = [
    "Chunk", "GenerationResult", "Job", "Model", "ModelClosedError", "Options", "Prompt", "PromptTooLongError",
    "QueueFullError", "QueueTimeoutError", "EngineConfig", "Speculation",
]
