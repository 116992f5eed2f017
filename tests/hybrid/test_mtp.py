"""The MTP (nextn) head vs the numpy float64 reference (tests/reference/qwen35_ref.py).

Convention under test: row p = head on (x_p at position p, trunk hidden h_{p−1}, zeros at
p = 0), and row p's argmax drafts x_{p+1} — the same target as the main head's row p.
"""
import numpy as np
import pytest

import hybrid
from hybrid.errors import HybridError
from hybrid.forward import Forward
from hybrid.model_file import open_model
from hybrid.mtp import MTPHead
from hybrid.synth import preset, write_model
from tests.hybrid.test_forward import float_weight_ops
from tests.reference.llama_cpp_ref import margin_mismatches
from tests.reference.qwen35_ref import reference_mtp_logits

# Same bounds as the trunk (test_forward.py): the quantised matvecs round activations to int8,
# which moves logits ~0.2 (Q8_0) / ~1.5 (Q4_K_M) from exact math; the float runs are tight.
LOGIT_TOL = {"Q8_0": 0.5, "Q4_K_M": 1.5}
MEAN_TOL = 0.1
EXACT_TOL = 1e-4

CODE = '''import os
import sys


class Config:
    def __init__(self, path):
        self.path = path
        self.values = {}

    def load(self):
        with open(self.path) as f:
            for line in f:
                key, value = line.split("=", 1)
                self.values[key.strip()] = value.strip()
        return self.values
'''


@pytest.fixture(scope="module")
def q4km(trained_model_q4km):
    return hybrid.load(trained_model_q4km, threads=1)


@pytest.fixture(scope="module")
def q8(trained_model_q8):
    return hybrid.load(trained_model_q8, threads=1)


@pytest.fixture(scope="module")
def code_ids(q4km):
    return q4km.tokenizer.encode(CODE)


@pytest.fixture(scope="module")
def synthetic_f32(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp") / "tiny-f32.gguf"
    write_model(path, preset("tiny", arch="qwen35", mtp=True), types="F32", seed=3)
    return path


def teacher_forced_mtp(forward: Forward, ids) -> np.ndarray:
    """Model.mtp_logits, but on any Forward (e.g. one with float ops)."""
    head = MTPHead(forward)
    state = forward.new_state(len(ids) + 1)
    _, hidden = forward.forward(state, np.asarray(ids), logits="none")
    h_prev = np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden[:-1]])
    out, _ = head.forward(state, np.asarray(ids), h_prev, logits="all")
    return out


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0"])
def test_mtp_logits_match_reference(name, request, code_ids):
    model = request.getfixturevalue({"Q4_K_M": "q4km", "Q8_0": "q8"}[name])
    ids = code_ids[:24]      # few rows: the int8-activation matvec that decoding and drafting use
    ours = model.mtp_logits(ids)
    ref = reference_mtp_logits(model.path, ids)
    err = np.abs(ours - ref)
    print(f"\n{name} MTP: |logit error| max {err.max():.3g} mean {err.mean():.3g}")
    assert ours.shape == ref.shape == (len(ids), model.config.n_vocab) and ours.dtype == np.float32
    assert err.max() < LOGIT_TOL[name] and err.mean() < MEAN_TOL
    assert margin_mismatches(ref, ours, tol=LOGIT_TOL[name]) == 0


@pytest.mark.parametrize("name", ["Q4_K_M", "Q8_0"])
def test_float_activation_mtp_matches_reference_tightly(name, request, code_ids):
    model = request.getfixturevalue({"Q4_K_M": "q4km", "Q8_0": "q8"}[name])
    ids = code_ids[:24]
    ours = teacher_forced_mtp(Forward(model.file, ops=float_weight_ops()), ids)
    ref = reference_mtp_logits(model.path, ids)
    assert np.abs(ours - ref).max() < EXACT_TOL
    assert (ours.argmax(1) == ref.argmax(1)).all()


def test_synthetic_f32_mtp_matches_reference_tightly(synthetic_f32):
    """F32 weights take the float matvec: no activation rounding anywhere."""
    ids = np.random.default_rng(7).integers(0, 384, size=20)
    with open_model(synthetic_f32) as mf:
        ours = teacher_forced_mtp(Forward(mf), ids)
    ref = reference_mtp_logits(synthetic_f32, ids)
    np.testing.assert_allclose(ours, ref, atol=EXACT_TOL, rtol=1e-5)


def test_row_p_drafts_the_token_after_x_p(q4km, code_ids):
    """On code the MTP row p agrees with the main head's row p ~80% of the time (model README);
    an off-by-one pairing (h_p instead of h_{p−1}, or comparing with row p+1) drops far below."""
    ids = code_ids
    mtp, main = q4km.mtp_logits(ids).argmax(1), q4km.logits(ids).argmax(1)
    agree = float(np.mean(mtp == main))
    shifted = float(np.mean(mtp[:-1] == main[1:]))
    print(f"\nMTP row p vs main row p: {agree:.2f}; vs main row p+1: {shifted:.2f} over {len(ids)} tokens")
    assert agree > 0.65
    assert shifted < agree - 0.3


def test_rows_split_over_calls_equal_one_call(q4km, code_ids):
    """Speculative decoding runs the head a few rows at a time; that must not change a bit."""
    ids = np.asarray(code_ids[:20])
    fw, head = q4km.forward, q4km.mtp
    state = fw.new_state(32)
    _, hidden = fw.forward(state, ids, logits="none")
    h_prev = np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden[:-1]])
    whole, whole_hidden = head.forward(state, ids, h_prev, logits="all")
    state.mtp_n_past = 0
    parts, hiddens, start = [], [], 0
    for size in (7, 1, 1, 5, 6):
        out, hid = head.forward(state, ids[start:start + size], h_prev[start:start + size], logits="all")
        parts.append(out)
        hiddens.append(hid)
        start += size
    assert state.mtp_n_past == len(ids) and state.n_past == len(ids)
    np.testing.assert_array_equal(np.concatenate(parts), whole)
    np.testing.assert_array_equal(np.concatenate(hiddens), whole_hidden)
    last, _ = head.forward(fw.new_state(32), ids[:3], h_prev[:3], logits="last")
    np.testing.assert_array_equal(last, whole[2:3])
    picks, picked_hidden = head.forward(fw.new_state(32), ids, h_prev, logits="all", pick=True)
    assert picks.ids.tolist() == whole.argmax(1).tolist()
    np.testing.assert_array_equal(picked_hidden, whole_hidden)


def test_bad_calls_give_clear_errors(q4km, tmp_path):
    head, state = q4km.mtp, q4km.new_state(4)
    with pytest.raises(HybridError, match="one hidden row per token"):
        head.forward(state, [1, 2], np.zeros((1, q4km.config.n_embd), np.float32))
    with pytest.raises(HybridError, match="do not fit the context of 4"):
        head.forward(state, [1] * 5, np.zeros((5, q4km.config.n_embd), np.float32))
    assert state.mtp_n_past == 0
    path = tmp_path / "no-mtp.gguf"
    write_model(path, preset("tiny", arch="qwen35", mtp=False), types="F32")
    plain = hybrid.load(path, threads=1)
    assert not plain.has_mtp
    with pytest.raises(HybridError, match="no MTP block"):
        plain.mtp_logits([1, 2])
    with pytest.raises(HybridError, match="no MTP head"):
        list(plain.generate([1, 2], max_tokens=2, draft=1))
    assert len(list(plain.generate([1, 2], max_tokens=2))) > 0      # the default drafts only with a head
