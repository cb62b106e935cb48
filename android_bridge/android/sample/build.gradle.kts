plugins {
    id("com.android.application")
    id("org.jetbrains.kotlin.android")
}

android {
    namespace = "dev.edgespec.sample"
    compileSdk = 35
    defaultConfig { applicationId = "dev.edgespec.sample"; minSdk = 26; targetSdk = 35; versionCode = 1; versionName = "0.1" }
    compileOptions { sourceCompatibility = JavaVersion.VERSION_17; targetCompatibility = JavaVersion.VERSION_17 }
    kotlinOptions { jvmTarget = "17" }
    androidResources { noCompress += listOf("onnx", "data", "json") }
    // assets/<bundle>/ comes from: python android_bridge/tools/package_bundle.py BUNDLE sample/src/main --budget 3GB
}

dependencies {
    implementation(project(":edgespec"))
    implementation("androidx.lifecycle:lifecycle-runtime-ktx:2.8.7")
}
