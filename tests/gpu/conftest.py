"""GPU tests run on the real GPU when there is one, else on Numba's CUDA simulator.

numba.cuda picks real-or-simulator once, at its first import, from NUMBA_ENABLE_CUDASIM
(`import numba` alone does not import numba.cuda). pytest loads this file when it collects
tests/gpu, before any module here imports numba.cuda, so setting the variable now is in time
unless something collected earlier already imported numba.cuda; then every GPU test fails with
the reason (run `NUMBA_ENABLE_CUDASIM=1 pytest tests/gpu` or move that import). The variable
stays set for the whole session: numba re-reads its config while compiling.
"""
import os
import sys

import pytest

from gpu.device import available, simulated

if not available() and not simulated():
    _TOO_LATE = "numba.cuda" in sys.modules
    if not _TOO_LATE:
        os.environ["NUMBA_ENABLE_CUDASIM"] = "1"
else:
    _TOO_LATE = False


@pytest.fixture(autouse=True)
def _cuda_mode_is_usable():
    if _TOO_LATE:
        pytest.fail("no GPU, and numba.cuda was imported before tests/gpu/conftest.py could "
                    "switch on the CUDA simulator; run: NUMBA_ENABLE_CUDASIM=1 pytest tests/gpu")


@pytest.fixture(scope="session")
def on_real_gpu() -> bool:
    return available() and not simulated()
