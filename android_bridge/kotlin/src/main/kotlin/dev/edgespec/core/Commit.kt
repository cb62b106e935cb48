package dev.edgespec.core

/** What one round adds: tokens, their text (cut before a stop string), all text so far, and why decoding stops (null: it goes on). */
data class Committed(val tokens: List<Int>, val piece: String, val text: String, val stopReason: String?)

/**
 * The stopping rules as one pure function (edge_spec/commit.py): a round may return more tokens than
 * plain decoding would have produced, so they are cut at the token budget, then the context limit,
 * then EOS within what is kept, then stop strings in the decoded text (the earliest in the text wins,
 * whichever was listed first).
 */
object Commit {
    fun cutTokens(stepTokens: List<Int>, nGenerated: Int, maxNewTokens: Int, room: Int, eos: Set<Int>): Pair<List<Int>, String?> {
        val budget = maxNewTokens - nGenerated
        val new = stepTokens.take(maxOf(0, minOf(budget, room)))
        val eosAt = new.indexOfFirst { it in eos }
        return when {
            eosAt >= 0 -> new.subList(0, eosAt + 1) to "eos"
            new.size == budget -> new to "length"
            new.size == room -> new to "context"
            else -> new to null
        }
    }

    /** Where text (ending with the new piece) must be cut: the earliest stop string that reaches into the piece. */
    fun findStop(text: String, piece: String, stops: List<String>): Int? =
        stops.map { text.indexOf(it, maxOf(0, text.length - piece.length - it.length)) }.filter { it >= 0 }.minOrNull()

    /** decode: the text the kept tokens add (the caller's stream decoder, which may hold back incomplete UTF-8). */
    fun commit(
        stepTokens: List<Int>, nGenerated: Int, maxNewTokens: Int, room: Int, eos: Set<Int>,
        text: String, stops: List<String>, decode: (List<Int>) -> String,
    ): Committed {
        var (tokens, reason) = cutTokens(stepTokens, nGenerated, maxNewTokens, room, eos)
        var piece = decode(tokens)
        var all = text + piece
        val cut = if (stops.isEmpty()) null else findStop(all, piece, stops)
        if (cut != null) {
            piece = piece.substring(0, maxOf(0, piece.length - (all.length - cut)))
            all = all.substring(0, cut); reason = "stop"
        }
        return Committed(tokens, piece, all, reason)
    }
}
