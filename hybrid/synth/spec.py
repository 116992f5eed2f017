"""What a synthetic model looks like: architecture, every dimension, MTP, layout variant.

A `SynthSpec` turns into the same `ModelConfig` the reader builds from a real file, so the
writer and the reader agree on the layout through one function (`hybrid.layout.expected_tensors`).
Presets copy the released models' dims (docs/MODEL_FORMAT.md §1.2) or pick tiny dims that
every ggml type can hold: all matrix row lengths are multiples of 256, the K-quant block.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass

from ..config import ARCHITECTURES, ATTN, GDN, ModelConfig
from ..errors import HybridError
from ..layout import LayoutOptions


@dataclass(frozen=True)
class SynthSpec:
    arch: str
    n_layer: int                  # trunk layers (the MTP block comes on top)
    n_embd: int
    n_vocab: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    ssm_conv_kernel: int
    ssm_d_state: int              # d_k = d_v
    ssm_n_k_heads: int
    ssm_n_v_heads: int
    n_ff: int = 0                 # dense FFN width (qwen35)
    n_expert: int = 0             # MoE (qwen35moe, qwen3next)
    n_expert_used: int = 0
    n_ff_exp: int = 0
    n_ff_shexp: int = 0
    full_attention_interval: int = 4
    rope_theta: float = 1e7
    rms_eps: float = 1e-6
    context_length: int = 262144
    rope_sections: tuple[int, ...] | None = None   # None: the converter's default split of n_rot/2
    mtp: bool = True
    tied_output: bool = False
    fused_gate_up_exps: bool = False
    legacy_ssm_in: bool = False   # qwen3next only
    write_recurrent_layers: bool = False   # also write the optional per-block bool array
    name: str = "synthetic"

    # --- derived -------------------------------------------------------------------------
    @property
    def ssm_d_inner(self) -> int:
        return self.ssm_n_v_heads * self.ssm_d_state

    @property
    def n_layer_all(self) -> int:
        return self.n_layer + (1 if self.mtp else 0)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        k = self.full_attention_interval
        return tuple(ATTN if (i + 1) % k == 0 else GDN for i in range(self.n_layer))

    @property
    def sections(self) -> tuple[int, ...]:
        """M-RoPE sections [t, h, w, e]; the default splits n_rot/2 as 11/11/10 does 32."""
        if self.rope_sections is not None:
            return tuple(self.rope_sections)
        s = self.n_rot // 2
        return ((s + 2) // 3, (s + 1) // 3, s // 3, 0)

    def layout_options(self) -> LayoutOptions:
        return LayoutOptions(fused_gate_up_exps=self.fused_gate_up_exps, legacy_ssm_in=self.legacy_ssm_in)

    def config(self) -> ModelConfig:
        self.validate()
        moe = self.arch != "qwen35"
        return ModelConfig(
            arch=self.arch, n_layer=self.n_layer, n_nextn=1 if self.mtp else 0,
            n_embd=self.n_embd, n_vocab=self.n_vocab, n_head=self.n_head, n_head_kv=self.n_head_kv,
            head_dim=self.head_dim, n_rot=self.n_rot,
            # the file stores these as f32: give the values a reader will see
            rope_theta=_f32(self.rope_theta), rms_eps=_f32(self.rms_eps),
            context_length=self.context_length, layer_kinds=self.layer_kinds,
            ssm_conv_kernel=self.ssm_conv_kernel, ssm_d_state=self.ssm_d_state,
            ssm_n_k_heads=self.ssm_n_k_heads, ssm_n_v_heads=self.ssm_n_v_heads,
            ssm_d_inner=self.ssm_d_inner,
            n_ff=0 if moe else self.n_ff, n_expert=self.n_expert if moe else 0,
            n_expert_used=self.n_expert_used if moe else 0, n_ff_exp=self.n_ff_exp if moe else 0,
            n_ff_shexp=self.n_ff_shexp if moe else 0, tied_output=self.tied_output,
            rope_sections=self.sections if self.arch != "qwen3next" else (),
        )

    def validate(self) -> None:
        """Refuse specs llama.cpp could not load, with the reason in one line."""
        def bad(msg: str) -> None:
            raise HybridError(f"bad {self.arch} model spec: {msg}")

        if self.arch not in ARCHITECTURES:
            bad(f"unknown architecture; choose one of {', '.join(ARCHITECTURES)}")
        positive = ("n_layer", "n_embd", "n_vocab", "n_head", "n_head_kv", "head_dim", "n_rot",
                    "ssm_conv_kernel", "ssm_d_state", "ssm_n_k_heads", "ssm_n_v_heads",
                    "full_attention_interval", "context_length")
        for f in positive:
            if getattr(self, f) < 1:
                bad(f"{f} must be ≥ 1 (got {getattr(self, f)})")
        if self.n_head % self.n_head_kv:
            bad(f"n_head {self.n_head} is not a multiple of n_head_kv {self.n_head_kv}")
        if self.n_rot % 2 or self.n_rot > self.head_dim:
            bad(f"n_rot {self.n_rot} must be even and ≤ head_dim {self.head_dim}")
        if self.ssm_n_v_heads % self.ssm_n_k_heads:
            bad(f"ssm_n_v_heads {self.ssm_n_v_heads} is not a multiple of ssm_n_k_heads {self.ssm_n_k_heads}")
        if self.arch == "qwen35":
            if self.n_ff < 1:
                bad("a dense qwen35 model needs n_ff ≥ 1")
        elif not (self.n_expert >= 1 and 1 <= self.n_expert_used <= self.n_expert and self.n_ff_exp >= 1):
            bad(f"MoE needs n_expert ≥ 1, 1 ≤ n_expert_used ≤ n_expert and n_ff_exp ≥ 1 "
                f"(got {self.n_expert}, {self.n_expert_used}, {self.n_ff_exp})")
        if self.legacy_ssm_in and self.arch != "qwen3next":
            bad("legacy_ssm_in exists only for qwen3next")
        if self.arch != "qwen3next" and sum(self.sections) != self.n_rot // 2:
            bad(f"rope sections {list(self.sections)} must sum to n_rot/2 = {self.n_rot // 2}")


def _f32(v: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", v))[0])


# --- presets -----------------------------------------------------------------------------------

# Tiny: 4 trunk layers (3 GDN + 1 attention) + MTP; H_v ≠ H_k so the V-head order matters;
# every row length (256, 512) is a multiple of 256, so all eight types fit.
_TINY = dict(n_layer=4, n_embd=256, n_vocab=384, n_head=4, n_head_kv=2, head_dim=64, n_rot=16,
             ssm_conv_kernel=4, ssm_d_state=64, ssm_n_k_heads=2, ssm_n_v_heads=4,
             context_length=4096, name="tiny")
_TINY_MOE = dict(_TINY, n_expert=4, n_expert_used=2, n_ff_exp=256, n_ff_shexp=256)

# Qwen3.5-0.8B-like: the smallest real shape, for CPU benchmarks.
_SMALL = dict(n_layer=24, n_embd=1024, n_vocab=248320, n_head=8, n_head_kv=2, head_dim=256, n_rot=64,
              ssm_conv_kernel=4, ssm_d_state=128, ssm_n_k_heads=16, ssm_n_v_heads=16, name="small")
_BIG_ATTN = dict(head_dim=256, n_rot=64, ssm_conv_kernel=4, ssm_d_state=128, ssm_n_k_heads=16)

_PRESETS: dict[tuple[str, str], dict] = {
    ("tiny", "qwen35"): dict(_TINY, n_ff=512),
    ("tiny", "qwen35moe"): _TINY_MOE,
    ("tiny", "qwen3next"): _TINY_MOE,
    ("small", "qwen35"): dict(_SMALL, n_ff=3584, tied_output=True),
    ("small", "qwen35moe"): dict(_SMALL, n_expert=64, n_expert_used=8, n_ff_exp=512, n_ff_shexp=512),
    ("27b", "qwen35"): dict(_BIG_ATTN, n_layer=64, n_embd=5120, n_ff=17408, n_head=24, n_head_kv=4,
                            ssm_n_v_heads=48, n_vocab=248320, name="Qwen3.6-27B-synthetic"),
    ("35b-a3b", "qwen35moe"): dict(_BIG_ATTN, n_layer=40, n_embd=2048, n_head=16, n_head_kv=2,
                                   ssm_n_v_heads=32, n_vocab=248320, n_expert=256, n_expert_used=8,
                                   n_ff_exp=512, n_ff_shexp=512, name="Qwen3.6-35B-A3B-synthetic"),
    ("80b-a3b", "qwen3next"): dict(_BIG_ATTN, n_layer=48, n_embd=2048, n_head=16, n_head_kv=2,
                                   ssm_n_v_heads=32, n_vocab=151936, n_expert=512, n_expert_used=10,
                                   n_ff_exp=512, n_ff_shexp=512, mtp=False,
                                   name="Qwen3-Next-80B-A3B-synthetic"),
}
PRESET_NAMES = tuple(dict.fromkeys(name for name, _ in _PRESETS))
SPEC_FIELDS = tuple(f.name for f in dataclasses.fields(SynthSpec))


def preset(name: str, arch: str | None = None, **overrides) -> SynthSpec:
    """A named shape, optionally for a given arch, with any field overridden.

    `arch=None` takes the preset's only (or first) architecture: tiny → qwen35.
    """
    archs = [a for (n, a) in _PRESETS if n == name]
    if not archs:
        raise HybridError(f"unknown preset {name!r}; choose one of {', '.join(PRESET_NAMES)}")
    arch = arch or archs[0]
    if (name, arch) not in _PRESETS:
        raise HybridError(f"preset {name!r} exists for {', '.join(archs)}, not for {arch!r}")
    unknown = set(overrides) - (set(SPEC_FIELDS) - {"arch"})
    if unknown:
        raise HybridError(f"unknown spec field(s) {', '.join(sorted(unknown))}; "
                          f"fields are: {', '.join(SPEC_FIELDS)}")
    spec = SynthSpec(arch=arch, **{**_PRESETS[(name, arch)], **overrides})
    spec.validate()
    return spec
