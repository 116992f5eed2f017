"""gpu.matmul.matvec against gguf's dequantiser + a float64 matmul, and per-slot bit identity.

Weights are random raw block bytes (every bit pattern of quants, scales and mins occurs) with
sane fp16 scale fields; `gguf.quants.dequantize` says what they mean. On the simulator the
shapes are tiny (each simulated block is slow); on a real GPU they are larger. The float
kernel's types are checked here; the quantised types (int8 activations) in test_matvec_q8.py.
"""
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from numba import cuda

from gpu import available, simulated
from gpu.matmul.kernel_source import MAX_SLOTS
from gpu.matmul.matvec import matvec
from cpu import ggml_types as gt
from hybrid.errors import HybridError

TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS",
         "Q3_K", "Q2_K", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_XXS"]
FLOAT_TYPES = ["F32", "F16", "BF16"]   # the float kernel's; the others: test_matvec_q8.py
FP16_FIELD_OFFSETS = {"Q8_0": [0], "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "IQ4_NL": [0],
                      "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_XS": [0], "Q3_K": [108], "Q2_K": [80, 82],
                      "IQ2_XS": [0], "IQ2_S": [0], "IQ1_S": [0], "IQ1_M": [], "MXFP4": [], "IQ3_XXS": [0],
                      "IQ3_S": [0], "IQ2_XXS": [0]}
E8M0_FIELD_OFFSETS = {"MXFP4": 0}     # a random exponent byte would overflow the products
REAL_GPU = available() and not simulated()
ROWS = 389 if REAL_GPU else 5  # never a multiple of a block's rows: the tail block is partial


def n_cols(t: gt.GGMLType) -> int:
    """Several column tiles, the last one partial (units past the row end must add nothing).
    Tiles are 16 or 32 units of 32 lanes (gpu/matmul/quants.py)."""
    if REAL_GPU:
        return 4096 + (256 if t.block_elems == 256 else t.block_elems * 3)
    return {256: 1280, 32: 1088 if t.name == "Q4_0" else 640, 1: 544}[t.block_elems]


def random_weights(t: gt.GGMLType, rows: int, cols: int, rng) -> np.ndarray:
    if t.name in ("F32", "F16", "BF16"):
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        if t.name == "F16":
            return w.astype(np.float16).view(np.uint8)
        if t.name == "BF16":
            return (w.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
        return w.view(np.uint8)
    n_blocks = cols // t.block_elems
    raw = rng.integers(0, 256, (rows, n_blocks, t.block_bytes), dtype=np.uint8)
    for off in FP16_FIELD_OFFSETS[t.name]:
        scale = rng.uniform(-0.05, 0.05, (rows, n_blocks)).astype(np.float16)
        raw[:, :, off:off + 2] = scale.view(np.uint8).reshape(rows, n_blocks, 2)
    if t.name == "IQ1_M":   # its fp16 d is the top nibbles of the four u16 scales (bytes 48..55)
        d = rng.uniform(-0.05, 0.05, (rows, n_blocks)).astype(np.float16).view(np.uint16)
        for k in range(4):
            nibble = ((d >> (4 * k)) & 15).astype(np.uint8)
            raw[:, :, 49 + 2 * k] = (raw[:, :, 49 + 2 * k] & 0x0F) | (nibble << 4)
    if t.name in E8M0_FIELD_OFFSETS:     # scales 2**-10 .. 2**-3
        raw[:, :, E8M0_FIELD_OFFSETS[t.name]] = rng.integers(118, 126, (rows, n_blocks), dtype=np.uint8)
    return raw.reshape(rows, n_blocks * t.block_bytes)


def reference(t: gt.GGMLType, w_bytes: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(W @ x.T).T in float64, and the matching sum of |w||x| that bounds float32 rounding."""
    w = dequantize(w_bytes, GGMLQuantizationType(t.id)).astype(np.float64)
    assert w.shape == (w_bytes.shape[0], x.shape[1])
    x64 = x.astype(np.float64)
    return x64 @ w.T, np.abs(x64) @ np.abs(w).T


def run(t: gt.GGMLType, w_dev, x: np.ndarray, rows: int, **kw) -> np.ndarray:
    out = cuda.to_device(np.full((x.shape[0], rows), np.nan, np.float32))  # poisoned
    matvec(t.id, w_dev, cuda.to_device(np.ascontiguousarray(x)), out, **kw)
    return out.copy_to_host()


def assert_close(got, want, magnitude):
    err = np.abs(got.astype(np.float64) - want)
    # fp32 dot products of <= ~5k terms stay far inside 1e-4 of sum |w||x|; one wrong weight
    # or scale moves the result by ~ that sum / cols, well outside
    bound = 1e-4 * magnitude + 1e-6
    assert np.all(np.isfinite(got)), "output has NaN/inf (unwritten rows?)"
    assert np.all(err <= bound), f"max excess {np.max(err - bound):.3g}"


@pytest.mark.parametrize("name", FLOAT_TYPES)
def test_matches_reference_and_slots_are_bit_identical(name):
    t = gt.by_name(name)
    rng = np.random.default_rng(sum(map(ord, name)))
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    x = rng.standard_normal((4, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    by_n = {n: run(t, w_dev, x[:n], ROWS) for n in (1, 2, 3, 4)}
    last_alone = run(t, w_dev, x[3:4], ROWS)
    for n, got in by_n.items():
        assert_close(got, want[:n], magnitude[:n])
    # every slot of every call has the bits of that slot run alone (slot 0: n=1; slot 3 alone)
    for n, got in by_n.items():
        assert np.array_equal(got.view(np.uint32), by_n[4][:n].view(np.uint32)), f"n={n}"
    assert np.array_equal(by_n[4][3].view(np.uint32), last_alone[0].view(np.uint32))


@pytest.mark.parametrize("name", ["F16", "Q4_K"])
def test_rows_per_warp_never_changes_bits(name):
    t = gt.by_name(name)
    rng = np.random.default_rng(7)
    cols = n_cols(t)
    w_dev = cuda.to_device(random_weights(t, ROWS, cols, rng))
    x = rng.standard_normal((2, cols)).astype(np.float32)
    base = run(t, w_dev, x, ROWS, rows_per_warp=1)
    for r in (2, 4):
        got = run(t, w_dev, x, ROWS, rows_per_warp=r)
        assert np.array_equal(got.view(np.uint32), base.view(np.uint32)), f"rows_per_warp={r}"


def test_more_slots_than_one_launch_takes():
    t = gt.F16
    rng = np.random.default_rng(3)
    cols = n_cols(t)
    w_bytes = random_weights(t, ROWS, cols, rng)
    w_dev = cuda.to_device(w_bytes)
    n = MAX_SLOTS + 2
    x = rng.standard_normal((n, cols)).astype(np.float32)
    want, magnitude = reference(t, w_bytes, x)
    got = run(t, w_dev, x, ROWS)
    assert_close(got, want, magnitude)
    last = run(t, w_dev, x[n - 1:], ROWS)
    assert np.array_equal(got[n - 1:].view(np.uint32), last.view(np.uint32))


def test_rejects_bad_input_with_a_clear_error():
    t = gt.Q8_0
    w_dev = cuda.to_device(np.zeros((4, t.row_bytes(64)), np.uint8))
    x_dev = cuda.to_device(np.zeros((1, 64), np.float32))
    out_dev = cuda.to_device(np.zeros((1, 4), np.float32))
    with pytest.raises(HybridError, match="unsupported tensor type"):
        matvec(int(GGMLQuantizationType.TQ2_0), w_dev, x_dev, out_dev)
    with pytest.raises(HybridError, match="do not hold"):
        matvec(t.id, w_dev, cuda.to_device(np.zeros((1, 96), np.float32)), out_dev)
    with pytest.raises(HybridError, match="out has shape"):
        matvec(t.id, w_dev, x_dev, cuda.to_device(np.zeros((2, 4), np.float32)))
    with pytest.raises(HybridError, match="uint8"):
        matvec(t.id, cuda.to_device(np.zeros((4, 17), np.uint16)), x_dev, out_dev)
