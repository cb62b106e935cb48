package dev.edgespec.client

import org.json.JSONArray
import org.json.JSONObject
import java.io.BufferedReader
import java.io.IOException
import java.io.InputStreamReader
import java.net.HttpURLConnection
import java.net.URL

/** An error the server answered with (OpenAI shape: {"error": {"message", "type", "code"}}), or a transport failure. */
class RemoteException(val status: Int, message: String, val type: String? = null, val code: String? = null) : IOException(message)

data class ChatMessage(val role: String, val content: String)

data class RemoteOptions(
    val maxTokens: Int? = null, val temperature: Double? = null, val topP: Double? = null, val topK: Int? = null,
    val seed: Long? = null, val stop: List<String> = emptyList(),
)

/** A finished completion: the text, why it stopped, token usage, and the server's speculative stats (raw JSON). */
data class RemoteResult(
    val text: String, val finishReason: String?, val promptTokens: Int?, val completionTokens: Int?, val speculative: JSONObject?,
)

/**
 * A small client for edge-spec's OpenAI-compatible server (`python -m runtime serve`), plain and streaming
 * (server-sent events). Only HttpURLConnection and org.json: both exist on Android. Calls block: on
 * Android run them off the main thread (the Android module's Flow wrapper does).
 */
class RemoteClient(baseUrl: String, private val apiKey: String? = null, private val timeoutMs: Int = 60_000) {
    private val base = baseUrl.trimEnd('/').let { if (it.endsWith("/v1")) it else "$it/v1" }

    fun models(): List<String> {
        val body = request("GET", "/models", null)
        val data = JSONObject(body.readText()).getJSONArray("data")
        return (0 until data.length()).map { data.getJSONObject(it).getString("id") }
    }

    fun complete(prompt: String, options: RemoteOptions = RemoteOptions()): RemoteResult =
        parseFinal(JSONObject(request("POST", "/completions", payload(options, false).put("prompt", prompt)).readText()), chat = false)

    fun chat(messages: List<ChatMessage>, options: RemoteOptions = RemoteOptions()): RemoteResult =
        parseFinal(JSONObject(request("POST", "/chat/completions", payload(options, false).put("messages", messagesJson(messages))).readText()), chat = true)

    /** Streams a completion: `onText` gets each piece as the server sends it; returns the assembled result. */
    fun streamComplete(prompt: String, options: RemoteOptions = RemoteOptions(), onText: (String) -> Unit): RemoteResult =
        stream("/completions", payload(options, true).put("prompt", prompt), chat = false, onText = onText)

    fun streamChat(messages: List<ChatMessage>, options: RemoteOptions = RemoteOptions(), onText: (String) -> Unit): RemoteResult =
        stream("/chat/completions", payload(options, true).put("messages", messagesJson(messages)), chat = true, onText = onText)

    private fun messagesJson(messages: List<ChatMessage>) =
        JSONArray().also { arr -> messages.forEach { arr.put(JSONObject().put("role", it.role).put("content", it.content)) } }

    private fun payload(o: RemoteOptions, stream: Boolean): JSONObject {
        val p = JSONObject().put("stream", stream)
        o.maxTokens?.let { p.put("max_tokens", it) }
        o.temperature?.let { p.put("temperature", it) }
        o.topP?.let { p.put("top_p", it) }
        o.topK?.let { p.put("top_k", it) }
        o.seed?.let { p.put("seed", it) }
        if (o.stop.isNotEmpty()) p.put("stop", JSONArray(o.stop))
        if (stream) p.put("stream_options", JSONObject().put("include_usage", true))
        return p
    }

    private fun stream(path: String, body: JSONObject, chat: Boolean, onText: (String) -> Unit): RemoteResult {
        val reader = request("POST", path, body)
        val text = StringBuilder()
        var finish: String? = null
        var usage: JSONObject? = null
        var speculative: JSONObject? = null
        reader.use {
            val data = StringBuilder()
            while (true) {
                val line = it.readLine() ?: break
                if (line.isEmpty()) { // end of one event
                    if (data.isEmpty()) continue
                    val payload = data.toString(); data.setLength(0)
                    if (payload == "[DONE]") break
                    val event = JSONObject(payload)
                    event.optJSONObject("error")?.let { e -> throw RemoteException(500, e.optString("message"), e.optString("type"), e.optString("code")) }
                    event.optJSONObject("usage")?.let { u -> usage = u }
                    event.optJSONObject("speculative")?.let { s -> speculative = s }
                    val choices = event.optJSONArray("choices") ?: continue
                    for (i in 0 until choices.length()) {
                        val choice = choices.getJSONObject(i)
                        val piece = if (chat) choice.optJSONObject("delta")?.let { d -> if (d.isNull("content")) null else d.optString("content") } else choice.optString("text")
                        if (!piece.isNullOrEmpty()) { text.append(piece); onText(piece) }
                        if (!choice.isNull("finish_reason")) finish = choice.getString("finish_reason")
                    }
                } else if (line.startsWith("data:")) {
                    if (data.isNotEmpty()) data.append('\n')
                    data.append(line.substring(5).trimStart())
                } // comments (":") and other fields are ignored, as the SSE spec says
            }
        }
        return RemoteResult(text.toString(), finish, usage?.optInt("prompt_tokens"), usage?.optInt("completion_tokens"), speculative)
    }

    private fun parseFinal(body: JSONObject, chat: Boolean): RemoteResult {
        val choice = body.getJSONArray("choices").getJSONObject(0)
        val text = if (chat) choice.getJSONObject("message").optString("content") else choice.getString("text")
        val usage = body.optJSONObject("usage")
        return RemoteResult(text, if (choice.isNull("finish_reason")) null else choice.getString("finish_reason"),
            usage?.optInt("prompt_tokens"), usage?.optInt("completion_tokens"), body.optJSONObject("speculative"))
    }

    private fun request(method: String, path: String, body: JSONObject?): BufferedReader {
        val conn = URL(base + path).openConnection() as HttpURLConnection
        conn.requestMethod = method
        conn.connectTimeout = timeoutMs
        conn.readTimeout = timeoutMs
        conn.setRequestProperty("Accept", if (body?.optBoolean("stream") == true) "text/event-stream" else "application/json")
        apiKey?.let { conn.setRequestProperty("Authorization", "Bearer $it") }
        if (body != null) {
            val bytes = body.toString().toByteArray(Charsets.UTF_8)
            conn.doOutput = true
            conn.setRequestProperty("Content-Type", "application/json")
            conn.setFixedLengthStreamingMode(bytes.size)
            conn.outputStream.use { it.write(bytes) }
        }
        val status = conn.responseCode
        if (status !in 200..299) {
            val err = (conn.errorStream ?: conn.inputStream)?.bufferedReader(Charsets.UTF_8)?.use { it.readText() } ?: ""
            val obj = runCatching { JSONObject(err).getJSONObject("error") }.getOrNull()
            throw RemoteException(status, obj?.optString("message") ?: "HTTP $status: $err", obj?.optString("type"), obj?.optString("code"))
        }
        return BufferedReader(InputStreamReader(conn.inputStream, Charsets.UTF_8))
    }
}
