#!/usr/bin/env bash
# The comparison runtimes, built here the way BENCHMARKS.md says, under $ANCHORS
# (default ~/.cache/edge-spec/anchors):
#   llama.cpp      the copy vendored in the llama-cpp-python sdist (PyPI), CMake Release,
#                  native CPU flags; tools llama-completion, llama-speculative-simple, llama-bench
#   genai-venv/    onnxruntime-genai 0.18.0 in its own environment (its builder needs
#                  transformers 5.x and torch; its onnxruntime must not meet ours)
#   hf/qwen-*      the official Q4_K_M GGUFs dequantized to Hugging Face folders (builder input)
#   genai/qwen-*   onnxruntime-genai's builder: int4, CPU
#   genai/spec-*   the 1.5B folder with a "draft" section naming the 0.5B (draft-model mode)
# Needs: cmake, a C++ compiler, python3.11+, the GGUFs in $EDGE_SPEC_MODELS, and this repo's
# environment (for the GGUF -> HF conversion: transformers + gguf). Takes ~30 min on 2 cores.
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
ANCHORS="${ANCHORS:-$HOME/.cache/edge-spec/anchors}"
MODELS="${EDGE_SPEC_MODELS:-$HOME/.cache/edge-spec/models}"
PY="${PYTHON:-python}"
LLAMA_CPP_PYTHON=0.3.36
mkdir -p "$ANCHORS" && cd "$ANCHORS"

if [ ! -x llama.cpp/build/bin/llama-speculative-simple ]; then
    "$PY" -m pip download --no-binary :all: --no-deps "llama-cpp-python==$LLAMA_CPP_PYTHON" -d .
    tar xzf "llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz"
    rm -rf llama.cpp && mv "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp" llama.cpp
    cmake -S llama.cpp -B llama.cpp/build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF
    cmake --build llama.cpp/build -j"$(nproc)" --target llama-completion llama-speculative-simple llama-bench
fi

if [ ! -x genai-venv/bin/python ]; then
    python3 -m venv genai-venv
    genai-venv/bin/pip install -q --upgrade pip
    genai-venv/bin/pip install -q onnxruntime-genai==0.18.0 torch==2.13.0 transformers==5.24.0 onnx==1.23.2 onnx-ir==1.1.0 gguf numpy
fi

for size in 0.5b 1.5b; do
    [ -f "hf/qwen-$size/config.json" ] || "$PY" "$HERE/gguf_to_hf.py" "$MODELS/qwen2.5-coder-$size-instruct-q4_k_m.gguf" "hf/qwen-$size"
    [ -f "genai/qwen-$size/genai_config.json" ] || genai-venv/bin/python -m onnxruntime_genai.models.builder \
        -i "hf/qwen-$size" -o "genai/qwen-$size" -p int4 -e cpu -c "genai/cache-$size"
done
genai-venv/bin/python "$HERE/genai_worker.py" --make-spec genai/qwen-1.5b genai/qwen-0.5b genai/spec-1.5b-0.5b
echo "anchors ready in $ANCHORS"
