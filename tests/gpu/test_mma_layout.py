"""The tensor-core GEMM's fragment bookkeeping, in numpy, no GPU needed.

gpu/mma_layout.py transcribes the PTX ISA's fragment layout of mma.m16n8k16 (which lane holds
which element of A, B, C/D); gpu/gemm_mma.py's addressing functions say where the kernel stores
weights and x in shared memory and which words a lane loads as its registers. Here:

* the transcription is a layout at all: every element held by exactly one (lane, slot), and
  one modelled instruction computes A·B + C;
* the kernel's addresses give each lane exactly the registers the ISA layout asks for, for
  every warp, row block, token block and k16 step of a real 128 × 128 tile, and a numpy model of
  a whole block (the kernel's walk over warps, blocks and steps, its output placement)
  reproduces a plain matmul: a layout mistake in the kernel fails here, on any machine;
* the padding and slot mappings keep shared-memory accesses free of bank conflicts.
"""
import numpy as np
import pytest

from gpu import gemm_mma
from gpu import mma_layout as L
from gpu.gemm_mma import STRIDE, MmaTile

BANKS = 32
REAL_TILE = MmaTile(2, 4, 4, 4, 1.0)      # the 128 × 128 tile gpu.gemm runs on the GPU
TILES = [REAL_TILE, MmaTile(2, 2, 4, 4, 1.0), MmaTile(1, 1, 1, 2, 1.0), MmaTile(2, 1, 1, 1, 1.0)]


def py(device_function):
    """The plain-Python body of a device function (on the simulator it already is one)."""
    return getattr(device_function, "py_func", device_function)


lane_offset, a_fragment, b_fragment = py(gemm_mma.lane_offset), py(gemm_mma.a_fragment), py(gemm_mma.b_fragment)
accumulator_position, unit_offset = py(gemm_mma.accumulator_position), py(gemm_mma.unit_offset)
x_pair_slot = py(gemm_mma.x_pair_slot)


def fp16_values(rng, shape) -> np.ndarray:
    """Random values exactly representable in fp16 (so packing loses nothing)."""
    return rng.standard_normal(shape).astype(np.float16).astype(np.float32)


@pytest.mark.parametrize("table, shape", [(L.A_AT, (16, 16)), (L.B_AT, (16, 8)), (L.C_AT, (16, 8))],
                         ids=["A", "B", "C"])
def test_isa_layout_holds_every_element_exactly_once(table, shape):
    held = np.zeros(shape, int)
    np.add.at(held, table, 1)
    assert np.all(held == 1)


def test_isa_layout_spot_checks_from_the_ptx_figures():
    # lane 5: groupID 1, threadID_in_group 1
    assert [L.a_position(5, i) for i in range(8)] == [(1, 2), (1, 3), (9, 2), (9, 3), (1, 10), (1, 11), (9, 10), (9, 11)]
    assert [L.b_position(5, i) for i in range(4)] == [(2, 1), (3, 1), (10, 1), (11, 1)]
    assert [L.c_position(5, i) for i in range(4)] == [(1, 2), (1, 3), (9, 2), (9, 3)]


def test_modelled_instruction_is_a_matmul():
    rng = np.random.default_rng(0)
    a, b, c = fp16_values(rng, (16, 16)), fp16_values(rng, (16, 8)), rng.standard_normal((16, 8)).astype(np.float32)
    assert np.array_equal(L.gather_a(L.scatter_a(a)), a) and np.array_equal(L.gather_b(L.scatter_b(b)), b)
    d = L.gather_c(L.warp_mma(L.scatter_a(a), L.scatter_b(b), L.scatter_c(c)))
    want = a.astype(np.float64) @ b.astype(np.float64) + c
    assert np.allclose(d, want, rtol=1e-6, atol=1e-6)


def test_pair_packing_puts_the_lower_k_in_the_low_half():
    word = L.pack_halves(np.float32(1.0), np.float32(-2.0))
    assert word == 0xC0003C00          # fp16 bits: 1.0 = 0x3C00, -2.0 = 0xC000


def stage_tiles(tile: MmaTile, w: np.ndarray, x: np.ndarray):
    """Flat uint32 shared tiles as the kernel's `stage` writes them (one buffer each)."""
    bm, bn = tile.block_rows, tile.block_tokens
    ws = np.full(bm * STRIDE, 0xFFFFFFFF, np.uint32)      # padding and unwritten words: NaN pairs
    xs = np.full(bn * STRIDE, 0xFFFFFFFF, np.uint32)
    for u in range(2 * bm):                                # weight unit u: row u % BM, half u // BM
        row, half = u % bm, u // bm
        at = int(unit_offset(np.uint32(row), np.uint32(half)))
        vals = w[row, 16 * half:16 * half + 16]
        ws[at:at + 8] = L.pack_halves(vals[0::2], vals[1::2])
    slots = set()
    for idx in range(16 * bn):
        token, pair = (int(v) for v in x_pair_slot(np.uint32(idx)))
        slots.add((token, pair))
        xs[token * STRIDE + pair] = L.pack_halves(x[token, 2 * pair], x[token, 2 * pair + 1])
    assert slots == {(t, p) for t in range(bn) for p in range(16)}, "x pairs: each staged exactly once"
    return ws, xs


def warp_origins(tile: MmaTile, warp: int) -> tuple[int, int]:
    """(first weight row, first token) of a warp's sub-tile, as the kernel computes them."""
    return (warp % tile.warps_rows) * 16 * tile.row_blocks, (warp // tile.warps_rows) * 8 * tile.token_blocks


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.name)
def test_kernel_fragments_are_the_isa_registers(tile):
    rng = np.random.default_rng(1)
    w, x = fp16_values(rng, (tile.block_rows, 32)), fp16_values(rng, (tile.block_tokens, 32))
    ws, xs = stage_tiles(tile, w, x)
    for warp in range(tile.threads // 32):
        m0, n0 = warp_origins(tile, warp)
        for s in range(2):
            for i in range(tile.row_blocks):
                want = L.scatter_a(w[m0 + 16 * i:m0 + 16 * i + 16, 16 * s:16 * s + 16])
                got = [a_fragment(ws, np.uint32(m0 * STRIDE + lane_offset(np.uint32(lane)) + 16 * STRIDE * i + 8 * s))
                       for lane in range(32)]
                assert np.array_equal(np.array(got, np.uint32), want), (warp, s, i)
            for j in range(tile.token_blocks):
                want = L.scatter_b(x[n0 + 8 * j:n0 + 8 * j + 8, 16 * s:16 * s + 16].T)
                got = [b_fragment(xs, np.uint32(n0 * STRIDE + lane_offset(np.uint32(lane)) + 8 * STRIDE * j + 8 * s))
                       for lane in range(32)]
                assert np.array_equal(np.array(got, np.uint32), want), (warp, s, j)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.name)
def test_block_model_reproduces_a_matmul(tile):
    """The kernel's walk for two K steps: staging, fragments, modelled mma, output placement."""
    rng = np.random.default_rng(2)
    bm, bn = tile.block_rows, tile.block_tokens
    w, x = fp16_values(rng, (bm, 64)), fp16_values(rng, (bn, 64))
    acc = np.zeros((tile.threads // 32, tile.row_blocks, tile.token_blocks, 32, 4), np.float32)
    for k in (0, 32):
        ws, xs = stage_tiles(tile, w[:, k:k + 32], x[:, k:k + 32])
        for warp in range(tile.threads // 32):
            m0, n0 = warp_origins(tile, warp)
            lanes = [lane_offset(np.uint32(lane)) for lane in range(32)]
            for s in range(2):
                for i in range(tile.row_blocks):
                    a = np.array([a_fragment(ws, np.uint32(m0 * STRIDE + o + 16 * STRIDE * i + 8 * s)) for o in lanes])
                    for j in range(tile.token_blocks):
                        b = np.array([b_fragment(xs, np.uint32(n0 * STRIDE + o + 8 * STRIDE * j + 8 * s)) for o in lanes])
                        acc[warp, i, j] = L.warp_mma(a.astype(np.uint32), b.astype(np.uint32), acc[warp, i, j])
    out = np.full((bn, bm), np.nan, np.float32)            # (tokens, rows), like the kernel's `out`
    for warp in range(tile.threads // 32):
        m0, n0 = warp_origins(tile, warp)
        for i in range(tile.row_blocks):
            for j in range(tile.token_blocks):
                for lane in range(32):
                    for c in range(4):
                        dr, dt = (int(v) for v in accumulator_position(np.uint32(lane), np.uint32(c)))
                        assert np.isnan(out[n0 + 8 * j + dt, m0 + 16 * i + dr]), "an output written twice"
                        out[n0 + 8 * j + dt, m0 + 16 * i + dr] = acc[warp, i, j, lane, c]
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5)


def banks(words) -> np.ndarray:
    return np.asarray(words, np.int64) % BANKS


def test_fragment_loads_hit_32_different_banks():
    offsets = [int(lane_offset(np.uint32(lane))) for lane in range(32)]
    for extra in (0, 4, 8 * STRIDE, 8 * STRIDE + 4):          # the four A registers (B: the first two)
        assert len(set(banks(np.add(offsets, extra)))) == 32


def test_staging_stores_do_not_conflict():
    # x: one 32-bit store per lane, a warp's 32 consecutive pair numbers
    for first in range(0, 16 * 128, 32):
        words = []
        for lane in range(32):
            token, pair = (int(v) for v in x_pair_slot(np.uint32(first + lane)))
            words.append(token * STRIDE + pair)
        assert len(set(banks(words))) == 32
    # weights: 16-byte stores, served a quarter-warp (8 lanes, consecutive rows) at a time; the 8
    # lanes must touch 8 different 4-bank groups
    for half in (0, 1):
        for first_row in range(0, 128, 8):
            groups = {int(unit_offset(np.uint32(r), np.uint32(half))) // 4 % 8 for r in range(first_row, first_row + 8)}
            assert len(groups) == 8
