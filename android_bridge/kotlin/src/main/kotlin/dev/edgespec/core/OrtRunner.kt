package dev.edgespec.core

import ai.onnxruntime.OnnxTensor
import ai.onnxruntime.OrtEnvironment
import ai.onnxruntime.OrtSession
import java.io.File
import java.nio.FloatBuffer
import java.nio.LongBuffer

/** Session options the phone path supports: CPU (default) or NNAPI (Android only). */
data class SessionSettings(val threads: Int = 0, val nnapi: Boolean = false)

/**
 * Runs stage graphs through ai.onnxruntime (the Android Java API; also the desktop one).
 * KV buffers are handed to ONNX Runtime as direct buffers, so the past is never copied.
 */
class OrtStageRunner(private val bundleDir: File, private val settings: SessionSettings = SessionSettings()) : StageRunner {
    private val env: OrtEnvironment = OrtEnvironment.getEnvironment()
    private val sessions = HashMap<String, OrtSession>()

    fun session(stage: StageInfo): OrtSession = sessions.getOrPut(stage.file) {
        val options = OrtSession.SessionOptions()
        if (settings.threads > 0) options.setIntraOpNumThreads(settings.threads)
        // As the Python runtime: workers spin within a run and stop when it returns, so one
        // stage's pool does not hold the cores while the next stage's session runs.
        options.addConfigEntry("session.intra_op.allow_spinning", "1")
        options.addConfigEntry("session.force_spinning_stop", "1")
        if (settings.nnapi) options.addNnapi()
        env.createSession(File(bundleDir, stage.file).path, options)
    }

    override fun run(stage: StageInfo, input: StageInput, start: Int, logitPositions: LongArray?, cache: KvCache): StageOutput {
        val feeds = LinkedHashMap<String, OnnxTensor>()
        try {
            when (input) {
                is StageInput.Ids -> feeds[stage.inputs[0]] =
                    OnnxTensor.createTensor(env, LongBuffer.wrap(input.ids), longArrayOf(1, input.ids.size.toLong()))
                is StageInput.States -> feeds[stage.inputs[0]] = OnnxTensor.createTensor(env, FloatBuffer.wrap(input.hidden.data),
                    longArrayOf(1, input.hidden.tokens.toLong(), input.hidden.size.toLong()))
            }
            if (!stage.layers.isEmpty()) {
                feeds[Names.KV_LEN] = OnnxTensor.createTensor(env, LongBuffer.wrap(longArrayOf(start.toLong())), longArrayOf(1))
                for (layer in stage.layers) {
                    feeds[Names.pastKey(layer)] = OnnxTensor.createTensor(env, cache.keys.getValue(layer), cache.shape)
                    feeds[Names.pastValue(layer)] = OnnxTensor.createTensor(env, cache.values.getValue(layer), cache.shape)
                }
            }
            if (stage.head) feeds[Names.LOGIT_POSITIONS] =
                OnnxTensor.createTensor(env, LongBuffer.wrap(logitPositions!!), longArrayOf(logitPositions.size.toLong()))
            session(stage).run(feeds, stage.outputs.toSet()).use { result ->
                val first = result.get(stage.outputs[0]).get() as OnnxTensor
                val shape = first.info.shape // [1, N, V] or [1, T, H]
                val flat = first.floatBuffer
                for (layer in stage.layers) {
                    val k = result.get(Names.newKey(layer)).get() as OnnxTensor
                    val v = result.get(Names.newValue(layer)).get() as OnnxTensor
                    cache.writeRows(layer, k.floatBuffer, v.floatBuffer, k.info.shape[2].toInt(), start)
                }
                val rows = shape[1].toInt(); val width = shape[2].toInt()
                return if (stage.head) {
                    StageOutput.Logits(Array(rows) { r -> FloatArray(width).also { flat.position(r * width); flat.get(it) } })
                } else {
                    StageOutput.States(Hidden(FloatArray(rows * width).also { flat.position(0); flat.get(it) }, rows, width))
                }
            }
        } finally {
            feeds.values.forEach { it.close() }
        }
    }

    override fun close() { sessions.values.forEach { it.close() }; sessions.clear() }
}
