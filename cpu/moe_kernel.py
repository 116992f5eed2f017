"""All routed experts of one MoE layer in one kernel call (quantised expert weights).

Why: run expert by expert from Python, a decode step pays ~5 kernel calls per selected expert per
layer (tens of µs each); with top-8 of small experts that overhead, not the weight stream, sets
the speed. Here one call does every (row, selected expert) pair; a decode step wakes the thread
pool twice (a few µs each on 16 cores) and allocates nothing:

  0. serially: group the (row, rank) slots by expert (a counting sort) and quantise each row of x
     to int8 once (a parallel region of its own only for prompt-sized calls);
  A. one item per thread, each a run of the step's (group, h row) pairs (`_share_rows`: runs
     of equal cost, crossing groups where they fall): copy the group's m rows of int8 x into
     this thread's bank (the contiguous (m, D) block the row dots read), then
     h = SiLU(W_gate,e x) ⊙ (W_up,e x), and int8 activations for the blocks of h it holds
     whole (those a run boundary splits: afterwards, serially for a decode step). Runs, not
     whole-group tiles: with the GPU's expert cache taking some experts a decode step leaves
     2-6 groups here, and 5 groups of 2 blocks tile 16 threads in two rounds;
  B. the same for y = W_down,e h over the (group, output row) pairs;
  C. out[i] = Σ_rank w[i, rank] · y[i, rank], each row in its own top-k rank order (serially for
     a decode step, where a region would cost more than the sum).

Every step is the same arithmetic, on the same bytes, as the one-expert-at-a-time path
(`cpu.ffn.swiglu` then `cpu.matvec.matvec` on the gathered rows, then the rank-order sum): the
activation quantisation is per row, the row dots give each slot the bits of a one-slot call, and
the sum order per row is fixed. So the result has exactly that path's bits, and row i of an n-row
call has exactly the bits of the 1-row call on x[i] (lossless drafting relies on it).

Expert matrices arrive as one 2-D row array per kind plus the first row of each expert in it
(`expert_rows`), so a fused gate_up tensor (gate and up interleaved per expert) needs no copy
and every kernel sees the same array type (one compiled specialisation). Temporaries live in a
`Workspace` that only grows; per-thread scratch sits in banks a whole number of cache lines
apart (threads writing one line — false sharing — halved the speed).

Numba trap kept out of here: in a parallel function a slice assignment (`a[j, :] = b[r]`) becomes
a parallel region of its own, even in serial code; copies are written as element loops.
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from numba import get_thread_id, njit, prange

from .ffn import _silu_times
from .matvec import ACT_BLOCK, ACT_SUM, _quantize_block, row_dot_quant

# Below this many elements, quantising x (step 0) and the weighted sum (C) run serially: a
# parallel region costs more than they do (decode); above, they get one region each.
_PARALLEL_MIN = 1 << 15
# the activation blocks of h that a run boundary splits are quantised after step A's region,
# serially up to this many (slot, block)s, in a region of their own above: the block was written
# by other cores, and one thread pulling it over costs ~5 µs a block on the H200 box's Xeon
# against ~6 µs for a region
_SERIAL_H_BLOCKS = 2
# the cost of reading one weight row, in row dots (one row dot per slot of the group): how a
# run of (group, row) pairs is weighed when the step's work is shared out (`_share_rows`)
_ROW_READ = 2
_LINE = 64                       # bytes of a cache line


@njit(inline="always")
def _block(flat, start, m, width):
    """Rows [start, start+m) of a (·, width) matrix stored flat: a C-contiguous (m, width) view."""
    return flat[start * width:(start + m) * width].reshape((m, width))


@njit(inline="always")
def _scales(flat, start, m, n_blocks):
    """Group-local block-major activation scales (n_blocks, m), stored at n_blocks·start."""
    return flat[n_blocks * start:n_blocks * (start + m)].reshape((n_blocks, m))


@njit(inline="always")
def _lines(n_elements, itemsize):
    """n_elements rounded up to whole cache lines, plus one spare line."""
    per_line = _LINE // itemsize
    return (n_elements + per_line - 1) // per_line * per_line + per_line


@njit(cache=True, nogil=True)
def _layout(n, k, D, n_ff, n_expert, n_banks, n_items):
    """Workspace sizes (elements of int8, float32, int16, int64) and per-thread bank strides
    (int8, float32, int16) for `_routed_experts`."""
    n_slots = n * k
    x_blocks, h_blocks = -(-D // ACT_BLOCK), -(-n_ff // ACT_BLOCK)
    x_cols, h_cols = x_blocks * ACT_BLOCK, h_blocks * ACT_BLOCK
    bank_i8 = _lines(n * x_cols, 1)                  # a group's int8 x (m ≤ n rows: an expert
    bank_f32 = _lines(x_blocks * n + 2 * n, 4)       # appears once per row), its scales, dots
    bank_i16 = _lines(n * x_cols // ACT_SUM, 2)
    sizes = (n * x_cols + n_slots * h_cols + n_banks * bank_i8,
             x_blocks * n + n_slots * (n_ff + h_blocks + D) + n_banks * bank_f32,
             (n * x_cols + n_slots * h_cols) // ACT_SUM + n_banks * bank_i16,
             n_expert + 3 + 4 * n_slots + 2 * n_items)
    return sizes, (bank_i8, bank_f32, bank_i16)


@njit(cache=True, nogil=True)
def _group_slots_into(experts, skip, n_expert, first, slot_row, slot_of, group_start, group_expert):
    """Slots = the (row, rank) pairs whose expert e has skip[e] < 0 (the others run elsewhere:
    the GPU's expert cache), ordered by expert (a stable counting sort: rows ascend within a group). Fills slot_row (row of each
    slot), slot_of (slot of pair i·k + rank, −1 when skipped), group_start (n_groups + 1 slot
    bounds) and group_expert (the expert of each group), using `first` (≥ n_expert + 1 int64)
    as the counter; returns n_groups."""
    n, k = experts.shape
    for e in range(n_expert + 1):                  # first[e + 1] counts pairs routed to e, then sums
        first[e] = 0
    for i in range(n):
        for rank in range(k):
            if skip[experts[i, rank]] < 0:
                first[experts[i, rank] + 1] += 1
    n_groups = 0
    for e in range(n_expert):
        if first[e + 1] > 0:
            group_start[n_groups], group_expert[n_groups] = first[e], e
            n_groups += 1
        first[e + 1] += first[e]
    group_start[n_groups] = first[n_expert]
    for i in range(n):
        for rank in range(k):
            e = experts[i, rank]
            if skip[e] >= 0:
                slot_of[i * k + rank] = -1
                continue
            s = first[e]
            first[e] += 1
            slot_row[s], slot_of[i * k + rank] = i, s
    return n_groups


def group_slots(experts: np.ndarray, n_expert: int):
    """`_group_slots_into` with fresh arrays and nothing skipped: (slot_row, slot_of,
    group_start, group_expert)."""
    n_slots = experts.size
    first = np.empty(n_expert + 1, np.int64)
    slot_row, slot_of = np.empty(n_slots, np.int64), np.empty(n_slots, np.int64)
    group_start, group_expert = np.empty(n_slots + 1, np.int64), np.empty(n_slots, np.int64)
    g = _group_slots_into(experts, no_skip(n_expert), n_expert, first, slot_row, slot_of, group_start, group_expert)
    return slot_row, slot_of, group_start[:g + 1], group_expert[:g]


@njit(inline="always")
def _rank_sum(y, slot_of, weights, out, i):
    """out[i] = Σ_rank weights[i, rank] · y[slot of (i, rank)], ranks in order (as
    cpu.moe._weighted_sum), skipped pairs left out (zeros when all are)."""
    k, D = weights.shape[1], out.shape[1]
    started = False
    for rank in range(k):
        s = slot_of[i * k + rank]
        if s < 0:
            continue
        w = weights[i, rank]
        if started:
            for c in range(D):
                out[i, c] += w * y[s, c]
        else:
            for c in range(D):
                out[i, c] = w * y[s, c]
            started = True
    if not started:
        for c in range(D):
            out[i, c] = 0.0


@njit(inline="always")
def _quantize_group_block(h, hq, hdx, hbs, group_start, g, n_ff, h_cols, h_blocks, hs, blk):
    """Activation block blk of the rows of h of group g (its slots) to int8."""
    s0, m = group_start[g], group_start[g + 1] - group_start[g]
    hg = _block(h, s0, m, n_ff)
    hqg, hdg, hbg = _block(hq, s0, m, h_cols), _scales(hdx, s0, m, h_blocks), _block(hbs, s0, m, hs)
    for j in range(m):
        _quantize_block(hg, hqg, hdg, hbg, j, blk)


@njit(inline="always")
def _row_cost(group_start, g):
    """The cost of one row of group g: its m row dots and the read of its weights."""
    return group_start[g + 1] - group_start[g] + _ROW_READ


@njit(inline="always")
def _share_rows(group_start, n_groups, n_rows, n_items, starts):
    """Splits the (group, row) pairs of a step, in group-then-row order (pair g·n_rows + r), into
    n_items runs of about equal cost: starts[item] is the first pair of the item's run,
    starts[n_items] the end. A row of a group of m slots costs m + _ROW_READ (its m row dots and
    the read of its weights): a prompt chunk's groups differ in m, a decode step's do not."""
    total = 0
    for g in range(n_groups):
        total += _row_cost(group_start, g) * n_rows
    g, before = 0, 0                       # cost of the groups ahead of group g
    for item in range(n_items):
        target = total * item // n_items
        while g < n_groups and before + _row_cost(group_start, g) * n_rows <= target:
            before += _row_cost(group_start, g) * n_rows
            g += 1
        per_row = _row_cost(group_start, g) if g < n_groups else 1
        starts[item] = g * n_rows + min(n_rows, -(-(target - before) // per_row))
    starts[n_items] = n_groups * n_rows


@njit(inline="always")
def _segment(u, end, n_rows):
    """The part of the run [u, end) of (group, row) pairs that lies in u's group: (group, first
    row, end row)."""
    g = u // n_rows
    r0 = u - g * n_rows
    return g, r0, min(n_rows, r0 + end - u)


@njit(cache=True, nogil=True, parallel=True)
def _routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts, skip, weights, out,
                    ws_i8, ws_f32, ws_i16, ws_i64, n_banks, n_items, pf, last_stage):
    n, D = out.shape
    k = weights.shape[1]
    n_expert = expert_rows.shape[1]
    n_slots = n * k
    x_blocks, h_blocks = -(-D // ACT_BLOCK), -(-n_ff // ACT_BLOCK)
    x_cols, h_cols = x_blocks * ACT_BLOCK, h_blocks * ACT_BLOCK
    xs, hs = x_cols // ACT_SUM, h_cols // ACT_SUM
    gate_up = (w_gate, w_up)

    # carve the workspace (`_layout`): shared arrays first, then the per-thread banks
    _, (bank_i8, bank_f32, bank_i16) = _layout(n, k, D, n_ff, n_expert, n_banks, n_items)
    xq = ws_i8[:n * x_cols].reshape((n, x_cols))
    hq = ws_i8[n * x_cols:n * x_cols + n_slots * h_cols]
    banks_i8 = ws_i8[n * x_cols + n_slots * h_cols:]
    bs = ws_i16[:n * xs].reshape((n, xs))
    hbs = ws_i16[n * xs:n * xs + n_slots * hs]
    banks_i16 = ws_i16[n * xs + n_slots * hs:]
    dx = ws_f32[:x_blocks * n].reshape((x_blocks, n))
    o = x_blocks * n
    h = ws_f32[o:o + n_slots * n_ff]
    o += n_slots * n_ff
    hdx = ws_f32[o:o + n_slots * h_blocks]
    o += n_slots * h_blocks
    y = ws_f32[o:o + n_slots * D].reshape((n_slots, D))
    banks_f32 = ws_f32[o + n_slots * D:]
    first = ws_i64[:n_expert + 1]
    slot_row = ws_i64[n_expert + 1:n_expert + 1 + n_slots]
    slot_of = ws_i64[n_expert + 1 + n_slots:n_expert + 1 + 2 * n_slots]
    group_start = ws_i64[n_expert + 1 + 2 * n_slots:n_expert + 2 + 3 * n_slots]
    group_expert = ws_i64[n_expert + 2 + 3 * n_slots:n_expert + 2 + 4 * n_slots]

    # 0. group the slots; quantise x once per row
    n_groups = _group_slots_into(experts, skip, n_expert, first, slot_row, slot_of, group_start, group_expert)
    if n * x_cols >= _PARALLEL_MIN:
        for task in prange(n * x_blocks):
            _quantize_block(x, xq, dx, bs, task // x_blocks, task % x_blocks)
    else:
        for i in range(n):
            for blk in range(x_blocks):
                _quantize_block(x, xq, dx, bs, i, blk)
    if last_stage == 0:
        return

    # A. per item (one per thread): its run of the (group, h row) pairs, h = SiLU(gate) ⊙ up for
    # the group's rows of x (copied into the thread's bank when the run enters the group), and
    # h to int8 per (group, activation block). Runs may cross groups: with the GPU's cache
    # taking some experts, a decode step leaves 2-6 groups here, which no whole-group tiling
    # spreads evenly over 16 threads. (No groups when every pair runs elsewhere: A and B do
    # nothing, C writes zeros.)
    starts = ws_i64[n_expert + 2 + 4 * n_slots:n_expert + 3 + 4 * n_slots + n_items]
    _share_rows(group_start, n_groups, n_ff, n_items, starts)
    for item in prange(n_items):
        me = get_thread_id()
        q = banks_i8[me * bank_i8:]
        b = banks_i16[me * bank_i16:]
        f32 = banks_f32[me * bank_f32:]
        u = starts[item]
        while u < starts[item + 1]:
            g, r0, r1 = _segment(u, starts[item + 1], n_ff)
            u += r1 - r0
            s0, m = group_start[g], group_start[g + 1] - group_start[g]
            qg, bg, d = _block(q, 0, m, x_cols), _block(b, 0, m, xs), _scales(f32, 0, m, x_blocks)
            gu = f32[x_blocks * m:x_blocks * m + 2 * m].reshape((2, m))   # gate and up of one row
            for j in range(m):
                row = slot_row[s0 + j]
                for c in range(x_cols):
                    qg[j, c] = xq[row, c]
                for c in range(xs):
                    bg[j, c] = bs[row, c]
                for blk in range(x_blocks):
                    d[blk, j] = dx[blk, row]
            hg = _block(h, s0, m, n_ff)
            e = group_expert[g]
            for r in range(r0, r1):
                for kind in range(2):   # a loop, not two calls: one inlined copy of the row-dot code
                    row_dot_quant(wtypes[kind], gate_up[kind], expert_rows[kind, e] + r, qg, d, bg, gu[kind], pf)
                for j in range(m):
                    hg[j, r] = _silu_times(gu[0, j], gu[1, j])
            # the activation blocks of h this segment holds whole go to int8 here
            for blk in range(-(-r0 // ACT_BLOCK), h_blocks):
                if min(n_ff, (blk + 1) * ACT_BLOCK) > r1:
                    break
                _quantize_group_block(h, hq, hdx, hbs, group_start, g, n_ff, h_cols, h_blocks, hs, blk)
    # ... and the ones a run boundary splits (a run starts strictly inside), afterwards
    split = ws_i64[n_expert + 3 + 4 * n_slots + n_items:n_expert + 3 + 4 * n_slots + 2 * n_items]
    n_split, split_rows = 0, 0
    for item in range(1, n_items):
        g = starts[item] // n_ff
        r = starts[item] - g * n_ff
        if g < n_groups and r % ACT_BLOCK != 0:
            block = g * h_blocks + r // ACT_BLOCK
            if n_split == 0 or split[n_split - 1] != block:
                split[n_split] = block
                n_split += 1
                split_rows += group_start[g + 1] - group_start[g]
    if split_rows > _SERIAL_H_BLOCKS:
        for i in prange(n_split):
            _quantize_group_block(h, hq, hdx, hbs, group_start, split[i] // h_blocks, n_ff, h_cols, h_blocks, hs,
                                  split[i] % h_blocks)
    else:
        for i in range(n_split):
            _quantize_group_block(h, hq, hdx, hbs, group_start, split[i] // h_blocks, n_ff, h_cols, h_blocks, hs,
                                  split[i] % h_blocks)
    if last_stage == 1:
        return

    # B. y = W_down h, per item: its run of the (group, output row) pairs
    _share_rows(group_start, n_groups, D, n_items, starts)
    for item in prange(n_items):
        me = get_thread_id()
        acc_bank = banks_f32[me * bank_f32:]
        u = starts[item]
        while u < starts[item + 1]:
            g, r0, r1 = _segment(u, starts[item + 1], D)
            u += r1 - r0
            s0, m = group_start[g], group_start[g + 1] - group_start[g]
            e = group_expert[g]
            q, d, b = _block(hq, s0, m, h_cols), _scales(hdx, s0, m, h_blocks), _block(hbs, s0, m, hs)
            acc = acc_bank[:m]
            for r in range(r0, r1):
                row_dot_quant(wtypes[2], w_down, expert_rows[2, e] + r, q, d, b, acc, pf)
                for j in range(m):
                    y[s0 + j, r] = acc[j]
    if last_stage == 2:
        return

    # C. the weighted sum, ranks in order
    if n_slots * D >= _PARALLEL_MIN:
        for i in prange(n):
            _rank_sum(y, slot_of, weights, out, i)
    else:
        for i in range(n):
            _rank_sum(y, slot_of, weights, out, i)


class Workspace(threading.local):
    """The kernel's scratch, grown on demand and then reused: per calling thread, so two threads
    running MoE layers at once (nogil kernels) never share it."""

    def __init__(self):
        self.buffers = tuple(np.empty(0, t) for t in (np.int8, np.float32, np.int16, np.int64))

    def get(self, sizes) -> tuple:
        if any(buf.size < size for buf, size in zip(self.buffers, sizes)):
            # at least double: the few call sizes of a run (decode, verify, prompt chunk) settle fast
            self.buffers = tuple(np.empty(max(size, 2 * buf.size), buf.dtype)
                                 for buf, size in zip(self.buffers, sizes))
        return self.buffers


_workspace = Workspace()


_NO_SKIP: dict[int, np.ndarray] = {}


def no_skip(n_expert: int) -> np.ndarray:
    """A skip table that leaves nothing out (shared; not to be written). Writable all the same,
    like the expert cache's slot table: to Numba a read-only array is another type, so a second
    compile of the whole kernel (minutes on a small box)."""
    table = _NO_SKIP.get(n_expert)
    if table is None:
        table = _NO_SKIP[n_expert] = np.full(n_expert, -1, np.int32)
    return table


STAGES = ("group + quantise x", "A: gate/up", "B: down", "C: weighted sum")
_layouts: dict[tuple, tuple] = {}   # (n, k, D, n_ff, E, banks, items) → workspace sizes: a decode
                                    # step's 40 calls of one size pay a dict lookup, not a Numba call


def routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff: int, x: np.ndarray, experts: np.ndarray,
                   weights: np.ndarray, out: np.ndarray, n_items: int, pf: int,
                   stages: int = len(STAGES), skip: np.ndarray | None = None) -> None:
    """out (n, D) = Σ_rank weights[i, rank] · (expert experts[i, rank])(x[i]), leaving out the
    pairs whose expert e has skip[e] ≥ 0 (skip: (E,) int32, the GPU expert cache's slot table:
    the GPU runs those, gpu/expert_cache.py; None: none left out).

    wtypes: (gate, up, down) ggml type ids; w_*: (rows, row_bytes) uint8, C-contiguous, read-only;
    expert_rows: (3, E) int64, the row of w_gate / w_up / w_down where expert e's matrix starts.
    x: (n, D) float32; experts, weights: `cpu.moe.route`. n_items: how many runs of work each
    parallel region shares out (the thread count: the runs weigh alike); pf: prefetch distance
    in bytes. stages < 4 stops after that many of the kernel's steps (STAGES; out is then not
    written): for a profiler timing each step (tools/device/moe_split.py)."""
    n, D = out.shape
    n_banks = numba.config.NUMBA_NUM_THREADS + 1     # get_thread_id() < the pool size
    key = (n, weights.shape[1], D, n_ff, expert_rows.shape[1], n_banks, n_items)
    sizes = _layouts.get(key)
    if sizes is None:
        sizes = _layouts[key] = _layout(*key)[0]
    skip = no_skip(expert_rows.shape[1]) if skip is None else skip
    _routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts, skip, weights, out,
                    *_workspace.get(sizes), n_banks, n_items, pf, stages - 1)
