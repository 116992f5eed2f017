"""GPU benchmark: device memory bandwidth, then each type's matvec GB/s and % of the read rate.

    python tools/gpu_bench.py            # decode shapes of a dense 27B, every type, n = 1, 2, 4, 8
    python tools/gpu_bench.py --quick    # smaller shapes
    python tools/gpu_bench.py --sweep    # also try other rows per warp and lanes per row on the decode shapes
    python tools/gpu_bench.py --types IQ2_XS,MXFP4   # only these types, at the FFN gate/up shape

GB/s counts weight bytes only (x and out are tiny). A '*' marks a time that may include idle
gaps (Python enqueued slower than the device ran); rN is the rows per warp (per lane group)
used, lN the lanes per row; regs are the registers per thread of each n's kernel.
"""
from __future__ import annotations

import argparse
import sys

from numba import cuda

import gpu_bench_kernels as bench
from gpu import require_cuda
from gpu.matmul.quants import UNITS
from cpu import ggml_types as gt

SLOTS = (1, 2, 4, 8)
# --sweep: (rows per warp, lanes per row), None = the default
SWEEP = [(None, None), (1, None), (2, None), (4, None), (None, 32), (None, 16), (None, 8)]
# (type, rows, cols): FFN gate/up and down of a dense 27B (D=5120, n_ff=17408), its lm_head
DECODE_SHAPES = [(gt.Q4_K, 17408, 5120), (gt.Q4_K, 5120, 17408), (gt.Q6_K, 248320, 5120)]
# every other type the GPU runs (its float-lane units are the registry), at the FFN gate/up shape
OTHER_TYPES = [u.type for u in UNITS.values() if u.type is not gt.Q4_K]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="smaller shapes")
    p.add_argument("--sweep", action="store_true", help="other rows per warp / lanes per row on the decode shapes")
    p.add_argument("--types", help="comma-separated type names: only these, at the FFN gate/up shape")
    p.add_argument("--ns", default=",".join(map(str, SLOTS)), help="inputs per pass to time, e.g. 1,4")
    a = p.parse_args(argv)
    slots = tuple(int(n) for n in a.ns.split(","))
    quick, sweep = a.quick, a.sweep
    only = None
    if a.types:
        only = [gt.BY_NAME.get(name.strip().upper()) for name in a.types.split(",")]
        if None in only:
            p.error(f"--types: unknown type in {a.types!r}; GPU types: {', '.join(u.type.name for u in UNITS.values())}")
    require_cuda()
    dev = cuda.get_current_device()
    print(f"GPU: {dev.name.decode() if isinstance(dev.name, bytes) else dev.name}, "
          f"{dev.MULTIPROCESSOR_COUNT} SMs")
    bw = bench.memory_bandwidth(1 << 30 if quick else 2 << 30)
    print(f"device memory: read {bw['read']:.0f} GB/s, copy (read+write) {bw['copy']:.0f} GB/s")
    read = bw["read"]

    if only:
        cases = [(t, 4096 if quick else 17408, 5120) for t in only]
    else:
        cases = [(t, r // 4, c) for t, r, c in DECODE_SHAPES] if quick else list(DECODE_SHAPES)
        cases += [(t, 4096 if quick else 17408, 5120) for t in OTHER_TYPES]
    header = f"{'type':5s} {'rows x cols':>14s} {'MB':>7s} " + " ".join(
        f"{'n=' + str(n) + ' GB/s (%)':>17s}" for n in slots)
    print(header)
    print("-" * len(header))
    for i, (t, rows, cols) in enumerate(cases):
        choices = SWEEP if sweep and i < len(DECODE_SHAPES) else SWEEP[:1]
        results = bench.bench_matvec(t, rows, cols, slots, choices)
        mb = rows * t.row_bytes(cols) / 1e6
        by_choice: dict = {}
        for res in results:
            by_choice.setdefault(res.requested, {})[res.n] = res
        for choice, row in by_choice.items():
            label = "".join(f" {k}={v}" for k, v in zip(("r", "lanes"), choice) if v is not None)
            cells = []
            for n in slots:
                res = row.get(n)
                cells.append(f"{'-':>17s}" if res is None else
                             f"{res.gbps:7.0f} ({100 * res.gbps / read:3.0f}%)r{res.rows_per_warp}l{res.lanes}"
                             f"{'*' if res.flagged else ' '}")
            regs = "/".join(str(row[n].registers) for n in slots if n in row)
            print(f"{t.name:5s} {f'{rows}x{cols}':>14s} {mb:7.1f} " + " ".join(cells)
                  + f"  regs {regs}" + label)
    print("\nn=1, x quantised once per input (gpu.matmul.matvec.matvecs) — the int8 kernel alone:")
    for t, rows, cols in (cases if only else cases[:len(DECODE_SHAPES)]):
        rates = bench.bench_matvec_shared_input(t, rows, cols)
        if rates:
            print(f"{t.name:5s} {f'{rows}x{cols}':>14s}  with its own quantise {rates[0]:5.0f} GB/s "
                  f"({100 * rates[0] / read:3.0f}%), kernel alone {rates[1]:5.0f} GB/s ({100 * rates[1] / read:3.0f}%)"
                  f"{'*' if rates[2] else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
