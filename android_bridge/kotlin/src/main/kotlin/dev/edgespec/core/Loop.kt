package dev.edgespec.core

/** One target pass: the accepted drafted tokens then one token from the target. */
data class Step(
    val tokens: List<Int>, val gamma: Int, val nDrafted: Int, val nAccepted: Int,
    val draftSeconds: Double, val targetSeconds: Double, val drafter: String?,
)

/** The speculative loop (runtime/loop.py): choose, draft, verify in one target pass, accept, roll back by length, report. */
object Loop {
    fun verify(logits: Array<FloatArray>, proposal: Proposal?, sampling: SamplingConfig, rng: UniformSource): Pair<Int, Int> {
        val draftTokens = proposal?.tokens ?: LongArray(0)
        if (sampling.greedy) return Verify.greedy(logits, draftTokens)
        val targetProbs = Array(logits.size) { Sampling.processLogits(logits[it], sampling) }
        if (proposal?.draftProbs == null) return Verify.deterministic(targetProbs, draftTokens, rng)
        return Verify.stochastic(targetProbs, proposal.draftProbs, draftTokens, rng)
    }

    /**
     * A lazy sequence of rounds; the caller stops consuming when it has enough. `policy`, started for this
     * drafter and sequence ([RoundPolicy.start]), plans each round (drafter and γ) and learns from each
     * round, handed back with its plan. `clock` (seconds) is read for every timing the policy learns from, the drafters' included, so
     * a fake clock makes adaptive γ deterministic (runtime/loop.py decode_steps).
     */
    fun decodeSteps(
        target: TargetModel, drafter: Drafter?, promptIds: LongArray, sampling: SamplingConfig, rng: UniformSource,
        policy: RoundPolicy, clock: () -> Double = monotonicSeconds,
    ): Sequence<Step> = sequence {
        var tokens = promptIds.copyOf()
        val head = tokens.copyOfRange(0, tokens.size - 1)
        target.cache.rollbackToPrefix(head)
        useClock(drafter, clock)
        drafter?.reset(head)
        target.prefill(tokens.copyOfRange(target.cache.kvLen, tokens.size - 1))
        while (true) {
            val began = clock()
            val plan = policy.choose(tokens)
            val active = plan.drafter
            val gamma = minOf(plan.gamma, target.cache.maxContext - tokens.size)
            val proposal = if (gamma > 0) active!!.propose(tokens, gamma, sampling, rng) else null
            val drafted = clock()
            val block = if (proposal == null) longArrayOf(tokens.last()) else longArrayOf(tokens.last()) + proposal.tokens
            val logits = target.forward(block, trunkHidden = (proposal as? TrunkProposal)?.trunkHidden)
            val verified = clock()
            val (nAccepted, next) = verify(logits, proposal, sampling, rng)
            val newTokens = block.copyOfRange(1, 1 + nAccepted) + next.toLong()
            tokens += newTokens
            // tokens minus the last: the pending token never keeps a row, even if it equals a rejected draft.
            target.cache.rollbackToPrefix(tokens.copyOfRange(0, tokens.size - 1))
            drafter?.accepted(tokens, nAccepted)
            val done = Round.of(active, gamma, proposal, nAccepted, newTokens.size, began, drafted, verified)
            policy.observe(plan, done)
            yield(Step(newTokens.map { it.toInt() }, gamma, done.nDrafted, nAccepted, done.draftSeconds, done.targetSeconds, done.drafter))
        }
    }
}
