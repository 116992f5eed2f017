"""What every specialised matvec/GEMM kernel is built from: the launch geometry shared by the
family, the source stamp in each kernel's cache key, and `specialise`, which turns a template
into a kernel function. The family's modules (matvec, matvec_q8, gemm, gemm_mma, gemm_units)
import this one and not each other's internals, so they form no import cycle."""
from __future__ import annotations

import functools
import hashlib
import pathlib
import types as pytypes

from ..runtime.device import simulated

# The simulator runs each thread as a Python thread: keep its blocks to one warp.
WARPS = 1 if simulated() else 4
BLOCK_THREADS = 32 * WARPS
MAX_SLOTS = 8
# Registers: R*N accumulators plus R units must stay in registers. Beyond this product NVVM stops
# unrolling the inner loops and spills the per-row arrays to local memory.
MAX_ROWS_X_SLOTS = 16


def source_stamp(*names: str) -> int:
    """Hash of these source files (paths under gpu/): part of the cache key of the kernels built from them
    (see specialise), so a change to any of them compiles the kernels anew."""
    here = pathlib.Path(__file__).parents[1]     # gpu/
    digest = hashlib.sha256()
    for name in names:
        digest.update((here / name).read_bytes())
    return int.from_bytes(digest.digest()[:4], "little")


SOURCE_STAMP = source_stamp("matmul/kernel_source.py", "matmul/matvec.py", "matmul/quants.py", "intrinsics.py")


def specialise(template_fn, constants: dict, functions: dict):
    """template_fn(**constants) with `functions` bound as its globals.

    Numba's disk cache keys a kernel by its bytecode and its closure values, and only watches
    the template's own file. So every compile-time number (type id and source stamp included)
    is a closure value, and the per-type device functions are globals: pickling those into the
    key would not be reproducible across processes, and the stamp already covers their source.
    """
    fn = template_fn(**constants)
    namespace = dict(fn.__globals__, **functions)
    return pytypes.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, fn.__closure__)


_made: dict[int, tuple] = {}      # id(kernel) → (module, factory name, args) of the call that made it


def kernel_factory(make):
    """`functools.cache` for a function that builds a kernel from hashable arguments, recording
    which call made each kernel: `made_by` names it, so that another process can make the same
    kernel and compile it into the shared disk cache (hybrid/kernel_prep.py compiles a cold
    start's kernels in parallel processes that way)."""
    cached = functools.cache(make)

    @functools.wraps(make)
    def factory(*args):
        kernel = cached(*args)
        _made.setdefault(id(kernel), (make.__module__, make.__name__, args))
        return kernel
    return factory


def made_by(kernel) -> tuple | None:
    """(module, factory name, args) of the `kernel_factory` call that made `kernel`, if one did."""
    return _made.get(id(kernel))
