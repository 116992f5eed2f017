"""Numba CUDA kernels, same op names as `cpu/`. Importing needs no GPU."""
import cpu  # noqa: F401  (first: it points Numba's disk cache at this source version, cpu/kernel_cache.py)

from .runtime.device import available, require_cuda, simulated

__all__ = ["available", "require_cuda", "simulated"]
