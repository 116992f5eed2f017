"""Atomic int64 array operations for Numba's parallel CPU kernels (Numba has none on the CPU).

Why: a parallel region that hands out fixed runs of work waits for its slowest thread, and on a
shared or virtualised machine one thread of a region routinely runs well behind the others
(docs/MEASUREMENTS.md). Threads that claim small chunks from a shared
counter finish together, and a counter per piece of work lets one region run steps that depend
on each other (the expert kernel's gate/up, then down) without a barrier.

`fetch_add` is a sequentially consistent read-modify-write: everything a thread wrote before it
is visible to the thread whose later `fetch_add` or `load_acquire` on the same element reads its
result.
"""
from __future__ import annotations

from numba import types
from numba.core import cgutils
from numba.core.extending import intrinsic


def _element_pointer(context, builder, aryty, ary, idxty, idx):
    arr = context.make_array(aryty)(context, builder, value=ary)
    i = context.cast(builder, idx, idxty, types.intp)
    return cgutils.get_item_pointer(context, builder, aryty, arr, [i], wraparound=False)


def _check_counter_array(a):
    if not (isinstance(a, types.Array) and a.ndim == 1 and a.dtype == types.int64 and a.mutable):
        raise TypeError(f"an atomic counter must live in a writable 1-D int64 array, not {a}")


@intrinsic
def fetch_add(typingctx, a, i, value):
    """a[i] += value atomically; returns the value a[i] held before."""
    _check_counter_array(a)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        v = context.cast(builder, args[2], sig.args[2], types.int64)
        return builder.atomic_rmw("add", ptr, v, "seq_cst")
    return types.int64(a, i, value), codegen


@intrinsic
def load_acquire(typingctx, a, i):
    """a[i], read atomically: a spin loop on it is not hoisted, and what the writer wrote before
    its `fetch_add` is visible once the new value is seen."""
    _check_counter_array(a)

    def codegen(context, builder, sig, args):
        ptr = _element_pointer(context, builder, sig.args[0], args[0], sig.args[1], args[1])
        return builder.load_atomic(ptr, "acquire", 8)
    return types.int64(a, i), codegen
