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

# ggml-cpu's type_traits_cpu[...].vec_dot_type: Q8_0 codes (Q8_1's are the same codes, with an
# extra sum the float form does not need), or Q8_K
_Q8_0_WEIGHTS = (T.Q4_0, T.Q8_0, T.Q5_0, T.IQ4_NL, T.MXFP4, T.Q4_1, T.Q5_1)
_Q8_K_WEIGHTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S,
                 T.IQ1_S, T.IQ1_M, T.IQ4_XS)


def q8_0(x: np.ndarray):
    """ggml's x86 AVX2 `quantize_row_q8_0` of rows x (n, cols): (qs int8 (n, cols), d float32
    (n, cols/32), the fp16 value widened). amax per 32, d = fp16(amax/127), id = 127/amax (0 for
    amax 0), qs = round-half-even(x·id) (`_mm256_round_ps` NEAREST), saturated by the packs."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(over="ignore"):   # amax/127 past 65504 is inf in fp16, as in ggml
        d = (amax / np.float32(127)).astype(np.float32).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint(xb * inv[:, :, None]).astype(np.int32)
    return np.clip(qs, -128, 127).astype(np.int8).reshape(n, cols), d


def q8_1(x: np.ndarray):
    """ggml's x86 `quantize_row_q8_1`: Q8_0's (qs, d) and s = fp16(d_f32·Σqs) per block, d_f32
    the unrounded amax/127."""
    qs, d = q8_0(x)
    n, cols = x.shape
    d32 = (np.abs(x.reshape(n, cols // 32, 32)).max(axis=2) / np.float32(127)).astype(np.float32)
    sums = qs.reshape(n, cols // 32, 32).astype(np.int32).sum(axis=2)
    with np.errstate(over="ignore"):
        return qs, d, (d32 * sums.astype(np.float32)).astype(np.float16).astype(np.float32)


MIN_TYPES = (T.Q4_1, T.Q5_1)   # weight = d·q + m per 32, dotted with Q8_1 activations


def block_mins(raw: np.ndarray, cols: int) -> np.ndarray:
    """The fp16 m (bytes 2..3 of each 32-weight block) of rows of raw Q4_1 / Q5_1 blocks (..., row
    bytes), as float64 (..., cols/32)."""
    blocks = raw.reshape(*raw.shape[:-1], cols // 32, -1)
    return blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def q8_1_min_term(x: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """llama.cpp's Q4_1 / Q5_1 dot takes each block's m·Σx as m·s, s = fp16(d_f32·Σq) of `q8_1`,
    where the float form (x rounded to Q8_0 codes, `round_activations`) gives m·d·Σq: the
    difference Σ_blocks m·(s − d·Σq), (n, rows) float64, for x (n, cols) and mins (rows, cols/32)."""
    qs, d, s = q8_1(np.ascontiguousarray(x, dtype=np.float32))
    sums = qs.reshape(x.shape[0], -1, 32).astype(np.float64).sum(axis=2)
    return (s.astype(np.float64) - d.astype(np.float64) * sums) @ mins.T


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5·2**23, keep the low 23 bits − 2**22 (half to even)."""
    bits = (v.astype(np.float32) + np.float32(12582912.0)).astype(np.float32).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def q8_k(x: np.ndarray):
    """ggml's `quantize_row_q8_K_ref` (what its x86 build calls) of rows x (n, cols), signs as
    ggml has them: (qs int8 (n, cols), d float32 (n, cols/256), bsums int16 (n, cols/16)).
    max = the value of largest |x| (the first such), iscale = −127/max, qs = min(127,
    nearest_int(iscale·x)), d = 1/iscale; an all-zero block has d = 0, qs = 0."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 256, 256).astype(np.float32)
    mx = np.take_along_axis(xb, np.abs(xb).argmax(axis=2)[:, :, None], axis=2)[:, :, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    qs = np.minimum(127, _nearest_int(iscale[:, :, None] * xb)).astype(np.int8)
    bsums = qs.reshape(n, cols // 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return qs.reshape(n, cols), d, bsums


def _q8_0(x: np.ndarray) -> np.ndarray:
    qs, d = q8_0(x.reshape(-1, x.shape[-1]))
    return (qs.astype(np.float64) * np.repeat(d.astype(np.float64), 32, axis=1)).reshape(x.shape)


def _q8_k(x: np.ndarray) -> np.ndarray:
    qs, d, _ = q8_k(x.reshape(-1, x.shape[-1]))
    return (qs.astype(np.float64) * np.repeat(d.astype(np.float64), 256, axis=1)).reshape(x.shape)


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
        with np.errstate(over="ignore"):   # past the half range: inf, as F16C's conversion gives
            out = x32.astype(np.float16)
    elif weight_type == T.BF16:
        out = _bf16(x32)
    else:  # F32 weights multiply f32 activations as they are
        out = x32
    return np.asarray(out, dtype=np.float64)
