// Android build of the edge-spec bridge. Needs Google's Maven (Android Gradle plugin, onnxruntime-android):
// NOT built on the development machine; see ../README.md "Verification".
pluginManagement { repositories { google(); mavenCentral(); gradlePluginPortal() } }
dependencyResolutionManagement { repositories { google(); mavenCentral() } }
rootProject.name = "edge-spec-android"
include(":edgespec", ":sample")
