package dev.edgespec.core

import org.json.JSONArray
import org.json.JSONObject
import java.io.File
import java.text.Normalizer
import java.util.regex.Pattern

/**
 * A byte-level BPE tokenizer read from a bundle's tokenizer.json (Hugging Face `tokenizers` format):
 * the Qwen2 and Llama 3 / SmolLM2 families. Supports what those files use: NFC/NFKC normalizers,
 * Split (regex or string) / ByteLevel / Digits pre-tokenizers, the BPE model (merges as "a b" strings
 * or pairs, ignore_merges), added tokens, TemplateProcessing / ByteLevel post-processors, and the
 * ByteLevel decoder. Anything else is refused at load time rather than tokenized differently.
 */
class BpeTokenizer private constructor(root: JSONObject) {
    class AddedToken(val id: Int, val content: String, val special: Boolean)

    private val vocab = HashMap<String, Int>()
    private val idToToken = HashMap<Int, String>()
    private val merges = HashMap<Long, Int>() // (leftId << 32 | rightId) -> rank
    private val mergeResult = HashMap<Long, Int>() // pair -> merged id
    private val ignoreMerges: Boolean
    private val added = ArrayList<AddedToken>()
    private val addedById = HashMap<Int, AddedToken>()
    private val addedByFirstChar = HashMap<Char, MutableList<AddedToken>>()
    private val normalizers = ArrayList<(String) -> String>()
    private val preTokenizers = ArrayList<(List<String>) -> List<String>>()
    private val prefixIds = ArrayList<Int>()
    private val suffixIds = ArrayList<Int>()
    private val cache = object : LinkedHashMap<String, IntArray>(4096, 0.75f, true) {
        override fun removeEldestEntry(eldest: MutableMap.MutableEntry<String, IntArray>?) = size > 20000
    }

    init {
        val model = root.getJSONObject("model")
        require(model.isNull("type") || model.getString("type") == "BPE") { "tokenizer model ${model.optString("type")} is not BPE" }
        require(model.isNull("dropout") || !model.has("dropout")) { "BPE dropout is not supported" }
        fun optStr(o: JSONObject, k: String) = if (o.isNull(k)) "" else o.getString(k)
        require(optStr(model, "continuing_subword_prefix") == "" && optStr(model, "end_of_word_suffix") == "") {
            "BPE subword prefixes/suffixes are not supported (byte-level BPE has none)"
        }
        require(model.isNull("byte_fallback") || !model.getBoolean("byte_fallback")) { "BPE byte_fallback is not supported (byte-level BPE needs none)" }
        ignoreMerges = !model.isNull("ignore_merges") && model.getBoolean("ignore_merges")
        require(model.isNull("unk_token")) { "BPE with an unk_token is not supported (byte-level BPE has none)" }
        val v = model.getJSONObject("vocab")
        for (token in v.keys()) { val id = v.getInt(token); vocab[token] = id; idToToken[id] = token }
        val m = model.getJSONArray("merges")
        for (rank in 0 until m.length()) {
            val entry = m.get(rank)
            val (a, b) = if (entry is JSONArray) entry.getString(0) to entry.getString(1) else {
                val s = entry as String; val sp = s.indexOf(' ', 1); s.substring(0, sp) to s.substring(sp + 1)
            }
            val ia = vocab[a] ?: continue; val ib = vocab[b] ?: continue; val merged = vocab[a + b] ?: continue
            val key = (ia.toLong() shl 32) or ib.toLong()
            if (key !in merges) { merges[key] = rank; mergeResult[key] = merged }
        }
        val addedArr = root.optJSONArray("added_tokens") ?: JSONArray()
        for (i in 0 until addedArr.length()) {
            val a = addedArr.getJSONObject(i)
            require(!a.optBoolean("lstrip") && !a.optBoolean("rstrip") && !a.optBoolean("single_word")) {
                "added token ${a.getString("content")}: lstrip/rstrip/single_word are not supported"
            }
            val t = AddedToken(a.getInt("id"), a.getString("content"), a.optBoolean("special"))
            added.add(t); addedById[t.id] = t; idToToken[t.id] = t.content
            if (t.content.isNotEmpty()) addedByFirstChar.getOrPut(t.content[0]) { mutableListOf() }.add(t)
        }
        addedByFirstChar.values.forEach { list -> list.sortByDescending { it.content.length } }
        root.optJSONObject("normalizer")?.let { addNormalizer(it) }
        val pre = root.optJSONObject("pre_tokenizer") ?: throw IllegalArgumentException("a byte-level tokenizer needs a pre_tokenizer")
        addPreTokenizer(pre)
        root.optJSONObject("post_processor")?.let { addPostProcessor(it) }
        root.optJSONObject("decoder")?.let { checkDecoder(it) }
    }

    private fun addNormalizer(n: JSONObject) {
        when (n.getString("type")) {
            "NFC" -> normalizers.add { Normalizer.normalize(it, Normalizer.Form.NFC) }
            "NFKC" -> normalizers.add { Normalizer.normalize(it, Normalizer.Form.NFKC) }
            "NFD" -> normalizers.add { Normalizer.normalize(it, Normalizer.Form.NFD) }
            "NFKD" -> normalizers.add { Normalizer.normalize(it, Normalizer.Form.NFKD) }
            "Sequence" -> { val a = n.getJSONArray("normalizers"); for (i in 0 until a.length()) addNormalizer(a.getJSONObject(i)) }
            else -> throw IllegalArgumentException("normalizer ${n.getString("type")} is not supported")
        }
    }

    private fun addPreTokenizer(p: JSONObject) {
        when (p.getString("type")) {
            "Sequence" -> { val a = p.getJSONArray("pretokenizers"); for (i in 0 until a.length()) addPreTokenizer(a.getJSONObject(i)) }
            "Split" -> {
                val pattern = p.getJSONObject("pattern")
                val regex = if (pattern.has("Regex")) javaPattern(pattern.getString("Regex")) else Pattern.compile(Pattern.quote(pattern.getString("String")))
                val behavior = p.getString("behavior")
                require(!p.optBoolean("invert")) { "inverted Split is not supported" }
                require(behavior == "Isolated" || behavior == "Removed") { "Split behavior $behavior is not supported" }
                preTokenizers.add { pieces -> pieces.flatMap { split(it, regex, behavior == "Removed") } }
            }
            "Digits" -> {
                val regex = Pattern.compile(if (p.optBoolean("individual_digits")) "\\p{Nd}" else "\\p{Nd}+")
                preTokenizers.add { pieces -> pieces.flatMap { split(it, regex, false) } }
            }
            "ByteLevel" -> {
                val prefixSpace = p.optBoolean("add_prefix_space", false)
                val useRegex = p.optBoolean("use_regex", true)
                preTokenizers.add { pieces ->
                    var ps = pieces
                    if (prefixSpace && ps.isNotEmpty() && !ps[0].startsWith(" ")) ps = listOf(" " + ps[0]) + ps.drop(1)
                    if (useRegex) ps = ps.flatMap { split(it, GPT2_PATTERN, false) }
                    ps.map { byteLevel(it) }
                }
            }
            else -> throw IllegalArgumentException("pre_tokenizer ${p.getString("type")} is not supported")
        }
    }

    private fun addPostProcessor(p: JSONObject) {
        when (p.getString("type")) {
            "ByteLevel" -> {}
            "Sequence" -> { val a = p.getJSONArray("processors"); for (i in 0 until a.length()) addPostProcessor(a.getJSONObject(i)) }
            "TemplateProcessing" -> {
                val single = p.getJSONArray("single")
                val specials = p.optJSONObject("special_tokens") ?: JSONObject()
                var seenSequence = false
                for (i in 0 until single.length()) {
                    val item = single.getJSONObject(i)
                    if (item.has("Sequence")) { seenSequence = true; continue }
                    val id = item.getJSONObject("SpecialToken").getString("id")
                    val ids = specials.getJSONObject(id).getJSONArray("ids")
                    for (j in 0 until ids.length()) (if (seenSequence) suffixIds else prefixIds).add(ids.getInt(j))
                }
            }
            else -> throw IllegalArgumentException("post_processor ${p.getString("type")} is not supported")
        }
    }

    private fun checkDecoder(d: JSONObject) {
        when (d.getString("type")) {
            "ByteLevel" -> {}
            "Sequence" -> { val a = d.getJSONArray("decoders"); for (i in 0 until a.length()) checkDecoder(a.getJSONObject(i)) }
            else -> throw IllegalArgumentException("decoder ${d.getString("type")} is not supported")
        }
    }

    val specialIds: Set<Int> get() = added.filter { it.special }.map { it.id }.toSet()
    fun tokenToId(token: String): Int? = vocab[token] ?: added.firstOrNull { it.content == token }?.id
    fun idToToken(id: Int): String? = idToToken[id]

    fun encode(text: String, addSpecialTokens: Boolean = true): IntArray {
        val out = ArrayList<Int>()
        if (addSpecialTokens) out.addAll(prefixIds)
        var segmentStart = 0
        var i = 0
        while (i < text.length) {
            val match = addedByFirstChar[text[i]]?.firstOrNull { text.startsWith(it.content, i) }
            if (match == null) { i++; continue }
            if (i > segmentStart) encodeSegment(text.substring(segmentStart, i), out)
            out.add(match.id)
            i += match.content.length
            segmentStart = i
        }
        if (segmentStart < text.length) encodeSegment(text.substring(segmentStart), out)
        if (addSpecialTokens) out.addAll(suffixIds)
        return out.toIntArray()
    }

    private fun encodeSegment(segment: String, out: MutableList<Int>) {
        var text = segment
        for (n in normalizers) text = n(text)
        var pieces = listOf(text)
        for (p in preTokenizers) pieces = p(pieces)
        for (piece in pieces) if (piece.isNotEmpty()) for (id in bpe(piece)) out.add(id)
    }

    private fun bpe(word: String): IntArray {
        cache[word]?.let { return it }
        if (ignoreMerges) vocab[word]?.let { return intArrayOf(it).also { r -> cache[word] = r } }
        val symbols = ArrayList<Int>(word.length)
        var i = 0
        while (i < word.length) {
            val cp = word.codePointAt(i); val s = String(Character.toChars(cp))
            // A byte missing from the vocabulary is dropped, as `tokenizers` does without an unk_token.
            vocab[s]?.let { symbols.add(it) }
            i += Character.charCount(cp)
        }
        if (symbols.isEmpty()) return IntArray(0).also { cache[word] = it }
        while (symbols.size > 1) {
            var bestRank = Int.MAX_VALUE; var bestKey = 0L
            for (j in 0 until symbols.size - 1) {
                val key = (symbols[j].toLong() shl 32) or symbols[j + 1].toLong()
                val rank = merges[key] ?: continue
                if (rank < bestRank) { bestRank = rank; bestKey = key }
            }
            if (bestRank == Int.MAX_VALUE) break
            val merged = mergeResult.getValue(bestKey)
            val left = (bestKey ushr 32).toInt(); val right = bestKey.toInt()
            var j = 0
            while (j < symbols.size - 1) {
                if (symbols[j] == left && symbols[j + 1] == right) { symbols[j] = merged; symbols.removeAt(j + 1) }
                j++
            }
        }
        return symbols.toIntArray().also { cache[word] = it }
    }

    fun decode(ids: IntArray, skipSpecialTokens: Boolean = true): String {
        val bytes = java.io.ByteArrayOutputStream()
        for (id in ids) {
            val addedToken = addedById[id]
            if (addedToken != null && addedToken.special && skipSpecialTokens) continue
            val token = idToToken[id] ?: continue
            val mapped = ByteArray(token.length)
            var ok = true
            for ((k, c) in token.withIndex()) { val b = CHAR_TO_BYTE[c]; if (b == null) { ok = false; break }; mapped[k] = b.toByte() }
            if (ok) bytes.write(mapped, 0, mapped.size) else { val raw = token.toByteArray(Charsets.UTF_8); bytes.write(raw, 0, raw.size) }
        }
        return Utf8.decodeLossy(bytes.toByteArray())
    }

    companion object {
        fun fromFile(file: File) = BpeTokenizer(JSONObject(file.readText(Charsets.UTF_8)))
        fun fromJson(text: String) = BpeTokenizer(JSONObject(text))

        /** Unicode White_Space, spelled out, so \s means the same on OpenJDK and Android (ICU). */
        private const val WS = "\\t\\n\\x0B\\f\\r\\x20\\x85\\xA0\\u1680\\u2000-\\u200A\\u2028\\u2029\\u202F\\u205F\\u3000"

        /** Translates a tokenizers (Oniguruma) regex to java.util.regex with the same meaning. */
        fun javaPattern(onig: String): Pattern {
            val sb = StringBuilder()
            var i = 0
            var inClass = 0
            while (i < onig.length) {
                val c = onig[i]
                if (c == '\\' && i + 1 < onig.length) {
                    val n = onig[i + 1]
                    when {
                        n == 's' -> sb.append(if (inClass > 0) WS else "[$WS]")
                        n == 'S' -> { require(inClass == 0) { "\\S inside a class is not supported" }; sb.append("[^$WS]") }
                        else -> sb.append(c).append(n)
                    }
                    i += 2; continue
                }
                if (c == '[') inClass++ else if (c == ']' && inClass > 0) inClass--
                if (c == '(' && onig.startsWith("(?i:", i)) { sb.append("(?iu:"); i += 4; continue }
                sb.append(c); i++
            }
            return Pattern.compile(sb.toString())
        }

        private val GPT2_PATTERN = javaPattern("'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+")

        private fun split(text: String, regex: Pattern, removeMatches: Boolean): List<String> {
            val out = ArrayList<String>()
            val m = regex.matcher(text)
            var last = 0
            while (m.find()) {
                if (m.end() == m.start()) continue
                if (m.start() > last) out.add(text.substring(last, m.start()))
                if (!removeMatches) out.add(m.group())
                last = m.end()
            }
            if (last < text.length) out.add(text.substring(last))
            return out
        }

        private val BYTE_TO_CHAR = CharArray(256)
        private val CHAR_TO_BYTE = HashMap<Char, Int>()

        init {
            val printable = (33..126) + (161..172) + (174..255)
            var n = 0
            for (b in 0 until 256) {
                val c = if (b in printable) b else 256 + n++
                BYTE_TO_CHAR[b] = c.toChar(); CHAR_TO_BYTE[c.toChar()] = b
            }
        }

        fun byteLevel(text: String): String {
            val bytes = text.toByteArray(Charsets.UTF_8)
            val sb = StringBuilder(bytes.size)
            for (b in bytes) sb.append(BYTE_TO_CHAR[b.toInt() and 0xff])
            return sb.toString()
        }
    }
}

/** UTF-8 decoding with U+FFFD for each maximal invalid subpart (Rust's from_utf8_lossy), on every JVM alike. */
object Utf8 {
    fun decodeLossy(b: ByteArray): String {
        val sb = StringBuilder(b.size)
        var i = 0
        while (i < b.size) {
            val c0 = b[i].toInt() and 0xff
            if (c0 < 0x80) { sb.append(c0.toChar()); i++; continue }
            val (need, lo, hi) = when (c0) {
                in 0xC2..0xDF -> Triple(1, 0x80, 0xBF)
                0xE0 -> Triple(2, 0xA0, 0xBF)
                in 0xE1..0xEC, 0xEE, 0xEF -> Triple(2, 0x80, 0xBF)
                0xED -> Triple(2, 0x80, 0x9F)
                0xF0 -> Triple(3, 0x90, 0xBF)
                in 0xF1..0xF3 -> Triple(3, 0x80, 0xBF)
                0xF4 -> Triple(3, 0x80, 0x8F)
                else -> Triple(0, 0, 0)
            }
            if (need == 0) { sb.append('\uFFFD'); i++; continue }
            var cp = c0 and (0x3F shr need)
            var j = 1
            var valid = true
            while (j <= need) {
                if (i + j >= b.size) { valid = false; break }
                val cj = b[i + j].toInt() and 0xff
                val (l, h) = if (j == 1) lo to hi else 0x80 to 0xBF
                if (cj < l || cj > h) { valid = false; break }
                cp = (cp shl 6) or (cj and 0x3F)
                j++
            }
            if (!valid) { sb.append('\uFFFD'); i += j; continue }
            sb.appendCodePoint(cp); i += need + 1
        }
        return sb.toString()
    }
}
