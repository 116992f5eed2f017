"""Type assignment and the byte plan: llama.cpp's Q4_K_M choices, uniform types, the 27B plan."""
import gguf
import pytest

from hybrid.errors import HybridError
from hybrid.synth import plan_model, preset
from hybrid.synth.spec import PRESET_NAMES

# The bundled trained model's shape (hybrid/data/README.md); its Q4_K_M file was made by
# llama.cpp's own quantizer, so it is the oracle for the Q4_K_M rule.
TRAINED_SHAPE = dict(n_layer=8, n_embd=512, n_ff=1024, n_vocab=8192, n_head=8, n_head_kv=2, head_dim=64,
                     n_rot=16, ssm_n_k_heads=4, ssm_n_v_heads=8, ssm_d_state=64)


def file_tensors(path):
    r = gguf.GGUFReader(path)
    return {t.name: (tuple(int(x) for x in t.shape), t.tensor_type.name) for t in r.tensors}


def test_q4_k_m_plan_equals_the_llama_cpp_quantized_trained_model(trained_model_q4km):
    ours = {t.name: (t.ne, t.type.name) for t in plan_model(preset("tiny", **TRAINED_SHAPE), "Q4_K_M")}
    assert ours == file_tensors(trained_model_q4km)


def test_uniform_q8_0_plan_equals_the_converter_written_trained_model(trained_model_q8):
    ours = {t.name: (t.ne, t.type.name) for t in plan_model(preset("tiny", **TRAINED_SHAPE), "Q8_0")}
    assert ours == file_tensors(trained_model_q8)


@pytest.mark.parametrize("recipe", ["F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"])
def test_uniform_recipe_types_every_matrix_and_keeps_f32_tensors(recipe):
    plan = plan_model(preset("tiny", arch="qwen35moe"), recipe)
    for t in plan:
        f32_only = len(t.ne) == 1 or t.name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ssm_a"))
        assert t.type.name == ("F32" if f32_only else recipe), t.name


def test_tied_output_gives_the_embedding_the_output_rule():
    plan = {t.name: t.type.name for t in plan_model(preset("tiny", tied_output=True))}
    assert "output.weight" not in plan
    assert plan["token_embd.weight"] == "Q6_K"


def test_moe_ffn_down_experts_and_shared_follow_more_bits_by_block():
    # 4 trunk blocks + MTP = 5: more-bits blocks are 0 (i < 5//8 = 0 is empty, 7*5//8 = 4 → 4),
    # and (i - 0) % 3 == 2 → 2. So blocks 2 and 4 (the MTP block) get Q6_K.
    plan = {t.name: t.type.name for t in plan_model(preset("tiny", arch="qwen35moe"))}
    for i in range(5):
        want = "Q6_K" if i in (2, 4) else "Q4_K"
        assert plan[f"blk.{i}.ffn_down_exps.weight"] == want
        assert plan[f"blk.{i}.ffn_down_shexp.weight"] == want
        assert plan[f"blk.{i}.ffn_gate_exps.weight"] == "Q4_K"


def test_overrides_place_a_type_by_regex():
    plan = plan_model(preset("tiny"), "Q4_K_M", overrides={r"blk\.1\.ffn_up": "BF16", r"attn_gate": "Q8_0"})
    types = {t.name: t.type.name for t in plan}
    assert types["blk.1.ffn_up.weight"] == "BF16"
    assert types["blk.0.ffn_up.weight"] == "Q4_K"
    assert all(types[f"blk.{i}.attn_gate.weight"] == "Q8_0" for i in (0, 1, 2))


def test_rows_that_do_not_fit_the_block_are_refused_clearly():
    with pytest.raises(HybridError, match="multiples of 256"):
        plan_model(preset("tiny", n_embd=288), "Q4_K_M")
    plan_model(preset("tiny", n_embd=288), "Q8_0")      # 288 = 9 × 32 fits Q8_0
    with pytest.raises(HybridError, match="unknown type recipe"):
        plan_model(preset("tiny"), "Q3_K_XL")


# --- the 27B plan ---------------------------------------------------------------------------

# Qwen3.6-27B: D=5120, n_ff=17408, 24/4 heads × 256, H_k=16, H_v=48, d=128, vocab 248320, 64 + 1 blocks.
# llama.cpp's more-bits blocks for n = 65: i < 8, i ≥ 56, and (i − 8) % 3 == 2.
MORE_BITS_27B = {*range(0, 8), *range(10, 56, 3), *range(56, 65)}
GDN_27B = {
    "attn_norm.weight": ((5120,), "F32"), "attn_qkv.weight": ((5120, 10240), None),
    "attn_gate.weight": ((5120, 6144), "Q4_K"), "ssm_beta.weight": ((5120, 48), "Q4_K"),
    "ssm_alpha.weight": ((5120, 48), "Q4_K"), "ssm_conv1d.weight": ((4, 10240), "F32"),
    "ssm_dt.bias": ((48,), "F32"), "ssm_a": ((48,), "F32"), "ssm_norm.weight": ((128,), "F32"),
    "ssm_out.weight": ((6144, 5120), "Q4_K"), "post_attention_norm.weight": ((5120,), "F32"),
}
ATTN_27B = {
    "attn_norm.weight": ((5120,), "F32"), "attn_q.weight": ((5120, 12288), "Q4_K"),
    "attn_k.weight": ((5120, 1024), "Q4_K"), "attn_v.weight": ((5120, 1024), None),
    "attn_output.weight": ((6144, 5120), "Q4_K"), "attn_q_norm.weight": ((256,), "F32"),
    "attn_k_norm.weight": ((256,), "F32"), "post_attention_norm.weight": ((5120,), "F32"),
}
FFN_27B = {"ffn_gate.weight": ((5120, 17408), "Q4_K"), "ffn_up.weight": ((5120, 17408), "Q4_K"),
           "ffn_down.weight": ((17408, 5120), None)}
NEXTN_27B = {"nextn.eh_proj.weight": ((10240, 5120), "Q4_K"), "nextn.enorm.weight": ((5120,), "F32"),
             "nextn.hnorm.weight": ((5120,), "F32"), "nextn.shared_head_norm.weight": ((5120,), "F32")}


def expected_27b():
    out = {"token_embd.weight": ((5120, 248320), "Q4_K"), "output_norm.weight": ((5120,), "F32"),
           "output.weight": ((5120, 248320), "Q6_K")}
    for i in range(65):
        more = "Q6_K" if i in MORE_BITS_27B else "Q4_K"
        block = dict(ATTN_27B if i == 64 or i % 4 == 3 else GDN_27B, **FFN_27B)
        if i == 64:
            block.update(NEXTN_27B)
        for name, (ne, t) in block.items():
            out[f"blk.{i}.{name}"] = (ne, t or more)
    return out


def test_27b_plan_has_exactly_the_converted_qwen36_27b_q4_k_m_tensors():
    plan = plan_model(preset("27b"), "Q4_K_M")
    assert {t.name: (t.ne, t.type.name) for t in plan} == expected_27b()
    assert plan.type_counts() == {"F32": 360, "Q4_K": 439, "Q6_K": 67}
    assert 16.5e9 < plan.total_bytes < 17.0e9          # ≈ 16.8 GB, the size of the real file's data
    assert plan.file_type == 15


def test_27b_plan_without_mtp_stops_at_block_63():
    names = {t.name for t in plan_model(preset("27b", mtp=False))}
    assert "blk.63.ffn_down.weight" in names and not any(n.startswith("blk.64.") for n in names)


@pytest.mark.parametrize("name,arch,n_blocks", [("35b-a3b", "qwen35moe", 41), ("80b-a3b", "qwen3next", 48)])
def test_big_moe_presets_plan(name, arch, n_blocks):
    spec = preset(name)
    assert spec.arch == arch and spec.n_layer_all == n_blocks
    plan = {t.name: (t.ne, t.type.name) for t in plan_model(spec)}
    E = spec.n_expert
    assert plan["blk.0.ffn_gate_exps.weight"] == ((2048, 512, E), "Q4_K")
    assert plan["blk.0.ffn_down_exps.weight"] == ((512, 2048, E), "Q6_K")
    assert plan["blk.0.ffn_gate_inp.weight"] == ((2048, E), "F32")
    assert plan["blk.0.ffn_gate_inp_shexp.weight"] == ((2048,), "F32")


def test_every_preset_plans():
    for name in PRESET_NAMES:
        assert len(plan_model(preset(name))) > 0


def test_preset_errors_are_clear():
    with pytest.raises(HybridError, match="unknown preset"):
        preset("huge")
    with pytest.raises(HybridError, match="not for 'qwen3next'"):
        preset("27b", arch="qwen3next")
    with pytest.raises(HybridError, match="unknown spec field"):
        preset("tiny", n_layers=3)
    with pytest.raises(HybridError, match="not a multiple of n_head_kv"):
        preset("tiny", n_head_kv=3)


def test_mixes_fall_back_like_llama_quant_where_a_block_does_not_fit():
    """n_embd 288 = 9 × 32: llama.cpp's tensor_type_fallback, not a refusal (Q3_K → Q4_0, Q5_K → Q5_1,
    Q6_K → Q8_0); the uniform recipes still refuse."""
    types = {t.name: t.type.name for t in plan_model(preset("tiny", n_embd=288), "Q3_K_L")}
    assert types["blk.0.ffn_gate.weight"] == "Q4_0" and types["blk.0.ffn_down.weight"] == "Q5_K"   # 512 wide rows
    assert types["blk.0.ssm_out.weight"] == "Q3_K" and types["output.weight"] == "Q8_0"
