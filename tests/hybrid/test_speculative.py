"""Speculative decoding with the MTP head (hybrid/speculative.py).

Three layers of checks:
* scripted: a fake trunk (the target always continues t with t + 1) and a fake head that drafts
  from a script, so every step's accept count, the stats, the bookkeeping of which MTP rows
  are true and every stop condition can be asserted exactly — and compared with plain decoding;
* rollback: the snapshot ring restores GDN/conv state bit-exactly for every accept count;
* end to end: greedy drafting emits exactly the tokens of plain decoding, on synthetic
  models and on the trained one.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import hybrid
from cpu.argmax import PICK_COLUMNS, argmax_rows
from cpu.top_logits import top_logits
from gpu.runtime.memory import to_host
from hybrid.events import Done, Prefill, Token
from hybrid.generate import generate_tokens
from hybrid.mtp import MTPHead
from hybrid.sampling import Picks, Sampler, SamplerConfig, TopLogits
from hybrid.draft_depth import DepthController
from hybrid.draft_policy import AUTO, MAX_AUTO_DEPTH
from hybrid import speculative
from hybrid.speculative import PENDING_MAX, generate_speculative
from hybrid.state import SessionState
from hybrid.synth import preset, write_model
from tests.hybrid.test_state import tiny_config

# --- scripted fakes ----------------------------------------------------------------------------

V = 32           # fake vocabulary; token t decodes to one letter, chr(ord('a') + t)
EOG = 31
WIDTH = 4        # fake hidden: (position + 1, token, made-by-MTP flag, 0)


class CountingTrunk:
    """A fake Forward whose target always continues token t with (t + 1) mod V. Its hidden rows
    are (position + 1, token, 0, 0), so the MTP side can tell which hidden it was handed."""
    min_prompt_rows = 1

    def __init__(self):
        self.config = SimpleNamespace(n_embd=WIDTH)
        self.verify_calls: list[list[int]] = []    # snapshotting steps
        self.plain_calls: list[list[int]] = []     # steps that drafted nothing

    def forward(self, state, token_ids, logits="last", snapshot=False, pick=False, top=0):
        ids = np.asarray(token_ids, np.int64)
        n = len(ids)
        state.check_fits(n)
        if snapshot:
            state.check_ring(n)
            self.verify_calls.append(ids.tolist())
        elif logits == "all":
            self.plain_calls.append(ids.tolist())
        hidden = np.zeros((n, WIDTH), np.float32)
        hidden[:, 0] = np.arange(state.n_past, state.n_past + n) + 1
        hidden[:, 1] = ids
        state.advance(n, snapshot)
        if logits == "none":
            return None, hidden
        rows = ids if logits == "all" else ids[-1:]
        out = np.full((len(rows), V), -10.0, np.float32)
        out[np.arange(len(rows)), (rows + 1) % V] = 10.0
        return (as_picks(out) if pick else as_top(out, top) if top else out), hidden

    def one_off_work(self) -> int:
        return 0            # nothing compiles or is captured: every step is steady


class ScriptedHead:
    """A fake MTP head. Each call that wants logits drafts the next scripted (token, confidence);
    with no script it drafts the right token (t + 1) with confidence 1. Every row it runs is
    recorded as position → (token, hidden it was paired with)."""

    def __init__(self, script=None):
        self.script = None if script is None else list(script)
        self.rows: dict[int, tuple[int, tuple]] = {}
        self.calls: list[tuple[int, list[int]]] = []

    def forward(self, state, token_ids, hidden_prev, logits="last", pick=False):
        ids = np.asarray(token_ids, np.int64)
        n, p0 = len(ids), state.mtp_n_past
        assert hidden_prev.shape == (n, WIDTH)
        for i in range(n):
            self.rows[p0 + i] = (int(ids[i]), tuple(float(v) for v in hidden_prev[i, :3]))
        self.calls.append((p0, ids.tolist()))
        state.mtp_n_past += n
        hidden = np.zeros((n, WIDTH), np.float32)
        hidden[:, 0] = np.arange(p0, p0 + n) + 1
        hidden[:, 1] = ids
        hidden[:, 2] = 1.0
        if logits == "none":
            return None, hidden
        token, confidence = self.script.pop(0) if self.script is not None else ((int(ids[-1]) + 1) % V, 1.0)
        row = np.full(V, np.log((1.0 - confidence) / (V - 1)) if confidence < 1.0 else -30.0)
        row[token] = np.log(confidence)
        out = row[None].astype(np.float32)
        return (as_picks(out) if pick else out), hidden


def as_top(logits: np.ndarray, count: int) -> list[TopLogits]:
    """What a forward called with top=count returns for these logits."""
    out = np.empty((logits.shape[0], 2 * TopLogits.count(count, logits.shape[1])), np.uint32)
    top_logits(np.ascontiguousarray(logits, np.float32), out)
    return TopLogits.rows(out, logits.shape[1])


def as_picks(logits: np.ndarray) -> Picks:
    """What a forward called with pick=True returns for these logits."""
    out = np.empty((logits.shape[0], PICK_COLUMNS), np.float32)
    argmax_rows(np.ascontiguousarray(logits, np.float32), out)
    return Picks.of(out)


class LetterTokenizer:
    def stream_decoder(self):
        return SimpleNamespace(push=lambda t: chr(ord("a") + t), flush=lambda: "")

    def is_eog(self, t):
        return t == EOG


def greedy():
    return Sampler(SamplerConfig(temperature=0.0))


def run_speculative(head, *, prompt=(0, 1, 2), depth=3, max_tokens=100, n_ctx=64, **kw):
    trunk = CountingTrunk()
    state = SessionState(tiny_config(), n_ctx, n_ring=(5 if depth == AUTO else depth + 1))
    events = list(generate_speculative(trunk, head, state, LetterTokenizer(), list(prompt), max_tokens=max_tokens,
                                       sampler=greedy(), depth=depth, n_ctx=n_ctx, **kw))
    return events, trunk, state


def run_plain(*, prompt=(0, 1, 2), max_tokens=100, n_ctx=64, **kw):
    state = SessionState(tiny_config(), n_ctx)
    return list(generate_tokens(CountingTrunk(), state, LetterTokenizer(), list(prompt), max_tokens=max_tokens,
                                sampler=greedy(), n_ctx=n_ctx, **kw))


def tokens(events):
    return [e.id for e in events if isinstance(e, Token)]


def done(events) -> Done:
    assert isinstance(events[-1], Done)
    return events[-1]


def assert_mtp_rows_are_true(head: ScriptedHead, state, sequence):
    """Every MTP row the cache keeps (< mtp_n_past) pairs x_p with the trunk's hidden of p−1."""
    for p in range(state.mtp_n_past):
        token, (h_pos, h_token, made_by_mtp) = head.rows[p]
        assert token == sequence[p], f"MTP row {p}"
        assert made_by_mtp == 0.0 and h_pos == p, f"MTP row {p} holds a hidden of position {h_pos - 1}"
        if p > 0:
            assert h_token == sequence[p - 1]


def test_scripted_accept_2_then_0_then_3_of_3():
    right = 1.0
    script = [(4, right), (5, right), (9, right),        # step 1, after 3: keep 4, 5; 9 is wrong
              (9, right), (9, right), (9, right),        # step 2, after 6: keep none
              (8, right), (9, right), (10, right)]       # step 3, after 7: keep all three
    head = ScriptedHead(script)
    events, trunk, state = run_speculative(head, depth=3, max_tokens=9)
    assert tokens(events) == [3, 4, 5, 6, 7, 8, 9, 10, 11]
    assert trunk.verify_calls == [[3, 4, 5, 9], [6, 9, 9, 9], [7, 8, 9, 10]]
    # pending rows: the kept drafts are redone with the trunk's hiddens in the next seed call
    assert head.calls == [(0, [0, 1, 2]), (3, [3]), (4, [4]), (5, [5]),
                          (4, [4, 5, 6]), (7, [9]), (8, [9]),
                          (7, [7]), (8, [8]), (9, [9])]
    assert head.script == []
    stats = done(events).stats
    assert (stats.stop_reason, stats.generated_tokens, stats.prompt_tokens) == ("length", 9, 3)
    d = stats.draft
    assert (d["depth"], d["steps"], d["drafted"], d["accepted"]) == (3, 3, 9, 5)
    assert d["acceptance"] == pytest.approx(5 / 9)
    assert d["tokens_per_step"] == pytest.approx(8 / 3)
    # per position: steps that kept draft i / steps that offered it
    assert d["acceptance_by_position"] == pytest.approx([2 / 3, 2 / 3, 1 / 3])
    assert state.n_past == 11 and state.mtp_n_past == 8
    assert_mtp_rows_are_true(head, state, [0, 1, 2, *tokens(events)])


def test_an_idle_mtp_head_runs_no_rows_and_the_output_is_plain_decodings():
    """A controller that knows draft 1 cannot pay (never kept, a drafted row costing a whole
    step) chooses depth 0 with the MTP head idle: the rows plain steps leave waiting are skipped,
    not run (no MTP call after the prompt's before its next probe), and the output is plain
    decoding's."""
    c = DepthController(MAX_AUTO_DEPTH, start=0)
    for _ in range(30):
        c.record(1, 0, 2.0)
        c.record(0, 0, 1.0)
    assert c.mtp_idle
    head = ScriptedHead()
    events, trunk, state = run_speculative(head, depth=AUTO, max_tokens=60, controller=c)
    assert tokens(events) == tokens(run_plain(max_tokens=60))
    assert head.calls == [(0, [0, 1, 2])] and trunk.verify_calls == []      # the prompt's rows only
    assert 0 < state.n_past - state.mtp_n_past <= PENDING_MAX   # positions skipped, the last rows wait


def test_the_first_drafting_step_after_plain_ones_teaches_no_cost():
    """Its MTP call runs the rows plain steps left waiting, a cost of the depth before; every
    other step is steady, a change between drafting depths included (its MTP call redoes only
    the rows the step before kept, as a steady step's does; the fakes do no one-off work)."""
    class Spy(DepthController):
        def __init__(self):
            super().__init__(3, start=0)
            self.script = iter([0, 0, 0, 2, 2, 2, 1, 3, 3, 0, 0, 1, 1] * 3)
            self.records = []

        def choose(self):
            self.steps += 1
            self.depth = next(self.script, 1)
            return self.depth

        def record(self, drafted, accepted, seconds, steady=True):
            self.records.append((drafted, steady))
            super().record(drafted, accepted, seconds, steady)

    spy = Spy()
    run_speculative(ScriptedHead(), depth=AUTO, max_tokens=50, controller=spy)
    drafted = [d for d, _ in spy.records]
    assert len(set(drafted)) == 4
    assert [steady for _, steady in spy.records] == [True] + [not (a == 0 and b > 0) for a, b in zip(drafted, drafted[1:])]


def test_the_stats_name_the_depth_auto_settled_on_not_a_probes():
    """A run whose last steps were a probe's (here: every step away from the choice, depth 2)
    reports the choice it returns to, not the depth it probed."""
    class Probing(DepthController):
        def choose(self):
            self.steps += 1
            self.choice, self.depth = 2, 0
            return self.depth

    events, _, _ = run_speculative(ScriptedHead(), depth=AUTO, max_tokens=12, controller=Probing(3))
    assert events[-1].stats.draft["depth"] == "auto(2)"


def test_p_min_stops_a_draft_early():
    script = [(4, 0.9), (5, 0.9), (6, 0.3),      # step 1: the third draft is too unsure
              (8, 0.2)]                          # step 2: even the first one is
    head = ScriptedHead(script)
    events, trunk, state = run_speculative(head, depth=3, max_tokens=6, p_min=0.5)
    assert tokens(events) == [3, 4, 5, 6, 7, 8]
    # step 3 has room for no draft (max_tokens): the trunk runs 7 alone, without a snapshot, and
    # its MTP row waits for a next draft
    assert trunk.verify_calls == [[3, 4, 5], [6]]
    assert head.script == []
    d = done(events).stats.draft
    assert (d["steps"], d["drafted"], d["accepted"]) == (3, 2, 2)
    assert d["tokens_per_step"] == pytest.approx(5 / 3)
    assert d["acceptance_by_position"] == [1.0, 1.0]
    assert_mtp_rows_are_true(head, state, [0, 1, 2, *tokens(events)])


@pytest.mark.parametrize("depth", [1, 3, 4])
def test_max_tokens_is_never_exceeded_even_when_everything_is_accepted(depth):
    for max_tokens in range(0, 13):
        events, trunk, _ = run_speculative(ScriptedHead(), depth=depth, max_tokens=max_tokens)
        assert tokens(events) == list(range(3, 3 + max_tokens))
        assert done(events).stats.stop_reason == "length"
        assert done(events).stats.generated_tokens == max_tokens
        # no verify pass drafts more than what is still wanted (steps with no room to draft
        # run the trunk on their one token without a snapshot)
        assert sum(len(c) for c in trunk.verify_calls + trunk.plain_calls) == max(0, max_tokens - 1)


SCENARIOS = {
    "stop string": dict(stop=["hi"]),                      # tokens 7, 8 = "h", "i"
    "stop string held then released": dict(stop=["hx"]),  # "h" held back, released with "i"
    "eog mid-step": dict(prompt=(20, 21, 22)),            # the 9th token is EOG (31)
    "eog ignored": dict(prompt=(20, 21, 22), ignore_eos=True, max_tokens=20),
    "context end": dict(n_ctx=12),
    "context end, one free slot": dict(n_ctx=5),
}


@pytest.mark.parametrize("depth", [1, 2, 3, 4, AUTO])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_stop_condition_matches_plain_decoding(scenario, depth):
    """With an always-right head most steps keep several tokens, so every stop lands mid-step."""
    kw = SCENARIOS[scenario]
    expect = run_plain(**kw)
    events, _, _ = run_speculative(ScriptedHead(), depth=depth, **kw)
    def shown(evs):
        return [(type(e).__name__, getattr(e, "id", None), e.text) for e in evs if not isinstance(e, Prefill)]
    assert shown(events) == shown(expect)
    assert (done(events).stats.stop_reason, done(events).stats.generated_tokens) == \
        (done(expect).stats.stop_reason, done(expect).stats.generated_tokens)


def test_stop_scenarios_stop_where_intended():
    assert done(run_plain(**SCENARIOS["stop string"])).stats.stop_reason == "stop_string"
    assert done(run_plain(**SCENARIOS["eog mid-step"])).stats.generated_tokens == 9
    assert done(run_plain(**SCENARIOS["eog ignored"])).stats.stop_reason == "length"
    assert len(tokens(run_plain(**SCENARIOS["context end"]))) == 12 - 3


# --- snapshot ring rollback on a real model -----------------------------------------------------

CODE = "import os\nimport sys\n\n\ndef read_lines(path):\n    with open(path) as f:\n        return f.readlines()\n"


@pytest.fixture(scope="module")
def trained(trained_model_q4km):
    return hybrid.load(trained_model_q4km, threads=1)


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_rollback_to_every_accept_count_equals_a_fresh_run(trained, k):
    """A k-token verify, then keep 1..k of it (accept count 0..k−1): GDN/conv states, positions
    and the logits of what follows equal a fresh run over prefix + kept tokens, bit for bit."""
    fw = trained.forward
    ids = np.asarray(trained.tokenizer.encode(CODE))
    prefix, verify, after = ids[:9], ids[9:9 + k], ids[15:18]
    base = fw.new_state(64, n_ring=5)
    fw.forward(base, prefix, logits="none")
    for n_keep in range(1, k + 1):
        state = base.copy()
        fw.forward(state, verify, logits="all", snapshot=True)
        state.rollback(n_keep)
        fresh = fw.new_state(64)
        fw.forward(fresh, np.concatenate([prefix, verify[:n_keep]]), logits="none")
        assert state.n_past == fresh.n_past == len(prefix) + n_keep
        for i in fresh.ssm:
            np.testing.assert_array_equal(to_host(state.ssm[i]), to_host(fresh.ssm[i]),
                                          err_msg=f"layer {i} keep {n_keep}/{k}")
            np.testing.assert_array_equal(to_host(state.conv[i]), to_host(fresh.conv[i]),
                                          err_msg=f"layer {i} keep {n_keep}/{k}")
        got, _ = fw.forward(state, after, logits="all")
        expect, _ = fw.forward(fresh, after, logits="all")
        np.testing.assert_array_equal(got, expect)


# --- greedy drafting == plain decoding, end to end ----------------------------------------------

N_TOKENS = 500
DEPTHS = [1, 2, 3, 4, "auto"]


def generate(model, prompt, draft, head=None, n_tokens=N_TOKENS, repeat_penalty=1.0):
    """Greedy tokens, the Done event, the state and every rollback's kept count; with `head`,
    the model drafts with it instead of its own MTP head."""
    model._mtp = head
    state, kept = None, []
    if draft != 0:
        state = model.forward.new_state(model.n_ctx, n_ring=5 if draft == "auto" else draft + 1)
        rollback = state.rollback
        state.rollback = lambda n_keep: (kept.append(n_keep), rollback(n_keep))
    events = list(model.generate(prompt, max_tokens=n_tokens, temperature=0.0, draft=draft,
                                 repeat_penalty=repeat_penalty, ignore_eos=True, state=state))
    model._mtp = None
    return tokens(events), done(events), state, kept


class KnownFutureHead:
    """The model's real MTP head — its KV cache and hiddens are what speculative.py manages —
    with its drafts replaced by the token plain decoding emitted there, except at ~30% of the
    positions where it drafts a wrong one. A random-weight model's own head is (almost) never
    right, so without this only the reject-everything path would run."""

    def __init__(self, head: MTPHead, sequence: list[int], n_vocab: int):
        self.head, self.sequence, self.n_vocab = head, sequence, n_vocab
        self.wrong = np.random.default_rng(11).random(len(sequence) + 8) < 0.3

    def forward(self, state, token_ids, hidden_prev, logits="last", pick=False):
        p = state.mtp_n_past + len(token_ids) - 1          # the row whose logits come back
        out, hidden = self.head.forward(state, token_ids, hidden_prev, logits=logits, pick=pick)
        if out is None:
            return out, hidden
        target = self.sequence[p + 1] if p + 1 < len(self.sequence) else 0
        if self.wrong[p + 1]:
            target = (target + 1) % self.n_vocab
        fake = np.zeros((1, self.n_vocab), np.float32)
        fake[0, target] = 10.0
        return (as_picks(fake) if pick else fake), hidden


@pytest.fixture(scope="module", params=["Q4_K_M", "Q8_0"])
def synthetic(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("spec") / f"tiny-{request.param}.gguf"
    write_model(path, preset("tiny", arch="qwen35", mtp=True), types=request.param, seed=5)
    model = hybrid.load(path, threads=1, n_ctx=N_TOKENS + 64)
    prompt = [int(t) for t in np.random.default_rng(2).integers(0, model.config.n_vocab, 8)]
    plain, _, _, _ = generate(model, prompt, 0)
    return model, prompt, plain


@pytest.mark.parametrize("draft", DEPTHS)
def test_synthetic_greedy_drafting_equals_plain_decoding(synthetic, draft):
    model, prompt, plain = synthetic
    head = KnownFutureHead(model.mtp, prompt + plain, model.config.n_vocab)
    got, end, _, kept = generate(model, prompt, draft, head)
    assert len(got) == N_TOKENS and end.stats.stop_reason == "length"
    assert got == plain
    d = end.stats.draft
    print(f"\ndraft {draft}: acceptance {d['acceptance']:.2f}, {d['tokens_per_step']:.2f} tokens/step")
    assert 0.3 < d["acceptance"] < 0.9
    if draft != "auto":
        assert set(kept) == set(range(1, draft + 2))     # every accept count 0..depth happened


def test_synthetic_own_head_drafting_equals_plain_decoding(synthetic):
    model, prompt, plain = synthetic
    got, end, _, _ = generate(model, prompt, 2, n_tokens=200)
    assert got == plain[:200]
    assert end.stats.draft["steps"] > 0


# Without a penalty this model loops on one line within ~30 tokens (and every draft is kept);
# with one it writes varied code, and the verify rows must see the drafts in their history.
TRAINED_PENALTY = 1.3


@pytest.fixture(scope="module")
def trained_plain(trained):
    """Plain greedy decoding, and a token-by-token teacher-forced run over its output that
    leaves every trunk and MTP row as one-row calls compute it (the MTP row p on x_p and the
    trunk's h_{p−1}): what drafting's caches must hold afterwards."""
    prompt = trained.tokenizer.encode(CODE)
    plain, _, _, _ = generate(trained, prompt, 0, repeat_penalty=TRAINED_PENALTY)
    sequence = np.asarray(prompt + plain)
    fw, head = trained.forward, trained.mtp
    teacher = fw.new_state(len(sequence))
    # the prompt in one call, as the prefill runs it (long calls may take a different kernel)
    _, hidden = fw.forward(teacher, sequence[:len(prompt)], logits="none")
    head.forward(teacher, sequence[:len(prompt)],
                 np.concatenate([np.zeros((1, hidden.shape[1]), np.float32), hidden[:-1]]), logits="none")
    h_prev = hidden[-1:]
    for p in range(len(prompt), len(sequence) - 1):      # the last emitted token is never run
        _, hidden = fw.forward(teacher, sequence[p:p + 1], logits="none")
        head.forward(teacher, sequence[p:p + 1], h_prev, logits="none")
        h_prev = hidden
    return prompt, plain, teacher


@pytest.mark.parametrize("draft", DEPTHS)
def test_trained_greedy_drafting_equals_plain_decoding(trained, trained_plain, draft, monkeypatch):
    """The trained head's own drafts. Afterwards the caches hold exactly what plain decoding and
    a teacher-forced MTP pass write: the trunk's up to n_past, the MTP head's up to mtp_n_past
    (its kept rows redone with the trunk's true hiddens, not its own), but for the positions an
    idle MTP head skipped."""
    prompt, plain, teacher = trained_plain
    skipped: list[int] = []          # MTP positions flush_pending(drop=True) passed over
    flush = speculative.flush_pending

    def spy(mtp, state, pending_ids, pending_h, drop=False):
        before = state.mtp_n_past
        out = flush(mtp, state, pending_ids, pending_h, drop)
        skipped.extend(range(before, state.mtp_n_past))
        return out
    monkeypatch.setattr(speculative, "flush_pending", spy)
    got, end, state, kept = generate(trained, prompt, draft, repeat_penalty=TRAINED_PENALTY)
    assert got == plain
    d = end.stats.draft
    print(f"\ndraft {draft}: acceptance {d['acceptance']:.2f}, {d['tokens_per_step']:.2f} tokens/step, "
          f"by position {np.round(d['acceptance_by_position'], 2).tolist()}")
    assert d["acceptance_by_position"][0] > 0.5         # an off-by-one pairing gives ~0.01
    assert len(set(kept)) > 1                            # steps with different accept counts

    assert state.n_past == teacher.n_past == len(prompt) + len(plain) - 1
    n_mtp = state.mtp_n_past
    # behind by the last step's drafts, and by the rows that steps drafting nothing left waiting
    assert state.n_past - (4 if draft == "auto" else draft) - (PENDING_MAX - 1) <= n_mtp <= state.n_past
    for i in teacher.ssm:       # compared as host copies: on a GPU the states are device arrays
        np.testing.assert_array_equal(to_host(state.ssm[i]), to_host(teacher.ssm[i]))
        np.testing.assert_array_equal(to_host(state.conv[i]), to_host(teacher.conv[i]))
    # auto may have idled the MTP head (draft_depth.mtp_idle: a CPU step's cost depends on the
    # box), skipping positions of steps that drafted nothing: those rows hold whatever was there
    # (nothing, or a chained draft's row from its own hidden); every other row is the teacher's
    assert draft == "auto" or not skipped
    true_mtp_rows = np.ones(n_mtp, bool)
    true_mtp_rows[[p for p in skipped if p < n_mtp]] = False
    for ours, ref, used in ((state.kv, teacher.kv, state.n_past), (state.mtp_kv, teacher.mtp_kv, n_mtp)):
        for i in ref:
            k, v = (to_host(a)[:, :used] for a in ours[i])
            k_ref, v_ref = (to_host(a)[:, :used] for a in ref[i])
            rows = true_mtp_rows if ours is state.mtp_kv else np.ones(used, bool)
            assert rows.sum() > len(prompt)
            np.testing.assert_array_equal(k[:, rows], k_ref[:, rows])
            np.testing.assert_array_equal(v[:, rows], v_ref[:, rows])


def test_sampled_drafting_is_seeded_and_respects_max_tokens(trained):
    """Sampling with drafts: the same seed gives the same text; drafts are kept now and then."""
    prompt = trained.tokenizer.encode(CODE)

    def sample(seed):
        events = list(trained.generate(prompt, max_tokens=64, temperature=0.8, seed=seed, draft=3,
                                       ignore_eos=True))
        return tokens(events), done(events).stats

    first, stats = sample(1)
    again, _ = sample(1)
    other, _ = sample(2)
    assert first == again and first != other
    assert len(first) == 64 and stats.stop_reason == "length"
    assert 0 < stats.draft["accepted"] < stats.draft["drafted"]
