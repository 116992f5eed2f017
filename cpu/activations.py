"""How activations are rounded before they meet a weight type: llama.cpp's CPU `vec_dot_type`.

llama.cpp's CPU backend converts the activations of a product to the weight type's
`vec_dot_type` (ggml-cpu's `type_traits_cpu`) and dots the two in that form. The rounding this
introduces is part of what its numbers are, and a coarser one costs accuracy: int8 per 256 on a
Q8_0 product has 1.3-2.2x the rounding error of int8 per 32 (docs/MEASUREMENTS.md). So every
kernel rounds activations the way llama.cpp's x86 (AVX2/AVX-512) code does for that weight type,
and this module is the one place that says which way that is (`FORMAT_OF`) and what each way
computes (`ActFormat`, the quantisers below). The numerics, from ggml's x86 `quantize_row_*`:

* Q8_0 (blocks of 32): amax = max|x|, d = fp16(amax / 127) (round to nearest even), codes
  q = rint(x · (127 / amax)) — a multiply by 127/amax, not a divide by d, rounded half to even;
  the dot scales block i's integer sum by d_w,i · d_x,i (both fp16 values: the product is exact).
* Q8_1 (blocks of 32): Q8_0's d and codes, plus s = fp16(d_f32 · Σq) with the unrounded d.
* Q8_K (blocks of 256): codes q = rint(x · (127 / amax)), d = 1 / (127 / amax) kept in float32,
  integer sums of the codes per 16 (`bsums`). ggml divides by the signed value of largest
  magnitude, so its codes and d carry that value's sign flipped; both flip together, so every
  product q·d (and every dot) has the same bits as here, where d ≥ 0.
* F16 / BF16: x rounded to the half type (nearest even) and widened back to float32 before the
  float dot; F32 weights meet x as it is.

Where this deliberately differs from ggml: a NaN in a block makes its scale NaN (the slot's
outputs show it) rather than leaving the codes to chance.

Memory layout for the int8 formats (`quantize`): codes xq (n, cols↑256) int8 (columns past
`cols` are 0), sums per 16 codes bs (n, cols↑256 / 16) int16 for every int8 format (uniform
arrays; only Q8_K's readers use them), and the scales `d`: Q8_K block-major (blocks, n) — the
K-quant row dot loads the scales of consecutive slots as one vector — Q8_0 slot-major
(n, blocks) — a 256-column span of a slot loads its 8 scales as one vector — and Q8_1 like
Q8_0 with [d, s] pairs (n, 2·blocks) (the Q4_1 / Q5_1 row dots, `cpu.simd._SmallBlocks`).
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
from gguf import GGMLQuantizationType as T
from numba import njit, prange

from .simd import f32_bits, f32_from_bits

CHUNK = 256       # columns per unit of the int8 layout (a K-quant super-block; 8 Q8_0 blocks)
SUM_ELEMS = 16    # codes per stored integer sum (the Q6_K scale granule)
QMAX = 127        # |q| ≤ 127: keeps every u8·i8 pair sum of `vpmaddubsw` below 2**15


class ActFormat(NamedTuple):
    """One activation rounding (a ggml `vec_dot_type`)."""
    code: int          # its number inside the kernels (compile-time constants)
    name: str          # the ggml type the activations become
    block: int         # elements per scale (1 for the float formats: no scale)
    half_scale: bool   # the scale is rounded to fp16 (Q8_0, Q8_1) or kept in float32 (Q8_K)
    half_sum: bool     # each block also carries fp16 s = d · Σq (Q8_1)

    @property
    def is_int8(self) -> bool:
        return self.block > 1

    def scale_width(self) -> int:
        """Floats of `d` per slot and 256-column chunk: a scale per block (Q8_1: scale and s)."""
        return CHUNK // self.block * (2 if self.half_sum else 1) if self.is_int8 else 0


Q8_K = ActFormat(0, "Q8_K", 256, False, False)
Q8_0 = ActFormat(1, "Q8_0", 32, True, False)
Q8_1 = ActFormat(2, "Q8_1", 32, True, True)
F16 = ActFormat(3, "F16", 1, False, False)
BF16 = ActFormat(4, "BF16", 1, False, False)
F32 = ActFormat(5, "F32", 1, False, False)
FORMATS = (Q8_K, Q8_0, Q8_1, F16, BF16, F32)
MAX_SCALE_WIDTH = max(f.scale_width() for f in FORMATS)   # workspace sizing

# ggml-cpu type_traits_cpu[type].vec_dot_type, for every weight type of a GGUF (the types no
# kernel here reads yet are listed too, so a new kernel only has to look its format up)
FORMAT_OF: dict[int, ActFormat] = {int(t): f for t, f in (
    (T.F32, F32), (T.F16, F16), (T.BF16, BF16),
    (T.Q4_0, Q8_0), (T.Q5_0, Q8_0), (T.Q8_0, Q8_0), (T.IQ4_NL, Q8_0), (T.MXFP4, Q8_0),
    (T.Q4_1, Q8_1), (T.Q5_1, Q8_1),
    (T.Q2_K, Q8_K), (T.Q3_K, Q8_K), (T.Q4_K, Q8_K), (T.Q5_K, Q8_K), (T.Q6_K, Q8_K),
    (T.IQ2_XXS, Q8_K), (T.IQ2_XS, Q8_K), (T.IQ2_S, Q8_K), (T.IQ3_XXS, Q8_K), (T.IQ3_S, Q8_K),
    (T.IQ1_S, Q8_K), (T.IQ1_M, Q8_K), (T.IQ4_XS, Q8_K), (T.TQ1_0, Q8_K), (T.TQ2_0, Q8_K),
)}

# the same table for compiled code: FORMAT_CODE[type id] = format code (−1: no such type)
FORMAT_CODE = np.full(max(FORMAT_OF) + 1, -1, np.int8)
for _t, _f in FORMAT_OF.items():
    FORMAT_CODE[_t] = _f.code
SCALE_WIDTH = np.array([f.scale_width() for f in sorted(FORMATS, key=lambda f: f.code)], np.int64)
_Q8_K, _Q8_0, _Q8_1 = Q8_K.code, Q8_0.code, Q8_1.code


def format_of(wtype: int) -> ActFormat:
    """The activation format of weight type `wtype` (KeyError for a type ggml's CPU lacks)."""
    return FORMAT_OF[int(wtype)]


@njit(inline="always")
def format_code(wtype):
    """`format_of(wtype).code` for compiled code."""
    return FORMAT_CODE[wtype]


@njit(inline="always")
def scale_width(fmt):
    """`ActFormat.scale_width()` of format code fmt, for compiled code."""
    return SCALE_WIDTH[fmt]


# ---- scalar pieces -------------------------------------------------------------------------

@njit(inline="always")
def half_round(v):
    """v ≥ 0 (float32, not NaN) rounded to the nearest IEEE half, ties to even, as float32 (what
    F16C's `vcvtps2ph` with rounding mode 0 gives): overflow → inf, subnormal halves kept."""
    if v >= np.float32(65520.0):
        return np.float32(np.inf)
    if v < np.float32(2.0 ** -14):                  # half subnormals: multiples of 2**-24
        return np.float32(np.rint(v * np.float32(2.0 ** 24))) * np.float32(2.0 ** -24)
    u = f32_bits(v)
    u = (u + np.uint32(0x0FFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return f32_from_bits(u)


# ---- the int8 quantisers: one 256-column chunk k of slot i ---------------------------------

@njit(inline="always")
def _amax(xs, n):
    """(max |xs[:n]|, False if a NaN is among them) as an integer max of the bit patterns
    without the sign (monotonic for non-negative floats, exact, and vectorised)."""
    top = np.uint32(0)
    for c in range(n):
        top = max(top, f32_bits(xs[c]) & np.uint32(0x7FFFFFFF))
    return f32_from_bits(top), top <= np.uint32(0x7F800000)


_ROUND = np.float32(1.5 * 2 ** 23)   # (v + _ROUND) − _ROUND = rint(v) (half to even) for |v| < 2**22


@njit(inline="always")
def _codes(xs, q, n, inv):
    """q[c] = rint(xs[c] · inv), half to even, for c < n (|xs·inv| ≤ 127·(1 + 2**-23): the
    rounding trick is exact there)."""
    for c in range(n):
        r = (xs[c] * inv + _ROUND) - _ROUND
        q[c] = min(np.int32(QMAX), max(np.int32(-QMAX), np.int32(r)))


@njit(inline="always")
def _block(xs, q, n):
    """One scale's block, n = its full size (a constant: the loops vectorise): codes into q,
    returns (amax, 127/amax or 0, finite)."""
    amax, finite = _amax(xs, n)
    inv = np.float32(QMAX) / amax if (amax > 0 and finite) else np.float32(0.0)
    _codes(xs, q, n, inv)
    return amax, inv, finite


@njit(inline="always")
def _chunk(fmt, xs, q, d, i, k):
    """Codes and scales of one full chunk xs (256 floats) of slot i, chunk k."""
    if fmt == _Q8_K:
        amax, inv, finite = _block(xs, q, CHUNK)
        # amax 0 → d 0; amax inf → d inf (the slot's outputs show it); NaN → d NaN
        d[k, i] = np.float32(1.0) / inv if inv > 0 else (amax if finite else np.float32(np.nan))
    else:
        for b in range(CHUNK // 32):
            amax, inv, finite = _block(xs[32 * b:32 * b + 32], q[32 * b:32 * b + 32], 32)
            dq = amax / np.float32(QMAX)
            dh = half_round(dq) if finite else np.float32(np.nan)
            if fmt == _Q8_0:
                d[i, 8 * k + b] = dh
            else:   # Q8_1: [d, s] per block, s = fp16(d·Σq) from the unrounded d
                t = np.int32(0)
                for c in range(32 * b, 32 * b + 32):
                    t += np.int32(q[c])
                sq = dq * np.float32(t)
                d[i, 16 * k + 2 * b] = dh
                d[i, 16 * k + 2 * b + 1] = (half_round(abs(sq)) if sq >= 0 else -half_round(abs(sq))) \
                    if finite else np.float32(np.nan)


@njit(inline="always")
def quantize_chunk(fmt, x, xq, d, bs, i, k):
    """Chunk k (columns 256k..) of slot i in format `fmt` (a code: Q8_K, Q8_0, Q8_1): codes, scales
    (layouts in the module docstring), sums per 16. Columns past x's are zeros, and so are the
    slots past x's rows (padding slots of `quantize(..., slots)`)."""
    c0 = k * CHUNK
    q = xq[i, c0:c0 + CHUNK]
    # 1-D views and constant trip counts: indices provably ≥ 0, so no wraparound code blocks vectorising
    if i < x.shape[0] and c0 + CHUNK <= x.shape[1]:
        _chunk(fmt, x[i, c0:c0 + CHUNK], q, d, i, k)
    else:   # a partial chunk or a padding slot: copied into zeros first
        xs = np.zeros(CHUNK, np.float32)
        if i < x.shape[0]:
            for c in range(c0, x.shape[1]):
                xs[c - c0] = x[i, c]
        _chunk(fmt, xs, q, d, i, k)
    sums = bs[i, c0 // SUM_ELEMS:(c0 + CHUNK) // SUM_ELEMS]
    for s in range(CHUNK // SUM_ELEMS):
        t = np.int32(0)
        for c in range(SUM_ELEMS):
            t += np.int32(q[s * SUM_ELEMS + c])
        sums[s] = t


@njit(cache=True, nogil=True, parallel=True)
def _quantize_parallel(fmt, x, xq, d, bs):
    n_chunks = xq.shape[1] // CHUNK
    for task in prange(xq.shape[0] * n_chunks):
        quantize_chunk(fmt, x, xq, d, bs, task // n_chunks, task % n_chunks)


@njit(cache=True, nogil=True)
def _quantize_serial(fmt, x, xq, d, bs):
    for i in range(xq.shape[0]):
        for k in range(xq.shape[1] // CHUNK):
            quantize_chunk(fmt, x, xq, d, bs, i, k)


PARALLEL_MIN = 1 << 15   # below this many elements, waking the thread pool costs more


def scale_shape(fmt: ActFormat, n: int, n_chunks: int) -> tuple[int, int]:
    """The shape of `d` for n slots of n_chunks 256-column chunks."""
    return (n_chunks, n) if fmt.code == _Q8_K else (n, n_chunks * fmt.scale_width())


def quantize(fmt: ActFormat, x: np.ndarray, slots: int | None = None):
    """x (n, cols) float32 in int8 format fmt: (xq, d, bs) as the module docstring lays out,
    for `slots` ≥ n slots (default n; the slots past n are zeros)."""
    if not fmt.is_int8:
        raise ValueError(f"{fmt.name} is not an int8 activation format (see round_floats)")
    n, cols = x.shape
    n = n if slots is None else slots
    n_chunks = -(-cols // CHUNK)
    xq = np.empty((n, n_chunks * CHUNK), np.int8)
    d = np.empty(scale_shape(fmt, n, n_chunks), np.float32)
    bs = np.empty((n, n_chunks * CHUNK // SUM_ELEMS), np.int16)
    run = _quantize_parallel if n * cols >= PARALLEL_MIN else _quantize_serial
    run(fmt.code, x, xq, d, bs)
    return xq, d, bs


def round_floats(fmt: ActFormat, x: np.ndarray) -> np.ndarray:
    """x as a float dot meets it: F16 / BF16 rounded to nearest even and widened back (ggml's
    fp32→bf16 also keeps a NaN a NaN); F32 as it is."""
    if fmt is F32:
        return x
    if fmt is F16:
        with np.errstate(over="ignore"):
            return x.astype(np.float16).astype(np.float32)
    if fmt is BF16:
        u = x.view(np.uint32)
        r = ((u + (np.uint32(0x7FFF) + ((u >> 16) & 1))) >> 16 << 16).astype(np.uint32)
        return np.where(np.isnan(x), x, r.view(np.float32))
    raise ValueError(f"{fmt.name} is not a float activation format")


def dequantized(fmt: ActFormat, x: np.ndarray) -> np.ndarray:
    """x (n, cols) as a product with a weight of activation format fmt meets it, in float32: for
    an int8 format, each code times its block's scale (what the integer dot of ggml multiplies);
    for a float one, round_floats. The kernels that decode weights to floats (`cpu.decoded`) take
    this, so they round activations as llama.cpp does for those types."""
    if not fmt.is_int8:
        return round_floats(fmt, x)
    n, cols = x.shape
    xq, d, _ = quantize(fmt, x)
    scales = d.T if fmt is Q8_K else d[:, ::2] if fmt.half_sum else d      # (n, blocks): the d of each block
    # C-contiguous, as the kernels take x: a column slice of a padded array is not
    return np.ascontiguousarray((xq.astype(np.float32) * np.repeat(scales, fmt.block, axis=1))[:, :cols])
