"""The numpy float64 reference (qwen35_ref + moe_ref) for qwen35moe and qwen3next against llama.cpp.

Tiny synthetic GGUFs (hybrid.synth `tiny` presets) in every layout llama.cpp accepts: separate or
fused expert gate/up, qwen3next's attn_qkv/attn_gate or legacy ssm_in, with and without MTP.
* F32 files: exact reference vs llama.cpp; only llama.cpp's f16 KV cache separates them (~1e-3).
* Q8_0 / Q4_K_M files: llama.cpp rounds activations to 8 bits before each quantised product, and
  these random models amplify that into logit differences of 0.4–5 (logit std ~2; the trained
  model moves ~1% of its scale), which would hide any layout bug. So the reference emulates that
  rounding (`round_activations=True`) and the gap shrinks to 0.05–0.15.
* MoE routing is discontinuous: where a row's k-th and (k+1)-th router logits nearly tie, a tiny
  numeric difference swaps an expert and moves that row and every later one. Inputs are grown
  token by token so every row's routing margin is clear (`reference_routing_gap`).
Bounds are 3–4x the largest difference measured over 18 variants. Tests skip without llama-cpp-python, and say so
when llama.cpp cannot load a variant or run its MTP head.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from hybrid.synth import preset, write_model
from tests.reference import moe_ref
from tests.reference.llama_cpp_rounding import round_activations
from tests.reference.llama_cpp_ref import llama_cpp_logits, llama_cpp_mtp_run, margin_mismatches, require_llama_cpp
from tests.reference.qwen35_ref import (
    load_model,
    reference_hidden,
    reference_logits,
    reference_mtp_logits,
    reference_routing_gap,
)

N_TOKENS = 16


@dataclass(frozen=True)
class Variant:
    arch: str
    types: str
    fused_gate_up_exps: bool = False
    legacy_ssm_in: bool = False
    mtp: bool = True

    @property
    def quantised(self) -> bool:
        return self.types != "F32"

    @property
    def max_abs(self) -> float:
        """Bound on |reference - llama.cpp| for logits, hidden and MTP logits."""
        return 0.4 if self.quantised else 0.005  # measured max over 18 variants: 0.145 / 0.0012

    @property
    def routing_margin(self) -> float:
        """Smallest router-logit margin accepted in the inputs: well above the router noise."""
        return 0.05 if self.quantised else 0.005

    def spec(self):
        layout = dict(fused_gate_up_exps=self.fused_gate_up_exps, legacy_ssm_in=self.legacy_ssm_in)
        return preset("tiny", self.arch, mtp=self.mtp, **layout)

    def __str__(self) -> str:
        extras = {"fused_gate_up": self.fused_gate_up_exps, "legacy_ssm_in": self.legacy_ssm_in, "no_mtp": not self.mtp}
        return "-".join([self.arch, self.types] + [name for name, on in extras.items() if on])


VARIANTS = [
    Variant("qwen35moe", "F32"),
    Variant("qwen35moe", "F32", fused_gate_up_exps=True, mtp=False),
    Variant("qwen35moe", "Q8_0"),
    Variant("qwen35moe", "Q4_K_M", fused_gate_up_exps=True),
    Variant("qwen3next", "F32"),
    Variant("qwen3next", "F32", legacy_ssm_in=True, fused_gate_up_exps=True),
    Variant("qwen3next", "F32", mtp=False),
    Variant("qwen3next", "Q8_0", legacy_ssm_in=True),
    Variant("qwen3next", "Q4_K_M"),
]


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """variant -> (path of its GGUF, clearly routed token ids), made once per module."""
    folder, cases = tmp_path_factory.mktemp("moe_ggufs"), {}

    def make(variant: Variant):
        if variant not in cases:
            path = folder / f"{variant}.gguf"
            write_model(path, variant.spec(), variant.types)
            cases[variant] = path, clear_routing_ids(path, variant)
        return cases[variant]

    return make


def clear_routing_ids(path, variant: Variant, seed: int = 0) -> list[int]:
    """N_TOKENS random token ids whose rows all route clearly in every MoE layer (trunk and MTP).

    Rows are causal, so redrawing the token of the first unclear row keeps the rows before it.
    """
    rng = np.random.default_rng(seed)
    n_vocab = load_model(path).w("token_embd.weight").shape[0]
    ids = rng.integers(n_vocab, size=N_TOKENS).tolist()
    for _ in range(20 * N_TOKENS):
        margins = np.min(
            [
                reference_routing_gap(path, ids, mtp=mtp, round_activations=variant.quantised)
                for mtp in ((False, True) if variant.mtp else (False,))
            ],
            axis=0,
        )
        unclear = np.nonzero(margins <= variant.routing_margin)[0]
        if unclear.size == 0:
            return ids
        ids[unclear[0]] = int(rng.integers(n_vocab))
    raise AssertionError(f"no clearly routed {N_TOKENS}-token input found for {variant}")


def assert_close(ours: np.ndarray, theirs: np.ndarray, variant: Variant, what: str) -> None:
    diff = np.abs(ours - theirs).max()
    assert diff < variant.max_abs, f"{variant} {what}: max |reference - llama.cpp| = {diff:.4g}"
    if ours.shape[-1] > ours.shape[0]:  # logits: argmax agreement by the margin rule
        assert margin_mismatches(ours, theirs, variant.max_abs) == 0, f"{variant} {what}: argmax differs"


def llama_cpp_main_logits(path, ids, variant: Variant) -> np.ndarray:
    try:
        return llama_cpp_logits(path, ids)
    except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
        pytest.skip(f"this llama.cpp cannot load {variant}: {e}")


@pytest.mark.parametrize("variant", VARIANTS, ids=str)
def test_reference_matches_llama_cpp(variant: Variant, case):
    llama_cpp = require_llama_cpp()
    path, ids = case(variant)
    rounding = variant.quantised
    ours = reference_logits(path, ids, round_activations=rounding)
    assert_close(ours, llama_cpp_main_logits(path, ids, variant), variant, "logits")
    if not variant.mtp:
        return
    try:
        run = llama_cpp_mtp_run(path, ids)
    except RuntimeError as e:
        pytest.skip(f"llama.cpp (llama-cpp-python {llama_cpp.__version__}) cannot run the MTP head of {variant}: {e}")
    assert_close(reference_hidden(path, ids, round_activations=rounding), run.hidden, variant, "post-norm hidden")
    assert_close(ours, run.logits, variant, "logits (MTP-enabled context)")
    assert_close(reference_mtp_logits(path, ids, round_activations=rounding), run.mtp_logits, variant, "MTP logits")


def test_activation_rounding_explains_the_quantised_gap(case):
    """Without the emulated rounding the reference sits ~10x further from llama.cpp on a quantised
    file (measured 0.78 vs 0.08 here); if this fails, llama.cpp stopped rounding activations."""
    require_llama_cpp()
    variant = Variant("qwen35moe", "Q8_0")
    path, ids = case(variant)
    theirs = llama_cpp_main_logits(path, ids, variant)
    exact_gap = np.abs(reference_logits(path, ids) - theirs).max()
    rounded_gap = np.abs(reference_logits(path, ids, round_activations=True) - theirs).max()
    assert exact_gap > 4 * rounded_gap


# ----------------------------------------------------------------------------------------------
# llama.cpp-free checks of the pieces


def test_q8_0_rounding_matches_gguf_quantize():
    x = np.random.default_rng(1).standard_normal((3, 256)).astype(np.float32) * 3
    theirs = dequantize(quantize(x, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
    ours = round_activations(x, GGMLQuantizationType.Q8_0)
    step = np.abs(x).reshape(-1, 32).max(axis=1) / 127  # one quantum per block
    assert np.all(np.abs(ours - theirs).reshape(-1, 32) <= step[:, None] * 1.01)  # ties may round apart
    assert np.mean(ours == theirs) > 0.99
    assert round_activations(x, GGMLQuantizationType.Q4_0) == pytest.approx(ours)  # same vec_dot_type


@pytest.mark.parametrize("weight_type", ["Q4_K", "Q5_K", "Q6_K"])
def test_q8_k_rounding_is_8_bit_blocks_of_256(weight_type):
    x = np.random.default_rng(2).standard_normal((2, 512)) * np.array([[0.01], [50.0]])
    ours = round_activations(x, GGMLQuantizationType[weight_type]).reshape(-1, 256)
    blocks = x.reshape(-1, 256)
    biggest = np.abs(blocks).argmax(axis=1)
    step = np.abs(blocks[np.arange(len(blocks)), biggest]) / 127
    levels = ours / step[:, None]
    assert np.allclose(levels, np.round(levels), atol=1e-3) and np.abs(levels).max() <= 127.001
    assert np.allclose(ours[np.arange(len(blocks)), biggest], blocks[np.arange(len(blocks)), biggest], rtol=1e-6)
    assert np.all(np.abs(ours - blocks) <= step[:, None] * 0.5001)


def test_half_precision_and_f32_rounding():
    x = np.random.default_rng(3).standard_normal(64) * 10
    assert np.array_equal(round_activations(x, GGMLQuantizationType.F16), x.astype(np.float32).astype(np.float16))
    bf16 = round_activations(x, GGMLQuantizationType.BF16).astype(np.float32)
    assert np.all(bf16.view(np.uint32) & 0xFFFF == 0)
    assert np.allclose(bf16, x, rtol=2**-8)
    assert np.array_equal(round_activations(x, GGMLQuantizationType.F32), x.astype(np.float32))


@dataclass
class Weights:
    """The minimal model moe_ref needs: numpy-order float64 weights and an exact `linear`."""

    weights: dict

    def linear(self, x, name, expert=None):
        w = self.weights[name] if expert is None else self.weights[name][expert]
        return x @ w.T


def _moe_weights(rng, d=16, n_ff=8, n_expert=5, shared=True) -> dict:
    w = {
        "ffn_gate_inp.weight": rng.standard_normal((n_expert, d)),
        "ffn_gate_exps.weight": rng.standard_normal((n_expert, n_ff, d)) / 4,
        "ffn_up_exps.weight": rng.standard_normal((n_expert, n_ff, d)) / 4,
        "ffn_down_exps.weight": rng.standard_normal((n_expert, d, n_ff)) / 3,
    }
    if shared:
        w |= {
            "ffn_gate_inp_shexp.weight": rng.standard_normal(d) / 4,
            "ffn_gate_shexp.weight": rng.standard_normal((n_ff, d)) / 4,
            "ffn_up_shexp.weight": rng.standard_normal((n_ff, d)) / 4,
            "ffn_down_shexp.weight": rng.standard_normal((d, n_ff)) / 3,
        }
    return w


def _moe_row_by_row(w: dict, x: np.ndarray, k: int) -> np.ndarray:
    """Independent formulation: every expert on every row, weights zero outside the top k."""

    def swiglu_ffn(row, gate, up, down):
        g = gate @ row
        return down @ (g / (1 + np.exp(-g)) * (up @ row))

    out = []
    for row in x:
        p = np.exp(w["ffn_gate_inp.weight"] @ row)
        p /= p.sum()
        keep = p >= np.sort(p)[-k]
        weights = np.where(keep, p, 0.0) / p[keep].sum()
        experts = zip(w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"], w["ffn_down_exps.weight"])
        y = sum(we * swiglu_ffn(row, *mats) for we, mats in zip(weights, experts))
        if "ffn_gate_shexp.weight" in w:
            gate = 1 / (1 + np.exp(-(w["ffn_gate_inp_shexp.weight"] @ row)))
            shared = (w["ffn_gate_shexp.weight"], w["ffn_up_shexp.weight"], w["ffn_down_shexp.weight"])
            y = y + gate * swiglu_ffn(row, *shared)
        out.append(y)
    return np.array(out)


@pytest.mark.parametrize("shared", [True, False])
def test_moe_ffn_matches_row_by_row_formula(shared):
    rng = np.random.default_rng(4)
    w, x = _moe_weights(rng, shared=shared), rng.standard_normal((7, 16))
    expected = _moe_row_by_row(w, x, k=2)
    assert moe_ref.moe_ffn(Weights({f"blk.0.{n}": a for n, a in w.items()}), x, "blk.0.", 2) == pytest.approx(expected)

    # the fused tensor {D, 2·n_ff, E} stacks gate then up along the output axis
    fused = {n: a for n, a in w.items() if n not in ("ffn_gate_exps.weight", "ffn_up_exps.weight")}
    fused["ffn_gate_up_exps.weight"] = np.concatenate([w["ffn_gate_exps.weight"], w["ffn_up_exps.weight"]], axis=1)
    assert moe_ref.moe_ffn(Weights(fused), x, "", 2) == pytest.approx(expected)
    assert moe_ref.routing_gap(Weights(w), x, "", 2).min() > 0


def test_qwen3next_legacy_ssm_in_equals_split_projections():
    """ssm_in holds [q_g, k_g, v_g (r·d), z_g (r·d)] per k-head group g; the split layout holds
    [all q | all k | all v] and all z. Built from the same rows, both give the same inputs."""
    rng = np.random.default_rng(5)
    h_k, h_v, d, dim = 2, 6, 4, 12
    r = h_v // h_k
    qkv = rng.standard_normal((2 * h_k * d + h_v * d, dim))
    z, ba = rng.standard_normal((h_v * d, dim)), rng.standard_normal((2 * h_v, dim))
    q, k, v = (x.reshape(h_k, -1, dim) for x in (qkv[: h_k * d], qkv[h_k * d : 2 * h_k * d], qkv[2 * h_k * d :]))
    per_group = np.concatenate([q, k, v, z.reshape(h_k, -1, dim)], axis=1)  # (H_k, 2d + 2rd, dim)
    split = Weights({"attn_qkv.weight": qkv, "attn_gate.weight": z, "ssm_ba.weight": ba})
    legacy = Weights({"ssm_in.weight": per_group.reshape(-1, dim), "ssm_ba.weight": ba})
    a = rng.standard_normal((3, dim))
    from_legacy = moe_ref.qwen3next_gdn_projections(legacy, a, "", h_k, h_v, d)
    for ours, theirs in zip(from_legacy, moe_ref.qwen3next_gdn_projections(split, a, "", h_k, h_v, d)):
        assert ours == pytest.approx(theirs)

    # ssm_ba: per group g, r beta rows then r alpha rows; v-head j = g·r + i
    _, _, b, alpha = moe_ref.qwen3next_gdn_projections(split, a, "", h_k, h_v, d)
    g, i = 1, 2
    assert b[:, g * r + i] == pytest.approx(a @ ba[g * 2 * r + i])
    assert alpha[:, g * r + i] == pytest.approx(a @ ba[g * 2 * r + r + i])
