"""The server's state cache: snapshots of the model state at turn boundaries, keyed by the token
ids they hold, bounded by a memory budget, least recently used first out.

A GDN layer's recurrent state folds in every token it has seen and cannot be cut back to a
shorter prefix, so a snapshot serves a request only when its ids are a prefix of the request's
ids; the longest such snapshot wins and only the rest is prefilled. A snapshot is the session's
`_Checkpoint`: GDN/conv states and only the KV rows in use, always in host memory (on a GPU path
the VRAM is the placement's), so the budget is host RAM. A conversation's snapshots share their
KV rows (a snapshot taken with a base copies only the rows after the base's): a 27B-shape state
at 8K tokens is ~1.2 GB, of which each new turn copies ~0.2 GB (GDN states and its own rows).
Shared arrays count once against the budget, and are freed with the last snapshot holding them
(the engine's base, the snapshot its live state descends from, may outlive its eviction: at most
one state's worth of host memory beyond the budget).
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Sequence

from ..session import _Checkpoint

log = logging.getLogger("hybrid.server")


class StateCache:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple, _Checkpoint] = OrderedDict()
        self._held: dict[int, int] = {}   # id(array) → how many kept snapshots hold it (they keep it alive)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, wanted: Sequence[int]) -> _Checkpoint | None:
        """The snapshot holding the longest proper prefix of `wanted` (at least one token must be
        left to prefill: its logits start the reply), or None."""
        best, best_key = None, None
        wanted = tuple(wanted)
        for key, ckpt in self._entries.items():
            n = len(key)
            if n < len(wanted) and (best is None or n > len(best.ids)) and wanted[:n] == key:
                best, best_key = ckpt, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best

    def put(self, state, ids: Sequence[int], base: _Checkpoint | None = None) -> _Checkpoint | None:
        """Snapshot `state`, which holds exactly `ids`, unless already kept or over the budget;
        `base`: a snapshot whose KV rows the state holds (see _Checkpoint). Returns the snapshot
        taken, else None."""
        key = tuple(ids)
        if not key or self.budget <= 0:
            return None
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        try:
            ckpt = _Checkpoint.take(state, list(key), on_host=True, base=base)
        except MemoryError as e:     # out of host memory: serving goes on, only slower
            log.warning("state not cached (%s: %s); emptying the cache", type(e).__name__, e)
            self.clear()
            return None
        if self._new_bytes(ckpt) > self.budget:
            return None
        self._entries[key] = ckpt
        self._hold(ckpt, +1)
        while self.bytes > self.budget:
            _, evicted = self._entries.popitem(last=False)
            self._hold(evicted, -1)
        return ckpt

    def _new_bytes(self, ckpt: _Checkpoint) -> int:
        return sum(a.nbytes for a in ckpt.arrays() if id(a) not in self._held)

    def _hold(self, ckpt: _Checkpoint, change: int) -> None:
        """Count `ckpt`'s arrays held (+1) or let go (-1); bytes count an array once."""
        for a in ckpt.arrays():
            n = self._held.get(id(a), 0) + change
            if n:
                self._held[id(a)] = n
            else:
                del self._held[id(a)]
            if n == (1 if change > 0 else 0):
                self.bytes += change * a.nbytes

    def clear(self) -> None:
        self._entries.clear()
        self._held.clear()
        self.bytes = 0
