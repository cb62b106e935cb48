"""The export's bounded memory (issue 16): weights read from the checkpoint one module at a
time (export/sources.open_checkpoint), stages traced in parts and stitched
(export/bundle._trace_parts, export/onnx_graphs.stitch_parts), graphs written weight by weight
(export/quantize.write_stage). Each step must give what the whole-model path gives."""

from __future__ import annotations

import json

import numpy as np
import pytest

import tiny
from real import SMOLLM2, need
from runtime.engine import Engine, EngineConfig


def _same_weights(spec: str) -> int:
    """Every parameter of the lazily opened checkpoint equals from_pretrained's, bit for bit."""
    import torch

    from export.sources import load_checkpoint, open_checkpoint

    whole = load_checkpoint(spec)
    lazy = open_checkpoint(spec)
    assert lazy.weights is not None, f"{spec}: opened whole, not lazily"
    assert all(p.is_meta for p in lazy.model.parameters())
    expected = dict(whole.model.named_parameters(remove_duplicate=False))
    assert sorted(expected) == sorted(n for n, _ in lazy.model.named_parameters(remove_duplicate=False))
    for name, param in expected.items():
        got = lazy.weights.tensor(name)
        assert got.dtype == torch.float32 and got.shape == param.shape, name
        assert torch.equal(got, param.detach()), f"{spec}: {name} differs from from_pretrained's"
    assert lazy.model.generation_config.eos_token_id == whole.model.generation_config.eos_token_id
    return len(expected)


def test_lazy_weights_equal_from_pretrained_safetensors(tiny_models):
    assert _same_weights(str(tiny_models.llama)) > 10


@pytest.mark.real_weights
def test_lazy_weights_equal_from_pretrained_gguf():
    """A real GGUF through transformers' own name map and tensor processors: SmolLM2 (Llama: q/k
    rows permuted back). Gemma 3 (norm weights stored +1, tied head) and Qwen2.5 (tied head)
    are read the same lazy way for their fp32 bundles, whose logits test_real_weights compares
    with transformers' from_pretrained model (1e-3): a misread tensor moves them far more, and
    comparing those two checkpoints here too cost about 4 of CI's minutes."""
    folder = need(SMOLLM2)
    assert _same_weights(str(folder / SMOLLM2)) > 100


@pytest.mark.real_weights
def test_gguf_read_once_parses_a_file_once_into_what_gguf_reads():
    """export.sources.gguf_read_once: its reader gives gguf's fields and tensors; transformers'
    metadata parse runs once per file within it, each caller gets its own copy; both are
    restored on exit."""
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    from export.sources import gguf_read_once, gguf_reader

    path = str(need(SMOLLM2) / SMOLLM2)
    plain, fast = gguf.GGUFReader(path), gguf_reader(path)
    assert list(fast.fields) == list(plain.fields)
    for name, field in plain.fields.items():
        assert fast.fields[name].types == field.types and fast.fields[name].data == field.data, name
        assert all(np.array_equal(a, b) for a, b in zip(fast.fields[name].parts, field.parts, strict=True)), name
    assert [(t.name, t.tensor_type, t.data_offset) for t in fast.tensors] == [(t.name, t.tensor_type, t.data_offset) for t in plain.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(fast.tensors, plain.tensors))

    expected = hf_gguf.load_gguf_checkpoint(path)
    readers = []
    reader_class, load = gguf.GGUFReader, hf_gguf.load_gguf_checkpoint
    with gguf_read_once():
        gguf.GGUFReader = type("Counted", (gguf.GGUFReader,), {"__init__": lambda self, *a: (readers.append(a), super(type(self), self).__init__(*a))[1]})
        first = hf_gguf.load_gguf_checkpoint(path)
        first["config"]["vocab_size"] = -1
        with gguf_read_once():  # nested: the same memo
            again = hf_gguf.load_gguf_checkpoint(path)
    assert len(readers) == 1 and first != again and again == expected
    assert (gguf.GGUFReader, hf_gguf.load_gguf_checkpoint) == (reader_class, load)


def test_loaded_modules_are_meta_again_after_the_block(tiny_models):
    from export.sources import open_checkpoint

    checkpoint = open_checkpoint(str(tiny_models.llama))
    with checkpoint.loaded(["model.layers.1", "lm_head"]):
        assert not any(p.is_meta for p in checkpoint.model.model.layers[1].parameters())
        assert not checkpoint.model.lm_head.weight.is_meta
        assert all(p.is_meta for p in checkpoint.model.model.layers[0].parameters())
    assert all(p.is_meta for p in checkpoint.model.parameters())


def test_trace_parts_cut_by_layers_and_bytes(tiny_models):
    """The embedding and the head are parts of their own; layers go `per_part` at a time, or by
    TRACE_BYTES of fp32 weights."""
    import export.bundle as bundle
    from export.bundle import _trace_parts
    from export.sources import open_checkpoint

    model = open_checkpoint(str(tiny_models.llama)).model
    none, e, h = range(0), True, False
    assert _trace_parts(model, range(4), True, True, None) == [(range(0, 0), True, False), (range(4), False, False), (range(4, 4), False, True)]
    assert _trace_parts(model, range(4), True, True, 3) == [(range(0, 0), True, False), (range(3), False, False), (range(3, 4), False, False), (range(4, 4), False, True)]
    assert _trace_parts(model, range(1, 4), False, False, 1) == [(range(1, 2), False, False), (range(2, 3), False, False), (range(3, 4), False, False)]
    assert _trace_parts(model, none, False, True, 1) == [(none, False, True)]
    assert _trace_parts(model, none, e, h, None) == [(none, e, h)]
    layer = 4 * sum(p.numel() for p in model.model.layers[0].parameters())
    saved = bundle.TRACE_BYTES
    try:
        bundle.TRACE_BYTES = 2 * layer
        assert [p for p, _, _ in _trace_parts(model, range(4), False, False, None)] == [range(2), range(2, 4)]
    finally:
        bundle.TRACE_BYTES = saved


@pytest.fixture(scope="module")
def part_bundles(tmp_path_factory, tiny_models):
    """The fp32 and int4 llama pair (draft model + layer-skip), traced whole and one layer a part."""
    from export.bundle import ExportConfig, export_bundle

    out = {}
    for quant in ("fp32", "int4"):
        for per_part in (None, 1):
            folder = tmp_path_factory.mktemp(f"parts-{quant}-{per_part}")
            log: list[str] = []
            export_bundle(ExportConfig(str(tiny_models.llama), folder / "b", quant, tiny.MAX_CONTEXT, (str(tiny_models.draft), "layer-skip:1"), trace_layers=per_part), log=log.append)
            out[quant, per_part] = (folder / "b", log)
    return out


@pytest.mark.parametrize("quant", ["fp32", "int4"])
def test_stitched_parts_give_the_same_logits(quant, part_bundles, hf_models):
    """One layer a part, stitched, computes what the stage traced whole computes (every stage:
    target trunk, rest and head of the layer-skip plan, and the draft); fp32 also matches
    transformers."""
    whole, _ = part_bundles[quant, None]
    parts, log = part_bundles[quant, 1]
    assert any("part 3 of 3" in line for line in log) and any("part 4 of 4" in line for line in log), log  # target.rest: layers 1..3 one a part; the 2-layer draft
    model, tok = hf_models["llama"]
    ids = tok(tiny.PROMPT)["input_ids"]
    manifest = json.loads((parts / "manifest.json").read_text())
    assert manifest["stages"].keys() == json.loads((whole / "manifest.json").read_text())["stages"].keys()
    import onnxruntime as ort

    for key, stage in manifest["stages"].items():
        a = ort.InferenceSession(str(whole / stage["file"]), providers=["CPUExecutionProvider"])
        b = ort.InferenceSession(str(parts / stage["file"]), providers=["CPUExecutionProvider"])
        assert [i.name for i in a.get_inputs()] == [i.name for i in b.get_inputs()]
        assert [o.name for o in a.get_outputs()] == [o.name for o in b.get_outputs()]
        feeds = _feeds(a, ids)
        for x, y, out in zip(a.run(None, feeds), b.run(None, feeds), a.get_outputs()):
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5, err_msg=f"{quant} {key} {out.name}")
    if quant == "fp32":
        engine = Engine(parts, EngineConfig(drafter="none"))
        np.testing.assert_allclose(engine.target.forward(ids), tiny.hf_logits(model, ids), atol=1e-4, rtol=1e-5)


def _feeds(session, ids):
    """Inputs for one block of `ids` at position 0 into an empty cache, any stage kind."""
    from edge_spec import names

    t = len(ids)
    feeds = {}
    for spec in session.get_inputs():
        shape = [d if isinstance(d, int) else 1 if d == "B" else t for d in spec.shape]  # B: the batch of fused graphs
        if spec.name == names.INPUT_IDS:
            feeds[spec.name] = np.array([ids], dtype=np.int64)
        elif spec.name == names.HIDDEN_IN:
            feeds[spec.name] = np.random.default_rng(0).standard_normal([1, t, shape[2]]).astype(np.float32)
        elif spec.name == names.SEQLENS_K:
            feeds[spec.name] = np.array([t - 1], dtype=np.int32)
        elif spec.name == names.TOTAL_SEQ_LEN:
            feeds[spec.name] = np.array(t, dtype=np.int32)
        elif spec.name == names.KV_LEN:
            feeds[spec.name] = np.array([0], dtype=np.int64)
        elif spec.name == names.LOGIT_POSITIONS:
            feeds[spec.name] = np.arange(t, dtype=np.int64)
        else:
            feeds[spec.name] = np.zeros(shape, dtype=np.float32)
    return feeds
