"""Which tensors live on the GPU, and what that costs: the placement planner.

The GPU fills up in this order (DESIGN.md §3–4):
1. the trunk (attention / GDN projections and norms, output_norm): read every token, and the
   layer loop runs there;
2. the state: KV cache of every attention layer, GDN recurrent + conv state times (1 + snapshot
   ring slots), activation scratch and a safety margin;
3. the lm_head (output.weight, or token_embd when tied): a whole matrix read every token.
   1–3 must fit; if they do not, the plan fails with the numbers and what to change;
4. when drafting: the MTP block's attention / eh_proj part (read once per draft token);
5. the FFN: every MoE layer's router + shared expert first (small, read every token), then the
   MTP block's FFN when drafting (read k−1 times per verify step), then whole dense FFN layers,
   smallest first, as many as fit (each is read once per token, so the count is what matters);
   with `split_ffn`, when not all of them fit, the same share of every one instead (its first
   hidden rows: the GPU computes them while the CPU computes the rest of the layer);
   routed experts stay on the CPU: a token reads only top-k of them, which CPU RAM serves well.
   `expert_cache` spends what is left on caching the same number of experts in every MoE layer
   (the runtime picks the most used ones). Of the uncached experts a token picks, the GPU still
   fetches a share (`pcie_share`) from host memory over PCIe, into staging slots reserved first.
   Prompt chunks run every routed expert on the GPU: each MoE layer's uncached experts are
   streamed in whole (two slots, one layer's uncached experts each), and the cache and those
   slots share what is left, as many cached experts as leave room for the slots.
Embeddings stay on the CPU: a token reads one row, so sending D floats up is free and the VRAM
goes to whole matrices. When tied, token_embd *is* the lm_head and goes with it. Everything not
on the GPU stays memory-mapped from the GGUF and is streamed by the CPU kernels. Without drafting
nothing reads the MTP block, so it stays (unread) on the CPU.

`-ot REGEX=CPU|GPU` (llama.cpp's --override-tensor) pins tensors whose name matches, first rule
wins; a pinned-GPU tensor counts as a must-have.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from gpu import available
from gpu.attention import KV_DTYPE as GPU_KV_DTYPE
from gpu.runtime.pcie import PCIE_MAX_ROWS, pcie_counts
from gpu.runtime.weight_stream import SLOTS as STREAM_SLOTS
from gpu.matmul.quants import UNITS as GPU_UNITS

from .config import ModelConfig
from .layout import options_from_names
from .generate import PREFILL_CHUNK
from .state import DEFAULT_N_CTX
from .errors import HybridError
from .units import MiB, format_size, parse_size
from .weights import split_rows

GPU, CPU = "gpu", "cpu"
SIDES = (GPU, CPU)
# Report order of the tensor groups.
GROUPS = ("trunk", "lm_head", "embeddings", "mtp", "mtp ffn", "router+shared", "ffn", "experts", "other")

F32_BYTES = 4
MARGIN_FRACTION = 0.05          # CUDA allocator rounding and fragmentation, kernel modules
MARGIN_MIN = 256 * MiB

_LAYER = re.compile(r"^blk\.(\d+)\.")

# Of the routed experts a token picks that the GPU does not cache, the share it fetches from host
# memory over PCIe while the CPU runs the rest (gpu/expert_cache.py). The host's DRAM serves both.
# The share that gave the fastest token on the 35B-A3B shape at 12 GiB (tools/device/moe_pcie_sweep.py,
# docs/MEASUREMENTS.md); past it the GPU's side of a hand-off takes longer than the CPU's.
DEFAULT_PCIE_SHARE = 0.375


def check_pcie_share(share) -> float:
    """The PCIe share as a float in 0..1, or a HybridError."""
    try:
        value = float(share)
    except (TypeError, ValueError):
        raise HybridError(f"the PCIe share must be a number from 0 to 1; got {share!r}") from None
    if not 0.0 <= value <= 1.0:
        raise HybridError(f"the PCIe share is a fraction of a token's uncached experts, from 0 to 1; got {value}")
    return value


# --- -ot / --override-tensor -------------------------------------------------------------------

@dataclass(frozen=True)
class Override:
    text: str
    pattern: re.Pattern
    side: str


def parse_overrides(items: Iterable[str]) -> tuple[Override, ...]:
    """'REGEX=CPU' / 'REGEX=GPU' (CUDA, CUDA0… also mean the GPU), as llama.cpp's -ot takes them."""
    out = []
    for text in items:
        regex, sep, target = str(text).rpartition("=")
        if not sep or not regex:
            raise HybridError(f"-ot {text!r}: write it as REGEX=CPU or REGEX=GPU, e.g. -ot 'ffn_.*_exps=CPU'")
        t = target.strip().upper()
        if t == "CPU":
            side = CPU
        elif t == "GPU" or re.fullmatch(r"CUDA\d*", t):
            side = GPU
        else:
            raise HybridError(f"-ot {text!r}: unknown target {target!r}; use CPU or GPU")
        try:
            pattern = re.compile(regex)
        except re.error as e:
            raise HybridError(f"-ot {text!r}: bad regular expression ({e})") from None
        out.append(Override(str(text), pattern, side))
    return tuple(out)


def _forced_side(name: str, overrides: Sequence[Override]) -> str | None:
    for o in overrides:
        if o.pattern.search(name):
            return o.side
    return None


# --- the plan ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorPlace:
    name: str
    group: str           # one of GROUPS
    side: str            # GPU or CPU
    nbytes: int
    token_bytes: int     # bytes read per plainly decoded token (routed experts: top-k share)
    draft_bytes: int     # bytes read per MTP draft token
    forced: bool = False  # pinned by -ot


@dataclass(frozen=True)
class Plan:
    device: str                              # "cuda" when a GPU is used, else "cpu"
    tensors: dict[str, TensorPlace]
    budget: int | None                       # VRAM budget in bytes; None for a CPU plan
    vram: dict[str, int]                     # what the budget pays for, bytes (empty for a CPU plan)
    n_ctx: int
    n_ring: int                              # snapshot ring slots (0: no drafting)
    expert_cache: dict[int, int] = field(default_factory=dict)   # layer → experts cached on the GPU
    expert_cache_token_bytes: int = 0        # per-token expert bytes the cache serves (uniform routing)
    notes: tuple[str, ...] = ()
    pcie_share: float = 0.0                  # of a token's uncached experts, the share the GPU fetches
    ffn_split: dict[int, int] = field(default_factory=dict)   # layer → hidden rows of its CPU FFN the GPU runs
    ffn_split_token_bytes: int = 0           # per-token FFN bytes those device halves read

    def side(self, name: str) -> str:
        return self.tensors[name].side

    @property
    def streams_experts(self) -> bool:
        """Whether prompt chunks stream each MoE layer's uncached experts to the GPU."""
        return self.vram.get("expert_streaming", 0) > 0

    def on_gpu(self, name: str) -> bool:
        return self.tensors[name].side == GPU

    @property
    def vram_used(self) -> int:
        return sum(self.vram.values())

    @property
    def vram_left(self) -> int | None:
        return None if self.budget is None else self.budget - self.vram_used

    def weight_bytes(self, side: str) -> int:
        return sum(t.nbytes for t in self.tensors.values() if t.side == side)

    def per_token(self, side: str) -> int:
        """Weight bytes one plainly decoded token reads on `side` (a k-token verify step reads the
        same bytes once for all k tokens, plus the drafts' MTP bytes)."""
        n = sum(t.token_bytes for t in self.tensors.values() if t.side == side)
        return n + self._moved_to_gpu(side)

    def per_draft(self, side: str) -> int:
        return sum(t.draft_bytes for t in self.tensors.values() if t.side == side)

    def ffn_per_token(self, side: str) -> int:
        """FFN share of per_token (dense layers, routers, shared and routed experts; MTP excluded)."""
        n = sum(t.token_bytes for t in self.tensors.values()
                if t.side == side and t.group in ("ffn", "router+shared", "experts"))
        return n + self._moved_to_gpu(side)

    def _moved_to_gpu(self, side: str) -> int:
        """Per-token bytes of CPU-side tensors that the GPU reads instead (cached experts, split
        FFNs' device halves), signed for `side`."""
        moved = self.expert_cache_token_bytes + self.ffn_split_token_bytes
        return moved if side == GPU else -moved

    def cpu_seconds_per_token(self, bandwidth: float) -> float:
        """The CPU side's roofline: its per-token bytes at `bandwidth` bytes/s."""
        return self.per_token(CPU) / bandwidth

    def ffn_layers(self, side: str) -> list[int]:
        """Trunk layers whose dense FFN (or router + shared expert) lies wholly on `side`."""
        by_layer: dict[int, set[str]] = {}
        for t in self.tensors.values():
            if t.group in ("ffn", "router+shared"):
                by_layer.setdefault(layer_of(t.name), set()).add(t.side)
        return sorted(i for i, sides in by_layer.items() if sides == {side})

    def groups(self) -> dict[str, dict[str, dict[str, int]]]:
        """group → side → {tensors, bytes, token_bytes, draft_bytes}, in GROUPS order, non-empty only."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for g in GROUPS:
            for t in self.tensors.values():
                if t.group != g:
                    continue
                cell = out.setdefault(g, {}).setdefault(
                    t.side, {"tensors": 0, "bytes": 0, "token_bytes": 0, "draft_bytes": 0})
                cell["tensors"] += 1
                cell["bytes"] += t.nbytes
                cell["token_bytes"] += t.token_bytes
                cell["draft_bytes"] += t.draft_bytes
        return out

    def to_dict(self, cpu_bandwidth: float | None = None) -> dict[str, Any]:
        """JSON-ready; keys are stable (`hybrid info --plan --json`)."""
        d: dict[str, Any] = {
            "device": self.device, "budget": self.budget, "n_ctx": self.n_ctx, "n_ring": self.n_ring,
            "vram": dict(self.vram), "vram_used": self.vram_used, "vram_left": self.vram_left,
            "weights": {s: self.weight_bytes(s) for s in SIDES},
            "per_token": {s: self.per_token(s) for s in SIDES},
            "per_draft": {s: self.per_draft(s) for s in SIDES},
            "ffn_per_token": {s: self.ffn_per_token(s) for s in SIDES},
            "ffn_layers_on_gpu": self.ffn_layers(GPU),
            "ffn_layers_on_cpu": self.ffn_layers(CPU),
            "expert_cache": {str(k): v for k, v in self.expert_cache.items()},
            "expert_cache_token_bytes": self.expert_cache_token_bytes,
            "pcie_share": self.pcie_share,
            "ffn_split": {str(k): v for k, v in self.ffn_split.items()},
            "ffn_split_token_bytes": self.ffn_split_token_bytes,
            "groups": self.groups(),
            "tensors": {n: t.side for n, t in self.tensors.items()},
            "forced": sorted(n for n, t in self.tensors.items() if t.forced),
            "notes": list(self.notes),
        }
        if cpu_bandwidth:
            d["cpu_bandwidth"] = cpu_bandwidth
            d["cpu_seconds_per_token"] = self.cpu_seconds_per_token(cpu_bandwidth)
        return d


# --- per-tensor facts ---------------------------------------------------------------------------

def layer_of(name: str) -> int:
    """blk.N.* → N; -1 for global tensors."""
    m = _LAYER.match(name)
    return int(m.group(1)) if m else -1


def is_routed_expert(name: str) -> bool:
    return "_exps." in name


def _is_ffn(name: str) -> bool:
    return ".ffn_" in name


def group_of(t, c: ModelConfig) -> str:
    """The placement group of a tensor (an object with .name and .role, as TensorInfo)."""
    name, role = t.name, t.role
    if role == "embeddings":
        return "lm_head" if c.tied_output else "embeddings"
    if role in ("lm_head", "trunk"):
        return role
    if name.endswith(".nextn.embed_tokens.weight"):
        return "embeddings"
    if role == "ffn" or (role == "mtp" and _is_ffn(name)):
        if is_routed_expert(name):
            return "experts"
        if role == "mtp":
            return "mtp ffn"
        return "router+shared" if c.is_moe else "ffn"
    if role == "mtp":
        return "mtp"
    return "other"


def _read_bytes(t, group: str, c: ModelConfig, mtp_embed: bool, mtp_head: bool) -> tuple[int, int]:
    """(bytes per plain token, bytes per draft token) that tensor t is read for. mtp_embed /
    mtp_head: the MTP block has its own embedding / head (else it reuses the trunk's)."""
    name, n = t.name, t.nbytes
    is_mtp = t.role == "mtp"
    if group == "embeddings":
        row = n // max(t.ne[-1], 1)           # one row of (D, n_vocab) per token looked up
        if is_mtp:
            return 0, row
        return row, 0 if mtp_embed else row
    if group == "lm_head":
        return n, 0 if mtp_head else n
    if is_routed_expert(name):
        n = n * c.n_expert_used // max(c.n_expert, 1)
    if group == "other":
        return 0, 0
    return (0, n) if is_mtp else (n, 0)


# --- state, scratch, margin ---------------------------------------------------------------------

def kv_bytes(c: ModelConfig, n_ctx: int, n_layers: int) -> int:
    """K and V (n_head_kv, n_ctx, d_h) of the GPU's cache type, for n attention layers."""
    return n_layers * 2 * c.n_head_kv * c.head_dim * n_ctx * np.dtype(GPU_KV_DTYPE).itemsize


def gdn_state_bytes(c: ModelConfig, n_ring: int) -> int:
    """Recurrent (H_v, d_v, d_k) + conv (K−1, C) float32 per GDN layer, live copy + ring slots."""
    n_gdn = sum(c.is_recurrent(i) for i in range(c.n_layer))
    per_layer = c.ssm_n_v_heads * c.ssm_d_state * c.ssm_d_state + (c.ssm_conv_kernel - 1) * c.ssm_conv_channels
    return n_gdn * per_layer * F32_BYTES * (1 + n_ring)


# Device scratch outside the forward's own buffers (the GPU attention's partial results for each
# call size, the GEMMs' staged inputs): an allowance of this many rows of H × PREFILL_CHUNK floats.
# None of those buffers grows with the context (the attention keeps a fixed number of partial
# results per row at any length), so neither does the allowance.
OTHER_SCRATCH_ROWS = 256


def scratch_bytes(c: ModelConfig, n_ring: int) -> int:
    """Activation buffers, an estimate from hybrid.forward's _Scratch: the forward keeps buffers
    for a prompt chunk (shorter chunks use its leading rows), each verify width and one token
    (a MoE layer's GPU experts write k output rows of D per row); plus the verify rows' logits
    and the allowance above."""
    D, H, dh = c.n_embd, c.n_head, c.head_dim
    ff = max(c.n_ff, c.n_ff_shexp, c.n_ff_exp * max(c.n_expert_used, 1))
    per_row = (4 * D + 2 * ff + c.n_expert_used * D + 4 * H * dh + 2 * c.n_head_kv * dh
               + 2 * c.ssm_conv_channels + 3 * c.ssm_d_inner + 2 * c.ssm_n_v_heads)
    verify = max(n_ring, 1)
    rows = PREFILL_CHUNK + verify + 1
    logits = verify * c.n_vocab
    other = H * OTHER_SCRATCH_ROWS * PREFILL_CHUNK
    return (rows * per_row + logits + other) * F32_BYTES


def streaming_bytes(c: ModelConfig, groups: Mapping[str, str], size: Mapping[str, int]) -> int:
    """The streamer's device slots (STREAM_SLOTS), each the largest dense FFN layer: a prompt
    chunk runs a host FFN layer on the GPU from one while the next layer's weights arrive in the
    other (gpu/runtime/weight_stream.py). A MoE model's slots hold experts: `_expert_streaming`."""
    if c.is_moe:
        return 0
    per_layer: dict[int, int] = {}
    for n, g in groups.items():
        if g == "ffn":
            per_layer[layer_of(n)] = per_layer.get(layer_of(n), 0) + size[n]
    return STREAM_SLOTS * max(per_layer.values(), default=0)


def safety_margin(budget: int) -> int:
    return max(int(budget * MARGIN_FRACTION), MARGIN_MIN)


# --- planning ----------------------------------------------------------------------------------

@dataclass
class _Unit:
    """Tensors placed together (a trunk layer's FFN, the lm_head…), plus VRAM they bring along."""
    label: str
    names: list[str]
    nbytes: int
    extra: int = 0       # non-weight VRAM that moves with the unit (the MTP block's KV cache)

    @property
    def cost(self) -> int:
        return self.nbytes + self.extra


def cpu_plan(model, n_ctx: int = DEFAULT_N_CTX, n_ring: int = 0, overrides: Sequence[Override] = (),
             reason: str = "--cpu-only", hint: str = "") -> Plan:
    """Everything on the CPU (no GPU needed). A -ot rule that pins a tensor to the GPU is an error."""
    pinned = [n for n in model.tensors if _forced_side(n, overrides) == GPU]
    if pinned:
        raise HybridError(f"-ot pins {pinned[0]} to the GPU, but this run is CPU-only ({reason}); "
                          "drop that -ot rule or the CPU-only setting")
    c = model.config
    n_ctx = _cap_ctx(c, n_ctx)
    places = _places(model, {n: CPU for n in model.tensors}, set())
    return Plan("cpu", places, None, {}, n_ctx, n_ring, notes=(f"CPU only: {reason}{hint}",))


def _without_gpu_kernels(model) -> str | None:
    """Why `model` cannot run on the GPU path: its first tensor of a type the GPU kernels do not
    run (`gpu.quants.UNITS`; the CPU runs every type of `cpu.ggml_types.SUPPORTED`), or None.
    Moving just those matrices to the CPU is not offered, as trunk matrices must be on the GPU
    and host FFN layers are streamed to the GPU for prompt chunks."""
    for name, t in model.tensors.items():
        wtype = getattr(t, "type", None)
        if wtype is not None and wtype.id not in GPU_UNITS:
            return f"{name} has type {wtype.name}, which the GPU kernels do not run yet"
    return None


def check_gpu_types(model) -> None:
    """A HybridError (one line) where `model` has a tensor type the GPU kernels do not run."""
    reason = _without_gpu_kernels(model)
    if reason:
        raise HybridError(f"{reason}; load the model with --device cpu (device=\"cpu\" in hybrid.load)")


def plan_placement(model, budget: int, *, n_ctx: int = DEFAULT_N_CTX, n_ring: int = 0,
                   overrides: Sequence[Override] = (), expert_cache: bool = False, pcie_share: float = 0.0,
                   split_ffn: bool = False, margin: int | None = None, notes: Sequence[str] = ()) -> Plan:
    """Place `model` (anything with .config and .tensors: name → .name/.role/.nbytes/.ne) given
    `budget` bytes of VRAM. HybridError when the must-have part does not fit. A MoE model's
    PCIe share (of each token's uncached experts, fetched by the GPU) reserves its staging
    slots before the expert cache takes what is left. split_ffn: when the dense FFN layers do
    not all fit, none is placed whole; the VRAM left holds the same share of each (its first
    hidden rows: `Plan.ffn_split`), which the GPU computes while the CPU computes the rest.
    A tensor type without GPU kernels is a HybridError (`check_gpu_types`)."""
    check_gpu_types(model)
    c: ModelConfig = model.config
    n_ctx = _cap_ctx(c, n_ctx)
    if n_ring < 0:
        raise HybridError(f"snapshot ring size must be ≥ 0, got {n_ring}")
    drafting = n_ring > 0 and c.n_nextn > 0
    groups = {n: group_of(t, c) for n, t in model.tensors.items()}
    forced = {n: s for n in model.tensors if (s := _forced_side(n, overrides)) is not None}
    free = {n for n in model.tensors if n not in forced}
    size = {n: t.nbytes for n, t in model.tensors.items()}

    def unit(label: str, names: Iterable[str], extra: int = 0) -> _Unit:
        names = [n for n in names if n in free]
        return _Unit(label, names, sum(size[n] for n in names), extra)

    margin = safety_margin(budget) if margin is None else margin
    n_attn = c.n_layer - sum(c.is_recurrent(i) for i in range(c.n_layer))
    vram = {"weights": 0, "kv_cache": kv_bytes(c, n_ctx, n_attn), "gdn_state": gdn_state_bytes(c, n_ring),
            "scratch": scratch_bytes(c, n_ring), "margin": margin}
    if sum(size.values()) + sum(vram.values()) > budget:     # some FFN will stay on the CPU
        vram["weight_streaming"] = streaming_bytes(c, groups, size)
    must = [unit("trunk", (n for n, g in groups.items() if g == "trunk")),
            unit("lm_head", (n for n, g in groups.items() if g == "lm_head")),
            _Unit("pinned by -ot", [n for n, s in forced.items() if s == GPU],
                  sum(size[n] for n, s in forced.items() if s == GPU))]
    need = sum(u.cost for u in must) + sum(vram.values())
    if need > budget:
        raise HybridError(_too_small(budget, must, vram, n_ctx, n_ring))

    side = {n: CPU for n in model.tensors}
    side.update(forced)
    for u in must:
        for n in u.names:
            side[n] = GPU
    vram["weights"] = sum(u.nbytes for u in must)
    left = budget - need
    dense = []          # split_ffn: the dense FFN layers, placed once the rest is

    def place(u: _Unit) -> None:
        nonlocal left
        for n in u.names:
            side[n] = GPU
        vram["weights"] += u.nbytes
        vram["kv_cache"] += u.extra
        left -= u.cost
    for u in _optional_units(model, groups, unit, c, n_ctx, drafting):
        if split_ffn and u.names and all(groups[n] == "ffn" for n in u.names):
            dense.append(u)
        elif u.names and u.cost <= left:
            place(u)
    split: dict[int, int] = {}
    split_bytes = 0
    if sum(u.cost for u in dense) <= left:
        for u in dense:
            place(u)
    else:
        split, split_bytes = _ffn_splits(model, dense, left)
        if split_bytes:
            vram["ffn_split"] = split_bytes
            left -= split_bytes

    per_expert = _expert_bytes_on_cpu(model, groups, side, c, drafting)
    staging = pcie_staging_bytes(pcie_share, c.n_expert_used, max(per_expert.values(), default=0))
    if staging > left:
        notes = [*notes, f"no room for the PCIe share's staging ({format_size(staging)}): the CPU runs every "
                         f"uncached expert"]
    if 0 < staging <= left:
        vram["pcie_staging"] = staging
        left -= staging
    else:
        pcie_share = 0.0
    # a fused gate_up stack's halves are no whole matrices a copy can cut (ExpertCache.streamable)
    fused = options_from_names(model.tensors).fused_gate_up_exps
    slots = 0 if fused else _expert_streaming(c, per_expert, left, expert_cache)
    if slots:
        vram["expert_streaming"] = slots
        left -= slots
    cache: dict[int, int] = {}
    cache_token_bytes = 0
    if expert_cache and c.is_moe:
        cache, cache_bytes, cache_token_bytes = _expert_cache(c, per_expert, left)
        vram["expert_cache"] = cache_bytes
    return Plan("cuda", _places(model, side, set(forced)), budget, vram, n_ctx, n_ring,
                cache, cache_token_bytes, tuple(notes), pcie_share, split, split_bytes)


def _ffn_splits(model, dense: Sequence[_Unit], left: int) -> tuple[dict[int, int], int]:
    """Spend `left` bytes on the same share of every dense FFN layer of `dense` whose three
    matrices are free to move (`weights.split_rows`): layer → the hidden rows the GPU computes,
    and their bytes (each read once per token, so also the per-token bytes)."""
    whole = [u for u in dense if len(u.names) == 3]
    share = left / max(sum(u.nbytes for u in whole), 1)
    split, total = {}, 0
    for u in whole:
        i = layer_of(u.names[0])
        gate, down = model.tensors[f"blk.{i}.ffn_gate.weight"], model.tensors[f"blk.{i}.ffn_down.weight"]
        n_ff = gate.ne[1]
        rows = split_rows(down.type.id, n_ff, share)
        if rows > 0:
            split[i] = rows
            total += u.nbytes * rows // n_ff      # whole rows of gate/up, whole blocks of down's rows
    return split, total


def pcie_staging_bytes(share: float, k: int, expert_bytes: int) -> int:
    """VRAM the PCIe share stages its fetched experts in: the most experts a row fetches, for
    every row of the largest call that fetches, of the largest expert (one set serves all layers)."""
    return int(pcie_counts(share, k)[-1]) * PCIE_MAX_ROWS * expert_bytes if share > 0 else 0


def _optional_units(model, groups: Mapping[str, str], unit, c: ModelConfig, n_ctx: int, drafting: bool):
    """What may go to the GPU after the must-haves, in priority order (first fit)."""
    by_layer: dict[int, dict[str, list[str]]] = {}
    for n, g in groups.items():
        by_layer.setdefault(layer_of(n), {}).setdefault(g, []).append(n)
    mtp_layers = range(c.n_layer, c.n_layer_all)
    if drafting:
        for i in mtp_layers:
            yield unit(f"blk.{i} mtp", by_layer.get(i, {}).get("mtp", []), extra=kv_bytes(c, n_ctx, 1))
    for i in range(c.n_layer):
        yield unit(f"blk.{i} router+shared", by_layer.get(i, {}).get("router+shared", []))
    if drafting:
        for i in mtp_layers:
            yield unit(f"blk.{i} mtp ffn", by_layer.get(i, {}).get("mtp ffn", []))
    dense = [unit(f"blk.{i} ffn", by_layer.get(i, {}).get("ffn", [])) for i in range(c.n_layer)]
    # smallest first: as many whole layers as fit (sorted() is stable: ties keep layer order)
    yield from sorted(dense, key=lambda u: u.nbytes)


def _expert_bytes_on_cpu(model, groups, side, c: ModelConfig, drafting: bool) -> dict[int, int]:
    """Layer → bytes of one routed expert, for the MoE layers whose routed experts are on the CPU
    (the MTP block's only when drafting)."""
    per_expert: dict[int, int] = {}
    for n, g in groups.items():
        i = layer_of(n)
        if g == "experts" and side[n] == CPU and (i < c.n_layer or drafting):
            per_expert[i] = per_expert.get(i, 0) + model.tensors[n].nbytes // c.n_expert
    return per_expert


def _expert_streaming(c: ModelConfig, per_expert: Mapping[int, int], left: int, cache_experts: bool) -> int:
    """Bytes of the slots (STREAM_SLOTS) a prompt chunk streams MoE layers' uncached experts into
    (gpu/runtime/weight_stream.py: one layer computes from a slot while the next layer's experts
    arrive in the other), each the uncached experts of the largest layer, given that the cache
    then takes what is left (`_expert_cache`): the most cached experts that leave room for the
    slots. 0 when the slots do not fit beside any cache (chunks hand the experts to the CPU)."""
    if not c.is_moe or not per_expert:
        return 0
    one_each, largest = sum(per_expert.values()), max(per_expert.values())
    most = min(c.n_expert, left // one_each) if cache_experts else 0
    for k in range(most, -1, -1):
        slots = STREAM_SLOTS * (c.n_expert - k) * largest
        if k * one_each + slots <= left:
            return slots
    return 0


def _expert_cache(c: ModelConfig, per_expert: Mapping[int, int], left: int) -> tuple[dict[int, int], int, int]:
    """Spend `left` bytes on caching the same number of experts in every MoE layer of
    `per_expert` (`_expert_bytes_on_cpu`). Returns (layer → experts, bytes, per-token bytes
    served at uniform routing: the runtime caches the most-used experts, so real hits are
    higher)."""
    token = {i: b * c.n_expert_used for i, b in per_expert.items() if i < c.n_layer}
    one_each = sum(per_expert.values())
    k = min(c.n_expert, left // one_each) if one_each else 0
    if k <= 0:
        return {}, 0, 0
    return ({i: k for i in sorted(per_expert)}, k * one_each,
            sum(b * k // c.n_expert for b in token.values()))


def _places(model, side: Mapping[str, str], forced: set[str]) -> dict[str, TensorPlace]:
    c = model.config
    mtp_embed = any(n.endswith(".nextn.embed_tokens.weight") for n in model.tensors)
    mtp_head = any(n.endswith(".nextn.shared_head_head.weight") for n in model.tensors)
    out = {}
    for n, t in model.tensors.items():
        g = group_of(t, c)
        tok, draft = _read_bytes(t, g, c, mtp_embed, mtp_head)
        out[n] = TensorPlace(n, g, side[n], t.nbytes, tok, draft, n in forced)
    return out


def _cap_ctx(c: ModelConfig, n_ctx: int) -> int:
    if n_ctx < 1:
        raise HybridError(f"context size must be ≥ 1, got {n_ctx}")
    return min(n_ctx, c.context_length)


def _too_small(budget: int, must: list[_Unit], vram: dict[str, int], n_ctx: int, n_ring: int) -> str:
    parts = [f"{u.label} {format_size(u.nbytes)}" for u in must if u.nbytes]
    parts += [f"KV cache {format_size(vram['kv_cache'])} (n_ctx {n_ctx})",
              f"GDN state {format_size(vram['gdn_state'])} (ring of {n_ring})",
              f"scratch {format_size(vram['scratch'])}", f"safety margin {format_size(vram['margin'])}"]
    if vram.get("weight_streaming"):
        parts.append(f"prompt weight streaming {format_size(vram['weight_streaming'])}")
    need = sum(u.nbytes for u in must) + sum(vram.values())
    return (f"not enough GPU memory: the part that must live on the GPU needs {format_size(need)} "
            f"({' + '.join(parts)}) but the budget is {format_size(budget)}. "
            f"Try a smaller --ctx-size, fewer draft tokens (--draft), a larger --vram, or --cpu-only")


# --- from a device ------------------------------------------------------------------------------

def gpu_free_memory() -> int | None:
    """Free VRAM in bytes on the current CUDA device; None without a real GPU. numba.cuda is
    imported only when a driver reports a device (importing it has side effects; DEVICE.md)."""
    if not available():
        return None
    from numba import cuda    # deferred: reached only once a driver reports a GPU (DEVICE.md)
    free, _total = cuda.current_context().get_memory_info()
    return int(free)


def plan_for(model_file, device: str = "auto", vram: str | int | None = None, cpu_only: bool = False,
             overrides: Sequence[str] | Sequence[Override] = (), n_ctx: int = DEFAULT_N_CTX,
             n_ring: int = 0, *, expert_cache: bool = False, pcie_share: float = 0.0,
             split_ffn: bool = False) -> Plan:
    """The plan a run uses. device: cpu, cuda or auto. vram: budget ('12GiB', bytes) or None for
    the GPU's free memory. Without a GPU: a CPU plan for auto, a clear error for cuda."""
    if device not in ("cpu", "cuda", "auto"):
        raise HybridError(f"unknown device {device!r}; choose one of cpu, cuda, auto")
    rules = tuple(o if isinstance(o, Override) else parse_overrides([o])[0] for o in overrides)
    budget = None if vram is None else parse_size(vram, "VRAM budget")
    if cpu_only or device == "cpu":
        if device == "cuda":
            raise HybridError("--cpu-only and --device cuda contradict each other; pick one")
        return cpu_plan(model_file, n_ctx, n_ring, rules, "--cpu-only" if cpu_only else "device cpu")
    free = gpu_free_memory()
    if free is None:
        if device == "cuda":
            raise HybridError("no CUDA GPU found (device cuda): run with --cpu-only or on a machine with "
                              "an NVIDIA GPU and driver")
        return cpu_plan(model_file, n_ctx, n_ring, rules, "no CUDA GPU found",
                        " (`hybrid info MODEL --plan --vram 12GiB` plans for a GPU of that size)")
    no_kernels = _without_gpu_kernels(model_file)
    if no_kernels and device == "auto":     # device cuda: plan_placement's error says the same
        return cpu_plan(model_file, n_ctx, n_ring, rules, no_kernels)
    notes = []
    if budget is None:
        budget = free
        notes.append(f"budget: the GPU's free memory, {format_size(free)}")
    elif budget > free:
        notes.append(f"--vram {format_size(budget)} is more than the GPU's free {format_size(free)}; "
                     f"using {format_size(free)}")
        budget = free
    return plan_placement(model_file, budget, n_ctx=n_ctx, n_ring=n_ring, overrides=rules,
                          expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn, notes=notes)
