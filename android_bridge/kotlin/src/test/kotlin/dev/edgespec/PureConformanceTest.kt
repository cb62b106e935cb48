package dev.edgespec

import dev.edgespec.core.Pcg64
import dev.edgespec.core.ReplayUniforms
import dev.edgespec.core.Sampling
import dev.edgespec.core.SamplingConfig
import dev.edgespec.core.Verify
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.math.BigInteger

/** Kotlin against Python on the pure parts: random stream, logit processing, sampling, verification, γ choice. */
class PureConformanceTest {
    @Test
    fun `Pcg64 reproduces numpy default_rng streams bit for bit`() {
        val cases = Traces.arr("rng.json").objects()
        assertTrue(cases.size >= 8)
        for (case in cases) {
            val rng = Pcg64(BigInteger(case.getString("seed")))
            val expected = case.getJSONArray("uniforms").doubles()
            for ((i, u) in expected.withIndex()) assertEquals(u.toRawBits(), rng.nextDouble().toRawBits(), "seed ${case.getString("seed")} draw $i")
        }
    }

    @Test
    fun `process_logits and sample match Python`() {
        val cases = Traces.arr("sampling.json").objects()
        assertTrue(cases.size >= 32)
        for ((n, case) in cases.withIndex()) {
            val config = SamplingConfig(case.getDouble("temperature"), case.getInt("top_k"), case.getDouble("top_p"))
            val probs = Sampling.processLogits(case.getJSONArray("logits").floats(), config)
            val nonzero = probs.indices.filter { probs[it] != 0.0 }
            assertEquals(case.getJSONArray("nonzero").ints().toList(), nonzero, "case $n: surviving tokens")
            val expected = case.getJSONArray("probs").doubles()
            for ((k, id) in nonzero.withIndex()) assertEquals(expected[k], probs[id], 1e-12 + 1e-9 * expected[k], "case $n token $id")
            val rng = Pcg64(case.getLong("seed"))
            val draws = IntArray(20) { Sampling.sample(probs, rng) }
            assertEquals(case.getJSONArray("draws").ints().toList(), draws.toList(), "case $n: draws")
        }
    }

    @Test
    fun `verification matches Python for greedy, stochastic and deterministic proposals`() {
        val cases = Traces.arr("verify.json").objects()
        assertTrue(cases.size >= 50)
        for ((n, case) in cases.withIndex()) {
            val p = case.getJSONArray("p").let { a -> Array(a.length()) { a.getJSONArray(it).doubles() } }
            val q = case.getJSONArray("q").let { a -> Array(a.length()) { a.getJSONArray(it).doubles() } }
            val draft = case.getJSONArray("draft").longs()
            val seed = case.getLong("seed")
            val s = Verify.stochastic(p, q, draft, Pcg64(seed))
            assertEquals(case.getJSONArray("stochastic").ints().toList(), listOf(s.first, s.second), "case $n stochastic")
            val d = Verify.deterministic(p, draft, Pcg64(seed))
            assertEquals(case.getJSONArray("deterministic").ints().toList(), listOf(d.first, d.second), "case $n deterministic")
            val logits = case.getJSONArray("logits").let { a -> Array(a.length()) { a.getJSONArray(it).floats() } }
            val g = Verify.greedy(logits, case.getJSONArray("greedy_draft").longs())
            assertEquals(case.getJSONArray("greedy").ints().toList(), listOf(g.first, g.second), "case $n greedy")
        }
    }

    @Test
    fun `a replayed uniform stream gives the same draws as the generator`() {
        val probs = doubleArrayOf(0.1, 0.0, 0.5, 0.25, 0.15)
        val uniforms = DoubleArray(50) { Pcg64(3).let { r -> repeat(it) { r.nextDouble() }; r.nextDouble() } }
        val replay = ReplayUniforms(uniforms)
        val gen = Pcg64(3)
        repeat(50) { assertEquals(Sampling.sample(probs, gen), Sampling.sample(probs, replay)) }
        assertEquals(50, replay.consumed)
    }
}
