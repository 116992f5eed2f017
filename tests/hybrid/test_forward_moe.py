"""The qwen35moe / qwen3next forward (MoE FFN, qwen3next GDN projections, MTP block) on tiny
synthetic models vs the numpy float64 reference (tests/reference/qwen35_ref.py + moe_ref.py),
plus the stepping properties the decoder relies on."""
import dataclasses

import numpy as np
import pytest

import hybrid
from cpu.quants import dequantize
from hybrid.forward import Forward
from cpu.ggml_types import F32
from hybrid.model_file import open_model
from hybrid.synth import preset, write_model
from hybrid.weights import Experts, Matrix, iter_matrices
from tests.hybrid.test_speculative import KnownFutureHead, generate
from tests.reference.qwen35_ref import (reference_hidden, reference_logits, reference_mtp_logits,
                                        reference_routing_gap)

EXACT_TOL = 1e-4                       # float32 forward vs float64 (logit scale ~8)
LOGIT_TOL, MEAN_TOL = 1.5, 0.1         # tests/hybrid/test_forward.py's quantised-activation bounds
PROMPT = np.random.default_rng(3).integers(0, 384, size=12)

VARIANTS = {   # name: (arch, spec overrides)
    "qwen35moe": ("qwen35moe", {}),
    "qwen35moe-fused-no-shared": ("qwen35moe", dict(fused_gate_up_exps=True, n_ff_shexp=0)),
    "qwen3next": ("qwen3next", {}),
    "qwen3next-legacy-fused": ("qwen3next", dict(legacy_ssm_in=True, fused_gate_up_exps=True)),
}


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """Writes each (variant, types) model once per module."""
    folder, made = tmp_path_factory.mktemp("moe"), {}

    def make(variant: str, types: str):
        if (variant, types) not in made:
            arch, over = VARIANTS[variant]
            path = folder / f"{variant}-{types}.gguf"
            write_model(path, preset("tiny", arch=arch, **over), types=types, seed=1)
            made[variant, types] = path
        return made[variant, types]
    return make


def run_all(fw, ids, n_ctx=32):
    return fw.forward(fw.new_state(n_ctx), ids, logits="all")


def max_error(ours, ref):
    return float(np.abs(ours - ref).max())


def clear_routing(path, ids, mtp=False, margin=1e-3):
    """No row's top-k sits within `margin` of a swap: float32 vs float64 routing agree."""
    return float(np.min(reference_routing_gap(path, ids, mtp=mtp))) > margin


@pytest.mark.parametrize("variant", VARIANTS)
def test_float_model_matches_reference_tightly(model_path, variant):
    path = model_path(variant, "F32")
    assert clear_routing(path, PROMPT)
    with open_model(path) as mf:
        logits, hidden = run_all(Forward(mf), PROMPT)
    ref = reference_logits(path, PROMPT)
    print(f"\n{variant}: |logit error| {max_error(logits, ref):.3g} (scale {np.abs(ref).max():.1f})")
    assert max_error(logits, ref) < EXACT_TOL
    assert max_error(hidden, reference_hidden(path, PROMPT)) < EXACT_TOL


@pytest.mark.parametrize("variant", ["qwen35moe", "qwen3next-legacy-fused"])
def test_mtp_head_matches_reference(model_path, variant):
    path = model_path(variant, "F32")
    assert clear_routing(path, PROMPT, mtp=True)
    got = hybrid.load(path, threads=1, n_ctx=64).mtp_logits(PROMPT)
    assert max_error(got, reference_mtp_logits(path, PROMPT)) < EXACT_TOL


@pytest.mark.parametrize("variant", ["qwen35moe", "qwen3next-legacy-fused"])
def test_q4_k_m_model_matches_reference_with_rounded_activations(model_path, variant):
    """Q4_K/Q6_K weights: activations rounded to int8 per 256 as both we and llama.cpp (Q8_K) do."""
    path = model_path(variant, "Q4_K_M")
    with open_model(path) as mf:
        logits, _ = run_all(Forward(mf), PROMPT)
    ref = reference_logits(path, PROMPT, round_activations=True)
    err = np.abs(logits - ref)
    print(f"\n{variant} Q4_K_M: |logit error| max {err.max():.3g} mean {err.mean():.3g}")
    assert err.max() < LOGIT_TOL and err.mean() < MEAN_TOL


def float_weights(fw: Forward) -> Forward:
    """fw with every matrix and expert stack dequantised to F32 (same records, same binding)."""
    def f32(wtype, data, cols):
        rows = np.ascontiguousarray(data).reshape(-1, data.shape[-1])
        return dequantize(wtype, rows, cols).view(np.uint8).reshape(*data.shape[:-1], 4 * cols)

    def convert(obj):
        if isinstance(obj, (Matrix, Experts)):
            return dataclasses.replace(obj, wtype=F32.id, data=f32(obj.wtype, obj.data, obj.cols))
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            return dataclasses.replace(obj, **{f.name: convert(getattr(obj, f.name))
                                               for f in dataclasses.fields(obj) if f.init})
        if isinstance(obj, tuple):
            return tuple(convert(o) for o in obj)
        return obj

    exact = Forward(fw.model_file)
    exact.weights = convert(fw.weights)
    return exact


def test_q8_0_rows_are_regrouped_like_the_reference(model_path):
    """Legacy ssm_in, fused ssm_ba and fused gate_up regrouped from quantised rows: with those
    weights dequantised, the float path must meet the exact reference tightly."""
    path = model_path("qwen3next-legacy-fused", "Q8_0")
    assert clear_routing(path, PROMPT)
    with open_model(path) as mf:
        logits, _ = run_all(float_weights(Forward(mf)), PROMPT)
    assert max_error(logits, reference_logits(path, PROMPT)) < EXACT_TOL


@pytest.mark.parametrize("variant, types", [("qwen35moe", "Q4_K_M"), ("qwen3next-legacy-fused", "Q8_0")])
def test_chunks_equal_all_at_once_equal_token_by_token(model_path, variant, types):
    with open_model(model_path(variant, types)) as mf:
        fw = Forward(mf)
        whole, hidden_whole = run_all(fw, PROMPT)
        for sizes in ([5, 4, 3], [1] * len(PROMPT)):
            state, parts, hiddens, start = fw.new_state(32), [], [], 0
            for size in sizes:
                logits, hidden = fw.forward(state, PROMPT[start:start + size], logits="all")
                parts.append(logits)
                hiddens.append(hidden)
                start += size
            np.testing.assert_array_equal(np.concatenate(parts), whole)
            np.testing.assert_array_equal(np.concatenate(hiddens), hidden_whole)


def test_moe_stats_count_each_selected_expert_once_per_layer(model_path):
    with open_model(model_path("qwen35moe", "Q4_K_M")) as mf:
        fw = Forward(mf)
        c = fw.config
        assert fw.weights.layers[0].ffn.expert_bytes == sum(
            mf.tensors[f"blk.0.ffn_{p}_exps.weight"].nbytes for p in ("gate", "up", "down")) // c.n_expert
        all_layers = sum(layer.ffn.expert_bytes for layer in fw.weights.layers)   # Q4_K_M mixes types
        run_all(fw, PROMPT[:1])
        one = fw.last_moe_stats
        assert one.rows == c.n_layer and one.saving == 1.0
        assert one.expert_bytes_read == one.expert_bytes_per_row == c.n_expert_used * all_layers
        run_all(fw, PROMPT)
        many = fw.last_moe_stats
        assert many.rows == len(PROMPT) * c.n_layer
        assert many.expert_bytes_per_row == len(PROMPT) * c.n_expert_used * all_layers
        # 12 rows × 2 of 4 experts: each layer reads its 4 experts once, not 24 expert matrices
        assert many.expert_bytes_read == c.n_expert * all_layers
        assert many.saving == len(PROMPT) * c.n_expert_used / c.n_expert


def test_dense_model_has_no_moe_traffic(trained_model_q4km):
    with open_model(trained_model_q4km) as mf:
        fw = Forward(mf)
        run_all(fw, PROMPT[:3])
    assert fw.last_moe_stats.rows == 0 and fw.last_moe_stats.saving == 1.0


@pytest.mark.parametrize("variant", ["qwen35moe", "qwen3next-legacy-fused"])
def test_greedy_drafting_equals_plain_decoding(model_path, variant):
    """k+1-row verify batches through the grouped MoE FFN give each row the one-row bits, so
    speculative greedy output is exactly plain greedy output, with rejected and accepted drafts."""
    model = hybrid.load(model_path(variant, "Q4_K_M"), threads=1, n_ctx=320)
    prompt = [int(t) for t in PROMPT[:6]]
    plain, _, _, _ = generate(model, prompt, 0, n_tokens=200)
    own, end, _, _ = generate(model, prompt, 2, n_tokens=200)            # its own (random) head
    assert own == plain and end.stats.draft["steps"] > 0
    head = KnownFutureHead(model.mtp, prompt + plain, model.config.n_vocab)
    known, end, _, kept = generate(model, prompt, 2, head, n_tokens=200)  # ~70% right drafts
    assert known == plain and set(kept) == {1, 2, 3}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_every_bound_matrix_is_named_after_its_tensor(model_path, variant):
    """A placement decides by tensor name, so a regrouped matrix (ssm_ba, ssm_in, a fused gate_up)
    must carry its tensor's name plus a "[part]": a bare "blk.0.ssm_in" matched no tensor and
    failed hybrid loading of legacy qwen3next files."""
    with open_model(model_path(variant, "F32")) as mf:
        names = [m.name for m in iter_matrices(Forward(mf).weights)]
        assert all(name.split("[", 1)[0] in mf.tensors for name in names), names
