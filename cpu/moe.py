"""The MoE FFN of qwen35moe / qwen3next (docs/MODEL_FORMAT.md §3.5), expert-grouped.

Per row x (llama.cpp's build_moe_ffn: softmax gating, renormalised top-k weights):
    ℓ = W_router x;  p = softmax(ℓ);  E = top-k(p);  w_e = p_e / Σ_{e'∈E} p_e'
    f = Σ_{e∈E} w_e · W_down,e(SiLU(W_gate,e x) ⊙ W_up,e x)  +  σ(w_sh · x) · SharedFFN(x)

Expert grouping: for n rows (a k-token verify, a prompt chunk), each selected expert's weights
are read ONCE, for all the rows routed to it. Quantised experts (what real models hold) run in one
kernel call per layer (`cpu.moe_kernel.routed_experts`: per-call overhead, not bandwidth, bounded
decode when each expert ran as its own swiglu + matvec calls); float experts keep that
expert-by-expert path, which the fused kernel matches bit for bit. Each row's expert outputs are
summed in its top-k rank order (not in group order), so row i of an n-row call is bit-identical
to the 1-row call on x[i].

`routed_ffn` is the routed half alone (routing from given logits, stats, the experts): the GPU
backend's one host hand-off per layer when only the routed experts stayed in host memory.
"""
from __future__ import annotations

import weakref
from collections.abc import Callable

import numba
import numpy as np
from numba import njit, prange

from cpu.ggml_types import DECODED_IDS

from . import matvec as _matvec
from .decoded_moe import routed_experts_decoded
from .ffn import swiglu
from .matvec import QUANT_TYPES, check_f32_matrix, check_weights, frozen, matvec
from .moe_kernel import BoundCall, routed_experts, shares_x_rounding


# ---- routing -----------------------------------------------------------------------------------

@njit(cache=True, nogil=True)
def _route(logits, k, experts, weights):
    n, n_expert = logits.shape
    taken = np.zeros(n_expert, np.bool_)
    for i in range(n):
        taken[:] = False
        # top-k by logit (softmax is monotonic, so the same set as top-k by p); scanning upwards
        # with a strict '>' keeps the lower index on ties. `best` always lands on an untaken
        # expert, even for NaN logits, so the indices stay valid (the NaN shows in the weights).
        for rank in range(k):
            best = -1
            for e in range(n_expert):
                if not taken[e] and (best < 0 or logits[i, e] > logits[i, best]):
                    best = e
            taken[best] = True
            experts[i, rank] = best
        # p_e / Σ_top-k p: the full softmax's denominator cancels, leaving a softmax over the
        # chosen logits. Rank 0 holds the largest logit: subtracting it keeps exp() ≤ 1.
        top = np.float64(logits[i, experts[i, 0]])
        total = 0.0
        for rank in range(k):
            total += np.exp(np.float64(logits[i, experts[i, rank]]) - top)
        for rank in range(k):
            weights[i, rank] = np.exp(np.float64(logits[i, experts[i, rank]]) - top) / total


def route(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-k experts per row and their renormalised softmax weights.

    logits: (n, E) float32 router outputs. Returns experts (n, k) int64, most probable first
    (ties → lower index), and weights (n, k) float32 summing to 1 per row."""
    check_f32_matrix(logits, "logits")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k = {k} experts per token; must be in 1..{logits.shape[1]}")
    experts = np.empty((logits.shape[0], k), np.int64)
    weights = np.empty((logits.shape[0], k), np.float32)
    _route(logits, k, experts, weights)
    return experts, weights


def expert_groups(experts: np.ndarray):
    """Yield (expert, rows, ranks) for each distinct expert in `experts` (n, k), by expert index:
    rows (ascending) that chose it, and the rank it has in each of those rows' top-k."""
    k = experts.shape[1]
    flat = experts.ravel()
    order = np.argsort(flat, kind="stable")          # stable: rows stay ascending within a group
    starts = np.flatnonzero(np.diff(flat[order])) + 1
    for slots in np.split(order, starts):
        yield int(flat[slots[0]]), slots // k, slots % k


# ---- combining -----------------------------------------------------------------------------------

@njit(cache=True, nogil=True, parallel=True)
def _weighted_sum(y, weights, out):
    """out[i] = Σ_rank weights[i, rank] · y[i, rank], ranks in order (a fixed order per row)."""
    n, k, D = y.shape
    for i in prange(n):
        for c in range(D):
            out[i, c] = weights[i, 0] * y[i, 0, c]
        for rank in range(1, k):
            w = weights[i, rank]
            for c in range(D):
                out[i, c] += w * y[i, rank, c]


@njit(cache=True, nogil=True, parallel=True)
def _add_gated(out, shared, gate_logit):
    """out[i] += σ(gate_logit[i]) · shared[i]: the shared expert's scalar sigmoid gate."""
    n, D = out.shape
    for i in prange(n):
        g = np.float32(1.0) / (np.float32(1.0) + np.exp(-gate_logit[i, 0]))
        for c in range(D):
            out[i, c] += g * shared[i, c]


# ---- the routed experts ---------------------------------------------------------------------------

def _run_expert_by_expert(ffn, x, experts, weights, out) -> None:
    """The reference path (float expert weights): one swiglu + one matvec per selected expert."""
    n, D = x.shape
    y = np.empty((n, ffn.n_used, D), np.float32)     # y[i, rank] = row i's rank-th expert output
    for e, rows, ranks in expert_groups(experts):
        xe = np.ascontiguousarray(x[rows])           # the rows this expert serves, one block
        h = np.empty((len(rows), ffn.gate.rows), np.float32)
        swiglu(ffn.gate.wtype, ffn.gate.data[e], ffn.up.wtype, ffn.up.data[e], xe, h)
        ye = np.empty((len(rows), D), np.float32)
        matvec(ffn.down.wtype, ffn.down.data[e], h, ye)
        y[rows, ranks] = ye
    _weighted_sum(y, weights, out)


def _expert_rows(stack: np.ndarray):
    """A stack (E, rows, row_bytes) whose experts are each C-contiguous, evenly spaced (also the
    halves of a fused gate_up tensor), as one read-only 2-D row array covering all of them, and
    the row step from one expert to the next. None if the stack is not laid out that way."""
    E, rows, row_bytes = stack.shape
    step, rem = divmod(stack.strides[0], row_bytes) if row_bytes else (0, 1)
    if rem or stack.strides[1:] != (row_bytes, 1) or (E > 1 and step < rows):
        return None
    span = (E - 1) * step + rows
    return frozen(np.lib.stride_tricks.as_strided(stack, (span, row_bytes), (row_bytes, 1))), step


_FUSED_WEIGHTS: dict[int, tuple] = {}   # id(ffn) → (weakref to it, its `_fused_weights`)


def _fused_weights(ffn):
    """The kernel's view of a layer's expert weights, made once per MoEFFN (checks and views
    cost tens of µs, a real share of a small layer's time): (wtypes, gate, up, down rows,
    expert_rows), or None where no fused kernel applies (float weights, gate and up types that
    round x differently, odd layouts). Experts of the SIMD types (every quantised type now) run
    in `cpu.moe_kernel`; with a type that has a decoder but no row dot among them (none now),
    in `cpu.decoded_moe` (`_uses_decoded`)."""
    hit = _FUSED_WEIGHTS.get(id(ffn))
    if hit is not None and hit[0]() is ffn:
        return hit[1]
    kinds = (ffn.gate, ffn.up, ffn.down)
    prepared = None
    simd = all(m.wtype in QUANT_TYPES for m in kinds)
    # the SIMD kernel quantises x once for gate and up; cpu.decoded_moe takes any mix of types
    decoded = not simd and all(m.wtype in QUANT_TYPES or m.wtype in DECODED_IDS for m in kinds)
    if (simd and shares_x_rounding(ffn.gate.wtype, ffn.up.wtype)) or decoded:
        n_ff, D = ffn.gate.rows, ffn.gate.cols
        if (ffn.up.rows, ffn.up.cols, ffn.down.rows, ffn.down.cols) != (n_ff, D, D, n_ff):
            raise ValueError(f"expert shapes disagree: gate {n_ff}×{D}, up {ffn.up.rows}×{ffn.up.cols}, "
                             f"down {ffn.down.rows}×{ffn.down.cols}")
        for m in kinds:
            check_weights(m.wtype, m.data[0], m.cols, m.name)
        mats = [_expert_rows(m.data) for m in kinds]
        if all(v is not None for v in mats):
            n_expert = ffn.gate.data.shape[0]
            expert_rows = np.array([np.arange(n_expert) * step for _, step in mats], np.int64)
            prepared = (tuple(m.wtype for m in kinds), *(w for w, _ in mats), expert_rows)
    _FUSED_WEIGHTS[id(ffn)] = (weakref.ref(ffn), prepared)
    weakref.finalize(ffn, _FUSED_WEIGHTS.pop, id(ffn), None)
    return prepared


def _uses_decoded(wtypes) -> bool:
    return not all(t in QUANT_TYPES for t in wtypes)


def _kernel_arguments(ffn, x, experts, weights, out) -> tuple | None:
    """`routed_experts`' arguments for these rows (all but the keywords), or None for float
    weights (the fused kernel does not apply)."""
    prepared = _fused_weights(ffn)
    if prepared is None:
        return None
    if ffn.gate.cols != x.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns but the experts take {ffn.gate.cols}")
    return (*prepared, ffn.gate.rows, x, experts, weights, out, numba.get_num_threads(), _matvec.PREFETCH_BYTES)


def _run_fused(ffn, x, experts, weights, out) -> bool:
    """All routed experts (but the pairs marked to run elsewhere) in one `routed_experts` call;
    False (nothing done) for float weights."""
    arguments = _kernel_arguments(ffn, x, experts, weights, out)
    if arguments is None:
        return False
    if _uses_decoded(arguments[0]):
        routed_experts_decoded(*arguments[:-2])      # it takes neither thread count nor prefetch distance
    else:
        routed_experts(*arguments)
    return True


# ---- the FFN -------------------------------------------------------------------------------------

def router_logits(ffn, x: np.ndarray) -> np.ndarray:
    """The router's logits (n, E) float32 for rows x (n, D)."""
    logits = np.empty((x.shape[0], ffn.router.rows), np.float32)
    matvec(ffn.router.wtype, ffn.router.data, x, logits)
    return logits


def routed_ffn(ffn, x: np.ndarray, logits: np.ndarray, out: np.ndarray, stats=None) -> np.ndarray:
    """out (n, D) = the routed experts' part of the MoE FFN of rows x (n, D), given the router's
    logits (n, E): route, then `run_routed`. Returns the selected experts (n, k)."""
    check_f32_matrix(logits, "logits", (x.shape[0], ffn.router.rows))
    experts, weights = route(logits, ffn.n_used)
    run_routed(ffn, x, experts, weights, out, stats)
    return experts


def run_routed(ffn, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, out: np.ndarray,
               stats=None) -> None:
    """out (n, D) = Σ_rank weights · expert(x) over the routed (row, rank) pairs `experts` (n, k)
    int64 with their weights (n, k) float32 (`route`); every pair counts into stats (a
    hybrid.forward.MoEStats) when given. A pair marked ~e (−1 − e) runs elsewhere (the GPU:
    gpu/expert_cache.py) and is left out of out.

    The GPU backend's hand-off calls this on the host with routing done on the device (a
    captured step calls `bind_routed`'s call instead)."""
    _check_routed(ffn, x, experts, weights, out)
    if stats is not None:
        stats.count(ffn, experts)
    if not _run_fused(ffn, x, experts, weights, out):
        if (experts < 0).any():
            raise ValueError("float experts cannot leave pairs to the GPU")
        _run_expert_by_expert(ffn, x, experts, weights, out)


def bind_routed(ffn, x: np.ndarray, experts: np.ndarray, weights: np.ndarray, out: np.ndarray,
                stats=None) -> Callable[[], None]:
    """`run_routed` on these arrays, checked once, as a call without arguments: for a captured
    step's hand-off, whose pinned buffers are rewritten in place before each replay. It may run
    at any replay: it touches nothing but these arrays, the weights and stats."""
    _check_routed(ffn, x, experts, weights, out)
    arguments = _kernel_arguments(ffn, x, experts, weights, out)
    if arguments is None or _uses_decoded(arguments[0]):
        return lambda: run_routed(ffn, x, experts, weights, out, stats)
    kernel = BoundCall(*arguments)
    if stats is None:
        return kernel
    n, pairs = experts.shape[0], experts.size

    def call():
        stats.add(ffn, n, kernel(), pairs)
    return call


def _check_routed(ffn, x, experts, weights, out) -> None:
    check_f32_matrix(x, "x")
    n, D = x.shape
    check_f32_matrix(out, "out", (n, D), writeable=True)
    if experts.shape != (n, ffn.n_used) or weights.shape != experts.shape:
        raise ValueError(f"routing of shape {experts.shape} / {weights.shape} for {n} rows of top-{ffn.n_used}")


def moe_ffn(ffn, x: np.ndarray, out: np.ndarray, stats=None) -> np.ndarray:
    """out (n, D) = the MoE FFN of rows x (n, D) float32; returns the selected experts (n, k),
    also counted into stats (a hybrid.forward.MoEStats) when given.

    `ffn` is a `hybrid.weights.MoEFFN`: router (F32 matrix), gate/up/down expert stacks
    (`data[e]` = expert e's matrix), n_used = k, optional shared expert and its gate."""
    check_f32_matrix(x, "x")
    n, D = x.shape
    check_f32_matrix(out, "out", (n, D), writeable=True)
    experts = routed_ffn(ffn, x, router_logits(ffn, x), out, stats)

    if ffn.shared is not None:
        sh = ffn.shared
        h = np.empty((n, sh.gate.rows), np.float32)
        swiglu(sh.gate.wtype, sh.gate.data, sh.up.wtype, sh.up.data, x, h)
        shared = np.empty((n, D), np.float32)
        matvec(sh.down.wtype, sh.down.data, h, shared)
        gate_logit = np.empty((n, 1), np.float32)
        matvec(ffn.shared_gate.wtype, ffn.shared_gate.data, x, gate_logit)
        _add_gated(out, shared, gate_logit)
    return experts
