"""Config parsing (MODEL_FORMAT.md §1.2) and the tensor layout (§2) for all three architectures.

Oracles: the metadata values of released models as the doc lists them, and tensor names and
shapes written out by hand from the doc's tables (not derived from hybrid.layout).
"""
from __future__ import annotations

import pytest

from hybrid.config import ATTN, GDN, config_from_metadata
from hybrid.errors import ModelError
from hybrid.layout import LayoutOptions, expected_tensors, options_from_names

from .ggufs import tiny_metadata

G, A = GDN, ATTN


def qwen36_27b() -> dict:
    a = "qwen35."
    return {
        "general.architecture": "qwen35", a + "block_count": 65, a + "nextn_predict_layers": 1,
        a + "context_length": 262144, a + "embedding_length": 5120, a + "feed_forward_length": 17408,
        a + "attention.head_count": 24, a + "attention.head_count_kv": 4,
        a + "attention.key_length": 256, a + "attention.value_length": 256,
        a + "attention.layer_norm_rms_epsilon": 1e-6, a + "rope.dimension_count": 64,
        a + "rope.freq_base": 1e7, a + "rope.dimension_sections": [11, 11, 10, 0],
        a + "ssm.conv_kernel": 4, a + "ssm.state_size": 128, a + "ssm.group_count": 16,
        a + "ssm.time_step_rank": 48, a + "ssm.inner_size": 6144, a + "full_attention_interval": 4,
        "general.file_type": 15, "general.quantization_version": 2,
    }


def qwen36_35b_a3b() -> dict:
    a = "qwen35moe."
    return {
        "general.architecture": "qwen35moe", a + "block_count": 41, a + "nextn_predict_layers": 1,
        a + "context_length": 262144, a + "embedding_length": 2048,
        a + "attention.head_count": 16, a + "attention.head_count_kv": 2,
        a + "attention.key_length": 256, a + "attention.value_length": 256,
        a + "attention.layer_norm_rms_epsilon": 1e-6, a + "rope.dimension_count": 64,
        a + "rope.freq_base": 1e7, a + "rope.dimension_sections": [11, 11, 10, 0],
        a + "ssm.conv_kernel": 4, a + "ssm.state_size": 128, a + "ssm.group_count": 16,
        a + "ssm.time_step_rank": 32, a + "ssm.inner_size": 4096, a + "full_attention_interval": 4,
        a + "expert_count": 256, a + "expert_used_count": 8,
        a + "expert_feed_forward_length": 512, a + "expert_shared_feed_forward_length": 384,
    }


def qwen3next_80b() -> dict:
    # An older qwen3next file: no full_attention_interval (default 4), no MTP, no rope sections.
    a = "qwen3next."
    return {
        "general.architecture": "qwen3next", a + "block_count": 48,
        a + "context_length": 262144, a + "embedding_length": 2048, a + "feed_forward_length": 5120,
        a + "attention.head_count": 16, a + "attention.head_count_kv": 2,
        a + "attention.key_length": 256, a + "attention.value_length": 256,
        a + "attention.layer_norm_rms_epsilon": 1e-6, a + "rope.dimension_count": 64,
        a + "rope.freq_base": 1e7, a + "ssm.conv_kernel": 4, a + "ssm.state_size": 128,
        a + "ssm.group_count": 16, a + "ssm.time_step_rank": 32, a + "ssm.inner_size": 4096,
        a + "expert_count": 512, a + "expert_used_count": 10,
        a + "expert_feed_forward_length": 512, a + "expert_shared_feed_forward_length": 512,
    }


# --- §1.2 keys ----------------------------------------------------------------------------------

def test_qwen35_dense_27b_every_key():
    c = config_from_metadata(qwen36_27b(), n_vocab=248320, tied_output=False)
    assert (c.arch, c.n_layer, c.n_nextn, c.n_layer_all) == ("qwen35", 64, 1, 65)
    assert (c.context_length, c.n_embd, c.n_ff, c.n_vocab) == (262144, 5120, 17408, 248320)
    assert (c.n_head, c.n_head_kv, c.head_dim, c.n_rot) == (24, 4, 256, 64)
    assert c.rms_eps == pytest.approx(1e-6) and c.rope_theta == 1e7
    assert c.rope_sections == (11, 11, 10, 0)
    assert (c.ssm_conv_kernel, c.ssm_d_state, c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_d_inner) == (4, 128, 16, 48, 6144)
    assert c.ssm_conv_channels == 2 * 16 * 128 + 6144
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp, c.is_moe) == (0, 0, 0, 0, False)
    assert not c.tied_output and c.gdn_head_pairing == "tiled"
    assert c.layer_kinds == (G, G, G, A) * 16


def test_qwen35moe_35b_a3b_every_key():
    c = config_from_metadata(qwen36_35b_a3b(), n_vocab=248320, tied_output=True)
    assert (c.arch, c.n_layer, c.n_nextn) == ("qwen35moe", 40, 1)
    assert (c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_rot) == (2048, 16, 2, 256, 64)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp, c.is_moe) == (256, 8, 512, 384, True)
    assert c.n_ff == 0   # MoE files need no dense width
    assert (c.ssm_n_k_heads, c.ssm_n_v_heads, c.ssm_d_inner) == (16, 32, 4096)
    assert c.tied_output and c.rope_sections == (11, 11, 10, 0)
    assert len(c.layer_kinds) == 40 and c.layer_kinds.count(A) == 10


def test_qwen3next_defaults_interval_and_no_mtp():
    c = config_from_metadata(qwen3next_80b(), n_vocab=151936, tied_output=False)
    assert (c.arch, c.n_layer, c.n_nextn, c.n_ff) == ("qwen3next", 48, 0, 5120)
    assert (c.n_expert, c.n_expert_used, c.n_ff_exp, c.n_ff_shexp) == (512, 10, 512, 512)
    assert c.layer_kinds == (G, G, G, A) * 12   # default interval 4
    assert c.rope_sections == () and c.gdn_head_pairing == "grouped"


def test_optional_keys_default():
    kv = tiny_metadata("qwen35", **{"rope.dimension_count": None, "rope.freq_base": None,
                                    "context_length": None, "attention.value_length": None})
    c = config_from_metadata(kv, n_vocab=128, tied_output=False)
    assert (c.n_rot, c.rope_theta, c.context_length) == (32, 10000.0, 4096)


@pytest.mark.parametrize("interval, kinds", [(4, (G, G, G, A, G, G, G, A)), (2, (G, A) * 4), (1, (A,) * 8)])
def test_interval_rule(interval, kinds):
    kv = tiny_metadata("qwen35", n_layer=8, full_attention_interval=interval)
    assert config_from_metadata(kv, n_vocab=128, tied_output=False).layer_kinds == kinds


def test_recurrent_layers_override_interval_and_exclude_mtp():
    # The explicit flags disagree with the interval rule on purpose; the MTP flag (last) is dropped.
    flags = [True, False, False, True, True, False]
    kv = tiny_metadata("qwen35moe", n_layer=5, **{"attention.recurrent_layers": flags})
    c = config_from_metadata(kv, n_vocab=128, tied_output=False)
    assert c.layer_kinds == (G, A, A, G, G)
    assert [c.is_recurrent(i) for i in range(c.n_layer_all)] == [True, False, False, True, True, False]


def test_trained_model_pattern_from_readme():
    kv = tiny_metadata("qwen35", n_layer=8,
                       **{"attention.recurrent_layers": [True, True, True, False, True, True, True, False, False]})
    c = config_from_metadata(kv, n_vocab=128, tied_output=False)
    assert c.layer_kinds == (G, G, G, A, G, G, G, A) and c.n_layer == 8 and not c.is_recurrent(8)


@pytest.mark.parametrize("change, message", [
    ({"ssm.state_size": None}, "'qwen35.ssm.state_size' is missing"),
    ({"nextn_predict_layers": 2}, "only 0 or 1 MTP block"),
    ({"attention.recurrent_layers": [True, False]}, "has 2 entries; expected 5"),
    ({"attention.value_length": 64}, "differ"),
    ({"ssm.inner_size": 48}, "inner_size 48"),
    ({"embedding_length": "wide"}, "is a string .wide.; expected an integer"),
])
def test_bad_metadata(change, message):
    with pytest.raises(ModelError, match=message):
        config_from_metadata(tiny_metadata("qwen35", **change), n_vocab=128, tied_output=False)


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ModelError, match="unsupported architecture 'llama'.*qwen35, qwen35moe, qwen3next"):
        config_from_metadata({"general.architecture": "llama"}, n_vocab=1, tied_output=False)


# --- §2 layout -----------------------------------------------------------------------------------

def layout(arch, options=LayoutOptions(), tied=False, **meta):
    c = config_from_metadata(tiny_metadata(arch, **meta), n_vocab=128, tied_output=tied)
    return {s.name: s for s in expected_tensors(c, options)}


ATTN_TENSORS = {  # tiny config: D=64, 2 heads, 1 KV head, head dim 32
    "attn_norm.weight": (64,), "attn_q.weight": (64, 128), "attn_k.weight": (64, 32),
    "attn_v.weight": (64, 32), "attn_output.weight": (64, 64), "attn_q_norm.weight": (32,),
    "attn_k_norm.weight": (32,), "post_attention_norm.weight": (64,),
}
GDN_COMMON = {  # H_k=2, H_v=4, d_k=d_v=16, inner 64, conv kernel 4 → conv channels 2·32+64 = 128
    "attn_norm.weight": (64,), "ssm_conv1d.weight": (4, 128), "ssm_dt.bias": (4,), "ssm_a": (4,),
    "ssm_norm.weight": (16,), "ssm_out.weight": (64, 64), "post_attention_norm.weight": (64,),
}
GDN_QWEN35 = {**GDN_COMMON, "attn_qkv.weight": (64, 128), "attn_gate.weight": (64, 64),
              "ssm_beta.weight": (64, 4), "ssm_alpha.weight": (64, 4)}
DENSE_FFN = {"ffn_gate.weight": (64, 96), "ffn_up.weight": (64, 96), "ffn_down.weight": (96, 64)}
MOE_FFN = {  # 4 experts of width 32, shared expert 32
    "ffn_gate_inp.weight": (64, 4), "ffn_gate_exps.weight": (64, 32, 4), "ffn_up_exps.weight": (64, 32, 4),
    "ffn_down_exps.weight": (32, 64, 4), "ffn_gate_inp_shexp.weight": (64,),
    "ffn_gate_shexp.weight": (64, 32), "ffn_up_shexp.weight": (64, 32), "ffn_down_shexp.weight": (32, 64),
}
NEXTN = {"nextn.eh_proj.weight": (128, 64), "nextn.enorm.weight": (64,), "nextn.hnorm.weight": (64,)}
NEXTN_OPTIONAL = {"nextn.shared_head_norm.weight": (64,), "nextn.embed_tokens.weight": (64, 128),
                  "nextn.shared_head_head.weight": (64, 128)}
TOP = {"token_embd.weight": (64, 128), "output_norm.weight": (64,), "output.weight": (64, 128)}


def expected(top, blocks):
    out = dict(top)
    for i, tensors in enumerate(blocks):
        out.update({f"blk.{i}.{n}": ne for n, ne in tensors.items()})
    return out


def shapes(specs, required=True):
    return {n: s.ne for n, s in specs.items() if s.required == required}


def test_layout_qwen35_dense_with_mtp():
    specs = layout("qwen35")
    gdn, attn = {**GDN_QWEN35, **DENSE_FFN}, {**ATTN_TENSORS, **DENSE_FFN}
    assert shapes(specs) == expected(TOP, [gdn, gdn, gdn, attn, {**attn, **NEXTN}])
    assert shapes(specs, required=False) == {f"blk.4.{n}": ne for n, ne in NEXTN_OPTIONAL.items()}
    roles = {n: s.role for n, s in specs.items()}
    assert roles["token_embd.weight"] == "embeddings" and roles["output.weight"] == "lm_head"
    assert roles["blk.0.attn_qkv.weight"] == "trunk" and roles["blk.3.attn_q.weight"] == "trunk"
    assert roles["blk.0.ffn_up.weight"] == "ffn" and roles["blk.4.ffn_up.weight"] == "mtp"
    assert roles["blk.4.attn_q.weight"] == "mtp" and roles["blk.4.nextn.eh_proj.weight"] == "mtp"


def test_layout_f32_only_tensors():
    specs = layout("qwen35moe")
    f32 = {n.split(".", 2)[-1] for n, s in specs.items() if s.f32_only and n.startswith("blk.0.")}
    assert f32 == {"attn_norm.weight", "ssm_conv1d.weight", "ssm_dt.bias", "ssm_a", "ssm_norm.weight",
                   "post_attention_norm.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight"}
    assert specs["output_norm.weight"].f32_only and not specs["blk.0.attn_qkv.weight"].f32_only


def test_layout_qwen35moe():
    specs = layout("qwen35moe")
    gdn, attn = {**GDN_QWEN35, **MOE_FFN}, {**ATTN_TENSORS, **MOE_FFN}
    assert shapes(specs) == expected(TOP, [gdn, gdn, gdn, attn, {**attn, **NEXTN}])


def test_layout_moe_without_shared_expert():
    specs = layout("qwen35moe", expert_shared_feed_forward_length=None)
    assert not any("shexp" in n for n in specs) and "blk.0.ffn_gate_exps.weight" in specs


def test_layout_fused_gate_up_exps():
    specs = layout("qwen35moe", LayoutOptions(fused_gate_up_exps=True))
    assert specs["blk.0.ffn_gate_up_exps.weight"].ne == (64, 64, 4)
    assert "blk.0.ffn_gate_exps.weight" not in specs and "blk.0.ffn_up_exps.weight" not in specs


def test_layout_qwen3next():
    specs = layout("qwen3next", n_nextn=0)
    gdn = {**GDN_COMMON, "attn_qkv.weight": (64, 128), "attn_gate.weight": (64, 64),
           "ssm_ba.weight": (64, 8), **MOE_FFN}
    attn = {**ATTN_TENSORS, **MOE_FFN}
    assert shapes(specs) == expected(TOP, [gdn, gdn, gdn, attn])


def test_layout_qwen3next_legacy_ssm_in():
    specs = layout("qwen3next", LayoutOptions(legacy_ssm_in=True), n_nextn=0)
    assert specs["blk.0.ssm_in.weight"].ne == (64, 2 * 32 + 2 * 64)   # raw in_proj_qkvz
    assert specs["blk.0.ssm_ba.weight"].ne == (64, 8)
    assert "blk.0.attn_qkv.weight" not in specs and "blk.0.attn_gate.weight" not in specs
    assert "blk.3.attn_q.weight" in specs   # attention layers do not change


def test_layout_tied_output():
    specs = layout("qwen35", tied=True)
    assert "output.weight" not in specs and specs["token_embd.weight"].ne == (64, 128)


def test_options_from_names():
    assert options_from_names({"blk.0.ffn_gate_up_exps.weight"}) == LayoutOptions(fused_gate_up_exps=True)
    assert options_from_names({"blk.0.ssm_in.weight"}) == LayoutOptions(legacy_ssm_in=True)
    assert options_from_names({"blk.0.attn_qkv.weight"}) == LayoutOptions()
