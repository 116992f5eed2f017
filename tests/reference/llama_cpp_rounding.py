"""llama.cpp's activation rounding before quantised products, for the reference's optional emulation.

llama.cpp's CPU backend does not multiply a quantised weight by f32 activations: it first converts
the activation row to the weight type's `vec_dot_type` (ggml-cpu.c `type_traits_cpu`) — Q8_0
blocks of 32 for Q4_0/Q8_0 weights, Q8_K blocks of 256 for the K-quants, f16/bf16 for f16/bf16
weights — and takes the integer (or half) dot product. On random synthetic models this 8-bit
rounding moves logits by several units (their layers amplify small errors far more than a trained
model's), which would swamp any real layout bug. Rounding the same way in the float64 reference
brings the gap back to ~0.1, so quantised files can be compared tightly.

Formulas (ggml-quants.c): Q8_0 — d = amax/127 stored as f16, q = round(x·127/amax) (the x86 SIMD
path rounds half to even); Q8_K — max = the signed element of largest |x|, iscale = −127/max,
q = min(127, nearest_int(iscale·x)), d = 1/iscale kept f32.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as T

_Q8_0_WEIGHTS = (T.Q4_0, T.Q8_0)
_Q8_K_WEIGHTS = (T.Q4_K, T.Q5_K, T.Q6_K)


def _q8_0(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    safe = np.where(amax > 0, amax, 1.0)
    q = np.where(amax > 0, np.round(blocks * (np.float32(127.0) / safe)), 0.0)
    d = (amax / np.float32(127.0)).astype(np.float16).astype(np.float64)
    return (q * d).reshape(x.shape)


def _q8_k(x: np.ndarray) -> np.ndarray:
    blocks = x.reshape(-1, 256)
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    safe = np.where(signed_max != 0, signed_max, 1.0)
    iscale = np.where(signed_max != 0, np.float32(-127.0) / safe, 0.0).astype(np.float32)
    q = np.minimum(np.round(iscale * blocks), 127.0)
    d = np.where(iscale != 0, 1.0 / np.where(iscale != 0, iscale, 1.0), 0.0).astype(np.float32)
    return (q * d).reshape(x.shape)


def _bf16(x: np.ndarray) -> np.ndarray:
    bits = x.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000  # round to nearest even
    return rounded.astype(np.uint32).view(np.float32)


def round_activations(x: np.ndarray, weight_type: int) -> np.ndarray:
    """Rows of x (..., n) as llama.cpp feeds them to a product with a weight of `weight_type`."""
    x32 = np.ascontiguousarray(x, dtype=np.float32)  # llama.cpp activations are f32
    if weight_type in _Q8_0_WEIGHTS:
        out = _q8_0(x32)
    elif weight_type in _Q8_K_WEIGHTS:
        out = _q8_k(x32)
    elif weight_type == T.F16:
        out = x32.astype(np.float16)
    elif weight_type == T.BF16:
        out = _bf16(x32)
    else:  # F32 weights multiply f32 activations as they are
        out = x32
    return np.asarray(out, dtype=np.float64)
