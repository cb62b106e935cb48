package dev.edgespec.flow

import dev.edgespec.client.ChatMessage
import dev.edgespec.client.RemoteClient
import dev.edgespec.client.RemoteOptions
import dev.edgespec.core.Engine
import dev.edgespec.core.GenerateConfig
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.channels.awaitClose
import kotlinx.coroutines.flow.Flow
import kotlinx.coroutines.flow.callbackFlow
import kotlinx.coroutines.flow.flowOn
import kotlinx.coroutines.launch
import java.util.concurrent.atomic.AtomicBoolean

/** What a token stream emits: text pieces as they are accepted, then one Done. */
sealed class TokenEvent {
    data class Text(val piece: String) : TokenEvent()
    data class Done(val stopReason: String, val tokens: Int) : TokenEvent()
}

/**
 * Coroutine streaming over the on-device engine: collecting runs the generation on Dispatchers.IO;
 * cancelling the collector stops generation after the current target pass.
 */
fun Engine.streamTokens(prompt: String, config: GenerateConfig = GenerateConfig()): Flow<TokenEvent> = callbackFlow {
    val cancelled = AtomicBoolean(false)
    val job = launch(Dispatchers.IO) {
        val result = generate(encode(prompt), config, cancelled = { cancelled.get() }) { trySend(TokenEvent.Text(it)) }
        send(TokenEvent.Done(result.stopReason, result.tokenIds.size))
        close()
    }
    awaitClose { cancelled.set(true); job.cancel() }
}

/** The same Flow shape for a remote edge box (chat completions, streamed). */
fun RemoteClient.streamChatFlow(messages: List<ChatMessage>, options: RemoteOptions = RemoteOptions()): Flow<TokenEvent> = callbackFlow {
    val job = launch(Dispatchers.IO) {
        val result = streamChat(messages, options) { trySend(TokenEvent.Text(it)) }
        send(TokenEvent.Done(result.finishReason ?: "stop", result.completionTokens ?: 0))
        close()
    }
    awaitClose { job.cancel() }
}.flowOn(Dispatchers.IO)
