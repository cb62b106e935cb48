"""What one generation did, built by one function from its Steps and its clock readings."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator, Sequence

if TYPE_CHECKING:
    from runtime.loop import Step


def acceptance_alpha(accepted: int, rejections: int) -> float | None:
    """Per-token acceptance α: the MLE for runs truncated at γ (each round accepts a run of
    drafted tokens and stops at its first rejection, if any), the α of E(α, γ)."""
    return accepted / (accepted + rejections) if accepted + rejections else None


@dataclass(frozen=True)
class Stats(Mapping):
    """Counts and seconds of one generation. Reads as a mapping of to_dict()'s keys too, for
    callers written against the dict it replaces."""

    target_passes: int
    drafted_tokens: int
    accepted_tokens: int
    rejections: int  # rounds whose drafted run stopped at a rejected token
    new_tokens: int  # tokens the generation kept
    gamma_histogram: tuple[tuple[int, int], ...]  # (γ as drafted, rounds), by γ
    drafter_rounds: tuple[tuple[str, int], ...]  # (drafter or "none", rounds), in order of first use
    cost_ratio: tuple[tuple[str, float], ...]  # (drafter, draft step / 1-token target pass), as the cost model holds it
    draft_s: float
    target_s: float
    prefill_s: float
    decode_s: float  # from the end of prefill to the end; the first round counts as decoding

    @property
    def acceptance_rate(self) -> float | None:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else None

    @property
    def alpha(self) -> float | None:
        return acceptance_alpha(self.accepted_tokens, self.rejections)

    @property
    def tokens_per_pass(self) -> float:
        return self.new_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def other_s(self) -> float:
        return max(self.decode_s - self.draft_s - self.target_s, 0.0)

    def to_dict(self) -> dict:
        """The JSON the CLI and the server print (keys and order as they always were)."""
        return {
            "target_passes": self.target_passes,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "tokens_per_pass": self.tokens_per_pass,
            "gamma_histogram": {str(gamma): n for gamma, n in self.gamma_histogram},
            "drafter_rounds": dict(self.drafter_rounds),
            "cost_ratio": dict(self.cost_ratio),
            "time_s": {"draft": self.draft_s, "target": self.target_s, "other": self.other_s},
        }

    def timings(self) -> dict:
        return {
            "prefill_ms": self.prefill_s * 1e3,
            "decode_s": self.decode_s,
            "decode_tokens_per_s": self.new_tokens / self.decode_s if self.decode_s else 0.0,
        }

    def __getitem__(self, key: str):
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())


def summarize(steps: Sequence[Step], new_tokens: int, cost_ratio: Mapping[str, float], began: float,
              first_step_at: float | None, ended: float) -> Stats:
    """steps: every target pass, in order; began, first_step_at, ended: perf_counter when the
    generation started, when its first Step arrived, and when it ended."""
    if steps:
        first = steps[0]
        # Prefill ends where the first round begins; the first round counts as decoding.
        prefill_s = first_step_at - began - first.draft_s - first.target_s
        decode_s = max(ended - began - prefill_s, 1e-9)
    else:  # no round ran (cancelled while queued): nothing was decoded
        prefill_s = decode_s = 0.0
    return Stats(
        target_passes=len(steps),
        drafted_tokens=sum(s.n_drafted for s in steps),
        accepted_tokens=sum(s.n_accepted for s in steps),
        rejections=sum(1 for s in steps if s.n_accepted < s.n_drafted),
        new_tokens=new_tokens,
        gamma_histogram=tuple(sorted(Counter(s.n_drafted for s in steps).items())),
        drafter_rounds=tuple(Counter(s.drafter or "none" for s in steps).items()),
        cost_ratio=tuple(cost_ratio.items()),
        draft_s=sum(s.draft_s for s in steps),
        target_s=sum(s.target_s for s in steps),
        prefill_s=prefill_s,
        decode_s=decode_s,
    )
