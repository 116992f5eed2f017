"""The runtime: where arrays live, where each part of the forward runs, and how rows move.

The forward (hybrid/forward.py) is the model's math against an op set; a backend owns everything
about running it: it allocates the activations and session states, copies between host and
backend arrays, places the weights, decides where an FFN or an embedding lookup runs, and runs
each step (`run_step`: a GPU backend captures it as a CUDA graph and replays it). Two of them:

* `CPUBackend`: numpy arrays, the `cpu.ops` kernels; every method is the plain numpy idiom.
* `GPUBackend`: device arrays and the `gpu.ops` kernels for the trunk; the FFN of a layer whose
  weights stay in host memory runs on the CPU through one hand-off (its input rows go down to
  pinned host memory, `cpu.ops` runs there, the result goes back up: DESIGN.md §3), except in
  calls of many rows (prompt chunks): there the layer's weights are copied to the device and
  the FFN runs there (`gpu.runtime.weight_stream`), one transfer instead of n rows of CPU work.
  A matrix op whose weight an -ot rule left in host memory hands off on its own (`gpu.ops`).
  A split FFN (`weights.SplitFFN`, `--split-ffn`) runs its device half during its host half's
  hand-off and adds the two.

Placement: which matrices a GPU backend uploads. `placement` is a function tensor name →
"gpu" | "cpu" (e.g. `hybrid.placement.Plan.side`), a mapping name → side (missing: "cpu"), a
collection of tensor names to upload, or None for the default: everything except the trunk's
FFN matrices (role "ffn" in `hybrid.layout`) goes to the GPU. Small vectors
(norms, conv taps, gate constants) always go with the backend.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import replace

import numpy as np

from .errors import HybridError
from .layout import expected_tensors, options_from_names
from .weights import DenseFFN, MoEFFN, SplitFFN, iter_matrices, place_weights, split_dense_ffn

PLACES = ("gpu", "cpu")
Placement = Callable[[str], str] | Mapping[str, str] | Collection[str] | None


class CPUBackend:
    name = "cpu"
    # the fewest rows of a call that gets the prompt kernels' bits (`generate.prompt_chunks`): every
    # CPU kernel keeps a row's bits whatever the number of rows
    min_prompt_rows = 1

    def __init__(self, ops=None):
        self._ops = ops

    @property
    def ops(self):
        if self._ops is None:          # imported on first use: a bare SessionState needs no kernels (cpu.ops loads them all)
            import cpu.ops
            self._ops = cpu.ops
        return self._ops

    def zeros(self, shape, dtype=np.float32) -> np.ndarray:
        return np.zeros(shape, dtype)

    def result(self, key: str, shape) -> np.ndarray:
        """A float32 buffer for a call's result: a fresh array the caller may keep."""
        return np.empty(shape, np.float32)

    def to_backend(self, host: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(host, dtype=host.dtype)

    def to_host(self, a) -> np.ndarray:
        return a

    def copy(self, dst, src) -> None:
        dst[...] = src

    def fill_zero(self, a) -> None:
        a.fill(0)

    def ffn(self, ffn, x, h, out, math) -> None:
        """out = FFN(x): math(ops, ffn, x, h, out) with this backend's op set."""
        math(self.ops, ffn, x, h, out)

    def embed_rows(self, table, ids) -> np.ndarray:
        """float32 (n, cols) rows `ids` of the embedding matrix `table`."""
        return self.ops.dequantize_rows(table.wtype, table.data, ids, table.cols)

    def run_step(self, fn, *args) -> None:
        """fn(*args): one step (see GPUBackend.run_step)."""
        fn(*args)

    def planning(self):
        """What a warm-up's plan pass runs in (hybrid/kernel_prep.py): nothing to change here."""
        return contextlib.nullcontext()

    @property
    def one_offs(self) -> int:
        """Steps that ran once-only work (none here: steps are never captured)."""
        return 0

    def place_weights(self, weights, model_file, placement: Placement, expert_cache=None, pcie_share: float = 0.0,
                      stream_experts: bool = False, ffn_split=None):
        if any((expert_cache or {}).values()):
            raise HybridError("an expert cache lives on the GPU, but this forward runs on the CPU backend")
        if ffn_split:
            raise HybridError("a split FFN's device half lives on the GPU, but this forward runs on the CPU backend")
        if placement is not None and any(_rule(placement, model_file)(m.name) == "gpu"
                                         for m in _all_matrices(weights)):
            raise HybridError("the placement puts weights on the GPU, but this forward runs on the CPU "
                              "backend; use backend='gpu'")
        return weights


class GPUBackend:
    name = "gpu"

    def __init__(self, ops=None, cuda_graphs: bool = True, stream_weights: bool = True,
                 stream_min_rows: int | None = None, register_host_memory: bool = True):
        """stream_weights: run the host FFNs of calls with ≥ stream_min_rows rows on the device on
        streamed weights (None: gpu.runtime.weight_stream.STREAM_MIN_ROWS); register_host_memory=False
        stages those copies through pinned buffers instead of page-locking the mapped file."""
        # the GPU kernel modules only once require_cuda has found a GPU (a clear error otherwise):
        # a CPU run never loads them
        from gpu import require_cuda
        require_cuda()
        import cpu.ops    # with the GPU modules: the CPU kernels are loaded on first use (CPUBackend.ops)
        import gpu.ffn
        import gpu.runtime.graphs
        import gpu.runtime.memory
        from gpu.matmul.gemm import GEMM_MIN_ROWS
        from gpu.runtime.pcie import PCIE_MAX_ROWS
        from gpu.runtime.weight_stream import STREAM_MIN_ROWS, WeightStreamer
        if ops is None:
            import gpu.ops as ops    # GPU backend only (see above)
        self.ops = ops
        self.host_ops = cpu.ops
        self.memory = gpu.runtime.memory
        self.graphs = gpu.runtime.graphs.StepGraphs(enabled=cuda_graphs)
        min_rows = (STREAM_MIN_ROWS if stream_min_rows is None else stream_min_rows) if stream_weights else None
        self.streamer = WeightStreamer(gpu.ffn.dense_ffn, min_rows, register=register_host_memory)
        # Calls of fewer rows run the decode kernels (int8 matvec, host FFNs on the CPU, PCIe expert
        # fetches), longer ones the prompt kernels (GEMM, streamed FFNs): each keeps a row's bits
        # within its kind, not across (`generate.prompt_chunks` keeps prompts on one kind)
        self.min_prompt_rows = max(GEMM_MIN_ROWS, min_rows or 0, PCIE_MAX_ROWS + 1)

    @property
    def stream_stats(self):
        """gpu.runtime.weight_stream.StreamStats: copy / device FFN / CPU FFN time of the calls so far."""
        return self.streamer.stats

    def zeros(self, shape, dtype=np.float32):
        return self.memory.zeros(shape, dtype)

    def result(self, key: str, shape):
        """A float32 device buffer for a call's result, reused per (key, shape): the forward
        copies results to the host before it returns."""
        return self.memory.scratch("result:" + key, tuple(shape))

    def to_backend(self, host: np.ndarray):
        return self.memory.upload(host)

    def to_host(self, a) -> np.ndarray:
        return self.memory.to_host(a)

    def copy(self, dst, src) -> None:
        self.memory.copy(dst, src)

    def fill_zero(self, a) -> None:
        self.memory.fill_zero(a)

    def ffn(self, ffn, x, h, out, math) -> None:
        """out = FFN(x) for device rows x, where the FFN's weights live: math(ops, ffn, x, h, out)
        with the device op set when any of its matrices is on the device (each product then runs
        where its weights are: gpu.ops); for an FFN wholly in host memory, on streamed weights in
        a call of many rows (a prompt chunk: one transfer beats n rows of CPU work), else with the
        CPU op set on the rows handed down to the host (one round trip). h: the hidden scratch."""
        if isinstance(ffn, SplitFFN):
            self._split_ffn(ffn, x, out, math)
        elif any(self.memory.is_device(m.data) for m in _ffn_matrices(ffn)):
            math(self.ops, ffn, x, h, out)
        elif self.streamer.wants(ffn, x.shape[0]):
            self.streamer.run(ffn, x, h, out)
        else:
            self._host_ffn(ffn, x, out, math)

    def _host_ffn(self, ffn, x, out, math, meanwhile=None) -> None:
        """out = FFN(x) by the CPU op set on the rows handed down to the host (one round trip);
        `meanwhile` queues device work that runs while the CPU does (gpu.runtime.memory.host_call)."""
        host_ops, h_shape = self.host_ops, (x.shape[0], ffn.gate.rows)
        self._host_call((x,), (out,), lambda x_host, out_host: math(
            host_ops, ffn, x_host, self.memory.host_buffer("ffn_hidden", h_shape), out_host), meanwhile)

    def _split_ffn(self, ffn, x, out, math) -> None:
        """out = device half + host half of a SplitFFN: the device half is queued while the CPU
        computes the host half (or, in a prompt chunk, before the host half runs on streamed
        weights), then added to it."""
        n = x.shape[0]
        part = self.memory.scratch("split_ffn:out", out.shape)
        hidden = self.memory.scratch("split_ffn:hidden", (n, ffn.device.gate.rows))

        def device_half():
            math(self.ops, ffn.device, x, hidden, part)
        if self.streamer.wants(ffn.host, n):
            device_half()
            self.streamer.run(ffn.host, x, self.memory.scratch("split_ffn:hidden_host", (n, ffn.host.gate.rows)), out)
        else:
            self._host_ffn(ffn.host, x, out, math, meanwhile=device_half)
        self.ops.add_inplace(out, part)

    def _host_call(self, inputs, outputs, fn, meanwhile=None) -> None:
        """fn(*inputs_host, *outputs_host) on pinned host copies of device arrays; the outputs go
        back up, after the device work `meanwhile` queues. The FFN hand-off: fn's time counts as
        CPU FFN time in stream_stats."""
        stats = self.stream_stats

        def timed(*arrays):
            t0 = time.perf_counter()
            fn(*arrays)
            stats.cpu_ffn_seconds += time.perf_counter() - t0
            stats.cpu_ffn_calls += 1
        self.memory.host_call(inputs, outputs, timed, meanwhile)

    def embed_rows(self, table, ids):
        """float32 (n, cols) rows `ids` of the embedding matrix `table`, dequantised where it
        lives: a table in host memory (the planner's placement) gives host rows, which the
        caller copies straight into its step's input buffer (no device array made per call)."""
        ops = self.ops if self.memory.is_device(table.data) else self.host_ops
        return ops.dequantize_rows(table.wtype, table.data, ids, table.cols)

    def run_step(self, fn, *args) -> None:
        """fn(*args) as one step: GPU work and host calls that read and write only args' buffers
        (and the weights). The first run of a step is eager, the second captured as a CUDA graph,
        and every later one with the same arguments replays it (`step_key`)."""
        self.graphs.run(step_key(fn, args, self.memory.address), lambda: fn(*args))

    @contextlib.contextmanager
    def planning(self):
        """What a warm-up's plan pass runs in (hybrid/kernel_prep.py), whose skipped kernels leave
        garbage: steps run eagerly and count as not seen (a capture would keep the skipped
        launches), and host calls are skipped (gpu.runtime.memory.skip_host_calls)."""
        graphs, self.graphs.enabled = self.graphs.enabled, False
        self.memory.skip_host_calls = True
        try:
            yield
        finally:
            self.graphs.enabled, self.memory.skip_host_calls = graphs, False

    @property
    def one_offs(self) -> int:
        """Steps that ran once-only work: a key's first eager run or its capture."""
        return self.graphs.one_offs

    def place_weights(self, weights, model_file, placement: Placement, expert_cache=None, pcie_share: float = 0.0,
                      stream_experts: bool = False, ffn_split=None):
        """The records with the GPU's matrices uploaded, `expert_cache` (layer → slots) routed
        experts of each MoE layer copied to the GPU, that share of each row's other routed
        experts fetched by the GPU over PCIe (gpu/expert_cache.py), with `stream_experts`
        a prompt chunk's uncached experts streamed in (the weight streamer's MoE layers), and
        `ffn_split` (layer → hidden rows) those host dense FFNs cut in two, the first rows'
        half uploaded (`weights.split_dense_ffn`)."""
        rule = _rule(placement, model_file)
        placed = place_weights(weights, lambda name: rule(name) == "gpu", self.memory.upload)
        if ffn_split:
            placed = _with_split_ffns(placed, ffn_split, self.memory.upload, self.memory.is_device)
        if expert_cache or pcie_share > 0 or stream_experts:
            placed = _with_expert_caches(placed, expert_cache or {}, pcie_share, stream_experts)
        # what a prompt chunk may stream: the trunk's layers in the order a forward runs them (a
        # dense FFN, or a MoE layer's expert cache), the MTP block's
        def streamed(ffn):
            if isinstance(ffn, SplitFFN):
                ffn = ffn.host
            if streamable_ffn(ffn, self.memory.is_device):
                return ffn
            cache = getattr(ffn, "cache", None)
            if stream_experts and cache is not None and cache.streamable():
                cache.streamer = self.streamer
                return cache
            return None
        order = [r for r in (streamed(layer.ffn) for layer in placed.layers) if r is not None]
        mtp = streamed(placed.mtp.block.ffn) if placed.mtp else None
        self.streamer.set_order(order, [mtp] if mtp is not None else [])
        return placed


def step_key(fn, args, address) -> tuple:
    """What a captured step is bound to, so a replay is right exactly when this matches: the
    function (and its object's identity, if it has one: a state), and per argument its identity
    (a state or the forward's scratch: `identity`), the address, shape and type of a buffer
    (`address(array)`), or the value of a flag or count. A graph replays the launches it recorded,
    with the buffers and scalars they were given."""
    def part(a):
        if a is None or isinstance(a, (bool, int, float, str)):
            return a
        if isinstance(a, np.generic):           # a numpy count or flag: its value
            return a.item()
        if isinstance(a, tuple):
            return tuple(part(e) for e in a)
        if hasattr(a, "identity"):
            return type(a).__name__, a.identity
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            return address(a), a.shape, a.dtype.str
        raise HybridError(f"a step's arguments are buffers, states, flags and counts; got {type(a).__name__}")
    owner = getattr(fn, "__self__", None)
    return (fn.__qualname__, None if owner is None else getattr(owner, "identity", None), *map(part, args))


def _with_split_ffns(weights, ffn_split, upload, is_device):
    """weights with trunk layer i's host dense FFN cut after ffn_split[i] hidden rows, the first
    half's matrices uploaded."""
    def split(layer):
        rows = ffn_split.get(layer.index, 0)
        if rows <= 0:
            return layer
        if not streamable_ffn(layer.ffn, is_device):    # (the same test: a dense FFN wholly in host memory)
            raise HybridError(f"blk.{layer.index}: only a dense FFN in host memory can be split")
        halves = split_dense_ffn(layer.ffn, rows)
        device = DenseFFN(*(replace(m, data=upload(m.data)) for m in (halves.device.gate, halves.device.up,
                                                                     halves.device.down)))
        return replace(layer, ffn=replace(halves, device=device))
    return replace(weights, layers=tuple(split(layer) for layer in weights.layers))


def _with_expert_caches(weights, slots, pcie_share: float, stream_experts: bool = False):
    """weights with an ExpertCache of slots[i] experts and the PCIe share on each MoE layer i
    (the MTP block is layer n_layer) whose routed experts stayed in host memory and whose router
    is on the GPU (the routing that splits the pairs runs there); with stream_experts every such
    layer gets one (of no slots, maybe: the streamed experts run through it)."""
    # gpu.expert_cache only once a GPU model places its experts: a CPU run never loads it
    from gpu.expert_cache import ExpertCache, cacheable
    from gpu.runtime.memory import is_device

    def cached(layer, index):
        ffn, k = layer.ffn, int(slots.get(index, 0))
        if ((k <= 0 and pcie_share <= 0 and not stream_experts) or not isinstance(ffn, MoEFFN) or not cacheable(ffn) or not is_device(ffn.router.data)
                or any(is_device(m.data) for m in (ffn.gate, ffn.up, ffn.down))):
            return layer
        return replace(layer, ffn=replace(ffn, cache=ExpertCache(ffn, k, pcie_share)))
    layers = tuple(cached(layer, layer.index) for layer in weights.layers)
    mtp = weights.mtp
    if mtp is not None:
        mtp = replace(mtp, block=cached(mtp.block, weights.config.n_layer))
    return replace(weights, layers=layers, mtp=mtp)


def make_backend(backend="cpu", ops=None, cuda_graphs: bool = True):
    """A backend object from its name ("cpu" | "gpu"), or the object itself."""
    if not isinstance(backend, str):
        return backend
    if backend == "cpu":
        return CPUBackend(ops)
    if backend == "gpu":
        return GPUBackend(ops, cuda_graphs)
    raise HybridError(f"unknown backend {backend!r}; choose 'cpu' or 'gpu'")


# --- placement ------------------------------------------------------------------------------------

def tensor_roles(model_file) -> dict[str, str]:
    """Tensor name → role ("embeddings", "lm_head", "trunk", "ffn", "mtp") for this file's layout."""
    names = set(model_file.tensors)
    return {s.name: s.role for s in expected_tensors(model_file.config, options_from_names(names))}


def default_gpu_placement(model_file) -> Callable[[str], str]:
    """Everything on the GPU except the trunk layers' FFN matrices (their bytes dominate)."""
    roles = tensor_roles(model_file)
    return lambda name: "cpu" if roles.get(name) == "ffn" else "gpu"


def _rule(placement: Placement, model_file) -> Callable[[str], str]:
    """The placement as a checked function of a bound matrix's name (its tensor name, with the
    "[part]" suffix of regrouped tensors removed)."""
    if placement is None:
        base = default_gpu_placement(model_file)
    elif callable(placement):
        base = placement
    elif isinstance(placement, Mapping):
        sides = dict(placement)
        base = lambda name: sides.get(name, "cpu")   # noqa: E731
    elif isinstance(placement, Collection) and not isinstance(placement, str):
        chosen = frozenset(placement)
        base = lambda name: "gpu" if name in chosen else "cpu"   # noqa: E731
    else:
        raise HybridError(f"placement must be a function name → 'gpu'|'cpu', a mapping name → side, a "
                          f"collection of tensor names to upload, or None; got {placement!r}")

    def rule(name: str) -> str:
        where = base(name.split("[", 1)[0])
        if where not in PLACES:
            raise HybridError(f"placement of {name} is {where!r}; expected 'gpu' or 'cpu'")
        return where
    return rule


def streamable_ffn(ffn, is_device) -> bool:
    """Whether prompt chunks may stream this FFN's weights to the GPU: a dense FFN wholly in host
    memory (a MoE layer streams through its expert cache: `ExpertCache.stream_sources`)."""
    return isinstance(ffn, DenseFFN) and not any(is_device(m.data) for m in _ffn_matrices(ffn))


def _ffn_matrices(ffn):
    if isinstance(ffn, DenseFFN):
        return (ffn.gate, ffn.up, ffn.down)
    shared = (ffn.shared.gate, ffn.shared.up, ffn.shared.down, ffn.shared_gate) if ffn.shared else ()
    return (ffn.router, ffn.gate, ffn.up, ffn.down, *shared)


def _all_matrices(weights):
    return iter_matrices(weights)
