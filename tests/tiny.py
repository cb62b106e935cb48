"""Tiny random-weight Hugging Face checkpoints for end-to-end tests.

Each builder writes a local HF folder (config, safetensors weights, tokenizer) so the tests
go through the real `python -m export <folder>` path. Everything is deterministic (fixed
seeds) and small: hidden 64, 2-4 layers, a byte-level BPE vocabulary of a few hundred tokens.
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
from pathlib import Path

MAX_CONTEXT = 64

BOS, EOS, PAD = "<s>", "</s>", "<pad>"
USER, ASSISTANT = "<|user|>", "<|assistant|>"
# transformers 5 loads a qwen2 folder's tokenizer as Qwen2Tokenizer, which adds <|endoftext|>
# unless the vocabulary has it: include it so every model sees the same len(tokenizer).
ENDOFTEXT = "<|endoftext|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT, ENDOFTEXT]

# Written by the template itself (bos first), so apply_chat_template and the runtime add nothing.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>{% else %}<|assistant|>{% endif %}"
    "{{ message['content'] }}{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

_WORDS_A = (
    "the a cat dog sat on mat and ran fast slow red blue green tree house river stone "
    "quick brown fox jumps over lazy bird sings song morning night light dark water fire "
    "print def return import class self value list dict for in if else while true false"
).split()
_WORDS_B = (
    "zyx qwv plk mno rst uvw kjh gfd sap lor ips dol amet cons adip elit sed eius tempor "
    "incid labore magna aliqua enim minim veniam quis nostrud exerc ullamco laboris nisi"
).split()


def _corpus(words: list[str], n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        n = rng.randint(4, 14)
        line = " ".join(rng.choice(words) for _ in range(n))
        if rng.random() < 0.3:
            line = line.capitalize() + "."
        if rng.random() < 0.2:
            line += f" {rng.randint(0, 999)}"
        lines.append(line)
    return lines


def make_tokenizer(variant: str = "a", vocab_size: int = 400):
    """A byte-level BPE wrapped as a transformers fast tokenizer, with BOS added on encode
    and a chat template. variant "b" is trained on other text (a different vocabulary)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    words, seed = (_WORDS_A, 0) if variant == "a" else (_WORDS_B, 1)
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(words, 400, seed), trainer=trainer)
    bos_id = backend.token_to_id(BOS)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def _randomize(model, seed: int, bias_scale: float = 0.0, weight_scale: float = 1.5) -> None:
    """Weights large enough that logits have clear winners (the default init gives near-ties
    that float noise could flip), random norm scales, and optional non-zero biases."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=gen))
            elif name.endswith(".bias"):
                param.copy_(bias_scale * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name or "lm_head" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                fan_in = param.shape[-1]
                param.copy_(torch.randn(param.shape, generator=gen) * (weight_scale / fan_in**0.5))


def _save(model, tok, folder: Path) -> Path:
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    eos_id = tok.convert_tokens_to_ids(EOS)
    bos_id = tok.convert_tokens_to_ids(BOS)
    pad_id = tok.convert_tokens_to_ids(PAD)
    model.config.eos_token_id = eos_id
    model.config.bos_token_id = bos_id
    model.config.pad_token_id = pad_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.bos_token_id = bos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def llama_config(n_vocab: int, n_layers: int = 4, hidden: int = 64, heads: int = 4, kv_heads: int = 2, tie: bool = True):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=n_vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=MAX_CONTEXT * 2,
        rope_parameters={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
            "rope_theta": 500000.0,
        },
        tie_word_embeddings=tie,
        rms_norm_eps=1e-5,
    )


def make_llama(
    folder: Path, tok, n_layers: int = 4, extra_rows: int = 0, seed: int = 0, hidden: int = 64, weight_scale: float = 1.5,
    tie: bool = True,
) -> Path:
    """Llama with llama3 rope scaling, GQA (4 heads, 2 KV heads), tied embeddings.
    A smaller weight_scale gives a less chaotic network (quantization noise grows less)."""
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config = llama_config(len(tok) + extra_rows, n_layers=n_layers, hidden=hidden, tie=tie)
    model = LlamaForCausalLM(config).eval()
    _randomize(model, seed, weight_scale=weight_scale)
    return _save(model, tok, folder)


def make_qwen2(folder: Path, tok, n_layers: int = 3, seed: int = 1) -> Path:
    """Qwen2 with GQA, non-zero random q/k/v biases, untied LM head."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=n_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_CONTEXT * 2,
        tie_word_embeddings=False,
        use_sliding_window=False,
        rms_norm_eps=1e-6,
    )
    model = Qwen2ForCausalLM(config).eval()
    _randomize(model, seed, bias_scale=0.5)
    assert model.model.layers[0].self_attn.q_proj.bias is not None
    return _save(model, tok, folder)


FAMILY_WINDOW = 12  # sliding window of the tiny windowed families: shorter than the 80-token test prompt


def family_config(family: str, n_vocab: int, max_context: int = 128):
    """A tiny config (hidden 64, 4 layers, 4 heads over 2 KV heads) of each exported family,
    windows of FAMILY_WINDOW where the family has them."""
    import transformers as tf

    common = dict(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=max_context * 2)
    if family == "llama":
        return llama_config(n_vocab)
    if family == "qwen2":
        return tf.Qwen2Config(**common, tie_word_embeddings=False, use_sliding_window=False)
    if family == "qwen3":
        # Windows on the upper two layers (max_window_layers): both mask kinds in one model.
        return tf.Qwen3Config(**common, head_dim=16, use_sliding_window=True, sliding_window=FAMILY_WINDOW, max_window_layers=2,
                              tie_word_embeddings=True)
    if family == "mistral":
        return tf.MistralConfig(**common, head_dim=16, sliding_window=FAMILY_WINDOW, tie_word_embeddings=False)
    if family == "phi3":
        # long-RoPE with distinct short and long factors: exact while the context stays within the original window.
        half = 8
        rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + 0.1 * i for i in range(half)],
                "long_factor": [2.0 + 0.5 * i for i in range(half)], "original_max_position_embeddings": max_context}
        config = tf.Phi3Config(**{**common, "max_position_embeddings": max_context * 4}, sliding_window=FAMILY_WINDOW, rope_parameters=rope,
                               original_max_position_embeddings=max_context, tie_word_embeddings=False, pad_token_id=0)
        return config
    if family == "gemma3_text":
        return tf.Gemma3TextConfig(**common, head_dim=16, query_pre_attn_scalar=24, sliding_window=FAMILY_WINDOW,
                                   layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}},
                                   tie_word_embeddings=True, pad_token_id=0)
    raise ValueError(family)


FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma3_text")


def make_family(folder: Path, tok, family: str, seed: int = 3) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(family_config(family, len(tok))).eval()
    _randomize(model, seed, bias_scale=0.5, weight_scale=1.0)
    return _save(model, tok, folder)


def make_unsupported(folder: Path, tok, kind: str = "gemma2") -> Path:
    """Config + tokenizer only, no weights: an exporter that refuses by model_type before
    loading weights never notices the weights are missing."""
    from transformers import Gemma2Config, GPT2Config

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "gemma2":
        config = Gemma2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    else:
        config = GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4, n_positions=MAX_CONTEXT)
    config.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def load_hf(folder: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(folder))
    return model, tok


def hf_logits(model, ids: list[int]):
    """float32 logits [T, V] from transformers for a single sequence."""
    import torch

    with torch.no_grad():
        out = model(torch.tensor([ids], dtype=torch.int64), use_cache=False)
    return out.logits[0].float().numpy()


def export(model_folder: Path, out: Path, quant: str = "fp32", drafts: tuple[str, ...] = (), max_context: int = MAX_CONTEXT, attention: str | None = None, device: str = "cpu",
           block_size: int = 32, draft_block_size: int | None = None):
    from export.bundle import ExportConfig, export_bundle

    return export_bundle(
        ExportConfig(model=str(model_folder), out=Path(out), quant=quant, max_context=max_context, drafts=tuple(drafts), attention=attention, device=device,
                     block_size=block_size, draft_block_size=draft_block_size),
        log=lambda message: None,
    )


PROMPT = "the quick brown fox jumps over the lazy dog and"


@contextlib.contextmanager
def old_dml_profile():
    """--device dml as it was before the kernel facts: fused GroupQueryAttention graphs and 3-input
    (symmetric) MatMulNBits, to show
    what the placement check and the emulations say of them."""
    from edge_spec.profiles import PROFILES

    saved = PROFILES["dml"]
    PROFILES["dml"] = dataclasses.replace(saved, attentions=("fused",), zero_points=False)
    try:
        yield
    finally:
        PROFILES["dml"] = saved


@contextlib.contextmanager
def coreml_graphs_without_slices():
    """--device coreml graphs as they were before the Core ML EP's input limit was a kernel fact:
    the embedding, LM head and merged gate/up whole, however wide."""
    from edge_spec import placement

    saved = placement.input_dim_limit
    placement.input_dim_limit = lambda provider: None
    try:
        yield
    finally:
        placement.input_dim_limit = saved


@contextlib.contextmanager
def coreml_norms_squared_in_float16():
    """--device coreml norms as they were before the scaled form: x * rsqrt(mean(x^2) + eps),
    which a float16 graph squares in float16."""
    import torch

    from export.static_cache import StageModule

    saved = StageModule.__dict__["_scaled_rms_norm"]
    StageModule._scaled_rms_norm = staticmethod(lambda x, weight, eps: weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)))
    try:
        yield
    finally:
        StageModule._scaled_rms_norm = saved
