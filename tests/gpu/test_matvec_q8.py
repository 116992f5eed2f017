"""The int8-activation matvec (gpu/matmul/matvec_q8.py) of the quantised types.

Oracles: a numpy quantiser of x written from the spec (blocks of 32; for Q8_0/Q4_0 llama.cpp's
Q8_0 rounding, dx = fp16(max|x|/127), xq = round-half-even(x · (127/max|x|)), the same numbers
as cpu.activations; for the K-quants dx = max|x|/127, xq = round-half-even(x · (1/dx)); float
sums in the quantiser's tree order), and gguf's
`dequantize` for the weights. With x̂ = dx·xq the kernel computes, up to float32 rounding,
    A·x̂ + (W − A)·x
where A is the part of W that multiplies the quants (W itself, or for the K-quants W with its
dmin field zeroed; W − A is then the −dmin·m term, which uses the float sum of x). That is
checked tightly; W·x in float64 is checked within the rounding of x, |x − x̂| ≤ dx/2.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numba import cuda

from gpu.matmul import matvec_q8
from gpu.matmul.kernel_source import MAX_SLOTS
from gpu.matmul.quants_q8 import K64, NATURAL, Q6K64, START, UNITS
from cpu import activations as cpu_activations
from cpu import ggml_types as gt
from tests.gpu.test_matvec import REAL_GPU, ROWS, n_cols, random_weights, run
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

Q_TYPES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K", "Q2_K",
           "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_XXS"]
U = 2.0 ** -24                      # unit roundoff of float32
MIN_FIELD = {"Q4_1": 2, "Q5_1": 2, "Q4_K": 2, "Q5_K": 2, "Q2_K": 82}  # byte offset of the fp16 min (dmin)
Q8_1_MIN = ("Q4_1", "Q5_1")         # their min term meets x as Q8_1's s, not the float sum
BSUM_MIN = ("Q2_K",)                # its min term meets the rounded x (dx·Σ xq per 16, Q8_K's bsums)
TERMS_PER_UNIT = {"Q8_0": 1, "Q4_0": 1, "Q4_1": 2, "Q5_0": 1, "Q5_1": 2, "IQ4_NL": 1, "Q4_K": 4, "Q5_K": 4,
                  "Q6_K": 4, "IQ4_XS": 2, "Q3_K": 4, "Q2_K": 4,
                  "IQ2_XS": 4, "IQ2_S": 4, "IQ1_S": 2, "IQ1_M": 4, "MXFP4": 1, "IQ3_XXS": 2, "IQ3_S": 2,
                  "IQ2_XXS": 2}


def quantize_reference(x: np.ndarray, layout: int = NATURAL):
    """(xq (n, cols) int, dx (n, blocks), float sums (n, blocks), int sums (n, blocks, 2)).
    NATURAL (the 32-weight block types' layout): llama.cpp's Q8_0 rounding, dx = fp16(amax/127)
    and x·(127/amax), and in place of the float sums Q8_1's s = fp16(amax/127 · Σ xq); the
    64-weight K-quant layouts: dx = amax/127 in float32 and x·(1/dx)."""
    n, cols = x.shape
    blocks = x.astype(np.float32).reshape(n, cols // 32, 8, 4)   # 8 lanes of 4 elements each
    amax = np.abs(blocks).max(axis=(2, 3))
    p = (blocks[..., 0] + blocks[..., 1]) + (blocks[..., 2] + blocks[..., 3])
    sums = ((p[..., 0] + p[..., 1]) + (p[..., 2] + p[..., 3])) + ((p[..., 4] + p[..., 5]) + (p[..., 6] + p[..., 7]))
    dx = amax / np.float32(127.0)
    if layout == NATURAL:
        dx = dx.astype(np.float16).astype(np.float32)
        inv = np.divide(np.float32(127.0), amax, out=np.zeros_like(amax), where=amax > 0)
    else:
        inv = np.divide(np.float32(1.0), dx, out=np.zeros_like(dx), where=dx > 0)
    xq = np.rint(blocks.reshape(n, -1, 32) * inv[..., None]).astype(np.int64)
    assert np.abs(xq).max() <= 127
    if layout == NATURAL:
        with np.errstate(over="ignore"):
            sums = ((amax / np.float32(127.0)) * xq.sum(-1).astype(np.float32)).astype(np.float16).astype(np.float32)
    return xq.reshape(n, cols), dx, sums, xq.reshape(n, -1, 2, 16).sum(-1)


def scale_part(t: gt.GGMLType, w_bytes: np.ndarray) -> np.ndarray:
    """The dequantised weights without the min term (the K-quants' −dmin·m, Q4_1/Q5_1's m)."""
    if t.name not in MIN_FIELD:
        return dequantize(w_bytes, GGMLQuantizationType(t.id))
    blocks = w_bytes.copy().reshape(w_bytes.shape[0], -1, t.block_bytes)
    blocks[:, :, MIN_FIELD[t.name]:MIN_FIELD[t.name] + 2] = 0
    return dequantize(blocks.reshape(w_bytes.shape), GGMLQuantizationType(t.id))


def int8_reference(t: gt.GGMLType, w_bytes: np.ndarray, x: np.ndarray, lanes: int):
    """(want, bound): the kernel's algorithm in float64, and its float32 rounding bound.

    Each of the row's `lanes` lanes adds T terms in a chain of fmas, then at most 5 butterfly
    levels add the lanes: at most
    (T + 5)·u of Σ|term| (the usual γ bound). Each term's factors carry ≤ 4 roundings (d·sc, ·dx,
    the fp16/f32 products of the dequantiser A is taken from, the simulator's unfused fma), the
    float sum of x 5 more: T + 16 in all.
    """
    w = dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64)
    a = scale_part(t, w_bytes).astype(np.float64)
    xq, dx, s, _ = quantize_reference(x, UNITS[t.id].x_layout)
    x_hat = xq * np.repeat(dx.astype(np.float64), 32, axis=1)
    x64 = x.astype(np.float64)
    if t.name in Q8_1_MIN:      # Σ m·s over the blocks: m is constant in a block
        m = (w - a)[:, ::32]
        want = x_hat @ a.T + s.astype(np.float64) @ m.T
        return want, (TERMS_PER_UNIT[t.name] * -(-m.shape[1] // lanes) + 16) * U * (
            np.abs(x_hat) @ np.abs(a).T + np.abs(s.astype(np.float64)) @ np.abs(m).T)
    x_min = x_hat if t.name in BSUM_MIN else x64
    want = x_hat @ a.T + x_min @ (w - a).T
    magnitude = np.abs(x_hat) @ np.abs(a).T + np.abs(x_min) @ np.abs(w - a).T
    units = UNITS[t.id].units_per_row(x.shape[1])
    terms_per_lane = TERMS_PER_UNIT[t.name] * -(-units // lanes)
    return want, (terms_per_lane + 16) * U * magnitude


def rounding_bound(t: gt.GGMLType, w_bytes: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bound on |A·(x − x̂)|: |xq − x/dx| ≤ 1/2 + 256u (x/dx ≤ 127 through two float32 roundings),
    plus 127·|dx − fp16(dx)| ≤ 127·2**-11·dx where dx is an fp16 (NATURAL)."""
    a = scale_part(t, w_bytes).astype(np.float64)
    if t.name in BSUM_MIN:      # the min term meets x̂ too
        a = dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64)
    _, dx, s, _ = quantize_reference(x, UNITS[t.id].x_layout)
    half = 127 * 2.0 ** -11 if UNITS[t.id].x_layout == NATURAL else 0.0
    step = np.repeat(dx.astype(np.float64), 32, axis=1) * (0.5 + 256 * U + half)
    bound = step @ np.abs(a).T
    if t.name in Q8_1_MIN:
        # |Σx − s| ≤ Σ|x − d·xq| + the fp16 rounding of s: at most 32·(dx/2)(1 + 2**-10) + 2**-11·|s|
        m = np.abs(dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64) - a)[:, ::32]
        bound += (17 * dx.astype(np.float64) + 2.0 ** -11 * np.abs(s)) @ m.T
    return bound


def assert_within(got, want, bound, what):
    assert np.all(np.isfinite(got)), f"{what}: NaN/inf (unwritten rows?)"
    excess = np.abs(got.astype(np.float64) - want) - bound
    assert np.all(excess <= 0), f"{what}: max excess {excess.max():.3g} (bound {bound.max():.3g})"


def test_quantiser_matches_the_numpy_spec_bit_for_bit():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32) * np.float32(3.0)
    x[0, 32:64] = 0.0                            # an all-zero block: dx = 0, xq = 0
    x[1, :32] = np.float32(0.5)                  # x·(127/amax) = 127 exactly for all
    x[2, 64:96] = np.arange(-16, 16, dtype=np.float32) + np.float32(0.5)   # amax 127: x·inv = k + .5, ties
    x[2, 64] = np.float32(127.0)
    xq_dev, xm_dev = matvec_q8.quantize(cuda.to_device(x))
    xq_words, xm = xq_dev.copy_to_host(), xm_dev.copy_to_host().reshape(3, -1, 4)
    want_q, dx, sums, halves = quantize_reference(x)
    got_q = xq_words.view(np.int8).reshape(3, 96).astype(np.int64)
    np.testing.assert_array_equal(got_q, want_q)
    np.testing.assert_array_equal(xm[..., 0].view(np.float32), dx)
    np.testing.assert_array_equal(xm[..., 1].view(np.float32), sums)      # Q8_1's s
    np.testing.assert_array_equal(xm[..., 2:].view(np.int32), halves)


def test_natural_layout_activations_are_the_cpu_kernels_bit_for_bit():
    """The GPU's x for the 32-weight block types (NATURAL layout) has the codes and scales of the
    CPU kernels' (cpu.activations Q8_0 and Q8_1, llama.cpp's rounding), so both backends round alike."""
    assert UNITS[gt.Q8_0.id].x_layout == NATURAL and UNITS[gt.Q4_0.id].x_layout == NATURAL
    for t in (gt.Q8_0, gt.Q4_0, gt.Q5_0, gt.IQ4_NL, gt.MXFP4):       # llama.cpp's CPU meets them with Q8_0
        assert UNITS[t.id].x_layout == NATURAL and cpu_activations.format_of(t.id).name == "Q8_0", t.name
    rng = np.random.default_rng(4)
    x = (rng.standard_t(2, (2, 256)) * rng.uniform(1e-3, 1e3, (2, 1))).astype(np.float32)
    x[0, :32] = np.append(np.arange(31) - 15.5, [127])       # ties
    x[1, 32:64] = 0.0
    xq_dev, xm_dev = matvec_q8.quantize(cuda.to_device(x))
    got_q = xq_dev.copy_to_host().view(np.int8).reshape(2, 256)
    got_d = xm_dev.copy_to_host().reshape(2, -1, 4)[..., 0].view(np.float32)
    cpu_q, cpu_d, _ = cpu_activations.quantize(cpu_activations.format_of(gt.Q8_0.id), x)
    np.testing.assert_array_equal(got_q, cpu_q)
    np.testing.assert_array_equal(got_d.view(np.uint32), cpu_d.view(np.uint32))
    # Q4_1/Q5_1 weights: the same codes and d, and Q8_1's s (cpu.activations' Q8_1)
    assert UNITS[gt.Q4_1.id].x_layout == NATURAL and UNITS[gt.Q5_1.id].x_layout == NATURAL
    got_s = xm_dev.copy_to_host().reshape(2, -1, 4)[..., 1].view(np.float32)
    _, cpu_ds, _ = cpu_activations.quantize(cpu_activations.format_of(gt.Q4_1.id), x)
    np.testing.assert_array_equal(got_s.view(np.uint32), cpu_ds[:, 1::2].view(np.uint32))


def lane_columns(layout: int, blk: int, p: int, k: int) -> np.ndarray:
    """Columns of x that lane (blk, p) of a 64-weight type reads in its load k: the weights it
    owns (gpu/matmul/quants_q8.py), written here from the block layouts, not from the kernel."""
    if layout == K64:      # columns 64p on (Q4_K/Q5_K chunk p, IQ4_XS sub-blocks 2p, 2p + 1, Q2_K/Q3_K
                           # bit pairs 2(p % 2), +1 of qs half p // 2)
        first = 64 * p + 16 * k
    else:                  # Q6_K half p // 2, 16 bytes p % 2: groups 32k on
        first = 128 * (p // 2) + 16 * (p % 2) + 32 * k
    return blk * 256 + first + np.arange(16)


@pytest.mark.parametrize("layout", [K64, Q6K64])
def test_quantiser_lays_x_out_for_the_64_weight_lanes(layout):
    """Load k of lane (blk, p) must find its 16 columns at words 128k + 4(4(blk % 8) + p) of its
    step of 8 blocks (one contiguous run per warp load), and its block numbers where its kernel
    reads them. 10 blocks: one whole step and a partial one."""
    rng = np.random.default_rng(7)
    cols = 256 * 10
    x = rng.standard_normal((2, cols)).astype(np.float32)
    xq_dev, xm_dev = matvec_q8.quantize(cuda.to_device(x), layout=layout)
    xq = xq_dev.copy_to_host()
    xm = xm_dev.copy_to_host()
    want_q, dx, sums, halves = quantize_reference(x, layout)
    assert xq.shape == (2, 2 * 512)  # padded to whole steps
    got_bytes = xq.view(np.int8).astype(np.int64)
    for blk in range(10):
        for p in range(4):
            for k in range(4):
                word = 512 * (blk // 8) + 128 * k + 4 * (4 * (blk % 8) + p)
                np.testing.assert_array_equal(got_bytes[:, 4 * word:4 * word + 16],
                                              want_q[:, lane_columns(layout, blk, p, k)])
    if layout == K64:   # [dx, Σx] per block of 32, then (second half of the row) Σ xq per 16
        np.testing.assert_array_equal(xm[:, 0:2 * 80:2].view(np.float32), dx)
        np.testing.assert_array_equal(xm[:, 1:2 * 80:2].view(np.float32), sums)
        np.testing.assert_array_equal(xm[:, cols // 16:].view(np.int32).reshape(2, 80, 2), halves)
        return
    # Q6_K: lane (blk, p = 2n + u) record: dx of blocks 8blk + 4n + t, then (second half of the
    # row) the dp4a start values START − 32·Σ xq over half u of each
    for blk in range(10):
        for p in range(4):
            blocks = 8 * blk + 4 * (p // 2) + np.arange(4)
            at = 4 * (4 * blk + p)
            np.testing.assert_array_equal(xm[:, at:at + 4].view(np.float32), dx[:, blocks])
            start = xm[:, cols // 16 + at:cols // 16 + at + 4].view(np.int32).astype(np.int64)
            np.testing.assert_array_equal(start, int(START) - 32 * halves[:, blocks, p % 2])


def check_against_oracles(t, w_bytes, x, got, lanes=None):
    """got against the int8 algorithm (tight) and W·x (within x's rounding); `lanes` per row:
    the kernel's choice when None."""
    lanes = lanes or matvec_q8.lanes_per_row(UNITS[t.id], x.shape[1])
    want, bound = int8_reference(t, w_bytes, x, lanes)
    assert_within(got, want, bound, f"{t.name} vs the int8 algorithm")
    w = dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64)
    assert_within(got, x.astype(np.float64) @ w.T, bound + rounding_bound(t, w_bytes, x), f"{t.name} vs W·x")


@pytest.mark.parametrize("name", Q_TYPES)
def test_matches_the_oracles_and_slots_are_bit_identical(name):
    """Rows: never a multiple of a block's rows. Columns: the last step of 32 units is partial.
    One slot takes one row per warp and R·U units per loop (units_in_flight; tail loop only on
    the simulator's shapes); more slots take two rows and fewer units: the bits must agree."""
    t = gt.by_name(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    by_n = {n: run(t, w_dev, x[:n], ROWS) for n in (1, 2, 4)}
    last_alone = run(t, w_dev, x[3:4], ROWS)
    check_against_oracles(t, w_bytes, x, by_n[4])
    for n, got in by_n.items():
        assert np.array_equal(got.view(np.uint32), by_n[4][:n].view(np.uint32)), f"n={n}"
    assert np.array_equal(by_n[4][3].view(np.uint32), last_alone[0].view(np.uint32))


def test_main_loop_and_tail_of_one_row_per_warp():
    """Q8_0 units are 16 weights: 102 units per row give lanes 0-5 of 32 one pass of the U = 4
    loop and every lane a tail; rows per warp 1, 2, 4 (U = 4, 2, 1) give the same bits."""
    t = gt.Q8_0
    rng = np.random.default_rng(5)
    cols = 32 * 51
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((1, cols)).astype(np.float32)
    base = run(t, w_dev, x, ROWS, rows_per_warp=1, lanes=32)
    check_against_oracles(t, w_bytes, x, base, lanes=32)
    for r in (2, 4):
        got = run(t, w_dev, x, ROWS, rows_per_warp=r, lanes=32)
        assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), f"rows_per_warp={r}"


@pytest.mark.parametrize("name", ["Q4_K", "Q6_K", "Q8_0"])
def test_every_lane_group_width(name):
    """32, 16, 8 or 4 lanes per row (a warp of 1, 2, 4 or 8 row groups): each width agrees
    with the oracles, and within a width slots and rows per group never change the bits."""
    t = gt.by_name(name)
    rng = np.random.default_rng(13)
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((2, cols)).astype(np.float32)
    for lanes in (32, 16, 8, 4):
        pair = run(t, w_dev, x, ROWS, lanes=lanes)
        check_against_oracles(t, w_bytes, x, pair, lanes)
        alone = run(t, w_dev, x[1:], ROWS, lanes=lanes, rows_per_warp=1)
        assert np.array_equal(pair[1].view(np.uint32), alone[0].view(np.uint32)), f"lanes={lanes}"


def test_lanes_per_row_leaves_few_lanes_idle():
    """The widths the kernel picks at the 27B shapes and the small ones (module docstring)."""
    q4_k, q8_0 = UNITS[gt.Q4_K.id], UNITS[gt.Q8_0.id]
    assert matvec_q8.lanes_per_row(q4_k, 5120) == 16       # 80 units: 5 steps of 16, not 2.5 of 32
    assert matvec_q8.lanes_per_row(q4_k, 17408) == 32      # 272 units: 8.5 steps, 6% idle
    assert matvec_q8.lanes_per_row(q4_k, 2048) == 32       # 32 units: one step
    assert matvec_q8.lanes_per_row(q4_k, 1280) == 4        # 20 units: 5 steps of 4
    assert matvec_q8.lanes_per_row(q4_k, 256) == 4         # one block: its 4 units
    assert matvec_q8.lanes_per_row(q8_0, 5120) == 32       # 320 units: 10 steps


def test_more_slots_than_one_launch_takes():
    t = gt.Q8_0
    rng = np.random.default_rng(3)
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    n = MAX_SLOTS + 2
    x = rng.standard_normal((n, cols)).astype(np.float32)
    got = run(t, w_dev, x, ROWS)
    check_against_oracles(t, w_bytes, x, got)
    last = run(t, w_dev, x[n - 1:], ROWS)
    assert np.array_equal(got[n - 1:].view(np.uint32), last.view(np.uint32))


@pytest.mark.skipif(not REAL_GPU, reason="the simulator reads unaligned words byte by byte")
def test_misaligned_weight_rows():
    """Q6_K/Q8_0/Q4_0/Q5_0/IQ4_NL/Q3_K/IQ2_XS/IQ2_S/IQ1_S/IQ3_XXS/IQ3_S/IQ2_XXS rows of an odd block
    count start 2 bytes off a word boundary every other row (Q4_1/Q5_1/Q2_K/IQ1_M rows stay 4-byte
    aligned, IQ4_XS rows 8-byte; MXFP4 rows start at any byte); a view one row in starts anywhere:
    the unaligned loads must see the same bytes."""
    for name in ("Q6_K", "Q8_0", "Q4_0", "Q5_0", "IQ4_NL", "Q4_1", "Q5_1", "Q3_K", "Q2_K", "IQ4_XS",
                 "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_XXS"):
        t = gt.by_name(name)
        rng = np.random.default_rng(11)
        cols = t.block_elems * 33
        w_bytes = random_weights(t, ROWS + 1, cols, rng)
        x = rng.standard_normal((2, cols)).astype(np.float32)
        w_dev = cuda.to_device(w_bytes)[1:]
        check_against_oracles(t, w_bytes[1:], x, run(t, w_dev, x, ROWS))


@pytest.mark.parametrize("n", [2, 9])
def test_matrices_of_one_input_share_its_quantisation_and_keep_their_bits(n):
    """gpu.matmul.matvec.matvecs (a GDN layer's projections of one x): every output has the bits of
    its own matvec call, across x layouts (Q4_K, Q6_K, Q8_0 each lay x out differently, F32 takes
    the float kernel), with matrices of one type grouped into launches (four Q4_K: a group of
    three, then one alone) between the others, and past one launch's slots."""
    from gpu.matmul.matvec import matvec, matvecs
    rng = np.random.default_rng(12)
    # K-quant rows of several column tiles, the last partial (n_cols); past a launch's slots the
    # simulator's x quantiser takes seconds per call at that width, so there 2 super-blocks
    cols = 1280 if REAL_GPU or n <= MAX_SLOTS else 512
    names = ["Q4_K", "Q6_K", "Q8_0", "Q4_K", "F32", "Q4_K", "Q4_K"]
    mats = [(gt.by_name(n), cuda.to_device(random_weights(gt.by_name(n), ROWS + 3 * i, cols, rng)))
            for i, n in enumerate(names)]
    x = cuda.to_device(rng.standard_normal((n, cols)).astype(np.float32))
    outs = [cuda.to_device(np.full((n, ROWS + 3 * i), np.nan, np.float32)) for i in range(len(mats))]
    matvecs([(t.id, w, out) for (t, w), out in zip(mats, outs)], x)
    for (t, w), out in zip(mats, outs):
        alone = cuda.to_device(np.full(out.shape, np.nan, np.float32))
        matvec(t.id, w, x, alone)
        assert np.array_equal(out.copy_to_host().view(np.uint32), alone.copy_to_host().view(np.uint32)), t.name
