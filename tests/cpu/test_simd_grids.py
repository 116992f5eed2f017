"""cpu.simd's grid-type row dots (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) on both
code paths: the x86 multiply-adds and sign instruction where the target has AVX2, plain vector IR
elsewhere. test_matvec reaches only the path of the machine it runs on; here a fresh row dot is compiled with
`_Vec` told that the target lacks AVX2 (plain IR runs on any machine). Its integer sums are exact
and its float operations are the same, so it must give matvec's bits, and both the float64
reference. The IQ2 readers' block sums are also held against gguf-py's integer codes: their
weights are (d/8)·(integer code) exactly, so the sum must equal Σ code·x exactly."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from numba import njit, types
from numba.core.extending import intrinsic

import cpu.simd as simd
from cpu.matvec import matvec, quantize_activations

from .quant_data import dequantized, quantized_x, random_rows, row_dot_kernel, type_id

COLS = 768     # 3 super-blocks


def matvec_and_fresh_row_dot(name, rows, slots, seed, monkeypatch, switch, value):
    """(w, x, matvec's out, a freshly compiled row dot's out with cpu.simd's compile-time choice
    `switch` made to return `value`), on random rows of the type."""
    rng = np.random.default_rng(seed)
    w = random_rows(name, rows, COLS, rng)
    x = rng.standard_normal((slots, COLS)).astype(np.float32)
    want = np.full((slots, rows), np.nan, np.float32)
    matvec(type_id(name), w, x, want)
    monkeypatch.setattr(simd, switch, lambda: value)    # read when the kernel compiles
    got = np.full((slots, rows), np.nan, np.float32)
    row_dot_kernel(type_id(name))(type_id(name), w, *quantize_activations(type_id(name), x), got)
    return w, x, want, got


@pytest.mark.parametrize("name", ["IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_plain_ir_path_gives_the_bits_of_matvec(name, monkeypatch):
    w, x, want, got = matvec_and_fresh_row_dot(name, 9, 5, 7, monkeypatch, "_target_has_avx2", False)
    np.testing.assert_array_equal(got, want)
    ref = dequantized(name, w, COLS) @ quantized_x(name, x).T
    assert np.allclose(got.T, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())


@pytest.mark.parametrize("gathers", [True, False])
@pytest.mark.parametrize("name", ["IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M"])
def test_both_ways_of_fetching_grid_rows_give_the_bits_of_matvec(name, gathers, monkeypatch):
    """The readers that gather their grid rows on AVX-512 machines and load them one by one
    elsewhere (`_target_gathers_fast`): each way, compiled fresh, gives matvec's bits."""
    _, _, want, got = matvec_and_fresh_row_dot(name, 7, 3, 11, monkeypatch, "_target_gathers_fast", gathers)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("up_front", [True, False])
@pytest.mark.parametrize("name", ["Q3_K", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ1_M"])
def test_parts_made_up_front_or_when_used_give_the_bits_of_matvec(name, up_front, monkeypatch):
    """The readers whose parts are made when the first slot uses them on 16-register targets
    (`simd._Chunks`) and up front on AVX-512 ones: each order, compiled fresh, gives matvec's bits
    (five slots: one group of 4 and one of 1 on this machine's row dot)."""
    _, _, want, got = matvec_and_fresh_row_dot(name, 7, 5, 13, monkeypatch, "_target_has_32_vector_registers",
                                               up_front)
    np.testing.assert_array_equal(got, want)


READERS = {"IQ2_XXS": simd.IQ2_XXS_BLOCKS, "IQ2_XS": simd.IQ2_XS_BLOCKS, "IQ2_S": simd.IQ2_S_BLOCKS}


def main_sum_kernel(reader):
    """A fresh (uncached) kernel: out[0..8) = the 8 i32 main lanes of one block against 256 x."""
    @intrinsic
    def dot(typingctx, blk, x, out):
        def codegen(context, builder, sig, args):
            v = simd._Vec(builder)
            ops = simd._Operands(context, builder, sig, args, blk=0, x=1, out=2)
            zero = simd._I64(0)
            main, aux = reader.unpack(v, ops.bytes_at("blk", zero))(ops.bytes_at("x", zero), None)
            builder.store(main, builder.bitcast(ops.bytes_at("out", zero), simd._I32X8.as_pointer()), align=1)
            return context.get_dummy_value()
        return types.none(blk, x, out), codegen

    @njit
    def run(blk, x, out):
        dot(blk, x, out)
    return run


@pytest.mark.parametrize("name", list(READERS))
@pytest.mark.parametrize("avx2", [True, False], ids=["x86", "plain"])
def test_block_sum_is_the_exact_integer_dot(name, avx2, monkeypatch):
    if avx2 and not simd._target_has_avx2():
        pytest.skip("the target has no AVX2")
    monkeypatch.setattr(simd, "_target_has_avx2", lambda: avx2)    # read when the kernel compiles
    rng = np.random.default_rng(7)
    kernel = main_sum_kernel(READERS[name])
    rows = random_rows(name, 4, 256, rng)
    for blk in rows:
        d = np.float64(blk[:2].view(np.float16)[0])
        codes = quants.dequantize(blk, Q(type_id(name))).astype(np.float64) * 8 / d
        assert np.array_equal(codes, np.round(codes))
        x = rng.integers(-127, 128, 256).astype(np.int8)
        out = np.zeros(8, np.int32)
        kernel(np.ascontiguousarray(blk), x, out)
        assert int(out.astype(np.int64).sum()) == int(codes.astype(np.int64) @ x.astype(np.int64))
