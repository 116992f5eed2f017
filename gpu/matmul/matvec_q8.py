"""Decode matvec of the quantised types on int8 activations: out[s, row] = W[row, :] · x[s, :].

Decoding every weight to float32 costs ~5-7 instructions and made the float kernel
(gpu/matmul/matvec.py) instruction-bound at 15-26 % of the memory bandwidth. Here (llama.cpp's "mmvq"
idea) x is quantised once per call to int8 in blocks of 32 (`quantize`), and each weight unit
is dotted with it by `dp4a`, four int8 products per instruction; the scales are applied in
float32 once per 16 or 32 weights. Per-type lane work: gpu/matmul/quants_q8.py.

Work split: a group of L lanes (L = 32, 16, 8 or 4; `lanes_per_row`) owns R consecutive rows,
a warp 32/L such groups; lane l of a group takes units l, l + L, l + 2L, ... of every one of its
rows (the same columns in each row, so each x word it loads serves R rows). L is the width that
leaves few lanes idle in a row's last step: a 5120-wide Q4_K row is 80 units, 2.5 steps of 32
lanes (a sixth of the lane-steps idle) but 5 steps of 16. A unit is 64
weights for the 256-weight types (one scale decode, one header load, int32 sums per 32 or 16
weights), 16 for Q8_0, 32 for the other 32-weight block types. A lane issues the loads of U units of its R rows
(R·U = the type's in_flight: 128 weights of the K-quants) before it uses any, so that several
loads per lane are in flight; x (small, L1/L2-resident) is read from global memory, nothing
goes through shared memory. For the 64-weight types the quantiser lays x out so that each
16-byte x load of a warp is one contiguous run (gpu/matmul/quants_q8.py `step_slot`). Each
(row, slot) sum is reduced across the group at the end by a fixed butterfly.

Per-slot bit identity: slot s of a row is the same sequence of float operations whatever the
slot count, R or U: the same lane adds the same units, one after another in column order, then
the same butterfly. x is quantised per slot. So a k-slot call gives each slot exactly the bits
of a 1-slot call. L does change the order, so it depends on the row length only.

Error: x·w is computed with x rounded to dx·xq, |x − dx·xq| ≤ dx/2 with dx = max|x|/127 over
its block of 32; Q4_K/Q5_K's min term uses the exact float sum of x, Q2_K's the rounded x (the int
sums of xq per 16, as llama.cpp).
"""
from __future__ import annotations

import functools

import numpy as np
from numba import cuda, float32, int32, uint32
from numba import types
from numba.np import numpy_support

from ..runtime import memory
from ..runtime.device import simulated
from ..intrinsics import device_function, f16_bits_to_f32, group_reduce, pack_f16x2, round_to_int
from .kernel_source import MAX_ROWS_X_SLOTS, MAX_SLOTS, WARPS, kernel_factory, source_stamp
from .kernel_source import specialise as _specialise
from .quants_q8 import K64, NATURAL, Q6K64, START, UNITS, Dp4aUnit, step_slot, x_row_words

BLOCK_THREADS = 32 * WARPS
X_BLOCK = 32             # activation elements per int8 scale
QUANTIZE_THREADS = 32 if simulated() else 128
LANES_PER_X_BLOCK = 8    # quantiser: each lane takes 4 elements (one packed int8 word)


SOURCE_STAMP = source_stamp("matmul/kernel_source.py", "matmul/matvec_q8.py", "matmul/quants_q8.py", "matmul/quants.py",
                            "intrinsics.py")

# Bound per ggml type in each specialised kernel's globals (see gpu.matmul.kernel_source.specialise).
load = prepare = load_x = dot = add_unit = None


# --- activations: x -> int8 ------------------------------------------------------------------------

def _quantize_template(STAMP, LAYOUT):
    def quantize_kernel(x, xq, xm_f, xm_i):
        """Blocks of 32 of x (n, cols) -> xq (n, cols/4) packed int8 words, and per block
        dx = max|x|/127, the float sum of x (NATURAL: Q8_1's s instead) and the int sums of xq
        over each half of 16, into xm (n, cols/8) as LAYOUT says.

        8 threads per block, 4 elements each; they combine their partial results through
        shared memory in a fixed tree (one barrier each for the floats and the int sums)."""
        if STAMP < 0:  # never true: puts the stamp in the cache key
            return
        partial = cuda.shared.array((QUANTIZE_THREADS, 2), float32)
        q_sums = cuda.shared.array(QUANTIZE_THREADS, int32)
        tid = cuda.threadIdx.x
        lane = tid & (LANES_PER_X_BLOCK - 1)
        first = tid - lane
        blocks = x.shape[1] // X_BLOCK
        total = x.shape[0] * blocks
        g = cuda.grid(1) // LANES_PER_X_BLOCK
        live = g < total
        g = min(g, total - 1)  # every thread reaches the barriers
        s = g // blocks
        b = g - s * blocks
        c0 = b * X_BLOCK + 4 * lane
        v0, v1, v2, v3 = x[s, c0], x[s, c0 + 1], x[s, c0 + 2], x[s, c0 + 3]
        partial[tid, 0] = max(max(abs(v0), abs(v1)), max(abs(v2), abs(v3)))
        partial[tid, 1] = (v0 + v1) + (v2 + v3)
        cuda.syncthreads()
        amax = partial[first, 0]
        for j in range(1, LANES_PER_X_BLOCK):
            amax = max(amax, partial[first + j, 0])
        d32 = amax / float32(127.0)
        if LAYOUT == NATURAL:
            # the 32-weight block types: x rounded as llama.cpp's CPU does for them
            # (cpu.activations' Q8_0 and Q8_1, whose codes and d are Q8_0's): dx = fp16(amax/127),
            # codes x·(127/amax) rounded half to even
            dx = f16_bits_to_f32(pack_f16x2(d32, float32(0.0)))
            inv = float32(127.0) / amax if amax > float32(0.0) else float32(0.0)
        else:
            dx = d32
            inv = float32(1.0) / dx if dx > float32(0.0) else float32(0.0)
        q0, q1, q2, q3 = round_to_int(v0 * inv), round_to_int(v1 * inv), round_to_int(v2 * inv), round_to_int(v3 * inv)
        q_sums[tid] = int32(q0 + q1 + q2 + q3)
        cuda.syncthreads()
        if live:
            word = b * 8 + lane
            if LAYOUT != NATURAL:
                word = step_slot(word, LAYOUT == Q6K64)
            xq[s, word] = ((uint32(q0) & uint32(0xFF)) | ((uint32(q1) & uint32(0xFF)) << uint32(8))
                           | ((uint32(q2) & uint32(0xFF)) << uint32(16)) | (uint32(q3) << uint32(24)))
            if lane == 0:
                x_sum = (((partial[first, 1] + partial[first + 1, 1])
                          + (partial[first + 2, 1] + partial[first + 3, 1]))
                         + ((partial[first + 4, 1] + partial[first + 5, 1])
                            + (partial[first + 6, 1] + partial[first + 7, 1])))
                half0 = (q_sums[first] + q_sums[first + 1]) + (q_sums[first + 2] + q_sums[first + 3])
                half1 = (q_sums[first + 4] + q_sums[first + 5]) + (q_sums[first + 6] + q_sums[first + 7])
                if LAYOUT == NATURAL:
                    # Q8_1's s = fp16(d·Σ xq) with the unrounded d (the min term of Q4_1/Q5_1)
                    xm_f[s, 4 * b] = dx
                    xm_f[s, 4 * b + 1] = f16_bits_to_f32(pack_f16x2(d32 * float32(half0 + half1), float32(0.0)))
                    xm_i[s, 4 * b + 2] = half0
                    xm_i[s, 4 * b + 3] = half1
                elif LAYOUT == K64:  # lane (blk, p) reads blocks 2p, 2p + 1: one 16-byte load
                    xm_f[s, 2 * b] = dx
                    xm_f[s, 2 * b + 1] = x_sum
                    # and (second half of the row) their int sums per 16 (Q8_K's bsums: Q3_K's
                    # zero point, Q2_K's min term), one 16-byte load too
                    second_plane = x.shape[1] // 16
                    xm_i[s, second_plane + 2 * b] = half0
                    xm_i[s, second_plane + 2 * b + 1] = half1
                else:
                    # lane (blk, p = 2n + u) reads its four groups' dx (blocks 4n + t of blk) and
                    # their dp4a start values START − 32·Σ xq over half u, one 16-byte load each
                    blk, j = b >> 3, b & 7
                    at = 4 * (4 * blk + 2 * (j >> 2)) + (j & 3)
                    second_plane = x.shape[1] // 16
                    xm_f[s, at] = dx
                    xm_f[s, at + 4] = dx
                    xm_i[s, second_plane + at] = START - int32(32) * half0
                    xm_i[s, second_plane + at + 4] = START - int32(32) * half1
    return quantize_kernel


@kernel_factory
def quantize_kernel(layout: int = NATURAL):
    fn = _specialise(_quantize_template, dict(STAMP=SOURCE_STAMP, LAYOUT=layout), {})
    return cuda.jit(cache=True)(fn)


def quantize(x_dev, stream=None, layout: int = NATURAL):
    """(xq, xm): x_dev (n, cols) float32 quantised to int8 per block of 32, in scratch buffers
    that the next call overwrites (see the module docstring of gpu/matmul/quants_q8.py). The 64-weight
    layouts need cols % 256 == 0."""
    n, cols = x_dev.shape
    xq = memory.scratch("matvec_q8.xq", (n, x_row_words(cols, layout)), np.uint32)
    xm = memory.scratch("matvec_q8.xm", (n, cols // 8), np.uint32)
    threads = n * (cols // X_BLOCK) * LANES_PER_X_BLOCK
    launch_stream = memory.stream() if stream is None else stream
    quantize_kernel(layout)[-(-threads // QUANTIZE_THREADS), QUANTIZE_THREADS, launch_stream](
        x_dev, xq, xm.view(np.float32), xm.view(np.int32))
    return xq, xm


# --- the matvec ------------------------------------------------------------------------------------

def _add_unit_template(N, R, U):
    def add_unit(raw, u, blk, p, q, fac, xq, xm, xv, xf, xs, acc):
        """acc[r, s] += unit (blk, p)'s dot for every row r and slot s; its weights are raw[r·U + u]."""
        for r in range(R):
            prepare(raw, r * U + u, q, fac, r, p)
        for s in range(N):
            load_x(xq, xm, s, blk, p, xv, xf, xs)
            for r in range(R):
                acc[r, s] = dot(q, fac, r, xv, xf, xs, acc[r, s])
    return add_unit


def _rows_template(N, R, U, L, RU, UPB, RAW, QW, FAC, XV, XF, XS):
    BPS = L // UPB     # blocks per step of L units
    GROUPS = 32 // L   # row groups per warp

    def matvec_rows(w, w8, xq, xm, out, rows, n_blocks, block):
        """The rows of thread block `block` (WARPS·GROUPS·R of them) for all N slots."""
        raw = cuda.local.array((RU, RAW), uint32)  # RU = R·U
        q = cuda.local.array((R, QW), uint32)
        fac = cuda.local.array((R, FAC), float32)
        xv = cuda.local.array(XV, uint32)
        xf = cuda.local.array(XF, float32)
        xs = cuda.local.array(XS, int32)
        acc = cuda.local.array((R, N), float32)
        tid = cuda.threadIdx.x
        lane = tid & (L - 1)   # within the row group
        row0 = ((block * WARPS + (tid >> 5)) * GROUPS + (tid & 31) // L) * R
        for r in range(R):
            for s in range(N):
                acc[r, s] = float32(0.0)
        # unit L·step + lane of the row is piece p of block blk
        p = lane % UPB
        blk = lane // UPB
        # U steps at a time: all their loads first (rows past the end reload the last row)
        while blk + BPS * (U - 1) < n_blocks:
            for u in range(U):
                for r in range(R):
                    load(w, w8, min(row0 + r, rows - 1), blk + BPS * u, p, raw, r * U + u)
            for u in range(U):
                add_unit(raw, u, blk + BPS * u, p, q, fac, xq, xm, xv, xf, xs, acc)
            blk += BPS * U
        if U > 1:  # the rest one step at a time, in the same column order
            while blk < n_blocks:
                for r in range(R):
                    load(w, w8, min(row0 + r, rows - 1), blk, p, raw, r * U)
                add_unit(raw, 0, blk, p, q, fac, xq, xm, xv, xf, xs, acc)
                blk += BPS
        group_reduce(acc, L)
        if lane == 0:
            for r in range(R):
                if row0 + r < rows:
                    for s in range(N):
                        out[s, row0 + r] = acc[r, s]
    return matvec_rows


def _kernel_template(TYPE_ID, SHAPE, STAMP):
    def matvec_q8_kernel(w, w8, xq, xm, out, rows, n_blocks):
        if TYPE_ID < 0 or SHAPE < 0 or STAMP < 0:  # never true: puts all three in the cache key (_specialise)
            return
        matvec_rows(w, w8, xq, xm, out, rows, n_blocks, cuda.blockIdx.x)
    return matvec_q8_kernel


GROUP = 3          # matrices one grouped launch takes (a GDN layer's z, β and α projections)


def _group_template(TYPE_ID, SHAPE, STAMP):
    def matvec_q8_group_kernel(w0, w80, out0, rows0, blocks0, w1, w81, out1, rows1, blocks1,
                               w2, w82, out2, rows2, blocks2, xq, xm, n_blocks):
        """Up to GROUP matrices of one type and width on the same x in one launch: the first
        blocks0 blocks run matrix 0, the next blocks1 matrix 1, the rest matrix 2 (each block
        the work it has in a launch of its own, so the same bits)."""
        if TYPE_ID < 0 or SHAPE < 0 or STAMP < 0:  # never true (see matvec_q8_kernel)
            return
        # One call site of the inlined row loop, on the block's matrix: three call sites made
        # three copies of the unrolled loop, and compiling them dominated the kernel's cold start.
        b = cuda.blockIdx.x
        w, w8, out, rows = w0, w80, out0, rows0
        if b >= blocks0 + blocks1:
            w, w8, out, rows, b = w2, w82, out2, rows2, b - blocks0 - blocks1
        elif b >= blocks0:
            w, w8, out, rows, b = w1, w81, out1, rows1, b - blocks0
        matvec_rows(w, w8, xq, xm, out, rows, n_blocks, b)
    return matvec_q8_group_kernel


def _experts_template(TYPE_ID, SHAPE, STAMP):
    def matvec_q8_experts_kernel(ws, ws8, hs, hs8, where, x_per_pair, xq, xm, out, rows, n_blocks):
        """Pair a = i·k + rank (grid y) of a MoE layer's routing, run where `where` (n, k) says
        (gpu/expert_cache.py): code s ≥ 0, from slot s of the cached stacks ws (slots, rows,
        words); code −2 − s, from slot s of the staged stacks hs (fetched over PCIe); −1 (the
        CPU runs it) skips the pair, leaving its out row as it was. out[a] = W · x, x being row
        i of xq/xm (the layer input) or, with x_per_pair, row a (the pair's hidden)."""
        if TYPE_ID < 0 or SHAPE < 0 or STAMP < 0:  # never true (see matvec_q8_kernel)
            return
        a = cuda.blockIdx.y
        k = where.shape[1]
        i = a // k
        code = where[i, a - i * k]
        if code == -1:
            return
        xr = a if x_per_pair else i
        if code >= 0:
            w, w8 = ws[code], ws8[code]
        else:
            w, w8 = hs[-2 - code], hs8[-2 - code]
        matvec_rows(w, w8, xq[xr:xr + 1], xm[xr:xr + 1], out[a:a + 1], rows, n_blocks, cuda.blockIdx.x)
    return matvec_q8_experts_kernel


def units_in_flight(unit: Dp4aUnit, rows_per_warp: int) -> int:
    """U: units per row a lane loads before it uses them (R·U = the type's in_flight: 128
    weights of the K-quants, 64 of Q8_0)."""
    return max(1, unit.in_flight // rows_per_warp)


def lanes_per_row(unit: Dp4aUnit, cols: int) -> int:
    """L, the lanes that share a row (module docstring): 32 unless that leaves more than an
    eighth of the lane-steps idle in the row's last step; then, of 16, 8, 4 (at least a
    block's units), the one with the fewest idle lane-steps, the widest on a tie (a 5120-wide
    row, 80 units with a sixth idle at 32, read fastest at 16; a 17408-wide one at 32). A function of the row length alone, so every call on a matrix adds
    in the same order."""
    units = unit.units_per_row(cols)

    def idle(w):
        return -(-units // w) * w - units
    if 8 * idle(32) <= -(-units // 32) * 32:
        return 32
    widths = [w for w in (16, 8, 4) if w >= unit.units_per_block]
    return min(widths, key=lambda w: (idle(w), -w))


def _build_kernel(unit: Dp4aUnit, n_slots: int, rows_per_warp: int, lanes: int = 32, template=None):
    """The kernel (Python function) for one type, slot count, rows per lane group and group width:
    the matvec, or the expert-cache one with template=_experts_template."""
    u = units_in_flight(unit, rows_per_warp)
    functions = dict(load=unit.load, prepare=unit.prepare, load_x=unit.load_x, dot=unit.dot)
    functions["add_unit"] = device_function(
        _specialise(_add_unit_template, dict(N=n_slots, R=rows_per_warp, U=u), functions))
    shape = dict(N=n_slots, R=rows_per_warp, U=u, L=lanes, RU=rows_per_warp * u, UPB=unit.units_per_block,
                 RAW=unit.raw_words, QW=unit.q_words,
                 FAC=unit.factors, XV=unit.x_words, XF=unit.x_floats, XS=unit.x_ints)
    # a Numba device function under the simulator too: it allocates local arrays and reads
    # threadIdx, which only the simulator's own device functions can
    rows_fn = cuda.jit(device=True, inline=True)(_specialise(_rows_template, shape, functions))
    template = template or _kernel_template
    # the kernel's own code is the same for every shape: the shape number keeps their disk
    # cache entries apart (matvec_rows, a global, is not part of the key)
    key = n_slots * 1_000_000 + rows_per_warp * 10_000 + lanes * 100 + u
    kernel_fn = _specialise(template, dict(TYPE_ID=unit.type.id, SHAPE=key, STAMP=SOURCE_STAMP),
                            dict(matvec_rows=rows_fn))
    kind = {_experts_template: "experts_", _group_template: "group_"}.get(template, "")
    kernel_fn.__name__ = kernel_fn.__qualname__ = \
        f"matvec_q8_{kind}{unit.type.name}_n{n_slots}_r{rows_per_warp}_l{lanes}"
    return kernel_fn


@kernel_factory
def kernel(type_id: int, n_slots: int, rows_per_warp: int, lanes: int = 32):
    """The compiled-on-first-launch kernel (cached on disk by Numba)."""
    return cuda.jit(cache=True)(_build_kernel(UNITS[type_id], n_slots, rows_per_warp, lanes))


@kernel_factory
def group_kernel(type_id: int, n_slots: int, rows_per_warp: int, lanes: int):
    return cuda.jit(cache=True)(_build_kernel(UNITS[type_id], n_slots, rows_per_warp, lanes, _group_template))


@kernel_factory
def experts_kernel(type_id: int, rows_per_warp: int, lanes: int):
    return cuda.jit(cache=True)(_build_kernel(UNITS[type_id], 1, rows_per_warp, lanes, _experts_template))


def _matrix(dtype):
    return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 2, "C")


def kernel_argtypes(unit: Dp4aUnit) -> tuple:
    """Numba argument types of a kernel (w, w8, xq, xm, out, rows, n_blocks)."""
    return (_matrix(unit.word), _matrix(np.uint8), _matrix(np.uint32), _matrix(np.uint32),
            _matrix(np.float32), types.int64, types.int64)


def group_argtypes(unit: Dp4aUnit) -> tuple:
    """Numba argument types of a group kernel: (w, w8, out, rows, blocks) × GROUP, xq, xm, n_blocks."""
    one = (_matrix(unit.word), _matrix(np.uint8), _matrix(np.float32), types.int64, types.int64)
    return (*one * GROUP, _matrix(np.uint32), _matrix(np.uint32), types.int64)


def experts_argtypes(unit: Dp4aUnit) -> tuple:
    """Numba argument types of an experts kernel (ws, ws8, hs, hs8, where, x_per_pair, xq, xm, out,
    rows, n_blocks)."""

    def stack(dtype):
        return types.Array(numpy_support.from_dtype(np.dtype(dtype)), 3, "C")
    return (stack(unit.word), stack(np.uint8), stack(unit.word), stack(np.uint8), types.Array(types.int32, 2, "C"),
            types.boolean, _matrix(np.uint32), _matrix(np.uint32), _matrix(np.float32), types.int64, types.int64)


# (slots, rows per group, lanes per row): the most units in flight; the most accumulators
PTX_CHECK_SHAPES = ((1, 1, 32), (8, 2, 16))
PTX_CHECK_SHAPES_ALL = ((1, 1, 32), (2, 2, 8), (3, 4, 32), (4, 2, 16), (8, 2, 4))


def ptx_targets(every_shape: bool = False):
    """(name, python function, argument types) of the quantiser and every type's kernels."""
    for layout in (NATURAL, K64, Q6K64):
        yield (f"matvec q8 quantize x layout {layout}",
               _specialise(_quantize_template, dict(STAMP=SOURCE_STAMP, LAYOUT=layout), {}),
               (_matrix(np.float32), _matrix(np.uint32), _matrix(np.float32), _matrix(np.int32)))
    for unit in UNITS.values():
        for n, r, lanes in (PTX_CHECK_SHAPES_ALL if every_shape else PTX_CHECK_SHAPES):
            if lanes >= unit.units_per_block:
                yield (f"matvec {unit.type.name} dp4a n={n} rows_per_warp={r} lanes={lanes}",
                       _build_kernel(unit, n, r, lanes), kernel_argtypes(unit))
        yield (f"matvec {unit.type.name} dp4a cached experts", _build_kernel(unit, 1, 2, 32, _experts_template),
               experts_argtypes(unit))
        yield (f"matvec {unit.type.name} dp4a group", _build_kernel(unit, 1, 1, 32, _group_template),
               group_argtypes(unit))


@functools.cache
def _sm_count() -> int:
    if simulated():
        return 0  # the simulator gains nothing from more, smaller blocks
    return cuda.get_current_device().MULTIPROCESSOR_COUNT


def default_rows_per_warp(n_slots: int, rows: int, lanes: int = 32) -> int:
    """Rows per lane group. Two, so that each x value a lane loads serves two rows, except at
    one slot with lane groups narrower than the warp: one row per group (the warp still owns
    two) and twice the warps. Fewer when the matrix has too few rows to give every SM several
    blocks. Any choice gives the same bits. The sweep that chose it (`tools/gpu_bench.py
    --sweep`) is in docs/MEASUREMENTS.md."""
    r = 1 if n_slots == 1 and lanes < 32 else 2
    while r > 1 and -(-rows // (WARPS * (32 // lanes) * r)) < 4 * _sm_count():
        r //= 2
    return r


def matvec(type_id: int, w_dev, x_dev, out_dev, rows: int, cols: int, n: int, stream,
           rows_per_warp: int | None = None, lanes: int | None = None, quantized=None) -> None:
    """out_dev[s, :] = W @ x_dev[s, :] (checked by gpu.matmul.quants.check_matvec): quantise x, then one
    launch per MAX_SLOTS slots. `rows_per_warp` (rows per lane group) and `lanes` (lanes per
    row, which changes the bits) override the defaults for benchmarks and tests. `quantized`:
    (xq, xm) of `quantize(x_dev, ..., layout=x_layout(type_id))`, already on the stream."""
    unit = UNITS[type_id]
    xq, xm = quantize(x_dev, stream, unit.x_layout) if quantized is None else quantized
    w = w_dev.view(unit.word)
    n_blocks = cols // unit.type.block_elems
    lanes = lanes or lanes_per_row(unit, cols)
    for s0 in range(0, n, MAX_SLOTS):
        k = min(MAX_SLOTS, n - s0)
        r = (min(rows_per_warp, max(1, MAX_ROWS_X_SLOTS // k)) if rows_per_warp
             else default_rows_per_warp(k, rows, lanes))
        ok = out_dev if k == n else out_dev[s0:s0 + k]
        blocks = -(-rows // (WARPS * (32 // lanes) * r))
        kernel(type_id, k, r, lanes)[blocks, BLOCK_THREADS, stream](
            w, w_dev, xq[s0:s0 + k], xm[s0:s0 + k], ok, rows, n_blocks)


def matvec_group(type_id: int, products, x_dev, cols: int, n: int, stream, quantized) -> None:
    """`matvec` of x_dev by 2..GROUP matrices of one type and width, products = ((w_dev,
    out_dev), ...), one launch per MAX_SLOTS slots instead of one per matrix, each row with the
    bits of its own matvec (rows per warp never changes them). `quantized`: as in `matvec`."""
    unit = UNITS[type_id]
    xq, xm = quantized
    n_blocks = cols // unit.type.block_elems
    lanes = lanes_per_row(unit, cols)
    total_rows = sum(w.shape[0] for w, _ in products)
    padded = list(products) + [products[-1]] * (GROUP - len(products))     # never reached: 0 blocks
    for s0 in range(0, n, MAX_SLOTS):
        k = min(MAX_SLOTS, n - s0)
        r = default_rows_per_warp(k, total_rows, lanes)
        args, grid = [], 0
        for i, (w_dev, out_dev) in enumerate(padded):
            rows = w_dev.shape[0]
            blocks = -(-rows // (WARPS * (32 // lanes) * r)) if i < len(products) else 0
            args += [w_dev.view(unit.word), w_dev, out_dev if k == n else out_dev[s0:s0 + k], rows, blocks]
            grid += blocks
        group_kernel(type_id, k, r, lanes)[grid, BLOCK_THREADS, stream](*args, xq[s0:s0 + k], xm[s0:s0 + k],
                                                                       n_blocks)


def experts_matvec(type_id: int, cached, staged, where, quantized, out_dev, x_per_pair: bool, stream) -> None:
    """A MoE layer's routed experts that the GPU runs (gpu/expert_cache.py): for every (row i,
    rank) pair a = i·k + rank that `where` (n, k) int32 gives the GPU — code s ≥ 0: slot s of
    `cached`; code −2 − s: slot s of `staged` (both (slots, rows, row_bytes) uint8 in VRAM) —
    out_dev[a] = W · x, x being row i of the quantised input, or row a with x_per_pair.
    quantized: (xq, xm) of `quantize` in this type's layout; out_dev: (n·k, rows) float32. Each
    pair gets the bits of a one-slot `matvec` on its expert's matrix, wherever that is read from."""
    unit = UNITS[type_id]
    _, rows, row_bytes = cached.shape
    cols = row_bytes // unit.type.block_bytes * unit.type.block_elems
    pairs = where.shape[0] * where.shape[1]
    lanes = lanes_per_row(unit, cols)
    r = default_rows_per_warp(1, rows * pairs, lanes)     # the pairs' blocks fill the GPU together
    blocks = -(-rows // (WARPS * (32 // lanes) * r))
    xq, xm = quantized
    experts_kernel(type_id, r, lanes)[(blocks, pairs), BLOCK_THREADS, stream](
        cached.view(unit.word), cached, staged.view(unit.word), staged, where, x_per_pair, xq, xm, out_dev,
        rows, cols // unit.type.block_elems)
