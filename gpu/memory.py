"""Device buffers and the pinned host staging that the CPU hand-off goes through.

* Arrays: `zeros`, `upload`, `to_host`, `copy` (device↔device or host→device, any 2-D
  strides), `fill_zero`, `is_device`.
* Scratch: `scratch(key, shape)` is a device buffer reused by every call that asks for the same
  key and shape (temporaries inside one op: never held across ops).
* Staging: `handoff(x, out)` copies the device rows x into pinned host memory and hands
  (x_host, out_host) to a CPU kernel; on exit out_host goes up into `out`. Pinned memory makes
  both copies plain DMA (no bounce through a pageable buffer), and the buffers only grow, so
  steady-state decoding allocates nothing.

Everything runs on the default stream: each copy to or from the host returns once it is done,
so a CPU kernel never reads rows the GPU is still writing.
"""
from __future__ import annotations

import contextlib

import numpy as np
from numba import cuda

from .device import simulated

# Threads per block of the elementwise kernels (the simulator runs each as a Python thread).
THREADS = 32 if simulated() else 128


def is_device(a) -> bool:
    """True for a numba device array (weights placed on the GPU), False for a host ndarray."""
    return not isinstance(a, np.ndarray) and hasattr(a, "copy_to_host")


def zeros(shape, dtype=np.float32):
    a = cuda.device_array(shape, dtype)
    fill_zero(a)
    return a


def upload(host: np.ndarray):
    """A C-contiguous device copy of a host array. A strided stack (one half of a fused expert
    tensor) goes up slice by slice, so no host copy of the whole stack is made."""
    if host.flags.c_contiguous or host.ndim < 3:
        return cuda.to_device(np.ascontiguousarray(host))
    dev = cuda.device_array(host.shape, host.dtype)
    for i in range(host.shape[0]):
        dev[i].copy_to_device(np.ascontiguousarray(host[i]))
    return dev


def to_host(a) -> np.ndarray:
    """A fresh host ndarray with a's contents (host arrays are returned as they are)."""
    return a if isinstance(a, np.ndarray) else a.copy_to_host()


@cuda.jit(cache=True)
def _fill_zero_kernel(flat):
    i = cuda.grid(1)
    if i < flat.shape[0]:
        flat[i] = 0


def fill_zero(a) -> None:
    if a.size:
        flat = a.reshape(a.size)
        _fill_zero_kernel[-(-a.size // THREADS), THREADS](flat)


@cuda.jit(cache=True)
def _copy_2d_kernel(dst, src):
    k = cuda.grid(1)
    cols = dst.shape[1]
    if k < dst.shape[0] * cols:
        r = k // cols
        dst[r, k - r * cols] = src[r, k - r * cols]


def copy(dst, src) -> None:
    """dst[...] = src for a device dst; src on the device or the host, same shape.

    Contiguous pairs are one memcpy; strided 2-D views (a column block, a KV prefix row) one
    small kernel; higher ranks go slice by slice along the first axis."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy: shapes differ: {dst.shape} vs {src.shape}")
    if dst.size == 0:
        return
    if isinstance(src, np.ndarray) and not src.flags.c_contiguous:
        src = np.ascontiguousarray(src)
    if _contiguous(dst) and _contiguous(src):
        dst.copy_to_device(src)
    elif isinstance(src, np.ndarray):
        copy(dst, upload(src))
    elif dst.ndim == 2:
        _copy_2d_kernel[-(-dst.size // THREADS), THREADS](dst, src)
    else:
        for i in range(dst.shape[0]):
            copy(dst[i], src[i])


def _contiguous(a) -> bool:
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_c_contiguous()


# --- reusable buffers ---------------------------------------------------------------------------

_scratch: dict[tuple, object] = {}


def scratch(key: str, shape: tuple[int, ...], dtype=np.float32):
    """A device buffer for `key` and this shape, allocated once (contents undefined)."""
    k = (key, tuple(shape), np.dtype(dtype).str)
    buf = _scratch.get(k)
    if buf is None:
        buf = _scratch[k] = cuda.device_array(shape, dtype)
    return buf


class _Pinned:
    """A growable pinned host buffer; `view(shape)` is a C-contiguous float32 view of its start."""

    def __init__(self):
        self.flat = np.empty(0, np.float32)

    def view(self, shape: tuple[int, ...]) -> np.ndarray:
        size = int(np.prod(shape))
        if size > self.flat.size:
            # the simulator has no page-locked memory; a plain array behaves the same there
            self.flat = np.empty(size, np.float32) if simulated() else cuda.pinned_array(size, np.float32)
        return self.flat[:size].reshape(shape)


_staging = {"in": _Pinned(), "out": _Pinned(), "ffn_hidden": _Pinned()}


def host_buffer(key: str, shape: tuple[int, ...]) -> np.ndarray:
    """Pinned float32 host scratch ("in" and "out" are `handoff`'s; "ffn_hidden" is free)."""
    return _staging[key].view(shape)


@contextlib.contextmanager
def handoff(x, out):
    """Run a CPU kernel on device rows: yields (x_host, out_host) in pinned memory; on a clean
    exit out_host is copied into the device array `out`."""
    x_host = _staging["in"].view(tuple(x.shape))
    out_host = _staging["out"].view(tuple(out.shape))
    x.copy_to_host(x_host)
    yield x_host, out_host
    out.copy_to_device(out_host)
