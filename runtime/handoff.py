"""`python -m runtime handoff BUNDLE --engine vllm|sglang`: the serve command that runs the same
target and draft on a cluster engine, so clients of this box move with only a new base URL.

Argument names follow those engines' documentation (vLLM: `vllm serve MODEL --speculative-config
JSON` with method "draft_model" or "ngram", num_speculative_tokens, prompt_lookup_min/max;
SGLang: `python -m sglang.launch_server --model-path` with --speculative-algorithm STANDALONE or
NGRAM, --speculative-draft-model-path, --speculative-num-steps, --speculative-eagle-topk,
--speculative-num-draft-tokens, --speculative-ngram-min/max-match-window-size). Nothing here runs
either engine; the command is printed for an operator to run.
"""

from __future__ import annotations

import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path

from edge_spec.catalog import CATALOG
from edge_spec.drafters import ROLE_DRAFTERS, SPECS
from edge_spec.manifest import Manifest
from edge_spec.verify import expected_tokens_per_pass
from runtime.drafters.prompt_lookup import PromptLookupDrafter

ENGINES = ("vllm", "sglang")
MAX_DRAFT = 8  # the longest draft this suggests; beyond it E(α, γ) grows little for any α < 0.9


@dataclass(frozen=True)
class Handoff:
    engine: str
    argv: tuple[str, ...]
    speculative: dict
    notes: tuple[str, ...]

    def command(self) -> str:
        return " ".join(shlex.quote(a) for a in self.argv)

    def to_dict(self) -> dict:
        return {"engine": self.engine, "command": self.command(), "argv": list(self.argv),
                "speculative": self.speculative, "notes": list(self.notes)}


def hub_id(source: str) -> tuple[str, str | None]:
    """(what the engine should load, a note when it is not a hub id) from a manifest `source`."""
    if source.startswith("hub id "):
        return source[len("hub id "):].split(" ")[0], None
    if source.startswith("catalog GGUF "):
        name = Path(source[len("catalog GGUF "):]).name.lower()
        for entry in CATALOG.values():
            if entry.gguf_file and entry.gguf_file.lower() == name:
                return entry.hub_id, f"{name} was exported from the GGUF of {entry.hub_id}; the engine loads the hub checkpoint"
    path = source.split(" ")[-1]
    return path, f"source {source!r} is no hub id: copy that checkpoint to the cluster and pass its path"


def measured_alpha(results_file: str | Path) -> dict[str, float]:
    """Median per-request α by bench mode ("model", "lookup", ...) from `benchmarks bench` results.json.
    A file that cannot be read or is not JSON is a ValueError naming it (one line on the CLI)."""
    try:
        data = json.loads(Path(results_file).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"--bench-results {results_file}: {getattr(exc, 'strerror', None) or exc}") from None
    by_mode: dict[str, list[float]] = {}
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if isinstance(value.get("mode"), str) and isinstance(value.get("alpha"), (int, float)):
                by_mode.setdefault(value["mode"], []).append(float(value["alpha"]))
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return {mode: statistics.median(values) for mode, values in by_mode.items()}


def bench_mode(manifest: Manifest, method: str) -> str:
    """The bench mode (a drafter of edge_spec/drafters.py) whose α predicts what the engine will
    draft with: the draft role's drafter, else the first that copies from this text alone (the
    engines' n-gram lookup keeps nothing from earlier requests)."""
    if method in ("auto", "draft") and "draft" in manifest.models:
        return ROLE_DRAFTERS["draft"]
    return next(spec.name for spec in SPECS.values() if spec.copies and not spec.remembers)


def draft_length(alpha: float, cost_ratio: float) -> int:
    """γ that maximizes expected tokens per unit of work, E(α, γ) / (1 + γ·c)."""
    best, best_value = 1, 0.0
    for gamma in range(1, MAX_DRAFT + 1):
        value = expected_tokens_per_pass(alpha, gamma) / (1 + gamma * cost_ratio)
        if value > best_value + 1e-9:
            best, best_value = gamma, value
    return best


def _cost_ratio(manifest: Manifest) -> float:
    """Draft/target work per token, from the architectures (layers × hidden²): a device-free estimate."""
    t, d = manifest.models["target"].arch, manifest.models["draft"].arch
    return (d.n_layers * d.hidden_size**2) / (t.n_layers * t.hidden_size**2)


def plan(manifest: Manifest, engine: str, method: str = "auto", alpha: float | None = None, port: int = 8000) -> Handoff:
    if engine not in ENGINES:
        raise ValueError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    notes = []
    target, note = hub_id(manifest.target.source)
    if note:
        notes.append(note)
    if method == "auto":
        method = "draft" if "draft" in manifest.models else "lookup"
    if method == "draft" and "draft" not in manifest.models:
        raise ValueError("this bundle has no draft model; use --method lookup")
    context = manifest.target.arch.max_context
    lookup = PromptLookupDrafter()
    if method == "draft":
        draft, note = hub_id(manifest.models["draft"].source)
        if note:
            notes.append(note)
        cost = _cost_ratio(manifest)
    else:
        draft, cost = None, 0.0
    if alpha is None:
        gamma = 4
        notes.append("no measured α given (--alpha or --bench-results): draft length 4 is a default, not a measurement")
    else:
        gamma = draft_length(alpha, cost if method == "draft" else 0.02)
        notes.append(f"draft length {gamma} maximizes E(α={alpha:.3f}, γ)/(1+γ·{cost if method == 'draft' else 0.02:.3f})")
    if engine == "vllm":
        spec = ({"method": "draft_model", "model": draft, "num_speculative_tokens": gamma} if method == "draft" else
                {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_min": lookup.min_ngram,
                 "prompt_lookup_max": lookup.max_match})
        argv = ["vllm", "serve", target, "--host", "0.0.0.0", "--port", str(port), "--max-model-len", str(context),
                "--speculative-config", json.dumps(spec, separators=(",", ":"))]
    else:
        if method == "draft":
            spec = {"speculative-algorithm": "STANDALONE", "speculative-draft-model-path": draft,
                    "speculative-num-steps": gamma, "speculative-eagle-topk": 1, "speculative-num-draft-tokens": gamma + 1}
        else:
            spec = {"speculative-algorithm": "NGRAM", "speculative-num-draft-tokens": gamma,
                    "speculative-ngram-min-match-window-size": lookup.min_ngram,
                    "speculative-ngram-max-match-window-size": lookup.max_match}
        argv = ["python", "-m", "sglang.launch_server", "--model-path", target, "--host", "0.0.0.0", "--port", str(port),
                "--context-length", str(context)]
        for name, value in spec.items():
            argv += [f"--{name}", str(value)]
    notes.append("both engines take --api-key KEY: add it when the port is reachable from other machines")
    notes.append(f"both serve the OpenAI API at http://HOST:{port}/v1: point this box's clients there")
    return Handoff(engine, tuple(argv), spec, tuple(notes))
