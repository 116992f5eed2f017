"""Which tensors a model of a given config has, with their ggml shapes (`ne`, fastest first).

This is llama.cpp's layout (docs/MODEL_FORMAT.md §2): the reader checks a file against it,
the synthetic writer writes exactly it. Roles group bytes for `hybrid info` and placement:
embeddings, lm_head, trunk (attention / GDN / norms), ffn (dense or MoE, router included), mtp.
"""
from __future__ import annotations

from dataclasses import dataclass

from .config import ModelConfig

ROLES = ("embeddings", "lm_head", "trunk", "ffn", "mtp")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    ne: tuple[int, ...]
    role: str
    required: bool = True
    f32_only: bool = False   # kept F32 by the converter and the quantiser (norms, conv, ssm_a, dt bias, router)


@dataclass(frozen=True)
class LayoutOptions:
    """Variants llama.cpp accepts for the same model."""
    fused_gate_up_exps: bool = False   # MoE: ffn_gate_up_exps instead of ffn_gate_exps + ffn_up_exps
    legacy_ssm_in: bool = False        # qwen3next: raw ssm_in instead of attn_qkv + attn_gate


def options_from_names(names: set[str]) -> LayoutOptions:
    """Detect which variant a file uses from the tensor names it holds."""
    return LayoutOptions(
        fused_gate_up_exps=any(n.endswith(".ffn_gate_up_exps.weight") for n in names),
        legacy_ssm_in=any(n.endswith(".ssm_in.weight") for n in names),
    )


def expected_tensors(c: ModelConfig, opts: LayoutOptions = LayoutOptions()) -> list[TensorSpec]:
    D = c.n_embd
    specs = [TensorSpec("token_embd.weight", (D, c.n_vocab), "embeddings"),
             TensorSpec("output_norm.weight", (D,), "trunk", f32_only=True)]
    if not c.tied_output:
        specs.append(TensorSpec("output.weight", (D, c.n_vocab), "lm_head"))
    for i in range(c.n_layer):
        specs += _gdn(c, i, opts) if c.is_recurrent(i) else _attention(c, i, "trunk")
        specs += _ffn(c, i, "ffn", opts)
    for i in range(c.n_layer, c.n_layer_all):
        specs += _attention(c, i, "mtp") + _ffn(c, i, "mtp", opts) + _nextn(c, i)
    return specs


def _norm(name: str, n: int, role: str) -> TensorSpec:
    return TensorSpec(name, (n,), role, f32_only=True)


def _attention(c: ModelConfig, i: int, role: str) -> list[TensorSpec]:
    D, dh, p = c.n_embd, c.head_dim, f"blk.{i}."
    return [
        _norm(p + "attn_norm.weight", D, role),
        TensorSpec(p + "attn_q.weight", (D, 2 * c.n_head * dh), role),   # [query | gate] per head
        TensorSpec(p + "attn_k.weight", (D, c.n_head_kv * dh), role),
        TensorSpec(p + "attn_v.weight", (D, c.n_head_kv * dh), role),
        TensorSpec(p + "attn_output.weight", (c.n_head * dh, D), role),
        _norm(p + "attn_q_norm.weight", dh, role),
        _norm(p + "attn_k_norm.weight", dh, role),
        _norm(p + "post_attention_norm.weight", D, role),
    ]


def _gdn(c: ModelConfig, i: int, opts: LayoutOptions) -> list[TensorSpec]:
    D, Hv, p = c.n_embd, c.ssm_n_v_heads, f"blk.{i}."
    specs = [_norm(p + "attn_norm.weight", D, "trunk")]
    if c.arch == "qwen3next" and opts.legacy_ssm_in:
        specs.append(TensorSpec(p + "ssm_in.weight", (D, 2 * c.ssm_key_dim + 2 * c.ssm_d_inner), "trunk"))
    else:
        specs += [TensorSpec(p + "attn_qkv.weight", (D, c.ssm_conv_channels), "trunk"),
                  TensorSpec(p + "attn_gate.weight", (D, c.ssm_d_inner), "trunk")]
    if c.arch == "qwen3next":
        specs.append(TensorSpec(p + "ssm_ba.weight", (D, 2 * Hv), "trunk"))
    else:
        specs += [TensorSpec(p + "ssm_beta.weight", (D, Hv), "trunk"),
                  TensorSpec(p + "ssm_alpha.weight", (D, Hv), "trunk")]
    specs += [
        TensorSpec(p + "ssm_conv1d.weight", (c.ssm_conv_kernel, c.ssm_conv_channels), "trunk", f32_only=True),
        TensorSpec(p + "ssm_dt.bias", (Hv,), "trunk", f32_only=True),
        TensorSpec(p + "ssm_a", (Hv,), "trunk", f32_only=True),
        _norm(p + "ssm_norm.weight", c.ssm_d_state, "trunk"),
        TensorSpec(p + "ssm_out.weight", (c.ssm_d_inner, D), "trunk"),
        _norm(p + "post_attention_norm.weight", D, "trunk"),
    ]
    return specs


def _ffn(c: ModelConfig, i: int, role: str, opts: LayoutOptions) -> list[TensorSpec]:
    D, p = c.n_embd, f"blk.{i}."
    if not c.is_moe:
        return [TensorSpec(p + "ffn_gate.weight", (D, c.n_ff), role),
                TensorSpec(p + "ffn_up.weight", (D, c.n_ff), role),
                TensorSpec(p + "ffn_down.weight", (c.n_ff, D), role)]
    E, F = c.n_expert, c.n_ff_exp
    specs = [TensorSpec(p + "ffn_gate_inp.weight", (D, E), role, f32_only=True)]
    if opts.fused_gate_up_exps:
        specs.append(TensorSpec(p + "ffn_gate_up_exps.weight", (D, 2 * F, E), role))
    else:
        specs += [TensorSpec(p + "ffn_gate_exps.weight", (D, F, E), role),
                  TensorSpec(p + "ffn_up_exps.weight", (D, F, E), role)]
    specs.append(TensorSpec(p + "ffn_down_exps.weight", (F, D, E), role))
    if c.n_ff_shexp:
        S = c.n_ff_shexp
        specs += [_norm(p + "ffn_gate_inp_shexp.weight", D, role),
                  TensorSpec(p + "ffn_gate_shexp.weight", (D, S), role),
                  TensorSpec(p + "ffn_up_shexp.weight", (D, S), role),
                  TensorSpec(p + "ffn_down_shexp.weight", (S, D), role)]
    return specs


def _nextn(c: ModelConfig, i: int) -> list[TensorSpec]:
    D, p = c.n_embd, f"blk.{i}.nextn."
    return [
        TensorSpec(p + "eh_proj.weight", (2 * D, D), "mtp"),      # input: [enorm(emb) ; hnorm(h)]
        _norm(p + "enorm.weight", D, "mtp"),
        _norm(p + "hnorm.weight", D, "mtp"),
        TensorSpec(p + "shared_head_norm.weight", (D,), "mtp", required=False, f32_only=True),
        TensorSpec(p + "embed_tokens.weight", (D, c.n_vocab), "mtp", required=False),
        TensorSpec(p + "shared_head_head.weight", (D, c.n_vocab), "mtp", required=False),
    ]
