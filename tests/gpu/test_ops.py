"""gpu.ops vs cpu.ops on the same inputs (each op of both against its float64 reference:
tests/test_backend_ops.py), plus the property lossless drafting needs: an n-row call gives every
row the bits of a one-row call, in-place calls, fused ops against their parts, kernel paths.
Shapes are tiny and odd (not multiples of 32) because the CUDA simulator is slow and the lanes
past a segment's end must add nothing."""
import sys

import numpy as np
import pytest
from numba import cuda

import cpu.ops
import gpu.ops
from gpu.runtime import memory
from gpu import simulated
from cpu import ggml_types as gt
from hybrid.forward import MoEStats
from hybrid.weights import DenseFFN, Experts, Matrix, MoEFFN
from tests.gpu.test_matvec import random_weights

EPS = 1e-6
TOL = dict(rtol=2e-5, atol=2e-6)


@pytest.fixture(scope="module", autouse=True)
def quick_simulator():
    """A faster simulator for these kernel-heavy tests (nothing changes on a real GPU): it runs
    each CUDA thread as a Python thread and every barrier waits for all of them; with the
    default 5 ms GIL switch interval a barrier costs ~10 ms, so switch faster. (Faster
    switching also made the simulator's shared-array race frequent: tests/conftest.py fixes
    that for every test.)"""
    if not simulated():
        yield
        return
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


def rng(seed):
    return np.random.default_rng(seed)


def f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def dev(a):
    return cuda.to_device(np.ascontiguousarray(a))


def bits_equal(a, b):
    return np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


# --- norms ----------------------------------------------------------------------------------------

# 300: wider than the entries a block holds in registers under the simulator (a warp × ROW_VALUES)
@pytest.mark.parametrize("D", [80, 300])
def test_rms_norm_matches_cpu_in_and_out_of_place(D):
    x = f32(rng(1).standard_normal((3, D)) * 3)
    w = f32(rng(2).standard_normal(D))
    want = np.empty_like(x)
    cpu.ops.rms_norm(x, w, EPS, want)
    out = dev(np.full_like(x, np.nan))
    gpu.ops.rms_norm(dev(x), dev(w), EPS, out)
    np.testing.assert_allclose(out.copy_to_host(), want, **TOL)
    inplace = dev(x)
    gpu.ops.rms_norm(inplace, dev(w), EPS, inplace)
    np.testing.assert_allclose(inplace.copy_to_host(), want, **TOL)


@pytest.mark.parametrize("D", [80, 300])
def test_add_rms_norm_has_the_bits_of_add_then_norm_and_matches_cpu(D):
    x = f32(rng(31).standard_normal((3, D)) * 3)
    y = f32(rng(32).standard_normal((3, D)))
    w = f32(rng(33).standard_normal(D))
    want_x, want = x.copy(), np.empty_like(x)
    cpu.ops.add_rms_norm(want_x, y, w, EPS, want)
    np.testing.assert_array_equal(want_x, x + y)
    # the fused kernel against the two GPU kernels it replaces: the same bits
    two_x, two = dev(x), dev(np.full_like(x, np.nan))
    gpu.ops.add_inplace(two_x, dev(y))
    gpu.ops.rms_norm(two_x, dev(w), EPS, two)
    got_x, got = dev(x), dev(np.full_like(x, np.nan))
    gpu.ops.add_rms_norm(got_x, dev(y), dev(w), EPS, got)
    assert bits_equal(got_x.copy_to_host(), two_x.copy_to_host())
    assert bits_equal(got.copy_to_host(), two.copy_to_host())
    np.testing.assert_allclose(got.copy_to_host(), want, **TOL)


def test_head_rms_norm_reads_the_query_half_and_works_in_place():
    n, H, d = 2, 3, 40
    qg = f32(rng(3).standard_normal((n, H, 2 * d)))
    w = f32(rng(4).standard_normal(d))
    want = np.empty((n, H, d), np.float32)
    cpu.ops.head_rms_norm(qg, w, EPS, want)
    out = dev(np.full((n, H, d), np.nan, np.float32))
    gpu.ops.head_rms_norm(dev(qg), dev(w), EPS, out)
    np.testing.assert_allclose(out.copy_to_host(), want, **TOL)
    k = f32(qg[:, :, :d])
    inplace = dev(k)
    gpu.ops.head_rms_norm(inplace, dev(w), EPS, inplace)
    np.testing.assert_allclose(inplace.copy_to_host(), want, **TOL)


# --- rope, attention ------------------------------------------------------------------------------


def attention_inputs(n, H=4, Hkv=2, d=40, n_ctx=12, seed=10):
    r = rng(seed)
    q = f32(r.standard_normal((n, H, d)))
    qg = f32(r.standard_normal((n, H, 2 * d)))
    k = f32(r.standard_normal((n, Hkv, d)))
    v = f32(r.standard_normal((n, Hkv, d)))
    cache = f32(r.standard_normal((2, Hkv, n_ctx, d)))      # stale contents past n_before + n
    return q, qg, k, v, cache


def gpu_attention(q, qg, k, v, cache, n_before):
    k_cache, v_cache = dev(cache[0]), dev(cache[1])
    pos = dev(np.arange(n_before, n_before + q.shape[0], dtype=np.int64))
    gpu.ops.kv_append(dev(k), dev(v), k_cache, v_cache, pos)
    out = dev(np.full((q.shape[0], q.shape[1] * q.shape[2]), np.nan, np.float32))
    gpu.ops.gated_attention(dev(q), dev(qg), k_cache, v_cache, pos, out)
    return out.copy_to_host(), k_cache.copy_to_host(), v_cache.copy_to_host()


def cpu_attention(q, qg, k, v, cache, n_before):
    """The CPU ops' append and attention: (out, k_cache, v_cache)."""
    k_cache, v_cache = cache[0].copy(), cache[1].copy()
    pos = np.arange(n_before, n_before + q.shape[0], dtype=np.int64)
    cpu.ops.kv_append(k, v, k_cache, v_cache, pos)
    out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
    cpu.ops.gated_attention(q, qg, k_cache, v_cache, pos, out)
    return out, k_cache, v_cache


def test_attention_rows_are_bit_identical_to_one_row_calls():
    n, n_before = 3, 4
    q, qg, k, v, cache = attention_inputs(n, seed=11)
    together, _, _ = gpu_attention(q, qg, k, v, cache, n_before)
    # row 2 alone: the cache already holds rows 0, 1 of this call
    cache_before = cache.copy()
    cache_before[0][:, n_before:n_before + 2] = k[:2].transpose(1, 0, 2)
    cache_before[1][:, n_before:n_before + 2] = v[:2].transpose(1, 0, 2)
    alone, _, _ = gpu_attention(q[2:], qg[2:], k[2:], v[2:], cache_before, n_before + 2)
    assert bits_equal(together[2:], alone)


def test_attention_over_many_parts_matches_cpu_and_batches_of_rows_keep_the_bits(monkeypatch):
    """Rows far enough in that their positions split into parts longer than the shortest one,
    merged in order; and a call cut into batches of rows (as calls of more than ROWS_PER_CALL
    rows are) gives the bits of one launch."""
    import gpu.attention
    n, n_before = 3, gpu.attention.PARTS * gpu.attention.PART_MIN + 5      # parts longer than PART_MIN
    q, qg, k, v, cache = attention_inputs(n, n_ctx=n_before + n, seed=13)
    want, _, _ = cpu_attention(q, qg, k, v, cache, n_before)
    whole, _, _ = gpu_attention(q, qg, k, v, cache, n_before)
    np.testing.assert_allclose(whole, want, **TOL)
    monkeypatch.setattr(gpu.attention, "ROWS_PER_CALL", 2)
    batched, _, _ = gpu_attention(q, qg, k, v, cache, n_before)
    assert bits_equal(whole, batched)


# --- gated delta net ------------------------------------------------------------------------------

def gdn_inputs(n, Hk=2, Hv=4, d=12, K=4, seed=12):
    r = rng(seed)
    C = 2 * Hk * d + Hv * d
    return dict(
        mix=f32(r.standard_normal((n, C))), conv_w=f32(r.standard_normal((K, C)) * 0.5),
        conv=f32(r.standard_normal((K - 1, C))), u=f32(r.standard_normal((n, C)) * 0.3),
        b=f32(r.standard_normal((n, Hv))), alpha=f32(r.standard_normal((n, Hv)) * 3),
        ssm_a=f32(-np.exp(r.standard_normal(Hv))), dt_bias=f32(r.standard_normal(Hv)),
        ssm=f32(r.standard_normal((Hv, d, d)) * 0.1), Hk=Hk)


@pytest.mark.parametrize("n", [3, 10])   # one thread per channel; a thread per (token, channel)
def test_conv1d_silu_matches_cpu_with_and_without_ring(n):
    g = gdn_inputs(n)
    C = g["mix"].shape[1]
    for ring_slots in (0, n + 1):
        conv_cpu, out_cpu = g["conv"].copy(), np.empty((n, C), np.float32)
        ring_cpu = np.zeros((ring_slots, 3, C), np.float32)
        cpu.ops.conv1d_silu(g["mix"], g["conv_w"], conv_cpu, out_cpu, ring_cpu)
        conv, out, ring = dev(g["conv"]), dev(np.full((n, C), np.nan, np.float32)), dev(np.zeros_like(ring_cpu))
        gpu.ops.conv1d_silu(dev(g["mix"]), dev(g["conv_w"]), conv, out, ring)
        np.testing.assert_allclose(out.copy_to_host(), out_cpu, **TOL)
        np.testing.assert_array_equal(conv.copy_to_host(), conv_cpu)
        np.testing.assert_array_equal(ring.copy_to_host(), ring_cpu)


@pytest.mark.parametrize("grouped", [False, True])
def test_gated_delta_rule_matches_cpu_and_fills_the_ring(grouped):
    n = 3
    g = gdn_inputs(n, seed=13 + grouped)
    Hv, d, _ = g["ssm"].shape
    args = (g["Hk"], grouped, g["b"], g["alpha"], g["ssm_a"], g["dt_bias"])
    ssm_cpu, out_cpu, ring_cpu = g["ssm"].copy(), np.empty((n, Hv * d), np.float32), np.zeros((n, Hv, d, d), np.float32)
    cpu.ops.gated_delta_rule(g["u"], *args, ssm_cpu, out_cpu, ring_cpu)
    ssm, out, ring = dev(g["ssm"]), dev(np.full((n, Hv * d), np.nan, np.float32)), dev(np.zeros_like(ring_cpu))
    gpu.ops.gated_delta_rule(dev(g["u"]), g["Hk"], grouped, *(dev(a) for a in args[2:]), ssm, out, ring)
    np.testing.assert_allclose(out.copy_to_host(), out_cpu, **TOL)
    np.testing.assert_allclose(ssm.copy_to_host(), ssm_cpu, **TOL)
    np.testing.assert_allclose(ring.copy_to_host(), ring_cpu, **TOL)
    assert bits_equal(ring.copy_to_host()[-1], ssm.copy_to_host())


@pytest.mark.parametrize("n", [3, 10])
def test_gdn_tokens_together_equal_one_at_a_time_bit_for_bit(n):
    g = gdn_inputs(n, seed=20)
    Hv, d, _ = g["ssm"].shape
    C = g["mix"].shape[1]
    no_ring_ssm, no_ring_conv = memory.zeros((0, Hv, d, d)), memory.zeros((0, 3, C))

    def run(rows, conv, ssm):
        m = len(rows)
        u = dev(np.zeros((m, C), np.float32))
        o = dev(np.zeros((m, Hv * d), np.float32))
        gpu.ops.conv1d_silu(dev(g["mix"][rows]), dev(g["conv_w"]), conv, u, no_ring_conv)
        gpu.ops.l2_norm_heads(u, 2 * g["Hk"], d, EPS)
        gpu.ops.gated_delta_rule(u, g["Hk"], False, dev(g["b"][rows]), dev(g["alpha"][rows]), dev(g["ssm_a"]),
                                 dev(g["dt_bias"]), ssm, o, no_ring_ssm)
        return o.copy_to_host()

    conv_all, ssm_all = dev(g["conv"]), dev(g["ssm"])
    together = run(list(range(n)), conv_all, ssm_all)
    conv_one, ssm_one = dev(g["conv"]), dev(g["ssm"])
    one_by_one = np.concatenate([run([t], conv_one, ssm_one) for t in range(n)])
    assert bits_equal(together, one_by_one)
    assert bits_equal(ssm_all.copy_to_host(), ssm_one.copy_to_host())
    assert bits_equal(conv_all.copy_to_host(), conv_one.copy_to_host())


def mixer_inputs(n, grouped, ring, seed):
    g = gdn_inputs(n, seed=seed)
    Hv, d, _ = g["ssm"].shape
    C = g["mix"].shape[1]
    r = rng(seed + 100)
    g.update(z=f32(r.standard_normal((n, Hv * d))), norm_w=f32(1 + 0.1 * r.standard_normal(d)), grouped=grouped,
             ring_conv=np.zeros((n if ring else 0, 3, C), np.float32),
             ring_ssm=np.zeros((n if ring else 0, Hv, d, d), np.float32))
    return g


def run_mixer(ops, g, rows, state, to=lambda a: a, back=lambda a: a, separate=False):
    """(y, o, ring_conv, ring_ssm) of ops.gdn_mixer on the given token rows, state = (conv, ssm)
    in place; separate=True runs its four ops one by one instead."""
    Hv, d, _ = g["ssm"].shape
    m, C = len(rows), g["mix"].shape[1]
    u, o, y = (to(np.zeros(shape, np.float32)) for shape in ((m, C), (m, Hv * d), (m, Hv * d)))
    rings = tuple(to(g[k].copy()) for k in ("ring_conv", "ring_ssm"))
    mix, z, b, alpha = (to(g[k][rows]) for k in ("mix", "z", "b", "alpha"))
    weights = tuple(to(g[k]) for k in ("conv_w", "ssm_a", "dt_bias", "norm_w"))
    if separate:
        ops.conv1d_silu(mix, weights[0], state[0], u, rings[0])
        ops.l2_norm_heads(u, 2 * g["Hk"], d, EPS)
        ops.gated_delta_rule(u, g["Hk"], g["grouped"], b, alpha, weights[1], weights[2], state[1], o, rings[1])
        ops.gated_rms_norm(o, z, weights[3], EPS, y)
    else:
        ops.gdn_mixer(mix, z, b, alpha, weights, state, rings, g["Hk"], g["grouped"], EPS, u, o, y)
    return tuple(back(a) for a in (y, o, *rings))


@pytest.mark.parametrize("n, grouped, ring", [(3, False, True), (3, True, False), (10, True, True)])
def test_gdn_mixer_has_the_bits_of_its_four_ops_and_matches_cpu(n, grouped, ring):
    """3 tokens: the fused launches (conv + norm + gates, delta rule + output norm); 10: the
    parallel conv, then the fused delta rule."""
    g = mixer_inputs(n, grouped, ring, seed=30)
    rows = list(range(n))
    state_cpu = (g["conv"].copy(), g["ssm"].copy())
    want = run_mixer(cpu.ops, g, rows, state_cpu)
    host = lambda a: a.copy_to_host()                       # noqa: E731
    state_fused, state_ops = (dev(g["conv"]), dev(g["ssm"])), (dev(g["conv"]), dev(g["ssm"]))
    fused = run_mixer(gpu.ops, g, rows, state_fused, dev, host)
    separate = run_mixer(gpu.ops, g, rows, state_ops, dev, host, separate=True)
    for a, b in zip((*fused, *state_fused), (*separate, *state_ops)):
        assert bits_equal(a if isinstance(a, np.ndarray) else host(a), b if isinstance(b, np.ndarray) else host(b))
    for a, b in zip(fused, want):
        np.testing.assert_allclose(a, b, **TOL)
    np.testing.assert_allclose(state_fused[1].copy_to_host(), state_cpu[1], **TOL)


def test_gdn_mixer_tokens_together_equal_one_at_a_time_bit_for_bit():
    """Also: each call leaves the output norm's arrival counters at zero for the next."""
    n = 4
    g = mixer_inputs(n, False, False, seed=31)
    host = lambda a: a.copy_to_host()                       # noqa: E731
    state_all, state_one = (dev(g["conv"]), dev(g["ssm"])), (dev(g["conv"]), dev(g["ssm"]))
    together = run_mixer(gpu.ops, g, list(range(n)), state_all, dev, host)[0]
    one_by_one = np.concatenate([run_mixer(gpu.ops, g, [t], state_one, dev, host)[0] for t in range(n)])
    assert bits_equal(together, one_by_one)
    assert all(bits_equal(a.copy_to_host(), b.copy_to_host()) for a, b in zip(state_all, state_one))


# --- residual, embeddings, FFN ----------------------------------------------------------------------


def quantized_rows(name, rows, cols, seed):
    """Random raw rows of a ggml type (every quant bit pattern, sane fp16 scales)."""
    return random_weights(gt.by_name(name), rows, cols, rng(seed))


@pytest.mark.parametrize("name", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q3_K",
                                  "Q2_K", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "IQ3_XXS", "IQ3_S",
                                  "IQ2_XXS"])
def test_dequantize_rows_on_the_device_match_the_cpu(name):
    t = gt.by_name(name)
    cols = 512 if t.block_elems == 256 else 96
    w = quantized_rows(name, 5, cols, seed=23)
    ids = np.array([4, 0, 4], np.int64)
    want = cpu.ops.dequantize_rows(t.id, w, ids, cols)
    got = gpu.ops.dequantize_rows(t.id, dev(w), ids, cols).copy_to_host()
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    host_table = gpu.ops.dequantize_rows(t.id, w, ids, cols).copy_to_host()   # table left on the host
    np.testing.assert_array_equal(host_table, want)


def test_mxfp4_scales_at_the_e8m0_edges_match_the_cpu_bit_for_bit():
    """MXFP4's block scale 2**(e − 128) is a subnormal for e = 0, 1 (a path of its own, which
    random blocks rarely reach) and near the float range's top for e = 250."""
    t = gt.MXFP4
    w = quantized_rows("MXFP4", 6, 96, seed=27)
    w.reshape(6, 3, 17)[:, :, 0] = np.array([0, 1, 2, 127, 128, 250], np.uint8)[:, None]
    ids = np.arange(6, dtype=np.int64)
    want = cpu.ops.dequantize_rows(t.id, w, ids, 96)
    assert np.isfinite(want).all() and (want[:2] != 0).any()
    assert bits_equal(gpu.ops.dequantize_rows(t.id, dev(w), ids, 96).copy_to_host(), want)


def test_matvec_and_swiglu_of_host_weights_are_the_cpu_kernels_bit_for_bit():
    t = gt.Q8_0
    D, F = 64, 48
    gate, up = quantized_rows("Q8_0", F, D, 24), quantized_rows("Q8_0", F, D, 25)
    x = f32(rng(26).standard_normal((3, D)))
    want_h = np.empty((3, F), np.float32)
    cpu.ops.swiglu(t.id, gate, t.id, up, x, want_h)
    h = dev(np.zeros((3, F), np.float32))
    gpu.ops.swiglu(t.id, gate, t.id, up, dev(x), h)
    assert bits_equal(h.copy_to_host(), want_h)
    want = np.empty((3, F), np.float32)
    cpu.ops.matvec(t.id, gate, x, want)
    out = dev(np.zeros((3, F), np.float32))
    gpu.ops.matvec(t.id, gate, dev(x), out)
    assert bits_equal(out.copy_to_host(), want)


def tiny_moe(place_on_device: bool, D=32, F=32, E=4, k=2, seed=30):
    r = rng(seed)
    f32_id = gt.F32.id

    def matrix(name, rows, cols, scale=0.3):
        data = f32(r.standard_normal((rows, cols)) * scale).view(np.uint8)
        return Matrix(name, f32_id, dev(data) if place_on_device else data, rows, cols)

    def experts(name, rows, cols):
        data = f32(r.standard_normal((E, rows, cols)) * 0.3).view(np.uint8)
        return Experts(name, f32_id, dev(data) if place_on_device else data, rows, cols)

    shared = DenseFFN(matrix("sg", F, D), matrix("su", F, D), matrix("sd", D, F))
    return MoEFFN(router=matrix("router", E, D, 1.0), gate=experts("g", F, D), up=experts("u", F, D),
                  down=experts("d", D, F), n_used=k, shared=shared, shared_gate=matrix("sgate", 1, D))


def test_moe_ffn_on_the_device_and_through_the_host_match_the_cpu():
    x = f32(rng(31).standard_normal((3, 32)))
    host_moe = tiny_moe(False)
    want = np.empty_like(x)
    want_experts = cpu.ops.moe_ffn(host_moe, x, want)
    for moe in (host_moe, tiny_moe(True)):
        out = dev(np.full_like(x, np.nan))
        stats = MoEStats()
        gpu.ops.moe_ffn(moe, dev(x), out, stats)
        assert stats.rows == 3 and stats.expert_bytes_read == len(np.unique(want_experts)) * moe.expert_bytes
        np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-5)


# --- memory -----------------------------------------------------------------------------------------

def test_copy_handles_strided_views_and_host_sources():
    a = f32(rng(32).standard_normal((3, 10)))
    dst = memory.zeros((3, 16))
    memory.copy(dst[:, 3:13], dev(a))
    memory.copy(dst[:, :2], a[:, :2])
    want = np.zeros((3, 16), np.float32)
    want[:, 3:13] = a
    want[:, :2] = a[:, :2]
    np.testing.assert_array_equal(dst.copy_to_host(), want)
    kv = memory.zeros((2, 8, 4))
    src = f32(rng(33).standard_normal((2, 8, 4)))
    memory.copy(kv[:, :5], dev(src)[:, :5])
    np.testing.assert_array_equal(kv.copy_to_host()[:, :5], src[:, :5])
    assert not kv.copy_to_host()[:, 5:].any()


def test_host_copies_take_src_at_the_call_and_convert_its_dtype():
    """Copies from host arrays are direct driver calls: each must land with the values src had
    at its call (the caller changes src at once), to_host must return fresh arrays, and a
    host src of another dtype is converted, never copied byte for byte."""
    src = np.arange(12, dtype=np.float32).reshape(3, 4)
    outs = [memory.zeros((3, 4)) for _ in range(4)]
    for out in outs:
        memory.copy(out, src)
        src += 100.0
    got = [memory.to_host(out) for out in outs]
    for k, g in enumerate(got):
        np.testing.assert_array_equal(g, np.arange(12, dtype=np.float32).reshape(3, 4) + 100 * k)
    positions = memory.zeros((5,), np.int64)
    memory.copy(positions, np.arange(7, 12))
    np.testing.assert_array_equal(memory.to_host(positions), np.arange(7, 12))
    memory.copy(outs[0], np.full((3, 4), 2.5, np.float64))
    np.testing.assert_array_equal(memory.to_host(outs[0]), np.full((3, 4), 2.5, np.float32))


# --- greedy picks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("passes", [2.9, 1.1])
def test_argmax_rows_merges_parts_in_id_order(passes):
    """Rows wider than one block's pass are cut into parts (2.9 passes: three parts; 1.1 times
    the most parts: parts of two passes): ties across parts keep the lowest id, probabilities
    sum every part."""
    from cpu.argmax import PICK_COLUMNS, PICK_ID, PICK_MAX, PICK_P
    from gpu.argmax import MAX_PARTS, PASS, part_span
    V = int(passes * PASS) if passes > 2 else int(passes * MAX_PARTS * PASS)
    assert -(-V // part_span(V)) > 1
    x = f32(rng(43).standard_normal((3, V)) * 3)
    x[0, [V - 1, PASS + 5, 2 * PASS + 1]] = 40.0             # a tie in three parts
    x[1, :] = -np.inf
    x[1, V - 2] = 1.5                                          # the only value, in the last part
    x[2, 0] = 30.0                                             # the first entry of the first part
    want = np.empty((3, PICK_COLUMNS), np.float32)
    cpu.ops.argmax_rows(x, want)
    out = dev(np.zeros((3, PICK_COLUMNS), np.float32))
    gpu.ops.argmax_rows(dev(x), out)
    got = out.copy_to_host()
    np.testing.assert_array_equal(got[:, PICK_ID], want[:, PICK_ID])
    assert got[0, PICK_ID] == PASS + 5
    np.testing.assert_allclose(got[:, PICK_P], want[:, PICK_P], rtol=1e-5)
    np.testing.assert_array_equal(got[:, PICK_MAX], want[:, PICK_MAX])


# --- the best logits of a row (sampling) ----------------------------------------------------------

def _top_pairs(out, count):
    """Each row's (id, bits) pairs in id order: the op leaves the order of its output free."""
    return [sorted(zip(r[:count].tolist(), r[count:].tolist())) for r in out]


def test_top_logits_of_a_row_too_flat_for_the_shared_list():
    """More equal logits than the shared list holds: the rounds read the row itself."""
    from gpu.top_logits import LIST_CAP
    x = np.full((1, LIST_CAP + 50), -1.5, np.float32)
    x[0, [LIST_CAP + 7, 3]] = 4.0
    want = np.empty((1, 10), np.uint32)
    cpu.ops.top_logits(x, want)
    out = dev(np.zeros((1, 10), np.uint32))
    gpu.ops.top_logits(dev(x), out)
    got = _top_pairs(out.copy_to_host(), 5)
    assert got == _top_pairs(want, 5)
    assert [i for i, _ in got[0]] == [0, 1, 2, 3, LIST_CAP + 7]
