"""Partial NEOX rotary embedding (docs/MODEL_FORMAT.md §3.3 step 4).

Only the first n_rot dims of each head rotate; pair i is (x_i, x_{i+n_rot/2}) (NEOX
"rotate_half" pairing, not the interleaved GPT-J pairing). qwen35's IMROPE with text-only
positions (t = h = w = p) is exactly this.
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit


def rope_inv_freq(n_rot: int, theta: float) -> np.ndarray:
    """θ^(−2i/n_rot) for i < n_rot/2, float64: computed once per model, exact to the double."""
    return theta ** (-2.0 * np.arange(n_rot // 2, dtype=np.float64) / n_rot)


@njit(cache=True, nogil=True)
def rope_neox(x, pos, inv_freq):
    """Rotate x (n, H, d) in place: row t at position pos[t], pairs (i, i + n_rot/2).

    n_rot = 2·len(inv_freq); dims n_rot..d−1 are left as they are. The angle and its
    cos/sin are taken in float64 so large positions keep their precision.

    Each row's cos/sin go into a small table first, so each head rotates its pairs in one
    contiguous loop over i that LLVM vectorises (a head-innermost loop strides d floats per
    step: 3-4x slower). Same operations per pair, so the same bits. The loop indexes x
    directly: 1-D views of the two halves measured 3x slower at n_rot/2 = 32 pairs (the
    per-head view set-up and overlap checks cost more than the pairs).
    """
    n, H, _ = x.shape
    half = inv_freq.shape[0]
    cos = np.empty(half, np.float32)
    sin = np.empty(half, np.float32)
    for t in range(n):
        p = np.float64(pos[t])
        for i in range(half):
            phi = p * inv_freq[i]
            cos[i] = np.float32(math.cos(phi))
            sin[i] = np.float32(math.sin(phi))
        for h in range(H):
            for i in range(half):
                a, b = x[t, h, i], x[t, h, i + half]
                x[t, h, i] = a * cos[i] - b * sin[i]
                x[t, h, i + half] = a * sin[i] + b * cos[i]
