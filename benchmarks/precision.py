"""Logits of bundles against transformers fp32 on the same checkpoint.

    python benchmarks/precision.py MODEL BUNDLE [BUNDLE ...] [--prompts N] [--out FILE.json]

MODEL is what the bundles were exported from (alias, folder, .gguf). For each bundle's target:
max |Δlogit| over every position of each prompt, and top-1 agreement (the fraction of positions
whose argmax equals transformers'). Prompts: HumanEval chat prompts and two raw prompts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--prompts", type=int, default=5)
    parser.add_argument("--out")
    args = parser.parse_args()

    import torch

    from export.sources import load_checkpoint
    from runtime.bench import load_prompts
    from runtime.engine import Engine, EngineConfig

    checkpoint = load_checkpoint(args.model)
    engines = {b: Engine(b, EngineConfig(drafter="none", calibrate=False)) for b in args.bundles}
    first = next(iter(engines.values()))
    prompt_ids = [first.encode(prompt=p) for p in ("def quicksort(items):\n", "The history of the printing press")]
    prompt_ids += [first.encode(messages=list(p.messages)) for p in load_prompts(f"humaneval:{args.prompts}")]
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
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
