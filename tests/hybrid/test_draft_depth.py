"""DepthController (hybrid/draft_depth.py): picks the depth with the most expected tokens per
second from scripted acceptance and step costs; probes one deeper now and then."""
import numpy as np
import pytest

from hybrid.draft_depth import _HOPELESS_SPACING, _PROBE_EVERY, DepthController

MAX = 4


def drive(c: DepthController, steps: int, accepted, cost) -> list[int]:
    """Run `steps` scripted steps: accepted(depth) drafts kept, cost(depth) seconds each."""
    chosen = []
    for _ in range(steps):
        d = c.choose()
        c.record(d, min(d, accepted(d)), cost(d))
        chosen.append(d)
    return chosen


def linear(per_draft):
    return lambda d: 1.0 + per_draft * d


def bernoulli(rate, seed=0):
    """Each draft kept with probability `rate` until the first miss."""
    rng = np.random.default_rng(seed)

    def accepted(d):
        m = 0
        while m < d and rng.random() < rate:
            m += 1
        return m
    return accepted


def test_expected_tokens_and_prior():
    c = DepthController(MAX)
    np.testing.assert_allclose(c.acceptance(), [0.8] * MAX)      # optimistic prior, nothing seen
    assert c.expected_tokens(0) == 1.0
    assert c.expected_tokens(2) == pytest.approx(1 + 0.8 + 0.64)
    for _ in range(30):                                        # draft 1 always kept, draft 2 never
        c.record(3, 1, 1.0)
    a = c.acceptance()
    assert a[0] == pytest.approx(1.0) and a[1] == pytest.approx(0.0)
    assert a[2] == pytest.approx(0.8)                          # draft 3 never offered after a keep of 2
    assert c.expected_tokens(3) == pytest.approx(2.0)


def test_step_cost_prior_and_linear_fit():
    c = DepthController(MAX)
    assert c.step_cost(2) == pytest.approx(1.3)
    c.record(1, 0, 2.0)
    assert c.step_cost(1) == 2.0
    assert c.step_cost(3) == pytest.approx(2.0 * 1.3)          # 15% per extra row from the one known
    c.record(3, 0, 4.0)
    assert c.step_cost(2) == pytest.approx(3.0)                 # a line through (1, 2) and (3, 4)
    assert c.step_cost(0) == pytest.approx(1.0)
    c.record(3, 0, 5.0)
    assert c.step_cost(3) == pytest.approx(0.9 * 4.0 + 0.1 * 5.0)   # EMA of what was measured


def settled(chosen, tail, steps_before=0):
    """The last `tail` choices without the probes (every _PROBE_EVERY-th choice of the
    controller and the one after it, which repeats it; the controller had made `steps_before`
    choices before these)."""
    steps = np.arange(1, len(chosen) + 1) + steps_before
    keep = steps % _PROBE_EVERY > 1
    return np.asarray(chosen)[keep][-tail:]


def test_high_acceptance_and_flat_cost_go_deep():
    chosen = drive(DepthController(MAX, start=1), 200, accepted=lambda d: d, cost=lambda d: 1.0)
    assert (settled(chosen, 100) == MAX).all()
    assert min(chosen[-100:]) == MAX - 1                       # only the shallower probes


def test_high_acceptance_and_mild_cost_go_deep():
    chosen = drive(DepthController(MAX), 300, accepted=bernoulli(0.95), cost=linear(0.1))
    assert np.mean(settled(chosen, 200) == MAX) > 0.9


def test_steep_cost_goes_shallow():
    """Each drafted row costing twice a plain step never pays, however good the drafts."""
    chosen = drive(DepthController(MAX), 200, accepted=lambda d: d, cost=linear(2.0))
    assert (settled(chosen, 150) == 0).all() and max(chosen[-150:]) <= 1


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_low_acceptance_goes_shallow_and_stays_there(rate):
    """A depth-4 step is expensive when drafts die; once the first draft is known to fail, only
    a probe of depth 1 may interrupt depth 0 (not a jump back to full depth)."""
    chosen = drive(DepthController(MAX), 300, accepted=bernoulli(rate, seed=1), cost=linear(0.15))
    tail = np.asarray(chosen[-250:])
    assert np.mean(tail == 0) > 0.85
    assert tail.max() <= 1


def test_probes_alternate_one_deeper_and_one_shallower():
    """Settled on depth 2 (draft 3 always fails): every _PROBE_EVERY-th choice tries depth 3 or
    depth 1, in turn; all others stay at 2."""
    c = DepthController(MAX, start=2)
    chosen = np.asarray(drive(c, 8 * _PROBE_EVERY, accepted=lambda d: min(d, 2), cost=linear(0.15)))
    steps = np.arange(1, len(chosen) + 1)
    late = steps > 2 * _PROBE_EVERY
    probe, held = steps % _PROBE_EVERY == 0, steps % _PROBE_EVERY == 1
    assert (chosen[late & ~probe & ~held] == 2).all()
    assert sorted(set(chosen[late & probe])) == [1, 3]
    assert list(chosen[late & probe]) == [3, 1, 3, 1, 3, 1]
    assert list(chosen[late & held]) == [1, 3, 1, 3, 1, 3]     # each probe lasts two steps


def test_steep_cost_is_found_from_one_measured_depth():
    """Started deep; a shallower probe measures a second cost, the linear fit then prices depth
    0, and the controller leaves the deep setting."""
    c = DepthController(MAX, start=MAX)
    first = drive(c, _PROBE_EVERY, accepted=lambda d: d, cost=linear(2.0))
    assert first[0] == MAX
    later = drive(c, 3 * _PROBE_EVERY, accepted=lambda d: d, cost=linear(2.0))
    assert (settled(later, 2 * _PROBE_EVERY, steps_before=_PROBE_EVERY) == 0).all()


def test_probing_finds_drafts_that_got_better():
    """Draft 2 fails for a while, then starts being kept (e.g. the text became repetitive): the
    probes see it, and the controller goes deep."""
    c = DepthController(MAX)
    drive(c, 100, accepted=lambda d: min(d, 1), cost=linear(0.15))
    assert c.depth <= 2
    chosen = drive(c, 150, accepted=lambda d: d, cost=linear(0.15))
    assert (settled(chosen, 50, steps_before=100) == MAX).all()


def test_drafts_that_cannot_pay_are_probed_rarely_and_idle_the_mtp_head():
    """Draft 1 never kept: once that is known, a probe of depth 1 (a slower step) runs at every
    _HOPELESS_SPACING-th probe slot only, and at depth 0 the MTP head is idle."""
    c = DepthController(MAX)
    drive(c, 4 * _PROBE_EVERY, accepted=lambda d: 0, cost=linear(0.5))
    steps = 16 * _PROBE_EVERY * _HOPELESS_SPACING
    chosen = np.asarray(drive(c, steps, accepted=lambda d: 0, cost=linear(0.5)))
    probes = np.count_nonzero(chosen == 1)
    assert chosen.max() == 1
    assert 0 < probes <= 2 * (steps // (_PROBE_EVERY * _HOPELESS_SPACING) + 1)    # each probe lasts two steps
    assert c.depth == 0 and c.mtp_idle


def test_drafts_that_might_pay_keep_the_probes_and_the_mtp_head_busy():
    """Draft 1 kept every other time, each drafted row costing 0.52 of a step: depth 0 is best on
    the measured rate (1.5 / 1.52) but not by a margin the observations are sure of, so depth 1
    is still probed every _PROBE_EVERY steps and the MTP head keeps its rows true."""
    keep = iter(np.tile([0, 1], 10_000))
    c = DepthController(1)
    chosen = np.asarray(drive(c, 40 * _PROBE_EVERY, accepted=lambda d: next(keep) if d else 0, cost=linear(0.52)))
    late = chosen[10 * _PROBE_EVERY:]
    assert np.count_nonzero(late == 1) >= 2 * (len(late) // _PROBE_EVERY) - 2
    assert np.mean(late == 0) > 0.8
    assert c.draft_may_pay() and not c.mtp_idle
