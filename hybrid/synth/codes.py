"""The fast path for big files: valid blocks of random codes under sane scales, no float search.

Quantising 27B floats in numpy would take hours; instead each block is random bytes (every bit
pattern of the code fields is a valid code, uniformly distributed) whose scale fields are then
overwritten so the decoded values have mean ≈ 0 and standard deviation ≈ `sigma`:

* Q8_0, Q4_0: codes are biased by half a step (−128..127, −8..7), so each block's scale gets a
  random sign, which cancels the bias over a row;
* Q4_K, Q5_K: m = sc and dmin = d·(nmax/2), so value = d·sc·(q − nmax/2), centred;
* Q6_K: signed 8-bit sub-scales with random signs.

Sub-scales vary at random over the upper half of their range so rows are not all alike. All
randomness comes from the bit generator's raw words (bounded-integer sampling is slower). What the file
means is still `gguf.quants.dequantize(bytes)`; `dequantize.py` reads it back the same way.
"""
from __future__ import annotations

import numpy as np

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


_SCALE_WRITERS = {"Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
