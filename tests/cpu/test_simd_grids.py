"""cpu.simd's grid-type row dots (IQ3_XXS, IQ3_S, IQ1_S) on both code paths: the x86 multiply-adds
and sign instruction where the target has AVX2, plain vector IR elsewhere. test_matvec reaches
only the path of the machine it runs on; here a fresh row dot is compiled with `_Vec` told that
the target lacks AVX2 (plain IR runs on any machine). Its integer sums are exact and its float
operations are the same, so it must give matvec's bits, and both the float64 reference."""
import numpy as np
import pytest
from numba import njit
from numba.core.extending import intrinsic

import cpu.simd as simd
from cpu.matvec import ROW_READERS, matvec, quantize_activations
from cpu.variants import type_mask

from .quant_data import dequantized, quantized_x, random_rows, type_id

COLS = 768     # 3 super-blocks


def row_dot_kernel(tid):
    """A fresh (uncached) kernel: out[n, r] = row r · slot n, through a row dot of type tid only."""
    row_dot = intrinsic(simd.row_dot_intrinsic({tid: ROW_READERS[tid]}))
    mask = type_mask((tid,))

    @njit
    def run(wtype, w, xq, dx, bs, out):
        acc = np.empty(xq.shape[0], np.float32)
        for r in range(w.shape[0]):
            row_dot(mask, wtype, w, r, xq, dx, bs, acc, 0)
            for n in range(xq.shape[0]):
                out[n, r] = acc[n]
    return run


@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S", "IQ1_S"])
def test_plain_ir_path_gives_the_bits_of_matvec(name, monkeypatch):
    rng = np.random.default_rng(7)
    w = random_rows(name, 9, COLS, rng)
    x = rng.standard_normal((5, COLS)).astype(np.float32)
    want = np.full((5, 9), np.nan, np.float32)
    matvec(type_id(name), w, x, want)
    monkeypatch.setattr(simd, "_target_has_avx2", lambda: False)    # read when the kernel compiles
    got = np.full((5, 9), np.nan, np.float32)
    row_dot_kernel(type_id(name))(type_id(name), w, *quantize_activations(type_id(name), x), got)
    np.testing.assert_array_equal(got, want)
    ref = dequantized(name, w, COLS) @ quantized_x(name, x).T
    assert np.allclose(got.T, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
