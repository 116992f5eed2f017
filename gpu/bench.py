"""GPU memory bandwidth and matvec throughput, timed on the device with CUDA events.

Timing trick: a one-thread kernel first sleeps for a few milliseconds on the stream while Python
enqueues the start event, the timed launches and the end event behind it. The events then measure
back-to-back kernels only, not Python's ~20-100 us per launch (which the decode loop must hide or
fuse separately). A result is flagged when enqueueing outlasted the sleep.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from numba import cuda, uint32

from hybrid import ggml_types as gt

from .intrinsics import load_u32x4
from .matvec import MAX_ROWS_X_SLOTS, default_rows_per_warp, kernel, matvec

SPIN_NS = 1000


@cuda.jit
def spin(iterations):
    """Hold the stream for about `iterations` microseconds."""
    if cuda.grid(1) == 0:
        for _ in range(iterations):
            cuda.nanosleep(uint32(SPIN_NS))


@cuda.jit
def read_all(words, sink):
    """Read every 16-byte row of `words` (n, 4) once; write nothing unless an impossible XOR
    turns up (keeps the loads alive without write traffic)."""
    acc = uint32(0)
    i = cuda.grid(1)
    while i < words.shape[0]:
        a, b, c, d = load_u32x4(words, i, 0)
        acc ^= a ^ b ^ c ^ d
        i += cuda.gridsize(1)
    if acc == uint32(0x9E3779B9):
        sink[0] = acc


@cuda.jit
def copy_all(src, dst):
    """dst = src for (n, 4) uint32 arrays, 16 bytes per load."""
    i = cuda.grid(1)
    while i < src.shape[0]:
        a, b, c, d = load_u32x4(src, i, 0)
        dst[i, 0] = a
        dst[i, 1] = b
        dst[i, 2] = c
        dst[i, 3] = d
        i += cuda.gridsize(1)


@cuda.jit
def fill_pseudo_random(flat_bytes, seed):
    """Cheap hash bytes: quants and scales of every value (fp16 fields may be NaN: timing only)."""
    i = cuda.grid(1)
    while i < flat_bytes.shape[0]:
        h = uint32(i) * uint32(0x9E3779B1) ^ uint32(seed)
        h ^= h >> uint32(15)
        h *= uint32(0x85EBCA77)
        flat_bytes[i] = h >> uint32(24)
        i += cuda.gridsize(1)


def _grid() -> tuple[int, int]:
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return sms * 8, 256


@dataclass
class Timing:
    seconds: float    # device time per launch
    flagged: bool     # enqueueing took longer than the spin: seconds may include idle time


def time_launches(launch, repeats: int = 20, spin_us: int = 5000) -> Timing:
    """Device seconds per call of `launch()` (which enqueues work on the default stream)."""
    launch()  # compile and warm up
    cuda.synchronize()
    for _ in range(3):
        spun, start, end = cuda.event(), cuda.event(), cuda.event()
        spun.record()
        spin[1, 32](spin_us)
        start.record()
        t0 = time.perf_counter()
        for _ in range(repeats):
            launch()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        flagged = enqueue_ms > spun.elapsed_time(start)
        if not flagged:
            break
        spin_us *= 4  # the sleep was shorter than Python's enqueueing: hold the stream longer
    return Timing(start.elapsed_time(end) / 1e3 / repeats, flagged)


def ptx_targets():
    """(name, python function, argument types) of the benchmark kernels, for the PTX check."""
    from numba import types
    u32x4 = types.Array(types.uint32, 2, "C")
    yield "bench spin", spin.py_func, (types.int64,)
    yield "bench read_all", read_all.py_func, (u32x4, types.Array(types.uint32, 1, "C"))
    yield "bench copy_all", copy_all.py_func, (u32x4, u32x4)
    yield "bench fill_pseudo_random", fill_pseudo_random.py_func, (types.Array(types.uint8, 1, "C"), types.int64)


def memory_bandwidth(nbytes: int = 2 << 30) -> dict[str, float]:
    """GB/s of a pure read and of a copy (bytes read + written) over `nbytes` of device memory."""
    words = cuda.device_array((nbytes // 16, 4), np.uint32)
    other = cuda.device_array_like(words)
    sink = cuda.device_array(1, np.uint32)
    grid, block = _grid()
    fill_pseudo_random[grid, block](words.reshape(-1).view(np.uint8), 1)
    read = time_launches(lambda: read_all[grid, block](words, sink), repeats=10)
    copy = time_launches(lambda: copy_all[grid, block](words, other), repeats=10)
    return {"read": nbytes / read.seconds / 1e9, "copy": 2 * nbytes / copy.seconds / 1e9}


def random_weights(t: gt.GGMLType, rows: int, cols: int, seed: int = 1):
    """(rows, row_bytes) uint8 device array of hash bytes, made on the device."""
    row_bytes = t.row_bytes(cols)
    flat = cuda.device_array(rows * row_bytes, np.uint8)
    grid, block = _grid()
    fill_pseudo_random[grid, block](flat, seed)
    return flat.reshape(rows, row_bytes)


@dataclass
class MatvecResult:
    type: str
    rows: int
    cols: int
    n: int
    requested: int | None  # rows per warp asked for (None: the default choice)
    rows_per_warp: int      # rows per warp used
    gbps: float
    flagged: bool
    registers: int          # per thread, of the kernel that ran


def bench_matvec(t: gt.GGMLType, rows: int, cols: int, slots=(1, 2, 4, 8),
                 rows_per_warp=(None,)) -> list[MatvecResult]:
    """Weight bytes streamed per second for each slot count (and rows-per-warp choice)."""
    w = random_weights(t, rows, cols)
    nbytes = w.shape[0] * w.shape[1]
    rng = np.random.default_rng(0)
    results = []
    for n in slots:
        x = cuda.to_device(rng.standard_normal((n, cols)).astype(np.float32))
        out = cuda.device_array((n, rows), np.float32)
        for r in rows_per_warp:
            if r is not None and r * n > MAX_ROWS_X_SLOTS:
                continue
            timing = time_launches(lambda: matvec(t.id, w, x, out, rows_per_warp=r))
            used = r or default_rows_per_warp(n, rows)
            regs = max(kernel(t.id, n, used).get_regs_per_thread().values())
            results.append(MatvecResult(t.name, rows, cols, n, r, used,
                                        nbytes / timing.seconds / 1e9, timing.flagged, regs))
    return results
