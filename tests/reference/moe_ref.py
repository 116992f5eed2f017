"""The parts of the numpy float64 reference that differ for `qwen35moe` and `qwen3next`.

qwen35_ref.py runs the shared skeleton (§3.2) and calls in here for:
* the MoE FFN of both MoE archs (§3.5): softmax router over all experts, top-k, renormalised
  weights, SwiGLU experts from the stacked 3-D tensors, plus the sigmoid-gated shared expert;
* qwen3next's GDN input projections (§2.4): `attn_qkv`/`attn_gate` or the legacy fused
  `ssm_in`, and the fused `ssm_ba`; its grouped V-head → K-head pairing lives in qwen35_ref.
Details checked against llama.cpp's `src/models/qwen35moe.cpp`, `qwen3next.cpp` and
`build_moe_ffn` (`src/llama-graph.cpp`), and numerically against llama.cpp itself
(test_moe_reference_vs_llama_cpp.py). Only numpy here; the model is anything with `weights` (name
-> float64 array in numpy order, ggml `ne` reversed) and `linear` (qwen35_ref.Model).
"""

from __future__ import annotations

from typing import Mapping, Protocol

import numpy as np


class Weights(Protocol):
    weights: Mapping[str, np.ndarray]

    def linear(self, x: np.ndarray, name: str, expert: int | None = None) -> np.ndarray:
        """x @ Wᵀ for weight `name`, or for slice `expert` of a stacked 3-D weight."""


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return gate * _sigmoid(gate) * up


def router_probabilities(m: Weights, x: np.ndarray, prefix: str) -> np.ndarray:
    """Softmax over all experts of the F32 router `ffn_gate_inp` {D, E}: (T, E)."""
    logits = m.linear(x, prefix + "ffn_gate_inp.weight")
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def top_k_experts(probs: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k most probable experts per row, most probable first: (T, k)."""
    return np.argsort(-probs, axis=-1, kind="stable")[:, :k]


def routing_gap(m: Weights, x: np.ndarray, prefix: str, k: int) -> np.ndarray:
    """Per row: router logit of the k-th chosen expert minus that of the best unchosen one.

    A small gap means a tiny numeric difference (e.g. llama.cpp's 8-bit activations) can swap an
    expert, which moves that row's output by a whole expert: tests use it to pick fair inputs.
    """
    logits = np.sort(m.linear(x, prefix + "ffn_gate_inp.weight"), axis=-1)
    if k >= logits.shape[1]:
        return np.full(x.shape[0], np.inf)  # every expert is always used: nothing can swap
    return logits[:, -k] - logits[:, -k - 1]


def _expert_gate_up(m: Weights, x: np.ndarray, prefix: str, e: int) -> tuple[np.ndarray, np.ndarray]:
    """Gate and up projections (T, n_ff_exp) of rows x by expert e, from separate or fused tensors."""
    fused = prefix + "ffn_gate_up_exps.weight"
    if fused not in m.weights:
        return m.linear(x, prefix + "ffn_gate_exps.weight", e), m.linear(x, prefix + "ffn_up_exps.weight", e)
    gate_up = m.linear(x, fused, e)  # {D, 2·n_ff_exp, E}: outputs [0, n_ff) gate, [n_ff, 2·n_ff) up
    n_ff = gate_up.shape[1] // 2
    return gate_up[:, :n_ff], gate_up[:, n_ff:]


def moe_ffn(m: Weights, x: np.ndarray, prefix: str, n_expert_used: int) -> np.ndarray:
    """§3.5 routed experts + gated shared expert for rows x (T, D) -> (T, D).

    llama.cpp: build_moe_ffn(..., SILU, norm_w=true, expert_weights_scale (not written for Qwen,
    so 0 = off), gating SOFTMAX); shared expert = build_ffn(SILU, PAR) times sigmoid(w_sh · x).
    """
    probs = router_probabilities(m, x, prefix)
    chosen = top_k_experts(probs, n_expert_used)
    renorm = np.take_along_axis(probs, chosen, axis=1).sum(axis=1)  # top-k weights sum to 1
    out = np.zeros_like(x)
    for e in np.unique(chosen):
        e = int(e)
        rows = np.nonzero((chosen == e).any(axis=1))[0]
        gate, up = _expert_gate_up(m, x[rows], prefix, e)
        expert_out = m.linear(_swiglu(gate, up), prefix + "ffn_down_exps.weight", e)  # {n_ff_exp, D, E}
        out[rows] += (probs[rows, e] / renorm[rows])[:, None] * expert_out

    if prefix + "ffn_gate_shexp.weight" not in m.weights:
        return out  # no shared expert
    shared = _swiglu(m.linear(x, prefix + "ffn_gate_shexp.weight"), m.linear(x, prefix + "ffn_up_shexp.weight"))
    shared = m.linear(shared, prefix + "ffn_down_shexp.weight")
    # F32 {D} (or {D, 1} as the HF converter writes it): one gate per row
    scalar_gate = _sigmoid(x @ m.weights[prefix + "ffn_gate_inp_shexp.weight"].reshape(-1))
    return out + scalar_gate[:, None] * shared


def qwen3next_gdn_projections(
    m: Weights, a: np.ndarray, prefix: str, h_k: int, h_v: int, d: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """qwen3next GDN inputs for rows a (T, D): (mix [q|k|v] (T, C), z (T, H_v·d), b, alpha (T, H_v)).

    V heads stay in HF's grouped order (v-head j = g·r + i belongs to k-head g, r = H_v/H_k).
    `ssm_ba` {D, 2·H_v} holds per k-head group g: [b_{g,0..r-1}, a_{g,0..r-1}].
    The legacy `ssm_in` {D, 2·key_dim + 2·value_dim} holds per group g: [q_g, k_g, v_g (r·d), z_g (r·d)];
    it is regrouped here into the [all q | all k | all v] conv channels the new layout stores.
    """
    n_tok, r = a.shape[0], h_v // h_k
    if prefix + "ssm_in.weight" not in m.weights:
        mix = m.linear(a, prefix + "attn_qkv.weight")
        z = m.linear(a, prefix + "attn_gate.weight")
    else:
        qkvz = m.linear(a, prefix + "ssm_in.weight").reshape(n_tok, h_k, 2 * d + 2 * r * d)
        q, k = qkvz[..., :d], qkvz[..., d : 2 * d]
        v, z = qkvz[..., 2 * d : 2 * d + r * d], qkvz[..., 2 * d + r * d :]
        mix = np.concatenate([x.reshape(n_tok, -1) for x in (q, k, v)], axis=1)
        z = z.reshape(n_tok, h_v * d)
    ba = m.linear(a, prefix + "ssm_ba.weight").reshape(n_tok, h_k, 2 * r)
    b, alpha = ba[..., :r].reshape(n_tok, h_v), ba[..., r:].reshape(n_tok, h_v)
    return mix, z, b, alpha
