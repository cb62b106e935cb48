"""One drafter table (edge_spec/drafters.py): the runtime's builders, the CLI, the planner, the
Engine's checks and the bench all read it, and what each built drafter does matches its row."""

from __future__ import annotations

import argparse
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
