"""Compile every GPU kernel to PTX for sm_90, with no GPU: typing errors the simulator cannot see.

Also fails a matvec kernel whose PTX uses local memory: its per-row arrays were not unrolled into
registers, a silent 2-10x slowdown.

Needs NVIDIA's compiler libraries (NVVM and NVRTC), e.g. `pip install "numba-cuda[cu13]"`.
Exit status: 0 all compiled, 1 a kernel failed, 3 the compiler libraries are missing.

    python tools/gpu_ptx_check.py [--all]    # --all: every (slots, rows-per-warp) shape
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

# The simulator's numba.cuda cannot compile: make sure this process gets the real target.
os.environ.pop("NUMBA_ENABLE_CUDASIM", None)

MISSING_LIBRARY = 3
CC = (9, 0)


def compiler_missing(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}".lower()
    return any(k in text for k in ("nvrtc", "nvvm", "libdevice", "dynamiclibnotfound")) and \
        any(k in text for k in ("not found", "failure finding", "cannot find", "no such file",
                                "unavailable", "could not"))


def main(argv: list[str]) -> int:
    from numba import cuda, types

    def probe(a):
        a[0] = 1.0

    try:
        cuda.compile_ptx(probe, (types.float32[::1],), cc=CC)
    except Exception as exc:  # noqa: BLE001 - which exception depends on the missing library
        if compiler_missing(exc):
            print(f"CUDA compiler libraries missing ({type(exc).__name__}: {exc}); "
                  f'install them with: pip install "numba-cuda[cu13]"')
            return MISSING_LIBRARY
        raise

    every_shape = "--all" in argv
    n_targets = len(targets(every_shape))
    workers = max(1, min(os.cpu_count() or 1, 8))
    # compiling is single-threaded: one process per core, each taking every workers-th kernel
    # (the kernels are built from closures, which do not pickle: each process builds the list)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:   # no fork of a CUDA process
        reports = pool.map(compile_share, [(every_shape, i, workers) for i in range(workers)])
        lines = sorted(line for report in reports for line in report)
    failed = 0
    for _, line, bad in lines:
        print(line, flush=True)
        failed += bad
    print(f"{n_targets - failed}/{n_targets} kernels compiled for sm_{CC[0]}{CC[1]}")
    return 1 if failed else 0


def targets(every_shape: bool) -> list:
    """(name, python function, argument types) of every kernel to check."""
    from gpu import bench, matvec, ops
    return [*matvec.ptx_targets(every_shape=every_shape), *ops.ptx_targets(), *bench.ptx_targets()]


def compile_share(job) -> list[tuple[int, str, bool]]:
    """Compile kernels first, first + step, ...: (index, report line, failed) for each."""
    every_shape, first, step = job
    from numba import cuda
    out = []
    for i, (name, pyfunc, argtypes) in enumerate(targets(every_shape)):
        if i % step != first:
            continue
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=CC)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            out.append((i, f"FAIL {name}: {type(exc).__name__}: {exc}", True))
            continue
        bad = name.startswith(("matvec", "gemm")) and ".local" in ptx
        note = "  FAIL: uses local memory (per-thread arrays not kept in registers)" if bad else ""
        out.append((i, f"{'ok  ' if not bad else 'FAIL'} {name:40s} {time.perf_counter() - t0:5.1f} s  "
                       f"{ptx.count(chr(10)):5d} PTX lines{note}", bad))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
