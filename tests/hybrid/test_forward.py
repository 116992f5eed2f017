"""The qwen35 forward on the trained test model vs the independent numpy float64 reference
(tests/reference/qwen35_ref.py), plus the stepping properties the decoder relies on."""
import types

import numpy as np
import pytest

import cpu.ops
from cpu.quants import dequantize
from hybrid.errors import HybridError
from hybrid.forward import Forward
from hybrid.model_file import open_model
from tests.reference.llama_cpp_ref import margin_mismatches
from tests.reference.qwen35_ref import _decoder_block, load_model, reference_hidden, reference_logits

# The reference multiplies the exactly dequantised weights in float64. Our quantised matvecs
# round activations to int8 as llama.cpp does for each weight type (per 32 for Q8_0, per 256
# for K-quants: cpu.activations), which lands ~0.2 (Q8_0) and ~1.5 (Q4_K_M) logits from exact
# math on these files (logit scale ~20), so the bounds are
# loose; the float-activation run below is the tight check of the forward's math.
LOGIT_TOL = {"Q8_0": 0.5, "Q4_K_M": 1.5}
MEAN_TOL = 0.1
EXACT_TOL = 1e-4
PROMPT = np.random.default_rng(1234).integers(0, 8192, size=24)


@pytest.fixture(scope="module")
def q4km(trained_model_q4km):
    with open_model(trained_model_q4km) as mf:
        yield Forward(mf)


@pytest.fixture(scope="module")
def q8(trained_model_q8):
    with open_model(trained_model_q8) as mf:
        yield Forward(mf)


def run_all(fw, ids, n_ctx=64, **kw):
    state = fw.new_state(n_ctx, **kw)
    logits, hidden = fw.forward(state, ids, logits="all")
    return logits, hidden, state


def float_weight_ops():
    """cpu.ops with every matrix dequantised once to F32: the float matvec path keeps the
    activations in float32, so the forward can be held to the float64 reference tightly."""
    f32_id = 0
    cache = {}

    def as_f32(wtype, w, cols):
        key = (w.ctypes.data, w.shape)
        if key not in cache:
            cache[key] = dequantize(wtype, w, cols).view(np.uint8)
        return cache[key]

    def matvec(wtype, w, x, out):
        cpu.ops.matvec(f32_id, as_f32(wtype, w, x.shape[1]), x, out)

    def swiglu(wtype_gate, w_gate, wtype_up, w_up, x, h_out):
        cols = x.shape[1]
        cpu.ops.swiglu(f32_id, as_f32(wtype_gate, w_gate, cols), f32_id, as_f32(wtype_up, w_up, cols), x, h_out)

    def matvecs(products, x):
        for wtype, w, out in products:
            matvec(wtype, w, x, out)

    ops = {name: getattr(cpu.ops, name) for name in cpu.ops.__all__}
    return types.SimpleNamespace(**{**ops, "matvec": matvec, "matvecs": matvecs, "swiglu": swiglu})


def errors(ours, ref):
    e = np.abs(ours - ref)
    return e.max(), e.mean()


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0"])
def test_logits_and_hidden_match_reference(name, request):
    fw = request.getfixturevalue({"Q4_K_M": "q4km", "Q8_0": "q8"}[name])
    logits, hidden, state = run_all(fw, PROMPT)
    ref = reference_logits(fw.model_file.path, PROMPT)
    ref_hidden = reference_hidden(fw.model_file.path, PROMPT)
    (err, mean), (h_err, h_mean) = errors(logits, ref), errors(hidden, ref_hidden)
    print(f"\n{name}: |logit error| max {err:.3g} mean {mean:.3g} (logit scale {np.abs(ref).max():.1f}); "
          f"|hidden error| max {h_err:.3g} mean {h_mean:.3g}")
    assert logits.shape == ref.shape and logits.dtype == np.float32
    assert err < LOGIT_TOL[name] and mean < MEAN_TOL
    assert h_err < LOGIT_TOL[name] and h_mean < MEAN_TOL
    assert margin_mismatches(ref, logits, tol=LOGIT_TOL[name]) == 0
    assert state.n_past == len(PROMPT)


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0"])
def test_float_activation_forward_matches_reference_tightly(name, request):
    fw = request.getfixturevalue({"Q4_K_M": "q4km", "Q8_0": "q8"}[name])
    exact = Forward(fw.model_file, ops=float_weight_ops())
    logits, hidden, _ = run_all(exact, PROMPT)
    ref = reference_logits(fw.model_file.path, PROMPT)
    (err, mean), (h_err, _) = errors(logits, ref), errors(hidden, reference_hidden(fw.model_file.path, PROMPT))
    print(f"\n{name} with float activations: |logit error| max {err:.3g} mean {mean:.3g}; "
          f"|hidden error| max {h_err:.3g}")
    assert err < EXACT_TOL and h_err < EXACT_TOL
    assert (logits.argmax(1) == ref.argmax(1)).all()


def test_attention_block_runs_the_mtp_block_like_the_reference(q4km):
    """The block the MTP decoder reuses: blk.L over its own KV cache, in two calls."""
    exact = Forward(q4km.model_file, ops=float_weight_ops())
    L = exact.config.n_layer
    rows = np.random.default_rng(5).standard_normal((6, exact.config.n_embd)).astype(np.float32)
    expect = _decoder_block(load_model(q4km.model_file.path), L, rows.astype(np.float64), recurrent=False)
    state = exact.new_state(16)
    got = rows.copy()
    exact.attention_block(exact.weights.mtp.block, got[:4], state.mtp_kv[L], 0)
    exact.attention_block(exact.weights.mtp.block, got[4:], state.mtp_kv[L], 4)
    np.testing.assert_allclose(got, expect, atol=EXACT_TOL, rtol=1e-5)
    assert state.n_past == 0                      # the trunk's position is untouched


def test_chunks_equal_all_at_once_equal_token_by_token(q4km):
    """Every kernel treats each row alone, so the split of a prompt never changes a bit."""
    whole, hidden_whole, _ = run_all(q4km, PROMPT)
    for sizes in ([5, 11, 8], [1] * len(PROMPT)):
        state = q4km.new_state(64)
        parts, hiddens, start = [], [], 0
        for size in sizes:
            logits, hidden = q4km.forward(state, PROMPT[start:start + size], logits="all")
            parts.append(logits)
            hiddens.append(hidden)
            start += size
        np.testing.assert_array_equal(np.concatenate(parts), whole)
        np.testing.assert_array_equal(np.concatenate(hiddens), hidden_whole)


def test_prompt_chunks_share_one_allocation_and_keep_every_bit(q4km):
    """Calls longer than a step use the leading rows of one chunk-sized allocation: a short chunk
    after a long one (and the reverse) sees only its own rows, and the split changes no bit."""
    ids = np.resize(PROMPT, 60)
    whole, hidden_whole, _ = run_all(q4km, ids)
    for sizes in ([40, 20], [17, 43]):
        state = q4km.new_state(64)
        got = [q4km.forward(state, ids[a:b], logits="all") for a, b in zip([0, sizes[0]], [sizes[0], 60])]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), whole)
        np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), hidden_whole)
    long, short = q4km._scratch_for(43), q4km._scratch_for(17)
    assert short.x.shape[0] == 17 and np.shares_memory(long.x, short.x) and np.shares_memory(long.h, short.h)


def test_logits_modes(q4km):
    whole, hidden, _ = run_all(q4km, PROMPT[:6])
    last, hidden_last = q4km.forward(q4km.new_state(16), PROMPT[:6], logits="last")
    np.testing.assert_array_equal(last, whole[-1:])
    np.testing.assert_array_equal(hidden_last, hidden)
    none, hidden_none = q4km.forward(q4km.new_state(16), PROMPT[:6].astype(np.int32), logits="none")
    assert none is None
    np.testing.assert_array_equal(hidden_none, hidden)
    for mode, rows in (("all", whole), ("last", whole[-1:])):
        picks, hidden_picked = q4km.forward(q4km.new_state(16), PROMPT[:6], logits=mode, pick=True)
        assert picks.ids.tolist() == rows.argmax(1).tolist()
        r64 = rows.astype(np.float64)
        np.testing.assert_allclose(picks.top_p, 1 / np.exp(r64 - r64.max(1, keepdims=True)).sum(1), rtol=1e-5)
        np.testing.assert_array_equal(hidden_picked, hidden)
        tops, hidden_top = q4km.forward(q4km.new_state(16), PROMPT[:6], logits=mode, top=5)
        assert_top_rows(tops, rows, 5)
        np.testing.assert_array_equal(hidden_top, hidden)


def assert_top_rows(tops, rows, count):
    """Each TopLogits holds its row's `count` largest logits (lower id first on ties), ids ascending."""
    assert len(tops) == len(rows)
    for top, row in zip(tops, rows):
        ids = np.sort(np.argsort(-row, kind="stable")[:count])
        assert top.ids.tolist() == ids.tolist() and top.n_vocab == row.size
        np.testing.assert_array_equal(top.logits, row[ids])


def test_state_copy_and_save_load_continue_identically(q4km, tmp_path):
    state = q4km.new_state(64)
    q4km.forward(state, PROMPT[:10], logits="none")
    twin = state.copy()
    state.save(tmp_path / "s.npz")
    expect, _ = q4km.forward(state, PROMPT[10:14], logits="all")
    got_copy, _ = q4km.forward(twin, PROMPT[10:14], logits="all")
    restored = type(state).load(tmp_path / "s.npz", q4km.config)
    got_loaded, _ = q4km.forward(restored, PROMPT[10:14], logits="all")
    np.testing.assert_array_equal(got_copy, expect)
    np.testing.assert_array_equal(got_loaded, expect)


def test_snapshot_rollback_equals_running_only_the_kept_tokens(q4km):
    """A 4-token verify, keep 2, continue: same as if only those 2 had ever been run."""
    prefix, verify, after = PROMPT[:8], PROMPT[8:12], PROMPT[12:15]
    state = q4km.new_state(64, n_ring=4)
    q4km.forward(state, prefix, logits="none")
    q4km.forward(state, verify, logits="all", snapshot=True)
    state.rollback(2)
    got, _ = q4km.forward(state, after, logits="all")
    plain = q4km.new_state(64)
    q4km.forward(plain, np.concatenate([prefix, verify[:2]]), logits="none")
    expect, _ = q4km.forward(plain, after, logits="all")
    np.testing.assert_array_equal(got, expect)


def test_snapshot_ring_slots_equal_step_by_step_states(q4km):
    state = q4km.new_state(32, n_ring=4)
    q4km.forward(state, PROMPT[:4], logits="none", snapshot=True)
    step = q4km.new_state(32)
    for t in range(4):
        q4km.forward(step, PROMPT[t:t + 1], logits="none")
        for i in step.ssm:
            np.testing.assert_array_equal(state.ring_ssm[i][t], step.ssm[i])
            np.testing.assert_array_equal(state.ring_conv[i][t], step.conv[i])


def test_bad_calls_give_clear_errors(q4km):
    state = q4km.new_state(8)
    with pytest.raises(HybridError, match="prompt of 9 tokens does not fit the context of 8"):
        q4km.forward(state, PROMPT[:9])
    assert state.n_past == 0
    with pytest.raises(HybridError, match="outside the vocabulary"):
        q4km.forward(state, [1, 8192])
    with pytest.raises(HybridError, match="non-empty 1-D integer"):
        q4km.forward(state, [])
    with pytest.raises(HybridError, match="non-empty 1-D integer"):
        q4km.forward(state, [1.5])
    with pytest.raises(HybridError, match="logits must be one of"):
        q4km.forward(state, [1], logits="first")
    with pytest.raises(HybridError, match="ring"):
        q4km.forward(state, [1, 2], snapshot=True)
