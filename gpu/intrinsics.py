"""The few device primitives the kernels need that Numba CUDA does not spell directly.

Each has two bodies: the real one (an intrinsic, libdevice or warp shuffles) and a plain-Python
twin for the CUDA simulator, which has no shuffles, no libdevice and no inline PTX. The twin is
picked when this module is imported, which is after numba.cuda has chosen its mode.
"""
from __future__ import annotations

import numpy as np
from numba import cuda, float32, int64, uint32, uint64

from .mma_layout import pack_halves, warp_mma
from .runtime.device import simulated

FULL_MASK = 0xFFFFFFFF

if not simulated():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.cudadrv import nvvm
    from numba.cuda.extending import intrinsic

    def asm_u32x3(template: str, result=types.uint32):
        """An intrinsic for one PTX instruction on three 32-bit integer operands: `template`
        names the result $0 and the operands $1-$3, e.g. "dp4a.s32.s32 $0, $1, $2, $3;". The
        operands are cast to `result`'s type, which the intrinsic returns."""
        @intrinsic
        def instruction(typingctx, a, b, c):
            if not all(isinstance(t, types.Integer) for t in (a, b, c)):
                return None
            sig = result(a, b, c)

            def codegen(context, builder, sig, args):
                i32 = ir.IntType(32)
                values = [context.cast(builder, v, t, result) for v, t in zip(args, sig.args)]
                asm = ir.InlineAsm(ir.FunctionType(i32, [i32] * 3), template, "=r,r,r,r")
                return builder.call(asm, values)

            return sig, codegen
        return instruction

    def _element_pointer(context, builder, sig, args):
        """Pointer to array[row, col] for an intrinsic taking (array, row, col)."""
        aryty, rowty, colty = sig.args
        ary, r, c = args
        indices = [context.cast(builder, r, rowty, types.intp),
                   context.cast(builder, c, colty, types.intp)]
        arystruct = context.make_array(aryty)(context, builder, value=ary)
        return cgutils.get_item_pointer(context, builder, aryty, arystruct, indices)

    def _ld_nc_v4(context, builder, sig, ptr):
        """ld.global.nc.v4.u32 at ptr, as the intrinsic's 4-tuple of uint32."""
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.LiteralStructType([i32] * 4), [ptr.type])
        asm = ir.InlineAsm(fnty, "ld.global.nc.v4.u32 {$0, $1, $2, $3}, [$4];",
                           "=r,=r,=r,=r,l")
        words = builder.call(asm, [ptr])
        return context.make_tuple(builder, sig.return_type,
                                  [builder.extract_value(words, k) for k in range(4)])

    def _is_u32_array(array, ndim):
        return isinstance(array, types.Array) and array.dtype == types.uint32 and array.ndim == ndim

    @intrinsic
    def _ld_nc_v4_u32(typingctx, array, row, col):
        """ld.global.nc.v4.u32 of array[row, col:col+4]: one 16-byte load per lane."""
        if not _is_u32_array(array, 2):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            return _ld_nc_v4(context, builder, sig, _element_pointer(context, builder, sig, args))

        return sig, codegen

    @intrinsic
    def _ld_nc_v4_u32_row(typingctx, array, col):
        """ld.global.nc.v4.u32 of array[col:col+4] (a 1-D array)."""
        if not _is_u32_array(array, 1):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, col)

        def codegen(context, builder, sig, args):
            aryty, colty = sig.args
            arystruct = context.make_array(aryty)(context, builder, value=args[0])
            ptr = builder.gep(arystruct.data, [context.cast(builder, args[1], colty, types.intp)])
            return _ld_nc_v4(context, builder, sig, ptr)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_u32x4(array, row, col):
        """array[row, col:col+4] in one load; col % 4 == 0 and rows 16-byte aligned."""
        return _ld_nc_v4_u32(array, row, col)

    @cuda.jit(device=True, inline=True)
    def load_row_u32x4(array, col):
        """array[col:col + 4] of a 1-D uint32 array in one load; 16-byte aligned."""
        return _ld_nc_v4_u32_row(array, col)

    @intrinsic
    def _ld_nc_16_bytes(typingctx, array, row, col):
        """The 16 bytes at &array[row, col] (any alignment) as four little-endian words.

        Five aligned 4-byte loads cover them (the fifth is the word holding the last byte, so
        nothing outside the array is read), and one funnel shift per word drops the bytes
        before the start. This is for 2-byte aligned blocks (Q6_K, Q8_0, Q4_0): five loads
        instead of eight 16-bit ones.
        """
        if not (isinstance(array, types.Array) and array.dtype == types.uint8 and array.ndim == 2):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, row, col)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig, args)
            i32, i64 = ir.IntType(32), ir.IntType(64)
            addr = builder.ptrtoint(ptr, i64)
            first = builder.and_(addr, ir.Constant(i64, ~3))
            last = builder.and_(builder.add(addr, ir.Constant(i64, 15)), ir.Constant(i64, ~3))
            # one asm block, so that the four consecutive words use immediate offsets
            load = ir.InlineAsm(ir.FunctionType(ir.LiteralStructType([i32] * 5), [i64, i64]),
                                "ld.global.nc.u32 $0, [$5];\n\tld.global.nc.u32 $1, [$5+4];\n\t"
                                "ld.global.nc.u32 $2, [$5+8];\n\tld.global.nc.u32 $3, [$5+12];\n\t"
                                "ld.global.nc.u32 $4, [$6];", "=r,=r,=r,=r,=r,l,l")
            loaded = builder.call(load, [first, last])
            words = [builder.extract_value(loaded, k) for k in range(5)]
            shift = builder.trunc(builder.shl(builder.and_(addr, ir.Constant(i64, 3)), ir.Constant(i64, 3)), i32)
            funnel = ir.InlineAsm(ir.FunctionType(i32, [i32, i32, i32]), "shf.r.wrap.b32 $0, $1, $2, $3;",
                                  "=r,r,r,r")
            out = [builder.call(funnel, [words[k], words[k + 1], shift]) for k in range(4)]
            return context.make_tuple(builder, sig.return_type, out)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_u32x4_unaligned(array8, row, col):
        """array8[row, col:col+16] (uint8, any alignment) as four little-endian uint32 words."""
        return _ld_nc_16_bytes(array8, row, col)

    @intrinsic
    def _lshr_u32(typingctx, x, n):
        if not (isinstance(x, types.Integer) and isinstance(n, types.Integer)):
            return None
        sig = types.uint32(x, n)

        def codegen(context, builder, sig, args):
            value, amount = (context.cast(builder, v, t, types.uint32) for v, t in zip(args, sig.args))
            return builder.lshr(value, amount)

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def shr_u32(x, n):
        """uint32(x) >> n as one 32-bit shift, 0 <= n < 32 (Numba would widen a variable shift to
        64 bits: two instructions)."""
        return _lshr_u32(x, n)

    _dp4a = asm_u32x3("dp4a.s32.s32 $0, $1, $2, $3;", types.int32)

    @cuda.jit(device=True, inline=True)
    def dp4a(a, b, c):
        """c + Σ_k a.byte[k]·b.byte[k], bytes as int8 (int32 result): four int8 products in one op."""
        return _dp4a(a, b, c)

    @cuda.jit(device=True, inline=True)
    def round_to_int(v):
        """v rounded to the nearest int32, ties to even (one cvt.rni)."""
        return cuda.libdevice.float2int_rn(v)

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
    def group_reduce(acc, width):
        """acc[r, s] = its sum over the lane's group of `width` consecutive lanes (a power of two
        up to 32), in every lane of the group. A fixed butterfly: each result depends only on the
        group's inputs, never on the array's shape or on the other groups."""
        for r in range(acc.shape[0]):
            for s in range(acc.shape[1]):
                value = acc[r, s]
                offset = width >> 1
                while offset > 0:
                    value += cuda.shfl_xor_sync(FULL_MASK, value, offset)
                    offset >>= 1
                acc[r, s] = value

    @cuda.jit(device=True, inline=True)
    def warp_reduce(acc):
        """acc[r, s] = its sum over the warp's 32 lanes, in every lane (group_reduce)."""
        group_reduce(acc, 32)

    @cuda.jit(device=True, inline=True)
    def warp_max_u64(value):
        """The largest of the warp's 32 uint64 values, in every lane."""
        offset = 16
        while offset > 0:
            other = uint64(cuda.shfl_xor_sync(FULL_MASK, int64(value), offset))
            value = max(value, other)
            offset >>= 1
        return value

    @cuda.jit(device=True, inline=True)
    def warp_max_f32(value):
        """The largest of the warp's 32 float32 values, in every lane."""
        offset = 16
        while offset > 0:
            value = max(value, cuda.shfl_xor_sync(FULL_MASK, value, offset))
            offset >>= 1
        return value

    # ---- tensor-core GEMM (gpu/matmul/gemm_mma.py) ------------------------------------------------------

    @intrinsic
    def _cvt_rn_f16x2_f32(typingctx, lo, hi):
        """cvt.rn.f16x2.f32: two floats rounded to fp16 (nearest even; beyond ±65504: ±inf)
        in one word. PTX puts its first source in the upper half, so `hi` goes first."""
        if not (isinstance(lo, types.Float) and isinstance(hi, types.Float)):
            return None
        sig = types.uint32(lo, hi)

        def codegen(context, builder, sig, args):
            lo_v, hi_v = (context.cast(builder, v, t, types.float32) for v, t in zip(args, sig.args))
            f32 = ir.FloatType()
            asm = ir.InlineAsm(ir.FunctionType(ir.IntType(32), [f32, f32]), "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f")
            return builder.call(asm, [hi_v, lo_v])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def pack_f16x2(lo, hi):
        """A word holding fp16(lo) in its low 16 bits and fp16(hi) in its high 16 bits."""
        return _cvt_rn_f16x2_f32(lo, hi)

    @intrinsic
    def _mma_m16n8k16(typingctx, a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 of one warp (gpu/mma_layout.py)."""
        words, accs = (a0, a1, a2, a3, b0, b1), (c0, c1, c2, c3)
        if not (all(isinstance(v, types.Integer) for v in words) and all(isinstance(v, types.Float) for v in accs)):
            return None
        sig = types.UniTuple(types.float32, 4)(*words, *accs)

        def codegen(context, builder, sig, args):
            ins = [context.cast(builder, v, t, types.uint32) for v, t in zip(args[:6], sig.args[:6])]
            ins += [context.cast(builder, v, t, types.float32) for v, t in zip(args[6:], sig.args[6:])]
            i32, f32 = ir.IntType(32), ir.FloatType()
            fnty = ir.FunctionType(ir.LiteralStructType([f32] * 4), [i32] * 6 + [f32] * 4)
            asm = ir.InlineAsm(fnty, "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                                     "{$0, $1, $2, $3}, {$4, $5, $6, $7}, {$8, $9}, {$10, $11, $12, $13};",
                               "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f")
            # convergent: the whole warp executes it together, so it must not be moved into
            # (or out of) control flow that the lanes might take differently
            d = builder.call(asm, ins, attrs=("convergent",))
            return context.make_tuple(builder, sig.return_type, [builder.extract_value(d, k) for k in range(4)])

        return sig, codegen

    @intrinsic
    def _ld_cg_f32(typingctx, array, row, col):
        """ld.global.cg.f32 of array[row, col] (float32 2-D): cached in L2 only."""
        if not (isinstance(array, types.Array) and array.dtype == types.float32 and array.ndim == 2):
            return None
        sig = types.float32(array, row, col)

        def codegen(context, builder, sig, args):
            ptr = _element_pointer(context, builder, sig, args)
            asm = ir.InlineAsm(ir.FunctionType(ir.FloatType(), [ptr.type]), "ld.global.cg.f32 $0, [$1];", "=f,l")
            return builder.call(asm, [ptr])

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_f32_l2(array, row, col):
        """array[row, col] read from L2, past the SM's own L1 (which is not kept coherent): for
        values other blocks of the running kernel wrote (and fenced) after it started."""
        return _ld_cg_f32(array, row, col)

    @cuda.jit(device=True, inline=True)
    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        """(d0, d1, d2, d3) = this lane's part of D = A·B + C for a 16×16 fp16 A (registers
        a0..a3, two fp16 each), a 16×8 fp16 B (b0, b1) and float32 C: every lane of the warp
        must call it together. Who holds what: gpu/mma_layout.py."""
        return _mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3)

    @intrinsic
    def _st_v4_u32(typingctx, array, index, w0, w1, w2, w3):
        """One 16-byte store of four words at array[index:index + 4] (1-D uint32 array)."""
        if not (isinstance(array, types.Array) and array.dtype == types.uint32 and array.ndim == 1):
            return None
        sig = types.void(array, index, w0, w1, w2, w3)

        def codegen(context, builder, sig, args):
            aryty = sig.args[0]
            ary = context.make_array(aryty)(context, builder, value=args[0])
            at = context.cast(builder, args[1], sig.args[1], types.intp)
            ptr = cgutils.get_item_pointer(context, builder, aryty, ary, [at])
            vecty = ir.VectorType(ir.IntType(32), 4)
            vec = ir.Constant(vecty, ir.Undefined)
            for k in range(4):
                word = context.cast(builder, args[2 + k], sig.args[2 + k], types.uint32)
                vec = builder.insert_element(vec, word, ir.Constant(ir.IntType(32), k))
            builder.store(vec, builder.bitcast(ptr, vecty.as_pointer()), align=16)
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def store_u32x4(array, index, w0, w1, w2, w3):
        """array[index:index + 4] = w0..w3 in one store; index % 4 == 0 and the array 16-byte
        aligned (in shared memory: a quarter of the wavefronts of four 4-byte stores)."""
        _st_v4_u32(array, index, w0, w1, w2, w3)

    # ---- lookup tables (gpu/matmul/quants.py) ----------------------------------------------------------

    _table_names: set[str] = set()

    def device_table(name: str, words: np.ndarray):
        """A device function returning `words` (1-D uint32) as an array in global memory.

        Numba puts a module-level array in __constant__ space, which serves one address per warp
        per cycle: lanes reading different entries of a grid serialise up to 32-way. A global
        array goes through L1 and serves a warp's scattered reads in a few transactions (what
        llama.cpp's CUDA grids do). The global is constant, so NVVM reads it with ld.global.nc.
        `name` names it: it is defined once per LLVM module however many call sites name it.
        """
        assert name not in _table_names, f"two device tables named {name}: a kernel would get one of them"
        _table_names.add(name)
        data = np.ascontiguousarray(words, dtype=np.uint32)
        assert data.ndim == 1
        arytype = types.Array(types.uint32, 1, "C")

        @intrinsic
        def _table(typingctx):
            sig = arytype()

            def codegen(context, builder, sig, args):
                module = builder.module
                try:
                    gv = module.get_global(name)
                except KeyError:
                    i32 = ir.IntType(32)
                    init = ir.Constant(ir.ArrayType(i32, data.size), [ir.Constant(i32, int(v)) for v in data])
                    gv = cgutils.add_global_variable(module, init.type, name, addrspace=nvvm.ADDRSPACE_GLOBAL)
                    gv.linkage = "internal"
                    gv.global_constant = True
                    gv.initializer = init
                    gv.align = 16
                generic = builder.addrspacecast(gv, ir.PointerType(ir.IntType(8)), "generic")
                ary = context.make_array(arytype)(context, builder)
                context.populate_array(ary, data=builder.bitcast(generic, ary.data.type),
                                       shape=[context.get_constant(types.intp, data.size)],
                                       strides=[context.get_constant(types.intp, 4)],
                                       itemsize=context.get_constant(types.intp, 4), meminfo=None)
                return ary._getvalue()

            return sig, codegen

        @cuda.jit(device=True, inline=True)
        def table():
            return _table()
        return table

    @cuda.jit(device=True, inline=True)
    def byte_perm(x, y, s):
        """Byte k (k = 0..3) of the result is byte (s >> 4k) & 7 of the 8-byte y:x (x bytes 0..3):
        one PRMT (libdevice masks the selector, so bit 3 of each nibble is ignored)."""
        return uint32(cuda.libdevice.byte_perm(np.int32(x), np.int32(y), np.int32(s)))

    # ---- int8 matvec (gpu/matmul/quants_q8.py) -----------------------------------------------------------

    _dp4a_us = asm_u32x3("dp4a.u32.s32 $0, $1, $2, $3;", types.int32)

    @cuda.jit(device=True, inline=True)
    def dp4a_us(a, b, c):
        """c + Σ_k a.byte[k]·b.byte[k], a's bytes as uint8 (0..255), b's as int8: lets a weight
        nibble stay in the high half of its byte (16·q) with no shift."""
        return _dp4a_us(a, b, c)

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

    def load_row_u32x4(array, col):
        assert col % 4 == 0, "vector load must be 16-byte aligned"
        return array[col], array[col + 1], array[col + 2], array[col + 3]

    def load_f32_l2(array, row, col):
        return array[row, col]

    def bits_to_f32(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0]

    def f16_bits_to_f32(bits):
        return np.float32(np.array([int(bits) & 0xFFFF], dtype=np.uint16).view(np.float16)[0])

    def load_u32x4_unaligned(array8, row, col):
        b = [int(array8[row, col + k]) for k in range(16)]
        return tuple(np.uint32(b[4 * k] | b[4 * k + 1] << 8 | b[4 * k + 2] << 16 | b[4 * k + 3] << 24)
                     for k in range(4))

    def shr_u32(x, n):
        return np.uint32(int(x) >> int(n))

    def dp4a(a, b, c):
        a, b, total = int(a), int(b), int(np.int32(c))
        for k in range(4):
            x, y = (a >> 8 * k) & 0xFF, (b >> 8 * k) & 0xFF
            total += (x - 256 if x > 127 else x) * (y - 256 if y > 127 else y)
        return np.int32(total)

    def round_to_int(v):
        return np.int32(np.rint(np.float32(v)))

    @cuda.jit(device=True)
    def group_reduce(acc, width):
        # The simulator has no shuffles: pass values through shared memory, same butterfly.
        scratch = cuda.shared.array((1024, 64), np.float32)
        tid = cuda.threadIdx.x
        base = tid - (tid & 31)
        cuda.syncthreads()
        scratch[tid, :acc.size] = acc.reshape(-1)
        cuda.syncthreads()
        lanes = scratch[base:base + 32, :acc.size].copy()
        offset = width >> 1
        while offset > 0:
            lanes = (lanes + lanes[np.arange(32) ^ offset]).astype(np.float32)
            offset >>= 1
        acc[...] = lanes[tid & 31].reshape(acc.shape)

    @cuda.jit(device=True)
    def warp_reduce(acc):
        group_reduce(acc, 32)

    def _lanes_max(scratch, value):
        # the simulator keys a shared array by the line that asks for it, so each caller passes
        # its own (one per dtype)
        tid = cuda.threadIdx.x
        base = tid - (tid & 31)
        cuda.syncthreads()
        scratch[tid] = value
        cuda.syncthreads()
        return scratch.dtype.type(scratch[base:base + 32].max())

    @cuda.jit(device=True)
    def warp_max_u64(value):
        return _lanes_max(cuda.shared.array(1024, np.uint64), value)

    @cuda.jit(device=True)
    def warp_max_f32(value):
        return _lanes_max(cuda.shared.array(1024, np.float32), value)

    # ---- tensor-core GEMM (gpu/matmul/gemm_mma.py): plain-Python stand-ins ------------------------------

    def pack_f16x2(lo, hi):
        return np.uint32(pack_halves(lo, hi))

    @cuda.jit(device=True)
    def mma_m16n8k16(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
        # The simulator has no tensor cores: the warp's lanes pass their registers through
        # shared memory and each computes the warp's D from the PTX fragment layout
        # (gpu/mma_layout.py), then keeps its own part.
        words = cuda.shared.array((1024, 6), np.uint32)
        accs = cuda.shared.array((1024, 4), np.float32)
        tid = cuda.threadIdx.x
        base = tid - (tid & 31)
        words[tid] = (a0, a1, a2, a3, b0, b1)
        accs[tid] = (c0, c1, c2, c3)
        cuda.syncthreads()
        d = warp_mma(words[base:base + 32, :4], words[base:base + 32, 4:], accs[base:base + 32])[tid & 31]
        cuda.syncthreads()          # every lane has read before the next call writes
        return d[0], d[1], d[2], d[3]

    def store_u32x4(array, index, w0, w1, w2, w3):
        assert index % 4 == 0, "vector store must be 16-byte aligned"
        array[index:index + 4] = (w0, w1, w2, w3)

    def device_table(name: str, words: np.ndarray):
        data = np.ascontiguousarray(words, dtype=np.uint32)
        return lambda: data

    def byte_perm(x, y, s):
        both = int(x) | (int(y) << 32)
        s = int(s)
        return np.uint32(sum(((both >> (8 * ((s >> (4 * k)) & 7))) & 0xFF) << (8 * k) for k in range(4)))

    def dp4a_us(a, b, c):
        a, b, total = int(a), int(b), int(np.int32(c))
        for k in range(4):
            y = (b >> 8 * k) & 0xFF
            total += ((a >> 8 * k) & 0xFF) * (y - 256 if y > 127 else y)
        return np.int32(total)


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


SIGNED_MAGIC = 0x4B400000             # float32 bits of 1.5 * 2**23: adding an integer |v| < 2**22
SIGNED_MAGIC_F = float32(12582912.0)  # to them gives exactly 1.5 * 2**23 + v


@device_function
def small_int_to_f32(v):
    """float32(v) for an int32 |v| < 2**22 (a dp4a sum), without I2F: one integer add plus one
    float subtract, both at the full rate (see small_uint_to_f32)."""
    return bits_to_f32(uint32(v + SIGNED_MAGIC)) - SIGNED_MAGIC_F
