"""KV-cache append and causal GQA attention with the sigmoid output gate (MODEL_FORMAT.md §3.3).

KV cache layout, per attention layer: k_cache, v_cache are KV_DTYPE (n_head_kv, n_ctx, d_h).
Head-major so that one query head scans the positions of its KV head as one contiguous
stream (position-major would stride by n_head_kv·d_h between positions).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .expf import expf

# Reassociation lets LLVM vectorise the d_h dot products. Every query row runs the same
# code whatever n is, so batched rows still match single-row calls bit for bit.
_FAST = {"reassoc", "contract", "nsz"}

# The cache's element type on this side: float32 (Numba has no float16 arrays on the CPU; host
# memory is also the plentiful kind). The GPU keeps fp16 (`gpu/attention.py`).
KV_DTYPE = np.float32


@njit(cache=True, nogil=True)
def kv_append(k, v, k_cache, v_cache, pos):
    """Write row t of k, v (n, n_head_kv, d_h) into cache position pos[t] (pos: int64 (n,))."""
    n, n_kv_heads, d = k.shape
    for g in range(n_kv_heads):
        for t in range(n):
            for i in range(d):
                k_cache[g, pos[t], i] = k[t, g, i]
                v_cache[g, pos[t], i] = v[t, g, i]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def gated_attention(q, qg, k_cache, v_cache, pos, out):
    """Causal GQA attention for n query rows, gated by σ(gate), written to out (n, H·d_h).

    q: (n, H, d_h) normed and rotated queries. Row t sits at position pos[t] (int64 (n,)) and
    sees cache positions 0..pos[t] (the cache already holds this call's keys).
    qg: (n, H, 2·d_h) the packed `attn_q` output; the second half of each head is the gate.
    Query head h reads KV head h // (H / n_head_kv) (consecutive groups, HF repeat_kv).
    Scale 1/sqrt(d_h).
    """
    n, H, d = q.shape
    group = H // k_cache.shape[0]
    scale = np.float32(1.0 / math.sqrt(d))
    # Rows are taken as 1-D views: LLVM vectorises the d_h loops over views, not over
    # 2-D/3-D indexing whose strides it cannot prove.
    for item in prange(n * H):
        t = item // H
        h = item - t * H
        g = h // group
        n_kv = pos[t] + 1
        qh = q[t, h]
        keys = k_cache[g]
        values = v_cache[g]
        scores = np.empty(n_kv, dtype=np.float32)
        best = np.float32(-np.inf)
        for p in range(n_kv):
            kp = keys[p]
            s = np.float32(0.0)
            for i in range(d):
                s += qh[i] * kp[i]
            s *= scale
            scores[p] = s
            best = max(best, s)
        total = np.float32(0.0)
        for p in range(n_kv):
            e = expf(scores[p] - best)
            scores[p] = e
            total += e
        acc = np.zeros(d, dtype=np.float32)
        for p in range(n_kv):
            wp = scores[p]
            vp = values[p]
            for i in range(d):
                acc[i] += wp * vp[i]
        inv_total = np.float32(1.0) / total
        gate = qg[t, h, d:]
        o = out[t, h * d:(h + 1) * d]
        for i in range(d):
            o[i] = acc[i] * inv_total / (np.float32(1.0) + expf(-gate[i]))
