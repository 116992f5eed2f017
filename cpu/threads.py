"""The CPU kernels' thread pool: how many threads a call uses.

Every kernel is one parallel loop per op, ending at a barrier. A decode step of a small model
reads tens of KB per matrix, microseconds of work, so the pool's wake-up and barriers cost what
the threads save; and when other programs keep the cores busy, every barrier also waits for the
thread the scheduler put aside, a time slice instead of microseconds, and decode collapses. So a
step (a call of few rows: decode, verify) of a model that reads under SMALL_STEP_BYTES of CPU
weights per token runs on one thread. Larger models are bandwidth-bound and keep every thread:
fewer threads read less per second. A call of many rows (a prompt chunk) is compute-bound and
uses every thread the user allowed.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import numba

SMALL_STEP_BYTES = 64 << 20    # CPU weight bytes per token below which a step runs on one thread
STEP_ROWS = 16                 # calls of at most this many rows are steps (decode, verify, MTP): bandwidth-bound


def available_cores() -> int:
    """The cores this process may run on (its affinity mask): the default thread count. The FFN
    kernels are bandwidth-bound and want every one."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    """Use `threads` threads (None: every available core), capped at Numba's pool size; returns
    the number set. ValueError below 1."""
    n = available_cores() if threads is None else threads
    if n < 1:
        raise ValueError(f"threads must be ≥ 1, got {n}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


@dataclass(frozen=True)
class ThreadPolicy:
    """Threads per call: `step` for calls of ≤ STEP_ROWS rows, `batch` for larger ones."""
    step: int
    batch: int

    @classmethod
    def for_step_bytes(cls, threads: int, token_bytes: int) -> "ThreadPolicy":
        """`threads` for prompt chunks; for steps too, unless a token reads under
        SMALL_STEP_BYTES of CPU weights (`token_bytes`): then one."""
        return cls(step=1 if token_bytes < SMALL_STEP_BYTES else threads, batch=threads)

    def use(self, rows: int) -> None:
        numba.set_num_threads(self.step if rows <= STEP_ROWS else self.batch)
