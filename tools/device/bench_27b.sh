#!/usr/bin/env bash
# The 27B-shape decode benchmark, for the GPU test machine (../../docs, DEVICE.md):
#   bash tools/device/bench_27b.sh [--vram 12GiB] [--n-gen 8] [--reps 2] [--json $OUT/bench_27b.json]
# 1. installs the pinned wheels in .whl/ (numpy < 2.5 for numba-cuda, gguf) into a private folder;
# 2. writes a 27B-shape qwen35 Q4_K_M synthetic model on the machine's local disk (~16 GB:
#    generated there, never carried back; kept between runs at $MODEL);
# 3. runs tools/device/bench_27b.py: CPU bandwidth, `hybrid info --plan --vram`, CPU-only plain,
#    verify-step and drafting decode, the hybrid (GPU) rows when that backend exists, one table.
# Extra arguments go to bench_27b.py.
set -euo pipefail
cd "$(dirname "$0")/../.."

SITE=${SITE:-/tmp/site}
MODEL=${MODEL:-/tmp/m27b.gguf}
export NUMBA_CACHE_DIR=${NUMBA_CACHE_DIR:-/tmp/numba-cache}

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl
else
    echo "note: no .whl/ wheels here; using the machine's own numpy and gguf" >&2
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"

echo "== $(nproc) CPUs, $(python3 -c 'import numpy, numba; print("numpy", numpy.__version__, "numba", numba.__version__)')"
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"

if [ ! -s "$MODEL" ]; then
    echo "== writing $MODEL (27B shape, Q4_K_M, random codes)"
    time python3 tools/make_model.py "$MODEL" --preset 27b --arch qwen35 --type Q4_K_M --method codes --force
fi
ls -l "$MODEL"

echo "== benchmark"
python3 tools/device/bench_27b.py "$MODEL" "$@"
