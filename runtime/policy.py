"""The round policy: which drafter drafts the next round and how many tokens, from measured costs.

For acceptance α, γ drafted tokens yield E(α, γ) = (1 − α^(γ+1)) / (1 − α) tokens per target
pass. A round costs γ draft steps plus one target pass over γ+1 tokens, against one 1-token
pass per token for plain decoding, so the expected speedup of γ is

    E(α, γ) · t_target(1) / (γ · t_draft + t_target(γ + 1)),

which is the textbook E / (1 + γc) when a (γ+1)-token pass costs what a 1-token pass does.
Both t_draft and the verify-cost curve t_target(T) are measured on this device (CostModel).

The loop asks `RoundPolicy.choose(tokens)` before each round and gets a frozen Plan (drafter, γ,
and what the choice assumed); it hands that plan back with what the round did in
`observe(plan, round)`, once. Nothing about a round is left on the policy between the two calls;
everything the policy learns (costs, α, probes, the loss ledger) goes through observe.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from edge_spec.verify import expected_tokens_per_pass
from runtime.drafters.base import Drafter, Proposal, parts
from runtime.gamma import CostModel, GammaConfig


@dataclass(frozen=True)
class Round:
    """What one round did, as the loop reports it to the policy."""

    drafter: str | None  # the part that drafted; None: a plain step
    gamma: int  # γ asked of it
    n_drafted: int
    n_accepted: int
    n_committed: int
    draft_s: float  # choosing and drafting, replay included
    target_s: float  # the verify pass
    round_s: float  # the whole round, as the clock read it
    catch_up_tokens: int = 0
    catch_up_s: float = 0.0

    @classmethod
    def of(cls, drafter: Drafter | None, gamma: int, proposal: Proposal | None, n_accepted: int, n_committed: int,
           began: float, drafted_at: float, verified_at: float) -> "Round":
        n_drafted = 0 if proposal is None else len(proposal.tokens)
        return cls(drafter.name if n_drafted else None, gamma, n_drafted, n_accepted, n_committed,
                   drafted_at - began, verified_at - drafted_at, verified_at - began,
                   proposal.catch_up_tokens if proposal is not None else 0, proposal.catch_up_seconds if proposal is not None else 0.0)


@dataclass(frozen=True)
class Plan:
    """What `choose` decided for one round and what the decision assumed; `observe` learns from
    it and the Round, so the policy keeps nothing about the round in between."""

    drafter: Drafter | None = None  # the part that drafts; None: a plain step (no drafter)
    gamma: int = 0  # tokens to draft (0: a plain step)
    evidence: int = 0  # the evidence class (Drafter.evidence) whose α the round's outcome updates
    probe: bool = False  # drafted while the part is switched off, to refresh α: its outcome moves the probe schedule
    whole_replay: bool = False  # a probe no later round carries: the ledger holds all of its replay, not a share
    draft_step_s: float = 0.0  # the seconds of a draft step the choice assumed
    replay_s: float = 0.0  # the seconds of replay before drafting the choice assumed
    # What the round, once observed, does to its part's probe schedule (ProbeSchedule.follow): "speculating"
    # (drafted on its merit), "sat_out" (a plain step counted toward the next probe), "probe", or "" (nothing).
    schedule: str = ""

    def __post_init__(self):
        if self.gamma < 0:
            raise ValueError(f"a plan's gamma must be >= 0, got {self.gamma}")
        if self.whole_replay and not self.probe:
            raise ValueError("only a probe holds its replay whole")
        if self.probe and not self.schedule:
            object.__setattr__(self, "schedule", "probe")  # a probe moves the schedule as one, however it was made
        if self.schedule not in ("", "speculating", "sat_out", "probe") or (self.schedule == "probe") != self.probe:
            raise ValueError(f"a plan's schedule is '', 'speculating', 'sat_out' or 'probe' (for a probe only), got {self.schedule!r}")


class AlphaEstimate:
    """Per-token acceptance from decayed pseudo-counts: accepted / (accepted + rejections), the
    MLE for a geometric run truncated at γ (positions after a rejection are never observed)."""

    def __init__(self, prior_alpha: float, decay: float):
        # Pseudo-counts: a weak prior that measured rounds quickly override.
        self.n_accepted = 2.0 * prior_alpha
        self.n_rejected = 2.0 * (1.0 - prior_alpha)
        self.decay = decay

    @property
    def value(self) -> float:
        return self.n_accepted / (self.n_accepted + self.n_rejected)

    def carry_over(self, prior_weight: float) -> None:
        """A new sequence: keep the estimate, shrunk to a prior of at most prior_weight rounds."""
        evidence = self.n_accepted + self.n_rejected
        if evidence > prior_weight:
            shrink = prior_weight / evidence
            self.n_accepted *= shrink
            self.n_rejected *= shrink

    def update(self, n_drafted: int, n_accepted: int) -> None:
        self.n_accepted = self.decay * self.n_accepted + n_accepted
        self.n_rejected = self.decay * self.n_rejected + (1.0 if n_accepted < n_drafted else 0.0)


class ProbeSchedule:
    """When a drafter that is switched off drafts once more: after probe_first plain steps, then
    twice as many after each probe that does not turn it back on, up to probe_every, until
    max_failed_probes in a row were rejected. Whether a round is a probe travels in its Plan."""

    def __init__(self, config: GammaConfig):
        self.config = config
        self.start()

    def start(self) -> None:
        self.plain_steps = 0
        self.gap = self.config.probe_first
        self.failed = 0

    def speculating(self) -> None:
        """Speculation pays again: the next switch-off probes soon."""
        self.plain_steps = 0
        self.gap = self.config.probe_first
        self.failed = 0

    def due(self) -> bool:
        """Whether a probe is due if the next round is a plain step (counted by sit_out)."""
        return self.plain_steps + 1 >= self.gap and self.failed < self.config.max_failed_probes

    def sit_out(self) -> None:
        """Count a plain step."""
        self.plain_steps += 1

    def probe(self) -> None:
        self.plain_steps = 0
        self.gap = min(2 * self.gap, self.config.probe_every)

    def follow(self, schedule: str) -> None:
        """A round chosen with Plan.schedule was played: the schedule moves as the plan said."""
        if schedule == "speculating":
            self.speculating()
        elif schedule == "sat_out":
            self.sit_out()
        elif schedule == "probe":
            self.probe()

    def outcome(self, n_drafted: int, n_accepted: int) -> None:
        """A probe's outcome: it fails when the target rejects a drafted token; one accepted in
        full is evidence for the drafter even while the prior still keeps the predicted gain low."""
        self.failed = 0 if n_accepted == n_drafted else self.failed + 1


class LossLedger:
    """What a drafter's rounds lost against plain decoding in this sequence, by the clock.
    Predictions rest on α and costs estimated from few rounds; the ledger on what the rounds
    really took (a draft model's replay by the share held against each round, PartPolicy.replay_share).
    Wins earn room for later rounds, and so does every token the sequence commits: the loss may
    reach max_loss of the plain time of the horizon plus the tokens so far, so a drafter
    switched off by early losses can come back."""

    def __init__(self, max_loss: float, costs: CostModel):
        self.max_loss = max_loss
        self.costs = costs
        self.start()

    def start(self, horizon_tokens: int = 256) -> None:
        self.horizon_tokens = horizon_tokens
        self.loss_seconds = 0.0
        self.tokens = 0
        self.taken = 0  # of those, committed by another part's rounds

    def record(self, seconds: float, n_tokens: int) -> None:
        """A round took `seconds` and committed n_tokens, which plain decoding takes n_tokens
        1-token passes for."""
        self.loss_seconds += seconds - n_tokens * self.costs.target_cost(1)

    def advance(self, n_tokens: int, taken: bool = False) -> None:
        """The sequence committed n_tokens (any round, plain steps included); taken: by a round
        another part of the drafter drafted."""
        self.tokens += n_tokens
        self.taken += n_tokens if taken else 0

    def room(self) -> float:
        """Seconds a round may still lose."""
        return self.max_loss * (self.horizon_tokens + self.tokens) * self.costs.target_cost(1) - self.loss_seconds

    def reach(self) -> float:
        """Tokens this part may still expect to commit: what the horizon still holds, less the
        share other parts have taken so far (at least one)."""
        left = self.horizon_tokens - self.tokens
        return max(1.0, left * (1.0 - self.taken / self.tokens) if self.tokens else float(left))


class PartPolicy:
    """γ for one drafter (one part of a mixed drafter): the argmax of the expected speedup over
    γ, read from its α estimate for the round's evidence class, its probe schedule and its loss
    ledger. The evidence class is what the drafter reports about the round it would draft
    (`Drafter.evidence`): a copy resting on a 20-token match is accepted far more often than one
    resting on 2 tokens, so each class learns its own α and earns its own γ."""

    def __init__(self, config: GammaConfig, costs: CostModel, prior_alpha: float = 0.6):
        self.config = config
        self.costs = costs
        self.prior_alpha = prior_alpha
        self.estimates: dict[int, AlphaEstimate] = {}
        self.probes = ProbeSchedule(config)
        self.ledger = LossLedger(config.max_loss, costs)
        self.start()

    def estimate(self, evidence: int = 0) -> AlphaEstimate:
        """The class's estimate, made from the prior on its first outcome (update)."""
        if evidence not in self.estimates:
            self.estimates[evidence] = AlphaEstimate(self.prior_alpha, self.config.decay)
        return self.estimates[evidence]

    def alpha(self, evidence: int = 0) -> float:
        known = self.estimates.get(evidence)  # read without making one: choosing changes nothing
        return (known if known is not None else AlphaEstimate(self.prior_alpha, self.config.decay)).value

    def start(self, horizon_tokens: int = 256) -> None:
        """A new sequence of up to horizon_tokens: probe soon again (α carries over as a prior,
        decayed by its rounds), and open a new loss ledger."""
        self.probes.start()
        self.ledger.start(horizon_tokens)
        for estimate in self.estimates.values():
            estimate.carry_over(self.config.prior_weight)

    def replay_share(self, replay_seconds: float, n_tokens: float) -> float:
        """The part of a replay that the ledger holds against a round committing n_tokens. A
        replay is paid once to bring a draft model back and serves every round it drafts after,
        so it is spread over the tokens the model may still commit (LossLedger.reach). Held
        whole against one round, it grew with every token the model sat out while the room
        grows by max_loss of a pass per token, and a model that fell behind could not even be
        probed again in the sequence."""
        return replay_seconds * min(1.0, n_tokens / self.ledger.reach())

    def round_cost(self, gamma: int, draft_step_cost: float, replay_seconds: float = 0.0) -> float:
        return replay_seconds + gamma * draft_step_cost + self.costs.target_cost(gamma + 1)

    def expected_speedup(self, gamma: int, draft_step_cost: float, replay_seconds: float = 0.0, evidence: int = 0) -> float:
        """With the replay whole: a round chosen on its merit must repay it (after copy streaks
        on code, a model that returns pays a new replay at each return)."""
        if gamma == 0:
            return 1.0
        tokens = expected_tokens_per_pass(self.alpha(evidence), gamma)
        return tokens * self.costs.target_cost(1) / self.round_cost(gamma, draft_step_cost, replay_seconds)

    def worst_loss(self, gamma: int, draft_step_cost: float, replay_seconds: float = 0.0, whole: bool = False) -> float:
        """What the ledger would hold against the round if the target rejected every drafted
        token: its share of the replay, or all of it for a probe (`whole`)."""
        replay = replay_seconds if whole else self.replay_share(replay_seconds, 1)
        return self.round_cost(gamma, draft_step_cost, replay) - self.costs.target_cost(1)

    def _gains(self, draft_step_cost: float, replay_seconds: float, evidence: int) -> dict[int, float]:
        """Expected speedup of a plain step (γ 0) and of every γ whose worst case the ledger affords."""
        room = self.ledger.room()
        affordable = [g for g in range(1, self.config.max_gamma + 1) if self.worst_loss(g, draft_step_cost, replay_seconds) <= room]
        return {g: self.expected_speedup(g, draft_step_cost, replay_seconds, evidence) for g in [0, *affordable]}

    def best_gain(self, draft_step_cost: float, replay_seconds: float = 0.0, evidence: int = 0) -> float:
        """The expected speedup of the best round this part could draft now (1.0: none pays)."""
        if self.config.fixed is not None:
            return self.expected_speedup(self.config.fixed, draft_step_cost, replay_seconds, evidence)
        return max(self._gains(draft_step_cost, replay_seconds, evidence).values())

    def choose(self, draft_step_cost: float, replay_seconds: float = 0.0, evidence: int = 0) -> Plan:
        """The plan for the next round (γ 0: a plain target step; drafter left to RoundPolicy),
        given the seconds of one draft step (0 for copying drafters), of replaying what the
        drafter missed before it can draft (a draft model after plain or copy rounds), and the
        round's evidence class. Only a γ whose worst case the ledger can afford is considered:
        a long first round on a prior carried over from other text must not spend the whole
        sequence's room at once. It changes nothing: what the plan does to the probe schedule
        travels in Plan.schedule and happens when the round is observed (a plan dropped unplayed,
        as a batched step may, moves nothing)."""
        assumed = dict(evidence=evidence, draft_step_s=draft_step_cost, replay_s=replay_seconds)
        if self.config.fixed is not None:
            return Plan(gamma=self.config.fixed, **assumed)
        gains = self._gains(draft_step_cost, replay_seconds, evidence)
        affordable = [g for g in gains if g]
        if not affordable:
            return Plan(**assumed)
        best = max(gains, key=lambda g: gains[g])  # the first of equals: the shortest
        if gains[best] >= self.config.min_gain:
            return Plan(gamma=best, schedule="speculating", **assumed)
        if self.probes.due():
            # Conditions change (a code block starts, say): draft once to refresh α. Its replay
            # is carried by later rounds only if the model, once caught up, would draft on its
            # merit; otherwise the probe buys only information and must afford its replay whole
            # (on prose, where multi-token passes are dear, such replays cost more than they found).
            caught_up = max(self.expected_speedup(g, draft_step_cost, 0.0, evidence) for g in affordable)
            whole = caught_up < self.config.min_gain
            room = self.ledger.room()
            probes = [g for g in affordable if self.worst_loss(g, draft_step_cost, replay_seconds, whole) <= room]
            if probes:
                return Plan(gamma=max(probes, key=lambda g: gains[g]), probe=True, whole_replay=whole, schedule="probe", **assumed)
        return Plan(schedule="sat_out", **assumed)

    def follow(self, plan: Plan) -> None:
        """A round chosen by this part was played (drafted or not): its probe schedule moves as the plan says."""
        self.probes.follow(plan.schedule)

    def update(self, plan: Plan, n_drafted: int, n_accepted: int) -> None:
        """The outcome of a round this drafter drafted on `plan` (nothing drafted: no information):
        α for the plan's evidence class, and the probe schedule if the plan was a probe."""
        if n_drafted == 0:
            return
        if plan.probe:
            self.probes.outcome(n_drafted, n_accepted)
        self.estimate(plan.evidence).update(n_drafted, n_accepted)

    def observe(self, plan: Plan, done: Round) -> None:
        """A round this drafter drafted on `plan`: α and probes (update), and what it lost in the
        ledger, its replay held by the round's share (replay_share) or whole for a probe that
        later rounds are not expected to carry (Plan.whole_replay)."""
        self.update(plan, done.n_drafted, done.n_accepted)
        replay = done.catch_up_s if plan.whole_replay else self.replay_share(done.catch_up_s, done.n_committed)
        self.ledger.record(done.round_s - done.catch_up_s + replay, done.n_committed)

    def committed(self, n_tokens: int, taken: bool = False) -> None:
        """The sequence committed n_tokens; taken: by a round another part of the drafter drafted."""
        self.ledger.advance(n_tokens, taken)


class RoundPolicy:
    """One per engine: the cost model, and a PartPolicy per (drafter, part, γ config) for the
    engine's life, so α learned on earlier sequences is the prior for the next while the probe
    schedule and the ledger restart with each sequence. Keyed by the drafter chosen too: auto's
    model part drafts where lookup finds no match or is expected to do worse, other text than
    the model alone sees, so their α must not mix."""

    def __init__(self, costs: CostModel | None = None, prior_alpha: float = 0.6):
        self.costs = costs if costs is not None else CostModel()
        self.prior_alpha = prior_alpha  # what a drafter's α starts from before its first round
        self._learned: dict[tuple, PartPolicy] = {}
        self.drafter: Drafter | None = None
        self.parts: dict[str, PartPolicy] = {}  # this sequence's, by part name
        self._priced: set[str] = set()  # this sequence's parts whose draft steps the cost model times

    def start(self, drafter: Drafter | None, horizon_tokens: int = 256, config: GammaConfig = GammaConfig()) -> "RoundPolicy":
        """A new sequence of up to horizon_tokens, drafted by `drafter` (None: plain decoding)."""
        self.drafter = drafter
        self.parts = {}
        self._priced = {part.name for part in parts(drafter) if part.costs_passes}
        for part in parts(drafter):
            key = (drafter.name, part.name, config)
            if key not in self._learned:
                self._learned[key] = PartPolicy(config, self.costs, self.prior_alpha)
            self.parts[part.name] = self._learned[key]
            self.parts[part.name].start(horizon_tokens)
        return self

    def choose(self, tokens) -> Plan:
        """The plan for the round after `tokens`: its drafter and γ (0: plain), with what the
        choice assumed. Of a mixed drafter's parts able to draft, the one whose best affordable
        round is expected to gain most (the drafter's preference among equals): a short n-gram
        match found almost anywhere in code must not take every round from a draft model that
        is doing better."""
        if self.drafter is None:
            return Plan()
        options = self.drafter.candidates(tokens)
        evidence = {p.name: p.evidence(tokens) for p in options}
        part = max(options, key=lambda p: self.parts[p.name].best_gain(*self._costs_of(p, tokens), evidence[p.name]))
        return replace(self.parts[part.name].choose(*self._costs_of(part, tokens), evidence[part.name]), drafter=part)

    def advanced(self, n_tokens: int) -> None:
        """The sequence committed n_tokens in passes it shared with other sequences (a batched
        plain step): counted like a plain round's, their seconds not taken as a 1-token pass's."""
        for policy in self.parts.values():
            policy.committed(n_tokens)

    def expected_round(self, plan: Plan) -> tuple[float, float]:
        """What the chosen round is expected to commit and take: E(α, γ) tokens, and seconds
        (γ draft steps, the replay, one verify pass over γ+1 tokens)."""
        if not plan.gamma:
            return 1.0, self.costs.target_cost(1)
        part = self.parts[plan.drafter.name]
        return (expected_tokens_per_pass(part.alpha(plan.evidence), plan.gamma),
                part.round_cost(plan.gamma, plan.draft_step_s, plan.replay_s))

    def _costs_of(self, part: Drafter, tokens) -> tuple[float, float]:
        """Seconds of one draft step of `part` and of its replay before it can draft after `tokens`."""
        step_cost = self.costs.draft_step.get(part.name, 0.0) if part.costs_passes else 0.0
        replay = self.costs.replay_cost(part.name, part.replay_tokens(tokens)) if part.catches_up else 0.0
        return step_cost, replay

    def observe(self, plan: Plan, done: Round) -> None:
        """Learn from a finished round, drafted on `plan` (what choose returned for it): the
        verify pass's cost, the probe schedule of the part it was planned for, and for a drafted
        round its drafter's α, probe outcome, ledger entry and draft and replay costs."""
        self.costs.record_target(done.n_drafted + 1, done.target_s)
        if plan.drafter is not None and plan.drafter.name in self.parts:
            self.parts[plan.drafter.name].follow(plan)
        if done.n_drafted:
            self.parts[done.drafter].observe(plan, done)
            if done.drafter in self._priced:
                self.costs.record_draft(done.drafter, done.n_drafted, done.draft_s - done.catch_up_s)
                self.costs.record_replay(done.drafter, done.catch_up_tokens, done.catch_up_s)
        for name, policy in self.parts.items():
            policy.committed(done.n_committed, taken=done.drafter not in (None, name))
