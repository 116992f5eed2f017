"""Slow, obvious numpy float64 reference forward for llama.cpp's GDN hybrids `qwen35` (dense),
`qwen35moe` and `qwen3next` (MoE; their differing parts live in moe_ref.py).

Written straight from docs/MODEL_FORMAT.md §3 (trunk) and §4.1–4.2 (MTP head). It is an oracle, so
it favours readability over speed: whole-sequence matmuls per layer, and plain Python loops over
tokens for the two things that are sequential (the DeltaNet recurrence, causal attention).
It reads tensors with `gguf.GGUFReader` + `gguf.quants.dequantize` only — never the engine's own
reader or kernels — so a bug shared by the engine and this file is unlikely.

Public API (token ids are one sequence starting at position 0):
    reference_logits(model_path, token_ids)     -> float64 (n, n_vocab)
    reference_hidden(model_path, token_ids)     -> float64 (n, D)   post-final-norm hidden (MTP input)
    reference_mtp_logits(model_path, token_ids) -> float64 (n, n_vocab)
    reference_routing_gap(model_path, token_ids, mtp=False) -> float64 (n,)  MoE top-k margin per row
Each takes `round_activations=True` to round activations before every product with a quantised
weight the way llama.cpp's CPU backend does (llama_cpp_rounding.py): exact math by default, a
tight llama.cpp comparison on quantised files with it.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
from dataclasses import dataclass

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

from tests.reference import moe_ref
from tests.reference.llama_cpp_rounding import MIN_TYPES, block_mins, q8_1_min_term
from tests.reference.llama_cpp_rounding import round_activations as _llama_cpp_rounded

ARCHS = ("qwen35", "qwen35moe", "qwen3next")


@dataclass(frozen=True)
class Hparams:
    arch: str
    n_layer_all: int  # block_count: trunk layers + MTP layers
    n_nextn: int  # MTP layers (0 or 1)
    recurrent: tuple[bool, ...]  # per trunk layer: GDN (True) or full attention (False)
    d_model: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_rot: int
    rope_theta: float
    eps: float
    conv_kernel: int
    gdn_k_heads: int  # H_k
    gdn_v_heads: int  # H_v
    gdn_head_dim: int  # d_k = d_v
    n_expert_used: int  # MoE top-k (0 for dense qwen35)

    @property
    def n_trunk(self) -> int:
        return self.n_layer_all - self.n_nextn


@dataclass(frozen=True)
class Model:
    hp: Hparams
    weights: dict[str, np.ndarray]  # numpy shapes (ggml ne reversed), float64
    types: dict[str, int]  # ggml type of each tensor in the file
    round_activations: bool = False  # emulate llama.cpp's activation rounding in `linear`
    mins: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # Q4_1/Q5_1 m per block

    def w(self, name: str) -> np.ndarray:
        return self.weights[name]

    def linear(self, x: np.ndarray, name: str, expert: int | None = None) -> np.ndarray:
        """x @ Wᵀ for weight `name` (or its slice `expert` of a stacked 3-D tensor): (T, out)."""
        w = self.weights[name] if expert is None else self.weights[name][expert]
        if self.round_activations:
            xr = _llama_cpp_rounded(x, self.types[name])
            if name in self.mins:    # their dot's m·s terms (`q8_1_min_term`)
                mins = self.mins[name] if expert is None else self.mins[name][expert]
                return xr @ w.T + q8_1_min_term(x, mins)
            x = xr
        return x @ w.T

    def w_or(self, name: str, fallback: str) -> np.ndarray:
        return self.weights.get(name, self.weights[fallback])


# ----------------------------------------------------------------------------------------------
# loading


def _field(reader: GGUFReader, key: str, default=None):
    field = reader.fields.get(key)
    if field is None:
        if default is None:
            raise ValueError(f"GGUF key {key!r} missing")
        return default
    return field.contents()


def _hparams(reader: GGUFReader) -> Hparams:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ValueError(f"reference forward supports archs {', '.join(ARCHS)}, got {arch!r}")
    k = lambda name, default=None: _field(reader, f"{arch}.{name}", default)  # noqa: E731
    n_all = int(k("block_count"))
    n_nextn = int(k("nextn_predict_layers", 0))
    n_trunk = n_all - n_nextn
    flags = reader.fields.get(f"{arch}.attention.recurrent_layers")
    if flags is not None:
        recurrent = tuple(bool(x) for x in flags.contents()[:n_trunk])
    else:  # §1.2: layer i is full attention iff (i+1) % interval == 0
        interval = int(k("full_attention_interval", 4))
        recurrent = tuple((i + 1) % interval != 0 for i in range(n_trunk))
    head_dim = int(k("attention.key_length"))
    return Hparams(
        arch=arch,
        n_layer_all=n_all,
        n_nextn=n_nextn,
        recurrent=recurrent,
        d_model=int(k("embedding_length")),
        n_head=int(k("attention.head_count")),
        n_head_kv=int(k("attention.head_count_kv")),
        head_dim=head_dim,
        n_rot=int(k("rope.dimension_count", head_dim)),
        rope_theta=float(k("rope.freq_base", 10000.0)),
        eps=float(k("attention.layer_norm_rms_epsilon")),
        conv_kernel=int(k("ssm.conv_kernel")),
        gdn_k_heads=int(k("ssm.group_count")),
        gdn_v_heads=int(k("ssm.time_step_rank")),
        gdn_head_dim=int(k("ssm.state_size")),
        n_expert_used=int(k("expert_used_count", 0)),
    )


def _dequantized(tensor) -> np.ndarray:
    numpy_shape = tuple(int(n) for n in reversed(tensor.shape))
    values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
    return np.asarray(values, dtype=np.float64).reshape(numpy_shape)


@functools.lru_cache(maxsize=4)
def _load(model_path: str) -> Model:
    reader = GGUFReader(model_path)
    weights = {t.name: _dequantized(t) for t in reader.tensors}
    for arr in weights.values():
        arr.setflags(write=False)  # the cache is shared between callers
    types = {t.name: int(t.tensor_type) for t in reader.tensors}
    mins = {t.name: block_mins(np.asarray(t.data), int(t.shape[0])) for t in reader.tensors
            if t.tensor_type in MIN_TYPES}
    return Model(_hparams(reader), weights, types, mins=mins)


def _model(model_path: str, round_activations: bool) -> Model:
    m = _load(model_path)
    return dataclasses.replace(m, round_activations=True) if round_activations else m


def load_model(model_path) -> Model:
    """Dequantised float64 weights of a qwen35 / qwen35moe / qwen3next GGUF, cached per resolved path."""
    return _load(_key(model_path))


def _key(model_path) -> str:
    return str(pathlib.Path(model_path).resolve())


# ----------------------------------------------------------------------------------------------
# elementwise helpers


def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    # weights are used as stored: the +1 of Gemma-style norms is already folded in (§2.7)
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _l2_norm(x: np.ndarray, eps: float) -> np.ndarray:
    # ggml_l2_norm: x / max(||x||, eps)
    return x / np.maximum(np.linalg.norm(x, axis=-1, keepdims=True), eps)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def _silu(x: np.ndarray) -> np.ndarray:
    return x * _sigmoid(x)


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


def _rope_neox(x: np.ndarray, positions: np.ndarray, n_rot: int, theta: float) -> np.ndarray:
    """NEOX RoPE on the first n_rot dims of each head: pairs (i, i + n_rot/2). x: (T, heads, d_h).

    qwen35's IMROPE with equal t/h/w positions (text) is exactly this (§3.3 step 4).
    """
    half = n_rot // 2
    angle = positions[:, None] * theta ** (-2.0 * np.arange(half) / n_rot)  # (T, half)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    out = x.copy()
    lo, hi = x[..., :half], x[..., half:n_rot]
    out[..., :half] = lo * cos - hi * sin
    out[..., half:n_rot] = lo * sin + hi * cos
    return out


# ----------------------------------------------------------------------------------------------
# blocks


def _gated_attention(m: Model, layer: int, a: np.ndarray) -> np.ndarray:
    """§3.3: gated full attention over rows 0..T-1 of one sequence (row t at position t)."""
    hp, pre = m.hp, f"blk.{layer}."
    n_tok, d_h = a.shape[0], hp.head_dim
    q_and_gate = m.linear(a, pre + "attn_q.weight").reshape(n_tok, hp.n_head, 2 * d_h)
    q, gate = q_and_gate[..., :d_h], q_and_gate[..., d_h:]  # packed [query | gate] per head
    k = m.linear(a, pre + "attn_k.weight").reshape(n_tok, hp.n_head_kv, d_h)
    v = m.linear(a, pre + "attn_v.weight").reshape(n_tok, hp.n_head_kv, d_h)
    q = _rms_norm(q, m.w(pre + "attn_q_norm.weight"), hp.eps)
    k = _rms_norm(k, m.w(pre + "attn_k_norm.weight"), hp.eps)
    positions = np.arange(n_tok, dtype=np.float64)
    q = _rope_neox(q, positions, hp.n_rot, hp.rope_theta)
    k = _rope_neox(k, positions, hp.n_rot, hp.rope_theta)

    heads_per_kv = hp.n_head // hp.n_head_kv
    scale = 1.0 / np.sqrt(d_h)
    out = np.empty((n_tok, hp.n_head, d_h))
    for t in range(n_tok):
        for h in range(hp.n_head):
            g = h // heads_per_kv  # consecutive query heads share a KV head
            scores = (k[: t + 1, g] @ q[t, h]) * scale  # causal: keys 0..t
            p = np.exp(scores - scores.max())
            out[t, h] = (p / p.sum()) @ v[: t + 1, g]
    out = out * _sigmoid(gate)
    return m.linear(out.reshape(n_tok, hp.n_head * d_h), pre + "attn_output.weight")


def _gated_delta_net(m: Model, layer: int, a: np.ndarray) -> np.ndarray:
    """§3.4: Gated DeltaNet from a zero state (conv and recurrent) over rows 0..T-1."""
    hp, pre = m.hp, f"blk.{layer}."
    n_tok = a.shape[0]
    h_k, h_v, d, kernel = hp.gdn_k_heads, hp.gdn_v_heads, hp.gdn_head_dim, hp.conv_kernel
    key_dim = h_k * d

    if hp.arch == "qwen3next":  # fused ssm_ba (and maybe legacy ssm_in), grouped V heads
        mix, z, b, alpha = moe_ref.qwen3next_gdn_projections(m, a, pre, h_k, h_v, d)
    else:
        mix = m.linear(a, pre + "attn_qkv.weight")  # (T, C): [q | k | v]
        z = m.linear(a, pre + "attn_gate.weight")
        b = m.linear(a, pre + "ssm_beta.weight")  # (T, H_v)
        alpha = m.linear(a, pre + "ssm_alpha.weight")
    z = z.reshape(n_tok, h_v, d)
    beta = _sigmoid(b)
    log_decay = m.w(pre + "ssm_a") * _softplus(alpha + m.w(pre + "ssm_dt.bias"))  # g <= 0

    # causal depthwise conv: tap j multiplies mix_{t-K+1+j}; tap K-1 is the current token
    conv_w = m.w(pre + "ssm_conv1d.weight")  # (C, K), oldest tap first
    padded = np.concatenate([np.zeros((kernel - 1, mix.shape[1])), mix])
    conv = np.stack([np.sum(conv_w.T * padded[t : t + kernel], axis=0) for t in range(n_tok)])
    u = _silu(conv)

    q = _l2_norm(u[:, :key_dim].reshape(n_tok, h_k, d), hp.eps)
    k = _l2_norm(u[:, key_dim : 2 * key_dim].reshape(n_tok, h_k, d), hp.eps)
    v = u[:, 2 * key_dim :].reshape(n_tok, h_v, d)

    # qwen35/qwen35moe: tiled pairing j % H_k (the converter reordered V heads);
    # qwen3next: grouped pairing j // r (V heads in HF order)
    r = h_v // h_k
    k_head = [j // r if hp.arch == "qwen3next" else j % h_k for j in range(h_v)]
    state = np.zeros((h_v, d, d))  # S_j[key index, value index]
    o = np.empty((n_tok, h_v, d))
    for t in range(n_tok):
        for j in range(h_v):
            kh = k_head[j]
            state[j] *= np.exp(log_decay[t, j])  # decay first ...
            delta = beta[t, j] * (v[t, j] - state[j].T @ k[t, kh])  # ... delta on the decayed state
            state[j] += np.outer(k[t, kh], delta)
            o[t, j] = (state[j].T @ q[t, kh]) / np.sqrt(d)  # ... then read
    y = _rms_norm(o, m.w(pre + "ssm_norm.weight"), hp.eps) * _silu(z)  # norm, then gate
    return m.linear(y.reshape(n_tok, h_v * d), pre + "ssm_out.weight")


def _ffn(m: Model, layer: int, x: np.ndarray) -> np.ndarray:
    """§3.5 dense SwiGLU, or the MoE FFN (routed + shared experts) of qwen35moe / qwen3next."""
    pre = f"blk.{layer}."
    if m.hp.n_expert_used:
        return moe_ref.moe_ffn(m, x, pre, m.hp.n_expert_used)
    gate = m.linear(x, pre + "ffn_gate.weight")
    up = m.linear(x, pre + "ffn_up.weight")
    return m.linear(_silu(gate) * up, pre + "ffn_down.weight")


def _decoder_block(
    m: Model, layer: int, h: np.ndarray, recurrent: bool, ffn_inputs: list | None = None
) -> np.ndarray:
    """§3.2 skeleton: pre-norm mixer + residual, pre-norm FFN + residual.

    `ffn_inputs` (optional) collects (layer, normed FFN input) for the MoE routing margins.
    """
    pre, eps = f"blk.{layer}.", m.hp.eps
    a = _rms_norm(h, m.w(pre + "attn_norm.weight"), eps)
    mixer = _gated_delta_net if recurrent else _gated_attention
    h = h + mixer(m, layer, a)
    x = _rms_norm(h, m.w(pre + "post_attention_norm.weight"), eps)
    if ffn_inputs is not None:
        ffn_inputs.append((layer, x))
    return h + _ffn(m, layer, x)


def _lm_head_name(m: Model) -> str:
    return "output.weight" if "output.weight" in m.weights else "token_embd.weight"  # tied fallback


# ----------------------------------------------------------------------------------------------
# whole passes, cached per (model, token ids, rounding)


@dataclass(frozen=True)
class _Pass:
    out: np.ndarray  # trunk: post-norm hidden (n, D); MTP: logits (n, n_vocab)
    ffn_inputs: tuple[tuple[int, np.ndarray], ...]  # (layer, normed FFN input rows); MoE models only


def _ffn_input_log(m: Model) -> list | None:
    """Where a pass keeps its FFN inputs: MoE models only (dense ones have no routing to check)."""
    return [] if m.hp.n_expert_used else None


def _checked_ids(m: Model, token_ids) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n_vocab = m.w("token_embd.weight").shape[0]
    if ids.size == 0 or ids.min() < 0 or ids.max() >= n_vocab:
        raise ValueError(f"token ids must be a non-empty sequence in [0, {n_vocab})")
    return ids


@functools.lru_cache(maxsize=16)
def _trunk_pass(model_path: str, ids: tuple[int, ...], round_activations: bool) -> _Pass:
    m = _model(model_path, round_activations)
    ffn_inputs = _ffn_input_log(m)
    h = m.w("token_embd.weight")[np.asarray(ids)]
    for layer in range(m.hp.n_trunk):
        h = _decoder_block(m, layer, h, m.hp.recurrent[layer], ffn_inputs)
    out = _rms_norm(h, m.w("output_norm.weight"), m.hp.eps)
    out.setflags(write=False)
    return _Pass(out, tuple(ffn_inputs or ()))


@functools.lru_cache(maxsize=16)
def _mtp_pass(model_path: str, ids: tuple[int, ...], round_activations: bool) -> _Pass:
    """§4.1–4.2: row p = MTP head on (x_p at position p, trunk post-norm hidden h_{p-1}; zeros at p = 0)."""
    m = _model(model_path, round_activations)
    if m.hp.n_nextn < 1:
        raise ValueError("model has no MTP (nextn) layer")
    hidden = _trunk_pass(model_path, ids, round_activations).out
    h_prev = np.concatenate([np.zeros((1, hidden.shape[1])), hidden[:-1]])

    layer, eps = m.hp.n_trunk, m.hp.eps
    pre = f"blk.{layer}.nextn."
    embed = m.w_or(pre + "embed_tokens.weight", "token_embd.weight")[np.asarray(ids)]
    joined = np.concatenate(
        [_rms_norm(embed, m.w(pre + "enorm.weight"), eps), _rms_norm(h_prev, m.w(pre + "hnorm.weight"), eps)],
        axis=1,
    )  # embedding half first
    u = m.linear(joined, pre + "eh_proj.weight")
    ffn_inputs = _ffn_input_log(m)
    out = _decoder_block(m, layer, u, recurrent=False, ffn_inputs=ffn_inputs)
    out = _rms_norm(out, m.w_or(pre + "shared_head_norm.weight", "output_norm.weight"), eps)
    head = pre + "shared_head_head.weight"
    logits = m.linear(out, head if head in m.weights else _lm_head_name(m))
    logits.setflags(write=False)
    return _Pass(logits, tuple(ffn_inputs or ()))


# ----------------------------------------------------------------------------------------------
# public API


def _pass_args(model_path, token_ids, round_activations: bool) -> tuple[str, tuple[int, ...], bool]:
    key = _key(model_path)
    ids = _checked_ids(_load(key), token_ids)
    return key, tuple(ids.tolist()), bool(round_activations)


def reference_hidden(model_path, token_ids, *, round_activations: bool = False) -> np.ndarray:
    """Post-final-norm trunk hidden RMSNorm(h_L; output_norm), float64 (n, D)."""
    return _trunk_pass(*_pass_args(model_path, token_ids, round_activations)).out.copy()


def reference_logits(model_path, token_ids, *, round_activations: bool = False) -> np.ndarray:
    """Main-head logits for every position, float64 (n, n_vocab)."""
    key, ids, rounding = _pass_args(model_path, token_ids, round_activations)
    m = _model(key, rounding)
    return m.linear(_trunk_pass(key, ids, rounding).out, _lm_head_name(m))


def reference_mtp_logits(model_path, token_ids, *, round_activations: bool = False) -> np.ndarray:
    """MTP-head logits, float64 (n, n_vocab) (§4.1–4.2).

    Row p = MTP head on (token x_p at position p, trunk post-norm hidden h_{p-1}; zeros for p = 0),
    with the MTP block's own causal KV over rows 0..p. h_{p-1} already "knows" x_p's context and
    the row adds x_p itself, so row p drafts x_{p+1}: the same target as the main head's row p.
    """
    return _mtp_pass(*_pass_args(model_path, token_ids, round_activations)).out.copy()


def reference_routing_gap(
    model_path, token_ids, *, mtp: bool = False, round_activations: bool = False
) -> np.ndarray:
    """Per row, float64 (n,): the smallest MoE routing margin — router logit of the k-th chosen
    expert minus the best unchosen one — over the MoE layers of the trunk pass (or of the MTP
    block with mtp=True). inf everywhere for dense models.

    Near zero, a tiny numeric difference can swap an expert and move that row (and, through
    attention and the GDN state, every later row) by a whole expert's output; comparisons against
    llama.cpp use inputs whose margins are clear.
    """
    args = _pass_args(model_path, token_ids, round_activations)
    m = _model(args[0], args[2])
    if not m.hp.n_expert_used:
        return np.full(len(args[1]), np.inf)
    passed = (_mtp_pass if mtp else _trunk_pass)(*args)
    gaps = [moe_ref.routing_gap(m, x, f"blk.{layer}.", m.hp.n_expert_used) for layer, x in passed.ffn_inputs]
    return np.min(gaps, axis=0)
