"""What ONNX Runtime's CPU GroupQueryAttention (the fused graphs' attention) does with a batch of
sequences over static KV buffers, the fact batched decoding (issue 36) is designed around: one
token per sequence batches exactly (each row as its solo pass computes it, bit for bit), while
a block of several tokens with a past is refused for batch > 1, so verify passes of several
sequences keep one attention node per sequence and share only the weight-reading kernels."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

H, KVH, D, MAX = 4, 2, 16, 64


def _gqa(batch: int, block: int) -> ort.InferenceSession:
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("q", f, [batch, block, H * D]), helper.make_tensor_value_info("k", f, [batch, block, KVH * D]),
              helper.make_tensor_value_info("v", f, [batch, block, KVH * D]), helper.make_tensor_value_info("past_key", f, [batch, KVH, MAX, D]),
              helper.make_tensor_value_info("past_value", f, [batch, KVH, MAX, D]), helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [batch]),
              helper.make_tensor_value_info("total_seq_len", TensorProto.INT32, []), helper.make_tensor_value_info("cos", f, [MAX, D // 2]),
              helper.make_tensor_value_info("sin", f, [MAX, D // 2])]
    outputs = [helper.make_tensor_value_info("out", f, [batch, block, H * D]), helper.make_tensor_value_info("present_key", f, [batch, KVH, MAX, D]),
               helper.make_tensor_value_info("present_value", f, [batch, KVH, MAX, D])]
    node = helper.make_node("GroupQueryAttention", [i.name for i in inputs], [o.name for o in outputs], domain="com.microsoft",
                            num_heads=H, kv_num_heads=KVH, do_rotary=1, scale=D ** -0.5)
    model = helper.make_model(helper.make_graph([node], "gqa", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def _feeds(rng, batch: int, block: int, past: list[int]) -> dict:
    angles = np.arange(MAX)[:, None] / (10000 ** (np.arange(0, D, 2) / D))[None]
    return {"q": rng.standard_normal((batch, block, H * D), np.float32), "k": rng.standard_normal((batch, block, KVH * D), np.float32),
            "v": rng.standard_normal((batch, block, KVH * D), np.float32),
            "past_key": rng.standard_normal((batch, KVH, MAX, D), np.float32), "past_value": rng.standard_normal((batch, KVH, MAX, D), np.float32),
            "seqlens_k": np.array([p + block - 1 for p in past], np.int32), "total_seq_len": np.array(max(past) + block, np.int32),
            "cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


def _one(feeds: dict, b: int, past: int, block: int) -> dict:
    picked = {name: feeds[name][b : b + 1].copy() for name in ("q", "k", "v", "past_key", "past_value")}
    return {**picked, "seqlens_k": np.array([past + block - 1], np.int32), "total_seq_len": np.array(past + block, np.int32),
            "cos": feeds["cos"], "sin": feeds["sin"]}


def test_one_token_per_sequence_batches_as_each_solo_pass_computes_it():
    past = [5, 11, 30]  # each sequence at its own length in its own slot of the buffer
    feeds = _feeds(np.random.default_rng(0), len(past), 1, past)
    out, present_key, _ = _gqa(len(past), 1).run(None, feeds)
    solo = _gqa(1, 1)
    for b, length in enumerate(past):
        alone, alone_key, _ = solo.run(None, _one(feeds, b, length, 1))
        assert np.array_equal(out[b], alone[0])
        assert np.array_equal(present_key[b, :, : length + 1], alone_key[0, :, : length + 1])


def test_a_block_of_several_tokens_with_a_past_is_refused_for_a_batch():
    feeds = _feeds(np.random.default_rng(1), 2, 3, [5, 11])
    with pytest.raises(Exception, match="batch_size must be 1 when sequence_length > 1"):
        _gqa(2, 3).run(None, feeds)
    alone = _gqa(1, 3).run(None, _one(feeds, 1, 11, 3))  # the same block, one sequence: accepted
    assert np.isfinite(alone[0]).all()
