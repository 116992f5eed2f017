"""GPU tests run on the real GPU when there is one, else on Numba's CUDA simulator.

The choice is made in tests/conftest.py, before collection: numba.cuda reads
NUMBA_ENABLE_CUDASIM once, at its first import, and any test module may be the first.
"""
import pytest

from gpu import available, simulated


@pytest.fixture(scope="session")
def on_real_gpu() -> bool:
    return available() and not simulated()
