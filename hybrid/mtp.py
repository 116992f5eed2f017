"""The MTP (nextn) head: the model's own one-block draft model (MODEL_FORMAT.md §4.1–4.2).

One row = (token x at position p, hidden h): h is the trunk's post-final-norm hidden of
position p−1 (or, when chaining drafts, the MTP head's own post-norm hidden of the previous
row). Row p's logits predict x_{p+1}, like the main head's row p.

    u  = W_eh · [RMSNorm(E[x]; enorm) ; RMSNorm(h; hnorm)]
    u += GatedAttention(RMSNorm(u; attn_norm_L), p)      own KV cache, blk.L weights
    u += FFN_L(RMSNorm(u; post_attention_norm_L))
    ĥ  = RMSNorm(u; shared_head_norm);  logits = W_head · ĥ

The head runs through the trunk's own ops and scratch (one block, same op set), so it
runs on whichever backend the Forward uses; it takes and returns host arrays like the trunk.
"""
from __future__ import annotations

import numpy as np

from .errors import HybridError
from .weights import embed_tokens


class MTPHead:
    def __init__(self, forward):
        self.fwd = forward
        self.w = forward.weights.mtp
        if self.w is None:
            raise HybridError("this model has no MTP block (nextn_predict_layers = 0): drafting needs one; "
                              "use --draft 0")
        self.layer = self.w.block.index

    def forward(self, state, token_ids, hidden_prev: np.ndarray, logits: str = "last"):
        """Run n MTP rows at positions state.mtp_n_past.. and advance it.

        hidden_prev: float32 (n, D), row i the hidden paired with token i.
        Returns (logits or None, post-norm hidden (n, D)) like Forward.forward.
        """
        fwd, ops, c, w, b = self.fwd, self.fwd.ops, self.fwd.config, self.w, self.fwd.backend
        ids = fwd.check_tokens(token_ids)
        n, D = len(ids), c.n_embd
        if hidden_prev.shape != (n, D):
            raise HybridError(f"MTP rows need one hidden row per token: got {hidden_prev.shape} for {n} tokens")
        if state.mtp_n_past + n > state.n_ctx:
            raise HybridError(f"{n} MTP rows do not fit the context of {state.n_ctx}")
        # inputs into buffers that stay put, so the GPU backend can replay the block as a graph
        emb, h_prev = b.result("mtp_emb", (n, D)), b.result("mtp_h_prev", (n, D))
        b.copy(emb, embed_tokens(fwd.weights, ids, ops, table=w.embed))
        b.copy(h_prev, np.ascontiguousarray(hidden_prev, dtype=np.float32))
        s = fwd.prepare_rows(n, state.mtp_n_past)
        hidden = b.result("mtp_hidden", (n, D))
        out = None if logits == "none" else b.result("mtp_logits", (n if logits == "all" else 1, c.n_vocab))
        kv = state.mtp_kv[self.layer]
        b.run_step(("mtp", n, logits, state.identity, s.identity), lambda: self._block(emb, h_prev, kv, s, hidden, out))
        state.mtp_n_past += n
        return (None if out is None else b.to_host(out)), b.to_host(hidden)

    def _block(self, emb, h_prev, kv, s, hidden, out) -> None:
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
        fwd.attention_block_on(w.block, x, kv, s)
        ops.rms_norm(x, w.shared_head_norm, c.rms_eps, hidden)
        if out is not None:
            ops.matvec(w.head.wtype, w.head.data, hidden[n - out.shape[0]:], out)
