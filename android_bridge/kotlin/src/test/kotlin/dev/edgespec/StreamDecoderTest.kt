package dev.edgespec

import dev.edgespec.core.BpeTokenizer
import dev.edgespec.core.StreamDecoder
import org.json.JSONObject
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import kotlin.random.Random

/** StreamDecoder on the tiny tokenizer: pieces add up to decode(all ids), and a push decodes a bounded window. */
class StreamDecoderTest {
    private val file = Traces.file(Traces.obj("tok_tiny.json").getString("tokenizer"))
    private val tok = BpeTokenizer.fromFile(file)
    private val vocabSize = JSONObject(file.readText()).getJSONObject("model").getJSONObject("vocab").length()

    @Test
    fun `random ids stream as the whole decode, with bounded work per push`() {
        val rng = Random(7)
        val end = tok.encode("a", false).last()
        repeat(40) { case ->
            val ids = List(rng.nextInt(1, 300)) { rng.nextInt(vocabSize) } + end // ends on a whole character
            var decodedIds = 0
            val decoder = StreamDecoder { window -> decodedIds += window.size; tok.decode(window) }
            val pieces = StringBuilder()
            // The window starts no earlier than the second-to-last push that returned text.
            var texted = intArrayOf(0, 0)
            var at = 0
            while (at < ids.size) {
                val size = listOf(0, 1, 1, 1, 2, 3, 5)[rng.nextInt(7)]
                val next = minOf(at + size, ids.size)
                decodedIds = 0
                val piece = decoder.push(ids.subList(at, next))
                at = next
                assertTrue(decodedIds <= 2 * (at - texted[0]), "case $case: a push decoded $decodedIds ids at $at (window from ${texted[0]})")
                if (piece.isNotEmpty()) texted = intArrayOf(texted[1], at)
                pieces.append(piece)
            }
            assertEquals(tok.decode(ids.toIntArray()), pieces.toString(), "case $case")
        }
    }

    @Test
    fun `text split over tokens streams whole characters`() {
        val text = "the cat sat on the mat 中文 😀 — é\n  def f():\n\treturn 1"
        val ids = tok.encode(text, false).toList()
        var decodedIds = 0
        val decoder = StreamDecoder { window -> decodedIds += window.size; tok.decode(window) }
        val pieces = ids.map { decoder.push(listOf(it)) }
        assertEquals(text, pieces.joinToString(""))
        assertTrue(pieces.none { "\uFFFD" in it })
        assertTrue(ids.size >= 30 && decodedIds <= 4 * ids.size, "decoded $decodedIds ids for ${ids.size}")
    }
}
