"""The fast path for big files: valid blocks of random codes under sane scales, no float search.

Quantising 27B floats in numpy would take hours; instead each block is random bytes (every bit
pattern of the code fields is a valid code, uniformly distributed) whose scale fields are then
overwritten so the decoded values have mean ≈ 0 and standard deviation ≈ `sigma`:

* Q8_0, Q4_0: codes are biased by half a step (−128..127, −8..7), so each block's scale gets a
  random sign, which cancels the bias over a row;
* Q4_K, Q5_K: m = sc and dmin = d·(nmax/2), so value = d·sc·(q − nmax/2), centred;
* Q6_K: signed 8-bit sub-scales with random signs.
* the `cpu.ggml_types.DECODED` types (low-bit K-quants, IQ quants, MXFP4): every code field is
  random (each bit pattern is valid: the IQ grid indices span their whole tables); the super-scale
  is fixed by decoding a sample at scale 1 and measuring its std (`_scaled_by_sample`), with a
  random sign for the symmetric types; the types with an offset (Q4_1, Q5_1, Q2_K) get the one
  that centres their codes. IQ1_M blocks have every delta-sign bit set: gguf-py's IQ1_M decoder
  ignores that bit (it always takes −delta), so only then do gguf-py and ggml agree on the values.

Sub-scales vary at random over the upper half of their range so rows are not all alike. All
randomness comes from the bit generator's raw words (bounded-integer sampling is slower). What the file
means is still `gguf.quants.dequantize(bytes)`; `dequantize.py` reads it back the same way.
"""
from __future__ import annotations

import numpy as np

from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from cpu import ggml_types as gt
from cpu.ggml_types import GGMLType
from .quantize import pack_scale_min, quantize


def random_blocks(rng: np.random.Generator, rows: int, n: int, t: GGMLType, sigma: float) -> np.ndarray:
    """(rows, t.row_bytes(n)) uint8 of valid `t` blocks whose values have std ≈ sigma."""
    if t.block_elems == 1:
        return quantize(rng.standard_normal((rows, n), dtype=np.float32) * np.float32(sigma), t)
    nb = rows * n // t.block_elems
    out = _random_bytes(rng, nb * t.block_bytes).reshape(nb, t.block_bytes)
    _SCALE_WRITERS[t.name](rng, out, float(sigma))
    return out.reshape(rows, t.row_bytes(n))


def _random_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    # The bit generator's raw 64-bit words: rng.bytes() is several times slower.
    words = rng.bit_generator.random_raw((n + 7) // 8)
    return words.view(np.uint8)[:n]


def _fp16_column(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16).reshape(-1, 1).view(np.uint8)


def _random_signs(rng: np.random.Generator, shape) -> np.ndarray:
    """±1 as float32, from raw bits (bounded-integer sampling is several times slower)."""
    bits = _random_bytes(rng, int(np.prod(shape))).reshape(shape) & 1
    return bits.astype(np.float32) * 2 - 1


def _sub_scales(rng: np.random.Generator, shape, top: int) -> np.ndarray:
    """Random sub-scales in [top/2 + 1, top] (top = 2^k − 1), from raw bits."""
    half = (top + 1) // 2
    return (_random_bytes(rng, int(np.prod(shape))).reshape(shape) & (half - 1)) + np.uint8(half)


def _rms_of_scales(top: int) -> float:
    v = np.arange((top + 1) // 2, top + 1, dtype=np.float64)
    return float(np.sqrt((v * v).mean()))


def _code_std(levels: int) -> float:
    """The std of a uniform code over 0..levels−1 about its centre: sqrt((levels² − 1) / 12)."""
    return float(np.sqrt((levels * levels - 1) / 12.0))


def _q8_0(rng, out, sigma):
    out[:, 0:2] = _fp16_column(_random_signs(rng, len(out)) * np.float32(sigma / _code_std(256)))


def _q4_0(rng, out, sigma):
    out[:, 0:2] = _fp16_column(_random_signs(rng, len(out)) * np.float32(sigma / _code_std(16)))


def _affine_k(rng, out, sigma, nmax: int):
    nb = len(out)
    sc = _sub_scales(rng, (nb, 8), 63)
    d = np.float32(sigma / (_code_std(nmax + 1) * _rms_of_scales(63)))
    dmin = np.float32(d * (nmax / 2))                 # m = sc ⇒ offset = d·sc·nmax/2
    out[:, 0:2] = _fp16_column(np.full(nb, d, np.float32))
    out[:, 2:4] = _fp16_column(np.full(nb, dmin, np.float32))
    out[:, 4:16] = pack_scale_min(sc, sc)


def _q4_k(rng, out, sigma):
    _affine_k(rng, out, sigma, 15)


def _q5_k(rng, out, sigma):
    _affine_k(rng, out, sigma, 31)


def _q6_k(rng, out, sigma):
    nb = len(out)
    raw = _random_bytes(rng, nb * 16).reshape(nb, 16)
    magnitude = ((raw & 63) + 64).astype(np.int16)                 # 64..127
    signed = np.where(raw & 128, magnitude, -magnitude).astype(np.int8)
    out[:, 192:208] = signed.view(np.uint8)
    d = np.float32(sigma / (_code_std(64) * _rms_of_scales(127)))
    out[:, 208:210] = _fp16_column(np.full(nb, d, np.float32))


# ---- the decoded types ------------------------------------------------------------------------

_SAMPLE_BLOCKS = 256     # blocks decoded at scale 1 to measure a type's std per unit scale


def _unit_std(out: np.ndarray, t: GGMLType, set_scale) -> float:
    """The std of the values of the first blocks of out with their super-scale set to 1."""
    sample = out[:_SAMPLE_BLOCKS].copy()
    set_scale(sample, np.ones(len(sample), np.float32))
    v = gguf_quants.dequantize(sample, GGMLQuantizationType(t.id)).astype(np.float64)
    return float(v.std()) or 1.0


def _fp16_at(offset: int):
    def set_scale(out, d):
        out[:, offset:offset + 2] = _fp16_column(d)
    return set_scale


def _scaled_by_sample(t: GGMLType, set_scale):
    """A writer for a symmetric type: super-scale ±sigma / (its std at scale 1)."""
    def write(rng, out, sigma):
        d = np.float32(sigma / _unit_std(out, t, set_scale))
        set_scale(out, _random_signs(rng, len(out)) * d)
    return write


def _iq1_m_scale(out, d):
    """IQ1_M's fp16 super-scale lives in the top nibbles of its four u16 scale words."""
    bits = d.astype(np.float16).view(np.uint16)
    words = out[:, 48:56].copy().view(np.uint16)                  # (nb, 4)
    for i in range(4):
        words[:, i] = (words[:, i] & 0x0FFF) | (((bits >> (4 * i)) & 0xF) << 12)
    out[:, 48:56] = words.view(np.uint8)


def _iq1_m(rng, out, sigma):
    out[:, 32:48] |= 0x88                     # every delta-sign bit set (see the module docstring)
    _scaled_by_sample(gt.IQ1_M, _iq1_m_scale)(rng, out, sigma)


def _mxfp4(rng, out, sigma):
    # e8m0 exponent e: values kv · 2**(e − 128), kv the doubled e2m1 codes (rms of all 16:
    # sqrt(274 / 8)). A power of two rarely hits sigma, so each block takes the exponent below or
    # above it, at the odds that make the mean variance sigma².
    rms = float(np.sqrt(274 / 8))
    lo = int(np.floor(np.log2(sigma / rms))) + 128
    v_lo, v_hi = (rms * 2.0 ** (lo - 128)) ** 2, (rms * 2.0 ** (lo - 127)) ** 2
    p_hi = (sigma * sigma - v_lo) / (v_hi - v_lo)
    pick = _random_bytes(rng, len(out)).astype(np.float64) / 256 < p_hi
    out[:, 0] = np.clip(lo + pick, 2, 250)


def _offset_type(d_at: int, m_at: int, levels: int, t: GGMLType):
    """Q4_1 / Q5_1: value = d·q + m with q ∈ 0..levels−1; m = −d·(levels−1)/2 centres them."""
    def write(rng, out, sigma):
        d = np.float32(sigma / _code_std(levels))
        out[:, d_at:d_at + 2] = _fp16_column(np.full(len(out), d, np.float32))
        out[:, m_at:m_at + 2] = _fp16_column(np.full(len(out), -d * (levels - 1) / 2, np.float32))
    return write


def _q2_k(rng, out, sigma):
    # scale byte s | m << 4 with m = s (8..15) and dmin = 1.5·d: value = d·s·(q − 1.5), q ∈ 0..3
    s = _sub_scales(rng, (len(out), 16), 15)
    out[:, 0:16] = s | (s << 4)
    d = np.float32(sigma / (_code_std(4) * _rms_of_scales(15)))
    out[:, 80:82] = _fp16_column(np.full(len(out), d, np.float32))
    out[:, 82:84] = _fp16_column(np.full(len(out), d * 1.5, np.float32))


_SCALE_WRITERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
                  "Q4_1": _offset_type(0, 2, 16, gt.Q4_1), "Q5_1": _offset_type(0, 2, 32, gt.Q5_1),
                  "Q2_K": _q2_k, "Q3_K": _scaled_by_sample(gt.Q3_K, _fp16_at(108)),
                  "IQ1_M": _iq1_m, "MXFP4": _mxfp4}
for _t in (gt.Q5_0, gt.IQ4_NL, gt.IQ4_XS, gt.IQ3_XXS, gt.IQ3_S, gt.IQ2_XXS, gt.IQ2_XS, gt.IQ2_S, gt.IQ1_S):
    _SCALE_WRITERS[_t.name] = _scaled_by_sample(_t, _fp16_at(0))       # d is the block's first field
assert set(_SCALE_WRITERS) == {t.name for t in gt.SUPPORTED.values() if t.block_elems > 1}
