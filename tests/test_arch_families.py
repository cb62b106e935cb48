"""Every exported family (export.archs) on a tiny random checkpoint: hidden 64, 4 layers, sliding
windows of tiny.FAMILY_WINDOW tokens where the family has them, shorter than the 80-token prompt
so windowing decides the result. fp32 bundles must give transformers' logits at every position,
fed at once and block by block over the past buffer, on fused, portable and masked graphs; greedy
speculation (lookup and layer-skip drafts) must give plain greedy's tokens."""

from __future__ import annotations

import numpy as np
import pytest

import tiny
from edge_spec.manifest import load_manifest
from runtime.engine import Engine, EngineConfig, GenerateConfig

MAX_CONTEXT = 128
PROMPT_TOKENS = 80
WINDOWED = ("qwen3", "mistral", "phi3", "gemma3_text")
ATTENTIONS = ("fused", "portable")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (folder, transformers model, 80-token prompt ids)."""
    tok = tiny.make_tokenizer()
    text = " ".join([tiny.PROMPT, "red blue green tree house river stone print def return import class"] * 4)
    ids = tok(text).input_ids[:PROMPT_TOKENS]
    assert len(ids) == PROMPT_TOKENS
    root = tmp_path_factory.mktemp("families")
    out = {}
    for family in tiny.FAMILIES:
        folder = tiny.make_family(root / family, tok, family)
        out[family] = (folder, tiny.load_hf(folder)[0], ids)
    return out


@pytest.fixture(scope="module")
def family_bundles(families, tmp_path_factory):
    root = tmp_path_factory.mktemp("family_bundles")
    bundles = {}
    for family, (folder, _, _) in families.items():
        for attention in ATTENTIONS:
            bundles[family, attention] = root / f"{family}-{attention}"
            tiny.export(folder, bundles[family, attention], max_context=MAX_CONTEXT, attention=attention, drafts=("layer-skip:2",))
    return bundles


def _engine(bundle, drafter="none", gamma=None):
    return Engine(bundle, EngineConfig(drafter=drafter, gamma=gamma))


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_logits_match_transformers_at_every_position(family, attention, families, family_bundles):
    _, model, ids = families[family]
    reference = tiny.hf_logits(model, ids)  # [80, V]
    runner = _engine(family_bundles[family, attention]).target
    runner.cache.reset()
    np.testing.assert_allclose(runner.forward(ids), reference, atol=1e-4, rtol=1e-5)
    # Block by block: queries at kv_len > W read windowed rows of the past buffer.
    runner.cache.reset()
    pieces = [runner.forward(ids[:20]), runner.forward(ids[20:23])] + [runner.forward(ids[i : i + 1]) for i in range(23, 40)]
    pieces.append(runner.forward(ids[40:]))
    np.testing.assert_allclose(np.concatenate(pieces), reference, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family", WINDOWED)
def test_windows_matter(family, families):
    """The same checkpoint without its windows gives other logits: the tests above check windowing."""
    _, model, ids = families[family]
    reference = tiny.hf_logits(model, ids)
    config = model.config
    saved = config.sliding_window
    try:
        config.sliding_window = 10_000
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 10_000
        unwindowed = tiny.hf_logits(model, ids)
    finally:
        config.sliding_window = saved
        for layer in model.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = saved
    assert np.abs(unwindowed[tiny.FAMILY_WINDOW + 4 :] - reference[tiny.FAMILY_WINDOW + 4 :]).max() > 1e-2


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_speculative_greedy_equals_plain(family, attention, families, family_bundles):
    _, _, ids = families[family]
    bundle = family_bundles[family, attention]
    config = GenerateConfig(max_new_tokens=30)
    plain = _engine(bundle).generate(ids, config).token_ids
    assert len(plain) > 0
    for drafter in ("lookup", "layer-skip"):
        assert _engine(bundle, drafter, 3).generate(ids, config).token_ids == plain, drafter


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_greedy_matches_transformers(family, families, family_bundles):
    import torch

    _, model, ids = families[family]
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=20, min_new_tokens=0)[0, len(ids) :].tolist()
    assert _engine(family_bundles[family, "fused"]).generate(ids, GenerateConfig(max_new_tokens=20)).token_ids == ref


def test_manifest_records_windows(family_bundles):
    manifest = load_manifest(family_bundles["gemma3_text", "fused"])
    w = tiny.FAMILY_WINDOW
    assert manifest.models["target"].arch.layer_windows == (w, w, 0, w)
    assert manifest.models["layer_skip"].arch.layer_windows == (w, w)
    assert load_manifest(family_bundles["llama", "fused"]).models["target"].arch.layer_windows == ()
    assert load_manifest(family_bundles["qwen3", "portable"]).models["target"].arch.layer_windows == (0, 0, w, w)


@pytest.mark.parametrize("family", ("mistral", "gemma3_text"))
def test_masked_graphs_match_transformers(family, families, tmp_path):
    """--device coreml's masked graphs (positions and bias from the runtime) window in-graph too."""
    folder, model, ids = families[family]
    out = tmp_path / "bundle"
    tiny.export(folder, out, quant="fp32", max_context=MAX_CONTEXT, attention=None, device="coreml")
    runner = Engine(out, EngineConfig(drafter="none", provider="cpu")).target
    reference = tiny.hf_logits(model, ids)
    runner.cache.reset()
    got = np.concatenate([runner.forward(ids[:30])] + [runner.forward(ids[i : i + 1]) for i in range(30, 40)] + [runner.forward(ids[40:])])
    np.testing.assert_allclose(got, reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("family", WINDOWED)
def test_coreml_wrapper_windows(family, families):
    """export.coreml's stateful wrapper, run in torch at float32 state precision, block by block."""
    import torch

    from export.coreml import StatefulStage
    from export.static_cache import StageModule

    _, model, ids = families[family]
    n_layers = model.config.num_hidden_layers
    stage = StageModule(model, 0, n_layers, True, True, model.config.vocab_size, "portable", MAX_CONTEXT)
    wrapper = StatefulStage(stage, range(n_layers), MAX_CONTEXT, torch.float32).eval()
    outs, at = [], 0
    with torch.no_grad():
        for n in (25, 1, 3, len(ids) - 29):
            outs.append(wrapper(torch.tensor([ids[at : at + n]], dtype=torch.int32), torch.tensor([at], dtype=torch.int32))[0][0].numpy())
            at += n
    np.testing.assert_allclose(np.concatenate(outs), tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-4)


def test_unsupported_variants_refused_by_name():
    from export.archs import UnsupportedArchitecture, arch_for, check_context

    phi3 = tiny.family_config("phi3", 300)
    arch_for(phi3)
    check_context(phi3, MAX_CONTEXT)
    with pytest.raises(UnsupportedArchitecture, match="--max-context 256 is past 128.*longrope"):
        check_context(phi3, 256)
    partial = tiny.family_config("phi3", 300)
    partial.rope_parameters = {**partial.rope_parameters, "partial_rotary_factor": 0.75}
    with pytest.raises(UnsupportedArchitecture, match="partial rotary"):
        arch_for(partial)
    gemma = tiny.family_config("gemma3_text", 300)
    gemma.attn_logit_softcapping = 50.0
    with pytest.raises(UnsupportedArchitecture, match="attn_logit_softcapping"):
        arch_for(gemma)
    act = tiny.family_config("mistral", 300)
    act.hidden_act = "gelu"
    with pytest.raises(UnsupportedArchitecture, match="activation 'gelu'"):
        arch_for(act)


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_a_batched_pass_computes_each_row_as_the_sequence_alone(family, families, family_bundles):
    """Fused graphs take a batch of sequences, one KV slot each (runtime/batch.py): with three
    sequences at lengths inside and past the window, each row is its 1-token pass bit for bit
    (q/k norms reshaped per sequence, windows from each one's own length)."""
    from runtime.batch import batched_target

    _, _, ids = families[family]
    engine = _engine(family_bundles[family, "fused"])
    target = batched_target(engine.loader, 3)
    lengths = (PROMPT_TOKENS, 7, 40)
    for slot, n in enumerate(lengths):
        target.runner(slot).prefill(ids[: n - 1])
    batched = target.step([0, 1, 2], [ids[n - 1] for n in lengths])
    for slot, n in enumerate(lengths):
        engine.target.cache.reset()
        engine.target.prefill(ids[: n - 1])
        assert np.array_equal(batched[slot], engine.target.forward([ids[n - 1]])[0]), (family, slot)
