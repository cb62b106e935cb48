package dev.edgespec.core

/** Hidden states [1, T, H] between stages. */
class Hidden(val data: FloatArray, val tokens: Int, val size: Int) {
    fun concat(other: Hidden): Hidden = Hidden(data + other.data, tokens + other.tokens, size)
}

/** What a stage is fed: token ids (first stage) or the previous stage's hidden states. */
sealed class StageInput {
    class Ids(val ids: LongArray) : StageInput()
    class States(val hidden: Hidden) : StageInput()
}

/** A stage's first output: logits [N, V] (head stage) or hidden states (any other stage). */
sealed class StageOutput {
    class Logits(val rows: Array<FloatArray>) : StageOutput()
    class States(val hidden: Hidden) : StageOutput()
}

/** Runs one stage graph; the ONNX Runtime implementation is [OrtStageRunner], tests may fake it. */
interface StageRunner : AutoCloseable {
    fun run(stage: StageInfo, input: StageInput, start: Int, logitPositions: LongArray?, cache: KvCache): StageOutput
}

/**
 * One role's forward pass over a block (runtime/model.py): its stages in order, KV written.
 * The loop and drafters only need [TargetModel]; [ModelRunner] is the real one.
 */
interface TargetModel {
    val cache: KvCache
    val vocabSize: Int
    /** Feeds tokens after cache.kvLen; returns logits for the last nLogits positions; extends the cache. */
    fun forward(tokens: LongArray, nLogits: Int = tokens.size, trunkHidden: Hidden? = null): Array<FloatArray>
    fun prefill(tokens: LongArray, chunk: Int = 256) {
        var begin = 0
        while (begin < tokens.size) {
            val end = minOf(begin + chunk, tokens.size)
            forward(tokens.copyOfRange(begin, end), nLogits = 1)
            begin = end
        }
    }
}

class ModelRunner(
    val role: String, val info: ModelInfo, val stages: List<StageInfo>, private val runner: StageRunner, override val cache: KvCache,
) : TargetModel {
    override val vocabSize = info.arch.vocabSize

    fun runStage(index: Int, input: StageInput, start: Int, logitPositions: LongArray? = null): StageOutput =
        runner.run(stages[index], input, start, logitPositions, cache)

    override fun forward(tokens: LongArray, nLogits: Int, trunkHidden: Hidden?): Array<FloatArray> {
        val block = tokens.size
        val start = cache.kvLen
        cache.checkRoom(start, block)
        val positions = LongArray(nLogits) { (block - nLogits + it).toLong() }
        val done = trunkHidden?.tokens ?: 0
        var x: StageInput = StageInput.Ids(tokens.copyOfRange(done, block))
        var out: StageOutput? = null
        for (index in stages.indices) {
            out = if (index == 0 && done > 0) {
                val rest = runStage(0, x, start + done) as StageOutput.States
                StageOutput.States(trunkHidden!!.concat(rest.hidden))
            } else {
                runStage(index, x, if (index > 0) start else start + done, positions)
            }
            if (out is StageOutput.States) x = StageInput.States(out.hidden)
        }
        cache.extend(tokens)
        return (out as StageOutput.Logits).rows
    }
}
