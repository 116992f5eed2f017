"""The layer loop, written once against an `ops` namespace (cpu.ops or gpu.ops) and a backend.
It is the model's math; where each part runs is the backend's business (hybrid/backend.py).

Per trunk layer (MODEL_FORMAT.md §3.2):
    a = RMSNorm(x; attn_norm);  x += GDN(a) or GatedAttention(a, pos)
    x += FFN(RMSNorm(x; post_attention_norm))
then hidden = RMSNorm(x; output_norm) and logits = W_output · hidden.

Any number of tokens per call (prompt chunks, one-token decode, k-token verify); every
kernel steps all n rows in one launch (the MoE FFN runs each selected expert once over all
the rows routed to it; `last_moe_stats` counts the expert bytes that saves). Scratch buffers
are allocated once per call size and reused, so the layer loop itself allocates nothing.
Not thread-safe: one Forward drives one call at a time (the scratch is shared).

Backends (hybrid/backend.py): "cpu" runs everything on numpy arrays; "gpu" keeps activations
and states on the device, and a layer whose FFN weights stayed in host memory (the default
placement) hands its FFN rows to the CPU and takes the result back (DESIGN.md §3). Either way
forward() returns host arrays. A call's layers and head are one step (`Backend.run_step`),
which the GPU backend replays as a CUDA graph.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, fields

import numpy as np

from cpu.argmax import PICK_COLUMNS
from cpu.moe_kernel import expert_ids
from cpu.threads import STEP_ROWS, ThreadPolicy

from . import compiles
from .backend import make_backend
from .config import ModelConfig
from .errors import HybridError
from .generate import PREFILL_CHUNK
from .sampling import Picks, TopLogits
from .state import DEFAULT_N_CTX, SessionState
from .weights import AttentionLayer, DenseFFN, GDNLayer, MoEFFN, ModelWeights, bind_weights, lm_head

LOGITS_MODES = ("last", "all", "none")
_identities = itertools.count()
# Scratch of step-sized calls (≤ STEP_ROWS rows: decode, every verify size, the MTP head's calls)
# is kept for the forward's lifetime: its buffers are part of each captured step's key, so freeing
# one would make every later step of that size run eagerly and be captured again. Prompt chunks
# (up to PREFILL_CHUNK rows) all use the leading rows of one chunk-sized allocation, so a prompt's
# last, shorter chunk costs no memory of its own; the views of the latest few sizes are kept.
_CHUNK_SIZES_KEPT = 2


class Forward:
    def __init__(self, model_file, ops=None, backend="cpu", placement=None, cuda_graphs: bool = True,
                 expert_cache=None, pcie_share: float = 0.0, stream_experts: bool = False, ffn_split=None):
        """backend: "cpu" | "gpu" (or a backend object); ops: an op set replacing the backend's
        own (tests); placement: which matrices the GPU backend uploads (hybrid/backend.py);
        cuda_graphs: the GPU backend replays repeated steps as CUDA graphs (gpu/runtime/graphs.py);
        expert_cache: layer → routed experts the GPU backend copies to VRAM; pcie_share: the share
        of each row's other routed experts its kernels read from host memory over PCIe
        (gpu/expert_cache.py); stream_experts: prompt chunks run every routed expert on the GPU,
        the uncached ones streamed in per layer (`Plan.streams_experts`); ffn_split: layer → the
        hidden rows of its host dense FFN that the GPU computes beside the CPU (`Plan.ffn_split`)."""
        self.backend = make_backend(backend, ops, cuda_graphs)
        self.ops = ops = self.backend.ops
        self.model_file = model_file          # keeps the mapped tensors alive
        self.config: ModelConfig = model_file.config
        self.weights: ModelWeights = bind_weights(model_file, self.backend, placement, expert_cache, pcie_share,
                                                   stream_experts, ffn_split)
        c = self.config
        self.inv_freq = ops.rope_inv_freq(c.n_rot, c.rope_theta)
        self.grouped_heads = c.gdn_head_pairing == "grouped"
        self._scratch: OrderedDict[int, _Scratch] = OrderedDict()
        self._chunk_rows: _Scratch | None = None     # the prompt chunks' allocation (see _CHUNK_SIZES_KEPT)
        self._allocations = 0
        self.threads: ThreadPolicy | None = None    # CPU threads per call size (None: leave as set)
        compiles.count()                      # start counting before the first kernel compiles
        self.last_moe_stats = MoEStats()      # of the latest forward() / attention_block() call

    def new_state(self, n_ctx: int | None = None, n_ring: int = 0) -> SessionState:
        n_ctx = n_ctx or min(DEFAULT_N_CTX, self.config.context_length)
        return SessionState(self.config, n_ctx, n_ring, self.backend)

    def forward(self, state: SessionState, token_ids, logits: str = "last", snapshot: bool = False,
                pick: bool = False, top: int = 0):
        """Run n tokens at positions state.n_past.. and advance the state.

        Returns (logits, hidden): logits float32 (1, n_vocab) for "last", (n, n_vocab) for
        "all", None for "none"; hidden float32 (n, D) after output_norm (the MTP input).
        pick=True returns the greedy `Picks` of those rows instead of the rows: picked where the
        logits are, so a GPU step sends back a few bytes instead of a vocabulary-wide row.
        top=C > 0 returns instead a `TopLogits` per row, its C best logits (what a top-k sampler
        reads: `SamplerConfig.candidates`), selected where the logits are.
        snapshot=True writes each token's GDN/conv state into the ring (state.rollback).
        """
        ids = self.check_tokens(token_ids)
        if logits not in LOGITS_MODES:
            raise HybridError(f"logits must be one of {', '.join(LOGITS_MODES)}; got {logits!r}")
        n = len(ids)
        state.check_fits(n)
        if snapshot:
            state.check_ring(n)
        self.use_threads(n)
        c, b = self.config, self.backend
        s = self.prepare_rows(n, state.n_past)
        b.copy(s.x, self.embed(ids))
        hidden = b.result("hidden", (n, c.n_embd))
        rows = 0 if logits == "none" else n if logits == "all" else 1
        out = b.result("logits", (rows, c.n_vocab)) if rows else None
        if pick and top:
            raise HybridError("ask for greedy picks or for the top logits, not both")
        head = None           # what comes back in place of the rows: greedy picks or top logits
        if pick and rows:
            Picks.check_vocab(c.n_vocab)
            head = b.result("picks", (rows, PICK_COLUMNS))
        elif top and rows:
            head = b.result("top", (rows, 2 * TopLogits.count(top, c.n_vocab)))
        b.run_step(self._layers_and_head, state, s, snapshot, hidden, out, head, top > 0)
        state.advance(n, snapshot)
        if head is not None:
            got = b.to_host(head)
            return (TopLogits.rows(got, c.n_vocab) if top else Picks.of(got)), b.to_host(hidden)
        return (None if out is None else b.to_host(out)), b.to_host(hidden)

    def embed(self, ids: np.ndarray, table=None):
        """Embedding rows of ids from `table` (token_embd when None), host or backend rows, for
        the caller to copy into its step's input buffer (Backend.embed_rows)."""
        return self.backend.embed_rows(self.weights.token_embd if table is None else table, ids)

    def _layers_and_head(self, state: SessionState, s: "_Scratch", snapshot: bool, hidden, out, head,
                         top: bool) -> None:
        ops, c, w = self.ops, self.config, self.weights
        ops.rms_norm(s.x, w.layers[0].attn_norm, c.rms_eps, s.a)
        for i, layer in enumerate(w.layers):
            if isinstance(layer, GDNLayer):
                self._gdn(layer, state, s, snapshot)
            else:
                self._attention(layer, state.kv[layer.index], s)
            self._residual_ffn(layer, s)
            # the FFN's residual add fused with the next norm: the next layer's, or output_norm
            if i + 1 < len(w.layers):
                ops.add_rms_norm(s.x, s.m, w.layers[i + 1].attn_norm, c.rms_eps, s.a)
            else:
                ops.add_rms_norm(s.x, s.m, w.output_norm, c.rms_eps, hidden)
        if out is not None:
            lm_head(w, hidden[hidden.shape[0] - out.shape[0]:], out, ops)
        if head is not None and top:
            ops.top_logits(out, head.view(np.uint32))
        elif head is not None:
            ops.argmax_rows(out, head)

    def attention_block(self, layer: AttentionLayer, x: np.ndarray, kv, n_before: int) -> None:
        """One full-attention block on rows x (n, D) in place, at positions n_before.., over the
        cache pair kv = (k_cache, v_cache). For the MTP block (blk.L with state.mtp_kv[L]);
        the caller keeps its own position counter. x is a backend array."""
        self.attention_block_on(layer, x, kv, self.prepare_rows(x.shape[0], n_before))

    def use_threads(self, n: int) -> None:
        """The CPU thread count for a call of n rows (cpu.threads.ThreadPolicy)."""
        if self.threads is not None:
            self.threads.use(n)

    def prepare_rows(self, n: int, n_before: int) -> "_Scratch":
        """The scratch for an n-row call at positions n_before.. (written to its pos array, which
        the kernels read on the device), with the MoE counters reset."""
        s = self._scratch_for(n)
        self.backend.copy(s.pos, np.arange(n_before, n_before + n))
        self.last_moe_stats.reset()
        return s

    def attention_block_on(self, layer: AttentionLayer, x, kv, s: "_Scratch") -> None:
        """attention_block on prepared rows (prepare_rows): it only runs ops, so it can be part of
        a step (Backend.run_step)."""
        b = self.backend
        b.copy(s.x, x)
        self.ops.rms_norm(s.x, layer.attn_norm, self.config.rms_eps, s.a)
        self._attention(layer, kv, s)
        self._residual_ffn(layer, s)
        self.ops.add_inplace(s.x, s.m)
        b.copy(x, s.x)

    # --- the two mixers and the FFN -----------------------------------------------------------
    def _residual_ffn(self, layer, s: "_Scratch") -> None:
        """x += mixer output; m = FFN(RMSNorm(x; post_attention_norm)). The caller adds m to x
        (fused with whatever norm comes next)."""
        self.ops.add_rms_norm(s.x, s.m, layer.post_norm, self.config.rms_eps, s.a)
        self._ffn(layer.ffn, s)

    def _attention(self, layer: AttentionLayer, kv, s: "_Scratch") -> None:
        ops, c = self.ops, self.config
        ops.matvecs(_products((layer.q, s.qg), (layer.k, s.k), (layer.v, s.v)), s.a)
        self._store_kv(layer, kv, s)
        ops.head_rms_norm(s.qg3, layer.q_norm, c.rms_eps, s.q)      # takes the query half of [q | gate]
        ops.rope_neox(s.q, s.pos, self.inv_freq)
        k_cache, v_cache = kv
        ops.gated_attention(s.q, s.qg3, k_cache, v_cache, s.pos, s.attn)
        ops.matvec(layer.o.wtype, layer.o.data, s.attn, s.m)

    def append_kv(self, layer: AttentionLayer, kv, s: "_Scratch") -> None:
        """K and V of the normed rows s.a (normed, roped) into the cache pair kv at s.pos."""
        self.ops.matvecs(_products((layer.k, s.k), (layer.v, s.v)), s.a)
        self._store_kv(layer, kv, s)

    def _store_kv(self, layer: AttentionLayer, kv, s: "_Scratch") -> None:
        """The projected K and V rows (s.k, s.v) normed, roped and appended to the cache."""
        ops, c = self.ops, self.config
        ops.head_rms_norm(s.k3, layer.k_norm, c.rms_eps, s.k3)
        ops.rope_neox(s.k3, s.pos, self.inv_freq)
        k_cache, v_cache = kv
        ops.kv_append(s.k3, s.v3, k_cache, v_cache, s.pos)

    def _gdn(self, layer: GDNLayer, state: SessionState, s: "_Scratch", snapshot: bool) -> None:
        ops, c = self.ops, self.config
        ops.matvecs(_products((layer.qkv, s.mix), (layer.gate, s.z), (layer.beta, s.b), (layer.alpha, s.alpha)), s.a)
        i = layer.index
        ring_conv = state.ring_conv[i] if snapshot else state.no_ring_conv
        ring_ssm = state.ring_ssm[i] if snapshot else state.no_ring_ssm
        ops.gdn_mixer(s.mix, s.z, s.b, s.alpha, (layer.conv_w, layer.ssm_a, layer.dt_bias, layer.ssm_norm),
                      (state.conv[i], state.ssm[i]), (ring_conv, ring_ssm), c.ssm_n_k_heads, self.grouped_heads,
                      c.rms_eps, s.u, s.o, s.y)
        ops.matvec(layer.out.wtype, layer.out.data, s.y, s.m)

    def _ffn(self, ffn, s: "_Scratch") -> None:
        """m = FFN(a), run by the backend where the FFN's weights live (Backend.ffn)."""
        self.backend.ffn(ffn, s.a, s.h, s.m, self._ffn_math)

    def _ffn_math(self, ops, ffn, a, h, m) -> None:
        """m = FFN(a) with the op set `ops` (h: the SwiGLU hidden)."""
        if isinstance(ffn, DenseFFN):
            ops.swiglu(ffn.gate.wtype, ffn.gate.data, ffn.up.wtype, ffn.up.data, a, h)
            ops.matvec(ffn.down.wtype, ffn.down.data, h, m)
        else:
            ops.moe_ffn(ffn, a, m, self.last_moe_stats)

    # --- helpers --------------------------------------------------------------------------------
    @property
    def min_prompt_rows(self) -> int:
        """The fewest rows of a call that the backend computes with its prompt kernels
        (`generate.prompt_chunks`)."""
        return self.backend.min_prompt_rows

    def one_off_work(self) -> int:
        """A count that grows whenever a call does work that later calls of its size will not:
        compiling a kernel, allocating a size's scratch, a GPU step's first run or capture.
        A step during which it did not change cost what every later such step will."""
        return compiles.count() + self._allocations + self.backend.one_offs

    def check_tokens(self, token_ids) -> np.ndarray:
        """The ids as a contiguous int64 array, or a HybridError naming the first bad one."""
        ids = np.asarray(token_ids)
        if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
            raise HybridError(f"token ids must be a non-empty 1-D integer array; got shape {ids.shape} "
                              f"of {ids.dtype}")
        bad = (ids < 0) | (ids >= self.config.n_vocab)
        if bad.any():
            raise HybridError(f"token id {int(ids[bad][0])} is outside the vocabulary (0..{self.config.n_vocab - 1})")
        return np.ascontiguousarray(ids, dtype=np.int64)

    def _scratch_for(self, n: int) -> "_Scratch":
        s = self._scratch.get(n)
        if s is None:
            if STEP_ROWS < n <= PREFILL_CHUNK:
                if self._chunk_rows is None:
                    self._chunk_rows = _Scratch.allocate(self.config, PREFILL_CHUNK, self.backend.zeros)
                    self._allocations += 1
                s = self._scratch[n] = self._chunk_rows.leading(n)
            else:
                s = self._scratch[n] = _Scratch.allocate(self.config, n, self.backend.zeros)
                self._allocations += 1
            chunks = [size for size in self._scratch if size > STEP_ROWS]
            for size in chunks[:max(0, len(chunks) - _CHUNK_SIZES_KEPT)]:
                del self._scratch[size]
        else:
            self._scratch.move_to_end(n)
        return s


def _products(*pairs) -> list:
    """ops.matvecs' (wtype, w, out) of (Matrix, out) pairs."""
    return [(m.wtype, m.data, out) for m, out in pairs]


@dataclass
class MoEStats:
    """Routed-expert weight traffic of one call's MoE FFNs, all layers together.

    Grouping rows by expert reads each selected expert once per layer; running the rows one by
    one would read each row's k experts: n × the per-token expert bytes."""
    rows: int = 0                   # token rows through MoE FFNs (n × MoE layers)
    expert_bytes_read: int = 0      # distinct selected experts' bytes, summed over layers
    expert_bytes_per_row: int = 0   # n × k × one expert's bytes, summed over layers

    def reset(self) -> None:
        """Start counting a new call (in place: a captured step's host calls hold this object)."""
        self.rows = self.expert_bytes_read = self.expert_bytes_per_row = 0

    def count(self, ffn: MoEFFN, experts: np.ndarray) -> None:
        """Count a call's routing: experts (rows, k), pairs the GPU runs marked ~e."""
        # a set of a few dozen ints is several times cheaper than np.unique (called per hand-off)
        self.add(ffn, experts.shape[0], len(set(expert_ids(experts).ravel().tolist())), experts.size)

    def add(self, ffn: MoEFFN, rows: int, distinct: int, pairs: int) -> None:
        """Count a call of `rows` rows that selected `distinct` experts in its `pairs` (row, rank)
        pairs (the expert kernel counts them)."""
        self.rows += rows
        self.expert_bytes_read += distinct * ffn.expert_bytes
        self.expert_bytes_per_row += pairs * ffn.expert_bytes

    @property
    def saving(self) -> float:
        """How many times fewer expert bytes grouping read (1.0 for one row, or no MoE)."""
        return self.expert_bytes_per_row / self.expert_bytes_read if self.expert_bytes_read else 1.0


@dataclass
class _Scratch:
    """Activation buffers for one call size n (float32, n rows; backend arrays); 3-D names are
    views of 2-D ones. `identity` tells a captured step which buffers it was recorded with."""
    identity: int
    pos: np.ndarray            # (n,) int64 token positions
    x: np.ndarray              # (n, D) the residual stream
    a: np.ndarray              # (n, D) normed input of the mixer / FFN
    m: np.ndarray              # (n, D) mixer / FFN output, added to x
    h: np.ndarray              # (n, n_ff) SwiGLU hidden
    qg: np.ndarray             # (n, 2·H·d_h) packed [query | gate] per head
    qg3: np.ndarray            # (n, H, 2·d_h) view of qg
    q: np.ndarray              # (n, H, d_h) normed, rotated queries
    k: np.ndarray              # (n, H_kv·d_h)
    k3: np.ndarray             # (n, H_kv, d_h) view of k
    v: np.ndarray
    v3: np.ndarray
    attn: np.ndarray           # (n, H·d_h) gated attention output
    mix: np.ndarray            # (n, C) GDN pre-conv channels
    u: np.ndarray              # (n, C) after conv + SiLU (+ L2 norm of q, k)
    z: np.ndarray              # (n, H_v·d_v) output gate
    b: np.ndarray              # (n, H_v) β logits
    alpha: np.ndarray          # (n, H_v)
    o: np.ndarray              # (n, H_v·d_v) delta-rule output
    y: np.ndarray              # (n, H_v·d_v) after the gated norm

    @classmethod
    def allocate(cls, c: ModelConfig, n: int, zeros) -> "_Scratch":
        def buf(*shape):
            return zeros((n, *shape), np.float32)
        D, H, Hkv, dh = c.n_embd, c.n_head, c.n_head_kv, c.head_dim
        qg, k, v = buf(2 * H * dh), buf(Hkv * dh), buf(Hkv * dh)
        return cls(
            identity=next(_identities),
            pos=zeros(n, np.int64),
            x=buf(D), a=buf(D), m=buf(D), h=buf(max(c.n_ff, 1)),
            qg=qg, qg3=qg.reshape(n, H, 2 * dh), q=buf(H, dh), k=k, k3=k.reshape(n, Hkv, dh),
            v=v, v3=v.reshape(n, Hkv, dh), attn=buf(H * dh),
            mix=buf(c.ssm_conv_channels), u=buf(c.ssm_conv_channels), z=buf(c.ssm_d_inner),
            b=buf(c.ssm_n_v_heads), alpha=buf(c.ssm_n_v_heads),
            o=buf(c.ssm_d_inner), y=buf(c.ssm_d_inner),
        )

    def leading(self, n: int) -> "_Scratch":
        """The first n rows of every buffer (views: the same memory) as a call size's scratch."""
        rows = {f.name: getattr(self, f.name)[:n] for f in fields(self) if f.name != "identity"}
        return _Scratch(identity=next(_identities), **rows)
