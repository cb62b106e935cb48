"""The one owner of concurrency for an Engine: admission, the line, turns, cancellation and
abandonment, and the one worker thread that drives the Engine.

    sequence = scheduler.submit(request)     # admission: QueueFullError at once, or a slot in the line
    scheduler.start(sequence, sink, synchronous)  # joins the line (a Job does this when first iterated)
    ...                                      # the worker decodes it; its chunks go to the sink
    scheduler.cancel(sequence) / withdraw(sequence)

The Engine is single-owner and lock-free; the worker is that owner, the one caller of
Engine.stream and Engine.advance_slots, whichever thread or event loop a request came from.
`Scheduler._next_pass` is where the sequences of the next pass are chosen and `_advance` where it
runs. With `slots` N > 1 (Model(parallel=N), serve --parallel N), every request takes one of the
Engine's N KV slots and Engine.advance_slots steps them: one batched target pass feeds each its
next token (runtime/batch.py), except that the one sequence holding the Engine's drafter plays a
speculative round of its own where that is priced to commit more tokens a second (alone, it
always may). ONNX Runtime's CPU GroupQueryAttention batches one token per sequence exactly but
refuses a block of several tokens with a past at batch > 1 (tests/test_batched_attention.py), so
batching several sequences' verify blocks needs one attention node per slot with the weight
kernels shared (not built). With one slot, a request decodes through Engine.stream.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable, Iterator

from runtime import heap
from runtime.engine import Engine, GenerateConfig, GenerationResult, Prompt, SlotSequence
from runtime.stats import summarize

WORKER_NAME = "edge-spec-scheduler"
# How often the idle worker looks at cancel Events set directly (not through cancel()), queue
# deadlines and streams left unread.
POLL_S = 0.05


class QueueFullError(RuntimeError):
    """The engine is busy and `max_queue` requests already wait: retry later."""


class QueueTimeoutError(TimeoutError):
    """The request waited longer than the model's queue_timeout for its turn."""


@dataclass(frozen=True)
class Chunk:
    """A piece of streamed text. The last chunk of every stream has text "" and the result."""

    text: str
    result: GenerationResult | None = None


@dataclass(frozen=True)
class Request:
    """What one sequence decodes: a checked prompt, its settings, and the Event that cancels it."""

    prompt: Prompt
    config: GenerateConfig
    cancel: threading.Event

    @property
    def client(self) -> str | None:
        """Who sent it (GenerateConfig.client): admission and slots are shared fairly by it."""
        return self.config.client

    def __post_init__(self):
        if not isinstance(self.prompt, Prompt):
            raise ValueError(f"a Request's prompt must be a Prompt (checked), got {type(self.prompt).__name__}")
        if not isinstance(self.config, GenerateConfig):
            raise ValueError(f"a Request's config must be a GenerateConfig, got {type(self.config).__name__}")


class Failure:
    """An exception the worker hands to the sequence's consumer, who raises it."""

    def __init__(self, exc: BaseException):
        self.exc = exc


class Sink:
    """Where a sequence's chunks go; called by the scheduler holding its lock, so never blocks."""

    def started(self) -> None:
        """The sequence took a slot."""

    def put(self, item: Chunk | Failure) -> None:
        raise NotImplementedError

    def end(self) -> None:
        """Nothing more will be put."""

    def ready(self) -> bool:
        """Whether the consumer can take another chunk now: a sequence is advanced only then."""
        return True


class BufferSink(Sink):
    """A synchronous consumer's chunks: one chunk decoded ahead of it, so a stream nobody reads
    stops decoding (and can be found abandoned) instead of running to its end."""

    def __init__(self):
        self.buffer: deque = deque()

    def put(self, item) -> None:
        self.buffer.append(item)

    def ready(self) -> bool:
        return not self.buffer


def empty_result(prompt_ids, stop_reason: str) -> GenerationResult:
    stats = summarize((), 0, {}, 0.0, None, 0.0)
    return GenerationResult("", list(prompt_ids), [], stop_reason, stats.timings(), stats)


ADMITTED, WAITING, RUNNING, ENDED = "admitted", "waiting", "running", "ended"


class Sequence:
    """One admitted request as the scheduler sees it. It holds no reference to the Job that
    wraps it, so a Job dropped by its caller is collected and gives its slot back."""

    def __init__(self, request: Request):
        self.request = request
        self.state = ADMITTED
        self.sink: Sink | None = None
        self.consumer: int | None = None  # thread id of a synchronous consumer
        self.enqueued_at: float | None = None  # perf_counter when it joined the line
        self.deadline: float | None = None  # monotonic: QueueTimeoutError past this while waiting
        self.started_at: float | None = None
        self.first_token_at: float | None = None  # perf_counter when its first chunk was decoded
        self.unread_since: float | None = None  # monotonic: decoded ahead and not taken since
        self.final: GenerationResult | None = None
        self.abandoned = False
        self.withdrawn = False  # its consumer went away: ended between passes, with no result
        self.generator: Iterator | None = None  # Engine.stream, advanced by the worker only
        self.decoding: SlotSequence | None = None  # or: plain decoding in a KV slot, batched with others

    @property
    def cancelled(self) -> bool:
        return self.request.cancel.is_set()

    def queue_s(self) -> float:
        end = self.started_at or time.perf_counter()
        return 0.0 if self.enqueued_at is None else end - self.enqueued_at


class Scheduler:
    """Admits up to slots + max_queue sequences (at most max_per_client of one client's), gives
    free slots to clients in turn, and hands each one's chunks to its sink. Thread-safe; the
    Engine is touched by the worker.

    Fairness between clients (Request.client; None is one anonymous client): a free slot goes
    to the oldest waiting sequence of the client with the fewest sequences running, on equal
    counts of the client that took a slot least recently, so a client with many requests in the
    line takes turns with one that has a single request; one client's own requests keep their
    order, and with one client the line is first come, first served."""

    def __init__(self, engine: Engine, *, max_queue: int, queue_timeout: float | None, stream_idle_timeout: float | None,
                 on_result: Callable[[GenerationResult], None] = lambda result: None,
                 on_queue_timeout: Callable[[], None] = lambda: None, slots: int = 1, max_per_client: int | None = None):
        if isinstance(slots, bool) or not isinstance(slots, int) or slots < 1:
            raise ValueError(f"slots must be an integer >= 1, got {slots!r}")
        if max_per_client is not None and (isinstance(max_per_client, bool) or not isinstance(max_per_client, int)
                                           or max_per_client < 1):
            raise ValueError(f"max_per_client must be an integer >= 1, or None, got {max_per_client!r}")
        if slots > 1:
            if engine.config.block_stable:
                raise ValueError("batched decoding is not block-stable (docs/batching.md): serve one "
                                 "sequence at a time (parallel 1) in block-stable mode")
            engine.batched(slots)  # the KV slots, allocated now: a bundle that cannot batch fails here
        self.engine = engine
        self.max_queue = max_queue
        self.queue_timeout = queue_timeout
        self.stream_idle_timeout = stream_idle_timeout
        self.slots = slots
        self.max_per_client = max_per_client  # None: one client may hold every place
        self._on_result = on_result
        self._on_queue_timeout = on_queue_timeout
        self.cond = threading.Condition()
        self._live: set[Sequence] = set()  # admitted and not ended: what max_queue bounds
        self._line: deque[Sequence] = deque()  # waiting for a slot, in the order they joined
        self._running: list[Sequence] = []  # in a slot
        self._held: Counter = Counter()  # admitted and not ended, per client
        self._turns: dict[str | None, int] = {}  # when each client holding sequences last took a slot
        self._turn = 0
        self._worker: threading.Thread | None = None

    # -- the surface ------------------------------------------------------------------------

    def submit(self, request: Request) -> Sequence:
        """Admission: a Sequence holding a slot or a place in the line, or QueueFullError."""
        with self.cond:
            if len(self._live) >= self.slots + self.max_queue:
                raise QueueFullError(f"the engine is busy and {self.max_queue} request(s) already wait; retry later")
            if self.max_per_client is not None and self._held[request.client] >= self.max_per_client:
                raise QueueFullError(f"this client already has {self.max_per_client} request(s) running or waiting, the "
                                     "most one client may; retry when one ends")
            sequence = Sequence(request)
            self._live.add(sequence)
            self._held[request.client] += 1
            return sequence

    def start(self, sequence: Sequence, sink: Sink, synchronous: bool) -> None:
        """The sequence joins the line; its chunks go to `sink`. RuntimeError (and the slot
        given back) on a thread that consumes a running stream of this scheduler: it would
        wait for itself."""
        worker = None
        with self.cond:
            # A cancelled sequence ends at once, so it waits for nothing.
            if not sequence.cancelled and any(s.consumer == threading.get_ident() for s in self._running):
                self._discard(sequence)
                raise RuntimeError("this thread is iterating a stream of this Model: a request made inside that loop "
                                   "would wait for it forever; finish or close() the stream first")
            if sequence.sink is not None:
                raise RuntimeError("a Job can be iterated only once")
            sequence.sink = sink
            sequence.consumer = threading.get_ident() if synchronous else None
            sequence.enqueued_at = time.perf_counter()
            if self.queue_timeout is not None:
                sequence.deadline = time.monotonic() + self.queue_timeout
            if sequence.cancelled or sequence.state == ENDED:  # cancelled, or closed, before it started
                self._end(sequence, Chunk("", empty_result(sequence.request.prompt, "cancelled")))
                return
            sequence.state = WAITING
            self._line.append(sequence)
            if self._worker is None:
                self._worker = worker = threading.Thread(target=self._work, name=WORKER_NAME, daemon=True)
            self.cond.notify_all()
        if worker is not None:
            # Started outside the lock: Thread.start waits for the new thread, and a collected handle's
            # finalizer (drop, withdraw: they take the lock) may run in that thread before it counts as started.
            worker.start()

    def cancel(self, sequence: Sequence) -> None:
        """A waiting sequence leaves the line now; a running one stops after its current pass."""
        with self.cond:
            sequence.request.cancel.set()
            if sequence.state == WAITING:
                self._line.remove(sequence)
                self._end(sequence, Chunk("", empty_result(sequence.request.prompt, "cancelled")))
            self.cond.notify_all()

    def drop(self, sequence: Sequence) -> None:
        """Its handle was collected: a sequence not yet started gives its admission back; one
        in the line or running is cancelled (and still counted, as any cancelled request)."""
        with self.cond:
            if sequence.state == ADMITTED:
                self._discard(sequence)
            else:
                self.cancel(sequence)

    def withdraw(self, sequence: Sequence) -> None:
        """Cancel, and give the slot back now: a sequence not yet started is dropped, a running
        one is waited for until its current pass ends (for a consumer that went away)."""
        with self.cond:
            sequence.request.cancel.set()
            if sequence.state == ADMITTED:
                self._discard(sequence)
                return
            sequence.withdrawn = True
            self.cancel(sequence)
            if self._worker is not threading.current_thread():
                while sequence.state == RUNNING:
                    self.cond.wait()

    def take(self, sequence: Sequence) -> Chunk:
        """The next chunk for a synchronous consumer (blocks); StopIteration after the last."""
        with self.cond:
            while True:
                if sequence.abandoned:
                    raise RuntimeError(
                        f"this stream was not advanced for {self.stream_idle_timeout:g} s while other requests "
                        "waited, so it was closed and its engine given to them (Model(stream_idle_timeout=...))")
                if sequence.sink.buffer:
                    item = sequence.sink.buffer.popleft()
                    sequence.unread_since = None
                    self.cond.notify_all()
                    break
                if sequence.state == ENDED:
                    raise StopIteration
                self.cond.wait()
        if isinstance(item, Failure):
            raise item.exc
        return item

    def cancel_all(self) -> None:
        with self.cond:
            for sequence in list(self._live):
                self.cancel(sequence)

    @property
    def busy(self) -> bool:
        return bool(self._running)

    @property
    def running(self) -> int:
        """Sequences decoding now (at most `slots`)."""
        with self.cond:
            return len(self._running)

    @property
    def waiting(self) -> int:
        """Sequences in the line (started, waiting for a slot)."""
        with self.cond:
            return len(self._line)

    @property
    def depth(self) -> int:
        """Admitted sequences not in a slot (waiting, or not started yet)."""
        with self.cond:
            return len(self._live) - len(self._running)

    # -- the worker -------------------------------------------------------------------------

    def _work(self) -> None:
        """Chooses the next pass and runs it, until nothing waits or runs (then the thread ends:
        a Model nobody uses holds no thread)."""
        while True:
            with self.cond:
                while True:
                    batch = self._next_pass()
                    if batch:
                        break
                    if not self._line and not self._running:
                        self._worker = None
                        break
                    self.cond.wait(self._wait_s())
            if not batch:
                heap.release_free()  # the burst is over: what its threads freed goes back
                return
            self._advance(batch)

    def _wait_s(self) -> float:
        """Until the next thing that may change without a notify: a deadline, or the poll."""
        deadlines = [s.deadline - time.monotonic() for s in self._line if s.deadline is not None]
        return max(0.0, min([POLL_S, *deadlines]))

    def _next_pass(self) -> list[Sequence]:
        """Under the lock: settle the line, fill free slots from its head, and return the running
        sequences the next pass advances (those whose consumer can take more, or cancelled)."""
        now = time.monotonic()
        for sequence in list(self._line):
            if sequence.cancelled:
                self._line.remove(sequence)
                self._end(sequence, Chunk("", empty_result(sequence.request.prompt, "cancelled")))
            elif sequence.deadline is not None and now >= sequence.deadline:
                self._line.remove(sequence)
                self._on_queue_timeout()
                self._end(sequence, Failure(QueueTimeoutError(f"waited {self.queue_timeout:g} s for the engine; retry later")))
        for sequence in list(self._running):
            if sequence.withdrawn:
                self._end(sequence, None)
            elif self._left_unread(sequence, now):
                self._abandon(sequence)
        while self._line and len(self._running) < self.slots:
            sequence = self._next_in_line()
            self._line.remove(sequence)
            self._turns[sequence.request.client], self._turn = self._turn, self._turn + 1
            sequence.state = RUNNING
            sequence.started_at = time.perf_counter()
            if self.slots > 1:
                taken = {s.decoding.slot for s in self._running if s.decoding is not None}
                slot = self.engine.free_slot(sequence.request.prompt, taken, self.slots)
                sequence.decoding = self.engine.slot_sequence(slot, sequence.request.prompt, sequence.request.config,
                                                              sequence.request.cancel)
            else:
                sequence.generator = self.engine.stream(sequence.request.prompt, sequence.request.config,
                                                        cancel=sequence.request.cancel)
            self._running.append(sequence)
            sequence.sink.started()
        batch = []
        for sequence in self._running:
            if sequence.cancelled or sequence.sink.ready():
                batch.append(sequence)
            elif sequence.unread_since is None:
                sequence.unread_since = now
        return batch

    def _next_in_line(self) -> Sequence:
        """The sequence a free slot goes to (the class docstring's turns)."""
        running = Counter(s.request.client for s in self._running)
        oldest: dict[str | None, Sequence] = {}
        for sequence in self._line:
            oldest.setdefault(sequence.request.client, sequence)
        # min keeps the first of equals: the client whose oldest sequence joined the line first.
        return min(oldest.values(), key=lambda s: (running[s.request.client], self._turns.get(s.request.client, -1)))

    def _left_unread(self, sequence: Sequence, now: float) -> bool:
        """A stream decoded ahead and not read for stream_idle_timeout while others wait: abandoned
        while still referenced, it must not hold the engine from them."""
        return (self.stream_idle_timeout is not None and bool(self._line) and sequence.unread_since is not None
                and now - sequence.unread_since > self.stream_idle_timeout)

    def _advance(self, batch: list[Sequence]) -> None:
        """Runs the pass, outside the lock: one step of the sequences in KV slots
        (Engine.advance_slots), or a round of the one stream decoding alone (slots 1)."""
        slotted = [s for s in batch if s.decoding is not None]
        for sequence in [s for s in slotted if s.cancelled]:
            tail, result = self.engine.end_slot(sequence.decoding, "cancelled")
            self._deliver(sequence, ([Chunk(tail)] if tail else []) + [Chunk("", result)])
        slotted = [s for s in slotted if not s.cancelled]
        if slotted:
            try:
                items = [[Chunk(piece, result) for piece, result in out] for out in self.engine.advance_slots([s.decoding for s in slotted])]
            except BaseException as exc:  # each consumer raises it; the worker keeps serving
                items = [[Failure(exc)] for _ in slotted]
            for sequence, chunks in zip(slotted, items):
                self._deliver(sequence, chunks)
        for sequence in batch:
            if sequence.generator is None:
                continue
            try:
                piece, result = next(sequence.generator)
                item = Chunk(piece, result)
            except BaseException as exc:  # the consumer raises it; the worker keeps serving
                item = Failure(exc)
            self._deliver(sequence, [item])

    def _deliver(self, sequence: Sequence, items: list[Chunk | Failure]) -> None:
        """A pass's chunks to the sequence's sink; the last one with a result (or a Failure) ends it."""
        with self.cond:
            if sequence.first_token_at is None:
                sequence.first_token_at = time.perf_counter()
            for item in items:
                if isinstance(item, Failure) or item.result is not None:
                    self._end(sequence, item)
                    return
                if sequence.withdrawn:
                    self._end(sequence, None)
                    return
                sequence.sink.put(item)
            if sequence.withdrawn:
                self._end(sequence, None)
            self.cond.notify_all()

    def _abandon(self, sequence: Sequence) -> None:
        sequence.abandoned = True
        sequence.request.cancel.set()
        self._end(sequence, None)

    def _discard(self, sequence: Sequence) -> None:
        """A sequence that never joined the line gives its admission back."""
        sequence.state = ENDED
        self._release(sequence)
        self.cond.notify_all()

    def _release(self, sequence: Sequence) -> None:
        """Its place, and its client's, are free (once, however it ended)."""
        if sequence not in self._live:
            return
        self._live.discard(sequence)
        client = sequence.request.client
        self._held[client] -= 1
        if not self._held[client]:
            del self._held[client]
            self._turns.pop(client, None)  # a client that comes back later is served as a new one

    def _end(self, sequence: Sequence, last: Chunk | Failure | None) -> None:
        """Under the lock, on the worker for a running sequence: frees its slot, then hands the
        consumer its last item, so a consumer that has the result finds the engine free."""
        if sequence.generator is not None:
            sequence.generator.close()  # the Engine's stream ends here, on the worker
            sequence.generator = None
        if sequence.decoding is not None:
            sequence.decoding.ended = True  # out of later passes; a drafter it held is free
        if sequence in self._running:
            self._running.remove(sequence)
        self._release(sequence)
        sequence.state = ENDED
        if isinstance(last, Chunk) and last.result is not None:
            last.result.timings["queue_s"] = sequence.queue_s()
            sequence.final = last.result
            self._on_result(last.result)
        if last is not None:
            sequence.sink.put(last)
        sequence.sink.end()
        self.cond.notify_all()
