"""The tensor-core GEMM's fragment bookkeeping, in numpy, no GPU needed.

gpu/mma_layout.py transcribes the PTX ISA's fragment layout of mma.m16n8k16 (which lane holds
which element of A, B, C/D); gpu/matmul/gemm_mma.py's addressing functions say in which order x is
converted (`fragment_source`), where each lane's A registers sit in shared memory
(`fragment_slot`), which weights a lane decodes as its B registers (`unit_row`,
`unit_column`) and where its accumulators go (`accumulator_position`). Here:

* the transcription is a layout at all: every element held by exactly one (lane, slot), and
  one modelled instruction computes A·B + C;
* the kernel's A registers (x) and B registers (weights) of every k16 step hold the same
  physical column for each k, and the four steps of a K step cover its 64 columns once: the
  permuted k order is still x · Wᵀ;
* a numpy model of a whole block (the kernel's copies, walk over warps, blocks and steps, its
  output placement) reproduces a plain matmul for every tile shape: a layout mistake in the
  kernel fails here, on any machine;
* the swizzled shared layout keeps the 16-byte fragment loads free of bank conflicts.
"""
import numpy as np
import pytest

from gpu.matmul import gemm_mma
from gpu import mma_layout as L
from gpu.matmul.gemm_mma import BK, BLOCK_WORDS, CHUNKS, MmaTile

BANKS = 32
TILES = [MmaTile(8, 2, 8, 1, 1.0), MmaTile(4, 2, 8, 3, 1.0), MmaTile(8, 1, 8, 2, 1.0), MmaTile(4, 2, 4, 3, 1.0),
         MmaTile(1, 1, 1, 1, 1.0), MmaTile(2, 1, 1, 1, 1.0), MmaTile(1, 2, 2, 1, 1.0)]


def py(device_function):
    """The plain-Python body of a device function (on the simulator it already is one)."""
    return getattr(device_function, "py_func", device_function)


fragment_source, fragment_slot = py(gemm_mma.fragment_source), py(gemm_mma.fragment_slot)
unit_row, unit_column, accumulator_position = py(gemm_mma.unit_row), py(gemm_mma.unit_column), \
    py(gemm_mma.accumulator_position)
u32 = np.uint32


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


def test_fragment_order_holds_every_x_word_once():
    held = np.zeros((16, BK // 2), int)
    for e in range(BLOCK_WORDS):
        token, word = (int(v) for v in fragment_source(u32(e)))
        held[token, word] += 1
    assert np.all(held == 1)


def fragment_row(x: np.ndarray) -> np.ndarray:
    """One x16 row (16 tokens × one K step) as gpu.matmul.gemm_mma.to_fp16_fragments writes it."""
    row = np.zeros(BLOCK_WORDS, np.uint32)
    for e in range(BLOCK_WORDS):
        token, word = (int(v) for v in fragment_source(u32(e)))
        row[e] = L.pack_halves(x[token, 2 * word], x[token, 2 * word + 1])
    return row


def stage(row: np.ndarray) -> np.ndarray:
    """The shared tile of one 16-token block after the kernel's copies: copy number c (chunk c
    of the block) goes from word 4c to `fragment_slot` of lane c / 4, step c % 4."""
    tile = np.full(BLOCK_WORDS, 0xFFFFFFFF, np.uint32)      # unwritten words: NaN pairs
    for c in range(CHUNKS):
        at = int(fragment_slot(u32(c >> 2), u32(c & 3)))
        assert np.all(tile[at:at + 4] == 0xFFFFFFFF), "a shared slot written twice"
        tile[at:at + 4] = row[4 * c:4 * c + 4]
    return tile


def a_registers(tile: np.ndarray, s: int) -> np.ndarray:
    """(32, 4) A registers of k16 step s, loaded as the kernel's multiply does."""
    return np.array([tile[int(fragment_slot(u32(lane), u32(s))):][:4] for lane in range(32)], np.uint32)


def unit_words(w: np.ndarray, lane: int) -> np.ndarray:
    """The eight B words a lane decodes from the weights w (8 rows × 64 columns of a K step)."""
    r, c = int(unit_row(u32(lane))), int(unit_column(u32(lane)))
    vals = w[r, c:c + 16]
    return L.pack_halves(vals[0::2], vals[1::2])


def b_registers(w: np.ndarray, s: int) -> np.ndarray:
    """(32, 2) B registers of k16 step s: pair slots q of the lane's words 2s + q."""
    return np.array([unit_words(w, lane)[2 * s:2 * s + 2] for lane in range(32)], np.uint32)


def test_a_and_b_registers_hold_the_same_column_for_every_k():
    # Tag every column: x[token, col] = col, w[row, col] = col (exact in fp16). In each k16
    # step, A's column k and B's row k must then name the same column, and the 4 steps × 16 k
    # must name each of the K step's 64 columns once.
    x = np.tile(np.arange(BK, dtype=np.float32), (16, 1))
    w = np.tile(np.arange(BK, dtype=np.float32), (8, 1))
    tile = stage(fragment_row(x))
    seen = []
    for s in range(4):
        a = L.gather_a(a_registers(tile, s))            # 16 tokens × 16 k
        b = L.gather_b(b_registers(w, s))               # 16 k × 8 rows
        assert np.all(a == a[:1]) and np.all(b == b[:, :1]), "a k mixes columns across tokens or rows"
        assert np.array_equal(a[0], b[:, 0])
        seen += list(a[0])
    assert sorted(seen) == list(range(BK))


def block_model(tile: MmaTile, w: np.ndarray, x: np.ndarray) -> np.ndarray:
    """The kernel's walk for one block over w (BM × K) and x (BN × K), modelled instruction by
    instruction: x converted and copied per K step, each warp's units as B registers, the
    fragments, the mma chain and the output placement. Returns out (BN × BM)."""
    bm, bn, mt, nb = tile.block_rows, tile.block_tokens, tile.token_blocks, tile.row_blocks
    acc = np.zeros((tile.warps, mt, nb, 32, 4), np.float32)
    for k in range(0, w.shape[1], BK):
        tiles = [stage(fragment_row(x[16 * i:16 * i + 16, k:k + BK])) for i in range(mt)]
        for warp in range(tile.warps):
            for s in range(4):
                for i in range(mt):
                    a = a_registers(tiles[i], s)
                    for j in range(nb):
                        r0 = warp * 8 * nb + 8 * j
                        b = b_registers(w[r0:r0 + 8, k:k + BK], s)
                        acc[warp, i, j] = L.warp_mma(a, b, acc[warp, i, j])
    out = np.full((bn, bm), np.nan, np.float32)
    for warp in range(tile.warps):
        for i in range(mt):
            for j in range(nb):
                for lane in range(32):
                    for c in range(4):
                        dt, dr = (int(v) for v in accumulator_position(u32(lane), u32(c)))
                        t, r = 16 * i + dt, warp * 8 * nb + 8 * j + dr
                        assert np.isnan(out[t, r]), "an output written twice"
                        out[t, r] = acc[warp, i, j, lane, c]
    return out


@pytest.mark.parametrize("tile", TILES[4:] + TILES[:1], ids=lambda t: t.name)
def test_block_model_reproduces_a_matmul(tile):
    rng = np.random.default_rng(2)
    w, x = fp16_values(rng, (tile.block_rows, 2 * BK)), fp16_values(rng, (tile.block_tokens, 2 * BK))
    out = block_model(tile, w, x)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", TILES, ids=lambda t: t.name)
def test_tile_shapes_split_the_copies_evenly(tile):
    assert (CHUNKS * tile.token_blocks) % tile.threads == 0
    assert tile.threads % 32 == 0 and tile.launch_bounds == (tile.threads, tile.blocks_per_sm)


def banks(words) -> np.ndarray:
    return np.asarray(words, np.int64) % BANKS


def test_fragment_loads_do_not_conflict():
    # 16-byte loads are served a quarter warp (8 lanes) at a time: its lanes must touch 8
    # different 4-bank groups, in every step
    for s in range(4):
        for quarter in range(4):
            groups = {int(fragment_slot(u32(lane), u32(s))) // 4 % 8 for lane in range(8 * quarter, 8 * quarter + 8)}
            assert len(groups) == 8, (s, quarter)


def test_copy_offsets_are_linear_in_the_copy_number():
    # gpu.matmul.gemm_mma.copy_x adds 4·p·THREADS to both offsets of a thread's first copy: true when
    # the swizzle only depends on bits of c that a multiple of 32 leaves alone
    for threads in (32, 64, 128, 256):
        for tid in range(threads):
            first = int(fragment_slot(u32((tid % CHUNKS) >> 2), u32(tid & 3))) + BLOCK_WORDS * (tid // CHUNKS)
            for p in range(1, 4):
                c = tid + p * threads
                want = int(fragment_slot(u32((c % CHUNKS) >> 2), u32(c & 3))) + BLOCK_WORDS * (c // CHUNKS)
                assert want == first + 4 * p * threads
