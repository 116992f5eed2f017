"""cpu.activations: the activation rounding each weight type gets, checked against numpy
statements of ggml's quantisers (tests/reference/llama_cpp_rounding.py), and what it buys."""
import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import quants

from cpu import activations as act
from cpu.ggml_types import BY_NAME, DECODED
from cpu.matvec import matvec, quantize_activations

from tests.reference import llama_cpp_rounding as ref

from .quant_data import TYPES, dequantized, quantized_x, random_rows, type_id


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def hard_inputs(n, cols, seed):
    """Normals at scales 1e-3..1e3, plus exact halves (x·127/amax = k + 0.5), all-zero blocks,
    a lone tiny value, a huge one, and heavy tails."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((n, cols)) * rng.uniform(1e-3, 1e3, (n, 1))).astype(np.float32)
    x[0, :256] = np.append(np.arange(254) - 126.5, [127, -0.5])
    x[0, 256:288] = np.append(np.arange(31) - 15.5, [127])        # a Q8_0 block of exact halves
    x[1, :64] = 0
    x[2, 40] = 1e-30
    x[3, 7] = 3e30
    x[4] = (rng.standard_t(2, cols) * 3).astype(np.float32)
    return x


@pytest.mark.parametrize("n, cols", [(5, 512), (7, 1024)])
def test_q8_0_is_ggml_x86_bit_for_bit(n, cols):
    x = hard_inputs(n, cols, cols)
    xq, d, _ = act.quantize(act.Q8_0, x)
    want_q, want_d = ref.q8_0(x)
    assert np.array_equal(xq, want_q)
    assert np.array_equal(bits(d), bits(want_d))


@pytest.mark.parametrize("n, cols", [(5, 512), (7, 1024)])
def test_q8_k_is_ggml_bit_for_bit_up_to_its_sign_convention(n, cols):
    """ggml's codes and d carry the sign of −(value of largest magnitude); ours are d ≥ 0: the
    same numbers with both signs flipped, so every product q·d has the same bits."""
    x = hard_inputs(n, cols, cols + 1)
    xq, d, bs = act.quantize(act.Q8_K, x)
    want_q, want_d, want_bs = ref.q8_k(x)
    sign = np.where(want_d < 0, -1, 1)                                  # (n, blocks)
    assert np.array_equal(bits(d.T * sign), bits(want_d))
    assert np.array_equal(xq * np.repeat(sign, 256, axis=1), want_q)
    assert np.array_equal(bs * np.repeat(sign, 16, axis=1), want_bs)


def test_q8_1_is_ggml_x86_bit_for_bit():
    """Q8_1 (no kernel reads it yet; Q4_1/Q5_1 weights will): Q8_0's codes and d, and
    s = fp16(d·Σq) from the unrounded d, stored as [d, s] pairs."""
    x = hard_inputs(5, 512, 11)
    xq, d, _ = act.quantize(act.Q8_1, x)
    want_q, want_d, want_s = ref.q8_1(x)
    assert np.array_equal(xq, want_q)
    assert np.array_equal(bits(d[:, 0::2]), bits(want_d)) and np.array_equal(bits(d[:, 1::2]), bits(want_s))


def test_partial_chunks_and_zero_padding():
    """352 columns: one full chunk, then three Q8_0 blocks; codes past the columns are 0."""
    x = hard_inputs(5, 352, 5)
    xq, d, bs = act.quantize(act.Q8_0, x)
    want_q, want_d = ref.q8_0(x)
    assert np.array_equal(xq[:, :352], want_q) and not xq[:, 352:].any()
    assert np.array_equal(bits(d[:, :11]), bits(want_d)) and not d[:, 11:].any()
    assert np.array_equal(bs, xq.reshape(5, -1, 16).astype(np.int32).sum(axis=2))


def test_half_rounding_is_numpy_float16():
    rng = np.random.default_rng(0)
    u = np.concatenate([rng.integers(0, 0x7F800000, 200_000, dtype=np.uint32),
                        np.float32([0, 2 ** -24, 2 ** -25, 3 * 2 ** -25, 2 ** -14, 65504, 65519.99, 65520,
                                    1e30]).view(np.uint32)])
    x = u.view(np.float32).reshape(1, -1)
    x = np.concatenate([x, np.zeros((1, -x.shape[1] % 32), np.float32)], axis=1)
    # amax of a one-element-per-block input is that element: d = half(x/127)
    blocks = np.zeros((x.shape[1], 32), np.float32)
    blocks[:, 0] = x[0]
    _, d, _ = act.quantize(act.Q8_0, blocks.reshape(1, -1))
    with np.errstate(over="ignore"):
        want = (x[0] / np.float32(127)).astype(np.float16).astype(np.float32)
    assert np.array_equal(bits(d[0]), bits(want))


@pytest.mark.parametrize("name", ["F16", "BF16"])
def test_float_weights_meet_x_rounded_to_their_type(name):
    """An identity-like weight row picks out one rounded activation each."""
    cols = 64
    eye = np.eye(cols, dtype=np.float32)
    w = np.ascontiguousarray(quants.quantize(eye, T[name])).view(np.uint8).reshape(cols, -1)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((2, cols)) * 1e3).astype(np.float32)
    x[0, :3] = [np.float32(1 + 2 ** -11), np.float32(1 + 3 * 2 ** -11), 65519.0]   # F16 ties, the top half
    out = np.empty((2, cols), np.float32)
    with np.errstate(over="ignore"):
        matvec(type_id(name), w, x, out)
    want = quantized_x(name, x).astype(np.float32)
    assert np.array_equal(bits(out), bits(want))


def test_the_table_names_llama_cpp_vec_dot_types():
    """A few rows of ggml-cpu's type_traits_cpu, and every type the kernels read has a format."""
    expect = {T.Q8_0: "Q8_0", T.Q4_0: "Q8_0", T.Q5_0: "Q8_0", T.IQ4_NL: "Q8_0", T.MXFP4: "Q8_0",
              T.Q4_1: "Q8_1", T.Q5_1: "Q8_1", T.Q4_K: "Q8_K", T.Q6_K: "Q8_K", T.Q2_K: "Q8_K",
              T.IQ4_XS: "Q8_K", T.F16: "F16", T.BF16: "BF16", T.F32: "F32"}
    for t, name in expect.items():
        assert act.format_of(int(t)).name == name
    for name in TYPES:
        assert act.FORMAT_CODE[type_id(name)] == act.format_of(type_id(name)).code


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0"])
@pytest.mark.parametrize("n", [1, 4])
def test_q8_0_products_are_the_rounded_x_product_to_float32_order(name, n):
    """Against float64 products of the weights with llama.cpp-rounded x: only float32
    accumulation differs (a few ulps of the magnitude over these 128 blocks)."""
    rng = np.random.default_rng(n)
    cols = 4096
    w = random_rows(name, 24, cols, rng)
    x = (rng.standard_t(3, (n, cols)) * 0.5).astype(np.float32)
    out = np.empty((n, 24), np.float32)
    matvec(type_id(name), w, x, out)
    wd, xr = dequantized(name, w, cols), quantized_x(name, x)
    magnitude = np.abs(wd) @ np.abs(xr).T
    assert np.all(np.abs(out.T - wd @ xr.T) <= 2e-6 * magnitude)


def test_per_32_rounding_is_closer_to_float64_than_per_256_on_heavy_tails():
    """What the table is for: on heavy-tailed activations (outlier features), Q8_0's per-32
    rounding gives a smaller product error than Q8_K's per-256 on the same Q8_0 weights."""
    rng = np.random.default_rng(7)
    cols, rows, n = 2048, 64, 16
    w = random_rows("Q8_0", rows, cols, rng)
    wd = dequantized("Q8_0", w, cols)
    x = (rng.standard_t(2, (n, cols))).astype(np.float32)
    exact = wd @ x.astype(np.float64).T
    err = {}
    for fmt in (act.Q8_0, act.Q8_K):
        qs, d = ref.q8_0(x) if fmt == act.Q8_0 else ref.q8_k(x)[:2]
        xd = qs.astype(np.float64) * np.repeat(d.astype(np.float64), fmt.block, axis=1)
        err[fmt.name] = np.sqrt(np.mean((wd @ xd.T - exact) ** 2))
    out = np.empty((n, rows), np.float32)
    matvec(type_id("Q8_0"), w, x, out)
    ours = np.sqrt(np.mean((out.T - exact) ** 2))
    assert err["Q8_0"] < 0.8 * err["Q8_K"]
    assert ours < 0.8 * err["Q8_K"]


def test_quantize_activations_follows_the_weight_type():
    x = hard_inputs(5, 512, 3)
    for name, fmt in (("Q4_K", act.Q8_K), ("Q6_K", act.Q8_K), ("Q8_0", act.Q8_0), ("Q4_0", act.Q8_0)):
        got = quantize_activations(type_id(name), x)
        want = act.quantize(fmt, x)
        assert all(np.array_equal(a, b) for a, b in zip(got, want))
    assert act.quantize(act.Q8_K, x)[1].shape == (2, 5) and act.quantize(act.Q8_0, x)[1].shape == (5, 16)
    assert act.quantize(act.Q8_1, x)[1].shape == (5, 32)
    with pytest.raises(ValueError, match="not an int8"):
        act.quantize(act.F16, x)


@pytest.mark.parametrize("name", [t.name for t in DECODED])
def test_decoded_types_meet_x_as_llama_cpp_rounds_it(name):
    """cpu.decoded multiplies decoded weights by `dequantized` x: it must be the float form of the
    int8 activations ggml gives that type (Q8_0 / Q8_1 / Q8_K, the numpy statement)."""
    x = np.random.default_rng(3).standard_t(3, size=(3, 512)).astype(np.float32)
    t = BY_NAME[name].id
    ours = act.dequantized(act.format_of(t), x)
    np.testing.assert_array_equal(ours, ref.round_activations(x, t).astype(np.float32))
