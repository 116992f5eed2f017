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
from cpu.blocks import IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID
from cpu.errors import HybridError
from cpu.simd import IQ4NL_KVALUES, MXFP4_KVALUES

from ..runtime.device import simulated
from ..intrinsics import (bits_to_f32, byte_perm, device_function, device_table, f16_bits_to_f32, fma, load_u32x4,
                         shr_u32, small_uint_to_f32)

ZERO = float32(0.0)
LOW16 = uint32(0xFFFF)
LOW8 = uint32(0xFF)
FOUR = uint32(4)
EIGHT = uint32(8)
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
# packed four to a word: word k holds entries 4k..4k+3, so that the two halves w1:w0 (entries 0..7)
# and w3:w2 (8..15) are each one 8-byte PRMT source, and a lookup is byte permutes in registers
# (no table in memory, no per-lane divergent reads).
def _packed_table(values) -> tuple:
    return tuple(uint32(v) for v in np.array(values, np.int8).view(np.uint32))


IQ4_NL_W0, IQ4_NL_W1, IQ4_NL_W2, IQ4_NL_W3 = _packed_table(IQ4NL_KVALUES)
MXFP4_W0, MXFP4_W1, MXFP4_W2, MXFP4_W3 = _packed_table(MXFP4_KVALUES)


@device_function
def table_byte(n, w0, w1, w2, w3):
    """Entry n (0..15) of a packed table as a byte (uint32 0..255, two's complement): entry n & 7
    of each half, then the half bit 3 of n picks (selector 0 or 4: byte 0 of the first or the
    second permute)."""
    low = byte_perm(w0, w1, n)
    high = byte_perm(w2, w3, n)
    return byte_perm(low, high, (n >> uint32(1)) & FOUR) & LOW8


@device_function
def table_bytes(v, w0, w1, w2, w3):
    """(low, high): the table bytes of the low nibbles of v's four bytes, and of their high
    nibbles, each a word (byte k from byte k of v). A selector nibble of PRMT picks by its low
    3 bits, so each permute of a half looks up four of v's nibbles at once; a third permute takes
    each byte from the half that the nibble's bit 3 names."""
    halves = ((v & uint32(0x88888888)) >> uint32(1)) | uint32(0x32103210)   # nibble k: k, or k + 4
    # a: the entries of v's nibbles 0..3 (byte 0 low, high, byte 1 low, high); b: of nibbles 4..7
    a = byte_perm(byte_perm(w0, w1, v), byte_perm(w2, w3, v), halves)
    up = v >> SIXTEEN
    b = byte_perm(byte_perm(w0, w1, up), byte_perm(w2, w3, up), halves >> SIXTEEN)
    return byte_perm(a, b, uint32(0x6420)), byte_perm(a, b, uint32(0x7531))


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


# ---------------------------------------------------------------- IQ grid types (256 per block)
# IQ2_XS, IQ2_S, IQ1_S, IQ1_M: each 8 weights are one entry of a grid of 8-byte rows (cpu.blocks
# owns the grids; here their bytes, int8, two uint32 words per row), signed (IQ2) or shifted by a
# delta (IQ1), times a scale per 16 weights (IQ1_S: per 32). All three GPU paths (float lanes here,
# gpu/matmul/quants_q8.py, gpu/matmul/gemm_units.py) turn a group of 16 weights into four words of
# int8 values v and a factor f (weight = f·v):
# IQ2: v = ±grid, f = d·(sc + 1/2)/4 = d·(2sc + 1)·⅛; IQ1: v = 8·grid ± 1 (the delta ±⅛ times 8),
# f = d·(2sc + 1)·⅛. Both products are the CPU decoder's real value scaled by a power of two,
# so they round to its bits.
# The grids live in global memory, one __device__ array per grid and kernel read through L1
# (`device_table` says why not __constant__ space); each unit's prepare (GEMM: store) takes its
# grid's array (`*_grid()`) once and hands it to the helpers below.
IQ2XS_GRID_WORDS = np.ascontiguousarray(IQ2XS_GRID.astype(np.uint8)).view(np.uint32).ravel()  # 8, 25, 43
IQ2S_GRID_WORDS = np.ascontiguousarray(IQ2S_GRID.astype(np.uint8)).view(np.uint32).ravel()
IQ1S_GRID_WORDS = np.ascontiguousarray(IQ1S_GRID.astype(np.int8)).view(np.uint32).ravel()   # −1, 0, 1 (IQ1_M too)
iq2xs_grid = device_table("hybrid_iq2xs_grid", IQ2XS_GRID_WORDS)
iq2s_grid = device_table("hybrid_iq2s_grid", IQ2S_GRID_WORDS)
iq1s_grid = device_table("hybrid_iq1s_grid", IQ1S_GRID_WORDS)
EIGHTH = float32(0.125)
BYTE_ONES = uint32(0x01010101)
LOW7 = uint32(0x7F7F7F7F)
TOP_BITS = uint32(0x80808080)
ALL_BITS = uint32(0xFFFFFFFF)
SPREAD4 = uint32(0x00204081)   # × a 4-bit field: bit b to bit 8b (b + 7b; no two partial products meet)


@device_function
def signed_bytes(g, signs):
    """The four grid bytes of g (each 1..127) negated where bits 0..3 of signs are set: −v =
    (v ^ 0xFF) + 1 in each byte, no carries since v ≥ 1."""
    ones = ((signs & uint32(15)) * SPREAD4) & BYTE_ONES
    return (g ^ (ones * uint32(0xFF))) + ones


@device_function
def iq2_entry(grid, g, signs):
    """Grid row g's 8 values with the signs of bits 0..7 of signs, as two int8 words."""
    return (signed_bytes(grid[g << uint32(1)], signs),
            signed_bytes(grid[(g << uint32(1)) | uint32(1)], signs >> uint32(4)))


@device_function
def ksigns(s7):
    """An IQ2 7-bit sign field to its 8 sign bits: bit 7 makes the count of minus signs even
    (the rule cpu.simd's KSIGNS tabulates; computed here instead of a per-lane table lookup)."""
    par = s7 ^ (s7 >> uint32(4))
    par ^= par >> uint32(2)
    par ^= par >> uint32(1)
    return s7 | ((par & uint32(1)) << uint32(7))


@device_function
def iq2_xs_words(grid, e):
    """Two IQ2_XS qs entries (e = entry | next << 16: 9-bit grid index, 7-bit signs) as 4 words;
    grid = iq2xs_grid()."""
    a0, a1 = iq2_entry(grid, e & uint32(511), ksigns((e >> uint32(9)) & uint32(127)))
    b0, b1 = iq2_entry(grid, (e >> SIXTEEN) & uint32(511), ksigns(e >> uint32(25)))
    return a0, a1, b0, b1


@device_function
def iq2_s_words(grid, qs, signs, qh):
    """Two IQ2_S entries: qs, signs = their low index bytes and sign bytes (bits 0..15), qh their
    2-bit index tops (bits 0..3), as 4 words; grid = iq2s_grid()."""
    g0 = (qs & LOW8) | ((qh & uint32(3)) << EIGHT)
    g1 = ((qs >> EIGHT) & LOW8) | (((qh >> uint32(2)) & uint32(3)) << EIGHT)
    a0, a1 = iq2_entry(grid, g0, signs)
    b0, b1 = iq2_entry(grid, g1, signs >> EIGHT)
    return a0, a1, b0, b1


@device_function
def add_bytes(a, b):
    """a + b in each byte, mod 256 (no carries between bytes)."""
    return ((a & LOW7) + (b & LOW7)) ^ ((a ^ b) & TOP_BITS)


@device_function
def iq1_entry(grid, g, negative):
    """8·(grid row g) ± 1 (− where negative is all ones, + where 0) as two int8 words; 8·v is
    (v & 31) << 3 in each byte (v ∈ {−1, 0, 1}: 0xFF & 31 = 31, 31·8 = 0xF8 = −8)."""
    delta = negative | BYTE_ONES
    a = (grid[g << uint32(1)] & uint32(0x1F1F1F1F)) << uint32(3)
    b = (grid[(g << uint32(1)) | uint32(1)] & uint32(0x1F1F1F1F)) << uint32(3)
    return add_bytes(a, delta), add_bytes(b, delta)


@device_function
def iq1_s_words(grid, qs, qh, first):
    """Entries first, first + 1 of an IQ1_S sub-block: qs = their low index bytes (bits 0..15),
    qh = the sub-block's u16 (3 index bits per entry, bit 15 the delta's sign), as 4 words;
    grid = iq1s_grid()."""
    negative = ((qh >> uint32(15)) & uint32(1)) * ALL_BITS
    g0 = (qs & LOW8) | ((shr_u32(qh, uint32(3 * first)) & uint32(7)) << EIGHT)
    g1 = ((qs >> EIGHT) & LOW8) | ((shr_u32(qh, uint32(3 * first + 3)) & uint32(7)) << EIGHT)
    a0, a1 = iq1_entry(grid, g0, negative)
    b0, b1 = iq1_entry(grid, g1, negative)
    return a0, a1, b0, b1


@device_function
def iq1_m_words(grid, qs, qh):
    """Two IQ1_M entries: qs = their low index bytes (bits 0..15), qh = their nibbles (bits 0..7:
    3 index bits, then the delta's sign), as 4 words; grid = iq1s_grid()."""
    g0 = (qs & LOW8) | ((qh & uint32(7)) << EIGHT)
    g1 = ((qs >> EIGHT) & LOW8) | (((qh >> uint32(4)) & uint32(7)) << EIGHT)
    a0, a1 = iq1_entry(grid, g0, ((qh >> uint32(3)) & uint32(1)) * ALL_BITS)
    b0, b1 = iq1_entry(grid, g1, ((qh >> uint32(7)) & uint32(1)) * ALL_BITS)
    return a0, a1, b0, b1


@device_function
def iq1_m_d(s01, s23):
    """IQ1_M's fp16 d, in the top nibbles of its four u16 scales (s01 = scales 0 | 1 << 16, s23)."""
    return (((s01 >> uint32(12)) & uint32(0xF)) | ((s01 >> uint32(24)) & uint32(0xF0))
            | ((s23 >> uint32(4)) & uint32(0xF00)) | ((s23 >> SIXTEEN) & uint32(0xF000)))


@device_function
def odd_scale(d, sc):
    """d·(2sc + 1)·⅛ for a 3- or 4-bit field sc (the low bits of sc; IQ2: d·(sc + ½)/4)."""
    return (d * small_uint_to_f32(((sc & uint32(15)) << uint32(1)) | uint32(1), ZERO)) * EIGHTH


@device_function
def grid_value(raw, r, i):
    """Byte i of raw[r, 0:8] (the lane's int8 values) as float32."""
    return int8_to_f32((raw[r, i >> 2] >> uint32(8 * (i & 3))) & LOW8)


# Float lanes: kquant_owner's split, weights i < 16 the group of 16 G0 = 4c + hh, i ≥ 16 the group
# G1 = 4c + 2 + hh (c = chunk, hh = half of the lane). prepare turns the loaded words into the
# two groups' int8 values, raw[r, 0:4] and raw[r, 4:8]; fac = their factors.
# IQ2_XS (74 B: d, qs[32] u16, scales[8]; uint16 words): group G = entries 2G, 2G + 1, scale
# nibble G % 2 of scales[G // 2]. raw = entries of G0 | of G1 | scales[2c .. 2c + 1] | d.

@device_function
def iq2_xs_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 37
    first = base + 1 + 8 * c + 2 * (lane & 1)
    for h in range(2):
        raw[r, h] = uint32(w[row, first + 4 * h]) | (uint32(w[row, first + 4 * h + 1]) << SIXTEEN)
    raw[r, 2] = uint32(w[row, base + 33 + c])
    raw[r, 3] = uint32(w[row, base])


@device_function
def iq2_xs_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    hh = uint32(lane & 1)
    e0, e1, sc = raw[r, 0], raw[r, 1], raw[r, 2]
    d = f16_or_zero(raw[r, 3], live)
    grid = iq2xs_grid()
    store4(raw, r, 0, iq2_xs_words(grid, e0))
    store4(raw, r, 4, iq2_xs_words(grid, e1))
    fac[r, 0] = odd_scale(d, shr_u32(sc, hh << uint32(2)))
    fac[r, 1] = odd_scale(d, shr_u32(sc, (hh + uint32(2)) << uint32(2)))


@device_function
def grid_weight(raw, fac, r, i, lane):
    return fac[r, i >> 4] * grid_value(raw, r, i)


# IQ2_S (82 B: d, qs[32], signs[32], qh[8], scales[8]; uint16 words): entry k = qs[k] | 2 bits
# 2(k % 4) of qh[k // 4] << 8, signs[k]. raw = qs of G0 | of G1 << 16, their signs likewise,
# qh[2c .. 2c + 1] | scales[2c .. 2c + 1] << 16, d.

@device_function
def iq2_s_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 41
    g0 = 4 * c + (lane & 1)
    raw[r, 0] = uint32(w[row, base + 1 + g0]) | (uint32(w[row, base + 3 + g0]) << SIXTEEN)
    raw[r, 1] = uint32(w[row, base + 17 + g0]) | (uint32(w[row, base + 19 + g0]) << SIXTEEN)
    raw[r, 2] = uint32(w[row, base + 33 + c]) | (uint32(w[row, base + 37 + c]) << SIXTEEN)
    raw[r, 3] = uint32(w[row, base])


@device_function
def iq2_s_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    hh = uint32(lane & 1)
    qs, signs, hs = raw[r, 0], raw[r, 1], raw[r, 2]
    d = f16_or_zero(raw[r, 3], live)
    grid = iq2s_grid()
    for h in range(2):  # G0 (qh byte 0 of hs), G1 (byte 1); entries 2(G % 2) + 0, 1 of that byte
        store4(raw, r, 4 * h, iq2_s_words(grid, shr_u32(qs, uint32(16 * h)), shr_u32(signs, uint32(16 * h)),
                                          shr_u32(hs, uint32(8 * h) + (hh << uint32(2)))))
        fac[r, h] = odd_scale(d, shr_u32(hs >> SIXTEEN, (hh + uint32(2 * h)) << uint32(2)))


# IQ1_S (50 B: d, qs[32], qh[8] u16; uint16 words): sub-block ib = G // 2 has qh[ib], G its
# entries 2(G % 2), + 1. raw = qs of G0 | of G1 << 16, qh[2c] | qh[2c + 1] << 16, d.

@device_function
def iq1_s_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 25
    g0 = 4 * c + (lane & 1)
    raw[r, 0] = uint32(w[row, base + 1 + g0]) | (uint32(w[row, base + 3 + g0]) << SIXTEEN)
    raw[r, 1] = uint32(w[row, base + 17 + 2 * c]) | (uint32(w[row, base + 18 + 2 * c]) << SIXTEEN)
    raw[r, 2] = uint32(w[row, base])


@device_function
def iq1_s_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    qs, qh2 = raw[r, 0], raw[r, 1]
    d = f16_or_zero(raw[r, 2], live)
    first = 2 * (lane & 1)
    grid = iq1s_grid()
    for h in range(2):
        qh = shr_u32(qh2, uint32(16 * h)) & LOW16
        store4(raw, r, 4 * h, iq1_s_words(grid, shr_u32(qs, uint32(16 * h)), qh, first))
        fac[r, h] = odd_scale(d, (qh >> uint32(12)) & uint32(7))


# IQ1_M (56 B: qs[32], qh[16], scales[4] u16; uint16 words): entry k = qs[k] | nibble k % 2 of
# qh[k // 2] (3 index bits, the delta's sign); group G's scale 3 bits 3(G % 4) of scales[G // 4],
# d in the scales' top nibbles. raw = qs of G0 | of G1 << 16, qh[4c .. 4c + 3] (G0's byte hh,
# G1's 2 + hh), scales 0 | 1 << 16, 2 | 3 << 16.

@device_function
def iq1_m_load(w, w8, row, col0, cols, lane, raw, r):
    blk, _ = kquant_block(col0, lane, cols)
    c = (lane & 7) >> 1
    base = blk * 28
    g0 = 4 * c + (lane & 1)
    raw[r, 0] = uint32(w[row, base + g0]) | (uint32(w[row, base + 2 + g0]) << SIXTEEN)
    raw[r, 1] = uint32(w[row, base + 16 + 2 * c]) | (uint32(w[row, base + 17 + 2 * c]) << SIXTEEN)
    raw[r, 2] = uint32(w[row, base + 24]) | (uint32(w[row, base + 25]) << SIXTEEN)
    raw[r, 3] = uint32(w[row, base + 26]) | (uint32(w[row, base + 27]) << SIXTEEN)


@device_function
def iq1_m_prepare(raw, fac, r, col0, cols, lane):
    _, live = kquant_block(col0, lane, cols)
    c = uint32((lane & 7) >> 1)
    hh = uint32(lane & 1)
    qs, qh, s01, s23 = raw[r, 0], raw[r, 1], raw[r, 2], raw[r, 3]
    d = f16_or_zero(iq1_m_d(s01, s23), live)
    scales = shr_u32(s23 if c >= uint32(2) else s01, (c & uint32(1)) << uint32(4))
    grid = iq1s_grid()
    for h in range(2):
        store4(raw, r, 4 * h, iq1_m_words(grid, shr_u32(qs, uint32(16 * h)),
                                          shr_u32(qh, uint32(16 * h) + (hh << uint32(3)))))
        fac[r, h] = odd_scale(d, shr_u32(scales, uint32(3) * (hh + uint32(2 * h))) & uint32(7))


# IQ3_XXS, IQ3_S, IQ2_XXS: grid rows of positive values (IQ3: 4 bytes, one word; IQ2_XXS: 8 bytes,
# two words), each weight with its own sign. All three GPU paths take 16 weights at a time (half
# hh of a 32-weight sub-block ib) as four int8 words, as for the types above (grids in global
# memory, taken once per prepare/store), and the sub-block's scale as their factor.
IQ3XXS_GRID_WORDS = np.ascontiguousarray(IQ3XXS_GRID.astype(np.uint8)).view(np.uint32).ravel()   # 4..62
IQ3S_GRID_WORDS = np.ascontiguousarray(IQ3S_GRID.astype(np.uint8)).view(np.uint32).ravel()       # odd 1..15
IQ2XXS_GRID_WORDS = np.ascontiguousarray(IQ2XXS_GRID.astype(np.uint8)).view(np.uint32).ravel()   # 8, 25, 43
iq3xxs_grid = device_table("hybrid_iq3xxs_grid", IQ3XXS_GRID_WORDS)
iq3s_grid = device_table("hybrid_iq3s_grid", IQ3S_GRID_WORDS)
iq2xxs_grid = device_table("hybrid_iq2xxs_grid", IQ2XXS_GRID_WORDS)


@device_function
def sign_pair(aux, first):
    """The 16 sign bits of the 7-bit sign fields first, first + 1 of aux (IQ3_XXS, IQ2_XXS)."""
    return ksigns(shr_u32(aux, uint32(7 * first)) & uint32(127)) | (
        ksigns(shr_u32(aux, uint32(7 * first + 7)) & uint32(127)) << EIGHT)


@device_function
def iq3_xxs_words(grid, qs, aux, first):
    """16 weights of an IQ3_XXS sub-block: qs = their 4 grid bytes, aux = the sub-block's u32 (sign
    fields first, first + 1 theirs), as 4 words; grid = iq3xxs_grid()."""
    signs = sign_pair(aux, first)
    return (signed_bytes(grid[qs & LOW8], signs), signed_bytes(grid[(qs >> EIGHT) & LOW8], signs >> uint32(4)),
            signed_bytes(grid[(qs >> SIXTEEN) & LOW8], signs >> EIGHT),
            signed_bytes(grid[qs >> uint32(24)], signs >> uint32(12)))


@device_function
def iq2_xxs_words(grid, qs, aux, first):
    """16 weights of an IQ2_XXS sub-block: its entries first, first + 1 (bytes of qs, the
    sub-block's grid u32) with sign fields first, first + 1 of aux, as 4 words; grid =
    iq2xxs_grid()."""
    signs = sign_pair(aux, first)
    a0, a1 = iq2_entry(grid, shr_u32(qs, uint32(8 * first)) & LOW8, signs)
    b0, b1 = iq2_entry(grid, shr_u32(qs, uint32(8 * first + 8)) & LOW8, signs >> EIGHT)
    return a0, a1, b0, b1


@device_function
def iq3_s_words(grid, qs, qh, signs):
    """16 IQ3_S weights: qs = their 4 low index bytes, qh = the 9th index bits (bits 0..3), signs a
    bit per weight (bits 0..15), as 4 words; grid = iq3s_grid()."""
    w0 = signed_bytes(grid[(qs & LOW8) | ((qh & uint32(1)) << EIGHT)], signs)
    w1 = signed_bytes(grid[((qs >> EIGHT) & LOW8) | (((qh >> uint32(1)) & uint32(1)) << EIGHT)], signs >> uint32(4))
    w2 = signed_bytes(grid[((qs >> SIXTEEN) & LOW8) | (((qh >> uint32(2)) & uint32(1)) << EIGHT)], signs >> EIGHT)
    w3 = signed_bytes(grid[(qs >> uint32(24)) | (((qh >> uint32(3)) & uint32(1)) << EIGHT)], signs >> uint32(12))
    return w0, w1, w2, w3


@device_function
def iq3_xxs_scale(d, aux):
    """IQ3_XXS's sub-block scale d·(s + ½)/2, s = aux >> 28 (odd_scale's d·(2s + 1)/8, times 2)."""
    return odd_scale(d, aux >> uint32(28)) * float32(2.0)


@device_function
def iq3_s_scale(d, sc):
    """IQ3_S's sub-block scale d·(2sc + 1) for the 4-bit field sc (the low bits of sc)."""
    return d * small_uint_to_f32(((sc & uint32(15)) << uint32(1)) | uint32(1), ZERO)


# Float lanes: kquant_owner's split as above, G0 = half hh of sub-block 2c (weights i < 16), G1 =
# half hh of sub-block 2c + 1 (uint16 words). Loaded: raw[r, 2h] = the 4 grid bytes or qs bytes of
# sub-block 2c + h (IQ2_XXS: all 4 of the sub-block), raw[r, 2h + 1] = its aux (IQ3_S: its sign
# bytes 4ib + 2hh, + 1 | the qh word holding qh[ib] << 16), raw[r, 4] = d (IQ3_S: | the scales
# word holding scales[c] << 16).
# IQ3_XXS (98 B: d, qs[64] a grid byte per 4 weights, aux u32 per sub-block: 4 × 7-bit sign fields
# and a 4-bit scale on top). IQ2_XXS (66 B: d, per sub-block a u32 of 4 grid bytes (8 weights
# each) and an aux u32 as IQ3_XXS's). IQ3_S (110 B: d, qs[64] the low 8 bits of a grid index per 4
# weights, qh[8] their 9th bits (bit k % 8 of qh[k // 8]), signs[32] a bit per weight, scales[4] a
# nibble per sub-block).

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
    qs0, aux0, qs1, aux1 = raw[r, 0], raw[r, 1], raw[r, 2], raw[r, 3]
    d = f16_or_zero(raw[r, 4], live)
    first = 2 * (lane & 1)
    grid = iq3xxs_grid()
    store4(raw, r, 0, iq3_xxs_words(grid, qs0, aux0, first))
    store4(raw, r, 4, iq3_xxs_words(grid, qs1, aux1, first))
    fac[r, 0] = iq3_xxs_scale(d, aux0)
    fac[r, 1] = iq3_xxs_scale(d, aux1)


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
    qs0, aux0, qs1, aux1 = raw[r, 0], raw[r, 1], raw[r, 2], raw[r, 3]
    d = f16_or_zero(raw[r, 4], live)
    first = 2 * (lane & 1)
    grid = iq2xxs_grid()
    store4(raw, r, 0, iq2_xxs_words(grid, qs0, aux0, first))
    store4(raw, r, 4, iq2_xxs_words(grid, qs1, aux1, first))
    fac[r, 0] = odd_scale(d, aux0 >> uint32(28))
    fac[r, 1] = odd_scale(d, aux1 >> uint32(28))


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
    qs0, v0, qs1, v1, dsc = raw[r, 0], raw[r, 1], raw[r, 2], raw[r, 3], raw[r, 4]
    d = f16_or_zero(dsc, live)
    scales = shr_u32(dsc >> SIXTEEN, (c & uint32(1)) << uint32(3))        # scales[c]: sub-blocks 2c, 2c + 1
    grid = iq3s_grid()
    # qh[ib] is byte ib % 2 = h of its word; this half's 9th bits are its bits 4hh .. 4hh + 3
    store4(raw, r, 0, iq3_s_words(grid, qs0, shr_u32(v0 >> SIXTEEN, hh << uint32(2)), v0 & LOW16))
    store4(raw, r, 4, iq3_s_words(grid, qs1, shr_u32(v1 >> SIXTEEN, uint32(8) + (hh << uint32(2))), v1 & LOW16))
    fac[r, 0] = iq3_s_scale(d, scales)
    fac[r, 1] = iq3_s_scale(d, scales >> uint32(4))


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
    LaneUnit(gt.IQ2_XS, U16, 32, 8, 2, iq2_xs_load, iq2_xs_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.IQ2_S, U16, 32, 8, 2, iq2_s_load, iq2_s_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.IQ1_S, U16, 32, 8, 2, iq1_s_load, iq1_s_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.IQ1_M, U16, 32, 8, 2, iq1_m_load, iq1_m_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.MXFP4, U8, 32, 8, 8, mxfp4_load, mxfp4_prepare, mxfp4_weight, q4_0_owner),
    LaneUnit(gt.IQ3_XXS, U16, 32, 8, 2, iq3_xxs_load, iq3_xxs_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.IQ3_S, U16, 32, 8, 2, iq3_s_load, iq3_s_prepare, grid_weight, kquant_owner),
    LaneUnit(gt.IQ2_XXS, U16, 32, 8, 2, iq2_xxs_load, iq2_xxs_prepare, grid_weight, kquant_owner),
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

