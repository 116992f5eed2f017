"""KV-cache append and causal GQA attention with the sigmoid output gate, on the GPU.

Same ops, arguments and cache layout as `cpu/attention.py`: k_cache, v_cache are
(n_head_kv, n_ctx, d_h), head-major, so one query head streams its KV head's positions. Their
elements are fp16 here (KV_DTYPE), as llama.cpp's default cache type: a long context takes half
the VRAM that would otherwise hold FFN weights, and a step reads half the bytes. K and V are
rounded to nearest on the way in (`kv_append`); scores, softmax and sums stay float32.

Attention is split over the positions (as flash-decoding does), because a decode step has only
n_head query rows to spread: one block per (query row, head) left most of the GPU idle and read
the cache at a small fraction of its bandwidth. Two launches:
* `_attention_parts`: one block per (row, KV head, part); a warp per query head of the KV head's
  group (they read the same K/V rows, which the cache then serves to the others). A part is a
  run of `part_size(n_kv, parts)` positions (at least PART_MIN; `layout` sets the parts); the
  warp keeps an online softmax over it (running max, sum and weighted value sum), four
  positions per step (their K and V rows loaded at once, one butterfly for their scores), lanes
  split d_h.
* `_attention_merge`: one warp per (row, head, slice of d_h) weighs the parts (their maxima and
  sums taken by the lanes in turn, then across the warp) and sums its outputs over the parts in
  order, then applies the gate (a block per (row, head) whose threads each walk every part
  would make the merge a serial chain of loads spread over few blocks).
The parts depend only on how many positions a row sees (and on the model, through `layout`), and
are merged in a fixed order, so each row of a k-row verify (or a prompt chunk) keeps the bits of
a one-row call.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from cpu.errors import HybridError

from .runtime import memory
from .runtime.device import simulated
from .intrinsics import warp_max_f32, warp_reduce
from .runtime.memory import THREADS, stream

MAX_HEAD_DIM = 256                    # qwen35/qwen3next use 256; local arrays need a bound
PER_LANE = MAX_HEAD_DIM // 32
POSITIONS = 4                         # cache positions per warp step: one butterfly for their scores
# parts per row at most and the shortest part (the simulator's are small, so tests meet several parts)
PARTS, PART_MIN = (4, 4) if simulated() else (128, 16)
# A row is cut into as many parts as keep one row's parts launch within one wave of blocks: about
# what an H200-class GPU keeps resident at once with this kernel's registers (two blocks of up
# to 8 warps per SM). Fewer parts leave SMs waiting on memory; more run as a second, mostly idle
# wave. So a model with fewer KV heads gets more parts (`layout`).
WAVE_BLOCKS = 256
ROWS_PER_CALL = 17                    # the most rows per pair of launches: a verify step up to --draft 16
# (row, part) results per head one pair of launches keeps (all its rows at 64 parts): rows per
# call shrink as parts grow, so more parts never make the scratch larger
PARTIAL_ROWS = ROWS_PER_CALL * 64
MERGE_THREADS = 32                    # the merge's block: one warp per (row, head, slice of d_h)
NEG_INF = float32(-math.inf)
KV_DTYPE = np.float16


@cuda.jit(device=True, inline=True)
def part_size(n_kv, parts):
    """Positions per part for a row that sees n_kv: at least PART_MIN, at most `parts` parts, a
    multiple of POSITIONS."""
    per = -(-n_kv // parts)
    per = -(-per // POSITIONS) * POSITIONS
    return max(per, PART_MIN)


@cuda.jit(cache=True)
def _kv_append(k, v, k_cache, v_cache, pos):
    n, n_kv_heads, d = k.shape
    e = cuda.grid(1)
    if e >= n * n_kv_heads * d:
        return
    t = e // (n_kv_heads * d)
    rest = e - t * n_kv_heads * d
    g = rest // d
    i = rest - g * d
    k_cache[g, pos[t], i] = k[t, g, i]
    v_cache[g, pos[t], i] = v[t, g, i]


def layout(n_head_kv: int) -> tuple[int, int]:
    """(parts each row is cut into, rows per pair of launches) for a model with n_head_kv KV
    heads (see WAVE_BLOCKS, PARTIAL_ROWS): fixed per model, so a row's bits depend on its
    position count alone."""
    parts = max(1, min(PARTS, WAVE_BLOCKS // n_head_kv))
    return parts, max(1, min(ROWS_PER_CALL, PARTIAL_ROWS // parts))


def kv_append(k, v, k_cache, v_cache, pos):
    """Write row t of k, v (n, n_head_kv, d_h) into cache position pos[t] (pos: int64 (n,)),
    rounded to the cache's type."""
    size = k.shape[0] * k.shape[1] * k.shape[2]
    _kv_append[-(-size // THREADS), THREADS, stream()](k, v, k_cache, v_cache, pos)


@cuda.jit(cache=True)
def _attention_parts(q, k_cache, v_cache, pos, row0, part_best, part_total, part_acc):
    n_kv_heads = k_cache.shape[0]
    H, d = q.shape[1], q.shape[2]
    b = cuda.blockIdx.x
    parts = part_best.shape[2]
    s = b % parts
    b //= parts
    g = b % n_kv_heads
    r = b // n_kv_heads                 # row of this call's batch
    t = row0 + r
    warp = cuda.threadIdx.x >> 5
    lane = cuda.threadIdx.x & 31
    h = g * (H // n_kv_heads) + warp
    n_kv = pos[t] + 1
    per = part_size(n_kv, parts)
    lo = s * per
    if lo >= n_kv:                      # (the whole block: every warp has the same bounds)
        return
    hi = min(lo + per, n_kv)
    scale = float32(1.0 / math.sqrt(d))

    qv = cuda.local.array(PER_LANE, float32)
    acc = cuda.local.array(PER_LANE, float32)
    red = cuda.local.array((POSITIONS, 1), float32)
    for j in range(PER_LANE):
        i = lane + 32 * j
        qv[j] = q[t, h, i] * scale if i < d else float32(0.0)
        acc[j] = float32(0.0)
    kk = cuda.local.array((POSITIONS, PER_LANE), float32)
    vv = cuda.local.array((POSITIONS, PER_LANE), float32)
    for k in range(POSITIONS):          # (entries past d_h stay 0: they are never loaded)
        for j in range(PER_LANE):
            kk[k, j] = float32(0.0)
            vv[k, j] = float32(0.0)
    best = NEG_INF                      # running max of the part's scores
    total = float32(0.0)                # running Σ exp(score − best)
    for p0 in range(lo, hi, POSITIONS):
        # every load of the step first, so that they are in flight together (one memory latency
        # per step, not one per position behind each exp)
        for k in range(POSITIONS):
            p = min(p0 + k, hi - 1)     # past the end: a valid row, ignored below
            for j in range(PER_LANE):
                i = lane + 32 * j
                if i < d:
                    kk[k, j] = k_cache[g, p, i]
                    vv[k, j] = v_cache[g, p, i]
        for k in range(POSITIONS):
            score = float32(0.0)
            for j in range(PER_LANE):
                if lane + 32 * j < d:
                    score += qv[j] * kk[k, j]
            red[k, 0] = score
        warp_reduce(red)                # POSITIONS dot products in one butterfly
        new_best = best
        for k in range(POSITIONS):
            if p0 + k < hi:
                new_best = max(new_best, red[k, 0])
        rescale = math.exp(best - new_best)     # 0 on the first step (best = −inf)
        total *= rescale
        for j in range(PER_LANE):
            acc[j] *= rescale
        for k in range(POSITIONS):
            if p0 + k < hi:
                e = math.exp(red[k, 0] - new_best)
                total += e
                for j in range(PER_LANE):
                    acc[j] += e * vv[k, j]
        best = new_best
    if lane == 0:
        part_best[r, h, s] = best
        part_total[r, h, s] = total
    for j in range(PER_LANE):
        i = lane + 32 * j
        if i < d:
            part_acc[r, h, s, i] = acc[j]


@cuda.jit(cache=True)
def _attention_merge(qg, pos, row0, part_best, part_total, part_acc, out):
    H = part_best.shape[1]
    d = part_acc.shape[3]
    slices = -(-d // MERGE_THREADS)
    b = cuda.blockIdx.x
    c = b % slices                      # this block's slice of the head's d_h outputs
    b //= slices
    r = b // H
    h = b - r * H
    t = row0 + r
    lane = cuda.threadIdx.x
    n_kv = pos[t] + 1
    used = -(-n_kv // part_size(n_kv, part_best.shape[2]))
    weight = cuda.shared.array(PARTS, float32)
    # the lanes take the parts in turn; the sums' order depends on `used` alone
    top = NEG_INF
    for s in range(lane, used, MERGE_THREADS):
        top = max(top, part_best[r, h, s])
    top = warp_max_f32(top)
    red = cuda.local.array((1, 1), float32)
    red[0, 0] = float32(0.0)
    for s in range(lane, used, MERGE_THREADS):
        red[0, 0] += part_total[r, h, s] * math.exp(part_best[r, h, s] - top)
    warp_reduce(red)                    # the same total in every lane
    for s in range(lane, used, MERGE_THREADS):
        weight[s] = math.exp(part_best[r, h, s] - top) / red[0, 0]
    cuda.syncthreads()
    i = c * MERGE_THREADS + lane
    if i < d:
        o = float32(0.0)
        for s in range(used):
            o += part_acc[r, h, s, i] * weight[s]
        out[t, h * d + i] = o / (float32(1.0) + math.exp(-qg[t, h, d + i]))


def gated_attention(q, qg, k_cache, v_cache, pos, out):
    """Causal GQA attention for n query rows, gated by σ(gate), into out (n, H·d_h).

    q (n, H, d_h) normed, rotated queries; row t sits at position pos[t] (int64 (n,), on the
    device, so a captured graph reads each step's positions) and sees cache positions
    0..pos[t] (the cache already holds this call's keys). qg (n, H, 2·d_h) is the
    packed `attn_q` output whose second half per head is the gate. Head h reads KV head
    h // (H / n_head_kv). Scale 1/sqrt(d_h)."""
    n, H, d = q.shape
    n_kv_heads = k_cache.shape[0]
    if d > MAX_HEAD_DIM:
        raise HybridError(f"GPU attention supports head_dim ≤ {MAX_HEAD_DIM}; this model has {d}")
    group = H // n_kv_heads
    if group * n_kv_heads != H or group > 32:
        raise HybridError(f"GPU attention needs n_head a multiple of n_head_kv, at most 32 query heads per KV "
                          f"head; this model has {H} and {n_kv_heads}")
    parts, per_call = layout(n_kv_heads)
    rows = min(n, per_call)
    best = memory.scratch("attention_part_best", (rows, H, parts))
    total = memory.scratch("attention_part_total", (rows, H, parts))
    acc = memory.scratch("attention_part_acc", (rows, H, parts, d))
    for row0 in range(0, n, rows):
        m = min(rows, n - row0)
        _attention_parts[m * n_kv_heads * parts, 32 * group, stream()](q, k_cache, v_cache, pos, row0,
                                                                       best, total, acc)
        _attention_merge[m * H * -(-d // MERGE_THREADS), MERGE_THREADS, stream()](qg, pos, row0, best, total,
                                                                                  acc, out)
