"""N-input matrix-vector product over GGUF weight rows: out[n, r] = Σ_c W[r, c] · x[n, c].

The core bet of the CPU side: one pass over the weights serves all N input slots (the k tokens
of a speculative verify step), and N = 4 must cost little more than N = 1. Decoding a quantised
weight is the expensive part, so it is done once per block and shared by all slots (see
`cpu.simd`); the per-slot work is a handful of integer multiply-adds per 32 weights.

Activations are rounded as llama.cpp's CPU backend rounds them for the weight type
(`cpu.activations`, its `vec_dot_type`): K-quants (Q2_K … Q6_K), IQ4_XS and the grid types
(IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) meet int8 per 256 with a float32 scale and
sums per 16 (Q8_K); the 32-element block types (Q8_0, Q4_0, Q5_0, IQ4_NL,
MXFP4) meet int8 per 32 with an fp16 scale (Q8_0), each block's integer sum scaled by its own
d_w·d_x in one FMA; Q4_1 and Q5_1 meet Q8_1 (the same, plus s = fp16(d_x·Σq_x) per block, which
their min m meets as m·s). Integer sums are exact and every slot runs the same float operations, so
slot n of an N-input call gives exactly the bits of the 1-input call on x[n]; the error against
the float64 product comes only from rounding x to 127 levels per block (|x_q·d − x| ≤ d/2,
d ≈ max|x_block| / 127) and from float32 accumulation.

Float weights (F32, F16, BF16): x rounded to F16 / BF16 for those weights (as llama.cpp does),
then float32 products with float32 sums in a fixed vector order, one code path for every slot
(bit identity again holds).

A quantised type without a row dot in `ROW_READERS` (none now: every type of
`cpu.ggml_types.DECODED` has one) would go to `cpu.decoded`: blocks decoded to float32 once for
all slots, meeting x as their int8 format rounds it (the float form of llama.cpp's Q8_0 / Q8_1 /
Q8_K activations).
"""
from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange
from numba.core.extending import intrinsic

from cpu.ggml_types import (BF16, DECODED_IDS, F32, IQ1_M, IQ1_S, IQ2_S, IQ2_XS, IQ2_XXS, IQ3_S, IQ3_XXS, IQ4_NL,
                            IQ4_XS, MXFP4, Q2_K, Q3_K, Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, SUPPORTED,
                            type_name)

from . import activations as act
from .atomics import fetch_add
from .decoded import matvec_decoded
from .simd import (IQ1_M_BLOCKS, IQ1_S_BLOCKS, IQ2_S_BLOCKS, IQ2_XS_BLOCKS, IQ2_XXS_BLOCKS, IQ3_S_BLOCKS,
                   IQ3_XXS_BLOCKS, IQ4_NL_BLOCKS, IQ4_XS_BLOCKS, MXFP4_BLOCKS, Q2_K_BLOCKS, Q3_K_BLOCKS, Q4_0_BLOCKS,
                   Q4_1_BLOCKS, Q4_K_BLOCKS, Q5_0_BLOCKS, Q5_1_BLOCKS, Q5_K_BLOCKS, Q6_K_BLOCKS, Q8_0_BLOCKS,
                   WIDE_GROUP, f16_bits_to_f32, f32_from_bits, row_dot_intrinsic)
from .variants import Variants, type_mask

# Software prefetch distance for the weight stream, in bytes (0: off). With all cores streaming,
# the hardware prefetcher alone leaves the multiply-adds waiting on memory (the sweep that chose
# 4096: docs/MEASUREMENTS.md). Passed to the kernels at run time, so a benchmark can sweep it
# without recompiling.
PREFETCH_BYTES = 4096

# The types with a SIMD row dot (`cpu.simd`): each ggml type id → its reader. The one list of the
# int8-activation path: matvec, the fused FFN, the MoE expert kernel and the routing in cpu.moe /
# cpu.matmul read it; a quantised type missing here would take `cpu.decoded`'s decode-then-dot
# path (every type of cpu.ggml_types.DECODED is here now).
ROW_READERS = {Q4_K.id: Q4_K_BLOCKS, Q5_K.id: Q5_K_BLOCKS, Q6_K.id: Q6_K_BLOCKS, Q8_0.id: Q8_0_BLOCKS,
               Q4_0.id: Q4_0_BLOCKS, Q3_K.id: Q3_K_BLOCKS, Q2_K.id: Q2_K_BLOCKS, IQ4_XS.id: IQ4_XS_BLOCKS,
               IQ4_NL.id: IQ4_NL_BLOCKS, Q5_0.id: Q5_0_BLOCKS, MXFP4.id: MXFP4_BLOCKS,
               IQ2_XXS.id: IQ2_XXS_BLOCKS, IQ2_XS.id: IQ2_XS_BLOCKS, IQ2_S.id: IQ2_S_BLOCKS,
               IQ3_XXS.id: IQ3_XXS_BLOCKS, IQ3_S.id: IQ3_S_BLOCKS, IQ1_S.id: IQ1_S_BLOCKS,
               Q4_1.id: Q4_1_BLOCKS, Q5_1.id: Q5_1_BLOCKS, IQ1_M.id: IQ1_M_BLOCKS}
QUANT_TYPES = frozenset(ROW_READERS)


# ---- activations -----------------------------------------------------------------------------

def quantize_activations(wtype: int, x: np.ndarray):
    """x in the int8 format weight type wtype's dots read (`cpu.activations`): (xq, dx, bs)."""
    return act.quantize(act.format_of(wtype), x)


# ---- one weight row against all slots (shared by matvec, the fused FFN and the MoE kernel) ---

# row_dot_quant(type_mask, wtype, w, r, xq, dx, bs, acc, pf): acc[n] = Σ_c W[r, c] · x[n, c] for
# every slot n (acc overwritten), quantised types; weights `pf` bytes ahead are prefetched; only
# the types in type_mask (a compile-time constant, `cpu.variants.type_mask`) have code. Slots go in
# groups of 4, then one group of the 1-3 left: a group shares one decode of the weights (a k=3
# verify step decodes once, not as 2 + 1); past 4 slots the row is read again from L1.
# row_dot_wide: the same with groups of `cpu.simd.WIDE_GROUP` (8 with AVX-512), for matvec and the
# fused FFN, whose verify steps of 5-8 slots would otherwise decode every row twice; the MoE
# kernel keeps groups of 4 (its one kernel holds every type's code three times: twice the code
# would double its compile time).
row_dot_quant = intrinsic(row_dot_intrinsic(ROW_READERS))
row_dot_wide = intrinsic(row_dot_intrinsic(ROW_READERS, WIDE_GROUP))


# ---- kernels ---------------------------------------------------------------------------------

def _make_matvec_quant(wtype_id):
    types_here = type_mask((wtype_id,))           # the row dot's code: this type's only

    @njit(cache=True, nogil=True, parallel=True)
    def _matvec_quant(wtype, w, xq, dx, bs, out, n_tiles, n_workers, pf):
        rows, n_slots = w.shape[0], xq.shape[0]
        per_tile = -(-rows // n_tiles)
        claimed = np.zeros(1, np.int64)               # tiles handed out (`n_tiles_for`)
        for _ in prange(n_workers):
            acc = np.empty(n_slots, np.float32)
            t = fetch_add(claimed, 0, 1)
            while t < n_tiles:
                for r in range(t * per_tile, min(rows, (t + 1) * per_tile)):
                    row_dot_wide(types_here, wtype, w, r, xq, dx, bs, acc, pf)
                    for n in range(n_slots):
                        out[n, r] = acc[n]
                t = fetch_add(claimed, 0, 1)
    return _matvec_quant


_matvec_quant = Variants(_make_matvec_quant)      # _matvec_quant(wtype): the kernel for that type (`cpu.variants`)


@njit(inline="always")
def _widen_half(is_bf16, bits):
    if is_bf16:
        return f32_from_bits(np.uint32(bits) << np.uint32(16))
    return f16_bits_to_f32(bits)


@njit(cache=True, nogil=True, fastmath=True)
def _dot_f32(a, b, n):
    """Σ a[j]·b[j], j < n, vectorised in one fixed order (the same machine code for every slot)."""
    s = np.float32(0.0)
    for j in range(n):
        s += a[j] * b[j]
    return s


@njit(cache=True, nogil=True, parallel=True)
def _matvec_f32(w, x, out, n_tiles):
    rows, cols = w.shape
    n_slots = x.shape[0]
    per_tile = -(-rows // n_tiles)
    for t in prange(n_tiles):
        for r in range(t * per_tile, min(rows, (t + 1) * per_tile)):
            for n in range(n_slots):
                out[n, r] = _dot_f32(w[r], x[n], cols)


@njit(cache=True, nogil=True, parallel=True)
def _matvec_half(is_bf16, w, x, out, n_tiles):
    """F16/BF16 rows (w: uint16 bits): widen a row to float32 once, then one dot per slot."""
    rows, cols = w.shape
    n_slots = x.shape[0]
    per_tile = -(-rows // n_tiles)
    for t in prange(n_tiles):
        wf = np.empty(cols, np.float32)
        for r in range(t * per_tile, min(rows, (t + 1) * per_tile)):
            for j in range(cols):
                wf[j] = _widen_half(is_bf16, w[r, j])
            for n in range(n_slots):
                out[n, r] = _dot_f32(wf, x[n], cols)


# ---- public entry point ----------------------------------------------------------------------

def n_tiles_for(rows: int, threads: int) -> int:
    """Row tiles for a quantised kernel's `threads` to claim one at a time (`cpu.atomics`): a few
    per thread, so a thread slowed down (on a shared or virtualised machine one thread of a region
    often runs well behind the others) claims fewer, and the region does not wait for it. (Callers
    ask numba.get_num_threads() once per op: it takes a lock, microseconds a call.)"""
    return max(1, min(rows, 8 * threads))


def check_weights(wtype: int, w: np.ndarray, cols: int, what: str = "w") -> None:
    """Raise ValueError unless w holds `cols`-column rows of type wtype, ready for the kernels."""
    t = SUPPORTED.get(wtype)
    if t is None:
        raise ValueError(f"{what}: unsupported tensor type {type_name(wtype)}; supported: "
                         f"{', '.join(s.name for s in SUPPORTED.values())}")
    if not isinstance(w, np.ndarray) or w.dtype != np.uint8 or w.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D uint8 array of raw {t.name} rows, got "
                         f"{_describe(w)}")
    if not w.flags.c_contiguous:
        raise ValueError(f"{what}: rows must be C-contiguous (got strides {w.strides})")
    if cols <= 0 or cols % t.block_elems:
        raise ValueError(f"{what}: {t.name} rows need a multiple of {t.block_elems} columns, got {cols}")
    if w.shape[1] != t.row_bytes(cols):
        raise ValueError(f"{what}: a {t.name} row of {cols} columns is {t.row_bytes(cols)} bytes, "
                         f"but rows here are {w.shape[1]} bytes")


def check_f32_matrix(a: np.ndarray, what: str, shape: tuple[int, int] | None = None, writeable: bool = False) -> None:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D float32 array, got {_describe(a)}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{what}: must be C-contiguous (got strides {a.strides})")
    if shape is not None and a.shape != shape:
        raise ValueError(f"{what}: expected shape {shape}, got {a.shape}")
    if writeable and not a.flags.writeable:
        raise ValueError(f"{what}: must be writeable")
    if a.shape[0] < 1:
        raise ValueError(f"{what}: needs at least one row (input slot)")


def frozen(w: np.ndarray) -> np.ndarray:
    """A read-only view of w. Weights usually come read-only from the mapped model file, and
    Numba compiles read-only and writable arrays separately: passing every weight read-only
    keeps one compiled kernel (and lets the FFN kernel hold gate and up in one tuple)."""
    if not w.flags.writeable:
        return w
    v = np.asarray(w).view()
    v.flags.writeable = False
    return v


def _describe(a) -> str:
    if isinstance(a, np.ndarray):
        return f"{a.ndim}-D {a.dtype} array of shape {a.shape}"
    return type(a).__name__


def matvec(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """out[n, r] = Σ_c W[r, c] · x[n, c] for all n in one pass over W (rows in parallel).

    wtype: ggml type id; w: (rows, row_bytes) uint8, C-contiguous; x: (n, cols) float32;
    out: (n, rows) float32, overwritten. Releases the GIL while it runs."""
    check_matvec(wtype, w, x, out)
    run_matvec(wtype, w, x, out)


def check_matvec(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray) -> None:
    """Raise ValueError unless (wtype, w, x, out) are valid `matvec` arguments."""
    check_f32_matrix(x, "x")
    n, cols = x.shape
    check_weights(wtype, w, cols)
    check_f32_matrix(out, "out", (n, w.shape[0]), writeable=True)


def run_matvec(wtype: int, w: np.ndarray, x: np.ndarray, out: np.ndarray, quantized=None) -> None:
    """matvec without the checks (callers have checked); `quantized` reuses
    quantize_activations(wtype, x)."""
    rows = w.shape[0]
    if rows == 0:
        return
    threads = numba.get_num_threads()
    tiles = n_tiles_for(rows, threads)
    w = frozen(w)
    if wtype in QUANT_TYPES:
        xq, dx, bs = quantized if quantized is not None else quantize_activations(wtype, x)
        _matvec_quant(wtype)(wtype, w, xq, dx, bs, out, tiles, threads, PREFETCH_BYTES)
        return
    if wtype in DECODED_IDS:      # (a quantised type without a row dot)
        matvec_decoded(wtype, w, x, out)
        return
    x = act.round_floats(act.format_of(wtype), x)   # F16/BF16 weights meet x rounded to their type
    if wtype == F32.id:
        _matvec_f32(w.view(np.float32), x, out, tiles)
    else:
        _matvec_half(wtype == BF16.id, w.view(np.uint16), x, out, tiles)
