#!/usr/bin/env python3
"""What the GPU does, kernel by kernel, during replayed decode steps (CUPTI trace via torch).

    python3 tools/device/step_trace.py MODEL.gguf [--vram 12GiB] [--steps 4] [--k 1] [--context 4] [--n-ctx N]

Runs k-token steps as the engine runs them (CUDA graphs replayed, CPU hand-offs between the
segments) under torch.profiler, whose CUPTI tracer records every kernel and copy of the process,
Numba's included, with device timestamps. Prints per step:
* the kernels by name: launches per step, mean and total device µs;
* each segment between two hand-offs: its span on the device (first activity to the hand-off's
  inputs: its last copy down, or a MoE layer's routing kernel), the kernels' busy time in it,
  and so the idle gaps between nodes;
* the time from a hand-off's inputs (its last copy down, or a MoE layer's routing kernel, which
  writes them to mapped host memory) to the next segment's first activity (the CPU FFN, the
  host's wake-up and the next graph launch), and when the GPU's own work of the hand-off ended.
Kernel and copy durations are the device's own; the gaps between them are not: the tracer
slows every launch down, so spans and gaps come out larger than in an untraced step (on the H200
a 35B-A3B segment spans ~125 µs traced against ~75 µs of host wait untraced).
Needs torch on the machine (the GPU machine has it); nothing of the engine is changed.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def short_name(mangled: str) -> str:
    """The module and function of a Numba kernel's Itanium-mangled name (others as they are)."""
    if not mangled.startswith("_Z"):
        return mangled
    parts, i = [], mangled.find("N") + 1 if mangled.startswith("_ZN") else 2
    while i < len(mangled) and mangled[i].isdigit():
        m = re.match(r"\d+", mangled[i:])
        n = int(m.group())
        i += len(m.group())
        parts.append(mangled[i:i + n])
        i += n
    names = [p for p in parts if p not in ("cudapy",)]
    return ".".join(names[-2:]) if names else mangled


def activities(trace_path: str) -> list[tuple[float, float, str, str]]:
    """(start µs, end µs, kind, name) of every GPU kernel / copy / memset, by start."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = []
    for e in events:
        cat = e.get("cat", "")
        if e.get("ph") == "X" and cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            name = short_name(e["name"]) if cat == "kernel" else e["name"]
            out.append((float(e["ts"]), float(e["ts"]) + float(e["dur"]), cat, name))
    return sorted(out)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", default="12GiB")
    p.add_argument("--steps", type=int, default=4, help="traced steps")
    p.add_argument("--k", type=int, default=1, help="tokens per step (a verify step with logits of all rows when > 1)")
    p.add_argument("--no-expert-cache", action="store_true")
    p.add_argument("--pcie-share", type=float, default=None, help="default: the engine's")
    p.add_argument("--context", type=int, default=4, help="prompt tokens before the traced steps")
    p.add_argument("--n-ctx", type=int, default=None,
                   help="the context the placement is planned for (default: what the run needs)")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    import hybrid
    from hybrid.bench import prefill_prompt
    from hybrid.placement import DEFAULT_PCIE_SHARE
    share = DEFAULT_PCIE_SHARE if args.pcie_share is None else args.pcie_share
    n_ctx = args.n_ctx or args.context + args.steps * args.k + 64
    model = hybrid.load(args.model, device="cuda", vram=args.vram, n_ctx=n_ctx, expert_cache=not args.no_expert_cache,
                        pcie_share=share)
    model.warmup()
    fw = model.forward
    state = fw.new_state(n_ctx)
    prefill_prompt(model, state, np.arange(1, args.context + 1, dtype=np.int32) % model.config.n_vocab)
    toks = np.full(args.k, 5, np.int32)
    logits = "last" if args.k == 1 else "all"
    for _ in range(3):                                   # eager, captured, replayed
        fw.forward(state, toks, logits=logits, pick=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            fw.forward(state, toks, logits=logits, pick=True)
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "trace.json")
        prof.export_chrome_trace(path)
        acts = activities(path)
    if not acts:
        print("the trace holds no GPU activity (CUPTI saw none of Numba's launches?)")
        return 1
    steps = args.steps
    print(f"{args.model.name}: {steps} steps of k={args.k}, {len(acts)} GPU activities "
          f"({len(acts) / steps:.0f} per step), span {(acts[-1][1] - acts[0][0]) / steps:.0f} µs per step")

    by_name = defaultdict(list)
    for t0, t1, cat, name in acts:
        by_name[(cat, name)].append(t1 - t0)
    busy = sum(t1 - t0 for t0, t1, _, _ in acts) / steps
    print(f"  device busy {busy:.0f} µs per step (kernels and copies, overlaps counted twice)")
    print(f"  {'kind':10s} {'name':44s} {'per step':>8s} {'mean µs':>8s} {'µs/step':>8s}")
    for (cat, name), ds in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {cat[:10]:10s} {name[:44]:44s} {len(ds) / steps:8.1f} {statistics.mean(ds):8.2f} "
              f"{sum(ds) / steps:8.1f}")

    # segments: a host→device copy (a dense hand-off's result) or a MoE layer's `_finish` (which
    # reads the host's sum in place) starts one; its critical part runs to the hand-off's inputs:
    # its last copy down, or the MoE routing kernel (which writes them to mapped host memory);
    # the rest of the segment is the `meanwhile` work, beside the CPU call
    segs, cur = [], []
    for a in acts:
        if _starts_segment(a) and cur:
            segs.append(cur)
            cur = []
        cur.append(a)
    segs.append(cur)
    spans, kernel_busy, host_gaps, meanwhile, counts = [], [], [], [], []
    for i, seg in enumerate(segs):
        ends = [j for j, a in enumerate(seg) if _ends_critical(a)]
        critical = seg[:ends[-1] + 1] if ends else seg
        spans.append(critical[-1][1] - critical[0][0])
        kernel_busy.append(_union(critical))
        counts.append(len(critical))
        if i + 1 < len(segs):
            host_gaps.append(segs[i + 1][0][0] - critical[-1][1])
            meanwhile.append(max(a[1] for a in seg) - critical[-1][1])
    med = statistics.median
    print(f"  {len(segs) / steps:.0f} segments per step; critical part (to the hand-off's inputs), median: "
          f"{med(counts):.0f} activities, span {med(spans):.1f} µs, busy {med(kernel_busy):.1f} µs, "
          f"idle gaps {med(spans) - med(kernel_busy):.1f} µs")
    if host_gaps:
        print(f"  hand-off (inputs ready → next segment's first activity): median {med(host_gaps):.1f} µs, "
              f"total {sum(host_gaps) / steps:.0f} µs per step; the GPU's meanwhile work ends "
              f"{med(meanwhile):.1f} µs after the inputs (median)")
    # one segment of each shape (GDN layers, attention layers, the step's ends), activity by activity
    shown = set()
    for seg in segs[len(segs) - len(segs) // steps:]:          # the last step's
        shape = tuple(name for _, _, _, name in seg)
        if shape in shown or len(shown) >= 3:
            continue
        shown.add(shape)
        print(f"  a segment of {len(seg)} activities (start offset µs, duration µs):")
        base = seg[0][0]
        for t0, t1, cat, name in seg:
            print(f"    {t0 - base:8.1f} {t1 - t0:7.2f}  {name[:64]}")
    return 0


def _is_kernel(name: str, function: str) -> bool:
    """Whether a kernel's name (`module.function`, or demangled `gpu::module::function[abi:…]…`)
    is this function's."""
    return re.search(rf"(^|[.:]){function}($|\[|\()", name) is not None


def _starts_segment(activity) -> bool:
    _, _, cat, name = activity
    return (cat == "gpu_memcpy" and "HtoD" in name) or _is_kernel(name, "_finish")


def _ends_critical(activity) -> bool:
    _, _, cat, name = activity
    return (cat == "gpu_memcpy" and "DtoH" in name) or _is_kernel(name, "_route")


def _union(seg) -> float:
    """Time covered by at least one activity of seg."""
    total, end = 0.0, -1e30
    for t0, t1, _, _ in sorted(seg):
        if t1 > end:
            total += t1 - max(t0, end)
            end = t1
    return total


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
