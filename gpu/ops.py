"""The op set the forward pass calls, GPU flavour: the names and argument order of `cpu/ops.py`.

Activations, states and scratch are device arrays. Weights are wherever the placement put them
(`hybrid.weights.bind_weights`): the matrix ops look at each weight and run
* on the device when it is a device array, or
* on the CPU when it is a host array: the activation rows go down to pinned host memory, the CPU
  kernel (`cpu.ops`, nogil) runs there, and its result comes back up (`gpu.memory.host_call`).
Small vectors (norm weights, conv taps, gate constants) always live on the device.
"""
from __future__ import annotations

import numba
import numpy as np
from numba import cuda

import cpu.ops as host_ops
from cpu.quants import dequantize_rows as host_dequantize_rows

from . import embed, ffn, memory
from .argmax import argmax_rows
from .attention import gated_attention, kv_append
from .gdn import conv1d_silu, gated_delta_rule, gdn_mixer
from .matvec import matvec as device_matvec
from .matvec import matvecs as device_matvecs
from .memory import THREADS, host_call, is_device, stream

# Decode-time launches are deliberately small (a few rows, one block per head): numba's
# low-occupancy warning would fire on most of them and bury the user's output.
numba.config.CUDA_LOW_OCCUPANCY_WARNINGS = False
from .norm import add_rms_norm, gated_rms_norm, head_rms_norm, l2_norm_heads, rms_norm
from .rope import rope_inv_freq, rope_neox
from .top_logits import top_logits

NAME = "gpu"


def matvec(wtype: int, w, x, out) -> None:
    """out = x · Wᵀ for device rows x (n, cols): on the device, or through the host for a host W."""
    if is_device(w):
        device_matvec(wtype, w, x, out)
    else:
        host_call((x,), (out,), lambda x_host, out_host: host_ops.matvec(wtype, w, x_host, out_host))


def matvecs(products, x) -> None:
    """matvec of one input x by several matrices, products = ((wtype, w, out), ...): the device
    matrices share one quantisation of x (gpu.matvec.matvecs)."""
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
      (`gpu.ffn.hybrid_moe_ffn`; capturable as a CUDA graph);
    * experts on the device (all of them, or some kinds by an -ot rule): on the device, each
      product where its weights live (`gpu.ffn.moe_ffn`; eager)."""
    if not any(is_device(m.data) for m in _matrices(moe)):
        host_call((x,), (out,), lambda x_host, out_host: host_ops.moe_ffn(moe, x_host, out_host, stats))
    elif not any(is_device(m.data) for m in (moe.gate, moe.up, moe.down)):
        ffn.hybrid_moe_ffn(moe, x, out, matvec=matvec, swiglu=swiglu, stats=stats)
    else:
        ffn.moe_ffn(moe, x, out, matvec=matvec, swiglu=swiglu, stats=stats)


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
    embed.dequantize_rows(wtype, w, memory.upload(ids), cols, out)
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
    "NAME", "add_inplace", "add_rms_norm", "argmax_rows", "conv1d_silu", "dequantize_rows", "gated_attention", "gated_delta_rule",
    "gated_rms_norm", "gdn_mixer", "head_rms_norm", "kv_append", "l2_norm_heads", "matvec", "matvecs", "moe_ffn", "rms_norm",
    "rope_inv_freq", "rope_neox", "swiglu", "top_logits",
]


def ptx_targets():
    """(name, python function, argument types) of every kernel this op set adds to the matvec,
    as the forward calls them: for the sm_90 PTX check (tools/gpu_ptx_check.py)."""
    from numba import types

    from . import argmax, attention, expert_cache as ec, gdn, norm, rope, top_logits as top

    f32, f64, i64 = types.float32, types.float64, types.int64

    def a(dtype, ndim, layout="C"):
        return types.Array(dtype, ndim, layout)

    m1, m2, m3, m4 = a(f32, 1), a(f32, 2), a(f32, 3), a(f32, 4)
    kernels = [
        ("argmax parts", argmax._argmax_parts, (m2, i64, m3)),
        ("argmax merge", argmax._argmax_merge, (m3, i64, m2)),
        ("top_logits", top._top_logits, (a(types.uint32, 2), a(types.uint32, 2))),
        ("rms_norm", norm._rms_norm, (m2, m1, f64, m2)),
        ("add_rms_norm", norm._add_rms_norm, (m2, m2, m1, f64, m2)),
        ("head_rms_norm", norm._head_rms_norm, (m3, m1, f64, m3)),
        ("gated_rms_norm", norm._gated_rms_norm, (m2, m2, m1, f64, m2)),
        ("l2_norm_heads", norm._l2_norm_heads, (m2, i64, i64, f64)),
        ("rope_neox", rope._rope_neox, (m3, a(i64, 1), a(f64, 1))),
        ("kv_append", attention._kv_append, (m3, m3, m3, m3, a(i64, 1))),
        ("attention parts", attention._attention_parts, (m3, m3, m3, a(i64, 1), i64, m3, m3, m4)),
        ("attention merge", attention._attention_merge, (m3, a(i64, 1), i64, m3, m3, m4, m2)),
        ("conv1d_silu", gdn._conv1d_silu, (m2, m2, m2, m2, m3)),
        ("conv1d_silu tokens", gdn._conv1d_silu_tokens, (m2, m2, m2, m2, m3)),
        ("conv state advance", gdn._conv_state_advance, (m2, m2)),
        ("gdn_gates", gdn._gdn_gates, (m2, m2, m1, m1, m2, m2)),
        ("gdn conv_norm_gates", gdn._conv_norm_gates, (m2, m2, m2, m2, m3, i64, i64, f64, m2, m2, m1, m1, m2, m2)),
        ("gated_delta_rule", gdn._gated_delta_rule, (m2, i64, types.boolean, m2, m2, m3, m2, m4,
                                                     m2, m1, f64, m2, a(types.int32, 2))),
        ("add_inplace", _add_inplace, (m2, m2)),
        ("silu_times", ffn._silu_times, (m2, m2)),
        ("moe gather_rows", ffn._gather_rows, (m2, a(i64, 1), i64, m2)),
        ("moe scatter_rows", ffn._scatter_rows, (m2, a(i64, 1), a(i64, 1), i64, m3)),
        ("moe weighted_sum", ffn._weighted_sum, (m3, m2, m2)),
        ("moe add_gated", ffn._add_gated, (m2, m2, m2)),
        ("expert cache route", ec._route, (a(types.uint32, 2), a(types.int32, 1), a(types.int32, 1), a(i64, 2), m2,
                                           a(types.int32, 2), m2, m2, a(i64, 2), m2)),
        ("expert cache silu_times", ec._silu_times_gpu, (m2, m2, a(types.int32, 2))),
        ("expert cache fetch", ec._fetch, (a(types.int32, 2), a(i64, 2),
                                           *(a(types.uint32, 2), i64, a(types.uint32, 2)) * 2)),
        ("expert cache finish", ec._finish, (m2, m2, m2, a(types.int32, 2), m2, m2, m2, types.boolean)),
        ("fill_zero", memory._fill_zero_kernel, (m1,)),
        ("copy_2d", memory._copy_2d_kernel, (a(f32, 2, "A"), a(f32, 2, "A"))),
    ]
    for name, kernel, argtypes in kernels:
        yield name, kernel.py_func, argtypes
    yield from embed.ptx_targets()
    from . import gemm
    yield from gemm.ptx_targets()        # prompt-chunk products (matvec calls of many rows)
