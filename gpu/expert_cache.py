"""Routed experts cached on the GPU: the VRAM a plan leaves over holds copies of some experts of
each MoE layer, and the GPU runs the selected ones it holds while the CPU runs the rest.

Why: the routed experts are most of a MoE model's bytes per token and stay in host memory
(hybrid/placement.py), so the CPU's read bandwidth sets the decode speed, while the GPU idles
through each layer's hand-off. Every expert the GPU holds is read at HBM speed instead, and
during that idle time. The planner gives each MoE layer the same number of slots
(`Plan.expert_cache`).

Per MoE layer (gpu/ffn.py `hybrid_moe_ffn`), with the router on the device:
  1. `route` on the device: each row's top-k experts and their renormalised weights (the rule of
     cpu.moe.route), copied down with the rows for the hand-off (this runs for every MoE layer
     with its router on the device, cache or none);
  2. while the host runs the experts that have no slot (`cpu.moe.run_routed`, which skips the
     others by the host copy of the slot table), the device runs the ones that have: gate and
     up products of the pair's row, SiLU(g)·u, the down product (`run_cached`; one launch per
     matrix kind for all the (row, rank) pairs, `gpu.matvec_q8.experts_matvec`, a pair without
     a slot returns at once);
  3. `finish`: out = (host part) + Σ over the cached ranks, in rank order, of weight · output
     (+ the gated shared expert).
Every row's arithmetic is the same whatever the number of rows, so a k-token verify row keeps
the bits of a one-token step (lossless drafting). The split into a host and a device part
changes the order of the rank sum against the CPU-only path (a last-bit difference).

Which experts: the cache starts with the lowest-numbered ones; `load` puts others in (a
caller that has counted which experts a workload picks can move the most used ones in).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int64, uint32, uint64

from . import memory
from .intrinsics import bits_to_f32, warp_max_u64
from .matvec_q8 import UNITS, experts_matvec, quantize
from .memory import THREADS, stream

MAX_EXPERTS = 1024         # experts per layer the routing kernel takes (Qwen3.5/3.6 MoE: 256, Qwen3-Next: 512)
MAX_TOP_K = 64             # experts per row the routing kernel picks (Qwen MoE: 8 or 10)
MAX_PAIRS = 65535          # (row, rank) pairs of one call: the grid's y limit


def cacheable(ffn) -> bool:
    """Whether this MoE FFN's routed experts can run from the cache: every kind a dp4a type."""
    return (all(int(m.wtype) in UNITS for m in (ffn.gate, ffn.up, ffn.down))
            and routes_on_device(ffn.router.rows, ffn.n_used))


class ExpertCache:
    """Copies of `n_slots` of one MoE layer's routed experts in VRAM, and which expert sits where.

    stacks: the (gate, up, down) device arrays (n_slots, rows, row_bytes) uint8; slot_of: device
    int32 (E,), each expert's slot or −1; host_slot_of: the same table on the host."""

    def __init__(self, ffn, n_slots: int):
        if not cacheable(ffn):
            raise ValueError("expert cache: the experts' types have no dp4a kernel")
        n_expert = ffn.gate.data.shape[0]
        self.n_slots = min(int(n_slots), n_expert)
        self.stacks = tuple(cuda.device_array((self.n_slots, *m.data.shape[1:]), np.uint8)
                            for m in (ffn.gate, ffn.up, ffn.down))
        self.wtypes = tuple(int(m.wtype) for m in (ffn.gate, ffn.up, ffn.down))
        self.host_slot_of = np.full(n_expert, -1, np.int32)
        self.slot_of = memory.upload(self.host_slot_of)
        self.experts = np.full(self.n_slots, -1, np.int64)      # the expert in each slot
        self.load(ffn, np.arange(self.n_slots))

    def load(self, ffn, experts) -> None:
        """Put these experts (at most n_slots, distinct) in the cache, keeping those already in
        and reusing the slots of the ones they push out."""
        want = list(dict.fromkeys(int(e) for e in experts))[:self.n_slots]
        keep = set(want)
        free = [s for s, e in enumerate(self.experts) if e not in keep]
        for e in want:
            if self.host_slot_of[e] >= 0:
                continue
            s = free.pop(0)
            if self.experts[s] >= 0:
                self.host_slot_of[self.experts[s]] = -1
            for stack, m in zip(self.stacks, (ffn.gate, ffn.up, ffn.down)):
                memory.copy(stack[s], m.data[e])
            self.experts[s], self.host_slot_of[e] = e, s
        memory.copy(self.slot_of, self.host_slot_of)
        memory.synchronize()


# --- 1. routing ----------------------------------------------------------------------------------

@cuda.jit(device=True, inline=True)
def _order_key(bits):
    """A uint32 that orders as the float32 logit with these bits does, −0.0 equal to 0.0, NaN
    below every number (cpu.moe.route keeps a NaN it met first; the row is garbage either way,
    and both pick valid, distinct experts)."""
    magnitude = bits & uint32(0x7FFFFFFF)
    if magnitude > uint32(0x7F800000):             # NaN
        return uint32(0)
    if magnitude == uint32(0):                     # ±0.0
        return uint32(0x80000000)
    return ~bits if bits >> uint32(31) else bits | uint32(0x80000000)


@cuda.jit(device=True, inline=True)
def _pick_value(bits, e):
    """A uint64 that ranks expert e's logit (bits) among the row's: its order key above, the
    complement of its index below, so a tie goes to the lower index (a total order, as
    cpu.moe.route breaks ties). Never 0 (a NaN's key is 0 but its low word is not), so 0 can
    mark an expert already picked."""
    return (uint64(_order_key(bits)) << uint64(32)) | (uint64(0xFFFFFFFF) - uint64(e))


@cuda.jit(cache=True)
def _route(bits, experts, weights):
    """bits: the router logits (n, E) as uint32. One warp per row picks the k best in k rounds:
    each lane takes the largest `_pick_value` of its own experts (e ≡ lane mod 32), a shuffle
    butterfly gives the warp's largest, and the lane that holds the winner zeroes it. Then the
    lanes weigh the picks and lane 0 sums them in rank order. About k·E/32 compares per lane,
    no barrier per round: 5.7 µs a row on the H200 at E = 256 (k = 8), 8.8 at E = 512 (k = 10),
    where a block that ranked every expert against all E others (E² compares) took 12 and 40."""
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    n_expert = bits.shape[1]
    k = experts.shape[1]
    values = cuda.shared.array(MAX_EXPERTS, uint64)
    picked = cuda.shared.array(MAX_TOP_K, int64)
    picked_logit = cuda.shared.array(MAX_TOP_K, float64)
    share = cuda.shared.array(MAX_TOP_K, float64)         # exp(l_rank − l_0)
    total = cuda.shared.array(1, float64)
    for e in range(t, n_expert, 32):      # a lane only ever reads back its own experts
        values[e] = _pick_value(bits[i, e], e)
    for rank in range(k):
        top = uint64(0)
        for e in range(t, n_expert, 32):
            top = max(top, values[e])
        top = warp_max_u64(top)
        e = int64(uint64(0xFFFFFFFF) - (top & uint64(0xFFFFFFFF)))
        if t == e % 32:
            values[e] = uint64(0)
        if t == 0:
            picked[rank] = e
            picked_logit[rank] = float64(bits_to_f32(bits[i, e]))
    cuda.syncthreads()
    # p_e / Σ_top-k p in float64, as cpu.moe.route: a softmax over the chosen logits
    for r in range(t, k, 32):
        share[r] = math.exp(picked_logit[r] - picked_logit[0])
    cuda.syncthreads()
    if t == 0:
        total[0] = 0.0
        for r in range(k):
            total[0] += share[r]
    cuda.syncthreads()
    for r in range(t, k, 32):
        experts[i, r] = picked[r]
        weights[i, r] = share[r] / total[0]


def routes_on_device(n_expert: int, k: int) -> bool:
    """Whether `route` takes top-k of n_expert experts."""
    return k <= min(n_expert, MAX_TOP_K) and n_expert <= MAX_EXPERTS


def route(logits, experts, weights) -> None:
    """experts (n, k) int64 and weights (n, k) float32 of router logits (n, E), on the device."""
    n, k = experts.shape
    if not routes_on_device(logits.shape[1], k):
        raise ValueError(f"top-{k} of {logits.shape[1]} experts; the routing kernel takes top-{MAX_TOP_K} "
                         f"of {MAX_EXPERTS} at most")
    if n:
        _route[n, 32, stream()](logits.view(np.uint32), experts, weights)


# --- 2. the cached experts -------------------------------------------------------------------------

@cuda.jit(cache=True)
def _silu_times_cached(g, u, slot_of, experts):
    """g ← SiLU(g) ⊙ u on the rows of the pairs that have a slot. Not gpu.ffn.silu_times on
    every row: the others hold leftovers, whose exp may overflow (the simulator raises)."""
    t = cuda.grid(1)
    cols = g.shape[1]
    k = experts.shape[1]
    if t < g.shape[0] * cols:
        a = t // cols
        c = t - a * cols
        if slot_of[experts[a // k, a % k]] >= 0:
            gv = g[a, c]
            g[a, c] = gv / (float32(1.0) + math.exp(-gv)) * u[a, c]


def run_cached(cache: ExpertCache, x, experts, y) -> None:
    """y[i·k + rank] = the output of row i's rank-th expert, for the pairs whose expert is
    cached (other rows of y are left as they were). x: (n, D) float32 on the device."""
    n, k = experts.shape
    gate_t, up_t, down_t = cache.wtypes
    g_stack, u_stack, d_stack = cache.stacks
    s = stream()
    h_shape = (n * k, g_stack.shape[1])
    g, u = memory.scratch("expert_cache.g", h_shape), memory.scratch("expert_cache.u", h_shape)
    xq = quantize(x, s, UNITS[gate_t].x_layout)
    experts_matvec(gate_t, g_stack, cache.slot_of, experts, xq, g, False, s)
    if UNITS[up_t].x_layout != UNITS[gate_t].x_layout:
        xq = quantize(x, s, UNITS[up_t].x_layout)
    experts_matvec(up_t, u_stack, cache.slot_of, experts, xq, u, False, s)
    _silu_times_cached[-(-g.size // THREADS), THREADS, s](g, u, cache.slot_of, experts)
    hq = quantize(g, s, UNITS[down_t].x_layout)
    experts_matvec(down_t, d_stack, cache.slot_of, experts, hq, y, True, s)


# --- 3. the sum ------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _finish(out, y, experts, weights, slot_of, shared, gate_logit, with_shared):
    t = cuda.grid(1)
    D = out.shape[1]
    k = experts.shape[1]
    if t < out.shape[0] * D:
        i = t // D
        c = t - i * D
        acc = out[i, c]
        for rank in range(k):
            if slot_of[experts[i, rank]] >= 0:
                acc += weights[i, rank] * y[i * k + rank, c]
        if with_shared:
            acc += float32(1.0) / (float32(1.0) + math.exp(-gate_logit[i, 0])) * shared[i, c]
        out[i, c] = acc


def finish(out, y, experts, weights, cache: ExpertCache, shared=None, gate_logit=None) -> None:
    """out (n, D) += Σ over the cached ranks, in rank order, of weights · y; then
    + σ(gate_logit) · shared when given."""
    with_shared = shared is not None
    if not with_shared:
        shared = gate_logit = out      # not read
    _finish[-(-out.size // THREADS), THREADS, stream()](out, y, experts, weights, cache.slot_of, shared,
                                                         gate_logit, with_shared)
