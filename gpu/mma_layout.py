"""Which lane of a warp holds which matrix element in `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`.

D (16×8, f32) = A (16×16, f16) · B (16×8, f16) + C (16×8, f32), computed by a whole warp, each
lane holding a fragment of every matrix in registers. The positions below are the PTX ISA's
("Matrix Fragments for mma.m16n8k16 with floating point type"), with groupID g = lane >> 2 and
threadID_in_group t = lane % 4:

* A: 4 registers of two fp16 each, elements a0..a7 (low half first): a_i sits at
  row g + 8 for i in {2, 3, 6, 7} (else row g), column 2t + (i & 1) + 8 for i >= 4.
* B: 2 registers of two fp16, b0..b3: b_i sits at row (k) 2t + (i & 1) + 8 for i >= 2,
  column (n) g.
* C, D: 4 floats c0..c3: c_i sits at row g + 8 for i >= 2 (else g), column 2t + (i & 1).

So every A or B register holds two k-consecutive elements: with both matrices k-contiguous in
memory (A row-major, B column-major: ".row.col"), a register is one aligned 32-bit word.

Plain numpy, no Numba: the CUDA simulator's stand-in for the instruction
(gpu.intrinsics.mma_m16n8k16) and the layout tests (tests/gpu/test_mma_layout.py) use it.
"""
from __future__ import annotations

import numpy as np

M, N, K = 16, 8, 16
LANES = 32
A_REGS, B_REGS, C_REGS = 4, 2, 4


def a_position(lane: int, i: int) -> tuple[int, int]:
    """(row, k) of A element a_i of `lane`, i < 8."""
    g, t = lane >> 2, lane & 3
    return g + 8 * ((i >> 1) & 1), 2 * t + (i & 1) + 8 * (i >> 2)


def b_position(lane: int, i: int) -> tuple[int, int]:
    """(k, column) of B element b_i of `lane`, i < 4."""
    g, t = lane >> 2, lane & 3
    return 2 * t + (i & 1) + 8 * (i >> 1), g


def c_position(lane: int, i: int) -> tuple[int, int]:
    """(row, column) of accumulator element c_i (or d_i) of `lane`, i < 4."""
    g, t = lane >> 2, lane & 3
    return g + 8 * (i >> 1), 2 * t + (i & 1)


def _table(position, lanes: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) index arrays of shape (lanes, count): where element i of each lane sits."""
    pos = np.array([[position(lane, i) for i in range(count)] for lane in range(lanes)])
    return pos[..., 0], pos[..., 1]


A_AT = _table(a_position, LANES, 2 * A_REGS)     # element a_i of lane l sits at a[A_AT[0][l, i], A_AT[1][l, i]]
B_AT = _table(b_position, LANES, 2 * B_REGS)
C_AT = _table(c_position, LANES, C_REGS)


def pack_halves(lo, hi) -> np.ndarray:
    """uint32 words holding fp16(lo) in the low 16 bits and fp16(hi) in the high ones (the
    order of cvt.rn.f16x2.f32 hi, lo)."""
    lo16 = np.asarray(lo, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    hi16 = np.asarray(hi, np.float32).astype(np.float16).view(np.uint16).astype(np.uint32)
    return lo16 | (hi16 << np.uint32(16))


def _halves(regs: np.ndarray) -> np.ndarray:
    """(lanes, 2·registers) fp16 elements of uint32 registers, low half first, as float32."""
    regs = np.ascontiguousarray(regs, np.uint32)
    low = (regs & np.uint32(0xFFFF)).astype(np.uint16).view(np.float16)
    high = (regs >> np.uint32(16)).astype(np.uint16).view(np.float16)
    return np.stack([low, high], axis=-1).reshape(regs.shape[0], -1).astype(np.float32)


def _pairs(elements: np.ndarray) -> np.ndarray:
    """uint32 registers of (lanes, 2·registers) elements: element 2r low, 2r + 1 high."""
    return pack_halves(elements[:, 0::2], elements[:, 1::2])


def scatter_a(a: np.ndarray) -> np.ndarray:
    """The (32, 4) uint32 A registers of a warp for the 16×16 matrix `a` (rounded to fp16)."""
    return _pairs(np.asarray(a, np.float32)[A_AT])


def scatter_b(b: np.ndarray) -> np.ndarray:
    """The (32, 2) uint32 B registers of a warp for the 16×8 matrix `b` (rounded to fp16)."""
    return _pairs(np.asarray(b, np.float32)[B_AT])


def scatter_c(c: np.ndarray) -> np.ndarray:
    """The (32, 4) float32 accumulators of a warp for the 16×8 matrix `c`."""
    return np.asarray(c, np.float32)[C_AT]


def _gather(values: np.ndarray, at: tuple[np.ndarray, np.ndarray], shape) -> np.ndarray:
    out = np.full(shape, np.nan, np.float32)
    out[at] = values
    return out


def gather_a(regs: np.ndarray) -> np.ndarray:
    """The 16×16 A matrix a warp's (32, 4) registers hold (unheld elements NaN)."""
    return _gather(_halves(regs), A_AT, (M, K))


def gather_b(regs: np.ndarray) -> np.ndarray:
    """The 16×8 B matrix a warp's (32, 2) registers hold (unheld elements NaN)."""
    return _gather(_halves(regs), B_AT, (K, N))


def gather_c(acc: np.ndarray) -> np.ndarray:
    """The 16×8 accumulator matrix a warp's (32, 4) floats hold (unheld elements NaN)."""
    return _gather(np.asarray(acc, np.float32), C_AT, (M, N))


def warp_mma(a_regs: np.ndarray, b_regs: np.ndarray, c_acc: np.ndarray) -> np.ndarray:
    """The (32, 4) float32 D registers one m16n8k16 instruction leaves in a warp's lanes.

    A model, not the hardware's bits: fp16 products are exact in float64 and the sum is rounded
    to float32 once, where the tensor cores round (toward zero) in steps.
    """
    a, b, c = gather_a(a_regs), gather_b(b_regs), gather_c(c_acc)
    d = (a.astype(np.float64) @ b.astype(np.float64) + c).astype(np.float32)
    return scatter_c(d)
