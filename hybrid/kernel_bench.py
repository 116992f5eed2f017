"""`hybrid bench-kernels`: are the CPU matvec kernels memory-bound, and what does N cost?

For each weight type and FFN shape it times one N-input matvec pass for N in {1, 2, 4, 8} and
reports it against the read bandwidth measured in the same run (cpu.bandwidth). The weights are
random but valid blocks, cycled through enough copies (8× the last-level cache) that every pass
streams from DRAM: a real decode step reads GBs of FFN weights once, and a server L3 of a few
hundred MiB would otherwise hold part of a single 50–100 MB matrix set and flatter the kernels.
Times are medians of many passes, and the N values of one (type, shape) are timed in
interleaved rounds: on a shared machine the available bandwidth drifts by tens of percent
within seconds, and interleaving makes that drift hit every N alike, so "cost vs N=1" stays
meaningful.
"""
from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numba
import numpy as np
from rich.console import Console
from rich.table import Table

from cpu.bandwidth import read_bandwidth
from cpu.ggml_types import BY_NAME, DECODED, GGMLType
from cpu.matvec import matvec

from .errors import HybridError
from .synth.codes import random_blocks

SHAPES = ((5120, 17408), (17408, 5120), (2048, 512))   # (rows, cols) of W = (out, in)
NS = (1, 2, 4, 8)
ALL_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q4_0", "BF16", "F16", "F32", *(t.name for t in DECODED))
QUICK_TYPES = ("Q4_K", "Q5_K", "Q6_K", "Q8_0")
GiB = 1 << 30


@dataclass
class KernelResult:
    type: str
    rows: int
    cols: int
    n: int
    seconds: float            # median time of one pass
    gbps: float               # weight bytes / seconds
    pct_of_bandwidth: float   # gbps / measured read bandwidth, in %
    cost_vs_n1: float         # seconds / seconds at n = 1 (same type and shape)


@dataclass
class BenchReport:
    bandwidth_gbps: float
    threads: int
    results: list[KernelResult] = field(default_factory=list)

    def to_json(self) -> dict:
        return {"bandwidth_gbps": self.bandwidth_gbps, "threads": self.threads,
                "results": [asdict(r) for r in self.results]}


@dataclass(frozen=True)
class BenchPlan:
    types: tuple[str, ...]
    shapes: tuple[tuple[int, int], ...] = SHAPES
    ns: tuple[int, ...] = NS
    bandwidth_bytes: int = GiB      # probe buffer
    stream_bytes: int = GiB         # weight copies cycled per (type, shape)
    min_seconds: float = 0.5        # timing budget per (type, shape, n)
    min_repeats: int = 7

    @classmethod
    def make(cls, types=None, quick: bool = False) -> "BenchPlan":
        chosen = tuple(types) if types else (QUICK_TYPES if quick else ALL_TYPES)
        llc = last_level_cache_bytes()
        if quick:
            size = max(GiB // 4, 4 * llc)
            return cls(chosen, bandwidth_bytes=size, stream_bytes=size, min_seconds=0.1, min_repeats=5)
        size = max(GiB, 8 * llc)
        return cls(chosen, bandwidth_bytes=size, stream_bytes=size)


def last_level_cache_bytes(default: int = 64 << 20) -> int:
    """Size of the largest CPU cache (Linux sysfs), or `default` where it cannot be read."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
            best = max(best, int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
        except (OSError, ValueError):
            continue
    return best or default


def parse_types(names) -> tuple[str, ...]:
    """Type names, upper-cased and checked (ValueError names the supported ones)."""
    out = []
    for name in names:
        for part in str(name).split(","):
            if part.strip():
                t = BY_NAME.get(part.strip().upper())
                if t is None:
                    raise ValueError(f"unknown tensor type {part.strip()!r}; supported: {', '.join(ALL_TYPES)}")
                out.append(t.name)
    return tuple(dict.fromkeys(out))


# ---- weights ---------------------------------------------------------------------------------

_SCALE_OFFSETS = {"Q4_0": (0,), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_weights(t: GGMLType, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """(rows, row_bytes) uint8 of valid blocks: random quants, fp16 scales of a sane size
    (random bytes there could be inf/NaN), float types from a normal distribution."""
    if t.name in ("F32", "F16", "BF16"):
        v = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        if t.name == "F32":
            return v.view(np.uint8)
        if t.name == "F16":
            return v.astype(np.float16).view(np.uint8)
        return (v.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.uint8)
    if t in DECODED:
        return random_blocks(rng, rows, cols, t, 0.02)
    n_blocks = cols // t.block_elems
    w = rng.integers(0, 256, size=(rows, n_blocks, t.block_bytes), dtype=np.uint8)
    for off in _SCALE_OFFSETS[t.name]:
        d = rng.uniform(1e-3, 2e-3, size=(rows, n_blocks)).astype(np.float16)
        w[:, :, off:off + 2] = d.view(np.uint8).reshape(rows, n_blocks, 2)
    return w.reshape(rows, n_blocks * t.block_bytes)


def _weight_copies(w: np.ndarray, total_bytes: int) -> list[np.ndarray]:
    """Enough distinct copies of w (at least 2) that cycling through them exceeds total_bytes."""
    count = max(2, -(-total_bytes // max(1, w.nbytes)))
    return [w] + [w.copy() for _ in range(count - 1)]


# ---- timing ----------------------------------------------------------------------------------

def warm_up(type_names) -> None:
    """Compile (or load from the cache) every kernel the benchmark will call."""
    rng = np.random.default_rng(0)
    for name in type_names:
        t = BY_NAME[name]
        w = random_weights(t, 8, 512, rng)
        for n in (1, 5):
            matvec(t.id, w, np.ones((n, 512), np.float32), np.empty((n, 8), np.float32))
    read_bandwidth(1 << 20, repeats=1)


def _time_interleaved(t: GGMLType, copies, xs, outs, plan: BenchPlan) -> list[float]:
    """Median seconds of one matvec pass for each input (x, out) pair, timed round-robin: one
    pass per input per round, each pass on the next weight copy (so from DRAM)."""
    for x, out in zip(xs, outs):
        matvec(t.id, copies[-1], x, out)
    times: list[list[float]] = [[] for _ in xs]
    spent, i = 0.0, 0
    while len(times[0]) < plan.min_repeats or (spent < plan.min_seconds * len(xs) and len(times[0]) < 10_000):
        for k, (x, out) in enumerate(zip(xs, outs)):
            w = copies[i % len(copies)]
            i += 1
            t0 = time.perf_counter()
            matvec(t.id, w, x, out)
            dt = time.perf_counter() - t0
            times[k].append(dt)
            spent += dt
    return [float(np.median(ts)) for ts in times]


def pass_seconds(t: GGMLType, w: np.ndarray, plan: BenchPlan, n: int = 1) -> float:
    """Median seconds of one n-input matvec pass over the weights w (rows of type t), each pass on
    the next of enough copies of w that they come from memory (tools/vs_ggml_cpu.py)."""
    rows, cols = w.shape[0], w.shape[1] // t.block_bytes * t.block_elems
    x = np.random.default_rng(0).standard_normal((n, cols), dtype=np.float32)
    return _time_interleaved(t, _weight_copies(w, plan.stream_bytes), [x], [np.empty((n, rows), np.float32)], plan)[0]


def run(plan: BenchPlan, threads: int, progress: Callable[[str], None] = lambda msg: None) -> BenchReport:
    """Measure bandwidth, then every (type, shape, n) of the plan."""
    numba.set_num_threads(threads)
    progress(f"measuring read bandwidth over {plan.bandwidth_bytes >> 20} MiB")
    report = BenchReport(bandwidth_gbps=read_bandwidth(plan.bandwidth_bytes), threads=threads)
    rng = np.random.default_rng(1234)
    for name in plan.types:
        t = BY_NAME[name]
        for rows, cols in plan.shapes:
            progress(f"{name} {rows}×{cols}")
            copies = _weight_copies(random_weights(t, rows, cols, rng), plan.stream_bytes)
            xs = [rng.standard_normal((n, cols), dtype=np.float32) for n in plan.ns]
            outs = [np.empty((n, rows), np.float32) for n in plan.ns]
            seconds = _time_interleaved(t, copies, xs, outs, plan)
            base = seconds[plan.ns.index(1)] if 1 in plan.ns else seconds[0]
            for n, sec in zip(plan.ns, seconds):
                gbps = copies[0].nbytes / sec / 1e9
                report.results.append(KernelResult(name, rows, cols, n, sec, gbps,
                                                   100.0 * gbps / report.bandwidth_gbps, sec / base))
            del copies
    return report


# ---- display ---------------------------------------------------------------------------------

def render_table(report: BenchReport):
    """A rich Table of the report (one row per type, shape and n)."""
    table = Table(title=f"CPU matvec, {report.threads} threads, read bandwidth "
                        f"{report.bandwidth_gbps:.1f} GB/s", title_justify="left")
    for col in ("type", "W rows×cols", "N", "time/pass", "GB/s", "% of BW", "× N=1"):
        table.add_column(col, justify="left" if col in ("type", "W rows×cols") else "right")
    previous = None
    for r in report.results:
        key = (r.type, r.rows, r.cols)
        if previous is not None and key != previous:
            table.add_section()
        previous = key
        table.add_row(r.type, f"{r.rows}×{r.cols}", str(r.n), _fmt_time(r.seconds), f"{r.gbps:.1f}",
                      f"{r.pct_of_bandwidth:.0f}%", f"{r.cost_vs_n1:.2f}")
    return table


def _fmt_time(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.0f} µs"


# ---- the command -----------------------------------------------------------------------------

def run_command(*, quick: bool = False, as_json: bool = False, threads: Optional[int] = None, types=None) -> None:
    """`hybrid bench-kernels` (and tools/bench_kernels.py): table or JSON on stdout, status on stderr."""
    err = Console(stderr=True, highlight=False)
    try:
        chosen = parse_types(types or [])
    except ValueError as e:
        raise HybridError(str(e)) from None
    max_threads = numba.config.NUMBA_NUM_THREADS
    n_threads = max_threads if threads is None else threads
    if not 1 <= n_threads <= max_threads:
        raise HybridError(f"--threads must be between 1 and {max_threads} (NUMBA_NUM_THREADS), got {n_threads}")
    plan = BenchPlan.make(chosen, quick=quick)
    with _status(err, "compiling kernels… (first run only; later runs load them from the cache)"):
        warm_up(plan.types)
    with _status(err, "benchmarking") as update:
        report = run(plan, n_threads, progress=update)
    if as_json:
        print(json.dumps(report.to_json()))   # plain print: rich would wrap and break the JSON
    else:
        Console(highlight=False).print(render_table(report))


@contextmanager
def _status(console, message: str):
    """A live spinner on a terminal, plain progress lines otherwise (never a silent pause)."""
    if console.is_terminal:
        with console.status(message) as st:
            yield lambda msg: st.update(f"{message}: {msg}")
    else:
        console.print(message)
        yield lambda msg: console.print(f"  {msg}")
