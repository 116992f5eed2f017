"""Gated DeltaNet kernels on the GPU: causal conv1d + SiLU and the gated delta rule, each
stepping all n tokens of a call in one launch. Same ops, arguments and state layouts as
`cpu/gdn.py` (ssm (H_v, d_v, d_k) with the key index contiguous; conv (K−1, C) oldest row
first; rings (R, …) with R = 0 for no snapshots), so states move between the two unchanged.

Per-slot bit identity: every token is one step of the same per-channel / per-row code,
whatever n is, so an n-token call leaves exactly the states and outputs of n one-token calls.
(The per-head L2 norm between the two is `gpu.norm.l2_norm_heads`.)
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64

from hybrid.errors import HybridError

from .device import simulated
from .intrinsics import warp_reduce
from . import memory
from .memory import THREADS, stream

MAX_CONV_KERNEL = 8            # the window lives in registers (every released model has K = 4)
WARPS = 1 if simulated() else 4
MAX_STATE = 128                # d_k bound (every qwen35/qwen3next size): state rows stay in registers
PER_LANE = MAX_STATE // 32
ROWS = 4                       # value rows per warp: one butterfly reduces all of them, k̂ is read once


@cuda.jit(cache=True)
def _conv1d_silu(mix, w, conv, out, ring_conv):
    n, C = mix.shape
    K = w.shape[0]
    keep = K - 1
    ch = cuda.grid(1)
    if ch >= C:
        return
    snap = ring_conv.shape[0] > 0
    window = cuda.local.array(MAX_CONV_KERNEL, float32)   # oldest input first, current last
    for r in range(keep):
        window[r] = conv[r, ch]
    for t in range(n):
        window[keep] = mix[t, ch]
        o = float32(0.0)
        for j in range(K):
            o += w[j, ch] * window[j]
        out[t, ch] = o / (float32(1.0) + math.exp(-o))
        for r in range(keep):
            window[r] = window[r + 1]
        if snap:
            for r in range(keep):
                ring_conv[t, r, ch] = window[r]
    for r in range(keep):
        conv[r, ch] = window[r]


@cuda.jit(cache=True)
def _conv1d_silu_tokens(mix, w, conv, out, ring_conv):
    """One thread per (token, channel): a prompt chunk's outputs (and ring slots) in parallel.
    Reads the conv state as it was before the call; `_conv_state_advance` updates it after."""
    n, C = mix.shape
    K = w.shape[0]
    keep = K - 1
    k = cuda.grid(1)
    if k >= n * C:
        return
    t = k // C
    ch = k - t * C
    window = cuda.local.array(MAX_CONV_KERNEL, float32)   # inputs t−K+1 .. t, oldest first
    for j in range(K):
        src = t - keep + j                                # < 0: still in the old state
        window[j] = mix[src, ch] if src >= 0 else conv[keep + src, ch]
    o = float32(0.0)
    for j in range(K):
        o += w[j, ch] * window[j]
    out[t, ch] = o / (float32(1.0) + math.exp(-o))
    if ring_conv.shape[0] > 0:
        for r in range(keep):
            ring_conv[t, r, ch] = window[r + 1]


@cuda.jit(cache=True)
def _conv_state_advance(mix, conv):
    """conv ← the last K−1 inputs of [old state; mix], per channel, oldest first."""
    n, C = mix.shape
    keep = conv.shape[0]
    ch = cuda.grid(1)
    if ch >= C:
        return
    for r in range(keep):                                 # n ≥ CONV_PARALLEL_TOKENS > K − 1
        conv[r, ch] = mix[n - keep + r, ch]


# Below this many tokens one thread walks a channel's tokens (decode, verify: one launch);
# from it on, a thread per (token, channel) and a second launch to advance the state. At least
# MAX_CONV_KERNEL, so the new state is always the last K − 1 of the call's own inputs.
CONV_PARALLEL_TOKENS = MAX_CONV_KERNEL


def conv1d_silu(mix, w, conv, out, ring_conv):
    """Causal depthwise conv over n tokens, then SiLU; advances the conv state.

    mix (n, C) pre-conv inputs; w (K, C) taps oldest→current; conv (K−1, C) state, updated in
    place; out (n, C). ring_conv (R, K−1, C): if R > 0, slot t receives the window after token t.
    Either way every output is the same sum in the same order, so the bits do not depend on n."""
    if w.shape[0] > MAX_CONV_KERNEL:
        raise HybridError(f"GPU conv1d supports kernels ≤ {MAX_CONV_KERNEL}; this model has {w.shape[0]}")
    n, C = mix.shape
    if n < CONV_PARALLEL_TOKENS:
        _conv1d_silu[-(-C // THREADS), THREADS, stream()](mix, w, conv, out, ring_conv)
        return
    _conv1d_silu_tokens[-(-(n * C) // THREADS), THREADS, stream()](mix, w, conv, out, ring_conv)
    _conv_state_advance[-(-C // THREADS), THREADS, stream()](mix, conv)


@cuda.jit(cache=True)
def _gdn_gates(b, alpha, ssm_a, dt_bias, beta, decay):
    """Per (token, v-head): β = σ(b) and decay = exp(ssm_a · softplus(α + dt_bias)), in
    float64 as on the CPU. Computed once here instead of by each of a head's warps per token."""
    k = cuda.grid(1)
    n, n_v = b.shape
    if k < n * n_v:
        t = k // n_v
        j = k - t * n_v
        beta[t, j] = float32(1.0 / (1.0 + math.exp(-float64(b[t, j]))))
        a = float64(alpha[t, j]) + dt_bias[j]
        softplus = a if a > 20.0 else math.log1p(math.exp(a))
        decay[t, j] = float32(math.exp(float64(ssm_a[j]) * softplus))


@cuda.jit(cache=True)
def _gated_delta_rule(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm):
    n = u.shape[0]
    n_v, d_v, d_k = ssm.shape
    lane = cuda.threadIdx.x & 31
    warp_rows = -(-d_v // ROWS)                   # warps per head
    item = cuda.blockIdx.x * WARPS + (cuda.threadIdx.x >> 5)
    live_warp = item < n_v * warp_rows
    item = min(item, n_v * warp_rows - 1)         # idle warps still take part in the (simulated) reductions
    j = item // warp_rows
    c0 = (item - j * warp_rows) * ROWS            # this warp's value rows c0 .. c0+ROWS−1 of head j
    ratio = n_v // n_k_heads
    kh = j // ratio if grouped else j % n_k_heads
    q0 = kh * d_k
    k0 = n_k_heads * d_k + kh * d_k
    v0 = 2 * n_k_heads * d_k + j * d_v
    scale = float32(1.0 / math.sqrt(d_k))
    snap = ring_ssm.shape[0] > 0

    s = cuda.local.array((ROWS, PER_LANE), float32)   # S_j[:, c0 + r], lane l holding keys l, l+32, …
    kk = cuda.local.array(PER_LANE, float32)      # this token's k̂ and q̂, the lane's keys
    qq = cuda.local.array(PER_LANE, float32)
    vv = cuda.local.array(ROWS, float32)
    k_next = cuda.local.array(PER_LANE, float32)  # the next token's inputs, loaded while this
    q_next = cuda.local.array(PER_LANE, float32)  # token computes: the scan is latency-bound
    v_next = cuda.local.array(ROWS, float32)
    red = cuda.local.array((ROWS, 1), float32)
    for r in range(ROWS):
        c = min(c0 + r, d_v - 1)
        for e in range(PER_LANE):
            i = lane + 32 * e
            s[r, e] = ssm[j, c, i] if i < d_k else float32(0.0)
    for e in range(PER_LANE):
        i = min(lane + 32 * e, d_k - 1)
        k_next[e] = u[0, k0 + i]
        q_next[e] = u[0, q0 + i]
    for r in range(ROWS):
        v_next[r] = u[0, v0 + min(c0 + r, d_v - 1)]
    beta_next = beta[0, j]
    decay_next = decay[0, j]
    for t in range(n):
        for e in range(PER_LANE):
            live = lane + 32 * e < d_k
            kk[e] = k_next[e] if live else float32(0.0)
            qq[e] = q_next[e] if live else float32(0.0)
        for r in range(ROWS):
            vv[r] = v_next[r]
        beta_t = beta_next
        decay_t = decay_next
        tn = min(t + 1, n - 1)                    # the last token reloads itself, harmlessly
        for e in range(PER_LANE):
            i = min(lane + 32 * e, d_k - 1)
            k_next[e] = u[tn, k0 + i]
            q_next[e] = u[tn, q0 + i]
        for r in range(ROWS):
            v_next[r] = u[tn, v0 + min(c0 + r, d_v - 1)]
        beta_next = beta[tn, j]
        decay_next = decay[tn, j]
        for r in range(ROWS):
            kv = float32(0.0)
            for e in range(PER_LANE):
                si = s[r, e] * decay_t
                s[r, e] = si
                kv += si * kk[e]
            red[r, 0] = kv
        warp_reduce(red)                          # Sᵀk̂ for all ROWS rows in one butterfly
        for r in range(ROWS):
            delta = beta_t * (vv[r] - red[r, 0])
            o = float32(0.0)
            for e in range(PER_LANE):
                si = s[r, e] + kk[e] * delta
                s[r, e] = si
                o += si * qq[e]
            red[r, 0] = o
        warp_reduce(red)
        for r in range(ROWS):
            c = c0 + r
            if live_warp and c < d_v:
                if lane == 0:
                    out[t, j * d_v + c] = red[r, 0] * scale
                if snap:
                    for e in range(PER_LANE):
                        i = lane + 32 * e
                        if i < d_k:
                            ring_ssm[t, j, c, i] = s[r, e]
    for r in range(ROWS):
        c = c0 + r
        if live_warp and c < d_v:
            for e in range(PER_LANE):
                i = lane + 32 * e
                if i < d_k:
                    ssm[j, c, i] = s[r, e]


def gated_delta_rule(u, n_k_heads, grouped, b, alpha, ssm_a, dt_bias, ssm, out, ring_ssm):
    """The gated delta rule over n tokens, per v-head j with S_j in `ssm` (H_v, d_v, d_k):

        S ← exp(g)·S;  δ = β·(v − Sᵀk̂);  S ← S + k̂δᵀ;  o = Sᵀq̂ / sqrt(d_k)

    Arguments as `cpu.gdn.gated_delta_rule`. One warp per ROWS value rows c of head j: the rows
    stay in registers across all n tokens and are written back (and into ring slot t) as it goes."""
    n_v, d_v, d_k = ssm.shape
    if d_k > MAX_STATE:
        raise HybridError(f"GPU delta rule supports state size ≤ {MAX_STATE}; this model has {d_k}")
    n = u.shape[0]
    if n == 0:
        return
    beta = memory.scratch("gdn_beta", (n, n_v))
    decay = memory.scratch("gdn_decay", (n, n_v))
    _gdn_gates[-(-(n * n_v) // THREADS), THREADS, stream()](b, alpha, ssm_a, dt_bias, beta, decay)
    blocks = -(-(n_v * -(-d_v // ROWS)) // WARPS)
    _gated_delta_rule[blocks, 32 * WARPS, stream()](u, int(n_k_heads), bool(grouped), beta, decay,
                                                    ssm, out, ring_ssm)
