"""cpu.simd's IQ2 grid readers (IQ2_XXS, IQ2_XS, IQ2_S) on both code paths: the x86 one
(`vpmaddubsw`, `vpsignb`, `vpmaddwd`) where the target has AVX2, plain vector IR elsewhere. The
row-dot tests reach only the path of the machine they run on; here the other one is emitted as
well, by telling `_Vec` the target lacks AVX2. Oracle: gguf-py's dequantisation, whose weights are
(d/8)·(integer code) exactly, so the reader's integer sum must equal Σ code·x exactly."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf import quants
from numba import njit, types
from numba.core.extending import intrinsic

import cpu.simd as simd

from .quant_data import random_rows, type_id

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
