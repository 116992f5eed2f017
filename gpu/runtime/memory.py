"""Device buffers and the pinned host staging that the CPU hand-off goes through.

* Arrays: `zeros`, `upload`, `to_host`, `copy` (device↔device or host→device, any 2-D
  strides), `fill_zero`, `is_device`. Copies between host arrays and the device are direct
  driver calls (`copy_raw`): Numba's own cost tens of µs each.
* Scratch: `scratch(key, shape)` is a device buffer reused by every call that asks for the same
  key and shape (temporaries inside one op: never held across ops); shapes that differ in their
  first dimension share one allocation per power-of-two bucket of it.
* Staging: `host_call(inputs, outputs, fn, meanwhile)` copies device arrays into pinned host
  memory, runs a CPU function on them and sends its outputs back up. Pinned memory makes both
  copies plain DMA (no bounce through a pageable buffer), and the buffers only grow, so
  steady-state decoding allocates nothing. GPU work that does not depend on the CPU function
  (`meanwhile`) runs on the device while the host runs it. An input or output may instead be
  `mapped` host memory that kernels write and read in place: then it has no copy at all (in a
  captured step each copy is a graph node on a hand-off's critical path).

Everything of gpu/ runs in order on ONE stream (`stream()`): kernels and copies are queued
there, and the host waits for it (`synchronize`) only where it reads device data. The one
exception, `beside`, forks work onto a second stream and joins it back (a MoE layer's fetch of
experts over PCIe, which waits on the bus, beside its shared expert and expert products, which
use the SMs). One explicit stream, not the legacy default one, because CUDA can capture a
stream's work into a graph (gpu/runtime/graphs.py) and cannot capture the legacy default stream.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
from numba import cuda

from .device import simulated

# Threads per block of the elementwise kernels (the simulator runs each as a Python thread).
THREADS = 32 if simulated() else 128


_stream = None


def stream():
    """The stream every kernel launch and copy of gpu/ goes to (created on first use)."""
    global _stream
    if _stream is None:
        _stream = cuda.stream()
    return _stream


def synchronize() -> None:
    """Wait until everything queued on the stream has run."""
    stream().synchronize()


def _event():
    """An event for ordering only (no timestamps: cheaper to record)."""
    return cuda.event() if simulated() else cuda.event(timing=False)   # the simulator's takes no flag


_marker = None


def mark():
    """An event recorded on the stream now: `wait_for(mark())` later waits only for the work
    queued before this point, not for what is queued after it. One event, reused (a host call
    waits for it before the next host call records it again)."""
    global _marker
    if _marker is None:
        _marker = _event()
    fast = driver()
    if fast:
        cu, handle = fast
        check(cu.cuEventRecord(int(_marker.handle), handle))
    else:
        _marker.record(stream())
    return _marker


_driver = None


def driver():
    """(cuda.bindings' driver module, the stream's handle), for the calls a replayed step makes at
    every hand-off (a graph launch, the marker's record and wait) straight to the driver: Numba's
    wrappers add a few µs of Python to each (argument checks, a debug log call, the error check),
    and a 35B-A3B token makes ~160 of them. None under the simulator (no driver): decided once, as
    `simulated()` reads the environment at every call."""
    global _driver
    if _driver is None:
        if simulated():
            _driver = ()                     # known: no driver
        else:
            from cuda.bindings import driver as cu    # cuda-python: only with a real driver
            _driver = (cu, stream().handle)
    return _driver or None


def check(result, error=RuntimeError):
    """A cuda.bindings call's values (its result: (error, *values)); `error` raised if it failed."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise error(f"CUDA driver call failed: {driver()[0].cuGetErrorName(err)[1].decode()}")
    return values[0] if len(values) == 1 else values


_side = None
_events: list = []        # _events[0]: the fork; _events[j + 1]: the end of side part j


def beside(side_parts, main_parts) -> None:
    """Work on a second stream beside the main one, in matched parts: side part j (a function
    of the side stream) queues there, after everything queued so far and after side part j − 1;
    main part j (no argument; None for nothing) queues on the main stream, after main part j − 1,
    and the main stream then waits for side part j. So main part j + 1 runs only once side part
    j has run, and work queued on the main stream afterwards waits for all of both. The GPU may
    run each side part beside the main part of the same j. Inside a CUDA-graph capture this
    records a fork, a dependency per part and a join of the graph."""
    global _side
    if _side is None:
        _side = cuda.stream()
    while len(_events) < len(side_parts) + 1:
        _events.append(_event())
    _events[0].record(stream())
    _events[0].wait(_side)
    for j, (side_part, main_part) in enumerate(zip(side_parts, main_parts, strict=True)):
        side_part(_side)
        _events[j + 1].record(_side)
        if main_part is not None:
            main_part()
        _events[j + 1].wait(stream())


def wait_for(event) -> None:
    """Wait until the stream has run everything queued before `event` was recorded."""
    fast = driver()
    if fast:
        check(fast[0].cuEventSynchronize(int(event.handle)))
    else:
        event.synchronize()


def is_device(a) -> bool:
    """True for a numba device array (weights placed on the GPU), False for a host ndarray."""
    return not isinstance(a, np.ndarray) and hasattr(a, "copy_to_host")


def address(a) -> int | None:
    """Where a's first element lives: a device array's device address (the simulator's: the
    address of the host array it wraps), a host array's own. A captured graph is bound to it."""
    if isinstance(a, np.ndarray):
        return a.__array_interface__["data"][0]
    if simulated():
        return a._ary.__array_interface__["data"][0]
    return a.device_ctypes_pointer.value


def zeros(shape, dtype=np.float32):
    a = cuda.device_array(shape, dtype)
    fill_zero(a)
    return a


def upload(host: np.ndarray):
    """A C-contiguous device copy of a host array. A strided stack (one half of a fused expert
    tensor) goes up slice by slice, so no host copy of the whole stack is made."""
    if host.flags.c_contiguous or host.ndim < 3:
        return cuda.to_device(np.ascontiguousarray(host), stream=stream())
    dev = cuda.device_array(host.shape, host.dtype)
    for i in range(host.shape[0]):
        dev[i].copy_to_device(np.ascontiguousarray(host[i]), stream=stream())
    return dev


def to_host(a) -> np.ndarray:
    """A fresh C-contiguous host ndarray with a's contents (host arrays are returned as they are).
    A strided view of three or more axes (a KV prefix: heads × used rows × head size) comes down
    slice by slice along its first axis, so only its own elements cross, not the span they lie in."""
    if isinstance(a, np.ndarray):
        return a
    host = np.empty(a.shape, a.dtype)
    _copy_down(host, a)
    synchronize()
    return host


def _copy_down(host: np.ndarray, a) -> None:
    if a.size == 0:
        return
    if a.is_c_contiguous():
        copy_raw(host, a, up=False)
    elif a.ndim >= 3:
        for i in range(a.shape[0]):
            _copy_down(host[i], a[i])
    else:
        host[...] = a.copy_to_host(stream=stream())


@cuda.jit(cache=True)
def _fill_zero_kernel(flat):
    i = cuda.grid(1)
    if i < flat.shape[0]:
        flat[i] = 0


def fill_zero(a) -> None:
    if a.size and simulated():
        a._ary.fill(0)      # the simulator runs one Python thread per CUDA thread: minutes for a chunk's scratch
    elif a.size:
        flat = a.reshape(a.size)
        _fill_zero_kernel[-(-a.size // THREADS), THREADS, stream()](flat)


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
    small kernel; higher ranks go slice by slice along the first axis. Asynchronous: a host
    src is staged by the driver before this returns, so the caller may reuse it at once."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"copy: shapes differ: {dst.shape} vs {src.shape}")
    if dst.size == 0:
        return
    if isinstance(src, np.ndarray) and (not src.flags.c_contiguous or src.dtype != dst.dtype):
        src = np.ascontiguousarray(src, dtype=dst.dtype)
    if _contiguous(dst) and isinstance(src, np.ndarray):
        copy_raw(dst, src, up=True)
    elif _contiguous(dst) and _contiguous(src):
        dst.copy_to_device(src, stream=stream())
    elif isinstance(src, np.ndarray):
        copy(dst, upload(src))
    elif dst.ndim == 2:
        _copy_2d_kernel[-(-dst.size // THREADS), THREADS, stream()](dst, src)
    else:
        for i in range(dst.shape[0]):
            copy(dst[i], src[i])


def _contiguous(a) -> bool:
    return a.flags.c_contiguous if isinstance(a, np.ndarray) else a.is_c_contiguous()


# --- reusable buffers ---------------------------------------------------------------------------

_scratch: dict[tuple, object] = {}        # (key, shape, dtype) → the buffer handed out
_buckets: dict[tuple, object] = {}        # (key, bucket, trailing shape, dtype) → its allocation


def scratch(key: str, shape: tuple[int, ...], dtype=np.float32):
    """A device buffer for `key` and this shape (contents undefined): the leading rows of one
    allocation per power-of-two bucket of the first dimension. Calls of many row counts (a
    server's prompt tails: one new count per request) then share a few allocations per key
    instead of leaving one each behind; nothing is ever freed, since a captured graph keeps
    using the buffers it was captured with."""
    shape, kind = tuple(shape), np.dtype(dtype).str
    k = (key, shape, kind)
    buf = _scratch.get(k)
    if buf is None:
        if not shape or math.prod(shape) == 0:
            # its own allocation (an empty one costs nothing): Numba slices a device array of no
            # elements to the array's own shape, so a bucket's leading rows would keep its row
            buf = cuda.device_array(shape, dtype)
        else:
            lead = shape[0]
            bucket = 1 << (lead - 1).bit_length()          # the power of two ≥ lead
            b = (key, bucket, shape[1:], kind)
            whole = _buckets.get(b)
            if whole is None:
                whole = _buckets[b] = cuda.device_array((bucket, *shape[1:]), dtype)
            buf = whole if lead == bucket else whole[:lead]
        assert tuple(buf.shape) == shape, (key, buf.shape, shape)
        _scratch[k] = buf
    return buf


_counters: dict[tuple, object] = {}


def counters(key: str, shape: tuple[int, ...]):
    """Device int32 counters for `key` and this shape, zeroed when first made: a kernel that
    counts arrivals in them leaves them at zero again (so a replayed graph finds them so)."""
    k = (key, tuple(shape))
    buf = _counters.get(k)
    if buf is None:
        buf = _counters[k] = zeros(shape, np.int32)
    return buf


class _Pinned:
    """A growable pinned host buffer; `view(shape, dtype)` is a C-contiguous view of its start."""

    def __init__(self):
        self.raw = np.empty(0, np.uint8)

    def view(self, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
        dtype = np.dtype(dtype)
        size = int(np.prod(shape)) * dtype.itemsize
        if size > self.raw.size:
            # the simulator has no page-locked memory; a plain array behaves the same there
            self.raw = np.empty(size, np.uint8) if simulated() else cuda.pinned_array(size, np.uint8)
        return self.raw[:size].view(dtype).reshape(shape)


_staging: dict[object, _Pinned] = {}


class Mapped(NamedTuple):
    """Pinned host memory mapped into the device's address space: `host` (an ndarray) and
    `device` (a device array over the same bytes, which kernels read and write over PCIe)."""
    host: np.ndarray
    device: object


_mapped: dict[tuple, Mapped] = {}


def mapped(key: str, shape: tuple[int, ...], dtype=np.float32) -> Mapped:
    """A mapped buffer for `key` and this shape, allocated once and never moved (a captured
    graph keeps its address); contents undefined."""
    k = (key, tuple(shape), np.dtype(dtype).str)
    m = _mapped.get(k)
    if m is None:
        a = cuda.mapped_array(shape, dtype)
        if simulated():          # the simulator's "device" array wraps a host array, no copy
            m = Mapped(a._ary, a)
        else:
            m = Mapped(np.asarray(a), cuda.from_cuda_array_interface(a.__cuda_array_interface__, owner=a,
                                                                     sync=False))
        _mapped[k] = m
    return m


def host_buffer(key, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """Pinned host scratch for `key` (contents undefined; valid until the next request of it)."""
    return _staging.setdefault(key, _Pinned()).view(tuple(shape), dtype)


def copy_raw(dst, src, up: bool) -> None:
    """Queue one copy between host memory and a C-contiguous device array of the same size on
    the stream — host src to device dst when `up`, device src to host dst otherwise — by a
    direct driver call: Numba's copy_to_device / copy_to_host cost many times the driver call's
    host time (a decode step makes a few such copies). The driver's rules for pageable host memory hold: a copy up has read src when this
    returns (src may be reused at once), a copy down has landed."""
    fast = driver()
    if not fast:
        if up:
            dst.copy_to_device(src, stream=stream())
        else:
            src.copy_to_host(dst, stream=stream())
        return
    cu, handle = fast
    if src.dtype != dst.dtype or src.size != dst.size:
        raise ValueError(f"copy: {src.size} {src.dtype} into {dst.size} {dst.dtype}")
    if up:
        check(cu.cuMemcpyHtoDAsync(dst.device_ctypes_pointer.value, src.ctypes.data, src.nbytes, handle))
    else:
        check(cu.cuMemcpyDtoHAsync(dst.ctypes.data, src.device_ctypes_pointer.value, dst.nbytes, handle))


# The CUDA-graph capture in progress, set by gpu/runtime/graphs.py while it records a step: host_call
# then records into it instead of running (kept here so that this module needs not import graphs).
capturing = None
# Set while a warm-up only looks for the kernels it would compile (hybrid/kernel_prep.py): the
# kernels it skips leave garbage in device buffers, which a host call must not read (the CPU
# would index with garbage expert ids), so host calls are skipped too; their `meanwhile` device
# work still runs, for the pass to meet its kernels.
skip_host_calls = False


def host_call(inputs, outputs, fn, meanwhile=None, bind=None) -> None:
    """Run a CPU function on device arrays: fn(*inputs_host, *outputs_host) gets pinned host
    copies of the device arrays `inputs` and fills `outputs_host`, which then go up into the
    device arrays `outputs`. A `Mapped` input or output is not copied: fn gets its host side,
    and kernels wrote (or will read) its device side in place.

    `meanwhile()`, if given, queues GPU work that neither feeds fn nor reads `outputs` (the
    shared expert of a MoE layer): it is queued after the input copies and the host waits only
    for those copies, so the GPU runs it while the CPU runs fn. The output copies queue after
    it, so work queued later sees both.

    This is the one place where a forward waits for the device (the CPU FFN hand-off). Inside
    a CUDA-graph capture (gpu/runtime/graphs.py) it ends one captured segment and starts the next, and
    fn runs at replay: fn must not keep the host arrays or rely on anything but them. `bind`,
    if given, is fn's faster form for replays: bind(*inputs_host, *outputs_host) is called once
    at capture (with the staging buffers a replay's copies fill) and returns what each replay
    calls, with no arguments."""
    if skip_host_calls:
        if meanwhile is not None:
            meanwhile()
        return
    recorder = capturing
    if recorder is not None:
        recorder.host_call(inputs, outputs, fn, meanwhile, bind)
        return
    host_in = staging_for("in", inputs, host_buffer)
    host_out = staging_for("out", outputs, host_buffer)
    for dev, host in copied_pairs(inputs, host_in):
        copy_raw(host, dev, up=False)
    if meanwhile is None:
        synchronize()
    else:
        copied = mark()
        meanwhile()
        wait_for(copied)
    fn(*host_in, *host_out)
    for dev, host in copied_pairs(outputs, host_out):
        copy_raw(dev, host, up=True)


def staging_for(kind: str, arrays, buffer) -> list[np.ndarray]:
    """The host arrays a host call hands fn for these device arrays: a Mapped one's own host
    side, else buffer((kind, i), shape, dtype) (pinned staging the call copies through)."""
    return [a.host if isinstance(a, Mapped) else buffer((kind, i), a.shape, a.dtype) for i, a in enumerate(arrays)]


def copied_pairs(arrays, hosts):
    """(device array, host staging) of the arrays a host call copies (all but the Mapped)."""
    return [(a, h) for a, h in zip(arrays, hosts) if not isinstance(a, Mapped)]
