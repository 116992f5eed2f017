"""Model.warmup on a GPU model captures, on the state the next generation gets, every step that
generation may meet: each call of the trunk and the MTP head (by rows and flags) and each rollback
slot, twice (the eager run, then the capture), so the generation replays from its first step.

The calls are compared here without a GPU: the bundled model on the CPU, its warm-up taking the
GPU branch (a stand-in graph cache, compilation left out), every forward, MTP and rollback call
logged with the state it stepped. On a real GPU, tests/gpu/test_graphs.py checks that nothing is
captured after the prompt."""
import types

import pytest

import hybrid
import hybrid.api
from hybrid.state import SessionState


def logged(m, monkeypatch) -> list:
    """Log (state, call) of every trunk, MTP and rollback call of `m` from now on."""
    log = []
    trunk, mtp, rollback = m.forward.forward, m.mtp.forward, SessionState.rollback

    def forward(state, ids, logits="last", snapshot=False, pick=False, top=0):
        log.append((id(state), ("trunk", len(ids), logits, snapshot, pick, top)))
        return trunk(state, ids, logits=logits, snapshot=snapshot, pick=pick, top=top)

    def head(state, ids, hidden, logits="last", pick=False):
        log.append((id(state), ("mtp", len(ids), logits, pick)))
        return mtp(state, ids, hidden, logits=logits, pick=pick)

    def restore(state, n_keep):
        if n_keep < state.ring_len:          # the captured step: a copy from ring slot n_keep − 1
            log.append((id(state), ("rollback", n_keep - 1)))
        return rollback(state, n_keep)
    monkeypatch.setattr(m.forward, "forward", forward)
    monkeypatch.setattr(m.mtp, "forward", head)
    monkeypatch.setattr(SessionState, "rollback", restore)
    return log


def warmed(m, monkeypatch, depth: int) -> tuple[list, dict]:
    """The log from now on, and what `m`'s warm-up (its GPU branch, with a graph cache) ran on
    each state: {state: {call: times}}."""
    log = logged(m, monkeypatch)
    with monkeypatch.context() as gpu:
        gpu.setattr(m, "device", "cuda")
        gpu.setattr(m.forward.backend, "graphs", types.SimpleNamespace(enabled=True), raising=False)
        gpu.setattr(m.forward.backend, "planning", None, raising=False)
        gpu.setattr(hybrid.api, "prepare", lambda run, *a, **k: 0)          # nothing to compile here
        m.warmup(draft_depth=depth)
    ran: dict = {}
    for s, c in log:
        ran.setdefault(s, {})[c] = ran.setdefault(s, {}).get(c, 0) + 1
    del log[:]
    return log, ran


def steps_after_prompt(log, events) -> list:
    """The logged calls of a generation past its prompt (calls of the prompt's row count left out)."""
    prompt_rows = events[-1].stats.prompt_tokens
    return [(s, c) for s, c in log if c[1] != prompt_rows]


def uncaptured(ran: dict, met: list) -> set:
    """Calls of `met` that the warm-up did not run twice on the state they stepped."""
    return {c for s, c in met if ran.get(s, {}).get(c, 0) < 2}


@pytest.mark.parametrize("depth", [2, 4])
def test_the_warm_up_runs_every_step_of_the_next_generation_twice_on_its_state(monkeypatch, depth):
    m = hybrid.load(None, device="cpu")
    log, ran = warmed(m, monkeypatch, depth)
    met = []
    for draft, temperature in ((depth, 0.0), (depth, 0.8), ("auto", 0.0), (0, 0.0), (0, 0.8)):
        if draft == "auto" and depth < 4:
            continue                                                           # auto may draft 4 deep
        del log[:]
        events = list(m.generate("def fibonacci(n):", max_tokens=40, temperature=temperature, seed=3,
                                 draft=draft, ignore_eos=True))
        assert events[-1].stats.generated_tokens == 40
        met += steps_after_prompt(log, events)
    assert len({s for s, _ in met}) == 1                                       # one state, kept and reused
    assert not uncaptured(ran, met), sorted(uncaptured(ran, met))
    assert any(c[0] == "rollback" for _, c in met) and any(c[0] == "mtp" for _, c in met)


def test_a_chat_session_claims_the_state_the_warm_up_captured_on():
    """`hybrid chat` and the server keep one state for their lifetime: they take the one the
    warm-up captured its steps on (`Model.claim_state`), so their first turn replays too."""
    m = hybrid.load(None, device="cpu")
    with pytest.MonkeyPatch.context() as monkeypatch:
        log, ran = warmed(m, monkeypatch, 4)
        session = m.session(draft="auto")
        met = []
        for text in ("Write a function.", "Now a test for it."):
            events = list(session.send(text, max_tokens=24, temperature=0.0, ignore_eos=True))
            met += steps_after_prompt(log, events)
            del log[:]
    assert {s for s, _ in met} == {id(session.state)} and id(session.state) in ran
    assert not uncaptured(ran, met), sorted(uncaptured(ran, met))
    assert m.claim_state(m.n_ctx, 5) is not session.state                     # handed out once
