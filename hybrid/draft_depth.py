"""Automatic draft depth: pick the depth that maximises expected tokens per second.

Expected tokens of a depth-D step = 1 + Σ_{j=1..D} Π_{i≤j} a_i, with a_i the measured
chance that draft i is kept given drafts 1..i−1 were. Step cost per depth is measured (the
median of its last _COST_WINDOW steady steps); depths not yet tried are priced by a linear fit
of the ones that were. The acceptance at position i is only observed when a step drafts at least
i tokens, so the controller now and then tries one deeper than its current choice; and one
measured depth cannot price the others (the 15%-per-row prior may be far off), so every other
such probe goes one shallower instead. A probe that leaves the choice as it was doubles the
spacing to the next one (up to _PROBE_MAX steps); one that changes it resets the spacing to
_PROBE_EVERY. Each probe is two steps at a worse depth and two changes of depth, and on a
settled model at _PROBE_EVERY that is every eighth step spent switching; backing off keeps
the cost of watching for drift near one step in a hundred.

At depth 0, a probe of depth 1 that could not pay even if draft 1 were kept as often as the
upper end of a two-sigma interval around its observed rate (`draft_may_pay`) runs only every
_PROBE_EVERY × _HOPELESS_SPACING steps: on a model whose drafts die, or whose verify rows cost more than they
bring, each probe is a slower step plus the MTP head's catch-up, and one every _PROBE_EVERY steps
costs auto several percent against plain decoding. While depth 0 is chosen so, the MTP head is
idle (`mtp_idle`): of the rows plain steps leave waiting, only the newest are kept for the next
draft, the older ones are never run.

The choice moves only to a depth expected to beat it by more than _SWITCH_MARGIN of tokens/s.
On a model whose depths run at nearly the same speed, the measured costs wobble by more than
their differences; a choice that followed the wobble went back and forth between two tied depths,
and a run that mixed them came out slower than either depth alone (a reset of the probe spacing
on each wobble held the probes near their shortest spacing). A draft that got better is still
found: probes go one deeper in turn and see its acceptance, and a real gain is more than the
margin.

A step's wall time has outliers (a collection pause, the OS taking the core), and a depth the
controller only probes has few samples: a median shrugs off one slow step where an average would
keep that depth unused for many probes. A neighbour of the choice is therefore explored (every
_EXPLORE_EVERY steps) until it has _KNOWN_SAMPLES steady samples, not just one. The machine's
speed also drifts (other work on the cores, a slow first stretch of a process): a sample older
than _COST_AGE steps leaves its depth's window once _KNOWN_SAMPLES newer ones stand in for it, so
a depth timed in a slow stretch and only probed since is not priced by that stretch for good.
Aging alone is slow, though: a probe brings its depth one sample, every other probe goes the
other way, and the spacing backs off to _PROBE_MAX steps, so replacing three samples can take
longer than a short run. A revisit (a probe, an exploration) whose sample lies more than _DRIFT
off the depth's price therefore starts a re-timing: the depth is explored again like an untimed
one until _KNOWN_SAMPLES samples since stand in, and the older ones leave. One sample never
decides: if it was noise, the re-timing finds the price as it was.

Acceptance is read per position, and a short run sees few observations of the deeper ones: the
opening of a text often keeps draft 1 and loses draft 2, and two such misses read literally
(a_2 = 0) price every depth above 1 as worthless, so the controller never drafts deep enough to
see them kept later. a_i for i ≥ 2 therefore counts _SHRINK pseudo-observations at a_{i−1}
(drafts deeper in a chain are kept about as often as the one before, a little less): a few misses
lower it, a sustained run of misses still drives it toward 0. a_1 has no such pull: it is seen at
every drafting step, and an optimistic pull on a draft that always fails would keep depth 1 alive.
Being seen at every drafting step, a_1 can also afford a long memory (_DECAY, ~33 observations):
with ~10, a chance streak of misses on a draft kept 90% of the time read as a rate at which depth
0 wins. The deeper positions keep the short one (_DECAY_DEEP): at a shallower choice only probes
observe them, and a memory of 33 probes would keep a text's opening in their rates for thousands
of steps.

Only steady steps teach a step cost: a step that compiled a kernel, allocated a new call size's
buffers or captured a CUDA graph (the first uses of each depth) cost many times what the same
step costs afterwards, and one such sample would keep its depth unused for the rest of the run.
Nor does the first drafting step after plain ones (the caller's rule: its MTP call runs the rows
those left waiting); a change between drafting depths costs what a steady step there costs.

The priors (a_i = 0.8, 15% of a step per verify row) price the depths no step has timed, and on
a small model they overrate deep drafts by far: the choice moves toward an untimed depth one
depth at a time, each timed on the way, rather than jumping to it on the priors' word.
"""
from __future__ import annotations

from collections import deque

_DECAY = 0.97         # EMA weight of the past per observation of draft 1 (its counts span ~33 observations)
_DECAY_DEEP = 0.9     # the same for drafts 2 and deeper (~10 observations)
_COST_WINDOW = 9      # steady steps a depth's cost is the median of
_COST_AGE = 64        # steps after which a sample leaves its window, once _KNOWN_SAMPLES newer ones are in it
_PROBE_EVERY = 16     # steps between tries of a neighbouring depth, at first and after a change
_PROBE_MAX = 128      # the widest spacing probes that change nothing back off to
_EXPLORE_EVERY = 4    # steps between tries of a neighbouring depth with fewer than _KNOWN_SAMPLES steady samples
_HOPELESS_SPACING = 8  # a depth-1 probe that cannot pay runs at every 8th probe slot
_SWITCH_MARGIN = 0.03  # the gain in expected tokens/s over the current choice that moves it
_IDLE_EVIDENCE = 5.0   # drafts offered (EMA count, at most 1 / (1 − _DECAY) ≈ 33) before the MTP head may idle
_SHRINK = 2.0         # pseudo-observations pulling a_i (i ≥ 2) toward a_{i−1}
_KNOWN_SAMPLES = 3    # steady samples a neighbour is explored until, and that outlive _COST_AGE
_DRIFT = 0.10         # a revisited depth's sample this far off its price starts a re-timing


def _median(values) -> float:
    xs = sorted(values)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


class DepthController:
    """choose() and record() run once per step, in the step's critical path: on a small model a
    GPU step takes well under a millisecond, so their bookkeeping is plain Python floats and lists
    (numpy scalars and statistics.median cost many times more per call, a share of such a step
    that fixed depths do not pay), and the prices are kept until a measured cost changes."""

    def __init__(self, max_depth: int, start: int | None = None):
        """start: the first depth tried (1 unless given: one draft is the cheapest to prepare and
        already tells whether the head drafts well)."""
        self.max_depth = max_depth
        self.kept = [0.0] * (max_depth + 1)      # kept[i]: EMA count of draft i kept
        self.tried = [0.0] * (max_depth + 1)     # tried[i]: EMA count of draft i offered after i−1 kept
        self._cost = {}                          # depth → seconds per step (`cost`)
        self._fresh = True                       # `_cost` is up to date with `_times`
        self._costs = None                       # step_costs() until `cost` changes
        self._since = {}                         # depth → step its re-timing began (record)
        self._times: dict[int, deque] = {}       # depth → (step, seconds) of its last steady steps
        self.timed: dict[int, int] = {}          # depth → steady steps ever recorded at it
        self.depth = min(start if start is not None else 1, max_depth)
        self.steps = 0
        self.unsteady = 0                        # steps whose cost was not learnt (record)
        self.unsteady_seconds = 0.0              # their wall time (once-only work and changes of depth)
        self.seconds = 0.0                       # wall time of every recorded step
        self.held = False                        # the next choice repeats this one
        self.spacing = _PROBE_EVERY              # steps from one probe to the next (backs off)
        self.next_probe = _PROBE_EVERY           # the step of the next probe
        self.probes = 0                          # probes so far (alternates deeper / shallower)
        self.choice = self.depth                 # the depth steps return to between probes and explorations
        self.home = None                         # the choice a probe left, until the next choice
        self.settled = False                     # the choice's neighbours are timed: decide every _EXPLORE_EVERY steps

    def learnt(self) -> dict:
        """What this controller learnt, as plain JSON values: the acceptance counts, each depth's
        window of steady step seconds, and the choice (`resumed` starts from it)."""
        self.cost           # brings the windows up to date: samples past _COST_AGE leave first
        return {"kept": list(self.kept), "tried": list(self.tried), "choice": self.choice,
                "seconds": {str(d): [s for _, s in times] for d, times in self._times.items()}}

    @classmethod
    def resumed(cls, max_depth: int, learnt: dict) -> "DepthController":
        """A controller that starts from what another one learnt (`learnt`): its acceptance, its
        prices and its choice, as if those steps had just run here. Where the machine runs at
        another pace now, the samples age out (_COST_AGE) or a revisit re-times the depth
        (_DRIFT) as for a drift within a run. ValueError if `learnt` is not such a record."""
        try:
            kept = [float(v) for v in learnt["kept"]][:max_depth + 1]
            tried = [float(v) for v in learnt["tried"]][:max_depth + 1]
            choice = int(learnt["choice"])
            seconds = {int(d): [float(s) for s in v] for d, v in learnt["seconds"].items()}
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"not a depth controller's record: {e}") from None
        if (len(kept) != len(tried) or not all(0.0 <= k <= t for k, t in zip(kept, tried))
                or not all(0 <= d <= max_depth and all(x > 0.0 for x in v) for d, v in seconds.items())):
            raise ValueError("not a depth controller's record: counts or seconds out of range")
        c = cls(max_depth, start=min(max(choice, 0), max_depth))
        c.kept[:len(kept)], c.tried[:len(tried)] = kept, tried
        for d, values in seconds.items():
            if values:
                c._times[d] = deque(((0, x) for x in values[-_COST_WINDOW:]), maxlen=_COST_WINDOW)
                c.timed[d] = len(c._times[d])
        c._fresh = False
        return c

    def acceptance(self) -> list[float]:
        """a_i for i = 1..max_depth: a_1 as observed (an optimistic prior, 0.8, until seen);
        a_i for i ≥ 2 counts _SHRINK pseudo-observations at a_{i−1}."""
        kept, tried = self.kept, self.tried
        a = [kept[1] / tried[1] if tried[1] > 0.5 else 0.8]
        for i in range(2, self.max_depth + 1):
            a.append((kept[i] + _SHRINK * a[-1]) / (tried[i] + _SHRINK))
        return a

    def step_costs(self) -> list[float]:
        """Seconds per step of each depth 0..max_depth: measured, or priced from the measured."""
        cost = self.cost            # brings the prices up to date (and drops `_costs` if one moved)
        if self._costs is None:
            self._costs = self._price(cost)
        return self._costs

    def _price(self, cost: dict[int, float]) -> list[float]:
        if len(cost) > self.max_depth:      # every depth measured (a settled run): no fit to make
            return [cost[d] for d in range(self.max_depth + 1)]
        known = sorted(cost.items())
        if not known:
            return [1.0 + 0.15 * d for d in range(self.max_depth + 1)]
        if len(known) == 1:
            d0, c0 = known[0]        # prior: each extra row costs ~15% of a step
            return [c0 * (1.0 + 0.15 * (d - d0)) for d in range(self.max_depth + 1)]
        # least-squares line through the measured depths (a handful of points)
        n = len(known)
        mean_d = sum(d for d, _ in known) / n
        mean_c = sum(c for _, c in known) / n
        var = sum((d - mean_d) ** 2 for d, _ in known)
        slope = sum((d - mean_d) * (c - mean_c) for d, c in known) / var
        return [cost[d] if d in cost else max(mean_c + slope * (d - mean_d), 1e-9)
                for d in range(self.max_depth + 1)]

    def step_cost(self, depth: int) -> float:
        return self.cost[depth] if depth in self.cost else self.step_costs()[depth]

    def expected(self, acceptance=None) -> list[float]:
        """Expected tokens of a step at each depth 0..max_depth."""
        a = self.acceptance() if acceptance is None else acceptance
        tokens, run = [1.0], 1.0
        for i in range(self.max_depth):
            run *= float(a[i])
            tokens.append(tokens[-1] + run)
        return tokens

    def expected_tokens(self, depth: int, acceptance=None) -> float:
        return self.expected(acceptance)[depth]

    def rates(self) -> list[float]:
        """Expected tokens per second of each depth 0..max_depth."""
        return [t / c for t, c in zip(self.expected(), self.step_costs())]

    def choose(self) -> int:
        self.steps += 1
        if self.held:               # a probe's second step (see below)
            self.held = False
            return self.depth
        if not self._times:         # nothing timed yet: the start depth, not the priors' pick
            return self.depth
        if self.settled and self.steps % _EXPLORE_EVERY and self.steps < self.next_probe and self.home is None:
            # Between decisions: the choice (for two steps when it leaves depth 0, see below).
            # The choice is re-decided every _EXPLORE_EVERY steps once its
            # neighbours are timed: choose() and record() run in the step's critical path, where
            # their Python runs with caches cold from the step's kernels, several times slower
            # than in a loop by itself (docs/MEASUREMENTS.md, 2026-11-29 stop 53).
            self.held = self.choice != self.depth and self.depth == 0
            self.depth = self.choice
            return self.depth
        rate = self.rates()
        best = rate.index(max(rate))
        if rate[best] <= (1.0 + _SWITCH_MARGIN) * rate[self.choice]:
            best = self.choice
        elif best not in self.cost and abs(best - self.choice) > 1:
            # an untimed depth's rate is the priors' guess: one step toward it, timed on the way
            best = self.choice + (1 if best > self.choice else -1)
        if self.home is not None:   # the first choice after a probe: did it change the choice?
            self.spacing = min(2 * self.spacing, _PROBE_MAX) if best == self.home else _PROBE_EVERY
            self.home = None
        self.choice = best
        # a neighbour timed fewer than _KNOWN_SAMPLES times is tried sooner: its cost is only learnt
        # from steady steps (a GPU step's first run and its capture are not), so a run would
        # otherwise end before the controller knew whether one draft fewer or more pays, or would
        # price it by one sample that may be an outlier
        # — except depth 1 from depth 0 once it is timed and cannot pay (`draft_may_pay`): each
        # such try is a slower step bringing nothing, on a model whose drafts die
        untimed = [d for d in (best - 1, best + 1)
                   if 0 <= d <= self.max_depth and (self.timed.get(d, 0) < _KNOWN_SAMPLES or d in self._since)
                   and not (best == 0 and d in self.cost and not self.draft_may_pay())]
        self.settled = not untimed
        if untimed and self.steps % _EXPLORE_EVERY == 0:
            best = untimed[(self.steps // _EXPLORE_EVERY) % len(untimed)]
        elif self.steps >= self.next_probe and self.max_depth > 0:
            self.probes += 1
            # at depth 0 the spacing stays _PROBE_EVERY: acceptance is only seen through probes there
            self.next_probe = self.steps + (self.spacing if best > 0 else _PROBE_EVERY)
            self.home = best
            if best == 0:
                if self.draft_may_pay() or self.probes % _HOPELESS_SPACING == 0:
                    best = 1
            elif self.probes % 2 == 1 and best < self.max_depth:
                best += 1
            else:
                best -= 1
        # A first step away from depth 0 does work the new depth's steps do not (the MTP rows
        # that plain steps left waiting), and the caller marks it unsteady: such a change lasts
        # two steps, so the second one teaches the depth's cost. Other changes cost what a
        # steady step at the new depth costs: an exploration (for a cost sample) is one step; a
        # probe is two all the same, each an observation of the acceptance one draft deeper.
        self.held = best != self.depth and (self.depth == 0 or self.home is not None)
        self.depth = best
        return best

    def draft_may_pay(self) -> bool:
        """Whether depth 1 could beat depth 0 if draft 1 were kept as often as the upper end of a
        two-sigma interval around the observed rate (Agresti–Coull: 2 keeps and 2 misses added):
        1 before anything is seen, and optimistic while few observations stand behind it. (A
        fixed bonus of two keeps made a streak of misses on a draft that usually pays look
        hopeless after ~20 observations, and the rare probes of a hopeless depth 1 then kept
        the choice at depth 0 for hundreds of steps.)"""
        n = self.tried[1] + 4.0
        p = (self.kept[1] + 2.0) / n
        upper = p + 2.0 * (p * (1.0 - p) / n) ** 0.5
        return (1.0 + upper) / self.step_cost(1) >= 1.0 / self.step_cost(0)

    @property
    def mtp_idle(self) -> bool:
        """Depth 0 is chosen and, on measured costs of depths 0 and 1 and at least _IDLE_EVIDENCE
        drafts offered, a draft is not expected to pay: the MTP head's oldest waiting rows may be
        dropped rather than run. A later draft then attends to stale rows there, which costs
        acceptance, never correctness; the evidence bar keeps a few noisy early steps from
        starting that (the acceptance a probe then sees is lower, and would keep it idle)."""
        return (self.depth == 0 and 0 in self.cost and 1 in self.cost
                and self.tried[1] >= _IDLE_EVIDENCE and not self.draft_may_pay())

    def record(self, drafted: int, accepted: int, seconds: float, steady: bool = True) -> None:
        """One step: `drafted` offered, the first `accepted` of them kept, `seconds` wall time;
        steady=False: the step did once-only work, so its time says nothing of its depth's cost."""
        # Decay per observation, not per step: a position that was not drafted keeps what was
        # learnt of it. (Decaying every step let an unused position fall back to the optimistic
        # prior within ~7 shallow steps, and the controller then jumped to full depth.)
        for i in range(1, min(drafted, accepted + 1) + 1):
            w = _DECAY if i == 1 else _DECAY_DEEP
            self.tried[i] = w * self.tried[i] + 1.0
            self.kept[i] = w * self.kept[i] + (1.0 if i <= accepted else 0.0)
        self.seconds += seconds
        if not steady:
            self.unsteady += 1
            self.unsteady_seconds += seconds
            return
        times = self._times.get(drafted)
        if times is None:
            times = self._times[drafted] = deque(maxlen=_COST_WINDOW)
        # a revisit (a probe, an exploration: the depth has not run for a while) that disagrees
        # with the depth's price: time it afresh, and let the samples before go once enough new
        # ones stand in
        if (drafted not in self._since and times and times[-1][0] < self.steps - _EXPLORE_EVERY
                and abs(seconds - self.cost[drafted]) > _DRIFT * self.cost[drafted]):
            self._since[drafted] = self.steps
            self.settled = False
        times.append((self.steps, seconds))
        self.timed[drafted] = self.timed.get(drafted, 0) + 1
        since = self._since.get(drafted)
        if since is not None and sum(1 for s, _ in times if s >= since) >= _KNOWN_SAMPLES:
            while times[0][0] < since:
                times.popleft()
            del self._since[drafted]
        self._fresh = False

    @property
    def cost(self) -> dict[int, float]:
        """depth → seconds per step: the median of its window. Worked out when read, not in
        record(): between decisions (choose) nothing reads it."""
        if not self._fresh:
            self._fresh = True
            old = self.steps - _COST_AGE
            for d, times in self._times.items():    # age every depth's window
                while len(times) > _KNOWN_SAMPLES and times[0][0] < old:
                    times.popleft()
                price = _median([t for _, t in times])
                if self._cost.get(d) != price:   # the prices are refitted only when one moves
                    self._cost[d] = price
                    self._costs = None
        return self._cost
