"""GPU memory bandwidth, matvec and GEMM throughput, host→device copy rate, timed on the device
with CUDA events.

    python tools/gpu_bench_kernels.py --gemm [--quick]  # prompt-chunk GEMMs of a dense 27B's FFN, every tile
    python tools/gpu_bench_kernels.py --h2d             # host→device GB/s: pinned, registered, pageable
    python tools/gpu_bench_kernels.py --attention       # decode attention µs by context length (35B-A3B heads)

Also the library of tools/gpu_bench.py (matvec GB/s per type), tools/gpu_ptx_check.py (these
kernels' PTX) and the scripts in tools/device/ (`spin`, `read_all`).

Timing trick: a one-thread kernel first sleeps for a few milliseconds on the stream while Python
enqueues the start event, the timed launches and the end event behind it. The events then measure
back-to-back kernels only, not Python's ~20-100 us per launch (which the decode loop must hide or
fuse separately). A result is flagged when enqueueing outlasted the sleep.
"""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numba import cuda, types, uint32

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cpu import ggml_types as gt  # noqa: E402
from gpu.attention import KV_DTYPE, gated_attention  # noqa: E402
from gpu.intrinsics import load_u32x4  # noqa: E402
from gpu.matmul import gemm as gemm_module  # noqa: E402
from gpu.matmul import matvec_q8  # noqa: E402
from gpu.matmul.matvec import (MAX_ROWS_X_SLOTS, _uses_dp4a, default_rows_per_warp, kernel,  # noqa: E402
                               lanes_per_row, matvec)
from gpu.runtime import memory  # noqa: E402
from gpu import require_cuda  # noqa: E402
from gpu.runtime.host_mapping import register_host_ranges, unregister_host_ranges  # noqa: E402

SPIN_NS = 1000


@cuda.jit
def spin(iterations):
    """Hold the stream for about `iterations` microseconds."""
    if cuda.grid(1) == 0:
        for _ in range(iterations):
            cuda.nanosleep(uint32(SPIN_NS))


@cuda.jit
def read_all(words, sink):
    """Read every 16-byte row of `words` (n, 4) once; write nothing unless an impossible XOR
    turns up (keeps the loads alive without write traffic)."""
    acc = uint32(0)
    i = cuda.grid(1)
    while i < words.shape[0]:
        a, b, c, d = load_u32x4(words, i, 0)
        acc ^= a ^ b ^ c ^ d
        i += cuda.gridsize(1)
    if acc == uint32(0x9E3779B9):
        sink[0] = acc


@cuda.jit
def copy_all(src, dst):
    """dst = src for (n, 4) uint32 arrays, 16 bytes per load."""
    i = cuda.grid(1)
    while i < src.shape[0]:
        a, b, c, d = load_u32x4(src, i, 0)
        dst[i, 0] = a
        dst[i, 1] = b
        dst[i, 2] = c
        dst[i, 3] = d
        i += cuda.gridsize(1)


@cuda.jit
def fill_pseudo_random(flat_bytes, seed):
    """Cheap hash bytes: quants and scales of every value (fp16 fields may be NaN: timing only)."""
    i = cuda.grid(1)
    while i < flat_bytes.shape[0]:
        h = uint32(i) * uint32(0x9E3779B1) ^ uint32(seed)
        h ^= h >> uint32(15)
        h *= uint32(0x85EBCA77)
        flat_bytes[i] = h >> uint32(24)
        i += cuda.gridsize(1)


def _grid() -> tuple[int, int]:
    sms = cuda.get_current_device().MULTIPROCESSOR_COUNT
    return sms * 8, 256


@dataclass
class Timing:
    seconds: float    # device time per launch
    flagged: bool     # enqueueing took longer than the spin: seconds may include idle time


def time_launches(launch, repeats: int = 20, spin_us: int = 5000) -> Timing:
    """Device seconds per call of `launch()` (which enqueues work on the default stream)."""
    launch()  # compile and warm up
    cuda.synchronize()
    for _ in range(3):
        spun, start, end = cuda.event(), cuda.event(), cuda.event()
        spun.record()
        spin[1, 32](spin_us)
        start.record()
        t0 = time.perf_counter()
        for _ in range(repeats):
            launch()
        enqueue_ms = (time.perf_counter() - t0) * 1e3
        end.record()
        end.synchronize()
        flagged = enqueue_ms > spun.elapsed_time(start)
        if not flagged:
            break
        spin_us *= 4  # the sleep was shorter than Python's enqueueing: hold the stream longer
    return Timing(start.elapsed_time(end) / 1e3 / repeats, flagged)


def ptx_targets():
    """(name, python function, argument types) of the benchmark kernels, for the PTX check."""
    u32x4 = types.Array(types.uint32, 2, "C")
    yield "bench spin", spin.py_func, (types.int64,)
    yield "bench read_all", read_all.py_func, (u32x4, types.Array(types.uint32, 1, "C"))
    yield "bench copy_all", copy_all.py_func, (u32x4, u32x4)
    yield "bench fill_pseudo_random", fill_pseudo_random.py_func, (types.Array(types.uint8, 1, "C"), types.int64)


def memory_bandwidth(nbytes: int = 2 << 30) -> dict[str, float]:
    """GB/s of a pure read and of a copy (bytes read + written) over `nbytes` of device memory."""
    words = cuda.device_array((nbytes // 16, 4), np.uint32)
    other = cuda.device_array_like(words)
    sink = cuda.device_array(1, np.uint32)
    grid, block = _grid()
    fill_pseudo_random[grid, block](words.reshape(-1).view(np.uint8), 1)
    read = time_launches(lambda: read_all[grid, block](words, sink), repeats=10)
    copy = time_launches(lambda: copy_all[grid, block](words, other), repeats=10)
    return {"read": nbytes / read.seconds / 1e9, "copy": 2 * nbytes / copy.seconds / 1e9}


def random_weights(t: gt.GGMLType, rows: int, cols: int, seed: int = 1):
    """(rows, row_bytes) uint8 device array of hash bytes, made on the device."""
    row_bytes = t.row_bytes(cols)
    flat = cuda.device_array(rows * row_bytes, np.uint8)
    grid, block = _grid()
    fill_pseudo_random[grid, block](flat, seed)
    return flat.reshape(rows, row_bytes)


@dataclass
class MatvecResult:
    type: str
    rows: int
    cols: int
    n: int
    requested: tuple        # (rows per warp, lanes per row) asked for (None: the default)
    rows_per_warp: int      # rows per warp (per lane group) used
    lanes: int              # lanes per row used
    gbps: float
    flagged: bool
    registers: int          # per thread, of the kernel that ran


def bench_matvec(t: gt.GGMLType, rows: int, cols: int, slots=(1, 2, 4, 8),
                 choices=((None, None),)) -> list[MatvecResult]:
    """Weight bytes streamed per second for each slot count and (rows per warp, lanes per row)
    choice (None: the default)."""
    w = random_weights(t, rows, cols)
    nbytes = w.shape[0] * w.shape[1]
    rng = np.random.default_rng(0)
    results = []
    for n in slots:
        x = cuda.to_device(rng.standard_normal((n, cols)).astype(np.float32))
        out = cuda.device_array((n, rows), np.float32)
        for r, lanes in choices:
            if r is not None and r * n > MAX_ROWS_X_SLOTS:
                continue
            timing = time_launches(lambda: matvec(t.id, w, x, out, rows_per_warp=r, lanes=lanes))
            used_lanes = lanes or lanes_per_row(t.id, cols)
            used = r or default_rows_per_warp(n, rows, t.id, used_lanes)
            regs = max(kernel(t.id, n, used, used_lanes).get_regs_per_thread().values())
            results.append(MatvecResult(t.name, rows, cols, n, (r, lanes), used, used_lanes,
                                        nbytes / timing.seconds / 1e9, timing.flagged, regs))
    return results


def bench_matvec_shared_input(t: gt.GGMLType, rows: int, cols: int) -> tuple[float, float, bool] | None:
    """(GB/s of a one-slot matvec, GB/s of its kernel alone with x quantised beforehand, flagged):
    the second is what each matrix of one input costs when `matvecs` shares the quantisation (a
    GDN layer's four projections, attention's q/k/v). None for the float types (no quantise)."""
    if not _uses_dp4a(t.id):
        return None
    w = random_weights(t, rows, cols)
    x = cuda.to_device(np.random.default_rng(0).standard_normal((1, cols)).astype(np.float32))
    out = cuda.device_array((1, rows), np.float32)
    quantized = matvec_q8.quantize(x, None, matvec_q8.UNITS[t.id].x_layout)
    whole = time_launches(lambda: matvec(t.id, w, x, out), repeats=50)
    alone = time_launches(lambda: matvec_q8.matvec(t.id, w, x, out, rows, cols, 1, memory.stream(),
                                                   quantized=quantized), repeats=50)
    nbytes = w.shape[0] * w.shape[1]
    return nbytes / whole.seconds / 1e9, nbytes / alone.seconds / 1e9, whole.flagged or alone.flagged


# --- prompt-chunk GEMMs ---------------------------------------------------------------------------

# (type, rows, cols): a dense 27B's FFN gate/up and down (Q4_K_M stores down as Q6_K or Q4_K)
GEMM_SHAPES = [(gt.Q4_K, 17408, 5120), (gt.Q6_K, 5120, 17408), (gt.Q4_K, 5120, 17408)]
GEMM_ROWS = (256, 2048)      # the prefill chunk now, and a whole 2048-token prompt in one call


@dataclass
class GemmResult:
    type: str
    rows: int
    cols: int
    n: int
    tile: str
    chosen: bool            # the tile gpu.matmul.gemm.choose_tile picks for this shape
    seconds: float
    tflops: float           # 2·rows·cols·n / seconds
    flagged: bool
    registers: int


def bench_gemm(t: gt.GGMLType, rows: int, cols: int, n_rows=GEMM_ROWS) -> list[GemmResult]:
    """Every tile of gpu.matmul.gemm on one weight shape, for each row count."""
    w = random_weights(t, rows, cols)
    rng = np.random.default_rng(0)
    results = []
    for n in n_rows:
        x = cuda.to_device(rng.standard_normal((n, cols)).astype(np.float32))
        out = cuda.device_array((n, rows), np.float32)
        chosen = gemm_module.choose_tile(rows, n, cols=cols)
        for tile in gemm_module.TILES:
            timing = time_launches(lambda: gemm_module.gemm(t.id, w, x, out, tile=tile), repeats=5)
            regs = max(gemm_module.kernel(t.id, tile).get_regs_per_thread().values())
            results.append(GemmResult(t.name, rows, cols, n, tile.name, tile == chosen, timing.seconds,
                                      2 * rows * cols * n / timing.seconds / 1e12, timing.flagged, regs))
    return results


def print_gemm(quick: bool = False) -> None:
    shapes = [(t, r // 4, c) for t, r, c in GEMM_SHAPES] if quick else GEMM_SHAPES
    print(f"{'type':5s} {'rows x cols':>12s} {'n':>5s} {'tile':>8s} {'ms':>8s} {'TFLOPS':>7s} regs")
    best: dict[tuple, float] = {}
    for t, rows, cols in shapes:
        for res in bench_gemm(t, rows, cols):
            mark = "<" if res.chosen else " "
            print(f"{res.type:5s} {f'{rows}x{cols}':>12s} {res.n:5d} {res.tile:>8s} {res.seconds * 1e3:8.3f} "
                  f"{res.tflops:7.2f} {res.registers:4d} {mark}{'*' if res.flagged else ''}")
            if res.chosen:
                best[(t.name, rows, cols, res.n)] = res.seconds
    # one dense layer's FFN at each n: gate + up (the first shape twice) + down (Q6_K)
    gate, down = shapes[0], shapes[1]
    for n in GEMM_ROWS:
        layer = 2 * best[(gate[0].name, gate[1], gate[2], n)] + best[(down[0].name, down[1], down[2], n)]
        print(f"FFN layer, n={n}: {layer * 1e3:.2f} ms (chosen tiles) -> 64 such layers: "
              f"{n / (64 * layer):.0f} tokens/s for the FFN GEMMs alone")
    print("'<' the tile gpu.matmul.gemm.choose_tile picks; '*' time may include idle gaps")


# --- host→device copies -----------------------------------------------------------------------------

def host_to_device(nbytes: int = 1 << 30) -> dict[str, float]:
    """GB/s of one nbytes host→device copy from a pinned buffer, from a pageable buffer
    registered with cuMemHostRegister (what gpu.runtime.weight_stream does with the mapped file)
    and from plain pageable memory."""
    dev = cuda.device_array(nbytes, np.uint8)
    stream = cuda.stream()

    def rate(host) -> float:
        dev.copy_to_device(host, stream=stream)       # warm
        stream.synchronize()
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record(stream)
        dev.copy_to_device(host, stream=stream)
        end.record(stream)
        end.synchronize()
        return nbytes / (start.elapsed_time(end) / 1e3) / 1e9

    result = {"pinned": rate(cuda.pinned_array(nbytes, np.uint8))}
    pageable = np.ones(nbytes, np.uint8)
    bases, why = register_host_ranges([pageable])
    result["registered"] = rate(pageable) if why is None else float("nan")
    unregister_host_ranges(bases)
    result["pageable"] = rate(pageable)
    if why is not None:
        print(f"registration failed: {why}")
    return result


def bench_attention(contexts=(16, 128, 512, 2048, 8192), n_head=16, n_head_kv=2, head_dim=256,
                    rows=(1, 4)) -> list[tuple[int, int, float, float]]:
    """(rows, context, µs per call, GB/s of K/V read) of gpu.attention.gated_attention, each row
    seeing `context` positions (a decode or verify step that far into a sequence)."""
    rng = np.random.default_rng(0)
    cache_shape = (n_head_kv, max(contexts) + max(rows), head_dim)
    k_cache, v_cache = (memory.upload(rng.standard_normal(cache_shape, np.float32).astype(KV_DTYPE))
                        for _ in range(2))
    results = []
    for n in rows:
        q = memory.upload(rng.standard_normal((n, n_head, head_dim), np.float32))
        qg = memory.upload(rng.standard_normal((n, n_head, 2 * head_dim), np.float32))
        out = cuda.device_array((n, n_head * head_dim), np.float32)
        for context in contexts:
            pos = memory.upload(np.arange(context - 1, context - 1 + n, dtype=np.int64))
            t = time_launches(lambda: gated_attention(q, qg, k_cache, v_cache, pos, out)).seconds
            kv_bytes = 2 * n_head_kv * (context + n - 1) * head_dim * np.dtype(KV_DTYPE).itemsize
            results.append((n, context, 1e6 * t, kv_bytes / t / 1e9))
    return results


def main(argv: list[str]) -> int:
    require_cuda()
    if "--attention" in argv:
        print(f"{'rows':>4} {'context':>8} {'µs':>8} {'KV GB/s':>8}")
        for n, context, us, rate in bench_attention():
            print(f"{n:4d} {context:8d} {us:8.1f} {rate:8.1f}")
    if "--gemm" in argv:
        print_gemm(quick="--quick" in argv)
    if "--h2d" in argv:
        rates = host_to_device()
        print("host->device GB/s: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
    if not {"--gemm", "--h2d", "--attention"} & set(argv):
        print(__doc__)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
