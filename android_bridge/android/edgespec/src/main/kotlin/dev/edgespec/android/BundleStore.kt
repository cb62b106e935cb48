package dev.edgespec.android

import android.content.Context
import dev.edgespec.core.ManifestReader
import java.io.File
import java.io.IOException
import java.net.HttpURLConnection
import java.net.URL
import java.security.MessageDigest

/**
 * Puts a bundle where ONNX Runtime can open it: app-private files (graphs with external data must be
 * real files, not asset streams). Thin Android layer; everything it hands over is validated by the
 * JVM-pure ManifestReader (hashes included).
 */
class BundleStore(private val context: Context) {
    private val root: File get() = File(context.filesDir, "edge-spec")

    /** Copies assets/<name>/ (written by tools/package_bundle.py --layout assets) once, then validates it. */
    fun fromAssets(name: String): File {
        val dest = File(root, name)
        if (!File(dest, "manifest.json").isFile) {
            val tmp = File(root, "$name.partial").apply { deleteRecursively(); mkdirs() }
            val files = context.assets.list(name) ?: throw IOException("no assets/$name")
            for (file in files) context.assets.open("$name/$file").use { input -> File(tmp, file).outputStream().use { input.copyTo(it) } }
            dest.deleteRecursively()
            if (!tmp.renameTo(dest)) throw IOException("cannot move $tmp to $dest")
        }
        ManifestReader.load(dest)
        return dest
    }

    /**
     * Downloads a bundle hosted as tools/package_bundle.py --layout download wrote it: baseUrl/manifest.json,
     * then every file the manifest lists, each checked against its SHA-256 before the bundle is used.
     */
    fun download(name: String, baseUrl: String, onProgress: (file: String, bytes: Long) -> Unit = { _, _ -> }): File {
        val dest = File(root, name)
        val tmp = File(root, "$name.partial").apply { mkdirs() }
        val manifestFile = File(tmp, "manifest.json")
        fetch("$baseUrl/manifest.json", manifestFile) { onProgress("manifest.json", it) }
        val manifest = ManifestReader.fromJson(manifestFile.readText())
        for ((rel, sha) in manifest.files) {
            val target = File(tmp, rel)
            if (target.isFile && ManifestReader.sha256(target) == sha) continue // resumed download
            fetch("$baseUrl/$rel", target) { onProgress(rel, it) }
            val got = ManifestReader.sha256(target)
            if (got != sha) { target.delete(); throw IOException("$rel: SHA-256 $got, manifest says $sha") }
        }
        ManifestReader.validate(manifest, tmp, checkHashes = false) // hashes were checked file by file above
        dest.deleteRecursively()
        if (!tmp.renameTo(dest)) throw IOException("cannot move $tmp to $dest")
        return dest
    }

    private fun fetch(url: String, to: File, progress: (Long) -> Unit) {
        val conn = URL(url).openConnection() as HttpURLConnection
        try {
            if (conn.responseCode != 200) throw IOException("GET $url: HTTP ${conn.responseCode}")
            to.parentFile?.mkdirs()
            conn.inputStream.use { input -> to.outputStream().use { out ->
                val buf = ByteArray(1 shl 16); var total = 0L
                while (true) { val n = input.read(buf); if (n < 0) break; out.write(buf, 0, n); total += n; progress(total) }
            } }
        } finally { conn.disconnect() }
    }

    companion object {
        fun sha256(bytes: ByteArray): String = MessageDigest.getInstance("SHA-256").digest(bytes).joinToString("") { "%02x".format(it) }
    }
}
