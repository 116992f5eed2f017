"""Gated DeltaNet kernels on the GPU: causal conv1d + SiLU and the gated delta rule, each
stepping all n tokens of a call in one launch. Same ops, arguments and state layouts as
`cpu/gdn.py` (ssm (H_v, d_v, d_k) with the key index contiguous; conv (K−1, C) oldest row
first; rings (R, …) with R = 0 for no snapshots), so states move between the two unchanged.

Per-slot bit identity: every token is one step of the same per-channel / per-row code,
whatever n is, so an n-token call leaves exactly the states and outputs of n one-token calls.
(The per-head L2 norm between the two is `l2_norm_heads`; its kernel lives in `gpu/norm.py`, beside
the reduction it shares with the norms.)

The forward calls them through `gdn_mixer`, which fuses them with their neighbours for a decode
or verify step: the conv, the L2 norm and the gates in one launch; the delta rule and the
output norm in another (the last warp of a head to finish a token norms it). Same bits as the
separate ops.
"""
from __future__ import annotations

import math

from numba import cuda, float32, float64, int64, uint64

from cpu.errors import HybridError

from .intrinsics import load_f32_l2, warp_max_u64, warp_reduce
from .runtime import memory
from .runtime.memory import THREADS, stream
from .norm import WARPS, _l2_norm_heads, warp_blocks

MAX_CONV_KERNEL = 8            # the window lives in registers (every released model has K = 4)
MAX_STATE = 128                # d_k bound (every qwen35/qwen3next size): state rows stay in registers
PER_LANE = MAX_STATE // 32
ROWS = 4                       # value rows per warp: one butterfly reduces all of them, k̂ is read once


@cuda.jit(device=True, inline=True)
def _conv_step(w, window, x, ch, K):
    """SiLU of channel ch's conv over its window (oldest input first) with x as the current
    input, the taps summed in order; the window then moves on by one."""
    keep = K - 1
    window[keep] = x
    o = float32(0.0)
    for j in range(K):
        o += w[j, ch] * window[j]
    for r in range(keep):
        window[r] = window[r + 1]
    return o / (float32(1.0) + math.exp(-o))


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
        out[t, ch] = _conv_step(w, window, mix[t, ch], ch, K)
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
    _check_conv(w)
    n, C = mix.shape
    if n < CONV_PARALLEL_TOKENS:
        _conv1d_silu[-(-C // THREADS), THREADS, stream()](mix, w, conv, out, ring_conv)
        return
    _conv1d_silu_tokens[-(-(n * C) // THREADS), THREADS, stream()](mix, w, conv, out, ring_conv)
    _conv_state_advance[-(-C // THREADS), THREADS, stream()](mix, conv)


@cuda.jit(device=True, inline=True)
def _gate_values(b, alpha, ssm_a, dt_bias, t, j):
    """(β, decay) of token t, v-head j: β = σ(b) and decay = exp(ssm_a · softplus(α + dt_bias)),
    in float64 as on the CPU."""
    beta = float32(1.0 / (1.0 + math.exp(-float64(b[t, j]))))
    a = float64(alpha[t, j]) + dt_bias[j]
    softplus = a if a > 20.0 else math.log1p(math.exp(a))
    return beta, float32(math.exp(float64(ssm_a[j]) * softplus))


@cuda.jit(cache=True)
def _gdn_gates(b, alpha, ssm_a, dt_bias, beta, decay):
    """Per (token, v-head): the gates, computed once here instead of by each of a head's warps
    per token."""
    k = cuda.grid(1)
    n, n_v = b.shape
    if k < n * n_v:
        t = k // n_v
        j = k - t * n_v
        beta[t, j], decay[t, j] = _gate_values(b, alpha, ssm_a, dt_bias, t, j)


@cuda.jit(cache=True)
def _conv_norm_gates(mix, w, conv, out, ring_conv, n_norm, d, eps, b, alpha, ssm_a, dt_bias, beta, decay):
    """conv1d_silu, l2_norm_heads of the first n_norm heads and the gates in one launch, for
    calls of a few tokens. A block per d-wide channel segment, a thread per channel (a token's
    loads all in flight at once, as in `_conv1d_silu`); a normed segment's outputs meet in
    shared memory, where every warp sums their squares in `l2_norm_heads`' order (lane l: l,
    l + 32, ...; then the butterfly), so the bits are those of the three kernels. Past the
    segments' blocks, a thread per (token, v-head) gate."""
    n, C = mix.shape
    K = w.shape[0]
    keep = K - 1
    segments = -(-C // d)
    seg, tid = cuda.blockIdx.x, cuda.threadIdx.x
    if seg >= segments:
        k = (seg - segments) * cuda.blockDim.x + tid
        n_v = b.shape[1]
        if k < n * n_v:
            t = k // n_v
            j = k - t * n_v
            beta[t, j], decay[t, j] = _gate_values(b, alpha, ssm_a, dt_bias, t, j)
        return
    ch = seg * d + tid
    live = tid < d and ch < C
    c = min(ch, C - 1)                            # dead threads read a live channel
    norm = seg < n_norm                           # the same for the whole block
    snap = ring_conv.shape[0] > 0
    window = cuda.local.array(MAX_CONV_KERNEL, float32)   # oldest input first, current last
    outs = cuda.shared.array(MAX_STATE, float32)
    red = cuda.local.array((1, 1), float32)
    for r in range(keep):
        window[r] = conv[r, c]
    for t in range(n):
        o = _conv_step(w, window, mix[t, c], c, K)
        if snap and live:
            for r in range(keep):
                ring_conv[t, r, ch] = window[r]
        if norm:
            outs[tid] = o
            cuda.syncthreads()
            ss = float32(0.0)
            for i in range(tid & 31, d, 32):
                v = outs[i]
                ss += v * v
            red[0, 0] = ss
            warp_reduce(red)
            o *= float32(1.0 / max(math.sqrt(red[0, 0]), eps))
            cuda.syncthreads()                    # every warp has read before the next token writes
        if live:
            out[t, ch] = o
    if live:
        for r in range(keep):
            conv[r, ch] = window[r]


@cuda.jit(device=True, inline=True)
def _last_norms(out, norm_w, silu, eps, y, arrivals, t, j, warp_rows, lane):
    """After a warp wrote its rows of o (out) for token t, head j: the head's last warp to get
    here writes y[t] of the head, gated_rms_norm's bits (its lanes' sums in the same order, the
    same butterfly and expressions; norm_w and silu hold the lane's entries l, l + 32, ... of
    the weight and of SiLU(z), loaded beforehand), and resets the head's counter for the next
    call. The other warps' rows are fenced before they count and are read from L2."""
    cuda.threadfence()
    arrived = int64(0)
    if lane == 0:
        arrived = int64(cuda.atomic.add(arrivals, (t, j), 1)) + 1
    if int64(warp_max_u64(uint64(arrived))) != warp_rows:
        return
    d = y.shape[1] // arrivals.shape[1]
    base = j * d
    o = cuda.local.array(PER_LANE, float32)
    red = cuda.local.array((1, 1), float32)
    ss = float32(0.0)
    for e in range(PER_LANE):
        i = lane + 32 * e
        if i < d:
            o[e] = load_f32_l2(out, t, base + i)
            ss += o[e] * o[e]
    red[0, 0] = ss
    warp_reduce(red)
    scale = float32(1.0 / math.sqrt(red[0, 0] / d + eps))
    for e in range(PER_LANE):
        i = lane + 32 * e
        if i < d:
            y[t, base + i] = o[e] * scale * norm_w[e] * silu[e]
    if lane == 0:
        arrivals[t, j] = 0


@cuda.jit(cache=True)
def _gated_delta_rule(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm, z, norm_w, eps, y, arrivals):
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
    fused = y.shape[0] > 0                        # the output norm too (gdn_mixer)

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
    norm_wl = cuda.local.array(PER_LANE, float32)  # the output norm's weight and SiLU(z) at
    silu = cuda.local.array(PER_LANE, float32)     # the lane's entries of the head (fused only)
    if fused:
        for e in range(PER_LANE):
            norm_wl[e] = norm_w[min(lane + 32 * e, d_v - 1)]
    for t in range(n):
        if fused:                                 # loaded now, used after this token's scan
            for e in range(PER_LANE):
                zi = z[t, j * d_v + min(lane + 32 * e, d_v - 1)]
                silu[e] = zi / (float32(1.0) + math.exp(-zi))
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
        if fused and live_warp:
            _last_norms(out, norm_wl, silu, eps, y, arrivals, t, j, warp_rows, lane)
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
    _check_state(ssm)
    n = u.shape[0]
    if n == 0:
        return
    beta, decay = _gates(b, alpha, ssm_a, dt_bias)
    empty = memory.scratch("gdn_no_norm", (0, 0))
    _delta_rule(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm,
                (empty, ssm_a, 0.0, empty, memory.counters("gdn_no_norm", (0, 0))))


def gdn_mixer(mix, z, b, alpha, weights, state, rings, n_k_heads, grouped, eps, u, o, y):
    """A GDN layer's mixer between its input and output projections, as `cpu.gdn.gdn_mixer`:
    conv1d_silu, l2_norm_heads of q and k, gated_delta_rule and gated_rms_norm, with their
    bits, in two launches for a call of a few tokens (four at least otherwise): at decode sizes
    each launch's fixed cost is most of its time."""
    conv_w, ssm_a, dt_bias, norm_w = weights
    conv, ssm = state
    ring_conv, ring_ssm = rings
    _check_state(ssm)
    _check_conv(conv_w)
    n, C = mix.shape
    if n == 0:
        return
    n_v, _, d_k = ssm.shape
    if n < CONV_PARALLEL_TOKENS:
        beta, decay = _gates_scratch(n, n_v)
        block = 32 * -(-d_k // 32)
        blocks = -(-C // d_k) + -(-(n * n_v) // block)
        _conv_norm_gates[blocks, block, stream()](
            mix, conv_w, conv, u, ring_conv, int(2 * n_k_heads), int(d_k), float(eps), b, alpha, ssm_a, dt_bias,
            beta, decay)
    else:
        conv1d_silu(mix, conv_w, conv, u, ring_conv)
        l2_norm_heads(u, 2 * n_k_heads, d_k, eps)
        beta, decay = _gates(b, alpha, ssm_a, dt_bias)
    _delta_rule(u, n_k_heads, grouped, beta, decay, ssm, o, ring_ssm,
                (z, norm_w, float(eps), y, memory.counters("gdn_arrivals", (n, n_v))))


def _check_state(ssm):
    if ssm.shape[2] > MAX_STATE:
        raise HybridError(f"GPU delta rule supports state size ≤ {MAX_STATE}; this model has {ssm.shape[2]}")


def _check_conv(w):
    if w.shape[0] > MAX_CONV_KERNEL:
        raise HybridError(f"GPU conv1d supports kernels ≤ {MAX_CONV_KERNEL}; this model has {w.shape[0]}")


def _gates_scratch(n, n_v):
    return memory.scratch("gdn_beta", (n, n_v)), memory.scratch("gdn_decay", (n, n_v))


def _gates(b, alpha, ssm_a, dt_bias):
    """(β, decay) of b, alpha (n, H_v) in scratch, by their own launch."""
    beta, decay = _gates_scratch(*b.shape)
    _gdn_gates[-(-b.size // THREADS), THREADS, stream()](b, alpha, ssm_a, dt_bias, beta, decay)
    return beta, decay


def _delta_rule(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm, norm):
    """Launch the delta rule; norm = (z, norm_w, eps, y, arrivals), y of no rows for none."""
    n_v, d_v, _ = ssm.shape
    blocks = -(-(n_v * -(-d_v // ROWS)) // WARPS)
    _gated_delta_rule[blocks, 32 * WARPS, stream()](u, int(n_k_heads), bool(grouped), beta, decay,
                                                    ssm, out, ring_ssm, *norm)


def l2_norm_heads(x, n_heads, d, eps):
    """In place: x[t, h·d:(h+1)·d] /= max(‖·‖₂, eps) for the first n_heads heads of each row."""
    n = x.shape[0]
    _l2_norm_heads[warp_blocks(n * n_heads), 32 * WARPS, stream()](x, int(n_heads), int(d), float(eps))
