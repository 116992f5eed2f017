"""gpu/runtime/host_mapping.py: page ranges for registration, and device views of host arrays that kernels
read in place (on a real GPU: registered and mapped, no copy; under the simulator: copies)."""
import numpy as np
import pytest
from numba import cuda, int64

from gpu import simulated
from gpu.runtime.host_mapping import DeviceViews, page_ranges


def test_page_ranges_round_out_and_merge():
    buf = np.zeros(1 << 16, np.uint8)
    a, b, c = buf[10:20], buf[30:40], buf[40000:40010]     # a and b share a page
    ranges = page_ranges([c, a, b])
    assert len(ranges) == 2
    for (lo, size), array in zip(ranges, (a, c)):
        assert lo % 4096 == 0 and size % 4096 == 0
        assert lo <= array.ctypes.data and array.ctypes.data + array.nbytes <= lo + size


@cuda.jit
def _sum_rows(src, out):
    i = cuda.grid(1)
    if i < src.shape[0]:
        acc = int64(0)
        for j in range(src.shape[1]):
            acc += src[i, j]
        out[i] = acc


def test_a_kernel_reads_the_host_arrays_through_their_views():
    host = np.random.default_rng(1).integers(0, 255, (3, 40, 64), dtype=np.uint8)
    views = DeviceViews([host[0], host[2]])               # two ranges of one allocation
    assert views.why is None and len(views.arrays) == 2
    for view, want in zip(views.arrays, (host[0], host[2])):
        out = cuda.device_array(want.shape[0], np.int64)
        _sum_rows[1, 64](view, out)
        assert np.array_equal(out.copy_to_host(), want.sum(axis=1))
    if not simulated():                                   # read in place: a change shows through
        host[0, 0, 0] ^= 1
        out = cuda.device_array(40, np.int64)
        _sum_rows[1, 64](views.arrays[0], out)
        assert out.copy_to_host()[0] == host[0, 0].sum()


@pytest.mark.skipif(simulated(), reason="the simulator's views are copies, which any array can have")
def test_views_of_strided_arrays_are_refused_with_a_reason():
    host = np.zeros((8, 8), np.uint8)[:, ::2]
    views = DeviceViews([host])
    assert views.arrays is None
    assert "contiguous" in views.why
