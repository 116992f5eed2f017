"""How warp lanes dot each quantised type's blocks with int8 activations (gpu/matmul/matvec_q8.py).

A ggml block is cut into `units_per_block` units of 16, 32 or 64 weights; unit p of block blk
goes to a lane that takes piece p of every block it visits. The kernel walks the row 32 units at
a time, so consecutive lanes read consecutive pieces, and a lane's pieces are the same columns in
every row: the x values it loads serve all the rows of its warp. The 256-weight types' units are
64 weights, two sub-blocks (Q4_K/Q5_K, IQ4_XS, IQ1_S, IQ3_XXS, IQ3_S, IQ2_XXS) or four groups of 16
(Q6_K, Q3_K, Q2_K, IQ2_XS, IQ2_S, IQ1_M), so that one block-header load and one decode of the
packed scales serve 64 weights and the float work is a few operations per 32 (16) weights, while
`dp4a` does the products four at a time. Integer sums stay int32 up to
one exact conversion per scale (dp4a chains start at START: see magic_sum).

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

Activations (gpu/matmul/matvec_q8.py `quantize`): xq holds x as int8, four to a uint32 word, xm numbers
per 32-element block: dx (f32 bits: x ≈ dx·xq), the float sum of x (the K-quants' min term;
in the NATURAL layout Q8_1's s = fp16(d·Σ xq) instead, the min term of Q4_1/Q5_1), the int sums
of xq over its two halves of 16 (the zero points of Q4_0, Q5_0, Q6_K and Q3_K, Q2_K's min term).
Where each goes depends on the type (x layouts below): the 64-weight lanes get theirs in whole
16-byte loads.

Block layouts: docs/MODEL_FORMAT.md §6.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import int32, uint32, uint64

from cpu import ggml_types as gt

from ..intrinsics import (SIGNED_MAGIC, SIGNED_MAGIC_F, bits_to_f32, device_function, dp4a, dp4a_us,
                         f16_bits_to_f32, fma, load_u32x4, load_u32x4_unaligned, shr_u32,
                         small_uint_to_f32)
from .quants import (e8m0_half, int8_to_f32, iq1_m_d, iq1_m_words, iq1_s_words, iq1s_grid, iq2_s_words, iq2_xs_words,
                     iq2_xxs_words, iq2s_grid, iq2xs_grid, iq2xxs_grid, iq3_s_scale, iq3_s_words, iq3_xxs_scale,
                     iq3_xxs_words, iq3s_grid, iq3xxs_grid, IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3, MXFP4_W0,
                     MXFP4_W1, MXFP4_W2, MXFP4_W3, odd_scale, store4, table_bytes)

ZERO = np.float32(0.0)
LOW4 = uint32(0x0F0F0F0F)      # low nibble of each byte
HIGH4 = uint32(0xF0F0F0F0)     # high nibble of each byte
BIT4 = uint32(0x10101010)      # Q5_K's fifth bit, in place
BITS45 = uint32(0x30303030)    # Q6_K's two high bits, in place
LOW16 = uint32(0xFFFF)
LOW8 = uint32(0xFF)
ALL = uint32(0xFFFFFFFF)
TWO, THREE, FOUR, EIGHT, SIXTEEN, TWENTY_FOUR = (uint32(2), uint32(3), uint32(4), uint32(8), uint32(16),
                                               uint32(24))
START = int32(SIGNED_MAGIC)    # dp4a chains start here (magic_sum)
ONE, SIXTEENTH, THIRTY_TWO = np.float32(1.0), np.float32(0.0625), np.float32(32.0)


@dataclass(frozen=True)
class Dp4aUnit:
    """How one ggml type is dotted with int8 x by warp lanes (see the module docstring)."""
    type: gt.GGMLType
    word: np.dtype          # dtype the weight rows are viewed as for `w`
    units_per_block: int    # divides 32
    weights: int            # per unit
    in_flight: int          # units a lane loads before it uses them, at one row per warp
    x_layout: int           # how the quantiser lays out x for it (NATURAL, K64, Q6K64)
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
def dot8(q, r, first, xv, x_first, start):
    return dot4(q, r, first + 4, xv, x_first + 4, dot4(q, r, first, xv, x_first, start))


@device_function
def dot8_unsigned(q, r, first, xv, x_first, start):
    """dot8 with q's bytes as unsigned (dp4a_us)."""
    v = start
    for k in range(8):
        v = dp4a_us(q[r, first + k], xv[x_first + k], v)
    return v


@device_function
def magic_sum(v):
    """The float32 value of a dp4a chain's sum S whose chain started at START: v = START + S
    (|S| < 2**22), whose bits are exactly the float 1.5·2**23 + S. Starting the chain there
    instead of at 0 saves small_int_to_f32's integer add."""
    return bits_to_f32(v) - SIGNED_MAGIC_F


@device_function
def pick(mask, a, b):
    """a where mask's bits are set, b elsewhere (mask all ones or zero): one LOP3, no branch."""
    return (a & mask) | (b & (mask ^ ALL))


# ---------------------------------------------------------------- x layouts
# Where the quantiser puts xq and the per-block numbers, chosen per weight type (Dp4aUnit.x_layout):
NATURAL = 0   # xq in column order; xm: per block of 32 [dx, Q8_1's s, int sums of both halves]
K64 = 1       # lanes of 64 consecutive weights (Q4_K, Q5_K, Q3_K, Q2_K, IQ4_XS and the IQ1-IQ3 types;
              # xq permuted, step_slot);
              # xm: per block [dx, float sum], then (second half) the int sums of its halves
Q6K64 = 2     # Q6_K lanes of 64 weights (xq permuted); xm: dx and dp4a start values per lane


STEP_WORDS = 512  # xq words of a warp's step in the 64-weight layouts: 8 blocks of 256


@device_function
def step_slot(col_word, six_k):
    """Where xq word `col_word` (column 4·col_word) goes in the 64-weight layouts.

    A warp's step covers 8 blocks of 256 (4 lanes each) and a lane reads its 64 x values in 4
    loads of 16 bytes, load k of lane (b, p) at 16-byte slot 32k + 4b + p of the step: each load
    of the warp is then one contiguous 512-byte run, while in column order the lanes' 16-byte
    pieces lie 64 bytes apart (16 cache lines per load instead of 4). The row is padded to whole
    steps (x_row_words), so the stride is the same in the row's last step.
    Q4_K/Q5_K: column 64p + 16k + j of the block; Q6_K: 128n + 32k + 16u + j, p = 2n + u."""
    blk = col_word >> 6
    i = (col_word & 63) << 2  # column in the block
    if six_k:
        p = ((i >> 7) << 1) | ((i >> 4) & 1)
        k = (i >> 5) & 3
    else:
        p = i >> 6
        k = (i >> 4) & 3
    return lane_x_word(blk, p) + 128 * k + (col_word & 3)


@device_function
def lane_x_word(blk, p):
    """The first xq word of load 0 of lane (blk, p) in the 64-weight layouts (step_slot); load k
    is 128·k words on."""
    return 64 * blk - 48 * (blk & 7) + 4 * p


def x_row_words(cols: int, layout: int) -> int:
    """xq words per row: the 64-weight layouts pad the row to whole steps."""
    return cols // 4 if layout == NATURAL else -(-cols // 2048) * STEP_WORDS


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Unit p = chunk c = p of the block: its 32 qs bytes 32c + j hold in their low nibbles the
# elements 64c + j (sub-block 2c) and in their high nibbles 64c + 32 + j (sub-block 2c + 1),
# so one header load and one 6-bit scale decode serve 64 weights. Rows are 16-byte aligned:
# 16-byte loads for the qs, the block header (d, dmin, scales[12]) and Q5_K's 32 qh bytes, whose
# bit 2c is the low nibble's fifth bit and bit 2c + 1 the high nibble's.
# raw[i] = qs[8] | header[4] (| qh[8]); q[r] = sub-block 2c words[8] | sub-block 2c+1 words[8];
# fac[r] = d·sc(2c), −dmin·m(2c), d·sc(2c+1) (Q4_K: /16, see q4_k_prepare), −dmin·m(2c+1).

@device_function
def q4_k_load(w, w8, row, blk, p, raw, i):
    base = blk * 36  # 144-byte blocks in uint32 words: header 0..3, qs 4..35
    store4(raw, i, 0, load_u32x4(w, row, base + 4 + 8 * p))
    store4(raw, i, 4, load_u32x4(w, row, base + 8 + 8 * p))
    store4(raw, i, 8, load_u32x4(w, row, base))


@device_function
def q5_k_load(w, w8, row, blk, p, raw, i):
    base = blk * 44  # 176-byte blocks: header 0..3, qh 4..11, qs 12..43
    store4(raw, i, 0, load_u32x4(w, row, base + 12 + 8 * p))
    store4(raw, i, 4, load_u32x4(w, row, base + 16 + 8 * p))
    store4(raw, i, 8, load_u32x4(w, row, base))
    store4(raw, i, 12, load_u32x4(w, row, base + 4))
    store4(raw, i, 16, load_u32x4(w, row, base + 8))


@device_function
def kquant_factors(raw, i, fac, r, p, high_scale):
    """fac[r] from the header in raw[i, 8:12]: sub-blocks 2c and 2c+1 (get_scale_min_k4).

    Their 6-bit scales and mins sit in adjacent bytes, so both are unpacked as one 16-bit pair:
    bytes 2(c % 2), 2(c % 2) + 1 of the scale words a = scales[0:4], b = [4:8], e = [8:12].
    `high_scale` multiplies the second sub-block's scale (a power of two: exact).
    """
    shift = uint32(16 * (p & 1))
    first_four = ALL if p < 2 else uint32(0)  # sub-blocks 0..3: plain 6-bit fields
    a = shr_u32(raw[i, 9], shift)
    b = shr_u32(raw[i, 10], shift)
    e = shr_u32(raw[i, 11], shift)
    sc = pick(first_four, a & uint32(0x3F3F), (e & uint32(0x0F0F)) | ((a >> TWO) & uint32(0x3030)))
    m = pick(first_four, b & uint32(0x3F3F), ((e >> FOUR) & uint32(0x0F0F)) | ((b >> TWO) & uint32(0x3030)))
    d = f16_bits_to_f32(raw[i, 8] & LOW16)
    dmin = f16_bits_to_f32(raw[i, 8] >> SIXTEEN)
    fac[r, 0] = d * small_uint_to_f32(sc & LOW8, ZERO)
    fac[r, 1] = -(dmin * small_uint_to_f32(m & LOW8, ZERO))
    fac[r, 2] = (d * high_scale) * small_uint_to_f32(sc >> EIGHT, ZERO)
    fac[r, 3] = -(dmin * small_uint_to_f32(m >> EIGHT, ZERO))


@device_function
def q4_k_prepare(raw, i, q, fac, r, p):
    # The high nibbles stay where they are (16·q, one mask, no shift): q4_k_dot multiplies them
    # as unsigned bytes, and their scale carries the 1/16.
    for j in range(8):
        v = raw[i, j]
        q[r, j] = v & LOW4
        q[r, 8 + j] = v & HIGH4
    kquant_factors(raw, i, fac, r, p, SIXTEENTH)


@device_function
def q5_k_prepare(raw, i, q, fac, r, p):
    shift = uint32(2 * p)  # bits 2c, 2c+1 of each qh byte -> bits 0, 1
    for j in range(8):
        v = raw[i, j]
        h = shr_u32(raw[i, 12 + j], shift)
        q[r, j] = (v & LOW4) | ((h << FOUR) & BIT4)
        q[r, 8 + j] = ((v >> FOUR) & LOW4) | ((h << THREE) & BIT4)
    kquant_factors(raw, i, fac, r, p, ONE)


@device_function
def kquant_load_x(xq, xm, s, blk, p, xv, xf, xs):
    first = lane_x_word(blk, p)
    for k in range(4):  # columns 64p + 16k of the block (layout K64)
        put4(xv, 4 * k, load_u32x4(xq, s, first + 128 * k))
    m = load_u32x4(xm, s, 4 * (4 * blk + p))  # blocks 2p, 2p + 1 of 32: dx, Σx each
    xf[0] = bits_to_f32(m[0])
    xf[1] = bits_to_f32(m[1])
    xf[2] = bits_to_f32(m[2])
    xf[3] = bits_to_f32(m[3])


@device_function
def kquant_terms(lo, hi, fac, r, xf, acc):
    """acc + Σ (d·sc·q − dmin·m)·x over both sub-blocks = d·sc·dx·Σ q·xq − dmin·m·Σ x each;
    lo, hi are the dp4a sums started at SIGNED_MAGIC (see magic_sum)."""
    acc = fma(fac[r, 0] * xf[0], magic_sum(lo), acc)
    acc = fma(fac[r, 1], xf[1], acc)
    acc = fma(fac[r, 2] * xf[2], magic_sum(hi), acc)
    return fma(fac[r, 3], xf[3], acc)


@device_function
def q4_k_dot(q, fac, r, xv, xf, xs, acc):
    lo = dot8(q, r, 0, xv, 0, START)
    hi = dot8_unsigned(q, r, 8, xv, 8, START)  # 16·Σ q·xq: |16·15·127·32| < 2**22
    return kquant_terms(lo, hi, fac, r, xf, acc)


@device_function
def q5_k_dot(q, fac, r, xv, xf, xs, acc):
    return kquant_terms(dot8(q, r, 0, xv, 0, START), dot8(q, r, 8, xv, 8, START), fac, r, xf, acc)


# ---------------------------------------------------------------- Q6_K (210 B, 2-byte aligned)
# Unit p = (half n = p // 2, u = p % 2): 16 bytes of each of ql[64n + 16u:], ql[64n + 32 + 16u:]
# and qh[32n + 16u:]. Byte j of them holds four elements 128n + 16u + j + 32t (t = 0..3): t = 0
# the low nibble of the first ql piece, 1 of the second, 2 and 3 their high nibbles; qh's bit
# pair 2t the two high bits of each. Element group t (16 elements) has scale sc[8n + u + 2t].
# raw[i] = ql_a[4] | ql_b[4] | qh[4] | sc[8n+u] | sc[+2] << 8 | sc[+4] << 16 | sc[+6] << 24 | d.
# q = group t words[4], t = 0..3 (unsigned 6-bit); the zero point 32 goes into the dp4a start
# value: −32·Σ xq over the group, one half of an x block.

@device_function
def q6_k_load(w, w8, row, blk, p, raw, i):
    n = p >> 1
    base = blk * 210  # ql 0..127, qh 128..191, scales 192..207, d 208
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, base + 64 * n + 16 * (p & 1)))
    store4(raw, i, 4, load_u32x4_unaligned(w8, row, base + 64 * n + 32 + 16 * (p & 1)))
    store4(raw, i, 8, load_u32x4_unaligned(w8, row, base + 128 + 16 * p))
    scale = uint64(base + 192 + 6 * n + p)  # sc[8n + u]; unsigned indices skip Numba's wraparound
    raw[i, 12] = (uint32(w8[row, scale]) | (uint32(w8[row, scale + uint64(2)]) << EIGHT)
                  | (uint32(w8[row, scale + uint64(4)]) << SIXTEEN)
                  | (uint32(w8[row, scale + uint64(6)]) << TWENTY_FOUR))
    raw[i, 13] = uint32(w[row, uint64(blk * 105 + 104)])


@device_function
def q6_k_prepare(raw, i, q, fac, r, p):
    for j in range(4):
        a = raw[i, j]
        b = raw[i, 4 + j]
        h = raw[i, 8 + j]
        q[r, j] = (a & LOW4) | ((h << FOUR) & BITS45)
        q[r, 4 + j] = (b & LOW4) | ((h << TWO) & BITS45)
        q[r, 8 + j] = ((a >> FOUR) & LOW4) | (h & BITS45)
        q[r, 12 + j] = ((b >> FOUR) & LOW4) | ((h >> TWO) & BITS45)
    s = raw[i, 12]
    d = f16_bits_to_f32(raw[i, 13])
    fac[r, 0] = d * int8_to_f32(s & LOW8)
    fac[r, 1] = d * int8_to_f32((s >> EIGHT) & LOW8)
    fac[r, 2] = d * int8_to_f32((s >> SIXTEEN) & LOW8)
    fac[r, 3] = d * int8_to_f32(s >> TWENTY_FOUR)


@device_function
def q6_k_load_x(xq, xm, s, blk, p, xv, xf, xs):
    first = lane_x_word(blk, p)
    for t in range(4):  # columns 128n + 32t + 16u of the block (layout Q6K64)
        put4(xv, 4 * t, load_u32x4(xq, s, first + 128 * t))
    lane_record = 4 * (4 * blk + p)
    dx = load_u32x4(xm, s, lane_record)
    start = load_u32x4(xm, s, (xm.shape[1] >> 1) + lane_record)
    for t in range(4):
        xf[t] = bits_to_f32(dx[t])
        xs[t] = int32(start[t])


@device_function
def q6_k_dot(q, fac, r, xv, xf, xs, acc):
    for t in range(4):  # Σ (q − 32)·xq = Σ q·xq − 32·Σ xq
        acc = fma(fac[r, t] * xf[t], magic_sum(dot4(q, r, 4 * t, xv, 4 * t, xs[t])), acc)
    return acc


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
    return fma(fac[r, 0] * xf[0], magic_sum(dot4(q, r, 0, xv, 0, START)), acc)


# ---------------------------------------------------------------- the other 32-weight blocks
# One unit per block: qs[16]'s low nibbles are elements 0..15, its high nibbles 16..31 (Q5_*:
# bit j of qh is element j's fifth bit). q[r] = elements 0..15 as four words, then 16..31.
# x (NATURAL): its Q8_0 codes and dx, and per block either the dp4a start value for a zero
# point z (START − z·Σ xq: Q4_0 z = 8, Q5_0 16, IQ4_NL 0, whose table values are the quants) or,
# for the types with a min (Q4_1, Q5_1: d·q + m), Q8_1's s = fp16(amax/127 · Σ xq), so that the
# min term is m·s as llama.cpp's CPU computes it.

@device_function
def block_load_x(xq, xm, s, blk, xv, xf, xs, zero):
    put4(xv, 0, load_u32x4(xq, s, 8 * blk))
    put4(xv, 4, load_u32x4(xq, s, 8 * blk + 4))
    m = load_u32x4(xm, s, 4 * blk)
    xf[0] = bits_to_f32(m[0])
    xf[1] = bits_to_f32(m[1])
    xs[0] = START - zero * (int32(m[2]) + int32(m[3]))


@device_function
def block_dot(q, fac, r, xv, xf, xs, acc):
    """acc + d·dx·Σ (q − z)·xq (the zero point is in the start value xs[0])."""
    return fma(fac[r, 0] * xf[0], magic_sum(dot8(q, r, 0, xv, 0, xs[0])), acc)


@device_function
def min_dot(q, fac, r, xv, xf, xs, acc):
    """acc + d·dx·Σ q·xq + m·s."""
    acc = fma(fac[r, 0] * xf[0], magic_sum(dot8(q, r, 0, xv, 0, START)), acc)
    return fma(fac[r, 1], xf[1], acc)


@device_function
def nibbles(raw, i, q, r):
    """q[r] = the low nibbles of qs (raw[i, 0:4]), then its high nibbles, one per byte."""
    for j in range(4):
        v = raw[i, j]
        q[r, j] = v & LOW4
        q[r, 4 + j] = (v >> FOUR) & LOW4


@device_function
def spread_bit4(h):
    """Bits 0..3 of h to bit 4 of bytes 0..3 (bit b moves 7b + 4 up)."""
    return (((h & uint32(1)) << FOUR) | ((h & uint32(2)) << uint32(11)) | ((h & uint32(4)) << uint32(18))
            | ((h & uint32(8)) << uint32(25)))


@device_function
def fifth_bits(raw, i, q, r, qh):
    """nibbles(), with bit j of qh as element j's fifth bit."""
    for j in range(4):
        v = raw[i, j]
        q[r, j] = (v & LOW4) | spread_bit4(shr_u32(qh, uint32(4 * j)))
        q[r, 4 + j] = ((v >> FOUR) & LOW4) | spread_bit4(shr_u32(qh, uint32(16 + 4 * j)))


# Q4_0 (18 B: d, qs[16]); zero point 8. raw[i] = qs[4] | d.

@device_function
def q4_0_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 18 * blk + 2))
    raw[i, 4] = uint32(w[row, uint64(9 * blk)])


@device_function
def q4_0_prepare(raw, i, q, fac, r, p):
    nibbles(raw, i, q, r)
    fac[r, 0] = f16_bits_to_f32(raw[i, 4])


@device_function
def q4_0_load_x(xq, xm, s, blk, p, xv, xf, xs):
    block_load_x(xq, xm, s, blk, xv, xf, xs, int32(8))


# IQ4_NL (18 B: d, qs[16]): Q4_0's layout, each nibble an index into the IQ4_NL table
# (gpu/matmul/quants.py table_bytes). raw[i] = qs[4] | d.

@device_function
def table_nibbles(raw, i, q, r, w0, w1, w2, w3):
    """q[r] = the table bytes of a 32-weight block's nibbles, raw[i, 0:4] (low nibbles weights
    0..15, high ones 16..31): IQ4_NL's and MXFP4's layout."""
    for j in range(4):
        q[r, j], q[r, 4 + j] = table_bytes(raw[i, j], w0, w1, w2, w3)


@device_function
def iq4_nl_prepare(raw, i, q, fac, r, p):
    table_nibbles(raw, i, q, r, IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3)
    fac[r, 0] = f16_bits_to_f32(raw[i, 4])


@device_function
def iq4_nl_load_x(xq, xm, s, blk, p, xv, xf, xs):
    block_load_x(xq, xm, s, blk, xv, xf, xs, int32(0))


# MXFP4 (17 B: e8m0 exponent e, qs[16]; byte aligned, uint8 words): IQ4_NL's layout with MXFP4's
# table (2 × the e2m1 values) and the scale e8m0_half(e), x rounded as Q8_0 (llama.cpp's
# vec_dot_type for it). raw[i] = qs[4] | e.

@device_function
def mxfp4_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 17 * blk + 1))
    raw[i, 4] = uint32(w8[row, uint64(17 * blk)])


@device_function
def mxfp4_prepare(raw, i, q, fac, r, p):
    table_nibbles(raw, i, q, r, MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3)
    fac[r, 0] = e8m0_half(raw[i, 4])


# Q5_0 (22 B: d, qh u32, qs[16], 2-byte aligned); zero point 16. raw[i] = qs[4] | d | qh.

@device_function
def q5_0_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 22 * blk + 6))
    raw[i, 4] = uint32(w[row, uint64(11 * blk)])
    raw[i, 5] = uint32(w[row, uint64(11 * blk + 1)]) | (uint32(w[row, uint64(11 * blk + 2)]) << SIXTEEN)


@device_function
def q5_0_prepare(raw, i, q, fac, r, p):
    fifth_bits(raw, i, q, r, raw[i, 5])
    fac[r, 0] = f16_bits_to_f32(raw[i, 4])


@device_function
def q5_0_load_x(xq, xm, s, blk, p, xv, xf, xs):
    block_load_x(xq, xm, s, blk, xv, xf, xs, int32(16))


# Q4_1 (20 B: d, m, qs[16]) and Q5_1 (24 B: d, m, qh u32, qs[16]), 4-byte aligned: d·q + m.
# raw[i] = qs[4] | d | m << 16 (| qh); fac[r] = d, m.

@device_function
def q4_1_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 20 * blk + 4))
    raw[i, 4] = w[row, uint64(5 * blk)]


@device_function
def q5_1_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 24 * blk + 8))
    raw[i, 4] = w[row, uint64(6 * blk)]
    raw[i, 5] = w[row, uint64(6 * blk + 1)]


@device_function
def min_factors(raw, i, fac, r):
    fac[r, 0] = f16_bits_to_f32(raw[i, 4] & LOW16)
    fac[r, 1] = f16_bits_to_f32(raw[i, 4] >> SIXTEEN)


@device_function
def q4_1_prepare(raw, i, q, fac, r, p):
    nibbles(raw, i, q, r)
    min_factors(raw, i, fac, r)


@device_function
def q5_1_prepare(raw, i, q, fac, r, p):
    fifth_bits(raw, i, q, r, raw[i, 5])
    min_factors(raw, i, fac, r)


@device_function
def min_load_x(xq, xm, s, blk, p, xv, xf, xs):
    block_load_x(xq, xm, s, blk, xv, xf, xs, int32(0))


# ---------------------------------------------------------------- IQ4_XS, Q3_K, Q2_K (256 per block)
# Unit p = columns 64p .. 64p + 63 of the block (layout K64: x blocks 2p, 2p + 1, with their dx,
# and for Q3_K/Q2_K their int sums per 16, Q8_K's bsums). llama.cpp's CPU meets these weights with
# Q8_K (int8 per 256); like the other K-quants here, x is rounded per 32 instead (finer).


@device_function
def kquant_sums_load_x(xq, xm, s, blk, p, xv, xf):
    """kquant_load_x; returns the int sums of xq over the unit's four groups of 16 columns."""
    kquant_load_x(xq, xm, s, blk, p, xv, xf, xf)
    return load_u32x4(xm, s, (xm.shape[1] >> 1) + 4 * (4 * blk + p))


# IQ4_XS (136 B: d, scales_h u16, scales_l[4], qs[128]; 8-byte aligned, uint32 words). Sub-block
# ib (32 weights): qs[16ib + j]'s low nibble is element 32ib + j, its high nibble 32ib + 16 + j,
# each an index into IQ4_NL's table; scale d·(ls − 32), ls = 4 bits of scales_l | 2 of scales_h.
# raw[i] = qs[32p .. 32p + 31] (8 words) | d | scales_h << 16 | scales_l; q[r] = the table
# bytes of sub-block 2p (low then high nibbles), then 2p + 1; fac[r] = their two scales.

@device_function
def iq4_xs_load(w, w8, row, blk, p, raw, i):
    base = uint64(34 * blk)
    for k in range(8):
        raw[i, k] = w[row, base + uint64(2 + 8 * p + k)]
    raw[i, 8] = w[row, base]
    raw[i, 9] = w[row, base + uint64(1)]


@device_function
def iq4_xs_prepare(raw, i, q, fac, r, p):
    for j in range(4):
        a = raw[i, j]
        b = raw[i, 4 + j]
        q[r, j], q[r, 4 + j] = table_bytes(a, IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3)
        q[r, 8 + j], q[r, 12 + j] = table_bytes(b, IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3)
    d = f16_bits_to_f32(raw[i, 8] & LOW16)
    low = shr_u32(raw[i, 9], uint32(8 * p)) & LOW8          # scales_l[p]: sub-blocks 2p, 2p + 1
    high = shr_u32(raw[i, 8] >> SIXTEEN, uint32(4 * p))      # their 2-bit fields of scales_h
    fac[r, 0] = d * small_uint_to_f32((low & uint32(15)) | ((high & THREE) << FOUR), THIRTY_TWO)
    fac[r, 1] = d * small_uint_to_f32((low >> FOUR) | (((high >> TWO) & THREE) << FOUR), THIRTY_TWO)


@device_function
def iq4_xs_dot(q, fac, r, xv, xf, xs, acc):
    acc = fma(fac[r, 0] * xf[0], magic_sum(dot8(q, r, 0, xv, 0, START)), acc)
    return fma(fac[r, 1] * xf[2], magic_sum(dot8(q, r, 8, xv, 8, START)), acc)


# Q2_K and Q3_K: element 128n + 32j + l (n = 0, 1; j = 0..3; l < 32) is the bit pair 2j of qs
# byte 32n + l, and its group of 16 (one scale) is 8n + 2j + l // 16. Unit p (n = p // 2) thus
# reads all 32 qs bytes of half n and takes bit pairs 2j, j = 2(p % 2) + 0, 1; its groups
# t = 0..3 (columns 64p + 16t) are 4p + t. q[r, 4t .. 4t + 3] = group t's quants, one per byte.

@device_function
def bit_pairs(raw, i, q, r, p):
    """q[r] from the qs bytes in raw[i, 0:8] (l < 16, then l ≥ 16): group t's bit pairs."""
    shift = uint32(4 * (p & 1))
    for k in range(4):
        for t in range(4):
            q[r, 4 * t + k] = shr_u32(raw[i, 4 * (t & 1) + k], shift + uint32(2 * (t >> 1))) & uint32(0x03030303)


# Q3_K (110 B: hmask[32], qs[64], scales[12], d; 2-byte aligned, uint16 words): weight
# d·(sc − 32)·(q − 4), q = the bit pair | (bit 4n + j of hmask[l]) << 2, sc 6 bits: the low 4
# at nibble g // 8 of scales[g % 8], the high 2 at bits 2(g // 4) of scales[8 + g % 4]. The zero
# point 4 goes into the dp4a start value: −4·Σ xq over the group (xs[t]).
# raw[i] = qs[32n .. 32n + 31] | hmask[32] | scales[4(p % 2) .. + 3] | scales[8 .. 11] | d.

@device_function
def q3_k_load(w, w8, row, blk, p, raw, i):
    base = 110 * blk
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, base + 32 + 32 * (p >> 1)))
    store4(raw, i, 4, load_u32x4_unaligned(w8, row, base + 48 + 32 * (p >> 1)))
    store4(raw, i, 8, load_u32x4_unaligned(w8, row, base))
    store4(raw, i, 12, load_u32x4_unaligned(w8, row, base + 16))
    scales = uint64(55 * blk + 48 + 2 * (p & 1))
    raw[i, 16] = uint32(w[row, scales]) | (uint32(w[row, scales + uint64(1)]) << SIXTEEN)
    raw[i, 17] = uint32(w[row, uint64(55 * blk + 52)]) | (uint32(w[row, uint64(55 * blk + 53)]) << SIXTEEN)
    raw[i, 18] = uint32(w[row, uint64(55 * blk + 54)])


@device_function
def q3_k_prepare(raw, i, q, fac, r, p):
    bit_pairs(raw, i, q, r, p)
    shift = uint32(4 * (p >> 1) + 2 * (p & 1))
    for k in range(4):
        for t in range(4):
            h = shr_u32(raw[i, 8 + 4 * (t & 1) + k], shift + uint32(t >> 1)) & uint32(0x01010101)
            q[r, 4 * t + k] = q[r, 4 * t + k] | (h << TWO)
    # byte t of sc = the 6-bit scale of group 4p + t
    sc = (shr_u32(raw[i, 16], uint32(4 * (p >> 1))) & LOW4) | ((shr_u32(raw[i, 17], uint32(2 * p)) & uint32(0x03030303))
                                                             << FOUR)
    d = f16_bits_to_f32(raw[i, 18])
    fac[r, 0] = d * small_uint_to_f32(sc & LOW8, THIRTY_TWO)
    fac[r, 1] = d * small_uint_to_f32((sc >> EIGHT) & LOW8, THIRTY_TWO)
    fac[r, 2] = d * small_uint_to_f32((sc >> SIXTEEN) & LOW8, THIRTY_TWO)
    fac[r, 3] = d * small_uint_to_f32(sc >> TWENTY_FOUR, THIRTY_TWO)


@device_function
def q3_k_load_x(xq, xm, s, blk, p, xv, xf, xs):
    sums = kquant_sums_load_x(xq, xm, s, blk, p, xv, xf)
    for t in range(4):
        xs[t] = START - int32(4) * int32(sums[t])


@device_function
def q3_k_dot(q, fac, r, xv, xf, xs, acc):
    for t in range(4):  # Σ (q − 4)·xq = Σ q·xq − 4·Σ xq; x block 2p + t // 2
        acc = fma(fac[r, t] * xf[2 * (t >> 1)], magic_sum(dot4(q, r, 4 * t, xv, 4 * t, xs[t])), acc)
    return acc


# Q2_K (84 B: scales[16], qs[64], d, dmin; 4-byte aligned, uint32 words): weight
# d·(sc & 15)·q − dmin·(sc >> 4), sc = scales[g]. q is multiplied by its group's 4-bit scale in
# place (≤ 45, still a byte), so each x block is one dp4a chain Σ sc·q·xq; the min term is
# dmin·dx·Σ m·(Σ xq over the group), with the int sums of x (Q8_K's bsums) as llama.cpp's CPU.
# raw[i] = qs[32n .. 32n + 31] | scales[4p .. 4p + 3] | d | dmin << 16; q[r, 16] = the four mins.

@device_function
def q2_k_load(w, w8, row, blk, p, raw, i):
    base = uint64(21 * blk)
    for k in range(8):
        raw[i, k] = w[row, base + uint64(4 + 8 * (p >> 1) + k)]
    raw[i, 8] = w[row, base + uint64(p)]
    raw[i, 9] = w[row, base + uint64(20)]


@device_function
def q2_k_prepare(raw, i, q, fac, r, p):
    bit_pairs(raw, i, q, r, p)
    sc = raw[i, 8]
    for t in range(4):
        scale = shr_u32(sc, uint32(8 * t)) & uint32(15)
        for k in range(4):
            q[r, 4 * t + k] = uint32(q[r, 4 * t + k] * scale)   # bytes ≤ 3·15: no carries
    q[r, 16] = (sc >> FOUR) & LOW4
    fac[r, 0] = f16_bits_to_f32(raw[i, 9] & LOW16)
    fac[r, 1] = -f16_bits_to_f32(raw[i, 9] >> SIXTEEN)


@device_function
def q2_k_load_x(xq, xm, s, blk, p, xv, xf, xs):
    sums = kquant_sums_load_x(xq, xm, s, blk, p, xv, xf)
    for t in range(4):
        xs[t] = int32(sums[t])


@device_function
def q2_k_min_sum(m, xs, first):
    """START + Σ m·(Σ xq) over groups first, first + 1 (|·| ≤ 2·15·127·16: magic_sum's range)."""
    a = int32(shr_u32(m, uint32(8 * first)) & uint32(15)) * xs[first]
    b = int32(shr_u32(m, uint32(8 * first + 8)) & uint32(15)) * xs[first + 1]
    return START + int32(a + b)


@device_function
def q2_k_dot(q, fac, r, xv, xf, xs, acc):
    m = q[r, 16]
    acc = fma(fac[r, 0] * xf[0], magic_sum(dot8(q, r, 0, xv, 0, START)), acc)
    acc = fma(fac[r, 1] * xf[0], magic_sum(q2_k_min_sum(m, xs, 0)), acc)
    acc = fma(fac[r, 0] * xf[2], magic_sum(dot8(q, r, 8, xv, 8, START)), acc)
    return fma(fac[r, 1] * xf[2], magic_sum(q2_k_min_sum(m, xs, 2)), acc)


# ---------------------------------------------------------------- IQ2_XS, IQ2_S, IQ1_S, IQ1_M (256 per block)
# Unit p = columns 64p .. 64p + 63 (layout K64), groups of 16 t = 0..3 (block group 4p + t, x block
# 2p + t // 2): q[r, 4t .. 4t + 3] = group t's int8 values, fac[r, t] its factor (IQ1_S: one per
# sub-block 2p, 2p + 1), as gpu/matmul/quants.py decodes them for all three GPU paths. The grid
# rows are read once per unit and row; llama.cpp's CPU meets these weights with Q8_K, x is rounded
# per 32 here as for the K-quants.


@device_function
def group_dot(q, fac, r, xv, xf, xs, acc):
    for t in range(4):
        acc = fma(fac[r, t] * xf[2 * (t >> 1)], magic_sum(dot4(q, r, 4 * t, xv, 4 * t, START)), acc)
    return acc


# IQ2_XS (74 B: d, qs[32] u16, scales[8]; uint16 words). raw[i] = qs entries 8p .. 8p + 7 (four
# words of two) | scales[2p .. 2p + 1] | d.

@device_function
def iq2_xs_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 74 * blk + 2 + 16 * p))
    raw[i, 4] = uint32(w[row, uint64(37 * blk + 33 + p)])
    raw[i, 5] = uint32(w[row, uint64(37 * blk)])


@device_function
def iq2_xs_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(raw[i, 5])
    grid = iq2xs_grid()
    for t in range(4):
        store4(q, r, 4 * t, iq2_xs_words(grid, raw[i, t]))
        fac[r, t] = odd_scale(d, shr_u32(raw[i, 4], uint32(4 * t)))


# IQ2_S (82 B: d, qs[32], signs[32], qh[8], scales[8]; uint16 words). raw[i] = qs[8p .. 8p + 7]
# (two words) | signs[8p ..] (two) | qh[2p .. 2p + 1] | scales[2p .. 2p + 1] << 16 | d. Group t's
# entries 8p + 2t + e take bits 4t + 2e of that qh pair, its scale nibble t.

@device_function
def iq2_s_load(w, w8, row, blk, p, raw, i):
    base = uint64(41 * blk)
    for k in range(2):
        qs = base + uint64(1 + 4 * p + 2 * k)
        sg = base + uint64(17 + 4 * p + 2 * k)
        raw[i, k] = uint32(w[row, qs]) | (uint32(w[row, qs + uint64(1)]) << SIXTEEN)
        raw[i, 2 + k] = uint32(w[row, sg]) | (uint32(w[row, sg + uint64(1)]) << SIXTEEN)
    raw[i, 4] = uint32(w[row, base + uint64(33 + p)]) | (uint32(w[row, base + uint64(37 + p)]) << SIXTEEN)
    raw[i, 5] = uint32(w[row, base])


@device_function
def iq2_s_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(raw[i, 5])
    hs = raw[i, 4]
    grid = iq2s_grid()
    for t in range(4):
        half = uint32(16 * (t & 1))
        store4(q, r, 4 * t, iq2_s_words(grid, shr_u32(raw[i, t >> 1], half), shr_u32(raw[i, 2 + (t >> 1)], half),
                                              shr_u32(hs, uint32(4 * t))))
        fac[r, t] = odd_scale(d, shr_u32(hs >> SIXTEEN, uint32(4 * t)))


# IQ1_S (50 B: d, qs[32], qh[8] u16; uint16 words): raw[i] = qs[8p .. 8p + 7] (two words) |
# qh[2p] | qh[2p + 1] << 16 | d; q[r, 8s ..] = sub-block 2p + s, fac[r, s] its factor.

@device_function
def iq1_s_load(w, w8, row, blk, p, raw, i):
    base = uint64(25 * blk)
    for k in range(2):
        qs = base + uint64(1 + 4 * p + 2 * k)
        raw[i, k] = uint32(w[row, qs]) | (uint32(w[row, qs + uint64(1)]) << SIXTEEN)
    raw[i, 2] = uint32(w[row, base + uint64(17 + 2 * p)]) | (uint32(w[row, base + uint64(18 + 2 * p)]) << SIXTEEN)
    raw[i, 3] = uint32(w[row, base])


@device_function
def iq1_s_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(raw[i, 3])
    grid = iq1s_grid()
    for s in range(2):
        qh = shr_u32(raw[i, 2], uint32(16 * s)) & LOW16
        for e in range(2):      # entries 2e, 2e + 1
            store4(q, r, 8 * s + 4 * e, iq1_s_words(grid, shr_u32(raw[i, s], uint32(16 * e)), qh, 2 * e))
        fac[r, s] = odd_scale(d, (qh >> uint32(12)) & uint32(7))


# IQ1_M (56 B: qs[32], qh[16], scales[4] u16, d in their top nibbles; uint32 words): raw[i] =
# qs[8p .. 8p + 7] (two words) | qh[4p .. 4p + 3] (byte t: group t's two nibbles) | scales.

@device_function
def iq1_m_load(w, w8, row, blk, p, raw, i):
    base = uint64(14 * blk)
    raw[i, 0] = w[row, base + uint64(2 * p)]
    raw[i, 1] = w[row, base + uint64(2 * p + 1)]
    raw[i, 2] = w[row, base + uint64(8 + p)]
    raw[i, 3] = w[row, base + uint64(12)]
    raw[i, 4] = w[row, base + uint64(13)]


@device_function
def iq1_m_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(iq1_m_d(raw[i, 3], raw[i, 4]))
    # scales[p] (3 bits per group); a select, not raw[i, 3 + p // 2]: p is a run-time value, and a
    # run-time index would move raw to local memory
    scales = shr_u32(raw[i, 4] if p >= 2 else raw[i, 3], uint32(16 * (p & 1)))
    grid = iq1s_grid()
    for t in range(4):
        store4(q, r, 4 * t, iq1_m_words(grid, shr_u32(raw[i, t >> 1], uint32(16 * (t & 1))),
                                              shr_u32(raw[i, 2], uint32(8 * t))))
        fac[r, t] = odd_scale(d, shr_u32(scales, uint32(3 * t)) & uint32(7))


# IQ3_XXS, IQ3_S, IQ2_XXS: unit p = sub-blocks 2p, 2p + 1 (layout K64): q[r, 4t .. 4t + 3] = the
# group of 16 t's int8 values (half t % 2 of sub-block 2p + t // 2, gpu/matmul/quants.py's
# words), fac[r] = the two sub-blocks' scales; iq4_xs_dot adds them (|Σ q·xq| ≤ 62·127·32 per
# sub-block: magic_sum's range).
# IQ3_XXS (98 B, 2-byte aligned, uint16 words): raw[i] = qs[16p .. 16p + 15] | aux 2p | aux 2p + 1 | d.

@device_function
def iq3_xxs_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 98 * blk + 2 + 16 * p))
    aux = uint64(49 * blk + 33 + 4 * p)
    raw[i, 4] = uint32(w[row, aux]) | (uint32(w[row, aux + uint64(1)]) << SIXTEEN)
    raw[i, 5] = uint32(w[row, aux + uint64(2)]) | (uint32(w[row, aux + uint64(3)]) << SIXTEEN)
    raw[i, 6] = uint32(w[row, uint64(49 * blk)])


@device_function
def iq3_xxs_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(raw[i, 6])
    grid = iq3xxs_grid()
    for h in range(2):
        aux = raw[i, 4 + h]
        for hh in range(2):
            store4(q, r, 8 * h + 4 * hh, iq3_xxs_words(grid, raw[i, 2 * h + hh], aux, 2 * hh))
        fac[r, h] = iq3_xxs_scale(d, aux)


# IQ2_XXS (66 B, 2-byte aligned, uint16 words): raw[i] = grid 2p | aux 2p | grid 2p + 1 | aux 2p + 1 | d.

@device_function
def iq2_xxs_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 66 * blk + 2 + 16 * p))
    raw[i, 4] = uint32(w[row, uint64(33 * blk)])


@device_function
def iq2_xxs_prepare(raw, i, q, fac, r, p):
    d = f16_bits_to_f32(raw[i, 4])
    grid = iq2xxs_grid()
    for h in range(2):
        aux = raw[i, 2 * h + 1]
        for hh in range(2):
            store4(q, r, 8 * h + 4 * hh, iq2_xxs_words(grid, raw[i, 2 * h], aux, 2 * hh))
        fac[r, h] = odd_scale(d, aux >> uint32(28))


# IQ3_S (110 B, 2-byte aligned, uint16 words): raw[i] = qs[16p .. 16p + 15] | signs[8p .. 8p + 7] |
# qh[2p] | qh[2p + 1] << 8 | the scales word holding scales[p] << 16 | d.

@device_function
def iq3_s_load(w, w8, row, blk, p, raw, i):
    store4(raw, i, 0, load_u32x4_unaligned(w8, row, 110 * blk + 2 + 16 * p))
    base = uint64(55 * blk)
    signs = base + uint64(37 + 4 * p)
    raw[i, 4] = uint32(w[row, signs]) | (uint32(w[row, signs + uint64(1)]) << SIXTEEN)
    raw[i, 5] = uint32(w[row, signs + uint64(2)]) | (uint32(w[row, signs + uint64(3)]) << SIXTEEN)
    raw[i, 6] = uint32(w[row, base + uint64(33 + p)]) | (uint32(w[row, base + uint64(53 + (p >> 1))]) << SIXTEEN)
    raw[i, 7] = uint32(w[row, base])


@device_function
def iq3_s_prepare(raw, i, q, fac, r, p):
    qh = raw[i, 6]
    grid = iq3s_grid()
    for t in range(4):          # qs word t, 9th bits 4t .. 4t + 3 of qh, sign bits 16t .. 16t + 15
        signs = shr_u32(raw[i, 4 + (t >> 1)], uint32(16 * (t & 1))) & LOW16
        store4(q, r, 4 * t, iq3_s_words(grid, raw[i, t], shr_u32(qh, uint32(4 * t)), signs))
    d = f16_bits_to_f32(raw[i, 7])
    scales = shr_u32(qh >> SIXTEEN, uint32(8 * (p & 1)))
    fac[r, 0] = iq3_s_scale(d, scales)
    fac[r, 1] = iq3_s_scale(d, scales >> FOUR)


U8, U16, U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
UNITS: dict[int, Dp4aUnit] = {u.type.id: u for u in (
    Dp4aUnit(gt.Q8_0, U16, 2, 16, 4, NATURAL, 5, 4, 1, 4, 1, 1, q8_0_load, q8_0_prepare, q8_0_load_x, q8_0_dot),
    Dp4aUnit(gt.Q4_0, U16, 1, 32, 4, NATURAL, 5, 8, 1, 8, 2, 1, q4_0_load, q4_0_prepare, q4_0_load_x, block_dot),
    Dp4aUnit(gt.Q4_1, U32, 1, 32, 4, NATURAL, 5, 8, 2, 8, 2, 1, q4_1_load, q4_1_prepare, min_load_x, min_dot),
    Dp4aUnit(gt.Q5_0, U16, 1, 32, 4, NATURAL, 6, 8, 1, 8, 2, 1, q5_0_load, q5_0_prepare, q5_0_load_x, block_dot),
    Dp4aUnit(gt.Q5_1, U32, 1, 32, 4, NATURAL, 6, 8, 2, 8, 2, 1, q5_1_load, q5_1_prepare, min_load_x, min_dot),
    Dp4aUnit(gt.IQ4_NL, U16, 1, 32, 4, NATURAL, 5, 8, 1, 8, 2, 1, q4_0_load, iq4_nl_prepare, iq4_nl_load_x,
             block_dot),
    Dp4aUnit(gt.Q4_K, U32, 4, 64, 2, K64, 12, 16, 4, 16, 4, 1, q4_k_load, q4_k_prepare, kquant_load_x, q4_k_dot),
    Dp4aUnit(gt.Q5_K, U32, 4, 64, 2, K64, 20, 16, 4, 16, 4, 1, q5_k_load, q5_k_prepare, kquant_load_x, q5_k_dot),
    Dp4aUnit(gt.Q6_K, U16, 4, 64, 2, Q6K64, 14, 16, 4, 16, 4, 4, q6_k_load, q6_k_prepare, q6_k_load_x, q6_k_dot),
    Dp4aUnit(gt.IQ4_XS, U32, 4, 64, 2, K64, 10, 16, 2, 16, 4, 1, iq4_xs_load, iq4_xs_prepare, kquant_load_x,
             iq4_xs_dot),
    Dp4aUnit(gt.Q3_K, U16, 4, 64, 2, K64, 19, 16, 4, 16, 4, 4, q3_k_load, q3_k_prepare, q3_k_load_x, q3_k_dot),
    Dp4aUnit(gt.Q2_K, U32, 4, 64, 2, K64, 10, 17, 2, 16, 4, 4, q2_k_load, q2_k_prepare, q2_k_load_x, q2_k_dot),
    Dp4aUnit(gt.IQ2_XS, U16, 4, 64, 2, K64, 6, 16, 4, 16, 4, 1, iq2_xs_load, iq2_xs_prepare, kquant_load_x, group_dot),
    Dp4aUnit(gt.IQ2_S, U16, 4, 64, 2, K64, 6, 16, 4, 16, 4, 1, iq2_s_load, iq2_s_prepare, kquant_load_x, group_dot),
    Dp4aUnit(gt.IQ1_S, U16, 4, 64, 2, K64, 4, 16, 2, 16, 4, 1, iq1_s_load, iq1_s_prepare, kquant_load_x, iq4_xs_dot),
    Dp4aUnit(gt.IQ1_M, U32, 4, 64, 2, K64, 5, 16, 4, 16, 4, 1, iq1_m_load, iq1_m_prepare, kquant_load_x, group_dot),
    Dp4aUnit(gt.MXFP4, U8, 1, 32, 4, NATURAL, 5, 8, 1, 8, 2, 1, mxfp4_load, mxfp4_prepare, iq4_nl_load_x,
             block_dot),
    Dp4aUnit(gt.IQ3_XXS, U16, 4, 64, 2, K64, 7, 16, 2, 16, 4, 1, iq3_xxs_load, iq3_xxs_prepare, kquant_load_x,
             iq4_xs_dot),
    Dp4aUnit(gt.IQ3_S, U16, 4, 64, 2, K64, 8, 16, 2, 16, 4, 1, iq3_s_load, iq3_s_prepare, kquant_load_x, iq4_xs_dot),
    Dp4aUnit(gt.IQ2_XXS, U16, 4, 64, 2, K64, 5, 16, 2, 16, 4, 1, iq2_xxs_load, iq2_xxs_prepare, kquant_load_x,
             iq4_xs_dot),
)}
