"""Self-speculation: some of the target's layers (a prefix, or a subset chosen at export), then
its final norm and LM head.

The draft runs the target's own stage sessions (the first, which holds the embedding and the
first kept layers, then every other stage the layer_skip role lists, then the head) and writes
their KV rows into the target's cache at the drafted positions, so no weights are loaded twice.
The verify pass reuses the first stage's output for every drafted position but the last, and
recomputes every later stage for every row it scores, overwriting the rows the draft wrote there.
"""

from __future__ import annotations

import numpy as np

from runtime.drafters.base import CostsPasses, TrunkProposal, pick_token
from runtime.model import ModelRunner


class LayerSkipDrafter(CostsPasses):
    name = "layer-skip"

    def __init__(self, runner: ModelRunner):
        self.runner = runner  # stages [trunk, kept segments..., head]; runner.cache is the target's cache

    def propose(self, tokens, gamma, sampling, rng):
        cache = self.runner.cache
        kv_len = cache.kv_len  # == len(tokens) - 1: the pending token goes at `kv_len`
        gamma = min(gamma, cache.max_context - kv_len - 1)
        if gamma <= 0:
            return None
        token = int(tokens[-1])
        last = len(self.runner.stages) - 1
        hidden, drafted, draft_probs = [], [], []
        first_position = np.zeros(1, dtype=np.int64)
        for i in range(gamma):
            x = self.runner.run_stage(0, np.array([[token]], dtype=np.int64), kv_len + i)  # [1,1,H], on the device there
            hidden.append(x if isinstance(x, np.ndarray) else self.runner.to_host(x))  # the verify pass reuses it
            for index in range(1, last):
                x = self.runner.run_stage(index, x, kv_len + i)  # [1,1,H]: a later kept segment
            logits = self.runner.run_stage(last, x, kv_len + i, first_position)[0, -1]  # [V]
            token, token_probs = pick_token(logits, sampling, rng)
            drafted.append(token)
            draft_probs.append(token_probs)
        return TrunkProposal.of(drafted, draft_probs, trunk_hidden=np.concatenate(hidden, axis=1))
