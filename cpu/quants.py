"""Decode GGUF weight blocks to float32, bit-exact with `gguf.quants.dequantize`.

Used where a float copy of rows is needed (embedding lookups, reference checks); the matvec
kernels never build one (they decode blocks in registers, see `cpu.simd`). Every float operation
below is the one gguf-py performs, in the same order (e.g. Q4_K: (d·sc)·q − dmin·m), so results
match bit for bit. Block layouts: docs/MODEL_FORMAT.md §6.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.ggml_types import BF16, DECODED_IDS, F16, F32, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, SUPPORTED

from .blocks import decode_block
from .matvec import check_weights, frozen
from .simd import f16_at
from .variants import Variants

_Q4_0, _Q8_0, _Q4_K, _Q5_K, _Q6_K = Q4_0.id, Q8_0.id, Q4_K.id, Q5_K.id, Q6_K.id


@njit(inline="always")
def _scale_min_k4(w, s, j):
    """`get_scale_min_k4`: the j-th 6-bit scale and min of a Q4_K/Q5_K block (scales at byte s)."""
    if j < 4:
        return w[s + j] & 63, w[s + j + 4] & 63
    return (w[s + j + 4] & 0xF) | ((w[s + j - 4] >> 6) << 4), (w[s + j + 4] >> 4) | ((w[s + j] >> 6) << 4)


@njit(inline="always")
def _block_q4_0(w, o, y):
    d = f16_at(w, o)
    for j in range(16):
        q = w[o + 2 + j]
        y[j] = d * np.float32(np.int32(q & 0xF) - 8)
        y[j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@njit(inline="always")
def _block_q8_0(w, o, y):
    d = f16_at(w, o)
    for j in range(32):
        y[j] = np.float32(np.int8(w[o + 2 + j])) * d


@njit(inline="always")
def _block_q4_k_q5_k(w, o, y, has_qh):
    d = f16_at(w, o)
    dmin = f16_at(w, o + 2)
    qs = o + 48 if has_qh else o + 16
    for c in range(4):
        sc1, m1 = _scale_min_k4(w, o + 4, 2 * c)
        sc2, m2 = _scale_min_k4(w, o + 4, 2 * c + 1)
        d1, dm1 = d * np.float32(sc1), dmin * np.float32(m1)
        d2, dm2 = d * np.float32(sc2), dmin * np.float32(m2)
        for l in range(32):
            b = w[qs + 32 * c + l]
            lo, hi = np.int32(b & 0xF), np.int32(b >> 4)
            if has_qh:
                h = w[o + 16 + l]
                lo |= ((h >> (2 * c)) & 1) << 4
                hi |= ((h >> (2 * c + 1)) & 1) << 4
            y[64 * c + l] = d1 * np.float32(lo) - dm1
            y[64 * c + 32 + l] = d2 * np.float32(hi) - dm2


@njit(inline="always")
def _block_q6_k(w, o, y):
    d = f16_at(w, o + 208)
    for h in range(2):
        ql, qh, sc, yo = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h, 128 * h
        for l in range(32):
            s = l // 16
            b_qh = np.int32(w[qh + l])
            q1 = (np.int32(w[ql + l] & 0xF) | ((b_qh & 3) << 4)) - 32
            q2 = (np.int32(w[ql + l + 32] & 0xF) | (((b_qh >> 2) & 3) << 4)) - 32
            q3 = (np.int32(w[ql + l] >> 4) | (((b_qh >> 4) & 3) << 4)) - 32
            q4 = (np.int32(w[ql + l + 32] >> 4) | (((b_qh >> 6) & 3) << 4)) - 32
            y[yo + l] = (d * np.float32(np.int8(w[sc + s]))) * np.float32(q1)
            y[yo + l + 32] = (d * np.float32(np.int8(w[sc + s + 2]))) * np.float32(q2)
            y[yo + l + 64] = (d * np.float32(np.int8(w[sc + s + 4]))) * np.float32(q3)
            y[yo + l + 96] = (d * np.float32(np.int8(w[sc + s + 6]))) * np.float32(q4)


def _make_dequantize_rows(wt):
    t = SUPPORTED[wt]
    elems, size = t.block_elems, t.block_bytes    # the block geometry, constants in the kernel

    @njit(cache=True, nogil=True)
    def _dequantize_rows(wtype, w, row_ids, out):
        # wtype == wt, the variant's type (a constant here: only its branch below is compiled).
        # serial: the hot use is an embedding lookup of a few rows, where a parallel launch costs
        # more than the work (and parallel=True would triple the compile time)
        flat = w.reshape(w.size)
        row_bytes = w.shape[1]
        cols = out.shape[1]
        for i in range(row_ids.shape[0]):
            base = row_ids[i] * row_bytes
            y = out[i]
            if wt == _Q4_0:
                for b in range(cols // 32):
                    _block_q4_0(flat, base + 18 * b, y[32 * b:])
            elif wt == _Q8_0:
                for b in range(cols // 32):
                    _block_q8_0(flat, base + 34 * b, y[32 * b:])
            elif wt == _Q4_K:
                for b in range(cols // 256):
                    _block_q4_k_q5_k(flat, base + 144 * b, y[256 * b:], False)
            elif wt == _Q5_K:
                for b in range(cols // 256):
                    _block_q4_k_q5_k(flat, base + 176 * b, y[256 * b:], True)
            elif wt == _Q6_K:
                for b in range(cols // 256):
                    _block_q6_k(flat, base + 210 * b, y[256 * b:])
            else:                                    # a `cpu.blocks` type
                for b in range(cols // elems):
                    decode_block(wt, flat, base + size * b, y[elems * b:])
    return _dequantize_rows


_dequantize_rows = Variants(_make_dequantize_rows)   # _dequantize_rows(wtype) → the kernel (`cpu.variants`)


def _float_rows(wtype: int, rows: np.ndarray) -> np.ndarray:
    """Rows of a float type (uint8 bytes) widened to float32 (exact)."""
    if wtype == F32.id:
        return rows.view(np.float32).copy()
    if wtype == F16.id:
        return rows.view(np.float16).astype(np.float32)
    return (rows.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def dequantize_rows(wtype: int, w: np.ndarray, row_ids, cols: int) -> np.ndarray:
    """Float32 copies of the rows `row_ids` of w (embedding lookup / get_rows): (len(ids), cols)."""
    check_weights(wtype, w, cols)
    ids = np.asarray(row_ids)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"row_ids: expected a 1-D array of integers, got {ids.dtype} of shape {ids.shape}")
    if ids.size and (ids.min() < 0 or ids.max() >= w.shape[0]):
        raise ValueError(f"row_ids: ids must lie in [0, {w.shape[0]}), got {ids.min()}..{ids.max()}")
    ids = ids.astype(np.int64, copy=False)
    if wtype in (F32.id, F16.id, BF16.id):
        return _float_rows(wtype, w[ids]).reshape(ids.size, cols)
    out = np.empty((ids.size, cols), np.float32)
    if ids.size:
        _dequantize_rows(wtype)(wtype, frozen(w), ids, out)
    return out


def dequantize(wtype: int, w: np.ndarray, cols: int) -> np.ndarray:
    """All rows of w as float32: (rows, cols)."""
    return dequantize_rows(wtype, w, np.arange(w.shape[0] if isinstance(w, np.ndarray) and w.ndim == 2 else 0), cols)


assert set(SUPPORTED) == {F32.id, F16.id, BF16.id, Q4_0.id, Q8_0.id, Q4_K.id, Q5_K.id, Q6_K.id} | DECODED_IDS
