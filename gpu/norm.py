"""RMSNorm and its variants on the GPU: same ops and arguments as `cpu/norm.py`.

One warp per normalised head segment, a block of warps per model-width row: threads stride over
the segment (coalesced), sum squares in float32, and the fixed butterfly of `warp_reduce` (then
the warps' partial sums in warp order) combines them. A segment's result depends only on its
own values, never on how many rows the call has, so the slots of a k-row call keep the bits of
one-row calls.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from .runtime.device import simulated
from .intrinsics import device_function, warp_reduce
from .runtime.memory import stream

# The simulator runs every thread as a Python thread: one warp per block keeps it quick.
WARPS = 1 if simulated() else 4
THREADS = 32 * WARPS


def warp_blocks(items: int) -> int:
    """Blocks for one warp per item."""
    return -(-items // WARPS)


# A model-width row (D = 2048..5120) gets a block of warps, about one warp per 128 entries, and
# each thread holds its entries in registers (`_norm_row`). In a decode step the row's loads
# miss the L2 (the layer's weights streamed through it), so what counts is how many loads each
# thread waits out in turn: more warps beat fewer looping ones, and registers beat reloading
# (the timings are in docs/MEASUREMENTS.md).
MAX_ROW_WARPS = 1 if simulated() else 32


def row_threads(D: int) -> int:
    """Threads of the block that normalises one row of width D (a function of D alone, so every
    row of every call sums its squares in the same order)."""
    return 32 * min(MAX_ROW_WARPS, max(1, -(-D // 128)))


@device_function
def row_scale(ss, D, eps, tid):
    """1/sqrt(mean + eps) of a row from each thread's partial sum of squares `ss`: the fixed
    butterfly within each warp, then the warps' sums in warp order (a row's bits never depend
    on the call's other rows). Ends with a barrier, so the caller may then overwrite its input."""
    red = cuda.local.array((1, 1), float32)
    partial = cuda.shared.array(MAX_ROW_WARPS, float32)
    red[0, 0] = ss
    warp_reduce(red)
    if (tid & 31) == 0:
        partial[tid >> 5] = red[0, 0]
    cuda.syncthreads()
    total = float32(0.0)
    for k in range(cuda.blockDim.x >> 5):
        total += partial[k]
    return float32(1.0 / math.sqrt(total / D + eps))


# Entries of a row each thread holds in registers between the two passes (all of a row up to
# 8 × 1024 wide; a wider row's rest is read twice). Every load is issued before the first store:
# a loop that stores x between its loads waits out each load in turn (the store may alias y).
ROW_VALUES = 8


@device_function
def _norm_row(x, y, add, w, eps, out, t):
    """out[t] = rms_norm(x[t] (+ y[t], stored back into x[t] when `add`); w)."""
    D = x.shape[1]
    tid = cuda.threadIdx.x
    step = cuda.blockDim.x
    vals = cuda.local.array(ROW_VALUES, float32)
    scales = cuda.local.array(ROW_VALUES, float32)
    ss = float32(0.0)                      # summed in index order, then the rest: the old loop's order
    for j in range(ROW_VALUES):
        i = tid + j * step
        if i < D:
            v = x[t, i]
            if add:
                v += y[t, i]
            vals[j] = v
            scales[j] = w[i]
            ss += v * v
    for i in range(tid + ROW_VALUES * step, D, step):
        v = x[t, i]
        if add:
            v += y[t, i]
            x[t, i] = v       # read back below by this same thread only
        ss += v * v
    if add:
        for j in range(ROW_VALUES):
            i = tid + j * step
            if i < D:
                x[t, i] = vals[j]
    scale = row_scale(ss, D, eps, tid)
    for j in range(ROW_VALUES):
        i = tid + j * step
        if i < D:
            out[t, i] = vals[j] * scale * scales[j]
    for i in range(tid + ROW_VALUES * step, D, step):
        out[t, i] = x[t, i] * scale * w[i]


@cuda.jit(cache=True)
def _rms_norm(x, w, eps, out):
    _norm_row(x, x, False, w, eps, out, cuda.blockIdx.x)


def rms_norm(x, w, eps, out):
    """out[t] = w ⊙ x[t] / sqrt(mean(x[t]²) + eps), rows of x (n, D); out may be x."""
    n = x.shape[0]
    if n:
        _rms_norm[n, row_threads(x.shape[1]), stream()](x, w, float(eps), out)


@cuda.jit(cache=True)
def _add_rms_norm(x, y, w, eps, out):
    _norm_row(x, y, True, w, eps, out, cuda.blockIdx.x)


def add_rms_norm(x, y, w, eps, out):
    """x += y (the residual add), then out = rms_norm(x; w): one pass instead of two kernels,
    with the bits of add_inplace followed by rms_norm."""
    n = x.shape[0]
    if n:
        _add_rms_norm[n, row_threads(x.shape[1]), stream()](x, y, w, float(eps), out)


@device_function
def warp_sum_squares(seg, d, lane):
    """Σ seg[i]² over i < d: the warp's lanes stride over the segment, then the fixed
    butterfly; every lane gets the same sum."""
    red = cuda.local.array((1, 1), float32)
    ss = float32(0.0)
    for i in range(lane, d, 32):
        v = seg[i]
        ss += v * v
    red[0, 0] = ss
    warp_reduce(red)
    return red[0, 0]


@cuda.jit(cache=True)
def _head_rms_norm(x, w, eps, out):
    n, H, _ = x.shape
    d = w.shape[0]
    lane = cuda.threadIdx.x & 31
    item = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    it = min(item, n * H - 1)
    t = it // H
    h = it - t * H
    scale = float32(1.0 / math.sqrt(warp_sum_squares(x[t, h], d, lane) / d + eps))
    if item < n * H:
        for i in range(lane, d, 32):
            out[t, h, i] = x[t, h, i] * scale * w[i]


def head_rms_norm(x, w, eps, out):
    """Per-head RMSNorm over the first len(w) entries of each head slot of x (n, H, S) into
    out (n, H, d): S = 2·d reads the query half of the packed [query | gate] in place."""
    n, H, _ = x.shape
    _head_rms_norm[warp_blocks(n * H), THREADS, stream()](x, w, float(eps), out)


@cuda.jit(cache=True)
def _gated_rms_norm(o, z, w, eps, out):
    n, width = o.shape
    d = w.shape[0]
    heads = width // d
    lane = cuda.threadIdx.x & 31
    item = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    it = min(item, n * heads - 1)
    t = it // heads
    base = (it - t * heads) * d
    scale = float32(1.0 / math.sqrt(warp_sum_squares(o[t, base:base + d], d, lane) / d + eps))
    if item < n * heads:
        for i in range(lane, d, 32):
            zi = z[t, base + i]
            silu = zi / (float32(1.0) + math.exp(-zi))
            out[t, base + i] = o[t, base + i] * scale * w[i] * silu


def gated_rms_norm(o, z, w, eps, out):
    """GDN output norm: per v-head RMSNorm(o_j; w) over d_v, then ⊙ SiLU(z_j); o, z, out (n, H_v·d_v)."""
    n, width = o.shape
    _gated_rms_norm[warp_blocks(n * (width // w.shape[0])), THREADS, stream()](o, z, w, float(eps), out)


# The kernel of `gpu.gdn.l2_norm_heads` (the op sits in gdn.py, as on the CPU). It stays beside
# `warp_sum_squares`: under the simulator that helper is plain Python and sees the simulated
# `cuda` (cuda.local) only while a kernel of this module runs.
@cuda.jit(cache=True)
def _l2_norm_heads(x, n_heads, d, eps):
    n = x.shape[0]
    lane = cuda.threadIdx.x & 31
    item = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    it = min(item, n * n_heads - 1)
    t = it // n_heads
    base = (it - t * n_heads) * d
    inv = float32(1.0 / max(math.sqrt(warp_sum_squares(x[t, base:base + d], d, lane)), eps))
    if item < n * n_heads:
        for i in range(lane, d, 32):
            x[t, base + i] *= inv
