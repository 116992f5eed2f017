"""Per-type loading and decoding of GGUF weights for the prompt-chunk GEMMs (gpu/gemm.py's float32
kernel and gpu/gemm_mma.py's tensor-core kernel share them).

A "unit" is 16 consecutive weights of one row, inside one K step of 32 columns (one Q8_0/Q4_0
block, one K-quant sub-block): the unit of column `col` (a multiple of 16) is its half
col // 16 % 2 of that step. Per type two device functions:

* `load(w, w8, row, col, cols, raw, p)` issues the loads of unit p (columns col .. col+15 of
  `row`) into raw[p, :] and nothing else: the kernels load the next step's words while they
  multiply this one, and any arithmetic on a loaded value here would wait for DRAM on the spot;
* `store(raw, p, col, cols, ws, at, stride)` decodes them into ws[at + i·stride], i < 16, as
  float32 (unsigned indices: Numba adds a negative-index fix-up to every signed index). Columns
  past the row end (dense types only: their column count need not be a multiple of 32) load
  the last column, in bounds, and store zeros.

Formulas: ../docs/MODEL_FORMAT.md §6 (the same as gpu/quants.py, another split of the work).
`w` is the row-major weight viewed as the type's natural word (the matvec's choice, so the same
alignment rules hold), `w8` the same bytes as uint8.
"""
from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass

import numpy as np
from numba import float32, uint32

from hybrid import ggml_types as gt

from .intrinsics import bits_to_f32, device_function, f16_bits_to_f32, fma, load_u32x4, small_uint_to_f32
from .matvec import SOURCE_STAMP
from .quants import UNITS as LANE_UNITS
from .quants import int8_to_f32, kquant_scale_min, store4

BK = 32            # columns per K step: one 32-weight block or K-quant sub-block
ZERO = float32(0.0)
LOW16 = uint32(0xFFFF)
SIXTEEN = uint32(16)


def _gemm_source_stamp() -> int:
    """Part of every GEMM kernel's cache key (see gpu.matvec._specialise): Numba's disk cache
    only watches the file that defines a kernel, and the GEMM kernels are built from these
    files' device functions too."""
    here = pathlib.Path(__file__).parent
    digest = hashlib.sha256(SOURCE_STAMP.to_bytes(4, "little"))
    for name in ("gemm_units.py", "gemm.py", "gemm_mma.py"):
        digest.update((here / name).read_bytes())
    return int.from_bytes(digest.digest()[:4], "little") >> 1     # >= 0: see the kernels' guard


GEMM_STAMP = _gemm_source_stamp()


@dataclass(frozen=True)
class GemmUnit:
    """How one ggml type's 16-weight units are loaded and decoded (see the module docstring)."""
    type: gt.GGMLType
    raw_words: int
    load: object
    store: object

    @property
    def word(self) -> np.dtype:
        """The dtype `w` is viewed as (the matvec's choice, so the same alignment rules hold)."""
        return LANE_UNITS[self.type.id].word


# ---------------------------------------------------------------- F32 / F16 / BF16
# Any column count: a unit past the row end loads the last column (in bounds) and stores zeros.

@device_function
def dense_load(w, w8, row, col, cols, raw, p):
    for i in range(16):
        raw[p, i] = uint32(w[row, min(col + i, cols - 1)])


@device_function
def f32_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = bits_to_f32(raw[p, i])
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def f16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = f16_bits_to_f32(raw[p, i])
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def bf16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = bits_to_f32(raw[p, i] << SIXTEEN)      # bf16 is the top half of an f32
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


# ---------------------------------------------------------------- Q8_0 (34 B: d, qs[32])
# uint16 words: d at 17·blk, qs bytes 16h .. 16h+15 of half h at 17·blk + 1 + 8h ...

@device_function
def q8_0_load(w, w8, row, col, cols, raw, p):
    base = (col >> 5) * 17
    half = (col >> 4) & 1
    raw[p, 8] = uint32(w[row, base])
    for j in range(8):
        raw[p, j] = uint32(w[row, base + 1 + 8 * half + j])


@device_function
def q8_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    for i in range(16):
        byte = (raw[p, i >> 1] >> uint32(8 * (i & 1))) & uint32(0xFF)
        ws[at + uint32(i) * stride] = d * int8_to_f32(byte)


# ---------------------------------------------------------------- Q4_0 (18 B: d, qs[16])
# Weight i < 16 is the low nibble of qs[i], weight 16 + i its high nibble: half h of the block
# reads all 16 qs bytes (8 uint16 words) and takes nibble h.

@device_function
def q4_0_load(w, w8, row, col, cols, raw, p):
    base = (col >> 5) * 9
    raw[p, 8] = uint32(w[row, base])
    for j in range(8):
        raw[p, j] = uint32(w[row, base + 1 + j])


@device_function
def q4_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        nib = (raw[p, i >> 1] >> (uint32(8 * (i & 1)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = d * small_uint_to_f32(nib, float32(8.0))


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Sub-block j (32 weights) of a block: scale/min j, the qs bytes of chunk c = j // 2 (low
# nibbles for even j, high for odd), Q5_K's fifth bits as bit j of qh bytes 0..31. Unit half h
# takes bytes 16h .. 16h+15 of those: 16-byte aligned, one vector load each. uint32 words.
# raw[p, 0:4] = header (d | dmin << 16, scales[12]); raw[p, 4:8] = qs; Q5_K: raw[p, 8:12] = qh.

@device_function
def q4_k_load(w, w8, row, col, cols, raw, p):
    word0 = (col >> 8) * 36                     # 144 bytes: header 16, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_u32x4(w, row, word0))
    store4(raw, p, 4, load_u32x4(w, row, word0 + 4 + 8 * ((col >> 6) & 3) + 4 * half))


@device_function
def q5_k_load(w, w8, row, col, cols, raw, p):
    word0 = (col >> 8) * 44                     # 176 bytes: header 16, qh 32, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_u32x4(w, row, word0))
    store4(raw, p, 4, load_u32x4(w, row, word0 + 12 + 8 * ((col >> 6) & 3) + 4 * half))
    store4(raw, p, 8, load_u32x4(w, row, word0 + 4 + 4 * half))


@device_function
def kquant_factors(raw, p, j):
    """(d·scale_j, dmin·min_j) of sub-block j from the unit's header words."""
    d = f16_bits_to_f32(raw[p, 0] & LOW16)
    dmin = f16_bits_to_f32(raw[p, 0] >> SIXTEEN)
    sc, mn = kquant_scale_min(raw[p, 1], raw[p, 2], raw[p, 3], j)
    return d * sc, dmin * mn


@device_function
def q4_k_store(raw, p, col, cols, ws, at, stride):
    j = (col >> 5) & 7
    scale, offset = kquant_factors(raw, p, j)
    shift = uint32(4 * (j & 1))
    for i in range(16):
        nib = (raw[p, 4 + (i >> 2)] >> (uint32(8 * (i & 3)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = fma(scale, small_uint_to_f32(nib, ZERO), -offset)


@device_function
def q5_k_store(raw, p, col, cols, ws, at, stride):
    j = (col >> 5) & 7
    scale, offset = kquant_factors(raw, p, j)
    shift = uint32(4 * (j & 1))
    for i in range(16):
        byte_shift = uint32(8 * (i & 3))
        nib = (raw[p, 4 + (i >> 2)] >> (byte_shift + shift)) & uint32(15)
        bit = (raw[p, 8 + (i >> 2)] >> (byte_shift + uint32(j))) & uint32(1)
        ws[at + uint32(i) * stride] = fma(scale, small_uint_to_f32(nib | (bit << uint32(4)), ZERO), -offset)


# ---------------------------------------------------------------- Q6_K (210 B, 2-byte aligned)
# Weight e of a block: half = e // 128, group g = (e % 128) // 32, l = e % 32. Low 4 bits:
# nibble g // 2 of ql[64·half + 32·(g % 2) + l]; high 2 bits: bits 2g of qh[32·half + l];
# scale sc[8·half + l // 16 + 2g] (int8); d the fp16 at byte 208. A unit (16 consecutive l)
# reads 16 ql and 16 qh bytes (8 uint16 words each), one scale byte and d.
# raw[p, 0:8] = ql, raw[p, 8:16] = qh, raw[p, 16] = scale byte | d bits << 16.

@device_function
def q6_k_load(w, w8, row, col, cols, raw, p):
    blk = col >> 8
    e = col & 255
    half = e >> 7
    g = (e >> 5) & 3
    l0 = e & 16
    base = blk * 105                            # in uint16 words
    ql = base + 32 * half + 16 * (g & 1) + (l0 >> 1)
    qh = base + 64 + 16 * half + (l0 >> 1)
    for j in range(8):
        raw[p, j] = uint32(w[row, ql + j])
        raw[p, 8 + j] = uint32(w[row, qh + j])
    scale = uint32(w8[row, blk * 210 + 192 + 8 * half + (l0 >> 4) + 2 * g])
    raw[p, 16] = scale | (uint32(w[row, base + 104]) << SIXTEEN)


@device_function
def q6_k_store(raw, p, col, cols, ws, at, stride):
    g = (col >> 5) & 3
    factor = f16_bits_to_f32(raw[p, 16] >> SIXTEEN) * int8_to_f32(raw[p, 16] & uint32(0xFF))
    low_shift = uint32(4 * (g >> 1))
    high_shift = uint32(2 * g)
    for i in range(16):
        byte_shift = uint32(8 * (i & 1))
        low = (raw[p, i >> 1] >> (byte_shift + low_shift)) & uint32(15)
        high = (raw[p, 8 + (i >> 1)] >> (byte_shift + high_shift)) & uint32(3)
        ws[at + uint32(i) * stride] = factor * small_uint_to_f32(low | (high << uint32(4)), float32(32.0))


UNITS: dict[int, GemmUnit] = {u.type.id: u for u in (
    GemmUnit(gt.F32, 16, dense_load, f32_store),
    GemmUnit(gt.F16, 16, dense_load, f16_store),
    GemmUnit(gt.BF16, 16, dense_load, bf16_store),
    GemmUnit(gt.Q8_0, 9, q8_0_load, q8_0_store),
    GemmUnit(gt.Q4_0, 9, q4_0_load, q4_0_store),
    GemmUnit(gt.Q4_K, 8, q4_k_load, q4_k_store),
    GemmUnit(gt.Q5_K, 12, q5_k_load, q5_k_store),
    GemmUnit(gt.Q6_K, 17, q6_k_load, q6_k_store),
)}
