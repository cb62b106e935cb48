"""The drafters, by name: what each needs in a bundle and what it can do, read by the CLI (choices
and help), the loader, the memory planner, the Engine's request checks and the bench.

How each is built lives in the runtime (`runtime/drafters/__init__.py`, `BUILDERS`, keyed by
the same names); `tests/test_drafter_table.py` checks that the two agree.
"""

from __future__ import annotations

from dataclasses import dataclass

# A drafter whose role is this runs the bundle's default draft (manifest.default_draft: the draft
# model, else the layer-skip draft), and copies alone on a bundle without one.
BUNDLE_DEFAULT = "default"


@dataclass(frozen=True)
class DrafterSpec:
    name: str
    help: str  # one line, for --draft's help
    role: str | None = None  # the draft role it runs: a manifest role, BUNDLE_DEFAULT, or None (the target alone)
    copies: bool = False  # drafts by copying text: no model pass per drafted token
    remembers: bool = False  # keeps earlier requests to copy from (EngineConfig.suffix_cache_tokens)
    reuses_trunk: bool = False  # drafts with the target's first layers: its verify pass skips them

    @property
    def requires(self) -> str | None:
        """The role a bundle must have for this drafter to be offered (None: any bundle)."""
        return None if self.role == BUNDLE_DEFAULT else self.role

    def draft_role(self, default_draft: str | None) -> str | None:
        """The draft role it runs on a bundle whose default draft is `default_draft`."""
        return default_draft if self.role == BUNDLE_DEFAULT else self.role


TABLE = (
    DrafterSpec("auto", "copy from this text, else the bundle's draft (model or layer-skip)", BUNDLE_DEFAULT),
    DrafterSpec("model", "the bundle's draft model", "draft"),
    DrafterSpec("layer-skip", "the target's first layers and its head (self-speculation)", "layer_skip", reuses_trunk=True),
    DrafterSpec("lookup", "copy from this text (prompt lookup)", copies=True),
    DrafterSpec("suffix", "copy from this text and earlier requests", copies=True, remembers=True),
    DrafterSpec("auto+suffix", "auto, plus copies from earlier requests where they match longer", BUNDLE_DEFAULT, remembers=True),
    DrafterSpec("none", "no drafting: one target pass per token"),
)
SPECS = {spec.name: spec for spec in TABLE}
DRAFTERS = tuple(SPECS)  # the names, in the order choices and messages list them
# The drafter that runs each draft role alone (the bench times one step of each).
ROLE_DRAFTERS = {spec.role: spec.name for spec in TABLE if spec.role not in (None, BUNDLE_DEFAULT)}
COPIERS = tuple(spec.name for spec in TABLE if spec.copies)


def drafter_spec(name: str) -> DrafterSpec:
    """The table's row for `name`; ValueError naming the choices for any other."""
    if name not in SPECS:
        raise ValueError(f"unknown drafter {name!r} (choose from {', '.join(DRAFTERS)})")
    return SPECS[name]


def available_drafters(roles) -> tuple[str, ...]:
    """The drafters a bundle with these model roles offers, in table order."""
    return tuple(spec.name for spec in TABLE if spec.requires is None or spec.requires in roles)


def drafter_help() -> str:
    """--draft's help: every name with its line."""
    return "; ".join(f"{spec.name}: {spec.help}" for spec in TABLE)
