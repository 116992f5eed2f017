"""Fused SwiGLU gate·up for N input slots: h[n, r] = SiLU(W_gate[r] · x[n]) · (W_up[r] · x[n]).

One parallel pass over row tiles reads the gate row and the up row of the same output row back
to back, so the activations are quantised once and each output needs no second sweep. The down
projection is a plain `cpu.matvec.matvec`. Per-slot bit identity carries over from the row dots:
SiLU and the product are the same float32 operations for every slot.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from . import activations as act
from . import matvec as _matvec
from .atomics import fetch_add
from .expf import expf
from .matvec import (QUANT_TYPES, check_f32_matrix, check_weights, frozen, n_tiles_for, quantize_activations,
                     row_dot_wide, run_matvec)
from .variants import Variants, type_mask


# rows of h whose SiLU(gate)·up run as one vectorised pass after their dots: a scalar exp per row
# in the middle of the row loop cost a sizeable share of a small expert row's two dots
SILU_ROWS = 64


@njit(inline="always")
def _silu_times(g, u):
    return g / (np.float32(1.0) + expf(-g)) * u


@njit(inline="always")
def _silu_rows(h, ups, r0, r1):
    """h[n, r0:r1] = SiLU(h[n, r0:r1]) · ups[n·SILU_ROWS ..] for every slot n: one vectorised pass
    (`cpu.expf` inlines) with the bits of `_silu_times` per element."""
    for n in range(h.shape[0]):
        g = h[n, r0:r1]
        u = ups[n * SILU_ROWS:n * SILU_ROWS + r1 - r0]
        for t in range(r1 - r0):
            g[t] = _silu_times(g[t], u[t])


@njit(inline="always")
def gated_row(h, ups, gate, up, r, done, end):
    """Row r of h (n slots, rows) from its gate and up products (n each): the gate goes into h,
    the up waits in ups (n · SILU_ROWS floats) until SILU_ROWS rows wait or r is the last row
    before `end`; then rows done..r get SiLU(gate)·up in one pass. Returns the first row whose
    SiLU is still to come (rows of one run go in order, starting at `done`)."""
    for n in range(h.shape[0]):
        h[n, r] = gate[n]
        ups[n * SILU_ROWS + r - done] = up[n]
    if r + 1 - done == SILU_ROWS or r + 1 == end:
        _silu_rows(h, ups, done, r + 1)
        return r + 1
    return done


def _make_swiglu_quant(gate_type, up_type):
    types_here = type_mask((gate_type, up_type))  # the row dots' code: these types' only

    @njit(cache=True, nogil=True, parallel=True)
    def _swiglu_quant(wtype_gate, w_gate, wtype_up, w_up, act_gate, act_up, h, n_tiles, n_workers, pf):
        xq, dx, bs = act_gate
        xq_u, dx_u, bs_u = act_up
        rows, n_slots = w_gate.shape[0], xq.shape[0]
        per_tile = -(-rows // n_tiles)
        claimed = np.zeros(1, np.int64)               # tiles handed out (`cpu.matvec.n_tiles_for`)
        for _ in prange(n_workers):
            gate = np.empty(n_slots, np.float32)      # one row's products, all slots
            up = np.empty(n_slots, np.float32)
            ups = np.empty(n_slots * SILU_ROWS, np.float32)   # up products waiting for their SiLU pass
            t = fetch_add(claimed, 0, 1)
            while t < n_tiles:
                r0, r1 = t * per_tile, min(rows, (t + 1) * per_tile)
                done = r0
                for r in range(r0, r1):
                    row_dot_wide(types_here, wtype_gate, w_gate, r, xq, dx, bs, gate, pf)
                    row_dot_wide(types_here, wtype_up, w_up, r, xq_u, dx_u, bs_u, up, pf)
                    done = gated_row(h, ups, gate, up, r, done, r1)
                t = fetch_add(claimed, 0, 1)
    return _swiglu_quant


_swiglu_quant = Variants(_make_swiglu_quant)      # _swiglu_quant(gate type, up type) → the kernel (`cpu.variants`)


@njit(cache=True, nogil=True, parallel=True)
def _silu_times_inplace(g, u):
    for n in range(g.shape[0]):
        for r in prange(g.shape[1]):
            g[n, r] = _silu_times(g[n, r], u[n, r])


def swiglu(wtype_gate: int, w_gate: np.ndarray, wtype_up: int, w_up: np.ndarray,
           x: np.ndarray, h_out: np.ndarray) -> None:
    """h_out[n, r] = SiLU(Σ_c Wg[r, c]·x[n, c]) · Σ_c Wu[r, c]·x[n, c] for every slot n.

    Weights as for `matvec` (raw GGUF rows, (n_ff, row_bytes) uint8); x: (n, D) float32;
    h_out: (n, n_ff) float32, overwritten."""
    check_swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
    rows = w_gate.shape[0]
    if rows == 0:
        return
    if wtype_gate in QUANT_TYPES and wtype_up in QUANT_TYPES:
        act_gate = quantize_activations(wtype_gate, x)
        # gate and up each meet x rounded for their own type (the same arrays when that agrees)
        same = act.format_of(wtype_gate) == act.format_of(wtype_up)
        act_up = act_gate if same else quantize_activations(wtype_up, x)
        threads = numba.get_num_threads()
        _swiglu_quant(wtype_gate, wtype_up)(wtype_gate, frozen(w_gate), wtype_up, frozen(w_up), act_gate, act_up, h_out,
                                            n_tiles_for(rows, threads), threads, _matvec.PREFETCH_BYTES)
        return
    # float weights (not what a quantised FFN holds): two passes, same arithmetic per slot
    up = np.empty_like(h_out)
    run_matvec(wtype_gate, w_gate, x, h_out)
    run_matvec(wtype_up, w_up, x, up)
    _silu_times_inplace(h_out, up)


def check_swiglu(wtype_gate: int, w_gate: np.ndarray, wtype_up: int, w_up: np.ndarray,
                 x: np.ndarray, h_out: np.ndarray) -> None:
    """Raise ValueError unless these are valid `swiglu` arguments."""
    check_f32_matrix(x, "x")
    n, cols = x.shape
    check_weights(wtype_gate, w_gate, cols, "w_gate")
    check_weights(wtype_up, w_up, cols, "w_up")
    if w_gate.shape[0] != w_up.shape[0]:
        raise ValueError(f"w_gate has {w_gate.shape[0]} rows but w_up has {w_up.shape[0]}")
    check_f32_matrix(h_out, "h_out", (n, w_gate.shape[0]), writeable=True)
