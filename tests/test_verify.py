"""Tests for edge_spec.verify: Monte Carlo losslessness plus exact path checks.

The Monte Carlo grid (5 draft scenarios x 4 processings x 2 seeds, 200k draws each)
runs through `batched_verify_stochastic`, a vectorized copy of the verification
rule that reads the same uniforms. Every grid case also replays its first draws
through the real `verify_stochastic` and requires identical results and uniform
counts, and two cases run the real function itself for all 200k draws, so the
statistics are about the shipped code, not only the copy.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from edge_spec.sampling import SamplingConfig, process_logits, sample
from edge_spec.verify import (
    expected_tokens_per_pass,
    speedup_bound,
    verify_deterministic,
    verify_greedy,
    verify_stochastic,
)
from tests.scripted_rng import ScriptedRng

GAMMA = 3
VOCAB = 12
N_DRAWS = 200_000
N_REPLAYED = 1_500  # draws per grid case checked draw-for-draw against the real function
TV_TOLERANCE = 0.01  # at 200k draws over 12 tokens the sampling noise in TV is ~0.003

PROCESSINGS = {
    "plain": SamplingConfig(temperature=1.0),
    "temp0.7": SamplingConfig(temperature=0.7),
    "topk3": SamplingConfig(temperature=1.0, top_k=3),
    "topp0.8": SamplingConfig(temperature=1.0, top_p=0.8),
}
SCENARIOS = ["equal", "close", "reversed", "draft_misses_target_mass", "draft_has_zero_target_mass"]
SEEDS = [0, 1]



# --- Monte Carlo helpers ------------------------------------------------------------


def make_case(scenario: str, config: SamplingConfig, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Target probs [GAMMA+1, V] and draft probs [GAMMA, V], both via the same processing."""
    rng = np.random.default_rng(10_000 + seed)
    target_logits = rng.normal(scale=1.5, size=(GAMMA + 1, VOCAB))  # [GAMMA+1, V]
    noise = rng.normal(size=(GAMMA, VOCAB))  # [GAMMA, V]
    draft_logits = target_logits[:GAMMA].copy()  # [GAMMA, V]
    if scenario == "close":
        draft_logits += 0.1 * noise
    elif scenario == "reversed":
        draft_logits = draft_logits[:, ::-1].copy()
    elif scenario == "draft_misses_target_mass":
        draft_logits += 0.3 * noise
        for row in range(GAMMA):
            favourite = int(np.argmax(target_logits[row]))
            others = rng.choice([t for t in range(VOCAB) if t != favourite], size=2, replace=False)
            draft_logits[row, [favourite, *others]] = -np.inf
    elif scenario == "draft_has_zero_target_mass":
        draft_logits += 0.3 * noise
        for row in range(GAMMA + 1):
            banned = rng.choice(VOCAB, size=3, replace=False)
            target_logits[row, banned] = -np.inf
            if row < GAMMA:
                # Make the draft like two banned tokens so they survive top-k / top-p.
                draft_logits[row, banned[:2]] = draft_logits[row].max() + 0.5
    else:
        assert scenario == "equal"
    target_probs = process_logits(target_logits, config)  # [GAMMA+1, V]
    draft_probs = process_logits(draft_logits, config)  # [GAMMA, V]

    # The scenario must actually hold after processing, or the case tests nothing new.
    if scenario == "equal":
        np.testing.assert_array_equal(draft_probs, target_probs[:GAMMA])
    elif scenario == "reversed":
        np.testing.assert_allclose(draft_probs, target_probs[:GAMMA, ::-1], atol=1e-15)
    elif scenario == "draft_misses_target_mass":
        assert ((draft_probs[0] == 0) & (target_probs[0] > 0)).any()
    elif scenario == "draft_has_zero_target_mass":
        assert ((draft_probs[0] > 0) & (target_probs[0] == 0)).any()
    if scenario != "equal":
        assert not np.array_equal(draft_probs, target_probs[:GAMMA])
    return target_probs, draft_probs


def inverse_cdf(probs: np.ndarray, uniforms: np.ndarray) -> np.ndarray:
    """Row-wise `sample` for probs [n, V] and uniforms [n]: same formula, vectorized."""
    cumulative = np.cumsum(probs, axis=1)  # [n, V]
    threshold = uniforms * cumulative[:, -1]  # [n]
    index = (cumulative <= threshold[:, None]).sum(axis=1)  # [n] == searchsorted(side="right")
    last_nonzero = probs.shape[1] - 1 - np.argmax(probs[:, ::-1] > 0, axis=1)  # [n]
    return np.where(index >= probs.shape[1], last_nonzero, index)


def draw_draft_tokens(draft_probs: np.ndarray, rng: np.random.Generator, n_draws: int) -> np.ndarray:
    """[n_draws, gamma] tokens from q, one uniform each, from the caller's rng stream."""
    gamma = draft_probs.shape[0]
    uniforms = rng.random((n_draws, gamma))  # [n, gamma]
    tokens = np.empty((n_draws, gamma), dtype=np.int64)  # [n, gamma]
    for position in range(gamma):
        rows = np.broadcast_to(draft_probs[position], (n_draws, draft_probs.shape[1]))  # [n, V]
        tokens[:, position] = inverse_cdf(rows, uniforms[:, position])
    return tokens


def batched_verify_stochastic(target_probs, draft_probs, draft_tokens, uniforms, bug=None):
    """Vectorized verify_stochastic; uniforms [n, gamma+1] are read in the same order.

    `bug` switches on known-wrong variants, used to show the statistical checks bite.
    Returns n_accepted [n], next_token [n], uniforms used per draw [n].
    """
    n_draws, gamma = draft_tokens.shape
    positions = np.arange(gamma)
    target_p = target_probs[positions, draft_tokens]  # [n, gamma]
    draft_q = draft_probs[positions, draft_tokens]  # [n, gamma]
    accepted = (target_p >= draft_q) | (uniforms[:, :gamma] * draft_q < target_p)  # [n, gamma]
    if bug == "accept_if_u_below_p":
        accepted = uniforms[:, :gamma] < target_p
    all_accepted = accepted.all(axis=1)  # [n]
    n_accepted = np.where(all_accepted, gamma, np.argmin(accepted, axis=1))  # first rejection

    residual = np.maximum(target_probs[:gamma] - draft_probs, 0.0)  # [gamma, V]
    if bug == "resample_from_target":
        residual = target_probs[:gamma].copy()
    empty = ~(residual.sum(axis=1) > 0.0)
    residual[empty] = target_probs[:gamma][empty]
    final_rows = np.concatenate([residual, target_probs[gamma:]], axis=0)  # [gamma+1, V]

    n_uniforms = np.where(all_accepted, gamma, n_accepted + 1) + 1  # [n]
    final_uniform = uniforms[np.arange(n_draws), n_uniforms - 1]  # [n]
    next_token = inverse_cdf(final_rows[n_accepted], final_uniform)  # [n]
    return n_accepted, next_token, n_uniforms


def emitted_tokens(draft_tokens, n_accepted, next_token):
    """[n, gamma+1] tokens emitted per draw; -1 after the correction/bonus token."""
    n_draws, gamma = draft_tokens.shape
    positions = np.arange(gamma + 1)[None, :]  # [1, gamma+1]
    padded = np.concatenate([draft_tokens, np.full((n_draws, 1), -1)], axis=1)  # [n, gamma+1]
    emitted = np.where(positions < n_accepted[:, None], padded, -1)
    return np.where(positions == n_accepted[:, None], next_token[:, None], emitted)


def total_variation(tokens, probs):
    empirical = np.bincount(tokens, minlength=probs.size) / tokens.size
    return 0.5 * np.abs(empirical - probs).sum()


def distribution_errors(target_probs, draft_probs, draft_tokens, n_accepted, next_token):
    """Deviations from losslessness; empty when every check passes."""
    errors = []
    emitted = emitted_tokens(draft_tokens, n_accepted, next_token)  # [n, gamma+1]
    # First emitted token (accepted draft token or correction) must follow p_0.
    tv_first = total_variation(emitted[:, 0], target_probs[0])
    if not tv_first < TV_TOLERANCE:
        errors.append(f"position 0: TV {tv_first:.4f}")
    # Later positions, given the draft reached them, must follow p_k (noise grows as 1/sqrt(n)).
    for position in range(1, draft_tokens.shape[1] + 1):
        reached = n_accepted >= position
        n_reached = int(reached.sum())
        if n_reached < 20_000:
            continue
        tolerance = TV_TOLERANCE * math.sqrt(N_DRAWS / n_reached)
        tv = total_variation(emitted[reached, position], target_probs[position])
        if not tv < tolerance:
            errors.append(f"position {position}: TV {tv:.4f} >= {tolerance:.4f} (n={n_reached})")
    # Acceptance rate at each position must be sum(min(p, q)) (Leviathan et al. 2023).
    for position in range(draft_tokens.shape[1]):
        reached = n_accepted >= position
        n_reached = int(reached.sum())
        if n_reached < 1_000:
            continue
        alpha = float(np.minimum(target_probs[position], draft_probs[position]).sum())
        observed = float((n_accepted[reached] > position).mean())
        tolerance = 5.0 * math.sqrt(max(alpha * (1.0 - alpha), 0.0) / n_reached) + 1e-12
        if not abs(observed - alpha) < tolerance:
            errors.append(f"position {position}: acceptance {observed:.4f} vs alpha {alpha:.4f}")
    return errors


# --- Monte Carlo tests --------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("processing", list(PROCESSINGS))
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_monte_carlo_output_follows_target(scenario, processing, seed):
    target_probs, draft_probs = make_case(scenario, PROCESSINGS[processing], seed)
    rng = np.random.default_rng(seed)
    draft_tokens = draw_draft_tokens(draft_probs, rng, N_DRAWS)  # [n, GAMMA]
    uniforms = rng.random((N_DRAWS, GAMMA + 1))  # [n, GAMMA+1], same stream
    n_accepted, next_token, n_uniforms = batched_verify_stochastic(
        target_probs, draft_probs, draft_tokens, uniforms
    )

    # Tie the vectorized copy to the real function, draw for draw.
    for draw in range(N_REPLAYED):
        scripted = ScriptedRng(uniforms[draw])
        result = verify_stochastic(target_probs, draft_probs, draft_tokens[draw], scripted)
        assert result == (n_accepted[draw], next_token[draw]), f"draw {draw}"
        assert scripted.n_used == n_uniforms[draw], f"draw {draw}"

    assert distribution_errors(target_probs, draft_probs, draft_tokens, n_accepted, next_token) == []


@pytest.mark.parametrize(
    "scenario, processing, seed",
    [("reversed", "plain", 0), ("draft_has_zero_target_mass", "topp0.8", 1)],
)
def test_monte_carlo_real_function_end_to_end(scenario, processing, seed):
    # No vectorized copy here: 200k calls of the shipped function on one rng stream.
    target_probs, draft_probs = make_case(scenario, PROCESSINGS[processing], seed)
    rng = np.random.default_rng(100 + seed)
    draft_tokens = draw_draft_tokens(draft_probs, rng, N_DRAWS)  # [n, GAMMA]
    n_accepted = np.empty(N_DRAWS, dtype=np.int64)
    next_token = np.empty(N_DRAWS, dtype=np.int64)
    for draw in range(N_DRAWS):
        n_accepted[draw], next_token[draw] = verify_stochastic(
            target_probs, draft_probs, draft_tokens[draw], rng
        )
    assert distribution_errors(target_probs, draft_probs, draft_tokens, n_accepted, next_token) == []


@pytest.mark.parametrize("bug", ["accept_if_u_below_p", "resample_from_target"])
@pytest.mark.parametrize("scenario", ["reversed", "draft_misses_target_mass"])
def test_monte_carlo_checks_catch_broken_rules(bug, scenario):
    # The statistical checks must reject plausible-looking wrong verifiers.
    target_probs, draft_probs = make_case(scenario, PROCESSINGS["plain"], 0)
    rng = np.random.default_rng(0)
    draft_tokens = draw_draft_tokens(draft_probs, rng, N_DRAWS)
    uniforms = rng.random((N_DRAWS, GAMMA + 1))
    n_accepted, next_token, _ = batched_verify_stochastic(
        target_probs, draft_probs, draft_tokens, uniforms, bug=bug
    )
    errors = distribution_errors(target_probs, draft_probs, draft_tokens, n_accepted, next_token)
    assert any(error.startswith("position 0: TV") for error in errors), errors


def test_draft_token_helper_matches_sample_stream():
    # draw_draft_tokens must be `sample` on the same stream, position by position.
    _, draft_probs = make_case("draft_misses_target_mass", PROCESSINGS["topk3"], 0)
    rng_batched, rng_loop = np.random.default_rng(4), np.random.default_rng(4)
    batched = draw_draft_tokens(draft_probs, rng_batched, 500)
    looped = [[sample(draft_probs[i], rng_loop) for i in range(GAMMA)] for _ in range(500)]
    np.testing.assert_array_equal(batched, looped)
    assert rng_batched.random() == rng_loop.random()


# --- verify_stochastic paths --------------------------------------------------------

P_ROWS = np.array(
    [
        [0.1, 0.2, 0.3, 0.4],
        [0.4, 0.3, 0.2, 0.1],
        [0.25, 0.25, 0.25, 0.25],
        [0.0, 0.0, 0.5, 0.5],
    ]
)  # [4, V]
Q_ROWS = np.array(
    [
        [0.4, 0.3, 0.2, 0.1],
        [0.1, 0.2, 0.3, 0.4],
        [0.7, 0.1, 0.1, 0.1],
    ]
)  # [3, V]


def test_rejection_at_first_position():
    # p0(0)/q0(0) = 0.25: u = 0.3 rejects; residual [0, 0, 0.1, 0.3] -> 0.2 picks token 2.
    rng = ScriptedRng([0.3, 0.2])
    assert verify_stochastic(P_ROWS[:3], Q_ROWS[:2], [0, 1], rng) == (0, 2)
    assert rng.n_used == 2
    rng = ScriptedRng([0.3, 0.3])  # 0.3 of residual mass 0.4 lies past 0.1 -> token 3
    assert verify_stochastic(P_ROWS[:3], Q_ROWS[:2], [0, 1], rng) == (0, 3)


def test_acceptance_boundary_is_strict():
    # Accept iff u < p/q = 0.25 exactly.
    assert verify_stochastic(P_ROWS[:2], Q_ROWS[:1], [0], ScriptedRng([0.2499, 0.0]))[0] == 1
    assert verify_stochastic(P_ROWS[:2], Q_ROWS[:1], [0], ScriptedRng([0.25, 0.0]))[0] == 0
    # Ratio >= 1 accepts whatever the uniform (even an out-of-range 1.0 that would make u * q == p).
    equal_rows = np.array([[0.3, 0.7], [0.5, 0.5]])
    assert verify_stochastic(equal_rows, equal_rows[:1], [1], ScriptedRng([1.0, 0.0])) == (1, 0)


def test_rejection_at_last_position():
    # Positions 0 and 1 have p >= q (always accepted, but each still uses a uniform);
    # position 2: p/q = 0.25/0.7, u = 0.9 rejects; residual [0, 0.15, 0.15, 0.15].
    rng = ScriptedRng([0.99, 0.99, 0.9, 0.5])
    assert verify_stochastic(P_ROWS, Q_ROWS, [3, 0, 0], rng) == (2, 2)
    assert rng.n_used == 4


def test_all_accepted_draws_bonus_from_last_target_row():
    # Bonus row [0, 0, 0.5, 0.5] differs from every residual and q, so its support shows.
    target = P_ROWS[[0, 1, 3]]  # [3, V]
    rng = ScriptedRng([0.5, 0.5, 0.1])  # p >= q at both positions, so u is irrelevant there
    assert verify_stochastic(target, Q_ROWS[:2], [3, 0], rng) == (2, 2)
    assert rng.n_used == 3
    assert verify_stochastic(target, Q_ROWS[:2], [3, 0], ScriptedRng([0.5, 0.5, 0.6])) == (2, 3)


def test_gamma_one():
    accept = ScriptedRng([0.1, 0.99])  # 0.1 < 0.25 accepts; bonus from row 1 -> token 3
    assert verify_stochastic(P_ROWS[:2], Q_ROWS[:1], [0], accept) == (1, 3)
    reject = ScriptedRng([0.9, 0.99])  # correction from residual [0, 0, 0.1, 0.3]
    assert verify_stochastic(P_ROWS[:2], Q_ROWS[:1], [0], reject) == (0, 3)


def test_gamma_zero_samples_from_target():
    rng = ScriptedRng([0.65])
    assert verify_stochastic(P_ROWS[:1], np.zeros((0, 4)), np.array([], dtype=np.int64), rng) == (0, 3)
    assert rng.n_used == 1


def test_empty_residual_falls_back_to_target():
    # p < q everywhere (p is deficient), so max(0, p - q) is all zero at a rejection.
    target = np.array([[0.25, 0.25], [0.5, 0.5]])
    draft = np.array([[0.5, 0.5]])
    assert verify_stochastic(target, draft, [0], ScriptedRng([0.9, 0.6])) == (0, 1)


def test_zero_draft_probability_raises_without_drawing():
    rng = ScriptedRng([0.5, 0.5])
    draft = np.array([[0.0, 1.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="q = 0"):
        verify_stochastic(P_ROWS[:2], draft, [0], rng)
    assert rng.n_used == 0
    # Also when the bad token sits behind a position that would be rejected.
    with pytest.raises(ValueError, match="position 1 has q = 0"):
        verify_stochastic(P_ROWS[:3], np.vstack([Q_ROWS[0], draft]), [0, 0], rng)
    assert rng.n_used == 0


@pytest.mark.parametrize(
    "target, draft, tokens, message",
    [
        (P_ROWS[:2], Q_ROWS[:2], [0, 1], "gamma"),
        (P_ROWS[:3, :3], Q_ROWS[:2], [0, 1], "vocab"),
        (P_ROWS[:3], Q_ROWS[:2], [0, 4], "outside vocabulary"),
        (P_ROWS[:3], Q_ROWS[:2], [0.0, 1.0], "integers"),
        (P_ROWS[:3], Q_ROWS[:2], [[0, 1]], "1-D"),
        (P_ROWS[:3], Q_ROWS[0], [0], "draft_probs"),
    ],
)
def test_verify_stochastic_validates_shapes(target, draft, tokens, message):
    with pytest.raises(ValueError, match=message):
        verify_stochastic(target, draft, tokens, ScriptedRng([0.5] * 5))


# --- verify_deterministic -----------------------------------------------------------


def test_deterministic_equals_stochastic_with_one_hot_draft():
    case_rng = np.random.default_rng(21)
    configs = [SamplingConfig(1.0), SamplingConfig(0.6, top_k=3), SamplingConfig(1.0, top_p=0.7)]
    n_rejected = n_all_accepted = 0
    for trial in range(3_000):
        gamma = int(case_rng.integers(0, 5))
        vocab_size = 8
        config = configs[trial % len(configs)]
        target_logits = case_rng.normal(scale=2.0, size=(gamma + 1, vocab_size))
        if trial % 7 == 0:
            target_logits[:, 2] = 50.0  # p(2) == 1 numerically
        target_probs = process_logits(target_logits, config)  # [gamma+1, V]
        # Prompt-lookup style proposals: mostly likely tokens, sometimes p(x) = 0 ones.
        likely = np.argmax(target_probs[:gamma], axis=1) if gamma else np.zeros(0, np.int64)
        random_tokens = case_rng.integers(0, vocab_size, size=gamma)
        draft_tokens = np.where(case_rng.random(gamma) < 0.6, likely, random_tokens)  # [gamma]
        one_hot_draft = np.eye(vocab_size)[draft_tokens].reshape(gamma, vocab_size)  # [gamma, V]

        rng_det, rng_sto = np.random.default_rng(trial), np.random.default_rng(trial)
        result = verify_deterministic(target_probs, draft_tokens, rng_det)
        assert result == verify_stochastic(target_probs, one_hot_draft, draft_tokens, rng_sto)
        assert rng_det.random() == rng_sto.random()  # same number of uniforms consumed
        n_rejected += result[0] < gamma
        n_all_accepted += result[0] == gamma
    assert n_rejected > 300 and n_all_accepted > 300  # both paths were exercised


def test_deterministic_rejection_samples_target_without_the_draft_token():
    # p0(1) = 0.2: u = 0.5 rejects; p0 with token 1 removed is [0.1, 0, 0.3, 0.4] (mass 0.8).
    rng = ScriptedRng([0.5, 0.2])  # 0.2 * 0.8 = 0.16 lands in token 2's slice [0.1, 0.4)
    assert verify_deterministic(P_ROWS[:2], [1], rng) == (0, 2)
    assert rng.n_used == 2
    assert verify_deterministic(P_ROWS[:2], [1], ScriptedRng([0.19, 0.0])) == (1, 0)
    assert verify_deterministic(P_ROWS[:2], [1], ScriptedRng([0.2, 0.0]))[0] == 0  # u < p strictly


def test_deterministic_validates():
    with pytest.raises(ValueError, match="gamma"):
        verify_deterministic(P_ROWS[:2], [0, 1], ScriptedRng([0.5] * 3))
    with pytest.raises(ValueError, match="outside vocabulary"):
        verify_deterministic(P_ROWS[:2], [9], ScriptedRng([0.5] * 3))


# --- verify_greedy ------------------------------------------------------------------

GREEDY_LOGITS = np.array(
    [
        [0.0, 1.0, 3.0, 2.0],  # argmax 2
        [4.0, 1.0, 3.0, 2.0],  # argmax 0
        [0.0, 1.0, 2.0, 3.0],  # argmax 3
        [0.0, 5.0, 2.0, 5.0],  # argmax 1 (tie with 3, first index wins)
    ]
)  # [4, V]


@pytest.mark.parametrize(
    "draft_tokens, expected",
    [
        ([2, 0, 3], (3, 1)),  # all accepted, bonus = argmax of last row
        ([1, 0, 3], (0, 2)),  # mismatch at first position
        ([2, 0, 0], (2, 3)),  # mismatch at last position
        ([2, 1, 3], (1, 0)),
    ],
)
def test_greedy_paths(draft_tokens, expected):
    assert verify_greedy(GREEDY_LOGITS, draft_tokens) == expected
    # Softmax is monotone, so probabilities give the same answer.
    probs = process_logits(GREEDY_LOGITS, SamplingConfig(temperature=1.0))
    assert verify_greedy(probs, draft_tokens) == expected


def test_greedy_tie_rejects_later_index():
    logits = np.array([[5.0, 5.0, 1.0], [0.0, 0.0, 1.0]])
    assert verify_greedy(logits, [1]) == (0, 0)
    assert verify_greedy(logits, [0]) == (1, 2)


def test_greedy_gamma_zero_and_validation():
    assert verify_greedy(GREEDY_LOGITS[:1], []) == (0, 2)
    with pytest.raises(ValueError, match="gamma"):
        verify_greedy(GREEDY_LOGITS, [2, 0])


def test_greedy_matches_stochastic_on_greedy_processing():
    # With temperature 0 both sides are one-hot, so stochastic verification must agree.
    rng = np.random.default_rng(8)
    config = SamplingConfig(temperature=0.0)
    for _ in range(300):
        target_logits = rng.normal(size=(GAMMA + 1, 6))
        draft_logits = target_logits[:GAMMA] + rng.normal(scale=0.8, size=(GAMMA, 6))
        draft_tokens = np.argmax(draft_logits, axis=1)
        expected = verify_greedy(target_logits, draft_tokens)
        stochastic = verify_stochastic(
            process_logits(target_logits, config), process_logits(draft_logits, config), draft_tokens, rng
        )
        assert stochastic == expected


# --- speedup formulas ---------------------------------------------------------------


def test_expected_tokens_per_pass():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens_per_pass(0.8, 4) == pytest.approx(3.3616)
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert expected_tokens_per_pass(1.0 - 1e-9, 4) == pytest.approx(5.0, rel=1e-6)
    assert expected_tokens_per_pass(0.7, 0) == 1.0
    # Matches the direct sum 1 + alpha + ... + alpha^gamma.
    assert expected_tokens_per_pass(0.3, 6) == pytest.approx(sum(0.3**k for k in range(7)))


def test_speedup_bound():
    assert speedup_bound(0.8, 4, 0.05) == pytest.approx(3.3616 / 1.2)
    assert speedup_bound(1.0, 3, 0.0) == 4.0
    assert speedup_bound(0.0, 5, 0.1) == pytest.approx(1.0 / 1.5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: expected_tokens_per_pass(-0.1, 2),
        lambda: expected_tokens_per_pass(1.1, 2),
        lambda: expected_tokens_per_pass(0.5, -1),
        lambda: expected_tokens_per_pass(0.5, 1.5),
        lambda: speedup_bound(0.5, 2, -0.1),
    ],
)
def test_speedup_formulas_validate(call):
    with pytest.raises(ValueError):
        call()
