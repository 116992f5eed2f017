"""The op set the forward pass calls, GPU flavour: the names and argument order of `cpu/ops.py`.

Activations, states and scratch are device arrays. Weights are wherever the placement put them
(`hybrid.weights.bind_weights`): the matrix ops look at each weight and run
* on the device when it is a device array, or
* on the CPU when it is a host array: the activation rows go down to pinned host memory, the CPU
  kernel (`cpu.ops`, nogil) runs there, and its result comes back up (`gpu.runtime.memory.host_call`).
Small vectors (norm weights, conv taps, gate constants) always live on the device.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

import cpu.ops as host_ops
from cpu.quants import dequantize_rows as host_dequantize_rows

from . import ffn, quants
from . import moe as device_moe
from .argmax import argmax_rows
from .attention import KV_DTYPE, gated_attention, kv_append
from .gdn import conv1d_silu, gated_delta_rule, gdn_mixer, l2_norm_heads
from .matmul.matvec import matvec as device_matvec
from .matmul.matvec import matvecs as device_matvecs
from .norm import add_rms_norm, gated_rms_norm, head_rms_norm, rms_norm
from .rope import rope_inv_freq, rope_neox
from .runtime import memory
from .runtime.memory import THREADS, host_call, is_device, stream
from .top_logits import top_logits

# Decode-time launches are deliberately small (a few rows, one block per head): numba's
# low-occupancy warning would fire on most of them and bury the user's output.
numba.config.CUDA_LOW_OCCUPANCY_WARNINGS = False

NAME = "gpu"


def matvec(wtype: int, w, x, out) -> None:
    """out = x · Wᵀ for device rows x (n, cols): on the device, or through the host for a host W."""
    if is_device(w):
        device_matvec(wtype, w, x, out)
    else:
        host_call((x,), (out,), lambda x_host, out_host: host_ops.matvec(wtype, w, x_host, out_host))


def matvecs(products, x) -> None:
    """matvec of one input x by several matrices, products = ((wtype, w, out), ...): the device
    matrices share one quantisation of x (gpu.matmul.matvec.matvecs)."""
    device_matvecs([p for p in products if is_device(p[1])], x)
    for wtype, w, out in products:
        if not is_device(w):
            matvec(wtype, w, x, out)


def swiglu(wtype_gate: int, w_gate, wtype_up: int, w_up, x, h_out) -> None:
    """h_out = SiLU(x · W_gateᵀ) · (x · W_upᵀ): the fused CPU kernel when both are on the host."""
    if not is_device(w_gate) and not is_device(w_up):
        host_call((x,), (h_out,),
                  lambda x_host, h_host: host_ops.swiglu(wtype_gate, w_gate, wtype_up, w_up, x_host, h_host))
    else:
        ffn.swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out, matvec=matvec)


def moe_ffn(moe, x, out, stats=None) -> None:
    """The MoE FFN of device rows x into out; the chosen experts go to stats.count (a
    hybrid.forward.MoEStats) when given. By where its weights are:
    * all in host memory: wholly on the host, one hand-off;
    * routed experts in host memory, router and shared expert on the device (the planner's
      placement): one hand-off for routing and every routed expert, the rest on the device
      (`gpu.moe.hybrid_moe_ffn`; capturable as a CUDA graph);
    * experts on the device (all of them, or some kinds by an -ot rule): on the device, each
      product where its weights live (`gpu.moe.moe_ffn`; eager)."""
    if not any(is_device(m.data) for m in _matrices(moe)):
        host_call((x,), (out,), lambda x_host, out_host: host_ops.moe_ffn(moe, x_host, out_host, stats))
    elif not any(is_device(m.data) for m in (moe.gate, moe.up, moe.down)):
        device_moe.hybrid_moe_ffn(moe, x, out, matvec=matvec, swiglu=swiglu, stats=stats)
    else:
        device_moe.moe_ffn(moe, x, out, matvec=matvec, swiglu=swiglu, stats=stats)


def _matrices(moe):
    """Every matrix of a MoE FFN: router, the routed expert stacks, the shared expert and its gate."""
    shared = (moe.shared.gate, moe.shared.up, moe.shared.down, moe.shared_gate) if moe.shared else ()
    return (moe.router, moe.gate, moe.up, moe.down, *shared)


def dequantize_rows(wtype: int, w, ids, cols: int):
    """float32 (n, cols) device rows `ids` (host int array) of W: embedding lookups."""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    if not is_device(w):
        return memory.upload(host_dequantize_rows(wtype, w, ids, cols))
    out = cuda.device_array((len(ids), cols), np.float32)
    quants.dequantize_rows(wtype, w, memory.upload(ids), cols, out)
    return out


@cuda.jit(cache=True)
def _add_inplace(x, y):
    k = cuda.grid(1)
    cols = x.shape[1]
    if k < x.shape[0] * cols:
        t = k // cols
        c = k - t * cols
        x[t, c] += y[t, c]


def add_inplace(x, y) -> None:
    """The residual add: x += y, both (n, D) on the device."""
    if x.size:
        _add_inplace[-(-x.size // THREADS), THREADS, stream()](x, y)


__all__ = [
    "KV_DTYPE", "NAME", "add_inplace", "add_rms_norm", "argmax_rows", "conv1d_silu", "dequantize_rows", "gated_attention", "gated_delta_rule",
    "gated_rms_norm", "gdn_mixer", "head_rms_norm", "kv_append", "l2_norm_heads", "matvec", "matvecs", "moe_ffn", "rms_norm",
    "rope_inv_freq", "rope_neox", "swiglu", "top_logits",
]

