"""Copy when the text repeats, otherwise draft with a model: chosen per round by the policy."""

from __future__ import annotations

from runtime.drafters.base import Drafter, Selects
from runtime.drafters.prompt_lookup import PromptLookupDrafter


class MixedDrafter(Selects):
    def __init__(self, lookup: PromptLookupDrafter, model: Drafter | None, name: str = "auto"):
        self.lookup = lookup
        self.model = model
        self.name = name

    def candidates(self, tokens):
        # A suffix match costs nothing to find and drafts for free: preferred when it is there.
        if self.model is None:
            return [self.lookup]
        return [self.lookup, self.model] if len(self.lookup.find(tokens, 1)) else [self.model]

    def parts(self):
        return [self.lookup] + ([self.model] if self.model is not None else [])

    def propose(self, tokens, gamma, sampling, rng):
        return self.candidates(tokens)[0].propose(tokens, gamma, sampling, rng)

    def accepted(self, tokens, n_accepted):
        for part in self.parts():
            part.accepted(tokens, n_accepted)

    def reset(self, tokens=()):
        for part in self.parts():
            part.reset(tokens)
