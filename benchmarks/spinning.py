"""Intra-op spinning A/B: two Engines on one bundle in one process, one whose sessions spin
within a run and stop when it returns (the runtime's setting), one with spinning off; their
1-token and 5-token target passes and draft steps timed alternately.

    python -m benchmarks spinning BUNDLE [--repeats 120] [--kv-len 512]
"""

from __future__ import annotations

import runtime.sessions as sessions
from benchmarks.ab_passes import time_alternately
from benchmarks.bench import PassTimer
from runtime.engine import Engine, EngineConfig


def _engine(bundle: str, spin: bool) -> Engine:
    """An Engine whose sessions are built with spinning on (+ stop at run end) or off."""
    shipped = sessions.session_options

    def options(provider, config):
        built = shipped(provider, config)
        built.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
        built.add_session_config_entry("session.force_spinning_stop", "1" if spin else "0")
        return built

    sessions.session_options = options
    try:
        return Engine(bundle, EngineConfig(drafter="none", calibrate=False))
    finally:
        sessions.session_options = shipped


def compare(bundle: str, repeats: int = 120, kv_len: int = 512, log=print) -> dict:
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # overwriting the shipped spin entries is intended: no warning per session
    sides = {}
    for name, spin in (("off", False), ("spin_stop", True)):
        timer = PassTimer(_engine(bundle, spin), kv_len, 5)
        sides[name] = {"T=1": lambda t=timer: t.target_pass(1), "T=5": lambda t=timer: t.target_pass(5)}
        if "draft" in timer.engine.bundle.manifest.drafts():
            sides[name]["draft"] = timer.draft_step("model")
    medians = time_alternately(sides, repeats)
    rows = {}
    for what in sides["off"]:
        off, spin = medians[("off", what)], medians[("spin_stop", what)]
        rows[what] = {"off_ms": off, "spin_stop_ms": spin, "spin_stop_over_off": spin / off}
        log(f"{what}: spinning off {off:.1f} ms, spin + stop {spin:.1f} ms, ratio {spin / off:.3f}")
    return {"bundle": bundle, "kv_len": kv_len, "repeats": repeats, "passes": rows}
