"""All routed experts of one MoE layer in two kernel calls, for expert weights of the decoded types.

`cpu.moe_kernel` runs experts whose three kinds all have SIMD row dots (int8 activations). An
expert stack of any other quantised type (a `cpu.ggml_types.DECODED` type without a row dot in
`cpu.matvec.ROW_READERS`; none since Q4_1, Q5_1 and IQ1_M got theirs, so `cpu.moe` routes no
layer here by itself now) — alone or mixed with SIMD types — would run here, with `cpu.decoded`'s arithmetic: blocks
decoded to float32 (`cpu.blocks.decode_block`), one block dot per slot, and the activations rounded as
llama.cpp rounds them for each matrix's type (`cpu.activations.dequantized`: x once per format
for gate and up, h for down), as the other paths do.

Steps (the slots are the (row, rank) pairs, grouped by expert with `cpu.moe_kernel`'s counting
sort; the x rows of each group gathered into one contiguous block first):
  A. one parallel region over (group, tile of n_ff rows): h = SiLU(W_gate,e x) ⊙ (W_up,e x), the
     gate and up rows of a tile decoded once for all the group's slots; then h rounded for the
     down type, row by row;
  B. one over (group, tile of D rows): y = W_down,e h;
  C. out[i] = Σ_rank w[i, rank] · y[slot of (i, rank)], in top-k rank order (`_rank_sum`).
Each (row, slot) product is `cpu.decoded.rows_dot`'s, whose bits do not depend on the other
slots, the rounding of a slot's activations reads that slot only, and the rank sum has a fixed
order per row: row i of an n-row call has exactly the bits of the 1-row call on x[i] (lossless
drafting relies on it), whichever thread ran which tile.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from cpu.ggml_types import SUPPORTED

from . import activations as act
from .decoded import ROW_TILE, rows_dot
from .ffn import _silu_times
from .moe_kernel import _rank_sum, group_slots
from .variants import Variants

TILES_PER_WORKER = 4     # tasks per thread and step, so a slow thread takes fewer


def _make_gate_up(gate_t, up_t):
    (g_elems, g_size), (u_elems, u_size) = ((SUPPORTED[t].block_elems, SUPPORTED[t].block_bytes)
                                            for t in (gate_t, up_t))
    y_elems = max(g_elems, u_elems)

    @njit(cache=True, nogil=True, parallel=True)
    def _gate_up(w_gate, w_up, expert_rows, xg, xu, group_start, group_expert, h, tiles):
        """Step A: h = SiLU(gate) ⊙ up for every slot (xg, xu: x as gate and up meet it)."""
        n_groups = group_expert.shape[0]
        n_ff = h.shape[1]
        fg, fu = w_gate.reshape(w_gate.size), w_up.reshape(w_up.size)
        per = -(-n_ff // tiles)
        for task in prange(n_groups * tiles):
            g, tile = task // tiles, task % tiles
            s0, s1, e = group_start[g], group_start[g + 1], group_expert[g]
            buf = np.empty((ROW_TILE, y_elems), np.float32)
            gate = np.empty((ROW_TILE, s1 - s0), np.float32)
            up = np.empty((ROW_TILE, s1 - s0), np.float32)
            end = min(n_ff, (tile + 1) * per)
            for r0 in range(tile * per, end, ROW_TILE):
                m = min(ROW_TILE, end - r0)
                rows_dot(gate_t, g_elems, g_size, fg, w_gate.shape[1], expert_rows[0, e] + r0, m, xg[s0:s1], buf, gate)
                rows_dot(up_t, u_elems, u_size, fu, w_up.shape[1], expert_rows[1, e] + r0, m, xu[s0:s1], buf, up)
                for i in range(m):
                    for j in range(s1 - s0):
                        h[s0 + j, r0 + i] = _silu_times(gate[i, j], up[i, j])
    return _gate_up


def _make_down(down_t):
    y_elems, d_size = SUPPORTED[down_t].block_elems, SUPPORTED[down_t].block_bytes

    @njit(cache=True, nogil=True, parallel=True)
    def _down(w_down, expert_rows, h, group_start, group_expert, y, tiles):
        """Step B: y = W_down h for every slot."""
        n_groups = group_expert.shape[0]
        D = y.shape[1]
        fd = w_down.reshape(w_down.size)
        per = -(-D // tiles)
        for task in prange(n_groups * tiles):
            g, tile = task // tiles, task % tiles
            s0, s1, e = group_start[g], group_start[g + 1], group_expert[g]
            buf = np.empty((ROW_TILE, y_elems), np.float32)
            acc = np.empty((ROW_TILE, s1 - s0), np.float32)
            end = min(D, (tile + 1) * per)
            for r0 in range(tile * per, end, ROW_TILE):
                m = min(ROW_TILE, end - r0)
                rows_dot(down_t, y_elems, d_size, fd, w_down.shape[1], expert_rows[2, e] + r0, m, h[s0:s1], buf, acc)
                for i in range(m):
                    for j in range(s1 - s0):
                        y[s0 + j, r0 + i] = acc[i, j]
    return _down


_gate_up = Variants(_make_gate_up)      # _gate_up(gate type, up type)
_down = Variants(_make_down)            # _down(down type)


@njit(cache=True, nogil=True)
def _rank_sums(y, slot_of, weights, out):
    for i in range(out.shape[0]):
        _rank_sum(y, slot_of, weights, out, i)


def _tiles(rows: int, n_groups: int) -> int:
    """Row tiles per group: about TILES_PER_WORKER tasks per thread over all groups, each tile at
    least ROW_TILE rows."""
    want = -(-TILES_PER_WORKER * numba.get_num_threads() // max(1, n_groups))
    return max(1, min(want, -(-rows // ROW_TILE)))


def routed_experts_decoded(wtypes, w_gate, w_up, w_down, expert_rows, n_ff: int, x: np.ndarray,
                           experts: np.ndarray, weights: np.ndarray, out: np.ndarray) -> int:
    """`cpu.moe_kernel.routed_experts` (same arguments but the thread count and prefetch, same
    meaning, pairs marked ~e left out) with the decoded-block arithmetic. Returns how many distinct
    experts `experts` names."""
    n, D = out.shape
    n_expert = expert_rows.shape[1]
    slot_row, slot_of, group_start, group_expert = group_slots(experts, n_expert)
    xs = np.ascontiguousarray(x[slot_row[:group_start[-1]]])
    n_slots = xs.shape[0]
    h = np.empty((n_slots, n_ff), np.float32)
    y = np.empty((n_slots, D), np.float32)
    n_groups = group_expert.shape[0]
    if n_groups:
        gate_t, up_t, down_t = wtypes
        xg = act.dequantized(act.format_of(gate_t), xs)
        xu = xg if act.format_of(up_t) == act.format_of(gate_t) else act.dequantized(act.format_of(up_t), xs)
        _gate_up(gate_t, up_t)(w_gate, w_up, expert_rows, xg, xu, group_start, group_expert, h,
                               _tiles(n_ff, n_groups))
        h = act.dequantized(act.format_of(down_t), h)
        _down(down_t)(w_down, expert_rows, h, group_start, group_expert, y, _tiles(D, n_groups))
    _rank_sums(y, slot_of, weights, out)
    ids = np.where(experts >= 0, experts, ~experts)
    return int(np.unique(ids).size)
