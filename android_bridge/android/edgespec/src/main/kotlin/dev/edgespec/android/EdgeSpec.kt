package dev.edgespec.android

import android.content.Context
import dev.edgespec.core.Engine
import dev.edgespec.core.EngineConfig
import dev.edgespec.core.GenerateConfig
import dev.edgespec.core.SessionSettings
import dev.edgespec.flow.TokenEvent
import dev.edgespec.flow.streamTokens
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.flow.Flow
import kotlinx.coroutines.withContext

/** The app-facing entry point: open a bundle shipped in assets (or downloaded), then stream tokens. */
object EdgeSpec {
    /** Loads on Dispatchers.IO (hash checks and session creation take seconds for real bundles). */
    suspend fun openFromAssets(context: Context, name: String, config: EngineConfig = EngineConfig(session = SessionSettings(threads = 4))): Engine =
        withContext(Dispatchers.IO) { Engine(BundleStore(context).fromAssets(name), config) }

    fun stream(engine: Engine, prompt: String, config: GenerateConfig = GenerateConfig()): Flow<TokenEvent> = engine.streamTokens(prompt, config)
}
