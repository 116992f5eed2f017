"""Greedy picks of logit rows on the device: the ops and output layout of `cpu/argmax.py`.

One block per row (a call has at most a few rows): threads stride over the vocabulary keeping
their first maximum and a running Σ exp(x − max) (rescaled when the maximum rises, as in an
online softmax), then combine in a fixed tree through shared memory, the lower id winning ties.
The row, just written by lm_head, is read once from L2.
"""
from __future__ import annotations

import math

from numba import cuda, float32, int32

from cpu.argmax import PICK_ID, PICK_MAX, PICK_P

from .device import simulated
from .memory import stream

THREADS = 32 if simulated() else 512
UNROLL = 8
_NEG_INF = float32(-math.inf)


@cuda.jit(device=True, inline=True)
def _merge(best_a, at_a, total_a, best_b, at_b, total_b):
    """(best, at, total) of two partial scans: the larger maximum, the lower id on a tie, and
    both sums rescaled to it (a part whose maximum is -inf adds nothing)."""
    if best_b > best_a or (best_b == best_a and at_b < at_a):
        best_a, at_a, total_a, best_b, at_b, total_b = best_b, at_b, total_b, best_a, at_a, total_a
    if best_b > _NEG_INF:
        total_a += total_b * math.exp(best_b - best_a)
    return best_a, at_a, total_a


@cuda.jit(device=True, inline=True)
def _take(v, i, best, at, total, nan):
    """The running (best, at, total, nan) of a thread after entry i of value v (-inf: none)."""
    if v != v:
        nan = int32(1)
    elif v > best:
        total = total * math.exp(best - v) + float32(1.0) if best > _NEG_INF else float32(1.0)
        best, at = v, int32(i)
    elif v > _NEG_INF:
        total += math.exp(v - best)
    return best, at, total, nan


@cuda.jit(cache=True)
def _argmax_rows(logits, picks):
    best_s = cuda.shared.array(THREADS, float32)
    at_s = cuda.shared.array(THREADS, int32)
    total_s = cuda.shared.array(THREADS, float32)
    nan_s = cuda.shared.array(THREADS, int32)
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    V = logits.shape[1]
    best, at, total, nan = _NEG_INF, int32(V), float32(0.0), int32(0)
    # UNROLL loads in flight per thread before any is used: one per thread left the block bound
    # by L2 latency (~8 GB/s); a thread still takes its entries in increasing id order
    for i0 in range(tid, V, THREADS * UNROLL):
        v = cuda.local.array(UNROLL, float32)
        for u in range(UNROLL):
            i = i0 + u * THREADS
            v[u] = logits[row, i] if i < V else _NEG_INF
        for u in range(UNROLL):
            best, at, total, nan = _take(v[u], i0 + u * THREADS, best, at, total, nan)
    best_s[tid], at_s[tid], total_s[tid], nan_s[tid] = best, at, total, nan
    cuda.syncthreads()
    half = THREADS // 2
    while half > 0:
        if tid < half:
            b, a, t = _merge(best_s[tid], at_s[tid], total_s[tid],
                             best_s[tid + half], at_s[tid + half], total_s[tid + half])
            best_s[tid], at_s[tid], total_s[tid] = b, a, t
            nan_s[tid] |= nan_s[tid + half]
        cuda.syncthreads()
        half //= 2
    if tid == 0:
        picks[row, PICK_ID] = float32(at_s[0]) if at_s[0] < V else float32(0.0)
        picks[row, PICK_P] = float32(1.0) / total_s[0]
        picks[row, PICK_MAX] = float32(math.nan) if nan_s[0] else best_s[0]


def argmax_rows(logits, picks) -> None:
    """picks[i] = (id of the first maximum of logits[i], its softmax probability, the maximum)."""
    _argmax_rows[logits.shape[0], THREADS, stream()](logits, picks)
