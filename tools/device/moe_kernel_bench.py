#!/usr/bin/env python3
"""The fused MoE expert kernel alone, with its weights cold (in DRAM), at the 35B-A3B shapes.

    python3 tools/device/moe_kernel_bench.py [--layers 24] [--experts 64] [--cpu-pairs 3]
                                             [--rows 1,2] [--pf 0,4096] [--calls 300]

Why: moe_split's "timed apart" figure reruns a hand-off's own inputs, so its experts sit in L3;
in a decode step every call reads experts nobody read for a whole step. Here each call takes the
next of `--layers` layers (each its own copy of the expert weights, together far larger than the
L3), routes every row to random distinct experts, and runs the first --cpu-pairs pairs of each
row on the CPU (the others are marked ~e, as the GPU's cached and fetched pairs are in a run).
It prints, per (rows, prefetch distance), the median µs per call of the kernel cut after each of
its steps, the bytes of the distinct experts the whole kernel read per second (beside the read
bandwidth probe of the same run), and the time of a plain parallel sum over the same bytes in as
many claimed pieces ("stream": the reads without the arithmetic). Weights in a mapped file (the
engine's GGUF) timed the same as numpy memory on the H100 box (stop 25).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from cpu.bandwidth import _sum_chunk, read_bandwidth  # noqa: E402
from cpu.atomics import fetch_add  # noqa: E402
from cpu.moe_kernel import CHUNKS_PER_WORKER, STAGES, routed_experts  # noqa: E402
from cpu.ggml_types import BY_NAME  # noqa: E402
from hybrid.kernel_bench import random_weights  # noqa: E402

D, N_FF, TOP_K = 2048, 512, 8      # Qwen3.5-35B-A3B: hidden size, expert width, experts per token


def _layers(n_layers: int, n_expert: int, types: tuple[str, str, str], rng):
    """n_layers copies of one layer's expert weights (gate, up, down), each in memory of its own."""
    first = [random_weights(BY_NAME[t], n_expert * rows, cols, rng)
             for t, (rows, cols) in zip(types, ((N_FF, D), (N_FF, D), (D, N_FF)))]
    return [first] + [[w.copy() for w in first] for _ in range(n_layers - 1)]


def _routing(n_rows: int, n_expert: int, cpu_pairs: int, rng):
    """Random distinct experts per row; pairs past the first cpu_pairs are marked ~e."""
    experts = np.stack([rng.choice(n_expert, TOP_K, replace=False) for _ in range(n_rows)]).astype(np.int64)
    experts[:, cpu_pairs:] = ~experts[:, cpu_pairs:]
    weights = np.full((n_rows, TOP_K), 1.0 / TOP_K, np.float32)
    return experts, weights


@njit(cache=True, nogil=True, parallel=True)
def _stream(words, spans, n_workers):
    """Sum the words of each span (matrix, first word, end word) as floats (the probe's loop), the
    spans claimed by n_workers threads from a counter: the kernel's reads without its arithmetic."""
    claimed = np.zeros(1, np.int64)
    total = np.zeros(n_workers * 16, np.float32)
    for worker in prange(n_workers):
        c = fetch_add(claimed, 0, 1)
        while c < spans.shape[0]:
            m, lo, hi = spans[c, 0], spans[c, 1], spans[c, 2]
            total[worker * 16] += _sum_chunk((words[0] if m == 0 else (words[1] if m == 1 else words[2]))[lo:hi])
            c = fetch_add(claimed, 0, 1)
    return total.sum()


def _spans(experts, expert_rows, layer, n_workers):
    """The word spans of the CPU pairs' distinct experts' gate, up and down matrices, each matrix
    cut into pieces so that the call has about as many spans as the kernel has chunks."""
    chosen = np.unique(experts[experts >= 0])
    pieces = max(1, CHUNKS_PER_WORKER * n_workers // max(1, 3 * len(chosen)))
    out = []
    for e in chosen:
        for m, w in enumerate(layer):
            rows = N_FF if m < 2 else D
            first = expert_rows[m, e] * w.shape[1] // 4
            size = rows * w.shape[1] // 4
            for p in range(pieces):
                out.append((m, first + size * p // pieces, first + size * (p + 1) // pieces))
    return np.array(out, np.int64)


def _timed(fn, args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--experts", type=int, default=64, help="experts per layer (each 1.77 MB at Q4_K)")
    p.add_argument("--cpu-pairs", type=int, default=3, help="pairs of each row the CPU runs (of 8)")
    p.add_argument("--rows", default="1,2")
    p.add_argument("--pf", default="4096", help="prefetch distances in bytes, comma-separated")
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--down", default="Q4_K", help="the down matrices' type (Q4_K_M mixes Q4_K and Q6_K)")
    a = p.parse_args()

    rng = np.random.default_rng(0)
    types = ("Q4_K", "Q4_K", a.down)
    t0 = time.perf_counter()
    layers = _layers(a.layers, a.experts, types, rng)
    gib = sum(w.nbytes for layer in layers for w in layer) / 2**30
    print(f"{a.layers} layers x {a.experts} experts ({gib:.1f} GiB) built in {time.perf_counter() - t0:.0f} s",
          flush=True)
    wtypes = np.array([BY_NAME[t].id for t in types], np.int64)
    expert_rows = np.stack([np.arange(a.experts) * N_FF, np.arange(a.experts) * N_FF,
                            np.arange(a.experts) * D]).astype(np.int64)
    expert_bytes = sum(w.nbytes for w in layers[0]) / a.experts
    threads = numba.get_num_threads()
    probe = read_bandwidth(1 << 32)
    print(f"threads {threads}, probe {probe:.1f} GB/s, one expert {expert_bytes / 1e6:.2f} MB", flush=True)

    # the same kernel on one thread, one expert over and over (in L2/L3): the dots' own speed
    x1 = rng.standard_normal((1, D)).astype(np.float32)
    one, _ = _routing(1, a.experts, 1, rng)
    args = (wtypes, *layers[0], expert_rows, N_FF, x1, one, np.ones((1, TOP_K), np.float32), np.empty((1, D), np.float32), 1, 4096)
    routed_experts(*args)
    warm = min(_timed(routed_experts, args) for _ in range(20))
    blocks = sum(w.nbytes for w in layers[0]) / a.experts / BY_NAME["Q4_K"].block_bytes
    print(f"one thread, one expert warm: {warm * 1e6:.0f} µs = {warm / blocks * 1e9:.2f} ns per block", flush=True)
    words = [tuple(w.reshape(-1).view(np.float32) for w in layer) for layer in layers]
    _stream(words[0], np.zeros((1, 3), np.int64), threads)

    stage_names = [f"+{name.split(':')[0]}" for name in STAGES]
    print("µs per call, median (each column: the kernel cut after that step); GB/s of the full kernel")
    print(f"{'rows':>4} {'pf':>6} {'stream':>7} " + " ".join(f"{n:>8}" for n in stage_names) + f" {'GB/s':>6} {'of probe':>8}")
    for n_rows in (int(v) for v in a.rows.split(",")):
        x = rng.standard_normal((n_rows, D)).astype(np.float32)
        out = np.empty((n_rows, D), np.float32)
        routings = [_routing(n_rows, a.experts, a.cpu_pairs, rng) for _ in range(a.calls)]
        moved = sum(len(np.unique(e[e >= 0])) for e, _ in routings) * expert_bytes
        spans = [_spans(e, expert_rows, layers[0], threads) for e, _ in routings]
        stream = [_timed(_stream, (words[i % len(layers)], spans[i], threads)) for i in range(a.calls)]
        for pf in (int(v) for v in a.pf.split(",")):
            medians = []
            for stages in range(1, len(STAGES) + 1):
                routed_experts(wtypes, *layers[0], expert_rows, N_FF, x, *routings[0], out, threads, pf, stages)
                times = [_timed(routed_experts, (wtypes, *layers[i % len(layers)], expert_rows, N_FF, x, *routings[i],
                                                 out, threads, pf, stages)) for i in range(a.calls)]
                medians.append(float(np.median(times)))
            rate = moved / sum(times) / 1e9           # the whole kernel: the last stages value
            print(f"{n_rows:>4} {pf:>6} {np.median(stream) * 1e6:>7.1f} " + " ".join(f"{m * 1e6:>8.1f}" for m in medians)
                  + f" {rate:>6.1f} {rate / probe:>8.0%}", flush=True)


if __name__ == "__main__":
    main()
