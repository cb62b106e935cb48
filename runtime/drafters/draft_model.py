"""A smaller same-tokenizer model drafts γ tokens autoregressively from its own KV cache."""

from __future__ import annotations

import numpy as np

from edge_spec.sampling import SamplingConfig
from runtime.drafters.base import Drafter, Proposal, pick_token
from runtime.model import ModelRunner


class DraftModelDrafter(Drafter):
    name = "model"

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, tokens, gamma, sampling: SamplingConfig, rng):
        cache = self.runner.cache
        gamma = min(gamma, cache.max_context - len(tokens) + 1)
        if gamma <= 0:
            return None
        # Catch up on what the draft has not seen: the whole prompt at first, then the one or
        # two tokens the last round committed.
        missing = tokens[cache.kv_len :]
        if len(missing) > 1:
            self.runner.prefill(missing[:-1])
        logits = self.runner.forward(missing[-1:], n_logits=1)[-1]  # [V]
        drafted, draft_probs = [], []
        for i in range(gamma):
            token, probs = pick_token(logits, sampling, rng)
            drafted.append(token)
            draft_probs.append(probs)
            if i + 1 < gamma:
                logits = self.runner.forward([token])[-1]  # [V]
        probs = None if sampling.greedy else np.stack(draft_probs)  # [γ,V]
        return Proposal(np.array(drafted, dtype=np.int64), probs)

    def accepted(self, tokens, n_accepted):
        self.runner.cache.rollback_to_prefix(tokens)

    def reset(self, tokens=()):
        self.runner.cache.rollback_to_prefix(tokens)
