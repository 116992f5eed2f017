"""Device-side block decoding for the GPU matvec: how each ggml type is split among warp lanes.

A warp works through a row in tiles of `32 * elems` columns. In each tile every lane owns
`elems` weights of the row (its "unit"), chosen so that the lane's loads are wide and coalesced
and its weights share as few scale factors as possible. Per type four device functions say it:

* `load(w, w8, row, col0, cols, lane, raw, r)` issues the loads of the lane's unit of tile
  `col0` of `row` into `raw[r, :]` (uint32 registers) and nothing else: the kernel loads the
  next tile while it multiplies this one, and any arithmetic on a loaded value here would wait
  for DRAM on the spot. Indices are clamped so loads past the row end stay in bounds.
* `prepare(raw, fac, r, col0, cols, lane)` turns the loaded words into float factors
  `fac[r, :]` (scales, fp16 fields) once they have arrived. A unit past the row end gets zero
  factors, so it adds exact zeros instead of needing a branch.
* `weight(raw, fac, r, i, lane)` is the lane's i-th weight as float32 (i is a compile-time
  constant once the kernel's loops are unrolled, so the shifts below are immediates).
* `owner(ct)` maps column `ct` of a tile to (lane, i): the kernel stages x in shared memory in
  that order, so a lane reads its x values from consecutive banks whatever its unit looks like.

Layouts and formulas: docs/MODEL_FORMAT.md §6. `w` is the row-major weight viewed as the
type's natural word (uint32 or uint16), `w8` the same bytes as uint8.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import float32, uint32

from cpu import ggml_types as gt
from cpu.errors import HybridError
from cpu.blocks import IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS
from cpu.simd import IQ4NL_KVALUES, MXFP4_KVALUES

from ..runtime.device import simulated
from ..intrinsics import (bits_to_f32, device_function, f16_bits_to_f32, fma, load_u32x4, shr_u32,
                         small_uint_to_f32)

ZERO = float32(0.0)
LOW16 = uint32(0xFFFF)
SIXTEEN = uint32(16)


@dataclass(frozen=True)
class LaneUnit:
    """How one ggml type is decoded by warp lanes (see the module docstring)."""
    type: gt.GGMLType
    word: np.dtype          # dtype `w` is viewed as
    elems: int              # weights per lane per tile (<= 32: the x swizzle uses lane ^ i)
    raw_words: int          # uint32 registers per row: the loaded unit
    factors: int            # float32 registers per row: its decoded scales
    load: object
    prepare: object
    weight: object
    owner: object
    aligned16: bool = False  # loads 16 bytes at a time: rows must start 16-byte aligned

    @property
    def tile_cols(self) -> int:
        return 32 * self.elems


# ---------------------------------------------------------------- shared scalar decoding

@device_function
def int8_to_f32(byte):
    """A uint8 holding a two's-complement int8, as float32."""
    return small_uint_to_f32(uint32(byte) ^ uint32(0x80), float32(128.0))


@device_function
def f16_or_zero(bits, live):
    value = f16_bits_to_f32(bits & LOW16)
    return value if live else ZERO


@device_function
def kquant_scale_min(s0, s1, s2, j):
    """get_scale_min_k4(j): 6-bit (scale, min) j of a Q4_K/Q5_K block, as float32.

    s0, s1, s2 are the block's 12 scale bytes as three little-endian words.
    """
    shift = uint32(8 * (j & 3))
    a = (s0 >> shift) & uint32(0xFF)  # scales[j % 4]
    b = (s1 >> shift) & uint32(0xFF)  # scales[4 + j % 4]
    c = (s2 >> shift) & uint32(0xFF)  # scales[8 + j % 4]
    if j < 4:
        sc = a & uint32(63)
        m = b & uint32(63)
    else:
        sc = (c & uint32(15)) | ((a >> uint32(6)) << uint32(4))
        m = (c >> uint32(4)) | ((b >> uint32(6)) << uint32(4))
    return small_uint_to_f32(sc, ZERO), small_uint_to_f32(m, ZERO)


# ---------------------------------------------------------------- F32 / F16 / BF16
# Lane l owns column 32*m + l of the tile, m = 0..15: plain coalesced loads of the raw bits.

@device_function
def dense_owner(ct):
    return ct & 31, ct >> 5


@device_function
def dense_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(16):
        raw[r, m] = uint32(w[row, min(col0 + 32 * m + lane, cols - 1)])


@device_function
def dense_prepare(raw, fac, r, col0, cols, lane):
    for m in range(16):
        if col0 + 32 * m + lane >= cols:
            raw[r, m] = uint32(0)  # the bits of +0.0 in all three formats


@device_function
def f32_weight(raw, fac, r, i, lane):
    return bits_to_f32(raw[r, i])


@device_function
def f16_weight(raw, fac, r, i, lane):
    return f16_bits_to_f32(raw[r, i])


@device_function
def bf16_weight(raw, fac, r, i, lane):
    return bits_to_f32(raw[r, i] << SIXTEEN)  # bf16 is the top half of an f32


# ---------------------------------------------------------------- Q8_0 (34 B: d, qs[32])
# Tile = 16 blocks. Step m = 0..7: lanes 0-15 take block 2m, lanes 16-31 block 2m+1; lane
# l reads qs bytes 2k, 2k+1 (k = l % 16) as one uint16. Weight i = 2m + byte.
# raw[r, m] = the two qs bytes | d bits << 16.

@device_function
def q8_0_owner(ct):
    blk = ct >> 5
    j = ct & 31
    return (blk & 1) * 16 + (j >> 1), 2 * (blk >> 1) + (j & 1)


@device_function
def small_block(col0, m, lane, blocks_per_step, cols):
    """(block index clamped into the row, live) of step m for 32-element blocks."""
    lanes_per_block = 32 // blocks_per_step
    blk = (col0 >> 5) + blocks_per_step * m + lane // lanes_per_block
    n_blocks = cols >> 5
    return min(blk, n_blocks - 1), blk < n_blocks


@device_function
def q8_0_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 2, cols)
        qs = uint32(w[row, blk * 17 + 1 + (lane & 15)])
        raw[r, m] = qs | (uint32(w[row, blk * 17]) << SIXTEEN)


@device_function
def q8_0_prepare(raw, fac, r, col0, cols, lane):
    for m in range(8):
        _, live = small_block(col0, m, lane, 2, cols)
        fac[r, m] = f16_or_zero(raw[r, m] >> SIXTEEN, live)


@device_function
def q8_0_weight(raw, fac, r, i, lane):
    byte = (raw[r, i >> 1] >> uint32(8 * (i & 1))) & uint32(0xFF)
    return fac[r, i >> 1] * int8_to_f32(byte)


# ---------------------------------------------------------------- Q4_0 (18 B: d, qs[16])
# Tile = 32 blocks. Step m = 0..7: lane l takes block 4m + l // 8 and reads qs bytes 2k, 2k+1
# (k = l % 8): low nibbles are elements 2k, 2k+1, high nibbles 16+2k, 17+2k.
# Weight i = 4m + 2*high + byte. raw[r, m] = the two qs bytes | d bits << 16.

@device_function
def q4_0_owner(ct):
    blk = ct >> 5
    j = ct & 31
    jj = j & 15
    return (blk & 3) * 8 + (jj >> 1), 4 * (blk >> 2) + 2 * (j >> 4) + (jj & 1)


@device_function
def q4_0_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 4, cols)
        qs = uint32(w[row, blk * 9 + 1 + (lane & 7)])
        raw[r, m] = qs | (uint32(w[row, blk * 9]) << SIXTEEN)


@device_function
def q4_0_prepare(raw, fac, r, col0, cols, lane):
    for m in range(8):
        _, live = small_block(col0, m, lane, 4, cols)
        fac[r, m] = f16_or_zero(raw[r, m] >> SIXTEEN, live)


@device_function
def q4_0_weight(raw, fac, r, i, lane):
    t = i & 3
    nib = (raw[r, i >> 2] >> uint32(8 * (t & 1) + 4 * (t >> 1))) & uint32(15)
    return fac[r, i >> 2] * small_uint_to_f32(nib, float32(8.0))


# ---------------------------------------------------------------- Q4_1, Q5_0, Q5_1, IQ4_NL (32 per block)
# Q4_0's split of the tile (q4_0_owner): step m, lane l takes block 4m + l // 8 and its qs bytes
# 2k, 2k+1 (k = l % 8), elements 2k, 2k+1 (low nibbles) and 16+2k, 17+2k (high nibbles); Q5_*
# take bits 2k, 2k+1, 16+2k, 17+2k of qh as their fifth bits. Weight i = 4m + 2*high + byte.
# raw[r, m] = the two qs bytes | d bits << 16 (all four types); Q4_1 / Q5_1: raw[r, 8 + m] = m
# bits, fac[r, 8 + m] = m; Q5_0 / Q5_1: raw[r, 16 + m] (Q5_0: 8 + m) = qh >> 2k after prepare.
# uint16 words: Q4_1 blocks are 10 (d, m, qs at 2..9), Q5_0 11 (d, qh 1..2, qs 3..10), Q5_1 12
# (d, m, qh 2..3, qs 4..11).

@device_function
def q4_1_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 4, cols)
        raw[r, m] = uint32(w[row, blk * 10 + 2 + (lane & 7)]) | (uint32(w[row, blk * 10]) << SIXTEEN)
        raw[r, 8 + m] = uint32(w[row, blk * 10 + 1])


@device_function
def q5_0_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 4, cols)
        raw[r, m] = uint32(w[row, blk * 11 + 3 + (lane & 7)]) | (uint32(w[row, blk * 11]) << SIXTEEN)
        raw[r, 8 + m] = uint32(w[row, blk * 11 + 1]) | (uint32(w[row, blk * 11 + 2]) << SIXTEEN)


@device_function
def q5_1_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 4, cols)
        raw[r, m] = uint32(w[row, blk * 12 + 4 + (lane & 7)]) | (uint32(w[row, blk * 12]) << SIXTEEN)
        raw[r, 8 + m] = uint32(w[row, blk * 12 + 1])
        raw[r, 16 + m] = uint32(w[row, blk * 12 + 2]) | (uint32(w[row, blk * 12 + 3]) << SIXTEEN)


@device_function
def q4_1_prepare(raw, fac, r, col0, cols, lane):
    for m in range(8):
        _, live = small_block(col0, m, lane, 4, cols)
        fac[r, m] = f16_or_zero(raw[r, m] >> SIXTEEN, live)
        fac[r, 8 + m] = f16_or_zero(raw[r, 8 + m], live)


@device_function
def shift_fifth_bits(raw, r, first, lane):
    """The qh words raw[r, first .. first + 7] shifted down to this lane's weights' bits."""
    shift = uint32(2 * (lane & 7))
    for m in range(8):
        raw[r, first + m] = raw[r, first + m] >> shift


@device_function
def q5_0_prepare(raw, fac, r, col0, cols, lane):
    q4_0_prepare(raw, fac, r, col0, cols, lane)
    shift_fifth_bits(raw, r, 8, lane)


@device_function
def q5_1_prepare(raw, fac, r, col0, cols, lane):
    q4_1_prepare(raw, fac, r, col0, cols, lane)
    shift_fifth_bits(raw, r, 16, lane)


@device_function
def nibble_at(raw, r, i):
    """The 4-bit quant of weight i of a Q4_0-split unit."""
    t = i & 3
    return (raw[r, i >> 2] >> uint32(8 * (t & 1) + 4 * (t >> 1))) & uint32(15)


@device_function
def fifth_bit_at(raw, r, first, i):
    """Weight i's fifth bit, from qh >> 2k in raw[r, first + m]: bit byte + 16·high."""
    t = i & 3
    return ((raw[r, first + (i >> 2)] >> uint32((t & 1) + 16 * (t >> 1))) & uint32(1)) << uint32(4)


@device_function
def q4_1_weight(raw, fac, r, i, lane):
    return fma(fac[r, i >> 2], small_uint_to_f32(nibble_at(raw, r, i), ZERO), fac[r, 8 + (i >> 2)])


@device_function
def q5_0_weight(raw, fac, r, i, lane):
    q = nibble_at(raw, r, i) | fifth_bit_at(raw, r, 8, i)
    return fac[r, i >> 2] * small_uint_to_f32(q, float32(16.0))


@device_function
def q5_1_weight(raw, fac, r, i, lane):
    q = nibble_at(raw, r, i) | fifth_bit_at(raw, r, 16, i)
    return fma(fac[r, i >> 2], small_uint_to_f32(q, ZERO), fac[r, 8 + (i >> 2)])


# The 16-entry int8 tables (IQ4_NL's IQ4NL_KVALUES, MXFP4's MXFP4_KVALUES: 2 × the e2m1 values)
# packed four to a word: word k holds entries 4k..4k+3, so that a lookup is two selects and a
# shift, with no table in memory.
def _packed_table(values) -> tuple:
    return tuple(uint32(v) for v in np.array(values, np.int8).view(np.uint32))


IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3 = _packed_table(IQ4NL_KVALUES)
MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3 = _packed_table(MXFP4_KVALUES)


@device_function
def table_byte(n, w0, w1, w2, w3):
    """Entry n (0..15) of a packed table as a byte (uint32 0..255, two's complement)."""
    a = w2 if n & uint32(8) else w0
    b = w3 if n & uint32(8) else w1
    word = b if n & uint32(4) else a
    return shr_u32(word, (n & uint32(3)) << uint32(3)) & uint32(0xFF)


@device_function
def iq4_nl_byte(n):
    """IQ4_NL's value of nibble n as a byte."""
    return table_byte(n, IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3)


@device_function
def mxfp4_byte(n):
    """MXFP4's value (2 × e2m1) of nibble n as a byte."""
    return table_byte(n, MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3)


@device_function
def e8m0_half(e):
    """MXFP4's block scale, halved for its doubled table: 2**(e − 128) for the exponent byte e
    (uint32), exactly (ggml's E8M0_TO_FP32_HALF): e ≥ 2 is a normal float (biased exponent
    e − 1), e = 0, 1 the subnormals 2**−128, 2**−127 (mantissa bit 21, 22)."""
    return bits_to_f32((e - uint32(1)) << uint32(23) if e >= uint32(2) else uint32(0x00200000) << e)


@device_function
def iq4_nl_weight(raw, fac, r, i, lane):
    return fac[r, i >> 2] * int8_to_f32(iq4_nl_byte(nibble_at(raw, r, i)))


# MXFP4 (17 B: e8m0 exponent e, qs[16]; byte aligned, uint8 words): Q4_0's split and nibble
# order, each nibble an index into MXFP4's table, scale e8m0_half(e). raw[r, m] = the two qs
# bytes | e << 16.

@device_function
def mxfp4_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(8):
        blk, _ = small_block(col0, m, lane, 4, cols)
        at = blk * 17 + 1 + 2 * (lane & 7)
        raw[r, m] = (uint32(w8[row, at]) | (uint32(w8[row, at + 1]) << uint32(8))
                     | (uint32(w8[row, blk * 17]) << SIXTEEN))


@device_function
def mxfp4_prepare(raw, fac, r, col0, cols, lane):
    for m in range(8):
        _, live = small_block(col0, m, lane, 4, cols)
        fac[r, m] = e8m0_half(raw[r, m] >> SIXTEEN) if live else ZERO


@device_function
def mxfp4_weight(raw, fac, r, i, lane):
    return fac[r, i >> 2] * int8_to_f32(mxfp4_byte(nibble_at(raw, r, i)))


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Tile = 4 blocks; 8 lanes per block. Lane l: block l // 8, chunk c = (l % 8) // 2, half hh =
# l % 2, i.e. the 16 qs bytes 32c + 16hh + j (one 16-byte load). Low nibbles are elements
# 64c + 16hh + j (sub-block 2c), high nibbles 64c + 32 + 16hh + j (sub-block 2c+1).
# Weight i = 16*high + j. raw[r, 0:4] = qs, raw[r, 4:8] = the block header (d | dmin << 16,
# scales[12]), Q5_K adds raw[r, 8:12] = qh bytes 16hh .. 16hh+15.
# fac = d*sc1, dmin*m1, d*sc2, dmin*m2 (the lane's two sub-blocks).

@device_function
def kquant_owner(ct):
    rem = ct & 63
    l5 = rem & 31
    return (ct >> 8) * 8 + ((ct & 255) >> 6) * 2 + (l5 >> 4), (rem >> 5) * 16 + (l5 & 15)


@device_function
def kquant_block(col0, lane, cols):
    """(block index clamped into the row, live) of the lane's unit."""
    blk = (col0 >> 8) + (lane >> 3)
    n_blocks = cols >> 8
    return min(blk, n_blocks - 1), blk < n_blocks


@device_function
def store4(raw, r, first, words):
    a, b, c, d = words
    raw[r, first] = a
    raw[r, first + 1] = b
    raw[r, first + 2] = c
    raw[r, first + 3] = d


@device_function
def q4_k_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    word0 = blk * 36  # 144 bytes: header 16, qs 128
    store4(raw, r, 0, load_u32x4(w, row, word0 + 4 + 8 * ((lane & 7) >> 1) + 4 * (lane & 1)))
    store4(raw, r, 4, load_u32x4(w, row, word0))


@device_function
def q5_k_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    word0 = blk * 44  # 176 bytes: header 16, qh 32, qs 128
    store4(raw, r, 0, load_u32x4(w, row, word0 + 12 + 8 * ((lane & 7) >> 1) + 4 * (lane & 1)))
    store4(raw, r, 4, load_u32x4(w, row, word0))
    store4(raw, r, 8, load_u32x4(w, row, word0 + 4 + 4 * (lane & 1)))


@device_function
def kquant_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    d = f16_or_zero(raw[r, 4], live)
    dmin = f16_or_zero(raw[r, 4] >> SIXTEEN, live)
    sc1, m1 = kquant_scale_min(raw[r, 5], raw[r, 6], raw[r, 7], 2 * c)
    sc2, m2 = kquant_scale_min(raw[r, 5], raw[r, 6], raw[r, 7], 2 * c + 1)
    fac[r, 0] = d * sc1
    fac[r, 1] = dmin * m1
    fac[r, 2] = d * sc2
    fac[r, 3] = dmin * m2


@device_function
def q5_k_prepare(raw, fac, r, col0, cols, lane):
    kquant_prepare(raw, fac, r, col0, cols, lane)
    # chunk c uses bits 2c (low nibbles) and 2c+1 (high) of each qh byte: shift them to 0, 1
    shift = uint32(2 * ((lane & 7) >> 1))
    for k in range(4):
        raw[r, 8 + k] = raw[r, 8 + k] >> shift


@device_function
def q4_k_weight(raw, fac, r, i, lane):
    high = i >> 4
    j = i & 15
    nib = (raw[r, j >> 2] >> uint32(8 * (j & 3) + 4 * high)) & uint32(15)
    return fma(fac[r, 2 * high], small_uint_to_f32(nib, ZERO), -fac[r, 2 * high + 1])


@device_function
def q5_k_weight(raw, fac, r, i, lane):
    high = i >> 4
    j = i & 15
    shift = uint32(8 * (j & 3))
    nib = (raw[r, j >> 2] >> (shift + uint32(4 * high))) & uint32(15)
    bit = (raw[r, 8 + (j >> 2)] >> (shift + uint32(high))) & uint32(1)
    q = nib | (bit << uint32(4))
    return fma(fac[r, 2 * high], small_uint_to_f32(q, ZERO), -fac[r, 2 * high + 1])


# ---------------------------------------------------------------- Q6_K (210 B, 2-byte aligned)
# Tile = 2 blocks = 4 halves of 128. Step m = 0..3 is half m % 2 of block m // 2. Lane l reads
# ql bytes 2l, 2l+1 and qh bytes 2(l%16), 2(l%16)+1 as uint16 (the block is only 2-byte
# aligned): elements 2l, 2l+1 (low nibbles) and 2l+64, 2l+65 (high nibbles), scales l//8 and
# 4 + l//8 of the half. Weight i = 4m + 2*high + byte.
# raw[r, m] = ql | qh << 16; raw[r, 4+m] = scale lo | scale hi << 8 | d bits << 16;
# fac[r, 2m + high] = d * scale.

@device_function
def q6_k_owner(ct):
    rem = ct & 255
    e = rem & 127
    e6 = e & 63
    return e6 >> 1, 4 * (2 * (ct >> 8) + (rem >> 7)) + 2 * (e >> 6) + (e6 & 1)


@device_function
def q6_k_block(col0, m, cols):
    blk = (col0 >> 8) + (m >> 1)
    n_blocks = cols >> 8
    return min(blk, n_blocks - 1), blk < n_blocks


@device_function
def q6_k_load(w, w8, row, col0, cols, lane, raw, r):
    for m in range(4):
        blk, _ = q6_k_block(col0, m, cols)
        half = m & 1
        base = blk * 105  # 210 bytes in uint16 words: ql 0..63, qh 64..95, scales 96..103, d 104
        ql = uint32(w[row, base + 32 * half + lane])
        qh = uint32(w[row, base + 64 + 16 * half + (lane & 15)])
        raw[r, m] = ql | (qh << SIXTEEN)
        scales = blk * 210 + 192 + 8 * half + (lane >> 3)
        raw[r, 4 + m] = (uint32(w8[row, scales]) | (uint32(w8[row, scales + 4]) << uint32(8))
                         | (uint32(w[row, base + 104]) << SIXTEEN))


@device_function
def q6_k_prepare(raw, fac, r, col0, cols, lane):
    # lanes >= 16 hold elements 32..63 (+64): their 2-bit qh fields sit 2 bits higher
    qh_shift = uint32(2 * (lane >> 4))
    for m in range(4):
        _, live = q6_k_block(col0, m, cols)
        v = raw[r, m]
        raw[r, m] = (v & LOW16) | (((v >> SIXTEEN) >> qh_shift) << SIXTEEN)
        s = raw[r, 4 + m]
        d = f16_or_zero(s >> SIXTEEN, live)
        fac[r, 2 * m] = d * int8_to_f32(s & uint32(0xFF))
        fac[r, 2 * m + 1] = d * int8_to_f32((s >> uint32(8)) & uint32(0xFF))


@device_function
def q6_k_weight(raw, fac, r, i, lane):
    m = i >> 2
    t = i & 3
    shift = uint32(8 * (t & 1) + 4 * (t >> 1))
    v = raw[r, m]
    nib = (v >> shift) & uint32(15)
    bits = (v >> (shift + SIXTEEN)) & uint32(3)
    q = nib | (bits << uint32(4))
    return fac[r, 2 * m + (t >> 1)] * small_uint_to_f32(q, float32(32.0))



# ---------------------------------------------------------------- IQ4_XS, Q3_K, Q2_K (256 per block)
# Q4_K's split of the tile (kquant_owner, kquant_block): lane l takes block l // 8, chunk
# c = (l % 8) // 2 and half hh = l % 2, i.e. columns 64c + 16hh + j (weight i = j) and
# 64c + 32 + 16hh + j (weight i = 16 + j), j < 16.
# IQ4_XS (136 B: d, scales_h, scales_l[4], qs[128]; uint32 words): those are sub-blocks 2c and
# 2c + 1, nibble hh of qs bytes 32c + j and 32c + 16 + j. raw[r, 0:8] = those qs words (shifted
# down by 4hh in prepare), raw[r, 8] = d | scales_h << 16, raw[r, 9] = scales_l; fac = the two
# sub-blocks' d·(ls − 32).

@device_function
def iq4_xs_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    base = blk * 34
    for k in range(8):
        raw[r, k] = w[row, base + 2 + 8 * ((lane & 7) >> 1) + k]
    raw[r, 8] = w[row, base]
    raw[r, 9] = w[row, base + 1]


@device_function
def iq4_xs_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = uint32((lane & 7) >> 1)
    for k in range(8):
        raw[r, k] = shr_u32(raw[r, k], uint32(4 * (lane & 1)))
    d = f16_or_zero(raw[r, 8], live)
    low = shr_u32(raw[r, 9], c << uint32(3))                 # scales_l[c]: sub-blocks 2c, 2c + 1
    high = shr_u32(raw[r, 8] >> SIXTEEN, c << uint32(2))
    for h in range(2):
        ls = (shr_u32(low, uint32(4 * h)) & uint32(15)) | ((shr_u32(high, uint32(2 * h)) & uint32(3)) << uint32(4))
        fac[r, h] = d * small_uint_to_f32(ls, float32(32.0))


@device_function
def iq4_xs_weight(raw, fac, r, i, lane):
    j = i & 15
    nib = (raw[r, 4 * (i >> 4) + (j >> 2)] >> uint32(8 * (j & 3))) & uint32(15)
    return fac[r, i >> 4] * int8_to_f32(iq4_nl_byte(nib))


# Q3_K / Q2_K: element 128n + 32s + l is the bit pair 2s of qs byte 32n + l, in group (one scale)
# 8n + 2s + l // 16. The lane's columns are n = c // 2, s = 2(c % 2) (weights i < 16) and + 1,
# l = 16hh + j: qs bytes 32n + 16hh + j, groups g = 4c + hh and 4c + 2 + hh.
# Q3_K (110 B: hmask[32], qs[64], scales[12], d; uint16 words): raw[r, 0:4] = those qs bytes,
# raw[r, 4:8] = hmask[16hh + j] (each shifted down to its pair / bit in prepare), raw[r, 8] =
# scales[4(c % 2) ..], raw[r, 9] = scales[8 .. 11], raw[r, 10] = d; fac = d·(sc − 32) of both groups.
# Q2_K (84 B: scales[16], qs[64], d, dmin; uint32 words): raw[r, 0:4] = the qs bytes, raw[r, 4] =
# scales[4c ..], raw[r, 5] = d | dmin << 16; fac = d·sc, dmin·m of both groups.

@device_function
def q3_k_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 55
    qs = base + 16 + 16 * (c >> 1) + 8 * (lane & 1)
    hm = base + 8 * (lane & 1)
    for k in range(4):
        raw[r, k] = uint32(w[row, qs + 2 * k]) | (uint32(w[row, qs + 2 * k + 1]) << SIXTEEN)
        raw[r, 4 + k] = uint32(w[row, hm + 2 * k]) | (uint32(w[row, hm + 2 * k + 1]) << SIXTEEN)
    raw[r, 8] = uint32(w[row, base + 48 + 2 * (c & 1)]) | (uint32(w[row, base + 49 + 2 * (c & 1)]) << SIXTEEN)
    raw[r, 9] = uint32(w[row, base + 52]) | (uint32(w[row, base + 53]) << SIXTEEN)
    raw[r, 10] = uint32(w[row, base + 54])


@device_function
def q3_k_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = uint32((lane & 7) >> 1)
    hh = uint32(lane & 1)
    pair = (c & uint32(1)) << uint32(2)
    bit = ((c >> uint32(1)) << uint32(2)) | ((c & uint32(1)) << uint32(1))
    for k in range(4):
        raw[r, k] = shr_u32(raw[r, k], pair)
        raw[r, 4 + k] = shr_u32(raw[r, 4 + k], bit)
    lo = shr_u32(raw[r, 8], (c >> uint32(1)) << uint32(2))
    hi = shr_u32(raw[r, 9], c << uint32(1))
    d = f16_or_zero(raw[r, 10], live)
    for h in range(2):  # groups 4c + hh (weights i < 16) and 4c + 2 + hh
        at = (hh + uint32(2 * h)) << uint32(3)
        sc = (shr_u32(lo, at) & uint32(15)) | ((shr_u32(hi, at) & uint32(3)) << uint32(4))
        fac[r, h] = d * small_uint_to_f32(sc, float32(32.0))


@device_function
def q3_k_weight(raw, fac, r, i, lane):
    h = i >> 4
    j = i & 15
    shift = uint32(8 * (j & 3))
    q = (raw[r, j >> 2] >> (shift + uint32(2 * h))) & uint32(3)
    q |= ((raw[r, 4 + (j >> 2)] >> (shift + uint32(h))) & uint32(1)) << uint32(2)
    return fac[r, h] * small_uint_to_f32(q, float32(4.0))


@device_function
def q2_k_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 21
    for k in range(4):
        raw[r, k] = w[row, base + 4 + 8 * (c >> 1) + 4 * (lane & 1) + k]
    raw[r, 4] = w[row, base + c]
    raw[r, 5] = w[row, base + 20]


@device_function
def q2_k_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = uint32((lane & 7) >> 1)
    for k in range(4):
        raw[r, k] = shr_u32(raw[r, k], (c & uint32(1)) << uint32(2))
    d = f16_or_zero(raw[r, 5], live)
    dmin = f16_or_zero(raw[r, 5] >> SIXTEEN, live)
    for h in range(2):  # groups 4c + hh (weights i < 16) and 4c + 2 + hh
        sc = shr_u32(raw[r, 4], (uint32(lane & 1) + uint32(2 * h)) << uint32(3))
        fac[r, 2 * h] = d * small_uint_to_f32(sc & uint32(15), ZERO)
        fac[r, 2 * h + 1] = dmin * small_uint_to_f32((sc >> uint32(4)) & uint32(15), ZERO)


@device_function
def q2_k_weight(raw, fac, r, i, lane):
    h = i >> 4
    j = i & 15
    q = (raw[r, j >> 2] >> uint32(8 * (j & 3) + 2 * h)) & uint32(3)
    return fma(fac[r, 2 * h], small_uint_to_f32(q, ZERO), -fac[r, 2 * h + 1])


# ---------------------------------------------------------------- IQ3_XXS, IQ3_S, IQ2_XXS (256 per block)
# Grids of positive byte values (cpu.blocks, the one owner), packed four to a uint32 word: the
# kernels read them as constant arrays. IQ3_XXS / IQ3_S rows are one word (4 weights), IQ2_XXS
# rows two (8 weights: words 2g, 2g + 1). KSIGNS: a 7-bit sign index to its 8 sign bits.
IQ3XXS_WORDS = np.ascontiguousarray(IQ3XXS_GRID.astype(np.uint8)).view(np.uint32).ravel()   # (256,)
IQ3S_WORDS = np.ascontiguousarray(IQ3S_GRID.astype(np.uint8)).view(np.uint32).ravel()       # (512,)
IQ2XXS_WORDS = np.ascontiguousarray(IQ2XXS_GRID.astype(np.uint8)).view(np.uint32).ravel()   # (512,)
KSIGNS_U32 = KSIGNS.astype(np.uint32)


@device_function
def signed_bytes(word, signs):
    """The four bytes of `word` (grid values 1..127) with byte k negated where bit k of `signs`
    is set: two's complement per byte, (g ^ 0xFF) + 1, no carry out of a byte as g ≥ 1."""
    t = ((signs & uint32(1)) | ((signs & uint32(2)) << uint32(7)) | ((signs & uint32(4)) << uint32(14))
         | ((signs & uint32(8)) << uint32(21)))
    return (word ^ (t * uint32(0xFF))) + t


@device_function
def sign_pair(aux, first):
    """The 16 sign bits of sign indices `first` and first + 1 (7 bits each) of aux."""
    lo = KSIGNS_U32[shr_u32(aux, uint32(7 * first)) & uint32(127)]
    return lo | (KSIGNS_U32[shr_u32(aux, uint32(7 * first + 7)) & uint32(127)] << uint32(8))


@device_function
def iq_half_scale(d, aux, quarter):
    """IQ3_XXS / IQ2_XXS sub-block scale d·(0.5 + aux >> 28)·(0.5 or 0.25), in ggml's order."""
    return d * (float32(0.5) + small_uint_to_f32(aux >> uint32(28), ZERO)) * quarter


@device_function
def signed_grid_value(word, byte, signs, j, fac):
    """fac · (byte `byte` of a grid word, negated where bit j of signs is set)."""
    v = small_uint_to_f32(shr_u32(word, uint32(8 * byte)) & uint32(0xFF), ZERO)
    return fac * (-v if (signs >> uint32(j)) & uint32(1) else v)


# Q4_K's split of the tile (kquant_owner, kquant_block): lane l takes sub-blocks 2c + h (h = 0 for
# weights i < 16, 1 for i ≥ 16), c = (l % 8) // 2, and their columns 16hh .. 16hh + 15, hh = l % 2.
# IQ3_XXS (98 B: d, qs[64] a grid byte per 4 weights, then per sub-block ib a u32 aux: 4 × 7-bit
# sign indices, one per 8 weights, and a 4-bit scale on top; uint16 words): raw[r, 2h] = grid
# bytes 8ib + 4hh .. + 3, raw[r, 2h + 1] = aux (after prepare: the half's 16 sign bits), raw[r, 4] = d.

@device_function
def iq3_xxs_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 49
    for h in range(2):
        ib = 2 * c + h
        g = base + 1 + 4 * ib + 2 * (lane & 1)
        raw[r, 2 * h] = uint32(w[row, g]) | (uint32(w[row, g + 1]) << SIXTEEN)
        raw[r, 2 * h + 1] = uint32(w[row, base + 33 + 2 * ib]) | (uint32(w[row, base + 34 + 2 * ib]) << SIXTEEN)
    raw[r, 4] = uint32(w[row, base])


@device_function
def iq3_xxs_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    d = f16_or_zero(raw[r, 4], live)
    for h in range(2):
        aux = raw[r, 2 * h + 1]
        fac[r, h] = iq_half_scale(d, aux, float32(0.5))
        raw[r, 2 * h + 1] = sign_pair(aux, 2 * (lane & 1))


@device_function
def iq3_xxs_weight(raw, fac, r, i, lane):
    h = i >> 4
    j = i & 15
    g = shr_u32(raw[r, 2 * h], uint32(8 * (j >> 2))) & uint32(0xFF)
    return signed_grid_value(IQ3XXS_WORDS[g], j & 3, raw[r, 2 * h + 1], j, fac[r, h])


# IQ2_XXS (66 B: d, then per sub-block ib a u32 of 4 grid bytes, one per 8 weights, and a u32 aux
# as IQ3_XXS's; uint16 words): raw[r, 2h] = the grid bytes (after prepare: those of half hh in the
# low 16 bits), raw[r, 2h + 1] = aux (after prepare: the half's 16 sign bits), raw[r, 4] = d.

@device_function
def iq2_xxs_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 33
    for h in range(2):
        at = base + 1 + 4 * (2 * c + h)
        raw[r, 2 * h] = uint32(w[row, at]) | (uint32(w[row, at + 1]) << SIXTEEN)
        raw[r, 2 * h + 1] = uint32(w[row, at + 2]) | (uint32(w[row, at + 3]) << SIXTEEN)
    raw[r, 4] = uint32(w[row, base])


@device_function
def iq2_xxs_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    d = f16_or_zero(raw[r, 4], live)
    hh = uint32(lane & 1)
    for h in range(2):
        aux = raw[r, 2 * h + 1]
        fac[r, h] = iq_half_scale(d, aux, float32(0.25))
        raw[r, 2 * h] = shr_u32(raw[r, 2 * h], hh << uint32(4))
        raw[r, 2 * h + 1] = sign_pair(aux, 2 * (lane & 1))


@device_function
def iq2_xxs_weight(raw, fac, r, i, lane):
    h = i >> 4
    j = i & 15
    g = shr_u32(raw[r, 2 * h], uint32(8 * (j >> 3))) & uint32(0xFF)
    word = IQ2XXS_WORDS[(g << uint32(1)) | uint32((j >> 2) & 1)]
    return signed_grid_value(word, j & 3, raw[r, 2 * h + 1], j, fac[r, h])


# IQ3_S (110 B: d, qs[64] low 8 bits of a grid index per 4 weights, qh[8] their 9th bits (bit k % 8
# of qh[k // 8] for qs byte k), signs[32] a bit per weight, scales[4] a nibble per sub-block:
# d·(1 + 2·sc); uint16 words): raw[r, 2h] = qs bytes 8ib + 4hh .. + 3, raw[r, 2h + 1] = sign bytes
# 4ib + 2hh, + 1 | the qh word holding qh[ib] << 16 (after prepare: the four 9th bits at 16..19),
# raw[r, 4] = d | the scales word holding scales[c] << 16.

@device_function
def iq3_s_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    hh = lane & 1
    base = blk * 55
    for h in range(2):
        ib = 2 * c + h
        g = base + 1 + 4 * ib + 2 * hh
        raw[r, 2 * h] = uint32(w[row, g]) | (uint32(w[row, g + 1]) << SIXTEEN)
        raw[r, 2 * h + 1] = uint32(w[row, base + 37 + 2 * ib + hh]) | (uint32(w[row, base + 33 + (ib >> 1)]) << SIXTEEN)
    raw[r, 4] = uint32(w[row, base]) | (uint32(w[row, base + 53 + (c >> 1)]) << SIXTEEN)


@device_function
def iq3_s_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = uint32((lane & 7) >> 1)
    hh = uint32(lane & 1)
    d = f16_or_zero(raw[r, 4], live)
    scales = shr_u32(raw[r, 4] >> SIXTEEN, (c & uint32(1)) << uint32(3))
    for h in range(2):
        sc = shr_u32(scales, uint32(4 * h)) & uint32(15)
        fac[r, h] = d * small_uint_to_f32(uint32(1) + (sc << uint32(1)), ZERO)
        v = raw[r, 2 * h + 1]
        qh = shr_u32(v >> SIXTEEN, (uint32(h) << uint32(3)) + (hh << uint32(2))) & uint32(15)  # ib % 2 = h
        raw[r, 2 * h + 1] = (v & LOW16) | (qh << SIXTEEN)


@device_function
def iq3_s_weight(raw, fac, r, i, lane):
    h = i >> 4
    j = i & 15
    v = raw[r, 2 * h + 1]
    g = (shr_u32(raw[r, 2 * h], uint32(8 * (j >> 2))) & uint32(0xFF)) | (
        (shr_u32(v, uint32(16 + (j >> 2))) & uint32(1)) << uint32(8))
    return signed_grid_value(IQ3S_WORDS[g], j & 3, v, j, fac[r, h])


U8, U16, U32 = np.dtype(np.uint8), np.dtype(np.uint16), np.dtype(np.uint32)
UNITS: dict[int, LaneUnit] = {u.type.id: u for u in (
    LaneUnit(gt.F32, U32, 16, 16, 1, dense_load, dense_prepare, f32_weight, dense_owner),
    LaneUnit(gt.F16, U16, 16, 16, 1, dense_load, dense_prepare, f16_weight, dense_owner),
    LaneUnit(gt.BF16, U16, 16, 16, 1, dense_load, dense_prepare, bf16_weight, dense_owner),
    LaneUnit(gt.Q8_0, U16, 16, 8, 8, q8_0_load, q8_0_prepare, q8_0_weight, q8_0_owner),
    LaneUnit(gt.Q4_0, U16, 32, 8, 8, q4_0_load, q4_0_prepare, q4_0_weight, q4_0_owner),
    LaneUnit(gt.Q4_1, U16, 32, 16, 16, q4_1_load, q4_1_prepare, q4_1_weight, q4_0_owner),
    LaneUnit(gt.Q5_0, U16, 32, 16, 8, q5_0_load, q5_0_prepare, q5_0_weight, q4_0_owner),
    LaneUnit(gt.Q5_1, U16, 32, 24, 16, q5_1_load, q5_1_prepare, q5_1_weight, q4_0_owner),
    LaneUnit(gt.IQ4_NL, U16, 32, 8, 8, q4_0_load, q4_0_prepare, iq4_nl_weight, q4_0_owner),
    LaneUnit(gt.Q4_K, U32, 32, 8, 4, q4_k_load, kquant_prepare, q4_k_weight, kquant_owner,
             aligned16=True),
    LaneUnit(gt.Q5_K, U32, 32, 12, 4, q5_k_load, q5_k_prepare, q5_k_weight, kquant_owner,
             aligned16=True),
    LaneUnit(gt.Q6_K, U16, 16, 8, 8, q6_k_load, q6_k_prepare, q6_k_weight, q6_k_owner),
    LaneUnit(gt.IQ4_XS, U32, 32, 10, 2, iq4_xs_load, iq4_xs_prepare, iq4_xs_weight, kquant_owner),
    LaneUnit(gt.Q3_K, U16, 32, 11, 2, q3_k_load, q3_k_prepare, q3_k_weight, kquant_owner),
    LaneUnit(gt.Q2_K, U32, 32, 6, 4, q2_k_load, q2_k_prepare, q2_k_weight, kquant_owner),
    LaneUnit(gt.MXFP4, U8, 32, 8, 8, mxfp4_load, mxfp4_prepare, mxfp4_weight, q4_0_owner),
    LaneUnit(gt.IQ3_XXS, U16, 32, 5, 2, iq3_xxs_load, iq3_xxs_prepare, iq3_xxs_weight, kquant_owner),
    LaneUnit(gt.IQ3_S, U16, 32, 5, 2, iq3_s_load, iq3_s_prepare, iq3_s_weight, kquant_owner),
    LaneUnit(gt.IQ2_XXS, U16, 32, 5, 2, iq2_xxs_load, iq2_xxs_prepare, iq2_xxs_weight, kquant_owner),
)}

def check_matvec(wtype: int, w_dev, x_dev, out_dev) -> tuple[LaneUnit, int, int, int]:
    """The unit of a matvec's weight type, and (rows, n, cols), or a HybridError naming what
    does not fit."""
    unit = UNITS.get(int(wtype))
    if unit is None:
        raise HybridError(f"GPU matvec: unsupported tensor type {gt.type_name(int(wtype))}; "
                          f"supported: {', '.join(u.type.name for u in UNITS.values())}")
    if w_dev.dtype != np.uint8 or w_dev.ndim != 2:
        raise HybridError(f"GPU matvec: weights must be a 2-D uint8 device array (rows, row_bytes), "
                          f"got {w_dev.dtype} {w_dev.shape}")
    if x_dev.dtype != np.float32 or x_dev.ndim != 2 or out_dev.dtype != np.float32 or out_dev.ndim != 2:
        raise HybridError("GPU matvec: x and out must be 2-D float32 device arrays (n, cols), (n, rows)")
    rows, row_bytes = w_dev.shape
    n, cols = x_dev.shape
    t = unit.type
    if cols % t.block_elems or t.row_bytes(cols) != row_bytes:
        raise HybridError(f"GPU matvec: {t.name} rows of {row_bytes} bytes do not hold "
                          f"{cols} columns (x has shape {x_dev.shape})")
    if out_dev.shape != (n, rows):
        raise HybridError(f"GPU matvec: out has shape {out_dev.shape}, expected {(n, rows)}")
    if n < 1 or rows < 1:
        raise HybridError("GPU matvec: empty input")
    for name, a in (("weights", w_dev), ("x", x_dev), ("out", out_dev)):
        if not a.is_c_contiguous():
            raise HybridError(f"GPU matvec: {name} must be C-contiguous")
    if unit.aligned16 and not simulated() and w_dev.device_ctypes_pointer.value % 16:
        raise HybridError(f"GPU matvec: {t.name} weights must start on a 16-byte boundary")
    return unit, rows, cols, n

