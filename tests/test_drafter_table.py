"""One drafter table (edge_spec/drafters.py): the runtime's builders, the CLI, the planner, the
Engine's checks, the bench and handoff all read it, and what each built drafter does matches its row."""

from __future__ import annotations

import argparse
import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest

from edge_spec import drafters as table
from edge_spec.budget import drafter_roles
from edge_spec.manifest import BundleError
from runtime.drafters import BUILDERS, ROLE_BUILDERS, Build
from runtime.drafters.base import CostsPasses, Drafter, parts


class FakeModel(CostsPasses):
    """Stands in for the drafter of a row's draft role (no bundle needed)."""

    name = "fake-model"

    def propose(self, tokens, gamma, sampling, rng):
        return None


def _built(name: str, model: Drafter | None = None) -> Drafter | None:
    return BUILDERS[name](Build(lambda: model, suffix_cache_tokens=64))


def test_builders_are_the_tables_names():
    assert tuple(BUILDERS) == table.DRAFTERS
    assert set(ROLE_BUILDERS) == set(table.ROLE_DRAFTERS)
    assert len(set(table.DRAFTERS)) == len(table.TABLE)


def test_built_drafters_do_what_their_row_says():
    for spec in table.TABLE:
        model = FakeModel()
        drafter = _built(spec.name, model)
        runs = parts(drafter)
        assert (model in runs) == (spec.role is not None), spec.name
        if spec.copies:
            assert runs and not any(part.costs_passes for part in runs), spec.name
        # A drafter keeping earlier requests overrides forget (Engine.forget drops them).
        assert any(type(part).forget is not Drafter.forget for part in runs) == spec.remembers, spec.name
        if spec.name == "none":
            assert drafter is None
    # On a bundle without a default draft, auto copies alone.
    assert [part.name for part in parts(_built("auto"))] == ["lookup"]


def test_every_cli_drafter_choice_comes_from_the_table(monkeypatch, capsys):
    from runtime.__main__ import main

    seen = []
    add_argument = argparse._ActionsContainer.add_argument

    def record(self, *args, **kwargs):
        action = add_argument(self, *args, **kwargs)
        seen.append(action)
        return action

    monkeypatch.setattr(argparse._ActionsContainer, "add_argument", record)
    with pytest.raises(SystemExit):
        main(["--help"])
    draft = [action for action in seen if "--draft" in action.option_strings]
    assert len(draft) >= 5  # generate, audit, serve, chat, plan
    for action in draft:
        assert tuple(action.choices) == table.DRAFTERS
    assert any(action.help == table.drafter_help() for action in draft)


def test_planner_engine_and_bench_read_the_table():
    from benchmarks.bench.run import MODES

    assert MODES == ("plain",) + tuple(n for n in table.DRAFTERS if n != "none")
    pair = SimpleNamespace(default_draft="draft", models={"target": 0, "draft": 0, "layer_skip": 0})
    alone = SimpleNamespace(default_draft=None, models={"target": 0})
    for spec in table.TABLE:
        roles = drafter_roles(pair, spec.name)
        assert roles == ("target",) + ((("draft" if spec.role == table.BUNDLE_DEFAULT else spec.role),) if spec.role else ())
        if spec.requires:
            with pytest.raises(BundleError):
                drafter_roles(alone, spec.name)
        else:
            assert drafter_roles(alone, spec.name) == ("target",)
    assert table.available_drafters(pair.models) == table.DRAFTERS
    assert table.available_drafters(alone.models) == ("auto", "lookup", "suffix", "auto+suffix", "none")
    with pytest.raises(ValueError, match="unknown drafter 'fast' \\(choose from auto, model, layer-skip, lookup, suffix, auto\\+suffix, none\\)"):
        drafter_roles(pair, "fast")


def test_capabilities_default_on_the_base_class():
    lookup = _built("lookup")
    tokens = np.array([1, 2, 3], dtype=np.int64)
    assert not lookup.costs_passes and not lookup.catches_up and lookup.replay_tokens(tokens) == 0
    assert lookup.parts() == [lookup] and lookup.candidates(tokens) == [lookup]
    lookup.forget()  # nothing to drop


def _renamed_table(monkeypatch) -> None:
    """The table with the draft role's drafter and the copier of this text alone under new names."""
    monkeypatch.setitem(table.ROLE_DRAFTERS, "draft", "draft-model")
    for old, new in (("model", "draft-model"), ("lookup", "ngram")):
        monkeypatch.setitem(table.SPECS, new, dataclasses.replace(table.SPECS[old], name=new))
        monkeypatch.delitem(table.SPECS, old)


def test_handoff_reads_alpha_under_the_tables_names(monkeypatch, tmp_path):
    """`handoff --bench-results` takes α of the mode the table names: the draft role's drafter,
    else the copier of this text alone (the engines' n-gram lookup)."""
    from runtime.__main__ import main

    _renamed_table(monkeypatch)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"runs": [{"mode": "draft-model", "alpha": 0.7}, {"mode": "ngram", "alpha": 0.4}]}))
    pair = SimpleNamespace(manifest=SimpleNamespace(models={"target": 0, "draft": 0}))
    alone = SimpleNamespace(manifest=SimpleNamespace(models={"target": 0}))
    planned = []
    monkeypatch.setattr("runtime.handoff.plan", lambda manifest, engine, method, alpha, port: planned.append(alpha) or
                        SimpleNamespace(command=lambda: "serve", notes=()))
    for bundle, method in ((pair, "auto"), (pair, "lookup"), (alone, "auto")):
        monkeypatch.setattr("runtime.bundle.open_bundle", lambda path, check_hashes: bundle)
        assert main(["handoff", "bundle", "--engine", "vllm", "--method", method, "--bench-results", str(results)]) == 0
    assert planned == [0.7, 0.4, 0.4]


def test_bench_counts_draft_model_forwards_for_the_draft_roles_drafter(monkeypatch):
    """A draft step of the draft role's drafter is priced per forward of its session, whatever
    the table calls it; other drafters per drafted token."""
    from benchmarks.bench.stats import run_row
    from runtime.loop import Step

    _renamed_table(monkeypatch)
    steps = [Step((1, 2, 3), 2, 2, 2, 0.03, 0.01, "draft-model"), Step((4, 5), 2, 2, 1, 0.01, 0.01, "ngram")]
    stats = {"target_passes": 2, "acceptance_rate": 0.75, "alpha": 0.75, "tokens_per_pass": 2.5, "gamma_histogram": {"2": 2},
             "drafter_rounds": {}, "time_s": 0.1}
    result = SimpleNamespace(stats=stats, timings={"decode_tokens_per_s": 50.0, "decode_s": 0.1, "prefill_ms": 1.0},
                             prompt_ids=[0], token_ids=[1, 2, 3, 4, 5], stop_reason="length")
    plain = {"target_t1_ms": 10.0, "tokens_per_s": 25.0, "token_ids": [1, 2, 3, 4, 5]}
    row = run_row("auto", SimpleNamespace(category="code", id="p"), 0, result, steps, (0.1, 0.0), 3, plain)
    # 30 ms over the 3 forwards counted at the draft model's session; the copier per drafted token.
    assert row["draft_step_ms"] == pytest.approx({"draft-model": 10.0, "ngram": 5.0})
