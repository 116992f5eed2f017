"""The routed experts the GPU runs itself: copies of some experts of each MoE layer in the VRAM a
plan leaves over (the cache), and a share of the others fetched from host memory over PCIe.
The CPU runs the rest.

Why: the routed experts are most of a MoE model's bytes per token and stay in host memory
(hybrid/placement.py), so the CPU's read bandwidth sets the decode speed, while the GPU idles
through each layer's hand-off. Every expert the GPU holds is read at HBM speed instead, and during
that idle time. And the host's DRAM has bandwidth the CPU's cores leave unused: the GPU reads ~45
GB/s of registered host memory over PCIe while the cores read ~88 (gpu/runtime/host_mapping.py), so it
can take a share of the uncached experts too. The planner gives each MoE layer the same number of
slots (`Plan.expert_cache`); the PCIe share is a fraction of each row's uncached experts.

Per MoE layer (gpu/moe.py `hybrid_moe_ffn`), with the router on the device:
  1. `route` on the device: each row's top-k experts and their renormalised weights (the rule of
     cpu.moe.route), and where each (row, rank) pair runs (`where`, n × k codes): from its cache
     slot s (code s ≥ 0); over PCIe, for the last `pcie_count[u]` of the row's u uncached ranks
     (code −2 − s: staging slot s, the j-th such pair of row i in slot i·c + j, c = the most
     any row takes); else on the CPU (−1). The host's copy of the experts (written with x into
     mapped host memory: the hand-off has no copy node) marks every pair the GPU runs as ~e
     (cpu.moe_kernel skips those). The rule reads nothing but the row's own routing, so a
     row's split is the same in a one-row step and in a k-row verify;
  2. while the host runs its pairs (`cpu.moe.run_routed`), the device runs the GPU's (`run`):
     `fetch` copies the PCIe pairs' gate and up matrices, then their down matrices, from the
     mapped host memory into staging slots, on a side stream (the copy waits on PCIe, not on
     the SMs): the shared expert runs beside the first part, the gate and up products of each
     pair's row and SiLU(g)·u beside the second, then the down product (one launch per matrix
     kind for all the pairs, from cache or staging slots, `gpu.matmul.matvec_q8.experts_matvec`; a CPU
     pair returns at once). Fetching first and computing from VRAM beat computing straight
     from host memory: three dependent launches each waited out PCIe's latency;
  3. `finish`: out = (host part) + Σ over the GPU's ranks, in rank order, of weight · output
     (+ the gated shared expert).
Every row's arithmetic is the same whatever the number of rows (up to `PCIE_MAX_ROWS` rows for
the PCIe share, which prompt chunks do not get: each pair fetches its expert alone, where the CPU
reads an expert once for all its rows), so a k-token verify row keeps the bits of a one-token
step (lossless drafting). The split into a host and a device part changes the order of the rank
sum against the CPU-only path, and the GPU rounds activations per 32, the CPU per 256 (a
last-bit difference).

Which experts are cached: the lowest-numbered ones at first; `load` puts others in (a caller that
has counted which experts a workload picks can move the most used ones in).
"""
from __future__ import annotations

import math

import numpy as np
from numba import cuda, float32, float64, int32, int64, uint32, uint64

from .runtime import memory
from .runtime.device import simulated
from .runtime.host_mapping import DeviceViews
from .runtime.pcie import PCIE_MAX_ROWS, pcie_counts
from .runtime.weight_stream import Source
from .intrinsics import bits_to_f32, load_u32x4, store_u32x4, warp_max_u64
from .matmul.matvec_q8 import UNITS, experts_matvec, quantize
from .runtime.memory import THREADS, stream

MAX_EXPERTS = 1024         # experts per layer the routing kernel takes (Qwen3.5/3.6 MoE: 256, Qwen3-Next: 512)
MAX_TOP_K = 64             # experts per row the routing kernel picks (Qwen MoE: 8 or 10)
MAX_COUNTS = MAX_TOP_K + 1  # entries of a PCIe count table (a shared array's size must be a constant)
X_COPY = 128               # entries of a routed row that one block of `_route` copies to the host
MAX_PAIRS = 65535          # (row, rank) pairs of one call: the grid's y limit
# blocks and threads per fetched matrix: 256 KB of loads in flight covers PCIe's latency
# (bandwidth × latency is well below it); four times as many blocks timed the same, so the fetch
# holds fewer of the SMs the kernels beside it use.
# The simulator runs each thread as a Python thread: a few do there.
FETCH_BLOCKS, FETCH_THREADS = (2, 32) if simulated() else (32, 256)
ON_CPU = -1                # a `where` code: the CPU runs the pair


def cacheable(ffn) -> bool:
    """Whether this MoE FFN's routed experts can run from the cache: every kind a dp4a type."""
    return (all(int(m.wtype) in UNITS for m in (ffn.gate, ffn.up, ffn.down))
            and routes_on_device(ffn.router.rows, ffn.n_used))


class ExpertCache:
    """A MoE layer's experts on the GPU's side: copies of `n_slots` routed experts in VRAM and
    which expert sits where, and (pcie_share > 0) the host memory of all of them mapped for the
    device, from which each row's share is fetched over PCIe.

    stacks: the (gate, up, down) device arrays (n_slots, rows, row_bytes) uint8; slot_of: device
    int32 (E,), each expert's slot or −1; host_slot_of: the same table on the host. mapped: the
    (gate, up, down) host stacks as device arrays (matrices, words) uint32, expert e being
    matrix e·steps[kind]; or None. pcie_count: device int32 (k + 1,), how many of a row's u
    uncached experts the GPU fetches; per_row: the most any row fetches (its staging slots,
    fixed at construction); pcie: "off", "mapped", or why the mapping failed."""

    def __init__(self, ffn, n_slots: int, pcie_share: float = 0.0):
        if not cacheable(ffn):
            raise ValueError("expert cache: the experts' types have no dp4a kernel")
        counts = pcie_counts(pcie_share, ffn.n_used)
        self.k = ffn.n_used
        n_expert = ffn.gate.data.shape[0]
        self.n_slots = min(int(n_slots), n_expert)
        self.stacks = tuple(cuda.device_array((self.n_slots, *m.data.shape[1:]), np.uint8)
                            for m in (ffn.gate, ffn.up, ffn.down))
        self.wtypes = tuple(int(m.wtype) for m in (ffn.gate, ffn.up, ffn.down))
        self.host_slot_of = np.full(n_expert, -1, np.int32)
        self.slot_of = memory.upload(self.host_slot_of)
        self.experts = np.full(self.n_slots, -1, np.int64)      # the expert in each slot
        self._hosts = (ffn.gate.data, ffn.up.data, ffn.down.data)
        self.streamer = None            # a gpu.runtime.weight_stream.WeightStreamer, set by the runtime
        self._stream_sources = None     # what `stream_sources` returns while the cache holds these experts
        self.stream_slot_of = None      # device int32 (E,): each uncached expert's index in the streamed stacks
        self.load(ffn, np.arange(self.n_slots))
        self.mapped, self.steps, self.pcie = None, (1, 1, 1), "off"
        if pcie_share > 0:
            self.pcie = self._map(ffn)
            if self.mapped is None:
                counts = np.zeros_like(counts)
        self.per_row = int(counts[-1])
        self.pcie_count = memory.upload(counts)

    def _map(self, ffn) -> str:
        """Map the experts' host memory for the device (`mapped`, `steps`); the mapping's state."""
        hosts, steps = [], []
        for m in (ffn.gate, ffn.up, ffn.down):
            stack, step = _host_stack(m.data)
            if stack[0].nbytes % 16:
                return "off: the expert matrices are not whole 16-byte words"
            hosts.append(stack.reshape(stack.shape[0], -1).view(np.uint32))
            steps.append(step)
        self._views = DeviceViews(hosts)
        if self._views.arrays is None:
            return f"off: {self._views.why}"
        self.mapped, self.steps = tuple(self._views.arrays), tuple(steps)
        return "mapped"

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
        uncached = self.host_slot_of < 0
        self.stream_slot_of = memory.upload(np.where(uncached, np.cumsum(uncached) - 1, -1).astype(np.int32))
        self._stream_sources = None
        memory.synchronize()

    def set_pcie_share(self, share: float) -> None:
        """Change the PCIe share in place (captured steps see the new table; a benchmark sweeps
        it), up to the share the cache was made with (its staging slots)."""
        counts = pcie_counts(share, self.k)
        if counts[-1] > self.per_row:
            raise ValueError(f"share {share} fetches up to {counts[-1]} experts a row; this cache stages {self.per_row}")
        memory.copy(self.pcie_count, counts)
        memory.synchronize()

    def runs(self, n: int) -> bool:
        """Whether the GPU runs any pair of a call of n rows: it caches experts, or the call is
        small enough to fetch (module docstring) and the launches' grid holds its pairs."""
        return n * self.k <= MAX_PAIRS and (self.n_slots > 0 or self.fetches(n))

    def fetches(self, n: int) -> bool:
        """Whether a call of n rows fetches its share over PCIe."""
        return self.per_row > 0 and n <= PCIE_MAX_ROWS

    def streams(self, n: int) -> bool:
        """Whether a call of n rows (a prompt chunk) runs every pair on the GPU, on this layer's
        uncached experts streamed in (`stream_sources`) rather than on the CPU."""
        return self.streamer is not None and n * self.k <= MAX_PAIRS and self.streamer.wants(self, n)

    def streamable(self) -> bool:
        """Whether the uncached experts' host memory can be streamed: each expert stack
        C-contiguous (not the halves of a fused gate_up tensor)."""
        return all(h.flags.c_contiguous for h in self._hosts)

    def stream_sources(self) -> tuple:
        """The (gate, up, down) stacks of the experts the cache does not hold, in expert order
        (expert e at `stream_slot_of[e]`), as `weight_stream.Source`s: one piece per run of
        consecutive uncached experts (one copy each)."""
        if self._stream_sources is None:
            uncached = np.flatnonzero(self.host_slot_of < 0)
            runs = np.split(uncached, np.flatnonzero(np.diff(uncached) != 1) + 1) if uncached.size else []
            self._stream_sources = tuple(
                Source(tuple(h[r[0]:r[-1] + 1] for r in runs), (uncached.size, *h.shape[1:]), h) for h in self._hosts)
        return self._stream_sources

    def tables(self, n: int) -> tuple:
        """(slot_of, pcie_count) for `route` in a call of n rows."""
        return self.slot_of, self.pcie_count if self.fetches(n) else no_gpu_tables(len(self.host_slot_of), self.k)[1]

    def staging(self) -> tuple | None:
        """The (gate, up, down) staging stacks (PCIE_MAX_ROWS · per_row slots each), or None.
        Scratch: every MoE layer of this shape uses the same ones, one after another."""
        if not self.per_row:
            return None
        return tuple(memory.scratch(f"expert_cache.stage{kind}", (PCIE_MAX_ROWS * self.per_row, *stack.shape[1:]),
                                    np.uint8) for kind, stack in enumerate(self.stacks))


def _host_stack(stack: np.ndarray) -> tuple[np.ndarray, int]:
    """An expert stack (E, rows, row_bytes) whose experts are evenly spaced C-contiguous matrices
    (the halves of a fused gate_up tensor too) as a C-contiguous stack of matrices from its
    first expert on, and the step: expert e is matrix e·step."""
    E, rows, row_bytes = stack.shape
    step, rem = divmod(stack.strides[0], rows * row_bytes) if rows * row_bytes else (0, 1)
    if rem or step < 1 or stack.strides[1:] != (row_bytes, 1):
        raise ValueError("expert stack is not a stack of evenly spaced C-contiguous matrices")
    matrices = (E - 1) * step + 1
    return np.lib.stride_tricks.as_strided(stack, (matrices, rows, row_bytes), (rows * row_bytes, row_bytes, 1)), step


def no_gpu_tables(n_expert: int, k: int) -> tuple:
    """(slot_of, pcie_count) for `route` when the GPU runs no routed expert (device arrays,
    made once per shape)."""
    key = (n_expert, k)
    if key not in _NO_GPU:
        _NO_GPU[key] = (memory.upload(np.full(n_expert, -1, np.int32)), memory.upload(np.zeros(k + 1, np.int32)))
    return _NO_GPU[key]


_NO_GPU: dict[tuple, tuple] = {}


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
def _route(bits, slot_of, pcie_count, experts, weights, where, x, x_out, experts_out, weights_out):
    """bits: the router logits (n, E) as uint32. One warp per row picks the k best in k rounds:
    each lane takes the largest `_pick_value` of its own experts (e ≡ lane mod 32), a shuffle
    butterfly gives the warp's largest, and the lane that holds the winner zeroes it. Then the
    lanes weigh the picks and lane 0 sums them in rank order, and places each pair (the module
    docstring's rule). About k·E/32 compares per lane, no barrier per round: faster than a block
    that ranked every expert against all E others (E² compares), by 2-4× at E = 256..512. Every global load after the rounds is
    made by the lanes at once (one rank each), so lane 0's serial placement reads shared memory
    only: a load per rank in its loop cost a memory latency each.
    Also copies the routing to experts_out / weights_out and the row x[i] to x_out[i] (when
    x_out has rows): the host's copies, in mapped host memory, with no copy node after. The row
    goes in blocks of its own (grid y ≥ 1, `X_COPY` entries each): one warp writing a
    model-width row over PCIe took longer than the routing itself."""
    i = cuda.blockIdx.x
    t = cuda.threadIdx.x
    if cuda.blockIdx.y > 0:
        if i < x_out.shape[0]:
            for c in range((cuda.blockIdx.y - 1) * X_COPY + t, min(cuda.blockIdx.y * X_COPY, x_out.shape[1]), 32):
                x_out[i, c] = x[i, c]
        return
    n_expert = bits.shape[1]
    k = experts.shape[1]
    values = cuda.shared.array(MAX_EXPERTS, uint64)
    picked = cuda.shared.array(MAX_TOP_K, int64)
    picked_logit = cuda.shared.array(MAX_TOP_K, float64)
    picked_slot = cuda.shared.array(MAX_TOP_K, int32)
    counts = cuda.shared.array(MAX_COUNTS, int32)
    share = cuda.shared.array(MAX_TOP_K, float64)         # exp(l_rank − l_0)
    code = cuda.shared.array(MAX_TOP_K, int32)
    total = cuda.shared.array(1, float64)
    for r in range(t, k + 1, 32):
        counts[r] = pcie_count[r]
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
    cuda.syncthreads()
    for r in range(t, k, 32):
        picked_logit[r] = float64(bits_to_f32(bits[i, picked[r]]))
        picked_slot[r] = slot_of[picked[r]]
    cuda.syncthreads()
    # p_e / Σ_top-k p in float64, as cpu.moe.route: a softmax over the chosen logits
    for r in range(t, k, 32):
        share[r] = math.exp(picked_logit[r] - picked_logit[0])
    cuda.syncthreads()
    if t == 0:
        total[0] = 0.0
        uncached = 0
        for r in range(k):
            total[0] += share[r]
            if picked_slot[r] < 0:
                uncached += 1
        over_pcie = counts[uncached]                # the last ones of the uncached ranks
        stage = i * counts[k]                       # this row's first staging slot
        for r in range(k - 1, -1, -1):
            slot = picked_slot[r]
            if slot >= 0:
                code[r] = slot
            elif over_pcie > 0:
                code[r] = -2 - stage
                stage += 1
                over_pcie -= 1
            else:
                code[r] = ON_CPU
    cuda.syncthreads()
    for r in range(t, k, 32):
        e = picked[r] if code[r] == ON_CPU else -1 - picked[r]
        w = share[r] / total[0]
        experts[i, r] = e
        weights[i, r] = w
        where[i, r] = code[r]
        experts_out[i, r] = e
        weights_out[i, r] = w


def routes_on_device(n_expert: int, k: int) -> bool:
    """Whether `route` takes top-k of n_expert experts."""
    return k <= min(n_expert, MAX_TOP_K) and n_expert <= MAX_EXPERTS


def route(logits, experts, weights, where=None, tables=None, to_host=None) -> None:
    """experts (n, k) int64 and weights (n, k) float32 of router logits (n, E), on the device,
    and where (n, k) int32 each pair runs, by `tables` = (slot_of, pcie_count)
    (`ExpertCache.tables`; None: the CPU runs every pair). Pairs the GPU runs come out of
    experts as ~e: the host's copy of the routing. to_host = (x, x_host, experts_host,
    weights_host): device views of mapped host buffers that also get the rows x and the routing
    (a hand-off's inputs, written where the host reads them)."""
    n, k = experts.shape
    if not routes_on_device(logits.shape[1], k):
        raise ValueError(f"top-{k} of {logits.shape[1]} experts; the routing kernel takes top-{MAX_TOP_K} "
                         f"of {MAX_EXPERTS} at most")
    slot_of, pcie_count = tables or no_gpu_tables(logits.shape[1], k)
    if where is None:
        where = memory.scratch("expert_cache.where", (n, k), np.int32)
    if to_host is None:
        no_rows = memory.scratch("expert_cache.no_rows", (0, 0))
        to_host = (no_rows, no_rows, experts, weights)      # the routing written twice in place
    if n:
        copy_blocks = -(-to_host[1].shape[1] // X_COPY)
        _route[(n, 1 + copy_blocks), 32, stream()](logits.view(np.uint32), slot_of, pcie_count, experts, weights, where,
                                                   *to_host)


# --- 2. the GPU's pairs ------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _silu_times_gpu(g, u, where):
    """g ← SiLU(g) ⊙ u on the rows of the pairs the GPU runs. Not gpu.ffn.silu_times on every
    row: the others hold leftovers, whose exp may overflow (the simulator raises)."""
    t = cuda.grid(1)
    cols = g.shape[1]
    k = where.shape[1]
    if t < g.shape[0] * cols:
        a = t // cols
        c = t - a * cols
        if where[a // k, a % k] != ON_CPU:
            gv = g[a, c]
            g[a, c] = gv / (float32(1.0) + math.exp(-gv)) * u[a, c]


@cuda.jit(device=True, inline=True)
def _copy_matrix(src, matrix, dst, t, stride):
    """dst[:] = src[matrix, :] (uint32 words, 16 bytes a load), words t·4, (t + stride)·4, …
    of it by this thread: two loads in flight before their stores."""
    words = dst.shape[0]
    q = 4 * t
    while q + 4 * stride < words:
        a0, a1, a2, a3 = load_u32x4(src, matrix, q)
        b0, b1, b2, b3 = load_u32x4(src, matrix, q + 4 * stride)
        store_u32x4(dst, q, a0, a1, a2, a3)
        store_u32x4(dst, q + 4 * stride, b0, b1, b2, b3)
        q += 8 * stride
    if q < words:
        a0, a1, a2, a3 = load_u32x4(src, matrix, q)
        store_u32x4(dst, q, a0, a1, a2, a3)


@cuda.jit(cache=True)
def _fetch(where, experts, a_src, a_step, a_dst, b_src, b_step, b_dst):
    """Pair p (grid y) fetched over PCIe (code −2 − s): its expert's matrix of kind a (grid z 0)
    or b (grid z 1) from the mapped host stack (matrices, words) into staging slot s of the
    (slots, words) stack."""
    p = cuda.blockIdx.y
    k = where.shape[1]
    i = p // k
    code = where[i, p - i * k]
    if code > -2:
        return
    slot = -2 - code
    e = -1 - experts[i, p - i * k]
    t = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
    stride = cuda.gridDim.x * cuda.blockDim.x
    if cuda.blockIdx.z == 0:
        _copy_matrix(a_src, e * a_step, a_dst[slot], t, stride)
    else:
        _copy_matrix(b_src, e * b_step, b_dst[slot], t, stride)


def fetch(cache: ExpertCache, where, experts, staged, stream, kinds=(0, 1, 2)) -> None:
    """Copy these matrix kinds (0 gate, 1 up, 2 down) of the pairs `where` sends over PCIe into
    their staging slots (`staged`: `staging()`): one launch per two kinds."""
    n, k = where.shape
    for first in range(0, len(kinds), 2):
        part = kinds[first:first + 2]
        args = []
        for kind in (part[0], part[-1]):          # (a, b): the same kind twice is read once
            stage = staged[kind]
            dst = stage.reshape(stage.shape[0], stage.shape[1] * stage.shape[2]).view(np.uint32)
            args += [cache.mapped[kind], cache.steps[kind], dst]
        _fetch[(FETCH_BLOCKS, n * k, len(part)), FETCH_THREADS, stream](where, experts, *args)


@cuda.jit(cache=True)
def _stream_codes(where, experts, stream_slot_of):
    """The pairs `_route` left to the CPU run on the GPU from the streamed stacks instead: code
    −2 − s, s the expert's index there, and the expert marked ~e as every GPU pair's."""
    t = cuda.grid(1)
    k = where.shape[1]
    if t < where.shape[0] * k:
        i = t // k
        r = t - i * k
        if where[i, r] == ON_CPU:
            e = experts[i, r]
            where[i, r] = -2 - stream_slot_of[e]
            experts[i, r] = -1 - e


def stream_codes(cache: ExpertCache, where, experts) -> None:
    """After `route`: every pair of the call runs on the GPU, the uncached ones from the stacks
    `cache.stream_sources` were copied into (`run`'s `staged`)."""
    _stream_codes[-(-where.size // THREADS), THREADS, stream()](where, experts, cache.stream_slot_of)


def run(cache: ExpertCache, x, where, experts, y, meanwhile=None, staged=None) -> None:
    """y[i·k + rank] = the output of row i's rank-th expert, for the pairs `where` gives the GPU
    (other rows of y are left as they were); meanwhile() queues other device work (the shared
    expert) that runs beside the fetch over PCIe. x: (n, D) float32 on the device. staged: the
    (gate, up, down) stacks the codes −2 − s index (streamed experts: `stream_codes`); None:
    the staging slots of the PCIe share, fetched here.

    The fetch goes in two parts on the side stream, gate and up matrices then down: the gate
    and up products (and SiLU, and h's quantisation) run beside the down matrices' fetch, so
    only the down product waits for the whole fetch."""
    n, k = where.shape
    fetching = staged is None and cache.fetches(n)
    if fetching:
        staged = cache.staging()
    gate_t, up_t, down_t = cache.wtypes
    s = stream()
    h_shape = (n * k, cache.stacks[0].shape[1])
    g, u = memory.scratch("expert_cache.g", h_shape), memory.scratch("expert_cache.u", h_shape)
    quantized = []

    def sources(kind):
        cached = cache.stacks[kind]
        return (cached, cached) if staged is None else ((cached if cache.n_slots else staged[kind]), staged[kind])

    def before_gate_up():
        if meanwhile is not None:
            meanwhile()
        quantized.append(quantize(x, s, UNITS[gate_t].x_layout))

    def gate_up():
        experts_matvec(gate_t, *sources(0), where, quantized[0], g, False, s)
        xq = quantized[0]
        if UNITS[up_t].x_layout != UNITS[gate_t].x_layout:
            xq = quantize(x, s, UNITS[up_t].x_layout)
        experts_matvec(up_t, *sources(1), where, xq, u, False, s)
        _silu_times_gpu[-(-g.size // THREADS), THREADS, s](g, u, where)
        quantized.append(quantize(g, s, UNITS[down_t].x_layout))

    if not fetching:
        before_gate_up()
        gate_up()
    else:
        memory.beside((lambda side: fetch(cache, where, experts, staged, side, (0, 1)),
                       lambda side: fetch(cache, where, experts, staged, side, (2,))),
                      (before_gate_up, gate_up))
    experts_matvec(down_t, *sources(2), where, quantized[1], y, True, s)


# --- 3. the sum ------------------------------------------------------------------------------------

@cuda.jit(cache=True)
def _finish(out, host_part, y, where, weights, shared, gate_logit, with_shared):
    t = cuda.grid(1)
    D = out.shape[1]
    k = where.shape[1]
    if t < out.shape[0] * D:
        i = t // D
        c = t - i * D
        acc = host_part[i, c]
        for rank in range(k):
            if where[i, rank] != ON_CPU:
                acc += weights[i, rank] * y[i * k + rank, c]
        if with_shared:
            acc += float32(1.0) / (float32(1.0) + math.exp(-gate_logit[i, 0])) * shared[i, c]
        out[i, c] = acc


def finish(out, host_part, y, where, weights, shared=None, gate_logit=None) -> None:
    """out (n, D) = host_part + Σ over the GPU's ranks, in rank order, of weights · y; then
    + σ(gate_logit) · shared when given. host_part may be a view of mapped host memory (the
    host's sum, read over PCIe where it lies); y is not read where no pair ran on the GPU."""
    with_shared = shared is not None
    if not with_shared:
        shared = gate_logit = out      # not read
    _finish[-(-out.size // THREADS), THREADS, stream()](out, host_part, y, where, weights, shared, gate_logit,
                                                        with_shared)
