#!/usr/bin/env bash
# Install the peer servers of benchmarks/serving_vs_peers.py outside the project venv.
#
#   bash benchmarks/peers/install.sh                     # both (~40-60 min on 2 cores: two llama.cpp compiles)
#   bash benchmarks/peers/install.sh llama-server        # only llama.cpp's llama-server (the peer)
#   bash benchmarks/peers/install.sh llama-cpp-python    # only llama-cpp-python's server (the extra)
#
# * llama-cpp-python's sdist, downloaded and extracted under $EPD_PEERS_SRC (default
#   /work/peers-src): its vendor/llama.cpp is the llama.cpp source both servers are built from,
#   and the benchmark runs its convert_hf_to_gguf.py (with its own gguf-py) to convert epd's
#   SmolLM2 safetensors to f16 / bf16 / q8_0 GGUF;
# * llama.cpp's own `llama-server` (the peer: continuous batching over --parallel slots), built
#   from that vendor/llama.cpp with cmake (Release, CPU only, -DGGML_NATIVE=ON, static, no
#   CURL / OpenSSL / web UI, only the llama-server target) into $EPD_LLAMA_SERVER_BUILD
#   (default $EPD_PEERS_SRC/llama-server-build); the binary is bin/llama-server there;
# * llama-cpp-python[server] into $EPD_PEERS_VENV (default /work/peers-venv), built from the
#   same sdist without the multimodal (mtmd/llava) library, which the text-only server never
#   loads (the serialising extra `llamacpp` of the benchmark: one request at a time);
# * sentencepiece into $EPD_PEERS_VENV/convert-extra (a --target directory, put on the
#   converter's PYTHONPATH only): the converter imports it even for a BPE tokenizer.
#
# Compile jobs: CMAKE_BUILD_PARALLEL_LEVEL (default 1) for both builds. Every step is
# skipped when what it makes is already there, so a rerun is cheap.
#
# transformers serve needs nothing here: its serving extras (fastapi, uvicorn, openai,
# pydantic, rich, accelerate) are already in the project venv. Nothing of the peers goes
# into pyproject.toml or the project venv.
set -euo pipefail

PART=${1:-all}
case "$PART" in
    all|llama-server|llama-cpp-python) ;;
    *) echo "usage: $0 [all|llama-server|llama-cpp-python]" >&2; exit 2 ;;
esac

VENV=${EPD_PEERS_VENV:-/work/peers-venv}
SRC=${EPD_PEERS_SRC:-/work/peers-src}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
BUILD=${EPD_LLAMA_SERVER_BUILD:-$SRC/llama-server-build}
PY=${PYTHON:-python3}
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --upgrade pip
fi

mkdir -p "$SRC"
sdist="$SRC/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    "$VENV/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
fi
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
    tar -xzf "$sdist" -C "$SRC"
fi
LLAMA_SRC="$SRC/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [ "$PART" != llama-server ] && ! "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null; then
    CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" "$VENV/bin/pip" install "$sdist[server]"
fi

server="$BUILD/bin/llama-server"
if [ "$PART" != llama-cpp-python ] && [ ! -x "$server" ]; then
    # the sdist has no .git: name the llama.cpp commit its CHANGELOG says it vendors, so that
    # `llama-server --version` reports it instead of "unknown"
    commit=$(grep -m1 -o 'ggml-org/llama.cpp@[0-9a-f]*' "$SRC/llama_cpp_python-$VERSION/CHANGELOG.md" \
             | cut -d@ -f2 || true)
    cmake -S "$LLAMA_SRC" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DLLAMA_OPENSSL=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_COMMIT="${commit:-unknown}"
    cmake --build "$BUILD" --config Release --target llama-server
fi

if [ ! -d "$VENV/convert-extra/sentencepiece" ]; then
    "$VENV/bin/pip" install -q --no-deps --target "$VENV/convert-extra" sentencepiece
fi

if [ "$PART" != llama-server ]; then
    "$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
fi
if [ "$PART" != llama-cpp-python ]; then
    echo "llama-server: $server ($("$server" --version 2>&1 | grep -m1 '^version' || echo 'version unknown'))"
fi
