#!/usr/bin/env python3
"""Run `hybrid bench-kernels` without installing the package (e.g. on the GPU test machine):

    PYTHONPATH=$PWD python3 tools/bench_kernels.py [--quick] [--json] [--threads N] [--types Q4_K,Q8_0]
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.errors import HybridError  # noqa: E402
from hybrid.kernel_bench import run_command  # noqa: E402

if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true", dest="as_json")
    p.add_argument("--threads", "-t", type=int)
    p.add_argument("--types", action="append")
    a = p.parse_args()
    try:
        run_command(quick=a.quick, as_json=a.as_json, threads=a.threads, types=a.types)
    except HybridError as e:
        sys.exit(f"error: {e}")
