"""Greedy picks of logit rows on the device: the ops and output layout of `cpu/argmax.py`.

A row is cut into parts (their size a function of the vocabulary alone), a block per
(row, part): threads stride over the part keeping their first maximum and a running
Σ exp(x − max) (rescaled when the maximum rises, as in an online softmax), then combine in a
fixed tree through shared memory, the lower id winning ties. A second launch merges each row's
parts in the same tree. One block per row left one SM doing every exp of a vocabulary-wide row;
the row, just written by lm_head, is read once from L2.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, int32

from cpu.argmax import PICK_ID, PICK_MAX, PICK_P

from .runtime import memory
from .runtime.device import simulated
from .runtime.memory import stream

THREADS = 32 if simulated() else 512
UNROLL = 8
PASS = THREADS * UNROLL          # entries a block takes in one pass
MAX_PARTS = 32 if simulated() else 128     # threads of the merge's block: one part each
_NEG_INF = float32(-math.inf)
_BEST, _AT, _TOTAL, _NAN = range(4)       # a part's summary, as float32 (ids < 2**24: exact)


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


@cuda.jit(device=True, inline=True)
def _tree(best, at, total, nan, tid, width):
    """Thread 0's (best, at, total, nan) of the block's first `width` (a power of two) threads'
    values, combined in a fixed tree: the same bits whatever the other blocks do."""
    best_s = cuda.shared.array(THREADS, float32)
    at_s = cuda.shared.array(THREADS, int32)
    total_s = cuda.shared.array(THREADS, float32)
    nan_s = cuda.shared.array(THREADS, int32)
    best_s[tid], at_s[tid], total_s[tid], nan_s[tid] = best, at, total, nan
    cuda.syncthreads()
    half = width // 2
    while half > 0:
        if tid < half:
            b, a, t = _merge(best_s[tid], at_s[tid], total_s[tid],
                             best_s[tid + half], at_s[tid + half], total_s[tid + half])
            best_s[tid], at_s[tid], total_s[tid] = b, a, t
            nan_s[tid] |= nan_s[tid + half]
        cuda.syncthreads()
        half //= 2
    return best_s[0], at_s[0], total_s[0], nan_s[0]


@cuda.jit(cache=True)
def _argmax_parts(logits, span, parts):
    row, part, tid = cuda.blockIdx.x, cuda.blockIdx.y, cuda.threadIdx.x
    V = logits.shape[1]
    end = min(V, (part + 1) * span)
    best, at, total, nan = _NEG_INF, int32(V), float32(0.0), int32(0)
    # UNROLL loads in flight per thread before any is used (one each left a block bound by L2
    # latency); a thread takes its entries in increasing id order
    for i0 in range(part * span + tid, end, PASS):
        v = cuda.local.array(UNROLL, float32)
        for u in range(UNROLL):
            i = i0 + u * THREADS
            v[u] = logits[row, i] if i < end else _NEG_INF
        for u in range(UNROLL):
            best, at, total, nan = _take(v[u], i0 + u * THREADS, best, at, total, nan)
    best, at, total, nan = _tree(best, at, total, nan, tid, THREADS)
    if tid == 0:
        parts[row, part, _BEST] = best
        parts[row, part, _AT] = float32(at)
        parts[row, part, _TOTAL] = total
        parts[row, part, _NAN] = float32(nan)


@cuda.jit(cache=True)
def _argmax_merge(parts, V, picks):
    row, tid = cuda.blockIdx.x, cuda.threadIdx.x
    n_parts = parts.shape[1]
    best, at, total, nan = _NEG_INF, int32(V), float32(0.0), int32(0)
    if tid < n_parts:
        best, at = parts[row, tid, _BEST], int32(parts[row, tid, _AT])
        total, nan = parts[row, tid, _TOTAL], int32(parts[row, tid, _NAN])
    best, at, total, nan = _tree(best, at, total, nan, tid, cuda.blockDim.x)
    if tid == 0:
        picks[row, PICK_ID] = float32(at) if at < V else float32(0.0)
        picks[row, PICK_P] = float32(1.0) / total
        picks[row, PICK_MAX] = float32(math.nan) if nan else best


def part_span(V: int) -> int:
    """Entries per part: whole passes, as few as keep the parts within MAX_PARTS."""
    passes = -(-V // (MAX_PARTS * PASS))
    return max(1, passes) * PASS


def argmax_rows(logits, picks) -> None:
    """picks[i] = (id of the first maximum of logits[i], its softmax probability, the maximum)."""
    rows, V = logits.shape
    span = part_span(V)
    n_parts = max(1, -(-V // span))
    parts = memory.scratch("argmax_parts", (rows, n_parts, 4))
    _argmax_parts[(rows, n_parts), THREADS, stream()](logits, span, parts)
    width = 1 << (n_parts - 1).bit_length()               # the merge tree's power of two
    _argmax_merge[rows, width, stream()](parts, V, picks)
