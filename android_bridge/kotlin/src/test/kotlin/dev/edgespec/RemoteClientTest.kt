package dev.edgespec

import dev.edgespec.client.ChatMessage
import dev.edgespec.client.RemoteClient
import dev.edgespec.client.RemoteException
import dev.edgespec.client.RemoteOptions
import dev.edgespec.core.Engine
import dev.edgespec.core.EngineConfig
import dev.edgespec.core.GenerateConfig
import dev.edgespec.flow.TokenEvent
import dev.edgespec.flow.streamChatFlow
import dev.edgespec.flow.streamTokens
import kotlinx.coroutines.flow.toList
import kotlinx.coroutines.runBlocking
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertThrows
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.io.File

/**
 * The Kotlin client against the Python server (`python -m runtime serve`, started by run_jvm_tests.sh on
 * 127.0.0.1 with the tiny llama bundle), plain and streaming, and against the on-device engine's text.
 */
class RemoteClientTest {
    private val url = System.getProperty("edgespec.server") ?: error("set -Dedgespec.server=URL (run_jvm_tests.sh starts the server)")
    private val client = RemoteClient(url)
    private val prompt = "the quick brown fox jumps over the lazy dog and"
    private val greedy = RemoteOptions(maxTokens = 12, temperature = 0.0)

    @Test
    fun `lists the served model`() {
        assertEquals(1, client.models().size)
    }

    @Test
    fun `plain and streamed completions agree, and equal the on-device engine's greedy text`() {
        val plain = client.complete(prompt, greedy)
        val pieces = ArrayList<String>()
        val streamed = client.streamComplete(prompt, greedy) { pieces.add(it) }
        assertEquals(plain.text, streamed.text)
        assertEquals(plain.text, pieces.joinToString(""))
        assertTrue(pieces.size >= 2, "streaming should deliver several pieces, got $pieces")
        assertEquals(plain.finishReason, streamed.finishReason)
        assertEquals(plain.completionTokens, streamed.completionTokens)
        assertTrue(plain.speculative != null, "the server reports speculative stats")
        Engine(File(Traces.dir, "tiny/llama"), EngineConfig(drafter = "none")).use { engine ->
            val local = engine.generate(prompt, GenerateConfig(maxNewTokens = 12))
            assertEquals(local.text, plain.text, "on-device Kotlin and the Python server disagree")
        }
    }

    @Test
    fun `chat plain and streamed`() {
        val messages = listOf(ChatMessage("user", "the cat sat on"))
        val plain = client.chat(messages, greedy)
        val pieces = ArrayList<String>()
        val streamed = client.streamChat(messages, greedy) { pieces.add(it) }
        assertEquals(plain.text, streamed.text)
        assertEquals(plain.text, pieces.joinToString(""))
        assertTrue(plain.text.isNotEmpty())
        assertTrue(streamed.completionTokens!! > 0, "usage arrives at the end of the stream")
    }

    @Test
    fun `seeded sampling over the wire is reproducible`() {
        val options = RemoteOptions(maxTokens = 10, temperature = 0.9, topP = 0.95, seed = 5)
        assertEquals(client.complete(prompt, options).text, client.streamComplete(prompt, options) {}.text)
    }

    @Test
    fun `server errors surface as RemoteException with the OpenAI error body`() {
        val e = assertThrows(RemoteException::class.java) { client.complete(prompt, RemoteOptions(temperature = -1.0)) }
        assertEquals(400, e.status)
        assertTrue(e.message!!.contains("temperature"), e.message)
    }

    @Test
    fun `Flow API streams remote chat and on-device tokens`() = runBlocking {
        val remote = client.streamChatFlow(listOf(ChatMessage("user", "the cat sat on")), greedy).toList()
        assertTrue(remote.last() is TokenEvent.Done)
        assertEquals(client.chat(listOf(ChatMessage("user", "the cat sat on")), greedy).text,
            remote.filterIsInstance<TokenEvent.Text>().joinToString("") { it.piece })
        Engine(File(Traces.dir, "tiny/llama"), EngineConfig(drafter = "auto", gamma = 3)).use { engine ->
            val events = engine.streamTokens(prompt, GenerateConfig(maxNewTokens = 10)).toList()
            val done = events.last() as TokenEvent.Done
            assertTrue(done.tokens in 1..10)
            assertEquals(engine.generate(prompt, GenerateConfig(maxNewTokens = 10)).text,
                events.filterIsInstance<TokenEvent.Text>().joinToString("") { it.piece })
        }
    }
}
