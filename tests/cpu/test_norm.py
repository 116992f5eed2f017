"""RMSNorm variants vs numpy float64 references (MODEL_FORMAT.md §3.1, §3.4 step 8)."""
import numpy as np
import pytest

from cpu.norm import gated_rms_norm, head_rms_norm, rms_norm

EPS = 1e-6


def ref_rms(x, w, eps=EPS):
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w.astype(np.float64)


def silu(z):
    z = z.astype(np.float64)
    return z / (1.0 + np.exp(-z))


def poisoned(shape):
    return np.full(shape, np.nan, dtype=np.float32)


def test_rms_norm_in_place_and_eps_matters():
    x = np.full((1, 8), 1e-4, dtype=np.float32)
    w = np.ones(8, dtype=np.float32)
    expect = ref_rms(x, w, eps=1e-6)
    rms_norm(x, w, 1e-6, x)          # out aliases x
    np.testing.assert_allclose(x, expect, rtol=1e-5)
    assert x[0, 0] < 0.1             # eps dominates a tiny vector: not normalised to 1


def test_head_rms_norm_in_place():
    rng = np.random.default_rng(2)
    k = rng.standard_normal((2, 3, 8)).astype(np.float32)
    w = rng.standard_normal(8).astype(np.float32)
    expect = ref_rms(k, w)
    head_rms_norm(k, w, EPS, k)
    np.testing.assert_allclose(k, expect, rtol=2e-6, atol=2e-6)


def test_gated_rms_norm_norms_per_head_then_gates():
    rng = np.random.default_rng(3)
    n, H, d = 3, 4, 16
    o = rng.standard_normal((n, H * d)).astype(np.float32)
    z = (rng.standard_normal((n, H * d)) * 2).astype(np.float32)
    w = rng.standard_normal(d).astype(np.float32)
    out = poisoned((n, H * d))
    gated_rms_norm(o, z, w, EPS, out)
    expect = ref_rms(o.reshape(n, H, d), w).reshape(n, H * d) * silu(z)
    np.testing.assert_allclose(out, expect, rtol=1e-5, atol=1e-6)
    # gate-then-norm would cancel the gate's scale per head; make sure we did not do that
    wrong = ref_rms((o * silu(z)).reshape(n, H, d), w).reshape(n, H * d)
    assert not np.allclose(out, wrong, atol=1e-3)


@pytest.mark.parametrize("d", [128, 20])                     # 20: not a multiple of a vector width
def test_gated_rms_norm_bits_are_pinned(d):
    """The bits are pinned, whatever vector width computes the gate loop: per head the float64
    sum of squares in index order, scale = float32(1 / sqrt(ss/d + eps)), then
    ((o·scale)·w)·SiLU(z) in float32 with cpu.expf's SiLU, one rounding per op."""
    from .test_gdn import _silu_f32                          # scalar float32 SiLU with cpu.expf
    rng = np.random.default_rng(d)
    n, H = 3, 5
    o = rng.standard_normal((n, H, d)).astype(np.float32)
    z = (rng.standard_normal((n, H, d)) * 4).astype(np.float32)
    z[0, 0, :4] = [0.0, -0.0, 100.0, -100.0]                 # exp clamps and a signed zero
    w = rng.standard_normal(d).astype(np.float32)
    o64 = o.astype(np.float64)
    ss = np.cumsum(o64 * o64, axis=-1)[..., -1:]             # cumsum: a sequential sum, unlike np.sum
    scale = (1.0 / np.sqrt(ss / d + EPS)).astype(np.float32)
    expect = o * scale * w * _silu_f32(z)
    out = poisoned((n, H * d))
    gated_rms_norm(o.reshape(n, H * d), z.reshape(n, H * d), w, EPS, out)
    np.testing.assert_array_equal(out.view(np.uint32), expect.reshape(n, H * d).view(np.uint32))
