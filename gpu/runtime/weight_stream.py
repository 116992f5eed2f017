"""FFN weights streamed from host memory to the GPU for prompt chunks (hybrid prefill).

In hybrid mode most FFN matrices stay in host memory (the mapped GGUF file) and a decode step
hands its few rows to the CPU. A prompt chunk of n rows would make the CPU read every weight
byte for n rows; copying the layer's weights to the GPU once and running the chunk's FFN there
costs one transfer instead. Two kinds of layer are streamed:

* a dense FFN (gate, up and down matrices): `WeightStreamer.run` runs it there as a GEMM
  (gpu/matmul/gemm.py);
* a MoE layer's routed experts, those its expert cache does not hold (the cache's
  `stream_sources`): `WeightStreamer.using` lends the caller (gpu/moe.py) the copied expert
  stacks. A 512-row chunk picks nearly every expert of a layer, so the whole uncached set is
  what the CPU would read anyway, once per chunk.

How:
* two device slots, each big enough for the largest layer's streamed matrices, filled on a
  copy stream of their own; layer i computes from one slot while layer i+1's weights copy into
  the other (double buffering). Events order it: a copy into a slot waits for the last FFN
  that read it, and an FFN waits for its slot's copy;
* the next layer is prefetched as soon as this one is queued: the next one in layer order at
  first, then whatever FFN really followed this one last time (say the MTP block's);
* the copies read pinned memory: the mapped file ranges of every streamed matrix are
  registered with the driver once (cuMemHostRegister, read-only), so each copy is a plain DMA
  straight from the mapping. Where that fails (no support, limits) each copy is staged through
  two pinned buffers instead (a parallel CPU copy into one while the other is in flight);
* the step cannot be a CUDA graph (it waits on events and copies host data per call): it
  calls graphs.require_eager first.

`StreamStats` splits a prefill's time: transfer time on the copy stream, the streamed FFNs'
device time, the time they waited for their weights, and the CPU FFN time of the hand-offs.
"""
from __future__ import annotations

import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
from numba import cuda, njit, prange

from . import graphs, memory
from .device import simulated
from .host_mapping import is_registered, page_ranges, register_host_ranges, unregister_host_ranges

# Stream a host FFN's weights when a call has at least this many rows. Streaming costs the
# layer's bytes / host→device bandwidth once (overlapped with the previous layer's work by the
# double buffer); the CPU hand-off costs n rows × the same bytes at the CPU prompt kernels'
# rate. Break-even was ~5 rows on the GPU machine (docs/MEASUREMENTS.md); 32 leaves room for the
# GPU's own FFN time and a copy that is not fully hidden, and keeps decode (1 row) and drafting
# verify steps (≤ 8 rows) on the CPU.
STREAM_MIN_ROWS = 32
SLOTS = 2                    # device slots: one layer computes from one while the next layer's copy fills another
SLOT_ALIGN = 256             # byte offset of each matrix in a slot (Q4_K/Q5_K need 16)
STAGE_BYTES = 32 << 20       # pinned staging buffer size, when the mapping cannot be registered


@dataclass
class StreamStats:
    """Where a prefill's FFN time went (seconds). Device times come from CUDA events, recorded
    only while `timing` is on (a tool turns it on; events cost a little per layer) and read by
    `resolve`, which waits for the recorded work. `reset` starts a new measurement."""
    timing: bool = False
    calls: int = 0              # FFN calls run on streamed weights
    rows: int = 0               # their rows, summed
    copies: int = 0             # layers copied (a layer still in its slot is not copied again)
    bytes_copied: int = 0
    copy_seconds: float = 0.0   # device time of the host→device copies (copy stream)
    ffn_seconds: float = 0.0    # device time of the streamed FFNs' kernels
    wait_seconds: float = 0.0   # device time an FFN waited for its weights to arrive
    cpu_ffn_seconds: float = 0.0  # host time of CPU FFN hand-offs (rows too few to stream)
    cpu_ffn_calls: int = 0
    pinning: str = "not yet"    # "registered" (DMA from the mapping) or "staged: <why>"
    pin_seconds: float = 0.0    # one-time registration of the mapped ranges
    _pending: list = field(default_factory=list, repr=False)

    def reset(self) -> None:
        """Zero the counters; timing and the pinning facts stay."""
        self.resolve()
        fresh = StreamStats(timing=self.timing, pinning=self.pinning, pin_seconds=self.pin_seconds)
        self.__dict__.update(fresh.__dict__)

    def resolve(self) -> "StreamStats":
        """Add the recorded event pairs' device time (waits for them to complete)."""
        for kind, start, end in self._pending:
            end.synchronize()
            seconds = 0.0 if simulated() else start.elapsed_time(end) / 1e3
            setattr(self, kind, getattr(self, kind) + seconds)
        self._pending.clear()
        return self

    def as_dict(self) -> dict:
        self.resolve()
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_")}

    def mark(self, stream):
        """A timing event recorded on `stream` now; None while timing is off."""
        if not self.timing:
            return None
        event = _event(timing=True)
        event.record(stream)
        return event

    def span(self, kind: str, start, end) -> None:
        """Count the device time between two marks as `kind` (when `resolve` reads it)."""
        if start is not None and end is not None:
            self._pending.append((kind, start, end))


def _event(timing: bool = False):
    """A CUDA event (the simulator's take no arguments and time nothing)."""
    return cuda.event() if simulated() else cuda.event(timing=timing)


@njit(cache=True, nogil=True, parallel=True)
def _copy_bytes(dst, src):
    """dst[:] = src[:] (uint8), in 1 MiB pieces over all cores: one core cannot fill the link."""
    piece = 1 << 20
    for p in prange((src.shape[0] + piece - 1) // piece):
        lo = p * piece
        hi = min(lo + piece, src.shape[0])
        dst[lo:hi] = src[lo:hi]


def _flat(host: np.ndarray) -> np.ndarray:
    return host.reshape(host.size)


class Source(NamedTuple):
    """One device matrix (or stack of them) a layer streams: its C-contiguous host pieces,
    copied one after another, the shape of the device array they make, and the host array they
    are cut from (page-locked whole: another choice of pieces stays inside it, and no later
    copy from the mapping straddles the edge of a registered range, which the driver refuses)."""
    pieces: tuple
    shape: tuple
    whole: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)


def dense_sources(ffn) -> tuple:
    """A dense FFN's gate, up and down matrices, each whole."""
    return tuple(Source((m.data,), m.data.shape, m.data) for m in (ffn.gate, ffn.up, ffn.down))


# --- the streamer ---------------------------------------------------------------------------------

class _Slot:
    """A device buffer holding one FFN's three matrices, and the events that order its use."""

    def __init__(self):
        self.buffer = None
        self.holds = None            # (record, its sources) whose weights are (or will be) here
        self.last_used = -1
        self.ready = _event()        # recorded on the copy stream after the copy into it
        self.released = _event()     # recorded on the compute stream after the FFN reading it
        self.views = None            # the device arrays of what it holds (made once per fill)


class WeightStreamer:
    """Runs FFN layers whose weights are in host memory on the GPU, streaming the weights in.
    A layer is a record: a dense FFN, or any object with `stream_sources()` (a MoE layer's
    expert cache), which returns the same tuple of `Source`s for as long as its content holds."""

    def __init__(self, dense_ffn, min_rows: int = STREAM_MIN_ROWS, register: bool = True,
                 stage_bytes: int = STAGE_BYTES, stats: StreamStats | None = None):
        """dense_ffn(wtypes, weights, x, h, out): the device FFN run on the streamed weights
        (`gpu.ffn.dense_ffn`; passed in, so the runtime imports no op); min_rows: the fewest rows
        a call must have to be streamed; register=False skips the page-locking of the mapping
        (always stage: tests, comparisons); stage_bytes: the size of each pinned staging buffer."""
        self.dense_ffn = dense_ffn
        self.min_rows = min_rows
        self.stats = stats or StreamStats()
        self.register = register              # read at the first copy
        self._stage_bytes = stage_bytes
        self._order: list = []
        self._others: list = []
        self._streamable: set[int] = set()
        self._dense: dict[int, tuple] = {}
        self._next: dict[int, object] = {}
        self._previous = None
        self._slots = [_Slot() for _ in range(SLOTS)]
        self._uses = 0
        self._copy_stream = None
        self._pinned: list[tuple[int, int]] | None = None    # registered (start, size); None: not tried
        self._finalizer = None
        self._stage_free = [_event(), _event()]
        self._stage_turn = 0

    # --- which FFNs -----------------------------------------------------------------------------
    def set_order(self, ffns, others=()) -> None:
        """The host-resident layers (dense FFNs with gate, up and down matrices all in host
        memory, or records with `stream_sources`) that calls may stream, in the order a forward
        runs them (the trunk's layers): the first guess of which one comes next (after the last:
        the first). `others` may be streamed too (the MTP block's); the mapping of both gets
        registered."""
        self._order = list(ffns)
        self._others = list(others)
        self._next = {id(f): self._order[(i + 1) % len(self._order)] for i, f in enumerate(self._order)}
        self._streamable = {id(f) for f in self._order + self._others}
        self._dense = {id(f): dense_sources(f) for f in self._order + self._others if not hasattr(f, "stream_sources")}

    @property
    def order(self) -> list:
        return list(self._order)

    def sources(self, record) -> tuple:
        """The `Source`s a layer streams."""
        dense = self._dense.get(id(record))
        return dense if dense is not None else record.stream_sources()

    @property
    def host_bytes(self) -> int:
        """Weight bytes of the layers that may be streamed (trunk order and others)."""
        return sum(src.nbytes for f in self._order + self._others for src in self.sources(f))

    @property
    def slot_bytes(self) -> int:
        """Device bytes of one slot (SLOTS are allocated, at the first streamed call)."""
        return max((_layout(self.sources(f))[1] for f in self._order + self._others), default=0)

    def wants(self, record, n_rows: int) -> bool:
        """Stream this call: a layer set_order named, and enough rows (streaming on)."""
        return self.min_rows is not None and n_rows >= self.min_rows and id(record) in self._streamable

    # --- running one --------------------------------------------------------------------------
    def run(self, ffn, x, h, out) -> None:
        """out (n, D) = SwiGLU FFN of device rows x (n, D) on weights copied from the host;
        h (n, n_ff) is its hidden scratch."""
        with self.using(ffn, x.shape[0]) as (gate, up, down):
            self.dense_ffn((ffn.gate.wtype, ffn.up.wtype, ffn.down.wtype), (gate, up, down), x, h, out)

    @contextmanager
    def using(self, record, rows: int):
        """The device arrays of a layer's streamed matrices (one per `Source`), for kernels the
        body queues on the compute stream: they run once the copy has landed, and the slot is
        not refilled before they are done. The next layer's copy is queued after the body."""
        graphs.require_eager("streamed FFN weights are copied from the host per call")
        compute = memory.stream()
        if self._previous is not None and self._previous is not record:
            self._next[id(self._previous)] = record   # learn what really follows
        self._previous = record
        slot = self._acquire(record)

        stats = self.stats
        before = stats.mark(compute)
        slot.ready.wait(compute)                      # the weights have arrived
        start = stats.mark(compute)
        yield self._views(slot)
        stats.span("wait_seconds", before, start)
        stats.span("ffn_seconds", start, stats.mark(compute))
        slot.released.record(compute)
        self._uses += 1
        slot.last_used = self._uses
        stats.calls += 1
        stats.rows += rows

        following = self._next.get(id(record))
        if following is not None:
            self._acquire(following)                  # prefetch into the other slot

    def _acquire(self, record) -> _Slot:
        """The slot holding the layer's weights, after queueing their copy if none does."""
        sources = self.sources(record)
        for slot in self._slots:
            if slot.holds is not None and slot.holds[0] is record and slot.holds[1] is sources:
                return slot
        slot = min(self._slots, key=lambda s: s.last_used)   # not the one just computed from
        self._copy_in(slot, record, sources)
        return slot

    # --- copies ---------------------------------------------------------------------------------
    def _copy_in(self, slot: _Slot, record, sources) -> None:
        self._ensure_pinning()
        offsets, size = _layout(sources)
        if slot.buffer is None or slot.buffer.size < size:
            slot.buffer = cuda.device_array(max(size, self.slot_bytes), np.uint8)
        slot.views = None
        stream = self._stream()
        slot.released.wait(stream)                    # the FFN that read this slot is done
        start = self.stats.mark(stream)
        for src, off in zip(sources, offsets):
            for piece in src.pieces:
                dst = slot.buffer[off:off + piece.nbytes]
                if self._is_pinned(piece):
                    dst.copy_to_device(_flat(piece), stream=stream)    # DMA straight from the mapping
                else:
                    self._copy_staged(dst, _flat(piece), stream)
                off += piece.nbytes
        self.stats.span("copy_seconds", start, self.stats.mark(stream))
        slot.ready.record(stream)
        slot.holds = (record, sources)
        self.stats.copies += 1
        self.stats.bytes_copied += sum(src.nbytes for src in sources)

    def _copy_staged(self, dst, src: np.ndarray, stream) -> None:
        """dst (device) = src (pageable host) through two pinned buffers taken in turn: the
        CPU fills one while the other's DMA runs."""
        for lo in range(0, src.size, self._stage_bytes):
            hi = min(lo + self._stage_bytes, src.size)
            k = self._stage_turn
            self._stage_turn ^= 1
            stage = memory.host_buffer(("weight_stream", k), (self._stage_bytes,), np.uint8)[:hi - lo]
            self._stage_free[k].synchronize()         # its previous DMA has read it
            _copy_bytes(stage, src[lo:hi])
            dst[lo:hi].copy_to_device(stage, stream=stream)
            self._stage_free[k].record(stream)

    def _ensure_pinning(self) -> None:
        """Register the mapped ranges of every layer in the order, once (the first copy); those
        another owner registered already (the expert cache's PCIe mapping) are used as they are."""
        if self._pinned is not None:
            return
        arrays = [src.whole for f in self._order + self._others for src in self.sources(f)]
        t0 = time.perf_counter()
        held = [a for a in arrays if self.register and is_registered(a)]
        rest = [a for a in arrays if not any(a is h for h in held)]
        bases, why = register_host_ranges(rest) if self.register and rest else (
            [], None if self.register else "registration turned off")
        self.stats.pin_seconds = time.perf_counter() - t0
        self.stats.pinning = "registered" if why is None else f"staged: {why}"
        self._pinned = [(a.ctypes.data, a.nbytes) for a in held] + (page_ranges(rest) if bases else [])
        if bases:
            self._finalizer = weakref.finalize(self, unregister_host_ranges, bases)

    def _is_pinned(self, host: np.ndarray) -> bool:
        start = host.ctypes.data
        return any(lo <= start and start + host.nbytes <= lo + size for lo, size in self._pinned)

    def _stream(self):
        if self._copy_stream is None:
            self._copy_stream = cuda.stream()
        return self._copy_stream

    def _views(self, slot: _Slot) -> tuple:
        """The device arrays of the sources slot holds."""
        if slot.views is None:
            sources = slot.holds[1]
            offsets, _ = _layout(sources)
            slot.views = tuple(slot.buffer[off:off + src.nbytes].reshape(src.shape) for src, off in zip(sources, offsets))
        return slot.views

    def close(self) -> None:
        """Unregister the pinned mapping (also done when the streamer is collected)."""
        if self._finalizer is not None:
            self._finalizer()
        self._pinned = []


def _layout(sources) -> tuple[list[int], int]:
    """Byte offsets of the sources in a slot, and the bytes the slot needs."""
    offsets, size = [], 0
    for src in sources:
        offsets.append(size)
        size += -(-src.nbytes // SLOT_ALIGN) * SLOT_ALIGN
    return offsets, size
