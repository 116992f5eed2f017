"""Host memory the GPU reads in place: page-locked ranges of the mapped GGUF file.

Two users: the weight streamer copies a prompt chunk's FFN weights with the copy engine straight
from the registered mapping (gpu/runtime/weight_stream.py), and a decode step's fetch kernel copies the
routed experts the GPU takes from it, by pointers the routing picks on the device
(gpu/expert_cache.py). Registration page-locks the ranges
(cuMemHostRegister, read-only: the file is mapped read-only) and maps them into the device's
address space, so a device pointer to them exists.

Why the GPU should read host memory at all: while every core streams weights, a kernel reading
registered host memory still gets about half of PCIe's rate (tools/device/pcie_share.py measures
both at once; figures in docs/MEASUREMENTS.md). The host's DRAM has more bandwidth than the cores
pull; the GPU's reads use some of the rest.
"""
from __future__ import annotations

import mmap
import weakref

import numpy as np
from numba import cuda

from . import memory
from .device import simulated


def page_ranges(arrays) -> list[tuple[int, int]]:
    """The host arrays' address ranges rounded out to whole pages, overlapping ones merged
    (the driver refuses to register a page twice)."""
    page = mmap.PAGESIZE
    spans = sorted((a.ctypes.data // page * page, -(-(a.ctypes.data + a.nbytes) // page) * page)
                   for a in arrays)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def register_host_ranges(arrays) -> tuple[list[int], str | None]:
    """Page-lock the memory of host arrays, mapped for the device: (registered base addresses,
    None), or ([], why not) with nothing left registered."""
    if simulated():
        return [], "the CUDA simulator has no page-locked memory"
    cu = memory.driver()[0]      # also makes Numba's context, which the driver's calls need
    flags = cu.CU_MEMHOSTREGISTER_READ_ONLY | cu.CU_MEMHOSTREGISTER_DEVICEMAP
    done: list[int] = []
    for start, size in page_ranges(arrays):
        (err,) = cu.cuMemHostRegister(start, size, flags)
        if int(err) != 0:
            unregister_host_ranges(done)
            return [], f"cuMemHostRegister: {cu.cuGetErrorName(err)[1].decode()}"
        done.append(start)
    return done, None


def is_registered(host: np.ndarray) -> bool:
    """Whether the driver already holds this array's memory page-locked (both of its ends): a
    range registered by one owner (the expert cache's mapping) cannot be registered again, and a
    copy from it is a DMA already."""
    if simulated() or host.nbytes == 0:
        return False
    cu = memory.driver()[0]
    # a device pointer exists exactly for page-locked memory mapped for the device (every
    # registration here is: `register_host_ranges`)
    return all(int(cu.cuMemHostGetDevicePointer(a, 0)[0]) == 0 for a in (host.ctypes.data, host.ctypes.data + host.nbytes - 1))


def unregister_host_ranges(bases: list[int]) -> None:
    from cuda.bindings import driver as cu    # cuda-python: only on a real GPU (none under the simulator)
    for base in bases:
        cu.cuMemHostUnregister(base)       # errors ignored: the mapping may already be gone
    bases.clear()


class DeviceViews:
    """Device arrays over host arrays, read in place by kernels (over PCIe), for as long as this
    object lives: `arrays` (C-contiguous views of the file), or None with `why` when the
    driver refused. Under the simulator the views are copies in (simulated) device memory:
    kernels read the same bytes, the same way."""

    def __init__(self, hosts):
        self.arrays, self.why = None, None
        if simulated():
            self.arrays = [cuda.to_device(np.ascontiguousarray(h)) for h in hosts]
            return
        if not all(h.flags.c_contiguous for h in hosts):
            self.why = "the views are not C-contiguous"
            return
        bases, self.why = register_host_ranges(hosts)
        if self.why is not None:
            return
        self._finalizer = weakref.finalize(self, unregister_host_ranges, bases)
        self.arrays = [_device_view(h) for h in hosts]


def _device_view(host: np.ndarray):
    """A numba device array over registered host memory (no copy; the owner keeps it alive)."""
    from cuda.bindings import driver as cu    # cuda-python: only on a real GPU (none under the simulator)
    err, pointer = cu.cuMemHostGetDevicePointer(host.ctypes.data, 0)
    if int(err) != 0:
        raise RuntimeError(f"cuMemHostGetDevicePointer: {cu.cuGetErrorName(err)[1].decode()}")
    # not flagged read-only (though it is): to Numba a read-only array is another type, which a
    # kernel taking it beside a device array of the same layout could not unify
    interface = {"shape": host.shape, "strides": None, "typestr": host.dtype.str, "data": (int(pointer), False),
                 "version": 3}
    return cuda.from_cuda_array_interface(interface, owner=host, sync=False)
