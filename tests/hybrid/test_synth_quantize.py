"""Our quantisers and decoder against the gguf package (the oracle for what a block means)."""
import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as GQ

from cpu import ggml_types as gt
from hybrid.synth import quantize
from hybrid.synth.codes import random_blocks
from hybrid.synth.dequantize import dequantize
from hybrid.synth.quantize import QUANTIZABLE

ALL = list(gt.BY_NAME.values())
FLOAT_QUANTISED = [t for t in ALL if t.name in QUANTIZABLE]     # the rest are written as random codes
# rms error / rms value on N(0, 1) rows: a loose bound per type's bits
MAX_REL_ERR = {"F32": 0.0, "F16": 1e-3, "BF16": 5e-3, "Q8_0": 0.01, "Q6_K": 0.03, "Q5_K": 0.05,
               "Q4_K": 0.10, "Q4_0": 0.12, "Q4_1": 0.12, "Q5_0": 0.06, "Q5_1": 0.06, "MXFP4": 0.25}
# |mean| / sigma of random codes: the IQ1 grids' values are not centred per block, and only the
# random sign of a block's scale cancels that over many blocks
MAX_MEAN = {"IQ1_S": 0.03, "IQ1_M": 0.03}


def gguf_dequant(b: np.ndarray, t) -> np.ndarray:
    return gguf.quants.dequantize(b, GQ(t.id)).reshape(b.shape[0], -1)


def rel_err(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


@pytest.fixture(scope="module")
def rows():
    return np.random.default_rng(1).standard_normal((48, 512)).astype(np.float32)


@pytest.mark.parametrize("t", FLOAT_QUANTISED, ids=lambda t: t.name)
def test_quantize_is_accurate_and_our_decoder_is_bit_exact(t, rows):
    b = quantize(rows, t)
    assert b.dtype == np.uint8 and b.shape == (48, t.row_bytes(512))
    ref = gguf_dequant(b, t)
    assert rel_err(ref, rows) <= MAX_REL_ERR[t.name]
    np.testing.assert_array_equal(dequantize(b, t, 512).view(np.uint32), ref.view(np.uint32))


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "BF16"])
def test_reference_rounding_types_match_gguf_quantize_bit_for_bit(name, rows):
    t = gt.by_name(name)
    x = rows.copy()
    x[0, :32] = 0.0                       # an all-zero block (scale 0)
    x[1, 5] = 1e4                         # an outlier dominating its block
    np.testing.assert_array_equal(quantize(x, t), gguf.quants.quantize(x, GQ(t.id)).reshape(48, -1))


@pytest.mark.parametrize("t", [t for t in FLOAT_QUANTISED if t.block_elems > 1], ids=lambda t: t.name)
def test_awkward_blocks_stay_finite_and_close(t):
    n = 512
    x = np.zeros((6, n), np.float32)
    x[1] = 3.0                                             # constant positive
    x[2] = -2.0                                            # constant negative
    x[3, ::7] = 1.0                                        # sparse
    x[4] = np.linspace(-1, 1, n)                           # ramp
    x[5] = np.random.default_rng(2).standard_normal(n) * 1e-3
    x[5, 17] = 50.0                                        # one huge outlier
    ref = gguf_dequant(quantize(x, t), t)
    assert np.all(np.isfinite(ref))
    np.testing.assert_array_equal(ref[0], 0.0)
    for r in (1, 2, 4):
        assert rel_err(ref[r], x[r]) < (0.15 if t.name == "MXFP4" else 0.1), r     # MXFP4: e2m1 codes


@pytest.mark.parametrize("t", ALL, ids=lambda t: t.name)
def test_random_codes_are_valid_centred_and_scaled(t):
    rng = np.random.default_rng(3)
    b = random_blocks(rng, 64, 1024, t, sigma=0.05)
    assert b.shape == (64, t.row_bytes(1024))
    ref = gguf_dequant(b, t)
    np.testing.assert_array_equal(dequantize(b, t, 1024).view(np.uint32), ref.view(np.uint32))
    assert np.all(np.isfinite(ref))
    assert abs(ref.std() - 0.05) < 0.05 * 0.05
    assert abs(ref.mean()) < 0.05 * MAX_MEAN.get(t.name, 0.01)
    # every row has its own values (not one block repeated)
    assert len({r.tobytes() for r in b}) == 64


def test_random_codes_are_deterministic():
    a = random_blocks(np.random.default_rng(7), 4, 256, gt.Q4_K, 0.1)
    b = random_blocks(np.random.default_rng(7), 4, 256, gt.Q4_K, 0.1)
    np.testing.assert_array_equal(a, b)


def test_rows_not_a_multiple_of_the_block_are_refused():
    with pytest.raises(ValueError, match="multiple of 256"):
        quantize(np.zeros((2, 300), np.float32), gt.Q4_K)
