"""The loop ↔ policy protocol: `RoundPolicy.choose` returns a frozen Plan, `observe(plan, round)`
is the only way back, and nothing about the round in flight stays on the policy; the γ knobs
are one GammaConfig inside EngineConfig; the policy traces for the Kotlin core drive this code
without tests/ or torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.mixed import MixedDrafter
from runtime.drafters.prompt_lookup import PromptLookupDrafter
from runtime.engine import EngineConfig
from runtime.gamma import CostModel, GammaConfig
from runtime.policy import PartPolicy, Plan, Round, RoundPolicy

ROOT = Path(__file__).resolve().parent.parent


class _Model:
    """What DraftModelDrafter asks of a runner before it drafts: a cache length."""

    class cache:
        kv_len = 0


def _costs() -> CostModel:
    costs = CostModel()
    for block, seconds in {1: 1.0, 2: 1.1, 3: 1.2, 9: 1.8}.items():
        costs.record_target(block, seconds)
    return costs


def _state(policy: RoundPolicy):
    """Everything the policy keeps, as comparable values."""
    parts = {name: (p.ledger.loss_seconds, p.ledger.tokens, p.ledger.taken, p.probes.plain_steps, p.probes.gap, p.probes.failed,
                    {k: (e.n_accepted, e.n_rejected) for k, e in p.estimates.items()}) for name, p in policy.parts.items()}
    return parts, dict(policy.costs.target), dict(policy.costs.draft_step), dict(policy.costs.replay_token)


def test_choose_returns_a_frozen_plan_and_leaves_no_round_on_the_policy():
    lookup = PromptLookupDrafter()
    policy = RoundPolicy(_costs()).start(lookup, config=GammaConfig(max_loss=10.0))
    before = set(vars(policy)), {name: set(vars(p)) for name, p in policy.parts.items()}
    plan = policy.choose(np.array([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9]))
    assert plan.drafter is lookup and plan.gamma >= 1 and plan.evidence == 3
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.gamma = 1
    assert (set(vars(policy)), {name: set(vars(p)) for name, p in policy.parts.items()}) == before
    assert not hasattr(policy.parts["lookup"].probes, "probing")


def test_observe_learns_from_the_plan_it_is_given_not_from_the_last_choice():
    """Two policies in the same state, one of which chose another round since: given the same
    plan and round back, they learn the same."""
    config = GammaConfig(max_loss=10.0)
    policies = [RoundPolicy(_costs()).start(PromptLookupDrafter(), config=config) for _ in range(2)]
    long_match = np.array([5, 6, 7, 8, 9, 1, 2, 3, 5, 6, 7, 8, 9])
    plans = [policy.choose(long_match) for policy in policies]
    policies[1].choose(np.array([1, 2, 3, 1, 2]))  # a round chosen (evidence class 1) and never drafted
    for policy, plan in zip(policies, plans):
        policy.observe(plan, Round("lookup", plan.gamma, plan.gamma, 1, 2, 0.0, 1.0, 1.0))
    first, second = (policy.parts["lookup"] for policy in policies)
    assert plans[0].evidence == 3 and (first.estimates[3].n_accepted, first.estimates[3].n_rejected) == (
        second.estimates[3].n_accepted, second.estimates[3].n_rejected)
    assert 1 not in second.estimates and second.alpha(1) == pytest.approx(0.6)  # the class of the later choice learned nothing
    assert first.ledger.loss_seconds == second.ledger.loss_seconds


def test_a_probe_plan_moves_the_probe_schedule_and_a_plan_on_merit_does_not():
    costs = _costs()
    part = PartPolicy(GammaConfig(probe_first=1, max_failed_probes=5), costs, prior_alpha=0.1)
    probe = part.choose(draft_step_cost=0.3)
    assert probe.gamma >= 1 and probe.probe
    part.update(probe, probe.gamma, 0)
    assert part.probes.failed == 1
    part.update(Plan(gamma=2), 2, 0)  # not a probe: α learns, the schedule does not count it
    assert part.probes.failed == 1
    part.update(probe, probe.gamma, probe.gamma)
    assert part.probes.failed == 0


def test_observe_holds_a_replay_by_its_share_or_whole_as_the_plan_says():
    done = Round("model", 2, 2, 0, 1, draft_s=2.5, target_s=1.0, round_s=3.5, catch_up_tokens=20, catch_up_s=2.0)
    losses = []
    for plan_args in ({}, {"probe": True}, {"probe": True, "whole_replay": True}):
        policy = RoundPolicy(_costs()).start(DraftModelDrafter(_Model()), horizon_tokens=50)
        policy.observe(Plan(policy.drafter, 2, **plan_args), done)
        losses.append(policy.parts["model"].ledger.loss_seconds)
    share = 3.5 - 2.0 + 2.0 / 50 - 1.0
    assert losses == pytest.approx([share, share, 3.5 - 1.0])
    with pytest.raises(ValueError, match="only a probe"):
        Plan(None, 2, whole_replay=True)


def test_a_mixed_drafter_plans_with_the_part_it_chose():
    copier, model = PromptLookupDrafter(), DraftModelDrafter(_Model())
    policy = RoundPolicy(_costs()).start(MixedDrafter([copier], model), config=GammaConfig(max_loss=10.0))
    policy.costs.record_draft("model", 1, 0.05)
    plan = policy.choose(np.array([1, 2, 3, 4]))  # nothing to copy: the model's round
    assert plan.drafter is model and plan.draft_step_s == pytest.approx(0.05)
    policy.observe(plan, Round("model", plan.gamma, plan.gamma, plan.gamma, plan.gamma + 1, 0.1, 1.0, 1.1))
    assert policy.parts["lookup"].ledger.taken == plan.gamma + 1 and policy.parts["model"].ledger.taken == 0


def test_gamma_config_is_a_field_of_engine_config():
    knobs = GammaConfig(max_loss=0.2, probe_every=8, decay=0.9)
    config = EngineConfig(gamma_config=knobs, max_gamma=4)
    assert config.gamma_for() == dataclasses.replace(knobs, max_gamma=4)
    fixed = dataclasses.replace(config, gamma=3)
    assert fixed.gamma_for() == dataclasses.replace(knobs, fixed=3, max_gamma=4)
    assert fixed.gamma_for(cap=2) == dataclasses.replace(knobs, fixed=2, max_gamma=2)  # a request's cap
    with pytest.raises(ValueError, match="not in gamma_config"):
        EngineConfig(gamma_config=GammaConfig(fixed=2))
    with pytest.raises(ValueError, match="gamma must be 1"):
        EngineConfig(gamma=40)
    with pytest.raises(ValueError, match="gamma_config must be a GammaConfig"):
        EngineConfig(gamma_config={"max_loss": 0.2})


@pytest.mark.parametrize("kwargs, message", [
    ({"probe_first": 0}, "probe_first and probe_every"), ({"probe_every": 0}, "probe_first and probe_every"),
    ({"max_failed_probes": -1}, "max_failed_probes"), ({"decay": 0.0}, "decay"), ({"decay": 1.5}, "decay"),
    ({"max_loss": -0.1}, "max_loss"), ({"min_gain": float("nan")}, "min_gain"), ({"probe_first": 2.5}, "integer"),
    ({"max_gamma": True}, "integer"),
])
def test_gamma_config_refuses_knobs_the_policy_cannot_use(kwargs, message):
    with pytest.raises(ValueError, match=message):
        GammaConfig(**kwargs)


def test_policy_traces_need_neither_tests_nor_torch(tmp_path):
    """write_traces.py --pure (the traces the Kotlin policy is checked against) with torch and
    every tests/ module made unimportable."""
    guard = (
        "import sys, runpy\n"
        "class Refuse:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'tiny', 'real', 'tests', 'conftest'):\n"
        "            raise ImportError('refused: ' + name)\n"
        "sys.meta_path.insert(0, Refuse())\n"
        f"sys.argv = ['write_traces.py', {str(tmp_path)!r}, '--pure']\n"
        f"runpy.run_path({str(ROOT / 'android_bridge' / 'tools' / 'write_traces.py')!r}, run_name='__main__')\n"
    )
    subprocess.run([sys.executable, "-c", guard], check=True, cwd=tmp_path, capture_output=True, timeout=600)
    cases = json.loads((tmp_path / "policy.json").read_text())
    plans = [r["plan"] for case in cases for seq in case["sequences"] for r in seq["rounds"]]
    assert any(p["probe"] and p["whole_replay"] for p in plans) and any(p["probe"] and not p["whole_replay"] for p in plans)
    assert {case["drafter"] for case in cases} == {"model", "auto", "lookup"}
    assert json.loads((tmp_path / "index.json").read_text()) == {"tiny": False, "real": False}


def test_choose_changes_nothing_and_observe_moves_the_schedule_as_the_plan_says():
    """choose is pure: over rounds of every kind (drafted on merit, plain steps counted toward a
    probe, probes), the policy's whole state is the same before and after each choose, also
    when a plan is chosen again and dropped unplayed (a batched step); observing the round
    moves the probe schedule as its plan says."""
    policy = RoundPolicy(_costs(), prior_alpha=0.2).start(DraftModelDrafter(_Model()), horizon_tokens=400,
                                                          config=GammaConfig(probe_first=2, probe_every=4, max_failed_probes=50, max_loss=10.0))
    part = policy.parts["model"]
    policy.costs.record_draft("model", 1, 0.05)
    rng = np.random.default_rng(0)
    kinds = set()
    for r in range(120):
        tokens = np.arange(r + 2)
        before = _state(policy)
        policy.choose(tokens)  # chosen and dropped, as batch_round may
        plan = policy.choose(tokens)
        assert _state(policy) == before, plan
        kinds.add(plan.schedule)
        steps = (part.probes.plain_steps, part.probes.gap)
        accepted = int(rng.integers(0, plan.gamma + 1)) if r < 60 else plan.gamma  # later rounds win: α climbs
        policy.observe(plan, Round("model" if plan.gamma else None, plan.gamma, plan.gamma, accepted, accepted + 1,
                                   0.05 * plan.gamma, 1.0, 1.0 + 0.05 * plan.gamma))
        after = (part.probes.plain_steps, part.probes.gap)
        expected = {"sat_out": (steps[0] + 1, steps[1]), "probe": (0, min(2 * steps[1], 4)),
                    "speculating": (0, 2), "": steps}[plan.schedule]
        assert after == expected, (r, plan.schedule, steps, after)
    assert kinds >= {"sat_out", "probe", "speculating"}, kinds
