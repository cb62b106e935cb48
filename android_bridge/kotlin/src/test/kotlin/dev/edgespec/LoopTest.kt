package dev.edgespec

import dev.edgespec.core.DraftModelDrafter
import dev.edgespec.core.Drafter
import dev.edgespec.core.GammaConfig
import dev.edgespec.core.PartPolicy
import dev.edgespec.core.Plan
import dev.edgespec.core.Hidden
import dev.edgespec.core.KvCache
import dev.edgespec.core.Loop
import dev.edgespec.core.MixedDrafter
import dev.edgespec.core.Pcg64
import dev.edgespec.core.PromptLookupDrafter
import dev.edgespec.core.RoundPolicy
import dev.edgespec.core.SamplingConfig
import dev.edgespec.core.Step
import dev.edgespec.core.TargetModel
import dev.edgespec.core.ContextFullException
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertThrows
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test

/**
 * A fake model: logits depend only on the tokens before each position (as a causal LM's do), read
 * from the cache's row tokens, so rollback mistakes show up as wrong tokens. `agree` < 1 makes a draft
 * that deviates from the target's rule at some positions.
 */
class FakeModel(maxContext: Int = 64, private val vocab: Int = 16, private val salt: Int = 0, private val agree: Double = 1.0) : TargetModel {
    override val cache = KvCache(0 until 0, 1, maxContext, 1)
    override val vocabSize = vocab
    var passes = 0

    private fun rowLogits(prefix: List<Long>): FloatArray {
        val h = prefix.takeLast(3).fold(17L) { acc, t -> acc * 31 + t }
        val best = ((h * 7 + prefix.size) % vocab).toInt().let { if (it < 0) it + vocab else it }
        val mix = ((h * 2654435761L + salt) ushr 7) % 1000 / 1000.0
        val winner = if (mix < agree) best else (best + 1) % vocab
        return FloatArray(vocab) { if (it == winner) 4f else ((it * 13 + h.toInt()) % 7).toFloat() * 0.3f }
    }

    override fun forward(tokens: LongArray, nLogits: Int, trunkHidden: Hidden?): Array<FloatArray> {
        passes++
        val start = cache.kvLen
        cache.checkRoom(start, tokens.size)
        val prefix = cache.rowTokens.take(start).toMutableList()
        val rows = ArrayList<FloatArray>()
        for ((i, t) in tokens.withIndex()) {
            prefix.add(t)
            if (i >= tokens.size - nLogits) rows.add(rowLogits(prefix))
        }
        cache.extend(tokens)
        return rows.toTypedArray()
    }
}

class LoopTest {
    private fun run(target: FakeModel, drafter: Drafter?, prompt: LongArray, n: Int, sampling: SamplingConfig = SamplingConfig(), gamma: Int? = 4): List<Step> {
        val policy = RoundPolicy().start(drafter, config = GammaConfig(fixed = gamma))
        val steps = ArrayList<Step>()
        var total = 0
        for (step in Loop.decodeSteps(target, drafter, prompt, sampling, Pcg64(sampling.seed ?: 0), policy)) {
            steps.add(step); total += step.tokens.size
            assertEquals(prompt.size + total - 1, target.cache.kvLen, "kv_len: every committed token but the pending one")
            if (total >= n) break
        }
        return steps
    }

    private fun tokens(steps: List<Step>, n: Int) = steps.flatMap { it.tokens }.take(n)
    private val prompt = longArrayOf(1, 2, 3, 4, 5, 1, 2, 3)

    @Test
    fun `greedy speculation with a draft model emits the target's plain tokens`() {
        val plain = tokens(run(FakeModel(), null, prompt, 40), 40)
        for (agree in listOf(1.0, 0.7, 0.3, 0.0)) {
            val target = FakeModel()
            val steps = run(target, DraftModelDrafter(FakeModel(salt = 5, agree = agree)), prompt, 40)
            assertEquals(plain, tokens(steps, 40), "agree=$agree")
            if (agree == 1.0) assertTrue(steps.all { it.nAccepted == it.nDrafted }, "a perfect draft is always accepted")
            assertTrue(target.passes < 40 || agree < 1.0)
        }
    }

    @Test
    fun `a perfect draft emits gamma plus one tokens per target pass`() {
        val steps = run(FakeModel(), DraftModelDrafter(FakeModel(agree = 1.0)), prompt, 30, gamma = 4)
        assertTrue(steps.dropLast(1).all { it.tokens.size == 5 && it.nAccepted == 4 })
    }

    @Test
    fun `after a fully accepted round the draft catches up in one 2-token pass`() {
        val draft = FakeModel(agree = 1.0)
        val drafter = DraftModelDrafter(draft)
        val rounds = Loop.decodeSteps(FakeModel(), drafter, prompt, SamplingConfig(), Pcg64(0), RoundPolicy().start(drafter, config = GammaConfig(fixed = 4))).iterator()
        val out = rounds.next().tokens.toMutableList()
        repeat(5) {
            val before = draft.passes
            val step = rounds.next()
            assertEquals(4, step.nAccepted)
            assertEquals(4, draft.passes - before, "[d_γ, bonus] in one pass, then γ - 1 drafting passes")
            out += step.tokens
        }
        assertEquals(tokens(run(FakeModel(), null, prompt, out.size), out.size), out)
    }

    @Test
    fun `prompt lookup and the mixed drafter keep greedy output exact`() {
        val plain = tokens(run(FakeModel(), null, prompt, 30), 30)
        assertEquals(plain, tokens(run(FakeModel(), PromptLookupDrafter(), prompt, 30), 30))
        val mixed = MixedDrafter(PromptLookupDrafter(), DraftModelDrafter(FakeModel(salt = 9, agree = 0.5)))
        val steps = run(FakeModel(), mixed, prompt, 30)
        assertEquals(plain, tokens(steps, 30))
        assertTrue(steps.any { it.drafter == "lookup" }, "the repeated prompt should be copied at least once")
    }

    @Test
    fun `seeded sampling is reproducible and unchanged by the draft's quality only through the stream`() {
        val sampling = SamplingConfig(temperature = 1.0, seed = 11)
        val a = tokens(run(FakeModel(), DraftModelDrafter(FakeModel(agree = 0.6)), prompt, 25, sampling), 25)
        val b = tokens(run(FakeModel(), DraftModelDrafter(FakeModel(agree = 0.6)), prompt, 25, sampling), 25)
        assertEquals(a, b)
        assertTrue(a.all { it in 0 until 16 })
    }

    @Test
    fun `prompt lookup finds the latest match of the longest suffix`() {
        val d = PromptLookupDrafter()
        assertEquals(listOf(9L, 8L), d.find(longArrayOf(1, 2, 3, 9, 8, 7, 1, 2, 3), 2).toList())
        assertEquals(listOf(4L, 5L, 6L), d.find(longArrayOf(5, 6, 4, 5, 6, 4, 5, 6), 3).toList())
        assertEquals(emptyList<Long>(), d.find(longArrayOf(1, 2, 3, 4), 3).toList())
        assertEquals(listOf(7L, 1L, 2L), d.find(longArrayOf(1, 2, 7, 1, 2), 5).toList())
    }

    @Test
    fun `rollback keeps the committed prefix only`() {
        val cache = KvCache(0 until 0, 1, 16, 1)
        cache.extend(longArrayOf(1, 2, 3, 4, 5))
        assertEquals(3, cache.rollbackToPrefix(longArrayOf(1, 2, 3, 9, 9, 9)))
        assertEquals(3, cache.rollbackToPrefix(longArrayOf(1, 2, 3, 4)))
        assertEquals(2, cache.rollbackToPrefix(longArrayOf(1, 2)))
        assertThrows(ContextFullException::class.java) { cache.checkRoom(10, 7) }
    }

    @Test
    fun `gamma never runs past the context`() {
        val target = FakeModel(maxContext = 20)
        val steps = run(target, DraftModelDrafter(FakeModel(maxContext = 20)), prompt, 11, gamma = 8)
        assertTrue(steps.sumOf { it.tokens.size } + prompt.size <= 21)
    }

    @Test
    fun `adaptive gamma drafts long when drafting is free and acceptance high, not at all when it is costly`() {
        val costs = dev.edgespec.core.CostModel().apply { for (b in 1..9) recordTarget(b, 0.01) }
        val c = PartPolicy(GammaConfig(), costs, priorAlpha = 0.95)
        assertEquals(8, c.choose(0.0).gamma)
        val slow = PartPolicy(GammaConfig(), costs, priorAlpha = 0.1)
        assertEquals(0, slow.choose(0.05).gamma)
    }

    @Test
    fun `a probe that buys only information pays its replay whole`() {
        val costs = dev.edgespec.core.CostModel().apply { mapOf(1 to 1.0, 2 to 1.27, 3 to 1.84, 4 to 2.13).forEach { (b, s) -> recordTarget(b, s) } }
        val low = PartPolicy(GammaConfig(), costs, priorAlpha = 0.4).apply { start(128) }
        // Choosing changes nothing: each round is played (follow) for the probe schedule to move.
        assertTrue((0 until 40).none { low.choose(0.16, 0.08 * 40).also(low::follow).gamma > 0 }, "a probe replayed 40 tokens")
        val probe = low.choose(0.16, 0.08 * 4).also(low::follow)
        assertEquals(1, probe.gamma)
        assertTrue(probe.probe && probe.wholeReplay)
        val high = PartPolicy(GammaConfig(), costs, priorAlpha = 0.95).apply { start(128) }
        high.ledger.record(2 * 0.16 + 1.84, 1)
        high.ledger.advance(1)
        var plan = Plan()
        val back = (0 until 100).first { plan = high.choose(0.16, 0.08 * it).also(high::follow); plan.gamma > 0 || run { high.ledger.advance(1); false } }
        assertTrue(back in 11..98 && !plan.wholeReplay, "came back after $back")
    }
}
