#!/usr/bin/env python3
"""Hybrid prefill on the GPU machine: prompt tokens per second, and where the FFN time went.

    PYTHONPATH=$PWD python3 tools/device/prefill_split.py MODEL.gguf [--vram 12GiB] [-n 512 -n 2048]
        [--chunk 256 --chunk 2048] [--reps 2] [--threads N] [--compare] [--staged]

Loads MODEL with hybrid.load on the GPU (the VRAM plan puts the trunk there, most FFN layers in
host memory), then for each prompt length n and chunk size prefills n random tokens in chunks
(the engine's hybrid.generate.PREFILL_CHUNK is 256; a bigger chunk streams each layer's
weights fewer times per prompt). Prints pp t/s (mean ± sd over --reps) and, for the last
repetition, the split gpu.runtime.weight_stream.StreamStats measures:

  copy     host→device transfer of the streamed FFN weights (device time on the copy stream;
           it overlaps the GPU work when the double buffer keeps up) and its GB/s
  gpu ffn  device time of the streamed FFNs' GEMMs
  wait     device time the FFNs waited for their weights (copy not hidden)
  cpu ffn  host time of CPU FFN hand-offs (calls below the streaming threshold)
  rest     wall time minus gpu ffn, wait and cpu ffn: the trunk on the GPU, lm_head, Python

--compare adds rows with streaming off (every FFN through the CPU hand-off); --staged copies
through pinned staging buffers instead of registering the mapped file.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def prefill(model, ids: np.ndarray, chunk: int) -> float:
    """Seconds to prefill ids into a fresh state, `chunk` tokens per forward call."""
    state = model.new_state(len(ids) + 1)
    t0 = time.perf_counter()
    for s in range(0, len(ids), chunk):
        part = ids[s:s + chunk]
        model.forward.forward(state, part, logits="last" if s + len(part) == len(ids) else "none")
    return time.perf_counter() - t0


def measure(model, n: int, chunk: int, reps: int, rng) -> tuple[list[float], dict]:
    stats = model.forward.backend.stream_stats
    rates = []
    for _ in range(reps):
        ids = rng.integers(0, model.config.n_vocab, n, dtype=np.int32)
        stats.reset()
        seconds = prefill(model, ids, chunk)
        rates.append(n / seconds)
        split = dict(stats.as_dict(), wall_seconds=seconds)
    return rates, split


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--vram", default="12GiB")
    ap.add_argument("-n", dest="n", type=int, action="append", help="prompt length (repeatable; default 512, 2048)")
    ap.add_argument("--chunk", type=int, action="append", help="tokens per forward call (repeatable; default 256)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--compare", action="store_true", help="also run every FFN through the CPU hand-off")
    ap.add_argument("--staged", action="store_true", help="stage copies instead of registering the mapping")
    args = ap.parse_args(argv)
    lengths, chunks = args.n or [512, 2048], args.chunk or [256]

    import hybrid
    from gpu.runtime.weight_stream import STREAM_MIN_ROWS
    from hybrid.units import format_size

    t0 = time.perf_counter()
    model = hybrid.load(args.model, device="cuda", vram=args.vram, threads=args.threads,
                        n_ctx=max(lengths) + 8)
    backend = model.forward.backend
    streamer = backend.streamer
    streamer.register = not args.staged
    host_ffns = len(streamer.order)
    print(f"loaded in {time.perf_counter() - t0:.1f} s: {model.config.n_layer} layers, {host_ffns} FFNs in host "
          f"memory ({format_size(streamer.host_bytes)}), streamed for calls of >= {STREAM_MIN_ROWS} rows "
          f"through two device slots of {format_size(streamer.slot_bytes)}")

    t0 = time.perf_counter()
    model.warmup()
    # every call size the runs will make: compiles its GEMM tiles; the first also registers the mapping
    sizes = sorted({size for n in lengths for c in chunks for size in (min(c, n), n % c) if size})
    for size in sizes:
        prefill(model, np.zeros(size, np.int32), size)
    stats = backend.stream_stats
    print(f"warm-up {time.perf_counter() - t0:.1f} s; copies: {stats.pinning} "
          f"(registering took {stats.pin_seconds:.2f} s)")
    stats.timing = True

    modes = [("stream", STREAM_MIN_ROWS)] + ([("cpu", None)] if args.compare else [])
    rng = np.random.default_rng(0)
    header = (f"{'n':>5s} {'chunk':>5s} {'mode':6s} {'pp t/s':>15s} {'copy GB':>7s} {'copy s':>7s} {'GB/s':>6s} "
              f"{'gpu ffn':>7s} {'wait':>6s} {'cpu ffn':>7s} {'rest':>6s} {'wall':>6s}")
    print(header)
    print("-" * len(header))
    for n in lengths:
        for chunk in chunks:
            for mode, min_rows in modes:
                streamer.min_rows = min_rows
                rates, s = measure(model, n, chunk, args.reps, rng)
                sd = statistics.stdev(rates) if len(rates) > 1 else 0.0
                gb = s["bytes_copied"] / 1e9
                rate = gb / s["copy_seconds"] if s["copy_seconds"] else 0.0
                rest = s["wall_seconds"] - s["ffn_seconds"] - s["wait_seconds"] - s["cpu_ffn_seconds"]
                print(f"{n:5d} {chunk:5d} {mode:6s} {statistics.fmean(rates):8.1f} ± {sd:5.1f} {gb:7.2f} "
                      f"{s['copy_seconds']:7.3f} {rate:6.1f} {s['ffn_seconds']:7.3f} {s['wait_seconds']:6.3f} "
                      f"{s['cpu_ffn_seconds']:7.3f} {rest:6.3f} {s['wall_seconds']:6.3f}", flush=True)
    streamer.min_rows = STREAM_MIN_ROWS
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except Exception as exc:     # a user-facing message for HybridError; anything else re-raised
        from hybrid.errors import HybridError
        if isinstance(exc, HybridError):
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        raise
