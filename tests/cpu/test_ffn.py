"""cpu.ffn.swiglu: fused gate·up against numpy float64, slot identity, validation."""
import numpy as np
import pytest

from cpu.ffn import swiglu

from .quant_data import QUANT_TYPES, dequantized, quantized_x, random_rows, type_id


def silu(v):
    with np.errstate(over="ignore"):   # exp(−v) → inf for very negative v: silu → −0, as intended
        return v / (1.0 + np.exp(-v))


def reference(gate, wg, up, wu, x):
    """h from the float64 gate/up products, with x as the kernels see it (int8-rounded per 256
    block) for quantised weights."""
    def product(name, w):
        xr = quantized_x(name, x)
        wd = dequantized(name, w, x.shape[1])
        return xr @ wd.T, np.abs(xr) @ np.abs(wd).T

    g, mg = product(gate, wg)
    u, mu = product(up, wu)
    # |Δh| ≤ |silu'|·|Δg|·|u| + |silu(g)|·|Δu|, with |silu'| < 1.1 and |Δ| ≤ 1e-4 of the magnitudes
    tol = 1.1 * 1e-4 * mg * np.abs(u) + np.abs(silu(g)) * 1e-4 * mu + 1e-30
    return silu(g) * u, tol


PAIRS = [("Q4_K", "Q4_K"), ("Q5_K", "Q6_K"), ("Q8_0", "Q4_0"), ("Q6_K", "Q8_0"), ("F16", "BF16"), ("F32", "Q4_K")]


@pytest.mark.parametrize("gate, up", PAIRS)
@pytest.mark.parametrize("n", [1, 3, 4, 8])
def test_swiglu_matches_numpy(gate, up, n):
    rng = np.random.default_rng(n)
    cols = 512
    wg, wu = random_rows(gate, 19, cols, rng), random_rows(up, 19, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    h = np.full((n, 19), np.nan, np.float32)
    swiglu(type_id(gate), wg, type_id(up), wu, x, h)
    want, tol = reference(gate, wg, up, wu, x)
    assert np.all(np.abs(h - want) <= tol)


@pytest.mark.parametrize("gate, up", PAIRS)
def test_each_slot_has_the_bits_of_a_one_input_call(gate, up):
    rng = np.random.default_rng(11)
    wg, wu = random_rows(gate, 13, 512, rng), random_rows(up, 13, 512, rng)
    x = rng.standard_normal((8, 512)).astype(np.float32)
    h = np.empty((8, 13), np.float32)
    swiglu(type_id(gate), wg, type_id(up), wu, x, h)
    for i in range(8):
        one = np.empty((1, 13), np.float32)
        swiglu(type_id(gate), wg, type_id(up), wu, x[i:i + 1], one)
        assert np.array_equal(one[0].view(np.uint32), h[i].view(np.uint32)), i


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
    rows = (SILU_ROWS + 7) * n_tiles_for(10**6)
    rng = np.random.default_rng(5)
    wg, wu = random_rows("Q4_K", rows, 256, rng), random_rows("Q6_K", rows, 256, rng)
    x = rng.standard_normal((n, 256)).astype(np.float32)
    h = np.full((n, rows), np.nan, np.float32)
    swiglu(type_id("Q4_K"), wg, type_id("Q6_K"), wu, x, h)
    want, tol = reference("Q4_K", wg, "Q6_K", wu, x)
    assert np.all(np.abs(h - want) <= tol)
