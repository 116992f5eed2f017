"""How many Numba compilations this process has run (CPU and CUDA kernels alike).

Numba fires a "numba:compile" event for each signature it compiles, and not for one it loads from
its disk cache, so the count tells work that ran once (a new shape's first call) from work that
will repeat: the draft-depth controller keeps such steps out of its step costs, and the CLI says
"compiling" only when something was.
"""
from __future__ import annotations

from numba.core import event

_count = 0
_installed = False


class _Counter(event.Listener):
    def on_start(self, ev) -> None:
        global _count
        _count += 1

    def on_end(self, ev) -> None:
        pass


def count() -> int:
    """Compilations started so far in this process (counting from the first call of this)."""
    global _installed
    if not _installed:
        event.register("numba:compile", _Counter())
        _installed = True
    return _count
