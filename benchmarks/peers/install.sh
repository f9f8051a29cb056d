#!/usr/bin/env bash
# Install the peer servers of benchmarks/serving_vs_peers.py outside the project venv.
#
#   bash benchmarks/peers/install.sh        # ~25-40 min on 2 cores (llama.cpp compiles from source)
#
# * llama-cpp-python[server] into $EPD_PEERS_VENV (default /work/peers-venv), built from its
#   sdist with one compile job (CMAKE_BUILD_PARALLEL_LEVEL=1) and without the multimodal
#   (mtmd/llava) library, which the text-only server never loads;
# * the same sdist, extracted under $EPD_PEERS_SRC (default /work/peers-src): the benchmark
#   runs its vendor/llama.cpp/convert_hf_to_gguf.py (with its own gguf-py) to convert epd's
#   SmolLM2 safetensors to f16 / bf16 GGUF;
# * sentencepiece into $EPD_PEERS_VENV/convert-extra (a --target directory, put on the
#   converter's PYTHONPATH only): the converter imports it even for a BPE tokenizer.
#
# transformers serve needs nothing here: its serving extras (fastapi, uvicorn, openai,
# pydantic, rich, accelerate) are already in the project venv. Nothing of the peers goes
# into pyproject.toml or the project venv.
set -euo pipefail

VENV=${EPD_PEERS_VENV:-/work/peers-venv}
SRC=${EPD_PEERS_SRC:-/work/peers-src}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PY=${PYTHON:-python3}

if [ ! -x "$VENV/bin/python" ]; then
    "$PY" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip

mkdir -p "$SRC"
sdist="$SRC/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$sdist" ]; then
    "$VENV/bin/pip" download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC"
fi
if [ ! -d "$SRC/llama_cpp_python-$VERSION" ]; then
    tar -xzf "$sdist" -C "$SRC"
fi

if ! "$VENV/bin/python" -c "import llama_cpp, llama_cpp.server" 2>/dev/null; then
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-1} CMAKE_ARGS="${CMAKE_ARGS:--DLLAVA_BUILD=OFF}" \
        "$VENV/bin/pip" install "$sdist[server]"
fi

"$VENV/bin/pip" install -q --no-deps --target "$VENV/convert-extra" sentencepiece

"$VENV/bin/python" -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__, 'in', '$VENV')"
