#!/usr/bin/env bash
# JVM tests of the Android bridge: installs what it needs (hash-checked), builds the test-only native
# shims, compiles the Kotlin core + tests with kotlinc, writes golden traces with the Python runtime,
# starts the Python server on loopback, runs JUnit, and ends with one line: "N passed, N failed".
#   PYTHON=/path/to/python bash android_bridge/run_jvm_tests.sh      (default PYTHON=python)
# Nothing is skipped: a missing trace, server or library is a failure, not a skip.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ROOT="$(dirname "$HERE")"
PYTHON="${PYTHON:-python}"
CACHE="${EDGE_SPEC_JVM_CACHE:-$HOME/.cache/edge-spec/jvm}"
BUILD="$HERE/build"
KOTLIN_VERSION=2.4.20
KOTLIN_TGZ_SHA=c23dab400d7ce5ea8b6c909947c0ca5454189e4bb1108695b5f464500e5e950f
ORT_NPM=com.github.asus4.onnxruntime@0.4.9
ORT_TGZ_SHA=e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d
ORT_AAR_SHA=98cddbac92640b4a6af72a03c42e0491851f366d3da66bbaeb5dd66310946cf2
began=$(date +%s)
say() { echo "run_jvm_tests: $*" >&2; }
fail() { say "$*"; echo "0 passed, 1 failed"; exit 1; }
check_sha() { # file sha
    local got; got=$(sha256sum "$1" | cut -d' ' -f1)
    [ "$got" = "$2" ] || { rm -f "$1"; fail "SHA-256 mismatch for $1: got $got, want $2 (deleted; rerun to download again)"; }
}
mkdir -p "$CACHE" "$BUILD"

# 1. Kotlin compiler (JetBrains' complete compiler, from npm), ORT Android AAR (from npm).
fetch_npm() { # package tarball sha
    if [ ! -f "$CACHE/$2" ]; then
        say "downloading $1"
        (cd "$CACHE" && npm pack --silent "$1" >/dev/null) || fail "npm pack $1 failed"
    fi
    check_sha "$CACHE/$2" "$3"
}
fetch_npm "kotlin-compiler@$KOTLIN_VERSION" "kotlin-compiler-$KOTLIN_VERSION.tgz" "$KOTLIN_TGZ_SHA"
fetch_npm "$ORT_NPM" "com.github.asus4.onnxruntime-0.4.9.tgz" "$ORT_TGZ_SHA"
KOTLIN="$CACHE/kotlin-$KOTLIN_VERSION"
if [ ! -x "$KOTLIN/package/bin/kotlinc" ]; then
    rm -rf "$KOTLIN.tmp" && mkdir -p "$KOTLIN.tmp" && tar xzf "$CACHE/kotlin-compiler-$KOTLIN_VERSION.tgz" -C "$KOTLIN.tmp" && mv "$KOTLIN.tmp" "$KOTLIN"
fi
ORT="$CACHE/ort-aar-1.29.0"
if [ ! -f "$ORT/classes.jar" ]; then
    rm -rf "$ORT.tmp" && mkdir -p "$ORT.tmp"
    tar xzf "$CACHE/com.github.asus4.onnxruntime-0.4.9.tgz" -C "$ORT.tmp" package/Plugins/Android/onnxruntime.aar
    check_sha "$ORT.tmp/package/Plugins/Android/onnxruntime.aar" "$ORT_AAR_SHA"
    (cd "$ORT.tmp" && unzip -q -o package/Plugins/Android/onnxruntime.aar classes.jar jni/x86_64/libonnxruntime4j_jni.so)
    rm -rf "$ORT.tmp/package" && mv "$ORT.tmp" "$ORT"
fi

# 2. JUnit 5 and Android's org.json, from Debian (apt verifies package signatures).
JUNIT=/usr/share/java/junit-platform-console-standalone.jar
ANDROID_JSON=/usr/share/java/com.android.json.jar
if [ ! -f "$JUNIT" ] || [ ! -f "$ANDROID_JSON" ]; then
    say "installing junit5 libandroid-json-java"
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
    $SUDO apt-get install -y -q junit5 libandroid-json-java >/dev/null 2>&1 \
        || { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q junit5 libandroid-json-java >/dev/null; } \
        || fail "cannot install junit5 libandroid-json-java"
fi

# 3. Golden traces from the Python runtime, in the background while kotlinc runs.
command -v "$PYTHON" >/dev/null || fail "PYTHON=$PYTHON not found"
ORT_LINUX_LIB=$("$PYTHON" -c 'import glob, os, onnxruntime; print(sorted(glob.glob(os.path.join(os.path.dirname(onnxruntime.__file__), "capi", "libonnxruntime.so.1*")))[-1])') \
    || fail "$PYTHON has no onnxruntime wheel (its Linux libonnxruntime stands in for the AAR's Android one)"
rm -rf "$BUILD/traces" "$BUILD/traces.rc"
# The subshell inherits set -e: a failing write_traces.py must still leave its status behind
# (an early exit would leave no traces.rc, or, before this rm, a stale 0 from the last run).
(cd "$ROOT" && { "$PYTHON" "$HERE/tools/write_traces.py" "$BUILD/traces" > "$BUILD/traces.log" 2>&1 && echo 0 || echo $?; } > "$BUILD/traces.rc") &
TRACES_PID=$!

# 4. Test-only stand-ins that let the AAR's bionic-linked x86_64 JNI library load on glibc.
bash "$HERE/shims/build.sh" "$BUILD/native"
cp "$ORT/jni/x86_64/libonnxruntime4j_jni.so" "$BUILD/native/"

# 5. Compile the JVM-pure core, the client, the Flow API and the tests.
CP_LIBS="$ORT/classes.jar:$ANDROID_JSON:$KOTLIN/package/lib/kotlinx-coroutines-core-jvm.jar"
JUNIT_API=$(ls /usr/share/java/junit-jupiter-api.jar /usr/share/java/apiguardian-api.jar /usr/share/java/opentest4j.jar | paste -sd:)
# The Android layer (library + sample app) is type-checked in the same kotlinc run against our own
# android.* stubs (android/stubs, compile-only: never on the test classpath, never shipped).
rm -rf "$BUILD/stubs" "$BUILD/edgespec-tests.jar" && mkdir -p "$BUILD/stubs"
javac -nowarn -d "$BUILD/stubs" $(find "$HERE/android/stubs" -name '*.java') || fail "android stubs do not compile"
say "compiling Kotlin (core, client, Flow API, tests; Android library + sample type-checked against stubs)"
JAVA_OPTS="-Xss8m" bash "$KOTLIN/package/bin/kotlinc" -nowarn "$HERE/kotlin/src/main/kotlin" "$HERE/kotlin/src/test/kotlin" \
    "$HERE/android/edgespec/src/main/kotlin" "$HERE/android/sample/src/main/kotlin" \
    -cp "$CP_LIBS:$JUNIT_API:$BUILD/stubs" -d "$BUILD/edgespec-tests.jar" 2>&1 | grep -v '^warning' >&2 || true
[ -f "$BUILD/edgespec-tests.jar" ] || fail "kotlinc failed (Kotlin core, tests or the Android layer)"
compiled=$(date +%s)

wait "$TRACES_PID" || true
[ "$(cat "$BUILD/traces.rc" 2>/dev/null)" = 0 ] || { tail -30 "$BUILD/traces.log" >&2; fail "write_traces.py failed"; }
grep '^write_traces' "$BUILD/traces.log" >&2 || true

# 6. The Python server on loopback, with the tiny llama bundle, for the client tests.
SERVER_LOG="$BUILD/server.log"
(cd "$ROOT" && exec "$PYTHON" -m runtime serve "$BUILD/traces/tiny/llama" --host 127.0.0.1 --port 0 --gamma 3 > "$SERVER_LOG" 2>&1) &
SERVER_PID=$!
trap 'kill "$SERVER_PID" 2>/dev/null || true' EXIT
URL=""
for _ in $(seq 1 240); do
    URL=$(grep -o 'http://127.0.0.1:[0-9]*' "$SERVER_LOG" 2>/dev/null | head -1 || true)
    [ -n "$URL" ] && break
    kill -0 "$SERVER_PID" 2>/dev/null || break
    sleep 0.5
done
[ -n "$URL" ] || { cat "$SERVER_LOG" >&2; fail "the Python server did not start"; }
say "server at $URL"

# 7. JUnit. (kotlinc's jar has no directory entries, so package selection finds nothing: name the classes.)
SELECT=$(unzip -Z1 "$BUILD/edgespec-tests.jar" | grep -E '^dev/edgespec/[A-Za-z]+Test\.class$' | sed -e 's#/#.#g' -e 's#\.class$##' -e 's#^#--select-class #' | tr '\n' ' ')
[ -n "$SELECT" ] || fail "no test classes were compiled"
set +e
LD_LIBRARY_PATH="$BUILD/native" ORT_LINUX_LIB="$ORT_LINUX_LIB" java -Xmx3g -Xss8m \
    -Donnxruntime.native.path="$BUILD/native" -Dedgespec.traces="$BUILD/traces" -Dedgespec.server="$URL" \
    -Dedgespec.sources="$HERE/kotlin/src/main/kotlin" \
    -jar "$JUNIT" --disable-banner --disable-ansi-colors --details=tree \
    --class-path "$BUILD/edgespec-tests.jar:$CP_LIBS:$KOTLIN/package/lib/kotlin-stdlib.jar" \
    $SELECT > "$BUILD/junit.log" 2>&1
set -e
cat "$BUILD/junit.log" >&2
count() { grep -E "\[ *[0-9]+ tests $1" "$BUILD/junit.log" | grep -oE '[0-9]+' | head -1; }
passed=$(count successful); failed=$(count failed); aborted=$(count aborted); skipped=$(count skipped)
[ -n "$passed" ] || fail "JUnit printed no summary"
[ "$passed" -gt 0 ] || fail "JUnit ran no tests"
failed=$(( ${failed:-0} + ${aborted:-0} + ${skipped:-0} ))  # nothing may skip silently
# 8. The bundle-packaging command's tests (Python), on the tiny bundle the traces step built.
set +e
(cd "$ROOT" && EDGE_SPEC_TINY_BUNDLE="$BUILD/traces/tiny/llama" "$PYTHON" -m pytest -q -p no:cacheprovider "$HERE/tests") > "$BUILD/pytest.log" 2>&1
set -e
tail -15 "$BUILD/pytest.log" >&2
py_passed=$(grep -oE '[0-9]+ passed' "$BUILD/pytest.log" | tail -1 | grep -oE '[0-9]+' || true)
py_failed=$(grep -oE '[0-9]+ (failed|error|errors)' "$BUILD/pytest.log" | grep -oE '[0-9]+' | awk '{s+=$1} END {print s+0}' || true)
[ -n "$py_passed" ] || py_failed=$(( ${py_failed:-0} + 1 ))  # no pytest summary: count as a failure
passed=$(( passed + ${py_passed:-0} )); failed=$(( failed + ${py_failed:-0} ))
say "JUnit and package_bundle tests; compile $((compiled - began))s, total $(( $(date +%s) - began ))s"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
