"""Bind a model file's tensors into per-layer weight records, once, before the first forward.

Matrices stay in their stored ggml type as zero-copy views of the mapped file (the matvec
kernels read them directly). Two qwen3next tensors are regrouped once, by whole rows (a row of
any ggml type is self-contained): the fused `ssm_ba` into ssm_beta/ssm_alpha and the legacy
`ssm_in` into attn_qkv/attn_gate, so the layer loop sees one GDN layout for all three archs
(owned copies: ssm_ba is tiny; ssm_in is a few % of a legacy file). Small F32 vectors (norms,
ssm_a, dt bias, conv taps) are copied into owned, writable float32 arrays: they are tiny, and
Numba types a read-only memmap view differently from a plain array, which would double every
kernel's compile.

Placement: `bind_weights(..., backend, placement)` hands the host records to the backend, which
may swap some `data` for device arrays (`place_weights`); a record's `location` says where its
bytes live, and the ops dispatch on it (gpu/ops.py).
"""
from __future__ import annotations

import functools

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any, Union

import numpy as np

from cpu.activations import CHUNK as ACT_CHUNK
from cpu.ggml_types import SUPPORTED

from .config import ModelConfig
from .errors import ModelError


@dataclass(frozen=True)
class Matrix:
    """W as the PyTorch (out = rows, in = cols) matrix: y = W x. `data` is uint8 (rows, row_bytes),
    a host array (usually a view of the mapped file) or a device array."""
    name: str
    wtype: int
    data: np.ndarray
    rows: int
    cols: int

    @property
    def location(self) -> str:
        return _location(self.data)


@dataclass(frozen=True)
class DenseFFN:
    gate: Matrix
    up: Matrix
    down: Matrix


@dataclass(frozen=True)
class Experts(Matrix):
    """E stacked matrices of one kind: `data` is uint8 (E, rows, row_bytes) and data[e], expert
    e's (rows, cols) matrix, is C-contiguous (also for the halves of a fused gate_up tensor)."""


@dataclass(frozen=True)
class MoEFFN:
    router: Matrix             # ffn_gate_inp (E, D), F32
    gate: Experts              # (E, n_ff_exp, D): ffn_gate_exps, or rows [0, n_ff_exp) of ffn_gate_up_exps
    up: Experts                # ffn_up_exps, or rows [n_ff_exp, 2·n_ff_exp) of ffn_gate_up_exps
    down: Experts              # (E, D, n_ff_exp)
    n_used: int                # k experts per token
    shared: DenseFFN | None    # the shared expert, when the model has one
    shared_gate: Matrix | None  # ffn_gate_inp_shexp {D} as a 1-row matrix: σ(w·x) scales the shared expert
    cache: Any = None           # gpu.expert_cache.ExpertCache: the routed experts the GPU runs (cached, over PCIe)

    @functools.cached_property
    def expert_bytes(self) -> int:
        """Weight bytes of one routed expert (gate + up + down)."""
        return self.gate.data[0].nbytes + self.up.data[0].nbytes + self.down.data[0].nbytes


@dataclass(frozen=True)
class SplitFFN:
    """A dense FFN cut along its hidden dimension: `device` holds rows [0, r) of gate and up and
    columns [0, r) of down, `host` the rest. Each half's SwiGLU needs only its own rows, so
    FFN(x) = device(x) + host(x) lets both sides of the machine read their share of one layer at
    once (`split_dense_ffn`; the backend's `ffn` runs it)."""
    device: DenseFFN
    host: DenseFFN


FFN = Union[DenseFFN, MoEFFN, SplitFFN]


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


def bind_weights(model_file, backend=None, placement=None, expert_cache=None, pcie_share: float = 0.0,
                 stream_experts: bool = False, ffn_split=None) -> ModelWeights:
    """Per-layer records for a qwen35, qwen35moe or qwen3next model, placed by `backend`
    (hybrid.backend) following `placement`, `expert_cache` (layer → routed experts to copy to
    the GPU: `Plan.expert_cache`), `pcie_share` (of each row's other routed experts, the share
    the GPU reads from host memory) and `stream_experts` (prompt chunks stream the uncached
    experts in) and `ffn_split` (layer → the hidden rows of its host dense FFN the GPU computes:
    `Plan.ffn_split`); host records when backend is None."""
    cfg: ModelConfig = model_file.config
    t = _Tensors(model_file.tensors, cfg)
    embd = t.matrix("token_embd.weight")
    output = embd if cfg.tied_output else t.matrix("output.weight")
    output_norm = t.vector("output_norm.weight")
    layers = tuple(_gdn_layer(t, i) if cfg.is_recurrent(i) else _attention_layer(t, i)
                   for i in range(cfg.n_layer))
    mtp = _mtp_block(t, cfg.n_layer, embd, output, output_norm) if cfg.n_nextn else None
    weights = ModelWeights(cfg, embd, output_norm, output, layers, mtp)
    return weights if backend is None else backend.place_weights(weights, model_file, placement, expert_cache, pcie_share,
                                                                 stream_experts, ffn_split)


def lm_head(weights: ModelWeights, hidden: np.ndarray, out: np.ndarray, ops) -> None:
    """out (n, n_vocab) = W_output · hidden (n, D), hidden already through output_norm."""
    ops.matvec(weights.output.wtype, weights.output.data, hidden, out)


# --- placement --------------------------------------------------------------------------------

def _location(data) -> str:
    return "cpu" if isinstance(data, np.ndarray) else "gpu"


_RECORDS = (ModelWeights, AttentionLayer, GDNLayer, DenseFFN, MoEFFN, SplitFFN, MTPBlock)


def place_weights(weights: ModelWeights, on_gpu: Callable[[str], bool], upload) -> ModelWeights:
    """The same records with the matrices `on_gpu(name)` picks, and every small vector, replaced
    by `upload(host array)`. A record shared by two fields (tied output and embedding, the MTP
    head's fallbacks) is uploaded once and stays shared."""
    placed: dict[int, object] = {}

    def place(obj):
        if id(obj) in placed:
            return placed[id(obj)]
        if isinstance(obj, Matrix):
            new = replace(obj, data=upload(obj.data)) if on_gpu(obj.name) else obj
        elif isinstance(obj, np.ndarray):
            new = upload(obj)
        elif isinstance(obj, _RECORDS):
            new = replace(obj, **{f.name: place(getattr(obj, f.name)) for f in fields(obj) if f.name != "config"})
        elif isinstance(obj, tuple):
            new = tuple(place(o) for o in obj)
        else:
            new = obj
        placed[id(obj)] = new
        return new
    return place(weights)


def split_rows(down_type: int, n_ff: int, share: float) -> int:
    """The hidden rows the device half of a split FFN takes for `share` of its bytes: a multiple
    of the activations' chunk (`cpu.activations.CHUNK`, 256: a whole block of down's columns for
    every type, and a whole unit of the host half's activation rounding), at most n_ff."""
    step = max(ACT_CHUNK, SUPPORTED[down_type].block_elems)
    return min(n_ff, int(n_ff * share) // step * step)


def split_dense_ffn(ffn: DenseFFN, rows: int) -> SplitFFN:
    """ffn cut after hidden row `rows` (`split_rows`), both halves host records: gate and up are
    row views of the file, down's columns are copied, as a column slice is no contiguous matrix."""
    down_type, n_ff = SUPPORTED[ffn.down.wtype], ffn.gate.rows
    if not 0 < rows < n_ff or rows % down_type.block_elems:
        raise ModelError(f"{ffn.down.name}: cannot split {n_ff} hidden rows after row {rows}")

    def rows_of(m: Matrix, start: int, stop: int) -> Matrix:
        return Matrix(f"{m.name}[{start}:{stop}]", m.wtype, m.data[start:stop], stop - start, m.cols)

    def columns_of(m: Matrix, start: int, stop: int) -> Matrix:
        data = m.data[:, down_type.row_bytes(start):down_type.row_bytes(stop)]
        return Matrix(f"{m.name}[:, {start}:{stop}]", m.wtype, np.ascontiguousarray(data), m.rows, stop - start)

    def half(start: int, stop: int) -> DenseFFN:
        return DenseFFN(rows_of(ffn.gate, start, stop), rows_of(ffn.up, start, stop), columns_of(ffn.down, start, stop))
    return SplitFFN(half(0, rows), half(rows, n_ff))


def iter_matrices(weights: ModelWeights):
    """Every distinct Matrix / Experts record of the model."""
    seen: set[int] = set()

    def walk(obj):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, Matrix):
            yield obj
        elif isinstance(obj, _RECORDS):
            for f in fields(obj):
                yield from walk(getattr(obj, f.name))
        elif isinstance(obj, tuple):
            for o in obj:
                yield from walk(o)
    return list(walk(weights))


# --- binding helpers --------------------------------------------------------------------------

class _Tensors:
    def __init__(self, tensors, config: ModelConfig):
        self.tensors = tensors
        self.config = config

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

    def row_vector(self, name: str) -> Matrix:
        """A 1-D weight {D} as a 1-row matrix, so a matvec gives its dot with each input row."""
        info = self.get(name)
        return Matrix(name, info.type.id, info.data.reshape(1, -1), rows=1, cols=info.ne[0])

    def experts(self, name: str) -> Experts:
        info = self.get(name)
        if len(info.ne) != 3:
            raise ModelError(f"{name} has shape {info.ne}; expected 3-D stacked expert matrices")
        return Experts(name, info.type.id, info.data, rows=info.ne[1], cols=info.ne[0])

    def vector(self, name: str) -> np.ndarray:
        return np.array(self.get(name).array(), dtype=np.float32, order="C", copy=True)

    def optional(self, name: str):
        return self.tensors.get(name)


def _ffn(t: _Tensors, p: str) -> FFN:
    if not t.config.is_moe:
        return DenseFFN(t.matrix(p + "ffn_gate.weight"), t.matrix(p + "ffn_up.weight"),
                        t.matrix(p + "ffn_down.weight"))
    if t.optional(p + "ffn_gate_up_exps.weight") is not None:
        gate, up = _split_gate_up(t.experts(p + "ffn_gate_up_exps.weight"))
    else:
        gate, up = t.experts(p + "ffn_gate_exps.weight"), t.experts(p + "ffn_up_exps.weight")
    has_shared = t.optional(p + "ffn_gate_shexp.weight") is not None
    return MoEFFN(
        router=t.matrix(p + "ffn_gate_inp.weight"), gate=gate, up=up,
        down=t.experts(p + "ffn_down_exps.weight"), n_used=t.config.n_expert_used,
        shared=DenseFFN(t.matrix(p + "ffn_gate_shexp.weight"), t.matrix(p + "ffn_up_shexp.weight"),
                        t.matrix(p + "ffn_down_shexp.weight")) if has_shared else None,
        shared_gate=t.row_vector(p + "ffn_gate_inp_shexp.weight") if has_shared else None,
    )


def _split_gate_up(fused: Experts) -> tuple[Experts, Experts]:
    """ffn_gate_up_exps {D, 2·n_ff_exp, E}: per expert, rows [0, n_ff_exp) are the gate and the
    rest the up projection (build_moe_ffn views the product the same way). Slicing rows of each
    expert keeps data[e] contiguous, so no bytes are copied."""
    f = fused.rows // 2
    return (Experts(fused.name + "[gate]", fused.wtype, fused.data[:, :f], f, fused.cols),
            Experts(fused.name + "[up]", fused.wtype, fused.data[:, f:], f, fused.cols))


def _rows_of(m: Matrix, rows: np.ndarray, name: str) -> Matrix:
    """The given output rows of m, in that order, as an owned contiguous matrix."""
    return Matrix(name, m.wtype, np.ascontiguousarray(m.data[rows]), len(rows), m.cols)


def _qwen3next_beta_alpha(t: _Tensors, p: str) -> tuple[Matrix, Matrix]:
    """ssm_ba {D, 2·H_v} holds per k-head group g: [b_{g,0..r−1}, a_{g,0..r−1}] (r = H_v/H_k).
    Split into beta and alpha with rows in v-head order j = g·r + i (qwen3next's grouped order)."""
    c = t.config
    r = c.ssm_n_v_heads // c.ssm_n_k_heads
    ba = t.matrix(p + "ssm_ba.weight")
    b_rows = (np.arange(c.ssm_n_k_heads)[:, None] * 2 * r + np.arange(r)[None, :]).ravel()
    return _rows_of(ba, b_rows, ba.name + "[beta]"), _rows_of(ba, b_rows + r, ba.name + "[alpha]")


def _legacy_qkv_gate(t: _Tensors, p: str) -> tuple[Matrix, Matrix]:
    """Legacy qwen3next ssm_in (HF in_proj_qkvz) holds per k-head group g: [q_g (d), k_g (d),
    v_g (r·d), z_g (r·d)]. Regroup into attn_qkv's [all q | all k | all v] (the conv channel
    order, v heads grouped) and attn_gate's all z — what the converter writes for new files."""
    c = t.config
    d, r = c.ssm_d_state, c.ssm_n_v_heads // c.ssm_n_k_heads
    group = 2 * d + 2 * r * d
    base = np.arange(c.ssm_n_k_heads)[:, None] * group

    def part(start: int, size: int) -> np.ndarray:
        return (base + start + np.arange(size)[None, :]).ravel()

    ssm_in = t.matrix(p + "ssm_in.weight")
    qkv_rows = np.concatenate([part(0, d), part(d, d), part(2 * d, r * d)])
    return (_rows_of(ssm_in, qkv_rows, ssm_in.name + "[qkv]"),
            _rows_of(ssm_in, part(2 * d + r * d, r * d), ssm_in.name + "[z]"))


def _attention_layer(t: _Tensors, i: int) -> AttentionLayer:
    p = f"blk.{i}."
    return AttentionLayer(
        index=i,
        attn_norm=t.vector(p + "attn_norm.weight"),
        q=t.matrix(p + "attn_q.weight"), k=t.matrix(p + "attn_k.weight"),
        v=t.matrix(p + "attn_v.weight"), o=t.matrix(p + "attn_output.weight"),
        q_norm=t.vector(p + "attn_q_norm.weight"), k_norm=t.vector(p + "attn_k_norm.weight"),
        post_norm=t.vector(p + "post_attention_norm.weight"),
        ffn=_ffn(t, p),
    )


def _gdn_layer(t: _Tensors, i: int) -> GDNLayer:
    p = f"blk.{i}."
    conv = t.vector(p + "ssm_conv1d.weight")                 # numpy (C, K)
    if t.optional(p + "ssm_in.weight") is not None:
        qkv, gate = _legacy_qkv_gate(t, p)
    else:
        qkv, gate = t.matrix(p + "attn_qkv.weight"), t.matrix(p + "attn_gate.weight")
    if t.config.arch == "qwen3next":
        beta, alpha = _qwen3next_beta_alpha(t, p)
    else:
        beta, alpha = t.matrix(p + "ssm_beta.weight"), t.matrix(p + "ssm_alpha.weight")
    return GDNLayer(
        index=i,
        attn_norm=t.vector(p + "attn_norm.weight"),
        qkv=qkv, gate=gate, beta=beta, alpha=alpha,
        conv_w=np.ascontiguousarray(conv.T),
        dt_bias=t.vector(p + "ssm_dt.bias"), ssm_a=t.vector(p + "ssm_a"),
        ssm_norm=t.vector(p + "ssm_norm.weight"),
        out=t.matrix(p + "ssm_out.weight"),
        post_norm=t.vector(p + "post_attention_norm.weight"),
        ffn=_ffn(t, p),
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
