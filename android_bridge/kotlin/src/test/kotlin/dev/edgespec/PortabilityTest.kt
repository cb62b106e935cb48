package dev.edgespec

import org.junit.jupiter.api.Assertions.assertTrue
import org.junit.jupiter.api.Test
import java.io.File

/** The shared code must run on Android: no android.* imports, no java.net.http (absent on Android). */
class PortabilityTest {
    @Test
    fun `shared sources use only APIs Android has`() {
        val root = File(System.getProperty("edgespec.sources") ?: error("set -Dedgespec.sources=DIR"))
        val files = root.walkTopDown().filter { it.extension == "kt" }.toList()
        assertTrue(files.size >= 10, "found only ${files.size} sources under $root")
        val bad = files.flatMap { f ->
            f.readLines().filter { it.startsWith("import android.") || it.contains("java.net.http") || it.contains("Math.multiplyHigh") }
                .map { "${f.name}: $it" }
        }
        assertTrue(bad.isEmpty(), bad.joinToString("\n"))
    }
}
