"""KV rollback: moving kv_len back must be indistinguishable from never having drafted.

Real graphs (a tiny fp32 bundle through ModelRunner) and the pure KVCache bookkeeping.
"""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine import Engine, EngineConfig
from runtime.kv_cache import ContextFullError, KVCache


def assert_same_logits(actual, expected):
    """Equal up to float32 noise: 1e-5 relative to the logits' scale (a block and a single
    token take different kernels; a wrong row read would move logits by O(1))."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape
    scale = max(1.0, float(np.abs(expected).max()))
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * scale)


@pytest.fixture(scope="module")
def runner(llama_bundle):
    return Engine(llama_bundle, EngineConfig(drafter="none", calibrate=False)).target


@pytest.fixture(scope="module")
def skip_runner(llama_bundle):
    """A layer-skip draft runner: it shares (and writes into) the target's cache."""
    engine = Engine(llama_bundle, EngineConfig(drafter="layer-skip", gamma=2, calibrate=False))
    return engine.target, engine.drafter.runner


PROMPT = [0, 17, 42, 99, 123, 7, 250, 31]


def _greedy(runner, prompt, n):
    """Plain incremental greedy decoding; returns (committed tokens, logits per step)."""
    runner.cache.reset()
    tokens = list(prompt)
    runner.forward(tokens[:-1])
    rows = []
    for _ in range(n):
        logits = runner.forward(tokens[-1:])[-1]
        rows.append(logits)
        tokens.append(int(np.argmax(logits)))
    return tokens, rows


def _wrong(token: int, vocab: int) -> int:
    return (token + 1) % vocab


def test_rollback_after_rejected_draft_equals_never_drafting(runner):
    vocab = runner.vocab_size
    tokens, reference = _greedy(runner, PROMPT, 10)
    # Decode 4 tokens, then verify a draft block [pending, wrong, x, y]: the target rejects
    # at the first drafted position.
    committed, _ = _greedy(runner, PROMPT, 4)
    assert committed == tokens[: len(PROMPT) + 4]
    correct = tokens[len(committed)]
    block = [committed[-1], _wrong(correct, vocab), 5, 6]
    logits = runner.forward(block)
    assert int(np.argmax(logits[0])) == correct
    assert_same_logits(logits[0], reference[4])
    committed = committed + [correct]
    assert runner.cache.rollback_to_prefix(committed) == len(committed) - 1  # keeps the pending token's row
    # Feed on: the logits are those of never having drafted.
    for step in range(5, 10):
        row = runner.forward(committed[-1:])[-1]
        assert_same_logits(row, reference[step])
        committed.append(int(np.argmax(row)))
    assert committed == tokens


def test_rollback_after_mismatch_in_the_middle_of_a_block(runner):
    vocab = runner.vocab_size
    tokens, reference = _greedy(runner, PROMPT, 10)
    committed, _ = _greedy(runner, PROMPT, 3)
    n = len(committed)
    # Draft: two right tokens, then a wrong one, then one more.
    block = [committed[-1], tokens[n], tokens[n + 1], _wrong(tokens[n + 2], vocab), 9]
    logits = runner.forward(block)
    assert_same_logits(logits[:3], np.stack(reference[3:6]))
    committed = tokens[: n + 3]  # two accepted + the target's correction
    assert runner.cache.rollback_to_prefix(committed) == n + 2
    assert list(runner.cache.row_tokens[: n + 2]) == committed[:-1]
    for step in range(6, 10):
        row = runner.forward(committed[-1:])[-1]
        assert_same_logits(row, reference[step])
        committed.append(int(np.argmax(row)))
    assert committed == tokens


def test_all_accepted_block_then_bonus(runner):
    tokens, reference = _greedy(runner, PROMPT, 8)
    committed, _ = _greedy(runner, PROMPT, 2)
    n = len(committed)
    block = [committed[-1]] + tokens[n : n + 3]
    logits = runner.forward(block)
    assert_same_logits(logits, np.stack(reference[2:6]))
    committed = tokens[: n + 4]  # 3 accepted + bonus
    assert runner.cache.rollback_to_prefix(committed) == n + 3  # nothing dropped
    row = runner.forward(committed[-1:])[-1]
    assert_same_logits(row, reference[6])


def test_stale_rows_past_kv_len_are_never_read(runner):
    tokens, reference = _greedy(runner, PROMPT, 6)
    committed, _ = _greedy(runner, PROMPT, 3)
    cache = runner.cache
    kv_len = cache.kv_len
    block = [committed[-1], tokens[len(committed)]]  # a multi-token block: the causal part too
    clean = runner.forward(block)
    assert_same_logits(clean, np.stack(reference[3:5]))
    assert cache.rollback_to_prefix(committed[:-1]) == kv_len
    rng = np.random.default_rng(0)
    for layer in cache.layers:
        for buffers in (cache.keys, cache.values):
            stale = buffers[layer][:, :, kv_len:]
            buffers[layer][:, :, kv_len:] = rng.normal(0, 1e4, size=stale.shape).astype(stale.dtype)
    garbage = {layer: cache.keys[layer][:, :, kv_len + 5].copy() for layer in cache.layers}
    dirty = runner.forward(block)
    assert np.isfinite(dirty).all()
    np.testing.assert_allclose(dirty, clean, rtol=0, atol=1e-6)  # same computation, other stale rows
    # Rows beyond the written block keep the garbage (nothing rewrites the whole buffer).
    for layer in cache.layers:
        np.testing.assert_array_equal(cache.keys[layer][:, :, kv_len + 5], garbage[layer])


def test_rows_written_by_layer_skip_draft_then_rolled_back(skip_runner):
    """The layer-skip draft writes trunk rows into the target's cache past kv_len; after a
    rejection those rows are stale and must not change the target's next logits."""
    target, draft = skip_runner
    tokens, reference = _greedy(target, PROMPT, 8)
    committed, _ = _greedy(target, PROMPT, 3)
    start = target.cache.kv_len
    # Draft two tokens through the trunk (writes layer-0 rows at start, start+1).
    for i, token in enumerate([77, 78]):  # not the tokens the target will feed
        hidden = draft.run_stage(0, np.array([[token]], dtype=np.int64), start + i)
        draft.run_stage(1, hidden, start + i, np.zeros(1, dtype=np.int64))
    assert target.cache.kv_len == start  # the draft does not extend the cache
    for step in range(3, 8):
        row = target.forward(committed[-1:])[-1]
        assert_same_logits(row, reference[step])
        committed.append(int(np.argmax(row)))


def test_forward_past_max_context_raises(runner):
    runner.cache.reset()
    max_context = runner.cache.max_context
    runner.forward(list(range(1, max_context - 1)))
    with pytest.raises(ContextFullError, match="context full"):
        runner.forward([1, 2, 3])
    assert runner.cache.kv_len == max_context - 2  # the refused block changed nothing
    runner.forward([1, 2])
    assert runner.cache.kv_len == max_context


# -- KVCache bookkeeping alone -----------------------------------------------------------------


def _cache(rows, max_context=16) -> KVCache:
    cache = KVCache(range(2), n_kv_heads=1, max_context=max_context, head_dim=2)
    for i, token in enumerate(rows):
        value = np.full((1, 1, 1, 2), float(token), dtype=np.float32)
        cache.write_rows(cache.layers, [value, -value] * len(cache.layers), i)
        cache.extend(np.array([token]))
    return cache


def test_rollback_keeps_the_longest_common_prefix():
    cache = _cache([5, 6, 7, 8, 9])
    assert cache.rollback_to_prefix([5, 6, 7, 8, 9, 10]) == 5  # committed runs past kv_len
    assert cache.rollback_to_prefix([5, 6, 7, 8, 9]) == 5
    assert cache.rollback_to_prefix(np.array([5, 6, 7, 1, 9])) == 3  # mismatch in the middle
    assert cache.kv_len == 3
    assert cache.rollback_to_prefix([5, 6, 7, 8, 9]) == 3  # rolled-back rows do not come back
    assert cache.rollback_to_prefix([5, 6]) == 2  # committed shorter than kv_len
    assert cache.rollback_to_prefix([4, 6]) == 0  # mismatch at the first row
    assert cache.rollback_to_prefix([]) == 0


def test_rollback_then_rewrite_uses_new_rows():
    cache = _cache([5, 6, 7, 8])
    cache.rollback_to_prefix([5, 6, 1])
    assert cache.kv_len == 2
    value = np.full((1, 1, 2, 2), 3.0, dtype=np.float32)
    cache.write_rows(cache.layers, [value, value, value, value], cache.kv_len)
    cache.extend(np.array([1, 2]))
    assert cache.kv_len == 4
    assert list(cache.row_tokens[:4]) == [5, 6, 1, 2]
    assert cache.keys[0][0, 0, :4, 0].tolist() == [5.0, 6.0, 3.0, 3.0]
    assert cache.values[1][0, 0, :4, 0].tolist() == [-5.0, -6.0, 3.0, 3.0]
    assert cache.rollback_to_prefix([5, 6, 1, 2, 3]) == 4


def test_feeds_and_room():
    cache = _cache([1, 2, 3], max_context=8)
    feeds = cache.feeds(range(1, 2))
    assert set(feeds) == {"past_key.1", "past_value.1"}
    assert feeds["past_key.1"] is cache.keys[1]  # no copy per step
    assert feeds["past_key.1"].shape == (1, 1, 8, 2)
    cache.check_room(3, 5)
    with pytest.raises(ContextFullError):
        cache.check_room(3, 6)
    assert cache.nbytes == 2 * 2 * 8 * 2 * 4
    cache.reset()
    assert cache.kv_len == 0 and cache.rollback_to_prefix([1, 2, 3]) == 0


def test_views_that_grow_keep_every_row_of_every_head():
    """grow_on_demand (masked graphs with a symbolic past width): contiguous views as wide as the
    rows in use, widened in place; every head's rows survive each move."""
    cache = KVCache(range(2), n_kv_heads=3, max_context=512, head_dim=4)
    cache.grow_on_demand()
    assert cache.capacity == 64 and cache.keys[0].shape == (1, 3, 64, 4)
    rng = np.random.default_rng(0)
    expected = {layer: np.zeros((2, 3, 0, 4), dtype=np.float32) for layer in cache.layers}  # keys, values
    capacities = []
    for block in (40, 30, 70, 100, 200, 60):
        start = cache.kv_len
        cache.check_room(start, block)
        cache.fit(start + block)
        new = [rng.standard_normal((1, 3, block, 4)).astype(np.float32) for _ in range(4)]
        cache.write_rows(cache.layers, new, start)
        cache.extend(np.arange(start, start + block))
        for i, layer in enumerate(cache.layers):
            expected[layer] = np.concatenate([expected[layer], np.concatenate([new[2 * i], new[2 * i + 1]])], axis=2)
        capacities.append(cache.capacity)
        for layer in cache.layers:
            assert cache.keys[layer].flags.c_contiguous and cache.keys[layer].shape[2] == cache.capacity
            np.testing.assert_array_equal(cache.keys[layer][0, :, : cache.kv_len], expected[layer][0])
            np.testing.assert_array_equal(cache.values[layer][0, :, : cache.kv_len], expected[layer][1])
    assert capacities == [64, 128, 192, 256, 448, 512]
    assert cache.feeds(range(1, 2))["past_key.1"] is cache.keys[1]  # the view itself: no copy per pass
    cache.reset()
    assert cache.capacity == 64 and cache.keys[0].shape == (1, 3, 64, 4)
