"""The MoE FFN on the GPU (the twin of `cpu/moe.py`), built from the device matvec and SwiGLU
(`gpu/ffn.py`, slot-for-slot bit identical) plus small gather/scatter/sum kernels, so every row
keeps the bits of a one-row call, as on the CPU. Two placements (gpu/ops.py picks):
  - `hybrid_moe_ffn`, routed experts in host memory (the planner's placement): router logits and
    routing on the device, then ONE hand-off per layer (`memory.host_call`) in which the host
    counts and runs the selected experts with the fused CPU kernel (`cpu.moe.run_routed`);
    meanwhile the device runs the shared expert and the selected experts it takes (those its
    expert cache holds, and a share of the others fetched from host memory over PCIe:
    gpu/expert_cache.py), and adds both once the host's sum is back. Nothing is read
    back outside the hand-off, so a step with such layers can be captured as a CUDA graph;
  - `moe_ffn`, experts uploaded (same algorithm as `cpu/moe.py`): router logits come to the
    host (n × E floats) for the top-k choice, the rows routed to each chosen expert are
    gathered into one block on the device and run through that expert once, and each row's
    expert outputs are summed in top-k rank order. Its launches depend on the routing, so it
    stays eager (`graphs.require_eager`).

Both take the matvec/swiglu to use as arguments: the op set passes its dispatching ones, so an
FFN whose parts are placed apart (an -ot rule moving one matrix) still runs, each product
where its weights live.
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32

from cpu.moe import bind_routed, expert_groups, route, router_logits, routed_ffn, run_routed

from . import expert_cache
from .runtime import graphs, memory
from .runtime.memory import THREADS, stream


def _blocks(size: int) -> int:
    return -(-size // THREADS)


@cuda.jit(cache=True)
def _gather_rows(x, rows, first, xe):
    k = cuda.grid(1)
    D = x.shape[1]
    if k < xe.shape[0] * D:
        r = k // D
        c = k - r * D
        xe[r, c] = x[rows[first + r], c]


@cuda.jit(cache=True)
def _scatter_rows(ye, rows, ranks, first, y):
    k = cuda.grid(1)
    D = ye.shape[1]
    if k < ye.shape[0] * D:
        r = k // D
        c = k - r * D
        y[rows[first + r], ranks[first + r], c] = ye[r, c]


@cuda.jit(cache=True)
def _weighted_sum(y, weights, out):
    k = cuda.grid(1)
    n, n_used, D = y.shape
    if k < n * D:
        i = k // D
        c = k - i * D
        acc = weights[i, 0] * y[i, 0, c]
        for rank in range(1, n_used):
            acc += weights[i, rank] * y[i, rank, c]
        out[i, c] = acc


@cuda.jit(cache=True)
def _add_gated(out, shared, gate_logit):
    k = cuda.grid(1)
    D = out.shape[1]
    if k < out.shape[0] * D:
        i = k // D
        c = k - i * D
        g = float32(1.0) / (float32(1.0) + math.exp(-gate_logit[i, 0]))
        out[i, c] += g * shared[i, c]


def moe_ffn(ffn, x, out, matvec, swiglu, stats=None) -> None:
    """out (n, D) = the MoE FFN of device rows x (n, D) with the experts uploaded (eager: see the
    module docstring); the chosen experts go to stats.count."""
    graphs.require_eager("the device MoE FFN picks its expert launches on the host")
    n, D = x.shape
    logits = memory.scratch("moe_logits", (n, ffn.router.rows))
    matvec(ffn.router.wtype, ffn.router.data, x, logits)
    experts, weights = route(memory.to_host(logits), ffn.n_used)
    if stats is not None:
        stats.count(ffn, experts)

    # every (row, rank) slot, grouped by expert: one upload for all the gathers and scatters
    groups = list(expert_groups(experts))
    rows = memory.upload(np.concatenate([g[1] for g in groups]).astype(np.int64))
    ranks = memory.upload(np.concatenate([g[2] for g in groups]).astype(np.int64))
    y = memory.scratch("moe_y", (n, ffn.n_used, D))
    first = 0
    for e, group_rows, _ in groups:
        m = len(group_rows)
        xe = memory.scratch("moe_xe", (m, D))
        _gather_rows[_blocks(m * D), THREADS, stream()](x, rows, first, xe)
        h = memory.scratch("moe_h", (m, ffn.gate.rows))
        swiglu(ffn.gate.wtype, ffn.gate.data[e], ffn.up.wtype, ffn.up.data[e], xe, h)
        ye = memory.scratch("moe_ye", (m, D))
        matvec(ffn.down.wtype, ffn.down.data[e], h, ye)
        _scatter_rows[_blocks(m * D), THREADS, stream()](ye, rows, ranks, first, y)
        first += m
    _weighted_sum[_blocks(n * D), THREADS, stream()](y, memory.upload(weights), out)

    add_shared_expert(ffn, x, out, matvec, swiglu)


def hybrid_moe_ffn(ffn, x, out, matvec, swiglu, stats=None) -> None:
    """out (n, D) = the MoE FFN of device rows x (n, D) whose routed experts are in host memory:
    one hand-off for the routed experts the GPU leaves to the host (`ffn.cache`: the experts
    cached in VRAM, and a share of the others fetched over PCIe; gpu/expert_cache.py); the shared
    expert and the GPU's experts run on the device meanwhile (they only need x and the routing)
    and are added once the host's sum is back. A prompt chunk whose layer streams its uncached
    experts (`ExpertCache.streams`) runs them all on the device instead (`_streamed_experts`)."""
    n, D = x.shape
    if n == 0:
        return
    shared, gate_logit = memory.scratch("moe_shared", (n, D)), memory.scratch("moe_shared_gate", (n, 1))
    device_shared = ffn.shared is not None and all(
        memory.is_device(w.data) for w in (ffn.shared.gate, ffn.shared.up, ffn.shared.down, ffn.shared_gate))
    if ffn.shared is not None and not device_shared:
        shared_expert(ffn, x, shared, gate_logit, matvec, swiglu)   # its host part: a hand-off of its own first
    shared_meanwhile = (lambda: shared_expert(ffn, x, shared, gate_logit, matvec, swiglu)) if device_shared else None

    if not memory.is_device(ffn.router.data) or not expert_cache.routes_on_device(ffn.router.rows, ffn.n_used):
        # the router left in host memory (an -ot rule), or more experts than the device routing
        # takes (`routes_on_device`): the router's product joins the hand-off and all experts run there
        memory.host_call((x,), (out,),
                         lambda x_host, out_host: routed_ffn(ffn, x_host, router_logits(ffn, x_host), out_host, stats),
                         shared_meanwhile)
        if ffn.shared is not None:
            _add_gated[_blocks(n * D), THREADS, stream()](out, shared, gate_logit)
        return

    logits = memory.scratch("moe_logits", (n, ffn.router.rows))
    matvec(ffn.router.wtype, ffn.router.data, x, logits)
    experts = memory.scratch("moe_experts", (n, ffn.n_used), np.int64)
    weights = memory.scratch("moe_weights", (n, ffn.n_used))
    where = memory.scratch("moe_where", (n, ffn.n_used), np.int32)
    if ffn.cache is not None and ffn.cache.streams(n):
        _streamed_experts(ffn, x, out, logits, experts, weights, where, shared, gate_logit, shared_meanwhile)
        return
    # the hand-off's inputs and output in mapped host memory: the routing kernel writes x and
    # the routing where the host reads them, and `finish` reads the host's sum where it lies
    to_host = (memory.mapped("moe_x", (n, D)), memory.mapped("moe_experts", (n, ffn.n_used), np.int64),
               memory.mapped("moe_weights", (n, ffn.n_used)))
    host_sum = memory.mapped("moe_out", (n, D))
    cache = ffn.cache if ffn.cache is not None and ffn.cache.runs(n) else None
    expert_cache.route(logits, experts, weights, where, None if cache is None else cache.tables(n),
                       (x, *(m.device for m in to_host)))
    y = memory.scratch("moe_gpu_y", (n * ffn.n_used, D)) if cache is not None else out   # (out: not read)

    def meanwhile():
        if cache is not None:
            expert_cache.run(cache, x, where, experts, y, shared_meanwhile)
        else:
            shared_meanwhile()

    # runs at a graph's replay too (bound once to the mapped buffers): it may only use its
    # arguments, ffn's host weights and stats
    memory.host_call(to_host, (host_sum,),     # host: x, experts (the GPU's pairs as ~e), weights, its sum
                     lambda *host: run_routed(ffn, *host, stats),
                     meanwhile if device_shared or cache is not None else None,
                     bind=lambda *host: bind_routed(ffn, *host, stats))
    expert_cache.finish(out, host_sum.device, y, where, weights,
                        *((shared, gate_logit) if ffn.shared is not None else ()))


def _streamed_experts(ffn, x, out, logits, experts, weights, where, shared, gate_logit, shared_meanwhile) -> None:
    """The routed experts of a prompt chunk, all on the device: the cached ones from the cache,
    the others from their stacks streamed in whole (gpu/runtime/weight_stream.py), with no
    hand-off: a chunk of many rows touches nearly every expert, and the copy engine brings a
    layer's uncached experts in faster than the cores read them once."""
    n, D = x.shape
    cache = ffn.cache
    y = memory.scratch("moe_gpu_y", (n * ffn.n_used, D))
    expert_cache.route(logits, experts, weights, where, cache.tables(n))
    expert_cache.stream_codes(cache, where, experts)
    if shared_meanwhile is not None:
        shared_meanwhile()            # needs none of the streamed weights: queued before the wait for them
    with cache.streamer.using(cache, n) as staged:
        expert_cache.run(cache, x, where, experts, y, staged=staged)
    no_host_part = memory.scratch("moe_no_host_part", (n, D))
    memory.fill_zero(no_host_part)
    expert_cache.finish(out, no_host_part, y, where, weights, *((shared, gate_logit) if ffn.shared is not None else ()))


def shared_expert(ffn, x, shared, gate_logit, matvec, swiglu) -> None:
    """shared (n, D) = SharedFFN(x) and gate_logit (n, 1) = w_sh · x, on the device."""
    sh = ffn.shared
    h = memory.scratch("moe_shared_h", (x.shape[0], sh.gate.rows))
    swiglu(sh.gate.wtype, sh.gate.data, sh.up.wtype, sh.up.data, x, h)
    matvec(sh.down.wtype, sh.down.data, h, shared)
    matvec(ffn.shared_gate.wtype, ffn.shared_gate.data, x, gate_logit)


def add_shared_expert(ffn, x, out, matvec, swiglu) -> None:
    """out += σ(w_sh · x) · SharedFFN(x), on the device (a no-op for MoE FFNs without one)."""
    if ffn.shared is None:
        return
    n, D = x.shape
    shared, gate_logit = memory.scratch("moe_shared", (n, D)), memory.scratch("moe_shared_gate", (n, 1))
    shared_expert(ffn, x, shared, gate_logit, matvec, swiglu)
    _add_gated[_blocks(n * D), THREADS, stream()](out, shared, gate_logit)
