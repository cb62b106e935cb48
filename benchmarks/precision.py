"""Logits of bundles against transformers fp32 on the same checkpoint.

    python -m benchmarks precision MODEL BUNDLE [BUNDLE ...] [--prompts N] [--out FILE.json]

MODEL is what the bundles were exported from (alias, folder, .gguf). For each bundle's target:
max |Δlogit| over every position of each prompt, and top-1 agreement (the fraction of positions
whose argmax equals transformers'). Prompts: HumanEval chat prompts and two raw prompts.
"""

from __future__ import annotations

import numpy as np


def compare(model: str, bundles: list[str], n_prompts: int) -> dict:
    import torch

    from export.sources import load_checkpoint
    from benchmarks.bench import load_prompts
    from runtime.engine import Engine, EngineConfig

    checkpoint = load_checkpoint(model)
    engines = {b: Engine(b, EngineConfig(drafter="none", calibrate=False)) for b in bundles}
    first = next(iter(engines.values()))
    prompt_ids = [first.encode(prompt=p) for p in ("def quicksort(items):\n", "The history of the printing press")]
    prompt_ids += [first.encode(messages=list(p.messages)) for p in load_prompts(f"humaneval:{n_prompts}")]
    rows = {}
    for bundle, engine in engines.items():
        diffs, agree, total = [], 0, 0
        for ids in prompt_ids:
            with torch.no_grad():
                reference = checkpoint.model(torch.tensor([ids])).logits[0].numpy()  # [T,V]
            engine.target.cache.reset()
            logits = engine.target.forward(ids)  # [T,V]
            diffs.append(float(np.abs(logits - reference[:, : logits.shape[1]]).max()))
            agree += int((logits.argmax(-1) == reference.argmax(-1)).sum())
            total += len(ids)
        rows[bundle] = {
            "quant": engine.bundle.manifest.target.quant,
            "max_abs_diff": max(diffs),
            "top1_agreement": agree / total,
            "positions": total,
        }
        print(f"{bundle}: {rows[bundle]}", flush=True)
    return rows
