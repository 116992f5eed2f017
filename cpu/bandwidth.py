"""Measure the CPU's memory read bandwidth the way the kernels see it: a Numba parallel sum.

This is the roofline the matvec kernels are judged against (bench-kernels reports each result
as a fraction of it), so it uses the same thread pool and the same kind of streaming read.
"""
from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange


@njit(cache=True, nogil=True, fastmath=True)
def _sum_chunk(a):
    s = np.float32(0.0)
    for i in range(a.shape[0]):
        s += a[i]
    return s


@njit(cache=True, nogil=True, parallel=True)
def _parallel_sum(a, n_chunks):
    per = -(-a.shape[0] // n_chunks)
    partial = np.zeros(n_chunks, np.float32)
    for c in prange(n_chunks):
        partial[c] = _sum_chunk(a[c * per:min(a.shape[0], (c + 1) * per)])
    return partial.sum()


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Median read bandwidth in GB/s (1e9 bytes/s) over `repeats` sums of an n_bytes buffer,
    with Numba's current thread count. The buffer should be far larger than the last-level cache."""
    a = np.ones(n_bytes // 4, np.float32)   # written once, so every page is really backed
    n_chunks = 4 * numba.get_num_threads()
    _parallel_sum(a[: 1 << 16], n_chunks)   # compile / warm the pool outside the timing
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _parallel_sum(a, n_chunks)
        times.append(time.perf_counter() - t0)
    return a.nbytes / float(np.median(times)) / 1e9
