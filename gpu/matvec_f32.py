"""Decode matvec of small float32 matrices: a MoE layer's router (256 × 2048 at the 35B-A3B
shape) and its shared expert's one-row gate.

The float kernel (gpu/matvec.py) walks a row in tiles of 256 columns, one tile's loads in
flight at a time behind a block barrier: for these matrices that is eight round trips to memory
in turn, 5.3 µs for the router and 4-8 µs for the one-row gate (H100, traced), on a decode
step's critical path once per layer. Here a warp takes one (row, slot): lane l reads the
16-byte words 4l, 4l + 128, ... of the row, UNROLL of them issued before any is used, and the
fixed butterfly adds the lanes' sums. Each slot is its own warp, so a k-slot call gives every
slot the bits of a one-slot call; the weights are re-read per slot, from L2 (SMALL_WORDS).
"""
from __future__ import annotations

from numba import cuda, float32, uint32

from .device import simulated
from .intrinsics import bits_to_f32, fma, load_u32x4, warp_reduce

WARPS = 1 if simulated() else 4
UNROLL = 8
SMALL_WORDS = 1 << 21        # 8 MB of weights at most: they stay in L2 across the slots


def takes(w_dev, cols: int) -> bool:
    """Whether an F32 matrix (rows, 4·cols bytes) goes to this kernel: small, and its rows
    start on 16-byte boundaries (the loads are 16 bytes)."""
    aligned = simulated() or w_dev.device_ctypes_pointer.value % 16 == 0
    return cols % 4 == 0 and w_dev.shape[0] * cols <= SMALL_WORDS and aligned


@cuda.jit(cache=True)
def _matvec_f32(w, x, out):
    rows, cols = w.shape               # w: the rows' float32 bits as uint32
    s = cuda.blockIdx.y
    row = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    lane = cuda.threadIdx.x & 31
    r = min(row, rows - 1)             # a warp past the end still takes part in the butterfly
    words = cuda.local.array((UNROLL, 4), uint32)
    acc = float32(0.0)
    for c0 in range(4 * lane, cols, 128 * UNROLL):
        for u in range(UNROLL):
            c = c0 + 128 * u
            if c < cols:
                words[u, 0], words[u, 1], words[u, 2], words[u, 3] = load_u32x4(w, r, c)
        for u in range(UNROLL):
            c = c0 + 128 * u
            if c < cols:
                for q in range(4):
                    acc = fma(bits_to_f32(words[u, q]), x[s, c + q], acc)
    red = cuda.local.array((1, 1), float32)
    red[0, 0] = acc
    warp_reduce(red)
    if lane == 0 and row < rows:
        out[s, row] = red[0, 0]


def matvec(w_dev, x_dev, out_dev, stream) -> None:
    """out_dev[s] = W @ x_dev[s] for an F32 W (rows, 4·cols bytes) that `takes` accepts."""
    rows = w_dev.shape[0]
    n = x_dev.shape[0]
    _matvec_f32[(-(-rows // WARPS), n), 32 * WARPS, stream](w_dev.view("uint32"), x_dev, out_dev)


def ptx_targets():
    from numba import types
    u32, f32 = types.Array(types.uint32, 2, "C"), types.Array(types.float32, 2, "C")
    yield "matvec F32 small", _matvec_f32.py_func, (u32, f32, f32)
