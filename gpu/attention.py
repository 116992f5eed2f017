"""KV-cache append and causal GQA attention with the sigmoid output gate, on the GPU.

Same ops, arguments and cache layout as `cpu/attention.py`: k_cache, v_cache are float32
(n_head_kv, n_ctx, d_h), head-major, so one query head streams its KV head's positions.

Attention: one block per (query row, head). Each warp takes every WARPS-th group of POSITIONS
cache positions, lanes split d_h (coalesced reads of a key/value row), and keeps an online
softmax (running max, sum and weighted value sum). The warps' partial results are then merged in warp order. Row t's
result depends only on its own query and the pos[t] + 1 positions it sees, so the slots
of a k-row verify keep the bits of one-row calls.
"""
from __future__ import annotations

import math

from numba import cuda, float32

from hybrid.errors import HybridError

from .device import simulated
from .intrinsics import warp_reduce
from .memory import THREADS, stream

WARPS = 1 if simulated() else 4
MAX_HEAD_DIM = 256                    # qwen35/qwen3next use 256; local arrays need a bound
PER_LANE = MAX_HEAD_DIM // 32
POSITIONS = 4                         # cache positions per warp step: one butterfly for their scores
NEG_INF = float32(-math.inf)


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


def kv_append(k, v, k_cache, v_cache, pos):
    """Write row t of k, v (n, n_head_kv, d_h) into cache position pos[t] (pos: int64 (n,))."""
    size = k.shape[0] * k.shape[1] * k.shape[2]
    _kv_append[-(-size // THREADS), THREADS, stream()](k, v, k_cache, v_cache, pos)


@cuda.jit(cache=True)
def _gated_attention(q, qg, k_cache, v_cache, pos, out):
    n, H, d = q.shape
    t = cuda.blockIdx.x // H
    h = cuda.blockIdx.x - t * H
    g = h // (H // k_cache.shape[0])
    warp = cuda.threadIdx.x >> 5
    lane = cuda.threadIdx.x & 31
    n_kv = pos[t] + 1
    scale = float32(1.0 / math.sqrt(d))

    qv = cuda.local.array(PER_LANE, float32)
    acc = cuda.local.array(PER_LANE, float32)
    red = cuda.local.array((POSITIONS, 1), float32)
    for j in range(PER_LANE):
        i = lane + 32 * j
        qv[j] = q[t, h, i] if i < d else float32(0.0)
        acc[j] = float32(0.0)
    best = NEG_INF                      # running max of this warp's scores
    total = float32(0.0)                # running Σ exp(score − best)
    for p0 in range(warp * POSITIONS, n_kv, WARPS * POSITIONS):
        for r in range(POSITIONS):
            p = min(p0 + r, n_kv - 1)   # past the end: a valid row, ignored below
            s = float32(0.0)
            for j in range(PER_LANE):
                i = lane + 32 * j
                if i < d:
                    s += qv[j] * k_cache[g, p, i]
            red[r, 0] = s
        warp_reduce(red)                # POSITIONS dot products in one butterfly
        new_best = best
        for r in range(POSITIONS):
            if p0 + r < n_kv:
                red[r, 0] *= scale
                new_best = max(new_best, red[r, 0])
        rescale = math.exp(best - new_best)     # 0 on the first group (best = −inf)
        total *= rescale
        for j in range(PER_LANE):
            acc[j] *= rescale
        for r in range(POSITIONS):
            if p0 + r < n_kv:
                e = math.exp(red[r, 0] - new_best)
                total += e
                for j in range(PER_LANE):
                    i = lane + 32 * j
                    if i < d:
                        acc[j] += e * v_cache[g, p0 + r, i]
        best = new_best

    # merge the warps' (best, total, acc) in warp order
    part_best = cuda.shared.array(WARPS, float32)
    part_total = cuda.shared.array(WARPS, float32)
    part_acc = cuda.shared.array((WARPS, MAX_HEAD_DIM), float32)
    if lane == 0:
        part_best[warp] = best
        part_total[warp] = total
    for j in range(PER_LANE):
        i = lane + 32 * j
        if i < d:
            part_acc[warp, i] = acc[j]
    cuda.syncthreads()
    if warp == 0:
        top = part_best[0]
        for w in range(1, WARPS):
            top = max(top, part_best[w])
        norm = float32(0.0)
        for w in range(WARPS):
            norm += part_total[w] * math.exp(part_best[w] - top)
        for j in range(PER_LANE):
            i = lane + 32 * j
            if i < d:
                o = float32(0.0)
                for w in range(WARPS):
                    o += part_acc[w, i] * math.exp(part_best[w] - top)
                gate = qg[t, h, d + i]
                out[t, h * d + i] = o / norm / (float32(1.0) + math.exp(-gate))


def gated_attention(q, qg, k_cache, v_cache, pos, out):
    """Causal GQA attention for n query rows, gated by σ(gate), into out (n, H·d_h).

    q (n, H, d_h) normed, rotated queries; row t sits at position pos[t] (int64 (n,), on the
    device, so a captured graph reads each step's positions) and sees cache positions
    0..pos[t] (the cache already holds this call's keys). qg (n, H, 2·d_h) is the
    packed `attn_q` output whose second half per head is the gate. Head h reads KV head
    h // (H / n_head_kv). Scale 1/sqrt(d_h)."""
    n, H, d = q.shape
    if d > MAX_HEAD_DIM:
        raise HybridError(f"GPU attention supports head_dim ≤ {MAX_HEAD_DIM}; this model has {d}")
    _gated_attention[n * H, 32 * WARPS, stream()](q, qg, k_cache, v_cache, pos, out)
