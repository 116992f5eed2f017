"""exp for float32 written so LLVM can vectorise it (libm's expf is an opaque scalar call).

Cody–Waite reduction x = n·ln2 + r with |r| ≤ ln2/2, a degree-6 polynomial for exp(r) (the
classic Cephes expf coefficients), then 2^n put straight into the exponent bits. Within 2 ulp
of the true value on [−87, 88]; inputs outside are clamped there (exp(−87) ≈ 1.6e−38 is as
good as 0 for SiLU and softmax, and SiLU only needs exp(−x) for large negative x to overflow
to "huge", which 88 gives: e^88 ≈ 1.7e38).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from .simd import f32_from_bits

_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)          # ln 2 split so n·_LN2_HI is exact for |n| ≤ 128
_LN2_LO = np.float32(-2.12194440e-4)
_LO, _HI = np.float32(-87.0), np.float32(88.0)
_P = (np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3),
      np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1))


@njit(inline="always", nogil=True)
def expf(x):
    x = min(max(x, _LO), _HI)
    n = np.floor(x * _LOG2E + np.float32(0.5))
    r = x - n * _LN2_HI - n * _LN2_LO
    p = _P[0]
    p = p * r + _P[1]
    p = p * r + _P[2]
    p = p * r + _P[3]
    p = p * r + _P[4]
    p = p * r + _P[5]
    y = p * r * r + r + np.float32(1.0)
    return y * f32_from_bits(np.uint32((np.int32(n) + 127) << 23))
