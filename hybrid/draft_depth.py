"""Automatic draft depth: pick the depth that maximises expected tokens per second.

Expected tokens of a depth-D step = 1 + Σ_{j=1..D} Π_{i≤j} a_i, with a_i the measured
chance that draft i is kept given drafts 1..i−1 were. Step cost per depth is measured (an
exponential average of wall time); depths not yet tried are priced by a linear fit of the
ones that were. The acceptance at position i is only observed when a step drafts at least
i tokens, so the controller now and then tries one deeper than its current choice; and one
measured depth cannot price the others (the 15%-per-row prior may be far off), so every other
such probe goes one shallower instead.
"""
from __future__ import annotations

import numpy as np

_DECAY = 0.9          # EMA weight of the past
_PROBE_EVERY = 16     # steps between tries of a deeper draft


class DepthController:
    def __init__(self, max_depth: int, start: int | None = None):
        self.max_depth = max_depth
        self.kept = np.zeros(max_depth + 1)      # kept[i]: EMA count of draft i kept
        self.tried = np.zeros(max_depth + 1)     # tried[i]: EMA count of draft i offered after i−1 kept
        self.cost = {}                           # depth → EMA seconds per step
        self.depth = min(start if start is not None else 3, max_depth)
        self.steps = 0

    def acceptance(self) -> np.ndarray:
        """a_i for i = 1..max_depth; an optimistic prior (0.8) where nothing was seen yet."""
        a = np.full(self.max_depth, 0.8)
        seen = self.tried[1:] > 0.5
        a[seen] = self.kept[1:][seen] / self.tried[1:][seen]
        return a

    def step_cost(self, depth: int) -> float:
        if depth in self.cost:
            return self.cost[depth]
        known = sorted(self.cost.items())
        if not known:
            return 1.0 + 0.15 * depth
        if len(known) == 1:
            d0, c0 = known[0]
            return c0 * (1.0 + 0.15 * (depth - d0))      # prior: each extra row costs ~15% of a step
        ds, cs = zip(*known)
        slope, icpt = np.polyfit(ds, cs, 1)
        return max(icpt + slope * depth, 1e-9)

    def expected_tokens(self, depth: int) -> float:
        return 1.0 + float(np.sum(np.cumprod(self.acceptance()[:depth])))

    def choose(self) -> int:
        best = max(range(0, self.max_depth + 1), key=lambda d: self.expected_tokens(d) / self.step_cost(d))
        self.steps += 1
        if self.steps % _PROBE_EVERY == 0 and self.max_depth > 0:
            deeper = (self.steps // _PROBE_EVERY) % 2 == 1
            if best == 0 or (deeper and best < self.max_depth):
                best += 1
            else:
                best -= 1
        self.depth = best
        return best

    def record(self, drafted: int, accepted: int, seconds: float) -> None:
        """One step: `drafted` offered, the first `accepted` of them kept, `seconds` wall time."""
        # Decay per observation, not per step: a position that was not drafted keeps what was
        # learnt of it. (Decaying every step let an unused position fall back to the optimistic
        # prior within ~7 shallow steps, and the controller then jumped to full depth.)
        for i in range(1, min(drafted, accepted + 1) + 1):
            self.tried[i] = _DECAY * self.tried[i] + 1.0
            self.kept[i] = _DECAY * self.kept[i] + (1.0 if i <= accepted else 0.0)
        old = self.cost.get(drafted)
        self.cost[drafted] = seconds if old is None else _DECAY * old + (1 - _DECAY) * seconds
