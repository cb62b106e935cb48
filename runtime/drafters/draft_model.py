"""A smaller same-tokenizer model drafts γ tokens autoregressively from its own KV cache."""

from __future__ import annotations

import numpy as np

from edge_spec.sampling import SamplingConfig
from runtime.drafters.base import CatchesUp, CatchUpProposal, pick_token
from runtime.model import ModelRunner


class DraftModelDrafter(CatchesUp):
    name = "model"

    def __init__(self, runner: ModelRunner):
        self.runner = runner

    def propose(self, tokens, gamma, sampling: SamplingConfig, rng):
        cache = self.runner.cache
        gamma = min(gamma, cache.max_context - len(tokens) + 1)
        if gamma <= 0:
            return None
        # Catch up on what the draft has not seen: the pending token, and after a round accepted
        # in full the last drafted token before it, in one pass; more is replay, timed apart.
        missing = tokens[cache.kv_len :]
        replay = self.replay_tokens(tokens)
        catch_up = 0.0
        if replay:
            began = self.clock()
            self.runner.prefill(missing[:-1])
            catch_up = self.clock() - began
            missing = missing[-1:]
        logits = self.runner.forward(missing, n_logits=1)[-1]  # [V]
        drafted, draft_probs = [], []
        for i in range(gamma):
            token, token_probs = pick_token(logits, sampling, rng)
            drafted.append(token)
            draft_probs.append(token_probs)
            if i + 1 < gamma:
                logits = self.runner.forward([token])[-1]  # [V]
        return CatchUpProposal.of(drafted, draft_probs, catch_up_seconds=catch_up, catch_up_tokens=replay)

    def replay_tokens(self, tokens):
        # More than the one token a round leaves unfed is replay after plain or copy rounds: a
        # one-off, not what a draft step costs.
        missing = len(tokens) - self.runner.cache.kv_len
        return missing - 1 if missing > 2 else 0

    def accepted(self, tokens, n_accepted):
        # Never keep a row for the pending (last) token: the next round feeds it first.
        self.runner.cache.rollback_to_prefix(tokens[:-1])

    def reset(self, tokens=(), prefill=True):
        self.runner.cache.rollback_to_prefix(tokens)
        if prefill:  # now, so it is timed as prefill rather than as drafting
            self.runner.prefill(np.asarray(tokens, dtype=np.int64)[self.runner.cache.kv_len :])
