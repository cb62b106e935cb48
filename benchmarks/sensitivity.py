"""Which weights the quantization error costs the most in KL: each role's matrices alone quantized
(export.quantize's fitted blocks, emulated in float32 in transformers), every other weight exact.

    python -m benchmarks sensitivity MODEL [--schemes int4/128,int4/64,int8/128] [--chunks 2] [--ctx 512] [--out FILE.json]

Roles are the exporter's matrices: qkv (q, k and v projections: one merged node in the graphs), o,
gate_up (one merged node), down and lm_head. Per role and scheme: the KL divergence and same-top-1
against the unquantized model on the fidelity text (benchmarks/fidelity.py's text and scoring),
the role's share of the weights, and the bytes per pass its matrices cost the CPU kernel at that
scheme, so a mix can be chosen by KL per byte. Activations are not quantized here (the kernel's
int8 activations at accuracy level 4 are not emulated): it ranks weights, the bundle is measured
with `benchmarks fidelity`.
"""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np

ROLE_MODULES = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
    "lm_head": ("lm_head",),
}


def parse_scheme(text: str) -> tuple[int, int]:
    bits, _, block = text.removeprefix("int").partition("/")
    if bits not in ("4", "8") or not block.isdigit():
        raise ValueError(f"scheme {text!r}: write int4/BLOCK or int8/BLOCK")
    return int(bits), int(block)


def fake_quantized(weight: np.ndarray, bits: int, block: int) -> np.ndarray:
    """weight [N, K] through export.quantize.fit_blocks and back (K padded to whole blocks)."""
    from export.quantize import fit_blocks

    n, k = weight.shape
    padded = np.zeros((n, -(-k // block) * block), np.float32)
    padded[:, :k] = weight
    out = np.empty_like(padded)
    for r in range(0, n, 8192):
        q, s, z = fit_blocks(padded[r : r + 8192], bits, block)
        out[r : r + 8192] = ((q.astype(np.float32) - z[..., None]) * s[..., None]).reshape(q.shape[0], -1)
    return out[:, :k]


def run(model: str, schemes: list[str], chunks: int = 2, ctx: int = 512, text: Path | None = None, log=print) -> dict:
    import torch

    from benchmarks.fidelity import DEFAULT_TEXT, compare_logits, summarize
    from export.gguf_blocks import matmul_kernel_bits
    from export.sources import load_checkpoint

    checkpoint = load_checkpoint(model)
    net = checkpoint.model
    if net.lm_head.weight is net.get_input_embeddings().weight:  # quantizing the head must leave the embedding exact
        net.lm_head.weight = torch.nn.Parameter(net.lm_head.weight.detach().clone())
    ids = np.asarray(checkpoint.tokenizer((text or DEFAULT_TEXT).read_text(), add_special_tokens=False)["input_ids"], dtype=np.int64)
    chunks = min(chunks, len(ids) // ctx)
    first = ctx // 2
    windows = [ids[c * ctx : (c + 1) * ctx] for c in range(chunks)]

    def logits() -> list[np.ndarray]:
        with torch.no_grad():
            return [net(torch.from_numpy(w[None])).logits[0, first:-1].numpy().copy() for w in windows]

    reference = logits()
    modules = {role: [(name, m) for name, m in net.named_modules() if isinstance(m, torch.nn.Linear) and name.endswith(suffixes)]
               for role, suffixes in ROLE_MODULES.items()}
    total = sum(m.weight.numel() for ms in modules.values() for _, m in ms)
    rows = {}
    for role, members in modules.items():
        params = sum(m.weight.numel() for _, m in members)
        for scheme in schemes:
            bits, block = parse_scheme(scheme)
            saved = [m.weight.data.clone() for _, m in members]
            for _, m in members:
                m.weight.data = torch.from_numpy(fake_quantized(m.weight.data.numpy(), bits, block))
            got = logits()
            for (_, m), w in zip(members, saved):
                m.weight.data = w
            del saved
            gc.collect()
            parts = [compare_logits(r, g, w[first + 1 :]) for r, g, w in zip(reference, got, windows)]
            row = {"role": role, "scheme": scheme, "params": params, "share": params / total,
                   "mib_per_pass": params * matmul_kernel_bits(bits, block) / 8 / 2**20, **summarize(parts)}
            rows[f"{role} {scheme}"] = row
            log(f"{role} {scheme}: KL {row['kl_mean']:.5f}, same top-1 {row['same_top1']:.4f}, {row['mib_per_pass']:.0f} MiB per pass")
    return {"model": model, "chunks": chunks, "ctx": ctx, "rows": rows}
