"""Many-input matrix product for prompt chunks: out[n, r] = Σ_c W[r, c] · x[n, c], n ≥ MIN_SLOTS.

`cpu.matvec` is built for a few input slots: per weight row and block it runs every slot, so with
hundreds of slots the int8 activations (n × cols bytes: 1.8 MB for a 512-token chunk of 3584
columns, past the L2 cache) stream through the core once per weight row, and each slot's sums are
reduced on their own. Here the work goes by tiles: TILE_ROWS weight rows × a slab of SLAB_BLOCKS
super-blocks, K-quant rows decoded once into `cpu.simd` records (unsigned codes, per-chunk scale
vectors, aux weights, d/dmin), then every group of 8 slots runs against the tile, block-outer, so
the group's activation block sits in L1 while it meets every row; the dot is loads, `vpmaddubsw`,
`vpmaddwd` and adds, each slot's sums gathered in 8 float lanes (`cpu.simd.tile_dot_k`). Q8_0/Q4_0
rows need no decoding: the same tiling runs `cpu.matvec`'s own span kernels, 8 slots a call.

Where the time goes: 2 multiplies (`vpmaddubsw` + `vpmaddwd`) per 32 weights per slot is the
floor of this arithmetic without VNNI; the inner loop runs close to that bound, and the rest is
the per-block reduction and float combine that bit identity requires (docs/MEASUREMENTS.md).

Bit identity: each output is the same integer lanes, combined by the same float operations in the
same order (block after block into 8 lanes from 0.0, then one fixed tree over the lanes), as
`cpu.matvec`'s N-input row dot, so slot n of a
many-row call has exactly the bits of a one-slot `matvec` call on x[n] (tested). Chunked prefill
therefore stays equal to token-by-token prefill, and speculative verify (few slots, cpu.matvec)
is untouched.

Covered: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 (`TYPES`). Every other type stays on `cpu.matvec`, whose
kernels serve any number of slots (each row dot decodes a block once for a group of slots);
`matmul` and `swiglu_matmul` hand them on. `takes`
says which calls `cpu.ops` routes here. Activations: `cpu.matvec`'s int8 quantisation for the
weight type (`cpu.activations`: Q8_K for K-quants, Q8_0 for Q8_0/Q4_0), slots padded to a
multiple of 8 (padding slots are zeros, computed and dropped).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cpu.ggml_types import Q4_0, Q4_K, Q5_K, Q6_K, Q8_0

from . import activations as act
from .ffn import _silu_times, check_swiglu, swiglu
from .matvec import check_matvec, frozen, run_matvec
from .simd import TILE_RECORD, decode_q4_k_block, decode_q5_k_block, decode_q6_k_block, dot_q4_0, dot_q8_0, tile_dot_k
from .variants import Variants

# Prompt chunks only: verify steps (a few slots) stay on cpu.matvec. This path already wins from
# 8 slots (docs/MEASUREMENTS.md), so the bound could go lower.
MIN_SLOTS = 16
SLOT_GROUP = 8      # slots per dot call (lanes of the float combine)
TILE_ROWS = 16      # weight rows per tile (a prange task)
SLAB_BLOCKS = 8     # super-blocks (256 columns) per decoded slab: 16 × 8 × 552 B = 69 KiB, in L2

_Q4_K, _Q5_K, _Q6_K, _Q8_0, _Q4_0 = Q4_K.id, Q5_K.id, Q6_K.id, Q8_0.id, Q4_0.id
TYPES = frozenset((_Q4_K, _Q5_K, _Q6_K, _Q8_0, _Q4_0))


# ---- activations: int8 as in cpu.matvec, slots padded to groups of 8 ---------------------------

def quantize_slots(wtype: int, x: np.ndarray):
    """The int8 activations of `cpu.matvec.quantize_activations(wtype, x)`, laid out for the tile
    kernels by groups of SLOT_GROUP slots (n rounded up; padding slots are zeros):
      xq (n_pad, cols↑256) int8 — group g is rows 8g..8g+7;
      dx — Q8_K: (groups, chunks, 8), the scale of chunk b of slot 8g+j at [g, b, j];
           Q8_0: (groups, 8, blocks), slot 8g+j's scales (slot-major, as cpu.matvec's) at [g, j];
      bs (n_pad, cols↑256 / 16) int16 — the activation sums per 16."""
    fmt = act.format_of(wtype)
    n_pad = -(-x.shape[0] // SLOT_GROUP) * SLOT_GROUP
    n_groups = n_pad // SLOT_GROUP
    xq, dx, bs = act.quantize(fmt, x, n_pad)
    if fmt == act.Q8_K:
        dx_g = np.ascontiguousarray(dx.reshape(dx.shape[0], n_groups, SLOT_GROUP).transpose(1, 0, 2))
    else:
        dx_g = dx.reshape(n_groups, SLOT_GROUP, dx.shape[1])
    return xq, dx_g, bs


# ---- K-quants: decoded tiles -------------------------------------------------------------------

@njit(inline="always")
def _decode_rows(wtype, w, r0, r1, b0, b1, tile):
    """Super-blocks b0..b1−1 of rows r0..r1−1 into tile records: (i, b) at (i·(b1−b0) + b−b0)·TILE_RECORD."""
    bb = 210 if wtype == _Q6_K else (176 if wtype == _Q5_K else 144)
    for r in range(r0, r1):
        for b in range(b0, b1):
            src = r * w.shape[1] + b * bb
            dst = ((r - r0) * (b1 - b0) + b - b0) * TILE_RECORD
            if wtype == _Q4_K:
                decode_q4_k_block(w, src, tile, dst)
            elif wtype == _Q5_K:
                decode_q5_k_block(w, src, tile, dst)
            else:
                decode_q6_k_block(w, src, tile, dst)


@njit(inline="always")
def _tile_times_group(wtype, tile, n_rows, b0, b1, xq, dx, bs, acc):
    """acc[i, j] (8 lanes) += Σ over super-blocks b0..b1−1 of row i of the decoded tile · slot j of the
    group (xq: its 8 rows; dx, bs: its slices). Block-outer: the group's activation block stays
    in L1 while it meets every row; per (row, slot) the super-blocks add in order."""
    for b in range(b0, b1):
        for i in range(n_rows):
            rec = (i * (b1 - b0) + b - b0) * TILE_RECORD
            if wtype == _Q6_K:
                tile_dot_k(tile, rec, xq, b, bs, dx, acc, i, False)
            else:
                tile_dot_k(tile, rec, xq, b, bs, dx, acc, i, True)


# ---- Q8_0 / Q4_0: their rows are already int8-ready, read in place -----------------------------

@njit(inline="always")
def _rows_times_group(wtype, w, r0, n_rows, k0, k1, xq, dx, acc):
    """acc[i, j] (8 lanes) += row r0+i of a Q8_0/Q4_0 matrix · slot j of the group over the
    256-column chunks k0..k1−1: `cpu.matvec`'s spans (8 blocks, then a block-by-block tail) with
    all 8 slots per call, chunk outer; dx: the group's (8, blocks) scales."""
    bb = 34 if wtype == _Q8_0 else 18
    n_blk = w.shape[1] // bb
    for k in range(k0, k1):
        first = k * 8
        for i in range(n_rows):
            off = (r0 + i) * w.shape[1] + first * bb
            if first + 8 <= n_blk:
                if wtype == _Q8_0:
                    dot_q8_0(w, off, xq, dx, k, 0, acc[i], 0, 0, 8, 8)
                else:
                    dot_q4_0(w, off, xq, dx, k, 0, acc[i], 0, 0, 8, 8)
            else:
                for t in range(n_blk - first):
                    if wtype == _Q8_0:
                        dot_q8_0(w, off + t * bb, xq, dx, k, t, acc[i], 0, 0, 8, 1)
                    else:
                        dot_q4_0(w, off + t * bb, xq, dx, k, t, acc[i], 0, 0, 8, 1)


# ---- kernels: prange over (row tile, slot part) tasks, column slabs inside ---------------------

@njit(inline="always")
def _is_k(wtype):
    return wtype == _Q4_K or wtype == _Q5_K or wtype == _Q6_K


@njit(inline="always")
def _tile_bytes(wtype):
    return TILE_ROWS * SLAB_BLOCKS * TILE_RECORD if _is_k(wtype) else 0


@njit(inline="always")
def _task_span(task, n_parts, rows, n_groups):
    """Task → (first row, end row, first slot group, end group): row tiles × slot parts."""
    tile, part = task // n_parts, task % n_parts
    r0 = tile * TILE_ROWS
    per_part = -(-n_groups // n_parts)
    return r0, min(rows, r0 + TILE_ROWS), part * per_part, min(n_groups, (part + 1) * per_part)


@njit(inline="always")
def _slot_total(acc, i, j):
    """Row i · slot j from a group's accumulators (8 float lanes per (row, slot), every type),
    summed in `cpu.simd._Vec.sums`' tree: what the N-input row dot does after its last block."""
    a = acc[i, j]
    return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))


@njit(inline="always")
def _slab_times_groups(wtype, w, tile, r0, r1, b0, b1, xq, dx, bs, g0, g1, acc):
    """acc[g − g0] += rows r0..r1−1 · slot group g over the column slab b0..b1−1, every group;
    K-quant rows are decoded into `tile` once for all the groups."""
    if _is_k(wtype):
        _decode_rows(wtype, w, r0, r1, b0, b1, tile)
    for g in range(g0, g1):
        xg = xq[g * 8:(g + 1) * 8]
        if _is_k(wtype):
            _tile_times_group(wtype, tile, r1 - r0, b0, b1, xg, dx[g], bs[g * 8:(g + 1) * 8], acc[g - g0])
        else:
            _rows_times_group(wtype, w, r0, r1 - r0, b0, b1, xg, dx[g], acc[g - g0])


# The kernels are made per weight type (`cpu.variants`): wt, gate_t, up_t are closure constants,
# equal to the wtype arguments, so the helpers' branches on the type are decided at compile time
# and only that type's code is compiled.

def _make_matmul(wt):
    @njit(cache=True, nogil=True, parallel=True)
    def _matmul(wtype, w, xq, dx, bs, out, n_parts):
        rows, n_slots = w.shape[0], out.shape[0]
        n_groups, n_blocks = xq.shape[0] // SLOT_GROUP, xq.shape[1] // act.CHUNK
        n_tiles = -(-rows // TILE_ROWS)
        for task in prange(n_tiles * n_parts):
            r0, r1, g0, g1 = _task_span(task, n_parts, rows, n_groups)
            tile = np.empty(_tile_bytes(wt), np.uint8)
            acc = np.zeros((max(0, g1 - g0), TILE_ROWS, 8, 8), np.float32)
            for b0 in range(0, n_blocks, SLAB_BLOCKS):
                b1 = min(n_blocks, b0 + SLAB_BLOCKS)
                _slab_times_groups(wt, w, tile, r0, r1, b0, b1, xq, dx, bs, g0, g1, acc)
            for g in range(g0, g1):
                for j in range(min(8, n_slots - g * 8)):
                    for i in range(r1 - r0):
                        out[g * 8 + j, r0 + i] = _slot_total(acc[g - g0], i, j)
    return _matmul


def _make_swiglu(gate_t, up_t):
    @njit(cache=True, nogil=True, parallel=True)
    def _swiglu(wtype_gate, w_gate, wtype_up, w_up, act_gate, act_up, h, n_parts):
        """h[n, r] = SiLU(gate) · up: a tile of gate rows and the same up rows, slab by slab; gate
        and up each read x rounded for their type (act_gate, act_up: (xq, dx, bs))."""
        xq, dx, bs = act_gate
        xq_u, dx_u, bs_u = act_up
        rows, n_slots = w_gate.shape[0], h.shape[0]
        n_groups, n_blocks = xq.shape[0] // SLOT_GROUP, xq.shape[1] // act.CHUNK
        n_tiles = -(-rows // TILE_ROWS)
        for task in prange(n_tiles * n_parts):
            r0, r1, g0, g1 = _task_span(task, n_parts, rows, n_groups)
            tile_gate = np.empty(_tile_bytes(gate_t), np.uint8)
            tile_up = np.empty(_tile_bytes(up_t), np.uint8)
            gate = np.zeros((max(0, g1 - g0), TILE_ROWS, 8, 8), np.float32)
            up = np.zeros_like(gate)
            for b0 in range(0, n_blocks, SLAB_BLOCKS):
                b1 = min(n_blocks, b0 + SLAB_BLOCKS)
                _slab_times_groups(gate_t, w_gate, tile_gate, r0, r1, b0, b1, xq, dx, bs, g0, g1, gate)
                _slab_times_groups(up_t, w_up, tile_up, r0, r1, b0, b1, xq_u, dx_u, bs_u, g0, g1, up)
            for g in range(g0, g1):
                for j in range(min(8, n_slots - g * 8)):
                    for i in range(r1 - r0):
                        h[g * 8 + j, r0 + i] = _silu_times(_slot_total(gate[g - g0], i, j),
                                                           _slot_total(up[g - g0], i, j))
    return _swiglu


_matmul = Variants(_make_matmul)        # _matmul(wtype): the kernel for that type
_swiglu = Variants(_make_swiglu)        # _swiglu(gate type, up type)


# ---- entry points ------------------------------------------------------------------------------

def _slot_parts(rows: int, n_slots: int) -> int:
    """Split the slots too when there are few row tiles (a 16-row projection), so every thread
    has work; each part decodes its tile again (cheap next to the products)."""
    tasks_wanted = 4 * numba.get_num_threads()
    n_tiles = -(-rows // TILE_ROWS)
    n_groups = -(-n_slots // SLOT_GROUP)
    return max(1, min(n_groups, -(-tasks_wanted // n_tiles)))


def takes(wtype: int, x) -> bool:
    """True where `matmul` applies: a covered weight type and at least MIN_SLOTS rows of x."""
    return wtype in TYPES and isinstance(x, np.ndarray) and x.ndim == 2 and x.shape[0] >= MIN_SLOTS


def matmul(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, r] = Σ_c W[r, c] · x[n, c], the bits of `cpu.matvec.matvec` (same arguments, checked
    the same way); any weight type (outside TYPES it is `cpu.matvec`). Any number of slots works;
    it pays from MIN_SLOTS on."""
    check_matvec(wtype, w, x, out)
    if wtype not in TYPES:          # no tiles for it: cpu.matvec's kernel serves any number of slots
        run_matvec(wtype, w, x, out)
        return
    if w.shape[0] == 0:
        return
    xq, dx, bs = quantize_slots(wtype, x)
    _matmul(wtype)(wtype, frozen(w), xq, dx, bs, out, _slot_parts(w.shape[0], x.shape[0]))


def swiglu_matmul(wtype_gate: int, w_gate: np.ndarray, wtype_up: int, w_up: np.ndarray,
                  x: np.ndarray, h_out: np.ndarray) -> None:
    """h_out[n, r] = SiLU(W_gate[r]·x[n]) · (W_up[r]·x[n]), the bits of `cpu.ffn.swiglu` (same
    arguments, checked the same way); with a type outside TYPES it is `cpu.ffn.swiglu`."""
    check_swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
    if wtype_gate not in TYPES or wtype_up not in TYPES:
        swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
        return
    if w_gate.shape[0] == 0:
        return
    act_gate = quantize_slots(wtype_gate, x)
    same = act.format_of(wtype_gate) == act.format_of(wtype_up)
    act_up = act_gate if same else quantize_slots(wtype_up, x)
    _swiglu(wtype_gate, wtype_up)(wtype_gate, frozen(w_gate), wtype_up, frozen(w_up), act_gate, act_up, h_out,
                                  _slot_parts(w_gate.shape[0], x.shape[0]))
