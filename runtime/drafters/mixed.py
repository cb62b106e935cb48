"""Copy when the text repeats, otherwise draft with a model: chosen per round by the policy."""

from __future__ import annotations

from runtime.drafters.base import Drafter, Selects
from runtime.drafters.prompt_lookup import PromptLookupDrafter
from runtime.drafters.suffix import SuffixDrafter


class MixedDrafter(Selects):
    """Copiers (prompt lookup; the suffix cache of earlier requests) and a draft model. Each
    copier that has a match is a candidate, so the policy weighs every kind of copy by its own
    α against the model's round: a copier added can only widen the choice."""

    def __init__(self, copiers: list[PromptLookupDrafter | SuffixDrafter], model: Drafter | None, name: str = "auto"):
        self.copiers = list(copiers)
        self.model = model
        self.name = name

    def candidates(self, tokens):
        # A match costs nothing to find and drafts for free: preferred when there is one.
        found = [copier for copier in self.copiers if len(copier.find(tokens, 1))]
        if self.model is None:
            return found or self.copiers[:1]
        return [*found, self.model]

    def parts(self):
        return self.copiers + ([self.model] if self.model is not None else [])

    def accepted(self, tokens, n_accepted):
        for part in self.parts():
            part.accepted(tokens, n_accepted)

    def seen(self, first_row, hidden):
        for part in self.parts():
            if part.reads_hidden:
                part.seen(first_row, {layer: hidden[layer] for layer in part.reads_hidden})

    def reset(self, tokens=(), prefill=True):
        for part in self.parts():
            part.reset(tokens, prefill)
