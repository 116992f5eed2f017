"""Tensor-core GEMM for prompt chunks: out (n, rows) = x (n, cols) · Wᵀ with fp16 products and
float32 sums, through `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` (Ampere and Hopper).

Numba has no tensor-core API; gpu/intrinsics.py emits the instruction as inline PTX, and
gpu/mma_layout.py says which lane holds which matrix element. The same shape as the float32
kernel in gpu/gemm.py, with the inner product moved to the tensor cores:

* a block of WARPS_ROWS × WARPS_TOKENS warps owns BM weight rows × BN tokens of `out`; each warp
  a sub-tile of 16·MT rows × 8·NT tokens: MT × NT m16n8 accumulator blocks, 4 floats per lane
  each (64 registers for the 64 × 32 warp tile of the 128 × 128 block);
* per K step of 32 columns (two k16 steps) the block decodes its BM × 32 weights with the
  per-type units of gpu/gemm_units.py (one 16-weight unit per thread), rounds them to fp16 and
  stores them as k-consecutive pairs, one 32-bit word each (cvt.rn.f16x2.f32); x is staged the
  same way. A = weight rows (row-major over k), B = x rows (k-contiguous: the ".col" operand),
  so each fragment register is one 32-bit shared load;
* shared tiles are rows of STRIDE = 20 words (16 pair words + 4 padding): the 8 rows × 4 words
  of a fragment load then fall in 32 different banks, and a weight unit's 8 words go out as two
  16-byte stores that no two lanes of a quarter-warp share a bank in;
* double buffering with one barrier per step: while the warps multiply step s from one buffer
  they decode step s + 1 (its words loaded during step s - 1) into the other and issue the
  loads of step s + 2, so DRAM latency and the decode ALU work overlap the tensor cores.

Numerics. Every weight and x value is rounded to fp16 (relative error <= 2^-11, or 2^-25
absolute below 2^-14); the products are exact and summed in float32 by the tensor cores. So a
result is about as accurate as a float32 sum of operands with 11-bit mantissas: fine next to
the weights' own quantisation error (Q8_0 ~2^-8, Q4_K ~2^-4). fp16 tops out at 65504: a larger
|x| or |weight| becomes ±inf and its token's outputs inf/NaN, loudly rather than silently
wrong. We accept that, as llama.cpp's fp16 cuBLAS prompt path does: decoded weights are small,
the inputs of the attention/GDN projections and FFN gate/up are RMS-normed, and the FFN down
projection's input silu(gate)·up, the one unnormalised operand, stays far below 65504 in the
models we serve. F32 weights stay on the float32 kernel (gpu.gemm.precision_for).

Bits. One chain of mma steps per output, in increasing k, whatever the tile: an output's bits
depend only on its weight row and x row (the tensor cores compute each element of D from its
row of A, column of B and its C alone), so the rows of an n-row call keep their bits in any
other call, on any of these tiles. They differ from the float32 kernel's bits.

The CUDA simulator runs this kernel too, with a numpy stand-in for the instruction
(gpu.intrinsics.mma_m16n8k16): the tile walk, staging and addressing are the real code.
"""
from __future__ import annotations

from dataclasses import dataclass

from numba import cuda, float32, uint32

from .device import simulated
from .gemm_units import BK, GEMM_STAMP, GemmUnit
from .intrinsics import device_function, mma_m16n8k16, pack_f16x2, store_u32x4
from .matvec import _specialise

STRIDE = 20      # words per shared tile row: 16 fp16 pairs (32 columns) + 4 words of padding
# 16-byte vector stores need 16-byte aligned tiles; the simulator takes no alignment argument
ALIGN = None if simulated() else 16


@dataclass(frozen=True)
class MmaTile:
    """A tensor-core block: WARPS_ROWS × WARPS_TOKENS warps, each MT m16 row blocks × NT n8
    token blocks."""
    warps_rows: int
    warps_tokens: int
    row_blocks: int
    token_blocks: int
    efficiency: float      # relative rate of an SM running this tile (for picking a tile)
    precision = "fp16"     # products of fp16-rounded operands (a class constant, not a field)

    @property
    def threads(self) -> int:
        return 32 * self.warps_rows * self.warps_tokens

    @property
    def block_rows(self) -> int:
        return 16 * self.row_blocks * self.warps_rows

    @property
    def block_tokens(self) -> int:
        return 8 * self.token_blocks * self.warps_tokens

    @property
    def name(self) -> str:
        return f"mma{self.block_rows}x{self.block_tokens}"


# ---------------------------------------------------------------- addressing (tests/gpu/test_mma_layout.py)

@device_function
def lane_offset(lane):
    """Word offset of a lane's first A (or B) register from its 16-row (8-row) block's first
    word, k16 step 0: row g = lane / 4, pair t = lane % 4 (elements 2t, 2t + 1)."""
    return (lane >> uint32(2)) * uint32(STRIDE) + (lane & uint32(3))


@device_function
def a_fragment(tile, at):
    """A registers (row g pairs t, row g+8 pairs t, row g pairs t+4, row g+8 pairs t+4) of a
    16-row block; `at` = the block's first word + lane_offset + 8 · k16 step."""
    return tile[at], tile[at + uint32(8 * STRIDE)], tile[at + uint32(4)], tile[at + uint32(8 * STRIDE + 4)]


@device_function
def b_fragment(tile, at):
    """B registers (token g pairs t, token g pairs t+4) of an 8-token block; `at` as above."""
    return tile[at], tile[at + uint32(4)]


@device_function
def accumulator_position(lane, c):
    """(row, token) of a lane's accumulator c < 4 in its 16 × 8 block."""
    return (lane >> uint32(2)) + uint32(8) * (c >> uint32(1)), uint32(2) * (lane & uint32(3)) + (c & uint32(1))


@device_function
def unit_offset(row, half):
    """First word of the 8 pair words of a weight unit (row, half of the K step)."""
    return row * uint32(STRIDE) + uint32(8) * half


@device_function
def x_pair_slot(idx):
    """(token, pair) of x pair number idx of a K step: pair = idx % 16, and lanes 16-31 of a warp
    take the token 4 after that of lanes 0-15, whose row is 80 words (16 banks) away: the two
    half-warps' staging stores do not collide."""
    rest = idx >> uint32(5)
    token = ((rest >> uint32(2)) << uint32(3)) + (((idx >> uint32(4)) & uint32(1)) << uint32(2)) + (rest & uint32(3))
    return token, idx & uint32(15)


# ---------------------------------------------------------------- the kernel

# Bound per ggml type and tile in each specialised kernel's globals (see gpu.matvec._specialise).
load = store = fetch = stage = multiply = None


def _fetch_template(BM, THREADS, UPT, XPT, N_UNITS):
    def fetch(w, w8, x, raw, xr, tid, row0, tok0, k, n, last_row, last_col, cols):
        """Issue the loads of K step k (this thread's weight units and x pairs) and nothing else.
        Rows, tokens and units past the end load the last one, in bounds: never stored."""
        for p in range(UPT):
            u = min(tid + uint32(p * THREADS), uint32(N_UNITS - 1))
            load(w, w8, min(row0 + u % uint32(BM), last_row), k + uint32(16) * (u // uint32(BM)), cols, raw, p)
        for q in range(XPT):
            token, pair = x_pair_slot(tid + uint32(q * THREADS))
            t = min(tok0 + token, n - uint32(1))
            col = k + uint32(2) * pair
            v0 = x[t, min(col, last_col)]
            v1 = x[t, min(col + uint32(1), last_col)]
            xr[q, 0] = v0 if col <= last_col else float32(0.0)
            xr[q, 1] = v1 if col + uint32(1) <= last_col else float32(0.0)
    return fetch


def _stage_template(BM, THREADS, UPT, XPT, N_UNITS):
    def stage(raw, xr, vals, ws, xs, tid, w_at, x_at, k, cols):
        """Decode the fetched K step k into fp16 pairs: weights into ws[w_at:], x into xs[x_at:]."""
        for p in range(UPT):
            u = tid + uint32(p * THREADS)
            if u < uint32(N_UNITS):
                half = u // uint32(BM)
                store(raw, p, k + uint32(16) * half, cols, vals, uint32(0), uint32(1))
                at = w_at + unit_offset(u % uint32(BM), half)
                store_u32x4(ws, at, pack_f16x2(vals[0], vals[1]), pack_f16x2(vals[2], vals[3]),
                            pack_f16x2(vals[4], vals[5]), pack_f16x2(vals[6], vals[7]))
                store_u32x4(ws, at + uint32(4), pack_f16x2(vals[8], vals[9]), pack_f16x2(vals[10], vals[11]),
                            pack_f16x2(vals[12], vals[13]), pack_f16x2(vals[14], vals[15]))
        for q in range(XPT):
            token, pair = x_pair_slot(tid + uint32(q * THREADS))
            xs[x_at + token * uint32(STRIDE) + pair] = pack_f16x2(xr[q, 0], xr[q, 1])
    return stage


def _multiply_template(MT, NT):
    def multiply(ws, xs, w_at, x_at, bf, acc):
        """acc += the warp's 16·MT weight rows × 8·NT tokens over one K step (two k16 steps);
        w_at, x_at: the warp's first words in the tiles, plus lane_offset."""
        for s in range(2):
            for j in range(NT):
                bf[j, 0], bf[j, 1] = b_fragment(xs, x_at + uint32(8 * STRIDE * j + 8 * s))
            for i in range(MT):
                a0, a1, a2, a3 = a_fragment(ws, w_at + uint32(16 * STRIDE * i + 8 * s))
                for j in range(NT):
                    d0, d1, d2, d3 = mma_m16n8k16(a0, a1, a2, a3, bf[j, 0], bf[j, 1],
                                                  acc[i, j, 0], acc[i, j, 1], acc[i, j, 2], acc[i, j, 3])
                    acc[i, j, 0] = d0
                    acc[i, j, 1] = d1
                    acc[i, j, 2] = d2
                    acc[i, j, 3] = d3
    return multiply


def _kernel_template(WARPS_ROWS, MT, NT, BM, BN, UPT, XPT, RAW, TYPE_ID, STAMP, ALIGN):
    W_BUF = BM * STRIDE              # words of one weight buffer (two buffers: double buffering)
    X_BUF = BN * STRIDE
    WS_WORDS = 2 * W_BUF             # (shapes must be constants, not expressions)
    XS_WORDS = 2 * X_BUF

    def gemm_mma_kernel(w, w8, x, out, rows, cols):
        if TYPE_ID < 0 or STAMP < 0:  # never true: puts both in the cache key (_specialise)
            return
        # Unsigned indices throughout: Numba adds a negative-index fix-up to every signed one.
        ws = cuda.shared.array(WS_WORDS, uint32, alignment=ALIGN)
        xs = cuda.shared.array(XS_WORDS, uint32, alignment=ALIGN)
        acc = cuda.local.array((MT, NT, 4), float32)
        bf = cuda.local.array((NT, 2), uint32)
        raw = cuda.local.array((UPT, RAW), uint32)       # a fetched step's weight words
        xr = cuda.local.array((XPT, 2), float32)         # ... and x values
        vals = cuda.local.array(16, float32)             # one decoded unit

        tid = uint32(cuda.threadIdx.x)
        lane = tid & uint32(31)
        warp = tid >> uint32(5)
        warp_row = (warp % uint32(WARPS_ROWS)) * uint32(16 * MT)
        warp_token = (warp // uint32(WARPS_ROWS)) * uint32(8 * NT)
        row0 = uint32(cuda.blockIdx.x * BM)
        tok0 = uint32(cuda.blockIdx.y * BN)
        n = uint32(x.shape[0])
        last_row = uint32(rows - 1)
        last_col = uint32(cols - 1)
        last_k = last_col & uint32(0xFFFFFFE0)           # first column of the last K step
        w_lane = warp_row * uint32(STRIDE) + lane_offset(lane)
        x_lane = warp_token * uint32(STRIDE) + lane_offset(lane)
        for i in range(MT):
            for j in range(NT):
                for c in range(4):
                    acc[i, j, c] = float32(0.0)

        # Prologue: step 0 decoded into buffer 0, step 1's loads in flight.
        fetch(w, w8, x, raw, xr, tid, row0, tok0, uint32(0), n, last_row, last_col, cols)
        stage(raw, xr, vals, ws, xs, tid, uint32(0), uint32(0), uint32(0), cols)
        fetch(w, w8, x, raw, xr, tid, row0, tok0, min(uint32(BK), last_k), n, last_row, last_col, cols)
        cuda.syncthreads()
        for k0 in range(0, cols, BK):
            k = uint32(k0)
            now = (k >> uint32(5)) & uint32(1)
            ahead = now ^ uint32(1)
            # Step k + 1 into the other buffer (free: everyone passed the barrier after reading
            # it), step k + 2's loads issued, then step k's products. Past the last step the
            # clamped steps repeat it, harmlessly: nothing reads them.
            stage(raw, xr, vals, ws, xs, tid, ahead * uint32(W_BUF), ahead * uint32(X_BUF),
                  min(k + uint32(BK), last_k), cols)
            fetch(w, w8, x, raw, xr, tid, row0, tok0, min(k + uint32(2 * BK), last_k), n, last_row, last_col, cols)
            multiply(ws, xs, now * uint32(W_BUF) + w_lane, now * uint32(X_BUF) + x_lane, bf, acc)
            cuda.syncthreads()

        for i in range(MT):
            for j in range(NT):
                for c in range(4):
                    dr, dt = accumulator_position(lane, uint32(c))
                    r = row0 + warp_row + uint32(16 * i) + dr
                    t = tok0 + warp_token + uint32(8 * j) + dt
                    if r <= last_row and t < n:
                        out[t, r] = acc[i, j, c]
    return gemm_mma_kernel


def build_kernel(unit: GemmUnit, tile: MmaTile):
    """The tensor-core GEMM kernel (Python function) for one type and tile shape."""
    bm, bn, threads = tile.block_rows, tile.block_tokens, tile.threads
    assert (BK // 2 * bn) % threads == 0, "x pairs must split evenly over the threads"
    shape = dict(BM=bm, THREADS=threads, UPT=-(-2 * bm // threads), XPT=BK // 2 * bn // threads, N_UNITS=2 * bm)
    functions = dict(load=unit.load, store=unit.store)
    functions["fetch"] = device_function(_specialise(_fetch_template, shape, functions))
    functions["stage"] = device_function(_specialise(_stage_template, shape, functions))
    functions["multiply"] = device_function(_specialise(
        _multiply_template, dict(MT=tile.row_blocks, NT=tile.token_blocks), functions))
    constants = dict(WARPS_ROWS=tile.warps_rows, MT=tile.row_blocks, NT=tile.token_blocks, BM=bm, BN=bn,
                     UPT=shape["UPT"], XPT=shape["XPT"], RAW=unit.raw_words,
                     TYPE_ID=unit.type.id, STAMP=GEMM_STAMP, ALIGN=ALIGN)
    fn = _specialise(_kernel_template, constants, functions)
    fn.__name__ = fn.__qualname__ = f"gemm_{unit.type.name}_{tile.name}"
    return fn
