package dev.edgespec

import dev.edgespec.core.BpeTokenizer
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.io.File

/** The Kotlin BPE tokenizer against the `tokenizers` library on a few hundred strings per tokenizer. */
class TokenizerConformanceTest {
    private fun check(name: String) {
        val trace = Traces.obj("tok_$name.json")
        val tok = BpeTokenizer.fromFile(Traces.file(trace.getString("tokenizer")))
        val failures = ArrayList<String>()
        val cases = trace.getJSONArray("cases").objects()
        for (case in cases) {
            val text = case.getString("text")
            val ids = tok.encode(text, true).toList()
            if (ids != case.getJSONArray("ids").ints().toList()) failures.add("encode ${quote(text)}: got $ids want ${case.getJSONArray("ids")}")
            val plain = tok.encode(text, false).toList()
            if (plain != case.getJSONArray("ids_plain").ints().toList()) failures.add("encode(plain) ${quote(text)}: got $plain")
            val want = case.getJSONArray("ids").ints()
            val decoded = tok.decode(want, true)
            if (decoded != case.getString("decoded")) failures.add("decode ${quote(text)}: got ${quote(decoded)} want ${quote(case.getString("decoded"))}")
            val special = tok.decode(want, false)
            if (special != case.getString("decoded_special")) failures.add("decode(special) ${quote(text)}: got ${quote(special)}")
        }
        for (d in trace.getJSONArray("decodes").objects()) {
            val got = tok.decode(d.getJSONArray("ids").ints(), true)
            if (got != d.getString("text")) failures.add("decode ${d.getJSONArray("ids")}: got ${quote(got)} want ${quote(d.getString("text"))}")
        }
        assertTrue(cases.size >= 300, "only ${cases.size} strings")
        assertTrue(failures.isEmpty(), "$name: ${failures.size} mismatches of ${cases.size} strings:\n" + failures.take(15).joinToString("\n"))
    }

    private fun quote(s: String) = buildString {
        append('"'); for (c in s) if (c.code < 32 || c.code in 0x7f..0xa0 || c.code in 0x2000..0x206f || c.code == 0x3000) append("\\u%04x".format(c.code)) else append(c); append('"')
    }

    @Test fun `tiny test tokenizer matches tokenizers`() = check("tiny")
    @Test fun `SmolLM2 tokenizer matches tokenizers`() = check("smollm2")
    @Test fun `Qwen2 tokenizer matches tokenizers`() = check("qwen2")
}
