package dev.edgespec

import org.json.JSONArray
import org.json.JSONObject
import java.io.File

/** Where run_jvm_tests.sh put the golden traces (-Dedgespec.traces=DIR). A missing trace fails, never skips. */
object Traces {
    val dir: File by lazy {
        val path = System.getProperty("edgespec.traces") ?: error("set -Dedgespec.traces=DIR (run android_bridge/run_jvm_tests.sh)")
        File(path).also { check(it.isDirectory) { "traces folder $it does not exist" } }
    }
    fun file(name: String): File = File(dir, name).also { check(it.isFile) { "golden trace $it is missing: write_traces.py did not write it" } }
    fun obj(name: String) = JSONObject(file(name).readText())
    fun arr(name: String) = JSONArray(file(name).readText())
}

fun JSONArray.ints() = IntArray(length()) { getInt(it) }
fun JSONArray.longs() = LongArray(length()) { getLong(it) }
fun JSONArray.doubles() = DoubleArray(length()) { getDouble(it) }
fun JSONArray.floats() = FloatArray(length()) { getDouble(it).toFloat() }
fun JSONArray.objects() = (0 until length()).map { getJSONObject(it) }
