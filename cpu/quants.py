"""Decode GGUF weight blocks to float32, bit-exact with `gguf.quants.dequantize`.

Used where a float copy of rows is needed (embedding lookups, reference checks); the matvec
kernels never build one (they decode blocks in registers, see `cpu.simd`, or into a small
buffer, see `cpu.decoded`). The block decoders are `cpu.blocks`' (bit-exact with gguf-py).
Block layouts: docs/MODEL_FORMAT.md §6.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from cpu.ggml_types import BF16, DECODED_IDS, F16, F32, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, SUPPORTED

from .blocks import decode_block
from .matvec import check_weights, frozen
from .variants import Variants


def _make_dequantize_rows(wt):
    t = SUPPORTED[wt]
    elems, size = t.block_elems, t.block_bytes    # the block geometry, constants in the kernel

    @njit(cache=True, nogil=True)
    def _dequantize_rows(w, row_ids, out):
        # serial: the hot use is an embedding lookup of a few rows, where a parallel launch costs
        # more than the work (and parallel=True would triple the compile time)
        flat = w.reshape(w.size)
        row_bytes = w.shape[1]
        for i in range(row_ids.shape[0]):
            base = row_ids[i] * row_bytes
            y = out[i]
            for b in range(out.shape[1] // elems):
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
        _dequantize_rows(wtype)(frozen(w), ids, out)
    return out


def dequantize(wtype: int, w: np.ndarray, cols: int) -> np.ndarray:
    """All rows of w as float32: (rows, cols)."""
    return dequantize_rows(wtype, w, np.arange(w.shape[0] if isinstance(w, np.ndarray) and w.ndim == 2 else 0), cols)


assert set(SUPPORTED) == {F32.id, F16.id, BF16.id, Q4_0.id, Q8_0.id, Q4_K.id, Q5_K.id, Q6_K.id} | DECODED_IDS
