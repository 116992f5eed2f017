"""Compile every GPU kernel to PTX for sm_90, with no GPU: typing errors the simulator cannot see.

Also fails a matvec or GEMM kernel whose PTX uses local memory (its per-row arrays were not
unrolled into registers, a silent 2-10x slowdown) or reads __constant__ memory (a table indexed per
lane there serialises the warp: the IQ grids live in global memory, gpu/matmul/quants.py).

Needs NVIDIA's compiler libraries (NVVM and NVRTC), e.g. `pip install "numba-cuda[cu13]"`.
Exit status: 0 all compiled, 1 a kernel failed, 3 the compiler libraries are missing.

    python tools/gpu_ptx_check.py [--all | --representative]
        --all: every (slots, rows-per-warp) shape
        --representative: each per-type kernel template once per type and once per variant
                          (tests/gpu/test_ptx.py's choice where no GPU is present: CI)
"""
from __future__ import annotations

import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from cpu.ggml_types import BY_NAME

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

    choice = ("--all" in argv, "--representative" in argv)
    n_targets = len(selected(*choice))
    workers = max(1, min(os.cpu_count() or 1, 8))
    # compiling is single-threaded: one process per core, each taking every workers-th kernel
    # (the kernels are built from closures, which do not pickle: each process builds the list)
    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:   # no fork of a CUDA process
        reports = pool.map(compile_share, [(choice, i, workers) for i in range(workers)])
        lines = sorted(line for report in reports for line in report)
    failed = 0
    for _, line, bad in lines:
        print(line, flush=True)
        failed += bad
    print(f"{n_targets - failed}/{n_targets} kernels compiled for sm_{CC[0]}{CC[1]}")
    return 1 if failed else 0


def targets(every_shape: bool) -> list:
    """(name, python function, argument types) of every kernel to check."""
    # imported here, not at the top: main() first checks that the compiler libraries exist
    import gpu_bench_kernels
    from gpu import quants
    from gpu.matmul import gemm, matvec
    return [*matvec.ptx_targets(every_shape=every_shape), *op_targets(), *quants.ptx_targets(),
            *gemm.ptx_targets(),        # prompt-chunk products (matvec calls of many rows)
            *gpu_bench_kernels.ptx_targets()]


def selected(every_shape: bool, representative: bool) -> list:
    """The targets to compile: all, or with `representative` a subset that still compiles every
    piece of kernel source at least once. A typing error in a template
    or in a type's lane code shows in any of their specialisations; one that only some constants
    reach, and local memory in the shapes left out, are for the full check on a GPU machine.
    A per-type target is named "<family> <type> <variant>" (e.g. "gemm Q4_K mma64x64w4"); the
    types of a family that share one list of variants form a group, and of a group of k types
    and m variants the i-th variant is kept for the j-th type when i ≡ j mod min(k, m): every
    type and every variant at least once, max(k, m) kernels instead of k·m, each variant with
    several types where there are more types than variants. Targets without a type name (the
    op set, the x quantiser) are all kept."""
    every = list(targets(every_shape))
    if not representative:
        return every
    parsed, variants = [], {}         # variants: (family, type) -> its variants, in order
    for target in every:
        words = target[0].split(" ")
        at = next((i for i, w in enumerate(words) if w in BY_NAME), None)
        key = None if at is None else (" ".join(words[:at]), words[at])
        parsed.append((target, key, None if at is None else " ".join(words[at + 1:])))
        if key is not None:
            variants.setdefault(key, []).append(parsed[-1][2])
    groups = {}                       # (family, variants) -> its types, in order
    for (family, type_name), names in variants.items():
        groups.setdefault((family, tuple(names)), []).append(type_name)
    keep = set()
    for (family, names), type_names in groups.items():
        period = min(len(type_names), len(names))
        keep.update((family, t, v) for j, t in enumerate(type_names) for i, v in enumerate(names)
                    if i % period == j % period)
    return [target for target, key, variant in parsed if key is None or (*key, variant) in keep]


def op_targets():
    """(name, python function, argument types) of every kernel the op set (gpu/ops.py) adds to
    the matmul family, with the argument types the forward calls them with."""
    from numba import types
    from numba.np import numpy_support

    from gpu import argmax, attention, ffn, gdn, moe, norm, ops, rope
    from gpu import expert_cache as ec
    from gpu import top_logits as top
    from gpu.runtime import memory

    f32, f64, i64 = types.float32, types.float64, types.int64

    def a(dtype, ndim, layout="C"):
        return types.Array(dtype, ndim, layout)

    m1, m2, m3, m4 = a(f32, 1), a(f32, 2), a(f32, 3), a(f32, 4)
    kv3 = a(numpy_support.from_dtype(attention.KV_DTYPE), 3)      # the cache's element type
    kernels = [
        ("argmax parts", argmax._argmax_parts, (m2, i64, m3)),
        ("argmax merge", argmax._argmax_merge, (m3, i64, m2)),
        ("top_logits", top._top_logits, (a(types.uint32, 2), a(types.uint32, 2))),
        ("rms_norm", norm._rms_norm, (m2, m1, f64, m2)),
        ("add_rms_norm", norm._add_rms_norm, (m2, m2, m1, f64, m2)),
        ("head_rms_norm", norm._head_rms_norm, (m3, m1, f64, m3)),
        ("gated_rms_norm", norm._gated_rms_norm, (m2, m2, m1, f64, m2)),
        ("l2_norm_heads", norm._l2_norm_heads, (m2, i64, i64, f64)),
        ("rope_neox", rope._rope_neox, (m3, a(i64, 1), a(f64, 1))),
        ("kv_append", attention._kv_append, (m3, m3, kv3, kv3, a(i64, 1))),
        ("attention parts", attention._attention_parts, (m3, kv3, kv3, a(i64, 1), i64, m3, m3, m4)),
        ("attention merge", attention._attention_merge, (m3, a(i64, 1), i64, m3, m3, m4, m2)),
        ("conv1d_silu", gdn._conv1d_silu, (m2, m2, m2, m2, m3)),
        ("conv1d_silu tokens", gdn._conv1d_silu_tokens, (m2, m2, m2, m2, m3)),
        ("conv state advance", gdn._conv_state_advance, (m2, m2)),
        ("gdn_gates", gdn._gdn_gates, (m2, m2, m1, m1, m2, m2)),
        ("gdn conv_norm_gates", gdn._conv_norm_gates, (m2, m2, m2, m2, m3, i64, i64, f64, m2, m2, m1, m1, m2, m2)),
        ("gated_delta_rule", gdn._gated_delta_rule, (m2, i64, types.boolean, m2, m2, m3, m2, m4,
                                                     m2, m1, f64, m2, a(types.int32, 2))),
        ("add_inplace", ops._add_inplace, (m2, m2)),
        ("silu_times", ffn._silu_times, (m2, m2)),
        ("moe gather_rows", moe._gather_rows, (m2, a(i64, 1), i64, m2)),
        ("moe scatter_rows", moe._scatter_rows, (m2, a(i64, 1), a(i64, 1), i64, m3)),
        ("moe weighted_sum", moe._weighted_sum, (m3, m2, m2)),
        ("moe add_gated", moe._add_gated, (m2, m2, m2)),
        ("expert cache route", ec._route, (a(types.uint32, 2), a(types.int32, 1), a(types.int32, 1), a(i64, 2), m2,
                                           a(types.int32, 2), m2, m2, a(i64, 2), m2)),
        ("expert cache silu_times", ec._silu_times_gpu, (m2, m2, a(types.int32, 2))),
        ("expert cache fetch", ec._fetch, (a(types.int32, 2), a(i64, 2),
                                           *(a(types.uint32, 2), i64, a(types.uint32, 2)) * 2)),
        ("expert cache finish", ec._finish, (m2, m2, m2, a(types.int32, 2), m2, m2, m2, types.boolean)),
        ("fill_zero", memory._fill_zero_kernel, (m1,)),
        ("copy_2d", memory._copy_2d_kernel, (a(f32, 2, "A"), a(f32, 2, "A"))),
    ]
    for name, kernel, argtypes in kernels:
        yield name, kernel.py_func, argtypes


def compile_share(job) -> list[tuple[int, str, bool]]:
    """Compile kernels first, first + step, ...: (index, report line, failed) for each."""
    choice, first, step = job
    from numba import cuda
    out = []
    for i, (name, pyfunc, argtypes) in enumerate(selected(*choice)):
        if i % step != first:
            continue
        t0 = time.perf_counter()
        try:
            ptx, _ = cuda.compile_ptx(pyfunc, argtypes, cc=CC)
        except Exception as exc:  # noqa: BLE001 - report every kernel, then fail
            out.append((i, f"FAIL {name}: {type(exc).__name__}: {exc}", True))
            continue
        local = name.startswith(("matvec", "gemm")) and ".local" in ptx
        # a table read from __constant__ space serialises a warp's lanes on distinct entries
        # (gpu/matmul/quants.py keeps the IQ grids in global memory for that reason)
        constant = name.startswith(("matvec", "gemm")) and "ld.const" in ptx
        bad = local or constant
        note = ("  FAIL: uses local memory (per-thread arrays not kept in registers)" if local else
                "  FAIL: reads __constant__ memory (per-lane table lookups serialise)" if constant else "")
        out.append((i, f"{'ok  ' if not bad else 'FAIL'} {name:40s} {time.perf_counter() - t0:5.1f} s  "
                       f"{ptx.count(chr(10)):5d} PTX lines{note}", bad))
    return out


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
