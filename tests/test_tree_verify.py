"""Tree verification (edge_spec/verify.py, issue 52): greedy keeps the deepest path of argmaxes;
recursive rejection sampling over siblings keeps the target's law, for siblings drawn
independently, without replacement, or copied from a trie (q one-hot). The law tests decode two
tokens through rounds of small trees on a toy law and test them with the audit's goodness of
fit (runtime/audit.py): the right verifier passes; one that tests every sibling against the
untouched p (siblings as independent chains) fails."""

from __future__ import annotations

import numpy as np
import pytest

from edge_spec.sampling import sample
from edge_spec.verify import verify_tree_greedy, verify_tree_stochastic
from runtime import audit

V = 5  # a small vocabulary: the two-token joint has 25 cells
SAMPLES = 10000


def _law(context: tuple, seed: int, scale: float) -> np.ndarray:
    logits = np.random.default_rng([seed, len(context), *context]).standard_normal(V) * scale
    e = np.exp(logits - logits.max())
    return e / e.sum()


def target(context):
    return _law(context, 1, 1.5)


def draft(context):
    return _law(context, 2, 1.0)  # another law: many rejections, and siblings matter


def _tree(context: tuple, mode: str, rng: np.random.Generator, width: int = 2, depth: int = 2):
    """Rows: the root (context's pending token), then `width` children per node down to `depth`,
    each drawn from the draft law after its path (mode: iid, without replacement, or the
    `width` most likely tokens copied as from a trie, q one-hot)."""
    tokens, parents, qs, contexts = [0], [-1], [np.zeros(V)], [context]
    frontier = [0]
    for _ in range(depth):
        grown = []
        for node in frontier:
            q = draft(contexts[node])
            left = q.copy()
            picks = np.argsort(-q)[:width] if mode == "trie" else None
            for i in range(width):
                if mode == "iid":
                    drawn, q_child = sample(q, rng), q
                elif mode == "without":
                    q_child = left / left.sum()
                    drawn = sample(q_child, rng)
                    left = left.copy()
                    left[drawn] = 0.0
                else:
                    drawn, q_child = int(picks[i]), np.eye(1, V, int(picks[i]))[0]
                tokens.append(int(drawn))
                parents.append(node)
                qs.append(q_child)
                contexts.append(contexts[node] + (int(drawn),))
                grown.append(len(tokens) - 1)
        frontier = grown
    return tokens, parents, (None if mode == "trie" else np.array(qs)), contexts


def independent_siblings(target_probs, draft_probs, tokens, parents, rng):
    """Wrong on purpose: every sibling tested against p itself, as if each were its own chain."""
    kids = [[c for c in range(len(tokens)) if parents[c] == n] for n in range(len(tokens))]
    path, node = [], 0
    while True:
        p = target_probs[node]
        for child in kids[node]:
            x = tokens[child]
            q = draft_probs[child] if draft_probs is not None else np.eye(1, V, x)[0]
            if rng.random() * q[x] < p[x]:
                path.append(child)
                break
        else:
            q = draft_probs[kids[node][-1]] if kids[node] and draft_probs is not None else np.zeros(V)
            residual = np.maximum(p - q, 0.0) if kids[node] else p
            return path, sample(residual / residual.sum(), rng)
        node = path[-1]


def decode_two(verifier, mode: str, seed: int) -> tuple[np.ndarray, int]:
    """SAMPLES runs of two tokens, each run rounds of trees until two are emitted; and how many
    rounds kept a sibling other than the first (the siblings were exercised)."""
    draft_rng, verify_rng = np.random.default_rng(seed), np.random.default_rng(seed + 1)
    out, later_siblings = np.zeros((SAMPLES, 2), dtype=np.int64), 0
    for n in range(SAMPLES):
        context, emitted = (), []
        while len(emitted) < 2:
            tokens, parents, qs, contexts = _tree(context, mode, draft_rng)
            path, token = verifier(np.array([target(c) for c in contexts]), qs, tokens, parents, verify_rng)
            later_siblings += bool(path) and path[0] != 1  # the root's second child kept
            new = [tokens[r] for r in path] + [token]
            context += tuple(new)
            emitted += new
        out[n] = emitted[:2]
    return out, later_siblings


def _report(samples: np.ndarray):
    law = {(): audit.Row.of(target(()), range(V))}
    law.update({(a,): audit.Row.of(target((a,)), range(V)) for a in range(V)})
    return audit.goodness_of_fit(samples, law, audit.AuditConfig(SAMPLES, 2, 0.01, seed=3))


@pytest.mark.law
@pytest.mark.parametrize("mode", ["iid", "without", "trie"])
def test_recursive_rejection_sampling_over_siblings_keeps_the_target_law(mode):
    samples, later = decode_two(verify_tree_stochastic, mode, seed=11)
    reports, detectable = _report(samples)
    assert later > SAMPLES // 20  # second siblings were accepted often: the sibling rule was exercised
    assert detectable is not None and detectable <= 0.02, detectable  # the test sees a TV of 0.02
    assert all(r.p_value > 0.01 / 2 for r in reports), [(r.position, r.p_value, r.tv) for r in reports]


@pytest.mark.law
@pytest.mark.parametrize("mode", ["iid", "trie"])
def test_a_verifier_that_treats_siblings_as_independent_fails(mode):
    samples, _ = decode_two(independent_siblings, mode, seed=11)
    reports, _ = _report(samples)
    assert min(r.p_value for r in reports) <= 0.01 / 2, [(r.position, r.p_value, r.tv) for r in reports]


def test_greedy_tree_keeps_the_deepest_path_of_argmaxes():
    # Root 0 -> rows 1 (token 3), 2 (token 4); row 2 -> rows 3 (token 1), 4 (token 2); row 1 -> row 5 (token 0).
    tokens, parents = [9, 3, 4, 1, 2, 0], [-1, 0, 0, 2, 2, 1]
    logits = np.full((6, V + 5), -1.0)
    for row, best in {0: 4, 1: 0, 2: 2, 3: 1, 4: 7, 5: 3}.items():
        logits[row, best] = 5.0
    assert verify_tree_greedy(logits, tokens, parents) == ([2, 4], 7)  # 4 (second sibling), then 2, then the bonus 7
    logits[0, 4], logits[0, 6] = -1.0, 5.0
    assert verify_tree_greedy(logits, tokens, parents) == ([], 6)
    with pytest.raises(ValueError, match="must be an earlier row"):
        verify_tree_greedy(logits, tokens, [-1, 0, 3, 2, 2, 1])
    with pytest.raises(ValueError, match="cannot have been drawn"):
        verify_tree_stochastic(np.full((2, 3), 1 / 3), np.array([[0, 0, 1.0], [1.0, 0, 0]]), [0, 2], [-1, 0], np.random.default_rng(0))
