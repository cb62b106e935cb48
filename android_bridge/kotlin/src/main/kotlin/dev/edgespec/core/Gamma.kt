package dev.edgespec.core

/** Adaptive γ (runtime/gamma.py): measured costs and a running acceptance estimate choose the draft length. */
data class GammaConfig(
    val fixed: Int? = null, val maxGamma: Int = 8, val probeFirst: Int = 2, val probeEvery: Int = 32,
    val maxFailedProbes: Int = 2, val minGain: Double = 1.02, val decay: Double = 0.98,
)

class CostModel(private val smoothing: Double = 0.2) {
    val target = HashMap<Int, Double>()
    val draftStep = HashMap<String, Double>()

    private fun ema(old: Double?, new: Double) = if (old == null) new else old + smoothing * (new - old)
    fun recordTarget(block: Int, seconds: Double) { target[block] = ema(target[block], seconds) }
    fun recordDraft(drafter: String, steps: Int, seconds: Double) { if (steps > 0) draftStep[drafter] = ema(draftStep[drafter], seconds / steps) }

    /** Measured cost of a block, else linear interpolation (np.interp: clamped at the ends). */
    fun targetCost(block: Int): Double {
        target[block]?.let { return it }
        val known = target.keys.sorted()
        if (known.isEmpty()) return 1.0
        if (block <= known.first()) return target.getValue(known.first())
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
    val alpha: Double get() = accepted / (accepted + rejected)

    /** A new sequence: probe soon again (α carries over as a prior), as runtime/gamma.py. */
    fun start() { plainSteps = 0; probeGap = config.probeFirst; failedProbes = 0; probing = false }

    fun expectedSpeedup(gamma: Int, draftStepCost: Double): Double {
        if (gamma == 0) return 1.0
        val tokens = Verify.expectedTokensPerPass(alpha, gamma)
        val roundCost = gamma * draftStepCost + costs.targetCost(gamma + 1)
        return tokens * costs.targetCost(1) / roundCost
    }

    fun choose(draftStepCost: Double): Int {
        config.fixed?.let { return it }
        val gains = DoubleArray(config.maxGamma + 1) { expectedSpeedup(it, draftStepCost) }
        val best = Sampling.argmax(gains)
        if (gains[best] >= config.minGain) { plainSteps = 0; probeGap = config.probeFirst; failedProbes = 0; return best }
        if (probing) { failedProbes += 1; probing = false }
        plainSteps += 1
        if (plainSteps >= probeGap && failedProbes < config.maxFailedProbes) {
            plainSteps = 0
            probeGap = minOf(2 * probeGap, config.probeEvery)
            probing = true
            return maxOf(1, Sampling.argmax(gains.copyOfRange(1, gains.size)) + 1)
        }
        return 0
    }

    fun update(nDrafted: Int, nAccepted: Int) {
        if (nDrafted == 0) return
        accepted = config.decay * accepted + nAccepted
        rejected = config.decay * rejected + (if (nAccepted < nDrafted) 1.0 else 0.0)
    }
}
