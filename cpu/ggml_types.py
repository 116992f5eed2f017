"""The ggml tensor types hybrid reads, and their block geometry.

A row of `n` elements of a quantised type is `n / block_elems` consecutive blocks of
`block_bytes` bytes each (docs/MODEL_FORMAT.md §6). Ids are ggml's enum values.
"""
from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as T


@dataclass(frozen=True)
class GGMLType:
    id: int
    name: str
    block_elems: int
    block_bytes: int

    def row_bytes(self, n_elems: int) -> int:
        return n_elems // self.block_elems * self.block_bytes


F32 = GGMLType(int(T.F32), "F32", 1, 4)
F16 = GGMLType(int(T.F16), "F16", 1, 2)
BF16 = GGMLType(int(T.BF16), "BF16", 1, 2)
Q4_0 = GGMLType(int(T.Q4_0), "Q4_0", 32, 18)
Q8_0 = GGMLType(int(T.Q8_0), "Q8_0", 32, 34)
Q4_K = GGMLType(int(T.Q4_K), "Q4_K", 256, 144)
Q5_K = GGMLType(int(T.Q5_K), "Q5_K", 256, 176)
Q6_K = GGMLType(int(T.Q6_K), "Q6_K", 256, 210)

SUPPORTED: dict[int, GGMLType] = {t.id: t for t in (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K)}
BY_NAME: dict[str, GGMLType] = {t.name: t for t in SUPPORTED.values()}


def type_name(type_id: int) -> str:
    """Name of any ggml type id, supported or not (for error messages)."""
    try:
        return T(type_id).name
    except ValueError:
        return f"type#{type_id}"


def by_name(name: str) -> GGMLType:
    try:
        return BY_NAME[name.upper()]
    except KeyError:
        raise ValueError(f"unknown tensor type {name!r}; supported: {', '.join(BY_NAME)}") from None
