"""Gemma 3 (text): interleaved sliding-window and global layers with rotary tables of their own,
q/k norms, four (1 + w) RMS norms per layer, GELU-tanh MLP, embedding scaled by sqrt(hidden)
(inside transformers' embedding module), attention scaled by query_pre_attn_scalar."""

from export.archs import ArchSpec, UnsupportedArchitecture, register


def _windows(config) -> tuple[int, ...]:
    return tuple(int(config.sliding_window) if t == "sliding_attention" else 0 for t in config.layer_types)


def _rope_kinds(config) -> tuple[str, ...]:
    return tuple(config.layer_types)


def _rope_table(inner, kind: str):
    rotary = inner.rotary_emb
    return getattr(rotary, f"{kind}_inv_freq"), float(getattr(rotary, f"{kind}_attention_scaling"))


def _check(config) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise UnsupportedArchitecture("gemma3: use_bidirectional_attention=True is not supported")
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise UnsupportedArchitecture("gemma3: attn_logit_softcapping is not supported")
    if getattr(config, "attention_bias", False):
        raise UnsupportedArchitecture("gemma3: attention_bias=True is not supported")


SPEC = register(ArchSpec(
    "gemma3_text", _check, rope_types=("default", "linear"), activation_key="hidden_activation", activations=("gelu_pytorch_tanh",),
    norm_offset=1.0, qk_norm=True, sandwich_norms=True, windows=_windows, rope_kinds=_rope_kinds, rope_table=_rope_table,
    attention_scale=lambda config: config.query_pre_attn_scalar**-0.5,
    logit_softcap=lambda config: getattr(config, "final_logit_softcapping", None),
))
