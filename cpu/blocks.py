"""Block decoders for every quantised type: one block → float32, bit-exact with ggml.

Each `block_<type>(w, o, y)` writes the block starting at byte o of the uint8 array w into
y[0:block_elems]. The float operations are ggml's (`dequantize_row_*` in ggml-quants.c), in its
order — e.g. Q2_K: (d·(sc & 15))·q − dmin·(sc >> 4) — so the bits equal `gguf.quants.dequantize`
(one exception: gguf-py's IQ1_M always takes the negative delta, ggml takes the sign from the
block; we follow ggml). Layouts and formulas: docs/MODEL_FORMAT.md §6.

`decode_block(wt, w, o, y)` runs the decoder of type wt, a compile-time constant (a kernel
factory's closure integer, `cpu.variants`), so a kernel carries one type's decoder only.

Tables: the IQ grids are facts of the format (ggml-common.h); they are taken from gguf-py's packed
copies once, at import, as float32 (exact small values). The sign table is the 7-bit index with its
parity as bit 7 (an even count of minus signs per 8 weights), computed here.
"""
from __future__ import annotations

import numpy as np
from gguf import quants as _gguf_quants
from numba import njit
from numba.core import types
from numba.core.errors import TypingError
from numba.extending import overload

from cpu.ggml_types import (IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL, IQ4_XS, MXFP4, Q2_K,
                            Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0)

from .simd import KSIGNS as KSIGNS_IQ2
from .simd import IQ4NL_KVALUES, MXFP4_KVALUES, e8m0_half_at, f16_at, f16_bits_to_f32


def _grid(cls) -> np.ndarray:
    cls.init_grid()
    return np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32)


IQ2XXS_GRID = _grid(_gguf_quants.IQ2_XXS)     # (256, 8) values 8, 25, 43
IQ2XS_GRID = _grid(_gguf_quants.IQ2_XS)       # (512, 8)
IQ2S_GRID = _grid(_gguf_quants.IQ2_S)         # (1024, 8)
IQ3XXS_GRID = _grid(_gguf_quants.IQ3_XXS)     # (256, 4) values 4..62
IQ3S_GRID = _grid(_gguf_quants.IQ3_S)         # (512, 4) odd values 1..15
IQ1S_GRID = _grid(_gguf_quants.IQ1_S)         # (2048, 8) values −1, 0, 1 (IQ1_M shares it)
KSIGNS = np.array(KSIGNS_IQ2, np.uint8)
IQ4NL_VALUES = np.array(IQ4NL_KVALUES, np.float32)
MXFP4_VALUES = np.array(MXFP4_KVALUES, np.float32)   # 2 × e2m1
IQ1_DELTA = np.float32(0.125)


@njit(inline="always")
def _u16(w, o):
    return np.uint32(w[o]) | (np.uint32(w[o + 1]) << np.uint32(8))


@njit(inline="always")
def _u32(w, o):
    return _u16(w, o) | (_u16(w, o + 2) << np.uint32(16))


@njit(inline="always")
def _sign(bits, j):
    return np.float32(-1.0) if (bits >> j) & 1 else np.float32(1.0)


# ---- the types with SIMD row dots (`cpu.simd`); decoded to floats for lookups and `cpu.decoded_moe`

@njit(inline="always")
def _scale_min_k4(w, s, j):
    """`get_scale_min_k4`: the j-th 6-bit scale and min of a Q4_K/Q5_K block (scales at byte s)."""
    if j < 4:
        return w[s + j] & 63, w[s + j + 4] & 63
    return (w[s + j + 4] & 0xF) | ((w[s + j - 4] >> 6) << 4), (w[s + j + 4] >> 4) | ((w[s + j] >> 6) << 4)


@njit(inline="always")
def block_q4_0(w, o, y):
    d = f16_at(w, o)
    for j in range(16):
        q = w[o + 2 + j]
        y[j] = d * np.float32(np.int32(q & 0xF) - 8)
        y[j + 16] = d * np.float32(np.int32(q >> 4) - 8)


@njit(inline="always")
def block_q8_0(w, o, y):
    d = f16_at(w, o)
    for j in range(32):
        y[j] = np.float32(np.int8(w[o + 2 + j])) * d


@njit(inline="always")
def block_q4_k_q5_k(w, o, y, has_qh):
    d = f16_at(w, o)
    dmin = f16_at(w, o + 2)
    qs = o + 48 if has_qh else o + 16
    for c in range(4):
        sc1, m1 = _scale_min_k4(w, o + 4, 2 * c)
        sc2, m2 = _scale_min_k4(w, o + 4, 2 * c + 1)
        d1, dm1 = d * np.float32(sc1), dmin * np.float32(m1)
        d2, dm2 = d * np.float32(sc2), dmin * np.float32(m2)
        for l in range(32):
            b = w[qs + 32 * c + l]
            lo, hi = np.int32(b & 0xF), np.int32(b >> 4)
            if has_qh:
                h = w[o + 16 + l]
                lo |= ((h >> (2 * c)) & 1) << 4
                hi |= ((h >> (2 * c + 1)) & 1) << 4
            y[64 * c + l] = d1 * np.float32(lo) - dm1
            y[64 * c + 32 + l] = d2 * np.float32(hi) - dm2


@njit(inline="always")
def block_q6_k(w, o, y):
    d = f16_at(w, o + 208)
    for h in range(2):
        ql, qh, sc, yo = o + 64 * h, o + 128 + 32 * h, o + 192 + 8 * h, 128 * h
        for l in range(32):
            s = l // 16
            b_qh = np.int32(w[qh + l])
            q1 = (np.int32(w[ql + l] & 0xF) | ((b_qh & 3) << 4)) - 32
            q2 = (np.int32(w[ql + l + 32] & 0xF) | (((b_qh >> 2) & 3) << 4)) - 32
            q3 = (np.int32(w[ql + l] >> 4) | (((b_qh >> 4) & 3) << 4)) - 32
            q4 = (np.int32(w[ql + l + 32] >> 4) | (((b_qh >> 6) & 3) << 4)) - 32
            y[yo + l] = (d * np.float32(np.int8(w[sc + s]))) * np.float32(q1)
            y[yo + l + 32] = (d * np.float32(np.int8(w[sc + s + 2]))) * np.float32(q2)
            y[yo + l + 64] = (d * np.float32(np.int8(w[sc + s + 4]))) * np.float32(q3)
            y[yo + l + 96] = (d * np.float32(np.int8(w[sc + s + 6]))) * np.float32(q4)


# ---- 32-weight blocks ------------------------------------------------------------------------

@njit(inline="always")
def block_q4_1(w, o, y):
    d, m = f16_at(w, o), f16_at(w, o + 2)
    for j in range(16):
        b = np.int32(w[o + 4 + j])
        y[j] = d * np.float32(b & 15) + m
        y[j + 16] = d * np.float32(b >> 4) + m


@njit(inline="always")
def block_q5_0(w, o, y):
    d, qh = f16_at(w, o), _u32(w, o + 2)
    for j in range(16):
        b = np.int32(w[o + 6 + j])
        y[j] = d * np.float32((b & 15 | np.int32((qh >> j) & 1) << 4) - 16)
        y[j + 16] = d * np.float32((b >> 4 | np.int32((qh >> (j + 16)) & 1) << 4) - 16)


@njit(inline="always")
def block_q5_1(w, o, y):
    d, m, qh = f16_at(w, o), f16_at(w, o + 2), _u32(w, o + 4)
    for j in range(16):
        b = np.int32(w[o + 8 + j])
        y[j] = d * np.float32(b & 15 | np.int32((qh >> j) & 1) << 4) + m
        y[j + 16] = d * np.float32(b >> 4 | np.int32((qh >> (j + 16)) & 1) << 4) + m


@njit(inline="always")
def block_iq4_nl(w, o, y):
    d = f16_at(w, o)
    for j in range(16):
        b = w[o + 2 + j]
        y[j] = d * IQ4NL_VALUES[b & 15]
        y[j + 16] = d * IQ4NL_VALUES[b >> 4]


@njit(inline="always")
def block_mxfp4(w, o, y):
    d = e8m0_half_at(w, o)   # halved: the table holds 2 × the e2m1 values
    for j in range(16):
        b = w[o + 1 + j]
        y[j] = d * MXFP4_VALUES[b & 15]
        y[j + 16] = d * MXFP4_VALUES[b >> 4]


# ---- K-quant super-blocks (256 weights) --------------------------------------------------------

@njit(inline="always")
def block_q2_k(w, o, y):
    # scales[16] qs[64] d dmin; weight e = 128h + 32s + l: 2 bits at shift 2s of qs[32h + l]
    d, dmin = f16_at(w, o + 80), f16_at(w, o + 82)
    for h in range(2):
        for s in range(4):
            for half in range(2):
                sc = np.int32(w[o + 8 * h + 2 * s + half])
                dl, ml = d * np.float32(sc & 15), dmin * np.float32(sc >> 4)
                for l in range(16 * half, 16 * half + 16):
                    q = (np.int32(w[o + 16 + 32 * h + l]) >> (2 * s)) & 3
                    y[128 * h + 32 * s + l] = dl * np.float32(q) - ml


@njit(inline="always")
def block_q3_k(w, o, y):
    # hmask[32] qs[64] scales[12] d; weight e = 128h + 32s + l: 2 bits at shift 2s of qs[32h + l],
    # minus 4 unless bit 4h + s of hmask[l] is set; 16 six-bit scales − 32, one per 16 weights
    d = f16_at(w, o + 108)
    for h in range(2):
        for s in range(4):
            for half in range(2):
                g = 8 * h + 2 * s + half                 # the scale of weights 16g .. 16g + 15
                lo = (np.int32(w[o + 96 + g % 8]) >> (4 * (g // 8))) & 15
                hi = (np.int32(w[o + 104 + g % 4]) >> (2 * (g // 4))) & 3
                dl = d * np.float32((lo | hi << 4) - 32)
                for l in range(16 * half, 16 * half + 16):
                    q = (np.int32(w[o + 32 + 32 * h + l]) >> (2 * s)) & 3
                    q -= ((np.int32(w[o + l]) >> (4 * h + s)) & 1 ^ 1) << 2
                    y[128 * h + 32 * s + l] = dl * np.float32(q)


@njit(inline="always")
def block_iq4_xs(w, o, y):
    # d, scales_h (u16: 2 bits per 32 weights), scales_l[4] (4 bits each), qs[128]
    d, sh = f16_at(w, o), _u16(w, o + 2)
    for ib in range(8):
        lo = (np.int32(w[o + 4 + ib // 2]) >> (4 * (ib % 2))) & 15
        hi = np.int32((sh >> (2 * ib)) & 3)
        dl = d * np.float32((lo | hi << 4) - 32)
        for j in range(16):
            b = w[o + 8 + 16 * ib + j]
            y[32 * ib + j] = dl * IQ4NL_VALUES[b & 15]
            y[32 * ib + 16 + j] = dl * IQ4NL_VALUES[b >> 4]


# ---- IQ grid types -----------------------------------------------------------------------------

@njit(inline="always")
def block_iq2_xxs(w, o, y):
    # d, then per 32 weights two u32: 4 grid bytes; 4 × 7-bit sign indices + a 4-bit scale
    d = f16_at(w, o)
    for ib in range(8):
        grid_ids, aux = o + 2 + 8 * ib, _u32(w, o + 6 + 8 * ib)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.25)
        for l in range(4):
            signs = KSIGNS[(aux >> (7 * l)) & 127]
            g = w[grid_ids + l]
            for j in range(8):
                y[32 * ib + 8 * l + j] = db * IQ2XXS_GRID[g, j] * _sign(signs, j)


@njit(inline="always")
def _iq2_scale(w, scales_at, s, d):
    """IQ2_XS / IQ2_S: the scale of weights 16s..16s+15, from nibble s of scales[8] at byte scales_at."""
    sc = (np.int32(w[scales_at + s // 2]) >> (4 * (s % 2))) & 15
    return d * (np.float32(0.5) + np.float32(sc)) * np.float32(0.25)


@njit(inline="always")
def block_iq2_xs(w, o, y):
    # d, qs[32] u16 (9-bit grid index, 7-bit sign index), scales[8] (4 bits per 16 weights)
    d = f16_at(w, o)
    for s in range(16):
        db = _iq2_scale(w, o + 66, s, d)
        for half in range(2):
            q = _u16(w, o + 2 + 2 * (2 * s + half))
            signs = KSIGNS[q >> 9]
            g = q & 511
            for j in range(8):
                y[16 * s + 8 * half + j] = db * IQ2XS_GRID[g, j] * _sign(signs, j)


@njit(inline="always")
def block_iq2_s(w, o, y):
    # d, qs[32] (grid index low 8 bits), signs[32] (a bit per weight), qh[8] (2 high bits per
    # index), scales[8] (4 bits per 16 weights)
    d = f16_at(w, o)
    for s in range(16):
        db = _iq2_scale(w, o + 74, s, d)
        for half in range(2):
            k = 2 * s + half
            g = np.int32(w[o + 2 + k]) | (((np.int32(w[o + 66 + k // 4]) >> (2 * (k % 4))) & 3) << 8)
            signs = w[o + 34 + k]
            for j in range(8):
                y[8 * k + j] = db * IQ2S_GRID[g, j] * _sign(signs, j)


@njit(inline="always")
def block_iq3_xxs(w, o, y):
    # d, qs[64] (a grid byte per 4 weights), then per 32 weights a u32: 4 × 7-bit signs + 4-bit scale
    d = f16_at(w, o)
    for ib in range(8):
        aux = _u32(w, o + 66 + 4 * ib)
        db = d * (np.float32(0.5) + np.float32(aux >> 28)) * np.float32(0.5)
        for l in range(4):
            signs = KSIGNS[(aux >> (7 * l)) & 127]
            for j in range(8):
                g = w[o + 2 + 8 * ib + 2 * l + j // 4]
                y[32 * ib + 8 * l + j] = db * IQ3XXS_GRID[g, j % 4] * _sign(signs, j)


@njit(inline="always")
def block_iq3_s(w, o, y):
    # d, qs[64] (grid index low 8 bits per 4 weights), qh[8] (the 9th bits), signs[32], scales[4]
    d = f16_at(w, o)
    for ib in range(8):
        sc = (np.int32(w[o + 106 + ib // 2]) >> (4 * (ib % 2))) & 15
        db = d * np.float32(1 + 2 * sc)
        for k in range(8 * ib, 8 * ib + 8):
            g = np.int32(w[o + 2 + k]) | (((np.int32(w[o + 66 + k // 8]) >> (k % 8)) & 1) << 8)
            for j in range(4):
                e = 4 * k + j
                y[e] = db * IQ3S_GRID[g, j] * _sign(w[o + 74 + e // 8], e % 8)


@njit(inline="always")
def block_iq1_s(w, o, y):
    # d, qs[32] (grid index low 8 bits per 8 weights), qh[8] u16 per 32 weights: 4 × 3 high index
    # bits, a 3-bit scale, the delta's sign
    d = f16_at(w, o)
    for ib in range(8):
        qh = _u16(w, o + 34 + 2 * ib)
        dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
        delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
        for l in range(4):
            g = np.int32(w[o + 2 + 4 * ib + l]) | np.int32(((qh >> (3 * l)) & 7) << 8)
            for j in range(8):
                y[32 * ib + 8 * l + j] = dl * (IQ1S_GRID[g, j] + delta)


@njit(inline="always")
def block_iq1_m(w, o, y):
    # qs[32], qh[16] (a nibble per 8 weights: 3 high index bits, the delta's sign), scales[8] =
    # 4 u16: 3-bit scales per 16 weights, and the fp16 d in their top nibbles
    s0, s1, s2, s3 = _u16(w, o + 48), _u16(w, o + 50), _u16(w, o + 52), _u16(w, o + 54)
    d = f16_bits_to_f32(np.uint16((s0 >> 12) | ((s1 >> 8) & 0x00F0) | ((s2 >> 4) & 0x0F00) | (s3 & 0xF000)))
    for h in range(16):
        sc = (_u16(w, o + 48 + 2 * (h // 4)) >> (3 * (h % 4))) & 7
        dl = d * np.float32(2 * sc + 1)
        for half in range(2):
            k = 2 * h + half
            nib = (np.int32(w[o + 32 + k // 2]) >> (4 * (k % 2))) & 15
            g = np.int32(w[o + k]) | ((nib & 7) << 8)
            delta = -IQ1_DELTA if nib & 8 else IQ1_DELTA
            for j in range(8):
                y[8 * k + j] = dl * (IQ1S_GRID[g, j] + delta)


# ---- by type -------------------------------------------------------------------------------------


@njit(inline="always")
def block_q4_k(w, o, y):
    block_q4_k_q5_k(w, o, y, False)


@njit(inline="always")
def block_q5_k(w, o, y):
    block_q4_k_q5_k(w, o, y, True)


# A kernel names its type as a closure integer and calls decode_block with it: the overload below
# sees the type as a compile-time literal and emits that type's decoder alone. Neither a `wt ==`
# chain (Numba did not prune the branches of a constant passed into an inlined function: all
# twenty decoders in every kernel, 10 s a matvec variant instead of 2) nor a decoder held in the
# kernel's closure (Numba's cache key pickles closure cells, and a dispatcher pickles with a
# per-process id: a cache miss in every new process) would do.
_DECODERS = {Q4_0.id: block_q4_0, Q8_0.id: block_q8_0, Q4_K.id: block_q4_k, Q5_K.id: block_q5_k,
             Q6_K.id: block_q6_k, Q4_1.id: block_q4_1, Q5_0.id: block_q5_0, Q5_1.id: block_q5_1,
             IQ4_NL.id: block_iq4_nl, MXFP4.id: block_mxfp4, Q2_K.id: block_q2_k, Q3_K.id: block_q3_k,
             IQ4_XS.id: block_iq4_xs, IQ2_XXS.id: block_iq2_xxs, IQ2_XS.id: block_iq2_xs,
             IQ2_S.id: block_iq2_s, IQ3_XXS.id: block_iq3_xxs, IQ3_S.id: block_iq3_s,
             IQ1_S.id: block_iq1_s, IQ1_M.id: block_iq1_m}


def decode_block(wt, w, o, y):
    """The block of ggml type wt (a compile-time constant: a kernel's closure integer) at byte o of
    the uint8 array w, as float32 into y[0:block_elems]. Compiled code only."""
    raise NotImplementedError("decode_block runs inside Numba kernels")


@overload(decode_block, inline="always")
def _decode_block(wt, w, o, y):
    if not isinstance(wt, types.IntegerLiteral):
        raise TypingError("decode_block needs the weight type as a compile-time constant")
    decode = _DECODERS[wt.literal_value]

    def impl(wt, w, o, y):
        decode(w, o, y)
    return impl
