"""CUDA graphs for the forward's GPU work: capture a step's launches once, replay them after.

Launching a Numba kernel from Python costs tens of microseconds (argument marshalling), and a
decode step launches ~15 kernels per layer: on a 64-layer model that is tens of milliseconds of
Python per token, more than the GPU work itself. A CUDA graph records the launches of one step
and replays them with one driver call, with the arguments (device pointers, sizes) baked in.

So a step may only be captured when every argument is the same at each replay: the same
activation and state buffers (the caller keys a graph by call size and the state it steps),
and no host value that changes per step — positions are read from a device array on the
device. The CPU FFN hand-off (`memory.host_call`) cannot be inside a graph: the host must wait
for the rows, run the CPU kernel and send its result back. A step is therefore a list of
segments: graph, host call, graph, host call, ..., graph. The host call's copies are part
of the graphs (the D2H at the end of one segment, the H2D at the start of the next) through
pinned buffers that are never reallocated, so their addresses stay valid. A host call's
`meanwhile` work is a graph of its own, launched after the segment's and before the host
waits: the host waits for an event recorded between the two, so that graph runs on the GPU
while the host call runs on the CPU. (One graph with an event-record node after the copies
would save the second launch, but the host's wait on that event returned only when the whole
graph had run: no overlap.)

Recording does not run anything: launches and copies are only captured, host calls only
remembered, then the step is replayed. An op that cannot be captured (one that reads device
data on the host mid-step, like the MoE FFN with experts on the device) makes the capture
fail before anything ran; that step then stays eager (`run` falls back and remembers it).
"""
from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
from numba import cuda

from . import memory
from .device import simulated

# Step graphs kept per cache. Drafting at a depth chosen per step uses a trunk verify step and
# MTP-head steps for every depth up to its maximum, besides decode and prompt chunks; a graph
# evicted and needed again costs an eager run and a capture, so keep them all.
_KEPT = 64


class NotCapturable(RuntimeError):
    """Raised inside a capture by an op that needs the host mid-step."""


def _check(result):
    """cuda.bindings calls return (error, *values): raise on an error, return the values."""
    return memory.check(result, NotCapturable)


def launch(graph_exec) -> None:
    """Queue an executable graph on the stream."""
    cu, stream = memory.driver()
    _check(cu.cuGraphLaunch(graph_exec, stream))


class Segment(NamedTuple):
    graph: object                                  # executable graph, ending with a host call's input copies
    meanwhile: object | None = None                # executable graph the GPU runs during the host call
    host_call: Callable[[], None] | None = None    # None: the step's last segment


class StepGraph:
    """A captured step: segments, run in order."""

    def __init__(self):
        self.segments: list[Segment] = []

    def replay(self, seconds: dict[str, float]) -> None:
        """Run the step; adds to seconds["gpu"] the time the host waited for the graphs (GPU
        work and the hand-off copies) and to seconds["cpu"] the host calls' time."""
        t0 = time.perf_counter()
        for graph_exec, meanwhile, host_call in self.segments:
            launch(graph_exec)
            if host_call is not None:
                if meanwhile is None:
                    memory.synchronize()
                else:
                    copied = memory.mark()
                    launch(meanwhile)
                    memory.wait_for(copied)
                t1 = time.perf_counter()
                host_call()
                t2 = time.perf_counter()
                seconds["gpu"] += t1 - t0
                seconds["cpu"] += t2 - t1
                t0 = t2
        memory.synchronize()
        seconds["gpu"] += time.perf_counter() - t0

    def close(self) -> None:
        cu = memory.driver()[0]
        for graph_exec, meanwhile, _ in self.segments:
            for g in (graph_exec, meanwhile):
                if g is not None:
                    cu.cuGraphExecDestroy(g)
        self.segments.clear()


class _Recorder:
    """Captures the stream into consecutive graphs, cutting at each host call."""

    def __init__(self):
        self.step = StepGraph()

    def begin(self) -> None:
        cu, stream = memory.driver()
        _check(cu.cuStreamBeginCapture(stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED))

    def end(self):
        """End the capture: its executable graph."""
        cu, stream = memory.driver()
        graph = _check(cu.cuStreamEndCapture(stream))
        try:
            return _check(cu.cuGraphInstantiate(graph, 0))
        finally:
            cu.cuGraphDestroy(graph)

    def abort(self) -> None:
        """End a capture that failed; whatever it recorded is dropped."""
        cu, stream = memory.driver()
        status = cu.cuStreamIsCapturing(stream)
        if int(status[0]) == 0 and int(status[1]) != 0:      # still capturing (or invalidated)
            result = cu.cuStreamEndCapture(stream)
            if int(result[0]) == 0 and result[1] is not None:
                cu.cuGraphDestroy(result[1])
        self.step.close()

    def host_call(self, inputs, outputs, fn, meanwhile=None, bind=None) -> None:
        stream = memory.stream()
        host_in = memory.staging_for("in", inputs, self._pinned)
        host_out = memory.staging_for("out", outputs, self._pinned)
        call = bind(*host_in, *host_out) if bind is not None else lambda: fn(*host_in, *host_out)
        for dev, host in memory.copied_pairs(inputs, host_in):
            dev.copy_to_host(host, stream=stream)
        self.step.segments.append(Segment(self.end(), None, call))
        if meanwhile is not None:       # (added to the segment once captured: abort frees the rest)
            self.begin()
            meanwhile()
            self.step.segments[-1] = self.step.segments[-1]._replace(meanwhile=self.end())
        self.begin()
        for dev, host in memory.copied_pairs(outputs, host_out):
            dev.copy_to_device(host, stream=stream)

    @staticmethod
    def _pinned(key, shape, dtype) -> np.ndarray:
        """Staging for a captured copy. Host calls run one after another, so all steps share it;
        keyed by exact shape, so it is never regrown (a graph keeps its address)."""
        shape, dtype = tuple(shape), np.dtype(dtype)
        return memory.host_buffer(("graph", *key, shape, dtype.str), shape, dtype)


def recording() -> _Recorder | None:
    """The capture in progress, if any (memory.host_call asks)."""
    return memory.capturing


def require_eager(why: str) -> None:
    """Called by an op that cannot run inside a graph: fails the capture in progress."""
    if memory.capturing is not None:
        raise NotCapturable(why)


def capture(body: Callable[[], None]) -> StepGraph:
    """Record body's GPU work (and host calls) as a StepGraph without running any of it."""
    rec = _Recorder()
    memory.capturing = rec
    try:
        with cuda.defer_cleanup():           # no frees while the stream is being captured
            rec.begin()
            body()
            rec.step.segments.append(Segment(rec.end()))
    except Exception as e:       # any failure inside a capture: nothing ran, so stay eager
        rec.abort()
        raise e if isinstance(e, NotCapturable) else NotCapturable(str(e)) from e
    except BaseException:
        rec.abort()
        raise
    finally:
        memory.capturing = None
    return rec.step


class StepGraphs:
    """A cache of captured steps by key. `run(key, body)`: the first call of a key runs body
    eagerly (it compiles kernels and allocates scratch, neither of which may happen inside a
    capture); the second captures it; later ones replay. Steps that cannot be captured stay
    eager. With enabled=False (or under the CUDA simulator, which has no graphs) body always
    runs eagerly."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and not simulated()
        self._graphs: OrderedDict[object, StepGraph] = OrderedDict()
        self._seen: set = set()
        self._eager: set = set()
        self.captures = 0            # how many steps were captured (tests, benchmarks)
        self.replays = 0
        self.one_offs = 0            # runs that were a key's first (eager) run or its capture
        # where replayed steps spent their time: waiting for the GPU (kernels and hand-off
        # copies), in host calls (the CPU FFN), and in all (the rest is Python between them)
        self.seconds = {"gpu": 0.0, "cpu": 0.0, "all": 0.0}

    @property
    def kept(self) -> int:
        """Captured steps held now (at most _KEPT: more captures than kept means evictions)."""
        return len(self._graphs)

    def run(self, key, body: Callable[[], None]) -> None:
        if not self.enabled or key in self._eager:
            body()
            return
        graph = self._graphs.get(key)
        if graph is None:
            self.one_offs += 1
            if key not in self._seen:
                self._seen.add(key)
                body()
                return
            try:
                graph = capture(body)
            except NotCapturable:
                self._eager.add(key)
                body()
                return
            self.captures += 1
            self._graphs[key] = graph
            while len(self._graphs) > _KEPT:
                self._graphs.popitem(last=False)[1].close()
        else:
            self._graphs.move_to_end(key)
        t0 = time.perf_counter()
        graph.replay(self.seconds)
        self.seconds["all"] += time.perf_counter() - t0
        self.replays += 1
