package dev.edgespec

import dev.edgespec.core.Commit
import dev.edgespec.core.CostModel
import dev.edgespec.core.DraftModelDrafter
import dev.edgespec.core.Drafter
import dev.edgespec.core.GammaConfig
import dev.edgespec.core.Hidden
import dev.edgespec.core.KvCache
import dev.edgespec.core.Loop
import dev.edgespec.core.MixedDrafter
import dev.edgespec.core.Pcg64
import dev.edgespec.core.PromptLookupDrafter
import dev.edgespec.core.CatchUpProposal
import dev.edgespec.core.CatchesUp
import dev.edgespec.core.Round
import dev.edgespec.core.Selects
import dev.edgespec.core.Proposal
import dev.edgespec.core.ReplayUniforms
import dev.edgespec.core.RoundPolicy
import dev.edgespec.core.SamplingConfig
import dev.edgespec.core.TargetModel
import dev.edgespec.core.UniformSource
import org.json.JSONObject
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import kotlin.math.abs

/** Replays the clock readings Python's decode_steps took, in order; a missing or extra reading fails. */
class ReplayClock(private val readings: DoubleArray) : () -> Double {
    var consumed = 0
        private set
    override fun invoke(): Double {
        check(consumed < readings.size) { "clock read more often than Python's loop did (${readings.size} readings)" }
        return readings[consumed++]
    }
}

/**
 * Python's fake model (write_traces.py FakeRunner) as the table of rows it served: logits by the
 * tokens before and at each position, read from the cache's row tokens. A row kept for a wrong
 * token asks for a prefix Python never computed, and fails here.
 */
class TableModel(private val table: JSONObject, maxContext: Int, override val vocabSize: Int) : TargetModel {
    override val cache = KvCache(0 until 0, 1, maxContext, 1)

    override fun forward(tokens: LongArray, nLogits: Int, trunkHidden: Hidden?): Array<FloatArray> {
        val start = cache.kvLen
        cache.checkRoom(start, tokens.size)
        val prefix = cache.rowTokens.take(start).toMutableList()
        val rows = tokens.map { t ->
            prefix.add(t)
            val key = prefix.joinToString(",")
            check(table.has(key)) { "logits asked after [$key], a prefix Python's loop never fed (a KV row kept for a wrong token?)" }
            table.getJSONArray(key).floats()
        }
        cache.extend(tokens)
        return rows.takeLast(nLogits).toTypedArray()
    }
}

/** Python's scripted drafter: the same proposals (tokens and q), asserted to be asked for at the same tokens. */
class ScriptedDrafter(private val calls: List<JSONObject>) : Drafter() {
    override val name = "scripted"
    private var n = 0
    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal {
        check(n < calls.size) { "more proposals asked for than Python's loop asked" }
        val call = calls[n++]
        assertEquals(call.getJSONArray("tokens").longs().toList(), tokens.toList(), "proposal $n: tokens")
        assertEquals(call.getInt("gamma"), gamma, "proposal $n: γ")
        val q = call.getJSONArray("q").let { a -> Array(a.length()) { a.getJSONArray(it).doubles() } }
        return Proposal(call.getJSONArray("draft").longs(), q)
    }
}

/** write_traces.py's scripted part: what it reports for a round comes from the script entry keyed by tokens[0]. */
open class ScriptedPart(override val name: String, protected val script: List<JSONObject>) : Drafter() {
    protected fun entry(tokens: LongArray) = script[tokens[0].toInt()]
    override fun evidence(tokens: LongArray): Int = entry(tokens).getJSONObject("evidence").optInt(name, 0)
    override fun propose(tokens: LongArray, gamma: Int, sampling: SamplingConfig, rng: UniformSource): Proposal? =
        error("the policy trace drafts nothing")
}

class ScriptedModel(script: List<JSONObject>) : ScriptedPart("model", script), CatchesUp {
    override var clock: () -> Double = { 0.0 }
    override fun replayTokens(tokens: LongArray): Int = entry(tokens).getInt("replay")
}

class ScriptedMixed(script: List<JSONObject>, private val members: List<Drafter>) : ScriptedPart("auto", script), Selects {
    override fun parts(): List<Drafter> = members
    override fun candidates(tokens: LongArray): List<Drafter> {
        val named = entry(tokens).getJSONArray("candidates").let { a -> List(a.length()) { a.getString(it) } }
        return members.filter { it.name in named }
    }
}

private fun near(want: Double, got: Double, what: String) =
    assertTrue(abs(want - got) <= 1e-12 + 1e-9 * abs(want), "$what: want $want, got $got")

/** Kotlin against Python on the commit policy, the cost model, the round policy's plans, the loop on fake models (fallback, adaptive γ) and the draft model's cache. */
class PolicyConformanceTest {
    @Test
    fun `commit policy cuts at budget, context, EOS, then the earliest stop string, as Python`() {
        val trace = Traces.arr("commit.json").getJSONObject(0)
        val pieces = trace.getJSONArray("pieces").let { a -> List(a.length()) { a.getString(it) } }
        val cases = trace.getJSONArray("cases").objects()
        assertTrue(cases.size >= 100)
        for ((n, case) in cases.withIndex()) {
            val stops = case.getJSONArray("stops").let { a -> List(a.length()) { a.getString(it) } }
            val got = Commit.commit(case.getJSONArray("step").ints().toList(), case.getInt("n_generated"), case.getInt("max_new_tokens"),
                case.getInt("room"), case.getJSONArray("eos").ints().toSet(), case.getString("text"), stops) { kept -> kept.joinToString("") { pieces[it] } }
            val what = "case $n (step ${case.getJSONArray("step")}, stops $stops)"
            assertEquals(case.getJSONArray("kept").ints().toList(), got.tokens, "$what: tokens kept")
            assertEquals(if (case.isNull("stop_reason")) null else case.getString("stop_reason"), got.stopReason, "$what: stop reason")
            assertEquals(case.getString("piece"), got.piece, "$what: piece")
            assertEquals(case.getString("text_after"), got.text, "$what: text")
        }
    }

    @Test
    fun `cost model interpolates, extends the slope past the largest block and prices replay as Python`() {
        for ((n, case) in Traces.arr("cost_model.json").objects().withIndex()) {
            val costs = CostModel()
            val records = case.getJSONArray("records")
            for (r in 0 until records.length()) {
                val rec = records.getJSONArray(r)
                when (rec.getString(0)) {
                    "target" -> costs.recordTarget(rec.getInt(1), rec.getDouble(2))
                    "draft" -> costs.recordDraft("model", rec.getInt(1), rec.getDouble(2))
                    "replay" -> costs.recordReplay("model", rec.getInt(1), rec.getDouble(2))
                }
            }
            val target = case.getJSONArray("target_cost").doubles()
            for ((i, want) in target.withIndex()) near(want, costs.targetCost(i + 1), "case $n target_cost(${i + 1})")
            val replay = case.getJSONArray("replay_cost").doubles()
            for ((i, k) in listOf(0, 1, 5, 40).withIndex()) near(replay[i], costs.replayCost("model", k), "case $n replay_cost($k)")
            if (case.isNull("cost_ratio")) assertEquals(null, costs.costRatio("model"), "case $n cost_ratio")
            else near(case.getDouble("cost_ratio"), costs.costRatio("model")!!, "case $n cost_ratio")
        }
    }

    private fun table(case: JSONObject, key: String) = TableModel(case.getJSONObject(key), case.getInt("max_context"), case.getInt("vocab"))

    @Test
    fun `the loop on fake models matches Python round by round (empty-residual fallback, adaptive gamma on a fake clock)`() {
        val cases = Traces.arr("loop.json").objects()
        assertTrue(cases.any { it.isNull("gamma") } && cases.any { !it.isNull("gamma") })
        for (case in cases) {
            val what = case.getString("name")
            val target = table(case, "target_table")
            val draft = if (case.has("draft_table")) table(case, "draft_table") else null
            val drafter: Drafter = when (case.getString("drafter")) {
                "scripted" -> ScriptedDrafter(case.getJSONArray("calls").objects())
                "model" -> DraftModelDrafter(draft!!)
                else -> MixedDrafter(PromptLookupDrafter(), DraftModelDrafter(draft!!))
            }
            val sampling = SamplingConfig(case.getDouble("temperature"), case.getInt("top_k"), case.getDouble("top_p"),
                if (case.isNull("seed")) null else case.getLong("seed"))
            val config = if (case.isNull("gamma")) GammaConfig(maxGamma = case.getInt("max_gamma"), maxLoss = case.getDouble("max_loss"),
                maxFailedProbes = case.getInt("max_failed_probes")) else GammaConfig(fixed = case.getInt("gamma"))
            val policy = RoundPolicy().start(drafter, if (case.has("horizon")) case.getInt("horizon") else 256, config)
            val costs = policy.costs
            val uniforms = ReplayUniforms(case.getJSONArray("uniforms").doubles())
            val readings = if (case.has("clock")) case.getJSONArray("clock").doubles() else null
            val clock = readings?.let { ReplayClock(it) }
            val rounds = case.getJSONArray("rounds").objects()
            val steps = Loop.decodeSteps(target, drafter, case.getJSONArray("prompt").longs(), sampling, uniforms, policy,
                clock ?: { 0.0 }).iterator()
            for ((i, round) in rounds.withIndex()) {
                val step = steps.next()
                val at = "$what round $i"
                assertEquals(round.getInt("gamma"), step.gamma, "$at: γ")
                assertEquals(round.getInt("drafted"), step.nDrafted, "$at: drafted")
                assertEquals(round.getInt("accepted"), step.nAccepted, "$at: accepted")
                assertEquals(round.getJSONArray("tokens").ints().toList(), step.tokens, "$at: tokens")
                assertEquals(if (round.isNull("drafter")) null else round.getString("drafter"), step.drafter, "$at: drafter")
                assertEquals(round.getInt("target_kv"), target.cache.kvLen, "$at: target kv_len")
                if (draft != null) assertEquals(round.getInt("draft_kv"), draft.cache.kvLen, "$at: draft kv_len")
                if (round.has("draft_s")) {
                    assertEquals(round.getDouble("draft_s"), step.draftSeconds, "$at: draft seconds")
                    assertEquals(round.getDouble("target_s"), step.targetSeconds, "$at: target seconds")
                }
            }
            assertEquals(case.getJSONArray("uniforms").length(), uniforms.consumed, "$what: uniforms consumed")
            if (clock != null) assertEquals(readings!!.size, clock.consumed, "$what: clock readings")
            if (case.has("costs")) {
                val want = case.getJSONObject("costs")
                for (kind in listOf("target", "draft_step", "replay_token")) {
                    val table = want.getJSONObject(kind)
                    val got: Map<String, Double> = when (kind) {
                        "target" -> costs.target.mapKeys { it.key.toString() }
                        "draft_step" -> costs.draftStep
                        else -> costs.replayToken
                    }
                    assertEquals(table.keys().asSequence().toSet(), got.keys, "$what: $kind keys")
                    for (k in table.keys()) near(table.getDouble(k), got.getValue(k), "$what: cost $kind[$k]")
                }
            }
        }
    }

    @Test
    fun `the round policy makes Python's plans and learns the same from each round (adaptive gamma, probes, replay share)`() {
        val cases = Traces.arr("policy.json").objects()
        assertTrue(cases.size >= 4)
        for (case in cases) {
            val what = case.getString("name")
            val script = case.getJSONArray("script").objects()
            val copier = ScriptedPart("lookup", script)
            val model = ScriptedModel(script)
            val drafter: Drafter = when (case.getString("drafter")) {
                "model" -> model
                "lookup" -> copier
                else -> ScriptedMixed(script, listOf(copier, model))
            }
            val knobs = case.getJSONObject("config")
            val defaults = GammaConfig()
            val config = GammaConfig(
                fixed = if (knobs.has("fixed")) knobs.getInt("fixed") else null, maxGamma = knobs.optInt("max_gamma", defaults.maxGamma),
                probeFirst = knobs.optInt("probe_first", defaults.probeFirst), probeEvery = knobs.optInt("probe_every", defaults.probeEvery),
                maxFailedProbes = knobs.optInt("max_failed_probes", defaults.maxFailedProbes), minGain = knobs.optDouble("min_gain", defaults.minGain),
                decay = knobs.optDouble("decay", defaults.decay), maxLoss = knobs.optDouble("max_loss", defaults.maxLoss),
                priorWeight = knobs.optDouble("prior_weight", defaults.priorWeight),
            )
            assertEquals(knobs.keySet(), knobs.keySet().filter { it in setOf("fixed", "max_gamma", "probe_first", "probe_every",
                "max_failed_probes", "min_gain", "decay", "max_loss", "prior_weight") }.toSet(), "$what: a γ knob the test does not read")
            val policy = RoundPolicy()
            val seeded = case.getJSONObject("seeded_target")
            for (k in seeded.keys().asSequence().sortedBy { it.toInt() }) policy.costs.recordTarget(k.toInt(), seeded.getDouble(k))
            if (!case.isNull("seeded_draft_step")) policy.costs.recordDraft("model", 1, case.getDouble("seeded_draft_step"))
            for ((s, sequence) in case.getJSONArray("sequences").objects().withIndex()) {
                policy.start(drafter, sequence.getInt("horizon"), config)
                for ((i, entry) in sequence.getJSONArray("rounds").objects().withIndex()) {
                    val at = "$what sequence $s round $i"
                    val want = entry.getJSONObject("plan")
                    val plan = policy.choose(longArrayOf(entry.getLong("key")))
                    assertEquals(if (want.isNull("drafter")) null else want.getString("drafter"), plan.drafter?.name, "$at: drafter")
                    assertEquals(want.getInt("gamma"), plan.gamma, "$at: γ")
                    assertEquals(want.getInt("evidence"), plan.evidence, "$at: evidence class")
                    assertEquals(want.getBoolean("probe"), plan.probe, "$at: probe")
                    assertEquals(want.getBoolean("whole_replay"), plan.wholeReplay, "$at: whole replay")
                    near(want.getDouble("draft_step_s"), plan.draftStepSeconds, "$at: draft step assumed")
                    near(want.getDouble("replay_s"), plan.replaySeconds, "$at: replay assumed")
                    val r = entry.getJSONObject("round")
                    policy.observe(plan, Round(if (r.isNull("drafter")) null else r.getString("drafter"), r.getInt("gamma"), r.getInt("n_drafted"),
                        r.getInt("n_accepted"), r.getInt("n_committed"), r.getDouble("draft_s"), r.getDouble("target_s"), r.getDouble("round_s"),
                        r.getInt("catch_up_tokens"), r.getDouble("catch_up_s")))
                    val loss = entry.getJSONObject("loss")
                    for (name in loss.keys()) near(loss.getDouble(name), policy.parts.getValue(name).ledger.lossSeconds, "$at: $name's ledger loss")
                }
            }
            val state = case.getJSONObject("state")
            for (name in state.keys()) {
                val want = state.getJSONObject(name)
                val part = policy.parts.getValue(name)
                near(want.getDouble("loss_seconds"), part.ledger.lossSeconds, "$what: $name loss")
                assertEquals(want.getInt("tokens"), part.ledger.tokens, "$what: $name tokens")
                assertEquals(want.getInt("taken"), part.ledger.taken, "$what: $name tokens taken by other parts")
                assertEquals(listOf(want.getInt("plain_steps"), want.getInt("gap"), want.getInt("failed")),
                    listOf(part.probes.plainSteps, part.probes.gap, part.probes.failed), "$what: $name probe schedule")
                val alpha = want.getJSONObject("alpha")
                assertEquals(alpha.keySet().map { it.toInt() }.toSet(), part.estimates.keys, "$what: $name evidence classes")
                for (k in alpha.keys()) {
                    near(alpha.getJSONArray(k).getDouble(0), part.estimates.getValue(k.toInt()).accepted, "$what: $name α[$k] accepted")
                    near(alpha.getJSONArray(k).getDouble(1), part.estimates.getValue(k.toInt()).rejected, "$what: $name α[$k] rejected")
                }
            }
            val costs = case.getJSONObject("costs")
            for (kind in listOf("target", "draft_step", "replay_token")) {
                val table = costs.getJSONObject(kind)
                val got: Map<String, Double> = when (kind) {
                    "target" -> policy.costs.target.mapKeys { it.key.toString() }
                    "draft_step" -> policy.costs.draftStep
                    else -> policy.costs.replayToken
                }
                assertEquals(table.keySet(), got.keys, "$what: $kind keys")
                for (k in table.keys()) near(table.getDouble(k), got.getValue(k), "$what: cost $kind[$k]")
            }
        }
    }

    @Test
    fun `the draft model prefills at reset, replays after sitting out, and never keeps the pending token's row`() {
        val case = Traces.arr("drafter.json").getJSONObject(0)
        val draft = table(case, "draft_table")
        val drafter = DraftModelDrafter(draft)
        for ((i, op) in case.getJSONArray("ops").objects().withIndex()) {
            val tokens = op.getJSONArray("tokens").longs()
            val what = "op $i ${op.getString("op")} after ${tokens.toList()}"
            when (op.getString("op")) {
                "reset" -> drafter.reset(tokens)
                "accepted" -> drafter.accepted(tokens, op.getInt("n_accepted"))
                "propose" -> {
                    assertEquals(op.getInt("replay"), drafter.replayTokens(tokens), "$what: tokens to replay")
                    val proposal = drafter.propose(tokens, op.getInt("gamma"), SamplingConfig(), Pcg64(0))!!
                    assertEquals(op.getJSONArray("draft").longs().toList(), proposal.tokens.toList(), "$what: drafted")
                    assertEquals(op.getInt("catch_up_tokens"), (proposal as CatchUpProposal).catchUpTokens, "$what: replayed tokens")
                }
            }
            assertEquals(op.getInt("kv_len"), draft.cache.kvLen, "$what: draft kv_len")
        }
    }
}
