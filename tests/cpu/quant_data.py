"""Random valid weight rows for every supported ggml type, and their float64 oracle (gguf-py).

F32/F16/BF16/Q8_0/Q4_0 rows come from `gguf.quants.quantize` of random normals; gguf-py cannot
quantise K-quants, so those are random bytes with the fp16 scale fields overwritten by sane
positive values (random bytes there could be inf/NaN). The `DECODED_TYPES` (read through
`cpu.decoded`) come from the synthetic writer's random valid blocks (`hybrid.synth.codes`). `extreme_rows` builds the blocks with the
largest products each type can hold, for overflow/saturation checks.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants
from numba import njit
from numba.core.extending import intrinsic

import cpu.simd as simd
from cpu.ggml_types import BY_NAME, DECODED
from cpu.matvec import ROW_READERS
from cpu.variants import type_mask
from hybrid.synth.codes import random_blocks
from tests.reference.llama_cpp_rounding import MIN_TYPES, block_mins, q8_1_min_term, round_activations

DECODED_TYPES = tuple(t.name for t in DECODED)
TYPES = ("F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", *DECODED_TYPES)
QUANT_TYPES = tuple(n for n in TYPES if BY_NAME[n].id in ROW_READERS)   # the int8-activation kernels
FP16_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q8_0": (0,), "Q4_0": (0,)}


def type_id(name: str) -> int:
    return BY_NAME[name].id


def random_rows(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of valid `name` blocks holding `cols` weights per row."""
    t = BY_NAME[name]
    if name in DECODED_TYPES:
        return random_blocks(rng, rows, cols, t, 0.02)
    if name in ("F32", "F16", "BF16", "Q8_0", "Q4_0"):
        data = rng.standard_normal((rows, cols)).astype(np.float32)
        q = quants.quantize(data, Q(t.id))
        return np.ascontiguousarray(q).view(np.uint8).reshape(rows, t.row_bytes(cols))
    n_blocks = cols // t.block_elems
    blocks = rng.integers(0, 256, size=(rows, n_blocks, t.block_bytes), dtype=np.uint8)
    for off in FP16_FIELDS[name]:
        d = (rng.uniform(0.5, 1.5, size=(rows, n_blocks)) / 64).astype(np.float16)
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, n_blocks, 2)
    return blocks.reshape(rows, n_blocks * t.block_bytes)


def extreme_rows(name: str, rows: int, cols: int, top: bool) -> np.ndarray:
    """Blocks whose weights all have the largest magnitude a code range gives, all of one sign.
    top=True: every quant code at its maximum (Q4_K/Q5_K 15/31 × scale 63, Q6_K 63 − 32 ×
    scale −128, Q8_0 127, Q4_0 15 − 8, Q5_0 31 − 16, IQ4_NL 113, MXFP4 12 (code 7), Q3_K 7 − 4 ×
    scale −32, Q2_K 3 × scale 15, IQ4_XS 113 × scale 31, IQ2 grid 43s (IQ2_XXS: its row 255),
    all signs negative, × scale 31/8, IQ3_XXS / IQ3_S the grid row with the largest adjacent pair
    (`_largest_pair_row`) × scale 31, signs +, IQ1_S grid 1 + 1/8 × scale 15); top=False: every
    code 0 (Q4_K/Q5_K −dmin·63, Q6_K −32 × −128, Q8_0 −128 via code 0x80, Q4_0 −8, Q5_0 −16,
    IQ4_NL −127; MXFP4 −12 via code 15, Q3_K −4 × −32, Q2_K −dmin·15, IQ4_XS −127 × −32, IQ2 grid
    row 0 (8s), signs positive, scale 31/8, IQ3_XXS / IQ3_S that grid row with signs −, IQ1_S
    −1 − 1/8). Q4_1 / Q5_1: top codes 15 / 31 with m = 1, else codes 0 with m = −1; IQ1_M as IQ1_S
    with its scales per 16 at 15. Scales are 1 (MXFP4: e = 128)."""
    t = BY_NAME[name]
    n_blocks = cols // t.block_elems
    b = np.zeros((rows, n_blocks, t.block_bytes), np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    minus_one = np.frombuffer(np.float16(-1.0).tobytes(), np.uint8)
    code = 0xFF if top else 0x00
    if name in ("Q4_K", "Q5_K"):
        b[:, :, 0:2] = one                          # d = 1
        b[:, :, 2:4] = one                          # dmin = 1
        b[:, :, 4:12] = 0xFF                        # scales/mins 0..3 = 63, high bits of 4..7 = 3
        b[:, :, 12:16] = 0xFF                       # scales/mins 4..7 low bits = 15 → all 63
        if top:                                     # mins 0 so the weights stay at their maximum
            b[:, :, 8:12] = 0xC0                    # mins 0..3 = 0, keeps the high bits of mins 4..7 …
            b[:, :, 12:16] = 0x0F                   # … and mins 4..7 low bits 0 → mins 4..7 = 48
        qs = 16 if name == "Q4_K" else 48
        b[:, :, qs:qs + 128] = code
        if name == "Q5_K":
            b[:, :, 16:48] = code
    elif name == "Q6_K":
        b[:, :, 0:192] = code                       # q = 63 or 0
        b[:, :, 192:208] = 0x80                     # scales −128
        b[:, :, 208:210] = one
    elif name == "Q8_0":
        b[:, :, 0:2] = one
        b[:, :, 2:34] = 0x7F if top else 0x80       # q = 127 or −128
    elif name in ("Q4_0", "IQ4_NL"):
        b[:, :, 0:2] = one
        b[:, :, 2:18] = code                        # q = 15 → 7 / 113, or 0 → −8 / −127
    elif name == "Q5_0":
        b[:, :, 0:2] = one
        b[:, :, 2:22] = code                        # qh and nibbles: q = 31 → 15, or 0 → −16
    elif name == "MXFP4":
        b[:, :, 0] = 128                            # scale 2**(128 − 128) = 1
        b[:, :, 1:17] = 0x77 if top else 0xFF       # codes 7 → 12, or 15 → −12
    elif name == "Q3_K":
        b[:, :, 0:96] = code                        # hmask and low bits: u = 7 → 3, or 0 → −4
        b[:, :, 96:108] = 0                         # six-bit scales 0 → −32
        b[:, :, 108:110] = one
    elif name == "Q2_K":
        b[:, :, 0:16] = 0x0F if top else 0xFF       # scale 15, min 0 (top) or min 15
        b[:, :, 16:80] = code                       # q = 3 or 0
        b[:, :, 80:82] = one
        b[:, :, 82:84] = one
    elif name == "IQ4_XS":
        b[:, :, 0:2] = one
        b[:, :, 2:8] = code                         # six-bit scales 63 → 31, or 0 → −32
        b[:, :, 8:136] = code                       # nibbles 15 → 113, or 0 → −127
    elif name in ("IQ2_XXS", "IQ2_XS", "IQ2_S"):
        b[:, :, 0:2] = one
        # top: grid index 255 (IQ2_XXS) or 511 / 1023 (all 43), every sign negative, scales 15 →
        # 31/8; else grid index 0 (all 8), every sign positive, scales still 15
        b[:, :, 2:] = code
        scales = {"IQ2_XXS": None, "IQ2_XS": 66, "IQ2_S": 74}[name]
        if scales is None:
            b[:, :, 9::8] |= 0xF0                   # the top nibble of each u32 aux
        else:
            b[:, :, scales:scales + 8] = 0xFF
    elif name == "IQ3_XXS":
        b[:, :, 0:2] = one
        b[:, :, 2:66] = _largest_pair_row(quants.IQ3_XXS)
        aux = 0xF0000000 if top else 0xFFFFFFFF        # scale 15 → 31; sign fields 0 → all +, 127 → all −
        b[:, :, 66:98] = np.frombuffer(np.array([aux] * 8, "<u4").tobytes(), np.uint8)
    elif name == "IQ3_S":
        g = _largest_pair_row(quants.IQ3_S)
        b[:, :, 0:2] = one
        b[:, :, 2:66] = g & 0xFF
        b[:, :, 66:74] = 0xFF if g >> 8 else 0x00       # the ninth index bits
        b[:, :, 74:106] = 0x00 if top else 0xFF         # signs
        b[:, :, 106:110] = 0xFF                         # scales 15 → 31
    elif name == "IQ1_S":
        b[:, :, 0:2] = one
        b[:, :, 2:34] = 0xFF                            # grid index low bits: row 2047 (all 1) or 0 (all −1) …
        qh = 0x7FFF if top else 0xF000                  # … high bits 7 or 0; scale 7 → 15; delta +1/8 or −1/8
        b[:, :, 34:50] = np.frombuffer(np.array([qh] * 8, "<u2").tobytes(), np.uint8)
        if not top:
            b[:, :, 2:34] = 0x00
    elif name in ("Q4_1", "Q5_1"):
        b[:, :, 0:2] = one                              # d = 1
        b[:, :, 2:4] = one if top else minus_one        # m = ±1: weights q + 1 (16 / 32) or −1
        b[:, :, 4:] = code                              # (Q5_1: qh too) q = 15 / 31, or 0
    elif name == "IQ1_M":
        # top: grid row 2047 (all 1), delta +1/8 (qh nibbles 7); else row 0 (all −1), delta −1/8
        # (nibbles 8); every 3-bit scale 7 → 15, d = 1 (0x3C00: its nibbles top the four u16s)
        b[:, :, 0:32] = code
        b[:, :, 32:48] = 0x77 if top else 0x88
        b[:, :, 48:56] = np.frombuffer(np.array([0x0FFF, 0x0FFF, 0xCFFF, 0x3FFF], "<u2").tobytes(), np.uint8)
    else:
        raise ValueError(name)
    return b.reshape(rows, n_blocks * t.block_bytes)


def _largest_pair_row(cls) -> int:
    """The grid row of an IQ grid type with the largest sum of two adjacent values (the largest
    i16 pair sum of `vpmaddubsw` against equal activations)."""
    cls.init_grid()
    g = cls.grid.reshape(cls.grid_shape)
    return int(np.maximum(g[:, 0] + g[:, 1], g[:, 2] + g[:, 3]).argmax())


def dequantized(name: str, w: np.ndarray, cols: int) -> np.ndarray:
    """The oracle: gguf-py's dequantisation, as float64 (rows, cols)."""
    return quants.dequantize(w, Q(type_id(name))).astype(np.float64).reshape(w.shape[0], cols)


def quantized_x(name: str, x: np.ndarray) -> np.ndarray:
    """x as the kernels' dots with `name` weights see it (float64): llama.cpp's activation
    rounding for that type, from the numpy statement of ggml's quantisers (tests/reference)."""
    return round_activations(x, Q(type_id(name)))


def min_term_correction(name: str, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """What the kernels' product with `name` weights adds to dequantized(w) @ quantized_x(x).T:
    llama.cpp's m·s per block for Q4_1 / Q5_1 (`q8_1_min_term`, (rows, n)); 0 for the other types."""
    if type_id(name) not in MIN_TYPES:
        return np.float64(0.0)
    return q8_1_min_term(x, block_mins(w, x.shape[1])).T


def row_dot_kernel(tid, group: int = 4):
    """A fresh (uncached) kernel: out[n, r] = row r · slot n, through a row dot of type tid only
    with slots in groups of `group`, compiled for whatever cpu.simd believes of the target when
    it first runs (tests patch that belief to reach the other code paths)."""
    row_dot = intrinsic(simd.row_dot_intrinsic({tid: ROW_READERS[tid]}, group))
    mask = type_mask((tid,))

    @njit
    def run(wtype, w, xq, dx, bs, out):
        acc = np.empty(xq.shape[0], np.float32)
        for r in range(w.shape[0]):
            row_dot(mask, wtype, w, r, xq, dx, bs, acc, 0)
            for n in range(xq.shape[0]):
                out[n, r] = acc[n]
    return run
