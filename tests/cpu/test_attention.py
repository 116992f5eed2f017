"""KV append + causal GQA attention with the sigmoid gate vs numpy float64 (MODEL_FORMAT.md §3.3)."""
import numpy as np
import pytest

from cpu.attention import gated_attention, kv_append


def at(start, n):
    """The positions of n rows from start, as the ops take them."""
    return np.arange(start, start + n, dtype=np.int64)


def ref_attention(q, gate, K, V, n_before, kv_head_of):
    """q, gate (n, H, d); K, V (P, Hkv, d) all positions so far. Row t sees 0..n_before+t."""
    n, H, d = q.shape
    out = np.zeros((n, H * d))
    for t in range(n):
        for h in range(H):
            g = kv_head_of(h)
            keys = K[: n_before + t + 1, g].astype(np.float64)
            s = keys @ q[t, h].astype(np.float64) / np.sqrt(d)
            p = np.exp(s - s.max())
            p /= p.sum()
            o = p @ V[: n_before + t + 1, g].astype(np.float64)
            out[t, h * d:(h + 1) * d] = o / (1.0 + np.exp(-gate[t, h].astype(np.float64)))
    return out


def make_case(rng, n, n_before, H, Hkv, d, n_ctx):
    P = n_before + n
    q = rng.standard_normal((n, H, d)).astype(np.float32)
    gate = rng.standard_normal((n, H, d)).astype(np.float32)
    qg = np.concatenate([rng.standard_normal((n, H, d)).astype(np.float32), gate], -1)  # [junk | gate]
    K = (rng.standard_normal((P, Hkv, d)) * 2).astype(np.float32)
    V = rng.standard_normal((P, Hkv, d)).astype(np.float32)
    # Cache beyond what this call fills is poison: reading it would turn outputs into NaN.
    k_cache = np.full((Hkv, n_ctx, d), np.nan, dtype=np.float32)
    v_cache = np.full((Hkv, n_ctx, d), np.nan, dtype=np.float32)
    kv_append(K[:n_before], V[:n_before], k_cache, v_cache, at(0, n_before))
    return q, gate, qg, K, V, k_cache, v_cache


@pytest.mark.parametrize("n,n_before,H,Hkv,d", [(1, 0, 2, 1, 16), (4, 0, 4, 2, 32), (3, 5, 8, 2, 64), (2, 7, 6, 3, 8)])
def test_attention_matches_reference(n, n_before, H, Hkv, d):
    rng = np.random.default_rng(n * 100 + n_before * 10 + H)
    q, gate, qg, K, V, kc, vc = make_case(rng, n, n_before, H, Hkv, d, n_ctx=n_before + n + 3)
    kv_append(K[n_before:], V[n_before:], kc, vc, at(n_before, n))
    out = np.full((n, H * d), np.nan, dtype=np.float32)
    gated_attention(q, qg, kc, vc, at(n_before, n), out)
    group = H // Hkv
    expect = ref_attention(q, gate, K, V, n_before, lambda h: h // group)
    np.testing.assert_allclose(out, expect, rtol=2e-5, atol=2e-6)


def test_kv_append_layout_is_head_major():
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 4)).astype(np.float32)
    v = rng.standard_normal((3, 2, 4)).astype(np.float32)
    kc = np.zeros((2, 8, 4), np.float32)
    vc = np.zeros((2, 8, 4), np.float32)
    kv_append(k, v, kc, vc, at(5, 3))
    np.testing.assert_array_equal(kc[:, 5:8], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(vc[:, 5:8], v.transpose(1, 0, 2))
    assert not kc[:, :5].any()


def test_causal_mask_and_gqa_mapping():
    """Row t must ignore later keys of the same call; head h reads kv head h // (H/Hkv)."""
    rng = np.random.default_rng(4)
    n, H, Hkv, d = 3, 4, 2, 8
    q, gate, qg, K, V, kc, vc = make_case(rng, n, 0, H, Hkv, d, n_ctx=n)
    kv_append(K, V, kc, vc, at(0, n))
    out = np.empty((n, H * d), np.float32)
    gated_attention(q, qg, kc, vc, at(0, n), out)
    # the first row sees only position 0: softmax of one score is 1, output = gated V[0]
    sig = 1 / (1 + np.exp(-gate[0].astype(np.float64)))
    for h in range(H):
        np.testing.assert_allclose(out[0, h * d:(h + 1) * d], V[0, h // 2] * sig[h], rtol=1e-5, atol=1e-6)
    tiled = ref_attention(q, gate, K, V, 0, lambda h: h % Hkv)     # the wrong pairing differs
    assert not np.allclose(out, tiled, atol=1e-3)
    no_mask = ref_attention(q, gate, K, V, n - 1, lambda h: h // 2)[:1]
    assert not np.allclose(out[:1], no_mask, atol=1e-3)


def test_batched_rows_equal_one_row_calls_bit_for_bit():
    rng = np.random.default_rng(5)
    n, H, Hkv, d = 5, 4, 2, 32
    q, gate, qg, K, V, kc, vc = make_case(rng, n, 3, H, Hkv, d, n_ctx=16)
    kv_append(K[3:], V[3:], kc, vc, at(3, n))
    batched = np.empty((n, H * d), np.float32)
    gated_attention(q, qg, kc, vc, at(3, n), batched)
    for t in range(n):
        one = np.empty((1, H * d), np.float32)
        gated_attention(q[t:t + 1], qg[t:t + 1], kc, vc, at(3 + t, 1), one)
        np.testing.assert_array_equal(one[0], batched[t])
