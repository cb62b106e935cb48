"""Self-speculation: the target's first N layers, then its final norm and LM head.

The draft runs the target's own trunk and head sessions and writes the trunk's KV rows into
the target's cache, so no weights are loaded twice and the verify pass reuses the trunk's
output for every drafted position but the last.
"""

from __future__ import annotations

import numpy as np

from runtime.drafters.base import CostsPasses, TrunkProposal, pick_token
from runtime.model import ModelRunner


class LayerSkipDrafter(CostsPasses):
    name = "layer-skip"

    def __init__(self, runner: ModelRunner):
        self.runner = runner  # stages [trunk, head]; runner.cache is the target's cache

    def propose(self, tokens, gamma, sampling, rng):
        cache = self.runner.cache
        kv_len = cache.kv_len  # == len(tokens) - 1: the pending token goes at `kv_len`
        gamma = min(gamma, cache.max_context - kv_len - 1)
        if gamma <= 0:
            return None
        token = int(tokens[-1])
        hidden, drafted, draft_probs = [], [], []
        first_position = np.zeros(1, dtype=np.int64)
        for i in range(gamma):
            trunk_hidden = self.runner.run_stage(0, np.array([[token]], dtype=np.int64), kv_len + i)  # [1,1,H]
            hidden.append(trunk_hidden)
            logits = self.runner.run_stage(1, trunk_hidden, kv_len + i, first_position)[0, -1]  # [V]
            token, token_probs = pick_token(logits, sampling, rng)
            drafted.append(token)
            draft_probs.append(token_probs)
        return TrunkProposal.of(drafted, draft_probs, trunk_hidden=np.concatenate(hidden, axis=1))
