"""All routed experts of one MoE layer in one kernel call (quantised expert weights).

Why: run expert by expert from Python, a decode step pays ~5 kernel calls per selected expert per
layer (tens of µs each); with top-8 of small experts that overhead, not the weight stream, sets
the speed. Here one call does every (row, selected expert) pair:

  1. group the (row, rank) pairs by expert (a counting sort) and gather the int8 activations of x
     (quantised once) in that order: group g holds the m rows routed to expert e_g as one
     contiguous block (the layout the row-dot helpers read);
  2. h = SiLU(W_gate,e x) ⊙ (W_up,e x) for every group, a prange over (group, row tile) items, so
     one pass over an expert's rows serves all the rows routed to it;
  3. quantise h row by row; 4. y = W_down,e h, again over (group, row tile) items;
  5. out[i] = Σ_rank w[i, rank] · y[i, rank], each row in its own top-k rank order.

Every step is the same arithmetic, on the same bytes, as the one-expert-at-a-time path
(`cpu.ffn.swiglu` then `cpu.matvec.matvec` on the gathered rows, then the rank-order sum): the
activation quantisation is per row, the row dots give each slot the bits of a one-slot call, and
the sum order per row is fixed. So the result has exactly that path's bits, and row i of an n-row
call has exactly the bits of the 1-row call on x[i].

Expert matrices arrive as one 2-D row array per kind plus the first row of each expert in it
(`expert_rows`), so a fused gate_up tensor (gate and up interleaved per expert) needs no copy
and every kernel sees the same array type (one compiled specialisation).
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from .ffn import _silu_times
from .matvec import ACT_BLOCK, ACT_SUM, _quantize_block, row_dot_quant


@njit(inline="always")
def _block(flat, start, m, width):
    """Rows [start, start+m) of a (·, width) matrix stored flat: a C-contiguous (m, width) view."""
    return flat[start * width:(start + m) * width].reshape((m, width))


@njit(inline="always")
def _scales(flat, start, m, n_blocks):
    """Group-local block-major activation scales (n_blocks, m), stored at n_blocks·start."""
    return flat[n_blocks * start:n_blocks * (start + m)].reshape((n_blocks, m))


@njit(cache=True, nogil=True)
def _group_slots(experts, n_expert):
    """Slots = the n·k (row, rank) pairs, ordered by expert (a stable counting sort: rows ascend
    within a group). Returns slot_row (row of each slot), slot_of (slot of pair i·k + rank),
    group_start (n_groups + 1 slot bounds) and group_expert (the expert of each group)."""
    n, k = experts.shape
    first = np.zeros(n_expert + 1, np.int64)       # first[e + 1] counts pairs routed to e, then sums
    for i in range(n):
        for rank in range(k):
            first[experts[i, rank] + 1] += 1
    n_groups = 0
    for e in range(n_expert):
        n_groups += first[e + 1] > 0
        first[e + 1] += first[e]
    group_start = np.empty(n_groups + 1, np.int64)
    group_expert = np.empty(n_groups, np.int64)
    g = 0
    for e in range(n_expert):
        if first[e + 1] > first[e]:
            group_start[g], group_expert[g] = first[e], e
            g += 1
    group_start[n_groups] = n * k
    slot_row = np.empty(n * k, np.int64)
    slot_of = np.empty(n * k, np.int64)
    for i in range(n):
        for rank in range(k):
            s = first[experts[i, rank]]
            first[experts[i, rank]] += 1
            slot_row[s], slot_of[i * k + rank] = i, s
    return slot_row, slot_of, group_start, group_expert


@njit(cache=True, nogil=True, parallel=True)
def routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, xq, dx, bs, experts, weights,
                   out, work_items, pf):
    """out (n, D) = Σ_rank weights[i, rank] · (expert experts[i, rank])(x[i]).

    wtypes: (gate, up, down) ggml type ids; w_*: (rows, row_bytes) uint8, C-contiguous, read-only;
    expert_rows: (3, E) int64, the row of w_gate / w_up / w_down where expert e's matrix starts.
    xq, dx, bs: `cpu.matvec.quantize_activations(x)`; experts, weights: `cpu.moe.route`.
    work_items: how many (group, row tile) items to aim for per projection (a few per thread)."""
    n, D = out.shape
    k = weights.shape[1]
    slot_row, slot_of, group_start, group_expert = _group_slots(experts, expert_rows.shape[1])
    n_slots = slot_row.shape[0]
    n_groups = group_expert.shape[0]
    tiles_up = max(1, min(n_ff, -(-work_items // n_groups)))
    tiles_down = max(1, min(D, -(-work_items // n_groups)))
    x_cols, x_blocks = xq.shape[1], dx.shape[0]
    h_blocks = -(-n_ff // ACT_BLOCK)
    h_cols = h_blocks * ACT_BLOCK
    gate_up = (w_gate, w_up)

    # 1. the activations of x in group order
    gxq = np.empty(n_slots * x_cols, np.int8)
    gdx = np.empty(n_slots * x_blocks, np.float32)
    gbs = np.empty(n_slots * (x_cols // ACT_SUM), np.int16)
    for g in prange(n_groups):
        s0, m = group_start[g], group_start[g + 1] - group_start[g]
        q, d, b = _block(gxq, s0, m, x_cols), _scales(gdx, s0, m, x_blocks), _block(gbs, s0, m, x_cols // ACT_SUM)
        for j in range(m):
            row = slot_row[s0 + j]
            q[j, :] = xq[row]
            b[j, :] = bs[row]
            for blk in range(x_blocks):
                d[blk, j] = dx[blk, row]

    # 2. h = SiLU(gate) ⊙ up, per (group, row tile)
    h = np.empty(n_slots * n_ff, np.float32)
    per_tile = -(-n_ff // tiles_up)
    for item in prange(n_groups * tiles_up):
        g, t = item // tiles_up, item % tiles_up
        s0, m = group_start[g], group_start[g + 1] - group_start[g]
        e = group_expert[g]
        q, d, b = _block(gxq, s0, m, x_cols), _scales(gdx, s0, m, x_blocks), _block(gbs, s0, m, x_cols // ACT_SUM)
        hg = _block(h, s0, m, n_ff)
        gu = np.empty((2, m), np.float32)   # gate and up of one row, all the group's slots
        for r in range(t * per_tile, min(n_ff, (t + 1) * per_tile)):
            for kind in range(2):   # a loop, not two calls: one inlined copy of the row-dot code
                row_dot_quant(wtypes[kind], gate_up[kind], expert_rows[kind, e] + r, q, d, b, gu[kind], pf)
            for j in range(m):
                hg[j, r] = _silu_times(gu[0, j], gu[1, j])

    # 3. int8 activations of h, per (slot, activation block); each group's scales block-major
    hq = np.empty(n_slots * h_cols, np.int8)
    hdx = np.empty(n_slots * h_blocks, np.float32)
    hbs = np.empty(n_slots * (h_cols // ACT_SUM), np.int16)
    for task in prange(n_groups * h_blocks):
        g, blk = task // h_blocks, task % h_blocks
        s0, m = group_start[g], group_start[g + 1] - group_start[g]
        hg = _block(h, s0, m, n_ff)
        q, d, b = _block(hq, s0, m, h_cols), _scales(hdx, s0, m, h_blocks), _block(hbs, s0, m, h_cols // ACT_SUM)
        for j in range(m):
            _quantize_block(hg, q, d, b, j, blk)

    # 4. y = W_down h, per (group, row tile)
    y = np.empty(n_slots * D, np.float32)
    per_tile = -(-D // tiles_down)
    for item in prange(n_groups * tiles_down):
        g, t = item // tiles_down, item % tiles_down
        s0, m = group_start[g], group_start[g + 1] - group_start[g]
        e = group_expert[g]
        q, d, b = _block(hq, s0, m, h_cols), _scales(hdx, s0, m, h_blocks), _block(hbs, s0, m, h_cols // ACT_SUM)
        yg = _block(y, s0, m, D)
        acc = np.empty(m, np.float32)
        for r in range(t * per_tile, min(D, (t + 1) * per_tile)):
            row_dot_quant(wtypes[2], w_down, expert_rows[2, e] + r, q, d, b, acc, pf)
            for j in range(m):
                yg[j, r] = acc[j]

    # 5. the weighted sum, ranks in order (as cpu.moe._weighted_sum)
    y2 = y.reshape((n_slots, D))
    for i in prange(n):
        s = slot_of[i * k]
        for c in range(D):
            out[i, c] = weights[i, 0] * y2[s, c]
        for rank in range(1, k):
            w = weights[i, rank]
            s = slot_of[i * k + rank]
            for c in range(D):
                out[i, c] += w * y2[s, c]
