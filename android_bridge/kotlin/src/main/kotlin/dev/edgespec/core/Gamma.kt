package dev.edgespec.core

/** Adaptive γ (runtime/gamma.py): measured costs and a running acceptance estimate choose the draft length. */
data class GammaConfig(
    val fixed: Int? = null, val maxGamma: Int = 8, val probeFirst: Int = 2, val probeEvery: Int = 32,
    val maxFailedProbes: Int = 2, val minGain: Double = 1.02, val decay: Double = 0.98, val maxLoss: Double = 0.01,
    val priorWeight: Double = 4.0,
)

class CostModel(private val smoothing: Double = 0.2) {
    val target = HashMap<Int, Double>()
    val draftStep = HashMap<String, Double>()
    val replayToken = HashMap<String, Double>() // by drafter: seconds per token replayed

    private fun ema(old: Double?, new: Double) = if (old == null) new else old + smoothing * (new - old)
    fun recordTarget(block: Int, seconds: Double) { target[block] = ema(target[block], seconds) }
    fun recordDraft(drafter: String, steps: Int, seconds: Double) { if (steps > 0) draftStep[drafter] = ema(draftStep[drafter], seconds / steps) }
    fun recordReplay(drafter: String, nTokens: Int, seconds: Double) { if (nTokens > 0) replayToken[drafter] = ema(replayToken[drafter], seconds / nTokens) }

    /** Seconds to replay nTokens the drafter missed; until measured, a draft step each (errs on the side of not drafting). */
    fun replayCost(drafter: String, nTokens: Int): Double =
        if (nTokens == 0) 0.0 else nTokens * (replayToken[drafter] ?: draftStep[drafter] ?: 0.0)

    /** Measured cost of a block, else linear interpolation; past the largest measured block the last segment's slope goes on (never down). */
    fun targetCost(block: Int): Double {
        target[block]?.let { return it }
        val known = target.keys.sorted()
        if (known.isEmpty()) return 1.0
        if (block <= known.first()) return target.getValue(known.first())
        if (block > known.last() && known.size > 1) {
            val below = known[known.size - 2]; val top = known.last()
            val slope = (target.getValue(top) - target.getValue(below)) / (top - below)
            return target.getValue(top) + maxOf(slope, 0.0) * (block - top)
        }
        if (block >= known.last()) return target.getValue(known.last())
        val hi = known.indexOfFirst { it > block }
        val x0 = known[hi - 1].toDouble(); val x1 = known[hi].toDouble()
        val y0 = target.getValue(known[hi - 1]); val y1 = target.getValue(known[hi])
        val slope = (y1 - y0) / (x1 - x0)
        return slope * (block - x0) + y0
    }

    fun costRatio(drafter: String): Double? {
        val d = draftStep[drafter] ?: return null
        val t = target[1] ?: return null
        return d / t
    }
}

class GammaController(val config: GammaConfig, val costs: CostModel, priorAlpha: Double = 0.6) {
    var accepted = 2.0 * priorAlpha
    var rejected = 2.0 * (1.0 - priorAlpha)
    var plainSteps = 0
    var probeGap = config.probeFirst
    var failedProbes = 0
    var probing = false
    var horizonTokens = 256
    var lossSeconds = 0.0
    val alpha: Double get() = accepted / (accepted + rejected)

    /** A new sequence of up to horizonTokens: probe soon again (α carries over as a prior) and open a new loss ledger, as runtime/gamma.py. */
    fun start(horizonTokens: Int = 256) {
        plainSteps = 0; probeGap = config.probeFirst; failedProbes = 0; probing = false
        this.horizonTokens = horizonTokens; lossSeconds = 0.0
        val evidence = accepted + rejected
        if (evidence > config.priorWeight) { val shrink = config.priorWeight / evidence; accepted *= shrink; rejected *= shrink }
    }

    /** A speculative round took `seconds` and committed nTokens, which plain decoding takes nTokens 1-token passes for. */
    fun recordRound(seconds: Double, nTokens: Int) { lossSeconds += seconds - nTokens * costs.targetCost(1) }

    /** Speculation with this drafter has lost, or would lose if a round risking atRisk seconds failed, more than maxLoss of the sequence's plain time. */
    fun overBudget(atRisk: Double = 0.0): Boolean = lossSeconds + atRisk > config.maxLoss * horizonTokens * costs.targetCost(1)

    fun roundCost(gamma: Int, draftStepCost: Double, replaySeconds: Double = 0.0): Double =
        replaySeconds + gamma * draftStepCost + costs.targetCost(gamma + 1)

    fun expectedSpeedup(gamma: Int, draftStepCost: Double, replaySeconds: Double = 0.0): Double {
        if (gamma == 0) return 1.0
        val tokens = Verify.expectedTokensPerPass(alpha, gamma)
        return tokens * costs.targetCost(1) / roundCost(gamma, draftStepCost, replaySeconds)
    }

    fun choose(draftStepCost: Double, replaySeconds: Double = 0.0): Int {
        config.fixed?.let { return it }
        if (overBudget()) return 0
        val gains = DoubleArray(config.maxGamma + 1) { expectedSpeedup(it, draftStepCost, replaySeconds) }
        val best = Sampling.argmax(gains)
        if (gains[best] >= config.minGain) { plainSteps = 0; probeGap = config.probeFirst; failedProbes = 0; return best }
        plainSteps += 1
        val probe = 1 + Sampling.argmax(gains.copyOfRange(1, gains.size))
        val expectedLoss = roundCost(probe, draftStepCost, replaySeconds) * (1.0 - gains[probe])
        val due = plainSteps >= probeGap && failedProbes < config.maxFailedProbes
        if (due && !overBudget(expectedLoss)) {
            plainSteps = 0
            probeGap = minOf(2 * probeGap, config.probeEvery)
            probing = true
            return probe
        }
        return 0
    }

    fun update(nDrafted: Int, nAccepted: Int) {
        if (nDrafted == 0) return
        // A probe fails only when the target rejects a drafted token (runtime/gamma.py).
        if (probing) { failedProbes = if (nAccepted == nDrafted) 0 else failedProbes + 1; probing = false }
        accepted = config.decay * accepted + nAccepted
        rejected = config.decay * rejected + (if (nAccepted < nDrafted) 1.0 else 0.0)
    }
}
