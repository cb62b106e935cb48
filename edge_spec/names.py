"""Graph input/output names, written by the exporter and bound by the runtime.

One stage graph runs layers [layer_start, layer_end) of a model; the first stage also embeds
token ids, the last one also applies the final norm and the LM head.
"""

import numpy as np

INPUT_IDS = "input_ids"  # int64 [1, T]: first stage only
HIDDEN_IN = "hidden_in"  # [1, T, hidden] in the activation type (float32, float16 on GPU profiles): every later stage
KV_LEN = "kv_len"  # int64 [1]: valid rows in the past buffers; the block sits at kv_len..kv_len+T (portable)
# Fused graphs take GroupQueryAttention's own position inputs, computed by the runtime, so no
# integer arithmetic runs inside the graph: on CUDA such nodes would be placed on the CPU (the
# kernel reads total_seq_len from host memory), which a session without CPU fallback refuses.
SEQLENS_K = "seqlens_k"  # int32 [1]: kv_len + T - 1
TOTAL_SEQ_LEN = "total_seq_len"  # int32 scalar: kv_len + T
LOGIT_POSITIONS = "logit_positions"  # int64 [N]: which block positions get logits (head stage)
LOGITS = "logits"  # float32 [1, N, vocab], whatever the activation type
HIDDEN_OUT = "hidden_out"  # [1, T, hidden], activation type: every stage without the head


def past_key(layer: int) -> str:
    return f"past_key.{layer}"  # [1, kv_heads, max_context, head_dim]


def past_value(layer: int) -> str:
    return f"past_value.{layer}"


def new_key(layer: int) -> str:
    return f"new_key.{layer}"  # [1, kv_heads, T, head_dim]: only the block's rows, never the cache


def new_value(layer: int) -> str:
    return f"new_value.{layer}"


def present_key(layer: int) -> str:
    return f"present_key.{layer}"  # [1, kv_heads, max_context, head_dim]: the past buffer itself, bound in place


def present_value(layer: int) -> str:
    return f"present_value.{layer}"


# How a stage's attention reads and writes the KV buffers (StageInfo.attention).
# "fused": ONNX Runtime's GroupQueryAttention writes the block's rows into the past buffer in
# place (the runtime binds present_* to the same memory as past_*); needs the com.microsoft ops.
# "portable": standard ONNX ops only; the graph returns the block's new rows (new_*) and the
# runtime copies them in (any ONNX Runtime build, including Android/NNAPI and the CoreML EP).
# "masked": standard ops as well, with the rotary positions and the attention mask fed by the
# runtime (POSITION_IDS, ATTENTION_BIAS) and every shape a constant, so no index arithmetic,
# comparison or range op is left in the graph: the ops the Core ML EP takes (--device coreml).
ATTENTION_KINDS = ("fused", "portable", "masked")
POSITION_IDS = "position_ids"  # int64 [T]: kv_len + 0..T-1
ATTENTION_BIAS = "attention_bias"  # float32 [T, P + T]: 0 where a row may attend, MASKED elsewhere
MASKED = -1e9  # added to the scores of positions a row must not see


def stage_inputs(embed: bool, head: bool, layers: range, attention: str = "portable") -> list[str]:
    names = [INPUT_IDS if embed else HIDDEN_IN]
    if layers:
        names += {"fused": [SEQLENS_K, TOTAL_SEQ_LEN], "masked": [POSITION_IDS, ATTENTION_BIAS]}.get(attention, [KV_LEN])
    if head:
        names.append(LOGIT_POSITIONS)
    for layer in layers:
        names += [past_key(layer), past_value(layer)]
    return names


def stage_outputs(head: bool, layers: range, attention: str = "fused") -> list[str]:
    names = [LOGITS if head else HIDDEN_OUT]
    key, value = (present_key, present_value) if attention == "fused" else (new_key, new_value)
    for layer in layers:
        names += [key(layer), value(layer)]
    return names


def position_feeds(inputs, start: int, block: int, max_context: int = 0) -> dict:
    """The position inputs a stage takes (KV_LEN; SEQLENS_K and TOTAL_SEQ_LEN; or POSITION_IDS
    and ATTENTION_BIAS over the max_context past rows fed) for a block of `block` tokens at row
    `start`, as the numpy arrays the graph declares."""
    feeds = {}
    if POSITION_IDS in inputs:
        feeds[POSITION_IDS] = np.arange(start, start + block, dtype=np.int64)
        bias = np.full((block, max_context + block), MASKED, dtype=np.float32)
        bias[:, :start] = 0.0  # the valid past rows
        bias[:, max_context:][np.tril_indices(block)] = 0.0  # causal within the block
        feeds[ATTENTION_BIAS] = bias
    if KV_LEN in inputs:
        feeds[KV_LEN] = np.array([start], dtype=np.int64)
    if SEQLENS_K in inputs:
        feeds[SEQLENS_K] = np.array([start + block - 1], dtype=np.int32)
        feeds[TOTAL_SEQ_LEN] = np.array(start + block, dtype=np.int32)
    return feeds
