package dev.edgespec.core

/** One target pass: the accepted drafted tokens then one token from the target. */
data class Step(
    val tokens: List<Int>, val gamma: Int, val nDrafted: Int, val nAccepted: Int,
    val draftSeconds: Double, val targetSeconds: Double, val drafter: String?,
)

/** The speculative loop (runtime/loop.py): draft, verify in one target pass, accept, roll back by length. */
object Loop {
    fun verify(logits: Array<FloatArray>, proposal: Proposal?, sampling: SamplingConfig, rng: UniformSource): Pair<Int, Int> {
        val draftTokens = proposal?.tokens ?: LongArray(0)
        if (sampling.greedy) return Verify.greedy(logits, draftTokens)
        val targetProbs = Array(logits.size) { Sampling.processLogits(logits[it], sampling) }
        if (proposal?.draftProbs == null) return Verify.deterministic(targetProbs, draftTokens, rng)
        return Verify.stochastic(targetProbs, proposal.draftProbs, draftTokens, rng)
    }

    /**
     * A lazy sequence of rounds; the caller stops consuming when it has enough. `clock` (seconds) is
     * read for every timing the cost model and γ controllers learn from, the drafters' included, so
     * a fake clock makes adaptive γ deterministic (runtime/loop.py decode_steps).
     */
    fun decodeSteps(
        target: TargetModel, drafter: Drafter?, promptIds: LongArray, sampling: SamplingConfig, rng: UniformSource,
        controllers: Map<String, GammaController>, costs: CostModel, clock: () -> Double = monotonicSeconds,
    ): Sequence<Step> = sequence {
        var tokens = promptIds.copyOf()
        val head = tokens.copyOfRange(0, tokens.size - 1)
        target.cache.rollbackToPrefix(head)
        drafter?.useClock(clock)
        drafter?.reset(head)
        target.prefill(tokens.copyOfRange(target.cache.kvLen, tokens.size - 1))
        while (true) {
            val began = clock()
            val active = drafter?.select(tokens)
            var nGamma = 0
            if (active != null) {
                val stepCost = if (active.costsPasses) costs.draftStep[active.name] ?: 0.0 else 0.0
                val replayCost = costs.replayCost(active.name, active.replayTokens(tokens))
                nGamma = minOf(controllers.getValue(active.name).choose(stepCost, replayCost), target.cache.maxContext - tokens.size)
            }
            val proposal = if (nGamma > 0) active!!.propose(tokens, nGamma, sampling, rng) else null
            val drafted = clock()
            val nDrafted = proposal?.tokens?.size ?: 0
            val block = if (proposal == null) longArrayOf(tokens.last()) else longArrayOf(tokens.last()) + proposal.tokens
            val logits = target.forward(block, trunkHidden = proposal?.trunkHidden)
            val verified = clock()
            val (nAccepted, next) = verify(logits, proposal, sampling, rng)
            val newTokens = block.copyOfRange(1, 1 + nAccepted) + next.toLong()
            tokens += newTokens
            // tokens minus the last: the pending token never keeps a row, even if it equals a rejected draft.
            target.cache.rollbackToPrefix(tokens.copyOfRange(0, tokens.size - 1))
            drafter?.accepted(tokens, nAccepted)
            val draftS = drafted - began
            val targetS = verified - drafted
            costs.recordTarget(block.size, targetS)
            if (nDrafted > 0) {
                val controller = controllers.getValue(active!!.name)
                controller.update(nDrafted, nAccepted)
                controller.recordRound(verified - began, newTokens.size)
                if (active.costsPasses) {
                    costs.recordDraft(active.name, nDrafted, draftS - proposal!!.catchUpSeconds)
                    costs.recordReplay(active.name, proposal.catchUpTokens, proposal.catchUpSeconds)
                }
            }
            yield(Step(newTokens.map { it.toInt() }, nGamma, nDrafted, nAccepted, draftS, targetS, if (nDrafted > 0) active!!.name else null))
        }
    }
}
