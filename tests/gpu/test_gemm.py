"""gpu.matmul.gemm against gguf's dequantiser + a float64 matmul, per type and per precision (the float32
FMA kernel and the fp16 tensor-core kernel); the per-row bit identity the GEMM promises (any n,
any tile of one precision); which precision a type gets; the matvec's routing of large calls;
SwiGLU of a prompt chunk; the fp16 range caveat.

Tiles never divide the shapes: the last row tile and token tile are partial, and the dense
types' last K step is too (their column count is no multiple of 32). On the CUDA simulator
the shapes are tiny and so are the tiles (gpu.matmul.gemm.TILES); more small tiles there take the
kernels' other paths (threads left without a weight unit, several units per thread, several
warps). The simulator runs the tensor-core kernel with a numpy model of the mma instruction
(gpu/mma_layout.py): its staging and addressing are checked there too, the instruction's own
rounding only on a real GPU.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numba import cuda

import gpu.ffn
from gpu import available, simulated
from gpu.matmul.gemm import GEMM_MIN_ROWS, TILES, MmaTile, Tile, choose_tile, gemm, precision_for
from gpu.matmul.matvec import matvec
from cpu import ggml_types as gt
from hybrid.errors import HybridError
from tests.gpu.test_matvec import TYPES, assert_close, random_weights, reference
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

REAL_GPU = available() and not simulated()
ROWS = 389 if REAL_GPU else 13
N = 300 if REAL_GPU else 11
# fp32 (4, 4, 1, 2): 16 threads for 8 weight units; (2, 2, 4, 2): 4 threads for 16 units.
# fp16 (2, 1, 1): two warps along the rows, each copying half a block of x; (1, 2, 2): two row
# blocks and two token blocks per warp, two x copies per thread.
EXTRA_TILES = () if REAL_GPU else (Tile(4, 4, 1, 2, 1.0), Tile(2, 2, 4, 2, 1.0),
                                   MmaTile(2, 1, 1, 1, 1.0), MmaTile(1, 2, 2, 1, 1.0))
PRECISIONS = ("fp32", "fp16")
# Under the simulator these types run in one precision each: both kernels call the same unit
# decoder (gpu/matmul/gemm_units.py), and test_backend_ops' n = 32 GPU rows run the fp16 one on
# every type against the reference.
ONE_PRECISION = {"IQ2_XS": "fp32", "IQ2_S": "fp16", "IQ1_S": "fp32", "IQ1_M": "fp16", "MXFP4": "fp32",
                 "IQ3_XXS": "fp32", "IQ3_S": "fp32", "IQ2_XXS": "fp32"}
CASES = [(name, p) for name in TYPES for p in PRECISIONS if REAL_GPU or ONE_PRECISION.get(name, p) == p]

FP16_UNIT = 2.0 ** -11        # relative rounding error of fp16 (11 significant bits)
FP16_TINY = 2.0 ** -25        # absolute rounding error below fp16's normal range (2^-14)
FP32_STEP = 2.0 ** -23        # one float32 addition, truncating (tensor cores round toward zero)


def n_cols(t: gt.GGMLType, precision: str = "fp32") -> int:
    """Several K steps of 32; a partial last step for the dense types. On the simulator the
    tensor-core runs take one K-quant block: the per-type loads they share with the float32
    kernel get their two-block case there."""
    if REAL_GPU:
        return 4096 + (256 if t.block_elems == 256 else 40 if t.block_elems == 1 else 96)
    return {256: 512 if precision == "fp32" else 256, 32: 96, 1: 72}[t.block_elems]


def tile_of(precision: str, rows: int, n: int):
    return choose_tile(rows, n, precision)


def run(t: gt.GGMLType, w_dev, x: np.ndarray, rows: int, **kw) -> np.ndarray:
    out = cuda.to_device(np.full((x.shape[0], rows), np.nan, np.float32))   # poisoned
    gemm(t.id, w_dev, cuda.to_device(np.ascontiguousarray(x)), out, **kw)
    return out.copy_to_host()


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


def fp16_bound(t: gt.GGMLType, w_bytes: np.ndarray, x: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """How far the tensor-core GEMM may be from the float64 product, per output.

    Each term w·x is computed as fp16(w)·fp16(x): fp16(v) = v(1 + d) + e with |d| <= 2^-11 and
    |e| <= 2^-25 (below 2^-14 only), so |fp16(w)fp16(x) - wx| <= (2u + u²)|w||x| + 2e'(|w| + |x|)
    with e' = e(1 + u) < 2e, plus e². The product itself is exact (11 × 11 bits fit float32).
    The K terms are then summed in float32, truncating: at most K additions of at most 2^-23
    of the running sum, itself <= the sum of |terms| <= (1 + u)²·sum|w||x| + the e part. And the
    kernel's float32 decode of a weight may differ from gguf's by an ulp or two (2^-22).
    """
    u, e, k = FP16_UNIT, FP16_TINY, x.shape[1]
    w = np.abs(dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64))
    tiny = 2 * e * (w.sum(axis=1)[None, :] + np.abs(x.astype(np.float64)).sum(axis=1)[:, None]) + k * e * e
    products = (2 * u + u * u + 2.0 ** -22) * magnitude + tiny
    sums = k * FP32_STEP * ((1 + u) ** 2 * magnitude + tiny)
    return products + sums


def assert_within(got, want, bound):
    assert np.all(np.isfinite(got)), "output has NaN/inf (unwritten rows?)"
    err = np.abs(got.astype(np.float64) - want)
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"


def check(t, precision, got, want, magnitude, w_bytes, x):
    if precision == "fp32":
        assert_close(got, want, magnitude)
    else:
        assert_within(got, want, fp16_bound(t, w_bytes, x, magnitude))


@pytest.mark.parametrize("name, precision", CASES)
def test_matches_reference_and_rows_keep_their_bits(name, precision):
    t = gt.by_name(name)
    rng = np.random.default_rng(100 + sum(map(ord, name)))
    cols = n_cols(t, precision)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((N, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    got = run(t, w_dev, x, ROWS, tile=tile_of(precision, ROWS, N))
    check(t, precision, got, want, magnitude, w_bytes, x)
    # a row's bits do not depend on the call's other rows or on its place in a token tile
    part = run(t, w_dev, x[3:8], ROWS, tile=tile_of(precision, ROWS, 5))
    assert np.array_equal(bits(part), bits(got[3:8]))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_half_types_with_an_odd_column_count(name):
    """F16 / BF16 units load weight pairs as aligned words when the rows hold an even number of
    columns; an odd count (rows alternately 2 bytes off) takes the 2-byte loads instead."""
    t = gt.by_name(name)
    rng = np.random.default_rng(19)
    rows, n, cols = 11, GEMM_MIN_ROWS, 37
    w_bytes = random_weights(t, rows, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    for precision in PRECISIONS:
        check(t, precision, run(t, w_dev, x, rows, tile=tile_of(precision, rows, n)), want, magnitude, w_bytes, x)


def test_each_type_gets_its_precision_by_default():
    assert precision_for(gt.F32.id) == "fp32"
    assert {precision_for(gt.by_name(name).id) for name in TYPES if name != "F32"} == {"fp16"}
    rng = np.random.default_rng(3)
    for t in (gt.F32, gt.Q4_0):
        w_dev = cuda.to_device(random_weights(t, 9, 32, rng))
        x = rng.standard_normal((GEMM_MIN_ROWS, 32)).astype(np.float32)
        default = run(t, w_dev, x, 9)
        chosen = run(t, w_dev, x, 9, tile=tile_of(precision_for(t.id), 9, GEMM_MIN_ROWS))
        other = run(t, w_dev, x, 9, tile=tile_of("fp16" if precision_for(t.id) == "fp32" else "fp32", 9,
                                                 GEMM_MIN_ROWS))
        assert np.array_equal(bits(default), bits(chosen))
        assert not np.array_equal(bits(default), bits(other)), "fp16 and fp32 sums should differ somewhere"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_tile_of_a_precision_gives_the_same_bits(precision):
    t = gt.Q8_0
    rng = np.random.default_rng(5)
    rows, n, cols = (ROWS, N, n_cols(t)) if REAL_GPU else (11, 13, 64)
    w_bytes = random_weights(t, rows, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    tiles = [tile for tile in TILES + EXTRA_TILES if tile.precision == precision]
    assert len(tiles) >= 2
    results = {tile: run(t, w_dev, x, rows, tile=tile) for tile in tiles}
    want, magnitude = reference(t, w_bytes, x)
    first = next(iter(results.values()))
    check(t, precision, first, want, magnitude, w_bytes, x)
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
    # |d(silu(g)·u)| <= 1.1·|u|·|dg| + |silu(g)|·|du| for errors dg, du of each product; Q8_0
    # takes the fp16 tensor-core GEMM: dg <= fp16_bound (~1.1e-3·magnitude at D = 64, plus tiny)
    assert precision_for(t.id) == "fp16"
    dg, du = fp16_bound(t, gate, x, g_mag), fp16_bound(t, up, x, u_mag)
    bound = 1.1 * np.abs(u) * dg + np.abs(g) * du + 1e-5
    got = h.copy_to_host()
    assert np.all(np.abs(got - want) <= bound)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_fp16_range_caveat_overflow_is_not_hidden():
    """|x| > 65504 overflows fp16: the tensor-core GEMM gives that row non-finite outputs (as
    llama.cpp's fp16 cuBLAS path does) instead of a silently wrong finite value; the float32
    kernel takes it."""
    t = gt.Q8_0
    rng = np.random.default_rng(13)
    rows, cols = 9, 64
    w_bytes = random_weights(t, rows, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((GEMM_MIN_ROWS, cols)).astype(np.float32)
    x[2, 7] = 1e5
    fp16 = run(t, w_dev, x, rows, tile=tile_of("fp16", rows, GEMM_MIN_ROWS))   # (the simulator's numpy warns)
    fp32 = run(t, w_dev, x, rows, tile=tile_of("fp32", rows, GEMM_MIN_ROWS))
    assert not np.any(np.isfinite(fp16[2])) and np.all(np.isfinite(np.delete(fp16, 2, axis=0)))
    assert np.all(np.isfinite(fp32))


def test_tile_choice_takes_big_tiles_for_big_calls_and_small_ones_to_fill_the_sms(monkeypatch):
    import gpu.matmul.gemm
    big, medium, small = Tile(16, 16, 8, 8, 1.0, 1), Tile(16, 16, 8, 4, 0.85, 2), Tile(16, 16, 4, 4, 0.7, 2)
    mma_big, mma_quarter = MmaTile(8, 2, 8, 1, 1.0), MmaTile(4, 2, 4, 3, 0.6)
    mma_half = MmaTile(4, 2, 8, 3, 1.0)          # the big tile's warps, 4 to a block, 3 blocks per SM
    monkeypatch.setattr(gpu.matmul.gemm, "TILES", (big, medium, small, mma_big, mma_half, mma_quarter))
    monkeypatch.setattr(gpu.matmul.gemm, "_sm_count", lambda: 132)
    assert choose_tile(17408, 2048, "fp32") == big     # thousands of blocks either way: least work per FMA
    assert choose_tile(5120, 64, "fp32") == small      # 40 big blocks would leave 92 SMs idle
    # fp16 by default. 272 blocks of 128 x 128 at one per SM: 3 rounds for 2.06 SMs' worth; 544
    # half blocks at 3 per SM: 5 blocks' time for 4.12
    assert choose_tile(17408, 256) == mma_half
    # 40 blocks of 128 x 128 leave 92 SMs idle; 320 quarter tiles fill them at 1.7x the work each
    assert choose_tile(5120, 64) == mma_quarter
    # A split K doubles the blocks: for the long rows of a down projection the half tiles fill
    # all SMs three deep where one split leaves them at two or fewer
    assert gpu.matmul.gemm.estimated_time(mma_half, 5120, 256, splits=2) < gpu.matmul.gemm.estimated_time(mma_half, 5120, 256)
    assert choose_tile(5120, 256, cols=17408) == mma_half
    with pytest.raises(HybridError, match="no 'bf16' tiles"):
        choose_tile(64, 64, "bf16")


def test_split_k_rows_keep_their_bits_and_match_the_reference(monkeypatch):
    """K split in parts whose partial sums add in split order (gpu.matmul.gemm_mma.k_splits, forced
    here for short rows; three uneven parts of a Q4_K row's 4 K steps on the simulator): the
    tensor-core GEMM's result is still within its bound, and a row's bits still do not depend
    on n or the tile."""
    from gpu.matmul import gemm_mma
    t = gt.Q4_K
    rng = np.random.default_rng(17)
    cols = n_cols(t, "fp16")
    steps = -(-cols // gemm_mma.BK)
    monkeypatch.setattr(gemm_mma, "SPLIT_MIN_STEPS", 2)
    monkeypatch.setattr(gemm_mma, "SPLITS", 3)
    assert gemm_mma.k_splits(cols) == min(3, steps) > 1
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((N, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    tiles = [tile for tile in TILES + EXTRA_TILES if tile.precision == "fp16"]
    got = run(t, w_dev, x, ROWS, tile=tiles[0])
    check(t, "fp16", got, want, magnitude, w_bytes, x)
    assert np.array_equal(bits(run(t, w_dev, x, ROWS, tile=tiles[-1])), bits(got))
    assert np.array_equal(bits(run(t, w_dev, x[3:8], ROWS, tile=tiles[-2])), bits(got[3:8]))
    monkeypatch.setattr(gemm_mma, "SPLIT_MIN_STEPS", 10 ** 9)
    assert not np.array_equal(bits(run(t, w_dev, x, ROWS, tile=tiles[0])), bits(got)), \
        "one chain and three partial sums should round differently somewhere"


def test_rejects_bad_input_with_a_clear_error():
    t = gt.Q8_0
    w_dev = cuda.to_device(np.zeros((4, t.row_bytes(64)), np.uint8))
    x_dev = cuda.to_device(np.zeros((40, 64), np.float32))
    with pytest.raises(HybridError, match="unsupported tensor type"):
        gemm(int(GGMLQuantizationType.TQ2_0), w_dev, x_dev, cuda.to_device(np.zeros((40, 4), np.float32)))
    with pytest.raises(HybridError, match="do not hold"):
        gemm(t.id, w_dev, cuda.to_device(np.zeros((40, 96), np.float32)),
             cuda.to_device(np.zeros((40, 4), np.float32)))
    with pytest.raises(HybridError, match="out has shape"):
        gemm(t.id, w_dev, x_dev, cuda.to_device(np.zeros((40, 5), np.float32)))
