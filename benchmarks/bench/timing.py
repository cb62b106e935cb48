"""Timing the Engine from outside: its sessions through the session hook it accepts, and
single passes at a fixed cache length."""

from __future__ import annotations

import statistics
import time

import numpy as np

from edge_spec.sampling import SamplingConfig
from runtime.engine import Engine


class SessionClock:
    """Wall-clock intervals spent inside session runs, by stage key: pass it to the Engine as
    its session_hook. Once `follow` names the target's KV cache, each run also notes the rows
    that cache held when it started, which tells the prefill's runs from the rounds'."""

    def __init__(self):
        # (start, end) perf_counter seconds, stage key, target cache rows at the start (None: not followed yet)
        self.calls: list[tuple[float, float, str, int | None]] = []
        self.target_rows = lambda: None

    def __call__(self, key: str, session) -> "TimedSession":
        return TimedSession(session, self, key)

    def follow(self, cache) -> None:
        self.target_rows = lambda: cache.kv_len

    def clear(self) -> None:
        self.calls.clear()

    def prefill_ended(self, prompt_tokens: int, began: float) -> float:
        """When the target's prefill ended: the end of the last run that started while the target's
        cache held fewer rows than the prompt's pending token's position (a draft model prefills
        before the target, and the rounds start with prompt_tokens - 1 rows); `began` if none ran."""
        ends = [end for _, end, _, rows in self.calls if rows is not None and rows < prompt_tokens - 1]
        return max(ends, default=began)

    def seconds_within(self, begin: float, end: float) -> float:
        return sum(max(0.0, min(e, end) - max(s, begin)) for s, e, _, _ in self.calls)

    def count(self, key: str, begin: float, end: float) -> int:
        return sum(1 for s, _, k, _ in self.calls if k == key and begin <= s <= end)


class TimedSession:
    """Stands in for a session: times run / run_with_iobinding, forwards the rest."""

    def __init__(self, session, clock: SessionClock, key: str):
        self._session = session
        self._clock = clock
        self._key = key

    def _timed(self, method, *args, **kwargs):
        rows = self._clock.target_rows()
        began = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            self._clock.calls.append((began, time.perf_counter(), self._key, rows))

    def run(self, *args, **kwargs):
        return self._timed(self._session.run, *args, **kwargs)

    def run_with_iobinding(self, *args, **kwargs):
        return self._timed(self._session.run_with_iobinding, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


def timed_ms(action, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        action()
        times.append((time.perf_counter() - began) * 1e3)
    return times


def ms_stats(times: list[float]) -> dict:
    return {"ms": statistics.median(times), "ms_min": min(times), "ms_max": max(times)}


def copy_bandwidth(mib: int, repeats: int) -> float:
    """Bytes per second a numpy copy moves (read + write, as STREAM's Copy counts them)."""
    src = np.ones(mib * (1 << 20) // 8, dtype=np.float64)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # page in both buffers before timing
    median_ms = statistics.median(timed_ms(lambda: np.copyto(dst, src), repeats))
    return 2 * src.nbytes / (median_ms / 1e3)


class PassTimer:
    """Single passes at a fixed cache length, for timing: the target's cache holds kv_len rows
    (of one repeated token: content does not change the work) and every pass starts from them."""

    def __init__(self, engine: Engine, kv_len: int, max_block: int):
        self.engine, self.kv_len = engine, kv_len
        eos = engine.bundle.manifest.tokenizer.eos_token_ids[0]
        self.tokens = np.full(kv_len + max_block, eos, dtype=np.int64)
        engine.target.cache.reset()
        engine.target.prefill(self.tokens[:kv_len])

    def target_pass(self, block: int) -> None:
        target = self.engine.target
        target.cache.rollback_to_prefix(self.tokens[:self.kv_len])
        target.forward(self.tokens[self.kv_len : self.kv_len + block])

    def draft_step(self, drafter_name: str):
        """Switch the engine to drafter_name and return a callable that runs one draft step
        from kv_len rows and takes it back."""
        engine, tokens, kv_len = self.engine, self.tokens, self.kv_len
        engine.use_drafter(drafter_name)
        drafter, greedy, rng = engine.drafter, SamplingConfig(), np.random.default_rng(0)
        engine.target.cache.rollback_to_prefix(tokens[:kv_len])
        drafter.reset(tokens[:kv_len])  # a draft model prefills its own cache here

        def step():
            drafter.propose(tokens[: kv_len + 1], 1, greedy, rng)
            drafter.accepted(tokens[: kv_len + 1], 0)  # back to kv_len rows

        return step
