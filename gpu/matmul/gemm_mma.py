"""Tensor-core GEMM for prompt chunks: out (n, rows) = x (n, cols) · Wᵀ with fp16 products and
float32 sums, through `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (Ampere and Hopper).

Numba has no tensor-core API; gpu/intrinsics.py emits the instruction as inline PTX, and
gpu/mma_layout.py says which lane holds which matrix element. The instruction's A operand is x
(16 tokens × 16 k), its B operand the weights (16 k × 8 weight rows), so D is a 16 × 8 piece of
`out` itself (tokens × rows).

Why this shape. The first version decoded each block's weights into shared memory and had
every warp read its fragments back: ~15 (Q4_K) to ~25 (Q6_K) instructions per mma on
converting x, storing and reloading weights, and its Q6_K loads (18 per 16 weights, each lane
a different row) saturated the L1. Here the weights never touch shared memory (6.3-7.5
instructions per mma on the 16-row × 128-token warp tiles):

* a warp owns 8·NB weight rows × all BN tokens of its block; lane (g, t) = (lane / 4, lane % 4)
  decodes, per K step of 64 columns, one 16-weight unit (gpu/matmul/gemm_units.py) of each of its NB
  rows 8j + g: columns 16t .. 16t + 15. The four lanes of a row read one 64-column span of it
  (a quarter of the L1 traffic of a lane per row), and each decoded weight serves the BN tokens
  of the block from registers;
* the k order inside a K step is permuted so that this is exactly the B operand: in k16 step s
  the lane's pair slot q (k pair t for q = 0, t + 4 for q = 1) is the physical column pair
  8t + 2s + q of the K step (`fragment_source`), for x as for the weights;
* x is converted to fp16 pairs once per call (`to_fp16_fragments`, a small kernel into a
  scratch buffer) and laid out in that order: per 16 tokens and K step, 512 words holding each
  lane's four A registers of each k16 step, so that one 16-byte shared load is one mma's A
  operand. Each K step's x goes global → shared with cp.async (no registers, no conversion),
  double-buffered, one barrier per step;
* the block's warps are stacked along the rows and share the x tile; the next step's weights
  are loaded before, and decoded during, this step's products (independent instructions the
  compiler interleaves with the mma), so DRAM latency and decode ALU work overlap the tensor
  cores.

Numerics. Every weight and x value is rounded to fp16 (relative error <= 2^-11, or 2^-25
absolute below 2^-14); the products are exact and summed in float32 by the tensor cores. So a
result is about as accurate as a float32 sum of operands with 11-bit mantissas: fine next to
the weights' own quantisation error (Q8_0 ~2^-8, Q4_K ~2^-4). fp16 tops out at 65504: a larger
|x| or |weight| becomes ±inf and its token's outputs inf/NaN, loudly rather than silently
wrong. We accept that, as llama.cpp's fp16 cuBLAS prompt path does: decoded weights are small,
the inputs of the attention/GDN projections and FFN gate/up are RMS-normed, and the FFN down
projection's input silu(gate)·up, the one unnormalised operand, stays far below 65504 in the
models we serve. F32 weights stay on the float32 kernel (gpu.matmul.gemm.precision_for).

Bits. One chain of mma steps per output, in increasing K step and k16 step, with the same k
permutation whatever the tile; long rows split K into a fixed number of such chains whose
partial sums are added in order (`k_splits`, a function of cols alone). So an output's bits
depend only on its weight row and x row (the tensor cores compute each element of D from its
row of A, column of B and its C alone): the rows of an n-row call keep their bits in any
other call, on any of these tiles. They differ from the float32 kernel's bits.

The CUDA simulator runs this kernel too, with numpy stand-ins for the instruction
(gpu.intrinsics.mma_m16n8k16) and plain copies for cp.async and the vector shared loads: the
tile walk, staging and addressing are the real code.
"""
from __future__ import annotations

from dataclasses import dataclass

from numba import cuda, float32, uint32

from ..runtime.device import simulated
from .gemm_units import GEMM_STAMP, GemmUnit
from ..intrinsics import device_function, mma_m16n8k16, pack_f16x2
from .kernel_source import specialise as _specialise

BK = 64              # columns per K step: four k16 steps, one 16-weight unit per lane and row
BLOCK_WORDS = 512    # fp16 pair words of x per 16 tokens and K step: 32 lanes × 4 steps × 4 registers
CHUNKS = BLOCK_WORDS // 4    # 16-byte cp.async copies per 16 tokens and K step (one per lane and step)
# cp.async and the 16-byte shared loads need 16-byte aligned tiles; the simulator takes no
# alignment argument
ALIGN = None if simulated() else 16


@dataclass(frozen=True)
class MmaTile:
    """A tensor-core block: WARPS warps stacked along the weight rows, each owning ROW_BLOCKS
    blocks of 8 rows × TOKEN_BLOCKS blocks of 16 tokens (all of the block's tokens).
    BLOCKS_PER_SM is the kernel's launch bound: ptxas keeps the registers per thread within
    65536 / (threads · blocks_per_sm), so that many blocks fit on an SM at once."""
    warps: int
    row_blocks: int
    token_blocks: int
    blocks_per_sm: int
    efficiency: float      # relative rate of a full SM running this tile (for picking a tile)
    precision = "fp16"     # products of fp16-rounded operands (a class constant, not a field)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def block_rows(self) -> int:
        return 8 * self.row_blocks * self.warps

    @property
    def block_tokens(self) -> int:
        return 16 * self.token_blocks

    @property
    def name(self) -> str:
        return f"mma{self.block_rows}x{self.block_tokens}w{self.warps}"

    @property
    def launch_bounds(self) -> tuple[int, int]:
        """(max threads per block, min blocks per SM) for cuda.jit."""
        return self.threads, self.blocks_per_sm


def fragments_shape(n: int, cols: int, token_blocks: int) -> tuple[int, int]:
    """Shape of the fp16 x buffer for tiles of `token_blocks` 16-token blocks: a row per K step
    (columns zero-padded to whole steps), BLOCK_WORDS per 16 tokens (tokens zero-padded to
    whole tiles, so that no copy needs a bound)."""
    tiles = -(-n // (16 * token_blocks))
    return -(-cols // BK), tiles * token_blocks * BLOCK_WORDS


# ---------------------------------------------------------------- intrinsics (real GPU and simulator)

if not simulated():
    from llvmlite import ir
    from numba import types
    from numba.cuda import cgutils
    from numba.cuda.extending import intrinsic

    def _shared_address(context, builder, aryty, ary, index, indexty):
        """The 32-bit .shared address of ary[index] (a 1-D shared array)."""
        arystruct = context.make_array(aryty)(context, builder, value=ary)
        ptr = cgutils.get_item_pointer(context, builder, aryty, arystruct,
                                       [context.cast(builder, index, indexty, types.intp)])
        shared = builder.addrspacecast(ptr, ir.PointerType(ptr.type.pointee, 3))
        return shared

    @intrinsic
    def _ld_shared_v4_u32(typingctx, array, index):
        """ld.shared.v4.u32 of array[index:index + 4] (a 1-D uint32 shared array)."""
        if not (isinstance(array, types.Array) and array.dtype == types.uint32 and array.ndim == 1):
            return None
        sig = types.UniTuple(types.uint32, 4)(array, index)

        def codegen(context, builder, sig, args):
            shared = _shared_address(context, builder, sig.args[0], args[0], args[1], sig.args[1])
            vecty = ir.VectorType(ir.IntType(32), 4)
            vec = builder.load(builder.bitcast(shared, ir.PointerType(vecty, 3)), align=16)
            return context.make_tuple(builder, sig.return_type,
                                      [builder.extract_element(vec, ir.Constant(ir.IntType(32), k))
                                       for k in range(4)])

        return sig, codegen

    @intrinsic
    def _cp_async_16(typingctx, dst, dst_index, src, src_index):
        """cp.async.cg.shared.global of the 16 bytes at element src_index of the C-contiguous
        uint32 array src (any shape: a flat index, one multiply-add of address arithmetic) to
        dst[dst_index:dst_index + 4] (a 1-D shared array)."""
        if not (isinstance(dst, types.Array) and dst.dtype == types.uint32 and dst.ndim == 1
                and isinstance(src, types.Array) and src.dtype == types.uint32 and src.layout == "C"):
            return None
        sig = types.void(dst, dst_index, src, src_index)

        def codegen(context, builder, sig, args):
            dstty, dst_indexty, srcty, src_indexty = sig.args
            shared = _shared_address(context, builder, dstty, args[0], args[1], dst_indexty)
            i32, i64 = ir.IntType(32), ir.IntType(64)
            data = context.make_array(srcty)(context, builder, value=args[2]).data
            src_ptr = builder.gep(data, [context.cast(builder, args[3], src_indexty, types.intp)])
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), [i32, i64]),
                               "{ .reg .u64 g; cvta.to.global.u64 g, $1; "
                               "cp.async.cg.shared.global [$0], [g], 16; }",
                               "r,l,~{memory}", side_effect=True)
            builder.call(asm, [builder.ptrtoint(shared, i32), builder.ptrtoint(src_ptr, i64)])
            return context.get_dummy_value()

        return sig, codegen

    @intrinsic
    def _cp_async_wait_all(typingctx):
        sig = types.void()

        def codegen(context, builder, sig, args):
            asm = ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "cp.async.wait_all;", "~{memory}",
                               side_effect=True)
            builder.call(asm, [])
            return context.get_dummy_value()

        return sig, codegen

    @cuda.jit(device=True, inline=True)
    def load_shared_u32x4(array, index):
        """array[index:index + 4] of a shared uint32 array in one load; index % 4 == 0."""
        return _ld_shared_v4_u32(array, index)

    @cuda.jit(device=True, inline=True)
    def cp_async_16(dst, dst_index, src, src_index):
        """Start copying the 16 bytes at flat element src_index of src (global, C-contiguous) to
        dst[dst_index:dst_index + 4] (shared), without registers; both 16-byte aligned.
        Complete after `cp_async_wait_all`."""
        _cp_async_16(dst, dst_index, src, src_index)

    @cuda.jit(device=True, inline=True)
    def cp_async_wait_all():
        """Wait until this thread's cp.async copies have landed (then a barrier shows them to
        the block)."""
        _cp_async_wait_all()

else:

    def load_shared_u32x4(array, index):
        assert index % 4 == 0, "vector load must be 16-byte aligned"
        return array[index], array[index + 1], array[index + 2], array[index + 3]

    def cp_async_16(dst, dst_index, src, src_index):
        assert dst_index % 4 == 0 and src_index % 4 == 0, "cp.async of 16 bytes must be 16-byte aligned"
        flat = src.reshape(-1)
        dst[dst_index:dst_index + 4] = flat[src_index:src_index + 4]

    def cp_async_wait_all():
        pass


# ---------------------------------------------------------------- addressing (tests/gpu/test_mma_layout.py)

@device_function
def fragment_source(e):
    """(token, word) within its 16 tokens and K step of word e < BLOCK_WORDS of an x fragment
    row: e = 16·lane + 4·s + r is A register r of `lane` in k16 step s. Register r holds token
    g (+ 8 for odd r) and pair slot q = r // 2, the physical pair word 8t + 2s + q (columns
    16t + 4s + 2q, + 1), with (g, t) = (lane / 4, lane % 4)."""
    lane = e >> uint32(4)
    s = (e >> uint32(2)) & uint32(3)
    r = e & uint32(3)
    token = (lane >> uint32(2)) + uint32(8) * (r & uint32(1))
    return token, uint32(8) * (lane & uint32(3)) + uint32(2) * s + (r >> uint32(1))


@device_function
def fragment_slot(lane, s):
    """Shared word offset, from its 16 tokens' first word, of a lane's A registers of k16 step s.
    The steps' 16-byte slots are XOR-swizzled by (lane / 2) % 4, so that the 8 lanes of a
    quarter warp load from 8 different 4-bank groups: no bank conflicts."""
    return uint32(16) * lane + uint32(4) * (s ^ ((lane >> uint32(1)) & uint32(3)))


@device_function
def unit_row(lane):
    """The row, within an 8-row block, of the weight unit a lane decodes (the B column g)."""
    return lane >> uint32(2)


@device_function
def unit_column(lane):
    """The first column, within a K step, of the 16-weight unit a lane decodes: 16t."""
    return uint32(16) * (lane & uint32(3))


@device_function
def accumulator_position(lane, c):
    """(token, row) of a lane's accumulator c < 4 in its 16-token × 8-row block."""
    return (lane >> uint32(2)) + uint32(8) * (c >> uint32(1)), uint32(2) * (lane & uint32(3)) + (c & uint32(1))


# ---------------------------------------------------------------- x to fp16 fragments, once per call

def _to_fp16_fragments_template(STAMP):
    def to_fp16_fragments(x, x16):
        """x16 = x as fp16 pairs in fragment order (`fragments_shape`, `fragment_source`); zeros
        past x's columns and tokens. One thread per word: the writes are coalesced, the reads
        gather within 16 tokens × 64 columns."""
        if STAMP < 0:                       # never true: the source stamp in the cache key
            return
        i = cuda.grid(1)
        row_words = x16.shape[1]
        if i < x16.shape[0] * row_words:
            step = i // row_words
            at = i - step * row_words
            token, word = fragment_source(uint32(at % BLOCK_WORDS))
            t = (at // BLOCK_WORDS) * 16 + token
            col = step * BK + 2 * word
            lo = float32(0.0)
            hi = float32(0.0)
            if t < x.shape[0]:
                if col < x.shape[1]:
                    lo = x[t, col]
                if col + 1 < x.shape[1]:
                    hi = x[t, col + 1]
            x16[step, at] = pack_f16x2(lo, hi)
    return to_fp16_fragments


def build_to_fp16_fragments():
    """The x conversion kernel (Python function)."""
    fn = _specialise(_to_fp16_fragments_template, dict(STAMP=GEMM_STAMP), {})
    fn.__name__ = fn.__qualname__ = "gemm_x_to_fp16_fragments"
    return fn


# ---------------------------------------------------------------- split K

# A call whose rows × tokens make few blocks (a 5120-row down projection of a 256-token chunk:
# 80 blocks of 128 × 128 for 132 SMs) leaves SMs idle; splitting K in two doubles the blocks.
# Each split's chain starts at zero and the partial sums are added in split order, so the
# bits differ from one chain's: to keep a row's bits independent of n and the tile, the split
# depends on `cols` alone. Long rows only: there each block has K steps to spare, and the
# partials' extra traffic (2·splits·n·rows floats) is small next to the products.
SPLIT_MIN_STEPS = 128            # K steps (of BK columns) from which K is split ...
SPLITS = 2                       # ... in this many parts


def k_splits(cols: int) -> int:
    """How many K ranges the tensor-core GEMM splits a row of `cols` columns into (split z
    takes K steps z·steps // splits up to (z + 1)·steps // splits: none is empty)."""
    steps = -(-cols // BK)
    return min(SPLITS, steps) if steps >= SPLIT_MIN_STEPS else 1


def _sum_splits_template(STAMP):
    def sum_splits(partials, out):
        """out[t, r] = the splits' partial sums of (t, r) added in split order."""
        if STAMP < 0:                       # never true: the source stamp in the cache key
            return
        i = cuda.grid(1)
        rows = out.shape[1]
        if i < out.shape[0] * rows:
            t = i // rows
            r = i - t * rows
            total = partials[0, t, r]
            for z in range(1, partials.shape[0]):
                total += partials[z, t, r]
            out[t, r] = total
    return sum_splits


def build_sum_splits():
    """The split reduction kernel (Python function)."""
    fn = _specialise(_sum_splits_template, dict(STAMP=GEMM_STAMP), {})
    fn.__name__ = fn.__qualname__ = "gemm_sum_splits"
    return fn


# ---------------------------------------------------------------- the GEMM kernel

# Bound per ggml type and tile in each specialised kernel's globals (see gpu.matmul.kernel_source.specialise).
load = store = copy_x = fetch = decode = multiply = None


def _copy_x_template(THREADS, XCP):
    def copy_x(x16, xs, src, dst):
        """Start the copies of one K step's x tile: copy p of this thread takes the 16 bytes at
        flat word src + 4·p·THREADS of x16 to xs[dst + 4·p·THREADS:]. (Copy number c = tid +
        p·THREADS is chunk c % CHUNKS of block c / CHUNKS: both offsets are linear in c, the
        swizzle of `fragment_slot` only permutes c's low two bits by bits 3 and 4.)"""
        for p in range(XCP):
            cp_async_16(xs, dst + uint32(4 * p * THREADS), x16, src + uint32(4 * p * THREADS))
    return copy_x


def _fetch_template(NB):
    def fetch(w0, w80, w1, w81, raw, col, last_unit, cols):
        """Issue the loads of this lane's NB <= 2 units (columns col .. col + 15 of the rows
        whose views are w0, w80 and w1, w81) and nothing else. Units past the row end load the
        last unit, in bounds: never used."""
        load(w0, w80, min(col, last_unit), cols, raw, 0)
        if NB > 1:
            load(w1, w81, min(col, last_unit), cols, raw, 1)
    return fetch


def _decode_template(NB):
    def decode(raw, vals, words, col, cols):
        """The fetched units as B registers: words[j, m] = the fp16 pair of weights 2m, 2m + 1
        of unit j. A unit wholly past the row end (col >= cols: quantised rows end on a unit)
        decodes the clamped unit `fetch` loaded, finite values that meet x's zero padding, so
        they add exact zeros (the same in every call: the padding depends on cols alone)."""
        for j in range(NB):
            store(raw, j, col, cols, vals, uint32(0), uint32(1))
            for m in range(8):
                words[j, m] = pack_f16x2(vals[2 * m], vals[2 * m + 1])
    return decode


def _multiply_template(NB, MT):
    def multiply(xs, buf, lane, words, acc):
        """acc += the warp's 16·MT tokens × 8·NB rows over one K step (four k16 steps): the x
        tile of buffer `buf`, B registers `words` (pair slots q of step s: words[j, 2s + q])."""
        for s in range(4):
            at = buf + fragment_slot(lane, uint32(s))
            for i in range(MT):
                a0, a1, a2, a3 = load_shared_u32x4(xs, at + uint32(BLOCK_WORDS * i))
                for j in range(NB):
                    acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3] = mma_m16n8k16(
                        a0, a1, a2, a3, words[j, 2 * s], words[j, 2 * s + 1],
                        acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
    return multiply


def _kernel_template(NB, MT, BM, RAW, TYPE_ID, STAMP, ALIGN, BLOCKS_PER_SM):
    X_BUF = MT * BLOCK_WORDS         # words of one x buffer (two: double buffering)
    XS_WORDS = 2 * X_BUF             # (shapes must be constants, not expressions)
    WARP_ROWS = 8 * NB

    def gemm_mma_kernel(w, w8, x16, out, rows, cols):
        """out[z] = x · Wᵀ over the K steps of split z = blockIdx.z (out: splits × n × rows)."""
        if TYPE_ID < 0 or STAMP < 0 or BLOCKS_PER_SM < 0:  # never true: all three in the cache key
            return
        # Unsigned indices throughout: Numba adds a negative-index fix-up to every signed one.
        xs = cuda.shared.array(XS_WORDS, uint32, alignment=ALIGN)
        acc = cuda.local.array((MT, NB, 4), float32)
        raw = cuda.local.array((NB, RAW), uint32)        # the next K step's weight words
        now = cuda.local.array((NB, 8), uint32)          # this K step's B registers
        ahead = cuda.local.array((NB, 8), uint32)        # ... the next one's, decoded meanwhile
        vals = cuda.local.array(16, float32)             # one decoded unit

        tid = uint32(cuda.threadIdx.x)
        lane = tid & uint32(31)
        warp_row0 = uint32(cuda.blockIdx.x * BM) + (tid >> uint32(5)) * uint32(WARP_ROWS)
        block0 = uint32(cuda.blockIdx.y * MT)            # first 16-token block of the tile
        n = uint32(out.shape[1])
        split = uint32(cuda.blockIdx.z)                  # this block's K steps: first .. last
        first = uint32(split * x16.shape[0] // out.shape[0])
        last = uint32((split + 1) * x16.shape[0] // out.shape[0] - 1)
        step_words = uint32(x16.shape[1])
        last_row = uint32(rows - 1)
        last_unit = uint32(cols - 1) & uint32(0xFFFFFFF0)
        col = unit_column(lane)
        # views of the rows of this lane's units, made once (rows past the end: the last row,
        # never stored)
        row = warp_row0 + unit_row(lane)
        w0 = w[min(row, last_row)]
        w80 = w8[min(row, last_row)]
        w1 = w[min(row + uint32(8), last_row)]
        w81 = w8[min(row + uint32(8), last_row)]
        # this thread's first x copy: chunk tid % CHUNKS of block tid / CHUNKS (see copy_x)
        x_src = block0 * uint32(BLOCK_WORDS) + uint32(4) * tid
        x_dst = (tid // uint32(CHUNKS)) * uint32(BLOCK_WORDS) + fragment_slot(
            (tid % uint32(CHUNKS)) >> uint32(2), tid & uint32(3))
        for i in range(MT):
            for j in range(NB):
                for c in range(4):
                    acc[i, j, c] = float32(0.0)

        # Prologue: the first step's x copies started and its weights decoded, the next step's
        # weights loading.
        copy_x(x16, xs, x_src + first * step_words, x_dst)
        fetch(w0, w80, w1, w81, raw, first * uint32(BK) + col, last_unit, cols)
        decode(raw, vals, now, first * uint32(BK) + col, cols)
        fetch(w0, w80, w1, w81, raw, min(first + uint32(1), last) * uint32(BK) + col, last_unit, cols)
        for step in range(first, last + uint32(1)):
            k = uint32(step)
            buf = (k - first) & uint32(1)
            cp_async_wait_all()
            cuda.syncthreads()           # step k's x is in; everyone is done reading buffer k + 1
            if k < last:
                copy_x(x16, xs, x_src + (k + uint32(1)) * step_words, x_dst + (buf ^ uint32(1)) * uint32(X_BUF))
            # Step k + 1's weights decoded and step k + 2's loads issued (past the last step the
            # clamped steps repeat it, harmlessly), then step k's products: the decode does
            # not depend on the products, so the compiler interleaves the two.
            decode(raw, vals, ahead, min(k + uint32(1), last) * uint32(BK) + col, cols)
            fetch(w0, w80, w1, w81, raw, min(k + uint32(2), last) * uint32(BK) + col, last_unit, cols)
            multiply(xs, buf * uint32(X_BUF), lane, now, acc)
            for j in range(NB):
                for m in range(8):
                    now[j, m] = ahead[j, m]

        for i in range(MT):
            for j in range(NB):
                for c in range(4):
                    dt, dr = accumulator_position(lane, uint32(c))
                    t = (block0 + uint32(i)) * uint32(16) + dt
                    r = warp_row0 + uint32(8 * j) + dr
                    if r <= last_row and t < n:
                        out[split, t, r] = acc[i, j, c]
    return gemm_mma_kernel


def build_kernel(unit: GemmUnit, tile: MmaTile):
    """The tensor-core GEMM kernel (Python function) for one type and tile shape."""
    threads, nb, mt = tile.threads, tile.row_blocks, tile.token_blocks
    assert (CHUNKS * mt) % threads == 0, "x copies must split evenly over the threads"
    assert nb in (1, 2), "a lane decodes one or two units per K step"
    functions = dict(load=unit.load, store=unit.store)
    functions["copy_x"] = device_function(_specialise(
        _copy_x_template, dict(THREADS=threads, XCP=CHUNKS * mt // threads), functions))
    functions["fetch"] = device_function(_specialise(_fetch_template, dict(NB=nb), functions))
    functions["decode"] = device_function(_specialise(_decode_template, dict(NB=nb), functions))
    functions["multiply"] = device_function(_specialise(_multiply_template, dict(NB=nb, MT=mt), functions))
    # (the launch bound is no kernel constant, but two tiles differing only in it must not share
    # Numba's disk cache entry)
    constants = dict(NB=nb, MT=mt, BM=tile.block_rows, RAW=unit.raw_words,
                     TYPE_ID=unit.type.id, STAMP=GEMM_STAMP, ALIGN=ALIGN, BLOCKS_PER_SM=tile.blocks_per_sm)
    fn = _specialise(_kernel_template, constants, functions)
    fn.__name__ = fn.__qualname__ = f"gemm_{unit.type.name}_{tile.name}"
    return fn
