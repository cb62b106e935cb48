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
sequence). Other requests wait their turn in a bounded queue, in arrival order except that clients
(the `client` setting) take turns (runtime/scheduler.py): `submit` (and so
every generate/stream call) raises QueueFullError at once when `max_queue` requests already
wait, and a request that waited longer than `queue_timeout` seconds raises QueueTimeoutError.
Calls may come from any number of threads and event loops at once. The Model's Scheduler
(runtime/scheduler.py) is the one owner of all of it: admission, the line, cancellation,
abandoned streams, and the one worker thread that drives the Engine for every caller.

Cancellation: pass `cancel=threading.Event()` and set it from anywhere, or call `Job.cancel()`
(anything else, `cancel=True` included, is a TypeError: a bool could never be set later).
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import AsyncIterator, Iterator

from edge_spec.params import shown
from runtime.engine import Engine, EngineConfig, GenerationResult, Prompt, PromptTooLongError
from runtime.requests import Options, Speculation
from runtime.scheduler import BufferSink, Chunk, Failure, QueueFullError, QueueTimeoutError, Request, Scheduler, Sink

STOP_REASONS = ("eos", "stop", "length", "context", "cancelled")


class ModelClosedError(RuntimeError):
    """The Model was closed; no new requests are taken."""


class _SyncStream:
    """A Job's synchronous iterator: takes the chunks the scheduler's worker decodes for it.
    Dropping it (a `break`, CPython collecting it) withdraws its request and frees the engine."""

    def __init__(self, job: "Job"):
        self._job = job
        self._scheduler = job.model._scheduler
        self._sequence = job._sequence
        self._started = False
        self._finalizer = weakref.finalize(self, self._scheduler.withdraw, self._sequence)
        self._finalizer.atexit = False  # at exit nobody waits for the pass it would wait for

    def __iter__(self):
        return self

    def __next__(self) -> Chunk:
        if not self._started:
            self._scheduler.start(self._sequence, BufferSink(), synchronous=True)
            self._started = True
        return self._scheduler.take(self._sequence)

    def close(self) -> None:
        self._finalizer()


_END = object()


class _AsyncSink(Sink):
    """An async consumer's chunks, handed to its event loop; decoded as fast as the engine goes
    (the consumer is the event loop, which leaving or cancelling ends through Job.cancel)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue, started: asyncio.Future,
                 cancel: threading.Event):
        self._loop, self._queue, self._started, self._cancel = loop, queue, started, cancel
        self._settled = False

    def _call(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is gone: nobody listens any more
            self._cancel.set()

    def _settle(self, value) -> None:
        if self._settled:
            return
        self._settled = True

        def settle():
            if not self._started.done():
                if isinstance(value, BaseException):
                    self._started.set_exception(value)
                else:
                    self._started.set_result(value)
        self._call(settle)

    def started(self) -> None:
        self._settle(True)

    def put(self, item) -> None:
        if isinstance(item, Failure):
            self._settle(item.exc)
        self._call(self._queue.put_nowait, item)

    def end(self) -> None:
        self._settle(False)  # ended before it took a slot: cancelled while waiting
        self._call(self._queue.put_nowait, _END)


class Job:
    """One admitted request. Iterate it once, either synchronously or asynchronously, or call
    result() / await aresult(); either way the Model's scheduler decodes it on its worker."""

    def __init__(self, model: "Model", prompt: Prompt, options: Options, cancel: threading.Event | None):
        self.model = model
        self.prompt = prompt
        self.prompt_ids = list(prompt)
        self.options = options
        self._cancel = cancel if cancel is not None else threading.Event()
        self._sequence = model._scheduler.submit(Request(prompt, options.generate_config(), self._cancel))
        # A Job dropped before it ran gives its admission back; one dropped while it runs stops.
        weakref.finalize(self, model._scheduler.drop, self._sequence)
        self._iterated = False
        self._async_queue: asyncio.Queue | None = None
        self._async_started: asyncio.Future | None = None
        self.submitted_at = time.perf_counter()

    # -- state ------------------------------------------------------------------------------

    @property
    def final(self) -> GenerationResult | None:
        """The result, once the generation has ended."""
        return self._sequence.final

    @property
    def first_token_at(self) -> float | None:
        """perf_counter when the first round's text (or the result) was decoded."""
        return self._sequence.first_token_at

    # -- control ----------------------------------------------------------------------------

    def cancel(self) -> None:
        """Stop this request: it leaves the queue, or stops after the current target pass."""
        self.model._scheduler.cancel(self._sequence)

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.final is not None

    def close(self) -> None:
        """Cancel, and release the engine and the queue slot now (for abandoned sync streams)."""
        self.model._scheduler.withdraw(self._sequence)

    # -- synchronous ------------------------------------------------------------------------

    def __iter__(self) -> Iterator[Chunk]:
        if self._iterated:
            raise RuntimeError("a Job can be iterated only once")
        self._iterated = True
        return _SyncStream(self)

    def result(self) -> GenerationResult:
        for _ in self:
            pass
        return self.final

    # -- asynchronous -----------------------------------------------------------------------

    async def astart(self) -> bool:
        """Join the line and wait until this job holds the engine. Returns False if it was
        cancelled while waiting; raises QueueTimeoutError."""
        if self._async_queue is None:
            if self._iterated:
                raise RuntimeError("a Job can be iterated only once")
            loop = asyncio.get_running_loop()
            queue, started = asyncio.Queue(), loop.create_future()
            # Retrieve a failure even when nobody awaits it any more (no "never retrieved" noise).
            started.add_done_callback(lambda f: f.cancelled() or f.exception())
            # An event loop run inside a sync stream's loop body (asyncio.run(model.agenerate(...)))
            # is refused here: the stream cannot advance until this await returns.
            self.model._scheduler.start(self._sequence, _AsyncSink(loop, queue, started, self._cancel), synchronous=False)
            self._iterated = True
            self._async_queue, self._async_started = queue, started
        return await asyncio.shield(self._async_started)

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
                if isinstance(item, Failure):
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


def _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout, max_per_client=None) -> None:
    for label, seconds in (("queue_timeout", queue_timeout), ("stream_idle_timeout", stream_idle_timeout)):
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, (int, float))
                                    or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"{label} must be a number of seconds > 0, or None, got {shown(seconds)}")
    if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
        raise ValueError(f"max_queue must be an integer >= 0, got {shown(max_queue)}")
    if max_per_client is not None and (isinstance(max_per_client, bool) or not isinstance(max_per_client, int) or max_per_client < 1):
        raise ValueError(f"max_per_client must be an integer >= 1, or None, got {shown(max_per_client)}")


@dataclass
class _Counters:
    values: dict = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


class Model:
    """A loaded bundle with a bounded request queue. Thread-safe; see the module docstring."""

    def __init__(self, engine: Engine, *, max_queue: int = 16, queue_timeout: float | None = None, name: str | None = None,
                 stream_idle_timeout: float | None = 60.0, parallel: int = 1, max_per_client: int | None = None):
        """parallel: sequences decoding at once. Above 1, requests that decode plainly (drafter
        "none") share each target pass, one KV slot each (runtime/batch.py); a request with a
        drafter decodes beside them, one such at a time. max_per_client: requests one client
        (the `client` setting) may have running or waiting; None: no bound but the queue's."""
        _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout, max_per_client)
        self.engine = engine
        self.name = name or Path(engine.bundle.path).resolve().name
        # stream_idle_timeout: a sync stream holding the engine but not advanced for this long,
        # while another request waits, is closed (abandoned but still referenced).
        self._scheduler = Scheduler(engine, max_queue=max_queue, queue_timeout=queue_timeout,
                                    stream_idle_timeout=stream_idle_timeout, on_result=self._record,
                                    on_queue_timeout=lambda: self._count("queue_timeouts"), slots=parallel,
                                    max_per_client=max_per_client)
        self._closed = False
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
        parallel: int = 1,
        max_per_client: int | None = None,
    ) -> "Model":
        """Open a bundle (validates it, loads the sessions, calibrates γ costs). engine_config,
        when given, replaces the provider..allow_fallback keywords. bundle_sha256: refuse the
        bundle unless its manifest.json has this SHA-256 (EngineConfig.bundle_sha256)."""
        _check_queue_settings(max_queue, queue_timeout, stream_idle_timeout, max_per_client)  # before the (slow) load
        config = engine_config or EngineConfig(
            provider=provider, threads=threads, drafter=drafter, gamma=gamma,
            max_gamma=max_gamma, allow_fallback=allow_fallback,
        )
        if bundle_sha256 is not None:
            config = dataclasses.replace(config, bundle_sha256=bundle_sha256)
        if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
            raise ValueError(f"parallel must be an integer >= 1, got {shown(parallel)}")  # before the (slow) load
        return cls(Engine(bundle, config), max_queue=max_queue, queue_timeout=queue_timeout, name=name,
                   stream_idle_timeout=stream_idle_timeout, parallel=parallel, max_per_client=max_per_client)

    # -- facts ------------------------------------------------------------------------------

    @property
    def max_context(self) -> int:
        return self.engine.target.cache.max_context

    @property
    def has_chat_template(self) -> bool:
        return self.engine.tokenizer.has_chat_template

    @property
    def queue_timeout(self) -> float | None:
        return self._scheduler.queue_timeout

    @property
    def stream_idle_timeout(self) -> float | None:
        return self._scheduler.stream_idle_timeout

    @property
    def max_queue(self) -> int:
        return self._scheduler.max_queue

    @property
    def queue_depth(self) -> int:
        """Requests admitted but not holding the engine."""
        return self._scheduler.depth

    @property
    def busy(self) -> bool:
        return self._scheduler.busy

    @property
    def running(self) -> int:
        """Requests decoding now (at most `parallel`)."""
        return self._scheduler.running

    @property
    def parallel(self) -> int:
        return self._scheduler.slots

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
        fields (max_tokens, temperature, top_k, top_p, seed, stop, client) or a whole `options`.
        Raises ValueError (bad settings), PromptTooLongError, ChatTemplateError or
        QueueFullError right away; otherwise returns a Job that has not started."""
        if self._closed:
            raise ModelClosedError("the model is closed")
        if sum(x is not None for x in (prompt, messages, prompt_ids)) != 1:
            raise ValueError("pass exactly one of prompt, messages or prompt_ids")
        if options is not None and settings:
            raise ValueError("pass either options or individual settings, not both")
        if cancel is not None and not isinstance(cancel, threading.Event):
            raise TypeError(f"cancel must be a threading.Event (set it to cancel) or None, got {shown(cancel)}")
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
        self._scheduler.cancel_all()

    def close(self) -> None:
        """Take no new requests and cancel those admitted."""
        self._closed = True
        self.cancel_all()


__all__ = [
    "Chunk", "GenerationResult", "Job", "Model", "ModelClosedError", "Options", "Prompt", "PromptTooLongError",
    "QueueFullError", "QueueTimeoutError", "EngineConfig", "Speculation",
]
