plugins {
    id("com.android.library")
    id("org.jetbrains.kotlin.android")
}

android {
    namespace = "dev.edgespec.android"
    compileSdk = 35
    defaultConfig {
        minSdk = 26 // java.nio direct buffers, java.text.Normalizer, coroutines; Pcg64 avoids API-31 multiplyHigh
        consumerProguardFiles("consumer-rules.pro")
    }
    // The JVM-pure core, client and Flow API are shared verbatim with the JVM tests (../../kotlin).
    sourceSets["main"].java.srcDirs("src/main/kotlin", "../../kotlin/src/main/kotlin")
    compileOptions { sourceCompatibility = JavaVersion.VERSION_17; targetCompatibility = JavaVersion.VERSION_17 }
    kotlinOptions { jvmTarget = "17" }
    // Graphs with external data must be real files for ONNX Runtime: never compress bundle assets.
    androidResources { noCompress += listOf("onnx", "data", "json") }
}

dependencies {
    // The JVM tests compile and run against this exact version's classes.jar (from the AAR).
    api("com.microsoft.onnxruntime:onnxruntime-android:1.29.0")
    implementation("org.jetbrains.kotlinx:kotlinx-coroutines-android:1.10.1")
    // org.json is part of the Android platform: no dependency.
}
