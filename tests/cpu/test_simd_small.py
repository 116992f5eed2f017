"""cpu.simd's 32-weight block row dots (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4, Q4_1, Q5_1) on all three
code paths: two blocks per 512-bit `vpdpbusd` where the target has AVX512-VNNI, one block per
256-bit multiply-add with the sign trick (AVX2), plain vector IR elsewhere. test_matvec reaches
only the path of the machine it runs on; here fresh row dots are compiled with `_Vec` told that
the target lacks the 512-bit path, or AVX2 altogether. Every path computes the same integer per
lane and the same float operations in the same order, so each must give matvec's bits, and all
must match the float64 reference."""
import numpy as np
import pytest

import cpu.simd as simd
from cpu.matvec import matvec, quantize_activations

from .quant_data import (dequantized, extreme_rows, min_term_correction, quantized_x, random_rows, row_dot_kernel,
                         type_id)

SMALL = ("Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1")
COLS = 2 * 256 + 3 * 32     # two full 8-block spans and a 3-block tail
SLOTS = 11                  # a group of WIDE_GROUP (8 with AVX-512) and one of the rest


def on_path(name, w, x, path, monkeypatch):
    """The products through a fresh row dot compiled for `path` ("zmm", "ymm", "plain")."""
    if path == "zmm" and not simd._target_has_zmm_vnni():
        pytest.skip("the target has no AVX512-VNNI")
    if path == "ymm" and not simd._target_has_avx2():
        pytest.skip("the target has no AVX2")
    with monkeypatch.context() as m:    # both are read when the kernel compiles
        m.setattr(simd, "_target_has_zmm_vnni", lambda: path == "zmm")
        m.setattr(simd, "_target_has_avx2", lambda: path != "plain")
        got = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
        row_dot_kernel(type_id(name), simd.WIDE_GROUP)(type_id(name), w, *quantize_activations(type_id(name), x), got)
    return got


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("path", ["zmm", "ymm", "plain"])
def test_every_path_gives_the_bits_of_matvec(name, path, monkeypatch):
    rng = np.random.default_rng(31)
    w = random_rows(name, 7, COLS, rng)
    x = rng.standard_normal((SLOTS, COLS)).astype(np.float32)
    x[3, :256] = 0.0                  # a zero span: the odd blocks' chain starts and stays at zero
    want = np.full((SLOTS, 7), np.nan, np.float32)
    matvec(type_id(name), w, x, want)
    got = on_path(name, w, x, path, monkeypatch)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))   # the zeros' signs too
    ref = dequantized(name, w, COLS) @ quantized_x(name, x).T + min_term_correction(name, w, x)
    assert np.allclose(got, ref.T, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("name", SMALL)
@pytest.mark.parametrize("path", ["zmm", "ymm"])
@pytest.mark.parametrize("top", [True, False], ids=["top", "bottom"])
def test_largest_products_are_exact_on_every_path(name, path, top, monkeypatch):
    """Weights at the ends of their code range (Q8_0 −128 included) against x of ±127 codes: the
    biased products of the 512-bit path reach their largest sums here."""
    w = extreme_rows(name, 3, COLS, top)
    x = np.ones((2, COLS), np.float32)
    x[1] = -1.0
    got = on_path(name, w, x, path, monkeypatch)
    ref = dequantized(name, w, COLS) @ quantized_x(name, x).T + min_term_correction(name, w, x)
    assert np.allclose(got, ref.T, rtol=1e-5, atol=0)    # a lost 128·Σw or a wrapped sum is far off
