"""Compile every GPU kernel to PTX for sm_90, with no GPU: typing errors the simulator cannot see.

Also fails a matvec kernel whose PTX uses local memory: its per-row arrays were not unrolled into
registers, a silent 2-10x slowdown.

Needs NVIDIA's compiler libraries (NVVM and NVRTC), e.g. `pip install "numba-cuda[cu13]"`.
Exit status: 0 all compiled, 1 a kernel failed, 3 the compiler libraries are missing.

    python tools/gpu_ptx_check.py [--all]    # --all: every (slots, rows-per-warp) shape
"""
from __future__ import annotations

import os
import sys
import time

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

    from gpu import bench, matvec, ops

    targets = [*matvec.ptx_targets(every_shape="--all" in argv), *ops.ptx_targets(), *bench.ptx_targets()]
    failed = 0
    for name, pyfunc, argtypes in targets:
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=CC)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            print(f"FAIL {name}: {type(exc).__name__}: {exc}")
            failed += 1
            continue
        note = ""
        if name.startswith(("matvec", "gemm")) and ".local" in ptx:
            note = "  FAIL: uses local memory (per-thread arrays not kept in registers)"
            failed += 1
        print(f"{'ok  ' if not note else 'FAIL'} {name:40s} {time.perf_counter() - t0:5.1f} s  "
              f"{ptx.count(chr(10)):5d} PTX lines{note}", flush=True)
    print(f"{len(targets) - failed}/{len(targets)} kernels compiled for sm_{CC[0]}{CC[1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
