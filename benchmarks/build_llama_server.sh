#!/usr/bin/env bash
# Builds llama.cpp's llama-server from llama-cpp-python 0.3.36's source distribution (its
# vendor/llama.cpp), the same llama.cpp that benchmarks/decode.py measures, for
# benchmarks/serve.py (make bench-serve). Never part of make test: it compiles for ~10 minutes
# on 2 cores.
#
#   benchmarks/build_llama_server.sh [BUILD_DIR] [PYTHON]
#
# BUILD_DIR (default build/llama-server) receives the sdist, its unpacked source and the cmake
# build; the binary ends up at BUILD_DIR/llama.cpp/build/bin/llama-server, and its path is
# printed last. Flags: -DLLAMA_CURL=OFF (no libcurl needed) and the ISA options of
# benchmarks/llama_cpp_cmake_args.py (GGML_NATIVE=OFF, never the AMX kernels). JOBS sets the
# parallel build jobs (default 2).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BUILD_DIR="${1:-build/llama-server}"
PY="${2:-python3}"
JOBS="${JOBS:-2}"
VERSION=0.3.36
mkdir -p "$BUILD_DIR"
BUILD_DIR="$(cd "$BUILD_DIR" && pwd)"
SRC="$BUILD_DIR/llama.cpp"
BIN="$SRC/build/bin/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
if [ ! -d "$SRC" ]; then
    SDIST="$BUILD_DIR/llama_cpp_python-$VERSION.tar.gz"
    if [ ! -f "$SDIST" ]; then
        "$PY" -m pip download --no-binary :all: --no-deps \
            -d "$BUILD_DIR" "llama-cpp-python==$VERSION" >&2
    fi
    tar -xzf "$SDIST" -C "$BUILD_DIR"
    mv "$BUILD_DIR/llama_cpp_python-$VERSION/vendor/llama.cpp" "$SRC"
    rm -rf "$BUILD_DIR/llama_cpp_python-$VERSION"
fi
# shellcheck disable=SC2046  # the ISA options are one word each
cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    $("$PY" "$HERE/llama_cpp_cmake_args.py") >&2
cmake --build "$SRC/build" --target llama-server -j"$JOBS" >&2
echo "$BIN"
