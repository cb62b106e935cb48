"""The commit policy (edge_spec/commit.py) and decode_steps' injectable clock."""

from __future__ import annotations

import numpy as np

from edge_spec.commit import commit
from edge_spec.sampling import SamplingConfig
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.gamma import GammaConfig
from runtime.kv_cache import KVCache
from runtime.loop import decode_steps
from runtime.passes import CacheRows, Scored
from runtime.policy import RoundPolicy

PIECES = ["a", "b", "c", "END", "xa", "yz"]
EOS = {3}


def run(step, n_generated=0, max_new=10, room=100, text="", stops=()):
    return commit(step, n_generated, max_new, room, EOS, text, stops, lambda kept: "".join(PIECES[t] for t in kept))


def test_eos_exactly_at_the_budget_is_kept_and_stops_as_eos():
    result = run([0, 3], n_generated=8, max_new=10)
    assert (result.tokens, result.stop_reason) == ((0, 3), "eos")


def test_eos_beyond_the_budget_is_cut_with_the_budget():
    result = run([0, 1, 3], n_generated=8, max_new=10)
    assert (result.tokens, result.stop_reason) == ((0, 1), "length")


def test_the_context_cuts_after_the_budget_and_before_eos():
    assert run([0, 1, 3], room=2).stop_reason == "context"
    assert run([0, 1, 3], max_new=2, room=2).stop_reason == "length"
    assert run([0, 3, 1], room=2).stop_reason == "eos"


def test_the_earliest_stop_string_in_the_text_wins_not_the_first_listed():
    result = run([2, 4, 5], text="b", stops=("yz", "xa"))
    assert (result.text, result.piece, result.stop_reason) == ("bc", "c", "stop")


def test_a_stop_string_that_began_in_earlier_text_cuts_there():
    result = run([0], text="xy", stops=("ya",))
    assert (result.text, result.piece, result.stop_reason) == ("x", "", "stop")


class CountingRunner(CacheRows):
    """Logits from the last token only; every pass advances a fake clock by 1 + 0.5 s/token."""

    def __init__(self, clock, vocab=8):
        self.cache = KVCache(range(0), 1, 64, 1)
        self.clock, self.vocab = clock, vocab

    def forward(self, token_ids, n_logits=None, trunk_hidden=None):
        token_ids = np.asarray(token_ids, dtype=np.int64)
        self.clock.now += 1.0 + 0.5 * len(token_ids)
        rows = np.stack([np.eye(self.vocab, dtype=np.float32)[(int(t) + 1) % self.vocab] * 5 for t in token_ids])
        self.cache.extend(token_ids)
        return rows[len(rows) - (len(rows) if n_logits is None else n_logits) :]

    def score(self, block, trunk_hidden=None):
        return Scored(self.forward(block.tokens, block.n_logits))

    def prefill(self, token_ids, chunk=256, hidden=()):
        if len(token_ids):
            self.forward(token_ids, n_logits=1)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_decode_steps_times_everything_with_the_clock_it_is_given():
    clock = FakeClock()
    target, draft = CountingRunner(clock), CountingRunner(clock)
    drafter = DraftModelDrafter(draft)
    policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=2))
    costs = policy.costs
    steps = decode_steps(target, drafter, [1, 2, 3], SamplingConfig(), np.random.default_rng(0), policy, clock=clock)
    first = next(steps)
    # The draft feeds the pending token, then one drafted token (2 passes of 1 token); the target verifies 3 tokens.
    assert (first.n_drafted, first.n_accepted, first.draft_s, first.target_s) == (2, 2, 3.0, 2.5)
    assert costs.target == {3: 2.5} and costs.draft_step == {"model": 1.5}
