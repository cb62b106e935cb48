"""Verification step of speculative decoding (pure functions).

Notation follows Leviathan et al. 2023 ("Fast Inference from Transformers via
Speculative Decoding"): p = target distribution, q = draft distribution, gamma =
number of drafted tokens. Chen et al. 2023 ("Accelerating Large Language Model
Decoding with Speculative Sampling") prove the same rejection scheme is lossless:
every emitted token is distributed exactly as p.

Random stream (a Kotlin port replicates it): each examined draft position consumes
one uniform from `rng.random()` for the accept test, then the correction or bonus
token consumes one more through `sample`. Nothing else touches the rng.
"""

from __future__ import annotations

import numpy as np

from edge_spec.sampling import sample


def _check_target(target_probs: np.ndarray, gamma: int) -> np.ndarray:
    target_probs = np.asarray(target_probs, dtype=np.float64)  # [gamma+1, V]
    if target_probs.ndim != 2 or target_probs.shape[0] != gamma + 1 or target_probs.shape[1] == 0:
        raise ValueError(
            f"target rows must have shape [gamma+1={gamma + 1}, V], got {target_probs.shape}"
        )
    return target_probs


def _check_draft_tokens(draft_tokens: np.ndarray, vocab_size: int | None = None) -> list[int]:
    draft_tokens = np.asarray(draft_tokens)  # [gamma]
    if draft_tokens.ndim != 1:
        raise ValueError(f"draft_tokens must be 1-D [gamma], got shape {draft_tokens.shape}")
    if draft_tokens.size and draft_tokens.dtype.kind not in "iu":
        raise ValueError(f"draft_tokens must be integers, got dtype {draft_tokens.dtype}")
    tokens = draft_tokens.tolist()  # Python ints: scalar indexing below stays cheap
    if vocab_size is not None:
        for token in tokens:
            if not 0 <= token < vocab_size:
                raise ValueError(f"draft token {token} outside vocabulary [0, {vocab_size})")
    return tokens


def verify_stochastic(
    target_probs: np.ndarray,
    draft_probs: np.ndarray,
    draft_tokens: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Speculative sampling: accept a prefix of the draft, then emit one more token.

    target_probs [gamma+1, V]: p at each position; row i is the target distribution
        after accepting i drafted tokens (row gamma is used for the bonus token).
    draft_probs [gamma, V]: q at each drafted position (same processing as p).
    draft_tokens [gamma]: tokens sampled from q.

    Token i is accepted with probability min(1, p_i(x)/q_i(x)). At the first
    rejection the correction is drawn from norm(max(0, p_i - q_i)); if every token
    is accepted a bonus token is drawn from p_gamma. Each emitted token is then
    distributed exactly as p (Leviathan et al. 2023; Chen et al. 2023).

    Returns (n_accepted, next_token): next_token is the correction when
    n_accepted < gamma, the bonus token when n_accepted == gamma.
    Raises ValueError on bad shapes or a draft token with q(x) = 0, which sampling
    from q could never have produced.
    """
    draft_probs = np.asarray(draft_probs, dtype=np.float64)  # [gamma, V]
    if draft_probs.ndim != 2:
        raise ValueError(f"draft_probs must have shape [gamma, V], got {draft_probs.shape}")
    gamma, vocab_size = draft_probs.shape
    target_probs = _check_target(target_probs, gamma)  # [gamma+1, V]
    if target_probs.shape[1] != vocab_size:
        raise ValueError(
            f"vocab mismatch: target has {target_probs.shape[1]}, draft has {vocab_size}"
        )
    tokens = _check_draft_tokens(draft_tokens, vocab_size)
    if len(tokens) != gamma:
        raise ValueError(f"expected {gamma} draft tokens, got {len(tokens)}")

    # Check every position before drawing, so a bad call leaves the rng stream untouched.
    drafted_q = draft_probs[np.arange(gamma), tokens].tolist()  # [gamma]
    for position, (token, draft_q) in enumerate(zip(tokens, drafted_q)):
        if not draft_q > 0.0:
            raise ValueError(
                f"draft token {token} at position {position} has q = {draft_q}; "
                "it cannot have been sampled from the draft distribution"
            )

    for position, (token, draft_q) in enumerate(zip(tokens, drafted_q)):
        target_p = float(target_probs[position, token])
        u = rng.random()
        # u < min(1, p/q) without dividing; `p >= q` guards u*q rounding up to q when p == q.
        if target_p >= draft_q or u * draft_q < target_p:
            continue
        residual = np.maximum(target_probs[position] - draft_probs[position], 0.0)  # [V]
        if not residual.sum() > 0.0:
            # p == q up to rounding: the residual is empty, and p is the right fallback.
            residual = target_probs[position]  # [V]
        return position, sample(residual, rng)
    return gamma, sample(target_probs[gamma], rng)


def verify_deterministic(
    target_probs: np.ndarray,
    draft_tokens: np.ndarray,
    rng: np.random.Generator,
) -> tuple[int, int]:
    """Verify tokens proposed without a distribution (e.g. prompt lookup).

    Mathematically verify_stochastic with q_i = one-hot(draft_tokens[i]): accept
    with probability p_i(x); at rejection sample from p_i with x removed and
    renormalized. Consumes the same uniforms and returns the same result as
    verify_stochastic given explicit one-hot q, without building [gamma, V]
    one-hot matrices. Emitted tokens are distributed as p (Leviathan et al. 2023;
    Chen et al. 2023).

    target_probs [gamma+1, V], draft_tokens [gamma]. Returns (n_accepted, next_token).
    """
    tokens = _check_draft_tokens(draft_tokens)
    gamma = len(tokens)
    target_probs = _check_target(target_probs, gamma)  # [gamma+1, V]
    vocab_size = target_probs.shape[1]
    for token in tokens:
        if not 0 <= token < vocab_size:
            raise ValueError(f"draft token {token} outside vocabulary [0, {vocab_size})")

    for position, token in enumerate(tokens):
        target_p = float(target_probs[position, token])
        u = rng.random()
        # verify_stochastic's test with q(x) = 1 (u * 1.0 == u exactly).
        if target_p >= 1.0 or u < target_p:
            continue
        # Equals max(0, p - one_hot(x)) bit for bit, since rejection implies p(x) < 1.
        residual = np.maximum(target_probs[position], 0.0)  # [V]
        residual[token] = 0.0
        if not residual.sum() > 0.0:
            residual = target_probs[position]  # [V]
        return position, sample(residual, rng)
    return gamma, sample(target_probs[gamma], rng)


def verify_greedy(target_logits_or_probs: np.ndarray, draft_tokens: np.ndarray) -> tuple[int, int]:
    """Greedy verification: accept while the draft matches the target argmax.

    target_logits_or_probs [gamma+1, V] (argmax is the same for logits and their
    softmax; logits avoid ties created by underflow). draft_tokens [gamma].
    Returns (n_accepted, argmax of row n_accepted); ties resolve to the first index
    as np.argmax. Equals the target's own greedy output, so it is lossless. No RNG.
    """
    tokens = _check_draft_tokens(draft_tokens)
    gamma = len(tokens)
    target = _check_target(target_logits_or_probs, gamma)  # [gamma+1, V]
    target_argmax = np.argmax(target, axis=-1)  # [gamma+1]
    n_accepted = 0
    while n_accepted < gamma and tokens[n_accepted] == int(target_argmax[n_accepted]):
        n_accepted += 1
    return n_accepted, int(target_argmax[n_accepted])


def expected_tokens_per_pass(alpha: float, gamma: int) -> float:
    """Expected tokens emitted per target pass, (1 - alpha^(gamma+1)) / (1 - alpha).

    alpha is the per-token acceptance rate (Leviathan et al. 2023, Sec. 3); the
    limit at alpha == 1 is gamma + 1 (every draft accepted plus the bonus token).
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if gamma < 0 or int(gamma) != gamma:
        raise ValueError(f"gamma must be a non-negative int, got {gamma!r}")
    if alpha == 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def speedup_bound(alpha: float, gamma: int, cost_ratio: float) -> float:
    """Walltime speedup bound expected / (1 + gamma * c), c = draft/target cost per token.

    Leviathan et al. 2023, Sec. 3; ignores verification overhead beyond one target pass.
    """
    if not cost_ratio >= 0.0:
        raise ValueError(f"cost_ratio must be >= 0, got {cost_ratio!r}")
    return expected_tokens_per_pass(alpha, gamma) / (1.0 + gamma * cost_ratio)


# -- trees: several candidates per position, verified in one target pass -------------------------
#
# A tree block (runtime/passes.py Block) is rows 0..T-1, row 0 the pending token (the root, already
# committed), each other row a drafted token whose parent is an earlier row. Row i's target row
# predicts what follows row i. Siblings are examined in block order.


def _children(parents: list[int]) -> list[list[int]]:
    kids: list[list[int]] = [[] for _ in parents]
    for row, parent in enumerate(parents):
        if row and not 0 <= parent < row:
            raise ValueError(f"row {row}'s parent {parent} must be an earlier row (row 0 is the root)")
        if row:
            kids[parent].append(row)
    return kids


def _check_tree(target: np.ndarray, tokens, parents) -> tuple[np.ndarray, list[int], list[list[int]]]:
    target = np.asarray(target, dtype=np.float64)  # [T,V]
    tokens, parents = _check_draft_tokens(tokens, target.shape[1] if target.ndim == 2 else None), [int(p) for p in parents]
    if target.ndim != 2 or target.shape[0] != len(tokens) or len(parents) != len(tokens) or not tokens or parents[0] != -1:
        raise ValueError(f"a tree takes target rows [T, V], T tokens and T parents, row 0's parent -1; got {target.shape}, "
                         f"{len(tokens)} tokens, parents {parents[:8]}")
    return target, tokens, _children(parents)


def verify_tree_greedy(target_logits_or_probs: np.ndarray, tokens, parents) -> tuple[list[int], int]:
    """The deepest path whose every token is the target's argmax after its ancestors: from the
    root, the first child holding its parent's argmax, and so on. target [T, V], tokens [T],
    parents [T]. Returns (the accepted rows after the root, in order; the argmax after the last).
    Equals greedy decoding's own tokens, so it is lossless. No RNG."""
    target, tokens, kids = _check_tree(target_logits_or_probs, tokens, parents)
    argmax = np.argmax(target, axis=-1)  # [T]
    path, node = [], 0
    while True:
        match = next((c for c in kids[node] if tokens[c] == int(argmax[node])), None)
        if match is None:
            return path, int(argmax[node])
        path.append(match)
        node = match


def verify_tree_stochastic(target_probs: np.ndarray, draft_probs: np.ndarray | None, tokens, parents,
                           rng: np.random.Generator) -> tuple[list[int], int]:
    """Recursive rejection sampling over a tree (SpecInfer's multi-step speculative sampling,
    Miao et al. 2024; Jeon et al. 2024 without replacement): at a node, its children are tested
    in order, child c accepted with min(1, p(x)/q_c(x)); after each rejection p becomes
    norm(max(0, p - q_c)), the next sibling is tested against that residual, and when every
    child is rejected the token is drawn from the last residual. An accepted child's own
    children are tested against its target row; a node without children draws the bonus from
    its row. Every emitted token is then distributed exactly as p.

    target_probs [T, V]: p after each row. draft_probs [T, V] or None: row c is the
    distribution child c was drawn from given its earlier siblings (the same q for siblings
    drawn independently; q without the earlier siblings' tokens, renormalized, for siblings
    drawn without replacement); None: every child proposed without a distribution (copied
    from a trie), verified as q one-hot. Row 0 of draft_probs is unused.
    Returns (the accepted rows after the root, in order; the token drawn after the last).
    Uniforms: one per examined child, then one draw by `sample`."""
    target, tokens, kids = _check_tree(target_probs, tokens, parents)
    if draft_probs is not None:
        draft_probs = np.asarray(draft_probs, dtype=np.float64)  # [T,V]
        if draft_probs.shape != target.shape:
            raise ValueError(f"draft_probs must have the target's shape {target.shape}, got {draft_probs.shape}")
        for row in range(1, len(tokens)):  # checked before drawing: a bad call leaves the stream untouched
            if not draft_probs[row, tokens[row]] > 0.0:
                raise ValueError(f"row {row}'s token {tokens[row]} has q = {draft_probs[row, tokens[row]]}; it cannot have been drawn from it")
    path, node = [], 0
    while True:
        p = target[node]  # [V]
        for child in kids[node]:
            x = tokens[child]
            u = rng.random()
            if draft_probs is None:  # q one-hot at x (verify_deterministic's rule, no [V] one-hot built)
                if p[x] >= 1.0 or u < p[x]:
                    path.append(child)
                    break
                residual = np.maximum(p, 0.0)  # [V]: max(0, p - one_hot(x)), as p(x) < 1 here
                residual[x] = 0.0
            else:
                q = draft_probs[child]  # [V]
                if p[x] >= q[x] or u * q[x] < p[x]:  # u < min(1, p/q) without dividing
                    path.append(child)
                    break
                residual = np.maximum(p - q, 0.0)  # [V]
            total = residual.sum()
            # p == q up to rounding leaves nothing: p itself is then the right law.
            p = residual / total if total > 0.0 else p
        else:
            return path, sample(p, rng)
        node = path[-1]
