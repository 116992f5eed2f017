"""Numba CPU kernels. `gpu/` provides the same ops under the same names."""
