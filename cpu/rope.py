"""Partial NEOX rotary embedding (../docs/MODEL_FORMAT.md §3.3 step 4).

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
    """
    n, H, _ = x.shape
    half = inv_freq.shape[0]
    for t in range(n):
        p = np.float64(pos[t])
        for i in range(half):
            phi = p * inv_freq[i]
            c = np.float32(math.cos(phi))
            s = np.float32(math.sin(phi))
            for h in range(H):
                a = x[t, h, i]
                b = x[t, h, i + half]
                x[t, h, i] = a * c - b * s
                x[t, h, i + half] = a * s + b * c
