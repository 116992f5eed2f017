"""cpu.moe: router top-k + renormalised softmax against numpy, the expert-grouped MoE FFN against
a per-row numpy float64 reference (weights dequantised by gguf-py), per-row bit identity, and the
one-call fused kernel against the expert-by-expert path, bit for bit."""
import dataclasses

import numpy as np
import pytest

import cpu.decoded_moe
import cpu.moe
import cpu.moe_kernel
from cpu.moe import expert_groups, moe_ffn, route
from cpu.moe_kernel import group_slots
from cpu.ggml_types import F32
from hybrid.weights import DenseFFN, Experts, Matrix, MoEFFN

from .quant_data import (DECODED_TYPES, QUANT_TYPES, dequantized, min_term_correction, quantized_x, random_rows,
                         type_id)

D, F, F_SHARED, E, K = 256, 256, 512, 6, 2


# ---- routing -----------------------------------------------------------------------------------

def numpy_route(logits, k):
    """llama.cpp's order of operations: softmax over all experts, top-k of p, p / Σ_top-k p."""
    z = logits.astype(np.float64)
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    top = np.argsort(-p, axis=1, kind="stable")[:, :k]
    chosen = np.take_along_axis(p, top, axis=1)
    return top, chosen / chosen.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("k", [1, 3, 8, 10])
def test_route_matches_softmax_top_k_renormalised(k):
    logits = (np.random.default_rng(k).standard_normal((16, 10)) * 3).astype(np.float32)
    experts, weights = route(logits, k)
    want_experts, want_weights = numpy_route(logits, k)
    np.testing.assert_array_equal(experts, want_experts)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-6, atol=1e-7)
    assert weights.dtype == np.float32 and experts.shape == (16, k)


def test_route_ties_go_to_the_lower_index():
    logits = np.array([[1, 3, 3, 0, 3], [2, 2, 2, 2, 2], [-1, 5, -1, -1, 5]], np.float32)
    experts, weights = route(logits, 3)
    np.testing.assert_array_equal(experts, [[1, 2, 4], [0, 1, 2], [1, 4, 0]])
    np.testing.assert_allclose(weights[1], [1 / 3] * 3, rtol=1e-6)


def test_route_survives_huge_and_nan_logits():
    logits = np.array([[1e30, -1e30, 0, 1e30], [np.nan, 1, np.nan, 2]], np.float32)
    experts, weights = route(logits, 2)
    np.testing.assert_array_equal(experts[0], [0, 3])
    np.testing.assert_allclose(weights[0], [0.5, 0.5])
    assert len(set(experts[1])) == 2 and all(0 <= e < 4 for e in experts[1])   # valid, distinct


@pytest.mark.parametrize("k", [0, 5])
def test_route_rejects_bad_k(k):
    with pytest.raises(ValueError, match="experts per token"):
        route(np.zeros((2, 4), np.float32), k)


def test_expert_groups_cover_every_slot_once():
    experts = np.array([[3, 1], [1, 0], [0, 3], [1, 2]])
    groups = list(expert_groups(experts))
    assert [e for e, _, _ in groups] == [0, 1, 2, 3]
    seen = np.zeros_like(experts)
    for e, rows, ranks in groups:
        assert list(rows) == sorted(rows)
        assert (experts[rows, ranks] == e).all()
        seen[rows, ranks] += 1
    assert (seen == 1).all()


# ---- the FFN -----------------------------------------------------------------------------------

def float_matrix(values: np.ndarray, name: str) -> Matrix:
    values = np.ascontiguousarray(values, np.float32)
    return Matrix(name, F32.id, values.view(np.uint8), rows=values.shape[0], cols=values.shape[1])


def make_ffn(gate_up: str, down: str, fused: bool, shared: bool, rng, n_ff: int = F):
    """A random MoE FFN record (like hybrid.weights binds) plus its float64 weights for the oracle."""
    F = n_ff  # noqa: N806 (the experts' rows; the module's F by default)
    def experts(name, kind, rows, cols):
        data = random_rows(kind, E * rows, cols, rng)
        return Experts(name, type_id(kind), data.reshape(E, rows, -1), rows, cols)

    if fused:   # one {D, 2F, E} tensor; the halves are per-expert row slices, as weights.py binds them
        both = experts("gate_up", gate_up, 2 * F, D)
        gate = Experts("gate", both.wtype, both.data[:, :F], F, D)
        up = Experts("up", both.wtype, both.data[:, F:], F, D)
    else:
        gate, up = experts("gate", gate_up, F, D), experts("up", gate_up, F, D)
    dn = experts("down", down, D, F)
    router = float_matrix(rng.standard_normal((E, D)) * 0.2, "router")
    sh = sh_gate = None
    if shared:
        sh = DenseFFN(*(Matrix(n, type_id(t), random_rows(t, r, c, rng), r, c) for n, t, r, c in
                        [("sh_gate", gate_up, F_SHARED, D), ("sh_up", gate_up, F_SHARED, D),
                         ("sh_down", down, D, F_SHARED)]))
        sh_gate = float_matrix(rng.standard_normal((1, D)) * 0.1, "sh_gate_inp")
    return MoEFFN(router, gate, up, dn, K, sh, sh_gate)


def as_f64(kind_id, data, cols):
    """Float64 weights, and the type whose activation rounding the kernel gives this kind's input."""
    name = next(n for n in ("F32", "F16", "BF16", *QUANT_TYPES, *DECODED_TYPES) if type_id(n) == kind_id)
    return dequantized(name, np.ascontiguousarray(data), cols), name


def silu(v):
    return v / (1.0 + np.exp(-v))


def reference_swiglu_down(gate, up, down, x):
    """W_down(SiLU(W_gate x) ⊙ W_up x) in float64 with each input rounded as the kernels see it
    (llama.cpp's rounding for each weight type), and the magnitude
    Σ|W_down|·|h| that bounds the error."""
    (wg, q_g), (wu, q_u), (wd, q_d) = (as_f64(m.wtype, m.data, m.cols) for m in (gate, up, down))
    g = quantized_x(q_g, x) @ wg.T + min_term_correction(q_g, np.ascontiguousarray(gate.data), x).T
    u = quantized_x(q_u, x) @ wu.T + min_term_correction(q_u, np.ascontiguousarray(up.data), x).T
    h = silu(g) * u
    hr = quantized_x(q_d, h.astype(np.float32))
    y = hr @ wd.T + min_term_correction(q_d, np.ascontiguousarray(down.data), h.astype(np.float32)).T
    return y, np.abs(hr) @ np.abs(wd).T


def reference_moe(ffn: MoEFFN, x: np.ndarray):
    """Row by row: float64 routing, then the weighted experts and the gated shared expert."""
    x64 = x.astype(np.float64)
    router = ffn.router.data.view(np.float32).astype(np.float64)
    out, mag = np.zeros_like(x64), np.zeros_like(x64)
    for i in range(len(x)):
        experts, weights = numpy_route((x64[i:i + 1] @ router.T), ffn.n_used)
        for e, w in zip(experts[0], weights[0]):
            y, m = reference_swiglu_down(*(Matrix("", s.wtype, s.data[e], s.rows, s.cols)
                                           for s in (ffn.gate, ffn.up, ffn.down)), x[i:i + 1])
            out[i] += w * y[0]
            mag[i] += w * m[0]
    if ffn.shared is not None:
        y, m = reference_swiglu_down(ffn.shared.gate, ffn.shared.up, ffn.shared.down, x)
        g = 1 / (1 + np.exp(-(x64 @ ffn.shared_gate.data.view(np.float32)[0].astype(np.float64))))
        out += g[:, None] * y
        mag += g[:, None] * m
    return out, mag


CASES = [("Q4_K", "Q6_K", False, True), ("Q8_0", "Q8_0", True, True), ("Q5_K", "Q4_0", False, False),
         ("F16", "BF16", True, True), ("F32", "F32", False, True), ("Q4_K", "Q4_K", True, False),
         # the low-bit SIMD types (the one MoE kernel of every ROW_READERS type: no extra compile)
         ("IQ4_XS", "Q3_K", True, True), ("Q4_K", "Q2_K", False, True),
         # the types with the newest row dots (Q4_1/Q5_1 on Q8_1 activations, IQ1_M), alone and
         # mixed with others (as real low-bit mixes are); cpu.decoded_moe, which these once took,
         # is forced in test_decoded_experts_run_in_one_kernel_call_whatever_the_threads
         ("Q4_1", "Q5_1", True, False), ("Q4_K", "IQ1_M", False, True),
         # 32-element types with SIMD row dots (the one all-types kernel: no variant of its own)
         ("MXFP4", "Q5_0", True, False),
         # grid types with SIMD row dots (the same kernel)
         ("IQ3_XXS", "IQ3_S", True, False), ("IQ1_S", "IQ3_XXS", False, True)]


@pytest.mark.parametrize("gate_up, down, fused, shared", CASES)
def test_moe_ffn_matches_per_row_float64_reference(gate_up, down, fused, shared):
    rng = np.random.default_rng(7)
    ffn = make_ffn(gate_up, down, fused, shared, rng)
    x = rng.standard_normal((5, D)).astype(np.float32)
    out = np.full((5, D), np.nan, np.float32)
    experts = moe_ffn(ffn, x, out)
    want, magnitude = reference_moe(ffn, x)
    np.testing.assert_array_equal(experts, numpy_route(x.astype(np.float64) @
                                                       ffn.router.data.view(np.float32).T, K)[0])
    # float32 sums and (quantised types) activation rounding flips of a few elements
    assert np.all(np.abs(out - want) <= 5e-4 * magnitude + 1e-6)
    assert np.abs(out).max() > 10 * np.abs(out - want).max()          # the check is not vacuous


@pytest.mark.parametrize("gate_up, down", [("Q4_K", "Q6_K"), ("Q8_0", "Q4_0"), ("F16", "F32"), ("IQ4_XS", "Q3_K")])
def test_each_row_has_the_bits_of_a_one_row_call(gate_up, down):
    rng = np.random.default_rng(3)
    ffn = make_ffn(gate_up, down, fused=True, shared=True, rng=rng)
    x = rng.standard_normal((9, D)).astype(np.float32)
    out = np.empty((9, D), np.float32)
    moe_ffn(ffn, x, out)
    for i in range(9):
        one = np.empty((1, D), np.float32)
        moe_ffn(ffn, x[i:i + 1], one)
        assert np.array_equal(one[0].view(np.uint32), out[i].view(np.uint32)), i


def test_each_selected_expert_is_run_once_over_all_its_rows(monkeypatch):
    # float experts take the expert-by-expert path: one swiglu per distinct selected expert
    rng = np.random.default_rng(5)
    ffn = make_ffn("F16", "F16", fused=False, shared=False, rng=rng)
    x = rng.standard_normal((12, D)).astype(np.float32)
    calls = []
    real = cpu.moe.swiglu

    def counting(wtype_g, w_g, wtype_u, w_u, xs, h):
        calls.append(len(xs))
        real(wtype_g, w_g, wtype_u, w_u, xs, h)

    monkeypatch.setattr(cpu.moe, "swiglu", counting)
    experts = moe_ffn(ffn, x, np.empty((12, D), np.float32))
    chosen, counts = np.unique(experts, return_counts=True)
    assert sorted(calls) == sorted(counts.tolist()) and sum(calls) == 12 * K
    assert len(calls) == len(chosen) < 12 * K


def test_quantised_experts_run_in_one_kernel_call(monkeypatch):
    rng = np.random.default_rng(5)
    ffn = make_ffn("Q4_K", "Q6_K", fused=True, shared=True, rng=rng)
    fused, per_expert = [], []
    real_fused, real_swiglu = cpu.moe.routed_experts, cpu.moe.swiglu
    monkeypatch.setattr(cpu.moe, "routed_experts", lambda *a, **kw: (fused.append(1), real_fused(*a, **kw)))
    monkeypatch.setattr(cpu.moe, "swiglu", lambda *a: (per_expert.append(1), real_swiglu(*a)))
    moe_ffn(ffn, rng.standard_normal((6, D)).astype(np.float32), np.empty((6, D), np.float32))
    assert len(fused) == 1 and len(per_expert) == 1          # the one swiglu: the shared expert


@pytest.mark.parametrize("gate_up, down", [("Q4_1", "Q5_1"), ("Q4_K", "IQ1_M")])
def test_decoded_experts_run_in_one_kernel_call_whatever_the_threads(gate_up, down, monkeypatch):
    """cpu.decoded_moe, forced: every quantised type now has a row dot, so no layer routes there by
    itself (it stays for a type added with a decoder and no reader yet)."""
    rng = np.random.default_rng(5)
    ffn = make_ffn(gate_up, down, fused=True, shared=False, rng=rng)
    x = rng.standard_normal((7, D)).astype(np.float32)
    monkeypatch.setattr(cpu.moe, "_uses_decoded", lambda wtypes: True)
    calls, real = [], cpu.moe.routed_experts_decoded
    monkeypatch.setattr(cpu.moe, "routed_experts_decoded", lambda *a: (calls.append(1), real(*a))[1])
    want = np.empty((7, D), np.float32)
    moe_ffn(ffn, x, want)
    assert len(calls) == 1
    for threads in (1, 3, 64):                   # tiles follow the thread count: the bits do not
        monkeypatch.setattr(cpu.decoded_moe.numba, "get_num_threads", lambda: threads)
        got = np.empty((7, D), np.float32)
        moe_ffn(ffn, x, got)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), threads


FUSED_CASES = [("Q4_K", "Q6_K", True), ("Q8_0", "Q4_0", False), ("Q5_K", "Q8_0", True), ("Q6_K", "Q4_K", False)]


@pytest.mark.parametrize("gate_up, down, fused", FUSED_CASES)
@pytest.mark.parametrize("threads", [1, 3, 64])
def test_one_call_kernel_has_the_bits_of_expert_by_expert_calls(gate_up, down, fused, threads, monkeypatch):
    """The fused kernel against the swiglu + matvec per expert path, bit for bit, for any split
    of the work into (group, row tile) items (the tile count follows the thread count)."""
    rng = np.random.default_rng(11)
    ffn = make_ffn(gate_up, down, fused, shared=False, rng=rng)
    x = rng.standard_normal((13, D)).astype(np.float32)
    x[3] = x[1]                                   # two rows with the same experts share every group
    logits = x @ ffn.router.data.view(np.float32).T
    experts, weights = route(np.ascontiguousarray(logits), K)
    want = np.full((13, D), np.nan, np.float32)
    cpu.moe._run_expert_by_expert(ffn, x, experts, weights, want)
    monkeypatch.setattr(cpu.moe.numba, "get_num_threads", lambda: threads)
    got = np.full((13, D), np.nan, np.float32)
    assert cpu.moe._run_fused(ffn, x, experts, weights, got)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert np.abs(got).max() > 0


def test_group_slots_order_pairs_by_expert_rows_ascending():
    experts = np.array([[3, 1], [1, 0], [0, 3], [1, 2], [5, 3]])
    slot_row, slot_of, group_start, group_expert = group_slots(experts, 7)
    np.testing.assert_array_equal(group_expert, [0, 1, 2, 3, 5])
    np.testing.assert_array_equal(group_start, [0, 2, 5, 6, 9, 10])
    np.testing.assert_array_equal(slot_row, [1, 2, 0, 1, 3, 3, 0, 2, 4, 4])
    for i in range(5):
        for rank in range(2):
            s = slot_of[i * 2 + rank]
            assert slot_row[s] == i
            g = np.searchsorted(group_start, s, side="right") - 1
            assert group_expert[g] == experts[i, rank]


def test_float_experts_are_left_to_the_per_expert_path():
    ffn = make_ffn("F32", "Q8_0", fused=False, shared=False, rng=np.random.default_rng(2))
    x = np.ones((1, D), np.float32)
    assert not cpu.moe._run_fused(ffn, x, np.zeros((1, K), np.int64), np.full((1, K), 0.5, np.float32),
                                  np.empty((1, D), np.float32))


def test_moe_ffn_rejects_mismatched_buffers():
    ffn = make_ffn("Q8_0", "Q8_0", fused=False, shared=False, rng=np.random.default_rng(0))
    x = np.zeros((2, D), np.float32)
    with pytest.raises(ValueError, match="out"):
        moe_ffn(ffn, x, np.zeros((3, D), np.float32))
    with pytest.raises(ValueError, match="x"):
        moe_ffn(ffn, x.astype(np.float64), np.zeros((2, D), np.float32))


def test_gate_and_up_that_round_x_differently_run_expert_by_expert():
    """Q4_K gate (x as Q8_K) with Q8_0 up (x as Q8_0): the one-call kernel quantises x once for
    both, so it refuses the layer and moe_ffn runs it expert by expert, each product meeting x
    rounded for its own type (the float64 reference rounds the same way)."""
    rng = np.random.default_rng(9)
    ffn = make_ffn("Q4_K", "Q6_K", fused=False, shared=True, rng=rng)
    ffn = dataclasses.replace(ffn, up=make_ffn("Q8_0", "Q6_K", fused=False, shared=False, rng=rng).up)
    x = rng.standard_normal((3, D)).astype(np.float32)
    experts, weights = route(x @ ffn.router.data.view(np.float32).T, K)
    assert not cpu.moe._run_fused(ffn, x, experts, weights, np.empty((3, D), np.float32))
    kinds = (ffn.gate, ffn.up, ffn.down)
    with pytest.raises(ValueError, match="round activations alike"):
        cpu.moe_kernel.routed_experts(tuple(m.wtype for m in kinds), *(m.data.reshape(-1, m.data.shape[-1]) for m in kinds),
                                      np.zeros((3, E), np.int64), F, x, experts, weights, np.empty((3, D), np.float32),
                                      1, 0)
    out = np.full((3, D), np.nan, np.float32)
    moe_ffn(ffn, x, out)
    want, magnitude = reference_moe(ffn, x)
    assert np.all(np.abs(out - want) <= 5e-4 * magnitude + 1e-6)
