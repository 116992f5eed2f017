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


@pytest.mark.parametrize("depth", [2, 4])
def test_the_warm_up_runs_every_step_of_the_next_generation_twice_on_its_state(monkeypatch, depth):
    m = hybrid.load(None, device="cpu")
    log = logged(m, monkeypatch)
    with monkeypatch.context() as gpu:          # the warm-up's GPU branch, with a graph cache
        gpu.setattr(m, "device", "cuda")
        gpu.setattr(m.forward.backend, "graphs", types.SimpleNamespace(enabled=True), raising=False)
        gpu.setattr(m.forward.backend, "planning", None, raising=False)
        gpu.setattr(hybrid.api, "prepare", lambda run, *a, **k: 0)          # nothing to compile here
        m.warmup(draft_depth=depth)
    warm = list(log)
    met = []
    for draft, temperature in ((depth, 0.0), (depth, 0.8), ("auto", 0.0), (0, 0.0), (0, 0.8)):
        if draft == "auto" and depth < 4:
            continue                                                           # auto may draft 4 deep
        del log[:]
        events = list(m.generate("def fibonacci(n):", max_tokens=40, temperature=temperature, seed=3,
                                 draft=draft, ignore_eos=True))
        assert events[-1].stats.generated_tokens == 40
        prompt_rows = events[-1].stats.prompt_tokens
        met += [(s, c) for s, c in log if c[1] != prompt_rows]              # the steps after the prompt
    states = {s for s, _ in met}
    assert len(states) == 1                                                    # one state, kept and reused
    state = states.pop()
    captured = {}
    for s, c in warm:
        if s == state:
            captured[c] = captured.get(c, 0) + 1
    missing = {c for _, c in met if captured.get(c, 0) < 2}
    assert not missing, sorted(missing)
    assert any(c[0] == "rollback" for _, c in met) and any(c[0] == "mtp" for _, c in met)
