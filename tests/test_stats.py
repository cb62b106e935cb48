"""runtime.stats: one frozen Stats from a generation's Steps, and the JSON it always was."""

from __future__ import annotations

import dataclasses
import json

import pytest

from runtime.loop import Step
from runtime.stats import Stats, acceptance_alpha, summarize

STEPS = [
    Step((5, 6, 7), 3, 3, 2, 0.25, 0.5, "lookup"),  # 2 of 3 accepted, then a rejection
    Step((8,), 0, 0, 0, 0.0, 0.25, None),  # a plain step
    Step((9, 10, 11, 12), 3, 3, 3, 0.5, 0.5, "draft"),  # all accepted
    Step((13,), 2, 2, 0, 0.25, 0.5, "draft"),  # rejected at once
]


def test_stats_from_steps_keep_the_dict_they_replaced():
    # Prefill: the first Step came 3.0 s in, its round took 0.75 s, so prefill took 2.25 s.
    stats = summarize(STEPS, 9, {"draft": 0.4}, 10.0, 13.0, 16.0)
    assert stats.to_dict() == {
        "target_passes": 4,
        "drafted_tokens": 8,
        "accepted_tokens": 5,
        "acceptance_rate": 5 / 8,
        "alpha": 5 / (5 + 2),
        "tokens_per_pass": 9 / 4,
        "gamma_histogram": {"0": 1, "2": 1, "3": 2},
        "drafter_rounds": {"lookup": 1, "none": 1, "draft": 2},
        "cost_ratio": {"draft": 0.4},
        "time_s": {"draft": 1.0, "target": 1.75, "other": 3.75 - 1.0 - 1.75},
    }
    assert list(stats.to_dict()) == list(stats) and json.dumps(stats.to_dict()) == json.dumps(dict(stats))
    assert stats.timings() == {"prefill_ms": 2250.0, "decode_s": 3.75, "decode_tokens_per_s": 9 / 3.75}
    assert stats["alpha"] == stats.alpha == acceptance_alpha(5, 2) and stats.rejections == 2
    hash(stats)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.target_passes = 0


def test_no_rounds_give_full_stats_with_alpha_none():
    empty = summarize([], 0, {}, 0.0, None, 0.0)
    full = summarize(STEPS, 9, {}, 10.0, 13.0, 16.0)
    assert isinstance(empty, Stats) and list(empty) == list(full)
    assert empty.alpha is None and empty.acceptance_rate is None and empty.tokens_per_pass == 0.0
    assert empty.to_dict()["time_s"] == {"draft": 0.0, "target": 0.0, "other": 0.0}
    assert empty.timings() == {"prefill_ms": 0.0, "decode_s": 0.0, "decode_tokens_per_s": 0.0}
    assert summarize(STEPS[1:2], 1, {}, 0.0, 1.0, 2.0).alpha is None  # a plain step drafts nothing
