"""Numba CPU kernels. `gpu/` provides the same ops under the same names."""
from . import kernel_cache

# before any kernel module is decorated: Numba picks a kernel's cache directory when it is defined
kernel_cache.use()
