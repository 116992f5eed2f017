"""The MTP (nextn) head: the model's own one-block draft model (MODEL_FORMAT.md §4.1–4.2).

One row = (token x at position p, hidden h): h is the trunk's post-final-norm hidden of
position p−1 (or, when chaining drafts, the MTP head's own post-norm hidden of the previous
row). Row p's logits predict x_{p+1}, like the main head's row p.

    u  = W_eh · [RMSNorm(E[x]; enorm) ; RMSNorm(h; hnorm)]
    u += GatedAttention(RMSNorm(u; attn_norm_L), p)      own KV cache, blk.L weights
    u += FFN_L(RMSNorm(u; post_attention_norm_L))
    ĥ  = RMSNorm(u; shared_head_norm);  logits = W_head · ĥ

Only the rows whose output someone reads run the whole block: a call's other rows exist to put
their K and V into the head's cache (the prompt, the kept drafts redone with the trunk's true
hiddens), and their attention output, FFN and head would be thrown away. That matters most for
a MoE head in hybrid placement, whose FFN is a CPU hand-off reading every routed expert of every
row. Every op gives each row the bits of a one-row call, so the rows that do run, and the cache,
hold exactly what running every row would have produced.

The head runs through the trunk's own ops and scratch (one block, same op set), so it runs on
whichever backend the Forward uses; it takes and returns host arrays like the trunk.
"""
from __future__ import annotations

import numpy as np

from cpu.argmax import PICK_COLUMNS

from .errors import HybridError
from .sampling import Picks

# rows that produce logits and hidden, by logits mode (n: the call's rows)
_OUTPUT_ROWS = {"all": lambda n: n, "last": lambda n: 1, "none": lambda n: 0}


class MTPHead:
    def __init__(self, forward):
        self.fwd = forward
        self.w = forward.weights.mtp
        if self.w is None:
            raise HybridError("this model has no MTP block (nextn_predict_layers = 0): drafting needs one; "
                              "use --draft 0")
        self.layer = self.w.block.index
        self._views: dict[tuple, tuple] = {}       # device result buffer → its head and hidden views

    def forward(self, state, token_ids, hidden_prev: np.ndarray, logits: str = "last", pick: bool = False):
        """Run n MTP rows at positions state.mtp_n_past.. and advance it.

        hidden_prev: float32 (n, D), row i the hidden paired with token i.
        Returns (logits, hidden) of the output rows: all n rows for "all", the last row for
        "last" ((1, n_vocab), (1, D)); (None, None) for "none", which only fills the cache.
        pick=True returns the rows' greedy `Picks` in place of their logits (as Forward.forward).
        """
        fwd, c, b = self.fwd, self.fwd.config, self.fwd.backend
        ids = fwd.check_tokens(token_ids)
        if logits not in _OUTPUT_ROWS:
            raise HybridError(f"logits must be one of {', '.join(_OUTPUT_ROWS)}; got {logits!r}")
        n, D, V = len(ids), c.n_embd, c.n_vocab
        if hidden_prev.shape != (n, D):
            raise HybridError(f"MTP rows need one hidden row per token: got {hidden_prev.shape} for {n} tokens")
        if state.mtp_n_past + n > state.n_ctx:
            raise HybridError(f"{n} MTP rows do not fit the context of {state.n_ctx}")
        n_out = _OUTPUT_ROWS[logits](n)
        pick = pick and n_out > 0
        fwd.use_threads(n)
        if pick:
            Picks.check_vocab(V)
        # inputs into buffers that stay put, so the GPU backend can replay the block as a graph
        emb, h_prev = b.result("mtp_emb", (n, D)), b.result("mtp_h_prev", (n, D))
        b.copy(emb, fwd.embed(ids, table=self.w.embed))
        b.copy(h_prev, np.ascontiguousarray(hidden_prev, dtype=np.float32))
        rows = fwd.prepare_rows(n, state.mtp_n_past)        # all n rows: projections, K and V
        out_rows = rows if n_out in (0, n) else fwd.prepare_rows(n_out, state.mtp_n_past + n - n_out)
        # what comes back (logits or picks, then hidden) in one buffer: one copy to the host, one wait
        first = PICK_COLUMNS if pick else V
        result = b.result("mtp_pick" if pick else "mtp_out", (1, n_out * (first + D))) if n_out else None
        head, hidden = self._result_views(result, n_out, first, D)
        out = b.result("mtp_logits", (n_out, V)) if pick else head
        kv = state.mtp_kv[self.layer]
        b.run_step(self._block, emb, h_prev, kv, rows, out_rows, hidden, out, head if pick else None)
        state.mtp_n_past += n
        if result is None:
            return None, None
        # new names: the step's closure above must keep the device views if it is run again
        head_host, hidden_host = _split(b.to_host(result), n_out, first, D)
        return (Picks.of(head_host) if pick else head_host), hidden_host

    def _result_views(self, result, n_out: int, first: int, D: int):
        """_split of a device result buffer, made once per buffer (the GPU backend keeps its result
        buffers): a numba device view costs host time to make, and a draft made four.
        The CPU backend's results are fresh arrays, split as they come."""
        if result is None or isinstance(result, np.ndarray):
            return _split(result, n_out, first, D)
        key = (id(result), n_out, first, D)
        views = self._views.get(key)
        if views is None:       # (the buffer kept with its views: its id stays its own)
            views = self._views[key] = (result, *_split(result, n_out, first, D))
        return views[1:]

    def _block(self, emb, h_prev, kv, rows, out_rows, hidden, out, picks) -> None:
        fwd, ops, c, w, b = self.fwd, self.fwd.ops, self.fwd.config, self.w, self.fwd.backend
        n, D = emb.shape
        cat = b.result("mtp_cat", (n, 2 * D))
        normed = b.result("mtp_normed", (n, D))
        ops.rms_norm(emb, w.enorm, c.rms_eps, normed)
        b.copy(cat[:, :D], normed)
        ops.rms_norm(h_prev, w.hnorm, c.rms_eps, normed)
        b.copy(cat[:, D:], normed)
        x = b.result("mtp_x", (n, D))
        ops.matvec(w.eh_proj.wtype, w.eh_proj.data, cat, x)
        n_out = 0 if out is None else out.shape[0]
        if n_out < n:
            self._fill_kv(x, kv, rows)
        if n_out:
            x_out = x[n - n_out:]
            fwd.attention_block_on(w.block, x_out, kv, out_rows)
            ops.rms_norm(x_out, w.shared_head_norm, c.rms_eps, hidden)
            ops.matvec(w.head.wtype, w.head.data, hidden, out)
            if picks is not None:
                ops.argmax_rows(out, picks)

    def _fill_kv(self, x, kv, s) -> None:
        """Append the K and V of rows x to the cache, at s's positions: the first half of the
        attention block, on the same inputs, so with the same bits. The output rows' K and V get
        written again by their full block."""
        fwd, layer = self.fwd, self.w.block
        fwd.backend.copy(s.x, x)
        fwd.ops.rms_norm(s.x, layer.attn_norm, fwd.config.rms_eps, s.a)
        fwd.append_kv(layer, kv, s)


def _split(buffer, n_out: int, first: int, D: int):
    """(head (n_out, first), hidden (n_out, D)): contiguous views of a (1, n_out·(first+D))
    buffer, host or device, head being logits (first = n_vocab) or picks; (None, None) without one."""
    if buffer is None:
        return None, None
    flat = buffer.reshape(buffer.size)
    cut = n_out * first
    return flat[:cut].reshape(n_out, first), flat[cut:].reshape(n_out, D)
