"""Numba CUDA kernels, same op names as `cpu/`. Importing needs no GPU."""
from .runtime.device import available, require_cuda, simulated

__all__ = ["available", "require_cuda", "simulated"]
