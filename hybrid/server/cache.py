"""The server's state cache: snapshots of the model state at turn boundaries, keyed by the token
ids they hold, bounded by a memory budget, least recently used first out.

A GDN layer's recurrent state folds in every token it has seen and cannot be cut back to a
shorter prefix, so a snapshot serves a request only when its ids are a prefix of the request's
ids; the longest such snapshot wins and only the rest is prefilled. A snapshot is the session's
`_Checkpoint`: GDN/conv states and only the KV rows in use, always in host memory (on a GPU path
the VRAM is the placement's; a 27B-shape state at 8K tokens is ~1.2 GB, which crosses PCIe in
a fraction of a prefill's time), so the budget is host RAM.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Sequence

from ..session import _Checkpoint

log = logging.getLogger("hybrid.server")


def _nbytes(ckpt: _Checkpoint) -> int:
    arrays = [*ckpt.ssm.values(), *ckpt.conv.values()]
    for kv in (ckpt.kv, ckpt.mtp_kv):
        for k, v in kv.values():
            arrays += [k, v]
    return sum(int(getattr(a, "nbytes", 0)) for a in arrays)


class StateCache:
    def __init__(self, budget_bytes: int):
        self.budget = int(budget_bytes)
        self._entries: OrderedDict[tuple, tuple[_Checkpoint, int]] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def longest_prefix(self, wanted: Sequence[int]) -> _Checkpoint | None:
        """The snapshot holding the longest proper prefix of `wanted` (at least one token must be
        left to prefill: its logits start the reply), or None."""
        best, best_key = None, None
        wanted = tuple(wanted)
        for key, (ckpt, _) in self._entries.items():
            n = len(key)
            if n < len(wanted) and (best is None or n > len(best.ids)) and wanted[:n] == key:
                best, best_key = ckpt, key
        if best_key is not None:
            self._entries.move_to_end(best_key)
        return best

    def put(self, state, ids: Sequence[int]) -> None:
        """Snapshot `state`, which holds exactly `ids`, unless already kept or over the budget."""
        key = tuple(ids)
        if not key or self.budget <= 0:
            return
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        try:
            ckpt = _Checkpoint.take(state, list(key), on_host=True)
        except MemoryError as e:     # out of host memory: serving goes on, only slower
            log.warning("state not cached (%s: %s); emptying the cache", type(e).__name__, e)
            self.clear()
            return
        size = _nbytes(ckpt)
        if size > self.budget:
            return
        self._entries[key] = (ckpt, size)
        self.bytes += size
        while self.bytes > self.budget:
            _, (_, freed) = self._entries.popitem(last=False)
            self.bytes -= freed

    def clear(self) -> None:
        self._entries.clear()
        self.bytes = 0
