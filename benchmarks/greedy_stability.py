"""Does a position's logit row depend on the block it is computed in?

    python -m benchmarks greedy_stability BUNDLE [BUNDLE ...] [--prompts SPEC] [--tokens N] [--out FILE.json]

Per bundle (its target role): greedy-decode each prompt plainly, one token per pass, keeping
every row of logits; then feed the same tokens again in blocks of T = 2…9 (as a verify pass
does: the pending token and T − 1 drafted ones) and compare each block row with the 1-token
row of the same position. Reports per T the distribution of max |Δlogit| per row (median,
p90, max) and the share of rows whose argmax differs; then, per drafter the bundle offers and
with block-stable mode off and on (runtime/model.py: every target pass scores at least two
positions), how many greedy runs are token-identical to plain decoding, and plain decoding's
time per token in each mode (its cost).
"""

from __future__ import annotations

import numpy as np

from edge_spec.drafters import ROLE_DRAFTERS

BLOCKS = tuple(range(2, 10))


def _plain_rows(engine, prompt_ids: list[int], n_tokens: int) -> tuple[list[int], np.ndarray]:
    """Greedy tokens after the prompt and the 1-token logits row that chose each."""
    target = engine.target
    target.cache.reset()
    target.prefill(prompt_ids[:-1])
    tokens, rows = list(prompt_ids), []
    for _ in range(n_tokens):
        row = target.forward(tokens[-1:])[0]  # [V]
        rows.append(row)
        tokens.append(int(np.argmax(row)))
    return tokens, np.stack(rows)  # rows[i] scores position len(prompt)+i


def block_deltas(engine, prompt_ids: list[int], n_tokens: int) -> dict[int, dict]:
    tokens, plain = _plain_rows(engine, prompt_ids, n_tokens)
    target, start = engine.target, len(prompt_ids) - 1  # row 0's input is the last prompt token
    out = {}
    for block in BLOCKS:
        deltas, flips = [], 0
        for offset in range(0, n_tokens - block + 1, block):
            target.cache.rollback_to_prefix(np.asarray(tokens[: start + offset], dtype=np.int64))
            if target.cache.kv_len != start + offset:  # rollback keeps only matching rows
                target.cache.reset()
                target.prefill(tokens[: start + offset])
            rows = target.forward(tokens[start + offset : start + offset + block])  # [T,V]
            reference = plain[offset : offset + block]
            deltas += np.abs(rows - reference).max(axis=1).tolist()
            flips += int((rows.argmax(1) != reference.argmax(1)).sum())
        out[block] = {"rows": len(deltas), "deltas": deltas, "argmax_flips": flips}
    return out


def identical_runs(engine, prompts: list[list[int]], n_tokens: int, drafters: list[str]) -> dict:
    from runtime.engine import GenerateConfig

    config = GenerateConfig(max_new_tokens=n_tokens)
    plain = [engine.generate(ids, config, speculative=False) for ids in prompts]
    out = {"plain_ms_per_token": float(np.median([1e3 / r.timings["decode_tokens_per_s"] for r in plain]))}
    for drafter in drafters:
        engine.use_drafter(drafter, gamma=None)
        same = sum(engine.generate(ids, config).token_ids == ref.token_ids for ids, ref in zip(prompts, plain))
        out[drafter] = {"identical": same, "runs": len(prompts)}
    return out


def summarize(per_prompt: list[dict[int, dict]]) -> dict:
    table = {}
    for block in BLOCKS:
        deltas = np.concatenate([np.asarray(p[block]["deltas"]) for p in per_prompt])
        flips = sum(p[block]["argmax_flips"] for p in per_prompt)
        table[str(block)] = {
            "rows": int(deltas.size),
            "median": float(np.median(deltas)),
            "p90": float(np.quantile(deltas, 0.9)),
            "max": float(deltas.max()),
            "argmax_flip_share": flips / max(int(deltas.size), 1),
        }
    return table


def run(bundles: list[str], prompts_spec: str, n_tokens: int, modes: tuple[str, ...] = ("default", "block_stable"), delta_prompts: int = 4) -> dict:
    from benchmarks.bench import load_prompts
    from runtime.engine import Engine, EngineConfig

    results = {}
    for bundle in bundles:
        engine = Engine(bundle, EngineConfig(drafter="none", calibrate=False))
        prompts = [engine.encode(messages=list(p.messages)) if p.messages else engine.encode(prompt=p.prompt) for p in load_prompts(prompts_spec)]
        per_prompt = [block_deltas(engine, ids, 32) for ids in prompts[:delta_prompts]]
        models = engine.bundle.manifest.models
        drafters = ["lookup"] + [d for role, d in ROLE_DRAFTERS.items() if role in models]
        row = {
            "quant": engine.bundle.manifest.target.quant,
            "device": engine.bundle.manifest.device,
            "blocks": summarize(per_prompt),
        }
        del engine
        for mode in modes:
            engine = Engine(bundle, EngineConfig(drafter="none", block_stable=mode == "block_stable"))
            row[mode] = identical_runs(engine, prompts, n_tokens, drafters)
            del engine
        results[bundle] = row
        print(f"{bundle}: {row}", flush=True)
    return results
