package dev.edgespec.core

/**
 * Logit processing and single-token sampling: a port of edge_spec/sampling.py.
 * Same order (temperature, top-k, top-p, softmax), same tie rules, same random stream:
 * every draw consumes exactly one uniform and maps it through the inverse CDF.
 */
data class SamplingConfig(val temperature: Double = 0.0, val topK: Int = 0, val topP: Double = 1.0, val seed: Long? = null) {
    init {
        require(temperature.isFinite() && temperature >= 0.0) { "temperature must be finite and >= 0, got $temperature" }
        require(topK >= 0) { "top_k must be >= 0 (0 disables it), got $topK" }
        require(topP > 0.0 && topP <= 1.0) { "top_p must be in (0, 1], got $topP" }
        require(seed == null || seed >= 0) { "seed must be >= 0 (numpy seeding rule), got $seed" }
    }
    val greedy: Boolean get() = temperature == 0.0
}

object Sampling {
    private const val TOP_P_CANDIDATES = 2048

    /** numpy's pairwise summation (what np.sum does along a contiguous axis). */
    fun pairwiseSum(a: DoubleArray, from: Int = 0, n: Int = a.size - from): Double {
        if (n < 8) {
            var s = -0.0
            for (i in from until from + n) s += a[i]
            return if (n == 0) 0.0 else s
        }
        if (n <= 128) {
            val r = DoubleArray(8) { a[from + it] }
            var i = 8
            while (i < n - (n % 8)) {
                for (j in 0 until 8) r[j] += a[from + i + j]
                i += 8
            }
            var res = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
            while (i < n) { res += a[from + i]; i++ }
            return res
        }
        var n2 = n / 2
        n2 -= n2 % 8
        return pairwiseSum(a, from, n2) + pairwiseSum(a, from + n2, n - n2)
    }

    fun softmax(x: DoubleArray): DoubleArray {
        var max = Double.NEGATIVE_INFINITY
        for (v in x) if (v > max) max = v
        val w = DoubleArray(x.size) { Math.exp(x[it] - max) }
        val total = pairwiseSum(w)
        for (i in w.indices) w[i] = w[i] / total
        return w
    }

    fun argmax(x: FloatArray): Int { var best = 0; for (i in 1 until x.size) if (x[i] > x[best]) best = i; return best }
    fun argmax(x: DoubleArray): Int { var best = 0; for (i in 1 until x.size) if (x[i] > x[best]) best = i; return best }

    /** One row of logits [V] -> float64 probabilities [V] (edge_spec.sampling.process_logits). */
    fun processLogits(logits: FloatArray, config: SamplingConfig): DoubleArray =
        processLogits(DoubleArray(logits.size) { logits[it].toDouble() }, config)

    fun processLogits(row: DoubleArray, config: SamplingConfig): DoubleArray {
        require(row.isNotEmpty()) { "logits must have shape [..., V] with V >= 1" }
        var max = Double.NEGATIVE_INFINITY
        for (v in row) {
            require(!v.isNaN()) { "logits contain NaN" }
            require(v != Double.POSITIVE_INFINITY) { "logits contain +inf" }
            if (v > max) max = v
        }
        require(max.isFinite()) { "every row of logits needs at least one finite value" }
        val vocab = row.size
        if (config.greedy) return DoubleArray(vocab).also { it[argmax(row)] = 1.0 }
        var scaled = DoubleArray(vocab) { row[it] / config.temperature }
        require(scaled.none { it == Double.POSITIVE_INFINITY }) { "temperature ${config.temperature} overflows the logits to +inf" }
        if (config.topK in 1 until vocab) {
            val kth = scaled.copyOf().also { it.sort() }[vocab - config.topK]
            scaled = DoubleArray(vocab) { if (scaled[it] < kth) Double.NEGATIVE_INFINITY else scaled[it] }
        }
        if (config.topP < 1.0 && vocab > 4 * TOP_P_CANDIDATES) {
            val remove = topPRemovalLarge(scaled, config.topP)
            if (remove != null) return softmax(DoubleArray(vocab) { if (remove[it]) Double.NEGATIVE_INFINITY else scaled[it] })
        }
        if (config.topP < 1.0) {
            // Stable ascending sort: among equal logits the lower id comes first (is dropped first).
            val order = (0 until vocab).sortedWith(compareBy<Int> { scaled[it] }.thenBy { it })
            val sorted = DoubleArray(vocab) { scaled[order[it]] }
            val probs = softmax(sorted)
            val remove = BooleanArray(vocab)
            var cumulative = 0.0
            for (i in 0 until vocab) {
                cumulative += probs[i]
                if (cumulative <= 1.0 - config.topP && i != vocab - 1) remove[order[i]] = true
            }
            scaled = DoubleArray(vocab) { if (remove[it]) Double.NEGATIVE_INFINITY else scaled[it] }
        }
        return softmax(scaled)
    }

    private fun topPRemovalLarge(row: DoubleArray, topP: Double): BooleanArray? {
        val vocab = row.size
        // The TOP_P_CANDIDATES most likely ids, ranked by descending logit, then descending id.
        val ranked = (0 until vocab).sortedWith(compareByDescending<Int> { row[it] }.thenByDescending { it }).take(TOP_P_CANDIDATES)
        val probs = softmax(row)
        val massAbove = DoubleArray(ranked.size)
        var cumulative = 0.0
        for (i in ranked.indices) { cumulative += probs[ranked[i]]; massAbove[i] = cumulative - probs[ranked[i]] }
        if (!(massAbove[ranked.size - 1] >= topP)) return null
        val remove = BooleanArray(vocab) { true }
        for (i in ranked.indices) if (massAbove[i] < topP) remove[ranked[i]] = false
        return remove
    }

    /** Inverse-CDF draw (edge_spec.sampling.sample): one uniform; first j with cdf[j] > u * total. */
    fun sample(probs: DoubleArray, rng: UniformSource): Int {
        require(probs.isNotEmpty()) { "probs must be a non-empty 1-D vector" }
        var min = Double.POSITIVE_INFINITY
        for (p in probs) if (p < min) min = p
        require(min >= 0.0) { "probs must be non-negative" }
        val cumulative = DoubleArray(probs.size)
        var s = 0.0
        for (i in probs.indices) { s += probs[i]; cumulative[i] = s }
        val total = cumulative[probs.size - 1]
        require(total.isFinite() && total > 0.0) { "probs must have positive finite total mass, got $total" }
        val x = rng.nextDouble() * total
        // searchsorted(side="right"): the first index whose value is > x.
        var lo = 0; var hi = probs.size
        while (lo < hi) { val mid = (lo + hi) ushr 1; if (cumulative[mid] <= x) lo = mid + 1 else hi = mid }
        if (lo >= probs.size) { lo = probs.size - 1; while (probs[lo] == 0.0) lo-- }
        return lo
    }
}
