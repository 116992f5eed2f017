"""The forward on the GPU backend (hybrid mode: trunk on the device, FFN where its weights live)
vs the CPU forward and the float-weight reference forward, on tiny synthetic qwen35 models
(1 GDN + 1 attention layer + MTP), plus the stepping properties lossless drafting relies on.

The CUDA simulator runs a device matvec in seconds, so the stepping tests place every matrix
on the host (the trunk's other kernels still all run on the device); the default placement
and the all-device placement are each checked once against the CPU forward.
"""
import re

import numpy as np
import pytest

import gpu.matmul.gemm
import gpu.runtime.pcie
import hybrid.forward
import hybrid.generate
from gpu import simulated
from gpu.attention import ROWS_PER_CALL
from gpu.gdn import CONV_PARALLEL_TOKENS
from hybrid.backend import GPUBackend
from hybrid.errors import HybridError
from hybrid.events import Stats
from hybrid.forward import Forward
from hybrid.generate import generate_tokens, prefill, prompt_chunks
from hybrid.grammar import Constraint
from hybrid.model_file import open_model
from hybrid.session import _Checkpoint
from hybrid.mtp import MTPHead
from hybrid.speculative import generate_speculative
from hybrid.weights import SplitFFN, split_dense_ffn
from hybrid.synth import preset, write_model
from hybrid.synth.vocab import MIN_VOCAB
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)
from tests.hybrid.test_forward import assert_top_rows, float_weight_ops
from tests.hybrid.test_speculative import KnownFutureHead, LetterTokenizer, greedy

SIMULATED = simulated()
SHAPE = dict(n_layer=2, full_attention_interval=2, n_embd=32, n_vocab=MIN_VOCAB + 8, n_head=2, n_head_kv=1,
             head_dim=16, n_rot=8, ssm_n_k_heads=1, ssm_n_v_heads=2, n_ff=32, context_length=256)
D_STATE = {"F32": 8}                    # the 32-weight block types need multiples of 32 (d_inner = 2·d_state)
# The 256-weight types the GPU runs past Q4_K..Q6_K share tiny models, 256 wide (n_embd): a
# 256-wide simulated forward costs seconds per matrix kind, not per type. The matrices that read
# the residual are of those types (z, β, α of one GDN layer of two: matvecs across types), the
# narrow ones (ffn_down, ssm_out, attn_output: 32 wide) of a 32-weight type: Q4_0, llama.cpp's
# fallback for them, or MXFP4 (another GPU type, tested at no extra forward).
WIDE_MODELS = {   # model name → (its matrices' types by name pattern, the narrow matrices' type)
    "Q2_K+Q3_K+IQ4_XS": ({r"ffn_(gate|up)\.weight$": "Q2_K", r"attn_(qkv|gate|[qkv])\.weight$": "Q3_K",
                          r"(^output|token_embd|ssm_alpha|ssm_beta|eh_proj)\.weight$": "IQ4_XS"}, "Q4_0"),
    "IQ2_XS+IQ2_S+IQ1_S+IQ1_M": ({r"ffn_(gate|up)\.weight$": "IQ2_XS", r"attn_(qkv|gate)\.weight$": "IQ2_S",
                                  r"attn_[qkv]\.weight$": "IQ1_M",
                                  r"(^output|token_embd|ssm_alpha|ssm_beta|eh_proj)\.weight$": "IQ1_S"}, "Q4_0"),
    "IQ2_XXS+IQ3_S+IQ3_XXS+MXFP4": ({r"ffn_(gate|up)\.weight$": "IQ2_XXS", r"attn_(qkv|gate|[qkv])\.weight$": "IQ3_S",
                                     r"(^output|token_embd|ssm_alpha|ssm_beta|eh_proj)\.weight$": "IQ3_XXS"}, "MXFP4"),
}
PROMPT = np.array([3, 141, 59, 26, 53, 5])
# float weights, GPU vs CPU: float32 arithmetic, and the GPU's fp16 K/V cache (gpu/attention.py:
# each cached value rounded by up to 2^-11 of itself; ~6e-4 on these logits, float32 alone ~1e-5)
EXACT_TOL = 2e-3
LOGIT_TOL, MEAN_TOL = 0.5, 0.1          # quantised: the CPU rounds activations to int8 (test_forward.py)
N_TOKENS = 6 if SIMULATED else 24       # greedy decoding length for the drafting test
# A chunk on the real GPU also meets what a short call never does: the GDN conv's launch per
# token (CONV_PARALLEL_TOKENS rows or more) and a second attention launch pair (past
# ROWS_PER_CALL rows). The simulator keeps to 3 tokens: it takes seconds per forward.
CHUNK = PROMPT[:3] if SIMULATED else np.resize(PROMPT, max(ROWS_PER_CALL, CONV_PARALLEL_TOKENS) + 3)


def all_on_host(name):
    return "cpu"


def all_on_device(name):
    return "gpu"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """model(types) → an open model file, written once per module."""
    folder, opened = tmp_path_factory.mktemp("gpu-forward"), {}
    files = []

    def make(types: str):
        if types not in opened:
            path = folder / f"tiny-{types}.gguf"
            d_state = D_STATE.get(types, 16)
            if types in WIDE_MODELS:
                overrides, narrow = WIDE_MODELS[types]
                write_model(path, preset("tiny", arch="qwen35", ssm_d_state=d_state, **dict(SHAPE, n_embd=256)),
                            types=narrow, seed=7, overrides=overrides)
            else:
                write_model(path, preset("tiny", arch="qwen35", ssm_d_state=d_state, **SHAPE), types=types, seed=7)
            files.append(open_model(path))
            opened[types] = files[-1].__enter__()
        return opened[types]
    yield make
    for f in files:
        f.__exit__(None, None, None)


def run(fw, ids, n_ctx=32):
    return fw.forward(fw.new_state(n_ctx), ids, logits="all")


def max_error(a, b):
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("placement", [None, all_on_device], ids=["default", "all-on-device"])
def test_float_model_matches_the_cpu_forward_tightly(model, placement):
    mf = model("F32")
    want, want_hidden = run(Forward(mf), PROMPT[:3])
    fw = Forward(mf, backend="gpu", placement=placement)
    got, hidden = run(fw, PROMPT[:3])
    assert got.dtype == np.float32 and got.shape == want.shape
    assert max_error(got, want) < EXACT_TOL and max_error(hidden, want_hidden) < EXACT_TOL
    ffn_places = {m.location for layer in fw.weights.layers for m in (layer.ffn.gate, layer.ffn.up, layer.ffn.down)}
    assert ffn_places == ({"cpu"} if placement is None else {"gpu"})
    assert fw.weights.layers[0].qkv.location == fw.weights.output.location == "gpu"


def test_quantised_model_matches_float_reference_and_cpu_forward(model):
    """Both sides round activations to int8 for the quantised matvecs (the device per block of
    32, the CPU per super-block): the logits stay within the tolerances of the float reference."""
    mf = model("Q8_0")
    reference, _ = run(Forward(mf, ops=float_weight_ops()), PROMPT[:3])
    cpu_logits, _ = run(Forward(mf), PROMPT[:3])
    got, _ = run(Forward(mf, backend="gpu"), PROMPT[:3])
    for name, other in (("float reference", reference), ("CPU forward", cpu_logits)):
        err, mean = max_error(got, other), float(np.abs(got - other).mean())
        assert err < LOGIT_TOL and mean < MEAN_TOL, f"vs {name}: max {err:.3g}, mean {mean:.3g}"
    assert (got.argmax(1) == reference.argmax(1)).all()


GPU_BLOCK_TYPES = ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", *WIDE_MODELS]  # the GPU's types past Q8_0/Q4_0 and Q4_K..Q6_K


@pytest.mark.parametrize("types", GPU_BLOCK_TYPES)
def test_block_type_model_runs_on_the_gpu_and_decodes_as_the_cpu_does(model, types):
    """A model of one of these types, every matrix on the device (the GPU kernels run them all,
    placement.check_gpu_types lets it load): its prompt logits within the quantised tolerance of
    the CPU forward's (both round x as llama.cpp does for the type; the GPU sums in another
    order), and greedy decoding gives the CPU's tokens up to a near-tie: where they part, the
    GPU's pick scores within that tolerance of the CPU's best in the CPU's own logits."""
    mf = model(types)
    quantised = {n: t.type.name for n, t in mf.tensors.items() if n.endswith("weight") and t.type.name != "F32"}
    if types in WIDE_MODELS:
        overrides, narrow = WIDE_MODELS[types]
        for pattern, name in overrides.items():
            assert {t for n, t in quantised.items() if re.search(pattern, n)} == {name}
        assert set(quantised.values()) == {*overrides.values(), narrow}
    else:
        assert set(quantised.values()) == {types}
    # the simulator runs a decode step in seconds: a shorter prompt and two steps there
    prompt = [int(t) for t in (PROMPT[:3] if SIMULATED else PROMPT)]
    count = 2 if SIMULATED else N_TOKENS

    def prompt_then_greedy(fw):
        """The prompt's logits (every row), then `count` tokens decoded greedily from that state
        as generate_tokens does (the first from the prompt's last row, the rest picked on the
        backend), without a second prefill."""
        state = fw.new_state(len(prompt) + count)
        logits, _ = fw.forward(state, np.array(prompt), logits="all")
        tokens = [int(logits[-1].argmax())]
        while len(tokens) < count:
            picks, _ = fw.forward(state, np.array(tokens[-1:]), logits="last", pick=True)
            tokens.append(int(picks.ids[-1]))
        return logits, tokens
    cpu_fw = Forward(mf)
    want, want_tokens = prompt_then_greedy(cpu_fw)
    got, got_tokens = prompt_then_greedy(Forward(mf, backend="gpu", placement=all_on_device))
    err, mean = max_error(got, want), float(np.abs(got - want).mean())
    assert err < LOGIT_TOL and mean < MEAN_TOL, f"max {err:.3g}, mean {mean:.3g}"
    assert len(got_tokens) == len(want_tokens) == count
    parted = next((i for i, (g, w) in enumerate(zip(got_tokens, want_tokens)) if g != w), None)
    if parted is not None:       # seen on an H100 with Q4_1 at token 20 of 24
        seen = np.array(prompt + got_tokens[:parted])
        last = run(cpu_fw, seen, n_ctx=len(seen) + 1)[0][-1]
        assert last[want_tokens[parted]] - last[got_tokens[parted]] < LOGIT_TOL, (parted, got_tokens, want_tokens)


@pytest.fixture(scope="module")
def stepping(model):
    """A GPU forward with every matrix on the host (see the module docstring)."""
    return Forward(model("F32"), backend="gpu", placement=all_on_host)


def test_chunks_equal_token_by_token_bit_for_bit(stepping):
    ids = CHUNK
    whole, hidden_whole = run(stepping, ids)
    state = stepping.new_state(32)
    parts = [stepping.forward(state, ids[t:t + 1], logits="all") for t in range(len(ids))]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), whole)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), hidden_whole)
    want, _ = run(Forward(stepping.model_file), ids)
    assert max_error(whole, want) < EXACT_TOL
    picks, hidden_picked = stepping.forward(stepping.new_state(32), ids, logits="all", pick=True)
    assert picks.ids.tolist() == whole.argmax(1).tolist()          # picked on the device
    np.testing.assert_array_equal(hidden_picked, hidden_whole)
    tops, _ = stepping.forward(stepping.new_state(32), ids, logits="all", top=4)
    assert_top_rows(tops, whole, 4)                                  # selected on the device


def test_rollback_copy_and_save_load_on_device_states(stepping, tmp_path):
    prefix, verify, after = PROMPT[:2], PROMPT[2:5], PROMPT[5:6]
    state = stepping.new_state(32, n_ring=3)
    stepping.forward(state, prefix, logits="none")
    twin = state.copy()
    state.save(tmp_path / "s.npz")
    stepping.forward(state, verify, logits="none", snapshot=True)
    state.rollback(2)
    got, _ = stepping.forward(state, after, logits="all")
    expect, _ = stepping.forward(twin, np.concatenate([verify[:2], after]), logits="all")
    np.testing.assert_array_equal(got, expect[-1:])

    loaded = type(state).load(tmp_path / "s.npz", stepping.config, backend=stepping.backend)
    saved = type(state).load(tmp_path / "s.npz", stepping.config)          # the same file, on the host
    assert loaded.n_past == saved.n_past == len(prefix)
    host = stepping.backend.to_host
    for i in saved.ssm:
        np.testing.assert_array_equal(host(loaded.ssm[i]), saved.ssm[i])
        np.testing.assert_array_equal(host(loaded.conv[i]), saved.conv[i])
        assert saved.ssm[i].any()
    for i, (k, v) in saved.kv.items():
        np.testing.assert_array_equal(host(loaded.kv[i][0])[:, :2], k[:, :2])
        np.testing.assert_array_equal(host(loaded.kv[i][1])[:, :2], v[:, :2])


def test_host_snapshots_of_device_states_restore_bit_exactly(stepping):
    """The server's cache keeps device states in host memory (compact: only the used KV rows
    come down); restored into another device state they continue bit for bit."""
    prefix, rest = PROMPT[:3], PROMPT[3:5]
    state = stepping.new_state(32)
    stepping.forward(state, prefix, logits="none")
    ckpt = _Checkpoint.take(state, list(prefix), on_host=True)
    arrays = list(ckpt.arrays())
    assert arrays and all(isinstance(a, np.ndarray) and a.flags.c_contiguous for a in arrays)
    assert all(sum(k.shape[1] for k in ks) == len(prefix) for ks, _ in ckpt.kv.values())
    want, _ = stepping.forward(state, rest, logits="all")
    other = stepping.new_state(32)
    stepping.forward(other, PROMPT[5:8], logits="none")        # other contents, replaced by the restore
    ckpt.restore(other)
    got, _ = stepping.forward(other, rest, logits="all")
    np.testing.assert_array_equal(got, want)


def test_greedy_drafting_equals_plain_decoding(stepping):
    assert_drafting_equals_plain_decoding(stepping)


def assert_drafting_equals_plain_decoding(stepping):
    prompt = [int(t) for t in PROMPT]
    n_ctx = len(prompt) + N_TOKENS + 8
    plain = [e.id for e in generate_tokens(stepping, stepping.new_state(n_ctx), LetterTokenizer(), prompt,
                                           max_tokens=N_TOKENS, sampler=greedy(), n_ctx=n_ctx, ignore_eos=True)
             if hasattr(e, "id")]
    head = KnownFutureHead(MTPHead(stepping), prompt + plain, stepping.config.n_vocab)
    events = list(generate_speculative(stepping, head, stepping.new_state(n_ctx, n_ring=3), LetterTokenizer(),
                                       prompt, max_tokens=N_TOKENS, sampler=greedy(), depth=2, n_ctx=n_ctx,
                                       ignore_eos=True))
    drafted = [e.id for e in events if hasattr(e, "id")]
    assert drafted == plain and len(plain) == N_TOKENS
    stats = events[-1].stats.draft
    assert stats["accepted"] > 0 and stats["accepted"] < stats["drafted"]   # both outcomes happened


class BanEveryThird(Constraint):
    """A grammar (`hybrid.grammar.Constraint`'s sampling over these rules) that refuses every
    token id divisible by 3."""
    stopped = False

    def __init__(self):     # no llguidance matcher: the rules below stand in for it
        pass

    def mask(self, logits):
        out = np.array(logits, np.float32).reshape(-1)
        out[::3] = -np.inf
        return out

    def accept(self, token):
        assert token % 3, token

    def allowed_prefix(self, tokens):
        cut = next((i for i, t in enumerate(tokens) if t % 3 == 0), len(tokens))
        return list(tokens[:cut])


def test_drafting_under_a_constraint_equals_plain_constrained_decoding(stepping):
    """The verify pass's whole rows come back from the device and each is masked in turn: the
    tokens are plain constrained decoding's, and drafts the constraint refuses (a third of the
    head's wrong ones) are cut before the verify."""
    prompt = [int(t) for t in PROMPT]
    n_ctx = len(prompt) + N_TOKENS + 8
    plain = [e.id for e in generate_tokens(stepping, stepping.new_state(n_ctx), LetterTokenizer(), prompt,
                                           max_tokens=N_TOKENS, sampler=greedy(), n_ctx=n_ctx, ignore_eos=True,
                                           constraint=BanEveryThird())
             if hasattr(e, "id")]
    assert all(t % 3 for t in plain)
    head = KnownFutureHead(MTPHead(stepping), prompt + plain, stepping.config.n_vocab)
    events = list(generate_speculative(stepping, head, stepping.new_state(n_ctx, n_ring=3), LetterTokenizer(),
                                       prompt, max_tokens=N_TOKENS, sampler=greedy(), depth=2, n_ctx=n_ctx,
                                       ignore_eos=True, constraint=BanEveryThird()))
    assert [e.id for e in events if hasattr(e, "id")] == plain
    assert events[-1].stats.draft["accepted"] > 0


SPLIT = {0: 16, 1: 16}      # of n_ff 32: each FFN's first 16 hidden rows on the GPU


@pytest.mark.parametrize("stream_rows", [None, 2], ids=["handed-off", "streamed"])
def test_split_ffn_layers_add_their_halves_as_the_cpu_forward_computes_the_whole(model, stream_rows):
    """A split FFN's device half runs while the CPU computes its host half (a prompt chunk: on
    streamed weights); the sum is the whole FFN."""
    mf = model("F32")
    want, want_hidden = run(Forward(mf), PROMPT[:3])
    backend = GPUBackend(stream_min_rows=stream_rows) if stream_rows else "gpu"
    fw = Forward(mf, backend=backend, ffn_split=SPLIT)
    for layer in fw.weights.layers:
        ffn = layer.ffn
        assert isinstance(ffn, SplitFFN)
        assert {m.location for m in (ffn.device.gate, ffn.device.up, ffn.device.down)} == {"gpu"}
        assert {m.location for m in (ffn.host.gate, ffn.host.up, ffn.host.down)} == {"cpu"}
        assert ffn.device.gate.rows == ffn.device.down.cols == ffn.host.up.rows == ffn.host.down.cols == 16
    got, hidden = run(fw, PROMPT[:3])
    assert max_error(got, want) < EXACT_TOL and max_error(hidden, want_hidden) < EXACT_TOL
    streamed = fw.backend.stream_stats
    assert (streamed.copies > 0) == (stream_rows is not None)


@pytest.mark.skipif(SIMULATED, reason="minutes under the simulator (the trunk's kernels at every verify width); "
                                       "the handed-off test checks a split FFN's verify rows")
def test_greedy_drafting_with_split_ffn_layers_equals_plain_decoding(model):
    assert_drafting_equals_plain_decoding(Forward(model("F32"), backend="gpu", ffn_split=SPLIT))


def test_a_split_needs_a_whole_block_of_down_columns_on_each_side(model):
    ffn = Forward(model("Q8_0")).weights.layers[0].ffn
    for rows in (0, 16, 32):
        with pytest.raises(HybridError, match="cannot split 32 hidden rows"):
            split_dense_ffn(ffn, rows)


def test_placement_forms_and_errors(model):
    mf = model("F32")
    w = Forward(mf, backend="gpu", placement={"output.weight", "blk.1.attn_q.weight"}).weights
    assert w.output.location == w.layers[1].q.location == "gpu"
    assert w.layers[1].k.location == w.layers[0].qkv.location == w.token_embd.location == "cpu"
    assert Forward(mf, backend="gpu", placement={"blk.0.ssm_out.weight": "gpu"}).weights.layers[0].out.location == "gpu"
    with pytest.raises(HybridError, match="unknown backend"):
        Forward(mf, backend="tpu")
    with pytest.raises(HybridError, match="CPU backend"):
        Forward(mf, placement=all_on_device)
    with pytest.raises(HybridError, match="expected 'gpu' or 'cpu'"):
        Forward(mf, backend="gpu", placement=lambda name: "device")


def test_prompt_chunks_on_the_device_use_views_of_one_allocation(model, monkeypatch):
    """Calls past a step's rows use the leading rows of one device allocation (STEP_ROWS scaled
    down here; on a real GPU the CHUNK tests run such calls through the whole forward)."""
    monkeypatch.setattr(hybrid.forward, "STEP_ROWS", 2)
    fw = Forward(model("F32"), backend="gpu", placement=all_on_device)
    long, short = fw._scratch_for(4), fw._scratch_for(3)
    rows = np.arange(4 * long.x.shape[1], dtype=np.float32).reshape(4, -1)
    fw.backend.copy(long.x, fw.backend.to_backend(rows))
    np.testing.assert_array_equal(fw.backend.to_host(short.x), rows[:3])
    assert short.qg3.shape[0] == 3 and fw.backend.memory.address(short.x) == fw.backend.memory.address(long.x)


def test_a_prompt_split_across_requests_keeps_the_bits_of_one_prefill(model, monkeypatch):
    """The server's case: a state holding prompt A (a cached turn), extended by B, must equal a
    prefill of A + B. The GPU computes calls under `min_prompt_rows` rows with its decode kernels
    (int8 matvec, host FFNs on the CPU) and longer ones with its prompt kernels (GEMM, streamed
    FFNs), whose last bits differ; `prompt_chunks` keeps every call of a long enough prompt on the
    prompt kernels, wherever the chunk boundaries fall. (Thresholds scaled down for the simulator.)"""
    monkeypatch.setattr(gpu.matmul.gemm, "GEMM_MIN_ROWS", 2)
    monkeypatch.setattr(gpu.runtime.pcie, "PCIE_MAX_ROWS", 1)
    monkeypatch.setattr(hybrid.generate, "PREFILL_CHUNK", 4)
    fw = Forward(model("Q8_0"), backend=GPUBackend(stream_min_rows=2))
    assert fw.min_prompt_rows == 2
    ids = np.array([3, 141, 59, 26, 53, 5, 89])
    a, b = ids[:5], ids[5:]                       # alone, a is cut 4 + 1 unless min rows apply

    def fill(state, prompt):
        *_, last = prefill(fw, state, prompt, Stats())
        return fw.backend.to_host(last)

    whole = fw.new_state(32)
    first_chunk = []                  # whole after its first call, ids[:4] = a[:4]: the control's start
    forward = fw.forward

    def recording_forward(state, chunk, **kw):
        out = forward(state, chunk, **kw)
        if state is whole and not first_chunk:
            first_chunk.append(state.copy())
        return out
    monkeypatch.setattr(fw, "forward", recording_forward)
    want = fill(whole, ids)
    assert prompt_chunks(len(ids), fw.min_prompt_rows)[0] == (0, 4)
    split = fw.new_state(32)
    fill(split, a)
    after_a = split.copy()
    got = fill(split, b)
    np.testing.assert_array_equal(got, want)
    host = fw.backend.to_host
    for i in whole.ssm:
        np.testing.assert_array_equal(host(split.ssm[i]), host(whole.ssm[i]))
    # the control: A fed 4 + 1 (as without min rows: a 1-row decode-kernel call) leaves other bits
    # than 3 + 2; its first 4 rows are whole's first call
    assert prompt_chunks(len(a)) == [(0, 4), (4, 5)]
    other = first_chunk[0]
    fw.forward(other, a[4:], logits="last")
    assert not all(np.array_equal(host(other.ssm[i]), host(after_a.ssm[i])) for i in after_a.ssm)
