"""Gated DeltaNet kernels: causal conv1d + SiLU, per-head L2 norm, the gated delta rule
(docs/MODEL_FORMAT.md §3.4). Each kernel steps all n tokens of a call in one launch.

State layouts (float32, one per GDN layer and sequence):
* recurrent state `ssm` (H_v, d_v, d_k): S_j[i][c] (key index i, value index c) lives at
  ssm[j, c, i], i.e. float offset j·d_v·d_k + c·d_k + i. The key index is contiguous, which
  is llama.cpp's layout too. Each value index c is then one contiguous row of d_k floats
  that the delta rule reads and updates on its own: rows are independent, so the kernel
  runs them in parallel and keeps each row in L1 across all n tokens.
* conv state `conv` (K−1, C): the last K−1 pre-conv inputs, oldest row first, channels
  contiguous (the transpose of llama.cpp's time-contiguous {K−1, C}); rolling it is a row shift.
* snapshot rings, optional: `ring_ssm` (R, H_v, d_v, d_k) and `ring_conv` (R, K−1, C).
  After token i of a call, slot i gets that token's state and conv window (requires
  R ≥ n). Speculative decoding rolls back to "after token i" by copying slot i. Pass
  arrays with R = 0 for no snapshots (same types, so no extra Numba specialisation).
"""
from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from .expf import expf
from .norm import gated_rms_norm

# Reassociation vectorises the d_k dot products; every token runs the same code, so an
# n-token call stays bit-identical to n one-token calls.
_FAST = {"reassoc", "contract", "nsz"}


_CONV_PARALLEL_ROWS = 16   # from this many tokens (prompt chunks) the conv runs on all cores
_CONV_BLOCK = 512          # channels per parallel work item


def conv1d_silu(mix, w, conv, out, ring_conv):
    """Causal depthwise conv over n tokens, then SiLU; advances the conv state.

    mix (n, C) pre-conv inputs; w (K, C) taps oldest→current (tap K−1 multiplies the
    current token; this is `ssm_conv1d` (C, K) transposed); conv (K−1, C) rolling state,
    updated in place; out (n, C) = SiLU(conv output). ring_conv (R, K−1, C): if R > 0,
    slot t receives the window after token t.

    Channels are independent and each is computed in the same order either way, so the
    parallel path (prompt chunks) gives the bits of the serial one (decode, verify), whose
    few channels·tokens do not pay for waking the thread pool.
    """
    if mix.shape[0] >= _CONV_PARALLEL_ROWS:
        _conv1d_silu_parallel(mix, w, conv, out, ring_conv)
    else:
        _conv1d_silu_channels(mix, w, conv, out, ring_conv, 0, mix.shape[1])


@njit(cache=True, nogil=True, parallel=True, error_model="numpy")
def _conv1d_silu_parallel(mix, w, conv, out, ring_conv):
    C = mix.shape[1]
    for b in prange((C + _CONV_BLOCK - 1) // _CONV_BLOCK):
        _conv1d_silu_channels(mix, w, conv, out, ring_conv, b * _CONV_BLOCK, min(C, (b + 1) * _CONV_BLOCK))


@njit(cache=True, nogil=True, error_model="numpy")
def _conv1d_silu_channels(mix, w, conv, out, ring_conv, c0, c1):
    """conv1d_silu for channels c0..c1−1 only.

    Written so LLVM vectorises every channel loop (6-7x faster than scalar code):
    * loops run over 1-D views [c0:c1] with an index from 0, which LLVM can tell is never
      negative; indexing from c0 left numba's negative-index wrap-around in every access;
    * error_model="numpy" drops the divide-by-zero check Python semantics put on the SiLU's
      division, a branch per element (its divisor 1 + exp(−a) is ≥ 1 anyway).
    Neither changes an operation: each channel is still 0 + w₀x₀ + w₁x₁ + … in tap order, then
    SiLU with expf, so the bits equal the scalar code's and those of any channel split.
    """
    n = mix.shape[0]
    K = w.shape[0]
    keep = K - 1
    m = c1 - c0
    snap = ring_conv.shape[0] > 0
    for t in range(n):
        o = out[t, c0:c1]
        if K == 4:          # the only kernel size in use: one pass, the sum stays in a register
            x0, x1, x2, x3 = _tap_input(mix, conv, t - 3, c0, c1), _tap_input(mix, conv, t - 2, c0, c1), \
                _tap_input(mix, conv, t - 1, c0, c1), mix[t, c0:c1]
            w0, w1, w2, w3 = w[0, c0:c1], w[1, c0:c1], w[2, c0:c1], w[3, c0:c1]
            for i in range(m):
                # starting from +0 like the general path keeps -0 sums at +0
                a = np.float32(0.0) + w0[i] * x0[i]
                a = a + w1[i] * x1[i]
                a = a + w2[i] * x2[i]
                a = a + w3[i] * x3[i]
                o[i] = a / (np.float32(1.0) + expf(-a))
        else:
            o[:] = np.float32(0.0)
            for j in range(K):
                x = _tap_input(mix, conv, t - keep + j, c0, c1)
                wj = w[j, c0:c1]
                for i in range(m):
                    o[i] += wj[i] * x[i]
            for i in range(m):
                a = o[i]
                o[i] = a / (np.float32(1.0) + expf(-a))
        if snap:
            for r in range(keep):
                _copy(ring_conv[t, r, c0:c1], _tap_input(mix, conv, t - keep + 1 + r, c0, c1))
    # New state: the last K−1 inputs of concat(state, mix). Reading index r+n ≥ r, so the
    # forward in-place shift never overwrites a row it still needs.
    for r in range(keep):
        _copy(conv[r, c0:c1], _tap_input(mix, conv, n - keep + r, c0, c1))


@njit(inline="always", nogil=True)
def _tap_input(mix, conv, s, c0, c1):
    """Channels c0..c1−1 of input s of the call; s < 0 reaches back into the conv state."""
    return conv[conv.shape[0] + s, c0:c1] if s < 0 else mix[s, c0:c1]


@njit(inline="always", nogil=True)
def _copy(dst, src):
    """dst[:] = src for equal-length 1-D views, as a loop LLVM turns into vector moves (numba's
    slice assignment goes through its general broadcasting path, 2-3x slower here)."""
    for i in range(dst.shape[0]):
        dst[i] = src[i]


@njit(cache=True, nogil=True)
def l2_norm_heads(x, n_heads, d, eps):
    """In place: x[t, h·d:(h+1)·d] /= max(‖·‖₂, eps) for the first n_heads heads of each row.

    For the GDN, x is the conv output (n, C) and n_heads = 2·H_k covers q then k.
    """
    n = x.shape[0]
    for t in range(n):
        for h in range(n_heads):
            base = h * d
            ss = 0.0
            for i in range(d):
                v = np.float64(x[t, base + i])
                ss += v * v
            inv = np.float32(1.0 / max(math.sqrt(ss), eps))
            for i in range(d):
                x[t, base + i] *= inv


def _gates(b, alpha, ssm_a, dt_bias):
    """β = σ(b) and the decay exp(g), g = ssm_a·softplus(α + dt_bias), per (token, v-head)."""
    beta = np.empty(b.shape, dtype=np.float32)
    decay = np.empty(b.shape, dtype=np.float32)
    _gates_into(b, alpha, ssm_a, dt_bias, beta, decay)
    return beta, decay


@njit(cache=True, nogil=True)
def _gates_into(b, alpha, ssm_a, dt_bias, beta, decay):
    # writes into arrays it is given and returns nothing, like the other kernels, so a warm-up's
    # plan pass (`hybrid.kernel_prep`) can skip it while it is not compiled yet
    n, n_v = b.shape
    for t in range(n):
        for j in range(n_v):
            beta[t, j] = 1.0 / (1.0 + math.exp(-np.float64(b[t, j])))
            a = np.float64(alpha[t, j]) + dt_bias[j]
            softplus = a if a > 20.0 else math.log1p(math.exp(a))   # ggml's cut-off
            decay[t, j] = math.exp(ssm_a[j] * softplus)


def gated_delta_rule(u, n_k_heads, grouped, b, alpha, ssm_a, dt_bias, ssm, out, ring_ssm):
    """The gated delta rule over n tokens, per v-head j, with S_j in `ssm` (H_v, d_v, d_k):

        S ← exp(g)·S;  δ = β·(v − Sᵀk̂);  S ← S + k̂δᵀ;  o = Sᵀq̂ / sqrt(d_k)

    u (n, C): conv output after L2 norm, channels [q̂: H_k·d_k | k̂: H_k·d_k | v: H_v·d_v].
    grouped: head pairing; False = tiled, v-head j uses k-head j mod H_k (qwen35, qwen35moe);
    True = grouped, j // (H_v/H_k) (qwen3next).
    b, alpha (n, H_v) raw projections; ssm_a, dt_bias (H_v,). out (n, H_v·d_v).
    ring_ssm (R, H_v, d_v, d_k): if R > 0, slot t receives the state after token t.
    """
    beta, decay = _gates(b, alpha, ssm_a, dt_bias)
    step = _delta_rule_4_rows if ssm.shape[1] % 4 == 0 else _delta_rule_rows
    step(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm)


def gdn_mixer(mix, z, b, alpha, weights, state, rings, n_k_heads, grouped, eps, u, o, y):
    """A GDN layer's mixer between its input projections and its output projection: the
    causal conv + SiLU of mix (n, C) into u, the L2 norm of u's q and k heads, the gated delta
    rule into o (n, H_v·d_v), then y = gated_rms_norm(o, z). weights = (conv_w, ssm_a, dt_bias,
    ssm_norm), state = (conv, ssm), rings = (ring_conv, ring_ssm); u and o are scratch. One op
    so that the GPU can run it in fewer launches (`gpu.gdn.gdn_mixer`)."""
    conv_w, ssm_a, dt_bias, norm_w = weights
    conv, ssm = state
    ring_conv, ring_ssm = rings
    conv1d_silu(mix, conv_w, conv, u, ring_conv)
    l2_norm_heads(u, 2 * n_k_heads, ssm.shape[2], eps)
    gated_delta_rule(u, n_k_heads, grouped, b, alpha, ssm_a, dt_bias, ssm, o, ring_ssm)
    gated_rms_norm(o, z, norm_w, eps, y)


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _delta_rule_4_rows(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm):
    """gated_delta_rule with four value rows of a head per work item (d_v a multiple of 4;
    beta, decay from _gates):
    each k̂ and q̂ element loaded once serves four rows, and the four independent sums keep
    the FMA pipes busy (docs/MEASUREMENTS.md has the gain). Every
    row is still stepped token by token inside the call, so an n-token call keeps the bits
    of n one-token calls."""
    n = u.shape[0]
    n_v, d_v, d_k = ssm.shape
    ratio = n_v // n_k_heads
    k_start = n_k_heads * d_k
    v_start = 2 * k_start
    scale = np.float32(1.0 / math.sqrt(d_k))
    snap = ring_ssm.shape[0] > 0
    quads = d_v // 4
    for item in prange(n_v * quads):
        j = item // quads
        c = 4 * (item - j * quads)
        kh = j // ratio if grouped else j % n_k_heads
        q0 = kh * d_k
        k0 = k_start + kh * d_k
        s0, s1, s2, s3 = ssm[j, c], ssm[j, c + 1], ssm[j, c + 2], ssm[j, c + 3]
        for t in range(n):
            ut = u[t]
            q = ut[q0:q0 + d_k]
            k = ut[k0:k0 + d_k]
            dec = decay[t, j]
            kv0 = kv1 = kv2 = kv3 = np.float32(0.0)
            for i in range(d_k):
                ki = k[i]
                a = s0[i] * dec
                s0[i] = a
                kv0 += a * ki
                a = s1[i] * dec
                s1[i] = a
                kv1 += a * ki
                a = s2[i] * dec
                s2[i] = a
                kv2 += a * ki
                a = s3[i] * dec
                s3[i] = a
                kv3 += a * ki
            bt = beta[t, j]
            v = v_start + j * d_v + c
            d0 = bt * (ut[v] - kv0)
            d1 = bt * (ut[v + 1] - kv1)
            d2 = bt * (ut[v + 2] - kv2)
            d3 = bt * (ut[v + 3] - kv3)
            o0 = o1 = o2 = o3 = np.float32(0.0)
            for i in range(d_k):
                ki = k[i]
                qi = q[i]
                a = s0[i] + ki * d0
                s0[i] = a
                o0 += a * qi
                a = s1[i] + ki * d1
                s1[i] = a
                o1 += a * qi
                a = s2[i] + ki * d2
                s2[i] = a
                o2 += a * qi
                a = s3[i] + ki * d3
                s3[i] = a
                o3 += a * qi
            o = j * d_v + c
            out[t, o] = o0 * scale
            out[t, o + 1] = o1 * scale
            out[t, o + 2] = o2 * scale
            out[t, o + 3] = o3 * scale
            if snap:
                ring_ssm[t, j, c:c + 4, :] = ssm[j, c:c + 4]


@njit(cache=True, nogil=True, parallel=True, fastmath=_FAST)
def _delta_rule_rows(u, n_k_heads, grouped, beta, decay, ssm, out, ring_ssm):
    """gated_delta_rule, one value row per work item (any d_v); beta, decay from _gates."""
    n = u.shape[0]
    n_v, d_v, d_k = ssm.shape
    ratio = n_v // n_k_heads
    k_start = n_k_heads * d_k
    v_start = 2 * k_start
    scale = np.float32(1.0 / math.sqrt(d_k))
    snap = ring_ssm.shape[0] > 0
    # One work item = one value row c of one head: it owns S_j[:, c] and nothing else.
    # Rows and q̂/k̂ are taken as 1-D views: LLVM vectorises the d_k loops over views
    # (about 5× faster than 2-D indexing, where it cannot prove the stride).
    for row in prange(n_v * d_v):
        j = row // d_v
        c = row - j * d_v
        kh = j // ratio if grouped else j % n_k_heads
        q0 = kh * d_k
        k0 = k_start + kh * d_k
        s = ssm[j, c]
        for t in range(n):
            ut = u[t]
            q = ut[q0:q0 + d_k]
            k = ut[k0:k0 + d_k]
            dec = decay[t, j]
            kv = np.float32(0.0)
            for i in range(d_k):
                si = s[i] * dec
                s[i] = si
                kv += si * k[i]
            delta = beta[t, j] * (ut[v_start + j * d_v + c] - kv)
            o = np.float32(0.0)
            for i in range(d_k):
                si = s[i] + k[i] * delta
                s[i] = si
                o += si * q[i]
            out[t, j * d_v + c] = o * scale
            if snap:
                ring_ssm[t, j, c, :] = s
