"""What block-stable mode costs: the same prompts decoded with it off and on, alternately.

    python -m benchmarks block_stable_cost BUNDLE [--prompts SPEC] [--tokens N] [--drafters none,auto] [--out FILE.json]

One engine per mode, loaded side by side; for every prompt and drafter the two modes run back
to back (the order alternating), greedy. Reports per drafter the median decode tokens/s of each
mode and the median of the per-prompt ratios (on / off).
"""

from __future__ import annotations

import numpy as np


def run(bundle: str, prompts_spec: str, n_tokens: int, drafters: list[str]) -> dict:
    from benchmarks.bench import load_prompts
    from runtime.engine import Engine, EngineConfig, GenerateConfig

    engines = {mode: Engine(bundle, EngineConfig(drafter="auto", block_stable=mode == "on")) for mode in ("off", "on")}
    prompts = [engines["off"].encode(messages=list(p.messages)) if p.messages else engines["off"].encode(prompt=p.prompt)
               for p in load_prompts(prompts_spec)]
    config = GenerateConfig(max_new_tokens=n_tokens)
    out = {"bundle": bundle, "tokens": n_tokens, "prompts": len(prompts), "drafters": {}}
    for drafter in drafters:
        speed = {"off": [], "on": []}
        for i, ids in enumerate(prompts):
            for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                engine = engines[mode]
                engine.use_drafter(drafter if drafter != "none" else "lookup", gamma=None)
                result = engine.generate(ids, config, speculative=drafter != "none")
                speed[mode].append(result.timings["decode_tokens_per_s"])
        ratios = np.array(speed["on"]) / np.array(speed["off"])
        out["drafters"][drafter] = {
            "tokens_per_s_off": float(np.median(speed["off"])),
            "tokens_per_s_on": float(np.median(speed["on"])),
            "ratio_on_off_median": float(np.median(ratios)),
            "per_prompt_ratio": ratios.round(3).tolist(),
        }
        print(drafter, out["drafters"][drafter], flush=True)
    return out
