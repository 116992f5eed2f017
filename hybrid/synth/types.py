"""Which ggml type each tensor of a synthetic model gets, and the byte plan of the whole file.

Two recipes: one uniform type for every matrix (what the converter's `--outtype` or
`llama-quantize --pure` writes), or `Q4_K_M` as llama.cpp's quantizer assigns it
(docs/MODEL_FORMAT.md §5). Tensors the converter forces to F32 (norms, conv taps, ssm_a,
dt bias, routers: `TensorSpec.f32_only`) and every 1-D tensor stay F32 in both.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterator, Mapping, NamedTuple

from gguf import LlamaFileType

from cpu import ggml_types as gt
from ..errors import HybridError
from cpu.ggml_types import GGMLType
from ..layout import TensorSpec, expected_tensors
from .spec import SynthSpec

ALIGNMENT = 32          # GGUF default (`general.alignment` absent)
RECIPES = ("Q4_K_M", *gt.BY_NAME)

# `general.file_type`: the llama_ftype a file made with each recipe reports.
_FILE_TYPE = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
}


class PlannedTensor(NamedTuple):
    name: str
    ne: tuple[int, ...]
    type: GGMLType

    @property
    def n_elements(self) -> int:
        n = 1
        for d in self.ne:
            n *= d
        return n

    @property
    def n_rows(self) -> int:
        return self.n_elements // self.ne[0]

    @property
    def nbytes(self) -> int:
        return self.n_rows * self.type.row_bytes(self.ne[0])


@dataclass(frozen=True)
class ModelPlan:
    tensors: tuple[PlannedTensor, ...]
    recipe: str
    file_type: int
    alignment: int = ALIGNMENT

    def __iter__(self) -> Iterator[PlannedTensor]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    @property
    def total_bytes(self) -> int:
        """Bytes of the tensor-data section, alignment padding included (the file adds its header)."""
        return sum(_aligned(t.nbytes, self.alignment) for t in self.tensors)

    def type_counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for t in self.tensors:
            counts[t.type.name] = counts.get(t.type.name, 0) + 1
        return counts


def _aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def plan_model(spec: SynthSpec, types: str = "Q4_K_M",
               overrides: Mapping[str, str] | None = None) -> ModelPlan:
    """Every tensor of `spec` in llama.cpp's order, with its type; nothing is written.

    `overrides` maps a regex (searched in the tensor name, first match wins) to a type name,
    applied after the recipe: a test hook to place a chosen type on a chosen tensor.
    """
    recipe = _recipe_name(types)
    specs = synth_layout(spec)
    chosen = (_q4_k_m(specs, spec) if recipe == "Q4_K_M"
              else [_uniform(s, gt.by_name(recipe)) for s in specs])
    rules = [(re.compile(p), _type_by_name(t)) for p, t in (overrides or {}).items()]
    planned = []
    for s, t in zip(specs, chosen):
        for rx, forced in rules:
            if rx.search(s.name):
                t = forced
                break
        _check_fits(s, t)
        planned.append(PlannedTensor(s.name, tuple(s.ne), t))
    return ModelPlan(tuple(planned), recipe, int(_FILE_TYPE[recipe]))


def synth_layout(spec: SynthSpec) -> list[TensorSpec]:
    """The tensors a converted Qwen file has: llama.cpp's layout minus the optional MTP embedding
    and head (Qwen's MTP shares the trunk's; its converter writes only `shared_head_norm`)."""
    return [s for s in expected_tensors(spec.config(), spec.layout_options())
            if s.required or s.name.endswith(".nextn.shared_head_norm.weight")]


def _recipe_name(types: str) -> str:
    for r in RECIPES:
        if r.upper() == str(types).upper():
            return r
    raise HybridError(f"unknown type recipe {types!r}; choose one of {', '.join(RECIPES)}")


def _type_by_name(name: str) -> GGMLType:
    try:
        return gt.by_name(name)
    except ValueError as e:
        raise HybridError(str(e)) from None


def _check_fits(s: TensorSpec, t: GGMLType) -> None:
    if s.ne[0] % t.block_elems:
        raise HybridError(
            f"tensor {s.name} has rows of {s.ne[0]} elements, but {t.name} packs {t.block_elems} "
            f"per block; pick dims that are multiples of {t.block_elems} or another type")


def _keeps_f32(s: TensorSpec) -> bool:
    return s.f32_only or len(s.ne) < 2


def _uniform(s: TensorSpec, t: GGMLType) -> GGMLType:
    return gt.F32 if _keeps_f32(s) else t


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's "more bits" layers: the first and last eighth, and every third in between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def _q4_k_m(specs: list[TensorSpec], spec: SynthSpec) -> list[GGMLType]:
    """llama-quant.cpp's Q4_K_M choices, tensor by tensor in file (= layer) order.

    attn_v and the GDN attn_qkv share one counter (llama.cpp treats a fused qkv like attn_v),
    so with one of them per block the counter equals the block index. ffn_down (dense, experts
    and shared expert) counts over all blocks, the MTP block included.
    """
    is_attn_v = [s.name.endswith((".attn_v.weight", ".attn_qkv.weight")) for s in specs]
    n_attn_v = sum(is_attn_v)
    n_blocks = spec.n_layer_all
    moe = spec.arch != "qwen35"
    i_attn_v = i_ffn_down = 0
    out = []
    for s, attn_v in zip(specs, is_attn_v):
        if _keeps_f32(s):
            t = gt.F32
        elif s.name == "output.weight":
            t = gt.Q6_K
        elif s.name == "token_embd.weight":
            t = gt.Q6_K if spec.tied_output else gt.Q4_K     # a tied embedding is also the lm_head
        elif attn_v:
            t = gt.Q6_K if use_more_bits(i_attn_v, n_attn_v) else gt.Q4_K
            i_attn_v += 1
        elif "ffn_down" in s.name:
            # MoE files: the layer comes from the name (experts may be interleaved); dense: the counter
            layer = _layer_of(s.name) if moe else i_ffn_down
            t = gt.Q6_K if use_more_bits(layer, n_blocks) else gt.Q4_K
            i_ffn_down += 1
        else:
            t = gt.Q4_K
        out.append(t)
    return out
