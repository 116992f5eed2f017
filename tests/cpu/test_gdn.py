"""Gated DeltaNet kernels vs numpy float64 references (MODEL_FORMAT.md §3.4), plus the
stepping properties speculative decoding relies on: an n-token call equals n one-token
calls bit for bit, and snapshot ring slot i holds the state after token i."""
import numpy as np
import pytest
from numba import njit

from cpu.expf import expf
from cpu.gdn import conv1d_silu, gated_delta_rule, l2_norm_heads

EPS = 1e-6
NO_RING_SSM = np.zeros((0, 1, 1, 1), np.float32)


def no_ring_conv(K, C):
    return np.zeros((0, K - 1, C), np.float32)


# --- float64 references -------------------------------------------------------------------

def ref_conv(mix, state, w_ck):
    """mix (n, C), state (K−1, C) oldest first, w_ck (C, K) as stored in ssm_conv1d."""
    window = state.astype(np.float64)
    outs, windows = [], []
    for x in mix.astype(np.float64):
        full = np.vstack([window, x[None]])                  # (K, C), tap K−1 = current
        c = (full * w_ck.T.astype(np.float64)).sum(0)
        outs.append(c / (1 + np.exp(-c)))
        window = full[1:]
        windows.append(window.copy())
    return np.array(outs), window, windows


def ref_l2(x, eps=EPS):
    x = x.astype(np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def ref_delta(u, Hk, dk, b, alpha, ssm_a, dt_bias, ssm, grouped):
    """ssm (Hv, dv, dk) in our layout: S_j (math, key × value) = ssm[j].T."""
    Hv, dv, _ = ssm.shape
    r = Hv // Hk
    S = [ssm[j].T.astype(np.float64) for j in range(Hv)]
    outs, states = [], []
    for t in range(u.shape[0]):
        q = u[t, :Hk * dk].reshape(Hk, dk).astype(np.float64)
        k = u[t, Hk * dk:2 * Hk * dk].reshape(Hk, dk).astype(np.float64)
        v = u[t, 2 * Hk * dk:].reshape(Hv, dv).astype(np.float64)
        o = np.zeros((Hv, dv))
        for j in range(Hv):
            kh = j // r if grouped else j % Hk
            beta = 1 / (1 + np.exp(-float(b[t, j])))
            g = float(ssm_a[j]) * np.log1p(np.exp(float(alpha[t, j]) + float(dt_bias[j])))
            S[j] = np.exp(g) * S[j]
            delta = beta * (v[j] - S[j].T @ k[kh])
            S[j] = S[j] + np.outer(k[kh], delta)
            o[j] = S[j].T @ q[kh] / np.sqrt(dk)
        outs.append(o.reshape(-1))
        states.append(np.stack([s.T for s in S]))
    return np.array(outs), states


def make_gdn(rng, n, Hk=2, Hv=4, dk=8):
    C = 2 * Hk * dk + Hv * dk
    u = rng.standard_normal((n, C)).astype(np.float32)
    u[:, :2 * Hk * dk] = ref_l2(u[:, :2 * Hk * dk].reshape(n, 2 * Hk, dk)).reshape(n, -1)
    b = rng.standard_normal((n, Hv)).astype(np.float32)
    alpha = rng.standard_normal((n, Hv)).astype(np.float32)
    ssm_a = -np.exp(rng.standard_normal(Hv)).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    ssm = (rng.standard_normal((Hv, dk, dk)) * 0.3).astype(np.float32)
    return u, b, alpha, ssm_a, dt_bias, ssm


# --- conv --------------------------------------------------------------------------------

@pytest.mark.parametrize("n,K,C", [(1, 4, 24), (2, 4, 40), (7, 4, 40), (5, 2, 8)])
def test_conv_matches_reference_and_rolls_state(n, K, C):
    rng = np.random.default_rng(n * 10 + K)
    mix = rng.standard_normal((n, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    w_ck = rng.standard_normal((C, K)).astype(np.float32)
    expect, expect_state, _ = ref_conv(mix, state, w_ck)
    out = np.full((n, C), np.nan, np.float32)
    conv1d_silu(mix, np.ascontiguousarray(w_ck.T), state, out, no_ring_conv(K, C))
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, expect_state.astype(np.float32))   # pure copies of inputs


def test_conv_taps_run_oldest_to_current():
    K, C = 4, 1
    w = np.array([[1.0], [10.0], [100.0], [1000.0]], np.float32)        # tap 3 = current token
    state = np.array([[1.0], [2.0], [3.0]], np.float32)                 # oldest first
    out = np.empty((1, C), np.float32)
    conv1d_silu(np.array([[4.0]], np.float32), w, state, out, no_ring_conv(K, C))
    c = 1 + 20 + 300 + 4000
    np.testing.assert_allclose(out[0, 0], c / (1 + np.exp(-c)))
    np.testing.assert_array_equal(state[:, 0], [2.0, 3.0, 4.0])


def test_conv_n_tokens_equal_n_single_calls_and_ring_holds_windows():
    rng = np.random.default_rng(7)
    n, K, C = 6, 4, 40
    mix = rng.standard_normal((n, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    start = rng.standard_normal((K - 1, C)).astype(np.float32)
    state_all, out_all = start.copy(), np.empty((n, C), np.float32)
    ring = np.full((n + 2, K - 1, C), np.nan, np.float32)
    conv1d_silu(mix, w, state_all, out_all, ring)
    state_one = start.copy()
    for t in range(n):
        one = np.empty((1, C), np.float32)
        conv1d_silu(mix[t:t + 1], w, state_one, one, no_ring_conv(K, C))
        np.testing.assert_array_equal(one[0], out_all[t])
        np.testing.assert_array_equal(ring[t], state_one)
    np.testing.assert_array_equal(state_all, state_one)
    assert np.isnan(ring[n:]).all()                                    # slots past n untouched


# --- L2 norm -------------------------------------------------------------------------------

def test_l2_norm_heads_normalises_only_the_leading_heads():
    rng = np.random.default_rng(8)
    n, H, d, tail = 3, 4, 16, 10
    x = rng.standard_normal((n, H * d + tail)).astype(np.float32)
    x[1, :d] = 1e-9                                                     # below eps: divided by eps
    expect = x.astype(np.float64).copy()
    expect[:, :H * d] = ref_l2(x[:, :H * d].reshape(n, H, d)).reshape(n, -1)
    y = x.copy()
    l2_norm_heads(y, H, d, EPS)
    np.testing.assert_allclose(y, expect, rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(y[:, H * d:], x[:, H * d:])
    np.testing.assert_allclose(y[1, :d], 1e-9 / EPS, rtol=1e-5)


# --- delta rule ----------------------------------------------------------------------------

@pytest.mark.parametrize("dk", [8, 6])          # 6: not a multiple of 4, the one-row kernel
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("n", [1, 5])
def test_delta_rule_matches_reference(n, grouped, dk):
    rng = np.random.default_rng(n + 17 * grouped)
    Hk = 2
    u, b, alpha, ssm_a, dt_bias, ssm = make_gdn(rng, n, Hk=Hk, Hv=4, dk=dk)
    expect, states = ref_delta(u, Hk, dk, b, alpha, ssm_a, dt_bias, ssm, grouped)
    out = np.full((n, 4 * dk), np.nan, np.float32)
    gated_delta_rule(u, Hk, grouped, b, alpha, ssm_a, dt_bias, ssm, out, NO_RING_SSM)
    np.testing.assert_allclose(out, expect, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ssm, states[-1], rtol=1e-4, atol=1e-5)


def test_head_pairing_switch_changes_the_result():
    rng = np.random.default_rng(9)
    u, b, alpha, ssm_a, dt_bias, ssm = make_gdn(rng, 2, Hk=2, Hv=4, dk=8)
    outs = []
    for grouped in (False, True):
        s, out = ssm.copy(), np.empty((2, 32), np.float32)
        gated_delta_rule(u, 2, grouped, b, alpha, ssm_a, dt_bias, s, out, NO_RING_SSM)
        outs.append(out)
    assert not np.allclose(*outs, atol=1e-3)


@pytest.mark.parametrize("dk", [16, 6])
def test_delta_rule_n_tokens_equal_n_single_calls_and_ring_slots(dk):
    rng = np.random.default_rng(10)
    n, Hk, Hv = 6, 2, 4
    u, b, alpha, ssm_a, dt_bias, start = make_gdn(rng, n, Hk=Hk, Hv=Hv, dk=dk)
    state_all, out_all = start.copy(), np.empty((n, Hv * dk), np.float32)
    ring = np.full((n, Hv, dk, dk), np.nan, np.float32)
    gated_delta_rule(u, Hk, False, b, alpha, ssm_a, dt_bias, state_all, out_all, ring)
    state_one = start.copy()
    for t in range(n):
        one = np.empty((1, Hv * dk), np.float32)
        gated_delta_rule(u[t:t + 1], Hk, False, b[t:t + 1], alpha[t:t + 1], ssm_a, dt_bias,
                         state_one, one, NO_RING_SSM)
        np.testing.assert_array_equal(one[0], out_all[t])
        np.testing.assert_array_equal(ring[t], state_one)
    np.testing.assert_array_equal(state_all, state_one)


def test_conv_parallel_path_matches_serial_bit_for_bit():
    """Prompt chunks take the multi-threaded conv; it must give the serial kernel's bits."""
    from cpu.gdn import _CONV_PARALLEL_ROWS, _conv1d_silu_channels, _conv1d_silu_parallel
    rng = np.random.default_rng(7)
    n, K, C = _CONV_PARALLEL_ROWS + 3, 4, 1100          # C not a multiple of the channel block
    mix = rng.standard_normal((n, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    outs, states, rings = [], [], []
    for run in (_conv1d_silu_parallel, lambda *a: _conv1d_silu_channels(*a, 0, C)):
        st, out = state.copy(), np.full((n, C), np.nan, np.float32)
        ring = np.full((n, K - 1, C), np.nan, np.float32)
        run(mix, w, st, out, ring)
        outs.append(out), states.append(st), rings.append(ring)
    np.testing.assert_array_equal(outs[0], outs[1])
    np.testing.assert_array_equal(states[0], states[1])
    np.testing.assert_array_equal(rings[0], rings[1])
    assert not np.isnan(outs[0]).any() and not np.isnan(rings[0]).any()


@njit(cache=True)
def _silu_f32(a):
    """SiLU in float32 with the kernels' exp, one element at a time (no vectorised code)."""
    out = np.empty_like(a)
    for i in range(a.size):
        out.flat[i] = a.flat[i] / (np.float32(1.0) + expf(-a.flat[i]))
    return out


@pytest.mark.parametrize("K", [4, 3])                        # 4: the one-pass kernel; 3: the general one
@pytest.mark.parametrize("n", [1, 5, 20])                    # 20: the multi-threaded path
def test_conv_bits_are_float32_sums_in_tap_order(n, K):
    """The conv's bits are pinned: per channel 0 + w₀x₀ + w₁x₁ + … in float32 (no FMA, no
    reordering), then SiLU with cpu.expf — whatever loop order or vector width computes it, and
    with -0 sums coming out as +0. Changing any of it would change decode outputs."""
    rng = np.random.default_rng(n * 10 + K)
    C = 1100                                                  # not a multiple of any vector width
    mix = rng.standard_normal((n, C)).astype(np.float32)
    w = rng.standard_normal((K, C)).astype(np.float32)
    w[:, :8] = 0.0                                            # all-zero taps on negative inputs: −0 products
    mix[:, :8] = -1.0
    state = rng.standard_normal((K - 1, C)).astype(np.float32)
    state[:, :8] = -1.0
    window = np.vstack([state, mix])
    sums = np.zeros((n, C), np.float32)
    for j in range(K):
        sums = sums + w[j] * window[j:j + n]                  # numpy float32: one rounding per op
    out = np.full((n, C), np.nan, np.float32)
    conv1d_silu(mix, w, state, out, no_ring_conv(K, C))
    expect = _silu_f32(sums)
    np.testing.assert_array_equal(out.view(np.uint32), expect.view(np.uint32))
    assert not np.signbit(out[:, :8]).any()
