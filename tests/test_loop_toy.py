"""The speculative loop on a numpy toy language model (no ONNX), and the round policy.

The toy target reads its context from a real KVCache (the token of each row is stored in the
key buffer), so a loop that fails to roll back, or feeds a token twice, changes its logits.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import time

import numpy as np
import pytest

from edge_spec.sampling import SamplingConfig
from edge_spec.verify import expected_tokens_per_pass
from runtime.drafters.base import CostsPasses, Proposal
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.engine import Engine
from runtime.gamma import CostModel, GammaConfig
from runtime.kv_cache import KVCache
from runtime.loop import decode_steps
from runtime.drafters.prompt_lookup import PromptLookupDrafter, match_class
from runtime.passes import CacheRows, Scored
from runtime.policy import PartPolicy, Plan, Round, RoundPolicy

VOCAB = 50
GREEDY = SamplingConfig()


class ToyLM:
    """logits(context) = bigram[last token] + mix[sum(context) % 7]: depends on the whole
    context, deterministic, and with clear argmax winners."""

    def __init__(self, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.bigram = rng.normal(0, 3, size=(VOCAB, VOCAB))  # [V,V]
        self.mix = rng.normal(0, 3, size=(7, VOCAB))  # [7,V]

    def logits(self, context) -> np.ndarray:
        context = [int(t) for t in context]
        return self.bigram[context[-1]] + self.mix[sum(context) % 7]  # [V]

    def greedy(self, prompt, n) -> list[int]:
        tokens = list(prompt)
        for _ in range(n):
            tokens.append(int(np.argmax(self.logits(tokens))))
        return tokens[len(prompt) :]


class ToyRunner(CacheRows):
    """The pass contract (runtime/passes.py) over a real KVCache: one layer, one head, head_dim 1;
    chains only, its logits from `forward`, as ModelRunner's convenience spells it."""

    def __init__(self, lm: ToyLM, max_context: int = 256):
        self.lm = lm
        self.cache = KVCache(range(1), n_kv_heads=1, max_context=max_context, head_dim=1)
        self.vocab_size = VOCAB
        self.fed: list[int] = []  # block sizes, for checks

    def forward(self, token_ids, n_logits=None, trunk_hidden=None):
        assert trunk_hidden is None
        token_ids = np.asarray(token_ids, dtype=np.int64)
        block, start = len(token_ids), self.cache.kv_len
        self.cache.check_room(start, block)
        past = self.cache.keys[0][0, 0, :start, 0].astype(np.int64).tolist()  # only valid rows
        rows = []
        for i in range(block):
            rows.append(self.lm.logits(past + token_ids[: i + 1].tolist()))
        new = token_ids.astype(np.float32).reshape(1, 1, block, 1)
        self.cache.write_rows(self.cache.layers, [new, new], start)
        self.cache.extend(token_ids)
        self.fed.append(block)
        n_logits = block if n_logits is None else n_logits
        return np.stack(rows)[block - n_logits :]  # [N,V]

    def score(self, block, trunk_hidden=None):
        assert block.is_chain and block.positions[0] == self.kept and not block.hidden
        return Scored(self.forward(block.tokens, block.n_logits, trunk_hidden))

    def prefill(self, token_ids, chunk: int = 256, hidden=()):
        assert not hidden
        for begin in range(0, len(token_ids), chunk):
            self.forward(token_ids[begin : begin + chunk], n_logits=1)


class ScriptedDrafter(CostsPasses):
    """Drafts the target's greedy continuation, except at scripted positions (one list per
    round: the positions in the block that get a wrong token)."""

    name = "scripted"

    def __init__(self, lm: ToyLM, script: list[list[int]] | None = None, alpha: float | None = None, seed: int = 0):
        self.lm, self.script, self.alpha = lm, list(script or []), alpha
        self.rng = np.random.default_rng(seed)
        self.rounds = 0
        self.accepted_calls: list[tuple[int, int]] = []
        self.reset_calls = 0

    def propose(self, tokens, gamma, sampling, rng):
        wrong = set(self.script[self.rounds]) if self.rounds < len(self.script) else set()
        self.rounds += 1
        context, drafted = [int(t) for t in tokens], []
        for i in range(gamma):
            right = int(np.argmax(self.lm.logits(context)))
            bad = i in wrong or (self.alpha is not None and self.rng.random() >= self.alpha)
            token = (right + 1 + int(self.rng.integers(VOCAB - 1))) % VOCAB if bad else right
            assert (token == right) == (not bad)
            drafted.append(token)
            context.append(token)
        return Proposal(np.array(drafted, dtype=np.int64), None)

    def accepted(self, tokens, n_accepted):
        self.accepted_calls.append((len(tokens), n_accepted))

    def reset(self, tokens=np.zeros(0, dtype=np.int64), prefill=True):
        self.reset_calls += 1


def _run(lm, drafter, gamma, prompt, n_tokens, max_context=256):
    target = ToyRunner(lm, max_context)
    policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=gamma or None))  # γ 0: plain, no drafter
    steps, committed = [], list(prompt)
    for step in decode_steps(target, drafter, list(prompt), GREEDY, np.random.default_rng(0), policy):
        steps.append(step)
        committed += list(step.tokens)
        # The loop invariant: every committed token but the pending last one is in the cache.
        assert target.cache.kv_len == len(committed) - 1
        assert target.cache.row_tokens[: len(committed) - 1].tolist() == committed[:-1]
        assert target.cache.keys[0][0, 0, : len(committed) - 1, 0].tolist() == committed[:-1]
        if len(committed) - len(prompt) >= n_tokens:
            break
    return steps, committed[len(prompt) :], target


PROMPT = [3, 14, 15, 9, 26]


def test_plain_loop_is_greedy():
    lm = ToyLM()
    steps, out, target = _run(lm, None, 0, PROMPT, 20)
    assert out == lm.greedy(PROMPT, 20)
    assert all(s.tokens and len(s.tokens) == 1 and s.gamma == 0 and s.n_drafted == 0 for s in steps)
    assert target.fed[0] == len(PROMPT) - 1 and set(target.fed[1:]) == {1}  # prefill, then 1 per step


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
def test_speculative_greedy_equals_plain(gamma):
    lm = ToyLM(1)
    rng = np.random.default_rng(gamma)
    script = [sorted(rng.choice(gamma, size=rng.integers(0, gamma + 1), replace=False).tolist()) for _ in range(60)]
    drafter = ScriptedDrafter(lm, script)
    steps, out, target = _run(lm, drafter, gamma, PROMPT, 40)
    assert out[:40] == lm.greedy(PROMPT, 40)[: len(out[:40])]
    assert len(out) >= 40
    for i, step in enumerate(steps):
        wrong = script[i]
        expected_accepted = min(wrong) if wrong else gamma
        assert step.n_drafted == gamma
        assert step.n_accepted == expected_accepted
        assert len(step.tokens) == step.n_accepted + 1
        assert step.drafter == "scripted" and step.gamma == gamma
    assert target.fed[1:] == [gamma + 1] * len(steps)  # one verify pass per round
    assert drafter.reset_calls == 1
    assert [n for _, n in drafter.accepted_calls] == [s.n_accepted for s in steps]


@pytest.mark.parametrize(
    "wrong,expected",
    [([0], 0), ([3], 3), ([], 4), ([1, 2], 1), ([0, 1, 2, 3], 0)],
    ids=["first", "last", "all-accepted", "middle", "all-wrong"],
)
def test_rejection_paths(wrong, expected):
    lm = ToyLM(2)
    gamma = 4
    drafter = ScriptedDrafter(lm, [wrong, [], wrong])
    steps, out, target = _run(lm, drafter, gamma, PROMPT, 3 * (gamma + 1))
    reference = lm.greedy(PROMPT, len(out))
    assert out == reference
    first = steps[0]
    assert first.n_accepted == expected
    assert len(first.tokens) == expected + 1
    # The last token is the target's own choice: the correction, or the bonus after γ accepts.
    assert first.tokens[-1] == reference[expected]
    assert steps[1].n_accepted == gamma  # a clean round right after a rejection
    assert target.cache.kv_len == len(PROMPT) + len(out) - 1


def test_gamma_one_alternating():
    lm = ToyLM(3)
    drafter = ScriptedDrafter(lm, [[0], [], [0], []] * 5)
    steps, out, _ = _run(lm, drafter, 1, PROMPT, 25)
    assert out[:25] == lm.greedy(PROMPT, 25)
    assert [s.n_accepted for s in steps[:4]] == [0, 1, 0, 1]
    assert [len(s.tokens) for s in steps[:4]] == [1, 2, 1, 2]


def test_gamma_capped_by_context():
    """Near the end of the buffer γ shrinks so the verify block always fits."""
    lm = ToyLM(4)
    drafter = ScriptedDrafter(lm)
    max_context = 24
    steps, out, target = _run(lm, drafter, 6, PROMPT, max_context - len(PROMPT), max_context=max_context)
    assert out == lm.greedy(PROMPT, len(out))
    length = len(PROMPT)
    for step in steps:
        assert step.gamma == min(6, max_context - length)
        length += len(step.tokens)
    assert steps[-1].gamma < 6  # the cap was reached
    assert max_context <= length <= max_context + 1
    assert max(target.fed) <= 7 and target.cache.kv_len == length - 1 <= max_context


def test_prompt_prefix_rows_are_reused():
    """A cache already holding a prefix of the prompt is not fed that prefix again."""
    lm = ToyLM(5)
    target = ToyRunner(lm)
    target.prefill(PROMPT + [1, 2, 3])
    target.fed.clear()
    prompt = PROMPT + [7, 8]
    step = next(decode_steps(target, None, prompt, GREEDY, np.random.default_rng(0), RoundPolicy().start(None)))
    assert target.fed == [1, 1]  # only prompt[5] (7) was prefilled; then the pending 8
    assert step.tokens == (lm.greedy(prompt, 1)[0],)


# -- round policy ------------------------------------------------------------------------------


def _costs(target_per_block: dict[int, float]) -> CostModel:
    costs = CostModel()
    for block, seconds in target_per_block.items():
        costs.record_target(block, seconds)
    return costs


def _with_alpha(alpha: float, costs: CostModel, config: GammaConfig = GammaConfig()) -> PartPolicy:
    controller = PartPolicy(config, costs, prior_alpha=alpha)
    assert controller.alpha() == pytest.approx(alpha)
    return controller


def test_fixed_gamma_is_returned_as_is():
    controller = PartPolicy(GammaConfig(fixed=5), _costs({1: 1.0}))
    assert controller.choose(100.0) == Plan(gamma=5, draft_step_s=100.0)
    controller.update(Plan(gamma=5), 5, 0)
    assert controller.choose(100.0).gamma == 5


def test_expensive_draft_chooses_zero():
    costs = _costs({1: 1.0, 2: 1.0, 9: 1.0})
    assert _with_alpha(0.9, costs).choose(draft_step_cost=1.5).gamma == 0


def test_low_alpha_chooses_zero():
    costs = _costs({1: 1.0, 9: 1.8})  # a bigger block costs more
    assert _with_alpha(0.05, costs).choose(draft_step_cost=0.01).gamma == 0


def test_cheap_draft_high_alpha_speculates():
    costs = _costs({1: 1.0, 9: 1.2})
    controller = _with_alpha(0.9, costs)
    gamma = controller.choose(draft_step_cost=0.02).gamma
    assert 1 <= gamma <= 8
    gains = [controller.expected_speedup(g, 0.02) for g in range(9)]
    assert gamma == int(np.argmax(gains)) and gains[gamma] > 2.0
    # γ = 0 is a plain step: speedup 1 exactly.
    assert controller.expected_speedup(0, 0.02) == 1.0
    # The formula: E(α, γ) · t(1) / (γ c + t(γ+1)).
    t3 = costs.target_cost(4)
    assert t3 == pytest.approx(1.0 + 0.2 * 3 / 8)  # interpolated between 1 and 9
    assert controller.expected_speedup(3, 0.02) == pytest.approx(expected_tokens_per_pass(0.9, 3) * 1.0 / (3 * 0.02 + t3))


def test_higher_alpha_never_shortens_gamma():
    costs = _costs({1: 1.0, 9: 1.5})
    chosen = [_with_alpha(a, costs).choose(0.05).gamma for a in (0.5, 0.7, 0.8, 0.9, 0.95)]
    assert chosen == sorted(chosen) and chosen[-1] > chosen[0]


def _play(controller: PartPolicy, *args, **kwargs) -> Plan:
    """A plan chosen and its round played: the probe schedule moves as the plan says (as
    RoundPolicy.observe has it do), since choosing alone changes nothing."""
    plan = controller.choose(*args, **kwargs)
    controller.follow(plan)
    return plan


def _rounds(controller: PartPolicy, n: int, draft_step_cost: float, accept: bool = False) -> list[int]:
    """γ chosen for n rounds; every drafted round is rejected at its first token (or accepted in full)."""
    choices = []
    for _ in range(n):
        plan = _play(controller, draft_step_cost=draft_step_cost)
        gamma = plan.gamma
        if gamma:
            controller.update(plan, gamma, gamma if accept else 0)
        choices.append(gamma)
    return choices


def test_lookup_copies_after_the_longest_match_not_the_latest():
    tokens = np.array([4, 5, 6, 7, 8, 1, 9, 0, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 8])
    lookup = PromptLookupDrafter()
    assert lookup.match(tokens) == (5, 5)  # "4 5 6 7 8" at the start, not the later "5 6 7 8"
    assert lookup.find(tokens, 2).tolist() == [1, 9] and lookup.evidence(tokens) == match_class(5) == 3
    # Matching at most 4 tokens (prompt lookup's n-grams before), the latest 4-gram's continuation is copied.
    assert PromptLookupDrafter(max_match=4).find(tokens, 2).tolist() == [2, 3]
    assert lookup.match(np.array([1, 2, 3])) == (0, 0) and lookup.evidence(np.array([1, 2, 3])) == 0
    assert [match_class(n) for n in (2, 3, 4, 5, 8, 9, 16, 17, 32)] == [1, 2, 2, 3, 3, 4, 4, 5, 5]


def test_alpha_is_learned_per_evidence_class():
    """Copies on long matches accepted, on short ones rejected: long rounds at long matches and
    none at short ones, where one α for both would choose the same for each."""
    controller = PartPolicy(GammaConfig(max_loss=10.0), _costs({1: 1.0, 9: 1.8}))
    for _ in range(20):
        controller.update(Plan(gamma=4, evidence=4), 4, 4)
        controller.update(Plan(gamma=4, evidence=1), 4, 0)
    assert controller.alpha(4) > 0.9 and controller.alpha(1) < 0.2
    assert controller.choose(0.0, evidence=4).gamma >= 4 and controller.choose(0.0, evidence=1).gamma == 0


def test_round_policy_learns_alpha_for_the_class_the_drafter_reported():
    lookup = PromptLookupDrafter()
    policy = RoundPolicy(_costs({1: 1.0, 9: 1.2})).start(lookup, config=GammaConfig(max_loss=10.0))
    long_match = np.array([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9])  # a 5-token match: class 3
    plan = policy.choose(long_match)
    gamma = plan.gamma
    assert plan.drafter is lookup and gamma >= 1 and plan.evidence == 3 and not plan.probe
    policy.observe(plan, Round("lookup", gamma, gamma, gamma, gamma + 1, 0.0, 1.0, 1.0))
    learned = policy.parts["lookup"].estimates
    assert learned[3].n_accepted == pytest.approx(0.98 * 1.2 + gamma) and 1 not in learned


def test_probes_after_probe_every_plain_steps():
    costs = _costs({1: 1.0, 2: 1.0})
    controller = _with_alpha(0.5, costs, GammaConfig(probe_first=5, probe_every=5, max_failed_probes=10, max_loss=10.0))
    choices = _rounds(controller, 11, draft_step_cost=3.0)
    assert choices[:4] == [0, 0, 0, 0]
    assert choices[4] >= 1  # the 5th plain step probes
    assert choices[5:9] == [0, 0, 0, 0] and choices[9] >= 1  # and the count starts again
    assert choices[10] == 0


def test_probes_back_off_and_restart_with_a_new_sequence():
    costs = _costs({1: 1.0, 2: 1.0})
    controller = _with_alpha(0.5, costs, GammaConfig(probe_first=2, probe_every=8, max_failed_probes=4, max_loss=10.0))
    choices = _rounds(controller, 60, draft_step_cost=3.0)
    probes = [i for i, gamma in enumerate(choices) if gamma]
    assert np.diff([-1] + probes).tolist() == [2, 4, 8, 8]  # gaps double up to probe_every, 4 failures, then off
    controller.start()
    assert _rounds(controller, 2, draft_step_cost=3.0)[1] >= 1


def test_a_probe_accepted_in_full_is_not_a_failure():
    """A prior learned on poorer text keeps the predicted gain under min_gain for a few
    probes even when the target accepts every drafted token; those probes must not use up
    max_failed_probes, or a drafter that would win stays off for the sequence."""
    costs = _costs({1: 1.0, 2: 1.4})  # γ = 1 pays only from α ≈ 0.84 on: (1 + α) / (0.4 + 1.4) ≥ min_gain
    config = GammaConfig(probe_first=2, probe_every=4, max_failed_probes=2, max_loss=1.0)
    rejected = _rounds(_with_alpha(0.5, costs, config), 40, draft_step_cost=0.4)
    assert sum(map(bool, rejected)) == 2  # two rejected probes, then off for the sequence
    accepted = _rounds(_with_alpha(0.5, costs, config), 40, draft_step_cost=0.4, accept=True)
    first_win = next(i for i, gamma in enumerate(accepted) if gamma and accepted[i - 1])
    assert sum(map(bool, accepted[:first_win])) > config.max_failed_probes  # probes went on ...
    assert all(accepted[first_win:])  # ... until α had climbed, and from then on every round drafts


def test_a_probe_that_wins_keeps_probing_alive():
    costs = _costs({1: 1.0, 2: 1.0})
    controller = _with_alpha(0.1, costs, GammaConfig(probe_first=2, probe_every=8, max_failed_probes=1))
    plans = [_play(controller, draft_step_cost=0.2) for _ in range(2)]
    assert [plan.gamma for plan in plans] == [0, 1] and plans[1].probe
    controller.update(plans[1], 1, 1)  # the probe was accepted ...
    for _ in range(30):
        controller.update(Plan(gamma=1), 1, 1)  # ... and so is every later draft: α climbs, speculation wins
    assert controller.choose(draft_step_cost=0.2).gamma >= 1 and controller.probes.failed == 0


def test_ledger_switches_off_a_drafter_whose_rounds_lose():
    """Predicted wins that the clock does not confirm (a bad α estimate, draft replay) stop
    once they have lost max_loss of the sequence's plain time."""
    costs = _costs({1: 1.0, 2: 1.1, 3: 1.2})
    controller = _with_alpha(0.9, costs, GammaConfig(max_loss=0.05))
    controller.start(horizon_tokens=100)  # room: 0.05 · 100 tokens · 1 s = 5 s
    rounds = 0
    while controller.choose(draft_step_cost=0.05).gamma:
        controller.ledger.record(seconds=3.0, n_tokens=1)  # each round loses 2 s against plain
        rounds += 1
        assert rounds < 10
    assert rounds == 3 and controller.ledger.loss_seconds == pytest.approx(6.0)
    assert all(controller.choose(0.05).gamma == 0 for _ in range(100))  # no probes either
    controller.start(horizon_tokens=100)  # a new sequence opens a new ledger
    assert controller.choose(0.05).gamma >= 1


def test_ledger_room_grows_with_the_tokens_committed():
    """The mechanism behind drafters that stayed off for a whole sequence: one rejected long
    round on a carried-over prior spent the sequence's room, and nothing could earn it back.
    Every committed token now adds max_loss of its plain time, so they come back."""
    costs = _costs({1: 1.0, 2: 1.1, 3: 1.2})
    controller = _with_alpha(0.9, costs, GammaConfig(max_loss=0.05))
    controller.start(horizon_tokens=100)
    controller.ledger.record(seconds=7.0, n_tokens=1)  # lost 6 s: 1 s over the 5 s room
    assert controller.choose(0.05).gamma == 0
    controller.ledger.advance(20)  # 20 plain tokens: + 0.05 · 20 · 1 s, room 0 s
    assert controller.ledger.room() == pytest.approx(0.0) and controller.choose(0.05).gamma == 0
    controller.ledger.advance(4)  # room 0.2 s: a γ = 1 round's worst case is 0.05 + 1.1 - 1 = 0.15 s
    assert controller.choose(0.05).gamma == 1


def test_round_length_is_sized_to_the_room_left():
    """A γ is chosen only if the ledger affords its loss when every drafted token is rejected,
    so an α carried over from other text cannot spend the whole room in one round."""
    costs = _costs({1: 1.0, 2: 1.2, 3: 1.4, 5: 1.8, 9: 2.6})
    controller = _with_alpha(0.99, costs, GammaConfig(max_loss=0.01, max_gamma=8))
    controller.start(horizon_tokens=100)  # room 1 s
    first = controller.choose(draft_step_cost=0.0).gamma
    assert first >= 1 and controller.worst_loss(first, 0.0) <= 1.0 < controller.worst_loss(first + 1, 0.0)
    controller.ledger.record(seconds=1.0, n_tokens=first + 1)  # accepted in full: won first s
    assert controller.choose(draft_step_cost=0.0).gamma > first  # wins buy longer rounds


def test_ledger_wins_earn_room_for_later_losses():
    costs = _costs({1: 1.0, 2: 1.1, 3: 1.2})
    controller = _with_alpha(0.9, costs, GammaConfig(max_loss=0.01))
    controller.start(horizon_tokens=100)  # room 1 s
    controller.ledger.record(seconds=1.2, n_tokens=3)  # won 1.8 s
    controller.ledger.record(seconds=3.5, n_tokens=1)  # lost 2.5 s: net loss 0.7 s, within budget
    assert controller.ledger.room() > 0 and controller.choose(0.05).gamma >= 1
    controller.ledger.record(seconds=1.5, n_tokens=1)  # net loss 1.2 s
    assert controller.ledger.room() < 0 and controller.choose(0.05).gamma == 0


def test_loop_feeds_the_ledger_what_rounds_took():
    """decode_steps records every speculative round's wall time and tokens in its drafter's
    ledger, and none for plain steps."""
    lm = ToyLM(5)
    target = ToyRunner(lm)

    class SlowDrafter(ScriptedDrafter):
        def propose(self, tokens, gamma, sampling, rng):
            time.sleep(0.02)  # far more than the toy target's passes for the tokens it drafts
            return super().propose(tokens, gamma, sampling, rng)

    drafter = SlowDrafter(lm)
    policy = RoundPolicy(prior_alpha=0.9).start(drafter, horizon_tokens=10, config=GammaConfig(max_loss=0.0, min_gain=0.0))
    controller = policy.parts[drafter.name]
    steps = decode_steps(target, drafter, PROMPT, GREEDY, np.random.default_rng(0), policy)
    first = next(steps)
    assert first.n_drafted >= 1 and controller.ledger.loss_seconds > 0  # what the round took, measured
    later = [next(steps) for _ in range(5)]
    assert all(step.n_drafted == 0 for step in later)  # over budget: plain steps only


def test_a_replay_counts_whole_in_the_gain_and_by_its_share_in_the_ledger():
    costs = _costs({1: 1.0, 2: 1.1, 3: 1.2, 5: 1.4})
    controller = _with_alpha(0.9, costs, GammaConfig(probe_first=100))
    controller.start(horizon_tokens=100)
    assert controller.choose(draft_step_cost=0.1).gamma >= 1  # a cheap, accurate draft wins ...
    assert controller.choose(draft_step_cost=0.1, replay_seconds=10.0).gamma == 0  # ... unless its round cannot repay a 10 s replay
    assert controller.expected_speedup(2, 0.1, 3.0) == pytest.approx(
        expected_tokens_per_pass(0.9, 2) * 1.0 / (3.0 + 2 * 0.1 + costs.target_cost(3)))
    # The ledger would hold a hundredth of it: the round's token of the 100 the model may still commit.
    assert controller.worst_loss(2, 0.1, 3.0) == pytest.approx(3.0 / 100 + 2 * 0.1 + costs.target_cost(3) - 1.0)
    controller.ledger.advance(98)  # two tokens left: half of it
    assert controller.worst_loss(2, 0.1, 3.0) == pytest.approx(3.0 / 2 + 2 * 0.1 + costs.target_cost(3) - 1.0)


def test_a_draft_model_that_sat_out_comes_back():
    """A rejected round that spends the ledger, then plain steps: the replay owed grows by a
    token each step. Held whole against the next round it outgrew the room (which grows by
    max_loss of a pass per token), so not even a probe could run and the draft model never
    drafted again; held by its share, a probe runs once the room allows."""
    costs = _costs({1: 1.0, 2: 1.27, 3: 1.84, 4: 2.13})
    controller = _with_alpha(0.95, costs)
    controller.start(horizon_tokens=128)
    controller.ledger.record(2 * 0.16 + 1.84, 1)  # a γ = 2 round rejected at its first token
    controller.ledger.advance(1)
    lag, drafted = 0, []
    for _ in range(100):
        gamma = _play(controller, draft_step_cost=0.16, replay_seconds=0.08 * lag).gamma
        drafted.append(gamma)
        if gamma:
            break
        lag += 1
        controller.ledger.advance(1)
    assert drafted[-1] >= 1 and lag > 10  # it sat out, then its replay did not keep it out


def test_a_probe_that_buys_only_information_pays_its_replay_whole():
    """The case of the test above at an α where the model, even caught up, would not draft on
    its merit (prose): no later round carries a probe's replay, so probes stop once the whole
    replay outgrows the room, and the ledger holds a probe's replay whole. Held by its share,
    probes after dozens of skipped tokens replayed them at every probe_every plain steps."""
    costs = _costs({1: 1.0, 2: 1.27, 3: 1.84, 4: 2.13})
    low = _with_alpha(0.4, costs)
    low.start(horizon_tokens=128)  # room 1.28 s; a γ = 1 probe's worst case is 0.43 s plus its replay
    assert not any(_play(low, draft_step_cost=0.16, replay_seconds=0.08 * 40).gamma for _ in range(40))  # 3.2 s replay
    plan = _play(low, draft_step_cost=0.16, replay_seconds=0.08 * 4)
    assert plan.gamma == 1 and plan.probe and plan.whole_replay and plan.replay_s == pytest.approx(0.32)  # 0.32 s: affordable
    high = _with_alpha(0.95, costs)  # caught up it would gain: its probe's replay goes by share
    high.start(horizon_tokens=128)
    high.ledger.record(2 * 0.16 + 1.84, 1)
    high.ledger.advance(1)
    for lag in range(100):
        plan = _play(high, draft_step_cost=0.16, replay_seconds=0.08 * lag)
        if plan.gamma:
            break
        high.ledger.advance(1)
    assert 10 < lag < 99 and not plan.whole_replay
    lm = ToyLM(3)
    policy = RoundPolicy(_costs({1: 1.0, 2: 1.0})).start(DraftModelDrafter(lm), horizon_tokens=50)
    part = policy.parts["model"]
    probe = Plan(policy.drafter, 2, probe=True, whole_replay=True)
    policy.observe(probe, Round("model", 2, 2, 0, 1, draft_s=2.5, target_s=1.0, round_s=3.5, catch_up_tokens=20, catch_up_s=2.0))
    assert part.ledger.loss_seconds == pytest.approx(3.5 - 1.0)


def test_the_ledger_records_a_replay_by_the_share_its_round_pays():
    lm = ToyLM(3)
    policy = RoundPolicy(_costs({1: 1.0, 2: 1.0})).start(DraftModelDrafter(lm), horizon_tokens=50)
    part = policy.parts["model"]
    policy.observe(Plan(policy.drafter, 2), Round("model", 2, 2, 2, 3, draft_s=2.5, target_s=1.0, round_s=3.5, catch_up_tokens=20, catch_up_s=2.0))
    # 3.5 s, less the 2 s replay, plus 3/50 of it; against 3 one-token passes.
    assert part.ledger.loss_seconds == pytest.approx(3.5 - 2.0 + 2.0 * 3 / 50 - 3.0)
    assert part.ledger.tokens == 3


def test_a_replay_is_spread_over_the_tokens_copies_leave_the_draft_model():
    from runtime.drafters.mixed import MixedDrafter

    policy = RoundPolicy(_costs({1: 1.0, 2: 1.1})).start(MixedDrafter([PromptLookupDrafter()], DraftModelDrafter(ToyLM(3))), horizon_tokens=100)
    model, lookup = policy.parts["model"], policy.parts["lookup"]
    policy.observe(Plan(policy.drafter.parts()[0], 8), Round("lookup", 8, 8, 8, 9, draft_s=0.0, target_s=2.0, round_s=2.0))
    policy.observe(Plan(), Round(None, 0, 0, 0, 1, draft_s=0.0, target_s=1.0, round_s=1.0))
    assert (model.ledger.taken, lookup.ledger.taken, model.ledger.tokens) == (9, 0, 10)
    # 90 tokens left, of which the model may expect the tenth that copies did not take.
    assert model.ledger.reach() == pytest.approx(9.0) and lookup.ledger.reach() == pytest.approx(90.0)
    assert model.worst_loss(1, 0.1, 3.0) == pytest.approx(3.0 / 9 + 0.1 + 1.1 - 1.0)


def test_a_probe_the_ledger_cannot_afford_is_not_run():
    costs = _costs({1: 1.0, 2: 1.0})
    config = GammaConfig(probe_first=2, probe_every=2, max_failed_probes=100, max_loss=0.05)
    cheap = _with_alpha(0.5, costs, config)
    cheap.start(horizon_tokens=100)  # budget 5 s
    assert [_play(cheap, draft_step_cost=3.0).gamma for _ in range(2)] == [0, 1]  # expected loss 2.5 s: affordable
    costly = _with_alpha(0.5, costs, config)
    costly.start(horizon_tokens=100)
    # 1000 s of replay ahead: even the hundredth of it a 1-token round pays is twice the budget.
    assert [_play(costly, draft_step_cost=3.0, replay_seconds=1000.0).gamma for _ in range(6)] == [0] * 6


def test_replay_cost_is_measured_per_token():
    costs = CostModel(smoothing=1.0)
    assert costs.replay_cost("model", 4) == 0.0  # nothing known: no price
    costs.record_draft("model", 2, 0.04)
    assert costs.replay_cost("model", 4) == pytest.approx(0.08)  # until measured: a draft step per token
    costs.record_replay("model", 8, 0.04)
    assert costs.replay_cost("model", 4) == pytest.approx(0.02) and costs.replay_cost("model", 0) == 0.0


def test_draft_model_reports_the_tokens_it_must_replay():
    lm = ToyLM(3)
    drafter = DraftModelDrafter(ToyRunner(lm))
    tokens = np.array(PROMPT, dtype=np.int64)
    drafter.reset(tokens[:-1])  # as the loop does: the pending last token is not fed
    assert drafter.replay_tokens(tokens) == 0
    later = np.concatenate([tokens, lm.greedy(PROMPT, 3)])  # three plain rounds committed tokens
    assert drafter.replay_tokens(later) == 3
    proposal = drafter.propose(later, 2, GREEDY, np.random.default_rng(0))
    assert proposal.catch_up_tokens == 3 and proposal.catch_up_seconds > 0
    assert proposal.tokens.tolist() == lm.greedy(later.tolist(), 2)  # the replayed cache drafts right


def test_draft_model_catches_up_in_one_pass_after_a_fully_accepted_round():
    """A round accepted in full leaves the draft without its last drafted token and the bonus
    token: one 2-token pass feeds both, so a round of γ costs γ draft passes, not γ + 1."""
    lm = ToyLM(4)
    draft, target = ToyRunner(lm), ToyRunner(lm)  # the draft is the target: every round is accepted in full
    drafter, gamma = DraftModelDrafter(draft), 3
    steps = decode_steps(target, drafter, PROMPT, GREEDY, np.random.default_rng(0), RoundPolicy().start(drafter, config=GammaConfig(fixed=gamma)))
    out = list(next(steps).tokens)
    for _ in range(6):
        draft.fed.clear()
        step = next(steps)  # runs this round's drafting
        assert step.n_accepted == gamma
        assert draft.fed == [2] + [1] * (gamma - 1)  # [d_γ, bonus] in one pass, then γ - 1 drafting passes
        out += step.tokens
    assert out == lm.greedy(PROMPT, len(out))


def test_a_new_sequence_keeps_alpha_but_not_the_weight_of_its_evidence():
    controller = PartPolicy(GammaConfig(decay=1.0, prior_weight=4.0), CostModel(), prior_alpha=0.5)
    for _ in range(50):
        controller.update(Plan(gamma=2), 2, 0)  # a long run of rejections: α ≈ 0.02, backed by ~50 rounds
    alpha = controller.alpha()
    controller.start()
    assert controller.alpha() == pytest.approx(alpha)  # the estimate carries over ...
    assert controller.estimate().n_accepted + controller.estimate().n_rejected == pytest.approx(4.0)  # ... as a prior worth 4 rounds
    for _ in range(4):
        controller.update(Plan(gamma=3), 3, 3)  # so a few accepted rounds of another kind of text overturn it
    assert controller.alpha() > 0.7


def test_alpha_update_is_the_truncated_geometric_mle():
    controller = PartPolicy(GammaConfig(decay=1.0), CostModel(), prior_alpha=0.5)  # 1 + 1 pseudo-counts
    controller.update(Plan(gamma=4), 4, 2)  # 2 accepted, then a rejection
    assert controller.alpha() == pytest.approx(3 / 5)
    controller.update(Plan(gamma=3), 3, 3)  # all accepted: no rejection observed
    assert controller.alpha() == pytest.approx(6 / 8)
    controller.update(Plan(gamma=0), 0, 0)  # nothing drafted: no information
    assert controller.alpha() == pytest.approx(6 / 8)
    decayed = PartPolicy(GammaConfig(decay=0.5), CostModel(), prior_alpha=0.5)
    decayed.update(Plan(gamma=2), 2, 0)
    assert decayed.alpha() == pytest.approx(0.5 / (0.5 + 1.5))


def test_alpha_estimate_converges_to_true_acceptance():
    rng = np.random.default_rng(0)
    controller = PartPolicy(GammaConfig(decay=1.0), CostModel())
    alpha, gamma = 0.7, 4
    for _ in range(3000):
        n = 0
        while n < gamma and rng.random() < alpha:
            n += 1
        controller.update(Plan(gamma=gamma), gamma, n)
    assert controller.alpha() == pytest.approx(alpha, abs=0.02)


def test_cost_model_ema_and_ratio():
    costs = CostModel(smoothing=0.5)
    assert costs.target_cost(3) == 1.0 and costs.cost_ratio("x") is None
    costs.record_target(1, 2.0)
    costs.record_target(1, 4.0)
    assert costs.target[1] == pytest.approx(3.0)
    costs.record_draft("x", 3, 3.0)
    costs.record_draft("x", 0, 99.0)  # no steps: ignored
    assert costs.cost_ratio("x") == pytest.approx(1.0 / 3.0)
    costs.record_target(5, 7.0)
    # interpolated inside, extended along the last slope past the largest measured block
    assert costs.target_cost(3) == pytest.approx(5.0) and costs.target_cost(9) == pytest.approx(11.0)


# -- acceptance statistics through the loop -----------------------------------------------------


@pytest.mark.parametrize("alpha,gamma", [(0.6, 3), (0.85, 5)])
def test_tokens_per_pass_matches_formula(alpha, gamma):
    """Drafts accepted i.i.d. with probability α: the reported tokens per pass and
    acceptance match (1 − α^(γ+1))/(1 − α) and α(1 − α^γ)/((1 − α)γ) within a few SE."""
    lm = ToyLM(6)
    drafter = ScriptedDrafter(lm, alpha=alpha, seed=1)
    n_tokens = 3000
    steps, out, _ = _run(lm, drafter, gamma, [1, 2], n_tokens, max_context=n_tokens + 64)
    assert out[:200] == lm.greedy([1, 2], 200)
    per_pass = np.array([len(s.tokens) for s in steps], dtype=np.float64)
    expected = expected_tokens_per_pass(alpha, gamma)
    standard_error = per_pass.std(ddof=1) / math.sqrt(len(per_pass))
    generated = out[:n_tokens]
    # The stats the engine reports for these steps.
    result = Engine._result(SimpleNamespace(costs=CostModel()), "", [1, 2], generated, "length", steps, 0.0, 0.1, 1.0)
    stats = result.stats
    assert stats["target_passes"] == len(steps)
    assert stats["tokens_per_pass"] == pytest.approx(len(generated) / len(steps))
    assert abs(stats["tokens_per_pass"] - expected) < 4 * standard_error + 2 / len(steps)
    accepted = np.array([s.n_accepted for s in steps], dtype=np.float64)
    expected_rate = alpha * (1 - alpha**gamma) / ((1 - alpha) * gamma)
    rate_se = accepted.std(ddof=1) / gamma / math.sqrt(len(steps))
    assert abs(stats["acceptance_rate"] - expected_rate) < 4 * rate_se
    assert stats["gamma_histogram"] == {str(gamma): len(steps)}
    # And the truncated-geometric MLE recovers α itself.
    rejections = sum(s.n_accepted < s.n_drafted for s in steps)
    mle = accepted.sum() / (accepted.sum() + rejections)
    assert abs(mle - alpha) < 0.04


@pytest.mark.parametrize("kwargs", [{"max_gamma": 0}, {"max_gamma": -1}, {"fixed": 0}, {"fixed": -2}])
def test_gamma_config_refuses_what_adaptive_gamma_cannot_use(kwargs):
    """--max-gamma 0 with adaptive γ used to reach np.argmax of an empty list; a negative γ ran."""
    with pytest.raises(ValueError, match="gamma must be 1"):
        GammaConfig(**kwargs)


def test_the_loop_drafts_with_the_chosen_part_never_the_selection():
    """A mixed drafter only selects: its own propose refuses, and the loop asks the part the
    plan names, so greedy output is the target's with copies and model rounds both taken."""
    from runtime.drafters.mixed import MixedDrafter

    lm = ToyLM(6)
    prompt = PROMPT + lm.greedy(PROMPT, 6) + PROMPT  # the prompt's start again: lookup has a match
    mixed = MixedDrafter([PromptLookupDrafter()], ScriptedDrafter(lm))
    with pytest.raises(TypeError, match="selects one of its parts"):
        mixed.propose(np.array(prompt, dtype=np.int64), 2, GREEDY, np.random.default_rng(0))
    steps, out, _ = _run(lm, mixed, 2, prompt, 30)
    assert out[:30] == lm.greedy(prompt, 30)
    assert {"lookup", "scripted"} <= {step.drafter for step in steps}
