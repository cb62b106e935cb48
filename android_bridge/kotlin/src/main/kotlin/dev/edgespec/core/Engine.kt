package dev.edgespec.core

import java.io.File

data class EngineConfig(
    val drafter: String = "auto", // auto | model | layer-skip | lookup | none
    val gamma: Int? = null, // null: adaptive
    val maxGamma: Int = 8,
    val checkHashes: Boolean = true,
    val session: SessionSettings = SessionSettings(),
    // The adaptive policy's other knobs (probes, ledger, α decay and prior); gamma and maxGamma above set its fixed and maxGamma.
    val gammaConfig: GammaConfig = GammaConfig(),
) {
    init {
        require(gammaConfig.fixed == null && gammaConfig.maxGamma == GammaConfig().maxGamma) {
            "set γ with EngineConfig(gamma = ..., maxGamma = ...), not in gammaConfig"
        }
        gammaConfig.copy(fixed = gamma, maxGamma = maxGamma)  // throws on a γ it cannot run
    }

    /** The γ config a generation runs with (runtime/engine.py EngineConfig.gamma_for): gammaConfig with this γ, capped at maxGamma. */
    fun gammaFor(gamma: Int?): GammaConfig = gammaConfig.copy(fixed = gamma?.let { minOf(it, maxGamma) }, maxGamma = maxGamma)
}

data class GenerateConfig(val maxNewTokens: Int = 256, val sampling: SamplingConfig = SamplingConfig(), val stop: List<String> = emptyList())

data class GenerationResult(
    val text: String, val promptIds: List<Int>, val tokenIds: List<Int>, val stopReason: String, val steps: List<Step>,
) {
    val acceptedTokens: Int get() = steps.sumOf { it.nAccepted }
    val draftedTokens: Int get() = steps.sumOf { it.nDrafted }
}

/**
 * Turns a growing id list into text pieces, holding back incomplete UTF-8 (runtime/tokenizer.py StreamDecoder).
 * Each push decodes only a window: the ids of the last non-empty piece (context) and those since.
 */
class StreamDecoder(private val decode: (IntArray) -> String) {
    constructor(tokenizer: BpeTokenizer) : this({ ids -> tokenizer.decode(ids) })

    private val ids = ArrayList<Int>()
    private var context = 0 // window start: the first id of the last non-empty piece
    private var emitted = 0 // ids up to here are in emitted pieces; the rest wait

    fun push(newIds: List<Int>): String {
        ids.addAll(newIds)
        if (ids.size == emitted) return ""
        val text = decode(slice(context, ids.size))
        if (text.endsWith("\uFFFD")) return ""
        val known = if (emitted > context) decode(slice(context, emitted)) else ""
        val piece = text.substring(minOf(known.length, text.length))
        if (piece.isNotEmpty()) context = emitted
        emitted = ids.size
        return piece
    }

    private fun slice(from: Int, to: Int) = IntArray(to - from) { ids[from + it] }
}

/**
 * The on-device engine: one bundle, one sequence at a time (runtime/engine.py without chat templates).
 * JVM-pure: no android.* import; the Android module wraps it in a coroutine Flow.
 */
class Engine(val bundleDir: File, val config: EngineConfig = EngineConfig(), stageRunner: StageRunner? = null) : AutoCloseable {
    val manifest: Manifest = ManifestReader.load(bundleDir, config.checkHashes)
    val tokenizer: BpeTokenizer = BpeTokenizer.fromFile(File(bundleDir, manifest.tokenizer.file))
    private val runner: StageRunner = stageRunner ?: OrtStageRunner(bundleDir, config.session)
    private val caches = HashMap<String, KvCache>()
    val target: ModelRunner = runnerFor("target")
    private val drafters = HashMap<String, Drafter?>()
    var drafter: Drafter? = null
        private set
    private var gamma: Int? = config.gamma
    val costs = CostModel()
    /** Keeps each drafter's α across generations, as runtime/engine.py does. */
    val policy = RoundPolicy(costs)
    private val lock = Any()

    init { useDrafter(config.drafter, config.gamma) }

    /** Switches drafter and γ policy (null: adaptive) without reloading sessions or buffers. */
    fun useDrafter(kind: String, gamma: Int? = null) = synchronized(lock) {
        require(kind in listOf("auto", "model", "layer-skip", "lookup", "none")) { "unknown drafter $kind" }
        config.copy(gamma = gamma)  // throws on a γ it cannot run, before the switch
        drafter = drafters.getOrPut(kind) { makeDrafter(kind) }
        this.gamma = gamma
    }

    fun runnerFor(role: String): ModelRunner {
        val info = manifest.models[role] ?: throw BundleException("this bundle has no '$role' model (it has ${manifest.models.keys})")
        val owner = info.sharesKvWith ?: role
        val cache = caches.getOrPut(owner) {
            val arch = manifest.models.getValue(owner).arch
            if (arch.kvDtype != "float32") throw BundleException("KV dtype ${arch.kvDtype} is not supported on the phone path")
            KvCache(0 until arch.nLayers, arch.nKvHeads, arch.maxContext, arch.headDim)
        }
        return ModelRunner(role, info, info.stages.map { manifest.stages.getValue(it) }, runner, cache)
    }

    private fun modelDrafter(kind: String): Drafter? {
        val role = when (kind) { "model" -> "draft"; "layer-skip" -> "layer_skip"; else -> manifest.defaultDraft } ?: return null
        return if (role == "layer_skip") LayerSkipDrafter(runnerFor(role)) else DraftModelDrafter(runnerFor(role))
    }

    private fun makeDrafter(kind: String): Drafter? = when (kind) {
        "none" -> null
        "lookup" -> PromptLookupDrafter()
        "auto" -> MixedDrafter(PromptLookupDrafter(), modelDrafter("auto"))
        else -> modelDrafter(kind)
    }

    fun encode(text: String, addSpecialTokens: Boolean = true): IntArray = tokenizer.encode(text, addSpecialTokens)

    /** The policy started for a sequence of up to horizonTokens with `drafter` (null: plain) and this engine's γ setting. */
    fun startPolicy(drafter: Drafter?, horizonTokens: Int = 256): RoundPolicy =
        policy.start(drafter, horizonTokens, config.gammaFor(gamma))

    /** Generates from prompt ids; `onPiece` receives text as tokens are accepted; `cancelled` is polled per pass. */
    fun generate(
        promptIds: IntArray, config: GenerateConfig = GenerateConfig(), speculative: Boolean = true,
        cancelled: () -> Boolean = { false }, rng: UniformSource? = null, onPiece: (String) -> Unit = {},
    ): GenerationResult = synchronized(lock) {
        val maxContext = target.cache.maxContext
        require(promptIds.isNotEmpty()) { "the prompt is empty" }
        require(promptIds.size < maxContext) { "prompt has ${promptIds.size} tokens but the bundle's max context is $maxContext" }
        val random: UniformSource = rng ?: Pcg64(config.sampling.seed ?: (System.nanoTime() and Long.MAX_VALUE))
        val eos = manifest.tokenizer.eosTokenIds.toSet()
        val decoder = StreamDecoder(tokenizer)
        val generated = ArrayList<Int>()
        val steps = ArrayList<Step>()
        var stopReason: String? = null
        var text = ""
        val active = if (speculative) drafter else null
        val started = startPolicy(active, config.maxNewTokens)
        for (step in Loop.decodeSteps(target, active, LongArray(promptIds.size) { promptIds[it].toLong() }, config.sampling, random, started)) {
            steps.add(step)
            // A round may commit tokens past where plain decoding would have stopped (Commit: budget, context, EOS, stop strings).
            val room = maxContext - promptIds.size - generated.size
            val kept = Commit.commit(step.tokens, generated.size, config.maxNewTokens, room, eos, text, config.stop) { decoder.push(it) }
            generated.addAll(kept.tokens)
            val piece = kept.piece
            text = kept.text; stopReason = kept.stopReason
            if (piece.isNotEmpty()) onPiece(piece)
            if (stopReason == null && cancelled()) stopReason = "cancelled"
            if (stopReason != null) break
        }
        GenerationResult(text, promptIds.toList(), generated, stopReason ?: "length", steps)
    }

    fun generate(prompt: String, config: GenerateConfig = GenerateConfig(), onPiece: (String) -> Unit = {}): GenerationResult =
        generate(encode(prompt), config, onPiece = onPiece)

    override fun close() = runner.close()
}
