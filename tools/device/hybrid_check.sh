#!/usr/bin/env bash
# On the GPU machine: the GPU tests on the real device, greedy decode of the bundled model on the
# CPU and hybrid paths (drafting on/off), then the 27B benchmark (CPU-only and hybrid rows).
#   bash tools/device/hybrid_check.sh [bench_27b.py arguments]      (carry .whl/)
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "== GPU tests"; python3 -m pytest tests/gpu -q -x -p no:cacheprovider 2>&1 | tail -4
echo "== decode modes (bundled model)"; python3 tools/device/decode_modes.py
echo "== 27B"; bash tools/device/bench_27b.sh "$@"
