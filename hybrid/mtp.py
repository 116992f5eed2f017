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
        cat = b.result("mtp_cat", (n, 2 * D))
        normed = b.result("mtp_normed", (n, D))
        ops.rms_norm(embed_tokens(fwd.weights, ids, ops, table=w.embed), w.enorm, c.rms_eps, normed)
        b.copy(cat[:, :D], normed)
        ops.rms_norm(b.to_backend(np.ascontiguousarray(hidden_prev, dtype=np.float32)), w.hnorm, c.rms_eps, normed)
        b.copy(cat[:, D:], normed)
        x = b.result("mtp_x", (n, D))
        ops.matvec(w.eh_proj.wtype, w.eh_proj.data, cat, x)
        fwd.attention_block(w.block, x, state.mtp_kv[self.layer], state.mtp_n_past)
        hidden = b.result("mtp_hidden", (n, D))
        ops.rms_norm(x, w.shared_head_norm, c.rms_eps, hidden)
        state.mtp_n_past += n
        if logits == "none":
            return None, b.to_host(hidden)
        rows = hidden if logits == "all" else hidden[n - 1:]
        out = b.result("mtp_logits", (rows.shape[0], c.n_vocab))
        ops.matvec(w.head.wtype, w.head.data, rows, out)
        return b.to_host(out), b.to_host(hidden)
