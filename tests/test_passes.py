"""The pass contract (runtime/passes.py): a pass scores tokens with positions and parents, rows
are kept by index, and a drafter that reads the target's hidden states is shown the kept rows'.
Tiny random-weight bundles: the fused CPU graphs (chains) and the masked ones (--device coreml,
which take positions and a mask from the runtime, so a tree)."""

from __future__ import annotations

import numpy as np
import pytest

import tiny
from edge_spec.sampling import SamplingConfig
from runtime.drafters.base import Drafter, Proposal
from runtime.engine import Engine, EngineConfig
from runtime.gamma import GammaConfig
from runtime.kv_cache import KVCache
from runtime.loop import decode_steps
from runtime.passes import Block
from runtime.policy import RoundPolicy


def _engine(bundle) -> Engine:
    return Engine(bundle, EngineConfig(provider="cpu", drafter="none", calibrate=False))


@pytest.fixture(scope="module")
def masked_bundle(tmp_path_factory, tiny_models):
    """The tiny llama's masked graphs with a layer-skip draft: two stages, so layer 1's output is a stage's."""
    out = tmp_path_factory.mktemp("masked") / "llama-coreml"
    tiny.export(tiny_models.llama, out, quant="fp32", drafts=("layer-skip:2",), device="coreml")
    return out


def test_a_block_refuses_positions_and_parents_that_do_not_make_a_tree():
    chain = Block.chain([4, 5, 6], start=7)
    assert chain.is_chain and chain.positions.tolist() == [7, 8, 9] and chain.n_logits == 3
    tree = Block(np.array([4, 5, 6, 7]), np.array([7, 8, 8, 9]), np.array([-1, 0, 0, 2]), 4)
    assert not tree.is_chain and tree.path(3) == [0, 2, 3]
    assert tree.visible().astype(int).tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]
    with pytest.raises(ValueError, match="parent must come before it"):
        Block(np.array([4, 5, 6]), np.array([7, 8, 9]), np.array([-1, 2, 1]), 1)
    with pytest.raises(ValueError, match="the parent's plus one"):
        Block(np.array([4, 5, 6]), np.array([7, 8, 10]), np.array([-1, 0, 0]), 1)
    with pytest.raises(ValueError, match="n_logits must be 1..3"):
        Block.chain([4, 5, 6], 0, n_logits=0)


def test_keep_moves_the_kept_rows_into_place_and_a_prefix_only_moves_the_length():
    cache = KVCache(range(2), n_kv_heads=1, max_context=16, head_dim=2)
    rows = np.arange(8, dtype=np.float32)
    for layer in cache.layers:
        cache.keys[layer][0, 0, :8] = rows[:, None] + 100 * layer
        cache.values[layer][0, 0, :8] = -rows[:, None]
    cache.extend(np.arange(20, 28))
    cache.keep([0, 1, 4, 6])
    assert cache.kv_len == 4 and cache.row_tokens[:4].tolist() == [20, 21, 24, 26]
    assert cache.keys[1][0, 0, :4, 0].tolist() == [100, 101, 104, 106] and cache.values[0][0, 0, :4, 1].tolist() == [0, -1, -4, -6]
    cache.keep(range(3))
    assert cache.kv_len == 3 and cache.keys[0][0, 0, 3, 0] == 6  # a prefix moves nothing
    for wrong in ([2, 1], [0, 3], [-1]):
        with pytest.raises(ValueError, match="ascending rows below 3"):
            cache.keep(wrong)
    assert cache.rollback_to_prefix(np.array([20, 21, 99])) == 2


def test_a_tree_pass_scores_each_path_as_that_path_alone_and_keeps_the_accepted_one(masked_bundle):
    target = _engine(masked_bundle).target
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 250, size=9)]
    target.prefill(prompt)
    k = target.kept
    # The pending token 17 with two candidates after it (40, 41), each with a child (42; 43).
    tokens, parents = np.array([17, 40, 41, 42, 43]), np.array([-1, 0, 0, 1, 2])
    tree = Block(tokens, k + np.array([0, 1, 1, 2, 2]), parents, 5, hidden=(1,))
    scored = target.score(tree)
    for leaf in (3, 4):
        path = tree.path(leaf)
        target.keep(range(k))
        alone = target.score(Block.chain(tokens[path], k, hidden=(1,)))
        np.testing.assert_allclose(scored.logits[path], alone.logits, atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(scored.hidden[1][path], alone.hidden[1], atol=1e-4, rtol=1e-4)
        after_chain = target.score(Block.chain([44], k + 3)).logits
        # The same tree again, then only the path's rows kept (moved into place), then the next token.
        target.keep(range(k))
        target.score(tree)
        target.keep([*range(k), *(k + r for r in path)])
        assert target.kept == k + 3 and target.cache.row_tokens[k : k + 3].tolist() == tokens[path].tolist()
        np.testing.assert_allclose(target.score(Block.chain([44], k + 3)).logits, after_chain, atol=1e-4, rtol=1e-4)
        target.keep(range(k))


def test_fused_graphs_take_chains_only_and_name_the_layers_they_return(llama_bundle):
    target = _engine(llama_bundle).target
    assert not target.trees() and target.hidden_layers() == (0, 3)  # after the trunk (layer-skip:1) and after the last layer
    tree = Block(np.array([5, 6, 7]), np.array([0, 1, 1]), np.array([-1, 0, 0]), 3)
    with pytest.raises(ValueError, match="chain only"):
        target.score(tree)
    with pytest.raises(ValueError, match="trunk rows are a chain's"):
        target.score(tree, trunk_hidden=np.zeros((1, 1, 64), dtype=np.float32))
    with pytest.raises(ValueError, match=r"returns the outputs of layers \[0, 3\], not \[2\]"):
        target.score(Block.chain([5, 6], 0, hidden=(2,)))
    with pytest.raises(ValueError, match="starts at position 1, after 0 kept rows"):
        target.score(Block.chain([5, 6], 1))


def test_the_hidden_state_a_pass_returns_is_the_layers_output_in_transformers(llama_bundle, hf_models):
    import torch

    model, tokenizer = hf_models["llama"]
    ids = tokenizer(tiny.PROMPT).input_ids
    with torch.no_grad():
        reference = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[1][0].numpy()  # after layer 0
    scored = _engine(llama_bundle).target.score(Block.chain(ids, 0, hidden=(0,)))
    np.testing.assert_allclose(scored.hidden[0], reference, atol=1e-4, rtol=1e-4)


class ReadingOracle(Drafter):
    """Drafts the plain greedy continuation, every other round with its last token wrong, and reads
    the target's layer 0, recording what it is shown."""

    name = "oracle"
    reads_hidden = (0,)

    def __init__(self, plain: list[int]):
        self.plain, self.rounds = plain, 0
        self.shown: list[tuple[int, np.ndarray]] = []

    def propose(self, tokens, gamma, sampling, rng):
        self.rounds += 1
        drafted = list(self.plain[len(tokens) : len(tokens) + gamma])
        if self.rounds % 2 and drafted:
            drafted[-1] = (drafted[-1] + 1) % 250
        return Proposal.of(drafted, [None] * len(drafted)) if drafted else None

    def seen(self, first_row, hidden):
        self.shown.append((first_row, hidden[0]))


def test_a_drafter_that_reads_hidden_states_is_shown_every_kept_row_once(llama_bundle):
    engine = _engine(llama_bundle)
    prompt = engine.encode(" ".join([tiny.PROMPT] * 2))
    greedy = SamplingConfig(temperature=0.0)

    def run(drafter, n=20):
        policy = RoundPolicy().start(drafter, config=GammaConfig(fixed=3))
        tokens, steps = list(prompt), []
        for step in decode_steps(engine.target, drafter, prompt, greedy, np.random.default_rng(0), policy):
            tokens += step.tokens
            steps.append(step)
            if len(tokens) - len(prompt) >= n:
                return tokens, steps

    plain, _ = run(None, 30)
    drafter = ReadingOracle(plain)
    tokens, steps = run(drafter)
    assert tokens == plain[: len(tokens)] and sum(s.n_accepted for s in steps) > 5 and any(s.n_accepted < s.n_drafted for s in steps)
    kept = engine.target.kept
    # Each showing starts where the last one ended, from row 0 (the plain run's rows are not kept for it).
    assert [first for first, _ in drafter.shown] == np.cumsum([0] + [len(h) for _, h in drafter.shown[:-1]]).tolist()
    assert sum(len(h) for _, h in drafter.shown) == kept
    shown = np.concatenate([h for _, h in drafter.shown])  # [kept, H]
    engine.target.keep(range(0))
    again = engine.target.prefill(np.asarray(tokens[:kept]), hidden=(0,))[0]
    np.testing.assert_allclose(shown, again, atol=1e-4, rtol=1e-4)
