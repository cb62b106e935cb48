package dev.edgespec.sample

import android.app.Activity
import android.os.Bundle
import android.widget.TextView
import dev.edgespec.android.EdgeSpec
import dev.edgespec.core.GenerateConfig
import dev.edgespec.flow.TokenEvent
import kotlinx.coroutines.CoroutineScope
import kotlinx.coroutines.Dispatchers
import kotlinx.coroutines.SupervisorJob
import kotlinx.coroutines.cancel
import kotlinx.coroutines.launch

/** Minimal sample: open the bundle shipped in assets/smollm2/, stream a completion into a TextView. */
class MainActivity : Activity() {
    private val scope = CoroutineScope(SupervisorJob() + Dispatchers.Main)

    override fun onCreate(savedInstanceState: Bundle?) {
        super.onCreate(savedInstanceState)
        val view = TextView(this)
        setContentView(view)
        scope.launch {
            val engine = EdgeSpec.openFromAssets(this@MainActivity, "smollm2")
            EdgeSpec.stream(engine, "def fibonacci(n):", GenerateConfig(maxNewTokens = 64)).collect { event ->
                when (event) {
                    is TokenEvent.Text -> view.append(event.piece)
                    is TokenEvent.Done -> view.append("\n[${event.stopReason}, ${event.tokens} tokens]")
                }
            }
        }
    }

    override fun onDestroy() { scope.cancel(); super.onDestroy() }
}
