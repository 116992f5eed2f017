"""hybrid.session.ChatSession: later turns prefill only new tokens, and continue exactly as a fresh
prefill of the whole conversation would: the same tokens (greedy), and a state holding the bits
that the session's own calls compute in a new state. Not those of one call over everything: on
the CPU every row of a call has a one-row call's bits, but on a GPU a call of GEMM_MIN_ROWS rows
or more takes the GEMM, whose rows have other bits (gpu/matmul/matvec.py)."""
import numpy as np
import pytest

import hybrid
from gpu.runtime.memory import to_host
from hybrid.errors import HybridError
from hybrid.events import Done, Prefill, Token
from hybrid.generate import prompt_chunks

GREEDY = dict(max_tokens=10, temperature=0)


@pytest.fixture(scope="module")
def model():
    return hybrid.load(threads=1)


def run(events):
    tokens, prefills, done = [], [], None
    for ev in events:
        if isinstance(ev, Token):
            tokens.append(ev.id)
        elif isinstance(ev, Prefill):
            prefills.append(ev)
        elif isinstance(ev, Done):
            done = ev
    return tokens, prefills, done.stats


def fresh(model, ids, draft=0):
    return run(model.generate(list(ids), draft=draft, **GREEDY))[0]


def assert_state_is_what_its_calls_compute(model, session, prompts):
    """The session's state holds exactly what running its consumed ids into a new state gives, in
    the calls the session made: each turn's prompt from its first uncached id, `prompts` giving
    (cached, prompt end) per turn, in prefill chunks; every other id (a reply token) one row at a
    time (a drafting step verifies several, with a one-row call's bits on every backend); on the
    CPU, whose kernels keep a row's bits at any call size, as one call of every id. Every GDN/conv
    state and every used KV row, bit for bit; arrays on a GPU compared as host copies."""
    ids = session.tokens
    assert ids and session.state.n_past == len(ids)
    calls, done = [], 0
    for cached, end in prompts:
        calls += [ids[p:p + 1] for p in range(done, cached)]
        calls += [ids[cached + a:cached + b] for a, b in prompt_chunks(end - cached, model.forward.min_prompt_rows)]
        done = end
    calls += [ids[p:p + 1] for p in range(done, len(ids))]
    if model.forward.min_prompt_rows == 1:
        # one kind of kernel for every call size (the CPU): a single call of every id is the same
        calls = [ids]
    want = model.forward.new_state(session.n_ctx)
    for call in calls:
        model.forward.forward(want, np.asarray(call), logits="none")
    got, n = session.state, len(ids)
    for i in want.ssm:
        np.testing.assert_array_equal(to_host(got.ssm[i]), to_host(want.ssm[i]), err_msg=f"ssm of layer {i}")
        np.testing.assert_array_equal(to_host(got.conv[i]), to_host(want.conv[i]), err_msg=f"conv of layer {i}")
    for i, (k, v) in want.kv.items():
        np.testing.assert_array_equal(to_host(got.kv[i][0])[:, :n], to_host(k)[:, :n], err_msg=f"K of layer {i}")
        np.testing.assert_array_equal(to_host(got.kv[i][1])[:, :n], to_host(v)[:, :n], err_msg=f"V of layer {i}")


@pytest.mark.parametrize("draft", [0, 2])
def test_second_turn_prefills_only_new_tokens_and_matches_a_fresh_prefill(model, draft):
    s = model.session(system="You write Python.", draft=draft)
    first = s.render("def add(a, b):")
    tokens1, _, st1 = run(s.send("def add(a, b):", **GREEDY))
    assert st1.cached_tokens == 0 and st1.prompt_tokens == len(first)
    assert tokens1 == fresh(model, first, draft)

    second = s.render("now subtract")
    assert second[:len(first)] == first
    tokens2, prefills, st2 = run(s.send("now subtract", **GREEDY))
    # at least the whole first prompt is reused; only the rest goes through prefill
    assert st2.cached_tokens >= len(first)
    assert st2.cached_tokens + st2.prompt_tokens == len(second)
    assert prefills[-1].total == st2.prompt_tokens
    assert tokens2 == fresh(model, second, draft)
    assert_state_is_what_its_calls_compute(model, s, [(0, len(first)), (st2.cached_tokens, len(second))])
    assert [m["role"] for m in s.messages] == ["user", "assistant", "user", "assistant"]


def test_raw_generate_continues_the_live_state(model):
    s = model.session(draft=0)      # plain decoding runs its last token too: the state holds all
    part1 = model.tokenizer.encode("def add(a, b):")
    tokens1, _, _ = run(s.generate(part1, **GREEDY))
    part2 = model.tokenizer.encode("\n\ndef sub(a, b):", add_special=False)
    tokens2, _, st = run(s.generate(part2, **GREEDY))
    history = part1 + tokens1
    assert st.cached_tokens == len(history)          # prompt + every reply token, nothing re-run
    assert st.prompt_tokens == len(part2)
    assert tokens2 == fresh(model, history + part2)
    assert_state_is_what_its_calls_compute(model, s, [(0, len(part1)), (len(history), len(history + part2))])


def test_repeat_penalty_sees_the_cached_tokens(model):
    penalty = dict(GREEDY, max_tokens=16, repeat_penalty=1.5, repeat_last_n=-1)
    s = model.session()
    part1 = model.tokenizer.encode("def add(a, b):\n    return a + b\n")
    tokens1, _, _ = run(s.generate(part1, **penalty))
    part2 = model.tokenizer.encode("\ndef add(a, b):", add_special=False)
    tokens2, _, st = run(s.generate(part2, **penalty))
    assert st.cached_tokens > 0
    assert tokens2 == run(model.generate(part1 + tokens1 + part2, **penalty))[0]


def test_checkpoint_restores_trunk_and_mtp_state_exactly(model):
    from hybrid.session import _Checkpoint
    ids = np.asarray(model.tokenizer.encode("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):"))
    mtp, D = model.mtp, model.config.n_embd

    def prefix(state, n, seq=ids):
        _, hidden = model.forward.forward(state, seq[:n], logits="none")
        mtp.forward(state, seq[:n], np.concatenate([np.zeros((1, D), np.float32), hidden[:-1]]), logits="none")
        return hidden[-1:]

    state = model.forward.new_state(64, n_ring=3)
    h = prefix(state, 8)
    ckpt = _Checkpoint.take(state, list(ids[:8]))
    state.reset()                                  # overwrite everything: another sequence
    prefix(state, len(ids), ids[::-1].copy())
    state.n_past, state.mtp_n_past = 3, 5
    ckpt.restore(state)
    got, got_h = model.forward.forward(state, ids[8:12], logits="all")
    got_mtp, _ = mtp.forward(state, ids[8:9], h, logits="all")
    ref = model.forward.new_state(64)
    h_ref = prefix(ref, 8)
    want, want_h = model.forward.forward(ref, ids[8:12], logits="all")
    want_mtp, _ = mtp.forward(ref, ids[8:9], h_ref, logits="all")
    assert np.array_equal(got, want) and np.array_equal(got_h, want_h) and np.array_equal(got_mtp, want_mtp)


def test_an_interrupted_turn_resumes_from_the_checkpoint(model):
    """Ctrl-C may land inside a forward pass, so the live state is not trusted afterwards; the copy
    taken when the prompt finished prefilling still is."""
    s = model.session()
    first = s.render("def add(a, b):")
    events = s.send("def add(a, b):", max_tokens=50, temperature=0)
    while not isinstance(next(events), Token):
        pass
    done = events.throw(KeyboardInterrupt())      # what display.drive does with a Ctrl-C
    assert isinstance(done, Done) and done.stats.stop_reason == "interrupted"
    with pytest.raises(StopIteration):
        next(events)
    second = s.render("again")
    tokens, _, st = run(s.send("again", **GREEDY))
    assert st.cached_tokens == len(first)
    assert tokens == fresh(model, second)
    assert_state_is_what_its_calls_compute(model, s, [(0, len(first)), (len(first), len(second))])


def test_a_conversation_that_does_not_continue_the_state_starts_over(model):
    s = model.session()
    run(s.generate("import os", **GREEDY))           # raw tokens: no chat template
    wanted = s.render("hello")
    _, _, st = run(s.send("hello", **GREEDY))
    assert st.cached_tokens == 0 and st.prompt_tokens == len(wanted)
    s.reset()
    assert s.messages == [] and s.state.n_past == 0
    _, _, st = run(s.send("hello", **GREEDY))
    assert st.cached_tokens == 0


def test_bad_calls_give_clear_errors(model):
    s = model.session(n_ctx=16)
    with pytest.raises(HybridError, match="no longer fits the context of 16"):
        s.send("a long message " * 10)
    with pytest.raises(HybridError, match="unknown sampling option"):
        s.send("hi", temprature=0)
    with pytest.raises(HybridError, match="draft depth"):
        model.session(draft="lots")
    with pytest.raises(HybridError, match="outside the vocabulary"):
        s.generate([model.config.n_vocab])
    assert s.state.n_past == 0
