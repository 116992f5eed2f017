"""How warp lanes dot each quantised type's blocks with int8 activations (gpu/matvec_q8.py).

A ggml block is cut into `units_per_block` units of 16 or 32 weights; unit p of block blk goes
to a lane that takes piece p of every block it visits. The kernel walks the row 32 units at a
time, so consecutive lanes read consecutive pieces (coalesced), and a lane's pieces are the same
columns in every row: the x values it loads serve all the rows of its warp. A unit's weights
share one scale (Q6_K and the K-quants: two sub-groups with one each), so the float work is a few
operations per 16 weights while `dp4a` does the products four at a time.

Per type, four device functions (`r` picks a row of the warp, `i` a loaded unit):
* `load(w, w8, row, blk, p, raw, i)` issues the loads of unit (blk, p) of `row` into raw[i, :]
  and does nothing else, so that the kernel can have several units in flight before it waits.
* `prepare(raw, i, q, fac, r, p)` turns them into dp4a-ready words q[r, :] (quants widened to
  one byte each) and float factors fac[r, :] (block scale · sub-block scale, and −min terms).
* `load_x(xq, xm, s, blk, p, xv, xf, xs)` loads slot s's activations for the unit: int8 words
  xv, floats xf (block scales dx, float sums), ints xs (dp4a start values for zero points).
* `dot(q, fac, r, xv, xf, xs, acc)` returns acc + the unit's dot product for row r.
p is the same for all of a lane's units: what depends on it alone is computed once per lane
(the compiler hoists it out of the kernel's loop), so the decoding is branch-free selects.

Activations (gpu/matvec_q8.py `quantize`): xq holds x as int8, four to a uint32 word; xm holds
per 32-element block four words: dx (f32 bits: x ≈ dx·xq), the float sum of x (the K-quants'
min term), and the int sums of xq over its two halves of 16 (the zero points of Q4_0 and Q6_K).

Block layouts: ../docs/MODEL_FORMAT.md §6.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import int32, uint32, uint64

from hybrid import ggml_types as gt

from .intrinsics import (bits_to_f32, device_function, dp4a, f16_bits_to_f32, fma, load_u32x4,
                         load_u32x4_unaligned, shr_u32, small_int_to_f32, small_uint_to_f32)
from .quants import int8_to_f32, store4

ZERO = np.float32(0.0)
LOW4 = uint32(0x0F0F0F0F)      # low nibble of each byte
BIT4 = uint32(0x10101010)      # Q5_K's fifth bit, in place
BITS45 = uint32(0x30303030)    # Q6_K's two high bits, in place
LOW16 = uint32(0xFFFF)
LOW8 = uint32(0xFF)
ALL = uint32(0xFFFFFFFF)
TWO, THREE, FOUR, EIGHT, SIXTEEN = uint32(2), uint32(3), uint32(4), uint32(8), uint32(16)


@dataclass(frozen=True)
class Dp4aUnit:
    """How one ggml type is dotted with int8 x by warp lanes (see the module docstring)."""
    type: gt.GGMLType
    word: np.dtype          # dtype the weight rows are viewed as for `w`
    units_per_block: int    # divides 32
    raw_words: int          # uint32 loaded per (row, unit)
    q_words: int            # dp4a-ready words per row
    factors: int            # float factors per row
    x_words: int            # int8 words of x per slot
    x_floats: int
    x_ints: int
    load: object
    prepare: object
    load_x: object
    dot: object

    def units_per_row(self, cols: int) -> int:
        return cols // self.type.block_elems * self.units_per_block


@device_function
def put4(a, first, words):
    """a[first:first+4] = words, for a 1-D array."""
    w0, w1, w2, w3 = words
    a[first] = w0
    a[first + 1] = w1
    a[first + 2] = w2
    a[first + 3] = w3


@device_function
def dot4(q, r, first, xv, x_first, start):
    """start + Σ over four words of the int8 products of q[r, first..] and xv[x_first..]."""
    v = dp4a(q[r, first], xv[x_first], start)
    v = dp4a(q[r, first + 1], xv[x_first + 1], v)
    v = dp4a(q[r, first + 2], xv[x_first + 2], v)
    return dp4a(q[r, first + 3], xv[x_first + 3], v)


@device_function
def pick(mask, a, b):
    """a where mask's bits are set, b elsewhere (mask all ones or zero): one LOP3, no branch."""
    return (a & mask) | (b & (mask ^ ALL))


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Unit p = 16 qs bytes 16p: chunk c = p // 2, half hh = p % 2. Low nibbles are elements
# 64c + 16hh + j (sub-block 2c), high nibbles 64c + 32 + 16hh + j (sub-block 2c + 1), j < 16.
# Rows are 16-byte aligned: one 16-byte load each for the qs piece and the block header (d,
# dmin, scales[12]); Q5_K adds its 16 qh bytes 16hh + j, whose bit 2c is the low nibble's fifth
# bit and bit 2c + 1 the high nibble's.
# raw[i] = qs[4] | header[4] (| qh[4]); q[r] = low-nibble words[4] | high-nibble words[4];
# fac[r] = d·sc(2c), −dmin·m(2c), d·sc(2c+1), −dmin·m(2c+1) (the mins for hh = 0 only).

@device_function
def q4_k_load(w, w8, row, blk, p, raw, i):
    base = blk * 36  # 144-byte blocks in uint32 words: header 0..3, qs 4..35
    store4(raw, i, 0, load_u32x4(w, row, base + 4 + 4 * p))
    store4(raw, i, 4, load_u32x4(w, row, base))


@device_function
def q5_k_load(w, w8, row, blk, p, raw, i):
    base = blk * 44  # 176-byte blocks: header 0..3, qh 4..11, qs 12..43
    store4(raw, i, 0, load_u32x4(w, row, base + 12 + 4 * p))
    store4(raw, i, 4, load_u32x4(w, row, base))
    store4(raw, i, 8, load_u32x4(w, row, base + 4 + 4 * (p & 1)))


@device_function
def kquant_factors(raw, i, fac, r, p):
    """fac[r] from the header in raw[i, 4:8]: sub-blocks 2c and 2c+1 (get_scale_min_k4).

    Their 6-bit scales and mins sit in adjacent bytes, so both are unpacked as one 16-bit pair:
    bytes 2(c % 2), 2(c % 2) + 1 of the scale words a = scales[0:4], b = [4:8], e = [8:12].
    The −dmin·m·Σx term is the sub-block's, whose two halves are two lanes' units: the lane of
    the first half (hh = 0) adds it for the whole sub-block, the other gets zero factors.
    """
    c = p >> 1
    shift = uint32(16 * (c & 1))
    first_four = ALL if c < 2 else uint32(0)  # sub-blocks 0..3: plain 6-bit fields
    a = shr_u32(raw[i, 5], shift)
    b = shr_u32(raw[i, 6], shift)
    e = shr_u32(raw[i, 7], shift)
    sc = pick(first_four, a & uint32(0x3F3F), (e & uint32(0x0F0F)) | ((a >> TWO) & uint32(0x3030)))
    m = pick(first_four, b & uint32(0x3F3F), ((e >> FOUR) & uint32(0x0F0F)) | ((b >> TWO) & uint32(0x3030)))
    d = f16_bits_to_f32(raw[i, 4] & LOW16)
    dmin = f16_bits_to_f32(raw[i, 4] >> SIXTEEN)
    dmin = dmin if (p & 1) == 0 else ZERO
    fac[r, 0] = d * small_uint_to_f32(sc & LOW8, ZERO)
    fac[r, 1] = -(dmin * small_uint_to_f32(m & LOW8, ZERO))
    fac[r, 2] = d * small_uint_to_f32(sc >> EIGHT, ZERO)
    fac[r, 3] = -(dmin * small_uint_to_f32(m >> EIGHT, ZERO))


@device_function
def q4_k_prepare(raw, i, q, fac, r, p):
    for j in range(4):
        v = raw[i, j]
        q[r, j] = v & LOW4
        q[r, 4 + j] = (v >> FOUR) & LOW4
    kquant_factors(raw, i, fac, r, p)


@device_function
def q5_k_prepare(raw, i, q, fac, r, p):
    shift = uint32(2 * (p >> 1))  # bits 2c, 2c+1 of each qh byte -> bits 0, 1
    for j in range(4):
        v = raw[i, j]
        h = shr_u32(raw[i, 8 + j], shift)
        q[r, j] = (v & LOW4) | ((h << FOUR) & BIT4)
        q[r, 4 + j] = ((v >> FOUR) & LOW4) | ((h << THREE) & BIT4)
    kquant_factors(raw, i, fac, r, p)


@device_function
def kquant_load_x(xq, xm, s, blk, p, xv, xf, xs):
    word = blk * 64 + 16 * (p >> 1) + 4 * (p & 1)  # element 64c + 16hh of the block, in words
    put4(xv, 0, load_u32x4(xq, s, word))
    put4(xv, 4, load_u32x4(xq, s, word + 8))      # 32 elements on: sub-block 2c + 1
    x_block = blk * 8 + 2 * (p >> 1)
    lo = load_u32x4(xm, s, 4 * x_block)
    hi = load_u32x4(xm, s, 4 * x_block + 4)
    xf[0] = bits_to_f32(lo[0])
    xf[1] = bits_to_f32(lo[1])
    xf[2] = bits_to_f32(hi[0])
    xf[3] = bits_to_f32(hi[1])


@device_function
def kquant_dot(q, fac, r, xv, xf, xs, acc):
    lo = dot4(q, r, 0, xv, 0, int32(0))
    hi = dot4(q, r, 4, xv, 4, int32(0))
    # Σ (d·sc·q − dmin·m)·x over a sub-block = d·sc·dx·Σ q·xq − dmin·m·Σ x
    acc = fma(fac[r, 0] * xf[0], small_int_to_f32(lo), acc)
    acc = fma(fac[r, 1], xf[1], acc)
    acc = fma(fac[r, 2] * xf[2], small_int_to_f32(hi), acc)
    return fma(fac[r, 3], xf[3], acc)


# ---------------------------------------------------------------- Q6_K (210 B, 2-byte aligned)
# Unit p = (half n = p // 4, kodd = p // 2 % 2, u = p % 2). Its 16 ql bytes 16p hold, in their
# low nibbles, the elements 16g + j of group g = 8n + 2kodd + u (scale sc[g]) and in their high
# nibbles the elements 64 further on (group g + 4). Their 2-bit high parts are bits 2kodd (and
# 2kodd + 4) of qh bytes 32n + 16u + j.
# raw[i] = ql[4] | qh[4] | sc[g] | sc[g+4] << 8 | d << 16. q = group g words[4] | group g+4
# words[4] (unsigned 6-bit); the zero point 32 goes into the dp4a start value: −32·Σ xq.

@device_function
def q6_k_load(w, w8, row, blk, p, raw, i):
    n = p >> 2
    base = blk * 210  # ql 0..127, qh 128..191, scales 192..207, d 208
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, base + 16 * p))
    store4(raw, i, 4, load_u32x4_unaligned(w8, row, base + 128 + 32 * n + 16 * (p & 1)))
    scale = uint64(base + 192 + 4 * n + p)  # sc[g]; unsigned indices skip Numba's wraparound
    raw[i, 8] = (uint32(w8[row, scale]) | (uint32(w8[row, scale + uint64(4)]) << EIGHT)
                 | (uint32(w[row, uint64(blk * 105 + 104)]) << SIXTEEN))


@device_function
def q6_k_prepare(raw, i, q, fac, r, p):
    shift = uint32(2 * ((p >> 1) & 1))  # kodd's two bits -> bits 0-1 (group g), 4-5 (g + 4)
    for j in range(4):
        low = raw[i, j]
        high = shr_u32(raw[i, 4 + j], shift)
        q[r, j] = (low & LOW4) | ((high << FOUR) & BITS45)
        q[r, 4 + j] = ((low >> FOUR) & LOW4) | (high & BITS45)
    s = raw[i, 8]
    d = f16_bits_to_f32(s >> SIXTEEN)
    fac[r, 0] = d * int8_to_f32(s & LOW8)
    fac[r, 1] = d * int8_to_f32((s >> EIGHT) & LOW8)


@device_function
def q6_k_load_x(xq, xm, s, blk, p, xv, xf, xs):
    g = p + 4 * (p >> 2)  # the group: 8n + 2kodd + u
    word = blk * 64 + 4 * g
    put4(xv, 0, load_u32x4(xq, s, word))
    put4(xv, 4, load_u32x4(xq, s, word + 16))  # 64 elements on: group g + 4
    x_block = blk * 8 + (g >> 1)
    a = load_u32x4(xm, s, 4 * x_block)
    b = load_u32x4(xm, s, 4 * x_block + 8)
    xf[0] = bits_to_f32(a[0])
    xf[1] = bits_to_f32(b[0])
    second_half = ALL if p & 1 else uint32(0)  # group g is half u of its block of 32
    xs[0] = int32(-32) * int32(pick(second_half, a[3], a[2]))
    xs[1] = int32(-32) * int32(pick(second_half, b[3], b[2]))


@device_function
def q6_k_dot(q, fac, r, xv, xf, xs, acc):
    lo = dot4(q, r, 0, xv, 0, xs[0])  # Σ (q − 32)·xq = Σ q·xq − 32·Σ xq
    hi = dot4(q, r, 4, xv, 4, xs[1])
    acc = fma(fac[r, 0] * xf[0], small_int_to_f32(lo), acc)
    return fma(fac[r, 1] * xf[1], small_int_to_f32(hi), acc)


# ---------------------------------------------------------------- Q8_0 (34 B: d, qs[32])
# Unit p = half p of the block: 16 int8 quants at byte 2 + 16p, and d.

@device_function
def q8_0_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 34 * blk + 2 + 16 * p))
    raw[i, 4] = uint32(w[row, uint64(17 * blk)])


@device_function
def q8_0_prepare(raw, i, q, fac, r, p):
    for j in range(4):
        q[r, j] = raw[i, j]
    fac[r, 0] = f16_bits_to_f32(raw[i, 4])


@device_function
def q8_0_load_x(xq, xm, s, blk, p, xv, xf, xs):
    put4(xv, 0, load_u32x4(xq, s, 8 * blk + 4 * p))
    xf[0] = bits_to_f32(xm[s, uint64(4 * blk)])


@device_function
def q8_0_dot(q, fac, r, xv, xf, xs, acc):
    return fma(fac[r, 0] * xf[0], small_int_to_f32(dot4(q, r, 0, xv, 0, int32(0))), acc)


# ---------------------------------------------------------------- Q4_0 (18 B: d, qs[16])
# One unit per block: low nibbles are elements 0..15, high nibbles 16..31; zero point 8.

@device_function
def q4_0_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 18 * blk + 2))
    raw[i, 4] = uint32(w[row, uint64(9 * blk)])


@device_function
def q4_0_prepare(raw, i, q, fac, r, p):
    for j in range(4):
        v = raw[i, j]
        q[r, j] = v & LOW4
        q[r, 4 + j] = (v >> FOUR) & LOW4
    fac[r, 0] = f16_bits_to_f32(raw[i, 4])


@device_function
def q4_0_load_x(xq, xm, s, blk, p, xv, xf, xs):
    put4(xv, 0, load_u32x4(xq, s, 8 * blk))
    put4(xv, 4, load_u32x4(xq, s, 8 * blk + 4))
    m = load_u32x4(xm, s, 4 * blk)
    xf[0] = bits_to_f32(m[0])
    xs[0] = int32(-8) * (int32(m[2]) + int32(m[3]))


@device_function
def q4_0_dot(q, fac, r, xv, xf, xs, acc):
    total = dot4(q, r, 4, xv, 4, dot4(q, r, 0, xv, 0, xs[0]))  # Σ (q − 8)·xq
    return fma(fac[r, 0] * xf[0], small_int_to_f32(total), acc)


U16, U32 = np.dtype(np.uint16), np.dtype(np.uint32)
UNITS: dict[int, Dp4aUnit] = {u.type.id: u for u in (
    Dp4aUnit(gt.Q8_0, U16, 2, 5, 4, 1, 4, 1, 1, q8_0_load, q8_0_prepare, q8_0_load_x, q8_0_dot),
    Dp4aUnit(gt.Q4_0, U16, 1, 5, 8, 1, 8, 1, 1, q4_0_load, q4_0_prepare, q4_0_load_x, q4_0_dot),
    Dp4aUnit(gt.Q4_K, U32, 8, 8, 8, 4, 8, 4, 1, q4_k_load, q4_k_prepare, kquant_load_x, kquant_dot),
    Dp4aUnit(gt.Q5_K, U32, 8, 12, 8, 4, 8, 4, 1, q5_k_load, q5_k_prepare, kquant_load_x, kquant_dot),
    Dp4aUnit(gt.Q6_K, U16, 8, 9, 8, 2, 8, 2, 2, q6_k_load, q6_k_prepare, q6_k_load_x, q6_k_dot),
)}
