"""cpu.quants: float decoding of every supported type, bit-exact against gguf-py."""
import os
import subprocess
import sys

import numpy as np
import pytest

from cpu.quants import dequantize, dequantize_rows
from cpu.ggml_types import BY_NAME

from .quant_data import DECODED_TYPES, TYPES, dequantized, random_rows, type_id


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
        dequantize(8000, w, 512)      # no such type


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


@pytest.mark.parametrize("name", DECODED_TYPES)
def test_every_code_decodes_like_gguf(name):
    """Random bytes in every field but the super-scale, block by block: each decoder covers
    its whole code space bit-exactly (the synthetic blocks fix some fields' ranges)."""
    t = BY_NAME[name]
    rng = np.random.default_rng(11)
    w = random_rows(name, 64, t.block_elems, rng)                    # sane scales …
    codes = rng.integers(0, 256, size=w.shape, dtype=np.uint8)
    keep = np.zeros(t.block_bytes, bool)                             # … and random codes around them
    keep[list(_SCALE_BYTES[name])] = True
    w = np.where(keep, w, codes).astype(np.uint8)
    if name == "IQ1_M":
        w[:, 32:48] |= 0x88      # gguf-py's IQ1_M ignores the delta-sign bit; ggml (and we) read it
    got = dequantize(type_id(name), w, t.block_elems)
    want = dequantized(name, w, t.block_elems).astype(np.float32)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# bytes holding each decoded type's super-scale (and offset), left as the synthetic writer set them
_SCALE_BYTES = {"Q4_1": range(0, 4), "Q5_0": range(0, 2), "Q5_1": range(0, 4), "Q2_K": range(80, 84),
                "Q3_K": range(108, 110), "IQ4_NL": range(0, 2), "IQ4_XS": range(0, 2), "IQ3_XXS": range(0, 2),
                "IQ3_S": range(0, 2), "IQ2_XXS": range(0, 2), "IQ2_XS": range(0, 2), "IQ2_S": range(0, 2),
                "IQ1_S": range(0, 2), "IQ1_M": (49, 51, 53, 55), "MXFP4": (0,)}


def test_iq1_m_delta_sign_follows_ggml():
    """ggml: delta = −1/8 where the group's bit 3 is set, +1/8 where clear. gguf-py always takes
    −1/8, so the clear case is checked against the formula: a block with every grid index 0,
    scale words 0 but d = 1 (fp16 0x3C00 in the top nibbles), sign bits clear → (grid₀ + 1/8)."""
    from cpu.blocks import IQ1S_GRID
    b = np.zeros((1, 56), np.uint8)
    words = np.array([0x0000, 0x0000, 0xC000, 0x3000], np.uint16)  # nibbles of 0x3C00, low first
    b[0, 48:56] = words.view(np.uint8)
    got = dequantize(type_id("IQ1_M"), b, 256)[0]
    assert np.array_equal(got, np.tile(IQ1S_GRID[0] + np.float32(0.125), 32))
    b[0, 32:48] = 0x88
    got = dequantize(type_id("IQ1_M"), b, 256)[0]
    assert np.array_equal(got, np.tile(IQ1S_GRID[0] - np.float32(0.125), 32))


_WARM_PROBE = """
import numpy as np
from cpu import decoded, quants
from cpu.ggml_types import BY_NAME
t = BY_NAME["IQ2_XS"]
w = np.zeros((4, 2 * t.block_bytes), np.uint8)
decoded.matvec_decoded(t.id, w, np.ones((1, 2 * t.block_elems), np.float32), np.empty((1, 4), np.float32))
quants.dequantize_rows(t.id, w, [1], 2 * t.block_elems)
kernels = (decoded._matvec(t.id), quants._dequantize_rows(t.id))
print(sum(k.stats.cache_misses.get(s, 0) for k in kernels for s in k.signatures))
"""


def test_kernels_made_per_type_load_from_the_disk_cache_in_a_new_process(tmp_path):
    """A per-type kernel's cache key covers its closure: a second process must find the first's
    compilations (a dispatcher in a closure pickles with a per-process id, and missed every time)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}
    runs = [subprocess.run([sys.executable, "-c", _WARM_PROBE], capture_output=True, text=True, env=env,
                           timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[-1].stderr
    assert int(runs[0].stdout.split()[-1]) == 2 and int(runs[1].stdout.split()[-1]) == 0
