"""Exactness audit: do speculative samples follow the target's own law?

Each of N samples is the first K tokens of a speculative generation (a fixed γ by default, so
every sample drafts). Their exact law comes from the target itself,

    P(x1 … xK) = Π_k p(x_k | prompt, x_<k),

one 1-token target pass per distinct prefix the samples reached, through the same
`process_logits` as decoding (`exact_rows`).

The test is sequential goodness of fit. Given the tokens before position k, the samples that
share a prefix v (n_v of them) draw their next token from Multinomial(n_v, p_v) under the
null, independently across prefixes. Each prefix's cells are fixed by p_v alone: the tokens
it ranks highest until they hold all but `REST_MASS` of it (at most `MAX_CELLS`), plus one cell
for everything else, the mass no sample may have seen. Position k's statistic is the G
statistic summed over its prefixes; its p-value is simulated from the exact law given the n_v,
never asymptotic, with enough draws that the smallest p-value lies below the threshold. Each
position's test is valid given the earlier ones, so Bonferroni over K bounds the family-wise
error by alpha.

Power: the smallest total-variation distance at position 1 (every sample reaches it) that the
test detects with 80% probability at this N, for an alternative that moves mass from the
target's most likely token to its second (`detectable_tv`). A PASS also needs speculation to
have been exercised: every sample drafted, and some draft was rejected (else the residual
was never sampled).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from edge_spec.sampling import SamplingConfig, process_logits

MAX_CELLS = 64
REST_MASS = 1e-3
POWER = 0.8
ENDED = -1  # pads a sample that stopped (drew a stop token) before K tokens: nothing is drawn after a stop


@dataclass(frozen=True)
class AuditConfig:
    samples: int = 600
    positions: int = 3
    alpha: float = 0.01  # family-wise significance level
    simulations: int | None = None  # None: enough that the p-value floor is a tenth of the threshold
    seed: int = 0

    def __post_init__(self):
        if self.samples < 20:
            raise ValueError(f"samples must be at least 20, got {self.samples}")
        if not 1 <= self.positions <= 32:
            raise ValueError(f"positions must be 1..32, got {self.positions}")
        if not 0.0 < self.alpha < 0.5:
            raise ValueError(f"alpha must be in (0, 0.5), got {self.alpha}")
        if self.simulations is not None and (self.simulations + 1) * self.threshold <= 1:
            raise ValueError(f"{self.simulations} simulations cannot give a p-value below {self.threshold:.2g}")

    @property
    def threshold(self) -> float:
        return self.alpha / self.positions

    @property
    def n_simulations(self) -> int:
        return self.simulations or math.ceil(10 / self.threshold)


@dataclass(frozen=True)
class Node:
    """What the test keeps of p(· | prompt, prefix): its cells and their probabilities."""

    cells: np.ndarray  # [C] token ids, most likely first
    probs: np.ndarray  # [C+1] the cells' probabilities, then the rest

    @classmethod
    def of(cls, probs: np.ndarray) -> "Node":
        order = np.argsort(-probs, kind="stable")[:MAX_CELLS]
        mass = np.cumsum(probs[order])
        n = min(int(np.searchsorted(mass, 1.0 - REST_MASS)) + 1, len(order))
        cells = order[:n]
        kept = probs[cells].astype(np.float64)
        rest = float(np.delete(probs, cells).astype(np.float64).sum())  # summed, not 1 - kept: rounding must not empty it
        return cls(cells, np.append(kept, rest) / (kept.sum() + rest))

    def counts(self, tokens: list[int]) -> np.ndarray:
        index = {int(t): i for i, t in enumerate(self.cells)}
        out = np.zeros(len(self.probs), dtype=np.int64)
        for t in tokens:
            out[index.get(int(t), len(self.cells))] += 1
        return out


@dataclass(frozen=True)
class Row:
    """What the audit keeps of one prefix's p: its cells, and p at every token any sample drew
    at that position (a full row is the vocabulary's size, and there is one per prefix)."""

    node: Node
    at: dict[int, float]

    @classmethod
    def of(cls, probs: np.ndarray, tokens) -> "Row":
        return cls(Node.of(probs), {int(t): float(probs[int(t)]) for t in tokens})


def g_statistic(counts: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """G = 2 Σ O ln(O / E) over cells, for counts [..., C]; inf when a cell of probability 0
    was observed (an outcome the exact law rules out)."""
    counts = np.asarray(counts, dtype=np.float64)
    n = counts.sum(axis=-1, keepdims=True)
    expected = n * probs
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log(counts / expected), 0.0)
    return 2.0 * terms.sum(axis=-1)


def _prefixes(samples: np.ndarray, k: int) -> dict[tuple, list[int]]:
    """Position k's groups: prefix (k tokens) -> the next tokens of the samples sharing it; a
    sample that stopped before position k draws nothing there."""
    groups: dict[tuple, list[int]] = {}
    for row in samples:
        if row[k] == ENDED:
            continue
        groups.setdefault(tuple(int(t) for t in row[:k]), []).append(int(row[k]))
    return groups


@dataclass(frozen=True)
class PositionReport:
    position: int  # 1-based: the k-th generated token
    prefixes: int  # distinct prefixes the samples reached before it
    g: float
    p_value: float
    tv: float  # empirical TV against the exact marginal, estimated through the samples' prefixes
    impossible: int  # samples that drew a token the exact law gives probability 0


@dataclass(frozen=True)
class AuditReport:
    mode: str  # exact | plain
    drafter: str
    gamma: str
    samples: int
    alpha: float
    simulations: int
    positions: tuple[PositionReport, ...]
    drafted_tokens: int
    samples_drafted: int  # samples in which speculation drafted at least one token
    rejections: int  # rounds with a rejected draft (each samples the residual)
    residual_tokens: int  # audited tokens that came from a residual (or p without the draft)
    detectable_tv: float | None  # position 1, 80% power
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def threshold(self) -> float:
        return self.alpha / max(len(self.positions), 1)

    @property
    def exercised(self) -> bool:
        return self.samples_drafted == self.samples and self.rejections > 0

    @property
    def passed(self) -> bool:
        return self.exercised and all(p.p_value > self.threshold for p in self.positions)

    @property
    def verdict(self) -> str:
        if not self.exercised:
            return "NOT EXERCISED"
        return "PASS" if self.passed else "FAIL"

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(threshold=self.threshold, exercised=self.exercised, passed=self.passed, verdict=self.verdict)
        return out

    def lines(self) -> list[str]:
        lines = [
            f"{self.samples} samples, drafter {self.drafter}, gamma {self.gamma}: {self.drafted_tokens} tokens drafted "
            f"({self.samples_drafted}/{self.samples} samples drafted), {self.rejections} rejections, "
            f"{self.residual_tokens} audited tokens from the residual",
        ]
        for p in self.positions:
            extra = f", {p.impossible} impossible under the target" if p.impossible else ""
            lines.append(f"position {p.position}: TV {p.tv:.4f}, G {p.g:.1f} over {p.prefixes} prefixes, p-value {p.p_value:.4f}{extra}")
        if self.detectable_tv is not None:
            lines.append(f"power: at N = {self.samples} a TV of {self.detectable_tv:.3f} at position 1 is detected with 80% probability")
        lines += list(self.notes)
        why = {
            "PASS": f"every position's p-value > {self.threshold:.2g} (alpha {self.alpha} over {len(self.positions)} positions)",
            "FAIL": f"a position's p-value <= {self.threshold:.2g}: the samples do not follow the {'target' if self.mode == 'exact' else 'plain samples'}",
            "NOT EXERCISED": "speculation did not draft in every sample and reject somewhere, so the verifier was not tested; "
            "use a fixed --gamma, a drafter that drafts on this prompt, or more samples",
        }[self.verdict]
        lines.append(f"{self.verdict}: {why}")
        return lines


class ExactLaw:
    """p(· | prompt, prefix) from the target, one 1-token pass per prefix, as plain decoding
    computes it: each generated token's KV row written by its own pass."""

    def __init__(self, target, prompt_ids: list[int], sampling: SamplingConfig):
        self.target, self.prompt, self.sampling = target, list(prompt_ids), sampling

    def rows(self, samples: np.ndarray) -> dict[tuple, Row]:
        """A Row for every prefix (length 0..K-1) the samples [N, K] reached."""
        cache, out = self.target.cache, {}
        drawn = [set(samples[:, k].tolist()) - {ENDED} for k in range(samples.shape[1])]
        for prefix in observed_prefixes(samples):  # sorted: neighbours share rows, each pass feeds one token
            sequence = self.prompt + list(prefix)
            cache.rollback_to_prefix(np.asarray(sequence[:-1], dtype=np.int64))
            if cache.kv_len < len(self.prompt) - 1:
                self.target.prefill(self.prompt[cache.kv_len : -1])
            for token in sequence[cache.kv_len : -1]:
                self.target.forward([token], n_logits=1)
            logits = self.target.forward(sequence[-1:], n_logits=1)[-1]
            out[prefix] = Row.of(process_logits(logits, self.sampling), drawn[len(prefix)])
        cache.rollback_to_prefix(np.asarray(self.prompt[:-1], dtype=np.int64))
        return out


def goodness_of_fit(samples: np.ndarray, law: dict[tuple, Row], config: AuditConfig) -> tuple[list[PositionReport], float | None]:
    """samples [N, K]; law: every prefix (length 0..K-1) the samples reached -> its Row.
    Returns per-position reports and the detectable TV at position 1."""
    rng = np.random.default_rng(config.seed)
    n_samples, n_positions = samples.shape
    reports, detectable = [], None
    for k in range(n_positions):
        groups = _prefixes(samples, k)
        observed, simulated, impossible = 0.0, np.zeros(config.n_simulations), 0
        empirical = Counter(int(t) for t in samples[:, k] if t != ENDED)
        live = max(sum(empirical.values()), 1)
        marginal = dict.fromkeys(empirical, 0.0)  # the exact marginal at the drawn tokens, through the samples' prefixes
        for prefix, tokens in groups.items():
            row = law[prefix]
            impossible += sum(1 for t in tokens if not row.at[t] > 0.0)
            observed += float(g_statistic(row.node.counts(tokens), row.node.probs))
            draws = rng.multinomial(len(tokens), row.node.probs, size=config.n_simulations)  # [B, C+1]
            simulated += g_statistic(draws, row.node.probs)
            for t in marginal:
                marginal[t] += row.at[t] * len(tokens) / live
        p_value = 0.0 if impossible else (1 + int(np.sum(simulated >= observed - 1e-9))) / (1 + config.n_simulations)
        # TV over the vocabulary: tokens never drawn contribute their exact mass, 1 - Σ drawn.
        tv = 0.5 * (1.0 - sum(marginal.values()) + sum(abs(c / live - marginal[t]) for t, c in empirical.items()))
        reports.append(PositionReport(k + 1, len(groups), observed, p_value, tv, impossible))
        if k == 0:
            detectable = detectable_tv(law[()].node, n_samples, simulated, config.threshold, rng)
    return reports, detectable


def detectable_tv(node: Node, n: int, null_g: np.ndarray, threshold: float, rng: np.random.Generator, trials: int = 400) -> float | None:
    """Smallest t such that moving mass t from the most to the second most likely cell (TV t)
    is detected with POWER probability by the position-1 test at level threshold."""
    if len(node.probs) < 2 or node.probs[0] <= 0.0:
        return None
    critical = float(np.quantile(null_g, 1.0 - threshold))

    def power(t: float) -> float:
        alternative = node.probs.copy()
        alternative[0] -= t
        alternative[1] += t
        g = g_statistic(rng.multinomial(n, alternative, size=trials), node.probs)
        return float(np.mean(g > critical))

    low, high = 0.0, float(node.probs[0])
    if power(high) < POWER:
        return None
    for _ in range(14):
        mid = 0.5 * (low + high)
        low, high = (mid, high) if power(mid) < POWER else (low, mid)
    return high


def two_sample(speculative: np.ndarray, plain: np.ndarray, config: AuditConfig) -> list[PositionReport]:
    """--against plain: a permutation test of the TV between the two sample sets per position,
    with enough permutations that the smallest p-value lies below the threshold."""
    rng = np.random.default_rng(config.seed)
    reports = []
    for k in range(speculative.shape[1]):
        a, b = speculative[:, k], plain[:, k]
        _, codes = np.unique(np.concatenate([a, b]), return_inverse=True)
        n, m = len(a), int(codes.max()) + 1

        def tv(c):
            return 0.5 * np.abs(np.bincount(c[:n], minlength=m) / n - np.bincount(c[n:], minlength=m) / (len(c) - n)).sum()

        observed = tv(codes)
        at_least = sum(tv(rng.permutation(codes)) >= observed - 1e-12 for _ in range(config.n_simulations))
        prefixes = len({tuple(r[:k]) for r in speculative.tolist()})
        reports.append(PositionReport(k + 1, prefixes, 0.0, (at_least + 1) / (config.n_simulations + 1), float(observed), 0))
    return reports


@dataclass(frozen=True)
class SampleRun:
    tokens: np.ndarray  # [N, K]
    drafted_tokens: int
    samples_drafted: int
    rejections: int
    residual_tokens: int


def speculative_samples(engine, prompt_ids: list[int], sampling: SamplingConfig, config: AuditConfig, speculative: bool = True, seed_offset: int = 0) -> SampleRun:
    """The first K tokens of N generations, each seeded apart, with what speculation did in the
    rounds that produced them."""
    from runtime.engine import GenerateConfig

    rows, drafted, samples_drafted, rejections, residual = [], 0, 0, 0, 0
    for i in range(config.samples):
        seeded = replace(sampling, seed=config.seed + seed_offset + i)  # every other sampling field as asked
        result = engine.generate(prompt_ids, GenerateConfig(config.positions, seeded), speculative=speculative)
        rows.append((result.token_ids + [ENDED] * config.positions)[: config.positions])
        position, sample_drafted = 0, 0
        for n_drafted, n_accepted in result.rounds:
            if position >= config.positions:
                break
            sample_drafted += n_drafted
            rejected = n_accepted < n_drafted
            rejections += rejected
            position += n_accepted + 1
            residual += rejected and position <= config.positions
        drafted += sample_drafted
        samples_drafted += sample_drafted > 0
    return SampleRun(np.array(rows, dtype=np.int64), drafted, samples_drafted, rejections, residual)


def plain_samples(runner, prompt_ids: list[int], sampling: SamplingConfig, config: AuditConfig, seed_offset: int) -> np.ndarray:
    """N plain samples of K tokens from one role's runner (the self-test draws them from the
    draft's q), one token per pass."""
    from edge_spec.sampling import sample

    rows = []
    for i in range(config.samples):
        rng = np.random.default_rng(config.seed + seed_offset + i)
        tokens = list(prompt_ids)
        runner.cache.rollback_to_prefix(np.asarray(tokens[:-1], dtype=np.int64))
        runner.prefill(tokens[runner.cache.kv_len : -1])
        for _ in range(config.positions):
            tokens.append(sample(process_logits(runner.forward(tokens[-1:], n_logits=1)[-1], sampling), rng))
        rows.append(tokens[len(prompt_ids) :])
    return np.array(rows, dtype=np.int64)


def self_test(engine, prompt_ids: list[int], sampling: SamplingConfig, config: AuditConfig) -> tuple[list[PositionReport], float | None]:
    """The same statistics on N samples of the draft's q instead of speculation: a test with
    power must reject them. ValueError when the drafter has no model to sample from."""
    drafter = getattr(engine.drafter, "model", None) or engine.drafter
    runner = getattr(drafter, "runner", None)
    if runner is None:
        raise ValueError("--self-test samples from the draft's q: this drafter has no draft model")
    samples = plain_samples(runner, prompt_ids, sampling, config, seed_offset=0)
    engine.target.cache.reset()
    return goodness_of_fit(samples, ExactLaw(engine.target, prompt_ids, sampling).rows(samples), config)


def audit_exact(samples: np.ndarray, run: SampleRun, law: dict[tuple, Row], config: AuditConfig, drafter: str, gamma: str, notes=()) -> AuditReport:
    positions, detectable = goodness_of_fit(samples, law, config)
    return AuditReport("exact", drafter, gamma, config.samples, config.alpha, config.n_simulations, tuple(positions),
                       run.drafted_tokens, run.samples_drafted, run.rejections, run.residual_tokens, detectable, tuple(notes))


def observed_prefixes(samples: np.ndarray) -> list[tuple]:
    """The prefixes after which some sample drew a token (none after it stopped)."""
    return sorted({tuple(int(t) for t in row[:k]) for row in samples for k in range(samples.shape[1]) if row[k] != ENDED})
