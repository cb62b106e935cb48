package dev.edgespec.core

import org.json.JSONArray
import org.json.JSONException
import org.json.JSONObject
import java.io.File
import java.security.MessageDigest

/** A bundle that cannot be used, with the reason (same messages as edge_spec.manifest). */
class BundleException(message: String) : Exception(message)

const val SCHEMA_VERSION = 3
const val MANIFEST_FILE = "manifest.json"
val QUANTS = listOf("int4", "int8", "fp16", "fp32")
val QUANT_BLOCKS = listOf(16, 32, 64, 128, 256)
val KV_DTYPES = listOf("float32", "float16")
val ATTENTION_KINDS = listOf("fused", "portable")

data class ArchInfo(
    val modelType: String, val nLayers: Int, val nHeads: Int, val nKvHeads: Int, val headDim: Int,
    val hiddenSize: Int, val vocabSize: Int, val maxContext: Int, val kvDtype: String = "float32",
)

data class StageInfo(
    val file: String, val dataFiles: List<String>, val embed: Boolean, val head: Boolean,
    val layerStart: Int, val layerEnd: Int, val inputs: List<String>, val outputs: List<String>,
    val attention: String = "fused",
) {
    val layers: IntRange get() = layerStart until layerEnd
}

data class ModelInfo(
    val source: String, val arch: ArchInfo, val quant: String, val stages: List<String>, val sharesKvWith: String? = null,
)

data class TokenizerInfo(
    val file: String, val chatTemplate: String?, val bosTokenId: Int?, val eosTokenIds: List<Int>,
    val nRealTokens: Int, val specialTokens: Map<String, String> = emptyMap(),
)

data class Manifest(
    val schemaVersion: Int, val stages: Map<String, StageInfo>, val models: Map<String, ModelInfo>,
    val tokenizer: TokenizerInfo, val files: Map<String, String>, val createdBy: String = "", val defaultDraft: String? = null,
) {
    val target: ModelInfo get() = models.getValue("target")
    fun drafts(): List<String> = models.keys.filter { it != "target" }
}

/** Reads JSON fields the way edge_spec.manifest._build does: unknown or missing fields are errors. */
private class Fields(val obj: JSONObject, val where: String, known: List<String>) {
    init {
        val unknown = obj.keys().asSequence().filter { it !in known }.sorted().toList()
        if (unknown.isNotEmpty()) throw BundleException("manifest $where: unknown field(s) $unknown")
    }

    fun has(name: String) = obj.has(name) && !obj.isNull(name)
    private fun need(name: String) { if (!obj.has(name)) throw BundleException("manifest $where: missing field '$name'") }
    fun str(name: String): String { need(name); return obj.get(name) as? String ?: typeError(name, "a string") }
    fun strOrNull(name: String, default: String? = null): String? =
        if (!obj.has(name)) default else if (obj.isNull(name)) null else obj.get(name) as? String ?: typeError(name, "a string")
    fun int(name: String): Int { need(name); return asInt(name, obj.get(name)) }
    fun intOrNull(name: String): Int? { need(name); return if (obj.isNull(name)) null else asInt(name, obj.get(name)) }
    fun bool(name: String): Boolean { need(name); return obj.get(name) as? Boolean ?: typeError(name, "a boolean") }
    fun strings(name: String, required: Boolean = false): List<String> {
        if (!obj.has(name)) { if (required) need(name); return emptyList() }
        val arr = obj.get(name) as? JSONArray ?: typeError(name, "a list")
        return (0 until arr.length()).map { arr.get(it) as? String ?: typeError(name, "a list of strings") }
    }
    fun ints(name: String): List<Int> {
        if (!obj.has(name)) return emptyList()
        val arr = obj.get(name) as? JSONArray ?: typeError(name, "a list")
        return (0 until arr.length()).map { asInt(name, arr.get(it)) }
    }
    fun obj(name: String): JSONObject = if (!obj.has(name)) JSONObject() else obj.get(name) as? JSONObject ?: typeError(name, "an object")
    private fun asInt(name: String, v: Any): Int = when (v) {
        is Int -> v
        is Long -> v.toInt()
        else -> typeError(name, "an integer")
    }
    private fun typeError(name: String, what: String): Nothing = throw BundleException("manifest $where: field '$name' must be $what")
}

object ManifestReader {
    fun fromJson(text: String): Manifest {
        val root = try { JSONObject(text) } catch (e: JSONException) { throw BundleException("manifest is not valid JSON: ${e.message}") }
        val version = root.opt("schema_version")
        if (version != SCHEMA_VERSION) {
            throw BundleException(
                "manifest schema version ${version ?: "None"} is not supported by this runtime (it reads version $SCHEMA_VERSION); " +
                    "re-export the bundle with this edge-spec version",
            )
        }
        val top = Fields(root, "top level", listOf("schema_version", "stages", "models", "tokenizer", "files", "created_by", "default_draft", "coreml", "device"))
        // Phones run float32 graphs on the CPU provider or NNAPI: the GPU and Apple profiles are refused by name.
        val device = top.strOrNull("device", "cpu") ?: "cpu"
        if (device != "cpu") throw BundleException("this bundle was exported for --device $device; the Android core runs --device cpu bundles (re-export with --device cpu --attention portable)")
        val stagesObj = top.obj("stages")
        val stages = LinkedHashMap<String, StageInfo>()
        for (key in stagesObj.keys()) {
            val f = Fields(stagesObj.getJSONObject(key), "stage '$key'",
                listOf("file", "data_files", "embed", "head", "layer_start", "layer_end", "inputs", "outputs", "attention"))
            stages[key] = StageInfo(f.str("file"), f.strings("data_files"), f.bool("embed"), f.bool("head"),
                f.int("layer_start"), f.int("layer_end"), f.strings("inputs"), f.strings("outputs"),
                f.strOrNull("attention", "fused") ?: "fused")
        }
        val modelsObj = top.obj("models")
        val models = LinkedHashMap<String, ModelInfo>()
        for (role in modelsObj.keys()) {
            val f = Fields(modelsObj.getJSONObject(role), "model '$role'", listOf("source", "arch", "quant", "stages", "shares_kv_with", "trimmed_head", "block_size", "zero_points", "gguf_blocks", "layer_search"))
            // A trimmed draft head needs its logits put back at the kept token ids; this core does not do that yet.
            if (f.has("trimmed_head")) {
                throw BundleException("model '$role' has a trimmed LM head (trimmed_head): the Android core does not run trimmed draft heads yet; export without --draft-vocab")
            }
            // Each MatMulNBits node carries its own block size: the manifest's is checked, not needed.
            if (f.has("block_size") && f.int("block_size") !in QUANT_BLOCKS) {
                throw BundleException("model '$role': block_size ${f.int("block_size")} is not one of $QUANT_BLOCKS")
            }
            // Zero points, like blocks, live in each MatMulNBits node: the field is checked, not needed.
            if (f.has("zero_points")) f.bool("zero_points")
            // GGUF blocks are MatMulNBits/GatherBlockQuantized nodes like any other: checked, not needed.
            if (f.has("gguf_blocks")) {
                val kept = f.obj("gguf_blocks")
                val counts = kept.keys().asSequence().map { kept.get(it) }.toList()
                if (counts.isEmpty() || counts.any { !(it is Int && it >= 0) && !(it is Long && it >= 0L) }) {
                    throw BundleException("manifest model '$role': gguf_blocks is not a table of GGUF types to parameter counts")
                }
            }
            // The export's record of how a layer-skip subset was chosen: checked, not needed to run it.
            if (f.has("layer_search")) {
                f.obj("layer_search")
                if (f.strOrNull("shares_kv_with") == null)
                    throw BundleException("model '$role' has a layer_search: only a layer-skip draft (sharing the target's KV) is searched")
            }
            val a = Fields(f.obj("arch"), "model '$role' arch",
                listOf("model_type", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_size", "vocab_size", "max_context", "kv_dtype", "layer_windows"))
            // Windowed layers are masked inside the graphs, but that path is untested here: refused by name, not run.
            if (a.ints("layer_windows").any { it > 0 }) {
                throw BundleException("model '$role' has sliding-window layers (layer_windows): the Android core does not run windowed bundles yet; export a model without sliding windows")
            }
            val arch = ArchInfo(a.str("model_type"), a.int("n_layers"), a.int("n_heads"), a.int("n_kv_heads"), a.int("head_dim"),
                a.int("hidden_size"), a.int("vocab_size"), a.int("max_context"), a.strOrNull("kv_dtype", "float32") ?: "float32")
            models[role] = ModelInfo(f.str("source"), arch, f.str("quant"), f.strings("stages"), f.strOrNull("shares_kv_with"))
        }
        val t = Fields(top.obj("tokenizer"), "tokenizer",
            listOf("file", "chat_template", "bos_token_id", "eos_token_ids", "n_real_tokens", "special_tokens"))
        val special = LinkedHashMap<String, String>()
        if (t.has("special_tokens")) { val s = t.obj("special_tokens"); for (k in s.keys()) special[k] = s.getString(k) }
        val tokenizer = TokenizerInfo(t.str("file"), t.strOrNull("chat_template"), t.intOrNull("bos_token_id"), t.ints("eos_token_ids"),
            t.int("n_real_tokens"), special)
        val filesObj = top.obj("files")
        val files = LinkedHashMap<String, String>()
        for (k in filesObj.keys()) files[k] = filesObj.getString(k)
        return Manifest(root.getInt("schema_version"), stages, models, tokenizer, files,
            top.strOrNull("created_by", "") ?: "", top.strOrNull("default_draft"))
    }

    /** Every check edge_spec.manifest.validate makes, in the same order, with the same messages. */
    fun validate(m: Manifest, bundleDir: File, checkHashes: Boolean = true) {
        if ("target" !in m.models) throw BundleException("manifest has no 'target' model")
        if (m.defaultDraft != null && m.defaultDraft !in m.models)
            throw BundleException("manifest default_draft '${m.defaultDraft}' is not one of its models")
        val target = m.target
        for ((role, model) in m.models) {
            if (model.quant !in QUANTS) throw BundleException("model '$role': unknown quantization '${model.quant}' (known: $QUANTS)")
            if (model.arch.kvDtype !in KV_DTYPES) throw BundleException("model '$role': unknown KV dtype '${model.arch.kvDtype}'")
            if (model.arch.vocabSize < m.tokenizer.nRealTokens) throw BundleException(
                "vocabulary mismatch: model '$role' has ${model.arch.vocabSize} LM-head rows but the tokenizer has ${m.tokenizer.nRealTokens} tokens")
            if (role != "target" && model.arch.vocabSize != target.arch.vocabSize) throw BundleException(
                "vocabulary mismatch: draft '$role' scores ${model.arch.vocabSize} tokens, target scores ${target.arch.vocabSize}; " +
                    "export with a draft that shares the target's tokenizer")
            if (model.sharesKvWith != null) {
                val owner = m.models[model.sharesKvWith]
                if (owner == null || owner.sharesKvWith != null) throw BundleException("model '$role' shares KV with '${model.sharesKvWith}', which owns none")
                if (owner.arch.maxContext != model.arch.maxContext) throw BundleException("model '$role' and '${model.sharesKvWith}' disagree on max context")
            }
            validateStages(m, role, model)
        }
        for ((role, model) in m.models) {
            val ownerRole = model.sharesKvWith ?: role
            val owner = m.models.getValue(ownerRole)
            if (model.stages.first() != owner.stages.first() || model.stages.last() != owner.stages.last())
                throw BundleException("model '$role' must run '${model.sharesKvWith}''s first and last stages")
            // Its own stages in the owner's order: the layers it skips are whole stages of the owner.
            val order = model.stages.map { owner.stages.indexOf(it) }
            if (-1 in order || order != order.toSortedSet().toList())
                throw BundleException("model '$role' must run some of '${model.sharesKvWith}''s stages, in its order")
        }
        validateFiles(m, bundleDir, checkHashes)
    }

    private fun validateStages(m: Manifest, role: String, model: ModelInfo) {
        if (model.stages.isEmpty()) throw BundleException("model '$role' has no stages")
        var nextLayer = 0
        var run = 0
        for ((i, key) in model.stages.withIndex()) {
            val stage = m.stages[key] ?: throw BundleException("model '$role' names stage '$key', which the manifest does not list")
            if (stage.embed != (i == 0) || stage.head != (i == model.stages.size - 1))
                throw BundleException("model '$role': stage '$key' is out of place (embed first, head last)")
            // A role sharing another's KV (a layer-skip draft) may skip layers between its stages.
            val skips = model.sharesKvWith != null && i > 0 && stage.layerStart > nextLayer
            if (!stage.layers.isEmpty() && stage.layerStart != nextLayer && !skips)
                throw BundleException("model '$role': stage '$key' starts at layer ${stage.layerStart}, expected $nextLayer")
            if (!stage.layers.isEmpty()) nextLayer = stage.layerEnd
            run += stage.layers.count()
            if (stage.attention !in ATTENTION_KINDS)
                throw BundleException("stage '$key': unknown attention kind '${stage.attention}' (known: $ATTENTION_KINDS)")
            // Fused stages need ONNX Runtime's contrib GroupQueryAttention and in-place KV binding,
            // which this core does not drive (NNAPI cannot run contrib ops either).
            if (stage.attention != "portable" && !stage.layers.isEmpty())
                throw BundleException("stage '$key' uses ${stage.attention} attention; the on-device core runs portable graphs: " +
                    "re-export with `python -m export MODEL --attention portable`")
            if (stage.inputs != Names.stageInputs(stage.embed, stage.head, stage.layers) ||
                stage.outputs != Names.stageOutputs(stage.head, stage.layers))
                throw BundleException("stage '$key': graph input/output names do not follow edge_spec.names")
        }
        if (run != model.arch.nLayers) throw BundleException("model '$role': stages run $run layers, arch says ${model.arch.nLayers}")
    }

    private fun validateFiles(m: Manifest, dir: File, checkHashes: Boolean) {
        val referenced = sortedSetOf(m.tokenizer.file)
        for (stage in m.stages.values) { referenced.add(stage.file); referenced.addAll(stage.dataFiles) }
        val unlisted = referenced.filter { it !in m.files }
        if (unlisted.isNotEmpty()) throw BundleException("manifest lists no hash for $unlisted")
        for ((rel, expected) in m.files) {
            val file = File(dir, rel)
            if (!file.isFile) throw BundleException("bundle file missing: $file (the bundle is incomplete; re-export it)")
            if (checkHashes) {
                val actual = sha256(file)
                if (actual != expected) throw BundleException(
                    "bundle file altered: $file has SHA-256 ${actual.take(16)}…, manifest says ${expected.take(16)}… (re-export the bundle, or restore the file)")
            }
        }
    }

    fun sha256(file: File): String {
        val digest = MessageDigest.getInstance("SHA-256")
        file.inputStream().use { input ->
            val buf = ByteArray(1 shl 20)
            while (true) { val n = input.read(buf); if (n < 0) break; digest.update(buf, 0, n) }
        }
        return digest.digest().joinToString("") { "%02x".format(it) }
    }

    fun load(bundleDir: File, checkHashes: Boolean = true): Manifest {
        if (!bundleDir.isDirectory) throw BundleException("bundle folder not found: $bundleDir")
        val path = File(bundleDir, MANIFEST_FILE)
        if (!path.isFile) throw BundleException("$bundleDir is not a bundle: it has no $MANIFEST_FILE (run `python -m export` first)")
        val text = try { path.readText(Charsets.UTF_8) } catch (e: Exception) { throw BundleException("$path cannot be read: ${e.message}") }
        val m = fromJson(text)
        validate(m, bundleDir, checkHashes)
        return m
    }
}
