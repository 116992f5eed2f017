#!/usr/bin/env python3
"""Where a hybrid decode step's time goes, op by op, on the GPU machine.

    PYTHONPATH=$PWD python3 tools/device/gpu_profile.py MODEL.gguf [--vram 12GiB] [--steps 4] [--k 1]

Runs k-token steps with every kernel launched from Python (no CUDA graphs) and times each op of
gpu.ops on the device: a spin kernel holds the stream while Python enqueues the op between two
events, so the measured interval is the op's device time alone, without the launch overhead
that graph replay removes. Host calls (the CPU FFN hand-off, copies included) are timed on the
host. Also times one MTP head call. Prints ms per step per op, largest first.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", default="12GiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--k", type=int, default=1, help="tokens per step (a verify step when > 1)")
    p.add_argument("--prefill", action="store_true",
                   help="steps are prompt chunks of k tokens: last-row logits, no snapshot ring")
    args = p.parse_args(argv)

    from numba import cuda

    import gpu.runtime.memory as memory
    import gpu.ops as ops
    import hybrid
    from tools.gpu_bench_kernels import spin

    model = hybrid.load(args.model, device="cuda", vram=args.vram, cuda_graphs=False)
    model.warmup()
    device_s: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    host_s: dict[str, float] = defaultdict(float)

    depth = [0]                # ops call ops (swiglu calls matvec): time the outermost call only

    def device_timed(name, fn):
        def run(*a, **kw):
            if depth[0]:
                return fn(*a, **kw)
            depth[0] += 1
            try:
                # matvecs by weight shape: small matrices waste a launch's worth of time
                label = f"{name} {a[1].shape[0]}x{a[2].shape[1]}" if name == "matvec" else name
                return timed_on_device(label, fn, *a, **kw)
            finally:
                depth[0] -= 1
        return run

    def timed_on_device(name, fn, *a, **kw):
        stream = memory.stream()
        start, end = cuda.event(), cuda.event()
        spin[1, 32, stream](200)                     # 200 µs: longer than enqueueing one op
        start.record(stream)
        result = fn(*a, **kw)
        end.record(stream)
        end.synchronize()
        device_s[name] += cuda.event_elapsed_time(start, end) / 1e3
        calls[name] += 1
        return result

    def host_timed(name, fn):
        def run(*a, **kw):
            memory.synchronize()
            depth[0] += 1
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                memory.synchronize()
                host_s[name] += time.perf_counter() - t0
                calls[name] += 1
                depth[0] -= 1
        return run

    for name in ops.__all__:
        if name not in ("NAME", "KV_DTYPE", "rope_inv_freq", "matvec", "swiglu", "moe_ffn"):
            setattr(ops, name, device_timed(name, getattr(ops, name)))
    # matrix ops run on the device or through a host call depending on where the weights are
    for name in ("matvec", "swiglu", "moe_ffn"):
        fn = getattr(ops, name)
        dev_fn, host_fn = device_timed(name, fn), host_timed(name + " (host)", fn)

        def either(*a, _d=dev_fn, _h=host_fn, _name=name, **kw):
            w = a[1] if _name != "moe_ffn" else a[0].gate.data
            return (_d if memory.is_device(w) else _h)(*a, **kw)
        setattr(ops, name, either)
    memory.host_call = host_timed("host FFN call (copies + CPU)", memory.host_call)

    fw = model.forward
    verify = args.k > 1 and not args.prefill
    state = fw.new_state(64 + args.steps * args.k, n_ring=args.k if verify else 0)
    fw.forward(state, np.arange(1, 9, dtype=np.int32), logits="none")
    ids = np.arange(1, args.k + 1, dtype=np.int32)
    for d in (device_s, host_s, calls):
        d.clear()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        fw.forward(state, ids, logits="all" if verify else "last", snapshot=verify)
        if verify:
            state.rollback(1)
    wall = (time.perf_counter() - t0) / args.steps

    rows = [(n, s / args.steps, "gpu") for n, s in device_s.items()] + \
           [(n, s / args.steps, "host") for n, s in host_s.items()]
    total_gpu = sum(s for _, s, side in rows if side == "gpu")
    print(f"k={args.k}: {wall * 1e3:.1f} ms per step with per-op syncs; device time of the GPU ops "
          f"{total_gpu * 1e3:.2f} ms")
    print(f"{'op':34s} {'side':4s} {'ms/step':>8s} {'calls':>6s} {'µs/call':>8s}")
    for name, s, side in sorted(rows, key=lambda r: -r[1]):
        n = calls[name] / args.steps
        print(f"{name:34s} {side:4s} {s * 1e3:8.2f} {n:6.0f} {1e6 * s / max(n, 1):8.1f}")

    if model.has_mtp:
        from hybrid.mtp import MTPHead
        head = MTPHead(fw)
        hidden = np.zeros((1, model.config.n_embd), np.float32)
        head.forward(state, [1], hidden)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            head.forward(state, [1], hidden)
        print(f"MTP head, one row, eager with per-op syncs: {(time.perf_counter() - t0) / args.steps * 1e3:.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
