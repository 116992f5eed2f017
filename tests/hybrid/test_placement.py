"""The placement planner on real model shapes (synthetic tensor tables: nothing is written),
and `hybrid info --plan` on the bundled model.

Oracles are computed here from the tensor table and the config formulas, independently of the
planner: KV and GDN state sizes, per-token bytes (every weight once, one embedding row, top-k of
the routed experts), and that the plan adds up and is maximal (the next FFN layer would not fit).
"""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import hybrid.placement as placement
from hybrid.cli import app
from hybrid.errors import HybridError
from gpu.runtime.pcie import PCIE_MAX_ROWS, pcie_counts
from hybrid.placement import (CPU, GPU, gdn_state_bytes, kv_bytes, parse_overrides,
                              plan_for, plan_placement)
from hybrid.synth import plan_model, preset
from hybrid.synth.types import synth_layout

from ..conftest import BUNDLED_MODEL

GiB = 2**30


def fake_model(name: str, arch: str | None = None, **over) -> SimpleNamespace:
    """A ModelFile look-alike (config + name → name/ne/nbytes/role) of a synthetic preset, Q4_K_M."""
    spec = preset(name, arch, **over)
    roles = {s.name: s.role for s in synth_layout(spec)}
    tensors = {t.name: SimpleNamespace(name=t.name, ne=t.ne, nbytes=t.nbytes, role=roles[t.name], type=t.type)
               for t in plan_model(spec, "Q4_K_M")}
    return SimpleNamespace(config=spec.config(), tensors=tensors)


@pytest.fixture(scope="module")
def m27b():
    return fake_model("27b")


@pytest.fixture(scope="module")
def moe():
    return fake_model("35b-a3b", "qwen35moe")


def ffn_layers(m, layer: int) -> list[str]:
    return [n for n in m.tensors if n.startswith(f"blk.{layer}.ffn_")]


# --- dense 27B on a 12 GiB card ----------------------------------------------------------------

def test_27b_on_12gib_puts_trunk_and_lm_head_on_the_gpu_and_most_ffn_on_the_cpu(m27b):
    c = m27b.config
    p = plan_placement(m27b, 12 * GiB, n_ctx=4096, n_ring=5)
    assert p.device == "cuda" and p.budget == 12 * GiB
    for name, t in m27b.tensors.items():
        if t.role == "trunk" or name == "output.weight":
            assert p.side(name) == GPU, name
    assert p.side("token_embd.weight") == CPU            # a lookup: one row per token
    gpu_layers = p.ffn_layers(GPU)
    assert 0 < len(gpu_layers) < c.n_layer / 2           # some FFN layers fit, most stay on the CPU
    assert sorted(gpu_layers + p.ffn_layers(CPU)) == list(range(c.n_layer))
    for i in gpu_layers:                                  # whole layers: gate, up and down together
        assert all(p.side(n) == GPU for n in ffn_layers(m27b, i))


def test_27b_accounting_adds_up(m27b):
    c = m27b.config
    p = plan_placement(m27b, 12 * GiB, n_ctx=4096, n_ring=5)
    total = sum(t.nbytes for t in m27b.tensors.values())
    gpu_bytes = sum(t.nbytes for n, t in m27b.tensors.items() if p.side(n) == GPU)
    assert p.weight_bytes(GPU) == gpu_bytes == p.vram["weights"]
    assert p.weight_bytes(GPU) + p.weight_bytes(CPU) == total
    n_attn = sum(not c.is_recurrent(i) for i in range(c.n_layer))
    assert n_attn == 16
    kv_one = 2 * c.n_head_kv * c.head_dim * 4096 * 2      # fp16 K and V (gpu/attention.py)
    assert p.vram["kv_cache"] == (n_attn + 1) * kv_one    # the MTP block's attention is on the GPU too
    gdn_one = (c.ssm_n_v_heads * c.ssm_d_state ** 2 + (c.ssm_conv_kernel - 1) * c.ssm_conv_channels) * 4
    assert p.vram["gdn_state"] == 48 * gdn_one * (1 + 5)
    assert p.vram["margin"] >= 12 * GiB // 20
    one_ffn_layer = sum(m27b.tensors[n].nbytes for n in ffn_layers(m27b, 0))
    assert p.vram["weight_streaming"] == 2 * one_ffn_layer   # two slots for streaming prompt FFNs
    assert p.vram_used == sum(p.vram.values()) <= p.budget
    assert p.vram_left == p.budget - p.vram_used
    # maximal: the smallest FFN layer still on the CPU would not fit in what is left
    smallest_cpu_layer = min(sum(m27b.tensors[n].nbytes for n in ffn_layers(m27b, i)) for i in p.ffn_layers(CPU))
    assert smallest_cpu_layer > p.vram_left


def test_27b_per_token_bytes(m27b):
    p = plan_placement(m27b, 12 * GiB, n_ring=5)
    t = m27b.tensors
    mtp = {n for n, x in t.items() if x.role == "mtp"}
    row = t["token_embd.weight"].nbytes // m27b.config.n_vocab
    every_weight = sum(x.nbytes for n, x in t.items() if n not in mtp and n != "token_embd.weight")
    assert p.per_token(GPU) + p.per_token(CPU) == every_weight + row
    assert p.per_token(CPU) == row + sum(t[n].nbytes for i in p.ffn_layers(CPU) for n in ffn_layers(m27b, i))
    assert p.ffn_per_token(CPU) == p.per_token(CPU) - row
    # a draft reads the MTP block, the (shared) lm_head and one embedding row
    assert p.per_draft(GPU) + p.per_draft(CPU) == sum(t[n].nbytes for n in mtp) + t["output.weight"].nbytes + row
    assert p.cpu_seconds_per_token(100e9) == pytest.approx(p.per_token(CPU) / 100e9)


def test_more_vram_moves_more_ffn_layers(m27b):
    small = plan_placement(m27b, 12 * GiB, n_ring=5)
    big = plan_placement(m27b, 16 * GiB, n_ring=5)
    huge = plan_placement(m27b, 40 * GiB, n_ring=5)
    assert len(small.ffn_layers(GPU)) < len(big.ffn_layers(GPU)) < len(huge.ffn_layers(GPU)) == 64
    assert huge.per_token(CPU) == m27b.tensors["token_embd.weight"].nbytes // m27b.config.n_vocab


def test_split_ffn_spends_the_same_vram_on_a_share_of_every_cpu_layer(m27b):
    c = m27b.config
    whole = plan_placement(m27b, 12 * GiB, n_ctx=4096, n_ring=5)
    split = plan_placement(m27b, 12 * GiB, n_ctx=4096, n_ring=5, split_ffn=True)
    assert split.ffn_layers(GPU) == [] and sorted(split.ffn_split) == list(range(c.n_layer))
    layer_bytes = {i: sum(m27b.tensors[n].nbytes for n in ffn_layers(m27b, i)) for i in range(c.n_layer)}
    share = {i: rows / c.n_ff for i, rows in split.ffn_split.items()}
    for i, rows in split.ffn_split.items():
        assert rows % 256 == 0 and 0 < rows < c.n_ff
        assert share[i] == pytest.approx(share[0], abs=256 / c.n_ff)      # the same share of each layer
    device_bytes = sum(layer_bytes[i] * rows // c.n_ff for i, rows in split.ffn_split.items())
    assert split.vram["ffn_split"] == split.ffn_split_token_bytes == device_bytes
    assert split.vram_used <= split.budget
    # the VRAM whole layers took, to within a block column of each layer
    whole_ffn = sum(layer_bytes[i] for i in whole.ffn_layers(GPU))
    assert whole_ffn - c.n_layer * layer_bytes[0] * 256 // c.n_ff <= device_bytes <= whole_ffn + split.vram_left
    # the CPU reads what the GPU does not, per token, as before
    assert split.per_token(CPU) + split.per_token(GPU) == whole.per_token(CPU) + whole.per_token(GPU)
    assert split.ffn_per_token(GPU) == device_bytes
    assert split.to_dict()["ffn_split"] == {str(i): r for i, r in split.ffn_split.items()}


def test_split_ffn_places_whole_layers_when_they_all_fit_and_leaves_pinned_layers_whole(m27b):
    assert plan_placement(m27b, 80 * GiB, n_ctx=4096, split_ffn=True).ffn_split == {}
    p = plan_placement(m27b, 12 * GiB, n_ctx=4096, split_ffn=True, overrides=parse_overrides([r"blk\.3\.ffn_down=GPU"]))
    assert 3 not in p.ffn_split and len(p.ffn_split) == m27b.config.n_layer - 1
    assert p.side("blk.3.ffn_down.weight") == GPU


def test_too_small_a_budget_says_what_is_needed(m27b):
    with pytest.raises(HybridError) as e:
        plan_placement(m27b, 4 * GiB, n_ring=5)
    msg = str(e.value)
    assert "not enough GPU memory" in msg and "budget is 4.00 GiB" in msg
    assert "trunk" in msg and "lm_head" in msg and "KV cache" in msg
    assert "--ctx-size" in msg and "--cpu-only" in msg


def test_a_long_context_can_make_the_must_have_part_too_big(m27b):
    plan_placement(m27b, 12 * GiB, n_ctx=4096, n_ring=5)
    with pytest.raises(HybridError, match="n_ctx 131072"):
        plan_placement(m27b, 12 * GiB, n_ctx=131072, n_ring=5)  # 17 layers × 1 GiB of KV


def test_only_the_kv_cache_grows_with_the_context(m27b):
    """No device buffer but the KV cache is sized by n_ctx (the attention keeps a fixed number of
    partial results per row), so a longer context takes its KV bytes from the weights, short of at
    most one FFN layer (whole layers move)."""
    short, long = (plan_placement(m27b, 12 * GiB, n_ctx=n, n_ring=5) for n in (4096, 32768))
    assert short.vram["scratch"] == long.vram["scratch"]
    grown = long.vram["kv_cache"] - short.vram["kv_cache"]
    ffn_layer = long.vram["weight_streaming"] // placement.STREAM_SLOTS    # the streamer's slot: the largest layer
    assert grown > 0 and short.vram["weights"] - long.vram["weights"] >= grown - ffn_layer


def test_without_drafting_the_mtp_block_stays_on_the_cpu(m27b):
    p = plan_placement(m27b, 40 * GiB, n_ring=0)
    mtp = [n for n, t in m27b.tensors.items() if t.role == "mtp"]
    assert mtp and all(p.side(n) == CPU for n in mtp)
    assert p.vram["gdn_state"] == gdn_state_bytes(m27b.config, 0)
    assert p.vram["kv_cache"] == kv_bytes(m27b.config, 4096, 16)


def test_tied_lm_head_goes_to_the_gpu_with_the_embedding():
    m = fake_model("small", "qwen35")
    assert m.config.tied_output
    p = plan_placement(m, 8 * GiB, n_ring=5)
    assert p.side("token_embd.weight") == GPU
    assert p.tensors["token_embd.weight"].group == "lm_head"


# --- -ot / --override-tensor -------------------------------------------------------------------

def test_override_pins_tensors_first_rule_wins(m27b):
    rules = parse_overrides([r"blk\.0\.ffn_up=GPU", r"ffn_=CPU", r"attn_qkv=CPU"])
    p = plan_placement(m27b, 12 * GiB, n_ring=5, overrides=rules)
    assert p.side("blk.0.ffn_up.weight") == GPU and p.tensors["blk.0.ffn_up.weight"].forced
    assert p.side("blk.0.ffn_gate.weight") == CPU
    assert all(p.side(n) == CPU for n in m27b.tensors if ".ffn_" in n and n != "blk.0.ffn_up.weight")
    assert p.side("blk.0.attn_qkv.weight") == CPU and p.side("blk.0.attn_gate.weight") == GPU
    assert p.ffn_layers(GPU) == []
    assert p.vram["weights"] == p.weight_bytes(GPU)


def test_override_to_gpu_counts_as_must_have(m27b):
    every_ffn_on_gpu = parse_overrides(["ffn_=CUDA0"])
    with pytest.raises(HybridError, match="pinned by -ot"):
        plan_placement(m27b, 12 * GiB, n_ring=5, overrides=every_ffn_on_gpu)


@pytest.mark.parametrize("text, match", [
    ("ffn_up", "REGEX=CPU or REGEX=GPU"), ("=CPU", "REGEX=CPU"), ("ffn=TPU", "unknown target"),
    ("(ffn=CPU", "bad regular expression"),
])
def test_bad_overrides(text, match):
    with pytest.raises(HybridError, match=match):
        parse_overrides([text])


def test_override_targets():
    assert [o.side for o in parse_overrides(["a=cpu", "b=GPU", "c=CUDA", "d=cuda1", "x=y=CPU"])] == \
        [CPU, GPU, GPU, GPU, CPU]
    assert parse_overrides(["x=y=CPU"])[0].pattern.pattern == "x=y"


# --- CPU only, and plans from the device --------------------------------------------------------

def test_cpu_only_puts_everything_on_the_cpu(m27b, monkeypatch):
    monkeypatch.setattr(placement, "gpu_free_memory", lambda: pytest.fail("--cpu-only must not probe a GPU"))
    for p in (plan_for(m27b, "auto", cpu_only=True, n_ring=5), plan_for(m27b, "cpu", vram="12GiB")):
        assert p.device == "cpu" and p.budget is None and p.vram == {} and p.vram_used == 0
        assert all(t.side == CPU for t in p.tensors.values())
        assert p.per_token(GPU) == 0
    with pytest.raises(HybridError, match="pins blk.0.ffn_up.weight to the GPU"):
        plan_for(m27b, cpu_only=True, overrides=[r"blk\.0\.ffn_up=GPU"])
    with pytest.raises(HybridError, match="contradict"):
        plan_for(m27b, "cuda", cpu_only=True)


def test_no_gpu_gives_a_cpu_plan_for_auto_and_an_error_for_cuda(m27b, monkeypatch):
    monkeypatch.setattr(placement, "gpu_free_memory", lambda: None)
    p = plan_for(m27b, "auto", n_ring=5)
    assert p.device == "cpu" and "no CUDA GPU" in p.notes[0]
    with pytest.raises(HybridError, match="no CUDA GPU found"):
        plan_for(m27b, "cuda")


def test_budget_defaults_to_free_vram_and_is_capped_by_it(m27b, monkeypatch):
    monkeypatch.setattr(placement, "gpu_free_memory", lambda: 14 * GiB)
    assert plan_for(m27b, "cuda", n_ring=5).budget == 14 * GiB
    assert plan_for(m27b, "auto", vram="12GiB", n_ring=5).budget == 12 * GiB
    capped = plan_for(m27b, "auto", vram="20GiB", n_ring=5)
    assert capped.budget == 14 * GiB and "more than the GPU's free" in capped.notes[0]


# --- MoE --------------------------------------------------------------------------------------

def test_moe_keeps_routed_experts_on_the_cpu(moe):
    c = moe.config
    p = plan_placement(moe, 12 * GiB, n_ring=5)
    experts = [n for n in moe.tensors if "_exps." in n]
    assert experts and all(p.side(n) == CPU for n in experts)
    for i in range(c.n_layer):                       # router and shared expert: on the GPU
        for n in ffn_layers(moe, i):
            if "_exps." not in n:
                assert p.side(n) == GPU, n
    assert p.ffn_layers(GPU) == list(range(c.n_layer))
    # a token reads top-k of E experts per layer on the CPU (the MTP block's only when drafting)
    trunk_experts = [n for n in experts if int(n.split(".")[1]) < c.n_layer]
    row = moe.tensors["token_embd.weight"].nbytes // c.n_vocab
    expected = row + sum(moe.tensors[n].nbytes * c.n_expert_used // c.n_expert for n in trunk_experts)
    assert p.per_token(CPU) == expected
    assert p.per_token(CPU) < 0.05 * sum(moe.tensors[n].nbytes for n in trunk_experts)


def test_moe_expert_cache_spends_leftover_vram(moe):
    c = moe.config
    plain = plan_placement(moe, 12 * GiB, n_ring=5)
    cached = plan_placement(moe, 12 * GiB, n_ring=5, expert_cache=True)
    k = set(cached.expert_cache.values())
    assert len(k) == 1 and 0 < next(iter(k)) < c.n_expert
    assert sorted(cached.expert_cache) == list(range(c.n_layer_all))    # MTP block too (drafting)
    one_more_expert_per_layer = cached.vram["expert_cache"] // next(iter(k))
    assert cached.vram_used <= cached.budget and cached.vram_left < one_more_expert_per_layer
    assert cached.per_token(CPU) < plain.per_token(CPU)
    assert cached.per_token(CPU) + cached.per_token(GPU) == plain.per_token(CPU) + plain.per_token(GPU)
    assert all(cached.side(n) == CPU for n in moe.tensors if "_exps." in n)   # tensors stay mapped


def test_moe_pcie_share_reserves_its_staging_before_the_expert_cache(moe):
    c = moe.config
    cached = plan_placement(moe, 12 * GiB, n_ring=5, expert_cache=True)
    shared = plan_placement(moe, 12 * GiB, n_ring=5, expert_cache=True, pcie_share=0.375)
    expert = sum(moe.tensors[n].nbytes for n in moe.tensors if n.startswith("blk.0.") and "_exps." in n) // c.n_expert
    per_row = int(pcie_counts(0.375, c.n_expert_used)[-1])
    assert per_row == 3 and shared.pcie_share == 0.375
    assert shared.vram["pcie_staging"] == PCIE_MAX_ROWS * per_row * expert
    assert shared.vram_used <= shared.budget
    assert next(iter(shared.expert_cache.values())) < next(iter(cached.expert_cache.values()))
    assert "pcie_staging" not in cached.vram and cached.pcie_share == 0.0


def test_moe_pcie_share_is_off_where_its_staging_does_not_fit(moe):
    without = plan_placement(moe, 12 * GiB, n_ring=5, margin=0)
    staging = plan_placement(moe, 12 * GiB, n_ring=5, pcie_share=1.0, margin=0).vram["pcie_staging"]
    before_streaming = without.vram_used - without.vram["expert_streaming"]
    squeezed = plan_placement(moe, before_streaming + staging - 1, n_ring=5, pcie_share=1.0, margin=0)
    assert squeezed.pcie_share == 0.0 and "pcie_staging" not in squeezed.vram
    assert any("PCIe" in note for note in squeezed.notes)


def expert_bytes(m, layer: int = 0) -> int:
    return sum(t.nbytes for n, t in m.tensors.items() if n.startswith(f"blk.{layer}.") and "_exps." in n) // m.config.n_expert


def test_moe_prompt_streaming_slots_hold_each_layers_uncached_experts_beside_the_cache(moe):
    c = moe.config
    plain = plan_placement(moe, 12 * GiB, n_ring=5)
    assert plain.streams_experts and plain.vram["expert_streaming"] == 2 * c.n_expert * expert_bytes(moe)
    cached = plan_placement(moe, 12 * GiB, n_ring=5, expert_cache=True)
    k = next(iter(cached.expert_cache.values()))
    assert 0 < k < c.n_expert and cached.vram_used <= cached.budget
    assert cached.vram["expert_streaming"] == 2 * (c.n_expert - k) * expert_bytes(moe)
    # one more cached expert per layer would not leave room for the (smaller) slots
    one_each = cached.vram["expert_cache"] // k
    assert cached.vram_left < one_each - 2 * expert_bytes(moe)


def test_moe_prompt_streaming_is_off_where_its_slots_do_not_fit(moe):
    plain = plan_placement(moe, 12 * GiB, n_ring=5, margin=0)
    squeezed = plan_placement(moe, plain.vram_used - 1, n_ring=5, margin=0)
    assert not squeezed.streams_experts and "expert_streaming" not in squeezed.vram


def test_moe_with_fused_gate_up_experts_reserves_no_streaming_slots():
    fused = fake_model("35b-a3b", "qwen35moe", fused_gate_up_exps=True)
    assert any(n.endswith(".ffn_gate_up_exps.weight") for n in fused.tensors)
    assert not plan_placement(fused, 12 * GiB, n_ring=5).streams_experts


def test_dense_models_stream_no_experts(m27b):
    assert not plan_placement(m27b, 12 * GiB, n_ring=5).streams_experts


def test_dense_models_get_no_pcie_share(m27b):
    p = plan_placement(m27b, 12 * GiB, n_ring=5, pcie_share=0.5)
    assert p.pcie_share == 0.0 and "pcie_staging" not in p.vram


def test_every_verify_step_fits_the_pcie_row_limit():
    from hybrid.draft_policy import parse_depth
    deepest = max(d for d in range(64) if _parses(parse_depth, d))
    assert PCIE_MAX_ROWS == deepest + 1


def _parses(parse, depth) -> bool:
    try:
        parse(depth)
        return True
    except HybridError:
        return False


def test_pcie_counts_round_half_up_and_refuse_shares_outside_zero_to_one():
    assert pcie_counts(0.5, 8).tolist() == [0, 1, 1, 2, 2, 3, 3, 4, 4]
    assert pcie_counts(0.375, 8).tolist() == [0, 0, 1, 1, 2, 2, 2, 3, 3]
    assert pcie_counts(0.0, 3).tolist() == [0] * 4 and pcie_counts(1.0, 3).tolist() == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="0..1"):
        pcie_counts(1.5, 8)


# --- hybrid info --plan ---------------------------------------------------------------------------

runner = CliRunner()


def test_info_plan_json_on_the_bundled_model():
    r = runner.invoke(app, ["info", str(BUNDLED_MODEL), "--plan", "--vram", "1GiB", "-c", "2048",
                            "--draft", "3", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    p = s["plan"]
    assert p["device"] == "cuda" and p["budget"] == GiB and p["n_ctx"] == 2048 and p["n_ring"] == 4
    assert len(p["tensors"]) == s["n_tensors"]
    assert p["weights"]["gpu"] + p["weights"]["cpu"] == s["tensor_bytes"]
    c = s["config"]
    n_attn = s["layer_kinds"].count("attn") + s["n_nextn"]          # the MTP block drafts: its KV too
    assert p["vram"]["kv_cache"] == n_attn * 2 * c["n_head_kv"] * c["head_dim"] * 2048 * 2     # fp16
    assert p["vram_used"] == sum(p["vram"].values()) <= p["budget"]
    assert p["tensors"]["output.weight"] == "gpu" and p["tensors"]["token_embd.weight"] == "cpu"
    assert p["ffn_layers_on_gpu"] == list(range(8))           # 20 MB: everything fits
    assert p["cpu_seconds_per_token"] == pytest.approx(p["per_token"]["cpu"] / 100e9)


def test_info_plan_cpu_only_and_overrides_json():
    r = runner.invoke(app, ["info", str(BUNDLED_MODEL), "--cpu-only", "--json"])
    assert r.exit_code == 0, r.output
    p = json.loads(r.stdout)["plan"]
    assert p["device"] == "cpu" and set(p["tensors"].values()) == {"cpu"} and p["budget"] is None
    r = runner.invoke(app, ["info", str(BUNDLED_MODEL), "--vram", "1GiB", "-ot", r"blk\.[0-3]\.ffn_=CPU", "--json"])
    p = json.loads(r.stdout)["plan"]
    assert p["ffn_layers_on_gpu"] == [4, 5, 6, 7] and p["ffn_layers_on_cpu"] == [0, 1, 2, 3]


def test_info_plan_tables():
    r = runner.invoke(app, ["info", str(BUNDLED_MODEL), "--plan", "--vram", "1GiB"], env={"COLUMNS": "160"})
    assert r.exit_code == 0, r.output
    for text in ("placement plan", "what lives where", "VRAM budget", "KV cache", "safety margin",
                 "bytes read per decoded token", "CPU roofline at 100.0 GB/s", "ffn (blk 0–7)"):
        assert text in r.stdout, text


def test_info_plan_split_ffn():
    """The bundled model's FFN at a budget that holds a share of it: every layer split the same."""
    args = ["info", str(BUNDLED_MODEL), "--vram", "305MiB", "--split-ffn"]
    p = json.loads(runner.invoke(app, [*args, "--json"]).stdout)["plan"]
    assert p["ffn_split"] == {str(i): 256 for i in range(8)} and p["ffn_layers_on_gpu"] == []
    assert p["vram"]["ffn_split"] == p["ffn_split_token_bytes"] == p["ffn_per_token"]["gpu"] > 0
    r = runner.invoke(app, args, env={"COLUMNS": "160"})
    assert r.exit_code == 0 and "ffn split (rows 0–255)" in r.stdout and "split FFNs' device halves" in r.stdout


def test_info_plan_too_small_is_a_clean_error():
    r = runner.invoke(app, ["info", str(BUNDLED_MODEL), "--vram", "10MiB"])
    assert r.exit_code != 0 and isinstance(r.exception, HybridError)
    assert "not enough GPU memory" in str(r.exception)


def test_decode_rejects_a_bad_vram_before_loading():
    r = runner.invoke(app, ["decode", "-p", "x", "--vram", "lots"])
    assert isinstance(r.exception, HybridError) and "cannot read 'lots'" in str(r.exception)


def test_no_streaming_slots_when_every_weight_fits(m27b):
    p = plan_placement(m27b, 64 * GiB, n_ctx=4096, n_ring=5)
    assert not p.ffn_layers(CPU) and "weight_streaming" not in p.vram
