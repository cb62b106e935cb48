"""A/B two bundles of the same model: one target pass of T tokens and one draft-model step,
timed alternately in one process (both engines loaded, each at the same kv_len), so machine
drift falls on both sides alike. For export changes that keep the graphs' contract.

    python -m benchmarks ab OLD_BUNDLE NEW_BUNDLE [--blocks 1,5] [--kv-len 512] [--repeats 40]
"""

from __future__ import annotations

import statistics
import time

from benchmarks.bench import PassTimer
from runtime.engine import Engine, EngineConfig


def _passes(bundle: str, kv_len: int, blocks: list[int]) -> dict:
    """Callables by name: 'T=<n>' runs a target pass of n tokens at kv_len; 'draft' one step
    of the bundle's draft model (if it has one)."""
    engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    timer = PassTimer(engine, kv_len, max(blocks))
    actions = {f"T={block}": (lambda block=block: timer.target_pass(block)) for block in blocks}
    if "draft" in engine.bundle.manifest.drafts():
        actions["draft"] = timer.draft_step("model")
    return actions


def time_alternately(sides: dict[str, dict], repeats: int) -> dict[tuple[str, str], float]:
    """Median ms of each (side, action) over repeats, the sides' actions interleaved and their
    order reversed every other repeat, so drift and cache state fall on every side alike."""
    order = [(side, name, action) for name in next(iter(sides.values())) for side, actions in sides.items()
             for action in [actions.get(name)] if action]
    times = {(side, name): [] for side, name, _ in order}
    for repeat in range(repeats + 1):
        for side, name, action in order if repeat % 2 else order[::-1]:
            began = time.perf_counter()
            action()
            if repeat:  # the first run of each shape allocates and prepacks
                times[(side, name)].append((time.perf_counter() - began) * 1e3)
    return {key: statistics.median(ms) for key, ms in times.items()}


def compare(old: str, new: str, blocks: list[int], kv_len: int = 512, repeats: int = 40, log=print) -> dict:
    """Median ms per pass on each side and new / old, by pass name."""
    sides = {"old": _passes(old, kv_len, blocks), "new": _passes(new, kv_len, blocks)}
    medians = time_alternately(sides, repeats)
    rows = {}
    for n in (n for n in sides["old"] if n in sides["new"]):
        old_ms, new_ms = medians[("old", n)], medians[("new", n)]
        rows[n] = {"old_ms": old_ms, "new_ms": new_ms, "new_over_old": new_ms / old_ms}
        log(f"{n}: old {old_ms:.1f} ms, new {new_ms:.1f} ms, new / old {new_ms / old_ms:.3f}")
    return {"old": old, "new": new, "kv_len": kv_len, "repeats": repeats, "passes": rows}
