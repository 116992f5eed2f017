"""The GPU lookup tables (gpu/matmul/quants.py): the 16-entry tables looked up by byte permutes,
and the IQ grids read from global memory, each checked in a kernel against gguf-py's own values
(the matvec tests check them again through whole products)."""
import numpy as np
import pytest
from gguf import quants as gguf_quants
from numba import cuda

from gpu.matmul import quants

TABLES = {"IQ4_NL": (gguf_quants.IQ4_NL.kvalues, (quants.IQ4_NL_W0, quants.IQ4_NL_W1, quants.IQ4_NL_W2,
                                                   quants.IQ4_NL_W3)),
          # 2 × the e2m1 values, as ggml's table (halved again by e8m0_half)
          "MXFP4": (gguf_quants.MXFP4.kvalues,
                    (quants.MXFP4_W0, quants.MXFP4_W1, quants.MXFP4_W2, quants.MXFP4_W3))}


@cuda.jit
def _lookups(words, table, low, high, single):
    i = cuda.grid(1)
    if i < words.size:
        w0, w1, w2, w3 = table[0], table[1], table[2], table[3]
        low[i], high[i] = quants.table_bytes(words[i], w0, w1, w2, w3)
        single[i] = quants.table_byte(words[i] & np.uint32(15), w0, w1, w2, w3)


@pytest.mark.parametrize("name", sorted(TABLES))
def test_sixteen_entry_table_lookups(name):
    values, packed = TABLES[name]
    entries = np.array(values, np.int64) & 0xFF
    rng = np.random.default_rng(7)
    # every nibble value in every position, then random words
    words = np.concatenate([np.arange(16, dtype=np.uint32) * np.uint32(0x11111111),
                            rng.integers(0, 2 ** 32, 48, dtype=np.uint64).astype(np.uint32)])
    low, high, single = (np.zeros_like(words) for _ in range(3))
    out = [cuda.to_device(a) for a in (low, high, single)]
    _lookups[1, words.size](cuda.to_device(words), cuda.to_device(np.array(packed, np.uint32)), *out)
    low, high, single = (a.copy_to_host() for a in out)
    nibble = [(words.astype(np.int64) >> (4 * k)) & 15 for k in range(8)]
    want_low = sum(entries[nibble[2 * k]] << (8 * k) for k in range(4))
    want_high = sum(entries[nibble[2 * k + 1]] << (8 * k) for k in range(4))
    np.testing.assert_array_equal(low, want_low)
    np.testing.assert_array_equal(high, want_high)
    np.testing.assert_array_equal(single, entries[nibble[0]])


GRIDS = {"IQ2_XXS": (quants.iq2xxs_grid, gguf_quants.IQ2_XXS), "IQ2_XS": (quants.iq2xs_grid, gguf_quants.IQ2_XS),
         "IQ2_S": (quants.iq2s_grid, gguf_quants.IQ2_S), "IQ3_XXS": (quants.iq3xxs_grid, gguf_quants.IQ3_XXS),
         "IQ3_S": (quants.iq3s_grid, gguf_quants.IQ3_S), "IQ1_S": (quants.iq1s_grid, gguf_quants.IQ1_S)}


def _grid_kernel(table):
    @cuda.jit
    def read(out):
        grid = table()
        for i in range(cuda.grid(1), out.size, cuda.gridsize(1)):
            out[i] = grid[i]
    return read


@pytest.mark.parametrize("name", sorted(GRIDS))
def test_grids_in_global_memory_hold_gguf_grids(name):
    table, cls = GRIDS[name]
    cls.init_grid()
    want = np.ascontiguousarray(cls.grid.reshape(cls.grid_shape).astype(np.int8)).view(np.uint32).ravel()
    out = cuda.to_device(np.zeros(want.size, np.uint32))
    _grid_kernel(table)[1, 32](out)
    np.testing.assert_array_equal(out.copy_to_host(), want)
