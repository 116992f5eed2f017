"""DepthController (hybrid/draft_depth.py): picks the depth with the most expected tokens per
second from scripted acceptance and step costs; probes one deeper now and then."""
import itertools

import numpy as np
import pytest

from hybrid.draft_depth import (_COST_AGE, _COST_WINDOW, _DECAY_DEEP, _EXPLORE_EVERY, _HOPELESS_SPACING, _KNOWN_SAMPLES,
                                _PROBE_EVERY, _PROBE_MAX, _SHRINK, _SWITCH_MARGIN, DepthController)

MAX = 4


def drive(c: DepthController, steps: int, accepted, cost, probing: list | None = None) -> list[int]:
    """Run `steps` scripted steps: accepted(depth) drafts kept, cost(depth) seconds each.
    probing: appended to, per step, whether it was one of a probe's two steps."""
    chosen = []
    for _ in range(steps):
        d = c.choose()
        if probing is not None:
            probing.append(c.home is not None)      # set by a probe until the choice after it
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
    seen = (1 - _DECAY_DEEP ** 30) / (1 - _DECAY_DEEP)         # draft 2's EMA count of 30 observations
    assert a[0] == pytest.approx(1.0)
    assert a[1] == pytest.approx(_SHRINK * 1.0 / (seen + _SHRINK))     # 0 kept, pulled toward a_1
    assert a[2] == pytest.approx(a[1])                         # draft 3 never offered after a keep of 2
    assert c.expected_tokens(3) == pytest.approx(2.0 + a[1] + a[1] * a[2])


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
    assert c.step_cost(3) == pytest.approx(4.5)                 # the median of what was measured
    c.record(3, 0, 40.0)                                        # one outlier (a pause) moves it little
    assert c.step_cost(3) == pytest.approx(5.0)
    for _ in range(_COST_WINDOW):
        c.record(3, 0, 6.0)
    assert c.step_cost(3) == pytest.approx(6.0)                 # the window forgets the old steps


def settled(c: DepthController, steps: int, accepted, cost, tail: int) -> np.ndarray:
    """Drive `steps` more steps; the last `tail` choices that were not a probe's."""
    probing: list[bool] = []
    chosen = np.asarray(drive(c, steps, accepted, cost, probing))
    return chosen[~np.asarray(probing)][-tail:]


def test_high_acceptance_and_flat_cost_go_deep():
    c = DepthController(MAX, start=1)
    assert (settled(c, 200, accepted=lambda d: d, cost=lambda d: 1.0, tail=100) == MAX).all()
    chosen = drive(c, 2 * _PROBE_MAX, accepted=lambda d: d, cost=lambda d: 1.0)
    assert min(chosen) == MAX - 1                               # only the shallower probes


def test_high_acceptance_and_mild_cost_go_deep():
    tail = settled(DepthController(MAX), 300, accepted=bernoulli(0.95), cost=linear(0.1), tail=200)
    assert np.mean(tail == MAX) > 0.9


def test_steep_cost_goes_shallow():
    """Each drafted row costing twice a plain step never pays, however good the drafts."""
    c = DepthController(MAX)
    assert (settled(c, 200, accepted=lambda d: d, cost=linear(2.0), tail=150) == 0).all()
    assert max(drive(c, 150, accepted=lambda d: d, cost=linear(2.0))) <= 1


@pytest.mark.parametrize("rate", [0.0, 0.1])
def test_low_acceptance_goes_shallow_and_stays_there(rate):
    """A depth-4 step is expensive when drafts die; once the first draft is known to fail, only
    a probe of depth 1 may interrupt depth 0 (not a jump back to full depth)."""
    chosen = drive(DepthController(MAX), 300, accepted=bernoulli(rate, seed=1), cost=linear(0.15))
    tail = np.asarray(chosen[-250:])
    assert np.mean(tail == 0) > 0.85
    assert tail.max() <= 1


def test_probes_alternate_and_back_off_while_they_change_nothing():
    """Settled on depth 2 (draft 3 always fails): probes try depth 3 and depth 1 in turn, two
    steps each; all other steps stay at 2; as no probe changes the choice, the spacing between
    probes doubles up to _PROBE_MAX."""
    c = DepthController(MAX, start=2)
    probing: list[bool] = []
    chosen = np.asarray(drive(c, 12 * _PROBE_MAX, accepted=lambda d: min(d, 2), cost=linear(0.15), probing=probing))
    probing = np.asarray(probing)
    late = np.arange(len(chosen)) > 4 * _PROBE_EVERY
    assert (chosen[late & ~probing] == 2).all()
    starts = np.flatnonzero(late & probing & ~np.roll(probing, 1))[:-1]     # the last may be cut short
    assert all(probing[s + 1] and chosen[s + 1] == chosen[s] for s in starts)   # each probe lasts two steps
    depths = chosen[starts].tolist()
    assert set(depths) == {1, 3} and all(a != b for a, b in zip(depths, depths[1:]))
    gaps = np.diff(np.flatnonzero(probing & ~np.roll(probing, 1)))
    assert gaps[0] == _PROBE_EVERY and (np.diff(gaps) >= 0).all() and gaps[-1] == _PROBE_MAX


@pytest.mark.parametrize("gain, moves", [(4.0, True), (1.0 + _SWITCH_MARGIN / 3, False)])
def test_a_probe_moves_the_choice_only_for_a_gain_above_the_margin(gain, moves):
    """Backed off on depth 1 (draft 2 always fails); a probe then finds its depth cheaper than
    priced. A gain above _SWITCH_MARGIN moves the choice there and the probes come every
    _PROBE_EVERY steps again; a tie (measurement wobble) leaves the choice and the spacing as
    they were."""
    c = DepthController(MAX, start=1)
    kept = lambda d: min(d, 1)      # noqa: E731
    for _ in range(_COST_WINDOW):   # depth 3 measured: the cheap probe below must not price it by the fit
        c.record(3, kept(3), 1.45)
    drive(c, 8 * _PROBE_MAX, accepted=kept, cost=linear(0.15))
    assert c.spacing == _PROBE_MAX
    while c.home is None:
        d = c.choose()
        c.record(d, kept(d), 1.0 + 0.15 * d)
    probe = c.depth
    assert c.choose() == probe                      # the probe's second step
    home_rate = 2.0 / 1.15                          # depth 1: one draft, always kept
    cost = c.expected_tokens(probe) / (gain * home_rate)
    for _ in range(_COST_WINDOW):                   # the probed depth's whole cost window
        c.record(probe, kept(probe), cost)
    assert c.choose() == (probe if moves else 1)
    assert c.spacing == (_PROBE_EVERY if moves else _PROBE_MAX)


def test_tied_depths_do_not_trade_the_choice_back_and_forth():
    """Depths 1 and 2 at the same expected speed, step costs wobbling 3% at random: the choice
    stays where it first settled rather than following each wobble, so changes of depth are
    the probes' and explorations' only."""
    rng = np.random.default_rng(1)
    # a_1 = 1, a_2 = 0.5: depth 1 makes 2 tokens, depth 2 makes 2.5; costs in that ratio
    keep2 = iter(np.tile([2, 1], 10_000))
    per_depth = {0: 0.6, 1: 1.0, 2: 1.25, 3: 1.5, 4: 1.75}
    c = DepthController(MAX, start=1)
    drive(c, 2 * _PROBE_MAX, accepted=lambda d: min(d, next(keep2)) if d >= 2 else d,
          cost=lambda d: per_depth[d] * (1 + 0.03 * rng.standard_normal()))
    choices = []
    for _ in range(4 * _PROBE_MAX):
        d = c.choose()
        choices.append(c.choice)
        c.record(d, min(d, next(keep2)) if d >= 2 else d, per_depth[d] * (1 + 0.03 * rng.standard_normal()))
    assert np.count_nonzero(np.diff(choices)) <= 2


def test_steep_cost_is_found_from_one_measured_depth():
    """Started deep; a shallower probe measures a second cost, the linear fit then prices depth
    0, and the controller leaves the deep setting."""
    c = DepthController(MAX, start=MAX)
    first = drive(c, _PROBE_EVERY, accepted=lambda d: d, cost=linear(2.0))
    assert first[0] == MAX
    later = settled(c, 3 * _PROBE_EVERY, accepted=lambda d: d, cost=linear(2.0), tail=2 * _PROBE_EVERY)
    assert (later == 0).all()


def test_probing_finds_drafts_that_got_better():
    """Draft 2 fails for a while, then starts being kept (e.g. the text became repetitive): the
    probes see it, and the controller goes deep."""
    c = DepthController(MAX)
    drive(c, 100, accepted=lambda d: min(d, 1), cost=linear(0.15))
    assert c.depth <= 2
    # within two of the widest probe spacings (one deeper, one shallower probe each)
    assert (settled(c, 2 * _PROBE_MAX + 50, accepted=lambda d: d, cost=linear(0.15), tail=50) == MAX).all()


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


def test_depth_one_is_not_explored_further_once_it_cannot_pay():
    """Drafts that die from the first step, a drafting step costing 1.5 plain ones, and the
    caller's steadiness rule (the first step after a change of depth is unsteady): within 16
    steps `draft_may_pay` says no, and from then on depth 1 is not explored for samples (each
    try is a slower step bringing nothing) until the rare probe of a hopeless depth."""
    c, previous, chosen, may_pay = DepthController(MAX), None, [], []
    for _ in range(4 * _PROBE_EVERY):
        d = c.choose()
        c.record(d, 0, linear(0.5)(d), steady=d == previous)
        previous = d
        chosen.append(d)
        may_pay.append(c.draft_may_pay())
    hopeless = may_pay.index(False)
    assert hopeless < 16 and not any(may_pay[hopeless:])
    assert not any(chosen[hopeless + 1:])


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



def test_a_draft_that_failed_a_few_times_early_is_not_written_off():
    """Draft 2 missed twice right after draft 1 was kept: a_2 is pulled toward a_1 by _SHRINK
    pseudo-observations rather than read as 0 from two samples, so depth 2 keeps a price that a
    probe can confirm."""
    c = DepthController(MAX)
    for _ in range(2):
        c.record(2, 1, 1.0)
    for _ in range(8):
        c.record(1, 1, 1.0)
    a = c.acceptance()
    assert a[0] == pytest.approx(1.0)
    assert a[1] == pytest.approx(_SHRINK / (c.tried[2] + _SHRINK)) and a[1] > 0.4


def test_old_samples_leave_a_depths_window_once_newer_ones_stand_in():
    """A depth timed while the machine was slow, then not for _COST_AGE steps: a few new samples
    replace the old ones (at least _KNOWN_SAMPLES stay, so one new sample does not decide)."""
    c = DepthController(MAX, start=1)
    for _ in range(_COST_WINDOW):
        c.record(2, 2, 5.0)
    c.steps += _COST_AGE + 1                        # steps spent at other depths
    c.record(2, 2, 2.0)
    assert c.step_cost(2) == 5.0                    # one new sample against the three newest old ones
    for _ in range(_KNOWN_SAMPLES - 1):
        c.record(2, 2, 2.0)
    assert c.step_cost(2) == 2.0


def test_a_neighbour_is_explored_until_it_has_enough_samples():
    """A neighbour with fewer than _KNOWN_SAMPLES steady samples is tried every _EXPLORE_EVERY
    steps: one sample (perhaps an outlier) does not settle its cost."""
    c = DepthController(MAX, start=1)
    while c.choice != 1 or c.steps < _EXPLORE_EVERY:    # the priors' optimism about deeper drafts spent
        drive(c, 1, accepted=lambda d: min(d, 1), cost=linear(0.15))
    assert c.steps < 8 * _EXPLORE_EVERY
    drive(c, 6 * _EXPLORE_EVERY, accepted=lambda d: min(d, 1), cost=linear(0.15))
    for d in (0, 2):
        assert c.timed[d] >= _KNOWN_SAMPLES


def shifting(steps_slow: int, misses: int, per_depth=(1.0, 1.7, 2.2, 2.8, 3.8)):
    """The step costs and acceptance of a warm-up on the dev box: the first `steps_slow` steps run
    1.6 times slower (a busy machine, first-use costs), and for the first `misses` steps only
    draft 1 is kept (the text's opening); afterwards every draft is kept and depth 3 is best."""
    step = 0

    def accepted(d):
        return d if step >= misses else min(d, 1)

    def cost(d):
        nonlocal step
        step += 1
        return per_depth[d] * (1.6 if step <= steps_slow else 1.0)
    return accepted, cost


def test_early_misses_on_a_slow_start_do_not_lock_the_choice():
    """Early misses of draft 2 and early costs from a slow start once kept the controller at depth
    1 for good (draft 2 read as never kept, depth 2's only price the slow one); it now settles on
    the best depth within 60 steps."""
    accepted, cost = shifting(40, 8)
    tail = settled(DepthController(MAX), 200, accepted=accepted, cost=cost, tail=120)
    assert np.mean(tail == 3) > 0.9


def test_a_neighbour_timed_in_a_slow_stretch_is_timed_afresh_when_a_probe_disagrees():
    """Depth 1 (the start) runs 1.25 times slower for the first 25 steps, so depth 2 looks best;
    afterwards depth 1 is the best. Its stale price outlived the slow stretch until enough probes
    had replaced its samples (probes back off, so that took ~70 steps); now the first probe that
    disagrees re-times it, and the controller is back on depth 1 for most of steps 40-100."""
    per_depth = (0.443, 0.751, 1.2, 1.6, 2.0)
    step = 0

    def cost(d):
        nonlocal step
        step += 1
        return per_depth[d] * (1.25 if d == 1 and step <= 25 else 1.0)
    c = DepthController(MAX)
    chosen = np.asarray(drive(c, 100, accepted=lambda d: min(d, 2), cost=cost))
    assert np.mean(chosen[40:] == 1) > 0.8
    assert c.step_cost(1) == pytest.approx(0.751)


def test_a_streak_of_misses_does_not_trap_the_choice_at_depth_zero():
    """A draft kept 90% of the time on costs where depth 1 needs a rate above 0.73 to pay (the
    bundled model on a GPU), then 10 misses in a row: the controller may fall back to depth 0,
    but its probes of depth 1 stay frequent while the evidence against draft 1 is that thin, so
    it is back to drafting for most of the 100 steps after the next 50."""
    per_depth = (0.511, 0.885, 1.219, 1.537, 1.855)
    rng = np.random.default_rng(3)
    streak = {"left": 0}

    def accepted(d):
        m = 0
        while m < d and (streak["left"] == 0 and rng.random() < 0.9):
            m += 1
        streak["left"] = max(streak["left"] - (d > 0), 0)
        return m
    c = DepthController(MAX)
    drive(c, 200, accepted=accepted, cost=lambda d: per_depth[d])
    streak["left"] = 10
    drive(c, 50, accepted=accepted, cost=lambda d: per_depth[d])
    later = np.asarray(drive(c, 100, accepted=accepted, cost=lambda d: per_depth[d]))
    assert np.mean(later > 0) > 0.8


def test_an_untimed_depth_is_approached_one_depth_at_a_time():
    """From depth 1, the priors (every draft kept, 15% a row) price depth 4 best, while its real
    steps cost three plain ones: the choice climbs one depth at a time, timing each, and never
    settles on the depth it was never shown to pay at (a jump there straight from the priors
    spent two of a short run's first steps at the slowest depth)."""
    cost = (1.0, 1.3, 1.7, 2.5, 3.0)
    c, choices = DepthController(MAX, start=1), []
    for _ in range(40):
        d = c.choose()
        choices.append(c.choice)
        c.record(d, d, cost[d])
    assert all(abs(b - a) <= 1 for a, b in zip(choices, choices[1:]))
    assert MAX not in choices and choices[-1] == 2


def test_explorations_between_drafting_depths_are_one_step_and_from_depth_zero_two():
    """A change between drafting depths costs what a steady step there costs (the caller marks it
    steady): an exploration of such a neighbour is one step. Leaving depth 0, the first step runs
    the MTP rows plain steps left waiting (the caller marks it unsteady), so it lasts two."""
    c = DepthController(MAX, start=2)
    for _ in range(_COST_WINDOW):           # depths 2 and 3 timed, draft 3 never kept: the choice is 2
        c.record(2, 2, 1.3)
        c.record(3, 2, 1.45)
    chosen = drive(c, 6 * _EXPLORE_EVERY, accepted=lambda d: min(d, 2), cost=linear(0.15))
    runs = [len(list(g)) for k, g in itertools.groupby(chosen) if k == 1]
    assert len(runs) >= _KNOWN_SAMPLES and all(n == 1 for n in runs) and c.choice == 2
    z = DepthController(MAX, start=0)
    chosen = drive(z, 4 * _EXPLORE_EVERY, accepted=lambda d: min(d, 1), cost=linear(0.3))
    runs = [len(list(g)) for k, g in itertools.groupby(chosen) if k == 1]
    assert runs and all(n >= 2 for n in runs[:-1])
