"""SessionState: allocation per layer kind, context overflow, copy, save/load, reset, rollback."""
import dataclasses

import numpy as np
import pytest

from hybrid.config import ATTN, GDN, ModelConfig
from hybrid.errors import HybridError
from hybrid.state import SessionState


def tiny_config(**over) -> ModelConfig:
    base = dict(arch="qwen35", n_layer=4, n_nextn=1, n_embd=32, n_vocab=50, n_head=4, n_head_kv=2,
                head_dim=8, n_rot=4, rope_theta=1e7, rms_eps=1e-6, context_length=128,
                layer_kinds=(GDN, GDN, GDN, ATTN), ssm_conv_kernel=4, ssm_d_state=8,
                ssm_n_k_heads=2, ssm_n_v_heads=4, ssm_d_inner=32, n_ff=64)
    base.update(over)
    return ModelConfig(**base)


def filled(cfg, n_ctx=16, n_past=5, n_ring=3, seed=0) -> SessionState:
    rng = np.random.default_rng(seed)
    s = SessionState(cfg, n_ctx, n_ring)
    for group in (s.ssm, s.conv, s.ring_ssm, s.ring_conv):
        for a in group.values():
            a[...] = rng.standard_normal(a.shape)
    for kv in (s.kv, s.mtp_kv):
        for k, v in kv.values():
            k[...] = rng.standard_normal(k.shape)
            v[...] = rng.standard_normal(v.shape)
    s.n_past, s.mtp_n_past = n_past, 2
    return s


def assert_same_contents(a: SessionState, b: SessionState):
    assert (a.n_past, a.mtp_n_past, a.n_ctx) == (b.n_past, b.mtp_n_past, b.n_ctx)
    for i in a.ssm:
        np.testing.assert_array_equal(a.ssm[i], b.ssm[i])
        np.testing.assert_array_equal(a.conv[i], b.conv[i])
    for kva, kvb, used in ((a.kv, b.kv, a.n_past), (a.mtp_kv, b.mtp_kv, a.mtp_n_past)):
        assert kva.keys() == kvb.keys()
        for i in kva:
            for x, y in zip(kva[i], kvb[i]):
                np.testing.assert_array_equal(x[:, :used], y[:, :used])


def test_allocation_follows_layer_kinds_and_mtp():
    cfg = tiny_config()
    s = SessionState(cfg, n_ctx=16, n_ring=2)
    assert sorted(s.ssm) == sorted(s.conv) == [0, 1, 2]
    assert sorted(s.kv) == [3] and sorted(s.mtp_kv) == [4]            # MTP block at index L
    assert s.kv[3][0].shape == (2, 16, 8)
    assert s.ssm[0].shape == (4, 8, 8)
    assert s.conv[0].shape == (3, 2 * 2 * 8 + 32)
    assert s.ring_ssm[0].shape == (2, 4, 8, 8) and s.ring_conv[0].shape == (2, 3, 64)
    assert s.no_ring_ssm.shape[0] == 0 and s.n_past == 0


def test_context_overflow_message():
    s = SessionState(tiny_config(), n_ctx=8)
    s.check_fits(8)
    with pytest.raises(HybridError, match="prompt of 9 tokens does not fit the context of 8"):
        s.check_fits(9)
    s.n_past = 6
    with pytest.raises(HybridError, match="prompt of 3 tokens does not fit the context of 8"):
        s.check_fits(3)
    with pytest.raises(HybridError, match="ring"):
        s.check_ring(1)


def test_copy_is_deep_and_equal():
    a = filled(tiny_config())
    b = a.copy()
    assert_same_contents(a, b)
    b.ssm[0][...] = 0
    b.kv[3][0][...] = 0
    assert a.ssm[0].any() and a.kv[3][0].any()


def test_save_load_round_trip(tmp_path):
    cfg = tiny_config()
    a = filled(cfg)
    path = tmp_path / "state.npz"
    a.save(path)
    b = SessionState.load(path, cfg)
    assert_same_contents(a, b)
    bigger = SessionState.load(path, cfg, n_ctx=32)
    assert bigger.n_ctx == 32 and bigger.n_past == a.n_past
    np.testing.assert_array_equal(bigger.kv[3][0][:, :5], a.kv[3][0][:, :5])


def test_load_rejects_other_models_and_bad_files(tmp_path):
    cfg = tiny_config()
    path = tmp_path / "state.npz"
    filled(cfg).save(path)
    with pytest.raises(HybridError, match="different model"):
        SessionState.load(path, dataclasses.replace(cfg, n_embd=64))
    with pytest.raises(HybridError, match="do not fit the context of 4"):
        SessionState.load(path, cfg, n_ctx=4)
    with pytest.raises(HybridError, match="does not exist"):
        SessionState.load(tmp_path / "missing.npz", cfg)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(HybridError, match="not a hybrid state file"):
        SessionState.load(junk, cfg)
    with pytest.raises(HybridError, match="cannot write"):
        filled(cfg).save(tmp_path / "no" / "such" / "dir.npz")


def test_reset_clears_recurrent_state_and_positions():
    s = filled(tiny_config())
    s.reset()
    assert s.n_past == s.mtp_n_past == 0 and s.ring_len == 0
    assert not any(a.any() for a in s.ssm.values()) and not any(a.any() for a in s.conv.values())


def test_rollback_restores_the_ring_slot_once():
    s = filled(tiny_config(), n_past=5, n_ring=3)
    s.advance(3, snapshot=True)                 # a 3-token verify at positions 5, 6, 7
    assert (s.n_past, s.ring_base, s.ring_len) == (8, 5, 3)
    slot1 = {i: s.ring_ssm[i][1].copy() for i in s.ssm}
    s.rollback(2)                               # keep 2 tokens: state after token index 1
    assert s.n_past == 7
    for i in s.ssm:
        np.testing.assert_array_equal(s.ssm[i], slot1[i])
        np.testing.assert_array_equal(s.conv[i], s.ring_conv[i][1])
    with pytest.raises(HybridError, match="cannot roll back"):
        s.rollback(1)                           # single use


def test_rollback_keeping_everything_leaves_state_and_bounds_are_checked():
    s = filled(tiny_config(), n_ring=3)
    s.advance(2, snapshot=True)
    before = {i: s.ssm[i].copy() for i in s.ssm}
    s.rollback(2)
    assert s.n_past == 7
    for i in s.ssm:
        np.testing.assert_array_equal(s.ssm[i], before[i])
    s.advance(2, snapshot=True)
    for bad in (0, 3):
        with pytest.raises(HybridError, match="cannot roll back"):
            s.rollback(bad)
    s.advance(1, snapshot=False)                # a plain call spends the ring
    with pytest.raises(HybridError, match="cannot roll back"):
        s.rollback(1)
