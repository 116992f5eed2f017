"""gpu.gemm against gguf's dequantiser + a float64 matmul, per type; the per-row bit identity the
GEMM promises (any n, any tile); the matvec's routing of large calls; SwiGLU of a prompt chunk.

Tiles never divide the shapes: the last row tile and token tile are partial, and the dense
types' last K step is too (their column count is no multiple of 32). On the CUDA simulator
the shapes are tiny and so are the tiles (gpu.gemm.TILES); two more small tiles there take the
kernel's other paths (threads left without a weight unit, several units per thread).
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from numba import cuda

import gpu.ffn
from gpu.device import available, simulated
from gpu.gemm import GEMM_MIN_ROWS, TILES, Tile, choose_tile, gemm
from gpu.matvec import matvec
from hybrid import ggml_types as gt
from hybrid.errors import HybridError
from tests.gpu.test_matvec import TYPES, assert_close, random_weights, reference
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

REAL_GPU = available() and not simulated()
ROWS = 389 if REAL_GPU else 13
N = 300 if REAL_GPU else 11
# (4, 4, 1, 2): 16 threads for 8 weight units; (2, 2, 4, 2): 4 threads for 16 units
EXTRA_TILES = () if REAL_GPU else (Tile(4, 4, 1, 2, 1.0), Tile(2, 2, 4, 2, 1.0))


def n_cols(t: gt.GGMLType) -> int:
    """Several K steps of 32; a partial last step for the dense types."""
    if REAL_GPU:
        return 4096 + (256 if t.block_elems == 256 else 40 if t.block_elems == 1 else 96)
    return {256: 512, 32: 96, 1: 72}[t.block_elems]


def run(t: gt.GGMLType, w_dev, x: np.ndarray, rows: int, **kw) -> np.ndarray:
    out = cuda.to_device(np.full((x.shape[0], rows), np.nan, np.float32))   # poisoned
    gemm(t.id, w_dev, cuda.to_device(np.ascontiguousarray(x)), out, **kw)
    return out.copy_to_host()


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


@pytest.mark.parametrize("name", TYPES)
def test_matches_reference_and_rows_keep_their_bits(name):
    t = gt.by_name(name)
    rng = np.random.default_rng(100 + sum(map(ord, name)))
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((N, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    got = run(t, w_dev, x, ROWS)
    assert_close(got, want, magnitude)
    # a row's bits do not depend on the call's other rows or on its place in a token tile
    part = run(t, w_dev, x[3:8], ROWS)
    assert np.array_equal(bits(part), bits(got[3:8]))


def test_every_tile_gives_the_same_bits():
    t = gt.Q8_0
    rng = np.random.default_rng(5)
    rows, n, cols = (ROWS, N, n_cols(t)) if REAL_GPU else (11, 13, 64)
    w_bytes = random_weights(t, rows, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    results = {tile: run(t, w_dev, x, rows, tile=tile) for tile in TILES + EXTRA_TILES}
    want, magnitude = reference(t, w_bytes, x)
    first = next(iter(results.values()))
    assert_close(first, want, magnitude)
    for tile, got in results.items():
        assert np.array_equal(bits(got), bits(first)), f"tile {tile}"


def test_matvec_sends_large_calls_to_the_gemm():
    t = gt.Q4_0
    rng = np.random.default_rng(9)
    rows, cols = 9, 64
    w_dev = cuda.to_device(random_weights(t, rows, cols, rng))
    x = rng.standard_normal((GEMM_MIN_ROWS, cols)).astype(np.float32)
    out = cuda.to_device(np.zeros((GEMM_MIN_ROWS, rows), np.float32))
    matvec(t.id, w_dev, cuda.to_device(x), out)
    assert np.array_equal(bits(out.copy_to_host()), bits(run(t, w_dev, x, rows)))
    # one row fewer stays on the matvec: every row has the bits of a one-slot call
    small = cuda.to_device(np.zeros((GEMM_MIN_ROWS - 1, rows), np.float32))
    matvec(t.id, w_dev, cuda.to_device(x[:-1]), small)
    alone = cuda.to_device(np.zeros((1, rows), np.float32))
    matvec(t.id, w_dev, cuda.to_device(x[5:6]), alone)
    assert np.array_equal(bits(small.copy_to_host()[5:6]), bits(alone.copy_to_host()))


def test_swiglu_of_a_prompt_chunk_matches_float64():
    t = gt.Q8_0
    rng = np.random.default_rng(11)
    F, D, n = 24, 64, GEMM_MIN_ROWS + 3
    gate, up = random_weights(t, F, D, rng), random_weights(t, F, D, rng)
    x = rng.standard_normal((n, D)).astype(np.float32)
    h = cuda.to_device(np.full((n, F), np.nan, np.float32))
    gpu.ffn.swiglu(t.id, cuda.to_device(gate), t.id, cuda.to_device(up), cuda.to_device(x), h)
    g, g_mag = reference(t, gate, x)
    u, u_mag = reference(t, up, x)
    want = g / (1 + np.exp(-g)) * u
    # |d(silu(g)·u)| ≤ 1.1·|u|·|dg| + |silu(g)|·|du| for float32 errors dg, du of each product
    bound = 1e-4 * (1.1 * np.abs(u) * g_mag + np.abs(g) * u_mag) + 1e-5
    got = h.copy_to_host()
    assert np.all(np.abs(got - want) <= bound)


def test_tile_choice_takes_big_tiles_for_big_calls_and_small_ones_to_fill_the_sms(monkeypatch):
    import gpu.gemm
    big, medium, small = Tile(16, 16, 8, 8, 1.0), Tile(16, 16, 8, 4, 0.85), Tile(16, 16, 4, 4, 0.7)
    monkeypatch.setattr(gpu.gemm, "TILES", (big, medium, small))
    monkeypatch.setattr(gpu.gemm, "_sm_count", lambda: 132)
    assert choose_tile(17408, 2048) == big          # thousands of blocks either way: least work per FMA
    assert choose_tile(5120, 64) == small           # 40 big blocks would leave 92 SMs idle


def test_rejects_bad_input_with_a_clear_error():
    t = gt.Q8_0
    w_dev = cuda.to_device(np.zeros((4, t.row_bytes(64)), np.uint8))
    x_dev = cuda.to_device(np.zeros((40, 64), np.float32))
    with pytest.raises(HybridError, match="unsupported tensor type"):
        gemm(int(GGMLQuantizationType.Q5_0), w_dev, x_dev, cuda.to_device(np.zeros((40, 4), np.float32)))
    with pytest.raises(HybridError, match="do not hold"):
        gemm(t.id, w_dev, cuda.to_device(np.zeros((40, 96), np.float32)),
             cuda.to_device(np.zeros((40, 4), np.float32)))
    with pytest.raises(HybridError, match="out has shape"):
        gemm(t.id, w_dev, x_dev, cuda.to_device(np.zeros((40, 5), np.float32)))
