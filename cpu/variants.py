"""Kernels compiled for the weight types a call meets, not for every quantised type.

The kernels that take a weight type at run time (`cpu.matvec`'s, the fused FFN, the row
dequantiser, the prompt-chunk matmul) branch on it inside. Compiled as one kernel for every
quantised type, the code of the types a model never holds was most of their compile time, and
compiling is most of a first run. So each such kernel is made by a factory `make(*type_ids)` for the weight
types of its call (one per weight argument, in order), which become closure constants in the
kernel: Numba prunes the branches of other types before it types the code (a comparison of two
constants), and the SIMD row dot emits only those types' readers (`cpu.simd.row_dot_intrinsic`
takes `type_mask(...)` as a compile-time constant). Numba caches a closure's compilations on disk
keyed by the closure's contents as well, so every variant has its own cache entries.

A Q4_K_M model then compiles `_matvec_quant` for Q4_K and for Q6_K and the fused FFN for
(Q4_K, Q4_K) only. A type's code is the same in every variant, so the variant never changes a
result's bits.
"""
from __future__ import annotations

from typing import Callable, Iterable


def type_mask(type_ids: Iterable[int]) -> int:
    """The mask of these ggml type ids (bit t for type t), as `row_dot_intrinsic` takes it."""
    mask = 0
    for t in type_ids:
        mask |= 1 << int(t)
    return mask


class Variants:
    """One kernel's variants: `self(*type_ids)` is make(*type_ids), made once per type tuple
    (a Numba dispatcher; it compiles on its first call, or loads from the disk cache)."""

    def __init__(self, make: Callable[..., object]):
        self.make = make
        self._made: dict[tuple[int, ...], object] = {}
        self.__doc__ = make.__doc__

    def __call__(self, *type_ids: int):
        kernel = self._made.get(type_ids)
        if kernel is None:
            kernel = self._made[type_ids] = self.make(*(int(t) for t in type_ids))
        return kernel

    def made(self) -> dict[tuple[int, ...], object]:
        """The variants made so far, by type tuple."""
        return dict(self._made)
