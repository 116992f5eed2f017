"""Per-type loading and decoding of GGUF weights for the prompt-chunk GEMMs (gpu/matmul/gemm.py's float32
kernel and gpu/matmul/gemm_mma.py's tensor-core kernel share them).

A "unit" is 16 consecutive weights of one row, half of a 32-column block (one 32-weight
block, one K-quant sub-block): the unit of column `col` (a multiple of 16) is its half
col // 16 % 2 of that block. The float32 kernel decodes a row's two units of a K step into
shared memory, the tensor-core kernel one unit per lane straight into its registers. Per type
two device functions:

* `load(w, w8, col, cols, raw, p)` issues the loads of unit p (columns col .. col+15 of the
  row whose views w, w8 are) into raw[p, :] and nothing else: the kernels load the next step's
  words while they multiply this one, and any arithmetic on a loaded value here would wait for
  DRAM on the spot. (Row views, made once per row, keep the row's address arithmetic out of
  the kernels' loops.)
* `store(raw, p, col, cols, ws, at, stride)` decodes them into ws[at + i·stride], i < 16, as
  float32 (unsigned indices: Numba adds a negative-index fix-up to every signed index). Columns
  past the row end (dense types only: their column count need not be a multiple of 32) load
  the last column, in bounds, and store zeros.

Formulas: docs/MODEL_FORMAT.md §6 (the same as gpu/matmul/quants.py, another split of the work).
`w` is a weight row viewed as the type's natural word (the matvec's choice, so the same
alignment rules hold), `w8` the same bytes as uint8.
"""
from __future__ import annotations

import hashlib
import pathlib
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from cpu import ggml_types as gt

from ..runtime.device import simulated
from ..intrinsics import (MAGIC, MAGIC_F, bits_to_f32, device_function, f16_bits_to_f32, fma,
                         load_row_u32x4, shr_u32, small_uint_to_f32)
from .kernel_source import SOURCE_STAMP
from .quants import UNITS as LANE_UNITS
from .quants import (e8m0_half, grid_value, int8_to_f32, iq1_m_d, iq1_m_words, iq1_s_words, iq1s_grid, iq2_s_words,
                     iq2_xs_words, iq2_xxs_words, iq2s_grid, iq2xs_grid, iq2xxs_grid, iq3_s_scale, iq3_s_words,
                     iq3_xxs_scale, iq3_xxs_words, iq3s_grid, iq3xxs_grid, iq4_nl_byte, mxfp4_byte, odd_scale, store4)

BK = 32            # columns per K step of the float32 kernel: one 32-weight block or K-quant sub-block
ZERO = float32(0.0)
LOW16 = uint32(0xFFFF)
SIXTEEN = uint32(16)


# ---------------------------------------------------------------- bit tricks for the decoders
# (gpu/intrinsics.py belongs to the matvec; these few serve only the GEMM units.)
#
# The K-quant decoders turn a small integer v into float32 without I2F (a quarter-rate
# instruction): OR-ing it into the mantissa of 2^23 (MAGIC) gives exactly 2^23 + v, and one
# subtraction gives v. A 4-bit field need not be shifted down first: at bit 8b (b < 3) the OR
# gives 2^23 + v·2^(8b), still exact, and the decoder scales by scale·2^(-8b) instead, also
# exact (a power of two), so the product and its rounding are those of scale·v. Masking and
# OR-ing are one three-input LOP3 when both constants sit in registers: `and_or` forces that
# (ptxas takes only one immediate per LOP3 and would otherwise split it in two).

if not simulated():
    from llvmlite import ir
    from numba import types
    from numba.cuda.extending import intrinsic

    from ..intrinsics import asm_u32x3

    _and_or = asm_u32x3("lop3.b32 $0, $1, $2, $3, 0xea;")                # (a & b) | c
    _bit_select = asm_u32x3("lop3.b32 $0, $1, $2, $3, 0xe4;")            # (a & c) | (b & ~c)
    _funnel_right = asm_u32x3("shf.r.wrap.b32 $0, $1, $2, $3;")          # (hi:lo) >> n, low word

    def _aligned_words(count: int):
        @intrinsic
        def load(typingctx, array, col):
            """The `count` aligned 4-byte words from the one holding byte &array[col] on (1-D
            uint8 array, any alignment), and 8 · (that address % 4): loads only, so that the
            shift waits for nothing."""
            if not (isinstance(array, types.Array) and array.dtype == types.uint8 and array.ndim == 1):
                return None
            sig = types.UniTuple(types.uint32, count + 1)(array, col)

            def codegen(context, builder, sig, args):
                aryty, colty = sig.args
                arystruct = context.make_array(aryty)(context, builder, value=args[0])
                ptr = builder.gep(arystruct.data, [context.cast(builder, args[1], colty, types.intp)])
                i32, i64 = ir.IntType(32), ir.IntType(64)
                addr = builder.ptrtoint(ptr, i64)
                first = builder.and_(addr, ir.Constant(i64, ~3))
                # one asm block, so that the consecutive words use immediate offsets
                text = "\n\t".join(f"ld.global.nc.u32 ${k}, [${count}+{4 * k}];" for k in range(count))
                returned = ir.LiteralStructType([i32] * count) if count > 1 else i32   # (LLVM: no 1-tuples)
                load = ir.InlineAsm(ir.FunctionType(returned, [i64]), text, ",".join(["=r"] * count + ["l"]))
                loaded = builder.call(load, [first])
                shift = builder.trunc(builder.shl(builder.and_(addr, ir.Constant(i64, 3)), ir.Constant(i64, 3)), i32)
                words = [builder.extract_value(loaded, k) for k in range(count)] if count > 1 else [loaded]
                return context.make_tuple(builder, sig.return_type, words + [shift])

            return sig, codegen
        return load

    _five_words = _aligned_words(5)
    _one_word = _aligned_words(1)

    @cuda.jit(device=True, inline=True)
    def and_or(a, mask, bits):
        """(a & mask) | bits in one LOP3."""
        return _and_or(a, mask, bits)

    @cuda.jit(device=True, inline=True)
    def bit_select(a, b, mask):
        """a's bits where mask is 1, b's where it is 0, in one LOP3."""
        return _bit_select(a, b, mask)

    @cuda.jit(device=True, inline=True)
    def funnel_right(lo, hi, n):
        """The low word of (hi:lo) >> n, n < 32: a word starting n bits into lo."""
        return _funnel_right(lo, hi, n)

    @cuda.jit(device=True, inline=True)
    def load_five_words(array8, col):
        """(w0..w4, shift): the five aligned words from the one holding byte array8[col] (1-D
        uint8; the 20 bytes from there must be readable); funnel_right(w_k, w_k+1, shift) is
        then word k of the 16 bytes at array8[col]."""
        return _five_words(array8, col)

    @cuda.jit(device=True, inline=True)
    def load_word(array8, col):
        """The 4 bytes at array8[col] (1-D uint8) as a little-endian word; 4-byte aligned."""
        return _one_word(array8, col)[0]

else:

    def _u32(v):
        return np.uint32(int(v) & 0xFFFFFFFF)

    def and_or(a, mask, bits):
        return _u32((int(a) & int(mask)) | int(bits))

    def bit_select(a, b, mask):
        return _u32((int(a) & int(mask)) | (int(b) & ~int(mask)))

    def funnel_right(lo, hi, n):
        return _u32(((int(hi) << 32) | int(lo)) >> int(n))

    def load_five_words(array8, col):
        # a row view: where its bytes sit in a word is where they sit in the whole array, whose
        # start the real allocator aligns (and the simulator's need not: offsets count from it)
        base = array8.base if array8.base is not None else array8
        at = int(col) + (array8.__array_interface__["data"][0] - base.__array_interface__["data"][0])
        flat = base.reshape(-1)
        first = at & ~3
        words = [_u32(int.from_bytes(bytes(flat[first + 4 * k:first + 4 * k + 4]).ljust(4, b"\0"), "little"))
                 for k in range(5)]
        return (*words, np.uint32(8 * (at & 3)))

    def load_word(array8, col):
        words = load_five_words(array8, col)
        assert words[5] == 0, "word load must be 4-byte aligned"
        return words[0]


def _gemm_source_stamp() -> int:
    """Part of every GEMM kernel's cache key (see gpu.matmul.kernel_source.specialise): Numba's disk cache
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
# F32: raw[p, i] = the bits of weight i (16 words: on the 4-warp tensor-core tiles ptxas
# spills a few of them, a path F32 weights take only when a caller names the tile, see
# gpu.matmul.gemm.precision_for). F16 / BF16: raw[p, m] = weights 2m and 2m + 1 (low half first), one
# aligned 4-byte load each when the rows hold an even number of columns (so every row starts
# 4-byte aligned), else two 2-byte loads joined.

@device_function
def dense_load(w, w8, col, cols, raw, p):
    for i in range(16):
        raw[p, i] = uint32(w[min(col + i, cols - 1)])


@device_function
def dense16_load(w, w8, col, cols, raw, p):
    if cols & 1 == 0:
        for m in range(8):
            raw[p, m] = load_word(w8, 2 * min(col + 2 * m, cols - 2))
    else:
        for m in range(8):
            low = uint32(w[min(col + 2 * m, cols - 1)])
            raw[p, m] = low | (uint32(w[min(col + 2 * m + 1, cols - 1)]) << SIXTEEN)


@device_function
def f32_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = bits_to_f32(raw[p, i])
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def f16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = f16_bits_to_f32(raw[p, i >> 1] >> uint32(16 * (i & 1)))
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def bf16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        word = raw[p, i >> 1]
        bits = word & uint32(0xFFFF0000) if i & 1 else word << SIXTEEN    # bf16 is the top half of an f32
        value = bits_to_f32(bits)
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


# ---------------------------------------------------------------- Q8_0 (34 B: d, qs[32])
# uint16 words: d at 17·blk, qs bytes 16h .. 16h+15 of half h at 17·blk + 1 + 8h ...

@device_function
def q8_0_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 17
    half = (col >> 4) & 1
    raw[p, 8] = uint32(w[base])
    for j in range(8):
        raw[p, j] = uint32(w[base + 1 + 8 * half + j])


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
def q4_0_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 9
    raw[p, 8] = uint32(w[base])
    for j in range(8):
        raw[p, j] = uint32(w[base + 1 + j])


@device_function
def q4_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        nib = (raw[p, i >> 1] >> (uint32(8 * (i & 1)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = d * small_uint_to_f32(nib, float32(8.0))


# ---------------------------------------------------------------- Q4_1, Q5_0, Q5_1, IQ4_NL (32 per block)
# Q4_0's split: half h reads all 16 qs bytes (raw[p, 0:8]) and takes nibble h; Q5_* take bit
# 16h + i of qh as weight i's fifth bit. uint16 words: Q4_1 blocks are 10 (d, m, qs at 2..9),
# Q5_0 11 (d, qh 1..2, qs 3..10), Q5_1 12 (d, m, qh 2..3, qs 4..11), IQ4_NL 9 (Q4_0's).
# raw[p, 8] = d bits; raw[p, 9] = m bits (Q4_1) or qh (Q5_*); Q5_1: raw[p, 10] = m bits.

@device_function
def qs_load(w, first, raw, p):
    for j in range(8):
        raw[p, j] = uint32(w[first + j])


@device_function
def q4_1_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 10
    raw[p, 8] = uint32(w[base])
    raw[p, 9] = uint32(w[base + 1])
    qs_load(w, base + 2, raw, p)


@device_function
def q5_0_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 11
    raw[p, 8] = uint32(w[base])
    raw[p, 9] = uint32(w[base + 1]) | (uint32(w[base + 2]) << SIXTEEN)
    qs_load(w, base + 3, raw, p)


@device_function
def q5_1_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 12
    raw[p, 8] = uint32(w[base])
    raw[p, 9] = uint32(w[base + 2]) | (uint32(w[base + 3]) << SIXTEEN)
    raw[p, 10] = uint32(w[base + 1])
    qs_load(w, base + 4, raw, p)


@device_function
def nibble(raw, p, i, shift):
    """Weight i's 4-bit quant of the unit: nibble `shift` / 4 of qs byte i."""
    return (raw[p, i >> 1] >> (uint32(8 * (i & 1)) + shift)) & uint32(15)


@device_function
def q4_1_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    m = f16_bits_to_f32(raw[p, 9])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        ws[at + uint32(i) * stride] = fma(d, small_uint_to_f32(nibble(raw, p, i, shift), ZERO), m)


@device_function
def q5_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    half = uint32((col >> 4) & 1)
    qh = shr_u32(raw[p, 9], half << uint32(4))
    for i in range(16):
        q = nibble(raw, p, i, half << uint32(2)) | (((qh >> uint32(i)) & uint32(1)) << uint32(4))
        ws[at + uint32(i) * stride] = d * small_uint_to_f32(q, float32(16.0))


@device_function
def q5_1_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    m = f16_bits_to_f32(raw[p, 10])
    half = uint32((col >> 4) & 1)
    qh = shr_u32(raw[p, 9], half << uint32(4))
    for i in range(16):
        q = nibble(raw, p, i, half << uint32(2)) | (((qh >> uint32(i)) & uint32(1)) << uint32(4))
        ws[at + uint32(i) * stride] = fma(d, small_uint_to_f32(q, ZERO), m)


@device_function
def iq4_nl_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        ws[at + uint32(i) * stride] = d * int8_to_f32(iq4_nl_byte(nibble(raw, p, i, shift)))


# MXFP4 (17 B: e8m0 exponent e, qs[16]; byte aligned): IQ4_NL's nibbles with MXFP4's table and
# the scale e8m0_half(e). raw[p, 0:8] = qs bytes 2j, 2j + 1 as IQ4_NL's words, raw[p, 8] = e.

@device_function
def mxfp4_load(w, w8, col, cols, raw, p):
    base = (col >> 5) * 17
    raw[p, 8] = uint32(w8[base])
    for j in range(8):
        raw[p, j] = uint32(w8[base + 1 + 2 * j]) | (uint32(w8[base + 2 + 2 * j]) << uint32(8))


@device_function
def mxfp4_store(raw, p, col, cols, ws, at, stride):
    d = e8m0_half(raw[p, 8])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        ws[at + uint32(i) * stride] = d * int8_to_f32(mxfp4_byte(nibble(raw, p, i, shift)))


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Sub-block j (32 weights) of a block: scale/min j, the qs bytes of chunk c = j // 2 (low
# nibbles for even j, high for odd), Q5_K's fifth bits as bit j of qh bytes 0..31. Unit half h
# takes bytes 16h .. 16h+15 of those: 16-byte aligned, one vector load each. uint32 words.
# raw[p, 0:4] = header (d | dmin << 16, scales[12]); raw[p, 4:8] = qs; Q5_K: raw[p, 8:12] = qh.

@device_function
def q4_k_load(w, w8, col, cols, raw, p):
    word0 = (col >> 8) * 36                     # 144 bytes: header 16, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_row_u32x4(w, word0))
    store4(raw, p, 4, load_row_u32x4(w, word0 + 4 + 8 * ((col >> 6) & 3) + 4 * half))


@device_function
def q5_k_load(w, w8, col, cols, raw, p):
    word0 = (col >> 8) * 44                     # 176 bytes: header 16, qh 32, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_row_u32x4(w, word0))
    store4(raw, p, 4, load_row_u32x4(w, word0 + 12 + 8 * ((col >> 6) & 3) + 4 * half))
    store4(raw, p, 8, load_row_u32x4(w, word0 + 4 + 4 * half))


@device_function
def kquant_scale_min(s0, s1, s2, j):
    """get_scale_min_k4(j): 6-bit (scale, min) j of a Q4_K/Q5_K block, as float32, from the
    12 scale bytes as three little-endian words. (gpu.matmul.quants has the same with a branch; here
    both halves are computed and one selected, so that the decode stays one basic block the
    compiler can interleave with the tensor-core products.)"""
    shift = uint32(8 * (j & 3))
    a = (s0 >> shift) & uint32(0xFF)  # scales[j % 4]
    b = (s1 >> shift) & uint32(0xFF)  # scales[4 + j % 4]
    c = (s2 >> shift) & uint32(0xFF)  # scales[8 + j % 4]
    low = j < 4
    sc = a & uint32(63) if low else (c & uint32(15)) | ((a >> uint32(6)) << uint32(4))
    m = b & uint32(63) if low else (c >> uint32(4)) | ((b >> uint32(6)) << uint32(4))
    return small_uint_to_f32(sc, ZERO), small_uint_to_f32(m, ZERO)


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
    # the nibble at bit 8b of a word scales by scale·2^(-8b) (see and_or); byte 3 is shifted
    # to bit 16 first
    scale8 = scale * float32(2.0 ** -8)
    scale16 = scale * float32(2.0 ** -16)
    shift = uint32(4 * (j & 1))
    for k in range(4):
        q = shr_u32(raw[p, 4 + k], shift)
        top = shr_u32(q, uint32(8))
        i = uint32(4 * k)
        ws[at + i * stride] = fma(bits_to_f32(and_or(q, uint32(0xF), MAGIC)) - MAGIC_F, scale, -offset)
        ws[at + (i + uint32(1)) * stride] = fma(bits_to_f32(and_or(q, uint32(0xF00), MAGIC)) - MAGIC_F,
                                                 scale8, -offset)
        ws[at + (i + uint32(2)) * stride] = fma(bits_to_f32(and_or(q, uint32(0xF0000), MAGIC)) - MAGIC_F,
                                                 scale16, -offset)
        ws[at + (i + uint32(3)) * stride] = fma(bits_to_f32(and_or(top, uint32(0xF0000), MAGIC)) - MAGIC_F,
                                                 scale16, -offset)


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
# reads 16 ql and 16 qh bytes, one scale byte and d. The 16-byte runs start 2-byte aligned:
# five aligned words each (12 loads a unit, not 18 of 2 bytes), shifted into place on decode.
# raw[p, 0:5] = ql words, raw[p, 5:10] = qh words, raw[p, 10] = scale byte, raw[p, 11] = d
# bits, raw[p, 12] = the runs' shift (both start at the same place in a word).

@device_function
def q6_k_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    e = col & 255
    half = e >> 7
    g = (e >> 5) & 3
    l0 = e & 16
    base = blk * 210
    q0, q1, q2, q3, q4, shift = load_five_words(w8, base + 64 * half + 32 * (g & 1) + l0)
    h0, h1, h2, h3, h4, _ = load_five_words(w8, base + 128 + 32 * half + l0)
    raw[p, 0] = q0
    raw[p, 1] = q1
    raw[p, 2] = q2
    raw[p, 3] = q3
    raw[p, 4] = q4
    raw[p, 5] = h0
    raw[p, 6] = h1
    raw[p, 7] = h2
    raw[p, 8] = h3
    raw[p, 9] = h4
    raw[p, 10] = uint32(w8[base + 192 + 8 * half + (l0 >> 4) + 2 * g])
    raw[p, 11] = uint32(w[blk * 105 + 104])
    raw[p, 12] = shift


@device_function
def q6_k_store(raw, p, col, cols, ws, at, stride):
    g = (col >> 5) & 3
    factor = f16_bits_to_f32(raw[p, 11]) * int8_to_f32(raw[p, 10])
    # the 6-bit value at bit 8b of a word is assembled in place and scales by factor·2^(-8b)
    # (see and_or; the zero point 32 goes into the subtracted constant); byte 3 is shifted to
    # bit 16 first
    factor8 = factor * float32(2.0 ** -8)
    factor16 = factor * float32(2.0 ** -16)
    low_shift = uint32(4 * (g >> 1))
    high_shift = uint32(2 * g)
    shift = raw[p, 12]
    for k in range(4):
        low = shr_u32(funnel_right(raw[p, k], raw[p, k + 1], shift), low_shift)
        high = shr_u32(funnel_right(raw[p, 5 + k], raw[p, 6 + k], shift), high_shift)
        v = bit_select(low, high << uint32(4), uint32(0x0F0F0F0F))     # bits 0-5 of each byte
        top = shr_u32(v, uint32(8))
        i = uint32(4 * k)
        ws[at + i * stride] = (bits_to_f32(and_or(v, uint32(0x3F), MAGIC)) - (MAGIC_F + float32(32.0))) * factor
        ws[at + (i + uint32(1)) * stride] = (bits_to_f32(and_or(v, uint32(0x3F00), MAGIC))
                                             - (MAGIC_F + float32(32.0 * 2 ** 8))) * factor8
        ws[at + (i + uint32(2)) * stride] = (bits_to_f32(and_or(v, uint32(0x3F0000), MAGIC))
                                             - (MAGIC_F + float32(32.0 * 2 ** 16))) * factor16
        ws[at + (i + uint32(3)) * stride] = (bits_to_f32(and_or(top, uint32(0x3F0000), MAGIC))
                                             - (MAGIC_F + float32(32.0 * 2 ** 16))) * factor16



# ---------------------------------------------------------------- IQ4_XS, Q3_K, Q2_K (256 per block)
# Unit of column col: e = col % 256 of block blk, group 16-column half hh = (e // 16) % 2.
# IQ4_XS (136 B: d, scales_h, scales_l[4], qs[128]; uint32 words): sub-block ib = e // 32, nibble
# hh of qs bytes 16ib .. 16ib + 15; scale d·(ls − 32), ls = nibble ib % 2 of scales_l[ib // 2] |
# bits 2ib of scales_h << 4. raw[p, 0:4] = qs, raw[p, 4] = d | scales_h << 16, raw[p, 5] = scales_l.
# Q3_K / Q2_K: element 128n + 32s + l is the bit pair 2s of qs byte 32n + l, group (one scale)
# g = 8n + 2s + l // 16 = e // 16: a unit reads qs bytes 32n + 16hh .. + 15.
# Q3_K (110 B: hmask[32], qs[64], scales[12], d; uint16 words): weight d·(sc − 32)·(q − 4), q =
# the pair | bit 4n + s of hmask[16hh + i] << 2; sc = nibble g // 8 of scales[g % 8] | bits
# 2(g // 4) of scales[8 + g % 4] << 4. raw[p, 0:4] = qs, raw[p, 4:8] = hmask, raw[p, 8], [9] =
# those scale bytes, raw[p, 10] = d.
# Q2_K (84 B: scales[16], qs[64], d, dmin; uint32 words): weight d·(sc & 15)·q − dmin·(sc >> 4),
# sc = scales[g]. raw[p, 0:4] = qs, raw[p, 4] = sc, raw[p, 5] = d | dmin << 16.

@device_function
def iq4_xs_load(w, w8, col, cols, raw, p):
    base = (col >> 8) * 34
    first = base + 2 + 4 * ((col >> 5) & 7)
    for k in range(4):
        raw[p, k] = w[first + k]
    raw[p, 4] = w[base]
    raw[p, 5] = w[base + 1]


@device_function
def iq4_xs_store(raw, p, col, cols, ws, at, stride):
    ib = uint32((col >> 5) & 7)
    low = shr_u32(raw[p, 5], ib << uint32(2)) & uint32(15)
    high = shr_u32(raw[p, 4] >> SIXTEEN, ib << uint32(1)) & uint32(3)
    dl = f16_bits_to_f32(raw[p, 4]) * small_uint_to_f32(low | (high << uint32(4)), float32(32.0))
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        nib = (raw[p, i >> 2] >> (uint32(8 * (i & 3)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = dl * int8_to_f32(iq4_nl_byte(nib))


@device_function
def q3_k_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    e = col & 255
    g = e >> 4
    base = blk * 55
    qs = base + 16 + 16 * (e >> 7) + 8 * (g & 1)
    hm = base + 8 * (g & 1)
    for k in range(4):
        raw[p, k] = uint32(w[qs + 2 * k]) | (uint32(w[qs + 2 * k + 1]) << SIXTEEN)
        raw[p, 4 + k] = uint32(w[hm + 2 * k]) | (uint32(w[hm + 2 * k + 1]) << SIXTEEN)
    raw[p, 8] = uint32(w8[blk * 110 + 96 + (g & 7)])
    raw[p, 9] = uint32(w8[blk * 110 + 104 + (g & 3)])
    raw[p, 10] = uint32(w[base + 54])


@device_function
def q3_k_store(raw, p, col, cols, ws, at, stride):
    e = col & 255
    g = uint32(e >> 4)
    sc = (shr_u32(raw[p, 8], (g >> uint32(3)) << uint32(2)) & uint32(15)) | (
        (shr_u32(raw[p, 9], (g >> uint32(2)) << uint32(1)) & uint32(3)) << uint32(4))
    dl = f16_bits_to_f32(raw[p, 10]) * small_uint_to_f32(sc, float32(32.0))
    s = uint32((e >> 5) & 3)
    pair = s << uint32(1)
    bit = (uint32(e >> 7) << uint32(2)) + s
    for i in range(16):
        byte = uint32(8 * (i & 3))
        q = shr_u32(raw[p, i >> 2], byte + pair) & uint32(3)
        h = shr_u32(raw[p, 4 + (i >> 2)], byte + bit) & uint32(1)
        ws[at + uint32(i) * stride] = dl * small_uint_to_f32(q | (h << uint32(2)), float32(4.0))


@device_function
def q2_k_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    e = col & 255
    base = blk * 21
    first = base + 4 + 8 * (e >> 7) + 4 * ((e >> 4) & 1)
    for k in range(4):
        raw[p, k] = w[first + k]
    raw[p, 4] = uint32(w8[blk * 84 + (e >> 4)])
    raw[p, 5] = w[base + 20]


@device_function
def q2_k_store(raw, p, col, cols, ws, at, stride):
    sc = raw[p, 4]
    dl = f16_bits_to_f32(raw[p, 5]) * small_uint_to_f32(sc & uint32(15), ZERO)
    ml = f16_bits_to_f32(raw[p, 5] >> SIXTEEN) * small_uint_to_f32(sc >> uint32(4), ZERO)
    pair = uint32(2 * ((col >> 5) & 3))
    for i in range(16):
        q = shr_u32(raw[p, i >> 2], uint32(8 * (i & 3)) + pair) & uint32(3)
        ws[at + uint32(i) * stride] = fma(dl, small_uint_to_f32(q, ZERO), -ml)


# ---------------------------------------------------------------- IQ2_XS, IQ2_S, IQ1_S, IQ1_M (256 per block)
# Unit = group G = e // 16 of block blk = col // 256 (e = col % 256): its two grid entries 2G,
# 2G + 1 and its scale, decoded by gpu/matmul/quants.py's group decoders into raw[p, 0:4] (int8
# values v) and one factor f: weight f·v. uint16 words.
# IQ2_XS (74 B): raw[p] = entries 2G | 2G + 1 << 16, scales[G // 2], d.
# IQ2_S (82 B): raw[p] = qs[2G .. 2G + 1] | signs[2G ..] << 16, qh[G // 2] | scales[G // 2] << 8, d.
# IQ1_S (50 B): raw[p] = qs[2G .. 2G + 1], qh[G // 2] (its entries 2(G % 2), + 1), d.
# IQ1_M (56 B): raw[p] = qs[2G .. 2G + 1], qh[G], scales 0 | 1 << 16, 2 | 3 << 16.

@device_function
def grid_store(raw, p, fac, ws, at, stride):
    for i in range(16):
        ws[at + uint32(i) * stride] = fac * grid_value(raw, p, i)


@device_function
def iq2_xs_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    g = (col & 255) >> 4
    base = blk * 37
    raw[p, 0] = uint32(w[base + 1 + 2 * g]) | (uint32(w[base + 2 + 2 * g]) << SIXTEEN)
    raw[p, 1] = uint32(w8[blk * 74 + 66 + (g >> 1)])
    raw[p, 2] = uint32(w[base])


@device_function
def iq2_xs_store(raw, p, col, cols, ws, at, stride):
    g = uint32((col & 255) >> 4)
    fac = odd_scale(f16_bits_to_f32(raw[p, 2]), shr_u32(raw[p, 1], (g & uint32(1)) << uint32(2)))
    store4(raw, p, 0, iq2_xs_words(iq2xs_grid(), raw[p, 0]))
    grid_store(raw, p, fac, ws, at, stride)


@device_function
def iq2_s_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    g = (col & 255) >> 4
    base = blk * 41
    raw[p, 0] = uint32(w[base + 1 + g]) | (uint32(w[base + 17 + g]) << SIXTEEN)
    raw[p, 1] = uint32(w8[blk * 82 + 66 + (g >> 1)]) | (uint32(w8[blk * 82 + 74 + (g >> 1)]) << uint32(8))
    raw[p, 2] = uint32(w[base])


@device_function
def iq2_s_store(raw, p, col, cols, ws, at, stride):
    shift = uint32(((col & 255) >> 4) & 1) << uint32(2)     # 4·(G % 2): qh bits and scale nibble
    fac = odd_scale(f16_bits_to_f32(raw[p, 2]), shr_u32(raw[p, 1] >> uint32(8), shift))
    store4(raw, p, 0, iq2_s_words(iq2s_grid(), raw[p, 0], raw[p, 0] >> SIXTEEN, shr_u32(raw[p, 1], shift)))
    grid_store(raw, p, fac, ws, at, stride)


@device_function
def iq1_s_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    g = (col & 255) >> 4
    base = blk * 25
    raw[p, 0] = uint32(w[base + 1 + g])
    raw[p, 1] = uint32(w[base + 17 + (g >> 1)])
    raw[p, 2] = uint32(w[base])


@device_function
def iq1_s_store(raw, p, col, cols, ws, at, stride):
    qh = raw[p, 1]
    fac = odd_scale(f16_bits_to_f32(raw[p, 2]), (qh >> uint32(12)) & uint32(7))
    store4(raw, p, 0, iq1_s_words(iq1s_grid(), raw[p, 0], qh, 2 * (((col & 255) >> 4) & 1)))
    grid_store(raw, p, fac, ws, at, stride)


@device_function
def iq1_m_load(w, w8, col, cols, raw, p):
    blk = col >> 8
    g = (col & 255) >> 4
    base = blk * 28
    raw[p, 0] = uint32(w[base + g])
    raw[p, 1] = uint32(w8[blk * 56 + 32 + g])
    raw[p, 2] = uint32(w[base + 24]) | (uint32(w[base + 25]) << SIXTEEN)
    raw[p, 3] = uint32(w[base + 26]) | (uint32(w[base + 27]) << SIXTEEN)


@device_function
def iq1_m_store(raw, p, col, cols, ws, at, stride):
    g = uint32((col & 255) >> 4)
    s01, s23 = raw[p, 2], raw[p, 3]
    scales = shr_u32(s23 if g >= uint32(8) else s01, ((g >> uint32(2)) & uint32(1)) << uint32(4))   # scales[G // 4]
    fac = odd_scale(f16_bits_to_f32(iq1_m_d(s01, s23)), shr_u32(scales, uint32(3) * (g & uint32(3))) & uint32(7))
    store4(raw, p, 0, iq1_m_words(iq1s_grid(), raw[p, 0], raw[p, 1]))
    grid_store(raw, p, fac, ws, at, stride)


# IQ3_XXS, IQ3_S, IQ2_XXS: unit = half hh = (e // 16) % 2 of sub-block ib = e // 32, decoded by
# gpu/matmul/quants.py's words into raw[p, 0:4]; uint16 words. Loaded: raw[p, 0] = its 4 grid or qs
# bytes (IQ2_XXS: the sub-block's 4), raw[p, 1] = the sub-block's aux (IQ3_S: the half's sign
# bytes | the qh word holding qh[ib] << 16), raw[p, 2] = d (IQ3_S: | the scales word holding
# scales[ib // 2] << 16).

@device_function
def iq3_xxs_load(w, w8, col, cols, raw, p):
    base = (col >> 8) * 49
    ib = (col >> 5) & 7
    g = base + 1 + 4 * ib + 2 * ((col >> 4) & 1)
    raw[p, 0] = uint32(w[g]) | (uint32(w[g + 1]) << SIXTEEN)
    raw[p, 1] = uint32(w[base + 33 + 2 * ib]) | (uint32(w[base + 34 + 2 * ib]) << SIXTEEN)
    raw[p, 2] = uint32(w[base])


@device_function
def iq3_xxs_store(raw, p, col, cols, ws, at, stride):
    aux = raw[p, 1]
    fac = iq3_xxs_scale(f16_bits_to_f32(raw[p, 2]), aux)
    store4(raw, p, 0, iq3_xxs_words(iq3xxs_grid(), raw[p, 0], aux, 2 * ((col >> 4) & 1)))
    grid_store(raw, p, fac, ws, at, stride)


@device_function
def iq2_xxs_load(w, w8, col, cols, raw, p):
    at = (col >> 8) * 33 + 1 + 4 * ((col >> 5) & 7)
    raw[p, 0] = uint32(w[at]) | (uint32(w[at + 1]) << SIXTEEN)
    raw[p, 1] = uint32(w[at + 2]) | (uint32(w[at + 3]) << SIXTEEN)
    raw[p, 2] = uint32(w[(col >> 8) * 33])


@device_function
def iq2_xxs_store(raw, p, col, cols, ws, at, stride):
    aux = raw[p, 1]
    fac = odd_scale(f16_bits_to_f32(raw[p, 2]), aux >> uint32(28))
    store4(raw, p, 0, iq2_xxs_words(iq2xxs_grid(), raw[p, 0], aux, 2 * ((col >> 4) & 1)))
    grid_store(raw, p, fac, ws, at, stride)


@device_function
def iq3_s_load(w, w8, col, cols, raw, p):
    base = (col >> 8) * 55
    ib = (col >> 5) & 7
    hh = (col >> 4) & 1
    g = base + 1 + 4 * ib + 2 * hh
    raw[p, 0] = uint32(w[g]) | (uint32(w[g + 1]) << SIXTEEN)
    raw[p, 1] = uint32(w[base + 37 + 2 * ib + hh]) | (uint32(w[base + 33 + (ib >> 1)]) << SIXTEEN)
    raw[p, 2] = uint32(w[base]) | (uint32(w[base + 53 + (ib >> 2)]) << SIXTEEN)


@device_function
def iq3_s_store(raw, p, col, cols, ws, at, stride):
    ib = uint32((col >> 5) & 7)
    hh = uint32((col >> 4) & 1)
    v = raw[p, 1]
    scales = shr_u32(raw[p, 2] >> SIXTEEN, ((ib >> uint32(1)) & uint32(1)) << uint32(3))   # scales[ib // 2]
    fac = iq3_s_scale(f16_bits_to_f32(raw[p, 2]), shr_u32(scales, (ib & uint32(1)) << uint32(2)))
    qh = shr_u32(v >> SIXTEEN, ((ib & uint32(1)) << uint32(3)) + (hh << uint32(2)))    # qh[ib], bits 4hh on
    store4(raw, p, 0, iq3_s_words(iq3s_grid(), raw[p, 0], qh, v & LOW16))
    grid_store(raw, p, fac, ws, at, stride)


UNITS: dict[int, GemmUnit] = {u.type.id: u for u in (
    GemmUnit(gt.F32, 16, dense_load, f32_store),
    GemmUnit(gt.F16, 8, dense16_load, f16_store),
    GemmUnit(gt.BF16, 8, dense16_load, bf16_store),
    GemmUnit(gt.Q8_0, 9, q8_0_load, q8_0_store),
    GemmUnit(gt.Q4_0, 9, q4_0_load, q4_0_store),
    GemmUnit(gt.Q4_1, 10, q4_1_load, q4_1_store),
    GemmUnit(gt.Q5_0, 10, q5_0_load, q5_0_store),
    GemmUnit(gt.Q5_1, 11, q5_1_load, q5_1_store),
    GemmUnit(gt.IQ4_NL, 9, q4_0_load, iq4_nl_store),
    GemmUnit(gt.Q4_K, 8, q4_k_load, q4_k_store),
    GemmUnit(gt.Q5_K, 12, q5_k_load, q5_k_store),
    GemmUnit(gt.Q6_K, 13, q6_k_load, q6_k_store),
    GemmUnit(gt.IQ4_XS, 6, iq4_xs_load, iq4_xs_store),
    GemmUnit(gt.Q3_K, 11, q3_k_load, q3_k_store),
    GemmUnit(gt.Q2_K, 6, q2_k_load, q2_k_store),
    GemmUnit(gt.IQ2_XS, 4, iq2_xs_load, iq2_xs_store),
    GemmUnit(gt.IQ2_S, 4, iq2_s_load, iq2_s_store),
    GemmUnit(gt.IQ1_S, 4, iq1_s_load, iq1_s_store),
    GemmUnit(gt.IQ1_M, 4, iq1_m_load, iq1_m_store),
    GemmUnit(gt.MXFP4, 9, mxfp4_load, mxfp4_store),
    GemmUnit(gt.IQ3_XXS, 4, iq3_xxs_load, iq3_xxs_store),
    GemmUnit(gt.IQ3_S, 4, iq3_s_load, iq3_s_store),
    GemmUnit(gt.IQ2_XXS, 4, iq2_xxs_load, iq2_xxs_store),
)}
