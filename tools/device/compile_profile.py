#!/usr/bin/env python3
"""Where a cold start's seconds go: runs one CLI command in this process and records every Numba
compilation (CPU `@njit` via Numba's compile event; CUDA kernels by timing CUDADispatcher.compile,
which fires no event) with its duration and the wall time it started at.

    python3 tools/device/compile_profile.py decode -p "def fibonacci(n):" -n 64 --temp 0

Run it with an empty NUMBA_CACHE_DIR to see a first run; a warm cache shows what still compiles.
"""
from __future__ import annotations

import collections
import logging
import sys
import time

from numba.core import event

T0 = time.perf_counter()
records: list[tuple[str, str, float, float]] = []     # (target, name, start s, seconds)


class _CPU(event.Listener):
    def on_start(self, ev):
        ev.data["_t"] = time.perf_counter()

    def on_end(self, ev):
        d = ev.data["dispatcher"]
        t = ev.data.get("_t", time.perf_counter())
        records.append(("cpu", f"{d.py_func.__module__}.{d.py_func.__name__}", t - T0, time.perf_counter() - t))


def _wrap_cuda() -> None:
    try:
        from numba.cuda.dispatcher import CUDADispatcher
    except ImportError:
        return
    inner = CUDADispatcher.compile

    def compile(self, sig):
        known = len(self.overloads)
        t = time.perf_counter()
        out = inner(self, sig)
        if len(self.overloads) > known and self._cache_misses:
            records.append(("cuda", f"{self.py_func.__module__}.{self.py_func.__name__}", t - T0,
                            time.perf_counter() - t))
        return out
    CUDADispatcher.compile = compile


def report() -> None:
    out = sys.stderr
    by = collections.defaultdict(lambda: [0, 0.0])
    for target, _, _, s in records:
        by[target][0] += 1
        by[target][1] += s
    print(f"\n== compile profile: {time.perf_counter() - T0:.1f} s in all", file=out)
    for target, (n, s) in sorted(by.items()):
        print(f"{target:5} {n:4d} compilations {s:7.1f} s", file=out)
    for target, name, at, s in sorted(records, key=lambda r: -r[3])[:25]:
        print(f"  {target:5} {s:6.2f} s at {at:6.1f} s  {name}", file=out)
    if records:
        print(f"last compilation ended at {max(a + s for _, _, a, s in records):.1f} s", file=out)


def main() -> int:
    # hybrid.kernel_prep's phase lines: plan passes, worker processes, the warm-up run
    logging.basicConfig(stream=sys.stderr, format="[%(relativeCreated)7.0f ms] %(message)s")
    logging.getLogger("hybrid.kernel_prep").setLevel(logging.INFO)
    event.register("numba:compile", _CPU())
    _wrap_cuda()
    from hybrid.cli import main as cli
    sys.argv = ["hybrid", *sys.argv[1:]]
    try:
        cli()
    except SystemExit:
        pass
    finally:
        report()
    return 0


if __name__ == "__main__":
    sys.exit(main())
