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

Where the time goes (2-core Zen 3): 2 multiplies (`vpmaddubsw` + `vpmaddwd`) per 32 weights per
slot is the floor of this arithmetic without VNNI, and Zen 3 issues them on 2 pipes; the inner
loop runs at ~85 % of that bound (~230 GFLOP/s on 2 cores); the rest is the per-block reduction
and float combine that bit identity requires.

Bit identity: each output is the same integer lanes, combined by the same float operations in the
same order (block after block into 8 lanes from 0.0, then one fixed tree over the lanes), as
`cpu.matvec`'s N-input row dot, so slot n of a
many-row call has exactly the bits of a one-slot `matvec` call on x[n] (tested). Chunked prefill
therefore stays equal to token-by-token prefill, and speculative verify (few slots, cpu.matvec)
is untouched.

Covered: Q4_K, Q5_K, Q6_K, Q8_0, Q4_0 (`TYPES`); float weights stay on `cpu.matvec`. The decoded
types (`cpu.ggml_types.DECODED`) have one kernel for any number of slots (`cpu.decoded`, which
already decodes a row tile once for all slots); `matmul` and `swiglu_matmul` hand them on. `takes`
says which calls `cpu.ops` routes here. Activations: `cpu.matvec`'s int8 quantisation, slots padded
to a multiple of 8 (padding slots are zeros, computed and dropped).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cpu.ggml_types import DECODED_IDS, Q4_0, Q4_K, Q5_K, Q6_K, Q8_0, type_name

from .decoded import matvec_decoded
from .ffn import _silu_times, check_swiglu, swiglu
from .matvec import (_PARALLEL_QUANTIZE_MIN, ACT_BLOCK, ACT_QMAX, ACT_SUM, _quantize_block, check_matvec,
                     frozen)
from .simd import (TILE_RECORD, decode_q4_k_block, decode_q5_k_block, decode_q6_k_block, dot_q4_0, dot_q8_0,
                   f32_from_bits, tile_dot_k)
from .variants import Variants

# Prompt chunks only: verify steps (a few slots) stay on cpu.matvec. Measured on the 2-core Zen 3,
# this path already wins from 8 slots (~1.25× at n = 8, Q4_K/Q6_K), so the bound could go lower.
MIN_SLOTS = 16
SLOT_GROUP = 8      # slots per dot call (lanes of the float combine)
TILE_ROWS = 16      # weight rows per tile (a prange task)
SLAB_BLOCKS = 8     # super-blocks (256 columns) per decoded slab: 16 × 8 × 552 B = 69 KiB, in L2

_Q4_K, _Q5_K, _Q6_K, _Q8_0, _Q4_0 = Q4_K.id, Q5_K.id, Q6_K.id, Q8_0.id, Q4_0.id
TYPES = frozenset((_Q4_K, _Q5_K, _Q6_K, _Q8_0, _Q4_0))


# ---- activations: int8 as in cpu.matvec, slots padded to groups of 8 ---------------------------

_ROUND = np.float32(1.5 * 2 ** 23)   # (v + _ROUND) − _ROUND = rint(v) for |v| < 2**22


@njit(inline="always")
def _quantize_full_block(x, x_bits, xq, dx, bs, i, k):
    """`cpu.matvec._quantize_block` for a full 256-column block, written so LLVM vectorises it,
    with the same bytes out: max |x| as an integer max of the bit patterns without the sign
    (monotonic for non-negative floats, and exact), round-half-even by the 1.5·2**23 trick
    (the value np.rint gives). Like the original, only a NaN marks a block non-finite (an inf
    gives amax = inf, inv = 0)."""
    c0 = k * ACT_BLOCK
    # 1-D views and constant trip counts: indices provably ≥ 0, so no wraparound code blocks vectorising
    xs, bits, q = x[i, c0:c0 + ACT_BLOCK], x_bits[i, c0:c0 + ACT_BLOCK], xq[i, c0:c0 + ACT_BLOCK]
    top = np.uint32(0)
    for c in range(ACT_BLOCK):
        top = max(top, bits[c] & np.uint32(0x7FFFFFFF))
    finite = top <= np.uint32(0x7F800000)
    amax = f32_from_bits(top)
    inv = np.float32(ACT_QMAX) / amax if (amax > 0 and finite) else np.float32(0.0)
    dx[k, i] = amax / np.float32(ACT_QMAX) if finite else np.float32(np.nan)
    for c in range(ACT_BLOCK):
        r = (xs[c] * inv + _ROUND) - _ROUND
        q[c] = min(np.int32(ACT_QMAX), max(np.int32(-ACT_QMAX), np.int32(r)))
    sums = bs[i, c0 // ACT_SUM:(c0 + ACT_BLOCK) // ACT_SUM]
    for s in range(ACT_BLOCK // ACT_SUM):
        t = np.int32(0)
        for c in range(ACT_SUM):
            t += np.int32(q[s * ACT_SUM + c])
        sums[s] = t


@njit(inline="always")
def _quantize_slot_block(x, x_bits, xq, dx, bs, i, k):
    """cpu.matvec's quantisation of block k of slot i (the same bytes); padding slots (past x's
    rows) are zeros."""
    if i >= x.shape[0]:
        dx[k, i] = 0.0
        for c in range(k * ACT_BLOCK, (k + 1) * ACT_BLOCK):
            xq[i, c] = 0
        for s in range(k * ACT_BLOCK // ACT_SUM, (k + 1) * ACT_BLOCK // ACT_SUM):
            bs[i, s] = 0
    elif (k + 1) * ACT_BLOCK <= x.shape[1]:
        _quantize_full_block(x, x_bits, xq, dx, bs, i, k)
    else:
        _quantize_block(x, xq, dx, bs, i, k)


@njit(cache=True, nogil=True, parallel=True)
def _quantize_padded(x, x_bits, xq, dx, bs):
    n_blocks = dx.shape[0]
    for task in prange(xq.shape[0] * n_blocks):
        _quantize_slot_block(x, x_bits, xq, dx, bs, task // n_blocks, task % n_blocks)


@njit(cache=True, nogil=True)
def _quantize_padded_serial(x, x_bits, xq, dx, bs):
    for i in range(xq.shape[0]):
        for k in range(dx.shape[0]):
            _quantize_slot_block(x, x_bits, xq, dx, bs, i, k)


def quantize_slots(x: np.ndarray):
    """The int8 activations of `cpu.matvec.quantize_activations`, laid out for the tile kernels by
    groups of SLOT_GROUP slots (n rounded up; padding slots are zeros):
      xq (n_pad, cols↑256) int8 — group g is rows 8g..8g+7;
      dx (groups, blocks, 8) f32 — the scale of block b of slot 8g+j at [g, b, j];
      bs (n_pad, cols↑256 / 16) int16 — the activation sums per 16."""
    n, cols = x.shape
    n_blocks = -(-cols // ACT_BLOCK)
    n_pad = -(-n // SLOT_GROUP) * SLOT_GROUP
    n_groups = n_pad // SLOT_GROUP
    xq = np.empty((n_pad, n_blocks * ACT_BLOCK), np.int8)
    dx = np.empty((n_blocks, n_pad), np.float32)
    bs = np.empty((n_pad, n_blocks * ACT_BLOCK // ACT_SUM), np.int16)
    quantize = _quantize_padded if x.size >= _PARALLEL_QUANTIZE_MIN else _quantize_padded_serial
    quantize(x, x.view(np.uint32), xq, dx, bs)
    dx_g = np.ascontiguousarray(dx.reshape(n_blocks, n_groups, SLOT_GROUP).transpose(1, 0, 2))
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
    """acc[i, 0, j] += row r0+i of a Q8_0/Q4_0 matrix · slot j of the group over activation blocks
    k0..k1−1: `cpu.matvec`'s spans (8 blocks under one activation scale, then a block-by-block
    tail) with all 8 slots per call, activation block outer."""
    bb = 34 if wtype == _Q8_0 else 18
    n_blk = w.shape[1] // bb
    for k in range(k0, k1):
        first = k * 8
        for i in range(n_rows):
            off = (r0 + i) * w.shape[1] + first * bb
            if first + 8 <= n_blk:
                if wtype == _Q8_0:
                    dot_q8_0(w, off, xq, dx, k, 0, acc[i, 0], 0, 0, 8, 8)
                else:
                    dot_q4_0(w, off, xq, dx, k, 0, acc[i, 0], 0, 0, 8, 8)
            else:
                for t in range(n_blk - first):
                    if wtype == _Q8_0:
                        dot_q8_0(w, off + t * bb, xq, dx, k, 32 * t, acc[i, 0], 0, 0, 8, 1)
                    else:
                        dot_q4_0(w, off + t * bb, xq, dx, k, 32 * t, acc[i, 0], 0, 0, 8, 1)


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
def _slot_total(wtype, acc, i, j):
    """Row i · slot j from a group's accumulators: K-quants keep 8 float lanes per (row, slot),
    summed here in `cpu.simd._Vec.sums`' tree (what the N-input row dot does after its last
    block); Q8_0/Q4_0 keep one float per slot, in lanes row 0."""
    if _is_k(wtype):
        a = acc[i, j]
        return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
    return acc[i, 0, j]


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
        n_groups, n_blocks = dx.shape[0], dx.shape[1]
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
                        out[g * 8 + j, r0 + i] = _slot_total(wt, acc[g - g0], i, j)
    return _matmul


def _make_swiglu(gate_t, up_t):
    @njit(cache=True, nogil=True, parallel=True)
    def _swiglu(wtype_gate, w_gate, wtype_up, w_up, xq, dx, bs, h, n_parts):
        """h[n, r] = SiLU(gate) · up: a tile of gate rows and the same up rows, slab by slab."""
        rows, n_slots = w_gate.shape[0], h.shape[0]
        n_groups, n_blocks = dx.shape[0], dx.shape[1]
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
                _slab_times_groups(up_t, w_up, tile_up, r0, r1, b0, b1, xq, dx, bs, g0, g1, up)
            for g in range(g0, g1):
                for j in range(min(8, n_slots - g * 8)):
                    for i in range(r1 - r0):
                        h[g * 8 + j, r0 + i] = _silu_times(_slot_total(gate_t, gate[g - g0], i, j),
                                                           _slot_total(up_t, up[g - g0], i, j))
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


def _check_covered(*wtypes: int) -> None:
    for t in wtypes:
        if t not in TYPES:
            raise ValueError(f"cpu.matmul covers {', '.join(sorted(type_name(i) for i in TYPES))}, "
                             f"not {type_name(t)} (use cpu.matvec)")


def matmul(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, r] = Σ_c W[r, c] · x[n, c], the bits of `cpu.matvec.matvec` (same arguments, checked
    the same way); wtype in TYPES or a decoded type. Any number of slots works; it pays from
    MIN_SLOTS on."""
    check_matvec(wtype, w, x, out)
    if wtype in DECODED_IDS:
        matvec_decoded(wtype, frozen(w), x, out)
        return
    _check_covered(wtype)
    if w.shape[0] == 0:
        return
    xq, dx, bs = quantize_slots(x)
    _matmul(wtype)(wtype, frozen(w), xq, dx, bs, out, _slot_parts(w.shape[0], x.shape[0]))


def swiglu_matmul(wtype_gate: int, w_gate: np.ndarray, wtype_up: int, w_up: np.ndarray,
                  x: np.ndarray, h_out: np.ndarray) -> None:
    """h_out[n, r] = SiLU(W_gate[r]·x[n]) · (W_up[r]·x[n]), the bits of `cpu.ffn.swiglu` (same
    arguments, checked the same way); both types in TYPES, or either a decoded type (then it is
    `cpu.ffn.swiglu`)."""
    check_swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
    if wtype_gate in DECODED_IDS or wtype_up in DECODED_IDS:
        swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
        return
    _check_covered(wtype_gate, wtype_up)
    if w_gate.shape[0] == 0:
        return
    xq, dx, bs = quantize_slots(x)
    _swiglu(wtype_gate, wtype_up)(wtype_gate, frozen(w_gate), wtype_up, frozen(w_up), xq, dx, bs, h_out,
                                  _slot_parts(w_gate.shape[0], x.shape[0]))
