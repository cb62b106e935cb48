package dev.edgespec.core

import java.nio.ByteBuffer
import java.nio.ByteOrder
import java.nio.FloatBuffer

class ContextFullException(message: String) : Exception(message)

/**
 * Static KV buffers and their length (runtime/kv_cache.py): the only place where rollback happens.
 * Rows [0, kvLen) of every layer hold the keys/values of rowTokens[0, kvLen); later rows are stale
 * and masked by the graphs, so rolling back is only moving kvLen. Buffers are direct (native order)
 * so ONNX Runtime reads them without a copy.
 */
class KvCache(val layers: IntRange, val nKvHeads: Int, val maxContext: Int, val headDim: Int) {
    val shape = longArrayOf(1, nKvHeads.toLong(), maxContext.toLong(), headDim.toLong())
    private val floatsPerLayer = nKvHeads * maxContext * headDim
    val keys: Map<Int, FloatBuffer> = layers.associateWith { newBuffer() }
    val values: Map<Int, FloatBuffer> = layers.associateWith { newBuffer() }
    val rowTokens = LongArray(maxContext) { -1L }
    var kvLen = 0

    private fun newBuffer(): FloatBuffer =
        ByteBuffer.allocateDirect(floatsPerLayer * 4).order(ByteOrder.nativeOrder()).asFloatBuffer()

    val nbytes: Long get() = 2L * layers.count() * floatsPerLayer * 4

    fun checkRoom(start: Int, block: Int) {
        if (start + block > maxContext) throw ContextFullException("context full: $start + $block tokens exceed max context $maxContext")
    }

    /** Copies one layer's block rows ([1,KVH,T,D] flattened) into rows [start, start+T); kvLen is left alone. */
    fun writeRows(layer: Int, newKey: FloatBuffer, newValue: FloatBuffer, block: Int, start: Int) {
        copyRows(keys.getValue(layer), newKey, block, start)
        copyRows(values.getValue(layer), newValue, block, start)
    }

    private fun copyRows(dst: FloatBuffer, src: FloatBuffer, block: Int, start: Int) {
        val rowFloats = block * headDim
        val tmp = FloatArray(rowFloats)
        for (h in 0 until nKvHeads) {
            src.position(h * rowFloats); src.get(tmp, 0, rowFloats)
            dst.position((h * maxContext + start) * headDim); dst.put(tmp, 0, rowFloats)
        }
        dst.position(0)
    }

    /** Marks the rows just written for all layers as holding `tokens`. */
    fun extend(tokens: LongArray) {
        tokens.copyInto(rowTokens, kvLen)
        kvLen += tokens.size
    }

    /** Drops every row that is not the committed token at its position; returns kvLen. */
    fun rollbackToPrefix(committed: LongArray): Int {
        val n = minOf(kvLen, committed.size)
        var i = 0
        while (i < n && rowTokens[i] == committed[i]) i++
        kvLen = i
        return kvLen
    }

    fun reset() { kvLen = 0 }
}
