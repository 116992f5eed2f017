"""Float rows → ggml block bytes, for every type hybrid reads (numpy, vectorised over blocks).

Block layouts are docs/MODEL_FORMAT.md §6. Q8_0 and Q4_0 follow ggml's reference rounding
(bit-identical to `gguf.quants.quantize`). The K-quants are our own: per sub-block a small search
over candidate scales with a least-squares refit (the idea of ggml's `make_qkx2_quants`), then
6-bit (Q4_K/Q5_K) or 8-bit (Q6_K) sub-scales under an fp16 super-scale. They are not bit-identical
to llama-quantize, and need not be: `gguf.quants.dequantize(bytes)` defines what a block means.
Q4_1, Q5_0, Q5_1 and MXFP4 use gguf-py's quantisers (ggml's reference rounding). The other
`cpu.ggml_types.DECODED` types (low-bit K-quants, IQ quants) have no float quantiser here: their
files are written with random codes (`codes.py`; the writer's "auto" method picks that).
"""
from __future__ import annotations

import numpy as np

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from cpu import ggml_types as gt
from cpu.ggml_types import GGMLType
from ..errors import HybridError

QK_K = 256


def quantize(x: np.ndarray, t: GGMLType | str) -> np.ndarray:
    """Quantise float rows `x` (rows, n) to `(rows, t.row_bytes(n))` uint8; `t` a type or its name."""
    if isinstance(t, str):
        t = gt.by_name(t)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x[None, :]
    rows, n = x.shape
    if n % t.block_elems:
        raise ValueError(f"{t.name} needs rows of a multiple of {t.block_elems} elements, got {n}")
    encode = _ENCODERS.get(t.name)
    if encode is None:
        raise HybridError(f"{t.name}: no float quantiser in the synthetic writer; "
                          f"write it with random codes (--method codes)")
    blocks = x.reshape(-1, t.block_elems)
    out = encode(blocks)
    return out.reshape(rows, t.row_bytes(n))


# --- float types -------------------------------------------------------------------------------

def _f32(b: np.ndarray) -> np.ndarray:
    return b.view(np.uint8)


def _f16(b: np.ndarray) -> np.ndarray:
    return b.astype(np.float16).view(np.uint8)


def _bf16(b: np.ndarray) -> np.ndarray:
    """Round to nearest even on the upper 16 bits; NaNs stay (quiet) NaNs."""
    u = b.view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    out = np.where(is_nan, (u >> 16) | 0x40, rounded).astype(np.uint16)
    return out.view(np.uint8)


# --- helpers -------------------------------------------------------------------------------

def _roundf(v: np.ndarray) -> np.ndarray:
    """C `roundf` (half away from zero), evaluated in float64 so x + 0.5 cannot round up."""
    v = v.astype(np.float64)
    return np.where(v >= 0, np.floor(v + 0.5), np.ceil(v - 0.5))


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _safe_inverse(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)


# --- 32-element blocks -------------------------------------------------------------------------

def _q8_0(b: np.ndarray) -> np.ndarray:
    d = (np.abs(b).max(axis=1, keepdims=True) / np.float32(127)).astype(np.float32)
    q = _roundf(b * _safe_inverse(d)).astype(np.int8)
    return np.concatenate([_fp16_bytes(d), q.view(np.uint8)], axis=1)


def _q4_0(b: np.ndarray) -> np.ndarray:
    # The scale maps the element of largest magnitude to code 0 (-8), keeping its sign.
    at = np.abs(b).argmax(axis=1)[:, None]
    d = (np.take_along_axis(b, at, axis=1) / np.float32(-8)).astype(np.float32)
    v = (b * _safe_inverse(d)).astype(np.float32) + np.float32(8.5)
    q = np.minimum(np.trunc(v), 15).astype(np.uint8)
    return np.concatenate([_fp16_bytes(d), q[:, :16] | (q[:, 16:] << 4)], axis=1)


# --- K-quants ----------------------------------------------------------------------------------

def _fit_affine(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block (last axis) the scale s ≥ 0 and offset m ≥ 0 of x ≈ s·q − m, q ∈ 0..nmax.

    Tries 11 grid widths around the min..max range, refits (s, m) by least squares for the codes
    each gives, keeps the one of least squared error. m ≥ 0 (the minimum is clamped to ≤ 0)
    because the format stores the offset unsigned. A search only: float32 and rint suffice.
    """
    lo = np.minimum(x.min(axis=-1, keepdims=True), 0)
    span = x.max(axis=-1, keepdims=True) - lo
    shifted, n = x - lo, np.float32(x.shape[-1])
    sx = x.sum(-1, keepdims=True)
    best_err = np.full(lo.shape, np.inf, np.float32)
    best_s, best_m = np.zeros(lo.shape, np.float32), np.zeros(lo.shape, np.float32)
    safe_span = np.where(span > 0, span, 1)
    for step in np.linspace(-1.0, 1.0, 11, dtype=np.float32):
        q = np.clip(np.rint(shifted * ((nmax + step) / safe_span)), 0, nmax)
        sq, sqq, sqx = q.sum(-1, keepdims=True), (q * q).sum(-1, keepdims=True), (q * x).sum(-1, keepdims=True)
        det = n * sqq - sq * sq
        ok = det > 0
        safe_det = np.where(ok, det, 1)
        # All codes equal (det = 0, e.g. a constant sub-block): keep the offset at lo, fit the scale.
        s_at_lo = (sqx - lo * sq) / np.where(sqq > 0, sqq, 1)
        s = np.where(ok, (n * sqx - sq * sx) / safe_det, s_at_lo)
        off = np.where(ok, (sqq * sx - sq * sqx) / safe_det, lo)
        # An offset above zero cannot be stored: refit the scale alone with offset 0.
        pos = off > 0
        s = np.maximum(np.where(pos, sqx / np.where(sqq > 0, sqq, 1), s), 0)
        off = np.where(pos, 0, off)
        err = np.square(s * q + off - x).sum(-1, keepdims=True)
        better = err < best_err
        best_err = np.where(better, err, best_err)
        best_s, best_m = np.where(better, s, best_s), np.where(better, -off, best_m)
    return best_s[..., 0], best_m[..., 0]


def _six_bit(v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sub-block values (nb, 8) ≥ 0 → fp16 super-scale (nb,) and 6-bit codes (nb, 8)."""
    d = (v.max(axis=1) / 63).astype(np.float16).astype(np.float32)
    codes = np.clip(_roundf(v * _safe_inverse(d)[:, None]), 0, 63).astype(np.uint8)
    return d, codes


def pack_scale_min(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins (nb, 8) → the 12-byte K-quant field (`get_scale_min_k4` inverse)."""
    out = np.empty((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, 0:4] | ((sc[:, 4:8] >> 4) << 6)
    out[:, 4:8] = m[:, 0:4] | ((m[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:8] & 0x0F) | ((m[:, 4:8] & 0x0F) << 4)
    return out


def _affine_k(b: np.ndarray, nmax: int) -> tuple[np.ndarray, ...]:
    """Shared Q4_K/Q5_K step: fp16 d, dmin, 6-bit (sc, m) and codes q (nb, 256) in 0..nmax."""
    sub = b.reshape(-1, 8, 32)
    s, m = _fit_affine(sub, nmax)
    d, sc = _six_bit(s)
    dmin, mc = _six_bit(m)
    scale = (d[:, None] * sc).astype(np.float32)[..., None]      # what the decoder will use
    offset = (dmin[:, None] * mc).astype(np.float32)[..., None]
    q = np.clip(_roundf((sub + offset) * _safe_inverse(scale)), 0, nmax).astype(np.uint8)
    return d, dmin, pack_scale_min(sc, mc), q.reshape(-1, QK_K)


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K low nibbles: byte 32c+l holds element 64c+l (low) and 64c+32+l (high)."""
    q = (q & 0x0F).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _q4_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_k(b, 15)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, _nibbles_k(q)], axis=1)


def high_bits_q5_k(q: np.ndarray) -> np.ndarray:
    """Q5_K qh: bit j of byte l is the fifth bit of element 32j + l."""
    hi = (q >> 4).reshape(-1, 8, 32).astype(np.uint8)
    return np.bitwise_or.reduce(hi << np.arange(8, dtype=np.uint8)[None, :, None], axis=1)


def _q5_k(b: np.ndarray) -> np.ndarray:
    d, dmin, scales, q = _affine_k(b, 31)
    return np.concatenate([_fp16_bytes(d), _fp16_bytes(dmin), scales, high_bits_q5_k(q), _nibbles_k(q)],
                          axis=1)


def _fit_symmetric(x: np.ndarray) -> np.ndarray:
    """Per 16-element sub-block the signed scale s of x ≈ s·q, q ∈ −32..31, least squared error.

    Candidates map the largest-magnitude element to about −32 (as ggml does, so the asymmetric
    code range is used fully), each refit by least squares. A search only: float32 and rint.
    """
    at = np.abs(x).argmax(axis=-1)[..., None]
    peak = np.take_along_axis(x, at, axis=-1)
    safe_peak = np.where(peak != 0, peak, 1)
    best_err = np.full(peak.shape, np.inf, np.float32)
    best = np.zeros(peak.shape, np.float32)
    for step in np.linspace(-0.9, 0.9, 7, dtype=np.float32):
        q = np.clip(np.rint(x * (-(32 + step) / safe_peak)), -32, 31)
        qq = (q * q).sum(-1, keepdims=True)
        s = np.where(qq > 0, (q * x).sum(-1, keepdims=True) / np.where(qq > 0, qq, 1), 0)
        err = np.square(s * q - x).sum(-1, keepdims=True)
        better = err < best_err
        best_err, best = np.where(better, err, best_err), np.where(better, s, best)
    return best[..., 0]


def pack_q6_k_codes(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Codes (nb, 256) in 0..63 → ql (nb, 128) and qh (nb, 64), per 128-element half n:
    ql[64n+l] = lo4(q[128n+l]) | lo4(q[128n+64+l])<<4, ql[64n+32+l] = lo4(q[128n+32+l]) | lo4(q[128n+96+l])<<4,
    qh[32n+l] = the top 2 bits of q[128n+l], q[128n+32+l], q[128n+64+l], q[128n+96+l] at bits 0, 2, 4, 6."""
    q = q.reshape(-1, 2, 4, 32)              # half n, quarter k (element 128n + 32k + l), l
    lo, hi = q & 0x0F, q >> 4
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


def _q6_k(b: np.ndarray) -> np.ndarray:
    sub = b.reshape(-1, 16, 16)
    s = _fit_symmetric(sub)
    d = (np.abs(s).max(axis=1) / 127).astype(np.float16).astype(np.float32)
    sc = np.clip(_roundf(s * _safe_inverse(d)[:, None]), -128, 127).astype(np.int8)
    scale = (d[:, None] * sc.astype(np.float32)).astype(np.float32)[..., None]
    q = (np.clip(_roundf(sub * _safe_inverse(scale)), -32, 31) + 32).astype(np.uint8)
    ql, qh = pack_q6_k_codes(q.reshape(-1, QK_K))
    return np.concatenate([ql, qh, sc.view(np.uint8), _fp16_bytes(d)], axis=1)


def _by_gguf(t: GGMLType):
    def encode(b: np.ndarray) -> np.ndarray:
        return gguf_quants.quantize(b, GGMLQuantizationType(t.id)).reshape(len(b), t.block_bytes)
    return encode


_ENCODERS = {
    "F32": _f32, "F16": _f16, "BF16": _bf16, "Q8_0": _q8_0, "Q4_0": _q4_0,
    "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    **{t.name: _by_gguf(t) for t in (gt.Q4_1, gt.Q5_0, gt.Q5_1, gt.MXFP4)},
}
QUANTIZABLE = frozenset(_ENCODERS)       # the types `quantize` can write; the rest only as random codes
assert QUANTIZABLE <= set(gt.BY_NAME)
