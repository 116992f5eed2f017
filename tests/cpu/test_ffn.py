"""cpu.ffn.swiglu: a float64 reference (test_matmul uses it), validation, and the SiLU passes of long
row tiles. Type pairs × slot counts against numpy, with per-slot bit identity: tests/test_backend_ops.py."""
import numba
import numpy as np
import pytest

from cpu.ffn import swiglu

from .quant_data import dequantized, min_term_correction, quantized_x, random_rows, type_id


def silu(v):
    with np.errstate(over="ignore"):   # exp(−v) → inf for very negative v: silu → −0, as intended
        return v / (1.0 + np.exp(-v))


def reference(gate, wg, up, wu, x):
    """h from the float64 gate/up products, with x as the kernels see it (int8-rounded per 256
    block) for quantised weights."""
    def product(name, w):
        xr = quantized_x(name, x)
        wd = dequantized(name, w, x.shape[1])
        return xr @ wd.T + min_term_correction(name, w, x).T, np.abs(xr) @ np.abs(wd).T

    g, mg = product(gate, wg)
    u, mu = product(up, wu)
    # |Δh| ≤ |silu'|·|Δg|·|u| + |silu(g)|·|Δu|, with |silu'| < 1.1 and |Δ| ≤ 1e-4 of the magnitudes
    tol = 1.1 * 1e-4 * mg * np.abs(u) + np.abs(silu(g)) * 1e-4 * mu + 1e-30
    return silu(g) * u, tol


def test_swiglu_rejects_mismatched_inputs():
    rng = np.random.default_rng(0)
    wg, wu = random_rows("Q4_K", 4, 512, rng), random_rows("Q4_K", 5, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    with pytest.raises(ValueError, match="w_gate has 4 rows but w_up has 5"):
        swiglu(type_id("Q4_K"), wg, type_id("Q4_K"), wu, x, np.empty((2, 4), np.float32))
    with pytest.raises(ValueError, match=r"h_out: expected shape \(2, 4\)"):
        swiglu(type_id("Q4_K"), wg, type_id("Q4_K"), wu[:4], x, np.empty((2, 5), np.float32))
    with pytest.raises(ValueError, match="w_up: a Q6_K row"):
        swiglu(type_id("Q4_K"), wg, type_id("Q6_K"), wu[:4], x, np.empty((2, 4), np.float32))


@pytest.mark.parametrize("n", [1, 3])
def test_row_tiles_longer_than_one_silu_pass(n):
    """Tiles of more than SILU_ROWS rows: their SiLU·up runs in passes, the last one partial."""
    from cpu.ffn import SILU_ROWS
    from cpu.matvec import n_tiles_for
    rows = (SILU_ROWS + 7) * n_tiles_for(10**6, numba.get_num_threads())
    rng = np.random.default_rng(5)
    wg, wu = random_rows("Q4_K", rows, 256, rng), random_rows("Q6_K", rows, 256, rng)
    x = rng.standard_normal((n, 256)).astype(np.float32)
    h = np.full((n, rows), np.nan, np.float32)
    swiglu(type_id("Q4_K"), wg, type_id("Q6_K"), wu, x, h)
    want, tol = reference("Q4_K", wg, "Q6_K", wu, x)
    assert np.all(np.abs(h - want) <= tol)
