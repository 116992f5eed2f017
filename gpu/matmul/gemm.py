"""Quantised matrix x many rows on the GPU: out (n, rows) = x (n, cols) · Wᵀ, a tiled GEMM.

The decode matvec (gpu/matmul/matvec.py) is weight-stationary and re-reads W for every 8 slots; a
prompt chunk of hundreds of rows needs the weights reused from on-chip memory instead. Two
kernels, one template per ggml type and tile:

* the tensor-core kernel (gpu/matmul/gemm_mma.py): fp16 products, float32 sums, mma.sync, weights
  decoded straight into the instruction's registers and x converted to fp16 once per call; the
  default for every type but F32 (see `precision_for`; its numerics and fp16 range caveat are
  there);
* the float32 FMA kernel below, classic shared-memory tiling: float32 products and sums; F32
  weights, any call given one of its tiles, and what the CUDA simulator mostly runs.

The float32 kernel: a block owns a tile of BM weight rows × BN token rows of `out` and walks K
in steps of BK = 32 columns (one 32-weight block, one K-quant sub-block): the block's threads
cooperatively decode the (BM × 32) weight tile into shared memory as float32 (each thread one or
more 16-weight "units", gpu/matmul/gemm_units.py) and stage the (BN × 32) x tile next to it; each
thread then accumulates a register micro-tile of TM rows × TN tokens with FMAs, reading one
column of each shared tile per k. Software pipeline: the next step's raw weight words and x
values are loaded into registers before this step's FMAs, so global-memory latency overlaps
the arithmetic.

Accumulation is one chain per output in either kernel, in a fixed k order (increasing; for the
tensor-core kernel one fixed permutation inside each K step of 64). So every output's bits
depend only on its weight row, its x row and the kernel's precision: not on n, the tile shape
or the row's place in the tile (a GEMM call gives a row the bits of that row in any other GEMM
call of the same precision). They differ from the matvec's bits (other summation order), which
is why the matvec keeps calls of fewer than GEMM_MIN_ROWS rows (gpu/matmul/matvec.py routes the rest
here).

Thread layout in the FMA loop: thread (tr, tt) = (tid % TR, tid // TR) owns weight rows
tr + TR·i and tokens tt + TT·j. A warp then reads 16 consecutive floats of the weight tile
(broadcast to the two tt) and two of the x tile: no shared-memory bank conflicts. The x tile's
rows are padded by one float so its transposed staging stores do not conflict either.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32
from numba import types
from numba.np import numpy_support

from cpu import ggml_types as gt
from cpu.errors import HybridError

from . import gemm_mma
from ..runtime import memory
from ..runtime.device import simulated
from .gemm_mma import MmaTile
from .gemm_units import BK, GEMM_STAMP, UNITS, GemmUnit
from ..intrinsics import device_function, fma
from .kernel_source import kernel_factory
from .kernel_source import specialise as _specialise
from .quants import check_matvec as _check

__all__ = ["GEMM_MIN_ROWS", "BK", "TILES", "Tile", "MmaTile", "UNITS", "GemmUnit", "precision_for",
           "choose_tile", "estimated_time", "gemm", "kernel", "kernel_argtypes", "ptx_targets"]

# Calls with at least this many rows go through the GEMM (gpu/matmul/matvec.py routes them). At 32
# rows the matvec already reads W four times (8 slots per pass) while a GEMM tile reads it once.
GEMM_MIN_ROWS = 32


@dataclass(frozen=True)
class Tile:
    """A float32 block's shape: TR × TT threads, each owning TM weight rows × TN tokens."""
    thread_rows: int
    thread_tokens: int
    rows_per_thread: int
    tokens_per_thread: int
    efficiency: float      # relative FMA rate of a full SM running this tile (for picking a tile)
    blocks_per_sm: int = 1  # blocks an SM holds at once (by ptxas' registers; no launch bound)
    precision = "fp32"     # float32 products and sums (a class constant, not a field)

    @property
    def threads(self) -> int:
        return self.thread_rows * self.thread_tokens

    @property
    def block_rows(self) -> int:
        return self.thread_rows * self.rows_per_thread

    @property
    def block_tokens(self) -> int:
        return self.thread_tokens * self.tokens_per_thread

    @property
    def name(self) -> str:
        return f"{self.block_rows}x{self.block_tokens}"


# Float32 tiles. Per k a thread loads TM + TN floats from shared memory for TM·TN FMAs: 8×8 is
# the classic SGEMM balance (16 loads : 64 FMAs, ~75% of the inner loop's instructions are
# FMAs); smaller micro-tiles load relatively more (8×4: ~65%, 4×4: ~55%) but make more, smaller
# blocks, which spread over more SMs when rows × n is small (the down projection of a 256-row
# chunk is 80 blocks of 128×128 for 132 SMs). ptxas gives the 8×8 tiles ~160-215 registers per
# thread (one 256-thread block per SM), 8×4 ~95-140 (two), 4×4 ~80-112 (two or three), none
# spilled.
# Tensor-core tiles (gpu/matmul/gemm_mma.py: warps stacked along the rows, each 8·NB rows × all the
# block's tokens). sm_90 registers per thread (Q4_K / Q6_K, under the launch bound, none
# spilled), instructions per mma in the main loop, shared memory per block:
# * mma128x128w8: 8 warps of 16 rows × 128 tokens, one block per SM; 171 / 191 registers,
#   6.5 / 7.4 instructions, 32 KiB. x is re-read from L2 once per 128 rows, but a 256-token
#   chunk of a 5120-row projection makes 80 blocks (160 with split K): SMs idle.
# * mma64x128w4: the same warps, 4 to a block, bound to 3 blocks per SM; 168 / 168
#   registers, 6.3 / 7.5 instructions, 32 KiB: twice the blocks for small calls, 12 warps per
#   SM when full.
# * mma64x128w8: 8 warps of 8 rows × 128 tokens, bound to 2 blocks per SM; 119 / 124
#   registers, 8.5 / 9.2 instructions (each x fragment feeds one row block, not two), 32 KiB;
#   16 warps per SM to hide latency.
# * mma64x64w4: 4 warps of 16 rows × 64 tokens, bound to 3 blocks per SM; 149 / 151
#   registers, 10.8 / 13.3 instructions (a decoded weight serves 64 tokens, not 128), 16 KiB:
#   four times the big tile's blocks.
# (The first version's 128 × 128 tile took ~15 / ~25 instructions per mma.)
# Efficiencies (compared within one precision only) are the measured rates at n=2048, where
# every tile fills the GPU, relative to mma64x128w4 (docs/MEASUREMENTS.md): the smaller block
# with 12 warps per SM beats the fewer instructions of the big one. The call's block count, the SM count and
# `blocks_per_sm` do the rest (`choose_tile`). `python
# tools/gpu_bench_kernels.py --gemm` times every tile on the FFN shapes to check the choice. The simulator runs
# each thread as a Python thread: tiny tiles, one warp for the tensor-core one.
if simulated():
    TILES = (Tile(4, 4, 2, 2, 1.0), MmaTile(1, 1, 1, 1, 1.0))
else:
    TILES = (Tile(16, 16, 8, 8, 1.0, 1), Tile(16, 16, 8, 4, 0.85, 2), Tile(16, 16, 4, 4, 0.7, 2),
             MmaTile(8, 2, 8, 1, 0.85), MmaTile(4, 2, 8, 3, 1.0), MmaTile(8, 1, 8, 2, 0.67), MmaTile(4, 2, 4, 3, 0.72))

# Resident warps per SM at which a tile runs at its full rate (4 schedulers, two warps each to
# hide each other's latencies); fewer leave it proportionally slower. An estimate for
# `choose_tile`, like the efficiencies.
SATURATING_WARPS = 8


def precision_for(wtype: int) -> str:
    """The GEMM precision a weight type gets: "fp32" for F32 weights (whoever stores float32
    asks for float32 arithmetic), "fp16" tensor cores for the rest, whose values carry no more
    than fp16's 11 significant bits (F16, BF16) or far fewer (quantised types). The fp16 range
    caveat for activations is in gpu/matmul/gemm_mma.py."""
    return "fp32" if int(wtype) == gt.F32.id else "fp16"


# ---------------------------------------------------------------- the float32 kernel

# Bound per ggml type in each specialised kernel's globals (see gpu.matmul.kernel_source.specialise).
load = store = fma_column = None


def _fma_column_template(TR, TT, TM, TN):
    def fma_column(ws, xs, w_at, x_at, a, b, acc):
        """acc[i, j] += ws[w_at + TR·i] · xs[x_at + TT·j]: one k of the micro-tile."""
        for i in range(TM):
            a[i] = ws[w_at + uint32(TR * i)]
        for j in range(TN):
            b[j] = xs[x_at + uint32(TT * j)]
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = fma(a[i], b[j], acc[i, j])
    return fma_column


def _kernel_template(TR, TT, TM, TN, RAW, UPT, XPT, TYPE_ID, STAMP):
    BM = TR * TM
    BN = TT * TN
    THREADS = TR * TT
    N_UNITS = 2 * BM                 # units of one K step: two halves of each weight row
    XS_COLS = BN + 1                 # x tile row, padded
    WS_SIZE = BK * BM                # (shapes must be constants, not expressions)
    XS_SIZE = BK * XS_COLS

    def gemm_kernel(w, w8, x, out, rows, cols):
        if TYPE_ID < 0 or STAMP < 0:  # never true: puts both in the cache key (_specialise)
            return
        # Flat shared tiles indexed by unsigned integers: Numba adds a negative-index fix-up to
        # every signed index, which here would cost more registers and instructions than the
        # FMAs themselves. ws[k·BM + m]: decoded weights; xs[k·XS_COLS + t]: x, padded rows.
        ws = cuda.shared.array(WS_SIZE, float32)
        xs = cuda.shared.array(XS_SIZE, float32)
        acc = cuda.local.array((TM, TN), float32)
        a = cuda.local.array(TM, float32)
        b = cuda.local.array(TN, float32)
        raw = cuda.local.array((UPT, RAW), uint32)        # next step's weight words
        xr = cuda.local.array(XPT, float32)               # next step's x values

        tid = uint32(cuda.threadIdx.x)
        tr = tid % uint32(TR)
        tt = tid // uint32(TR)
        row0 = uint32(cuda.blockIdx.x * BM)
        tok0 = uint32(cuda.blockIdx.y * BN)
        n = uint32(x.shape[0])
        last_row = uint32(rows - 1)
        last_col = uint32(cols - 1)
        for i in range(TM):
            for j in range(TN):
                acc[i, j] = float32(0.0)

        # Prologue: the first K step's loads. Unit u = tid + p·THREADS is row u % BM, half
        # u // BM (a warp's units are consecutive rows: conflict-free transposed stores); x
        # value q is column idx % 32 of token idx // 32 (a warp reads 128 contiguous bytes).
        # Rows and tokens past the end load the last one (in bounds) and are never stored.
        for p in range(UPT):
            u = min(tid + uint32(p * THREADS), uint32(N_UNITS - 1))
            r = min(row0 + u % uint32(BM), last_row)
            load(w[r], w8[r], uint32(16) * (u // uint32(BM)), cols, raw, p)
        for q in range(XPT):
            idx = tid + uint32(q * THREADS)
            col = idx & uint32(31)
            value = x[min(tok0 + (idx >> uint32(5)), n - uint32(1)), min(col, last_col)]
            xr[q] = value if col <= last_col else float32(0.0)

        for k0 in range(0, cols, BK):
            cuda.syncthreads()              # everyone is done reading the previous tiles
            for p in range(UPT):
                u = tid + uint32(p * THREADS)
                if u < uint32(N_UNITS):
                    half = u // uint32(BM)
                    store(raw, p, uint32(k0) + uint32(16) * half, cols, ws,
                          half * uint32(16 * BM) + u % uint32(BM), uint32(BM))
            for q in range(XPT):
                idx = tid + uint32(q * THREADS)
                xs[(idx & uint32(31)) * uint32(XS_COLS) + (idx >> uint32(5))] = xr[q]
            cuda.syncthreads()

            # the next step's loads (the last step reloads itself, harmlessly), in flight
            # while this step's FMAs run
            k_next = uint32(k0 + BK if k0 + BK < cols else k0)
            for p in range(UPT):
                u = min(tid + uint32(p * THREADS), uint32(N_UNITS - 1))
                r = min(row0 + u % uint32(BM), last_row)
                load(w[r], w8[r], k_next + uint32(16) * (u // uint32(BM)), cols, raw, p)
            for q in range(XPT):
                idx = tid + uint32(q * THREADS)
                col = k_next + (idx & uint32(31))
                value = x[min(tok0 + (idx >> uint32(5)), n - uint32(1)), min(col, last_col)]
                xr[q] = value if col <= last_col else float32(0.0)

            # Four straight-line k per iteration: constant shared offsets, a quarter of the
            # loop and address arithmetic (NVVM does not unroll a body this large by itself).
            for k in range(0, BK, 4):
                w_at = uint32(k * BM) + tr
                x_at = uint32(k * XS_COLS) + tt
                fma_column(ws, xs, w_at, x_at, a, b, acc)
                fma_column(ws, xs, w_at + uint32(BM), x_at + uint32(XS_COLS), a, b, acc)
                fma_column(ws, xs, w_at + uint32(2 * BM), x_at + uint32(2 * XS_COLS), a, b, acc)
                fma_column(ws, xs, w_at + uint32(3 * BM), x_at + uint32(3 * XS_COLS), a, b, acc)

        for j in range(TN):
            t = tok0 + tt + uint32(TT * j)
            if t < n:
                for i in range(TM):
                    r = row0 + tr + uint32(TR * i)
                    if r <= last_row:
                        out[t, r] = acc[i, j]
    return gemm_kernel


def _build_fp32_kernel(unit: GemmUnit, tile: Tile):
    """The float32 GEMM kernel (Python function) for one type and tile shape."""
    tr, tt, tm, tn = tile.thread_rows, tile.thread_tokens, tile.rows_per_thread, tile.tokens_per_thread
    assert (BK * tile.block_tokens) % tile.threads == 0, "x tile must split evenly over the threads"
    constants = dict(TR=tr, TT=tt, TM=tm, TN=tn, RAW=unit.raw_words,
                     UPT=-(-2 * tile.block_rows // tile.threads),
                     XPT=BK * tile.block_tokens // tile.threads,
                     TYPE_ID=unit.type.id, STAMP=GEMM_STAMP)
    functions = dict(load=unit.load, store=unit.store)
    functions["fma_column"] = device_function(_specialise(_fma_column_template, dict(TR=tr, TT=tt, TM=tm, TN=tn),
                                                          functions))
    fn = _specialise(_kernel_template, constants, functions)
    fn.__name__ = fn.__qualname__ = f"gemm_{unit.type.name}_{tile.name}_{tm}x{tn}"
    return fn


def _build_kernel(unit: GemmUnit, tile: Tile | MmaTile):
    """The GEMM kernel (Python function) for one type and tile: the tile says which kernel."""
    if isinstance(tile, MmaTile):
        return gemm_mma.build_kernel(unit, tile)
    return _build_fp32_kernel(unit, tile)


@kernel_factory
def kernel(type_id: int, tile: Tile | MmaTile):
    """The compiled-on-first-launch kernel (cached on disk by Numba)."""
    bounds = getattr(tile, "launch_bounds", None)       # the simulator takes none
    options = dict(launch_bounds=bounds) if bounds and not simulated() else {}
    return cuda.jit(cache=True, **options)(_build_kernel(UNITS[type_id], tile))


@functools.cache
def _sm_count() -> int:
    return 1 if simulated() else cuda.get_current_device().MULTIPROCESSOR_COUNT


def estimated_time(tile: Tile | MmaTile, rows: int, n: int, splits: int = 1) -> float:
    """A call's time on `tile`, in units of one product at a full SM's rate: the blocks (of
    each of `splits` K ranges) are dealt evenly to the SMs, the busiest SM's share runs
    `blocks_per_sm` at a time, at the tile's efficiency scaled down while fewer than
    SATURATING_WARPS warps are resident."""
    blocks = -(-rows // tile.block_rows) * -(-n // tile.block_tokens) * splits
    per_sm = -(-blocks // _sm_count())
    warps = min(per_sm, tile.blocks_per_sm) * tile.threads / 32
    rate = tile.efficiency * min(1.0, warps / SATURATING_WARPS)
    return per_sm * tile.block_rows * tile.block_tokens / splits / rate


def choose_tile(rows: int, n: int, precision: str = "fp16", cols: int | None = None) -> Tile | MmaTile:
    """The tile of `precision` with the least `estimated_time`: big tiles do less work per
    product, small ones spread a small call over more SMs. `cols` tells the tensor-core tiles
    how many K ranges the call is split into (gpu.matmul.gemm_mma.k_splits); without it, one. Any
    choice within one precision gives the same bits."""
    candidates = [tile for tile in TILES if tile.precision == precision]
    if not candidates:
        raise HybridError(f"GPU GEMM: no {precision!r} tiles; precisions: "
                          f"{', '.join(sorted({t.precision for t in TILES}))}")

    def cost(tile) -> float:
        splits = gemm_mma.k_splits(cols) if cols and isinstance(tile, MmaTile) else 1
        return estimated_time(tile, rows, n, splits)
    return min(candidates, key=cost)


def gemm(wtype: int, w_dev, x_dev, out_dev, stream=None, tile: Tile | MmaTile | None = None) -> None:
    """out_dev = x_dev · Wᵀ on the device: W is `wtype` rows of raw GGUF blocks.

    w_dev: uint8 device array (rows, row_bytes); x_dev: float32 (n, cols); out_dev: float32
    (n, rows). Same checks and argument order as gpu.matmul.matvec.matvec, for any n ≥ 1 (the matvec
    sends calls of GEMM_MIN_ROWS rows or more here). Asynchronous on `stream` (gpu.runtime.memory's
    when None). The kernel is the tensor-core one or the float32 one as `precision_for(wtype)`
    says; `tile` (one of TILES, a benchmark and test knob) picks a kernel and shape instead.
    Tiles of one precision give the same bits. The tensor-core kernel first converts x to fp16
    fragments into a scratch buffer, and long rows (gpu.matmul.gemm_mma.k_splits) add their split
    partial sums from another (gpu.runtime.memory.scratch, one per shape), on the same stream.
    """
    lane_unit, rows, cols, n = _check(wtype, w_dev, x_dev, out_dev)
    tile = tile or choose_tile(rows, n, precision_for(wtype), cols)
    launch_stream = memory.stream() if stream is None else stream
    if not isinstance(tile, MmaTile):
        grid = (-(-rows // tile.block_rows), -(-n // tile.block_tokens))
        kernel(lane_unit.type.id, tile)[grid, tile.threads, launch_stream](
            w_dev.view(lane_unit.word), w_dev, x_dev, out_dev, rows, cols)
        return
    x16 = memory.scratch("gemm.x16", gemm_mma.fragments_shape(n, cols, tile.token_blocks), np.uint32)
    _launch_elementwise(_to_fp16_fragments(), x16.shape[0] * x16.shape[1], launch_stream, x_dev, x16)
    splits = gemm_mma.k_splits(cols)
    partials = out_dev.reshape(1, n, rows) if splits == 1 else memory.scratch("gemm.splits", (splits, n, rows))
    grid = (-(-rows // tile.block_rows), -(-n // tile.block_tokens), splits)
    kernel(lane_unit.type.id, tile)[grid, tile.threads, launch_stream](
        w_dev.view(lane_unit.word), w_dev, x16, partials, rows, cols)
    if splits > 1:
        _launch_elementwise(_sum_splits(), n * rows, launch_stream, partials, out_dev)


def _launch_elementwise(fn, count: int, stream, *args) -> None:
    fn[-(-count // memory.THREADS), memory.THREADS, stream](*args)


@kernel_factory
def _to_fp16_fragments():
    return cuda.jit(cache=True)(gemm_mma.build_to_fp16_fragments())


@kernel_factory
def _sum_splits():
    return cuda.jit(cache=True)(gemm_mma.build_sum_splits())


def _matrix(dtype, ndim: int = 2):
    return types.Array(numpy_support.from_dtype(np.dtype(dtype)), ndim, "C")


def kernel_argtypes(unit: GemmUnit, tile: Tile | MmaTile | None = None) -> tuple:
    """Numba argument types of a GEMM kernel (w, w8, x, out, rows, cols): for the tensor-core
    kernel x is fp16 fragments (uint32) and out the splits' partial sums (3-D)."""
    if isinstance(tile, MmaTile):
        x, out = _matrix(np.uint32), _matrix(np.float32, 3)
    else:
        x, out = _matrix(np.float32), _matrix(np.float32)
    return _matrix(unit.word), _matrix(np.uint8), x, out, types.int64, types.int64


def ptx_targets():
    """(name, python function, argument types) of every GEMM kernel the engine can pick (type ×
    each tile of the type's precision_for) and of the x conversion, for the sm_90 PTX check;
    their PTX must not use local memory (a micro-tile or accumulator array spilled). Tiles of
    the other precision, which only a benchmark or test forces (the simulator tests run them),
    would cost CI ~90 s more to compile."""
    yield "gemm x to fp16 fragments", gemm_mma.build_to_fp16_fragments(), (_matrix(np.float32), _matrix(np.uint32))
    yield "gemm sum splits", gemm_mma.build_sum_splits(), (_matrix(np.float32, 3), _matrix(np.float32))
    for unit in UNITS.values():
        for tile in TILES:
            if tile.precision == precision_for(unit.type.id):
                yield f"gemm {unit.type.name} {tile.name}", _build_kernel(unit, tile), kernel_argtypes(unit, tile)
