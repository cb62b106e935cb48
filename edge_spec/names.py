"""Graph input/output names, written by the exporter and bound by the runtime.

One stage graph runs layers [layer_start, layer_end) of a model; the first stage also embeds
token ids, the last one also applies the final norm and the LM head.
"""

INPUT_IDS = "input_ids"  # int64 [1, T]: first stage only
HIDDEN_IN = "hidden_in"  # float32 [1, T, hidden]: every later stage
KV_LEN = "kv_len"  # int64 [1]: valid rows in the past buffers; the block sits at kv_len..kv_len+T
LOGIT_POSITIONS = "logit_positions"  # int64 [N]: which block positions get logits (head stage)
LOGITS = "logits"  # float32 [1, N, vocab]
HIDDEN_OUT = "hidden_out"  # float32 [1, T, hidden]: every stage without the head


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
ATTENTION_KINDS = ("fused", "portable")


def stage_inputs(embed: bool, head: bool, layers: range) -> list[str]:
    names = [INPUT_IDS if embed else HIDDEN_IN]
    if layers:
        names.append(KV_LEN)
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
