import os
import pathlib

# Before numpy loads: multi-threaded BLAS is ~30x slower than one thread on the small
# products of the reference forwards, and it fights Numba's threads for the cores.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

# numba.cuda chooses real GPU or simulator once, at its first import, from this variable; any
# test module (CPU ones too, through hybrid.forward's backends) may be the first to import it,
# so the choice is made here, before collection starts.
from gpu import available as _gpu_available, simulated as _gpu_simulated  # noqa: E402

if not _gpu_available() and not _gpu_simulated():
    os.environ["NUMBA_ENABLE_CUDASIM"] = "1"

import sys  # noqa: E402
import threading  # noqa: E402

import traceback  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402


def _share_simulated_shared_arrays() -> None:
    """numba-cuda 0.30's simulated `cuda.shared.array` races: two threads of a launch's first
    block can both allocate a "shared" array and then not share it, so rows of block 0 come out
    wrong (seen in CI: tests/gpu/test_matvec.py's F32 case, rows 0-3 of a 5-row launch, once in
    three runs). Allocate under a lock, one array per source line, as the real GPU shares: for
    every test, not only those that also speed the simulator up (tests/gpu/test_ops.py)."""
    from numba.core import types
    from numba.cuda.simulator.kernelapi import FakeCUDAShared
    from numba.np import numpy_support
    original, lock = FakeCUDAShared.array, threading.Lock()

    def shared_array(self, shape, dtype, alignment=None):
        if shape == 0 or alignment is not None:
            return original(self, shape, dtype, alignment)
        if isinstance(dtype, types.Type):
            dtype = numpy_support.as_dtype(dtype)
        caller = traceback.extract_stack(sys._getframe(1), limit=1)[0][0:2]   # one array per source line
        with lock:
            array = self._allocations.get(caller)
            if array is None:
                array = self._allocations[caller] = np.empty(shape, dtype)
        return array
    FakeCUDAShared.array = shared_array


if _gpu_simulated():
    _share_simulated_shared_arrays()

@pytest.fixture(autouse=True)
def _own_cache_folder(tmp_path_factory, monkeypatch):
    """What `--draft auto` learnt is kept in the user's cache folder (hybrid/draft_memory.py): each
    test, and every process it starts, learns in a folder of its own, so a record left by one
    test (a CLI run in a subprocess) never sets where another starts, nor do the user's. (The
    kernels stay put: importing gpu above pointed NUMBA_CACHE_DIR at them, cpu/kernel_cache.py.)"""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))


ROOT = pathlib.Path(__file__).resolve().parent.parent
BUNDLED_MODEL = ROOT / "hybrid" / "data" / "tiny-qwen35-mtp-Q4_K_M.gguf"


@pytest.fixture(scope="session")
def trained_model_q8(tmp_path_factory) -> pathlib.Path:
    """The bundled trained model as uniform Q8_0, made here (tests/requantize.py) so a plain clone
    runs the tests that need it instead of skipping them."""
    from tests.requantize import requantize
    return requantize(BUNDLED_MODEL, tmp_path_factory.mktemp("models") / "tiny-qwen35-mtp-Q8_0.gguf")


@pytest.fixture(scope="session")
def trained_model_q4km() -> pathlib.Path:
    return BUNDLED_MODEL


def pytest_sessionfinish(session, exitstatus):
    """A run that executed no test, or skipped every test, must not look green."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or exitstatus != 0:
        return
    passed = len(reporter.stats.get("passed", []))
    if passed == 0:
        session.exitstatus = 1
