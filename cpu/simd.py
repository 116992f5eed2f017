"""SIMD building blocks for the quantised dot products: Numba intrinsics that emit LLVM vector IR.

Why intrinsics: Numba has no vector types, and LLVM's loop vectoriser, left alone, picks 128-bit
multiply-adds, re-does the weight unpacking for every input slot and cannot keep block scales out
of the inner loop. Here the code per weight (super-)block serves G input slots: the weights are
unpacked once into registers and reused by every slot, and the products are integer (activations
are int8, see `cpu.activations`), so every slot's sums are exact and independent of how slots are
grouped — which is what makes per-slot bit identity hold by construction. A slot keeps its
blocks' float parts in 8 lanes and sums the lanes once per row, in one fixed tree. The row
dot (`row_dot_intrinsic`) is one intrinsic with the type and group dispatch inside.

On x86 with AVX2 the multiply-adds are `vpmaddubsw` (u8·i8 → i16 pair sums) and `vpmaddwd`
(i16·i16 → i32 pair sums), the same instructions llama.cpp uses for Q4_K·Q8_K, plus `vpdpbusd`
for the 32-element block types (Q8_0, Q4_0, Q5_0, IQ4_NL, MXFP4; Q4_1, Q5_1 with their min
on Q8_1's s) where VNNI exists, and
`vpshufb` for the 16-entry code tables (IQ4_NL, IQ4_XS, MXFP4), and rows of constant grid tables
in the module for the grid types (IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S, IQ1_M); with AVX-512 BW and GFNI, Q4_K
goes two sub-blocks at a time in 512-bit registers (its lanes then fold onto the 256-bit ones,
same integers), and with AVX512-VNNI the 32-element block types go two blocks per 512-bit
`vpdpbusd` (`_SmallBlocks._pairs`: same lanes, same bits as one block per 256-bit one). LLVM
keeps such explicit 512-bit IR in zmm registers (Numba sets no "min-legal-vector-width" or
"prefer-vector-width" attribute, so the host CPU's 256-bit preference only steers the loop
vectoriser). Elsewhere the
same arithmetic is written as plain vector IR (exact as well: no pair sum here can saturate, see
`cpu.activations.QMAX`). Offsets are in elements of the array they index; no bounds are checked
here (the Python entry points validate shapes first).

The kernels that inline these intrinsics live in other files (cpu/matvec.py, cpu/ffn.py,
cpu/quants.py, cpu/matmul.py, cpu/moe_kernel.py, cpu/activations.py), whose Numba cache stamps
would not see an edit here: the cache folder is per version of all kernel sources
(cpu/kernel_cache.py), so such an edit recompiles them.

Block layouts: docs/MODEL_FORMAT.md §6.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import llvmlite.binding as llvm
import numpy as np
from gguf import quants as _gguf_quants
from llvmlite import ir
from numba import types
from numba.core import cgutils, config
from numba.core.extending import intrinsic

_I1, _I8, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()
_U8X32 = ir.VectorType(_I8, 32)
_U8X64 = ir.VectorType(_I8, 64)
_I16X16 = ir.VectorType(_I16, 16)
_I32X8 = ir.VectorType(_I32, 8)
_F32X8 = ir.VectorType(_F32, 8)


def _target_features() -> set[str]:
    """The x86 features Numba compiles for (same source as Numba's codegen); empty elsewhere."""
    if (config.CPU_NAME or "").lower() == "generic" or not llvm.get_process_triple().startswith("x86_64"):
        return set()
    features = config.CPU_FEATURES
    if features is None:
        features = llvm.get_host_cpu_features().flatten()
    return {f[1:] for f in features.split(",") if f.startswith("+")}


def _target_has_32_vector_registers() -> bool:
    """Whether our 256-bit byte and word code may use 32 vector registers: the EVEX forms of its
    instructions need AVX512-BW and -VL (AVX2 alone has 16). Read when a kernel compiles."""
    return {"avx512bw", "avx512vl"} <= _target_features()


def _target_has_avx2() -> bool:
    return "avx2" in _target_features()


def _half_to_float(builder: ir.IRBuilder, h):
    """IEEE half bit patterns (i16, or a vector of them) → float32, exactly. With F16C this is
    one `vcvtph2ps`; without it LLVM would call a runtime helper the JIT does not provide, so the
    bits are rebuilt by hand (normal numbers rebias the exponent; subnormals are m·2⁻²⁴)."""
    vec = isinstance(h.type, ir.VectorType)
    i32 = ir.VectorType(_I32, h.type.count) if vec else _I32
    f32 = ir.VectorType(_F32, h.type.count) if vec else _F32
    if "f16c" in _target_features():
        return builder.fpext(builder.bitcast(h, ir.VectorType(ir.HalfType(), h.type.count) if vec else ir.HalfType()), f32)

    def c(value, ty=i32):
        return ir.Constant(ty, [ty.element(value)] * ty.count) if vec else ir.Constant(ty, value)

    b = builder
    u = b.zext(h, i32)
    sign = b.shl(b.and_(u, c(0x8000)), c(16))
    em = b.and_(u, c(0x7FFF))
    normal = b.add(b.shl(em, c(13)), c((127 - 15) << 23))
    special = b.or_(c(0x7F800000), b.shl(b.and_(em, c(0x3FF)), c(13)))
    bits = b.select(b.icmp_unsigned(">=", em, c(0x7C00)), special, normal)
    tiny = b.bitcast(b.fmul(b.sitofp(em, f32), c(2.0 ** -24, f32)), i32)
    bits = b.select(b.icmp_unsigned("<", em, c(0x0400)), tiny, bits)
    return b.bitcast(b.or_(bits, sign), f32)


def _target_has_vnni() -> bool:
    """256-bit VNNI (`vpdpbusd` on ymm): AVX-VNNI, or AVX512-VNNI with AVX512-VL."""
    f = _target_features()
    return "avx2" in f and ("avxvnni" in f or {"avx512vnni", "avx512vl"} <= f)


def _target_has_zmm_vnni() -> bool:
    """512-bit `vpdpbusd` (AVX512-VNNI with AVX512-BW): the 32-weight block types take two blocks
    per multiply-add (`_SmallBlocks.emit_span`). A function of its own so tests can switch the
    256-bit path on where the machine has both."""
    return {"avx2", "avx512vnni", "avx512bw"} <= _target_features()


class _Vec:
    """Emits the vector operations the dot products need, into one IR builder."""

    def __init__(self, builder: ir.IRBuilder):
        self.b = builder
        self.avx2 = _target_has_avx2()
        self.vnni = self.avx2 and _target_has_vnni()
        # 512-bit weight units (Q4_K): two sub-blocks per multiply, nibbles split in one op
        self.zmm = self.vnni and {"avx512bw", "avx512vl", "gfni"} <= _target_features()
        # 512-bit `vpdpbusd` for two 32-weight blocks at a time (`dot_u8_i8_512`)
        self.zmm_vnni = self.avx2 and _target_has_zmm_vnni()

    # ---- memory --------------------------------------------------------------------------------
    def prefetch_span(self, ptr, distance, n_bytes: int):
        """Prefetch (into L1) the n_bytes that start `distance` bytes past ptr: one hint per 64 B,
        so consecutive blocks touch every cache line of the stream. Prefetches never fault."""
        fn = cgutils.get_or_insert_function(
            self.b.module, ir.FunctionType(ir.VoidType(), [_I8.as_pointer(), _I32, _I32, _I32]), "llvm.prefetch.p0")
        ahead = self.b.gep(ptr, [distance])
        for line in range(-(-n_bytes // 64)):
            self.b.call(fn, [self.b.gep(ahead, [_I64(64 * line)]), _I32(0), _I32(3), _I32(1)])

    def load(self, ptr, byte_off: int, ty):
        p = self.b.gep(ptr, [_I64(byte_off)]) if byte_off else ptr
        return self.b.load(self.b.bitcast(p, ty.as_pointer()), align=1)

    # ---- byte lanes ----------------------------------------------------------------------------
    @staticmethod
    def splat_const(ty, value):
        return ir.Constant(ty, [ty.element(value)] * ty.count)

    def and8(self, v, mask: int):
        return self.b.and_(v, self.splat_const(v.type, mask))

    def shr8(self, v, n: int):
        return self.b.lshr(v, self.splat_const(v.type, n)) if n else v

    def shl8(self, v, n: int):
        return self.b.shl(v, self.splat_const(v.type, n)) if n else v

    def bits8(self, v, shift: int, mask: int, to: int):
        """((v >> shift) & mask) << to, per byte."""
        return self.shl8(self.and8(self.shr8(v, shift), mask), to)

    # ---- multiply-adds -------------------------------------------------------------------------
    def _x86(self, name, ret, args):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ret, [a.type for a in args]), name)
        return self.b.call(fn, args)

    def _pair_sum(self, v, n_out):
        even = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n_out), list(range(0, 2 * n_out, 2))))
        odd = self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n_out), list(range(1, 2 * n_out, 2))))
        return self.b.add(even, odd)

    def maddubs(self, u, s):
        """u8 × i8 → i16, adjacent pairs summed (callers keep every pair sum below 2**15);
        32 or 64 bytes (64: AVX-512BW targets only, see `zmm`)."""
        n = u.type.count
        if n == 64:
            return self._x86("llvm.x86.avx512.pmaddubs.w.512", ir.VectorType(_I16, 32), [u, s])
        if self.avx2:
            return self._x86("llvm.x86.avx2.pmadd.ub.sw", _I16X16, [u, s])
        wide = ir.VectorType(_I16, n)
        return self._pair_sum(self.b.mul(self.b.zext(u, wide), self.b.sext(s, wide)), n // 2)

    def madd(self, a, c):
        """i16 × i16 → i32, adjacent pairs summed; 16 or 32 lanes in."""
        n = a.type.count
        if n == 32:
            return self._x86("llvm.x86.avx512.pmaddw.d.512", ir.VectorType(_I32, 16), [a, c])
        if self.avx2:
            return self._x86("llvm.x86.avx2.pmadd.wd", _I32X8, [a, c])
        wide = ir.VectorType(_I32, n)
        return self._pair_sum(self.b.mul(self.b.sext(a, wide), self.b.sext(c, wide)), n // 2)

    def nibbles64(self, q):
        """32 bytes → 64 unsigned nibbles: the low nibbles in lanes 0..31, the high in 32..63
        (one `vgf2p8affineqb` on the bytes loaded twice: a bit matrix per half)."""
        both = self.b.shuffle_vector(q, q, ir.Constant(ir.VectorType(_I32, 64), list(range(32)) * 2))
        low, high = 0x0102040800000000, 0x1020408000000000   # output bit i = input bit i / i + 4
        matrix = ir.Constant(ir.VectorType(_I64, 8), [low] * 4 + [high] * 4)
        return self._x86("llvm.x86.vgf2p8affineqb.512", _U8X64,
                         [both, self.b.bitcast(matrix, _U8X64), ir.Constant(_I8, 0)])

    def madd_sum(self, pairs):
        """Σ madd(a, c) over the (a, c) pairs of i16 vectors (16 or 32 lanes), as 8 or 16 i32
        lanes. With VNNI each madd after the first adds into the running sum in one `vpdpwssd` (a
        third fewer vector ops than madd + add). It is emitted as inline asm: LLVM's machine
        combiner otherwise splits the intrinsic back into vpmaddwd + vpaddd. Integer sums are
        exact, so either form gives the same lanes."""
        if not self.vnni:
            return self.tree([self.madd(a, c) for a, c in pairs], self.b.add)
        llvm.initialize_native_asmparser()        # inline asm needs it; Numba does not set it up
        # AVX512-VL: the EVEX form and all 32 registers; AVX-VNNI alone: the VEX form, which
        # the assembler only picks when told ("vpdpwssd" alone assembles as EVEX: SIGILL there)
        evex = "avx512vl" in _target_features()
        reg = "v" if evex else "x"
        ty_in, ty_out = pairs[0][0].type, ir.VectorType(_I32, pairs[0][0].type.count // 2)
        dpwssd = ir.InlineAsm(ir.FunctionType(ty_out, [ty_in, ty_in, ty_out]),
                              ("" if evex else "{vex} ") + "vpdpwssd $2, $1, $0", f"={reg},{reg},{reg},0")
        # two interleaved chains: one chain of 8 dependent vpdpwssd (5 cycles each) left the
        # Xeon waiting on latency; the best of 1, 2 and 4 chains in llvm-mca for Sapphire Rapids
        chains = []
        for i in range(min(2, len(pairs))):
            total = self.madd(*pairs[i])
            for a, c in pairs[i + 2::2]:
                total = self.b.call(dpwssd, [a, c, total])
            chains.append(total)
        return self.tree(chains, self.b.add)

    def dot_u8_i8(self, u, s):
        """Σ of each 4 adjacent u8·i8 products, as 8 i32 lanes (`vpdpbusd` with VNNI)."""
        if self.vnni:
            return self._x86("llvm.x86.avx512.vpdpbusd.256", _I32X8,
                             [ir.Constant(_I32X8, None), self.b.bitcast(u, _I32X8), self.b.bitcast(s, _I32X8)])
        return self.madd(self.maddubs(u, s), self.splat_const(_I16X16, 1))

    def dot_u8_i8_512(self, acc, u, s):
        """acc + Σ of each 4 adjacent u8·i8 products of 64-byte u, s, as 16 i32 lanes (one
        `vpdpbusd` on zmm; `zmm_vnni` targets only). No saturation: the sum wraps like an add."""
        i32x16 = ir.VectorType(_I32, 16)
        return self._x86("llvm.x86.avx512.vpdpbusd.512", i32x16,
                         [acc, self.b.bitcast(u, i32x16), self.b.bitcast(s, i32x16)])

    def abs8(self, v):
        fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(_U8X32, [_U8X32, _I1]), "llvm.abs.v32i8")
        return self.b.call(fn, [v, _I1(0)])

    def sign8(self, x, q):
        """x with the sign of q applied (0 where q == 0), per signed byte."""
        if self.avx2:
            return self._x86("llvm.x86.avx2.psign.b", _U8X32, [x, q])
        zero = ir.Constant(_U8X32, None)
        neg = self.b.select(self.b.icmp_signed("<", q, zero), self.b.sub(zero, x), x)
        return self.b.select(self.b.icmp_signed("==", q, zero), zero, neg)

    def negate_where(self, x, bits):
        """x (32 signed bytes) with byte j negated where bit j of the i32 `bits` is set: on AVX-512
        targets the bits become a mask register (`kmovd`) and each use one masked subtract, with
        no vector of ±1 bytes built by shuffles. |x| ≤ 127: no overflow."""
        mask = self.b.bitcast(bits, ir.VectorType(_I1, 32))
        return self.b.select(mask, self.b.sub(ir.Constant(_U8X32, None), x), x)

    def signed_dot32(self, q, x):
        """Σ q·x over 32 signed bytes as 8 i32 lanes (|q| ≤ 128, |x| ≤ 127: no saturation)."""
        return self.dot_u8_i8(self.abs8(q), self.sign8(x, q))

    # ---- lanes ---------------------------------------------------------------------------------
    def pick16(self, v, lanes):
        """A 16 x i16 vector made of lanes of v (a 16 x i16 vector)."""
        return self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 16), list(lanes)))

    def tree(self, values, add):
        """Sum a list pairwise ((a+b)+(c+d))…: short dependency chains, and a fixed order."""
        while len(values) > 1:
            values = [add(values[i], values[i + 1]) if i + 1 < len(values) else values[i]
                      for i in range(0, len(values), 2)]
        return values[0]

    def sums(self, vectors, add):
        """Lane i = the sum of vectors[i] (1 to 8 vectors of 8 lanes), reduced together:
        pairs of vectors are folded into one (each keeps half its lanes) until one is left, then
        that one is folded on itself. Every vector's lanes meet in the same pairwise tree
        (lane j + lane j+4, then j + j+2, then j + j+1) however many are reduced at once, so a
        float sum has the same bits for every slot-group size."""
        b = self.b
        count = len(vectors)
        padded = 1 << (count - 1).bit_length()
        if padded != count:
            # 3 slots (6 K-quant sums): zero vectors make a power of two; they never meet a real
            # vector's lanes in the folds, so every real lane keeps its bits; cut off at the end
            zero = ir.Constant(vectors[0].type, None)
            vec = self.sums(list(vectors) + [zero] * (padded - count), add)
            return self.lanes(vec, range(count))
        items = [(vec, 1, vec.type.count) for vec in vectors]   # (vector, groups, lanes per group)

        def halves(groups, size):
            lo = [g * size + j for g in range(groups) for j in range(size // 2)]
            return lo, [i + size // 2 for i in lo]

        def mask(idx):
            return ir.Constant(ir.VectorType(_I32, len(idx)), idx)

        while len(items) > 1:
            folded = []
            for (va, groups, size), (vb, _, _) in zip(items[0::2], items[1::2]):
                lo, hi = halves(groups, size)
                n = groups * size
                folded.append((add(b.shuffle_vector(va, vb, mask(lo + [n + i for i in lo])),
                                   b.shuffle_vector(va, vb, mask(hi + [n + i for i in hi]))), 2 * groups, size // 2))
            items = folded
        vec, groups, size = items[0]
        while size > 1:
            lo, hi = halves(groups, size)
            vec = add(b.shuffle_vector(vec, vec, mask(lo)), b.shuffle_vector(vec, vec, mask(hi)))
            size //= 2
        return vec

    def combine(self, acc, scales, dx, main, aux, offset_scale):
        """acc + one super-block's part, lane by lane (acc 8 float lanes, main/aux 8 i32 lanes):
        with mins (offset_scale None: Q4_K, Q5_K) acc + (d·dx)·main − (dmin·dx)·aux, else acc +
        (d·dx)·(main − offset_scale·aux); d, dmin in lanes 0, 1 of `scales`, dx a float. Exact
        integers in, fixed float operations out: every path that sums a row this way (the N-input
        row dot, the decoded tiles) gets the same bits."""
        b = self.b
        d_dx = self.splat(b.fmul(b.extract_element(scales, _I32(0)), dx))
        if offset_scale is not None:
            total = b.sub(main, b.mul(aux, self.splat_const(_I32X8, offset_scale)))
            return self.fma(d_dx, b.sitofp(total, _F32X8), acc)
        dmin_dx = self.splat(b.fneg(b.fmul(b.extract_element(scales, _I32(1)), dx)))
        return self.fma(dmin_dx, b.sitofp(aux, _F32X8), self.fma(d_dx, b.sitofp(main, _F32X8), acc))

    def splat(self, scalar, count: int = 8):
        vec = self.b.insert_element(ir.Constant(ir.VectorType(scalar.type, count), None), scalar, _I32(0))
        return self.lane_splat(vec, 0)

    def fma(self, a, c, acc):
        """a·c + acc, rounded once (`vfmadd` where the target has FMA, else a libm-free
        multiply and add: the bits then differ between such machines, not between paths)."""
        if "fma" in _target_features():
            ty = a.type     # 8 or 16 float lanes
            fn = cgutils.get_or_insert_function(self.b.module, ir.FunctionType(ty, [ty] * 3),
                                                f"llvm.fma.v{ty.count}f32")
            return self.b.call(fn, [a, c, acc])
        return self.b.fadd(self.b.fmul(a, c), acc)

    def lanes(self, vec, idx):
        return self.b.shuffle_vector(vec, vec, ir.Constant(ir.VectorType(_I32, len(idx)), list(idx)))

    def f16s(self, ptr, byte_offs):
        """The IEEE halves at the given byte offsets, widened to float32, as a vector with one lane
        each (unused lanes 0). Built in a zeroed register on purpose: a lone half load becomes a
        `vpinsrw` into whatever the register held last, a false dependency that chains every
        block to the one before it."""
        h = ir.Constant(ir.VectorType(_I16, 8), None)
        for lane, off in enumerate(byte_offs):
            h = self.b.insert_element(h, self.load(ptr, off, _I16), _I32(lane))
        return _half_to_float(self.b, h)

    def f16(self, ptr, byte_off: int):
        return self.b.extract_element(self.f16s(ptr, [byte_off]), _I32(0))

    def lane_splat(self, v, lane: int):
        return self.b.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, v.type.count), [lane] * v.type.count))


# ---- scalar decoders -------------------------------------------------------------------------

@intrinsic
def f16_at(typingctx, arr, byte_off):
    """The IEEE half at byte offset byte_off of a uint8 array, as float32 (exact)."""
    def codegen(context, builder, sig, args):
        return _Vec(builder).f16(_Operands(context, builder, sig, args, arr=0).bytes_at("arr", args[1]), 0)
    return types.float32(arr, types.intp), codegen


@intrinsic
def f32_from_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _F32)
    return types.float32(types.uint32), codegen


@intrinsic
def f32_bits(typingctx, value):
    """The uint32 bit pattern of the float32 `value`."""
    def codegen(context, builder, sig, args):
        return builder.bitcast(args[0], _I32)
    return types.uint32(types.float32), codegen


@intrinsic
def f16_bits_to_f32(typingctx, bits):
    """The IEEE half with bit pattern `bits` (uint16), as float32 (exact)."""
    def codegen(context, builder, sig, args):
        return _half_to_float(builder, args[0])
    return types.float32(types.uint16), codegen


# ---- K-quant super-blocks (256 weights) ------------------------------------------------------

class _Chunks:
    """A super-block's 8 unpacked parts (32 weights each, with what the dot needs of them), made by
    part(c) when first used. Where the target has 16 vector registers (AVX2 without AVX-512), the
    first slot's dot thus takes each part right after it is made: x86 instruction selection keeps
    the order of the IR, and 8 parts made up front stay live together and spill. Where AVX-512
    gives 32 registers they are made up front, the order tuned there. Either order computes the
    same integers. The readers that use it were measured faster so on Zen 3 (Q3_K, IQ2_XS, IQ2_S,
    IQ3_XXS, IQ1_M); the others were not, and make their parts up front (docs/MEASUREMENTS.md,
    2026-11-29, stop 51)."""

    def __init__(self, part: Callable):
        self._part = part
        self._made: dict[int, object] = {}
        if _target_has_32_vector_registers():
            for c in range(8):
                self[c]

    def __getitem__(self, c: int):
        if c not in self._made:
            self._made[c] = self._part(c)
        return self._made[c]

    def __iter__(self):
        return (self[c] for c in range(8))


def _k4_scales(v: _Vec, blk, at: int):
    """The 8 six-bit scales and 8 mins of Q4_K/Q5_K (12 bytes at blk+at) as one 16 x i16 vector:
    lanes 0..7 scales, 8..15 mins (`get_scale_min_k4`). In vector registers: the bytes are
    placed by two shuffles, then masked and shifted; word shifts are safe where the mask keeps
    only bits that came from the byte itself."""
    b = v.b
    x16 = ir.VectorType(_I8, 16)
    s = b.shuffle_vector(v.load(blk, at, ir.VectorType(_I8, 12)), ir.Constant(ir.VectorType(_I8, 12), None),
                         ir.Constant(ir.VectorType(_I32, 16), list(range(12)) + [12] * 4))   # 12 bytes, then zeros
    zero = 12

    def place(idx):
        return b.shuffle_vector(s, s, ir.Constant(ir.VectorType(_I32, 16), idx))

    def const(values):
        return ir.Constant(x16, values)

    def shr_words(vec, n):   # (byte >> n) wherever the mask then drops the neighbour's bits
        w = ir.VectorType(_I16, 8)
        return b.bitcast(b.lshr(b.bitcast(vec, w), ir.Constant(w, [n] * 8)), x16)

    # low parts: scales 0..3 = s[0..3] & 63, scales 4..7 = s[8..11] & 15, mins 0..3 = s[4..7] & 63,
    # mins 4..7 = s[8..11] >> 4; high parts of lanes 4..7 and 12..15: (s[j−4] >> 6) << 4, (s[j] >> 6) << 4
    a = place([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 8, 9, 10, 11])
    hi = place([zero] * 4 + [0, 1, 2, 3] + [zero] * 4 + [4, 5, 6, 7])
    low = b.and_(a, const([63] * 4 + [15] * 4 + [63] * 4 + [0] * 4))
    top = b.and_(shr_words(a, 4), const([0] * 12 + [15] * 4))
    high = b.and_(shr_words(hi, 2), const([0x30] * 16))
    return b.zext(b.or_(b.or_(low, top), high), _I16X16)


def _k4_dot(v: _Vec, chunks, scm, x, bs):
    """Σ sc·q·x and Σ m·(x sums) of one Q4_K/Q5_K super-block for one slot, each as 8 i32 lanes.
    chunks: 4 pairs (low-half, high-half) of 32 unsigned weights; scm from _k4_scales."""
    pairs = []
    for c, (lo, hi) in enumerate(chunks):
        for half, q in enumerate((lo, hi)):
            sub = 2 * c + half
            pairs.append((v.maddubs(q, v.load(x, 32 * sub, _U8X32)), v.pick16(scm, [sub] * 16)))
    # x sums are per 16 elements; each min covers 32 of them: pair every min with two sums
    mins = v.pick16(scm, [8 + t // 2 for t in range(16)])
    return v.madd_sum(pairs), v.madd(mins, v.load(bs, 0, _I16X16))


def _unpack_q4k(v: _Vec, blk):
    scm = _k4_scales(v, blk, 4)
    if v.zmm:
        # a unit = one 32-byte chunk's 64 nibbles (sub-blocks 2c, 2c+1: elements 64c.. in order) and
        # its two scales; the 16 i32 lanes of the sum fold onto 8 (lane L of either half covers
        # elements 4L..4L+3 of its sub-block, as in the 256-bit form); faster than the 256-bit form
        # (docs/MEASUREMENTS.md).
        b = v.b
        units = []
        for c in range(4):
            nib = v.nibbles64(v.load(blk, 16 + 32 * c, _U8X32))          # sub-blocks 2c, 2c+1
            sc = b.shuffle_vector(scm, scm, ir.Constant(ir.VectorType(_I32, 32), [2 * c] * 16 + [2 * c + 1] * 16))
            units.append((nib, sc))
        mins = v.pick16(scm, [8 + t // 2 for t in range(16)])

        def dot(x, bs):
            wide = v.madd_sum([(v.maddubs(nib, v.load(x, 64 * c, _U8X64)), sc) for c, (nib, sc) in enumerate(units)])
            main = b.add(v.lanes(wide, range(8)), v.lanes(wide, range(8, 16)))
            return main, v.madd(mins, v.load(bs, 0, _I16X16))
        return dot
    chunks = []
    for c in range(4):
        q = v.load(blk, 16 + 32 * c, _U8X32)
        chunks.append((v.and8(q, 0x0F), v.shr8(q, 4)))
    return lambda x, bs: _k4_dot(v, chunks, scm, x, bs)


def _unpack_q5k(v: _Vec, blk):
    scm = _k4_scales(v, blk, 4)
    qh = v.load(blk, 16, _U8X32)
    chunks = []
    for c in range(4):
        q = v.load(blk, 48 + 32 * c, _U8X32)
        lo = v.b.or_(v.and8(q, 0x0F), v.bits8(qh, 2 * c, 1, 4))
        hi = v.b.or_(v.shr8(q, 4), v.bits8(qh, 2 * c + 1, 1, 4))
        chunks.append((lo, hi))
    return lambda x, bs: _k4_dot(v, chunks, scm, x, bs)


def _scales_of_chunks(v: _Vec, sc):
    """For each 32-element chunk c, the 16 i16 multipliers of its pair sums: lanes 0..7 the scale
    of elements 32c..32c+15 (sc lane 2c), lanes 8..15 that of the next 16 (lane 2c + 1)."""
    return [v.pick16(sc, [2 * c] * 8 + [2 * c + 1] * 8) for c in range(8)]


def _per16_dot(v: _Vec, codes, sc, aux):
    """The per-slot dot of a super-block with a scale per 16 weights (Q6_K, Q3_K, Q2_K): codes = 8 × 32
    unsigned codes of elements 32c.., sc = the 16 scales, aux = the 16 multipliers of the x sums
    per 16 (the scales again where an offset is taken back, the mins where they are subtracted);
    (Σ sc·q·x, Σ aux·(x sums)) as 8 i32 lanes each."""
    scale_pairs = _scales_of_chunks(v, sc)

    def dot(x, bs):
        pairs = [(v.maddubs(q, v.load(x, 32 * c, _U8X32)), s) for c, (q, s) in enumerate(zip(codes, scale_pairs))]
        return v.madd_sum(pairs), v.madd(aux, v.load(bs, 0, _I16X16))

    return dot


def _unpack_q6k(v: _Vec, blk):
    """Q6_K: 6-bit unsigned q (the −32 offset is applied through the x sums), int8 scale per 16.
    Per slot: (Σ sc·q·x, Σ sc·(x sums per 16)) as 8 i32 lanes each."""
    b = v.b
    sc = b.sext(v.load(blk, 192, ir.VectorType(_I8, 16)), _I16X16)
    parts = []  # 32 unsigned weights of elements 32c.., c = 4h + 0..3
    for h in range(2):
        ql_a = v.load(blk, 64 * h, _U8X32)
        ql_b = v.load(blk, 64 * h + 32, _U8X32)
        qh = v.load(blk, 128 + 32 * h, _U8X32)
        parts.append(b.or_(v.and8(ql_a, 0x0F), v.bits8(qh, 0, 3, 4)))
        parts.append(b.or_(v.and8(ql_b, 0x0F), v.bits8(qh, 2, 3, 4)))
        parts.append(b.or_(v.shr8(ql_a, 4), v.bits8(qh, 4, 3, 4)))
        parts.append(b.or_(v.shr8(ql_b, 4), v.bits8(qh, 6, 3, 4)))
    return _per16_dot(v, parts, sc, sc)


def _shr_lanes(v: _Vec, vec, shifts):
    """vec (a vector of small ints) with lane i shifted right by shifts[i] (constants): one
    uniform shift per distinct amount, blended by constant shuffles (x86 has no per-lane byte
    shift; a constant blend is one instruction)."""
    b = v.b
    n = vec.type.count
    out = None
    for s in sorted(set(shifts)):
        shifted = b.lshr(vec, ir.Constant(vec.type, [vec.type.element(s)] * n)) if s else vec
        out = shifted if out is None else b.shuffle_vector(
            out, shifted, ir.Constant(ir.VectorType(_I32, n), [n + i if shifts[i] == s else i for i in range(n)]))
    return out


def _six_bit_scales(v: _Vec, blk, low, high):
    """16 six-bit scales − 32 as 16 x i16 (Q3_K, IQ4_XS): lane i's low 4 bits at bit low[i][1] of
    byte low[i][0] of the block, its high 2 bits at bit high[i][1] of byte high[i][0]. The bytes
    are placed by shuffles of one load, then shifted (`_shr_lanes`) and masked."""
    b = v.b
    first = min(at for at, _ in low + high)
    raw = v.load(blk, first, ir.VectorType(_I8, max(at for at, _ in low + high) + 1 - first))
    x16 = ir.VectorType(_I8, 16)

    def field(places, mask):
        placed = b.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 16), [at - first for at, _ in places]))
        return b.and_(_shr_lanes(v, placed, [bit for _, bit in places]), ir.Constant(x16, [mask] * 16))

    six = b.or_(field(low, 15), b.shl(field(high, 3), ir.Constant(x16, [4] * 16)))
    return b.sub(b.zext(six, _I16X16), v.splat_const(_I16X16, 32))


def _q3k_scales(v: _Vec, blk):
    """Q3_K's 16 scales − 32 (scale g covers weights 16g..16g+15): low 4 bits in nibble g // 8 of
    byte 96 + g % 8, high 2 bits at bit 2·(g // 4) of byte 104 + g % 4."""
    return _six_bit_scales(v, blk, [(96 + g % 8, 4 * (g // 8)) for g in range(16)],
                           [(104 + g % 4, 2 * (g // 4)) for g in range(16)])


def _signed_x_dot(v: _Vec, chunks):
    """chunks: 8 × (32 unsigned bytes u, 32 signs s, 16 i16 scale lanes) of the elements
    32c..32c+31 → dot(x, bs) = (Σ scale·u·sign(s)·x, zero aux): the signs go onto x (`sign8`;
    s is ±1 for the IQ2 grids, the signed weight itself for IQ4_XS, whose u is its magnitude), or
    s is an i32 whose bit j is set where element j is negative (`_Vec.negate_where`; IQ2_XXS)."""
    zero = ir.Constant(_I32X8, None)

    def signed(x, s):
        return v.negate_where(x, s) if s.type == _I32 else v.sign8(x, s)

    def dot(x, bs):
        pairs = [(v.maddubs(g, signed(v.load(x, 32 * c, _U8X32), s)), sc) for c, (g, s, sc) in enumerate(chunks)]
        return v.madd_sum(pairs), zero

    return dot


def _unpack_q3k(v: _Vec, blk):
    """Q3_K as unsigned 3-bit codes u = low2 + 4·hbit (weight d·scale·(u − 4): the −4 goes through
    the x sums, offset_scale 4). Weight e = 128h + 32s + l: low2 = bits 2s..2s+1 of qs[32h + l],
    hbit = bit 4h + s of hmask[l]. Per slot: (Σ sc·u·x, Σ sc·(x sums per 16)) as 8 i32 lanes."""
    b = v.b
    sc = _q3k_scales(v, blk)
    hm = v.load(blk, 0, _U8X32)

    def part(c):     # 32 unsigned codes of elements 32c.., c = 4h + s
        h, s = divmod(c, 4)
        return b.or_(v.bits8(v.load(blk, 32 + 32 * h, _U8X32), 2 * s, 3, 0), v.bits8(hm, 4 * h + s, 1, 2))
    return _per16_dot(v, _Chunks(part), sc, sc)


def _unpack_q2k(v: _Vec, blk):
    """Q2_K: 2-bit codes q, per 16 weights a 4-bit scale (low nibble of scales[g]) and a 4-bit min
    (high nibble), weight d·sc·q − dmin·m. Weight e = 128h + 32s + l: bits 2s..2s+1 of
    qs[32h + l]. Per slot: (Σ sc·q·x, Σ m·(x sums per 16)) as 8 i32 lanes, Q4_K's combine."""
    b = v.b
    raw = v.load(blk, 0, ir.VectorType(_I8, 16))
    sc = b.zext(b.and_(raw, ir.Constant(raw.type, [15] * 16)), _I16X16)
    mins = b.zext(b.lshr(raw, ir.Constant(raw.type, [4] * 16)), _I16X16)
    parts = []  # (32 codes of elements 32c.., c = 4h + s)
    for h in range(2):
        qs = v.load(blk, 16 + 32 * h, _U8X32)
        for s in range(4):
            parts.append(v.bits8(qs, 2 * s, 3, 0))
    return _per16_dot(v, parts, sc, mins)


def _unpack_iq4xs(v: _Vec, blk):
    """IQ4_XS: per 32 weights (sub-block ib) a six-bit scale ls − 32 (low 4 bits: nibble ib % 2 of
    byte 4 + ib // 2; high 2: bits 2·ib of the u16 at byte 2) and 32 4-bit codes (16 bytes at
    8 + 16·ib, `_nibbles32`) read through the signed IQ4_NL table. The weights are signed, so
    each sub-block is a `signed_dot32` (|w| ≤ 127: no pair sum saturates) whose i16 pair sums
    meet ls in the `vpmaddwd`. No aux term (offset 0, aux lanes zero)."""
    ls = _six_bit_scales(v, blk, [(4 + ib % 8 // 2, 4 * (ib % 2)) for ib in range(16)],
                         [(2 + ib % 8 // 4, 2 * (ib % 4)) for ib in range(16)])   # lanes 8..15 repeat 0..7
    chunks = []
    for ib in range(8):
        q = _lookup16(v, _nibbles32(v, blk, 8 + 16 * ib), IQ4NL_KVALUES)
        chunks.append((v.abs8(q), q, v.pick16(ls, [ib] * 16)))
    return _signed_x_dot(v, chunks)      # |q| meets x with q's sign: signed_dot32's form


class _Operands:
    """An intrinsic's array arguments by role, at the argument positions `at` names (the dots':
    w (rows, row_bytes) uint8, xq (slots, cols) int8, dx (blocks, slots) float32, bs (slots,
    cols/16) int16, acc float32). Pointers are taken at element offsets."""

    def __init__(self, context, builder, sig, args, **at):
        self.context, self.b, self.sig, self.args, self.at = context, builder, sig, args, at

    def _array(self, role):
        i = self.at[role]
        return self.context.make_array(self.sig.args[i])(self.context, self.b, value=self.args[i])

    def shape(self, role):
        return cgutils.unpack_tuple(self.b, self._array(role).shape)

    def bytes_at(self, role, elem_off):
        itemsize = self.sig.args[self.at[role]].dtype.bitwidth // 8
        data = self.b.bitcast(self._array(role).data, _I8.as_pointer())
        return self.b.gep(data, [self.b.mul(elem_off, _I64(itemsize))])

    def floats_at(self, role, elem_off, count: int):
        return self.b.bitcast(self.b.gep(self._array(role).data, [elem_off]), ir.VectorType(_F32, count).as_pointer())


class _KQuant(NamedTuple):
    """A 256-weight super-block type on Q8_K activations as the row dot reads it (Q4_K, Q5_K,
    Q6_K, Q3_K, Q2_K, IQ4_XS and the grid types, IQ1_M included): `unpack` (the weights into registers, then a
    dot per slot giving Σ sc·q·x and the aux sum as 8 i32 lanes each), the block size, where d
    and dmin sit, the offset of unsigned codes (Q6_K 32, Q3_K 4, the IQ3/IQ1 grid types
    GRID_OFFSET; IQ4_XS and the IQ2 types 0 with zero aux lanes: their codes meet x signed; None:
    the type has mins instead, Q4_K, Q5_K, Q2_K), and a power of 2 that d is multiplied by (exact)
    where the integer codes are a multiple of the weights (IQ3_XXS 1/4, IQ2, IQ1_S and IQ1_M 1/8).
    A type whose d is not one fp16 field (IQ1_M: its bits spread over the scale words) gives
    d_at None and `d_of(v, blk)`: d as lane 0 of 8 float lanes (the others 0)."""
    unpack: Callable
    block_bytes: int
    d_at: int | None
    dmin_at: int | None
    offset_scale: int | None = None
    d_factor: float = 1.0
    d_of: Callable | None = None

    def emit_row(self, builder, ops: _Operands, row_off, n0, g_count: int, pf):
        """acc[n0 .. n0+G) = the row at byte row_off · x[n], super-block by super-block: each slot
        gathers the blocks' parts in 8 float lanes (`_Vec.combine`), summed at the end in a fixed
        tree (`_Vec.sums`). One loop per (type, G), emitted here with nothing else in it (a Numba
        loop around a per-block intrinsic ran 1.4-1.8x the cycles per block)."""
        xs, bss, dxs = ops.shape("xq")[1], ops.shape("bs")[1], ops.shape("dx")[1]
        lanes = cgutils.alloca_once(builder, _F32X8, size=g_count)    # promoted to registers
        for g in range(g_count):
            builder.store(ir.Constant(_F32X8, None), builder.gep(lanes, [_I32(g)]))
        n_blocks = builder.udiv(ops.shape("w")[1], _I64(self.block_bytes))
        with cgutils.for_range(builder, n_blocks) as loop:
            b_v = loop.index
            v = _Vec(builder)
            blk = ops.bytes_at("w", builder.add(row_off, builder.mul(b_v, _I64(self.block_bytes))))
            v.prefetch_span(blk, pf, self.block_bytes)
            weights = self.unpack(v, blk)
            if self.d_of is not None:
                scales = self.d_of(v, blk)
            else:
                scales = v.f16s(blk, [self.d_at] if self.dmin_at is None else [self.d_at, self.dmin_at])
            if self.d_factor != 1.0:
                scales = builder.fmul(scales, v.splat_const(_F32X8, self.d_factor))
            dxv = builder.load(ops.floats_at("dx", builder.add(builder.mul(b_v, dxs), n0), g_count), align=4)
            for g in range(g_count):
                n = builder.add(n0, _I64(g))
                x = ops.bytes_at("xq", builder.add(builder.mul(n, xs), builder.mul(b_v, _I64(256))))
                bs = ops.bytes_at("bs", builder.add(builder.mul(n, bss), builder.mul(b_v, _I64(16))))
                main, aux = weights(x, bs)
                slot = builder.gep(lanes, [_I32(g)])
                part = v.combine(builder.load(slot), scales, builder.extract_element(dxv, _I32(g)), main, aux,
                                 self.offset_scale)
                builder.store(part, slot)
        totals = _Vec(builder).sums([builder.load(builder.gep(lanes, [_I32(g)])) for g in range(g_count)], builder.fadd)
        builder.store(totals, ops.floats_at("acc", n0, g_count), align=4)


Q4_K_BLOCKS = _KQuant(_unpack_q4k, 144, d_at=0, dmin_at=2)
Q5_K_BLOCKS = _KQuant(_unpack_q5k, 176, d_at=0, dmin_at=2)
Q6_K_BLOCKS = _KQuant(_unpack_q6k, 210, d_at=208, dmin_at=None, offset_scale=32)
Q3_K_BLOCKS = _KQuant(_unpack_q3k, 110, d_at=108, dmin_at=None, offset_scale=4)
Q2_K_BLOCKS = _KQuant(_unpack_q2k, 84, d_at=80, dmin_at=82)
IQ4_XS_BLOCKS = _KQuant(_unpack_iq4xs, 136, d_at=0, dmin_at=None, offset_scale=0)


# ---- IQ3 / IQ1 grid super-blocks (IQ3_XXS, IQ3_S, IQ1_S, IQ1_M) on Q8_K activations ------------
#
# Each group of 4 (IQ3) or 8 (IQ1) weights is a row of a grid table (ggml-common.h iq3xxs_grid:
# unsigned values 4..62; iq3s_grid: odd 1..15; iq1s_grid: −1, 0, 1) and a 3- or 4-bit scale s per
# 32 weights (IQ1_M: per 16). The grid rows are gathered as u32 / u64 (bytes in element order) from a constant
# table in the LLVM module, and the signs applied once per block: signed weights w, |w| ≤ 62. They
# meet the activations as unsigned codes w + GRID_OFFSET ≤ 126 in `vpmaddubsw` (|pair| ≤ 2 · 126 ·
# 127 < 2**15; no sign op per slot), the offset taken back through the x sums as for Q6_K
# (main − GRID_OFFSET · Σ scale · (x sums)); the i16 pair sums meet the scale in `vpmaddwd`.


GRID_OFFSET = 64


def _grid_rows(cls, scale: int = 1, offset: int = 0) -> list[int]:
    """gguf-py's grid of an IQ type (rows of 4 or 8 small integers, as floats), each value times
    `scale` plus `offset`, as one u32 / u64 per row, element j in byte j (little-endian: a gathered
    row bitcasts to bytes in element order; negative values as int8)."""
    cls.init_grid()
    values = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape), dtype=np.float32) * scale + offset
    assert values.min() >= -128 and values.max() <= 255
    rows = (values.astype(np.int64) & 0xFF).astype(np.uint8)
    return [int(r) for r in rows.view(np.uint8).view(f"<u{rows.shape[1]}").reshape(-1)]


IQ3XXS_GRID_ROWS = _grid_rows(_gguf_quants.IQ3_XXS)     # 256 rows of 4 (u32)
IQ3S_GRID_ROWS = _grid_rows(_gguf_quants.IQ3_S)         # 512 rows of 4 (u32)
# IQ1_S / IQ1_M: the rows as the codes 8·grid + GRID_OFFSET (56, 64, 72 for −1, 0, 1), to which a
# weight group's delta ±1 is added (1 op per 32 weights instead of a shift and two adds)
IQ1S_CODE_ROWS = _grid_rows(_gguf_quants.IQ1_S, scale=8, offset=GRID_OFFSET)   # 2048 rows of 8 (u64)


def _const_table(v: _Vec, name: str, values, ty):
    """A constant table of integers of type ty in the current LLVM module (made once per module),
    as a pointer to ty. Internal linkage: the linker renames it where another module holds one of
    the same name."""
    module = v.b.module
    table = module.globals.get(name)
    if table is None:
        arr = ir.ArrayType(ty, len(values))
        table = ir.GlobalVariable(module, arr, name)
        table.linkage = "internal"
        table.global_constant = True
        table.initializer = ir.Constant(arr, [ty(x) for x in values])
    return v.b.bitcast(table, ty.as_pointer())


# An intrinsic's name spells its pointer arguments: "p0" where LLVM's pointers are opaque (LLVM 17 on,
# whatever llvmlite prints), "p0i32" / "p0i64" before (llvmlite >= 0.44 may bring LLVM 15)
_POINTER_MANGLE = "p0" if llvm.llvm_version_info >= (17,) else "p0i{}"


def _target_gathers_fast() -> bool:
    """Whether the grid readers fetch their table rows with vector gathers (else one scalar load per
    row). Gathers are fast on the AVX-512 cores (Intel's server cores, AMD's from Zen 4) and
    microcoded on the AVX2-only Zen 2/3, where the loads win; the measurements are in
    docs/MEASUREMENTS.md (2026-11-29, stops 50 and 51). Read when a kernel compiles."""
    return "avx512f" in _target_features()


def _fetch_rows(v: _Vec, table, ty, vector_idx: Callable, scalar_idx: Callable | None = None):
    """Rows of `table` (8 of u32 or 4 of u64) as one 32 x i8 vector, at the i32 lanes of
    vector_idx(): gathered where the target gathers fast, else loaded one by one, each at an i64
    scalar index: scalar_idx()'s (the same indices, computed in integer registers) where a reader
    gives them, else the lanes of vector_idx() taken out one by one. Which of the two is faster
    was measured per type on Zen 3 (docs/MEASUREMENTS.md, 2026-11-29, stop 51): the lanes for
    IQ3_S's 8 computed indices per vector; integer code for IQ1_S's and IQ1_M's 4, and for
    IQ3_XXS, whose indices are plain bytes of the block. Only the chosen form is built."""
    if _target_gathers_fast():
        return _gather_rows(v, table, vector_idx(), ty)
    if scalar_idx is not None:
        return _rows(v, table, scalar_idx(), ty)
    idx = vector_idx()
    return _rows(v, table, [v.b.zext(v.b.extract_element(idx, _I32(i)), _I64) for i in range(idx.type.count)], ty)


def _gather_rows(v: _Vec, table, idx, ty=_I32):
    """table[idx[i]] for the i32 indices idx (8 for u32 rows, 4 for u64 rows), as 32 bytes (row i
    in bytes 4i.. / 8i..): `llvm.masked.gather` (vpgatherdd / vpgatherdq with AVX2, scalar loads
    elsewhere)."""
    b = v.b
    n = idx.type.count
    ptrs = b.gep(table, [idx], source_etype=ty)
    ptrs.type = ir.VectorType(ty.as_pointer(), n)   # a GEP on a vector index is a vector of pointers
                                                    # (llvmlite types it as the scalar pointer)
    rows_ty = ir.VectorType(ty, n)
    fn = cgutils.get_or_insert_function(
        b.module, ir.FunctionType(rows_ty, [ptrs.type, _I32, ir.VectorType(_I1, n), rows_ty]),
        f"llvm.masked.gather.v{n}i{ty.width}.v{n}{_POINTER_MANGLE.format(ty.width)}")
    rows = b.call(fn, [ptrs, _I32(ty.width // 8), ir.Constant(ir.VectorType(_I1, n), [1] * n),
                       ir.Constant(rows_ty, None)])
    return b.bitcast(rows, _U8X32)


def _sign_bytes(v: _Vec, signs, first: int):
    """±1 per byte for the 32 weights whose sign bits are bytes first..first+3 of `signs` (a
    32 x i8 vector; bit j of a byte: weight j of its 8): −1 where the bit is set."""
    b = v.b
    spread = b.shuffle_vector(signs, signs, ir.Constant(ir.VectorType(_I32, 32), [first + j // 8 for j in range(32)]))
    bit = b.and_(spread, ir.Constant(_U8X32, [1 << (j % 8) for j in range(32)]))
    return b.select(b.icmp_unsigned("==", bit, ir.Constant(_U8X32, None)), v.splat_const(_U8X32, 1),
                    v.splat_const(_U8X32, -1))


def _offset_codes(v: _Vec, w):
    """Signed grid weights (|w| ≤ 62) as the unsigned codes w + GRID_OFFSET that `_grid_dot` takes."""
    return v.b.add(w, v.splat_const(_U8X32, GRID_OFFSET))


def _grid_dot(v: _Vec, codes, scale):
    """The per-slot dot of a grid type: codes = 8 sub-blocks of 32 unsigned codes w + GRID_OFFSET
    of the signed weights w, scale = their 8 scales in lanes 0..7 of a 16 x i16 vector; (Σ scale ·
    code · x, Σ scale · (x sums per 16)) as 8 i32 lanes each (the reader's offset_scale is
    GRID_OFFSET)."""
    scales = [v.pick16(scale, [ib] * 16) for ib in range(8)]
    per16 = v.pick16(scale, [t // 2 for t in range(16)])     # the scale of x sum t (elements 16t..)

    def dot(x, bs):
        pairs = [(v.maddubs(u, v.load(x, 32 * ib, _U8X32)), s) for ib, (u, s) in enumerate(zip(codes, scales))]
        return v.madd_sum(pairs), v.madd(per16, v.load(bs, 0, _I16X16))
    return dot


# ---- IQ2 grid types (IQ2_XXS, IQ2_XS, IQ2_S) ------------------------------------------------------
#
# Each 8 weights are a row of a fixed grid (unsigned bytes 8, 25, 43) times 8 signs, times a 4-bit
# scale s per 32 (IQ2_XXS) or 16 (IQ2_XS, IQ2_S) weights: weight = d·(0.5 + s)·0.25·grid·sign =
# (d/8)·(2s + 1)·grid·sign, exactly (d/8 is `_KQuant.d_factor`). The grid rows and the sign patterns
# are constant tables in the module, 8 bytes a row, read by plain loads (one per 8 weights); the
# signs go onto x (`sign8`), so `vpmaddubsw` meets the unsigned grid bytes and signed x (|pair| ≤
# 2·43·127 < 2**15) and `vpmaddwd` the odd scales 2s + 1. No aux term (offset 0, aux lanes zero).

# ggml's ksigns_iq2xs: a 7-bit sign index i → the 8 sign bits, bit 7 the parity of i (even count)
KSIGNS = tuple(i | ((bin(i).count("1") & 1) << 7) for i in range(128))


# byte j of row i: −1 where bit j of KSIGNS[i] is set, else +1 (the multiplier of `sign8`; IQ2_XS)
_SIGN_ROWS = [int.from_bytes(bytes(0xFF if (k >> j) & 1 else 1 for j in range(8)), "little") for k in KSIGNS]
_IQ2_TABLES = {"iq2xxs_grid": _grid_rows(_gguf_quants.IQ2_XXS), "iq2xs_grid": _grid_rows(_gguf_quants.IQ2_XS),
               "iq2s_grid": _grid_rows(_gguf_quants.IQ2_S), "iq2_signs": _SIGN_ROWS}


def _rows(v: _Vec, table, indices, ty):
    """table[indices[i]] (i64 scalars: 8 rows of u32 or 4 of u64) as one 32 x i8 vector, row i in
    bytes 4i.. / 8i.., one scalar load per row."""
    rows = ir.Constant(ir.VectorType(ty, len(indices)), None)
    for lane, idx in enumerate(indices):
        rows = v.b.insert_element(rows, v.b.load(v.b.gep(table, [idx]), align=ty.width // 8), _I32(lane))
    return v.b.bitcast(rows, _U8X32)


def _table_rows(v: _Vec, name: str, indices):
    """Rows indices[0..3] (i64 scalars) of the constant table `name` (`_IQ2_TABLES`, 8 bytes a row)
    as one 32 x i8 vector."""
    return _rows(v, _const_table(v, name, _IQ2_TABLES[name], _I64), indices, _I64)


def _byte_i64(v: _Vec, blk, at: int):
    """Byte `at` of the block as an i64 scalar (a table index, or the bits of one)."""
    return v.b.zext(v.load(blk, at, _I8), _I64)


def _bits_i64(v: _Vec, q, shift: int, mask: int):
    return v.b.and_(v.b.lshr(q, q.type(shift)) if shift else q, q.type(mask))


def _spill(v: _Vec, vec):
    """vec stored in a stack slot, as an i8 pointer to read its parts back with scalar loads. Taking
    lanes out of a register costs shuffle-port µops (`vpextrd` 2 each), the port the grid rows'
    inserts already keep busy; a load from a slot just written is forwarded from the store. The
    slot's address goes into an empty asm that may touch memory, so LLVM keeps the store and the
    loads (it would otherwise fold them back into lane extracts)."""
    llvm.initialize_native_asmparser()        # inline asm needs it; Numba does not set it up
    slot = cgutils.alloca_once(v.b, vec.type)
    v.b.store(vec, slot, align=1)
    escape = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [slot.type]), "", "r,~{memory}", side_effect=True)
    v.b.call(escape, [slot])
    return v.b.bitcast(slot, _I8.as_pointer())


def _ksign_bytes(v: _Vec, aux):
    """The sign bytes of 8 × 4 groups of 8 weights whose 7-bit sign indices are bits 7l.. of lane c
    of aux (8 x i32; IQ2_XXS, IQ3_XXS): byte 4c + l = KSIGNS[field l of lane c], the 7 bits and
    their parity as bit 7 (an even count of minus signs per 8); the i32 at byte 4c is then bit by
    bit the signs of the 32 weights of lane c's sub-block."""
    b = v.b

    def c32(x):
        return v.splat_const(_I32X8, x)

    # the four 7-bit fields into the four bytes of each lane, then each byte's parity into bit 7:
    # after w ^= w >> 4, >> 2, >> 1, bit 0 of a byte depends on that byte's bits only
    w = c32(0)
    for l in range(4):
        w = b.or_(w, b.shl(b.and_(b.lshr(aux, c32(7 * l)), c32(127)), c32(8 * l)))
    p = w
    for n in (4, 2, 1):
        p = b.xor(p, b.lshr(p, c32(n)))
    return b.bitcast(b.or_(w, b.shl(b.and_(p, c32(0x01010101)), c32(7))), _U8X32)


def _iq2_scales16(v: _Vec, blk, at: int):
    """IQ2_XS / IQ2_S: 2s + 1 for the 16 scales (nibble g % 2 of byte at + g // 2) as 16 x i16."""
    b = v.b
    raw = v.load(blk, at, ir.VectorType(_I8, 8))
    placed = b.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 16), [g // 2 for g in range(16)]))
    x16 = ir.VectorType(_I8, 16)
    s = b.and_(b.lshr(placed, ir.Constant(x16, [0, 4] * 8)), ir.Constant(x16, [15] * 16))
    s = b.zext(s, _I16X16)
    return b.add(b.add(s, s), v.splat_const(_I16X16, 1))


def _unpack_iq2xxs(v: _Vec, blk):
    """IQ2_XXS: per 32 weights (ib) a u64 at byte 2 + 8·ib: bytes 0..3 grid indices (8 weights
    each), bits 32 + 7l.. the sign index of group l, bits 60..63 the scale s. The sign indices of
    the block become sign bits in vector registers (`_ksign_bytes`), read back per 32 weights as
    an i32 (`_Vec.negate_where`); the grid indices are byte loads."""
    b = v.b
    # the high u32 of each word (lane ib) from two 256-bit loads (one 512-bit load is a zmm
    # instruction: it lowers the clock of some Intel cores)
    lo, hi = v.load(blk, 2, _I32X8), v.load(blk, 34, _I32X8)
    signs = _spill(v, _ksign_bytes(v, b.shuffle_vector(lo, hi, ir.Constant(_I32X8, list(range(1, 16, 2))))))
    chunks = []
    for ib in range(8):
        idx = [b.zext(v.load(blk, 2 + 8 * ib + l, _I8), _I64) for l in range(4)]
        s = b.lshr(b.zext(v.load(blk, 9 + 8 * ib, _I8), _I16), _I16(4))     # word ib's top byte: s in bits 4..7
        chunks.append((_table_rows(v, "iq2xxs_grid", idx), v.load(signs, 4 * ib, _I32),
                       v.splat(b.add(b.add(s, s), _I16(1)), 16)))
    return _signed_x_dot(v, chunks)


def _unpack_iq2xs(v: _Vec, blk):
    """IQ2_XS: per 8 weights (k) the u16 at byte 2 + 2k: bits 0..8 grid index, 9..15 sign index;
    scales (nibbles per 16 weights) at byte 66."""
    b = v.b
    scales = _scales_of_chunks(v, _iq2_scales16(v, blk, 66))

    def part(c):
        # each index word loaded as a scalar: taken out of one vector load, every one cost a
        # `vpextrw` (2 µops) on top (docs/MEASUREMENTS.md); loads are cheap and the block is in L1
        q = [b.zext(v.load(blk, 2 + 2 * (4 * c + l), _I16), _I64) for l in range(4)]
        grid = _table_rows(v, "iq2xs_grid", [_bits_i64(v, k, 0, 511) for k in q])
        signs = _table_rows(v, "iq2_signs", [_bits_i64(v, k, 9, 127) for k in q])
        return (grid, signs, scales[c])
    return _signed_x_dot(v, _Chunks(part))


def _unpack_iq2s(v: _Vec, blk):
    """IQ2_S: per 8 weights (k) the grid index qs[k] (byte 2 + k) | bits 2·(k % 4).. of qh[k // 4]
    (byte 66 + k // 4) << 8, and a sign byte (byte 34 + k: bit j the sign of weight j, no parity);
    scales (nibbles per 16 weights) at byte 74."""
    b = v.b
    scales = _scales_of_chunks(v, _iq2_scales16(v, blk, 74))
    sign_bits = v.load(blk, 34, _U8X32)

    def part(c):
        idx = []
        qh = b.zext(v.load(blk, 66 + c, _I8), _I64)     # scalar loads, as `_unpack_iq2xs`
        for l in range(4):
            k = 4 * c + l
            low = b.zext(v.load(blk, 2 + k, _I8), _I64)
            high = _bits_i64(v, qh, 2 * l, 3)
            idx.append(b.or_(low, b.shl(high, _I64(8))))
        grid = _table_rows(v, "iq2s_grid", idx)
        return (grid, _sign_bytes(v, sign_bits, 4 * c), scales[c])
    return _signed_x_dot(v, _Chunks(part))


IQ2_XXS_BLOCKS = _KQuant(_unpack_iq2xxs, 66, d_at=0, dmin_at=None, offset_scale=0, d_factor=0.125)
IQ2_XS_BLOCKS = _KQuant(_unpack_iq2xs, 74, d_at=0, dmin_at=None, offset_scale=0, d_factor=0.125)
IQ2_S_BLOCKS = _KQuant(_unpack_iq2s, 82, d_at=0, dmin_at=None, offset_scale=0, d_factor=0.125)


def _unpack_iq3xxs(v: _Vec, blk):
    """IQ3_XXS (98 bytes: d, 64 grid indices, 8 u32 aux): weight 32ib + 8l + j = d · (0.5 + s) · 0.5
    · grid[qs[8ib + 2l + j // 4]][j % 4] · sign, s = aux[ib] >> 28, the sign bit j of KSIGNS[the
    7-bit field l of aux[ib]] (the 7 bits and their parity as bit 7: an even count of minus signs
    per 8). d · (0.5 + s) · 0.5 = d/4 · (2s + 1) exactly (fp16 d times a 5-bit odd integer), so the
    integer scale is 2s + 1 and the reader's d_factor 1/4."""
    b = v.b
    aux = v.load(blk, 66, _I32X8)                  # lane ib
    signs = _ksign_bytes(v, aux)
    scale8 = b.trunc(b.add(b.shl(b.lshr(aux, v.splat_const(_I32X8, 28)), v.splat_const(_I32X8, 1)),
                           v.splat_const(_I32X8, 1)), ir.VectorType(_I16, 8))
    scale = b.shuffle_vector(scale8, scale8, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) * 2))
    table = _const_table(v, "iq3xxs_grid_rows", IQ3XXS_GRID_ROWS, _I32)

    def part(ib):
        grid = _fetch_rows(v, table, _I32, lambda: b.zext(v.load(blk, 2 + 8 * ib, ir.VectorType(_I8, 8)), _I32X8),
                          lambda: [_byte_i64(v, blk, 2 + 8 * ib + k) for k in range(8)])
        return _offset_codes(v, v.sign8(grid, _sign_bytes(v, signs, 4 * ib)))
    return _grid_dot(v, _Chunks(part), scale)


def _unpack_iq3s(v: _Vec, blk):
    """IQ3_S (110 bytes: d, qs[64], qh[8], signs[32], scales[4]): weight 4k + j = d · (1 + 2s) ·
    grid[qs[k] | bit k % 8 of qh[k // 8] << 8][j] · sign, the sign bit (4k + j) % 8 of signs[(4k +
    j) // 8], s = nibble ib % 2 of scales[ib // 2] for weights 32ib.."""
    b = v.b
    x16 = ir.VectorType(_I8, 16)
    raw = v.load(blk, 106, ir.VectorType(_I8, 4))
    placed = b.shuffle_vector(raw, raw, ir.Constant(ir.VectorType(_I32, 16), [ib % 8 // 2 for ib in range(16)]))
    s = b.and_(_shr_lanes(v, placed, [4 * (ib % 2) for ib in range(16)]), ir.Constant(x16, [15] * 16))
    scale = b.add(b.shl(b.zext(s, _I16X16), v.splat_const(_I16X16, 1)), v.splat_const(_I16X16, 1))
    table = _const_table(v, "iq3s_grid_rows", IQ3S_GRID_ROWS, _I32)
    bit_of = ir.Constant(_I32X8, list(range(8)))
    codes = []
    for ib in range(8):
        def vector_idx():
            low = b.zext(v.load(blk, 2 + 8 * ib, ir.VectorType(_I8, 8)), _I32X8)
            qh = v.splat(b.zext(v.load(blk, 66 + ib, _I8), _I32))
            return b.or_(low, b.shl(b.and_(b.lshr(qh, bit_of), v.splat_const(_I32X8, 1)), v.splat_const(_I32X8, 8)))

        grid = _fetch_rows(v, table, _I32, vector_idx)
        # the sign bits of weights 32ib.. are the i32 at 74 + 4ib as they lie (bit j: weight j)
        codes.append(_offset_codes(v, v.negate_where(grid, v.load(blk, 74 + 4 * ib, _I32))))
    return _grid_dot(v, codes, scale)


def _unpack_iq1s(v: _Vec, blk):
    """IQ1_S (50 bytes: d, qs[32], qh u16[8]): weight 32ib + 8l + j = d · (2s + 1) · (grid[g][j] +
    delta), g = qs[4ib + l] | ((qh[ib] >> 3l) & 7) << 8, s = (qh[ib] >> 12) & 7, delta = −1/8 if
    bit 15 of qh[ib] else 1/8, grid values −1, 0, 1. Exactly d/8 · (2s + 1) · (8·grid ± 1): the
    signed weights 8·grid ± 1 (|w| ≤ 9) and the integer scale 2s + 1; the reader's d_factor 1/8."""
    b = v.b
    qh = b.zext(v.load(blk, 34, ir.VectorType(_I16, 8)), _I32X8)        # lane ib
    scale8 = b.trunc(b.add(b.shl(b.and_(b.lshr(qh, v.splat_const(_I32X8, 12)), v.splat_const(_I32X8, 7)),
                                 v.splat_const(_I32X8, 1)), v.splat_const(_I32X8, 1)), ir.VectorType(_I16, 8))
    scale = b.shuffle_vector(scale8, scale8, ir.Constant(ir.VectorType(_I32, 16), list(range(8)) * 2))
    table = _const_table(v, "iq1s_code_rows", IQ1S_CODE_ROWS, _I64)
    x4 = ir.VectorType(_I32, 4)
    codes = []
    for ib in range(8):
        h = b.zext(v.load(blk, 34 + 2 * ib, _I16), _I32)

        def vector_idx():                   # qs bytes | index bits 8..10 from h
            high = b.shl(b.and_(b.lshr(v.splat(h, 4), ir.Constant(x4, [0, 3, 6, 9])), ir.Constant(x4, [7] * 4)),
                         ir.Constant(x4, [8] * 4))
            return b.or_(b.zext(v.load(blk, 2 + 4 * ib, ir.VectorType(_I8, 4)), x4), high)

        def scalar_idx():
            h64 = b.zext(h, _I64)
            return [b.or_(_byte_i64(v, blk, 2 + 4 * ib + l), b.shl(_bits_i64(v, h64, 3 * l, 7), _I64(8)))
                    for l in range(4)]
        grid = _fetch_rows(v, table, _I64, vector_idx, scalar_idx)      # 8·grid + GRID_OFFSET
        neg = b.icmp_unsigned("!=", b.and_(h, _I32(0x8000)), _I32(0))
        codes.append(b.add(grid, v.splat(b.select(neg, _I8(-1), _I8(1)), 32)))
    return _grid_dot(v, codes, scale)


IQ3_XXS_BLOCKS = _KQuant(_unpack_iq3xxs, 98, d_at=0, dmin_at=None, offset_scale=GRID_OFFSET, d_factor=0.25)
IQ3_S_BLOCKS = _KQuant(_unpack_iq3s, 110, d_at=0, dmin_at=None, offset_scale=GRID_OFFSET)
IQ1_S_BLOCKS = _KQuant(_unpack_iq1s, 50, d_at=0, dmin_at=None, offset_scale=GRID_OFFSET, d_factor=0.125)


def _iq1m_d(v: _Vec, blk):
    """IQ1_M's fp16 d, whose four nibbles are the top nibbles of the scale u16s at bytes 48..55
    (u16 i gives bits 4i..4i+3), as lane 0 of 8 float lanes."""
    b = v.b
    x4 = ir.VectorType(_I16, 4)
    words = v.load(blk, 48, x4)
    parts = b.and_(b.lshr(words, ir.Constant(x4, [12, 8, 4, 0])), ir.Constant(x4, [0x000F, 0x00F0, 0x0F00, 0xF000]))
    bits = v.tree([b.extract_element(parts, _I32(i)) for i in range(4)], b.or_)
    return _half_to_float(b, b.insert_element(ir.Constant(ir.VectorType(_I16, 8), None), bits, _I32(0)))


def _unpack_iq1m(v: _Vec, blk):
    """IQ1_M (56 bytes: qs[32], qh[16], 4 scale u16s): weight 8k + j = d · (2s + 1) · (grid[g][j] +
    delta), g = qs[k] | (nibble k of qh & 7) << 8 (nibble k: bits 4·(k % 2).. of qh[k // 2]),
    delta = −1/8 where bit 3 of that nibble is set, else 1/8, s = bits 3·(h % 4).. of u16 h // 4
    for the 16 weights h (a scale per 16, unlike IQ1_S's per 32). As IQ1_S: d/8 · (2s + 1) ·
    (8·grid ± 1), the codes 8·grid ± 1 + GRID_OFFSET (55..73) meeting x unsigned, the offset
    taken back through the x sums per 16, which share the scale granule (`_per16_dot`)."""
    b = v.b
    x4 = ir.VectorType(_I32, 4)
    words = v.load(blk, 48, ir.VectorType(_I16, 4))
    placed = b.shuffle_vector(words, words, ir.Constant(ir.VectorType(_I32, 16), [h // 4 for h in range(16)]))
    s = b.and_(b.lshr(placed, ir.Constant(_I16X16, [3 * (h % 4) for h in range(16)])), v.splat_const(_I16X16, 7))
    scale = b.add(b.add(s, s), v.splat_const(_I16X16, 1))
    table = _const_table(v, "iq1s_code_rows", IQ1S_CODE_ROWS, _I64)
    qh = v.load(blk, 32, ir.VectorType(_I8, 16))

    def part(c):        # 32 weights: groups k = 4c..4c+3, qh bytes 2c, 2c + 1
        def vector_idx():                   # qs bytes | index bits 8..10 from the qh nibbles
            pair = b.shuffle_vector(qh, qh, ir.Constant(x4, [2 * c, 2 * c, 2 * c + 1, 2 * c + 1]))
            high = b.shl(b.and_(b.lshr(b.zext(pair, x4), ir.Constant(x4, [0, 4, 0, 4])), ir.Constant(x4, [7] * 4)),
                         ir.Constant(x4, [8] * 4))
            return b.or_(b.zext(v.load(blk, 4 * c, ir.VectorType(_I8, 4)), x4), high)

        def scalar_idx():
            return [b.or_(_byte_i64(v, blk, 4 * c + l),
                          b.shl(_bits_i64(v, _byte_i64(v, blk, 32 + 2 * c + l // 2), 4 * (l % 2), 7), _I64(8)))
                    for l in range(4)]
        grid = _fetch_rows(v, table, _I64, vector_idx, scalar_idx)      # 8·grid + GRID_OFFSET
        spread = b.shuffle_vector(qh, qh, ir.Constant(ir.VectorType(_I32, 32), [2 * c + j // 16 for j in range(32)]))
        neg = b.and_(spread, ir.Constant(_U8X32, [0x08 if j // 8 % 2 == 0 else 0x80 for j in range(32)]))
        delta = b.select(b.icmp_unsigned("==", neg, ir.Constant(_U8X32, None)),
                         v.splat_const(_U8X32, 1), v.splat_const(_U8X32, -1))
        return b.add(grid, delta)
    return _per16_dot(v, _Chunks(part), scale, scale)


IQ1_M_BLOCKS = _KQuant(_unpack_iq1m, 56, d_at=None, dmin_at=None, offset_scale=GRID_OFFSET, d_factor=0.125,
                       d_of=_iq1m_d)


# ---- 32-weight blocks with a float scale each (Q8_0, Q4_0; Q5_0, IQ4_NL, MXFP4 below) ----------

class _SmallBlocks(NamedTuple):
    """A 32-weight block type with one float scale each: its size, how its 32 signed integer
    weights come out of blocks (`signed_weights(v, blk, byte_ats)`: 1 or 2 blocks, their weights
    end to end) and how the scales of blocks at the given byte offsets come out as float32 lanes
    (`scales(v, blk, byte_offs)`, lane i the block at byte_offs[i]; default: an fp16 at the
    block's byte 0). A weight is exactly
    scale × integer weight (`cpu.blocks`). Its activations are Q8_0 (`cpu.activations`): an fp16
    scale per 32, slot-major dx (slots, blocks).
    A type with a min (Q4_1, Q5_1: weight = d·q + m) gives min_at, the byte of its fp16 m in a
    block: its `signed_weights` are then the unsigned codes q (0..31, met by x as they are), its
    activations Q8_1 (dx (slots, 2·blocks): [d, s] per block, s = fp16(d_x·Σq_x)), and each block
    adds m·s, as llama.cpp's x86 dot does (not m·d_x·Σq_x: s is rounded on its own)."""
    block_bytes: int
    signed_weights: Callable
    scales: Callable = _Vec.f16s
    min_at: int | None = None

    def emit_span(self, builder, ops: _Operands, w_off, k, blk0, slot_lanes, n0, g_count: int, n_blk: int, pf):
        """n_blk (8 or 1) consecutive blocks (byte w_off; blocks blk0.. of activation chunk k)
        against slots n0 .. n0+G−1, into each slot's 8 float lanes (pointer slot_lanes(g)):
        block i adds (d_w,i · d_x,i) · (its 8 i32 lanes of Σ q·x) with one FMA, as llama.cpp's
        x86 Q8_0 dot does (the scale product of two fp16 values is exact). Even blocks chain onto
        the lanes, odd blocks into a second chain added at the end: two chains of 4 dependent
        FMAs per span instead of one of 8 (at N=1 nothing else hides their latency). The same
        operations for every slot, whatever G: slot bits do not depend on the grouping. With a
        min (Q8_1 activations), the blocks' m·s terms (lane i: block i) go onto the lanes by one
        more FMA after the chains: the lanes are summed at the end, so lane i may hold them.
        On `zmm_vnni` targets a full span goes two blocks per instruction (`_pairs`): the same
        integers and the same float operations in the same order, so the same bits."""
        assert n_blk in (1, 8)
        v = _Vec(builder)
        bb = self.block_bytes
        blk = ops.bytes_at("w", w_off)
        if n_blk > 1:   # the full 8-block spans carry the stream; tails are too short to matter
            v.prefetch_span(blk, pf, bb * n_blk)
        ds = self.scales(v, blk, [bb * i for i in range(n_blk)])
        mins = None if self.min_at is None else v.f16s(blk, [bb * i + self.min_at for i in range(n_blk)])
        per_block = 1 if mins is None else 2          # floats of dx per block: d (Q8_1: d, s)
        # One slot with signed weights stays on 256-bit vectors: there the weights' −128·Σw and
        # the x xor cost what the sign trick saved (measured slower, docs/MEASUREMENTS.md). Both
        # paths give the same bits, so the choice may depend on G.
        if v.zmm_vnni and n_blk == 8 and (g_count > 1 or self.min_at is not None):
            weights = None
            pairs = self._pairs(v, [self.signed_weights(v, blk, (bb * i, bb * i + bb)) for i in range(0, 8, 2)])
        else:
            weights = [self.signed_weights(v, blk, (bb * i,)) for i in range(n_blk)]
            pairs = None
        xs, dxs = ops.shape("xq")[1], ops.shape("dx")[1]
        for g in range(g_count):
            n = builder.add(n0, _I64(g))
            x = ops.bytes_at("xq", builder.add(builder.mul(n, xs),
                                               builder.add(builder.mul(k, _I64(256)), builder.mul(blk0, _I64(32)))))
            at = builder.add(builder.mul(n, dxs), builder.mul(builder.add(builder.mul(k, _I64(8)), blk0),
                                                              _I64(per_block)))
            raw = builder.load(ops.floats_at("dx", at, n_blk * per_block), align=4)
            if n_blk == 1:      # lane 0 (and the s in lane 1): the other lanes stay 0
                keep = list(range(per_block)) + [per_block] * (7 * per_block)
                raw = builder.shuffle_vector(raw, ir.Constant(raw.type, None),
                                             ir.Constant(ir.VectorType(_I32, 8 * per_block), keep))
            xd = raw if mins is None else v.lanes(raw, range(0, 16, 2))
            scales = builder.fmul(ds, xd)
            lanes = slot_lanes(g)
            if pairs is not None:
                total = pairs(x, scales, builder.load(lanes, align=4))
            else:
                chains = [builder.load(lanes, align=4), None]
                for i, q in enumerate(weights):
                    dot = v.signed_dot32(q, v.load(x, 32 * i, _U8X32)) if mins is None else \
                        v.dot_u8_i8(q, v.load(x, 32 * i, _U8X32))
                    p = builder.sitofp(dot, _F32X8)
                    s = v.lane_splat(scales, i)
                    c = chains[i % 2]
                    chains[i % 2] = builder.fmul(s, p) if c is None else v.fma(s, p, c)
                total = chains[0] if chains[1] is None else builder.fadd(chains[0], chains[1])
            if mins is not None:
                total = v.fma(mins, v.lanes(raw, range(1, 16, 2)), total)
            builder.store(total, lanes, align=4)

    def _pairs(self, v: _Vec, wide):
        """The 8 blocks' part of a span, two blocks per 512-bit register (`wide`: the 4 pairs'
        64 weights each): returns dot(x, scales, lanes) → lanes + the 8 blocks' products (x the
        span's 256 activation bytes, scales the 8 blocks' d_w·d_x as float lanes). Register j
        holds blocks 2j (lanes 0..7) and 2j+1 (lanes 8..15): one `vpdpbusd`, one `vcvtdq2ps`,
        one FMA cover both, half the per-slot instructions of the 256-bit path (which is
        compute-bound at N > 1).
        Same bits as the 256-bit path: every i32 lane is the same integer, and the float chain
        is the same. Lanes 0..7 run the even blocks' chain from `lanes`, lanes 8..15 the odd
        blocks' chain from −0.0 (fma(s, p, −0.0) is fmul(s, p) bit for bit, the zero's sign
        included), and the two halves are added at the end as the two chains were.
        Signed weights meet x through a bias instead of the sign trick (`vpsignb` has no 512-bit
        form): u = x + 128 (x ^ 0x80, |x| ≤ 127) is unsigned, and per 4-byte group
        Σ u·w − 128·Σ w = Σ x·w exactly (|Σ u·w| < 2**17). The −128·Σ w lanes depend on the
        weights alone: computed once per span, they are the accumulator the products add to.
        Unsigned codes (a min: Q4_1, Q5_1) meet x as they are."""
        b = v.b
        i32x16, f32x16 = ir.VectorType(_I32, 16), ir.VectorType(_F32, 16)
        zero = ir.Constant(i32x16, None)
        bias = v.splat_const(_U8X64, 0x80)
        signed = self.min_at is None
        starts = [b.sub(zero, v.dot_u8_i8_512(zero, bias, w)) if signed else zero for w in wide]
        odd_start = v.splat_const(_F32X8, -0.0)

        def dot(x, scales, lanes):
            acc = b.shuffle_vector(lanes, odd_start, ir.Constant(ir.VectorType(_I32, 16), list(range(16))))
            for j, w in enumerate(wide):
                xj = v.load(x, 64 * j, _U8X64)
                sums = v.dot_u8_i8_512(starts[j], b.xor(xj, bias), w) if signed else v.dot_u8_i8_512(zero, w, xj)
                s = b.shuffle_vector(scales, scales,
                                     ir.Constant(ir.VectorType(_I32, 16), [2 * j] * 8 + [2 * j + 1] * 8))
                acc = v.fma(s, b.sitofp(sums, f32x16), acc)
            return b.fadd(v.lanes(acc, range(8)), v.lanes(acc, range(8, 16)))
        return dot

    def emit_row(self, builder, ops: _Operands, row_off, n0, g_count: int, pf):
        """acc[n0 .. n0+G) = the row at byte row_off · x[n]: spans of 8 blocks (one activation
        chunk), a shorter tail block by block, each slot's lanes summed at the end in `_Vec.sums`'
        fixed tree."""
        lanes = cgutils.alloca_once(builder, _F32X8, size=g_count)    # promoted to registers
        for g in range(g_count):
            builder.store(ir.Constant(_F32X8, None), builder.gep(lanes, [_I32(g)]))

        def slot_lanes(g):
            return builder.gep(lanes, [_I32(g)])

        bb = self.block_bytes
        n_blk = builder.udiv(ops.shape("w")[1], _I64(bb))
        n_chunks = builder.udiv(builder.add(n_blk, _I64(7)), _I64(8))
        with cgutils.for_range(builder, n_chunks) as loop:
            k = loop.index
            first = builder.mul(k, _I64(8))
            off = builder.add(row_off, builder.mul(first, _I64(bb)))
            whole = builder.icmp_unsigned("<=", builder.add(first, _I64(8)), n_blk)
            with builder.if_else(whole) as (span, tail):
                with span:
                    self.emit_span(builder, ops, off, k, _I64(0), slot_lanes, n0, g_count, 8, pf)
                with tail:
                    with cgutils.for_range(builder, builder.sub(n_blk, first)) as t:
                        self.emit_span(builder, ops, builder.add(off, builder.mul(t.index, _I64(bb))), k,
                                       t.index, slot_lanes, n0, g_count, 1, pf)
        totals = _Vec(builder).sums([builder.load(slot_lanes(g)) for g in range(g_count)], builder.fadd)
        builder.store(totals, ops.floats_at("acc", n0, g_count), align=4)


def _span_intrinsic(blocks: _SmallBlocks):
    """Intrinsic factory: `_SmallBlocks.emit_span` as dot(w, w_off, xq, dx, k, blk0, acc, n0, pf,
    G, NB) (the tiled matmul's Q8_0/Q4_0 path): acc (slots, 8) float32 holds each slot's 8 lanes,
    to be summed as `_Vec.sums` does (`cpu.matmul._slot_total`)."""

    def typer(typingctx, w, w_off, xq, dx, k, blk0, acc, n0, pf, G, NB):
        if not (isinstance(G, types.IntegerLiteral) and isinstance(NB, types.IntegerLiteral)):
            return None

        def codegen(context, builder, sig, args):
            _, w_off_v, _, _, k_v, blk0_v, _, n0_v, pf_v, _, _ = args
            ops = _Operands(context, builder, sig, args, w=0, xq=2, dx=3, acc=6)

            def slot_lanes(g):
                return ops.floats_at("acc", builder.mul(builder.add(n0_v, _I64(g)), _I64(8)), 8)

            blocks.emit_span(builder, ops, w_off_v, k_v, blk0_v, slot_lanes, n0_v, G.literal_value,
                             NB.literal_value, pf_v)
            return context.get_dummy_value()

        return types.none(w, types.intp, xq, dx, types.intp, types.intp, acc, types.intp, types.intp, G, NB), codegen

    return typer


# A `_SmallBlocks` weight reader takes the byte offsets `ats` of 1 or 2 blocks and gives their
# 32 weights each, one vector of 32·len(ats) bytes in block order (2: the 512-bit span path).

def _join(v: _Vec, parts):
    """The vectors of `parts` (equal lengths) end to end, as one vector."""
    b = v.b
    while len(parts) > 1:
        n = 2 * parts[0].type.count
        parts = [b.shuffle_vector(parts[i], parts[i + 1], ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                 for i in range(0, len(parts), 2)]
    return parts[0]


def _q8_0_weights(v: _Vec, blk, ats):
    return _join(v, [v.load(blk, at + 2, _U8X32) for at in ats])


def _nibbles(v: _Vec, blk, ats):
    """The 32 unsigned 4-bit codes of the 16 bytes at blk+at, for each at in ats, in element
    order: the low nibbles are a block's elements 0..15, the high ones 16..31 (Q4_0, Q5_0,
    IQ4_NL, MXFP4, Q4_1, Q5_1, IQ4_XS). The high nibbles come from one 16-bit shift of the bytes
    (the mask then drops what crossed from the neighbour byte), the halves placed, then masked: a
    per-half byte shift of the placed vector has no x86 instruction, and LLVM widened it to words
    and packed back (8 instructions instead of 4). Two blocks share the shift and the mask: their
    bytes are joined first, and one shuffle places the four halves."""
    b = v.b
    x16 = ir.VectorType(_I8, 16)
    half = _join(v, [v.load(blk, at, x16) for at in ats])
    n = half.type.count
    words = ir.VectorType(_I16, n // 2)
    high = b.bitcast(b.lshr(b.bitcast(half, words), ir.Constant(words, [4] * (n // 2))), half.type)
    order = [i for blk_i in range(n // 16) for i in list(range(16 * blk_i, 16 * blk_i + 16))
             + list(range(n + 16 * blk_i, n + 16 * blk_i + 16))]
    both = b.shuffle_vector(half, high, ir.Constant(ir.VectorType(_I32, 2 * n), order))
    return v.and8(both, 0x0F)


def _nibbles32(v: _Vec, blk, at: int):
    """`_nibbles` of the one block at blk+at: its 32 codes."""
    return _nibbles(v, blk, (at,))


def _q4_0_weights(v: _Vec, blk, ats):
    """32 signed weights q − 8 per block."""
    q = _nibbles(v, blk, [at + 2 for at in ats])
    return v.b.sub(q, v.splat_const(q.type, 8))


Q8_0_BLOCKS = _SmallBlocks(34, _q8_0_weights)
Q4_0_BLOCKS = _SmallBlocks(18, _q4_0_weights)
dot_q8_0 = intrinsic(_span_intrinsic(Q8_0_BLOCKS))
dot_q4_0 = intrinsic(_span_intrinsic(Q4_0_BLOCKS))


# ---- more 32-weight blocks on Q8_0 activations (Q5_0, IQ4_NL, MXFP4) ---------------------------
#
# Each is a `_SmallBlocks`: the codes become 32 signed int8 weights in registers (|w| ≤ 127, so
# `signed_dot32` cannot saturate) and the block's float scale is exact as float32, so the row
# dot is the Q4_0 one with another unpacking. llama.cpp's x86 dots for these types scale each
# block's integer sum by d_w · d_x in one FMA as well.

# The non-linear code tables (ggml-common.h kvalues_iq4nl / kvalues_mxfp4): weight = scale ×
# table[code]. MXFP4's holds twice the e2m1 values (integers), its scale is halved to match.
IQ4NL_KVALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _lookup16(v: _Vec, idx, table):
    """table[idx] per byte, idx a 32 (or, AVX-512BW only, 64) x i8 vector of codes 0..15, table
    16 int8 values: one `vpshufb` (it looks up within each 128-bit lane, so the table is in every
    lane), else a tree of selects on the 4 index bits."""
    ty = idx.type
    if v.avx2:
        name = "llvm.x86.avx512.pshuf.b.512" if ty.count == 64 else "llvm.x86.avx2.pshuf.b"
        return v._x86(name, ty, [ir.Constant(ty, list(table) * (ty.count // 16)), idx])
    b, zero = v.b, ir.Constant(ty, None)
    level = [v.splat_const(ty, t) for t in table]
    for bit in range(4):
        on = b.icmp_unsigned("!=", v.and8(idx, 1 << bit), zero)
        level = [b.select(on, level[i + 1], level[i]) for i in range(0, len(level), 2)]
    return level[0]


def _fifth_bit_clear(v: _Vec, blk, ats):
    """Per element (32 x i1 per block, element order): is its fifth bit clear? Element j's fifth
    bit is bit j of the little-endian u32 at blk+at: byte j/8, bit j%8 (Q5_0, Q5_1)."""
    b = v.b
    qh = _join(v, [v.load(blk, at, ir.VectorType(_I8, 4)) for at in ats])
    n = 32 * len(ats)
    spread = b.shuffle_vector(qh, qh, ir.Constant(ir.VectorType(_I32, n), [j // 8 for j in range(n)]))
    ty = ir.VectorType(_I8, n)
    bit = b.and_(spread, ir.Constant(ty, [1 << (j % 8) for j in range(n)]))
    return b.icmp_unsigned("==", bit, ir.Constant(ty, None))


def _q5_0_weights(v: _Vec, blk, ats):
    """32 signed weights (nibble | fifth bit << 4) − 16 per block: nibble − 16 where the bit is clear."""
    q = _nibbles(v, blk, [at + 6 for at in ats])
    offset = v.b.select(_fifth_bit_clear(v, blk, [at + 2 for at in ats]), v.splat_const(q.type, 16),
                        ir.Constant(q.type, None))
    return v.b.sub(q, offset)


def _iq4_nl_weights(v: _Vec, blk, ats):
    return _lookup16(v, _nibbles(v, blk, [at + 2 for at in ats]), IQ4NL_KVALUES)


def _mxfp4_weights(v: _Vec, blk, ats):
    return _lookup16(v, _nibbles(v, blk, [at + 1 for at in ats]), MXFP4_KVALUES)


def _e8m0_half_to_float(builder: ir.IRBuilder, e):
    """ggml's E8M0_TO_FP32_HALF: the e8m0 exponent byte e (i32, or a vector of them) → the float32
    2**(e − 128), exactly: e ≥ 2 is a normal number (biased exponent e − 1), e = 0, 1 are the
    subnormals 2**−128, 2**−127 (bit 21, 22 of the mantissa)."""
    vec = isinstance(e.type, ir.VectorType)

    def c(value):
        return ir.Constant(e.type, [_I32(value)] * e.type.count) if vec else _I32(value)

    b = builder
    normal = b.shl(b.sub(e, c(1)), c(23))
    tiny = b.shl(c(0x00200000), e)
    bits = b.select(b.icmp_unsigned("<", e, c(2)), tiny, normal)
    return b.bitcast(bits, ir.VectorType(_F32, e.type.count) if vec else _F32)


def _mxfp4_scales(v: _Vec, blk, byte_offs):
    """The blocks' halved e8m0 scales (a byte at each block's byte 0) as float32 lanes."""
    e = ir.Constant(_I32X8, None)
    for lane, off in enumerate(byte_offs):
        e = v.b.insert_element(e, v.b.zext(v.load(blk, off, _I8), _I32), _I32(lane))
    return _e8m0_half_to_float(v.b, e)


@intrinsic
def e8m0_half_at(typingctx, arr, byte_off):
    """MXFP4's block scale: the e8m0 byte at byte offset byte_off of a uint8 array, as the
    float32 2**(e − 128) (`_e8m0_half_to_float`)."""
    def codegen(context, builder, sig, args):
        p = _Operands(context, builder, sig, args, arr=0).bytes_at("arr", args[1])
        return _e8m0_half_to_float(builder, builder.zext(builder.load(p), _I32))
    return types.float32(arr, types.intp), codegen


def _q4_1_codes(v: _Vec, blk, ats):
    """32 unsigned codes 0..15 per block (d at byte 0, m at 2, nibbles at 4)."""
    return _nibbles(v, blk, [at + 4 for at in ats])


def _q5_1_codes(v: _Vec, blk, ats):
    """32 unsigned codes nibble | fifth bit << 4 per block (d at 0, m at 2, qh u32 at 4, nibbles at 8)."""
    q = _nibbles(v, blk, [at + 8 for at in ats])
    high = v.b.select(_fifth_bit_clear(v, blk, [at + 4 for at in ats]), ir.Constant(q.type, None),
                      v.splat_const(q.type, 16))
    return v.b.or_(q, high)


Q5_0_BLOCKS = _SmallBlocks(22, _q5_0_weights)
Q4_1_BLOCKS = _SmallBlocks(20, _q4_1_codes, min_at=2)
Q5_1_BLOCKS = _SmallBlocks(24, _q5_1_codes, min_at=2)
IQ4_NL_BLOCKS = _SmallBlocks(18, _iq4_nl_weights)
MXFP4_BLOCKS = _SmallBlocks(17, _mxfp4_weights, _mxfp4_scales)


# ---- one weight row against all slots, every quantised type ------------------------------------

def _emit_groups(builder, n_slots, emit, group: int):
    """emit(n0, G) for the slots in groups of `group`, then one group of the 1..group−1 left (a
    group shares one decode of the weights)."""
    whole = builder.udiv(n_slots, _I64(group))
    with cgutils.for_range(builder, whole) as loop:
        emit(builder.mul(loop.index, _I64(group)), group)
    rest_at = builder.mul(whole, _I64(group))
    done = builder.append_basic_block("groups.done")
    switch = builder.switch(builder.sub(n_slots, rest_at), done)
    for g in range(1, group):
        block = builder.append_basic_block(f"groups.{g}")
        switch.add_case(_I64(g), block)
        builder.position_at_end(block)
        emit(rest_at, g)
        builder.branch(done)
    builder.position_at_end(done)


def _wide_group() -> int:
    """Slots per group of the wide row dot: 8 where AVX-512 gives 32 vector registers (the
    unpacked weights and 8 slots' lanes stay in registers), else 4."""
    return 8 if _target_has_32_vector_registers() else 4


WIDE_GROUP = _wide_group()


def row_dot_intrinsic(readers: dict, group: int = 4):
    """Intrinsic factory: row_dot(type_mask, wtype, w, r, xq, dx, bs, acc, pf) sets acc[n] =
    Σ_c W[r, c] · x[n, c] for every slot n of acc, W's blocks read by readers[wtype] (ggml type
    id → _KQuant or _SmallBlocks; other ids leave acc as it is), weights `pf` bytes ahead
    prefetched. type_mask, a compile-time integer (bit t: type t, `cpu.variants`), picks the
    readers whose code is emitted: a type outside it also leaves acc as it is. The type
    and slot-group dispatch are emitted here too: written as Numba functions around per-type
    intrinsics, each row call copied its five array arguments into the inlined bodies, and the
    reference counts of those copies (atomic, shared by every thread) cost more than the dots of
    a 512-wide expert row. Slots go in groups of `group` (one decode of the weights per group;
    more slots per group, more code per type). Grouping cannot change any slot's bits (integer
    sums, lane-wise combines, each slot adds its blocks in order)."""

    def typer(typingctx, type_mask, wtype, w, r, xq, dx, bs, acc, pf):
        if not isinstance(type_mask, types.IntegerLiteral):
            return None
        emitted = {t: reader for t, reader in readers.items() if (type_mask.literal_value >> t) & 1}

        def codegen(context, builder, sig, args):
            _, wtype_v, _, r_v, _, _, _, _, pf_v = args
            ops = _Operands(context, builder, sig, args, w=2, xq=4, dx=5, bs=6, acc=7)
            row_off = builder.mul(r_v, ops.shape("w")[1])
            n_slots = ops.shape("acc")[0]
            done = builder.append_basic_block("row.done")
            switch = builder.switch(wtype_v, done)
            for type_id, reader in emitted.items():
                block = builder.append_basic_block(f"row.type{type_id}")
                switch.add_case(_I64(type_id), block)
                builder.position_at_end(block)
                _emit_groups(builder, n_slots, lambda n0, g: reader.emit_row(builder, ops, row_off, n0, g, pf_v), group)
                builder.branch(done)
            builder.position_at_end(done)
            return context.get_dummy_value()

        return types.none(type_mask, types.int64, w, types.intp, xq, dx, bs, acc, types.intp), codegen

    return typer


# ---- decoded K-quant tiles (the many-row path, `cpu.matmul`) -----------------------------------
#
# When hundreds of input slots share a weight row, the row is decoded once into a record that the
# dot product only has to load: no nibble unpacking, no scale extraction, no shuffles per use.
# Record of one super-block (TILE_RECORD bytes):
#   [0, 256)    the 256 unsigned codes, in element order (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63)
#   [256, 512)  per 32-element chunk c, the 16 i16 multipliers of `vpmaddwd` after `vpmaddubsw`
#               (pair lanes 0..7 cover elements 32c..32c+15, lanes 8..15 the next 16): a K4 scale
#               repeated, or Q6_K's two 16-element scales
#   [512, 544)  16 i16 "aux" weights, lane t meeting the activation sum of elements 16t..16t+15:
#               the min of its 32-element sub-block (Q4_K/Q5_K) or its scale (Q6_K)
#   [544, 552)  d, dmin as float32 (exact copies of the fp16 fields; dmin = 0 for Q6_K)
# The dot computes the same integers as `dot_q4_k`/`dot_q5_k`/`dot_q6_k` (main = Σ sc·q·x,
# aux = Σ aux·(x sums)) and combines them with the same float operations, in the same order, so
# each output has the bits of the N-input kernels.

TILE_RECORD = 552
_REC_SCALES, _REC_AUX, _REC_D = 256, 512, 544


def _k4_codes(v: _Vec, blk, qs_at: int, qh_at):
    """The 8 chunks of 32 unsigned Q4_K (qh_at None) or Q5_K codes, element order."""
    qh = v.load(blk, qh_at, _U8X32) if qh_at is not None else None
    chunks = []
    for c in range(4):
        q = v.load(blk, qs_at + 32 * c, _U8X32)
        lo, hi = v.and8(q, 0x0F), v.shr8(q, 4)
        if qh is not None:
            lo = v.b.or_(lo, v.bits8(qh, 2 * c, 1, 4))
            hi = v.b.or_(hi, v.bits8(qh, 2 * c + 1, 1, 4))
        chunks += [lo, hi]
    return chunks


def _decode_k4(v: _Vec, blk, qh_at):
    """Q4_K/Q5_K record fields: codes, each chunk's scale repeated, the mins paired with the x
    sums per 16 (as in `_k4_dot`), d and dmin."""
    scm = _k4_scales(v, blk, 4)
    codes = _k4_codes(v, blk, 48 if qh_at is not None else 16, qh_at)
    chunk_scales = [v.pick16(scm, [c] * 16) for c in range(8)]
    aux = v.pick16(scm, [8 + t // 2 for t in range(16)])
    return codes, chunk_scales, aux, v.f16s(blk, [0, 2])


def _decode_q6k(v: _Vec, blk):
    """Q6_K record fields, the unpacking of `_unpack_q6k` stored in element order (its part with
    16-element sub-block t is chunk t/2)."""
    b = v.b
    sc = b.sext(v.load(blk, 192, ir.VectorType(_I8, 16)), _I16X16)
    codes = [None] * 8
    for h in range(2):
        ql_a = v.load(blk, 64 * h, _U8X32)
        ql_b = v.load(blk, 64 * h + 32, _U8X32)
        qh = v.load(blk, 128 + 32 * h, _U8X32)
        codes[4 * h + 0] = b.or_(v.and8(ql_a, 0x0F), v.bits8(qh, 0, 3, 4))
        codes[4 * h + 1] = b.or_(v.and8(ql_b, 0x0F), v.bits8(qh, 2, 3, 4))
        codes[4 * h + 2] = b.or_(v.shr8(ql_a, 4), v.bits8(qh, 4, 3, 4))
        codes[4 * h + 3] = b.or_(v.shr8(ql_b, 4), v.bits8(qh, 6, 3, 4))
    chunk_scales = [v.pick16(sc, [2 * c] * 8 + [2 * c + 1] * 8) for c in range(8)]
    return codes, chunk_scales, sc, v.f16s(blk, [208])


def _decode_k_intrinsic(decode):
    """Intrinsic factory: decode the super-block at byte w_off of w into the record at byte
    rec_off of `tile` (a uint8 array)."""

    def typer(typingctx, w, w_off, tile, rec_off):
        def codegen(context, builder, sig, args):
            v = _Vec(builder)
            ops = _Operands(context, builder, sig, args, w=0, tile=2)
            blk, rec = ops.bytes_at("w", args[1]), ops.bytes_at("tile", args[3])
            codes, chunk_scales, aux, ds = decode(v, blk)

            def store(value, at):
                builder.store(value, builder.bitcast(builder.gep(rec, [_I64(at)]), value.type.as_pointer()), align=1)

            for c in range(8):
                store(codes[c], 32 * c)
                store(chunk_scales[c], _REC_SCALES + 32 * c)
            store(aux, _REC_AUX)
            store(v.lanes(ds, [0, 1]), _REC_D)   # lane 1 is 0 where the type has no dmin
            return context.get_dummy_value()

        return types.none(w, types.intp, tile, types.intp), codegen

    return typer


decode_q4_k_block = intrinsic(_decode_k_intrinsic(lambda v, blk: _decode_k4(v, blk, None)))
decode_q5_k_block = intrinsic(_decode_k_intrinsic(lambda v, blk: _decode_k4(v, blk, 16)))
decode_q6_k_block = intrinsic(_decode_k_intrinsic(_decode_q6k))


@intrinsic
def tile_dot_k(typingctx, tile, rec_off, xq, b, bs, dx, acc, i, MINS):
    """One decoded super-block (record at byte rec_off of `tile`, activation block b) against the
    8 slots of a group: xq (8, cols) int8, bs (8, cols/16) int16, dx (blocks, 8) f32, and acc
    (rows, 8, 8) f32 holding 8 float lanes per (row, slot): row i's lanes of slot g take the
    block's part as the N-input row dot's do (`_Vec.combine`, MINS: Q4_K/Q5_K, else Q6_K's
    offset of 32), so summed in `_Vec.sums`' tree after the last block they give its bits."""
    if not isinstance(MINS, types.BooleanLiteral):
        return None

    def codegen(context, builder, sig, args):
        tile_v, rec_off_v, _, b_v, _, _, _, i_v, _ = args
        v = _Vec(builder)
        ops = _Operands(context, builder, sig, args, tile=0, xq=2, bs=4, dx=5, acc=6)
        rec = ops.bytes_at("tile", rec_off_v)
        xs, bss = ops.shape("xq")[1], ops.shape("bs")[1]
        block = builder.mul(b_v, _I64(256))
        slots = [ops.bytes_at("xq", builder.add(builder.mul(_I64(g), xs), block)) for g in range(8)]
        mains = [None] * 8
        for c in range(8):
            q = v.load(rec, 32 * c, _U8X32)
            s = v.load(rec, _REC_SCALES + 32 * c, _I16X16)
            for g in range(8):
                p = v.madd(v.maddubs(q, v.load(slots[g], 32 * c, _U8X32)), s)
                mains[g] = p if mains[g] is None else builder.add(mains[g], p)
        aux_w = v.load(rec, _REC_AUX, _I16X16)
        ds = v.load(rec, _REC_D, ir.VectorType(_F32, 2))
        dxv = builder.load(ops.floats_at("dx", builder.mul(b_v, _I64(8)), 8), align=4)
        offset_scale = None if MINS.literal_value else 32
        for g in range(8):
            sums = ops.bytes_at("bs", builder.add(builder.mul(_I64(g), bss), builder.mul(b_v, _I64(16))))
            aux = v.madd(aux_w, v.load(sums, 0, _I16X16))
            lanes = ops.floats_at("acc", builder.mul(builder.add(builder.mul(i_v, _I64(8)), _I64(g)), _I64(8)), 8)
            part = v.combine(builder.load(lanes, align=4), ds, builder.extract_element(dxv, _I32(g)), mains[g], aux,
                             offset_scale)
            builder.store(part, lanes, align=4)
        return context.get_dummy_value()

    return types.none(tile, types.intp, xq, types.intp, bs, dx, acc, types.intp, MINS), codegen
