package dev.edgespec.core

/** Up to γ proposed tokens; draftProbs = q per token (null: deterministic, verified as one-hot). */
open class Proposal(val tokens: LongArray, val draftProbs: Array<DoubleArray>?)

/** Layer skip's: the trunk's output for [pending, d1..d(γ-1)], rows already written, so the verify pass skips them. */
class TrunkProposal(tokens: LongArray, draftProbs: Array<DoubleArray>?, val trunkHidden: Hidden) : Proposal(tokens, draftProbs)

/**
 * A draft model's: catchUpSeconds/catchUpTokens are the replay of tokens it had not seen (after plain
 * or copy rounds), a one-off the cost model prices apart from a draft step (runtime/drafters/base.py).
 */
class CatchUpProposal(
    tokens: LongArray, draftProbs: Array<DoubleArray>?, val catchUpSeconds: Double = 0.0, val catchUpTokens: Int = 0,
) : Proposal(tokens, draftProbs)

/** Seconds from the JVM's monotonic clock: what the loop and drafters time with unless given another. */
val monotonicSeconds: () -> Double = { System.nanoTime() / 1e9 }

/**
 * The drafter interface the loop speaks to (runtime/drafters/base.py): what every drafter needs. What
 * only some need is a capability checked by type: [CostsPasses], [CatchesUp], [Selects].
 */
abstract class Drafter {
    abstract val name: String
    abstract fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal?
    open fun accepted(tokens: LongArray, nAccepted: Int) {}
    open fun reset(tokens: LongArray = LongArray(0)) {}
    /** The class of situation a round after `tokens` drafts in (a copy's match length); the policy keeps an α per class. */
    open fun evidence(tokens: LongArray): Int = 0

    companion object {
        /** Draft one token: argmax when greedy (no q needed), else a sample from q, returned with q. */
        fun pickToken(logits: FloatArray, sampling: SamplingConfig, rng: UniformSource): Pair<Int, DoubleArray?> {
            if (sampling.greedy) return Sampling.argmax(logits) to null
            val q = Sampling.processLogits(logits, sampling)
            return Sampling.sample(q, rng) to q
        }
    }
}

/** Drafting runs model passes (a draft model, layer skip): the cost model times its steps; other drafters draft for free. */
interface CostsPasses

/** A drafter with its own cache that must first feed itself what it missed; it times that replay with `clock` (the loop's). */
interface CatchesUp : CostsPasses {
    var clock: () -> Double
    /** Tokens this drafter must feed itself before it can draft after `tokens`; the round that drafts next pays for them. */
    fun replayTokens(tokens: LongArray): Int
}

/** A drafter made of parts, one of which drafts each round (the policy asks which). */
interface Selects {
    fun parts(): List<Drafter>
    /** The parts able to propose after `tokens`, preferred first; the policy picks one. */
    fun candidates(tokens: LongArray): List<Drafter>
}

/** The drafters a round can draft with: a mixed drafter's parts, else the drafter itself. */
fun partsOf(drafter: Drafter?): List<Drafter> = when (drafter) {
    null -> emptyList()
    is Selects -> drafter.parts()
    else -> listOf(drafter)
}

/** Drafters that time themselves (replay) read `clock`, so a fake clock reaches every measurement. */
fun useClock(drafter: Drafter?, clock: () -> Double) { partsOf(drafter).forEach { if (it is CatchesUp) it.clock = clock } }

/** 0 for no match, then 1 for a 2-token match, 2 for 3–4 tokens, 3 for 5–8, … (runtime/drafters/prompt_lookup.py). */
fun matchClass(matchLength: Int): Int = if (matchLength > 0) 32 - Integer.numberOfLeadingZeros(matchLength - 1) else 0

/** Copy what followed the latest earlier occurrence of the longest suffix match (at least minNgram, up to maxMatch tokens). */
class PromptLookupDrafter(private val maxMatch: Int = 32, private val minNgram: Int = 2) : Drafter() {
    override val name = "lookup"

    /** (where the copied continuation starts, the match length); (0, 0) when there is none. */
    fun match(tokens: LongArray): Pair<Int, Int> {
        val length = tokens.size
        var bestStart = 0
        var best = 0
        // Latest first, and only a strictly longer match replaces: the latest of the longest wins.
        for (i in length - 1 - minNgram downTo 0) {
            var n = 0
            while (n < minNgram && tokens[i + n] == tokens[length - minNgram + n]) n++
            if (n < minNgram) continue
            val start = i + minNgram
            var matched = minNgram
            while (matched < minOf(maxMatch, length) && start - 1 - matched >= 0 &&
                tokens[start - 1 - matched] == tokens[length - 1 - matched]) matched++
            if (matched > best) { best = matched; bestStart = start }
        }
        return bestStart to best
    }

    fun find(tokens: LongArray, gamma: Int): LongArray {
        val (start, matched) = match(tokens)
        return if (matched > 0) tokens.copyOfRange(start, minOf(start + gamma, tokens.size)) else LongArray(0)
    }

    override fun evidence(tokens: LongArray): Int = matchClass(match(tokens).second)

    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal? {
        val continuation = find(tokens, gamma)
        return if (continuation.isNotEmpty()) Proposal(continuation, null) else null
    }
}

/** A smaller same-tokenizer model drafts γ tokens from its own KV cache. */
class DraftModelDrafter(val runner: TargetModel) : Drafter(), CatchesUp {
    override val name = "model"
    override var clock: () -> Double = monotonicSeconds

    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal? {
        val cache = runner.cache
        val g = minOf(gamma, cache.maxContext - tokens.size + 1)
        if (g <= 0) return null
        // The pending token, and after a round accepted in full the last drafted token before it, go in one pass; more is replay, timed apart.
        var missing = tokens.copyOfRange(cache.kvLen, tokens.size)
        val replay = replayTokens(tokens)
        var catchUp = 0.0
        if (replay > 0) {
            val began = clock()
            runner.prefill(missing.copyOfRange(0, missing.size - 1))
            catchUp = clock() - began
            missing = missing.copyOfRange(missing.size - 1, missing.size)
        }
        var logits = runner.forward(missing, nLogits = 1).last()
        val drafted = LongArray(g)
        val probs = arrayOfNulls<DoubleArray>(g)
        for (i in 0 until g) {
            val (token, q) = pickToken(logits, sampling, rng)
            drafted[i] = token.toLong(); probs[i] = q
            if (i + 1 < g) logits = runner.forward(longArrayOf(token.toLong())).last()
        }
        return CatchUpProposal(drafted, if (sampling.greedy) null else Array(g) { probs[it]!! }, catchUp, replay)
    }

    /** More than the one token a round leaves unfed is replay after plain or copy rounds, not what a draft step costs. */
    override fun replayTokens(tokens: LongArray): Int {
        val missing = tokens.size - runner.cache.kvLen
        return if (missing > 2) missing - 1 else 0
    }

    /** Never keeps a row for the pending (last) token, even one equal to a rejected draft: the next round feeds it first. */
    override fun accepted(tokens: LongArray, nAccepted: Int) { runner.cache.rollbackToPrefix(tokens.copyOfRange(0, tokens.size - 1)) }

    /** Prefills the prompt now, so it is timed as prefill rather than as drafting. */
    override fun reset(tokens: LongArray) {
        runner.cache.rollbackToPrefix(tokens)
        runner.prefill(tokens.copyOfRange(runner.cache.kvLen, tokens.size))
    }
}

/**
 * Self-speculation: the target's first stage (trunk), the later stages the layer_skip role keeps (a subset
 * chosen at export), then the head, writing their KV rows into the target's cache.
 */
class LayerSkipDrafter(val runner: ModelRunner) : Drafter(), CostsPasses {
    override val name = "layer-skip"

    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal? {
        val cache = runner.cache
        val start = cache.kvLen
        val g = minOf(gamma, cache.maxContext - start - 1)
        if (g <= 0) return null
        var token = tokens.last()
        var hidden: Hidden? = null
        val drafted = LongArray(g)
        val probs = arrayOfNulls<DoubleArray>(g)
        for (i in 0 until g) {
            val h = (runner.runStage(0, StageInput.Ids(longArrayOf(token)), start + i) as StageOutput.States).hidden
            hidden = hidden?.concat(h) ?: h
            val last = runner.stages.size - 1
            var x = h
            for (index in 1 until last) x = (runner.runStage(index, StageInput.States(x), start + i) as StageOutput.States).hidden
            val logits = (runner.runStage(last, StageInput.States(x), start + i, longArrayOf(0)) as StageOutput.Logits).rows.last()
            val (t, q) = pickToken(logits, sampling, rng)
            token = t.toLong(); drafted[i] = token; probs[i] = q
        }
        return TrunkProposal(drafted, if (sampling.greedy) null else Array(g) { probs[it]!! }, hidden!!)
    }
}

/** Copy when the text repeats, otherwise draft with a model: chosen per round. */
class MixedDrafter(val lookup: PromptLookupDrafter, val model: Drafter?) : Drafter(), Selects {
    override val name = "auto"
    override fun candidates(tokens: LongArray): List<Drafter> = when {
        model == null -> listOf(lookup)
        lookup.find(tokens, 1).isNotEmpty() -> listOf(lookup, model)
        else -> listOf(model)
    }
    override fun parts(): List<Drafter> = listOfNotNull(lookup, model)
    // Drafting with a fixed part here would bypass the policy's choice and its α per part.
    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal? =
        throw IllegalStateException("'$name' selects one of its parts per round (RoundPolicy.choose): call propose on Plan.drafter")
    override fun accepted(tokens: LongArray, nAccepted: Int) { parts().forEach { it.accepted(tokens, nAccepted) } }
    override fun reset(tokens: LongArray) { parts().forEach { it.reset(tokens) } }
}
