"""cpu.matmul: bit-identical to cpu.matvec / cpu.ffn.swiglu for every covered type, within the
int8 bound of the float64 product, odd shapes (rows past a tile, padded slot groups, slot splits),
and the routing and checks of the entry points."""
import numpy as np
import pytest

import cpu.ops
from cpu import matmul as mm
from cpu.ffn import swiglu
from cpu.matvec import matvec, quantize_activations
from cpu.ggml_types import BY_NAME

from .quant_data import extreme_rows, random_rows, type_id
from .test_ffn import reference as swiglu_reference
from .test_matvec import check_against_references

COVERED = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0")
COLS = {"Q4_K": 768, "Q5_K": 512, "Q6_K": 768, "Q8_0": 352, "Q4_0": 352}
# 37 rows = two full 16-row tiles and a short one; Q8_0/Q4_0 at 352 columns = one 256-column span
# and a 3-block tail; n = 17 and 33 leave a padded slot group


def bits(a):
    return a.view(np.uint32)


def both(name, w, x):
    old = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    new = old.copy()                      # poisoned: every entry must be written
    matvec(type_id(name), w, x, old)
    mm.matmul(type_id(name), w, x, new)
    return old, new


@pytest.mark.parametrize("name", COVERED)
@pytest.mark.parametrize("n", [16, 17, 33, 64])
def test_matmul_has_the_bits_of_matvec_and_meets_the_int8_bound(name, n):
    rng = np.random.default_rng(10 * n + len(name))
    w = random_rows(name, 37, COLS[name], rng)
    x = rng.standard_normal((n, COLS[name])).astype(np.float32)
    old, new = both(name, w, x)
    assert np.array_equal(bits(new), bits(old))
    check_against_references(name, w, x, new)


@pytest.mark.parametrize("name", COVERED)
def test_one_block_per_row_and_few_rows(name):
    """One weight block per row, and 5 rows with 8 slot groups: the slots are split over tasks."""
    rng = np.random.default_rng(1)
    cols = BY_NAME[name].block_elems
    w = random_rows(name, 5, cols, rng)
    x = rng.standard_normal((64, cols)).astype(np.float32)
    old, new = both(name, w, x)
    assert np.array_equal(bits(new), bits(old))
    check_against_references(name, w, x, new)


@pytest.mark.parametrize("name", COVERED)
def test_wide_rows_span_several_column_slabs(name):
    """More than SLAB_BLOCKS activation blocks (and, for Q8_0/Q4_0, a tail block after them): the
    per-output sums continue across slabs in block order."""
    rng = np.random.default_rng(2)
    cols = 256 * (2 * mm.SLAB_BLOCKS + 1) + (32 if BY_NAME[name].block_elems == 32 else 0)
    w = random_rows(name, 18, cols, rng)
    x = rng.standard_normal((24, cols)).astype(np.float32)
    old, new = both(name, w, x)
    assert np.array_equal(bits(new), bits(old))


@pytest.mark.parametrize("name", ("Q4_K", "Q5_K", "Q6_K", "Q8_0"))
@pytest.mark.parametrize("top", [True, False])
def test_largest_products_neither_overflow_nor_saturate(name, top):
    w = extreme_rows(name, 3, 2048, top)
    x = np.full((16, 2048), -1.0, np.float32)
    old, new = both(name, w, x)
    assert np.array_equal(bits(new), bits(old))


@pytest.mark.parametrize("n, cols", [(16, 1024), (40, 352)])
@pytest.mark.parametrize("name", ("Q4_K", "Q8_0"))
def test_slot_quantisation_has_the_bytes_of_cpu_matvec(name, n, cols):
    """Exact halves (round half to even), zeros, the smallest and largest floats, ±inf and NaN,
    a partial last block; finite rows must match byte for byte, every scale bit for bit, in the
    grouped layout; padding slots are zeros."""
    if name == "Q4_K" and cols % 256:
        cols = 1024
    rng = np.random.default_rng(n)
    x = (rng.standard_normal((n, cols)) * rng.uniform(1e-3, 1e3, (n, 1))).astype(np.float32)
    x[0, :256] = np.append(np.arange(254) - 126.5, [127, -0.5])   # amax 127, inv 1: x·inv at exact halves
    x[1, :256] = 0
    x[2, 5] = 1e-45
    x[3, 7] = 3.4e38
    x[4, 1], x[5, 300], x[6, 9] = -np.inf, np.nan, np.inf
    xq, dx, bs = mm.quantize_slots(type_id(name), x)
    want_q, want_d, want_s = quantize_activations(type_id(name), x)
    if name == "Q4_K":      # (groups, chunks, 8) → (chunks, slots)
        got_d = dx.transpose(1, 0, 2).reshape(dx.shape[1], -1)
        assert np.array_equal(bits(got_d[:, :n]), bits(want_d)) and not got_d[:, n:].any()
    else:                   # (groups, 8, blocks) → (slots, blocks)
        got_d = dx.reshape(-1, dx.shape[2])
        assert np.array_equal(bits(got_d[:n]), bits(want_d)) and not got_d[n:].any()
    finite = np.isfinite(x).all(axis=1)
    assert np.array_equal(xq[:n][finite], want_q[finite])
    assert np.array_equal(bs[:n][finite], want_s[finite])
    assert not xq[n:].any() and not bs[n:].any()


def test_non_finite_input_shows_in_its_slot_only():
    rng = np.random.default_rng(3)
    w = random_rows("Q4_K", 20, 512, rng)
    x = rng.standard_normal((18, 512)).astype(np.float32)
    x[9, 300] = np.nan
    _, new = both("Q4_K", w, x)
    assert np.isnan(new[9]).all() and np.isfinite(np.delete(new, 9, axis=0)).all()


PAIRS = [("Q4_K", "Q4_K"), ("Q5_K", "Q6_K"), ("Q6_K", "Q8_0"), ("Q4_0", "Q4_K")]


@pytest.mark.parametrize("gate, up", PAIRS)
@pytest.mark.parametrize("n", [16, 33])
def test_swiglu_has_the_bits_of_the_fused_kernel(gate, up, n):
    rng = np.random.default_rng(n + len(gate + up))
    wg, wu = random_rows(gate, 37, 512, rng), random_rows(up, 37, 512, rng)
    x = rng.standard_normal((n, 512)).astype(np.float32)
    old, new = (np.full((n, 37), np.nan, np.float32) for _ in range(2))
    swiglu(type_id(gate), wg, type_id(up), wu, x, old)
    mm.swiglu_matmul(type_id(gate), wg, type_id(up), wu, x, new)
    assert np.array_equal(bits(new), bits(old))
    want, tol = swiglu_reference(gate, wg, up, wu, x)
    assert np.all(np.abs(new - want) <= tol)


def test_ops_route_prompt_chunks_here_and_few_slots_to_matvec(monkeypatch):
    calls = []
    monkeypatch.setattr(mm, "matmul", lambda *a: calls.append("matmul"))
    monkeypatch.setattr(mm, "swiglu_matmul", lambda *a: calls.append("swiglu_matmul"))
    rng = np.random.default_rng(0)
    w, wf = random_rows("Q4_K", 4, 256, rng), random_rows("F16", 4, 256, rng)
    for n, wtype, weights, routed in ((mm.MIN_SLOTS, "Q4_K", w, True), (mm.MIN_SLOTS - 1, "Q4_K", w, False),
                                      (mm.MIN_SLOTS, "F16", wf, False)):
        calls.clear()
        x = rng.standard_normal((n, 256)).astype(np.float32)
        cpu.ops.matvec(type_id(wtype), weights, x, np.empty((n, 4), np.float32))
        cpu.ops.swiglu(type_id(wtype), weights, type_id(wtype), weights, x, np.empty((n, 4), np.float32))
        assert calls == (["matmul", "swiglu_matmul"] if routed else []), (n, wtype)


def test_bad_inputs_raise_clear_errors():
    rng = np.random.default_rng(0)
    w = random_rows("Q4_K", 4, 512, rng)
    x = rng.standard_normal((16, 512)).astype(np.float32)
    with pytest.raises(ValueError, match=r"out: expected shape \(16, 4\)"):
        mm.matmul(type_id("Q4_K"), w, x, np.empty((16, 5), np.float32))
    with pytest.raises(ValueError, match="multiple of 256"):
        mm.matmul(type_id("Q4_K"), w, x[:, :300].copy(), np.empty((16, 4), np.float32))
    wf = random_rows("F16", 4, 512, rng)
    got, want = np.empty((16, 4), np.float32), np.empty((16, 4), np.float32)
    mm.matmul(type_id("F16"), wf, x, got)           # a type without tiles is cpu.matvec's
    matvec(type_id("F16"), wf, x, want)
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="w_gate has 4 rows but w_up has 3"):
        mm.swiglu_matmul(type_id("Q4_K"), w, type_id("Q4_K"), w[:3], x, np.empty((16, 4), np.float32))


# ---- types without tiles (to cpu.matvec: a row dot, IQ4_XS/Q3_K, or cpu.decoded, the rest) ------

DECODED_CASES = [("IQ4_XS", 768), ("Q3_K", 512), ("IQ2_S", 256), ("Q5_1", 352), ("MXFP4", 96), ("IQ1_M", 512)]


@pytest.mark.parametrize("name, cols", DECODED_CASES)
@pytest.mark.parametrize("n", [16, 33])
def test_decoded_types_chunk_has_each_slots_one_input_bits(name, cols, n):
    """A prompt chunk of a decoded type through cpu.matmul and cpu.ops: slot i has the bits of a
    one-input matvec on x[i] (chunked prefill = token-by-token), and meets the float64 product."""
    rng = np.random.default_rng(n)
    w = random_rows(name, 37, cols, rng)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    got, via_ops = np.full((n, 37), np.nan, np.float32), np.full((n, 37), np.nan, np.float32)
    mm.matmul(type_id(name), w, x, got)
    cpu.ops.matvec(type_id(name), w, x, via_ops)
    singles = np.concatenate([both(name, w, x[i:i + 1])[0] for i in range(n)])
    assert np.array_equal(bits(got), bits(singles)) and np.array_equal(bits(via_ops), bits(singles))
    check_against_references(name, w, x, got)


@pytest.mark.parametrize("gate, up", [("IQ1_M", "IQ1_M"), ("Q4_K", "IQ1_M"), ("Q4_K", "Q2_K")])
def test_decoded_swiglu_chunk_matches_per_slot_calls(gate, up):
    rng = np.random.default_rng(4)
    wg, wu = random_rows(gate, 21, 512, rng), random_rows(up, 21, 512, rng)
    x = rng.standard_normal((20, 512)).astype(np.float32)
    h = np.full((20, 21), np.nan, np.float32)
    mm.swiglu_matmul(type_id(gate), wg, type_id(up), wu, x, h)
    for i in (0, 7, 19):
        one = np.empty((1, 21), np.float32)
        swiglu(type_id(gate), wg, type_id(up), wu, x[i:i + 1], one)
        assert np.array_equal(bits(h[i:i + 1]), bits(one)), i
