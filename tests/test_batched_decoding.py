"""Batched plain decoding (runtime/batch.py): several sequences, one KV slot each, advanced by
one target pass. Each row must be what that sequence's own pass computes, whatever else is in
the batch, so each sequence's tokens are its solo tokens (float32 here, bit for bit)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import numpy as np
import pytest

from edge_spec.sampling import SamplingConfig
from runtime.batch import batched_target
from runtime.engine import Engine, EngineConfig, GenerateConfig

PROMPTS = [[0, 17, 42, 99, 123, 7], [5, 9, 250, 31, 8, 60, 61, 62, 63, 3, 2], [44, 45]]


def _engine(bundle) -> Engine:
    return Engine(bundle, EngineConfig(drafter="none", calibrate=False))


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_a_batched_pass_computes_each_row_as_the_sequence_alone(bundles, name):
    engine = _engine(bundles[name])
    target = batched_target(engine.loader, 4)
    for slot, prompt in enumerate(PROMPTS):  # three lengths in three slots; slot 3 idle
        target.runner(slot).prefill(prompt[:-1])
    batched = target.step([0, 1, 2], [p[-1] for p in PROMPTS])  # [3,V]
    for slot, prompt in enumerate(PROMPTS):
        solo = engine.target
        solo.cache.reset()
        solo.prefill(prompt[:-1])
        alone = solo.forward([prompt[-1]])  # [1,V]
        assert np.array_equal(batched[slot], alone[0]), f"slot {slot}: max difference {np.abs(batched[slot] - alone[0]).max()}"
        cache = target.slots.caches[slot]
        assert cache.kv_len == len(prompt)
        for layer in solo.cache.layers:  # the row the pass wrote, in the slot's own rows only
            assert np.array_equal(cache.keys[layer][0, :, : len(prompt)], solo.cache.keys[layer][0, :, : len(prompt)])


def test_a_slot_outside_the_step_keeps_its_rows_and_length(bundles):
    target = batched_target(_engine(bundles["llama"]).loader, 3)
    for slot, prompt in enumerate(PROMPTS):
        target.runner(slot).prefill(prompt)
    middle = target.slots.caches[1]
    kept = {layer: middle.keys[layer][0, :, : middle.kv_len].copy() for layer in middle.layers}
    target.step([0, 2], [3, 4])
    assert middle.kv_len == len(PROMPTS[1])
    assert all(np.array_equal(middle.keys[layer][0, :, : middle.kv_len], kept[layer]) for layer in middle.layers)
    assert [c.kv_len for c in target.slots.caches] == [len(PROMPTS[0]) + 1, len(PROMPTS[1]), len(PROMPTS[2]) + 1]


@pytest.mark.parametrize("quant", ["int8", "int4"])
def test_quantized_rows_do_not_depend_on_the_other_rows_of_a_batch(quant_bundles, quant):
    """A sequence's row is the same whatever else the batch holds; at int8 also the same as its
    1-row pass. At int4 that depends on the host: MLAS's 1-row int4 kernel rounded differently
    from its many-row kernel on an AVX2 host and identically on an AVX-512/VNNI AMD host (README,
    Batched decoding), so only the independence from other rows is asserted there."""
    target = batched_target(_engine(quant_bundles[quant]).loader, 4)
    rows = {}
    for batch in (1, 2, 3, 4):
        for slot in range(4):
            target.slots.caches[slot].reset()
            target.runner(slot).prefill(PROMPTS[slot % len(PROMPTS)][:-1])
        rows[batch] = target.step(list(range(batch)), [PROMPTS[s % len(PROMPTS)][-1] for s in range(batch)])[0]
    assert np.array_equal(rows[2], rows[3]) and np.array_equal(rows[2], rows[4])
    if quant == "int8":
        assert np.array_equal(rows[1], rows[2])


def test_portable_graphs_are_refused_with_the_reason(portable_bundle):
    with pytest.raises(ValueError, match="fused graphs"):
        batched_target(_engine(portable_bundle).loader, 2)


def test_generate_batch_gives_each_prompt_its_solo_result(bundles):
    """Different lengths, seeds, temperatures, stop strings and token limits in one batch; the
    sequences end at different passes (stop string, length) and leave the batch as they end."""
    engine = Engine(bundles["llama"], EngineConfig(drafter="lookup", calibrate=False))
    plain = {"drafter": "none"}
    free = engine.generate(PROMPTS[2], GenerateConfig(max_new_tokens=30, speculation=plain)).text
    configs = [GenerateConfig(max_new_tokens=20, sampling=SamplingConfig(temperature=0.0)),
               GenerateConfig(max_new_tokens=7, sampling=SamplingConfig(temperature=4.0, seed=5)),
               GenerateConfig(max_new_tokens=30, stop=(free[len(free) // 2 :][:3],))]
    solo = [engine.generate(p, dataclasses.replace(c, speculation=plain)) for p, c in zip(PROMPTS, configs)]
    batched = engine.generate_batch(PROMPTS, configs)
    for a, b in zip(batched, solo):
        assert (a.token_ids, a.text, a.stop_reason) == (b.token_ids, b.text, b.stop_reason)
    assert [r.stop_reason for r in solo] == ["length", "length", "stop"] and len({len(r.token_ids) for r in solo}) == 3


def test_a_long_prompt_enters_beside_a_running_sequence_in_priced_chunks(bundles, monkeypatch):
    """A sequence decoding gets its token every step while a new one's prompt goes in by chunks
    the cost model prices within prefill_stall_ms (here the smallest, 8 tokens); both answers are
    their solo answers. With prefill_stall_ms None the whole prompt goes in before the next step."""
    from runtime import model

    long_prompt = [int(t) for t in np.random.default_rng(3).integers(3, 250, size=60)]
    config = GenerateConfig(max_new_tokens=12)
    solo = _engine(bundles["llama"])
    expected = [solo.generate(p, config).token_ids for p in (PROMPTS[0], long_prompt)]
    fed = []
    prefill = model.ModelRunner.prefill
    monkeypatch.setattr(model.ModelRunner, "prefill", lambda runner, ids, chunk=256, **kw: (fed.append(len(ids)), prefill(runner, ids, chunk, **kw))[1])
    for stall, most in ((1e-3, 8), (None, len(long_prompt) - 1)):
        engine = Engine(bundles["llama"], EngineConfig(drafter="none", calibrate=False, prefill_stall_ms=stall))
        engine.batched(2)  # both slots from the start, as the Scheduler allocates them
        running = engine.slot_sequence(0, PROMPTS[0], config)
        engine.advance_slots([running])
        newcomer = engine.slot_sequence(1, long_prompt, config)
        fed.clear()
        newcomer_spoke = []
        while newcomer.tokens is None:
            before = len(running.out.generated)
            engine.advance_slots([running, newcomer])
            newcomer_spoke.append(bool(newcomer.out.generated))
            assert len(running.out.generated) == before + 1  # the running one stepped in every call
        assert max(fed) == most and sum(fed) == len(long_prompt) - 1
        assert newcomer_spoke == [False] * (-(-(len(long_prompt) - 1) // most) - 1) + [True]  # its first token with its last chunk
        while not (running.ended and newcomer.ended):
            engine.advance_slots([s for s in (running, newcomer) if not s.ended])
        assert [running.out.generated, newcomer.out.generated] == expected


def test_generate_batch_refuses_a_block_stable_engine(bundles):
    """Why: a batched pass attends with one query row per sequence (CPU GroupQueryAttention
    refuses a block of several beside other sequences, tests/test_batched_attention.py), and
    that row is the 1-row pass's, not the row a block-stable pass of 2 computes, even at fp32."""
    engine = Engine(bundles["llama"], EngineConfig(drafter="none", calibrate=False, block_stable=True))
    with pytest.raises(ValueError, match="not block-stable"):
        engine.generate_batch(PROMPTS)
    target, prompt = batched_target(engine.loader, 2), PROMPTS[1]
    for slot in (0, 1):
        target.runner(slot).prefill(prompt[:-1])
    batched = target.step([0, 1], [prompt[-1]] * 2)[0]
    engine.target.prefill(prompt[:-1])
    stable = engine.target.forward([prompt[-1]])[0]  # a 2-row pass, its second row dropped
    assert not np.array_equal(batched, stable)


@pytest.mark.parametrize("batch_pass", ["cheap", "dear"])
def test_the_sequence_holding_the_drafter_speculates_where_that_is_priced_to_pay(bundles, monkeypatch, batch_pass):
    """Greedy: every answer is its solo answer, whichever way each step went. Alone, the drafting
    sequence plays the policy's round (γ 3); beside others, its own round only where the priced
    comparison says so: never when a batched pass is made to look free, always when dear."""
    engine = Engine(bundles["llama"], EngineConfig(drafter="model", gamma=3, calibrate=False))
    configs = [GenerateConfig(max_new_tokens=24, speculation={"drafter": "model"}), GenerateConfig(max_new_tokens=4), GenerateConfig(max_new_tokens=9)]
    solo = [engine.generate(p, dataclasses.replace(c, speculation={"drafter": "none"})).token_ids for p, c in zip(PROMPTS, configs)]
    monkeypatch.setattr(engine.costs, "batch_cost", (lambda rows: 1e-9 * rows) if batch_pass == "cheap" else (lambda rows: 10.0 * rows))
    results = engine.generate_batch(PROMPTS, configs)
    assert [r.token_ids for r in results] == solo
    assert results[0].speculation["drafter"] == "model" and results[1].speculation["drafter"] == "none"
    rounds = dict(results[0].stats.gamma_histogram)
    assert rounds.get(3, 0) >= 1 and results[0].stats.drafted_tokens == 3 * rounds[3]
    assert rounds.get(0, 0) == (9 if batch_pass == "cheap" else 0)  # plain while the 9-token neighbour ran, or never


def test_the_draft_model_is_fed_only_in_a_round_that_drafts(bundles, monkeypatch):
    """Taking the drafter beside others does not make the batch wait for the draft model's
    prefill: while speculating is priced not to pay (a batched pass made to look free), the
    draft model runs nothing; it catches up in the first round it drafts, once its neighbours
    have ended, and the answers are still the solo ones."""
    import runtime.batch

    engine = Engine(bundles["llama"], EngineConfig(drafter="model", gamma=3, calibrate=False))
    configs = [GenerateConfig(max_new_tokens=24, speculation={"drafter": "model"}), GenerateConfig(max_new_tokens=4), GenerateConfig(max_new_tokens=9)]
    solo = [engine.generate(p, dataclasses.replace(c, speculation={"drafter": "none"})).token_ids for p, c in zip(PROMPTS, configs)]
    monkeypatch.setattr(engine.costs, "batch_cost", lambda rows: 1e-9 * rows)
    events, step, draft = [], runtime.batch.BatchedTarget.step, engine.drafter.runner

    def counted_step(self, slots, tokens):
        events.append(("batch", len(slots)))
        return step(self, slots, tokens)

    for name in ("prefill", "forward"):
        monkeypatch.setattr(draft, name, lambda *a, _run=getattr(draft, name), **k: events.append(("draft", 0)) or _run(*a, **k))
    monkeypatch.setattr(runtime.batch.BatchedTarget, "step", counted_step)
    results = engine.generate_batch(PROMPTS, configs)
    assert [r.token_ids for r in results] == solo
    last_shared = max(i for i, (kind, rows) in enumerate(events) if kind == "batch" and rows > 1)
    first_draft = min(i for i, (kind, _) in enumerate(events) if kind == "draft")
    assert first_draft > last_shared, events[: last_shared + 2]
    assert results[0].stats.drafted_tokens > 0


def _steady_costs(engine: Engine, monkeypatch) -> None:
    """Pass times that do not move (a verify pass of k tokens 1 + 0.1 (k - 1) one-token passes, a
    batched pass dear): whether a copy is drafted must not turn on a timing spike of a loaded
    2-core host, which made the policy sit the copies out."""
    costs = engine.costs
    monkeypatch.setattr(costs, "target", {block: 1.0 + 0.1 * (block - 1) for block in range(1, 10)})
    for name in ("record_target", "record_draft", "record_replay", "record_batch"):
        monkeypatch.setattr(costs, name, lambda *args: None)
    monkeypatch.setattr(costs, "batch_cost", lambda rows: 10.0 * rows)


def _concurrently(model, requests: list[dict]) -> list:
    """Each request's result, all submitted at once from one event loop (async consumers take
    every chunk as it comes, so each sequence is ready for every pass)."""
    async def run():
        return await asyncio.gather(*(model.agenerate(**r) for r in requests))

    return asyncio.run(run())


def _first_pass_waits_for(model, others: int, monkeypatch) -> list[int]:
    """Hold the first batched pass until `others` more sequences wait in the line; returns the
    list of each pass's batch size (the sequences that stepped: one whose prompt is still going
    in, a chunk a step, takes no row), filled as passes run."""
    sizes, advance = [], model.engine.advance_slots

    def advance_slots(sequences):
        if not sizes:
            deadline = time.monotonic() + 20
            while len(sequences) + model._scheduler.waiting < others + 1 and time.monotonic() < deadline:
                time.sleep(0.005)
        items = advance(sequences)
        sizes.append(sum(s.tokens is not None for s in sequences))
        return items

    monkeypatch.setattr(model.engine, "advance_slots", advance_slots)
    return sizes


def test_a_model_with_parallel_slots_batches_plain_requests_each_as_alone(bundles, monkeypatch):
    from runtime.api import Model

    engine = _engine(bundles["llama"])
    limits = (12, 5, 20)
    solo = [engine.generate(p, GenerateConfig(max_new_tokens=n, sampling=SamplingConfig(temperature=2.0, seed=s)))
            for s, (p, n) in enumerate(zip(PROMPTS, limits))]
    model = Model(engine, parallel=3)
    sizes = _first_pass_waits_for(model, 2, monkeypatch)
    results = _concurrently(model, [dict(prompt_ids=p, max_tokens=n, temperature=2.0, seed=s) for s, (p, n) in enumerate(zip(PROMPTS, limits))])
    assert [(r.token_ids, r.text) for r in results] == [(r.token_ids, r.text) for r in solo]
    assert sizes.count(3) >= 4 and sum(sizes) == sum(limits)  # one row per token: the three shared their passes


def test_a_speculative_request_shares_the_passes_of_a_model_with_parallel_slots(bundles, monkeypatch):
    from runtime.api import Model

    engine = _engine(bundles["llama"])
    plain, spec = GenerateConfig(max_new_tokens=16), GenerateConfig(max_new_tokens=40, speculation={"drafter": "lookup"})
    solo = [engine.generate(p, plain) for p in PROMPTS[:2]] + [engine.generate(PROMPTS[2], spec)]
    _steady_costs(engine, monkeypatch)
    model = Model(engine, parallel=3)
    sizes = _first_pass_waits_for(model, 2, monkeypatch)
    results = _concurrently(model, [dict(prompt_ids=PROMPTS[0], max_tokens=16, temperature=0), dict(prompt_ids=PROMPTS[1], max_tokens=16, temperature=0),
                                    dict(prompt_ids=PROMPTS[2], max_tokens=40, temperature=0, speculation={"drafter": "lookup"})])
    assert [r.token_ids for r in results] == [r.token_ids for r in solo]
    assert results[2].speculation == {"drafter": "lookup", "gamma": "auto", "max_gamma": 8, "batched": True}
    assert 3 in sizes and results[2].stats.drafted_tokens > 0  # in a batch with both others, and drafting


def test_a_layer_skip_request_decodes_plainly_in_a_slot_and_says_so(bundles):
    engine = Engine(bundles["llama"], EngineConfig(drafter="layer-skip", calibrate=False))
    results = engine.generate_batch(PROMPTS[:2], GenerateConfig(max_new_tokens=5, speculation={"drafter": "layer-skip"}))
    assert all(r.speculation["drafter"] == "none" and r.speculation["asked"] == "layer-skip" and not r.stats.drafted_tokens for r in results)


def test_parallel_slots_are_refused_where_they_cannot_batch(bundles, portable_bundle):
    from runtime.api import Model

    with pytest.raises(ValueError, match="not block-stable"):
        Model(Engine(bundles["llama"], EngineConfig(drafter="none", calibrate=False, block_stable=True)), parallel=2)
    with pytest.raises(ValueError, match="fused graphs"):
        Model(_engine(portable_bundle), parallel=2)
    with pytest.raises(ValueError, match="parallel must be"):
        Model.load(bundles["llama"], parallel=0)


def test_the_memory_plan_counts_the_kv_slots_and_names_the_most_that_fit(bundles):
    from edge_spec.budget import BudgetError, check_parallel, kv_bytes, plan_bundle
    from edge_spec.manifest import load_manifest

    manifest = load_manifest(bundles["llama"])
    one, four = (plan_bundle(manifest, bundles["llama"], "none", parallel=n) for n in (1, 4))
    assert four.part("KV slots") == 4 * kv_bytes(manifest.target.arch)
    assert four.total_bytes - one.total_bytes == four.part("KV slots") + four.part("batched logits")
    budget = plan_bundle(manifest, bundles["llama"], "none", parallel=2).total_bytes  # room for 2, not 3
    check_parallel(manifest, bundles["llama"], "none", budget, 2)
    with pytest.raises(BudgetError, match="too small for 3 sequences at once .*the most that fit: 2"):
        check_parallel(manifest, bundles["llama"], "none", budget, 3)
    engine = Engine(bundles["llama"], EngineConfig(drafter="none", calibrate=False, memory_budget=budget))
    with pytest.raises(BudgetError, match="the most that fit: 2"):
        engine.batched(3)
    assert len(engine.batched(2).slots) == 2


def test_a_slot_keeps_the_rows_a_later_prompt_starts_with(bundles):
    """A chat's next turn goes to the slot holding its earlier turn and prefills only what is new."""
    engine = _engine(bundles["llama"])
    config = GenerateConfig(max_new_tokens=6)
    first = engine.slot_sequence(1, PROMPTS[1], config)
    while not first.ended:
        engine.advance_slots([first])
    follow = PROMPTS[1] + first.out.generated + [7, 8]
    assert engine.free_slot(follow, set(), 2) == 1 and engine.free_slot(PROMPTS[0], set(), 2) == 0
    fed, prefill = [], engine.batched(2).runner(1).prefill
    engine.batched(2).runner(1).prefill = lambda ids: (fed.append(len(ids)), prefill(ids))[1]
    second = engine.slot_sequence(1, follow, config)
    while not second.ended:
        engine.advance_slots([second])
    assert fed == [len(follow) - 1 - (len(PROMPTS[1]) + len(first.out.generated) - 1)]
    assert second.out.generated == engine.generate(follow, config).token_ids


@pytest.mark.real_weights
def test_real_weights_four_batched_greedy_answers_equal_their_solo_answers():
    """Real weights at fp32 (Qwen2.5-Coder 0.5B, fused): four chat prompts decoded together give
    each its plain decoding's tokens. At int8 that is a kernel fact of the host, not a promise:
    on an AVX-512/VNNI host one of these four SmolLM2 int8 answers parted at its 17th token
    (README, Batched decoding)."""
    from tests import real

    real.need(real.QWEN_DRAFT)
    engine = Engine(real.bundle("qwen05-fp32"), EngineConfig(provider="cpu", drafter="none", calibrate=False))
    prompts = [engine.encode(messages=m) for m in real.humaneval_messages(4)]
    config = GenerateConfig(max_new_tokens=32)
    solo = [engine.generate(p, config).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_batch(prompts, config)] == solo


@pytest.mark.real_weights
def test_smollm2_int8_batched_rows_do_not_depend_on_the_others():
    """Real weights (SmolLM2 int8, its target cut in stages for the layer-skip draft): a row of a
    batched pass is the same whatever else the batch holds and whichever slot it takes."""
    from tests import real

    real.need(real.SMOLLM2)
    engine = Engine(real.bundle("smollm2-int8"), EngineConfig(provider="cpu", drafter="none", calibrate=False))
    prompts = [engine.encode(messages=m) for m in real.humaneval_messages(4)]
    target = engine.batched(4)
    rows = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):  # the same sequence beside others, in another slot
        for slot, i in enumerate(order):
            target.slots.caches[slot].reset()
            target.runner(slot).prefill(prompts[i][:-1])
        logits = target.step(list(range(4)), [prompts[i][-1] for i in order])
        rows.append(logits[order.index(0)])
    assert np.array_equal(rows[0], rows[1])


def test_an_idle_full_slot_below_the_batch_gives_up_its_last_row(bundles):
    target = batched_target(_engine(bundles["llama"]).loader, 2)
    full = target.slots.caches[0]
    target.runner(0).prefill(list(range(1, full.max_context + 1)))
    target.runner(1).prefill(PROMPTS[0][:-1])
    target.step([1], [PROMPTS[0][-1]])  # slot 0 is in the pass's range, not in the step
    assert full.kv_len == full.max_context - 1 and target.slots.caches[1].kv_len == len(PROMPTS[0])


def test_a_cancelled_batched_request_ends_and_its_neighbour_goes_on(bundles):
    from runtime.api import Model

    model = Model(_engine(bundles["llama"]), parallel=2)

    async def run():
        job = model.submit(prompt_ids=PROMPTS[0], max_tokens=40, temperature=0)
        other = model.submit(prompt_ids=PROMPTS[1], max_tokens=10, temperature=0)
        chunks = job.__aiter__()
        first = await chunks.__anext__()
        job.cancel()
        rest = [chunk async for chunk in chunks]
        return first, rest, await other.aresult()

    first, rest, other = asyncio.run(run())
    final = rest[-1].result
    assert final.stop_reason == "cancelled" and len(final.token_ids) < 40 and first.text
    assert other.stop_reason == "length" and len(other.token_ids) == 10
    deadline = time.monotonic() + 10
    while model.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert model.running == 0
