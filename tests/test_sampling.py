"""Tests for edge_spec.sampling against plain-loop references and hand-computed cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_spec.sampling import SamplingConfig, process_logits, sample
from tests.scripted_rng import ScriptedRng



def reference_process(row, temperature, top_k=0, top_p=1.0):
    """Plain-Python HF-style warpers for one row: temperature, top-k, top-p, softmax."""
    vocab_size = len(row)
    if temperature == 0.0:
        best = 0
        for index in range(vocab_size):
            if row[index] > row[best]:
                best = index
        return [1.0 if index == best else 0.0 for index in range(vocab_size)]
    scaled = [float(value) / temperature for value in row]
    if 0 < top_k < vocab_size:
        kth_largest = sorted(scaled, reverse=True)[top_k - 1]
        scaled = [value if value >= kth_largest else -math.inf for value in scaled]
    if top_p < 1.0:
        probs = plain_softmax(scaled)
        # Most likely first; among equal logits the higher token id first (so the
        # lower id is the one dropped), then keep tokens until the mass reaches top_p.
        order = sorted(range(vocab_size), key=lambda index: (scaled[index], index), reverse=True)
        kept, mass = set(), 0.0
        for index in order:
            kept.add(index)
            mass += probs[index]
            if mass >= top_p:
                break
        scaled = [scaled[index] if index in kept else -math.inf for index in range(vocab_size)]
    return plain_softmax(scaled)


def plain_softmax(values):
    largest = max(values)
    weights = [math.exp(value - largest) if value != -math.inf else 0.0 for value in values]
    total = sum(weights)
    return [weight / total for weight in weights]


CONFIG_GRID = [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7),
    SamplingConfig(temperature=1.8),
    SamplingConfig(temperature=1.0, top_k=1),
    SamplingConfig(temperature=1.0, top_k=3),
    SamplingConfig(temperature=0.7, top_k=5),
    SamplingConfig(temperature=1.0, top_p=0.8),
    SamplingConfig(temperature=0.5, top_p=0.5),
    SamplingConfig(temperature=1.3, top_k=6, top_p=0.9),
    SamplingConfig(temperature=0.0),
]


@pytest.mark.parametrize("config", CONFIG_GRID, ids=repr)
def test_matches_plain_reference(config):
    rng = np.random.default_rng(7)
    logits = rng.normal(scale=2.0, size=(40, 12))  # [40, V]
    probs = process_logits(logits, config)  # [40, V]
    assert probs.dtype == np.float64
    for row_logits, row_probs in zip(logits, probs):
        expected = reference_process(row_logits, config.temperature, config.top_k, config.top_p)
        np.testing.assert_allclose(row_probs, expected, rtol=1e-12, atol=1e-15)
        assert row_probs.sum() == pytest.approx(1.0, abs=1e-12)


def test_temperature_hand_computed():
    logits = np.array([0.0, math.log(3.0)])
    # T = 1: weights 1:3. T = 0.5 squares the ratio: 1:9.
    np.testing.assert_allclose(process_logits(logits, SamplingConfig(1.0)), [0.25, 0.75])
    np.testing.assert_allclose(process_logits(logits, SamplingConfig(0.5)), [0.1, 0.9])


def test_top_k_keeps_ties_at_the_cut():
    logits = np.array([3.0, 1.0, 2.0, 2.0, 0.0])
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2))
    weights = np.array([math.e**3, 0.0, math.e**2, math.e**2, 0.0])
    np.testing.assert_allclose(probs, weights / weights.sum())


def test_top_k_at_least_vocab_is_a_no_op():
    logits = np.array([0.3, -1.0, 2.0])
    plain = process_logits(logits, SamplingConfig(temperature=1.0))
    np.testing.assert_array_equal(process_logits(logits, SamplingConfig(1.0, top_k=3)), plain)
    np.testing.assert_array_equal(process_logits(logits, SamplingConfig(1.0, top_k=50)), plain)


def test_top_p_smallest_set_reaching_mass():
    # probs 0.5, 0.3, 0.2: top_p 0.75 needs the top two (0.5 < 0.75 <= 0.8).
    logits = np.log(np.array([0.2, 0.5, 0.3]))
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    np.testing.assert_allclose(probs, [0.0, 0.5 / 0.8, 0.3 / 0.8])
    # 0.45 is already covered by the top token alone.
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.45))
    np.testing.assert_array_equal(probs, [0.0, 1.0, 0.0])


def test_top_p_always_keeps_one_token():
    logits = np.array([[1.0, 1.0, 1.0, 1.0], [0.0, 5.0, 1.0, 2.0]])
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=1e-9))
    np.testing.assert_array_equal((probs > 0).sum(axis=-1), [1, 1])
    # Uniform row: ascending stable sort drops lower ids first, so the highest id survives.
    np.testing.assert_array_equal(probs, [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    # 1 - top_p rounds to 1.0, so every cumulative sum qualifies for removal; the top survives.
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=1e-300))
    np.testing.assert_array_equal(probs, [[0.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.0, 0.0]])


def test_top_p_tie_drops_lower_token_id():
    # probs 0.25, 0.25, 0.5 with top_p 0.7: one of the tied 0.25s goes; HF's ascending
    # stable order removes token 0 first.
    logits = np.array([0.0, 0.0, math.log(2.0)])
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(probs, [0.0, 1.0 / 3.0, 2.0 / 3.0])


def test_top_k_then_top_p_order():
    # top-k 2 leaves 0.6/0.4 renormalized; top-p 0.55 then keeps only the first.
    # Applying top-p first (on 0.45/0.3/0.25) would keep two tokens instead.
    logits = np.log(np.array([0.45, 0.3, 0.25]))
    probs = process_logits(logits, SamplingConfig(temperature=1.0, top_k=2, top_p=0.55))
    np.testing.assert_array_equal(probs, [1.0, 0.0, 0.0])


def _large_rows():
    """Rows of a 40,000-token vocabulary, past the size where top-p ranks only a prefix."""
    rng = np.random.default_rng(23)
    vocab = 40_000
    peaked = rng.normal(scale=2.0, size=vocab)
    peaked[rng.choice(vocab, 30, replace=False)] += 14.0  # the cut falls among the few near the top
    tied = peaked.copy()
    top = np.argsort(tied)[-12:]
    tied[top[:6]] = tied[top[5]]  # a run of equal logits around the cut
    flat = rng.normal(scale=0.02, size=vocab)  # thousands within the margin: the most likely 2048 are ranked
    flatter = np.zeros(vocab)  # no prefix reaches the mass: the whole row is sorted
    flatter[::7] = 1e-3
    trimmed = np.full(vocab, -np.inf)  # a trimmed draft head: -inf outside its kept rows
    kept = rng.choice(vocab, 5000, replace=False)
    trimmed[kept] = rng.normal(scale=3.0, size=kept.shape[0])
    wide = rng.normal(scale=4.0, size=vocab)  # many tokens fall below the margin yet carry mass
    grid = rng.normal(scale=1.5, size=vocab).round(1)  # ties everywhere, at the candidates' cap too
    return {"peaked": peaked, "tied": tied, "flat": flat, "flatter": flatter, "trimmed": trimmed, "wide": wide, "grid": grid}


@pytest.mark.parametrize("name", ["peaked", "tied", "flat", "flatter", "trimmed", "wide", "grid"])
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.999999])
def test_large_vocabulary_top_p_matches_the_plain_reference(name, top_p):
    row = _large_rows()[name].astype(np.float32)  # as a model returns it
    config = SamplingConfig(temperature=0.7, top_p=top_p)
    probs = process_logits(row, config)  # [V]
    expected = np.array(reference_process(row, config.temperature, 0, top_p))  # [V]
    np.testing.assert_array_equal(probs > 0.0, expected > 0.0)  # the same tokens survive
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


def test_large_vocabulary_top_p_cut_inside_a_tie_at_the_candidates_cap():
    """2,040 tokens at one logit, 100 tied just below (across the cap of 2,048 candidates), the
    cut after two of the tied ones: the two with the highest ids survive, not two the partial
    ranking happened to take in."""
    row = np.full(40_000, -10.0)
    order = np.random.default_rng(37).permutation(row.size)
    row[order[:2040]] = 5.0
    row[order[2040:2140]] = 4.9
    config = SamplingConfig(temperature=0.7, top_p=0.96)
    probs = process_logits(row, config)
    expected = np.array(reference_process(row, config.temperature, 0, config.top_p))
    tied_kept = np.flatnonzero((probs > 0) & (row == 4.9))
    assert tied_kept.tolist() == sorted(order[2040:2140])[-2:]
    np.testing.assert_allclose(probs, expected, rtol=1e-12, atol=1e-15)


def test_survivors_softmax_equals_masking_the_row_bit_for_bit():
    """_softmax_over computes on the survivors alone what masking the rest to -inf gives."""
    from edge_spec.sampling import _softmax, _softmax_over

    for row in _large_rows().values():
        survivors = np.flatnonzero(row >= np.quantile(row[np.isfinite(row)], 0.999))
        masked = np.full_like(row, -np.inf)
        masked[survivors] = row[survivors]
        np.testing.assert_array_equal(_softmax_over(row, survivors), _softmax(masked))


def test_greedy_is_one_hot_first_argmax():
    logits = np.array([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0]], dtype=np.float32)
    probs = process_logits(logits, SamplingConfig(temperature=0.0, top_k=2, top_p=0.1))
    assert probs.dtype == np.float64
    np.testing.assert_array_equal(probs, [[0, 1, 0, 0], [1, 0, 0, 0]])
    assert SamplingConfig().greedy and not SamplingConfig(temperature=0.1).greedy


@pytest.mark.parametrize(
    "config",
    [SamplingConfig(0.0), SamplingConfig(0.9), SamplingConfig(1.0, top_k=4), SamplingConfig(0.8, top_k=5, top_p=0.7)],
    ids=repr,
)
def test_vectorized_over_leading_dims(config):
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 3, 4, 10)).astype(np.float32)  # [2, 3, 4, V]
    logits[0, 1, 2, 3] = logits[0, 1, 2, 5]  # a tie somewhere
    batched = process_logits(logits, config)  # [2, 3, 4, V]
    assert batched.shape == logits.shape
    for index in np.ndindex(logits.shape[:-1]):
        np.testing.assert_array_equal(batched[index], process_logits(logits[index], config))


def test_negative_infinity_logits_get_zero_probability():
    logits = np.array([-np.inf, 0.0, 1.0, -np.inf])
    for config in [SamplingConfig(1.0), SamplingConfig(0.7, top_k=3), SamplingConfig(1.0, top_p=0.9)]:
        probs = process_logits(logits, config)
        assert probs[0] == 0.0 and probs[3] == 0.0
        assert probs.sum() == pytest.approx(1.0)


def test_large_logits_are_stable():
    probs = process_logits(np.array([1000.0, 999.0]), SamplingConfig(1.0))
    np.testing.assert_allclose(probs, [1 / (1 + math.exp(-1)), 1 / (1 + math.exp(1))])


@pytest.mark.parametrize(
    "logits, message",
    [
        (np.array([0.0, np.nan]), "NaN"),
        (np.array([0.0, np.inf]), r"\+inf"),
        (np.array([-np.inf, -np.inf]), "finite"),
        (np.zeros((2, 0)), "V >= 1"),
        (np.float64(1.0), "V >= 1"),
    ],
)
def test_bad_logits_raise(logits, message):
    with pytest.raises(ValueError, match=message):
        process_logits(logits, SamplingConfig(1.0))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 1.5}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": -1}, "seed"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_config_raises(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_config_is_frozen():
    config = SamplingConfig(temperature=0.5, top_k=np.int64(4), seed=3)
    with pytest.raises(AttributeError):
        config.temperature = 1.0  # type: ignore[misc]


# --- sample -------------------------------------------------------------------------


def test_sample_stream_is_one_uniform_per_draw():
    # The Kotlin port relies on this exact definition: u = rng.random(), first index
    # with cdf > u * total.
    probs = np.array([0.1, 0.0, 0.25, 0.05, 0.6, 0.0])
    rng_a, rng_b = np.random.default_rng(11), np.random.default_rng(11)
    draws = [sample(probs, rng_a) for _ in range(3000)]
    uniforms = rng_b.random(3000)
    cumulative = np.cumsum(probs)
    expected = np.searchsorted(cumulative, uniforms * cumulative[-1], side="right")
    np.testing.assert_array_equal(draws, expected)
    assert rng_a.random() == rng_b.random()  # both consumed exactly 3000 uniforms


def test_sample_over_a_sparse_vector_follows_the_stream_definition():
    """Mostly-zero rows (what top-p leaves) draw the index the full running sum defines."""
    rng = np.random.default_rng(29)
    probs = np.zeros(50_000)
    support = rng.choice(probs.size, 700, replace=False)
    probs[support] = rng.random(700) ** 4  # uneven sizes, so the partial sums round differently
    rng_a, rng_b = np.random.default_rng(31), np.random.default_rng(31)
    draws = [sample(probs, rng_a) for _ in range(3000)]
    cumulative = np.cumsum(probs)
    expected = np.searchsorted(cumulative, rng_b.random(3000) * cumulative[-1], side="right")
    np.testing.assert_array_equal(draws, expected)
    assert sample(probs, ScriptedRng([1.0])) == support.max()  # clamped to the last nonzero token


def test_sample_hand_computed_boundaries():
    probs = np.array([0.25, 0.0, 0.5, 0.25])
    assert sample(probs, ScriptedRng([0.0])) == 0
    assert sample(probs, ScriptedRng([0.2499])) == 0
    assert sample(probs, ScriptedRng([0.25])) == 2  # zero-mass token 1 is skipped
    assert sample(probs, ScriptedRng([0.7499])) == 2
    assert sample(probs, ScriptedRng([0.75])) == 3
    # Unnormalized input: the uniform scales by the total.
    assert sample(probs * 4.0, ScriptedRng([0.5])) == 2


def test_sample_clamps_to_last_nonzero_token():
    # u * total landing on total (rounding) must not return trailing zero-mass tokens.
    assert sample(np.array([0.2, 0.8, 0.0, 0.0]), ScriptedRng([1.0])) == 1


def test_sample_distribution():
    probs = np.array([0.05, 0.3, 0.0, 0.15, 0.5])
    rng = np.random.default_rng(5)
    draws = np.array([sample(probs, rng) for _ in range(40_000)])
    empirical = np.bincount(draws, minlength=probs.size) / draws.size
    assert empirical[2] == 0.0
    assert 0.5 * np.abs(empirical - probs).sum() < 0.012


@pytest.mark.parametrize(
    "probs, message",
    [
        (np.array([[0.5, 0.5]]), "1-D"),
        (np.array([]), "1-D"),
        (np.array([0.5, -0.1, 0.6]), "non-negative"),
        (np.array([0.0, 0.0]), "positive"),
        (np.array([0.5, np.nan]), "positive"),
    ],
)
def test_sample_rejects_bad_probs_without_drawing(probs, message):
    rng = ScriptedRng([0.5])
    with pytest.raises(ValueError, match=message):
        sample(probs, rng)
    assert rng.n_used == 0
