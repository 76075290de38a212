#!/bin/sh
# build.sh: builds llama.cpp's llama-bench, llama-batched-bench and llama-quantize
# from the source that the npm package node-llama-cpp ships as a git bundle
# (no GitHub needed), with the CPU's own instructions (-DGGML_NATIVE=ON).
#
# Needs: the package tarball (npm pack node-llama-cpp@3.22.1, default
# /tmp/nlc/node-llama-cpp-3.22.1.tgz), git, cmake, g++ (apt-get install -y cmake g++).
# Produces: $LLAMA/build/bin/{llama-bench,llama-batched-bench,llama-quantize}.
# Takes both cores of a 2-core machine for ~15 minutes.
set -eu
TGZ=${TGZ:-/tmp/nlc/node-llama-cpp-3.22.1.tgz}
LLAMA=${LLAMA:-/tmp/llama.cpp}
JOBS=${JOBS:-2}

if [ ! -d "$LLAMA" ]; then
	work=$(mktemp -d)
	tar xzf "$TGZ" -C "$work"
	cat "$work/package/llama/llama.cpp.info.json"
	git clone -q "$work/package/llama/gitRelease.bundle" "$LLAMA"
	rm -rf "$work"
fi
git -C "$LLAMA" log -1 --format='llama.cpp %H %ad'

cd "$LLAMA"
cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$JOBS" --target llama-bench llama-batched-bench llama-quantize
ls -l build/bin/llama-bench build/bin/llama-batched-bench build/bin/llama-quantize
