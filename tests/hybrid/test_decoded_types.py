"""Models of the decoded types (cpu.ggml_types.DECODED: Q4_1 … IQ1_M, MXFP4) and of llama.cpp's low-bit
mixes, CPU-only, against the numpy float64 reference (weights read by gguf-py); the mixes'
per-tensor types against llama-quant.cpp's rules; the errors for an unknown type and for a type
the GPU kernels do not run, and the GPU plan of the decoded types they do run."""
import struct

import numpy as np
import pytest

import hybrid
from cpu import ggml_types as gt
from hybrid.errors import HybridError, ModelError
from hybrid.model_file import open_model
from hybrid import placement
from hybrid.placement import check_gpu_types, plan_for, plan_placement
from hybrid.synth import preset, write_model
from hybrid.synth.types import MIXES, plan_model
from tests.reference.qwen35_ref import reference_logits

PROMPT = np.random.default_rng(5).integers(0, 384, size=8)
# the decoded types' products meet activations rounded as llama.cpp rounds them, which the
# reference emulates (round_activations=True): float32 order only (logit scale ~1-10)
EXACT_TOL = 2e-3
FLIP_TOL = 0.3            # a uniform model's max error where one rounded code flipped


def forward_logits(path):
    """Every position's logits from the library's CPU-only load."""
    return hybrid.load(path, device="cpu", threads=2, n_ctx=32).logits(PROMPT)


@pytest.mark.parametrize("name", [t.name for t in gt.DECODED])
def test_uniform_model_of_each_decoded_type_matches_reference(name, tmp_path):
    path = tmp_path / f"tiny-{name}.gguf"
    plan = write_model(path, preset("tiny", arch="qwen35"), types=name, seed=2)
    assert plan.type_counts()[name] > 0
    ours = forward_logits(path)
    ref = reference_logits(path, PROMPT, round_activations=True)
    err = float(np.abs(ours - ref).max())
    typical = float(np.median(np.abs(ours - ref)))
    print(f"\n{name}: |logit error| max {err:.3g}, median {typical:.3g} (scale {np.abs(ref).max():.2f})")
    # float order may tip one activation code across a rounding boundary (IQ2_XS: at position 3,
    # and the recurrent state carries it on: ~0.12 from there); float activations against this
    # reference, i.e. the wrong rounding, are 0.5-1.2 off
    assert np.abs(ref).max() > 0.1 and err < FLIP_TOL and typical < 0.05


@pytest.mark.parametrize("recipe", ["Q2_K_MIX", "Q3_K_M", "IQ4_XS_MIX"])
def test_llama_mix_models_match_reference(recipe, tmp_path):
    path = tmp_path / f"tiny-{recipe}.gguf"
    write_model(path, preset("tiny", arch="qwen35"), types=recipe, seed=3)
    ours, ref = forward_logits(path), reference_logits(path, PROMPT, round_activations=True)
    err = float(np.abs(ours - ref).max())
    print(f"\n{recipe}: |logit error| {err:.3g} (scale {np.abs(ref).max():.2f})")
    assert err < FLIP_TOL and float(np.median(np.abs(ours - ref))) < 0.05     # as the uniform models


# MoE files: experts of the decoded types (alone, and mixed with another type as IQ3_M's early
# ffn_down is) run in cpu.moe_kernel now that every one has a row dot (cpu.matvec.ROW_READERS;
# cpu.decoded_moe took them before); it rounds activations for each matrix's type, so
# with every other matrix F32 the model must meet the float64 reference that rounds them the same
# way. (A shared expert of a decoded type runs as a dense FFN: the dense tests above cover it.)
# (A whole MoE mix also rounds its Q8_0/K-quant trunk's activations to int8, and on these tiny
# models that flips routing: even uniform Q8_0 is ~3 logits off the exact reference, so the mixes
# below are only run.) (The decoded type pairs are tests/cpu/test_moe.py's: each pair compiles a
# kernel variant, shared through Numba's disk cache.)
MOE_EXPERTS = {
    "MXFP4+Q5_0": {r"ffn_(gate|up)_exps": "MXFP4", r"ffn_down_exps": "Q5_0"},
    "Q4_1+Q5_1": {r"ffn_(gate|up)_exps": "Q4_1", r"ffn_down_exps": "Q5_1"},
    "Q4_K+IQ1_M": {r"ffn_(gate|up)_exps": "Q4_K", r"ffn_down_exps": "IQ1_M"},
}


@pytest.mark.parametrize("experts", MOE_EXPERTS)
@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next"])
def test_decoded_experts_match_reference(experts, arch, tmp_path):
    path = tmp_path / f"tiny-{arch}-{experts}.gguf"
    write_model(path, preset("tiny", arch=arch), types="F32", seed=3, overrides=MOE_EXPERTS[experts])
    ours, ref = forward_logits(path), reference_logits(path, PROMPT, round_activations=True)
    err = float(np.abs(ours - ref).max())
    print(f"\n{arch} experts {experts}: |logit error| {err:.3g} (scale {np.abs(ref).max():.2f})")
    assert np.abs(ref).max() > 0.1 and err < FLIP_TOL and float(np.median(np.abs(ours - ref))) < 0.05


@pytest.mark.parametrize("recipe, arch", [("MXFP4_MOE", "qwen35moe"), ("Q3_K_S", "qwen3next")])
def test_moe_mix_models_run_cpu_only(recipe, arch, tmp_path):
    path = tmp_path / f"tiny-{arch}-{recipe}.gguf"
    plan = write_model(path, preset("tiny", arch=arch), types=recipe, seed=3)
    with open_model(path) as mf:
        assert {n: t.type.name for n, t in mf.tensors.items()} == {t.name: t.type.name for t in plan}
    logits = forward_logits(path)
    assert logits.shape == (len(PROMPT), 384) and np.isfinite(logits).all()


def _types(recipe, arch="qwen35", **over):
    plan = plan_model(preset("tiny", arch=arch, **over), recipe)
    return {t.name: t.type.name for t in plan}


def test_mixes_follow_llama_quant_rules():
    # tiny: n_head 4 / n_head_kv 2 = n_gqa 2; 4 trunk blocks + MTP = 5 ffn_down layers
    q2 = _types("Q2_K_MIX")
    assert q2["blk.0.ffn_gate.weight"] == "Q2_K" and q2["blk.0.ffn_down.weight"] == "Q3_K"
    assert q2["output.weight"] == "Q6_K" and q2["blk.3.attn_v.weight"] == "Q3_K"        # n_gqa < 4
    assert q2["blk.3.attn_output.weight"] == "Q3_K" and q2["blk.0.ssm_out.weight"] == "Q2_K"
    m = _types("Q3_K_M")
    assert m["blk.0.attn_qkv.weight"] == "Q5_K" and m["blk.1.attn_qkv.weight"] == "Q5_K"   # i_attention_wv < 2
    assert m["blk.2.attn_qkv.weight"] == "Q4_K" and m["blk.0.ffn_down.weight"] == "Q4_K"   # 0 < 5/16 is false
    assert _types("Q3_K_L")["blk.0.ffn_down.weight"] == "Q5_K"
    assert _types("Q3_K_S")["blk.0.ffn_down.weight"] == "Q3_K"
    s = _types("Q4_K_S")
    assert [s[f"blk.{i}.attn_qkv.weight"] for i in range(3)] == ["Q5_K"] * 3 and s["blk.3.attn_v.weight"] == "Q5_K"
    assert s["blk.1.ffn_down.weight"] == "Q4_K"
    iq4 = _types("IQ4_XS_MIX")
    assert iq4["blk.0.ffn_up.weight"] == "IQ4_XS" and iq4["blk.3.attn_v.weight"] == "IQ4_XS"
    assert _types("IQ4_XS_MIX", n_head=8, n_head_kv=2)["blk.3.attn_v.weight"] == "Q5_K"       # n_gqa ≥ 4
    iq3 = _types("IQ3_M")
    assert iq3["blk.1.ffn_gate.weight"] == "IQ3_S" and iq3["blk.3.attn_v.weight"] == "Q4_K"
    assert iq3["blk.3.attn_output.weight"] == "Q4_K"


@pytest.mark.parametrize("n_expert", [256, 512])
def test_moe_mixes_with_real_expert_counts(n_expert):
    over = dict(n_expert=n_expert, n_expert_used=8, n_layer=16)
    mx = _types("MXFP4_MOE", "qwen35moe", **over)
    assert mx["blk.0.ffn_gate_exps.weight"] == "MXFP4" and mx["blk.0.ffn_down_exps.weight"] == "MXFP4"
    assert mx["output.weight"] == "Q8_0" and mx["blk.0.ssm_out.weight"] == "Q8_0"
    assert mx["blk.0.ffn_gate_shexp.weight"] == "Q8_0"
    q2 = _types("Q2_K_MIX", "qwen35moe", **over)
    assert q2["blk.5.ffn_up_exps.weight"] == "Q2_K" and q2["blk.5.ffn_down_exps.weight"] == "Q3_K"
    ks = _types("Q4_K_S", "qwen35moe", **over)     # 17 blocks with MTP: ffn_down Q5_K below 17/8 = 2
    assert [ks[f"blk.{i}.ffn_down_exps.weight"] for i in (0, 1, 2)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert ks["blk.3.attn_output.weight"] == "Q4_K"         # the 8-expert rule does not apply
    iq3 = _types("IQ3_M", "qwen3next", **over)
    assert iq3["blk.0.ffn_down_exps.weight"] == "Q4_K" and iq3["blk.8.ffn_down_exps.weight"] == "IQ3_S"


def test_eight_expert_rule():
    t = _types("Q3_K_M", "qwen35moe", n_expert=8, n_expert_used=2)
    assert t["blk.3.attn_v.weight"] == "Q8_0" and t["blk.3.attn_k.weight"] == "Q8_0"
    assert t["blk.3.attn_output.weight"] == "Q5_K"


def test_mix_names_are_recipes():
    assert set(MIXES) == {"Q2_K_MIX", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "IQ4_XS_MIX", "IQ3_M", "MXFP4_MOE"}


def without_gpu_kernels(monkeypatch, name: str) -> None:
    """Every type of cpu.ggml_types.SUPPORTED has GPU kernels: the refusal path is checked on a type
    whose GPU units the planner is made not to see (a type the CPU would read first)."""
    tid = gt.by_name(name).id
    monkeypatch.setattr(placement, "GPU_UNITS", {k: u for k, u in placement.GPU_UNITS.items() if k != tid})


def test_gpu_path_refuses_types_without_gpu_kernels(tmp_path, monkeypatch):
    without_gpu_kernels(monkeypatch, "IQ3_S")
    path = tmp_path / "tiny-IQ3_S.gguf"
    write_model(path, preset("tiny", arch="qwen35"), types="IQ3_S", seed=2)
    with open_model(path) as mf:
        with pytest.raises(HybridError) as e:
            check_gpu_types(mf)
        with pytest.raises(HybridError, match="--device cpu"):
            plan_placement(mf, 1 << 30)                      # what a GPU load plans with
    msg = str(e.value)
    assert "\n" not in msg and "IQ3_S" in msg and ("blk." in msg or "token_embd" in msg)
    assert "--device cpu" in msg


@pytest.mark.parametrize("name", ["Q4_1", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS", "Q3_K", "Q2_K",
                                  "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "MXFP4", "IQ3_XXS", "IQ3_S", "IQ2_XXS"])
def test_gpu_path_takes_the_decoded_types_with_gpu_kernels(name, tmp_path, monkeypatch):
    """These decoded types have GPU units (gpu/matmul): a GPU load plans them (on the device
    where they fit), and --device auto keeps the GPU."""
    monkeypatch.setattr(placement, "gpu_free_memory", lambda: 12 << 30)
    path = tmp_path / f"tiny-{name}.gguf"
    write_model(path, preset("tiny", arch="qwen35"), types=name, seed=2)
    with open_model(path) as mf:
        check_gpu_types(mf)
        plan = plan_for(mf, "auto")
        assert plan.device != "cpu" and not any("GPU kernels" in note for note in plan.notes)


def test_device_auto_runs_types_without_gpu_kernels_on_the_cpu(tmp_path, monkeypatch):
    """The default device on a GPU box: such a file gets a CPU plan that says why, not an error;
    asking for cuda explicitly still gets the error."""
    monkeypatch.setattr(placement, "gpu_free_memory", lambda: 12 << 30)
    without_gpu_kernels(monkeypatch, "IQ3_S")
    path = tmp_path / "tiny-IQ3_S.gguf"
    write_model(path, preset("tiny", arch="qwen35"), types="IQ3_S", seed=2)
    with open_model(path) as mf:
        plan = plan_for(mf, "auto")
        assert plan.device == "cpu" and "IQ3_S" in plan.notes[0] and "GPU kernels" in plan.notes[0]
        with pytest.raises(HybridError, match="--device cpu"):
            plan_for(mf, "cuda")


def test_unknown_type_id_names_tensor_and_type(tmp_path):
    """A type id no ggml version defines (here 250) in the tensor table: one line naming both."""
    path = tmp_path / "tiny-Q8_0.gguf"
    write_model(path, preset("tiny", arch="qwen35"), types="Q8_0", seed=2)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_down.weight"
    at = data.index(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 250)
    path.write_bytes(bytes(data))
    with pytest.raises((ModelError, HybridError)) as e:
        open_model(path).close()
    msg = str(e.value)
    assert "\n" not in msg and "blk.0.ffn_down.weight" in msg and "250" in msg
