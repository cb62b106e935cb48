package dev.edgespec.core

/**
 * Verification of speculative decoding (edge_spec/verify.py), same rules and random stream:
 * each examined draft position consumes one uniform for the accept test, then the correction
 * or bonus token consumes one more through [Sampling.sample]. Results: (nAccepted, nextToken).
 */
object Verify {
    fun greedy(targetLogits: Array<FloatArray>, draftTokens: LongArray): Pair<Int, Int> {
        val gamma = draftTokens.size
        require(targetLogits.size == gamma + 1) { "target rows must have shape [gamma+1=${gamma + 1}, V], got ${targetLogits.size} rows" }
        val argmax = IntArray(gamma + 1) { Sampling.argmax(targetLogits[it]) }
        var n = 0
        while (n < gamma && draftTokens[n] == argmax[n].toLong()) n++
        return n to argmax[n]
    }

    fun stochastic(targetProbs: Array<DoubleArray>, draftProbs: Array<DoubleArray>, draftTokens: LongArray, rng: UniformSource): Pair<Int, Int> {
        val gamma = draftProbs.size
        require(targetProbs.size == gamma + 1) { "target rows must have shape [gamma+1=${gamma + 1}, V]" }
        require(draftTokens.size == gamma) { "expected $gamma draft tokens, got ${draftTokens.size}" }
        val vocab = targetProbs[0].size
        for ((pos, token) in draftTokens.withIndex()) {
            require(token in 0 until vocab) { "draft token $token outside vocabulary [0, $vocab)" }
            val q = draftProbs[pos][token.toInt()]
            require(q > 0.0) { "draft token $token at position $pos has q = $q; it cannot have been sampled from the draft distribution" }
        }
        for ((pos, t) in draftTokens.withIndex()) {
            val token = t.toInt()
            val q = draftProbs[pos][token]
            val p = targetProbs[pos][token]
            val u = rng.nextDouble()
            if (p >= q || u * q < p) continue
            var residual = DoubleArray(vocab) { maxOf(targetProbs[pos][it] - draftProbs[pos][it], 0.0) }
            if (!(Sampling.pairwiseSum(residual) > 0.0)) residual = targetProbs[pos]
            return pos to Sampling.sample(residual, rng)
        }
        return gamma to Sampling.sample(targetProbs[gamma], rng)
    }

    fun deterministic(targetProbs: Array<DoubleArray>, draftTokens: LongArray, rng: UniformSource): Pair<Int, Int> {
        val gamma = draftTokens.size
        require(targetProbs.size == gamma + 1) { "target rows must have shape [gamma+1=${gamma + 1}, V]" }
        val vocab = targetProbs[0].size
        for (token in draftTokens) require(token in 0 until vocab) { "draft token $token outside vocabulary [0, $vocab)" }
        for ((pos, t) in draftTokens.withIndex()) {
            val token = t.toInt()
            val p = targetProbs[pos][token]
            val u = rng.nextDouble()
            if (p >= 1.0 || u < p) continue
            var residual = DoubleArray(vocab) { maxOf(targetProbs[pos][it], 0.0) }
            residual[token] = 0.0
            if (!(Sampling.pairwiseSum(residual) > 0.0)) residual = targetProbs[pos]
            return pos to Sampling.sample(residual, rng)
        }
        return gamma to Sampling.sample(targetProbs[gamma], rng)
    }

    fun expectedTokensPerPass(alpha: Double, gamma: Int): Double {
        require(alpha in 0.0..1.0) { "alpha must be in [0, 1], got $alpha" }
        require(gamma >= 0) { "gamma must be a non-negative int, got $gamma" }
        if (alpha == 1.0) return (gamma + 1).toDouble()
        return (1.0 - Math.pow(alpha, (gamma + 1).toDouble())) / (1.0 - alpha)
    }
}
