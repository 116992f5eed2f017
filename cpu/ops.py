"""The op set the forward pass calls, CPU flavour. `gpu/ops.py` provides the same names
with the same argument order, so `hybrid/forward.py` is written once against either.

Conventions: activations are float32 C-contiguous, outputs are preallocated by the caller
and passed last (an op never allocates per call in the layer loop), weights are
(ggml type id, uint8 rows × row_bytes) pairs for the matrix ops.
"""
from __future__ import annotations

import numpy as np

from cpu.attention import gated_attention, kv_append
from cpu.ffn import swiglu
from cpu.gdn import conv1d_silu, gated_delta_rule, l2_norm_heads
from cpu.matvec import matvec
from cpu.moe import moe_ffn
from cpu.norm import gated_rms_norm, head_rms_norm, rms_norm
from cpu.quants import dequantize_rows
from cpu.rope import rope_inv_freq, rope_neox

NAME = "cpu"


def add_inplace(x: np.ndarray, y: np.ndarray) -> None:
    """The residual add: x += y (numpy's own loop; one C call, no temporaries)."""
    np.add(x, y, out=x)


__all__ = [
    "NAME", "add_inplace", "conv1d_silu", "dequantize_rows", "gated_attention", "gated_delta_rule",
    "gated_rms_norm", "head_rms_norm", "kv_append", "l2_norm_heads", "matvec", "moe_ffn", "rms_norm",
    "rope_inv_freq", "rope_neox", "swiglu",
]
