"""cpu.simd's 16-entry code-table lookup (IQ4_NL, MXFP4 weights) on both of its code paths:
`vpshufb` where the target has AVX2, a tree of selects elsewhere. The row-dot tests reach only
the path of the machine they run on; here the other one is emitted as well, by telling `_Vec`
that the target lacks AVX2 (the select tree is plain IR: it runs on any machine)."""
import numpy as np
import pytest
from numba import njit, types
from numba.core.extending import intrinsic

import cpu.simd as simd


def lookup_kernel(table):
    """A fresh (uncached) kernel: out[j] = table[codes[j]] for 32 codes, through `_lookup16`."""
    @intrinsic
    def lookup(typingctx, codes, out):
        def codegen(context, builder, sig, args):
            v = simd._Vec(builder)
            ops = simd._Operands(context, builder, sig, args, codes=0, out=1)
            idx = v.load(ops.bytes_at("codes", simd._I64(0)), 0, simd._U8X32)
            dst = builder.bitcast(ops.bytes_at("out", simd._I64(0)), simd._U8X32.as_pointer())
            builder.store(simd._lookup16(v, idx, table), dst, align=1)
            return context.get_dummy_value()
        return types.none(codes, out), codegen

    @njit
    def run(codes, out):
        lookup(codes, out)
    return run


@pytest.mark.parametrize("table", [simd.IQ4NL_KVALUES, simd.MXFP4_KVALUES], ids=["IQ4_NL", "MXFP4"])
@pytest.mark.parametrize("avx2", [True, False], ids=["vpshufb", "selects"])
def test_every_code_reads_its_table_entry(table, avx2, monkeypatch):
    if avx2 and not simd._target_has_avx2():
        pytest.skip("the target has no AVX2")
    monkeypatch.setattr(simd, "_target_has_avx2", lambda: avx2)    # read when the kernel compiles
    codes = np.concatenate([np.arange(16), np.arange(15, -1, -1)]).astype(np.uint8)   # both 128-bit halves
    out = np.zeros(32, np.int8)
    lookup_kernel(table)(codes, out)
    np.testing.assert_array_equal(out, np.array(table, np.int8)[codes])
