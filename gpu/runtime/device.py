"""Is there a CUDA GPU? Answered without importing `numba.cuda`.

`numba.cuda` decides once, at its first import, whether it is the real CUDA target or the
simulator (`NUMBA_ENABLE_CUDASIM=1`). So the probe here talks to the driver library directly
through ctypes: the test suite must know the answer before anything imports `numba.cuda`, and
`import gpu` must work on a machine with no GPU, no driver and no CUDA toolkit.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

from cpu.errors import HybridError

_DRIVER_NAMES = ("nvcuda.dll",) if sys.platform == "win32" else ("libcuda.so.1", "libcuda.so")


def simulated() -> bool:
    """True when numba.cuda runs (or will run) as the pure-Python CUDA simulator."""
    try:
        return int(os.environ.get("NUMBA_ENABLE_CUDASIM", "0")) != 0
    except ValueError:
        return False


@functools.cache
def available() -> bool:
    """True when a real CUDA GPU can run kernels: the driver loads and reports a device.

    The simulator does not count: it is a test tool, far too slow to serve a model.
    """
    for name in _DRIVER_NAMES:
        try:
            driver = ctypes.CDLL(name)
        except OSError:
            continue
        if driver.cuInit(0) != 0:
            return False
        count = ctypes.c_int(0)
        return driver.cuDeviceGetCount(ctypes.byref(count)) == 0 and count.value > 0
    return False


def require_cuda():
    """The `numba.cuda` module, ready to launch kernels; a clear error when there is no GPU."""
    if not (available() or simulated()):
        raise HybridError(
            "no CUDA GPU found: the GPU kernels need an NVIDIA GPU with a working driver "
            "(libcuda). Run on the CPU instead (device='cpu')."
        )
    # numba.cuda only once a GPU (or the simulator) is known: importing it picks its mode
    from numba import cuda

    return cuda
