"""Several sequences advanced by one target pass (issue 36, its first part: plain decoding).

A fused graph takes a batch of sequences, one KV slot each ([B,KVH,MAX,D], each row at its own
length through seqlens_k); ONNX Runtime's CPU GroupQueryAttention computes one token per
sequence of a batch exactly as that sequence's own 1-token pass, and refuses a block of several
tokens with a past when B > 1 (tests/test_batched_attention.py). So a batched pass here feeds one
token per sequence: plain decoding. Speculative blocks of several sequences need one attention
node per slot (not built yet).

    target = BatchedTarget(info, stages, sessions, KVSlots(n, ...))
    target.runner(i).prefill(prompt[:-1])              # a slot decodes alone through the usual loop
    logits = target.step([0, 1, 2], [t0, t1, t2])      # one pass, one token each: [3, V]

`batch_round` is one step of several sequences: the one holding the drafter plays a speculative
round of its own (runtime/loop.py's play_round) where that is priced to commit more tokens a
second than its row in the batch (`speculation_pays`), the rest share one batched pass.
Engine.slot_sequence / advance_slots decode sequences this way (sampling, text, stop strings and
results as Engine.stream has them); the Scheduler batches its requests through them.
"""

from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np

from edge_spec import names
from edge_spec.manifest import ModelInfo, StageInfo
from runtime import loop
from runtime.drafters.base import Drafter
from runtime.gamma import CostModel
from runtime.kv_cache import KVSlots
from runtime.model import ModelRunner
from runtime.policy import Plan, RoundPolicy


class BatchedTarget:
    """A role's stage sessions over N KV slots: `runner(i)` is slot i alone (the loop's target
    runner), `step` advances several slots by one token each in one pass."""

    def __init__(self, info: ModelInfo, stages: list[StageInfo], sessions: list, slots: KVSlots):
        unbatched = [s.file for s, session in zip(stages, sessions) if s.layers and (s.attention != "fused" or not hasattr(session, "io_binding"))]
        if unbatched:
            raise ValueError(f"batched decoding needs fused graphs with KV bound in place; {', '.join(unbatched)} is not one (re-export with --attention fused)")
        self.info, self.stages, self.sessions, self.slots = info, stages, sessions, slots
        self.vocab_size = info.arch.vocab_size
        self._runners: dict[int, ModelRunner] = {}
        self._bindings: dict[tuple[int, int], object] = {}  # (stage index, batch) -> IOBinding

    def runner(self, slot: int) -> ModelRunner:
        """Slot `slot` decoding alone: a ModelRunner over its cache (its rows of the buffers)."""
        if slot not in self._runners:
            self._runners[slot] = ModelRunner("target", self.info, self.stages, self.sessions, self.slots.caches[slot])
        return self._runners[slot]

    def _binding(self, index: int, batch: int):
        """Stage `index`'s binding with its past/present bound in place to the first `batch` slots."""
        if (index, batch) not in self._bindings:
            stage = self.stages[index]
            binding = self.sessions[index].io_binding()
            binding.bind_output(stage.outputs[0], "cpu")  # bound first, so get_outputs()[0] is it
            for layer in stage.layers:
                key, value = self.slots.ortvalues(layer, batch)
                binding.bind_ortvalue_input(names.past_key(layer), key)
                binding.bind_ortvalue_output(names.present_key(layer), key)
                binding.bind_ortvalue_input(names.past_value(layer), value)
                binding.bind_ortvalue_output(names.present_value(layer), value)
            self._bindings[index, batch] = binding
        return self._bindings[index, batch]

    def step(self, slots: Sequence[int], tokens: Sequence[int]) -> np.ndarray:
        """Feed tokens[j] to slot slots[j] at that slot's own length, in one pass over the first
        max(slots) + 1 slots; returns logits [len(slots), V] and extends each listed slot by its
        token. A slot in that range but not listed is fed at its length and not extended: the row
        it writes there is stale by the cache's invariant (a full one gives up its last row)."""
        if len(slots) != len(tokens) or not len(slots) or len(set(slots)) != len(slots):
            raise ValueError(f"a batched step takes one token for each of distinct slots, got slots {list(slots)} and {len(tokens)} tokens")
        caches = self.slots.caches
        batch = max(slots) + 1
        ids = np.zeros((batch, 1), dtype=np.int64)  # [B,1]
        for slot, token in zip(slots, tokens):
            ids[slot, 0] = token
        listed = set(slots)
        for slot, cache in enumerate(caches[:batch]):
            if slot in listed:
                cache.check_room(cache.kv_len, 1)
            elif cache.kv_len >= cache.max_context:
                cache.kv_len = cache.max_context - 1  # an idle full slot: its last row becomes the stale one written
        lengths = np.array([cache.kv_len for cache in caches[:batch]], dtype=np.int32)  # [B]
        x = ids
        for index, stage in enumerate(self.stages):
            binding = self._binding(index, batch)
            binding.bind_cpu_input(stage.inputs[0], np.ascontiguousarray(x))
            if stage.layers:
                binding.bind_cpu_input(names.SEQLENS_K, lengths)  # kv_len + T - 1 with T = 1
                binding.bind_cpu_input(names.TOTAL_SEQ_LEN, np.array(lengths.max() + 1, dtype=np.int32))
            if stage.head:
                binding.bind_cpu_input(names.LOGIT_POSITIONS, np.zeros(1, dtype=np.int64))
            binding.bind_output(stage.outputs[0], "cpu")
            self.sessions[index].run_with_iobinding(binding)
            x = binding.get_outputs()[0].numpy()  # hidden [B,1,H] or logits [B,1,V]
        for slot, token in zip(slots, tokens):
            caches[slot].extend(np.array([token], dtype=np.int64))
        return x[list(slots), 0]  # [len(slots),V]


def batched_target(loader, n: int) -> BatchedTarget:
    """The loaded bundle's target over n new KV slots in host memory (its sessions shared with
    the loader's runners)."""
    loader.runner("target")  # opens the target's stage sessions
    manifest = loader.bundle.manifest
    info = manifest.models["target"]
    if loader.caches["target"].device is not None:
        raise ValueError(f"batched decoding keeps KV slots in host memory; this target's KV lives on {loader.caches['target'].device}")
    arch = info.arch
    slots = KVSlots(n, range(arch.n_layers), arch.n_kv_heads, arch.max_context, arch.head_dim, arch.kv_dtype)
    return BatchedTarget(info, [manifest.stages[k] for k in info.stages], [loader.sessions[k] for k in info.stages], slots)


def speculation_pays(plan: Plan, rows: int, policy: RoundPolicy, costs: CostModel) -> bool:
    """Whether the round `plan` for one sequence, beside a batched pass over the other rows - 1,
    is expected to commit more tokens a second than one batched pass over all `rows` (each
    pass's cost as measured; a row count never measured runs batched first, which measures it).
    Alone (rows 1) it is the round policy's own choice."""
    if not plan.gamma:
        return False
    if rows == 1:
        return True
    together, apart = costs.batch_cost(rows), costs.batch_cost(rows - 1)
    if together is None or apart is None:
        return False
    tokens, seconds = policy.expected_round(plan)
    return (tokens + rows - 1) / (seconds + apart) > rows / together


def batch_round(target, sequences: list, drafting, drafter: Drafter | None, policy: RoundPolicy, costs: CostModel,
                clock: Callable[[], float] = time.perf_counter) -> list[loop.Step]:
    """One step of each sequence (each prefilled, `.tokens` its committed tokens with the last
    pending, `.slot`, `.rng`, `.config.sampling`): `drafting` (one of them, holding `drafter`
    and the policy's sequence, or None) plays a speculative round of its own if
    speculation_pays; the others (and it, if not) get one token each from one batched pass of
    `target` (BatchedTarget: .step, .runner), drawn from its row as the loop's plain step draws.
    Extends each sequence's tokens; returns each one's Step, in order."""
    plan = None
    if drafting is not None:
        plan = policy.choose(drafting.tokens)
        if not speculation_pays(plan, len(sequences), policy, costs):
            plan = None
    plain = [s for s in sequences if plan is None or s is not drafting]
    steps: dict[int, loop.Step] = {}
    if plain:
        began_batch = clock()
        logits = target.step([s.slot for s in plain], [int(s.tokens[-1]) for s in plain])  # [B,V]
        took = clock() - began_batch
        if len(plain) > 1:
            costs.record_batch(len(plain), took)
        for sequence, row in zip(plain, logits):
            token = loop.verify(row[None], None, sequence.config.sampling, sequence.rng)[1]
            sequence.tokens = np.append(sequence.tokens, token)
            steps[id(sequence)] = loop.Step((int(token),), 0, 0, 0, 0.0, took, None)
            if sequence is drafting:  # a drafter that keeps rows catches up on its next round
                drafter.accepted(sequence.tokens, 0)
                policy.advanced(1)
    if plan is not None:  # its round's seconds start here, after the others' pass
        drafting.tokens, steps[id(drafting)] = loop.play_round(target.runner(drafting.slot), drafter, plan, drafting.tokens,
                                                               drafting.config.sampling, drafting.rng, policy, clock(), clock)
    return [steps[id(s)] for s in sequences]
