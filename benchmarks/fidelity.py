"""How far a bundle's next-token distributions are from the checkpoint's, the way the field
measures it: KL divergence and same-top-1 against transformers in float32 on a fixed text.

    python -m benchmarks fidelity MODEL BUNDLE [BUNDLE ...] [--text FILE] [--ctx 512] [--chunks 8] [--out FILE.json]

MODEL is what the bundles were exported from (alias, folder, .gguf; a GGUF is dequantized, so the
reference is the file's own weights in float32). The text (default benchmarks/prompts/fidelity.txt,
this project's docs/architecture.md and docs/serving.md as of its commit) is cut into chunks of
--ctx tokens, each run from an empty cache, and the second half of each chunk is scored, as
llama.cpp's `llama-perplexity --kl-divergence` scores its windows, so the numbers are comparable.
Per bundle: mean KL(reference || bundle) in nats with its 99th percentile, the share of positions
whose top token equals the reference's, the perplexity ratio, and the bytes per weight its
MatMulNBits nodes read per pass (benchmarks.op_profile's account of the CPU kernel's layout).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

DEFAULT_TEXT = Path(__file__).with_name("prompts") / "fidelity.txt"


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def compare_logits(reference: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> dict:
    """Per-position KL(reference || logits), top-1 agreement and both next-token NLLs."""
    p, q = log_softmax(reference), log_softmax(logits[:, : reference.shape[1]])
    kl = (np.exp(p) * (p - q)).sum(-1)
    rows = np.arange(len(targets))
    return {"kl": kl, "same_top1": p.argmax(-1) == q.argmax(-1), "nll_ref": -p[rows, targets], "nll": -q[rows, targets]}


def summarize(parts: list[dict]) -> dict:
    kl = np.concatenate([x["kl"] for x in parts])
    same = np.concatenate([x["same_top1"] for x in parts])
    nll_ref = np.concatenate([x["nll_ref"] for x in parts])
    nll = np.concatenate([x["nll"] for x in parts])
    return {"positions": int(kl.size), "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)), "kl_max": float(kl.max()),
            "same_top1": float(same.mean()), "ppl_ratio": float(np.exp(nll.mean() - nll_ref.mean()))}


def weight_bytes(bundle: Path) -> dict:
    """Bytes per weight of the target's MatMulNBits nodes as the CPU kernel reads them."""
    from benchmarks.op_profile import matmul_nodes, matmulnbits_bytes
    from edge_spec.manifest import load_manifest

    manifest = load_manifest(bundle, check_hashes=False)
    files = {manifest.stages[s].file for s in manifest.target.stages}
    nodes = [a for f in files for a in matmul_nodes(bundle / f).values()]
    weights = sum(a["K"] * a["N"] for a in nodes if not a.get("dense"))  # a minimum matrix adds bytes, not weights
    read = sum(matmulnbits_bytes(a) for a in nodes)
    return {"matmul_weights": weights, "matmul_bytes_per_pass": read, "bits_per_weight": 8 * read / weights if weights else None}


def measure(model: str, bundles: list[str], text: Path = DEFAULT_TEXT, ctx: int = 512, chunks: int = 8, log=print) -> dict:
    """The reference's logits for every scored position first (then its weights go), then one
    bundle at a time: the peak is the larger of the two models plus those logits."""
    import gc

    import torch

    from export.sources import load_checkpoint
    from runtime.engine import Engine, EngineConfig
    from edge_spec.manifest import load_manifest
    from runtime.tokenizer import BundleTokenizer

    info = load_manifest(bundles[0], check_hashes=False).tokenizer
    tokenizer = BundleTokenizer(Path(bundles[0]) / info.file, info)
    ids = np.asarray(tokenizer.encode(text.read_text(), parse_special=False), dtype=np.int64)
    chunks = min(chunks, len(ids) // ctx)
    if chunks < 1:
        raise ValueError(f"{text}: {len(ids)} tokens, fewer than one chunk of {ctx}")
    first = ctx // 2
    windows = [ids[c * ctx : (c + 1) * ctx] for c in range(chunks)]
    checkpoint = load_checkpoint(model)
    references = []
    for c, window in enumerate(windows):
        with torch.no_grad():
            references.append(checkpoint.model(torch.from_numpy(window[None])).logits[0, first:-1].numpy().copy())
        log(f"reference chunk {c + 1}/{chunks}")
    del checkpoint
    gc.collect()
    rows = {}
    for bundle in bundles:
        engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
        parts = []
        for window, reference in zip(windows, references):
            engine.target.cache.reset()
            parts.append(compare_logits(reference, engine.target.forward(window)[first:-1], window[first + 1 :]))
        info = engine.bundle.manifest.target
        rows[bundle] = {"quant": info.quant, "block_size": info.block_size, "zero_points": info.zero_points, "gguf_blocks": info.gguf_blocks,
                        **weight_bytes(Path(bundle)), **summarize(parts)}
        log(f"{bundle}: {rows[bundle]}")
        del engine
        gc.collect()
    return {"model": model, "text": str(text), "ctx": ctx, "chunks": chunks, "scored_per_chunk": ctx - first - 1, "bundles": rows}
