#!/usr/bin/env bash
# hybrid vs llama.cpp on the GPU machine (tools/device/vs_llama_cpp.py; its docstring says what runs).
#   bash tools/device/vs_llama_cpp.sh build [--ik]           # ~7 min: llama-bench (CUDA) + the models
#   bash tools/device/vs_llama_cpp.sh bench [--rows 27b-12g,verify] [--reps 2] [--json $OUT/vs_llama_cpp.json]
# The environment only: the wheels (numpy<2.5 for numba-cuda, gguf) must already be installed in
# $SITE (default /tmp/site), and .bench/ carried (build_llama_cuda.sh and the two source tarballs).
set -euo pipefail
cd "$(dirname "$0")/../.."
SITE=${SITE:-/tmp/site}
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache} PYTHONUNBUFFERED=1
exec python3 tools/device/vs_llama_cpp.py "$@"
