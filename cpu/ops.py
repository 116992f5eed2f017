"""The op set the forward pass calls, CPU flavour. `gpu/ops.py` provides the same names
with the same argument order, so `hybrid/forward.py` is written once against either.

Conventions: activations are float32 C-contiguous, outputs are preallocated by the caller
and passed last (an op never allocates per call in the layer loop), weights are
(ggml type id, uint8 rows × row_bytes) pairs for the matrix ops.
"""
from __future__ import annotations

import numpy as np

from cpu import matmul as _matmul
from cpu.argmax import argmax_rows
from cpu.attention import KV_DTYPE, gated_attention, kv_append
from cpu.ffn import swiglu as _swiglu
from cpu.gdn import conv1d_silu, gated_delta_rule, gdn_mixer, l2_norm_heads
from cpu.matvec import matvec as _matvec
from cpu.moe import moe_ffn
from cpu.norm import gated_rms_norm, head_rms_norm, rms_norm
from cpu.quants import dequantize_rows
from cpu.rope import rope_inv_freq, rope_neox
from cpu.top_logits import top_logits

NAME = "cpu"


def matvec(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """`cpu.matvec.matvec`; a prompt chunk (≥ cpu.matmul.MIN_SLOTS rows) of a quantised type goes
    through `cpu.matmul`, which gives the same bits, tiled for many rows."""
    if _matmul.takes(wtype, x):
        _matmul.matmul(wtype, w, x, out)
    else:
        _matvec(wtype, w, x, out)


def matvecs(products, x: np.ndarray) -> None:
    """`matvec` of one input x by several matrices, products = ((wtype, w, out), ...) (the GPU
    quantises x once for all of them; here each call quantises its own, with the same bits)."""
    for wtype, w, out in products:
        matvec(wtype, w, x, out)


def swiglu(wtype_gate: int, w_gate: np.ndarray, wtype_up: int, w_up: np.ndarray,
           x: np.ndarray, h_out: np.ndarray) -> None:
    """`cpu.ffn.swiglu`, routed like `matvec` (both weight types must be covered)."""
    if _matmul.takes(wtype_gate, x) and _matmul.takes(wtype_up, x):
        _matmul.swiglu_matmul(wtype_gate, w_gate, wtype_up, w_up, x, h_out)
    else:
        _swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out)


def add_inplace(x: np.ndarray, y: np.ndarray) -> None:
    """The residual add: x += y (numpy's own loop; one C call, no temporaries)."""
    np.add(x, y, out=x)


def add_rms_norm(x: np.ndarray, y: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:
    """The residual add and the next RMSNorm: x += y, then out = rms_norm(x; w). One op so the
    GPU can do both in one pass over x (here it is just the two, bit for bit)."""
    add_inplace(x, y)
    rms_norm(x, w, eps, out)


__all__ = [
    "KV_DTYPE", "NAME", "add_inplace", "add_rms_norm", "argmax_rows", "conv1d_silu", "dequantize_rows", "gated_attention", "gated_delta_rule",
    "gated_rms_norm", "gdn_mixer", "head_rms_norm", "kv_append", "l2_norm_heads", "matvec", "matvecs", "moe_ffn", "rms_norm",
    "rope_inv_freq", "rope_neox", "swiglu", "top_logits",
]
