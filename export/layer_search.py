"""`--draft layer-skip:auto`: which of the target's layers a self-speculative draft keeps, chosen
by measurement on calibration text the project ships, on the fp32 checkpoint export loaded.

1. One forward pass over the calibration tokens records each decoder layer's input and output
   hidden states; a layer's influence is 1 - their mean cosine similarity (how much it turns the
   residual stream), and the pass's top-1 tokens are the reference.
2. For several counts k, the k layers of least total influence that form at most
   MAX_SKIPPED_RUNS runs (layer 0 and the last layer always kept) are a candidate.
3. Each candidate runs with its skipped layers' forward replaced by the identity; α is its
   teacher-forced top-1 agreement with the reference.
4. The chosen candidate has the best expected speedup E(α, γ) / (γ·c + V(γ+1)·(1 + o)) over γ
   (edge_spec.layer_subset.best_speedup), c its cost share from the weights it reads and the
   session runs it makes, V the verify curve, o the split target's extra session runs.
"""

from __future__ import annotations

import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from edge_spec import layer_subset as ls
from edge_spec.manifest import LayerCandidate, LayerSearch

DEFAULT_TOKENS = 512
MIN_TOKENS, MAX_TOKENS = 32, 8192
# Candidate sizes as shares of the layers: coarse steps, each candidate costs one forward pass.
SKIP_SHARES = (0.1, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5)
# A fixed slice of text every export machine has: standard-library code, then this project's README.
CODE_FILES = ("textwrap.py", "json/decoder.py", "heapq.py")
PROSE_FILE = Path(__file__).resolve().parent.parent / "README.md"
# One more ONNX Runtime session run (its fixed cost: binding, thread pool wake-up), in full target
# passes; an estimate for 0.1-1.5B models on a CPU, an option where it is measured.
DEFAULT_STAGE_COST = 0.02


@dataclass(frozen=True)
class SearchConfig:
    tokens: int = DEFAULT_TOKENS
    curve: tuple[float, ...] = ls.verify_curve("cpu")
    stage_cost: float = DEFAULT_STAGE_COST
    max_runs: int = ls.MAX_SKIPPED_RUNS

    def __post_init__(self):
        if isinstance(self.tokens, bool) or not isinstance(self.tokens, int) or not MIN_TOKENS <= self.tokens <= MAX_TOKENS:
            raise ValueError(f"--layer-search-tokens {self.tokens!r}: give {MIN_TOKENS}..{MAX_TOKENS} calibration tokens")
        if not 0 <= self.stage_cost < 1:
            raise ValueError(f"--layer-search-stage-cost {self.stage_cost!r}: give a share of a target pass in [0, 1)")
        if not 1 <= self.max_runs <= ls.MAX_SKIPPED_RUNS:
            raise ValueError(f"skipped runs {self.max_runs!r}: 1..{ls.MAX_SKIPPED_RUNS}")


@dataclass(frozen=True)
class Calibration:
    ids: np.ndarray  # int64 [T]
    description: str


def calibration(tokenizer, n_tokens: int) -> Calibration:
    """n_tokens ids: half from the standard-library files, half from the README (all from the
    code when the README is not beside the package), BOS first when the tokenizer has one."""
    root = Path(sysconfig.get_paths()["stdlib"])
    code = "\n".join((root / name).read_text(encoding="utf-8") for name in CODE_FILES if (root / name).is_file())
    prose = PROSE_FILE.read_text(encoding="utf-8") if PROSE_FILE.is_file() else ""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    room = n_tokens - len(bos)
    code_ids = tokenizer(code, add_special_tokens=False)["input_ids"]
    prose_ids = tokenizer(prose, add_special_tokens=False)["input_ids"] if prose else []
    take_prose = min(len(prose_ids), room // 2)
    ids = np.asarray(bos + code_ids[: room - take_prose] + prose_ids[:take_prose], dtype=np.int64)
    if len(ids) < MIN_TOKENS:
        raise ValueError(f"the calibration text gives {len(ids)} tokens, fewer than {MIN_TOKENS}")
    files = ", ".join(n for n in CODE_FILES if (root / n).is_file())
    words = f"standard library of Python {sysconfig.get_python_version()} ({files}): {len(ids) - take_prose - len(bos)} tokens"
    if take_prose:
        words += f", then edge-spec README.md: {take_prose} tokens"
    return Calibration(ids, words)


def least_influential(influence: list[float], k: int, max_runs: int) -> tuple[int, ...] | None:
    """The k layers of least total influence forming at most max_runs runs, never the first or
    the last layer; None when no such set exists. Dynamic programming over layers in order."""
    n = len(influence)
    # best[(skipped, runs, last skipped)] = (total influence, skipped layers)
    best: dict[tuple[int, int, bool], tuple[float, tuple[int, ...]]] = {(0, 0, False): (0.0, ())}
    for layer in range(n):
        step: dict[tuple[int, int, bool], tuple[float, tuple[int, ...]]] = {}

        def offer(key, value):
            if key not in step or value < step[key]:  # ties go to the earlier layers, whatever the order offered
                step[key] = value

        for (count, runs, was_skipped), (total, chosen) in best.items():
            offer((count, runs, False), (total, chosen))
            if 0 < layer < n - 1 and count < k:
                new_runs = runs + (not was_skipped)
                if new_runs <= max_runs:
                    offer((count + 1, new_runs, True), (total + influence[layer], chosen + (layer,)))
        best = step
    found = [v for (count, _, _), v in best.items() if count == k]
    return min(found)[1] if found else None


def _param_count(module) -> int:
    return sum(p.numel() for p in module.parameters())


class _Skipping:
    """Within the block, the layers named run as the identity: their forward is replaced on the
    instance (nothing of theirs is computed) and restored afterwards."""

    def __init__(self, layers, skipped, tuple_output: bool):
        self.layers, self.skipped, self.tuple_output = layers, skipped, tuple_output

    def __enter__(self):
        def identity(hidden_states, *args, **kwargs):
            return (hidden_states,) if self.tuple_output else hidden_states

        for i in self.skipped:
            self.layers[i].forward = identity
        return self

    def __exit__(self, *exc):
        for i in self.skipped:
            del self.layers[i].forward


def search(model, tokenizer, config: SearchConfig, log: Callable[[str], None]) -> tuple[tuple[int, ...], LayerSearch]:
    """The kept layers to export and the record of the search (every weight of `model` loaded)."""
    import torch

    cal = calibration(tokenizer, config.tokens)
    layers = model.model.layers
    n_layers = len(layers)
    ids = torch.from_numpy(cal.ids)[None]
    log(f"layer search: {len(cal.ids)} calibration tokens, full pass with hidden states of {n_layers} layers")
    cosines: dict[int, float] = {}
    shapes: dict[str, bool] = {}

    def recorder(index):
        def hook(module, args, kwargs, output):
            hidden_in = args[0] if args else kwargs["hidden_states"]
            shapes["tuple"] = isinstance(output, tuple)
            hidden_out = output[0] if isinstance(output, tuple) else output
            cosines[index] = float(torch.nn.functional.cosine_similarity(hidden_in[0].double(), hidden_out[0].double(), dim=-1).mean())
        return hook

    handles = [layer.register_forward_hook(recorder(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            reference = model(input_ids=ids, use_cache=False).logits[0].argmax(-1)
    finally:
        for handle in handles:
            handle.remove()
    influence = [round(max(1.0 - cosines[i], 0.0), 6) for i in range(n_layers)]

    layer_params = [_param_count(layer) for layer in layers]
    head_params = _param_count(model.model.norm) + _param_count(model.lm_head)
    total = sum(layer_params) + head_params
    counts = sorted({min(max(1, round(n_layers * share)), n_layers - 2) for share in SKIP_SHARES})
    candidates, sets = [], {}
    for k in counts:
        skipped = least_influential(influence, k, config.max_runs)
        if skipped is None or skipped in sets.values():
            continue
        with _Skipping(layers, skipped, shapes.get("tuple", False)), torch.no_grad():
            predicted = model(input_ids=ids, use_cache=False).logits[0].argmax(-1)
        alpha = float((predicted == reference).double().mean())
        kept = tuple(i for i in range(n_layers) if i not in skipped)
        pieces = ls.segments(kept, n_layers)
        draft_runs = sum(1 for _, is_kept in pieces if is_kept) + 1
        cost_share = (sum(layer_params[i] for i in kept) + head_params) / total + config.stage_cost * draft_runs
        speedup, gamma = ls.best_speedup(alpha, cost_share, config.curve, config.stage_cost * len(pieces))
        candidate = LayerCandidate(ls.describe(kept), round(alpha, 4), round(cost_share, 4), gamma, round(speedup, 4))
        log(f"layer search: skip {k} ({ls.describe(skipped)}): alpha {candidate.alpha:.3f}, cost share {candidate.cost_share:.3f}, "
            f"expected speedup {candidate.speedup:.3f} at gamma {gamma}")
        candidates.append(candidate)
        sets[candidate.kept] = skipped
    chosen = max(candidates, key=lambda c: (c.speedup, -c.cost_share))
    kept = tuple(i for i in range(n_layers) if i not in sets[chosen.kept])
    digest = hashlib.sha256(cal.ids.astype("<i8").tobytes()).hexdigest()
    record = LayerSearch(cal.description, digest, len(cal.ids), tuple(influence), tuple(config.curve), config.stage_cost, tuple(candidates), chosen.kept)
    log(f"layer search: keeping layers {chosen.kept} of {n_layers} (alpha {chosen.alpha:.3f}, cost share {chosen.cost_share:.3f})")
    return kept, record
