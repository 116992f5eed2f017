"""cpu.quants: float decoding of every supported type, bit-exact against gguf-py."""
import numpy as np
import pytest

from cpu.quants import dequantize, dequantize_rows
from cpu.ggml_types import BY_NAME

from .quant_data import TYPES, dequantized, random_rows, type_id


def _cols(name, blocks):
    return BY_NAME[name].block_elems * blocks if BY_NAME[name].block_elems > 1 else 3 * blocks


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("blocks", [1, 3])
def test_dequantize_is_bit_exact_against_gguf(name, blocks):
    rng = np.random.default_rng(blocks)
    cols = _cols(name, blocks)
    w = random_rows(name, 7, cols, rng)
    got = dequantize(type_id(name), w, cols)
    want = dequantized(name, w, cols).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == (7, cols)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("name", TYPES)
def test_dequantize_rows_picks_rows_in_order(name):
    rng = np.random.default_rng(5)
    cols = _cols(name, 2)
    w = random_rows(name, 9, cols, rng)
    ids = [8, 0, 3, 3]
    got = dequantize_rows(type_id(name), w, ids, cols)
    want = dequantized(name, w, cols)[ids].astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert dequantize_rows(type_id(name), w, np.array([], np.int64), cols).shape == (0, cols)


def test_dequantize_rows_rejects_bad_ids():
    w = random_rows("Q8_0", 4, 32, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        dequantize_rows(type_id("Q8_0"), w, [4], 32)
    with pytest.raises(ValueError, match="1-D array of integers"):
        dequantize_rows(type_id("Q8_0"), w, [0.5], 32)


def test_dequantize_rejects_mismatched_rows():
    w = random_rows("Q4_K", 2, 512, np.random.default_rng(0))
    with pytest.raises(ValueError, match="bytes"):
        dequantize(type_id("Q4_K"), w, 256)
    with pytest.raises(ValueError, match="multiple of 256"):
        dequantize(type_id("Q4_K"), w, 300)
    with pytest.raises(ValueError, match="unsupported tensor type"):
        dequantize(3, w, 512)     # Q4_1


def test_half_decoder_is_exact_for_every_bit_pattern():
    from numba import njit

    from cpu.simd import f16_bits_to_f32

    @njit
    def widen(bits, out):
        for i in range(bits.size):
            out[i] = f16_bits_to_f32(bits[i])

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.size, np.float32)
    widen(bits, out)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)   # NaN payloads may be quieted differently: only NaN-ness must match
    assert np.array_equal(np.isnan(out), nan)
    assert np.array_equal(out[~nan].view(np.uint32), want[~nan].view(np.uint32))
