"""Numba CUDA kernels, same op names as `cpu/`. Importing needs no GPU."""
