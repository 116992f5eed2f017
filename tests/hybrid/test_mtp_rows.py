"""The MTP head runs the whole block only on the rows whose output is read (hybrid/mtp.py): the
other rows only put their K and V into the head's cache. Against the same call with every row
run ("all"): the same bits for the last row's logits and hidden and for the cache, and the MoE
FFN (a CPU hand-off per row in hybrid placement) sees one row for "last" and none for "none"."""
import numpy as np
import pytest

from hybrid.errors import HybridError
from hybrid.forward import Forward
from hybrid.model_file import open_model
from hybrid.mtp import MTPHead
from hybrid.synth import preset, write_model
from hybrid.synth.vocab import MIN_VOCAB

SHAPE = dict(n_embd=64, n_vocab=MIN_VOCAB + 8, n_head=2, n_head_kv=1, head_dim=32, n_rot=16, ssm_n_k_heads=1,
             ssm_n_v_heads=2, ssm_d_state=32, context_length=256, n_layer=2, full_attention_interval=2,
             n_expert=8, n_expert_used=2, n_ff_exp=64, n_ff_shexp=64)
IDS = np.array([3, 141, 59, 26, 53])


@pytest.fixture(scope="module")
def fw(tmp_path_factory):
    path = tmp_path_factory.mktemp("mtp-rows") / "tiny-moe.gguf"
    write_model(path, preset("tiny", arch="qwen35moe", mtp=True, **SHAPE), types="Q8_0", seed=3)
    with open_model(path) as mf:
        yield Forward(mf)


def head_on_prefix(fw, logits):
    """The head over IDS after one row already in its cache, as drafting calls it."""
    state = fw.new_state(16)
    _, hidden = fw.forward(state, IDS, logits="none")
    h_prev = np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden[:-1]])
    head = MTPHead(fw)
    head.forward(state, IDS[:1], h_prev[:1], logits="none")
    out = head.forward(state, IDS[1:], h_prev[1:], logits=logits)
    return out, fw.last_moe_stats.rows, state


def same_cache(a, b, used):
    for i in a.mtp_kv:
        for x, y in zip(a.mtp_kv[i], b.mtp_kv[i]):
            np.testing.assert_array_equal(x[:, :used], y[:, :used])


def test_last_runs_the_block_on_the_last_row_only_with_the_bits_of_all(fw):
    (logits_all, hidden_all), rows_all, state_all = head_on_prefix(fw, "all")
    (logits, hidden), rows, state = head_on_prefix(fw, "last")
    assert logits.shape == (1, fw.config.n_vocab) and hidden.shape == (1, fw.config.n_embd)
    np.testing.assert_array_equal(logits, logits_all[-1:])
    np.testing.assert_array_equal(hidden, hidden_all[-1:])
    same_cache(state, state_all, len(IDS))
    assert (rows_all, rows) == (len(IDS) - 1, 1)
    assert state.mtp_n_past == state_all.mtp_n_past == len(IDS)


def test_none_only_fills_the_cache(fw):
    _, _, state_all = head_on_prefix(fw, "all")
    out, rows, state = head_on_prefix(fw, "none")
    assert out == (None, None) and rows == 0
    same_cache(state, state_all, len(IDS))


def test_an_unknown_logits_mode_is_refused(fw):
    with pytest.raises(HybridError, match="logits must be one of"):
        MTPHead(fw).forward(fw.new_state(4), [1], np.zeros((1, fw.config.n_embd), np.float32), logits="first")
