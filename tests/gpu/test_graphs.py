"""CUDA-graph replay of forward steps (gpu/runtime/graphs.py).

On a real GPU: a forward whose steps are captured and replayed gives the same bits as the
same forward launching every kernel from Python, for decode steps, verify steps with the
snapshot ring and rollback, and prompt chunks, in hybrid placement (CPU FFN hand-offs cut the
graph). The simulator has no graphs; there the cache's bookkeeping (eager first, capture second,
replay after, fall back to eager when a step cannot be captured) is checked with a stand-in
capture.
"""
import types

import numpy as np
import pytest

from gpu.runtime import graphs
from gpu import simulated
from hybrid.forward import Forward
from tests.gpu.test_forward_gpu import PROMPT, model  # noqa: F401 (module fixture)
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

real_gpu = pytest.mark.skipif(simulated(), reason="CUDA graphs need a real GPU (the simulator has none)")


def decode(fw, ids, verify=None):
    """Prefill ids[:2], then one token at a time; with verify, a 3-row snapshot step, a rollback to
    2 rows and two more single steps. Returns every step's logits."""
    state = fw.new_state(48, n_ring=4)
    out = [fw.forward(state, ids[:2], logits="all")[0]]
    for t in ids[2:]:
        out.append(fw.forward(state, [t], logits="all")[0])
    if verify is not None:
        for _ in range(2):
            out.append(fw.forward(state, verify, logits="all", snapshot=True)[0])
            state.rollback(2)
            out.append(fw.forward(state, verify[2:], logits="all")[0])
    return out


@real_gpu
@pytest.mark.parametrize("types", ["F32", "Q8_0"])
def test_replayed_steps_give_the_bits_of_launched_steps(model, types):
    mf = model(types)
    eager = Forward(mf, backend="gpu", cuda_graphs=False)
    replayed = Forward(mf, backend="gpu")
    ids, verify = list(PROMPT) * 2, [7, 8, 9]
    want, got = decode(eager, ids, verify), decode(replayed, ids, verify)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(a, b)
    cache = replayed.backend.graphs
    # the decode step, the verify step and the rollback (one captured step per state and slot)
    assert cache.captures == 3 and cache.replays >= len(ids)
    assert eager.backend.graphs.captures == 0


@real_gpu
def test_a_step_that_cannot_be_captured_stays_eager(model):
    """An op that must read device data on the host mid-step (the device-expert MoE path does)
    calls require_eager: the step runs eagerly, with the same results, and is never captured."""
    import gpu.ops

    def refusing_rms_norm(*args):
        graphs.require_eager("test op")
        gpu.ops.rms_norm(*args)

    ops = types.SimpleNamespace(**{n: getattr(gpu.ops, n) for n in dir(gpu.ops) if not n.startswith("_")})
    ops.rms_norm = refusing_rms_norm
    fw = Forward(model("F32"), ops=ops, backend="gpu")
    reference = Forward(model("F32"), backend="gpu", cuda_graphs=False)
    for a, b in zip(decode(reference, list(PROMPT)), decode(fw, list(PROMPT))):
        np.testing.assert_array_equal(a, b)
    assert fw.backend.graphs.captures == 0 and fw.backend.graphs.replays == 0


# --- bookkeeping, with a stand-in capture (runs under the simulator too) -----------------------------

class FakeStep:
    def __init__(self, body):
        self.body, self.closed = body, False

    def replay(self, seconds):
        self.body()

    def close(self):
        self.closed = True


def test_cache_runs_eager_then_captures_then_replays(monkeypatch):
    captured = []

    def fake_capture(body):
        captured.append(FakeStep(body))
        return captured[-1]

    monkeypatch.setattr(graphs, "capture", fake_capture)
    monkeypatch.setattr(graphs, "simulated", lambda: False)
    cache, runs = graphs.StepGraphs(), []
    for _ in range(4):
        cache.run("decode", lambda: runs.append("decode"))
    assert len(runs) == 4                  # each call runs the step once: eager, capture+replay, replay, replay
    assert cache.captures == 1 and cache.replays == 3

    def refuse():
        raise graphs.NotCapturable("host read")

    monkeypatch.setattr(graphs, "capture", lambda body: refuse())
    for _ in range(3):
        cache.run("verify", lambda: runs.append("verify"))
    assert runs.count("verify") == 3 and cache.captures == 1      # eager every time, never retried

    monkeypatch.setattr(graphs, "capture", fake_capture)
    for key in range(graphs._KEPT + 2):
        cache.run(key, lambda: None)
        cache.run(key, lambda: None)
    assert captured[0].closed and captured[1].closed and not captured[-1].closed


def test_disabled_cache_always_runs_eagerly(monkeypatch):
    monkeypatch.setattr(graphs, "capture", lambda body: pytest.fail("captured although disabled"))
    cache, runs = graphs.StepGraphs(enabled=False), []
    for _ in range(3):
        cache.run("k", lambda: runs.append(1))
    assert len(runs) == 3 and cache.replays == 0


def test_depth_changes_replay_captured_steps(model, monkeypatch):
    """Drafting at a depth chosen per step: once each depth has been used (run eagerly, then
    captured), changing depth replays the captured steps — no new capture, scratch or one-off
    work — however the depths alternate. (Scratch evicted between depths made every change a
    fresh eager run and capture.)"""
    from hybrid.mtp import MTPHead
    from hybrid.speculative import generate_speculative
    from tests.hybrid.test_speculative import LetterTokenizer, greedy

    monkeypatch.setattr(graphs, "capture", FakeStep)
    monkeypatch.setattr(graphs, "simulated", lambda: False)
    fw = Forward(model("F32"), backend="gpu", placement=lambda name: "cpu")
    head, prompt = MTPHead(fw), list(PROMPT[:3])     # each run prefills it: the simulator's seconds
    state = fw.new_state(160, n_ring=5)

    def run(depth):
        state.reset()
        events = list(generate_speculative(fw, head, state, LetterTokenizer(), prompt, max_tokens=5,
                                           sampler=greedy(), depth=depth, n_ctx=160, ignore_eos=True))
        assert events[-1].stats.generated_tokens == 5
    # each depth's steps seen, then captured (verify rows 2..4): one run of depth 1 repeats all
    # of its steps, depth 3 meets some (the last, shorter verify steps) once a run
    for depth in (1, 3, 3):
        run(depth)
    cache, work = fw.backend.graphs, fw.one_off_work()
    captures, replays = cache.captures, cache.replays
    for depth in (1, 3):
        run(depth)
    assert cache.captures == captures and cache.replays > replays
    assert fw.one_off_work() == work


@real_gpu
def test_after_the_warm_up_a_generation_replays_from_its_first_step():
    """Model.warmup captures its calls on the state the next generation gets, so a fresh process's
    first generation (the README's one-shot job) captures nothing and builds nothing after its
    prompt, at the auto depth and at depth 0, greedy and sampled. (Captured on the warm-up's own
    state, every step of such a run was an eager run and a capture in the run's time; figures in
    docs/MEASUREMENTS.md. The calls themselves are checked without a GPU in
    tests/hybrid/test_warmup_calls.py.)"""
    import hybrid
    from hybrid.draft_policy import MAX_AUTO_DEPTH
    from hybrid.events import Prefill
    m = hybrid.load(device="cuda")
    m.warmup(draft_depth=MAX_AUTO_DEPTH)
    cache = m.forward.backend.graphs
    for draft in ("auto", 0):
        for sampled in (False, True):
            events = m.generate("def fibonacci(n):", max_tokens=24, temperature=0.8 if sampled else 0.0,
                                seed=1, draft=draft, ignore_eos=True)
            for ev in events:                       # past the prompt: the steps alone
                if isinstance(ev, Prefill) and ev.done == ev.total:
                    break
            captures, work = cache.captures, m.forward.one_off_work()
            assert sum(1 for _ in events) >= 24
            assert (cache.captures, m.forward.one_off_work()) == (captures, work), (draft, sampled)
