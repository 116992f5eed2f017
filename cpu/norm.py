"""RMSNorm and its variants (docs/MODEL_FORMAT.md §3.1, §3.3 step 3, §3.4 step 8).

All weights are used exactly as stored in the GGUF: the converter already folded the
Gemma-style +1 into every norm except `ssm_norm`, which never had it.

These kernels are O(n·D) and tiny next to the matvecs around them, so they run serially:
a parallel region would cost more to start than it saves at decode sizes. Sums of squares
accumulate in float64 (as ggml's CPU rms_norm does), so the result does not depend on D.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit

from .expf import expf


@njit(cache=True, nogil=True)
def rms_norm(x, w, eps, out):
    """out[t] = w ⊙ x[t] / sqrt(mean(x[t]²) + eps), rows of x (n, D); out may be x."""
    n, D = x.shape
    for t in range(n):
        ss = 0.0
        for i in range(D):
            v = np.float64(x[t, i])
            ss += v * v
        scale = np.float32(1.0 / math.sqrt(ss / D + eps))
        for i in range(D):
            out[t, i] = x[t, i] * scale * w[i]


@njit(cache=True, nogil=True)
def head_rms_norm(x, w, eps, out):
    """Per-head RMSNorm over the first d = len(w) entries of each head slot.

    x is (n, H, S) with S ≥ d, out is (n, H, d). S > d reads a packed projection in place:
    `attn_q` gives per head [query | gate] (S = 2·d_h), and this takes the query half
    without a separate split copy. out may be x when S == d.
    """
    n, H, _ = x.shape
    d = w.shape[0]
    for t in range(n):
        for h in range(H):
            ss = 0.0
            for i in range(d):
                v = np.float64(x[t, h, i])
                ss += v * v
            scale = np.float32(1.0 / math.sqrt(ss / d + eps))
            for i in range(d):
                out[t, h, i] = x[t, h, i] * scale * w[i]


@njit(cache=True, nogil=True, error_model="numpy")
def gated_rms_norm(o, z, w, eps, out):
    """GDN output norm: per v-head, RMSNorm(o_j; w) over d_v, THEN ⊙ SiLU(z_j).

    o, z, out are (n, H_v·d_v); w is the shared `ssm_norm` (d_v,). Norm first, gate second
    (HF Qwen3NextRMSNormGated); the other order gives different numbers.

    error_model="numpy" drops the divide-by-zero branch Python semantics put on the SiLU's
    division (its divisor 1 + exp(−z) is ≥ 1 anyway): that branch kept LLVM from vectorising
    the gate loop (4-6x slower). Same operations, so the same bits. The float64 sum of
    squares stays scalar, as in every norm here: vectorising it would reorder the sum.
    """
    n, width = o.shape
    d = w.shape[0]
    n_heads = width // d
    for t in range(n):
        for j in range(n_heads):
            base = j * d
            ss = 0.0
            for i in range(d):
                v = np.float64(o[t, base + i])
                ss += v * v
            scale = np.float32(1.0 / math.sqrt(ss / d + eps))
            for i in range(d):
                zi = z[t, base + i]
                silu = zi / (np.float32(1.0) + expf(-zi))
                out[t, base + i] = o[t, base + i] * scale * w[i] * silu
