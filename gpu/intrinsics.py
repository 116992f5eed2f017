"""The few device primitives the kernels need that Numba CUDA does not spell directly.

Each has two bodies: the real one (an intrinsic, libdevice or warp shuffles) and a plain-Python
twin for the CUDA simulator, which has no shuffles, no libdevice and no inline PTX. The twin is
picked when this module is imported, which is after numba.cuda has chosen its mode.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, uint32

from .device import simulated

FULL_MASK = 0xFFFFFFFF

if not simulated():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    @intrinsic
    def _ld_nc_v4_u32(typingctx, array, row, col):
        """ld.global.nc.v4.u32 of array[row, col:col+4]: one 16-byte load per lane."""
        if not (isinstance(array, types.Array) and array.dtype == types.uint32 and array.ndim == 2):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            aryty, rowty, colty = sig.args
            ary, r, c = args
            indices = [context.cast(builder, r, rowty, types.intp),
                       context.cast(builder, c, colty, types.intp)]
            arystruct = context.make_array(aryty)(context, builder, value=ary)
            ptr = cgutils.get_item_pointer(context, builder, aryty, arystruct, indices)
            i32 = ir.IntType(32)
            fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ptr.type])
            asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
                               "=r,=r,=r,=r,l")
            words = builder.call(asm, [ptr])
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_value(words, k) for k in range(4)])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_u32x4(array, row, col):
        """array[row, col:col+4] in one load; col % 4 == 0 and rows 16-byte aligned."""
        return _ld_nc_v4_u32(array, row, col)

    @intrinsic
    def _cvt_f32_f16(typingctx, bits):
        """cvt.f32.f16 of the low 16 bits of an integer: the fp16 value they encode."""
        if not isinstance(bits, types.Integer):
            return None
        sig = types.float32(bits)

        def codegen(context, builder, sig, args):
            (value,) = args
            i16 = ir.IntType(16)
            if value.type.width > 16:
                value = builder.trunc(value, i16)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [i16]), "cvt.f32.f16 $0, $1;", "=f,h")
            return builder.call(asm, [value])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def f16_bits_to_f32(bits):
        """The float32 value of the fp16 whose bits are the low 16 bits of `bits`."""
        return _cvt_f32_f16(bits)

    @cuda.jit(device=True, inline=True)
    def bits_to_f32(bits):
        """The float32 whose bit pattern is `bits` (a free register reinterpretation)."""
        return cuda.libdevice.int_as_float(np.int32(bits))

    def device_function(pyfunc):
        """A device function, inlined into its caller by Numba."""
        return cuda.jit(device=True, inline=True)(pyfunc)

    @cuda.jit(device=True, inline=True)
    def fma(a, b, c):
        return cuda.fma(a, b, c)

    @cuda.jit(device=True, inline=True)
    def warp_reduce(acc):
        """acc[r, s] = its sum over the warp's 32 lanes, in every lane. A fixed butterfly: each
        result depends only on the 32 inputs, never on the array's shape."""
        for r in range(acc.shape[0]):
            for s in range(acc.shape[1]):
                value = acc[r, s]
                offset = 16
                while offset > 0:
                    value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
                    offset >>= 1
                acc[r, s] = value

else:

    def device_function(pyfunc):
        # Plain Python: the simulator's own device-function calls cost ~10 us each, and the
        # helpers need nothing from the simulated `cuda` module.
        return pyfunc

    def fma(a, b, c):
        return np.float32(np.float32(a) * np.float32(b) + np.float32(c))

    def load_u32x4(array, row, col):
        assert col % 4 == 0, "vector load must be 16-byte aligned"
        return (array[row, col], array[row, col + 1], array[row, col + 2], array[row, col + 3])

    def bits_to_f32(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    def f16_bits_to_f32(bits):
        return np.float32(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    @cuda.jit(device=True)
    def warp_reduce(acc):
        # The simulator has no shuffles: pass values through shared memory, same butterfly.
        scratch = cuda.shared.array((1024, 64), np.float32)
        tid = cuda.threadIdx.x
        base = tid - (tid & 31)
        cuda.syncthreads()
        scratch[tid, :acc.size] = acc.reshape(-1)
        cuda.syncthreads()
        lanes = scratch[base:base + 32, :acc.size].copy()
        offset = 16
        while offset > 0:
            lanes = (lanes + lanes[np.arange(32) ^ offset]).astype(np.float32)
            offset >>= 1
        acc[...] = lanes[tid & 31].reshape(acc.shape)


MAGIC = uint32(0x4B000000)  # float32 bits of 2**23: OR-ing an integer v < 2**23 into the
MAGIC_F = float32(8388608.0)  # mantissa gives exactly 2**23 + v


@device_function
def small_uint_to_f32(v, bias):
    """float32(v) - bias for an integer 0 <= v < 2**23, without I2F.

    Int-to-float conversion runs at a quarter of the FP32 rate on Hopper and would cap the
    quantised matvecs; OR-ing into the mantissa of 2**23 and subtracting is exact and costs one
    logic op plus one add. `bias` folds the format's zero point (8, 32, 128) into that add.
    """
    return bits_to_f32(uint32(v) | MAGIC) - (MAGIC_F + bias)
