"""Every GPU kernel compiles to PTX for sm_90 (catches typing errors the simulator cannot see).

Runs tools/gpu_ptx_check.py in a subprocess: this pytest process may be using the CUDA
simulator, whose numba.cuda cannot compile. Skips, with the reason, when NVIDIA's compiler
libraries are not installed (`pip install "numba-cuda[cu13]"`). Where no GPU is present (CI, two
cores) it compiles the tool's representative subset (every kernel source, not every
specialisation: docs/MEASUREMENTS.md has the times); a GPU machine compiles them all.
"""
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MISSING_LIBRARY = 3


def test_every_kernel_compiles_to_ptx_for_sm90(on_real_gpu):
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_ENABLE_CUDASIM"}
    choice = [] if on_real_gpu else ["--representative"]
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_ptx_check.py"), *choice],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode == MISSING_LIBRARY:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout + proc.stderr
