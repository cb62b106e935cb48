"""Drafters: one interface (drafters.base.Drafter), and how to build each drafter the table in
`edge_spec/drafters.py` names (BUILDERS, keyed by the same names)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from runtime.drafters.base import Drafter
from runtime.drafters.draft_model import DraftModelDrafter
from runtime.drafters.layer_skip import LayerSkipDrafter
from runtime.drafters.mixed import MixedDrafter
from runtime.drafters.prompt_lookup import PromptLookupDrafter
from runtime.drafters.suffix import SuffixDrafter, SuffixIndex, SuffixSettings
from runtime.model import ModelRunner

Runners = Callable[..., ModelRunner]  # runner(role, group=...): the loader's, shared sessions and caches


@dataclass(frozen=True)
class Build:
    """What a builder may use: the drafter of its table row's draft role (None where the bundle
    has no default draft), made only when asked, and the suffix cache's size."""

    model: Callable[[], Drafter | None]
    suffix_cache_tokens: int

    def suffix_index(self) -> SuffixIndex:
        return SuffixIndex(SuffixSettings(max_tokens=self.suffix_cache_tokens))


# The drafter that runs each draft role; the draft model has its own provider group.
ROLE_BUILDERS: dict[str, Callable[[Runners], Drafter]] = {
    "draft": lambda runner: DraftModelDrafter(runner("draft", group="draft")),
    "layer_skip": lambda runner: LayerSkipDrafter(runner("layer_skip")),
}

BUILDERS: dict[str, Callable[[Build], Drafter | None]] = {
    "auto": lambda b: MixedDrafter([PromptLookupDrafter()], b.model()),
    "model": lambda b: b.model(),
    "layer-skip": lambda b: b.model(),
    "lookup": lambda b: PromptLookupDrafter(),
    "suffix": lambda b: SuffixDrafter(b.suffix_index()),
    # Copies from earlier requests only where they match longer than this text (own_text=False).
    "auto+suffix": lambda b: MixedDrafter([PromptLookupDrafter(), SuffixDrafter(b.suffix_index(), own_text=False)], b.model(), "auto+suffix"),
    "none": lambda b: None,
}
