"""All routed experts of one MoE layer in one kernel call (quantised expert weights).

Why: run expert by expert from Python, a decode step pays ~5 kernel calls per selected expert per
layer (tens of µs each); with top-8 of small experts that overhead, not the weight stream, sets
the speed. Here one call does every (row, selected expert) pair; a decode step wakes the thread
pool once and allocates nothing:

  0. serially: group the (row, rank) slots by expert (a counting sort), quantise each row of x
     to int8 once, as gate and up round it (`cpu.activations`; the two must agree, `cpu.moe`
     runs other layers expert by expert), a parallel region of its own only for prompt-sized
     calls; h is quantised as the down type rounds it. Then cut the work
     into chunks: runs of one group's weight rows, of about equal cost (`_plan_chunks`);
  1. one parallel region whose threads claim chunks from a shared counter (`cpu.atomics`), first
     every gate/up chunk, then every down chunk:
     A (gate/up): copy the group's m rows of int8 x into this thread's bank (the contiguous
       (m, D) block the row dots read), h = SiLU(W_gate,e x) ⊙ (W_up,e x) for the chunk's rows;
       the thread that completes an activation block of h (a counter per block) turns it into
       int8 for all the group's slots, and counts the group's finished blocks;
     B (down): y = W_down,e h for the chunk's output rows, once the group's h is all int8 (a
       down chunk claimed early waits for its group's gate/up chunks, which were all claimed
       before it by threads that are running them: no deadlock, whatever the thread count);
  2. out[i] = Σ_rank w[i, rank] · y[i, rank], each row in its own top-k rank order (serially for
     a decode step, where a region would cost more than the sum).

Claimed chunks, not fixed runs per thread: the slowest thread of a region can run well behind
the others, and a fixed share makes every call wait for it; a second region for the down step
would cost another wake-up and join, and the blocks of h that a fixed run boundary split would
have to be quantised between the regions (figures: docs/MEASUREMENTS.md).

Every step is the same arithmetic, on the same bytes, as the one-expert-at-a-time path
(`cpu.ffn.swiglu` then `cpu.matvec.matvec` on the gathered rows, then the rank-order sum): the
activation quantisation is per row, the row dots give each slot the bits of a one-slot call, and
the sum order per row is fixed. So the result has exactly that path's bits, whichever thread
ran which chunk, and row i of an n-row call has exactly the bits of the 1-row call on x[i]
(lossless drafting relies on it).

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

from . import activations as act
from .activations import CHUNK as ACT_BLOCK          # columns per int8 chunk
from .activations import MAX_SCALE_WIDTH as SCALES   # scale floats per chunk and slot, any format
from .activations import SUM_ELEMS as ACT_SUM
from .activations import format_code, quantize_chunk, scale_width
from .atomics import fetch_add, load_acquire
from .ffn import SILU_ROWS, gated_row
from .matvec import QUANT_TYPES, row_dot_quant
from .variants import type_mask

# One kernel with the row dots of every SIMD type: its parallel regions, not the row dots, are most
# of its compile time (a variant per layer's types compiled in ~65 s against ~85 s for all types).
ALL_TYPES = type_mask(QUANT_TYPES)

# Below this many elements, quantising x (step 0) and the weighted sum (C) run serially: a
# parallel region costs more than they do (decode); above, they get one region each.
_PARALLEL_MIN = 1 << 15
# the cost of reading one weight row, in row dots (one row dot per slot of the group): how the
# chunks of a step are sized (`_plan_chunks`)
_ROW_READ = 2
# chunks per worker and step: enough that a slow thread claims fewer of them, few enough that a
# chunk is a few µs of work (a decode step's gate/up chunk: ~32 rows of two 1152-byte weight rows)
CHUNKS_PER_WORKER = 4
_LINE = 64                       # bytes of a cache line
_LINE_I64 = _LINE // 8
_Q8_K = act.Q8_K.code


@njit(inline="always")
def _block(flat, start, m, width):
    """Rows [start, start+m) of a (·, width) matrix stored flat: a C-contiguous (m, width) view."""
    return flat[start * width:(start + m) * width].reshape((m, width))


@njit(inline="always")
def _scales(fmt, flat, start, m, n_blocks):
    """The activation scales of slots start..start+m (n_blocks 256-column chunks each) in format
    fmt's layout (`cpu.activations`: Q8_K block-major (n_blocks, m), Q8_0 slot-major (m,
    8·n_blocks)), stored from SCALES·n_blocks·start: room for any format."""
    at = SCALES * n_blocks * start
    if fmt == _Q8_K:
        return flat[at:at + n_blocks * m].reshape((n_blocks, m))
    width = scale_width(fmt) * n_blocks
    return flat[at:at + width * m].reshape((m, width))


@njit(inline="always")
def _lines(n_elements, itemsize):
    """n_elements rounded up to whole cache lines, plus one spare line."""
    per_line = _LINE // itemsize
    return (n_elements + per_line - 1) // per_line * per_line + per_line


@njit(inline="always")
def _max_chunks(n_slots, n_workers):
    """A bound on the chunks `_plan_chunks` makes of one step (see there)."""
    return 2 * CHUNKS_PER_WORKER * n_workers + n_slots


@njit(cache=True, nogil=True)
def _layout(n, k, D, n_ff, n_expert, n_banks, n_workers):
    """Workspace sizes (elements of int8, float32, int16, int64) and per-thread bank strides
    (int8, float32, int16) for `_routed_experts`."""
    n_slots = n * k
    x_blocks, h_blocks = -(-D // ACT_BLOCK), -(-n_ff // ACT_BLOCK)
    x_cols, h_cols = x_blocks * ACT_BLOCK, h_blocks * ACT_BLOCK
    bank_i8 = _lines(n * x_cols, 1)                  # a group's int8 x (m ≤ n rows: an expert
    bank_f32 = _lines(SCALES * x_blocks * n + (3 + SILU_ROWS) * n, 4)   # once per row), its scales,
                                                              # dots and up products
    bank_i16 = _lines(n * x_cols // ACT_SUM, 2)
    sizes = (n * x_cols + n_slots * h_cols + n_banks * bank_i8,
             SCALES * x_blocks * n + n_slots * (n_ff + SCALES * h_blocks + D) + n_banks * bank_f32,
             (n * x_cols + n_slots * h_cols) // ACT_SUM + n_banks * bank_i16,
             2 * n_expert + 1 + 4 * n_slots + 1 + 2 * (_max_chunks(n_slots, n_workers) + 1)
             + _LINE_I64 + n_slots * (h_blocks + 1))
    return sizes, (bank_i8, bank_f32, bank_i16)


@njit(inline="always")
def _expert_of(code):
    """The expert of a routing entry: e for a pair run here, e for a pair marked ~e."""
    return code if code >= 0 else -1 - code


def shares_x_rounding(gate_type: int, up_type: int) -> bool:
    """True where gate and up weights meet x rounded the same way (`cpu.activations`): what the
    kernel needs, as it quantises each row of x once for both."""
    return act.format_of(gate_type) == act.format_of(up_type)


BAD_ROUTING = "routing names an expert the layer does not have"


def expert_ids(experts: np.ndarray) -> np.ndarray:
    """The experts of a routing whose entries may be marked ~e (run elsewhere)."""
    return np.where(experts >= 0, experts, ~experts)


@njit(cache=True, nogil=True)
def _group_slots_into(experts, n_expert, first, slot_row, slot_of, group_start, group_expert):
    """Slots = the (row, rank) pairs this kernel runs (expert e ≥ 0; a pair marked ~e runs
    elsewhere: the GPU, gpu/expert_cache.py), ordered by expert (a stable counting sort: rows
    ascend within a group). Fills slot_row (row of each slot), slot_of (slot of pair i·k + rank,
    −1 when it runs elsewhere), group_start (n_groups + 1 slot bounds) and group_expert (the
    expert of each group), using `first` (≥ n_expert + 1 int64) as the counter; returns n_groups."""
    n, k = experts.shape
    for e in range(n_expert + 1):                  # first[e + 1] counts pairs routed to e, then sums
        first[e] = 0
    for i in range(n):
        for rank in range(k):
            if experts[i, rank] >= 0:
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
            if e < 0:
                slot_of[i * k + rank] = -1
                continue
            s = first[e]
            first[e] += 1
            slot_row[s], slot_of[i * k + rank] = i, s
    return n_groups


def group_slots(experts: np.ndarray, n_expert: int):
    """`_group_slots_into` with fresh arrays: (slot_row, slot_of, group_start, group_expert)."""
    if experts.size and expert_ids(experts).max() >= n_expert:
        raise ValueError(BAD_ROUTING)
    n_slots = experts.size
    first = np.empty(n_expert + 1, np.int64)
    slot_row, slot_of = np.empty(n_slots, np.int64), np.empty(n_slots, np.int64)
    group_start, group_expert = np.empty(n_slots + 1, np.int64), np.empty(n_slots, np.int64)
    g = _group_slots_into(experts, n_expert, first, slot_row, slot_of, group_start, group_expert)
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
def _quantize_group_block(fmt, h, hq, hdx, hbs, group_start, g, n_ff, h_cols, h_blocks, hs, blk):
    """Activation chunk blk of the rows of h of group g (its slots) to int8 in format fmt."""
    s0, m = group_start[g], group_start[g + 1] - group_start[g]
    hg = _block(h, s0, m, n_ff)
    hqg, hdg, hbg = _block(hq, s0, m, h_cols), _scales(fmt, hdx, s0, m, h_blocks), _block(hbs, s0, m, hs)
    for j in range(m):
        quantize_chunk(fmt, hg, hqg, hdg, hbg, j, blk)


@njit(inline="always")
def _row_cost(group_start, g):
    """The cost of one row of group g: its m row dots and the read of its weights."""
    return group_start[g + 1] - group_start[g] + _ROW_READ


@njit(inline="always")
def _plan_chunks(group_start, n_groups, n_rows, goal, bounds):
    """Cuts a step's (group, row) pairs — pair g·n_rows + r, group by group — into about `goal`
    chunks of about equal cost, none crossing a group: bounds[c] is chunk c's first pair,
    bounds[n_chunks] the end; returns n_chunks. A row of a group of m slots costs m + _ROW_READ
    (its m row dots and the read of its weights): a prompt chunk's groups differ in m, a decode
    step's do not. A group gets rows_g = max(1, ⌊target / cost_g⌋) rows per chunk, and
    n_rows / rows_g ≤ 2·n_rows·cost_g / target either way (⌊v⌋ ≥ v/2 for v ≥ 1; rows_g = 1
    when cost_g > target), so all groups together make at most 2·goal chunks, plus one
    partial chunk per group: `_max_chunks`."""
    total = 0
    for g in range(n_groups):
        total += _row_cost(group_start, g) * n_rows
    target = max(1, -(-total // goal))
    c = 0
    for g in range(n_groups):
        per_chunk = max(1, target // _row_cost(group_start, g))
        for r in range(0, n_rows, per_chunk):
            bounds[c] = g * n_rows + r
            c += 1
    bounds[c] = n_groups * n_rows
    return c


@njit(inline="always")
def _chunk(bounds, c, n_rows):
    """Chunk c of `_plan_chunks`: (group, first row, end row)."""
    g = bounds[c] // n_rows
    return g, bounds[c] - g * n_rows, bounds[c + 1] - g * n_rows


@njit(cache=True, nogil=True, parallel=True)
def _routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts, weights, out,
                    ws_i8, ws_f32, ws_i16, ws_i64, n_banks, n_workers, pf, last_stage):
    n, D = out.shape
    k = weights.shape[1]
    n_expert = expert_rows.shape[1]
    n_slots = n * k
    x_blocks, h_blocks = -(-D // ACT_BLOCK), -(-n_ff // ACT_BLOCK)
    x_cols, h_cols = x_blocks * ACT_BLOCK, h_blocks * ACT_BLOCK
    xs, hs = x_cols // ACT_SUM, h_cols // ACT_SUM
    fmt_x, fmt_h = format_code(wtypes[0]), format_code(wtypes[2])   # gate and up share fmt_x (`_arguments`)

    # carve the workspace (`_layout`): shared arrays first, then the per-thread banks
    _, (bank_i8, bank_f32, bank_i16) = _layout(n, k, D, n_ff, n_expert, n_banks, n_workers)
    xq = ws_i8[:n * x_cols].reshape((n, x_cols))
    hq = ws_i8[n * x_cols:n * x_cols + n_slots * h_cols]
    banks_i8 = ws_i8[n * x_cols + n_slots * h_cols:]
    bs = ws_i16[:n * xs].reshape((n, xs))
    hbs = ws_i16[n * xs:n * xs + n_slots * hs]
    banks_i16 = ws_i16[n * xs + n_slots * hs:]
    dx = _scales(fmt_x, ws_f32, 0, n, x_blocks)
    o = SCALES * x_blocks * n
    h = ws_f32[o:o + n_slots * n_ff]
    o += n_slots * n_ff
    hdx = ws_f32[o:o + SCALES * n_slots * h_blocks]
    o += SCALES * n_slots * h_blocks
    y = ws_f32[o:o + n_slots * D].reshape((n_slots, D))
    banks_f32 = ws_f32[o + n_slots * D:]
    o = 0
    first = ws_i64[o:o + n_expert + 1]
    seen = ws_i64[o + n_expert + 1:o + 2 * n_expert + 1]
    o += 2 * n_expert + 1
    slot_row = ws_i64[o:o + n_slots]
    slot_of = ws_i64[o + n_slots:o + 2 * n_slots]
    group_start = ws_i64[o + 2 * n_slots:o + 3 * n_slots + 1]
    group_expert = ws_i64[o + 3 * n_slots + 1:o + 4 * n_slots + 1]
    o += 4 * n_slots + 1
    max_chunks = _max_chunks(n_slots, n_workers)
    bounds_a = ws_i64[o:o + max_chunks + 1]
    bounds_b = ws_i64[o + max_chunks + 1:o + 2 * (max_chunks + 1)]
    o += 2 * (max_chunks + 1)
    claimed = ws_i64[o:o + _LINE_I64]            # the queue's counter, a cache line of its own
    o += _LINE_I64
    block_rows_done = ws_i64[o:o + n_slots * h_blocks]     # per (group, activation block of h)
    blocks_ready = ws_i64[o + n_slots * h_blocks:o + n_slots * (h_blocks + 1)]   # per group

    # 0. count the distinct experts selected (those run elsewhere too: the bytes grouping reads,
    # for the MoE counters), group the slots; quantise x once per row; cut the work into chunks
    for e in range(n_expert):
        seen[e] = 0
    distinct = 0
    for i in range(n):
        for rank in range(k):
            e = _expert_of(experts[i, rank])
            if e >= n_expert:                   # never index with it (`_checked`)
                return -1
            distinct += 1 - seen[e]
            seen[e] = 1
    n_groups = _group_slots_into(experts, n_expert, first, slot_row, slot_of, group_start, group_expert)
    if n * x_cols >= _PARALLEL_MIN:
        for task in prange(n * x_blocks):
            quantize_chunk(fmt_x, x, xq, dx, bs, task // x_blocks, task % x_blocks)
    else:
        for i in range(n):
            for blk in range(x_blocks):
                quantize_chunk(fmt_x, x, xq, dx, bs, i, blk)
    if last_stage == 0:
        return distinct
    n_a = _plan_chunks(group_start, n_groups, n_ff, CHUNKS_PER_WORKER * n_workers, bounds_a)
    n_b = _plan_chunks(group_start, n_groups, D, CHUNKS_PER_WORKER * n_workers, bounds_b) if last_stage >= 2 else 0
    claimed[0] = 0
    for i in range(n_groups * h_blocks):
        block_rows_done[i] = 0
    for g in range(n_groups):
        blocks_ready[g] = 0

    # 1. the workers claim the gate/up chunks, then the down chunks (no groups when every pair
    # runs elsewhere: nothing to claim, C writes zeros)
    if n_a + n_b > 0:
        for worker in prange(n_workers):
            me = get_thread_id()
            q = banks_i8[me * bank_i8:]
            b = banks_i16[me * bank_i16:]
            f32 = banks_f32[me * bank_f32:]
            banked = -1                          # the group whose rows of x the bank holds
            c = fetch_add(claimed, 0, 1)
            while c < n_a + n_b:
                if c < n_a:
                    # A: h = SiLU(gate) ⊙ up for the chunk's rows, from the group's x in the bank
                    g, r0, r1 = _chunk(bounds_a, c, n_ff)
                    s0, m = group_start[g], group_start[g + 1] - group_start[g]
                    qg, bg, d = _block(q, 0, m, x_cols), _block(b, 0, m, xs), _scales(fmt_x, f32, 0, m, x_blocks)
                    f0 = SCALES * x_blocks * m                                    # past the x scales
                    g_out = f32[f0:f0 + m]                                        # gate and up of one row
                    u_out = f32[f0 + m:f0 + 2 * m]
                    ups = f32[f0 + 3 * m:f0 + (3 + SILU_ROWS) * m]               # (m, SILU_ROWS)
                    if banked != g:
                        for j in range(m):
                            row = slot_row[s0 + j]
                            for col in range(x_cols):
                                qg[j, col] = xq[row, col]
                            for col in range(xs):
                                bg[j, col] = bs[row, col]
                            if fmt_x == _Q8_K:
                                for blk in range(x_blocks):
                                    d[blk, j] = dx[blk, row]
                            else:
                                for blk in range(scale_width(fmt_x) * x_blocks):
                                    d[j, blk] = dx[row, blk]
                        banked = g
                    hg = _block(h, s0, m, n_ff)
                    e = group_expert[g]
                    done = r0
                    for r in range(r0, r1):
                        row_dot_quant(ALL_TYPES, wtypes[0], w_gate, expert_rows[0, e] + r, qg, d, bg, g_out, pf)
                        row_dot_quant(ALL_TYPES, wtypes[1], w_up, expert_rows[1, e] + r, qg, d, bg, u_out, pf)
                        done = gated_row(hg, ups, g_out, u_out, r, done, r1)
                    # the thread that completes an activation block of h turns it into int8
                    for blk in range(r0 // ACT_BLOCK, (r1 - 1) // ACT_BLOCK + 1):
                        lo, hi = blk * ACT_BLOCK, min(n_ff, (blk + 1) * ACT_BLOCK)
                        mine = min(r1, hi) - max(r0, lo)
                        if fetch_add(block_rows_done, g * h_blocks + blk, mine) + mine == hi - lo:
                            _quantize_group_block(fmt_h, h, hq, hdx, hbs, group_start, g, n_ff, h_cols, h_blocks, hs,
                                                  blk)
                            fetch_add(blocks_ready, g, 1)
                else:
                    # B: y = W_down h for the chunk's output rows, once the group's h is int8
                    g, r0, r1 = _chunk(bounds_b, c - n_a, D)
                    s0, m = group_start[g], group_start[g + 1] - group_start[g]
                    while load_acquire(blocks_ready, g) < h_blocks:
                        pass
                    e = group_expert[g]
                    hqg, d, hb = _block(hq, s0, m, h_cols), _scales(fmt_h, hdx, s0, m, h_blocks), _block(hbs, s0, m, hs)
                    f0 = SCALES * x_blocks * m
                    acc = f32[f0 + 2 * m:f0 + 3 * m]                        # past A's x scales and dots
                    for r in range(r0, r1):
                        row_dot_quant(ALL_TYPES, wtypes[2], w_down, expert_rows[2, e] + r, hqg, d, hb, acc, pf)
                        for j in range(m):
                            y[s0 + j, r] = acc[j]
                c = fetch_add(claimed, 0, 1)
    if last_stage <= 2:
        return distinct

    # 2. the weighted sum, ranks in order
    if n_slots * D >= _PARALLEL_MIN:
        for i in prange(n):
            _rank_sum(y, slot_of, weights, out, i)
    else:
        for i in range(n):
            _rank_sum(y, slot_of, weights, out, i)
    return distinct


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


STAGES = ("group + quantise x", "A: gate/up", "B: down", "C: weighted sum")
_layouts: dict[tuple, tuple] = {}   # (n, k, D, n_ff, E, banks, workers) → workspace sizes: a decode
                                    # step's 40 calls of one size pay a dict lookup, not a Numba call


def _arguments(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts, weights, out, n_workers, pf,
               stages) -> tuple:
    """`_routed_experts`'s arguments, the workspace included."""
    if not shares_x_rounding(wtypes[0], wtypes[1]):
        raise ValueError("the expert kernel quantises x once for gate and up: their types must round "
                         "activations alike (cpu.activations); run such experts one by one")
    n, D = out.shape
    n_banks = numba.config.NUMBA_NUM_THREADS + 1     # get_thread_id() < the pool size
    key = (n, weights.shape[1], D, n_ff, expert_rows.shape[1], n_banks, n_workers)
    sizes = _layouts.get(key)
    if sizes is None:
        sizes = _layouts[key] = _layout(*key)[0]
    return (wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts, weights, out,
            *_workspace.get(sizes), n_banks, n_workers, pf, stages - 1)


def routed_experts(wtypes, w_gate, w_up, w_down, expert_rows, n_ff: int, x: np.ndarray, experts: np.ndarray,
                   weights: np.ndarray, out: np.ndarray, n_workers: int, pf: int,
                   stages: int = len(STAGES)) -> int:
    """out (n, D) = Σ_rank weights[i, rank] · (expert experts[i, rank])(x[i]) over the pairs
    with experts[i, rank] ≥ 0; a pair marked ~e (= −1 − e) is left out: the GPU
    runs expert e for it (gpu/expert_cache.py). Returns how many distinct experts `experts`
    names (those run elsewhere included).

    wtypes: (gate, up, down) ggml type ids; w_*: (rows, row_bytes) uint8, C-contiguous, read-only;
    expert_rows: (3, E) int64, the row of w_gate / w_up / w_down where expert e's matrix starts.
    x: (n, D) float32; experts, weights: `cpu.moe.route`. n_workers: how many workers claim the
    chunks (the thread count; the chunks are sized for it, any count gives the same bits);
    pf: prefetch distance in bytes. stages < 4 stops after that many of the kernel's steps
    (STAGES; out is then not written): for a profiler timing each step (tools/device/moe_split.py)."""
    return _checked(_routed_experts(*_arguments(wtypes, w_gate, w_up, w_down, expert_rows, n_ff, x, experts,
                                                weights, out, n_workers, pf, stages)))


def _checked(distinct: int) -> int:
    """The kernel's count of distinct experts, or ValueError for routing naming an expert the
    layer does not have (the kernel returns −1 before indexing with it). Routing comes from
    `cpu.moe.route` or the device, so this is a garbage input: e.g. a warm-up's plan pass
    (hybrid/kernel_prep.py) that skipped the router, when this kernel is compiled in memory
    already, so the pass cannot stop before it; the error ends that pass instead."""
    if distinct < 0:
        raise ValueError(BAD_ROUTING)
    return distinct


class BoundCall:
    """`routed_experts` on arrays fixed once (a captured step's pinned hand-off buffers, rewritten
    in place before each replay): calling it runs the compiled kernel on them, with no argument
    typing or dispatch (a replayed decode step makes one such call per MoE layer, and the typing
    and dispatch of `cpu.moe.run_routed` cost more than a small layer's work). Returns what routed_experts returns."""

    def __init__(self, *arguments, stages: int = len(STAGES)):
        self.args = _arguments(*arguments, stages)
        # compiled for these argument types (or loaded from Numba's cache) without running
        self.entry = _routed_experts.compile(tuple(_routed_experts.typeof_pyval(a) for a in self.args))

    def __call__(self) -> int:
        return _checked(self.entry(*self.args))
