package dev.edgespec.core

/** What adaptive γ is configured with (runtime/gamma.py); Policy.kt chooses γ from it and the measured CostModel. */
data class GammaConfig(
    val fixed: Int? = null, val maxGamma: Int = 8, val probeFirst: Int = 2, val probeEvery: Int = 32,
    val maxFailedProbes: Int = 2, val minGain: Double = 1.02, val decay: Double = 0.98, val maxLoss: Double = 0.01,
    val priorWeight: Double = 4.0,
) {
    init {
        require(fixed == null || fixed in 1..MAX_GAMMA) { "gamma must be 1..$MAX_GAMMA (or adaptive), got $fixed" }
        require(maxGamma in 1..MAX_GAMMA) { "max_gamma must be 1..$MAX_GAMMA, got $maxGamma" }
        require(probeFirst >= 1 && probeEvery >= 1) { "probe_first and probe_every must be >= 1, got $probeFirst and $probeEvery" }
        require(maxFailedProbes >= 0) { "max_failed_probes must be >= 0, got $maxFailedProbes" }
        require(minGain >= 0 && maxLoss >= 0 && priorWeight >= 0) { "min_gain, max_loss and prior_weight must be >= 0" }
        require(decay > 0 && decay <= 1) { "decay must be in (0, 1], got $decay" }
    }

    companion object {
        /** Start-up calibration times every verify block up to maxGamma + 1 (runtime/gamma.py MAX_GAMMA). */
        const val MAX_GAMMA = 32
    }
}

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
