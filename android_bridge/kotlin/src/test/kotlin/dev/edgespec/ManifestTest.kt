package dev.edgespec

import dev.edgespec.core.BundleException
import dev.edgespec.core.Names
import dev.edgespec.core.SCHEMA_VERSION
import dev.edgespec.core.ManifestReader
import org.json.JSONObject
import org.junit.jupiter.api.Assertions.assertEquals
import org.junit.jupiter.api.Assertions.assertThrows
import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.io.File
import java.nio.file.Files

/** The manifest reader validates what edge_spec.manifest validates, with the same messages. */
class ManifestTest {
    private val bundle = File(Traces.dir, "tiny/llama")

    private fun mutated(change: (JSONObject) -> Unit, fileChange: (File) -> Unit = {}): File {
        val dir = Files.createTempDirectory("bundle").toFile()
        bundle.copyRecursively(dir, overwrite = true)
        val m = JSONObject(File(dir, "manifest.json").readText()); change(m)
        File(dir, "manifest.json").writeText(m.toString()); fileChange(dir)
        return dir
    }

    private fun refused(dir: File, vararg phrases: String) {
        val e = assertThrows(BundleException::class.java) { ManifestReader.load(dir) }
        for (p in phrases) assertTrue(e.message!!.contains(p), "'${e.message}' should mention '$p'")
        dir.deleteRecursively()
    }

    @Test
    fun `a good bundle loads with every role`() {
        val m = ManifestReader.load(bundle)
        assertEquals(setOf("target", "draft", "layer_skip"), m.models.keys)
        assertEquals("target", m.models.getValue("layer_skip").sharesKvWith)
    }

    @Test fun `schema version`() = refused(mutated({ it.put("schema_version", SCHEMA_VERSION + 1) }), "schema version ${SCHEMA_VERSION + 1} is not supported")
    @Test fun `fused attention refused`() = refused(mutated({ m ->
        val stage = m.getJSONObject("stages").getJSONObject("target.trunk")
        stage.put("attention", "fused")
        stage.put("outputs", org.json.JSONArray(Names.stageOutputs(false, 0 until stage.getInt("layer_end")).map { it.replace("new_", "present_") }))
    }), "re-export with `python -m export MODEL --attention portable`")
    @Test fun `sliding windows refused`() = refused(mutated({ m ->
        val arch = m.getJSONObject("models").getJSONObject("target").getJSONObject("arch")
        arch.put("layer_windows", org.json.JSONArray(List(arch.getInt("n_layers")) { if (it % 2 == 0) 16 else 0 }))
    }), "sliding-window layers (layer_windows)")
    @Test fun `trimmed draft head refused`() = refused(mutated({ m ->
        m.getJSONObject("models").getJSONObject("draft").put("trimmed_head", JSONObject(mapOf("file" to "draft.head_tokens.npy", "rows" to 64, "counted_from" to "")))
    }), "trimmed LM head (trimmed_head)", "export without --draft-vocab")
    @Test fun `block size not offered`() = refused(mutated({ it.getJSONObject("models").getJSONObject("target").put("block_size", 48) }),
        "block_size 48 is not one of [16, 32, 64, 128, 256]")
    @Test fun `gguf blocks not a table of counts`() = refused(mutated({ it.getJSONObject("models").getJSONObject("target").put("gguf_blocks", JSONObject().put("Q4_K", -1)) }),
        "gguf_blocks is not a table of GGUF types to parameter counts")

    @Test
    fun `gguf blocks read as a table of counts`() {
        // Counts past Int's range (a 7B model's Q4_K) are read, not refused.
        val dir = mutated({ it.getJSONObject("models").getJSONObject("target").put("gguf_blocks", JSONObject().put("Q4_K", 5_000_000_000L).put("Q6_K", 12)) })
        assertEquals(setOf("target", "draft", "layer_skip"), ManifestReader.load(dir).models.keys)
        dir.deleteRecursively()
    }

    @Test fun `unknown field`() = refused(mutated({ it.put("extra", 1) }), "unknown field(s) [extra]")
    @Test fun `gpu device profile refused`() = refused(mutated({ it.put("device", "cuda") }), "exported for --device cuda", "--device cpu")
    @Test fun `no target`() = refused(mutated({ m -> val models = m.getJSONObject("models"); models.put("x", models.remove("target")); m.remove("default_draft") }), "no 'target' model")
    @Test fun `unknown quantization`() = refused(mutated({ it.getJSONObject("models").getJSONObject("target").put("quant", "int3") }), "unknown quantization 'int3'")
    @Test fun `missing file`() = refused(mutated({}, { File(it, "tokenizer.json").delete() }), "bundle file missing")
    @Test fun `altered file`() = refused(mutated({}, { File(it, "tokenizer.json").appendText(" ") }), "bundle file altered")
    @Test fun `bad layer count`() = refused(mutated({ it.getJSONObject("models").getJSONObject("target").getJSONObject("arch").put("n_layers", 5) }), "arch says 5")
    @Test fun `not a bundle`() = refused(Files.createTempDirectory("empty").toFile(), "is not a bundle")
}
