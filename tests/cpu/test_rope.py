"""Partial NEOX RoPE vs a numpy float64 rotate_half reference (MODEL_FORMAT.md §3.3 step 4),
and its float32 bits pinned."""
import math

import numpy as np
import pytest

from cpu.rope import rope_inv_freq, rope_neox


def ref_rope(x, pos, n_rot, theta):
    """HF-style: rotate_half on the first n_rot dims; cos/sin duplicated over the halves."""
    x = x.astype(np.float64)
    half = n_rot // 2
    inv = 1.0 / theta ** (np.arange(0, n_rot, 2, dtype=np.float64) / n_rot)
    ang = pos[:, None].astype(np.float64) * inv[None, :]            # (n, half)
    cos = np.concatenate([np.cos(ang), np.cos(ang)], -1)[:, None, :]
    sin = np.concatenate([np.sin(ang), np.sin(ang)], -1)[:, None, :]
    r = x[..., :n_rot]
    rot_half = np.concatenate([-r[..., half:], r[..., :half]], -1)
    out = x.copy()
    out[..., :n_rot] = r * cos + rot_half * sin
    return out


@pytest.mark.parametrize("n,H,d,n_rot,theta", [(1, 2, 64, 16, 1e7), (4, 3, 32, 32, 1e4), (3, 8, 256, 64, 1e7)])
def test_rope_matches_rotate_half(n, H, d, n_rot, theta):
    rng = np.random.default_rng(n + H + d)
    x = rng.standard_normal((n, H, d)).astype(np.float32)
    pos = rng.integers(0, 40000, size=n).astype(np.int64)
    expect = ref_rope(x, pos, n_rot, theta)
    y = x.copy()
    rope_neox(y, pos, rope_inv_freq(n_rot, theta))
    np.testing.assert_allclose(y, expect, rtol=1e-5, atol=2e-6)
    np.testing.assert_array_equal(y[..., n_rot:], x[..., n_rot:])   # only the first n_rot rotate


def test_rope_at_position_zero_is_identity_and_pairs_are_neox():
    x = np.arange(2 * 16, dtype=np.float32).reshape(1, 2, 16)
    y = x.copy()
    rope_neox(y, np.array([0]), rope_inv_freq(8, 1e4))
    np.testing.assert_array_equal(y, x)
    # position 1, pair 0 = (dim 0, dim 4) rotated by 1 radian (θ^0 = 1)
    y = x.copy()
    rope_neox(y, np.array([1]), rope_inv_freq(8, 1e4))
    c, s = np.cos(1.0), np.sin(1.0)
    np.testing.assert_allclose(y[0, 0, 0], x[0, 0, 0] * c - x[0, 0, 4] * s, rtol=1e-6)
    np.testing.assert_allclose(y[0, 0, 4], x[0, 0, 0] * s + x[0, 0, 4] * c, rtol=1e-6)


@pytest.mark.parametrize("n,H,d,n_rot", [(3, 24, 256, 64), (2, 5, 32, 20)])   # 20: pairs not a multiple of 8
def test_rope_bits_are_float32_rotations_of_float64_angles(n, H, d, n_rot):
    """The bits are pinned, whatever loop order or vector width computes them: c, s = float32 of
    cos/sin of the float64 angle, then a·c − b·s and a·s + b·c in float32, one rounding per op
    (no FMA). Decode and prompt rows must keep agreeing with each other and with past outputs."""
    rng = np.random.default_rng(n_rot)
    x = rng.standard_normal((n, H, d)).astype(np.float32)
    pos = rng.integers(0, 300000, size=n).astype(np.int64)
    inv = rope_inv_freq(n_rot, 1e7)
    half = n_rot // 2
    ang = [[float(p) * f for f in inv] for p in pos]                 # float64, as the kernel takes it
    c = np.array([[math.cos(a) for a in row] for row in ang], np.float32)[:, None, :]
    s = np.array([[math.sin(a) for a in row] for row in ang], np.float32)[:, None, :]
    a, b = x[..., :half], x[..., half:n_rot]
    expect = x.copy()
    expect[..., :half] = a * c - b * s                                # numpy float32: one rounding per op
    expect[..., half:n_rot] = a * s + b * c
    y = x.copy()
    rope_neox(y, pos, inv)
    np.testing.assert_array_equal(y.view(np.uint32), expect.view(np.uint32))
