#!/usr/bin/env bash
# Builds the test-only stand-in libraries into $1 (see the *.c headers).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"; out="$1"; mkdir -p "$out"
cc="${CC:-gcc}"
"$cc" -shared -fPIC -O2 -fno-builtin -fno-stack-protector -Wl,--version-script="$here/libc.map" -Wl,-soname,libc.so -o "$out/libc.so" "$here/libc_shim.c" -ldl
"$cc" -shared -fPIC -O2 -Wl,--version-script="$here/libc.map" -Wl,-soname,libdl.so -o "$out/libdl.so" "$here/libdl_shim.c" -ldl
"$cc" -shared -fPIC -O2 -Wl,--version-script="$here/libc.map" -Wl,-soname,libm.so -o "$out/libm.so" "$here/libm_shim.c"
"$cc" -shared -fPIC -O2 -Wl,--version-script="$here/ort.map" -Wl,-soname,libonnxruntime.so -o "$out/libonnxruntime.so" "$here/libort_shim.c" -ldl
