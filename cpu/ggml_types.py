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

# The types real GGUFs use besides the ones above (low-bit mixes, IQ quants, MXFP4 experts), each
# with a float block decoder (`cpu.blocks`). Each has a SIMD row dot in `cpu.matvec.ROW_READERS`,
# so the CPU reads them as it reads the types above; a type added here before its reader would
# take the decode-then-dot path (`cpu.decoded`); layouts: MODEL_FORMAT.md §6.
Q4_1 = GGMLType(int(T.Q4_1), "Q4_1", 32, 20)
Q5_0 = GGMLType(int(T.Q5_0), "Q5_0", 32, 22)
Q5_1 = GGMLType(int(T.Q5_1), "Q5_1", 32, 24)
Q2_K = GGMLType(int(T.Q2_K), "Q2_K", 256, 84)
Q3_K = GGMLType(int(T.Q3_K), "Q3_K", 256, 110)
IQ4_NL = GGMLType(int(T.IQ4_NL), "IQ4_NL", 32, 18)
IQ4_XS = GGMLType(int(T.IQ4_XS), "IQ4_XS", 256, 136)
IQ3_XXS = GGMLType(int(T.IQ3_XXS), "IQ3_XXS", 256, 98)
IQ3_S = GGMLType(int(T.IQ3_S), "IQ3_S", 256, 110)
IQ2_XXS = GGMLType(int(T.IQ2_XXS), "IQ2_XXS", 256, 66)
IQ2_XS = GGMLType(int(T.IQ2_XS), "IQ2_XS", 256, 74)
IQ2_S = GGMLType(int(T.IQ2_S), "IQ2_S", 256, 82)
IQ1_S = GGMLType(int(T.IQ1_S), "IQ1_S", 256, 50)
IQ1_M = GGMLType(int(T.IQ1_M), "IQ1_M", 256, 56)
MXFP4 = GGMLType(int(T.MXFP4), "MXFP4", 32, 17)

# The quantised types that `cpu.blocks` decodes to float32 for `cpu.decoded`. All of them also have
# an int8 row dot (`cpu.matvec.ROW_READERS`, the one list of SIMD types), which matvec, the FFN
# and the MoE kernels take; their decoders still serve lookups (`cpu.quants`), and `cpu.decoded` /
# `cpu.decoded_moe` a type without a row dot (none now).
DECODED: tuple[GGMLType, ...] = (Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS,
                                 IQ2_S, IQ1_S, IQ1_M, MXFP4)
DECODED_IDS = frozenset(t.id for t in DECODED)

SUPPORTED: dict[int, GGMLType] = {t.id: t for t in (F32, F16, BF16, Q4_0, Q8_0, Q4_K, Q5_K, Q6_K, *DECODED)}
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
