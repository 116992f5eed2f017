"""The generic N-input product for the `cpu.ggml_types.DECODED` types: decode, then float dots.

out[n, r] = Σ_c W[r, c] · x[n, c] for weight types that have no hand-written SIMD row dot
(`cpu.ggml_types.DECODED` less `cpu.matvec.ROW_READERS`: none since Q4_1, Q5_1 and IQ1_M got
theirs; kept for a type added with a decoder before its reader, and tested on its own). Per row tile and block, each of
ROW_TILE rows' block is decoded once (`cpu.blocks.decode_block`, inlined: the type is a closure constant,
`cpu.variants`) into a small float32 buffer, then dotted with every input slot's float32
activations: one weight read and one decode serve all N slots, and for many slots (a prompt
chunk) each slot's activation block is reused by the ROW_TILE rows while it is in L1.

Bit identity: each (row, slot) adds its block dots in block order, and every block dot is the
same compiled function (`_dot`: vectorised, so its internal order is the machine code's, but one
machine code for every slot). That order depends on neither N, nor the slot, nor the row
tiling, nor the thread count, so slot n of an N-input call has exactly the bits of the 1-input
call on x[n] (tested), and a prompt chunk the bits of token-by-token decoding. Activations are
not rounded (unlike the int8 kernels of `cpu.matvec`): the error against the float64 product is
float32 rounding of the products and sums only.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cpu.ggml_types import SUPPORTED

from . import activations as act
from .blocks import decode_block
from .variants import Variants

ROW_TILE = 4    # rows decoded together (one slot's activation block meets them all)


# reassoc lets LLVM split the sum over vector lanes, contract fuse multiply-adds; no finite-math
# flags, so a NaN or inf in x or W still shows in the output
@njit(cache=True, nogil=True, fastmath={"reassoc", "contract"})
def _dot(y, x):
    """Σ y[j]·x[j] over one block, vectorised; one compiled function, so the same machine code,
    hence the same order, for every slot."""
    s = np.float32(0.0)
    for j in range(y.size):
        s += y[j] * x[j]
    return s


@njit(inline="always")
def rows_dot(wt, elems, size, flat, row_bytes, rows_at, m, x, y, acc):
    """acc[i, n] = row rows_at + i of W · slot n of x, for i < m: block by block, each row's block
    (type wt, a compile-time constant) decoded once into y[i, :elems] (y: ROW_TILE × ≥ elems
    floats), the block dots added in block order."""
    n_slots, cols = x.shape
    for i in range(m):
        for n in range(n_slots):
            acc[i, n] = 0.0
    for b in range(cols // elems):
        for i in range(m):
            decode_block(wt, flat, (rows_at + i) * row_bytes + b * size, y[i])
        for n in range(n_slots):
            xb = x[n, b * elems:(b + 1) * elems]
            for i in range(m):
                acc[i, n] += _dot(y[i, :elems], xb)


def _make_matvec(wt):
    t = SUPPORTED[wt]
    elems, size = t.block_elems, t.block_bytes     # constants in the kernel

    @njit(cache=True, nogil=True, parallel=True)
    def _matvec_decoded(w, x, out, n_tiles):
        rows, row_bytes = w.shape
        n_slots = x.shape[0]
        flat = w.reshape(w.size)
        per_tile = -(-rows // n_tiles)
        for tile in prange(n_tiles):
            y = np.empty((ROW_TILE, elems), np.float32)
            acc = np.empty((ROW_TILE, n_slots), np.float32)
            end = min(rows, (tile + 1) * per_tile)
            for r0 in range(tile * per_tile, end, ROW_TILE):
                m = min(ROW_TILE, end - r0)
                rows_dot(wt, elems, size, flat, row_bytes, r0, m, x, y, acc)
                for i in range(m):
                    for n in range(n_slots):
                        out[n, r0 + i] = acc[i, n]
    return _matvec_decoded


_matvec = Variants(_make_matvec)       # _matvec(wtype): the kernel for that type


def matvec_decoded(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, r] = Σ_c W[r, c] · x[n, c] for a DECODED type; arguments as `cpu.matvec.matvec`
    (checked by the caller; w read-only or not, C-contiguous). x meets the weights as llama.cpp
    rounds it for that type (its Q8_0 / Q8_1 / Q8_K codes times their scales,
    `cpu.activations.dequantized`), so these types agree with llama.cpp as the SIMD ones do."""
    rows = w.shape[0]
    if rows == 0:
        return
    x = act.dequantized(act.format_of(wtype), x)
    # row tiles of a few ROW_TILEs per thread: enough that threads finish together
    n_tiles = max(1, min(-(-rows // ROW_TILE), 8 * numba.get_num_threads()))
    _matvec(wtype)(w, x, out, n_tiles)
