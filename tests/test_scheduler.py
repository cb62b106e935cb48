"""runtime.scheduler: the one owner of concurrency (admission, the line, cancellation, abandoned
streams, the worker that drives the Engine), on a scripted engine whose passes can be held."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time

import pytest

from runtime.api import Model
from runtime.engine import Prompt
from runtime.scheduler import WORKER_NAME, empty_result


class ScriptedEngine:
    """Stands in for Engine: one pass per next(), one token a pass. A request is its prompt's
    first id; hold(k) makes request k's passes wait until the returned Event is set."""

    def __init__(self):
        self.passes: list[tuple[int, str]] = []  # (request, thread name), in order
        self.overlaps = 0
        self.closed: list[int] = []  # requests whose stream was closed
        self._active = 0
        self._gates: dict[int, threading.Event] = {}
        self.at_gate = threading.Event()

    def hold(self, request: int) -> threading.Event:
        self._gates[request] = threading.Event()
        return self._gates[request]

    def check_speculation(self, speculation) -> None:
        pass

    def check_prompt(self, ids) -> Prompt:
        return Prompt(ids, (100, 1000))

    def stream(self, prompt, config, cancel=None):
        tokens: list[int] = []
        reason = "length"
        try:
            for i in range(config.max_new_tokens):
                self._pass(prompt[0])
                tokens.append(i)
                yield f"{i} ", None
                if cancel is not None and cancel.is_set():
                    reason = "cancelled"
                    break
            text = "".join(f"{i} " for i in tokens)
            yield "", dataclasses.replace(empty_result(prompt, reason), text=text, token_ids=tokens)
        finally:
            self.closed.append(prompt[0])

    def _pass(self, request: int) -> None:
        self._active += 1
        self.overlaps += self._active > 1
        self.passes.append((request, threading.current_thread().name))
        gate = self._gates.get(request)
        if gate is not None:
            self.at_gate.set()
            assert gate.wait(20), "a held pass was never let go"
        time.sleep(0.002)
        self._active -= 1

    def served(self) -> list[int]:
        """Requests in the order their passes ran, each once per uninterrupted run of passes."""
        order: list[int] = []
        for request, _ in self.passes:
            if not order or order[-1] != request:
                order.append(request)
        return order


def scripted(**settings) -> tuple[Model, ScriptedEngine]:
    engine = ScriptedEngine()
    return Model(engine, name="scripted", **settings), engine


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def bounded(scenario, seconds: float = 10.0) -> None:
    """Runs scenario on a thread: a hang (what these tests guard against) fails instead of blocking."""
    outcome: list = []

    def run():
        try:
            scenario()
            outcome.append(None)
        except BaseException as exc:  # handed to the test thread
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(timeout=seconds)
    assert outcome, f"hung for {seconds} s"
    if outcome[0] is not None:
        raise outcome[0]


def test_threads_submitting_at_once_are_served_one_at_a_time_in_order():
    model, engine = scripted(max_queue=8)
    gate = engine.hold(0)
    first = model.submit(prompt_ids=[0, 1], max_tokens=2)
    runner = threading.Thread(target=first.result)
    runner.start()
    wait_until(engine.at_gate.is_set, "request 0 to hold the engine")
    jobs = {k: model.submit(prompt_ids=[k, 1], max_tokens=3) for k in range(1, 7)}
    results: dict = {}
    barrier = threading.Barrier(len(jobs))

    def consume(k):
        barrier.wait()  # all start iterating at once
        results[k] = jobs[k].result()

    threads = [threading.Thread(target=consume, args=(k,)) for k in jobs]
    for t in threads:
        t.start()
    wait_until(lambda: model._scheduler.waiting == len(jobs), "every request to join the line")
    assert model.busy and model.queue_depth == len(jobs)
    gate.set()
    for t in (runner, *threads):
        t.join(timeout=20)
    joined = sorted(jobs, key=lambda k: jobs[k]._sequence.enqueued_at)
    assert engine.served() == [0, *joined]  # one sequence at a time, in the order they joined the line
    assert engine.overlaps == 0
    assert {name for _, name in engine.passes} == {WORKER_NAME}  # the Engine is driven by the worker alone
    assert all(results[k].token_ids == [0, 1, 2] and results[k].text == "0 1 2 " for k in jobs)
    assert not model.busy and model.queue_depth == 0 and model.counters()["finished_length"] == 7


def test_a_cancelled_queued_request_leaves_the_queue_at_once():
    model, engine = scripted(max_queue=4)
    gate = engine.hold(0)
    running = model.submit(prompt_ids=[0, 1], max_tokens=2)
    runner = threading.Thread(target=running.result)
    runner.start()
    wait_until(engine.at_gate.is_set, "request 0 to hold the engine")
    queued = model.submit(prompt_ids=[1, 1], max_tokens=2)
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(queued.result()), daemon=True)
    waiter.start()
    wait_until(lambda: model._scheduler.waiting == 1, "request 1 to join the line")
    queued.cancel()  # while the engine is still inside request 0's pass
    waiter.join(timeout=2)
    assert got and got[0].stop_reason == "cancelled" and got[0].token_ids == []
    assert model.busy and model.queue_depth == 0  # it left without waiting for the pass
    gate.set()
    runner.join(timeout=10)
    assert 1 not in engine.served() and running.final.stop_reason == "length"
    assert model.counters()["finished_cancelled"] == 1
    closed = model.submit(prompt_ids=[2, 1], max_tokens=2)
    closed.close()  # before it ever started: its slot comes back, and it ends cancelled if run
    assert model.queue_depth == 0 and closed.result().stop_reason == "cancelled" and 2 not in engine.served()


def test_an_abandoned_stream_frees_the_model():
    model, engine = scripted(max_queue=2, stream_idle_timeout=0.3)
    held = model.stream(prompt_ids=[0, 1], max_tokens=50)
    assert next(held).text == "0 "  # read once, then left unread but referenced
    done: list = []
    began = time.monotonic()
    waiter = threading.Thread(target=lambda: done.append(model.generate(prompt_ids=[1, 1], max_tokens=2)), daemon=True)
    waiter.start()
    waiter.join(timeout=5)
    assert done and done[0].token_ids == [0, 1], "the waiting request never got the engine"
    assert 0.3 <= time.monotonic() - began < 3
    assert [r for r, _ in engine.passes].count(0) <= 2  # an unread stream decodes one chunk ahead, no more
    assert 0 in engine.closed
    with pytest.raises(RuntimeError, match="was not advanced for 0.3 s"):
        next(held)
    # A stream dropped by its loop frees the engine before the loop's next statement, with no
    # further pass and no result counted (nobody is left to read it).
    for chunk in model.stream(prompt_ids=[2, 1], max_tokens=50):
        break
    assert not model.busy and model.queue_depth == 0 and 2 in engine.closed
    passes = len(engine.passes)
    time.sleep(0.1)
    assert len(engine.passes) == passes and model.counters()["finished_cancelled"] == 0


def test_reentrant_use_inside_a_stream_is_refused_at_once():
    model, engine = scripted(max_queue=4)

    def scenario():
        stream = model.stream(prompt_ids=[0, 1], max_tokens=5)
        next(stream)
        for call in (lambda: model.generate(prompt_ids=[1, 1], max_tokens=2),
                     lambda: next(iter(model.stream(prompt_ids=[1, 1], max_tokens=2))),
                     lambda: asyncio.run(model.agenerate(prompt_ids=[1, 1], max_tokens=2))):
            with pytest.raises(RuntimeError, match="this thread is iterating a stream of this Model"):
                call()
            assert model.queue_depth == 0  # the refused request gave its slot back
        assert list(stream)[-1].result.token_ids == [0, 1, 2, 3, 4]  # the outer stream was not harmed

    bounded(scenario)
    assert model.generate(prompt_ids=[1, 1], max_tokens=2).token_ids == [0, 1]
    assert engine.served() == [0, 1]


def test_async_requests_share_the_worker_in_order():
    model, engine = scripted(max_queue=8)

    async def main():
        jobs = [model.astream(prompt_ids=[k, 1], max_tokens=3) for k in range(4)]
        for job in jobs:
            assert await job.astart() in (True, False)  # each joins the line in this order
        return [await job.aresult() for job in jobs]

    results = asyncio.run(main())
    assert engine.served() == [0, 1, 2, 3] and engine.overlaps == 0
    assert all(r.token_ids == [0, 1, 2] for r in results)
    assert not model.busy and model.queue_depth == 0


def test_cli_generate_goes_through_the_model(llama_bundle, monkeypatch, capsys):
    from runtime import scheduler
    from runtime.__main__ import main

    submitted: list = []
    original = scheduler.Scheduler.submit

    def spy(self, request):
        submitted.append(request)
        return original(self, request)

    monkeypatch.setattr(scheduler.Scheduler, "submit", spy)
    assert main(["generate", str(llama_bundle), "--prompt", "the cat", "--max-new-tokens", "4", "--draft", "none",
                 "--provider", "cpu", "--threads", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(submitted) == 1 and list(submitted[0].prompt) == out["prompt_ids"]
    assert submitted[0].config.max_new_tokens == 4
    assert set(out["timings"]) >= {"prefill_ms", "decode_tokens_per_s"} and "queue_s" not in out["timings"]


def test_the_worker_gives_the_heap_back_once_a_burst_ends(monkeypatch):
    import runtime.heap

    released: list[str] = []
    monkeypatch.setattr(runtime.heap, "release_free", lambda: released.append(threading.current_thread().name) or True)
    model, engine = scripted(max_queue=4)
    model.submit(prompt_ids=[0, 1], max_tokens=5).result()
    wait_until(lambda: model._scheduler._worker is None, "the worker to end")
    assert len(engine.passes) == 5
    assert released == [WORKER_NAME]  # once, by the worker, when nothing is left; not per pass
    model.submit(prompt_ids=[9, 1], max_tokens=1).result()
    wait_until(lambda: len(released) == 2, "the second burst's release")


def test_heap_calls_reach_glibc_here():
    import sys

    from runtime import heap

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's malloc_trim and mallopt exist on Linux only")
    assert heap.bound_arenas(8) and heap.release_free()


def test_a_handle_collected_while_the_worker_starts_does_not_deadlock(monkeypatch):
    """Thread.start waits until the new thread runs, and the garbage collector may run a collected
    handle's finalizer (drop, which takes the scheduler's lock) in that thread before it does: the
    worker must not be started under the lock. Found as a teardown that hung with every thread's
    stack printed (faulthandler_timeout): start() holding the lock inside Thread.start, drop
    waiting for it in the worker's bootstrap."""
    import runtime.scheduler as scheduler_module

    model, engine = scripted(max_queue=4)
    orphan = model.submit(prompt_ids=[5, 1], max_tokens=1)._sequence  # admitted, never started: drop gives it back
    real = threading.Thread

    class FinalizerFirst(real):
        def start(self):
            if self.name != WORKER_NAME:
                return super().start()
            ran = threading.Event()

            def bootstrap():
                model._scheduler.drop(orphan)  # what a finalizer collected in the new thread does, first
                ran.set()
                self.run()

            real(target=bootstrap, name=WORKER_NAME, daemon=True).start()
            assert ran.wait(5), "the new thread's finalizer waited for the lock held by the thread starting it"

    monkeypatch.setattr(scheduler_module.threading, "Thread", FinalizerFirst)
    bounded(lambda: model.submit(prompt_ids=[1, 1], max_tokens=2).result())
    assert model.queue_depth == 0 and not model.busy
    # Its worker ends before the next test counts what workers do (the heap given back at a burst's end).
    wait_until(lambda: not any(t.name == WORKER_NAME and t.is_alive() for t in threading.enumerate()), "the worker to end")
