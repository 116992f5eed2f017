"""Bind a model file's tensors into per-layer weight records, once, before the first forward.

Matrices stay in their stored ggml type as zero-copy views of the mapped file (the matvec
kernels read them directly). Small F32 vectors (norms, ssm_a, dt bias, conv taps) are
copied into owned, writable float32 arrays: they are tiny, and Numba types a read-only
memmap view differently from a plain array, which would double every kernel's compile.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Union

import numpy as np

from .config import ModelConfig
from .errors import ModelError


@dataclass(frozen=True)
class Matrix:
    """W as the PyTorch (out = rows, in = cols) matrix: y = W x. `data` is uint8 (rows, row_bytes)."""
    name: str
    wtype: int
    data: np.ndarray
    rows: int
    cols: int


@dataclass(frozen=True)
class DenseFFN:
    gate: Matrix
    up: Matrix
    down: Matrix


FFN = DenseFFN     # MoE (router + experts + shared expert) joins this union later


@dataclass(frozen=True)
class AttentionLayer:
    index: int
    attn_norm: np.ndarray      # (D,)
    q: Matrix                  # out 2·n_head·d_h: [query | gate] per head
    k: Matrix
    v: Matrix
    o: Matrix
    q_norm: np.ndarray         # (d_h,)
    k_norm: np.ndarray
    post_norm: np.ndarray      # post_attention_norm: the pre-FFN norm
    ffn: FFN


@dataclass(frozen=True)
class GDNLayer:
    index: int
    attn_norm: np.ndarray
    qkv: Matrix                # out C = [q | k | v] channels
    gate: Matrix               # z, out H_v·d_v
    beta: Matrix               # out H_v
    alpha: Matrix              # out H_v
    conv_w: np.ndarray         # (K, C) taps oldest→current: ssm_conv1d transposed for channel-contiguous loops
    dt_bias: np.ndarray        # (H_v,)
    ssm_a: np.ndarray          # (H_v,) = −exp(A_log), as stored
    ssm_norm: np.ndarray       # (d_v,)
    out: Matrix                # ssm_out, out D
    post_norm: np.ndarray
    ffn: FFN


Layer = Union[AttentionLayer, GDNLayer]


@dataclass(frozen=True)
class MTPBlock:
    """The nextn head at blk.L (MODEL_FORMAT.md §4.1); fallbacks already resolved."""
    eh_proj: Matrix            # in 2D = [enorm(emb) ; hnorm(h)]
    enorm: np.ndarray
    hnorm: np.ndarray
    shared_head_norm: np.ndarray
    embed: Matrix
    head: Matrix
    block: AttentionLayer


@dataclass(frozen=True)
class ModelWeights:
    config: ModelConfig
    token_embd: Matrix
    output_norm: np.ndarray
    output: Matrix             # token_embd when the model has tied embeddings
    layers: tuple[Layer, ...]
    mtp: MTPBlock | None


def bind_weights(model_file) -> ModelWeights:
    """Per-layer records for a qwen35 dense model. MoE archs raise ModelError for now."""
    cfg: ModelConfig = model_file.config
    if cfg.is_moe:
        raise ModelError(f"architecture '{cfg.arch}' (MoE) is not yet supported by the forward pass; "
                         "qwen35 dense models run")
    t = _Tensors(model_file.tensors)
    embd = t.matrix("token_embd.weight")
    output = embd if cfg.tied_output else t.matrix("output.weight")
    output_norm = t.vector("output_norm.weight")
    layers = tuple(_gdn_layer(t, i) if cfg.is_recurrent(i) else _attention_layer(t, i)
                   for i in range(cfg.n_layer))
    mtp = _mtp_block(t, cfg.n_layer, embd, output, output_norm) if cfg.n_nextn else None
    return ModelWeights(cfg, embd, output_norm, output, layers, mtp)


def embed_tokens(weights: ModelWeights, token_ids: np.ndarray, ops, table: Matrix | None = None) -> np.ndarray:
    """float32 (n, D) embedding rows (get_rows through the quant kernels)."""
    m = weights.token_embd if table is None else table
    return ops.dequantize_rows(m.wtype, m.data, token_ids, m.cols)


def lm_head(weights: ModelWeights, hidden: np.ndarray, out: np.ndarray, ops) -> None:
    """out (n, n_vocab) = W_output · hidden (n, D), hidden already through output_norm."""
    ops.matvec(weights.output.wtype, weights.output.data, hidden, out)


# --- binding helpers --------------------------------------------------------------------------

class _Tensors:
    def __init__(self, tensors):
        self.tensors = tensors

    def get(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise ModelError(f"model has no tensor '{name}', which the forward pass needs") from None

    def matrix(self, name: str) -> Matrix:
        info = self.get(name)
        if len(info.ne) != 2:
            raise ModelError(f"{name} has shape {info.ne}; expected a 2-D matrix")
        return Matrix(name, info.type.id, info.data, rows=info.ne[1], cols=info.ne[0])

    def vector(self, name: str) -> np.ndarray:
        return np.array(self.get(name).array(), dtype=np.float32, order="C", copy=True)

    def optional(self, name: str):
        return self.tensors.get(name)


def _dense_ffn(t: _Tensors, p: str) -> DenseFFN:
    return DenseFFN(t.matrix(p + "ffn_gate.weight"), t.matrix(p + "ffn_up.weight"),
                    t.matrix(p + "ffn_down.weight"))


def _attention_layer(t: _Tensors, i: int) -> AttentionLayer:
    p = f"blk.{i}."
    return AttentionLayer(
        index=i,
        attn_norm=t.vector(p + "attn_norm.weight"),
        q=t.matrix(p + "attn_q.weight"), k=t.matrix(p + "attn_k.weight"),
        v=t.matrix(p + "attn_v.weight"), o=t.matrix(p + "attn_output.weight"),
        q_norm=t.vector(p + "attn_q_norm.weight"), k_norm=t.vector(p + "attn_k_norm.weight"),
        post_norm=t.vector(p + "post_attention_norm.weight"),
        ffn=_dense_ffn(t, p),
    )


def _gdn_layer(t: _Tensors, i: int) -> GDNLayer:
    p = f"blk.{i}."
    conv = t.vector(p + "ssm_conv1d.weight")                 # numpy (C, K)
    return GDNLayer(
        index=i,
        attn_norm=t.vector(p + "attn_norm.weight"),
        qkv=t.matrix(p + "attn_qkv.weight"), gate=t.matrix(p + "attn_gate.weight"),
        beta=t.matrix(p + "ssm_beta.weight"), alpha=t.matrix(p + "ssm_alpha.weight"),
        conv_w=np.ascontiguousarray(conv.T),
        dt_bias=t.vector(p + "ssm_dt.bias"), ssm_a=t.vector(p + "ssm_a"),
        ssm_norm=t.vector(p + "ssm_norm.weight"),
        out=t.matrix(p + "ssm_out.weight"),
        post_norm=t.vector(p + "post_attention_norm.weight"),
        ffn=_dense_ffn(t, p),
    )


def _mtp_block(t: _Tensors, L: int, embd: Matrix, output: Matrix, output_norm: np.ndarray) -> MTPBlock:
    p = f"blk.{L}.nextn."
    head_norm = t.optional(p + "shared_head_norm.weight")
    return MTPBlock(
        eh_proj=t.matrix(p + "eh_proj.weight"),
        enorm=t.vector(p + "enorm.weight"), hnorm=t.vector(p + "hnorm.weight"),
        shared_head_norm=t.vector(p + "shared_head_norm.weight") if head_norm is not None else output_norm,
        embed=t.matrix(p + "embed_tokens.weight") if t.optional(p + "embed_tokens.weight") is not None else embd,
        head=t.matrix(p + "shared_head_head.weight") if t.optional(p + "shared_head_head.weight") is not None else output,
        block=_attention_layer(t, L),
    )
