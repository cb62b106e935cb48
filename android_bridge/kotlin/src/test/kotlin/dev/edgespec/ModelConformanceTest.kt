package dev.edgespec

import dev.edgespec.core.Engine
import dev.edgespec.core.GammaConfig
import dev.edgespec.core.RoundPolicy
import dev.edgespec.core.monotonicSeconds
import dev.edgespec.core.EngineConfig
import dev.edgespec.core.GenerateConfig
import dev.edgespec.core.Loop
import dev.edgespec.core.Pcg64
import dev.edgespec.core.ReplayUniforms
import dev.edgespec.core.SamplingConfig
import org.json.JSONObject
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.io.File
import kotlin.math.abs

/**
 * Kotlin over ai.onnxruntime against Python on the same ONNX graphs: logits within 1e-4, and every
 * speculative generation (greedy and seeded sampling, each drafter) round for round identical.
 */
class ModelConformanceTest {
    private fun check(name: String) {
        val trace = Traces.obj("model_$name.json")
        Engine(File(trace.getString("bundle")), EngineConfig(drafter = "none")).use { engine ->
            val promptIds = trace.getJSONArray("prompt_ids").ints()
            assertEquals(promptIds.toList(), engine.encode(trace.getString("prompt")).toList(), "prompt tokenization")
            engine.target.cache.reset()
            val logits = engine.target.forward(promptIds.map { it.toLong() }.toLongArray())
            val samples = trace.getJSONObject("logits")
            val rows = samples.getJSONArray("rows").ints()
            val stride = samples.getInt("stride")
            var worst = 0.0
            for ((k, row) in rows.withIndex()) {
                val want = samples.getJSONArray("values").getJSONArray(k).doubles()
                for ((j, w) in want.withIndex()) worst = maxOf(worst, abs(logits[row][j * stride] - w))
            }
            assertTrue(worst <= 1e-4, "$name: logits differ from Python by up to $worst")
            engine.target.cache.reset()
            val gens = trace.getJSONArray("generations").objects()
            assertTrue(gens.any { it.isNull("gamma") }, "$name: the trace has adaptive-γ runs")
            for (gen in gens) checkGeneration(engine, name, promptIds, gen)
            val stops = trace.getJSONArray("stops").objects()
            assertTrue(stops.isNotEmpty() && stops.all { it.getJSONArray("stop").length() == 2 }, "$name: the trace has stop-string runs")
            for (run in stops) checkStops(engine, name, promptIds, run)
        }
    }

    private fun sampling(gen: JSONObject) = SamplingConfig(gen.getDouble("temperature"), gen.getInt("top_k"), gen.getDouble("top_p"),
        if (gen.isNull("seed")) null else gen.getLong("seed"))

    private fun checkGeneration(engine: Engine, name: String, promptIds: IntArray, gen: JSONObject) {
        val adaptive = gen.isNull("gamma")
        val what = "$name drafter=${gen.getString("drafter")} γ=${if (adaptive) "adaptive" else gen.getInt("gamma")} T=${gen.getDouble("temperature")}"
        val sampling = sampling(gen)
        engine.useDrafter(gen.getString("drafter"), if (adaptive) null else gen.getInt("gamma").takeIf { it > 0 })  // γ 0 names plain decoding, drafter "none"
        val maxNew = gen.getInt("max_new_tokens")
        val want = gen.getJSONArray("token_ids").ints().toList()
        // 1) Engine.generate with the seeded generator (numpy's stream, reproduced); adaptive γ runs on the engine's real clock, so only 2).
        if (!adaptive) {
            val result = engine.generate(promptIds, GenerateConfig(maxNew, sampling))
            assertEquals(want, result.tokenIds, "$what: emitted tokens")
        }
        // 2) Round by round, replaying the exact uniforms Python drew (and for adaptive γ, from fresh costs and
        //    controllers, the fake clock's readings): same γ, proposals, acceptances, and draw count.
        val uniforms = gen.getJSONArray("uniforms").doubles()
        val replay = ReplayUniforms(uniforms)
        engine.target.cache.reset(); engine.drafter?.reset()
        val steps = gen.getJSONArray("steps").objects()
        val readings = if (adaptive) gen.getJSONArray("clock").doubles() else null
        val clock = readings?.let { ReplayClock(it) }
        val policy = if (!adaptive) engine.startPolicy(engine.drafter) else RoundPolicy().start(engine.drafter, maxNew,
            GammaConfig(maxGamma = gen.getInt("max_gamma"), maxLoss = gen.getDouble("max_loss"), maxFailedProbes = gen.getInt("max_failed_probes")))
        // Lazily, so the first round that differs is the one reported.
        val rounds = Loop.decodeSteps(engine.target, engine.drafter, promptIds.map { it.toLong() }.toLongArray(), sampling, replay,
            policy, clock ?: monotonicSeconds).iterator()
        for ((i, step) in steps.withIndex()) {
            val got = rounds.next()
            assertEquals(step.getInt("gamma"), got.gamma, "$what round $i γ")
            assertEquals(step.getJSONArray("tokens").ints().toList(), got.tokens, "$what round $i tokens")
            assertEquals(step.getInt("drafted"), got.nDrafted, "$what round $i drafted")
            assertEquals(step.getInt("accepted"), got.nAccepted, "$what round $i accepted")
            assertEquals(if (step.isNull("drafter")) null else step.getString("drafter"), got.drafter, "$what round $i drafter")
        }
        assertEquals(uniforms.size, replay.consumed, "$what: uniforms consumed")
        if (clock != null) assertEquals(readings!!.size, clock.consumed, "$what: clock readings")
        engine.target.cache.reset(); engine.drafter?.reset()
        if (sampling.seed != null) {
            val gen2 = Pcg64(sampling.seed!!)
            repeat(uniforms.size) { assertEquals(uniforms[it], gen2.nextDouble(), "$what uniform $it") }
        }
    }

    /** Engine.generate with stop strings where the later-listed one occurs earlier in the text: Python's text, tokens and reason. */
    private fun checkStops(engine: Engine, name: String, promptIds: IntArray, run: JSONObject) {
        val stops = run.getJSONArray("stop").let { a -> List(a.length()) { a.getString(it) } }
        val what = "$name drafter=${run.getString("drafter")} stops=$stops"
        engine.useDrafter(run.getString("drafter"), run.getInt("gamma"))
        val result = engine.generate(promptIds, GenerateConfig(run.getInt("max_new_tokens"), sampling(run), stops))
        assertEquals(run.getString("text"), result.text, "$what: text")
        assertEquals(run.getJSONArray("token_ids").ints().toList(), result.tokenIds, "$what: tokens")
        assertEquals(run.getString("stop_reason"), result.stopReason, "$what: stop reason")
    }

    @Test fun `tiny llama (draft model, layer skip, lookup, auto) matches Python`() = check("tiny_llama")
    @Test fun `tiny qwen2 (q-k-v biases, untied head) matches Python`() = check("tiny_qwen2")
    @Test fun `SmolLM2-135M real weights match Python`() = check("smollm2")
}
