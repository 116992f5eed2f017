"""Which ggml type each tensor of a synthetic model gets, and the byte plan of the whole file.

Two kinds of recipe: one uniform type for every matrix (what the converter's `--outtype` or
`llama-quantize --pure` writes), or a mix as llama.cpp's quantizer assigns it per tensor
(docs/MODEL_FORMAT.md §5): `Q4_K_M`, and the mixes of `MIXES` (llama-quant.cpp's
`llama_tensor_get_type_impl` at 0c1e570, no imatrix). Where a mix's name is also a type's
(Q2_K, IQ4_XS), the type names the uniform recipe and the mix is `<name>_MIX`. Tensors the
converter forces to F32 (norms, conv taps, ssm_a, dt bias, routers: `TensorSpec.f32_only`) and
every 1-D tensor stay F32 in all.
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
# llama.cpp's mixed ftypes done by `_llama_mix`: recipe name → (llama ftype, its base type)
MIXES = {
    "Q2_K_MIX": (LlamaFileType.MOSTLY_Q2_K, gt.Q2_K), "Q3_K_S": (LlamaFileType.MOSTLY_Q3_K_S, gt.Q3_K),
    "Q3_K_M": (LlamaFileType.MOSTLY_Q3_K_M, gt.Q3_K), "Q3_K_L": (LlamaFileType.MOSTLY_Q3_K_L, gt.Q3_K),
    "Q4_K_S": (LlamaFileType.MOSTLY_Q4_K_S, gt.Q4_K), "IQ4_XS_MIX": (LlamaFileType.MOSTLY_IQ4_XS, gt.IQ4_XS),
    "IQ3_M": (LlamaFileType.MOSTLY_IQ3_M, gt.IQ3_S), "MXFP4_MOE": (LlamaFileType.MOSTLY_MXFP4_MOE, gt.MXFP4),
}
RECIPES = ("Q4_K_M", *MIXES, *gt.BY_NAME)

# `general.file_type`: the llama_ftype a file made with each recipe reports.
_FILE_TYPE = {
    "Q4_K_M": LlamaFileType.MOSTLY_Q4_K_M, "F32": LlamaFileType.ALL_F32, "F16": LlamaFileType.MOSTLY_F16,
    "BF16": LlamaFileType.MOSTLY_BF16, "Q4_0": LlamaFileType.MOSTLY_Q4_0, "Q8_0": LlamaFileType.MOSTLY_Q8_0,
    "Q4_K": LlamaFileType.MOSTLY_Q4_K_S, "Q5_K": LlamaFileType.MOSTLY_Q5_K_S, "Q6_K": LlamaFileType.MOSTLY_Q6_K,
    "Q4_1": LlamaFileType.MOSTLY_Q4_1, "Q5_0": LlamaFileType.MOSTLY_Q5_0, "Q5_1": LlamaFileType.MOSTLY_Q5_1,
    "Q2_K": LlamaFileType.MOSTLY_Q2_K, "Q3_K": LlamaFileType.MOSTLY_Q3_K_S, "IQ4_NL": LlamaFileType.MOSTLY_IQ4_NL,
    "IQ4_XS": LlamaFileType.MOSTLY_IQ4_XS, "IQ3_XXS": LlamaFileType.MOSTLY_IQ3_XXS, "IQ3_S": LlamaFileType.MOSTLY_IQ3_S,
    "IQ2_XXS": LlamaFileType.MOSTLY_IQ2_XXS, "IQ2_XS": LlamaFileType.MOSTLY_IQ2_XS, "IQ2_S": LlamaFileType.MOSTLY_IQ2_S,
    "IQ1_S": LlamaFileType.MOSTLY_IQ1_S, "IQ1_M": LlamaFileType.MOSTLY_IQ1_M, "MXFP4": LlamaFileType.MOSTLY_MXFP4_MOE,
    **{name: ftype for name, (ftype, _) in MIXES.items()},
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
              else _llama_mix(specs, spec, recipe) if recipe in MIXES
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


# llama-quant.cpp's `tensor_type_fallback`: a type whose block does not divide a row's length
_FALLBACK = {**{t: gt.IQ4_NL for t in (gt.IQ1_S, gt.IQ1_M, gt.IQ2_XXS, gt.IQ2_XS, gt.IQ2_S, gt.IQ3_XXS, gt.IQ3_S,
                                       gt.IQ4_XS)},
             gt.Q2_K: gt.Q4_0, gt.Q3_K: gt.Q4_0, gt.Q4_K: gt.Q5_0, gt.Q5_K: gt.Q5_1, gt.Q6_K: gt.Q8_0}


def _fallback(s: TensorSpec, t: GGMLType) -> GGMLType:
    if s.ne[0] % t.block_elems == 0:
        return t
    t = _FALLBACK.get(t, t)
    return t if s.ne[0] % t.block_elems == 0 else gt.F16


def _llama_mix(specs: list[TensorSpec], spec: SynthSpec, recipe: str) -> list[GGMLType]:
    """llama-quant.cpp's choices for the `MIXES` ftypes (no imatrix), tensor by tensor in file order.

    Categories by name as llama.cpp's `tensor_get_category` finds them; attn_v and the GDN
    attn_qkv are both "attn_v-like" and share the counter i_attention_wv (as in `_q4_k_m`);
    ffn_down's layer is the block index (from the name in MoE files, the counter in dense ones;
    n counts all blocks, MTP included, as in `_q4_k_m`). n_gqa = n_head / n_head_kv.
    """
    ftype, base = MIXES[recipe]
    F = LlamaFileType
    n_gqa = spec.n_head // max(1, spec.n_head_kv)
    eight_experts = spec.n_expert == 8
    n = spec.n_layer_all
    moe = spec.arch != "qwen35"
    i_wv = i_down = 0
    out = []
    for s in specs:
        name = s.name
        t = base
        if _keeps_f32(s):
            out.append(gt.F32)
            continue
        if name == "output.weight" or (spec.tied_output and name == "token_embd.weight"):
            t = gt.Q8_0 if ftype == F.MOSTLY_MXFP4_MOE or s.ne[0] % base.block_elems else gt.Q6_K
        elif ftype == F.MOSTLY_MXFP4_MOE:
            t = gt.MXFP4 if len(s.ne) > 2 and s.ne[2] > 1 else gt.Q8_0     # experts MXFP4, the rest Q8_0
        elif name == "token_embd.weight":
            t = base
        elif "attn_v.weight" in name or "attn_qkv.weight" in name:
            if ftype == F.MOSTLY_Q2_K:
                t = gt.Q4_K if n_gqa >= 4 else gt.Q3_K
            elif ftype == F.MOSTLY_IQ3_M:
                t = gt.Q4_K
            elif ftype == F.MOSTLY_Q3_K_M:
                t = gt.Q5_K if i_wv < 2 else gt.Q4_K
            elif ftype == F.MOSTLY_Q3_K_L:
                t = gt.Q5_K
            elif ftype == F.MOSTLY_IQ4_XS and n_gqa >= 4:
                t = gt.Q5_K
            elif ftype == F.MOSTLY_Q4_K_S and i_wv < 4:
                t = gt.Q5_K
            if eight_experts:
                t = gt.Q8_0
            i_wv += 1
        elif "attn_k.weight" in name:
            if eight_experts:
                t = gt.Q8_0
        elif "ffn_down" in name:
            layer = _layer_of(name) if moe else i_down
            if ftype == F.MOSTLY_Q2_K:
                t = gt.Q3_K
            elif ftype == F.MOSTLY_Q3_K_M:
                t = gt.Q5_K if layer < n // 16 else gt.Q4_K
            elif ftype == F.MOSTLY_IQ3_M and (layer < n // 8 or (eight_experts and use_more_bits(layer, n))):
                t = gt.Q4_K
            elif ftype == F.MOSTLY_Q3_K_L:
                t = gt.Q5_K
            elif ftype in (F.MOSTLY_IQ4_XS, F.MOSTLY_Q4_K_S) and layer < n // 8:
                t = gt.Q5_K
            i_down += 1
        elif "attn_output.weight" in name:
            if eight_experts:
                if ftype != F.MOSTLY_Q3_K_L:
                    t = gt.Q5_K
            elif ftype == F.MOSTLY_Q2_K:
                t = gt.Q3_K
            elif ftype in (F.MOSTLY_Q3_K_M, F.MOSTLY_IQ3_M):
                t = gt.Q4_K
            elif ftype == F.MOSTLY_Q3_K_L:
                t = gt.Q5_K
        out.append(_fallback(s, t))
    return out
