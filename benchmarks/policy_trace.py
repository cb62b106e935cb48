"""python -m benchmarks policy_trace BUNDLE --out FILE.json [--prompts SPEC] [--drafter auto] [--max-new-tokens 128] [--target-ms 10,1.5] [--draft-ms 2.5,0.4]
python -m benchmarks policy_trace --compare A.json B.json

The rounds the round policy plays on a bundle (greedy, each prompt), under a virtual clock:
every forward pass advances it by a fixed cost of its rows (target: A + B ms a row, from
--target-ms; draft model: --draft-ms), so the policy's inputs do not depend on the host and two
commits of the code can be compared round for round (`--compare`). The host's noise moves
adaptive rounds with every run (their costs are measured); this removes it, so a difference
left is a difference in behaviour. Only the API both sides of a restructuring keep is used (the
Engine, its target, drafter and policy, `runtime.loop.decode_steps`), so an older checkout runs
this file too: `PYTHONPATH=OLD python benchmarks/policy_trace.py ...` from OLD.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _costs(text: str) -> tuple[float, float]:
    parts = text.split(",")
    try:
        fixed, per_row = (float(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MS,MS_PER_ROW such as 10,1.5, got {text!r}") from None
    if fixed < 0 or per_row < 0 or fixed + per_row <= 0:
        raise argparse.ArgumentTypeError(f"costs must be >= 0 and not both 0, got {text!r}")
    return fixed / 1000, per_row / 1000


def trace(bundle: str, prompts: list[dict], drafter: str, max_new_tokens: int, target_s: tuple[float, float],
          draft_s: tuple[float, float]) -> dict[str, list]:
    """Per prompt id, the rounds as [drafter, γ, accepted, committed token ids]."""
    import numpy as np

    import runtime.model as model
    from edge_spec.sampling import SamplingConfig
    from runtime.engine import Engine, EngineConfig
    from runtime.gamma import GammaConfig
    from runtime.loop import decode_steps

    now = [0.0]
    engine = Engine(bundle, EngineConfig(provider="cpu", drafter=drafter, calibrate=False))
    # Every pass: `score` where the pass contract has it (forward and prefill go through it), else `forward`.
    method = "score" if hasattr(model.ModelRunner, "score") else "forward"
    target, passes = engine.target, getattr(model.ModelRunner, method)

    def timed(runner, tokens, *args, **kwargs):
        fixed, per_row = target_s if runner is target else draft_s
        now[0] += fixed + per_row * len(getattr(tokens, "tokens", tokens))
        return passes(runner, tokens, *args, **kwargs)

    setattr(model.ModelRunner, method, timed)
    try:
        rounds = {}
        for prompt in prompts:
            ids = engine.encode(messages=prompt["messages"]) if prompt.get("messages") else engine.encode(prompt["prompt"])
            policy = engine.policy.start(engine.drafter, max_new_tokens, GammaConfig())
            played, n = [], 0
            for step in decode_steps(target, engine.drafter, ids, SamplingConfig(temperature=0.0), np.random.default_rng(0), policy,
                                     lambda: now[0]):
                played.append([step.drafter, step.gamma, step.n_accepted, list(step.tokens)])
                n += len(step.tokens)
                if n >= max_new_tokens:
                    break
            rounds[prompt["id"]] = played
        return rounds
    finally:
        setattr(model.ModelRunner, method, passes)


def compare(a: dict, b: dict) -> dict:
    """a, b: the traces' rounds by prompt id. Per prompt of either: rounds on each side, and the first round that differs (None: equal)."""
    out = {}
    for key in sorted(set(a) | set(b)):
        left, right = a.get(key), b.get(key)
        if left is None or right is None:
            out[key] = {"rounds": [None if left is None else len(left), None if right is None else len(right)], "first_difference": "missing"}
            continue
        first = next((i for i, (x, y) in enumerate(zip(left, right)) if x != y), None)
        if first is None and len(left) != len(right):
            first = min(len(left), len(right))
        out[key] = {"rounds": [len(left), len(right)], "first_difference": first}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks policy_trace", description=__doc__.splitlines()[3])
    parser.add_argument("bundle", nargs="?")
    parser.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two traces written by --out: which prompts' rounds differ, and where")
    parser.add_argument("--prompts", default="humaneval:6,stdlib-edit:4", help="as bench's --prompts")
    parser.add_argument("--drafter", default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--target-ms", type=_costs, default=_costs("10,1.5"), help="a target pass's virtual cost: MS,MS_PER_ROW")
    parser.add_argument("--draft-ms", type=_costs, default=_costs("2.5,0.4"), help="a draft-model pass's virtual cost: MS,MS_PER_ROW")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    if args.compare:
        traces = []
        for path in args.compare:
            try:
                traces.append(json.loads(Path(path).read_text())["rounds"])
            except (OSError, ValueError, KeyError) as exc:
                parser.error(f"{path}: not a policy_trace output ({exc})")
        report = compare(*traces)
        print(json.dumps(report, indent=1))
        same = all(r["first_difference"] is None for r in report.values())
        print(f"{sum(r['first_difference'] is None for r in report.values())}/{len(report)} prompts play the same rounds")
        return 0 if same else 1
    if not args.bundle or not args.out:
        parser.error("give BUNDLE and --out, or --compare A B")
    if args.max_new_tokens < 1:
        parser.error("--max-new-tokens must be >= 1")
    from benchmarks.bench.prompts import PromptsError, load_prompts

    try:
        prompts = [{"id": p.id, "messages": list(p.messages) if p.messages else None, "prompt": p.prompt} for p in load_prompts(args.prompts)
                   if p.messages or p.prompt]
    except PromptsError as exc:
        parser.error(str(exc))
    if not prompts:
        parser.error(f"--prompts {args.prompts!r} has no single-turn prompts")
    rounds = trace(args.bundle, prompts, args.drafter, args.max_new_tokens, args.target_ms, args.draft_ms)
    settings = {"drafter": args.drafter, "max_new_tokens": args.max_new_tokens, "target_s": args.target_ms, "draft_s": args.draft_ms}
    Path(args.out).write_text(json.dumps({"bundle": args.bundle, "settings": settings, "rounds": rounds}, separators=(",", ":")))
    counts = {key: [len(r), sum(1 for x in r if x[1])] for key, r in rounds.items()}
    print(json.dumps({"rounds, drafted": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
