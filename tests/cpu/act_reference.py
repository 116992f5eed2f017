"""numpy statements of ggml's activation quantisers, written from ggml's source (x86 build:
ggml/src/ggml-cpu/arch/x86/quants.c `quantize_row_q8_0` / `quantize_row_q8_1`, and
`quantize_row_q8_K_ref`, which the x86 build calls for Q8_K), kept literal on purpose —
ggml's own sign convention for Q8_K included — so that they are an oracle independent of
cpu/activations.py. Inputs are finite; cols a multiple of the block.
"""
from __future__ import annotations

import numpy as np

from cpu.activations import FORMAT_OF, Q8_0, Q8_K


def q8_0(x: np.ndarray):
    """(qs int8 (n, cols), d float32 (n, cols/32) — the fp16 value, widened) per x86 AVX2:
    amax per 32, d = fp16(amax/127), id = 127/amax (0 if amax is 0), qs = round-to-nearest-even(x·id)."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 32, 32).astype(np.float32)
    amax = np.abs(xb).max(axis=2)
    with np.errstate(over="ignore"):   # amax/127 past 65504 is inf in fp16, as in ggml
        d = (amax / np.float32(127)).astype(np.float32).astype(np.float16).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    qs = np.rint(xb * inv[:, :, None]).astype(np.int32)          # _mm256_round_ps(…, NEAREST)
    return np.clip(qs, -128, 127).astype(np.int8).reshape(n, cols), d  # packs saturate


def q8_1(x: np.ndarray):
    """Q8_0's (qs, d) and s = fp16(d_f32 · Σqs) per block, d_f32 the unrounded amax/127."""
    qs, d = q8_0(x)
    n, cols = x.shape
    amax = np.abs(x.reshape(n, cols // 32, 32)).max(axis=2)
    d32 = (amax / np.float32(127)).astype(np.float32)
    sums = qs.reshape(n, cols // 32, 32).astype(np.int32).sum(axis=2)
    with np.errstate(over="ignore"):
        return qs, d, (d32 * sums.astype(np.float32)).astype(np.float16).astype(np.float32)


def _nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's nearest_int: add 1.5·2**23, keep the low 23 bits − 2**22 (half to even)."""
    bits = (v.astype(np.float32) + np.float32(12582912.0)).astype(np.float32).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def q8_k(x: np.ndarray):
    """(qs int8 (n, cols), d float32 (n, cols/256), bsums int16 (n, cols/16)), ggml's signs:
    max = the value of largest |x| (first such), iscale = −127/max, qs = min(127,
    nearest_int(iscale·x)), d = 1/iscale; all-zero blocks d = 0, qs = 0."""
    n, cols = x.shape
    xb = x.reshape(n, cols // 256, 256).astype(np.float32)
    idx = np.abs(xb).argmax(axis=2)
    mx = np.take_along_axis(xb, idx[:, :, None], axis=2)[:, :, 0]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(mx != 0, np.float32(-127) / mx, np.float32(0)).astype(np.float32)
        d = np.where(mx != 0, np.float32(1) / iscale, np.float32(0)).astype(np.float32)
    qs = np.minimum(127, _nearest_int(iscale[:, :, None] * xb)).astype(np.int8)
    bsums = qs.reshape(n, cols // 16, 16).astype(np.int32).sum(axis=2).astype(np.int16)
    return qs.reshape(n, cols), d, bsums


def dequantized_x(wtype: int, x: np.ndarray) -> np.ndarray:
    """x as a weight type's dot meets it (llama.cpp's CPU), float64 (n, cols): q·d per block
    for int8 formats (cols padded to the block with zeros), x rounded to F16 / BF16 (nearest
    even, ggml_compute_fp32_to_bf16's formula) for those weights, x itself for F32."""
    fmt = FORMAT_OF[wtype]
    n, cols = x.shape
    if fmt.name == "F16":
        with np.errstate(over="ignore"):   # past the half range: inf, as F16C's conversion gives
            return x.astype(np.float16).astype(np.float64)
    if fmt.name == "BF16":
        u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
        top = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint32)
        return (top << 16).view(np.float32).astype(np.float64)
    if fmt.name == "F32":
        return x.astype(np.float64)
    pad = -cols % fmt.block
    xp = np.concatenate([x, np.zeros((n, pad), np.float32)], axis=1)
    if fmt == Q8_K:
        qs, d, _ = q8_k(xp)
    else:
        qs, d = q8_0(xp)
    out = qs.astype(np.float64) * np.repeat(d.astype(np.float64), fmt.block, axis=1)
    return out[:, :cols]
