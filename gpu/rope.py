"""Partial NEOX rotary embedding on the GPU: same ops and arguments as `cpu/rope.py`.

Only the first n_rot dims of each head rotate; pair i is (x_i, x_{i+n_rot/2}). One thread per
(row, pair) takes the angle and its cos/sin in float64 (large positions keep their precision)
and rotates that pair in every head.
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64

import cpu.rope

from .runtime.memory import THREADS, stream, upload


def rope_inv_freq(n_rot: int, theta: float):
    """θ^(−2i/n_rot) for i < n_rot/2, float64, on the device."""
    return upload(cpu.rope.rope_inv_freq(n_rot, theta))


@cuda.jit(cache=True)
def _rope_neox(x, pos, inv_freq):
    n, H, _ = x.shape
    half = inv_freq.shape[0]
    k = cuda.grid(1)
    if k >= n * half:
        return
    t = k // half
    i = k - t * half
    phi = float64(pos[t]) * inv_freq[i]
    c = float32(math.cos(phi))
    s = float32(math.sin(phi))
    for h in range(H):
        a = x[t, h, i]
        b = x[t, h, i + half]
        x[t, h, i] = a * c - b * s
        x[t, h, i + half] = a * s + b * c


def rope_neox(x, pos, inv_freq):
    """Rotate x (n, H, d) in place: row t at position pos[t] (int64, device), pairs (i, i + n_rot/2)."""
    items = x.shape[0] * inv_freq.shape[0]
    if items:
        _rope_neox[-(-items // THREADS), THREADS, stream()](x, pos, inv_freq)
