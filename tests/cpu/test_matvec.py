"""cpu.matvec: every type × N against float64 references, per-slot bit identity, odd shapes,
integer-overflow extremes, and input validation."""
import numpy as np
import pytest

from cpu.activations import format_of
from cpu.decoded import matvec_decoded
from cpu.matvec import matvec
from cpu.ggml_types import BY_NAME

from .quant_data import (DECODED_TYPES, QUANT_TYPES, TYPES, dequantized, extreme_rows, min_term_correction, quantized_x,
                         random_rows, type_id)

COLS = {"Q4_K": 512, "Q5_K": 512, "Q6_K": 512, "Q8_0": 352, "Q4_0": 352, "F32": 70, "F16": 70, "BF16": 70,
        **{name: 768 if BY_NAME[name].block_elems == 256 else 352 for name in DECODED_TYPES}}
# Q8_0/Q4_0 at 352 = one full 256-column span + a 3-block tail; 37 rows = not a multiple of any tile
# (nor of cpu.decoded.ROW_TILE); the decoded types: 3 or 11 blocks


def run(name, w, x):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)   # poisoned: every entry must be written
    matvec(type_id(name), w, x, out)
    assert np.isfinite(out).all()
    return out


def check_against_references(name, w, x, out):
    """Tight against the product with x rounded as llama.cpp rounds it for this type (integer sums
    are exact, only float32 rounding remains); quantised types also within the documented bound
    of the exact product: Σ|W|·(d/2 + 127·|d − fp16(d)|), d = max|x_block|/127."""
    wd = dequantized(name, w, x.shape[1])
    xr = quantized_x(name, x)
    rel = 1e-4 if name in QUANT_TYPES else 1e-5
    want = wd @ xr.T + min_term_correction(name, w, x)
    assert np.all(np.abs(out.T - want) <= rel * (np.abs(wd) @ np.abs(xr).T) + 1e-30)
    if name in QUANT_TYPES:
        block = format_of(type_id(name)).block
        n, cols = x.shape
        pad = np.concatenate([x, np.zeros((n, -cols % block), np.float32)], axis=1)
        step = np.repeat(np.abs(pad).reshape(n, -1, block).max(axis=2) / 127, block, axis=1)[:, :cols]
        half_scale = format_of(type_id(name)).half_scale
        bound = np.abs(wd) @ (step.T * (0.5 + (127 * 2.0 ** -11 if half_scale else 0))) \
            + 1e-4 * (np.abs(wd) @ np.abs(x.astype(np.float64)).T)
        assert np.all(np.abs(out.T - wd @ x.astype(np.float64).T) <= bound)


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_matches_float64_reference(name, n):
    rng = np.random.default_rng(100 * n + len(name))
    w = random_rows(name, 37, COLS[name], rng)
    x = rng.standard_normal((n, COLS[name])).astype(np.float32)
    check_against_references(name, w, x, run(name, w, x))


@pytest.mark.parametrize("name", TYPES)
def test_each_slot_has_the_bits_of_a_one_input_call(name):
    rng = np.random.default_rng(7)
    w = random_rows(name, 21, COLS[name], rng)
    x = rng.standard_normal((9, COLS[name])).astype(np.float32)
    singles = np.concatenate([run(name, w, x[i:i + 1]) for i in range(9)])
    for n in (1, 2, 3, 4, 5, 7, 8, 9):
        assert np.array_equal(run(name, w, x[:n]).view(np.uint32), singles[:n].view(np.uint32)), n


@pytest.mark.parametrize("name", TYPES)
@pytest.mark.parametrize("rows", [1, 5])
def test_one_block_per_row(name, rows):
    rng = np.random.default_rng(rows)
    cols = max(1, BY_NAME[name].block_elems)
    w = random_rows(name, rows, cols, rng)
    x = rng.standard_normal((3, cols)).astype(np.float32)
    check_against_references(name, w, x, run(name, w, x))


@pytest.mark.parametrize("name", QUANT_TYPES)
@pytest.mark.parametrize("top", [True, False])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_largest_products_neither_overflow_nor_saturate(name, top, sign):
    """Every weight and every activation at full scale and of one sign: every code is ±127 (x
    = ±max), so the result must equal the float64 product with the rounded x (exact for Q8_K's
    float scale; Q8_0's is fp16(1/127)) to float32 rounding."""
    w = extreme_rows(name, 3, 2048, top)
    x = np.full((2, 2048), sign, np.float32)
    want = dequantized(name, w, 2048) @ quantized_x(name, x).T + min_term_correction(name, w, x)
    assert np.allclose(run(name, w, x).T, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("name", ["Q4_K", "IQ4_XS", "Q5_0"])
def test_non_finite_input_shows_in_its_slot_only(name):
    rng = np.random.default_rng(3)
    w = random_rows(name, 4, 512, rng)
    x = rng.standard_normal((2, 512)).astype(np.float32)
    x[1, 300] = np.nan
    out = np.empty((2, 4), np.float32)
    matvec(type_id(name), w, x, out)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).all()


def _inputs():
    rng = np.random.default_rng(0)
    return random_rows("Q4_K", 4, 512, rng), rng.standard_normal((2, 512)).astype(np.float32), np.empty((2, 4), np.float32)


@pytest.mark.parametrize("mutate, message", [
    (lambda w, x, o: (w, x.astype(np.float64), o), "x: expected a 2-D float32"),
    (lambda w, x, o: (w, np.ones((2, 1024), np.float32)[:, ::2], o), "x: must be C-contiguous"),
    (lambda w, x, o: (w, x[:0], o[:0]), "at least one row"),
    (lambda w, x, o: (w.view(np.int8), x, o), "uint8"),
    (lambda w, x, o: (w.reshape(-1), x, o), "2-D uint8"),
    (lambda w, x, o: (np.concatenate([w, w])[::2], x, o), "rows must be C-contiguous"),
    (lambda w, x, o: (np.ascontiguousarray(w[:, :-2]), x, o), "bytes"),
    (lambda w, x, o: (w, x[:, :300].copy(), o), "multiple of 256"),
    (lambda w, x, o: (w, x, np.empty((2, 5), np.float32)), r"out: expected shape \(2, 4\)"),
    (lambda w, x, o: (w, x, np.empty((4, 2), np.float32).T), "out: must be C-contiguous"),
    (lambda w, x, o: (w, x, np.zeros((2, 4), np.float16)), "out: expected a 2-D float32"),
])
def test_bad_inputs_raise_clear_errors(mutate, message):
    w, x, out = mutate(*_inputs())
    with pytest.raises(ValueError, match=message):
        matvec(type_id("Q4_K"), w, x, out)


def test_unsupported_type_and_read_only_output():
    w, x, out = _inputs()
    with pytest.raises(ValueError, match="unsupported tensor type TQ1_0"):
        matvec(34, w, x, out)
    out.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        matvec(type_id("Q4_K"), w, x, out)


def _decoded_path(name, w, x):
    out = np.full((x.shape[0], w.shape[0]), np.nan, np.float32)
    matvec_decoded(type_id(name), w, x, out)
    return out


@pytest.mark.parametrize("name", ["IQ4_XS", "Q4_1"])
@pytest.mark.parametrize("path", [run, _decoded_path], ids=["matvec", "cpu.decoded"])
def test_decoded_types_give_the_same_bits_at_any_thread_count(name, path):
    """Rows are split into tiles by thread count; a row's bits must not depend on it: through
    matvec (the row dots, for every type now) and through cpu.decoded called directly (no type
    routes there by itself any more; it stays for a type with a decoder and no row dot)."""
    import numba
    rng = np.random.default_rng(9)
    w = random_rows(name, 37, COLS[name], rng)
    x = rng.standard_normal((4, COLS[name])).astype(np.float32)
    before = numba.get_num_threads()
    try:
        outs = []
        for threads in sorted({1, before}):
            numba.set_num_threads(threads)
            outs.append(path(name, w, x))
    finally:
        numba.set_num_threads(before)
    assert all(np.array_equal(o.view(np.uint32), outs[0].view(np.uint32)) for o in outs)
