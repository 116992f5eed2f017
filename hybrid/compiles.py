"""How many Numba compilations this process has run (CPU and CUDA kernels alike).

Numba fires a "numba:compile" event for each signature it compiles, and not for one it loads from
its disk cache, so the count tells work that ran once (a new shape's first call) from work that
will repeat: the draft-depth controller keeps such steps out of its step costs, and the CLI says
"compiling" only when something was. numba-cuda fires no such event for a kernel; its compiler
fires "numba-cuda:run_pass" for each pass of a compilation, which is counted instead (several
per kernel: the count only needs to change when something compiles).
"""
from __future__ import annotations

import sys

from numba.core import event

_count = 0
_installed = False
_cuda_installed = False


def _counter(listener_base):
    """A listener class for numba's or numba-cuda's event module (each has its own base)."""
    class Counter(listener_base):
        def on_start(self, ev) -> None:
            global _count
            _count += 1

        def on_end(self, ev) -> None:
            pass
    return Counter


def count() -> int:
    """Compilations started so far in this process (counting from the first call of this)."""
    global _installed, _cuda_installed
    if not _installed:
        event.register("numba:compile", _counter(event.Listener)())
        _installed = True
    if not _cuda_installed:
        # numba-cuda's events live in its own module, loaded once a GPU kernel module is (a
        # CPU-only run never imports it)
        cuda_event = sys.modules.get("numba.cuda.core.event")
        if cuda_event is not None:
            cuda_event.register("numba-cuda:run_pass", _counter(cuda_event.Listener)())
            _cuda_installed = True
    return _count

