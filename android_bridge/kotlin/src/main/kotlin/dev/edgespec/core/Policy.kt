package dev.edgespec.core

/** What one round did, as the loop reports it to the policy (runtime/policy.py Round). */
data class Round(
    val drafter: String?, val gamma: Int, val nDrafted: Int, val nAccepted: Int, val nCommitted: Int,
    val draftSeconds: Double, val targetSeconds: Double, val roundSeconds: Double,
    val catchUpTokens: Int = 0, val catchUpSeconds: Double = 0.0,
) {
    companion object {
        fun of(drafter: Drafter?, gamma: Int, proposal: Proposal?, nAccepted: Int, nCommitted: Int,
               began: Double, drafted: Double, verified: Double): Round {
            val nDrafted = proposal?.tokens?.size ?: 0
            val caughtUp = proposal as? CatchUpProposal
            return Round(if (nDrafted > 0) drafter!!.name else null, gamma, nDrafted, nAccepted, nCommitted,
                drafted - began, verified - drafted, verified - began, caughtUp?.catchUpTokens ?: 0, caughtUp?.catchUpSeconds ?: 0.0)
        }
    }
}

/**
 * What [RoundPolicy.choose] decided for one round and what the decision assumed (runtime/policy.py Plan);
 * [RoundPolicy.observe] learns from it and the Round, so the policy keeps nothing about the round in between.
 */
data class Plan(
    val drafter: Drafter? = null, // the part that drafts; null: a plain step
    val gamma: Int = 0,
    val evidence: Int = 0, // the evidence class whose α the round's outcome updates
    val probe: Boolean = false, // drafted while switched off, to refresh α: its outcome moves the probe schedule
    val wholeReplay: Boolean = false, // a probe no later round carries: the ledger holds all of its replay
    val draftStepSeconds: Double = 0.0,
    val replaySeconds: Double = 0.0,
    // What the round, once observed, does to its part's probe schedule (ProbeSchedule.follow): "speculating",
    // "sat_out" (a plain step counted toward the next probe), "probe", or "" (nothing); a probe's is "probe".
    val schedule: String = if (probe) "probe" else "",
) {
    init {
        require(gamma >= 0) { "a plan's gamma must be >= 0, got $gamma" }
        require(!wholeReplay || probe) { "only a probe holds its replay whole" }
        require(schedule in listOf("", "speculating", "sat_out", "probe") && (schedule == "probe") == probe) {
            "a plan's schedule is '', 'speculating', 'sat_out' or 'probe' (for a probe only), got '$schedule'"
        }
    }
}

/** Per-token acceptance from decayed pseudo-counts: the MLE for a geometric run truncated at γ. */
class AlphaEstimate(priorAlpha: Double, private val decay: Double) {
    var accepted = 2.0 * priorAlpha
    var rejected = 2.0 * (1.0 - priorAlpha)
    val value: Double get() = accepted / (accepted + rejected)

    /** A new sequence: keep the estimate, shrunk to a prior of at most priorWeight rounds. */
    fun carryOver(priorWeight: Double) {
        val evidence = accepted + rejected
        if (evidence > priorWeight) { val shrink = priorWeight / evidence; accepted *= shrink; rejected *= shrink }
    }

    fun update(nDrafted: Int, nAccepted: Int) {
        accepted = decay * accepted + nAccepted
        rejected = decay * rejected + (if (nAccepted < nDrafted) 1.0 else 0.0)
    }
}

/**
 * When a switched-off drafter drafts once more: after probeFirst plain steps, doubling up to probeEvery, until
 * maxFailedProbes in a row fail. Whether a round is a probe travels in its [Plan].
 */
class ProbeSchedule(private val config: GammaConfig) {
    var plainSteps = 0
    var gap = config.probeFirst
    var failed = 0

    fun start() { plainSteps = 0; gap = config.probeFirst; failed = 0 }
    fun speculating() { plainSteps = 0; gap = config.probeFirst; failed = 0 }
    /** Whether a probe is due if the next round is a plain step (counted by [sitOut]). */
    fun due(): Boolean = plainSteps + 1 >= gap && failed < config.maxFailedProbes
    fun sitOut() { plainSteps += 1 }
    fun probe() { plainSteps = 0; gap = minOf(2 * gap, config.probeEvery) }
    /** A round chosen with [Plan.schedule] was played: the schedule moves as the plan said. */
    fun follow(schedule: String) {
        when (schedule) { "speculating" -> speculating(); "sat_out" -> sitOut(); "probe" -> probe() }
    }
    /** A probe's outcome: it fails only when the target rejects a drafted token (runtime/policy.py). */
    fun outcome(nDrafted: Int, nAccepted: Int) { failed = if (nAccepted == nDrafted) 0 else failed + 1 }
}

/**
 * What a drafter's rounds lost against plain decoding in this sequence, by the clock; wins earn room for later
 * rounds, and so does every committed token: the loss may reach maxLoss of the plain time of the horizon plus the
 * tokens so far (runtime/policy.py LossLedger).
 */
class LossLedger(private val maxLoss: Double, private val costs: CostModel) {
    var horizonTokens = 256
    var lossSeconds = 0.0
    var tokens = 0
    var taken = 0  // of those, committed by another part's rounds

    fun start(horizonTokens: Int = 256) { this.horizonTokens = horizonTokens; lossSeconds = 0.0; tokens = 0; taken = 0 }
    /** A round took `seconds` and committed nTokens, which plain decoding takes nTokens 1-token passes for. */
    fun record(seconds: Double, nTokens: Int) { lossSeconds += seconds - nTokens * costs.targetCost(1) }
    /** The sequence committed nTokens (any round, plain steps included); taken: by a round another part drafted. */
    fun advance(nTokens: Int, taken: Boolean = false) { tokens += nTokens; if (taken) this.taken += nTokens }
    /** Seconds a round may still lose. */
    fun room(): Double = maxLoss * (horizonTokens + tokens) * costs.targetCost(1) - lossSeconds
    /** Tokens this part may still expect to commit: what the horizon still holds, less the share other parts took (at least one). */
    fun reach(): Double {
        val left = horizonTokens - tokens
        return maxOf(1.0, if (tokens > 0) left * (1.0 - taken.toDouble() / tokens) else left.toDouble())
    }
}

/**
 * γ for one drafter (one part of a mixed drafter): the argmax of the expected speedup, read from its α estimate for
 * the round's evidence class (a copy's match length, [Drafter.evidence]), probe schedule and ledger.
 */
class PartPolicy(val config: GammaConfig, val costs: CostModel, private val priorAlpha: Double = 0.6) {
    val estimates = LinkedHashMap<Int, AlphaEstimate>()
    val probes = ProbeSchedule(config)
    val ledger = LossLedger(config.maxLoss, costs)

    /** The class's estimate, made from the prior on its first outcome ([update]). */
    fun estimate(evidence: Int = 0): AlphaEstimate = estimates.getOrPut(evidence) { AlphaEstimate(priorAlpha, config.decay) }
    /** Read without making an estimate: choosing changes nothing. */
    fun alpha(evidence: Int = 0): Double = (estimates[evidence] ?: AlphaEstimate(priorAlpha, config.decay)).value

    init { start() }

    /** A new sequence of up to horizonTokens: probe soon again (α carries over as a prior) and open a new loss ledger. */
    fun start(horizonTokens: Int = 256) {
        probes.start(); ledger.start(horizonTokens); estimates.values.forEach { it.carryOver(config.priorWeight) }
    }

    /** The part of a replay the ledger holds against a round committing nTokens: spread over the tokens the model may still commit (runtime/policy.py). */
    fun replayShare(replaySeconds: Double, nTokens: Double): Double = replaySeconds * minOf(1.0, nTokens / ledger.reach())

    fun roundCost(gamma: Int, draftStepCost: Double, replaySeconds: Double = 0.0): Double =
        replaySeconds + gamma * draftStepCost + costs.targetCost(gamma + 1)

    /** With the replay whole: a round chosen on its merit must repay it. */
    fun expectedSpeedup(gamma: Int, draftStepCost: Double, replaySeconds: Double = 0.0, evidence: Int = 0): Double {
        if (gamma == 0) return 1.0
        val tokens = Verify.expectedTokensPerPass(alpha(evidence), gamma)
        return tokens * costs.targetCost(1) / roundCost(gamma, draftStepCost, replaySeconds)
    }

    /** What the ledger would hold against the round if the target rejected every drafted token: its share of the replay, or all of it for a probe (whole). */
    fun worstLoss(gamma: Int, draftStepCost: Double, replaySeconds: Double = 0.0, whole: Boolean = false): Double =
        roundCost(gamma, draftStepCost, if (whole) replaySeconds else replayShare(replaySeconds, 1.0)) - costs.targetCost(1)

    /** Expected speedup of a plain step (γ 0) and of every γ whose worst case the ledger affords. */
    private fun gains(draftStepCost: Double, replaySeconds: Double, evidence: Int): Map<Int, Double> {
        val room = ledger.room()
        val affordable = (1..config.maxGamma).filter { worstLoss(it, draftStepCost, replaySeconds) <= room }
        return (listOf(0) + affordable).associateWith { expectedSpeedup(it, draftStepCost, replaySeconds, evidence) }
    }

    /** The expected speedup of the best round this part could draft now (1.0: none pays). */
    fun bestGain(draftStepCost: Double, replaySeconds: Double = 0.0, evidence: Int = 0): Double {
        config.fixed?.let { return expectedSpeedup(it, draftStepCost, replaySeconds, evidence) }
        return gains(draftStepCost, replaySeconds, evidence).values.max()
    }

    /**
     * The plan for the next round (γ 0: plain; the drafter is [RoundPolicy]'s to fill in). Only a γ whose worst case
     * the ledger can afford is considered (runtime/policy.py PartPolicy.choose). It changes nothing: what the plan does
     * to the probe schedule travels in [Plan.schedule] and happens when the round is observed.
     */
    fun choose(draftStepCost: Double, replaySeconds: Double = 0.0, evidence: Int = 0): Plan {
        fun plan(gamma: Int = 0, probe: Boolean = false, whole: Boolean = false, schedule: String = if (probe) "probe" else "") =
            Plan(null, gamma, evidence, probe, whole, draftStepCost, replaySeconds, schedule)
        config.fixed?.let { return plan(it) }
        val gains = gains(draftStepCost, replaySeconds, evidence)
        val affordable = gains.keys.filter { it > 0 }
        if (affordable.isEmpty()) return plan()
        val best = gains.keys.maxBy { gains.getValue(it) }  // the first of equals: the shortest
        if (gains.getValue(best) >= config.minGain) return plan(best, schedule = "speculating")
        if (probes.due()) {
            // A probe whose model, caught up, would not draft on its merit buys only information: no later round carries its replay.
            val whole = affordable.maxOf { expectedSpeedup(it, draftStepCost, 0.0, evidence) } < config.minGain
            val room = ledger.room()
            val probeable = affordable.filter { worstLoss(it, draftStepCost, replaySeconds, whole) <= room }
            if (probeable.isNotEmpty()) return plan(probeable.maxBy { gains.getValue(it) }, probe = true, whole = whole)
        }
        return plan(schedule = "sat_out")
    }

    /** A round chosen by this part was played (drafted or not): its probe schedule moves as the plan says. */
    fun follow(plan: Plan) = probes.follow(plan.schedule)

    /** The outcome of a round drafted on `plan`: α for its evidence class, and the probe schedule if it was a probe. */
    fun update(plan: Plan, nDrafted: Int, nAccepted: Int) {
        if (nDrafted == 0) return
        if (plan.probe) probes.outcome(nDrafted, nAccepted)
        estimate(plan.evidence).update(nDrafted, nAccepted)
    }

    /** A round this drafter drafted on `plan`: α and probes, then its loss in the ledger, its replay by share or whole (Plan.wholeReplay). */
    fun observe(plan: Plan, done: Round) {
        update(plan, done.nDrafted, done.nAccepted)
        val replay = if (plan.wholeReplay) done.catchUpSeconds else replayShare(done.catchUpSeconds, done.nCommitted.toDouble())
        ledger.record(done.roundSeconds - done.catchUpSeconds + replay, done.nCommitted)
    }

    /** The sequence committed nTokens; taken: by a round another part of the drafter drafted. */
    fun committed(nTokens: Int, taken: Boolean = false) = ledger.advance(nTokens, taken)
}

/**
 * The round policy (runtime/policy.py RoundPolicy), one per engine: the cost model, and a PartPolicy per
 * (drafter, part, γ config) for the engine's life, so α carries over between sequences while probes and
 * the ledger restart. The loop asks [choose] for each round's [Plan] and hands it back with the Round to [observe].
 */
class RoundPolicy(val costs: CostModel = CostModel(), private val priorAlpha: Double = 0.6) {
    private val learned = HashMap<Triple<String, String, GammaConfig>, PartPolicy>()
    var drafter: Drafter? = null
        private set
    var parts: Map<String, PartPolicy> = emptyMap()
        private set
    private var priced: Set<String> = emptySet()

    /** A new sequence of up to horizonTokens, drafted by `drafter` (null: plain decoding). */
    fun start(drafter: Drafter?, horizonTokens: Int = 256, config: GammaConfig = GammaConfig()): RoundPolicy {
        this.drafter = drafter
        parts = partsOf(drafter).associate { part ->
            part.name to learned.getOrPut(Triple(drafter!!.name, part.name, config)) { PartPolicy(config, costs, priorAlpha) }.also { it.start(horizonTokens) }
        }
        priced = partsOf(drafter).filter { it is CostsPasses }.map { it.name }.toSet()
        return this
    }

    /** The plan for the round after `tokens`: its drafter (a mixed drafter's part), γ (0: plain) and what the choice assumed. */
    fun choose(tokens: LongArray): Plan {
        val top = drafter ?: return Plan()
        // Of a mixed drafter's parts able to draft, the one whose best affordable round gains most (runtime/policy.py).
        val options = if (top is Selects) top.candidates(tokens) else listOf(top)
        val classes = options.associate { it.name to it.evidence(tokens) }
        val part = options.maxBy { p -> costsOf(p, tokens).let { (step, replay) -> parts.getValue(p.name).bestGain(step, replay, classes.getValue(p.name)) } }
        val (stepCost, replay) = costsOf(part, tokens)
        return parts.getValue(part.name).choose(stepCost, replay, classes.getValue(part.name)).copy(drafter = part)
    }

    private fun costsOf(part: Drafter, tokens: LongArray): Pair<Double, Double> {
        val stepCost = if (part is CostsPasses) costs.draftStep[part.name] ?: 0.0 else 0.0
        val replay = if (part is CatchesUp) costs.replayCost(part.name, part.replayTokens(tokens)) else 0.0
        return stepCost to replay
    }

    /** Learns from a round drafted on `plan`: the verify pass's cost, and for a drafted round its drafter's α, probe, ledger, draft and replay costs. */
    fun observe(plan: Plan, done: Round) {
        costs.recordTarget(done.nDrafted + 1, done.targetSeconds)
        plan.drafter?.let { parts[it.name]?.follow(plan) }
        if (done.nDrafted > 0) {
            parts.getValue(done.drafter!!).observe(plan, done)
            if (done.drafter in priced) {
                costs.recordDraft(done.drafter, done.nDrafted, done.draftSeconds - done.catchUpSeconds)
                costs.recordReplay(done.drafter, done.catchUpTokens, done.catchUpSeconds)
            }
        }
        for ((name, policy) in parts) policy.committed(done.nCommitted, taken = done.drafter != null && done.drafter != name)
    }
}
