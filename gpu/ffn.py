"""SwiGLU on the GPU for weights placed there (the twin of `cpu/ffn.py`): gate and up products
with the device matvec (`gpu.matmul.matvec`, slot-for-slot bit identical), then h = SiLU(g) · u,
so every row keeps the bits of a one-row call, as on the CPU."""
from __future__ import annotations

import math

from numba import cuda, float32

from .matmul.matvec import matvec as device_matvec
from .runtime import memory
from .runtime.memory import THREADS, stream


def _blocks(size: int) -> int:
    return -(-size // THREADS)


@cuda.jit(cache=True)
def _silu_times(g, u):
    k = cuda.grid(1)
    cols = g.shape[1]
    if k < g.shape[0] * cols:
        t = k // cols
        c = k - t * cols
        gv = g[t, c]
        g[t, c] = gv / (float32(1.0) + math.exp(-gv)) * u[t, c]


def silu_times(g, u) -> None:
    """g ← SiLU(g) ⊙ u, both (n, F) on the device."""
    if g.size:
        _silu_times[_blocks(g.size), THREADS, stream()](g, u)


def swiglu(wtype_gate: int, w_gate, wtype_up: int, w_up, x, h_out, matvec=device_matvec) -> None:
    """h_out = SiLU(x · W_gateᵀ) · (x · W_upᵀ) on the device."""
    up = memory.scratch("swiglu_up", tuple(h_out.shape))
    matvec(wtype_gate, w_gate, x, h_out)
    matvec(wtype_up, w_up, x, up)
    silu_times(h_out, up)


def dense_ffn(wtypes, weights, x, h, out, matvec=device_matvec) -> None:
    """out = SwiGLU(x) · W_downᵀ on the device; wtypes, weights: (gate, up, down); h: the hidden
    scratch. What the runtime's weight streamer runs on the weights it copied in."""
    swiglu(wtypes[0], weights[0], wtypes[1], weights[1], x, h, matvec=matvec)
    matvec(wtypes[2], weights[2], h, out)   # both GEMMs for a prompt chunk (gpu.matmul.gemm)
