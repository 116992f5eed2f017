"""Matrix x k-vectors on the GPU: out[s, row] = dot(W[row, :], x[s, :]) for k slots.

Same op and argument order as `cpu.matvec.matvec`. Weight-stationary: every weight byte is read
from global memory once per call and applied to all k slots.

The quantised types (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL, MXFP4, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS,
IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) go to
gpu/matmul/matvec_q8.py: x rounded to int8 per block of 32 and dp4a products. This module's
float kernel serves F32/F16/BF16 (its decoding of the other types in `quants.py` lives on in
gpu/matmul/gemm.py and gpu/quants.py).

Work split of the float kernel (one kernel template, per-type decoding in `quants.py`):
* a block of WARPS warps; each warp owns `rows_per_warp` (R) consecutive rows;
* the row is walked in tiles of 32 * elems columns; in each tile each lane decodes its own
  `elems` weights (its unit) of each of its R rows, and multiplies them with x;
* x is staged per tile in shared memory in the lanes' order (bank-conflict-free reads), and one
  x value read serves all R rows;
* software pipeline: the next tile's weights are loaded (raw words only) while this tile is
  decoded and multiplied, so DRAM latency overlaps the arithmetic;
* at the end each (row, slot) sum is reduced across the warp by a fixed butterfly.

Per-slot bit identity: slot s of row r is summed by the same lanes, over the same units, in the
same order, then reduced by the same butterfly, whatever k, R or WARPS are. So a k-slot call gives
each slot exactly the bits a 1-slot call gives. Calls with k > MAX_SLOTS run in chunks of
MAX_SLOTS slots (weights re-read per chunk; bits unchanged).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32
from numba import types
from numba.np import numpy_support


from . import gemm, matvec_q8
from ..runtime import memory
from ..runtime.device import simulated
from ..intrinsics import device_function, fma, warp_reduce
from .kernel_source import BLOCK_THREADS, MAX_ROWS_X_SLOTS, MAX_SLOTS, SOURCE_STAMP, WARPS, kernel_factory
from .kernel_source import specialise as _specialise
from .quants import UNITS, LaneUnit, check_matvec as _check


# Bound per ggml type in each specialised kernel's globals (see _specialise).
load = prepare = weight = owner = multiply_eight = None


def _multiply_eight_template(N, R):
    def multiply_eight(first, xs, lane, raw, fac, xv, acc):
        """acc[r, s] += weight i of row r * x[s] of weight i, for i = first .. first+7."""
        for i_hi in range(2):
            for i_lo in range(4):
                i = first + 4 * i_hi + i_lo
                for s in range(N):
                    xv[s] = xs[s, i * 32 + (lane ^ i)]
                for r in range(R):
                    wi = weight(raw, fac, r, i, lane)
                    for s in range(N):
                        acc[r, s] = fma(wi, xv[s], acc[r, s])
    return multiply_eight


def _kernel_template(N, R, E, TILE, RAW, FAC, STAGED_PER_THREAD, TYPE_ID, STAMP):
    def matvec_kernel(w, w8, x, out, rows, cols):
        if TYPE_ID < 0 or STAMP < 0:  # never true: puts both in the cache key (_specialise)
            return
        xs = cuda.shared.array((N, TILE), float32)
        acc = cuda.local.array((R, N), float32)
        raw = cuda.local.array((R, RAW), uint32)       # the tile being multiplied
        raw_next = cuda.local.array((R, RAW), uint32)  # the next tile, in flight meanwhile
        fac = cuda.local.array((R, FAC), float32)
        xv = cuda.local.array(N, float32)
        staged_at = cuda.local.array(STAGED_PER_THREAD, int32)
        x_part = cuda.local.array((STAGED_PER_THREAD, N), float32)

        tid = cuda.threadIdx.x
        lane = tid & 31
        row0 = (cuda.blockIdx.x * WARPS + (tid >> 5)) * R
        for k in range(STAGED_PER_THREAD):
            # where x column (tid + k*BLOCK_THREADS) of a tile goes: element i of `ln`'s unit,
            # at lane ln ^ i of row i so that both staging writes and lane reads spread on banks
            ln, i = owner(tid + k * BLOCK_THREADS)
            staged_at[k] = i * 32 + (ln ^ i)
        for r in range(R):
            for s in range(N):
                acc[r, s] = float32(0.0)
            load(w, w8, min(row0 + r, rows - 1), 0, cols, lane, raw_next, r)

        for col0 in range(0, cols, TILE):
            # Software pipeline: take the prefetched tile, start loading the next one (the
            # last tile reloads itself, harmlessly), and only then stage x, decode and multiply,
            # so DRAM latency overlaps the work on this tile.
            for r in range(R):
                for j in range(RAW):
                    raw[r, j] = raw_next[r, j]
            col_next = col0 + TILE if col0 + TILE < cols else col0
            for r in range(R):
                load(w, w8, min(row0 + r, rows - 1), col_next, cols, lane, raw_next, r)
            # this thread's share of the x tile: loaded now, stored after the barrier
            for k in range(STAGED_PER_THREAD):
                col = col0 + tid + k * BLOCK_THREADS
                for s in range(N):
                    value = x[s, min(col, cols - 1)]  # unconditional load, then select
                    x_part[k, s] = value if col < cols else float32(0.0)
            cuda.syncthreads()  # everyone is done reading the previous tile of xs
            for k in range(STAGED_PER_THREAD):
                for s in range(N):
                    xs[s, staged_at[k]] = x_part[k, s]
            cuda.syncthreads()
            for r in range(R):
                prepare(raw, fac, r, col0, cols, lane)
            # Straight-line calls rather than one loop of E: NVVM fully unrolls each call's
            # small loops, keeping raw/fac/acc in registers; a rolled loop would spill them.
            multiply_eight(0, xs, lane, raw, fac, xv, acc)
            multiply_eight(8, xs, lane, raw, fac, xv, acc)
            if E == 32:
                multiply_eight(16, xs, lane, raw, fac, xv, acc)
                multiply_eight(24, xs, lane, raw, fac, xv, acc)

        warp_reduce(acc)
        if lane == 0:
            for r in range(R):
                if row0 + r < rows:
                    for s in range(N):
                        out[s, row0 + r] = acc[r, s]
    return matvec_kernel


def _build_kernel(unit: LaneUnit, n_slots: int, rows_per_warp: int):
    """The matvec kernel (Python function) for one type, slot count and rows per warp."""
    assert unit.elems in (16, 32)
    functions = dict(load=unit.load, prepare=unit.prepare, weight=unit.weight, owner=unit.owner)
    functions["multiply_eight"] = device_function(
        _specialise(_multiply_eight_template, dict(N=n_slots, R=rows_per_warp), functions))
    constants = dict(N=n_slots, R=rows_per_warp, E=unit.elems, TILE=unit.tile_cols,
                     RAW=unit.raw_words, FAC=unit.factors,
                     STAGED_PER_THREAD=unit.tile_cols // BLOCK_THREADS,
                     TYPE_ID=unit.type.id, STAMP=SOURCE_STAMP)
    kernel_fn = _specialise(_kernel_template, constants, functions)
    kernel_fn.__name__ = kernel_fn.__qualname__ = f"matvec_{unit.type.name}_n{n_slots}_r{rows_per_warp}"
    return kernel_fn


def _uses_dp4a(type_id: int) -> bool:
    return int(type_id) in matvec_q8.UNITS


def kernel(type_id: int, n_slots: int, rows_per_warp: int, lanes: int = 32):
    """The kernel `matvec` launches for this type and shape (compiled on first launch, cached
    on disk by Numba); `lanes` per row: the dp4a kernel's (lanes_per_row), 32 for the others."""
    if _uses_dp4a(type_id):
        return matvec_q8.kernel(type_id, n_slots, rows_per_warp, lanes)
    return float_kernel(type_id, n_slots, rows_per_warp)


def lanes_per_row(type_id: int, cols: int) -> int:
    """Lanes of a warp that share one row in `matvec` (all 32 but in the dp4a kernel)."""
    if _uses_dp4a(type_id):
        return matvec_q8.lanes_per_row(matvec_q8.UNITS[int(type_id)], cols)
    return 32


@kernel_factory
def float_kernel(type_id: int, n_slots: int, rows_per_warp: int):
    """The float-decoding kernel of any supported type."""
    pyfunc = _build_kernel(UNITS[type_id], n_slots, rows_per_warp)
    return cuda.jit(cache=True)(pyfunc)


def kernel_argtypes(unit: LaneUnit) -> tuple:
    """Numba argument types of a matvec kernel (w, w8, x, out, rows, cols)."""

    def matrix(dtype):
        return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 2, "C")

    return (matrix(unit.word), matrix(np.uint8), matrix(np.float32), matrix(np.float32),
            types.int64, types.int64)


PTX_CHECK_SHAPES = ((1, 1), (2, 2), (3, 4), (8, 2))  # (slots, rows per warp)


def ptx_targets(every_shape: bool = False):
    """(name, python function, argument types) of the matvec kernels, for the PTX check: per
    type the largest unrolled body, or every shape in PTX_CHECK_SHAPES; then the dp4a ones."""
    for unit in UNITS.values():
        if unit.type.id in matvec_q8.UNITS:
            continue  # served by matvec_q8
        for n, r in (PTX_CHECK_SHAPES if every_shape else PTX_CHECK_SHAPES[2:3]):
            yield (f"matvec {unit.type.name} n={n} rows_per_warp={r}",
                   _build_kernel(unit, n, r), kernel_argtypes(unit))
    yield from matvec_q8.ptx_targets(every_shape)


@functools.cache
def _sm_count() -> int:
    if simulated():
        return 0  # the simulator gains nothing from more, smaller blocks
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def default_rows_per_warp(n_slots: int, rows: int, type_id: int | None = None, lanes: int = 32) -> int:
    """Rows per warp (per group of `lanes` lanes) of the kernel `matvec` launches for `type_id`
    (the float kernel's when None). Float kernel: the most that the registers allow (more x
    reuse), fewer when the matrix has too few rows to give every SM several blocks. Any choice
    gives the same bits."""
    if type_id is not None and _uses_dp4a(type_id):
        return matvec_q8.default_rows_per_warp(n_slots, rows, lanes)
    r = max(1, min(4, MAX_ROWS_X_SLOTS // n_slots))
    while r > 1 and -(-rows // (WARPS * r)) < 4 * _sm_count():
        r //= 2
    return r



def matvec(wtype: int, w_dev, x_dev, out_dev, stream=None, rows_per_warp: int | None = None,
           lanes: int | None = None) -> None:
    """out_dev[s, :] = W @ x_dev[s, :] for every slot s; W is `wtype` rows of raw GGUF blocks.

    w_dev: uint8 device array (rows, row_bytes); x_dev: float32 (n, cols); out_dev: float32
    (n, rows). Asynchronous on `stream` (gpu.runtime.memory's stream when None). `rows_per_warp` is a
    tuning knob for benchmarks; it never changes the result. So is `lanes` (lanes per row of the
    dp4a kernel), which does change the bits (gpu/matmul/matvec_q8.py).

    Quantised types use int8 activations (gpu/matmul/matvec_q8.py): x is rounded per block of 32 to
    max|x|/127 steps, a relative error of up to 1/254 of the block's largest |x| per element.

    Calls of gpu.matmul.gemm.GEMM_MIN_ROWS rows or more (prompt chunks) go to the tiled GEMM, which
    reads each weight once per tile of rows instead of once per 8 slots: its rows have the
    GEMM's bits (the same in every GEMM call), not a one-slot call's. A `rows_per_warp` or
    `lanes` (benchmarks) keeps any call on this kernel.
    """
    unit, rows, cols, n = _check(wtype, w_dev, x_dev, out_dev)
    if rows_per_warp is None and lanes is None:
        if n >= gemm.GEMM_MIN_ROWS:
            gemm.gemm(wtype, w_dev, x_dev, out_dev, stream)
            return
    launch_stream = memory.stream() if stream is None else stream
    if _uses_dp4a(unit.type.id):
        matvec_q8.matvec(unit.type.id, w_dev, x_dev, out_dev, rows, cols, n, launch_stream, rows_per_warp, lanes)
        return
    w = w_dev.view(unit.word)
    for s0 in range(0, n, MAX_SLOTS):
        k = min(MAX_SLOTS, n - s0)
        r = min(rows_per_warp, max(1, MAX_ROWS_X_SLOTS // k)) if rows_per_warp else default_rows_per_warp(k, rows)
        xk = x_dev if k == n else x_dev[s0:s0 + k]
        ok = out_dev if k == n else out_dev[s0:s0 + k]
        blocks = -(-rows // (WARPS * r))
        float_kernel(unit.type.id, k, r)[blocks, BLOCK_THREADS, launch_stream](w, w_dev, xk, ok, rows, cols)


def matvecs(products, x_dev, stream=None) -> None:
    """out = W @ x for every (wtype, w_dev, out_dev) of one input x_dev (a GDN layer's four
    projections, attention's q/k/v): as `matvec` each, with the same bits, but the int8 types
    quantise x once per x layout instead of once per matrix (a launch saved each)."""
    launch_stream = memory.stream() if stream is None else stream
    shared = x_dev.shape[0] < gemm.GEMM_MIN_ROWS
    by_layout: dict[int, list] = {}
    for wtype, w_dev, out_dev in products:
        if shared and _uses_dp4a(wtype):
            by_layout.setdefault(matvec_q8.UNITS[wtype].x_layout, []).append((wtype, w_dev, out_dev))
        else:
            matvec(wtype, w_dev, x_dev, out_dev, launch_stream)
    # one layout at a time: its quantised x lives in scratch the next quantise overwrites; the
    # matrices of one type then go GROUP to a launch (a GDN layer's z, β, α: launch-bound sizes)
    for layout, group in by_layout.items():
        quantized = matvec_q8.quantize(x_dev, launch_stream, layout)
        n, cols = x_dev.shape
        by_type: dict[int, list] = {}
        for wtype, w_dev, out_dev in group:
            _check(wtype, w_dev, x_dev, out_dev)
            by_type.setdefault(wtype, []).append((w_dev, out_dev))
        for wtype, pairs in by_type.items():
            for i in range(0, len(pairs), matvec_q8.GROUP):
                part = pairs[i:i + matvec_q8.GROUP]
                if len(part) == 1:
                    (w_dev, out_dev), = part
                    matvec_q8.matvec(wtype, w_dev, x_dev, out_dev, w_dev.shape[0], cols, n, launch_stream,
                                     quantized=quantized)
                else:
                    matvec_q8.matvec_group(wtype, part, x_dev, cols, n, launch_stream, quantized)
