"""Quantised matrix x many rows on the GPU: out (n, rows) = x (n, cols) · Wᵀ, a tiled GEMM.

The decode matvec (gpu/matvec.py) is weight-stationary and re-reads W for every 8 slots; a
prompt chunk of hundreds of rows needs the weights reused from on-chip memory instead. Classic
shared-memory tiling, one kernel template per ggml type:

* a block owns a tile of BM weight rows × BN token rows of `out`;
* it walks K in steps of BK = 32 columns (one Q8_0/Q4_0 block, one K-quant sub-block): the
  block's threads cooperatively decode the (BM × 32) weight tile into shared memory as float32
  (each thread one or more "units": 16 consecutive weights of one row) and stage the (BN × 32)
  x tile next to it;
* each thread then accumulates a register micro-tile of TM rows × TN tokens with FMAs, reading
  one column of each shared tile per k;
* software pipeline: the next step's raw weight words and x values are loaded into registers
  before this step's FMAs, so global-memory latency overlaps the arithmetic.

Accumulation is float32, one chain per output in increasing k. So every output's bits depend
only on its weight row and x row: not on n, the tile shape or the row's place in the tile (a
GEMM call gives a row the bits of that row in any other GEMM call). They differ from the
matvec's bits (other summation order), which is why the matvec keeps calls of fewer than
GEMM_MIN_ROWS rows (gpu/matvec.py routes the rest here).

Thread layout in the FMA loop: thread (tr, tt) = (tid % TR, tid // TR) owns weight rows
tr + TR·i and tokens tt + TT·j. A warp then reads 16 consecutive floats of the weight tile
(broadcast to the two tt) and two of the x tile: no shared-memory bank conflicts. The x tile's
rows are padded by one float so its transposed staging stores do not conflict either.

Per-type decoding: `load(w, w8, row, col, cols, raw, p)` issues the loads of unit p (columns
col .. col+15 of `row`) into raw[p, :] and nothing else (its values are used one step later);
`store(raw, p, col, cols, ws, at, stride)` decodes them into ws[at + i·stride], i < 16 (the
flat shared tile, unsigned indices: see the kernel). Formulas:
../docs/MODEL_FORMAT.md §6 (the same as gpu/quants.py, another split of the work).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
from numba import cuda, float32, uint32

from hybrid import ggml_types as gt

from . import memory
from .device import simulated
from .intrinsics import bits_to_f32, device_function, f16_bits_to_f32, fma, load_u32x4, small_uint_to_f32
from .matvec import SOURCE_STAMP, _check, _specialise
from .quants import UNITS as LANE_UNITS
from .quants import int8_to_f32, kquant_scale_min, store4

# Calls with at least this many rows go through the GEMM (gpu/matvec.py routes them). At 32
# rows the matvec already reads W four times (8 slots per pass) while a GEMM tile reads it once.
GEMM_MIN_ROWS = 32
BK = 32            # columns per K step: one 32-weight block or K-quant sub-block

ZERO = float32(0.0)
LOW16 = uint32(0xFFFF)
SIXTEEN = uint32(16)


@dataclass(frozen=True)
class Tile:
    """A block's shape: TR × TT threads, each owning TM weight rows × TN tokens."""
    thread_rows: int
    thread_tokens: int
    rows_per_thread: int
    tokens_per_thread: int
    efficiency: float      # relative FMA rate of an SM running this tile (for picking a tile)

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


# Per k a thread loads TM + TN floats from shared memory for TM·TN FMAs: 8×8 is the classic
# SGEMM balance (16 loads : 64 FMAs, ~75% of the inner loop's instructions are FMAs); smaller
# micro-tiles load relatively more (8×4: ~65%, 4×4: ~55%) but make more, smaller blocks, which
# spread over more SMs when rows × n is small (the down projection of a 256-row chunk is 80
# blocks of 128×128 for 132 SMs). ptxas gives the 8×8 tiles ~160-215 registers per thread (one
# 256-thread block per SM), 8×4 ~95-140 (two), 4×4 ~80-112 (two or three), none spilled. The
# efficiencies are estimates from that; `python -m gpu.bench --gemm` times every tile on the
# FFN shapes to check the choice. The simulator runs each thread as a Python thread: tiny tiles.
if simulated():
    TILES = (Tile(4, 4, 2, 2, 1.0),)
else:
    TILES = (Tile(16, 16, 8, 8, 1.0), Tile(16, 16, 8, 4, 0.85), Tile(16, 16, 4, 4, 0.7))


@dataclass(frozen=True)
class GemmUnit:
    """How one ggml type's 16-weight units are loaded and decoded (see the module docstring)."""
    type: gt.GGMLType
    raw_words: int
    load: object
    store: object

    @property
    def word(self) -> np.dtype:
        """The dtype `w` is viewed as (the matvec's choice, so the same alignment rules hold)."""
        return LANE_UNITS[self.type.id].word


# ---------------------------------------------------------------- F32 / F16 / BF16
# Any column count: a unit past the row end loads the last column (in bounds) and stores zeros.

@device_function
def dense_load(w, w8, row, col, cols, raw, p):
    for i in range(16):
        raw[p, i] = uint32(w[row, min(col + i, cols - 1)])


@device_function
def f32_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = bits_to_f32(raw[p, i])
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def f16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = f16_bits_to_f32(raw[p, i])
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


@device_function
def bf16_store(raw, p, col, cols, ws, at, stride):
    for i in range(16):
        value = bits_to_f32(raw[p, i] << SIXTEEN)      # bf16 is the top half of an f32
        ws[at + uint32(i) * stride] = value if col + i < cols else ZERO


# ---------------------------------------------------------------- Q8_0 (34 B: d, qs[32])
# uint16 words: d at 17·blk, qs bytes 16h .. 16h+15 of half h at 17·blk + 1 + 8h ...

@device_function
def q8_0_load(w, w8, row, col, cols, raw, p):
    base = (col >> 5) * 17
    half = (col >> 4) & 1
    raw[p, 8] = uint32(w[row, base])
    for j in range(8):
        raw[p, j] = uint32(w[row, base + 1 + 8 * half + j])


@device_function
def q8_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    for i in range(16):
        byte = (raw[p, i >> 1] >> uint32(8 * (i & 1))) & uint32(0xFF)
        ws[at + uint32(i) * stride] = d * int8_to_f32(byte)


# ---------------------------------------------------------------- Q4_0 (18 B: d, qs[16])
# Weight i < 16 is the low nibble of qs[i], weight 16 + i its high nibble: half h of the block
# reads all 16 qs bytes (8 uint16 words) and takes nibble h.

@device_function
def q4_0_load(w, w8, row, col, cols, raw, p):
    base = (col >> 5) * 9
    raw[p, 8] = uint32(w[row, base])
    for j in range(8):
        raw[p, j] = uint32(w[row, base + 1 + j])


@device_function
def q4_0_store(raw, p, col, cols, ws, at, stride):
    d = f16_bits_to_f32(raw[p, 8])
    shift = uint32(4 * ((col >> 4) & 1))
    for i in range(16):
        nib = (raw[p, i >> 1] >> (uint32(8 * (i & 1)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = d * small_uint_to_f32(nib, float32(8.0))


# ---------------------------------------------------------------- Q4_K / Q5_K (256 per block)
# Sub-block j (32 weights) of a block: scale/min j, the qs bytes of chunk c = j // 2 (low
# nibbles for even j, high for odd), Q5_K's fifth bits as bit j of qh bytes 0..31. Unit half h
# takes bytes 16h .. 16h+15 of those: 16-byte aligned, one vector load each. uint32 words.
# raw[p, 0:4] = header (d | dmin << 16, scales[12]); raw[p, 4:8] = qs; Q5_K: raw[p, 8:12] = qh.

@device_function
def q4_k_load(w, w8, row, col, cols, raw, p):
    word0 = (col >> 8) * 36                     # 144 bytes: header 16, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_u32x4(w, row, word0))
    store4(raw, p, 4, load_u32x4(w, row, word0 + 4 + 8 * ((col >> 6) & 3) + 4 * half))


@device_function
def q5_k_load(w, w8, row, col, cols, raw, p):
    word0 = (col >> 8) * 44                     # 176 bytes: header 16, qh 32, qs 128
    half = (col >> 4) & 1
    store4(raw, p, 0, load_u32x4(w, row, word0))
    store4(raw, p, 4, load_u32x4(w, row, word0 + 12 + 8 * ((col >> 6) & 3) + 4 * half))
    store4(raw, p, 8, load_u32x4(w, row, word0 + 4 + 4 * half))


@device_function
def kquant_factors(raw, p, j):
    """(d·scale_j, dmin·min_j) of sub-block j from the unit's header words."""
    d = f16_bits_to_f32(raw[p, 0] & LOW16)
    dmin = f16_bits_to_f32(raw[p, 0] >> SIXTEEN)
    sc, mn = kquant_scale_min(raw[p, 1], raw[p, 2], raw[p, 3], j)
    return d * sc, dmin * mn


@device_function
def q4_k_store(raw, p, col, cols, ws, at, stride):
    j = (col >> 5) & 7
    scale, offset = kquant_factors(raw, p, j)
    shift = uint32(4 * (j & 1))
    for i in range(16):
        nib = (raw[p, 4 + (i >> 2)] >> (uint32(8 * (i & 3)) + shift)) & uint32(15)
        ws[at + uint32(i) * stride] = fma(scale, small_uint_to_f32(nib, ZERO), -offset)


@device_function
def q5_k_store(raw, p, col, cols, ws, at, stride):
    j = (col >> 5) & 7
    scale, offset = kquant_factors(raw, p, j)
    shift = uint32(4 * (j & 1))
    for i in range(16):
        byte_shift = uint32(8 * (i & 3))
        nib = (raw[p, 4 + (i >> 2)] >> (byte_shift + shift)) & uint32(15)
        bit = (raw[p, 8 + (i >> 2)] >> (byte_shift + uint32(j))) & uint32(1)
        ws[at + uint32(i) * stride] = fma(scale, small_uint_to_f32(nib | (bit << uint32(4)), ZERO), -offset)


# ---------------------------------------------------------------- Q6_K (210 B, 2-byte aligned)
# Weight e of a block: half = e // 128, group g = (e % 128) // 32, l = e % 32. Low 4 bits:
# nibble g // 2 of ql[64·half + 32·(g % 2) + l]; high 2 bits: bits 2g of qh[32·half + l];
# scale sc[8·half + l // 16 + 2g] (int8); d the fp16 at byte 208. A unit (16 consecutive l)
# reads 16 ql and 16 qh bytes (8 uint16 words each), one scale byte and d.
# raw[p, 0:8] = ql, raw[p, 8:16] = qh, raw[p, 16] = scale byte | d bits << 16.

@device_function
def q6_k_load(w, w8, row, col, cols, raw, p):
    blk = col >> 8
    e = col & 255
    half = e >> 7
    g = (e >> 5) & 3
    l0 = e & 16
    base = blk * 105                            # in uint16 words
    ql = base + 32 * half + 16 * (g & 1) + (l0 >> 1)
    qh = base + 64 + 16 * half + (l0 >> 1)
    for j in range(8):
        raw[p, j] = uint32(w[row, ql + j])
        raw[p, 8 + j] = uint32(w[row, qh + j])
    scale = uint32(w8[row, blk * 210 + 192 + 8 * half + (l0 >> 4) + 2 * g])
    raw[p, 16] = scale | (uint32(w[row, base + 104]) << SIXTEEN)


@device_function
def q6_k_store(raw, p, col, cols, ws, at, stride):
    g = (col >> 5) & 3
    factor = f16_bits_to_f32(raw[p, 16] >> SIXTEEN) * int8_to_f32(raw[p, 16] & uint32(0xFF))
    low_shift = uint32(4 * (g >> 1))
    high_shift = uint32(2 * g)
    for i in range(16):
        byte_shift = uint32(8 * (i & 1))
        low = (raw[p, i >> 1] >> (byte_shift + low_shift)) & uint32(15)
        high = (raw[p, 8 + (i >> 1)] >> (byte_shift + high_shift)) & uint32(3)
        ws[at + uint32(i) * stride] = factor * small_uint_to_f32(low | (high << uint32(4)), float32(32.0))


UNITS: dict[int, GemmUnit] = {u.type.id: u for u in (
    GemmUnit(gt.F32, 16, dense_load, f32_store),
    GemmUnit(gt.F16, 16, dense_load, f16_store),
    GemmUnit(gt.BF16, 16, dense_load, bf16_store),
    GemmUnit(gt.Q8_0, 9, q8_0_load, q8_0_store),
    GemmUnit(gt.Q4_0, 9, q4_0_load, q4_0_store),
    GemmUnit(gt.Q4_K, 8, q4_k_load, q4_k_store),
    GemmUnit(gt.Q5_K, 12, q5_k_load, q5_k_store),
    GemmUnit(gt.Q6_K, 17, q6_k_load, q6_k_store),
)}


# ---------------------------------------------------------------- the kernel

# Bound per ggml type in each specialised kernel's globals (see gpu.matvec._specialise).
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
            load(w, w8, min(row0 + u % uint32(BM), last_row), uint32(16) * (u // uint32(BM)), cols, raw, p)
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
                load(w, w8, min(row0 + u % uint32(BM), last_row), k_next + uint32(16) * (u // uint32(BM)),
                     cols, raw, p)
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


def _build_kernel(unit: GemmUnit, tile: Tile):
    """The GEMM kernel (Python function) for one type and tile shape."""
    tr, tt, tm, tn = tile.thread_rows, tile.thread_tokens, tile.rows_per_thread, tile.tokens_per_thread
    assert (BK * tile.block_tokens) % tile.threads == 0, "x tile must split evenly over the threads"
    constants = dict(TR=tr, TT=tt, TM=tm, TN=tn, RAW=unit.raw_words,
                     UPT=-(-2 * tile.block_rows // tile.threads),
                     XPT=BK * tile.block_tokens // tile.threads,
                     TYPE_ID=unit.type.id, STAMP=SOURCE_STAMP)
    functions = dict(load=unit.load, store=unit.store)
    functions["fma_column"] = device_function(_specialise(_fma_column_template, dict(TR=tr, TT=tt, TM=tm, TN=tn),
                                                          functions))
    fn = _specialise(_kernel_template, constants, functions)
    fn.__name__ = fn.__qualname__ = f"gemm_{unit.type.name}_{tile.name}_{tm}x{tn}"
    return fn


@functools.cache
def kernel(type_id: int, tile: Tile):
    """The compiled-on-first-launch kernel (cached on disk by Numba)."""
    return cuda.jit(cache=True)(_build_kernel(UNITS[type_id], tile))


@functools.cache
def _sm_count() -> int:
    return 1 if simulated() else cuda.get_current_device().MULTIPROCESSOR_COUNT


def choose_tile(rows: int, n: int) -> Tile:
    """The tile with the least estimated time: the blocks of the busiest SM (blocks spread
    evenly) times a block's work over the tile's efficiency. Big tiles do less work per FMA
    but leave SMs idle when a call makes few blocks. Any choice gives the same bits."""
    def cost(tile: Tile) -> float:
        blocks = -(-rows // tile.block_rows) * -(-n // tile.block_tokens)
        return -(-blocks // _sm_count()) * tile.block_rows * tile.block_tokens / tile.efficiency
    return min(TILES, key=cost)


def gemm(wtype: int, w_dev, x_dev, out_dev, stream=None, tile: Tile | None = None) -> None:
    """out_dev = x_dev · Wᵀ on the device: W is `wtype` rows of raw GGUF blocks.

    w_dev: uint8 device array (rows, row_bytes); x_dev: float32 (n, cols); out_dev: float32
    (n, rows). Same checks and argument order as gpu.matvec.matvec, for any n ≥ 1 (the matvec
    sends calls of GEMM_MIN_ROWS rows or more here). Asynchronous on `stream` (gpu.memory's
    when None). `tile` is a benchmark knob (one of TILES); it never changes the result.
    """
    lane_unit, rows, cols, n = _check(wtype, w_dev, x_dev, out_dev)
    tile = tile or choose_tile(rows, n)
    grid = (-(-rows // tile.block_rows), -(-n // tile.block_tokens))
    launch_stream = memory.stream() if stream is None else stream
    kernel(lane_unit.type.id, tile)[grid, tile.threads, launch_stream](
        w_dev.view(lane_unit.word), w_dev, x_dev, out_dev, rows, cols)


def kernel_argtypes(unit: GemmUnit) -> tuple:
    """Numba argument types of a GEMM kernel (w, w8, x, out, rows, cols)."""
    from numba import types
    from numba.np import numpy_support

    def matrix(dtype):
        return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 2, "C")

    return (matrix(unit.word), matrix(np.uint8), matrix(np.float32), matrix(np.float32),
            types.int64, types.int64)


def ptx_targets():
    """(name, python function, argument types) of every GEMM kernel (type × tile), for the
    sm_90 PTX check; their PTX must not use local memory (micro-tile spilled)."""
    for unit in UNITS.values():
        for tile in TILES:
            yield f"gemm {unit.type.name} {tile.name}", _build_kernel(unit, tile), kernel_argtypes(unit)
