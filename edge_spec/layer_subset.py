"""Layer-skip drafts as sets of kept layers: the export spec, the stage cut, and the cost model.

A layer-skip draft runs a subset of the target's layers with the target's own stage graphs:
the target is cut into consecutive segments at the edges of the skipped runs, the target runs
every segment and the draft only the kept ones, then the head. Shared by export (which cuts the
graphs and searches the subset), the memory planner and the manifest's checks.

Spec forms (export --draft):
- `layer-skip:N`: the first N layers (a prefix: one skipped run, the tail);
- `layer-skip:0-9,14-20,24-27`: the layers named, each item a layer or an inclusive range;
- `layer-skip:auto`: the subset export measures on calibration text (export.layer_search).
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "layer-skip:"
AUTO = "auto"
# Each skipped run cuts the target once more: one more session run in every target pass and, for a
# run followed by kept layers, in every draft step; past three the overhead eats what skipping saves.
MAX_SKIPPED_RUNS = 3
MAX_SEARCH_GAMMA = 8  # the longest draft the search's cost model considers (the runtime's own default)


class LayerSpecError(ValueError):
    """A layer-skip spec that names no usable subset, in one line."""


@dataclass(frozen=True)
class LayerSkipSpec:
    text: str  # as written, "layer-skip:..."
    kept: tuple[int, ...] | None  # ascending layer indices; None for auto (chosen at export)

    @property
    def auto(self) -> bool:
        return self.kept is None


def is_layer_skip(spec: str) -> bool:
    return spec.startswith(PREFIX)


def parse(spec: str, n_layers: int | None = None) -> LayerSkipSpec:
    """The spec's kept layers, checked against `n_layers` when known; LayerSpecError otherwise."""
    if not is_layer_skip(spec):
        raise LayerSpecError(f"{spec!r} is not a layer-skip draft (write layer-skip:N, layer-skip:0-9,14-20 or layer-skip:auto)")
    body = spec[len(PREFIX) :]
    if body == AUTO:
        if n_layers is not None and n_layers < 3:
            raise LayerSpecError(f"{spec!r}: the search keeps the first and last layers and skips one between; the model has {n_layers}")
        return LayerSkipSpec(spec, None)
    if body.isdigit():
        count = int(body)
        if count < 1 or (n_layers is not None and count >= n_layers):
            upper = f" and {n_layers - 1}" if n_layers is not None else ""
            raise LayerSpecError(f"{spec!r}: N must be a layer count between 1{upper}")
        return LayerSkipSpec(spec, tuple(range(count)))
    kept: list[int] = []
    for item in body.split(","):
        low, dash, high = item.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise LayerSpecError(f"{spec!r}: {item!r} is not a layer or a range a-b (write layer-skip:N, layer-skip:0-9,14-20 or layer-skip:auto)")
        first, last = int(low), int(high) if dash else int(low)
        if last < first or (kept and first <= kept[-1]):
            raise LayerSpecError(f"{spec!r}: list the kept layers in ascending order without overlap")
        kept.extend(range(first, last + 1))
    return LayerSkipSpec(spec, check_kept(tuple(kept), n_layers, spec))


def check_kept(kept: tuple[int, ...], n_layers: int | None, where: str) -> tuple[int, ...]:
    """Kept layers a draft can run: layer 0 among them (the first segment is a prefix, whose output
    the verify pass reuses), at least one skipped, at most MAX_SKIPPED_RUNS skipped runs."""
    if not kept or kept[0] != 0:
        raise LayerSpecError(f"{where!r}: keep layer 0 (the draft's first stage is the target's, with the embedding)")
    if n_layers is not None:
        if kept[-1] >= n_layers:
            raise LayerSpecError(f"{where!r}: layer {kept[-1]} is past the model's last layer {n_layers - 1}")
        if len(kept) == n_layers:
            raise LayerSpecError(f"{where!r}: keeps all {n_layers} layers; skip at least one")
        runs = len(skipped_runs(kept, n_layers))
        if runs > MAX_SKIPPED_RUNS:
            raise LayerSpecError(f"{where!r}: {runs} skipped runs; at most {MAX_SKIPPED_RUNS} (each one more session run per pass)")
    return kept


def segments(kept: tuple[int, ...], n_layers: int) -> list[tuple[range, bool]]:
    """The target's layers cut into maximal runs, each (layers, kept by the draft), in order."""
    kept_set, cuts = set(kept), []
    start = 0
    for i in range(1, n_layers + 1):
        if i == n_layers or (i in kept_set) != (start in kept_set):
            cuts.append((range(start, i), start in kept_set))
            start = i
    return cuts


def skipped_runs(kept: tuple[int, ...], n_layers: int) -> list[range]:
    return [layers for layers, is_kept in segments(kept, n_layers) if not is_kept]


def describe(kept: tuple[int, ...]) -> str:
    """Kept layers in the explicit spec's form: (0..9, 14..20) -> "0-9,14-20"."""
    items, start = [], None
    for i, layer in enumerate(kept):
        if start is None:
            start = layer
        if i + 1 == len(kept) or kept[i + 1] != layer + 1:
            items.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ",".join(items)


# -- the cost model the search chooses by ---------------------------------------------------------


def expected_tokens(alpha: float, gamma: int) -> float:
    """Tokens one round yields when each drafted token is accepted with probability α: (1-α^(γ+1))/(1-α)."""
    if alpha >= 1.0:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


def verify_curve(kind: str, max_gamma: int = MAX_SEARCH_GAMMA) -> tuple[float, ...]:
    """V(k) for k = 1..max_gamma+1 rows, relative to a 1-row pass. `cpu`: 1 + 0.4·(k-1) (BENCHMARKS.md:
    a 3-row pass 1.64×, a 5-row pass 2.7× on this CPU); `flat`: 1 (a GPU's pass barely grows with rows);
    or comma-separated numbers, V(1) first (1.0), rising, at least max_gamma+1 of them."""
    if kind == "cpu":
        return tuple(round(1.0 + 0.4 * k, 3) for k in range(max_gamma + 1))
    if kind == "flat":
        return (1.0,) * (max_gamma + 1)
    try:
        values = tuple(float(v) for v in kind.split(","))
    except ValueError:
        raise LayerSpecError(f"verify curve {kind!r}: write cpu, flat, or V(1),V(2),... as numbers") from None
    if len(values) < max_gamma + 1 or values[0] != 1.0 or any(b < a for a, b in zip(values, values[1:])):
        raise LayerSpecError(f"verify curve {kind!r}: give {max_gamma + 1} costs V(1)=1.0,V(2),... that never fall")
    return values[: max_gamma + 1]


def best_speedup(alpha: float, cost_share: float, curve: tuple[float, ...], target_overhead: float = 0.0) -> tuple[float, int]:
    """(speedup, γ) maximizing E(α, γ) / (γ·c + V(γ+1)·(1 + overhead)) over γ in 1..len(curve)-1,
    every cost in 1-row target passes; the overhead is the split target's extra session runs."""
    best = (0.0, 1)
    for gamma in range(1, len(curve)):
        speedup = expected_tokens(alpha, gamma) / (gamma * cost_share + curve[gamma] * (1.0 + target_overhead))
        if speedup > best[0] + 1e-12:
            best = (speedup, gamma)
    return best
