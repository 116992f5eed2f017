#!/usr/bin/env python3
"""What a CPU FFN hand-off costs beside its bytes: host time per call against the bytes it reads.

    python3 tools/device/handoff_cost.py MODEL.gguf [--vram 8GiB,12GiB,16GiB,20GiB] [--tokens 32]
                                          [--env GOMP_SPINCOUNT=0 --env GOMP_SPINCOUNT=30000000]

Each configuration loads MODEL (a dense model with a GPU) with --split-ffn at one VRAM budget, so
every FFN layer's host half reads the same bytes, fewer as the budget grows; it decodes, and reads
the host time of the CPU FFN hand-offs (`GPUBackend.stream_stats`). A line through (bytes a call,
seconds a call) gives the fixed cost of a call (the intercept: the threads' wake-up after the GPU's
part, the parallel regions' ramp and tail) and the rate its bytes stream at (1 / slope). Why it
matters: docs/MEASUREMENTS.md, "2026-11-29 (stop 48)": a split FFN's half-size calls streamed
slower than whole layers', which a fixed cost per call explains; whole layers pay it too, once per
CPU layer and token.

Each configuration runs in a process of its own, so an `--env` setting read when the process
starts (OpenMP's wait policy) applies to it; settings are crossed with the budgets (none: the
defaults alone).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def one(model: str, vram: str, tokens: int) -> dict:
    """Load, decode `tokens` after a short warm run, and report the hand-offs (in this process)."""
    import hybrid
    from hybrid.bench import bench_generate
    m = hybrid.load(model, device="cuda", vram=vram, n_ctx=tokens + 128, split_ffn=True)
    m.warmup()
    bench_generate(m, 8, 1)                   # graphs captured, threads started
    stats = m.forward.backend.stream_stats
    stats.cpu_ffn_seconds, stats.cpu_ffn_calls = 0.0, 0
    row = bench_generate(m, tokens, 1)
    steps = tokens + 3                        # bench_generate's two untimed steps and its context token too
    calls = stats.cpu_ffn_calls / steps
    return {"vram": vram, "tokens_per_s": tokens / row.seconds[0], "calls_per_token": calls,
            "seconds_per_call": stats.cpu_ffn_seconds / max(stats.cpu_ffn_calls, 1),
            "bytes_per_call": m.plan.ffn_per_token("cpu") / calls if calls else 0.0,
            "split_rows": sorted(set(m.plan.ffn_split.values()))}


def fit_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """Least squares y = a + b·x through (x, y) points: (a, b)."""
    n = len(points)
    if n < 2:
        raise ValueError("a line needs two points")
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    if var == 0:
        raise ValueError("the points share one x: vary the budget")
    b = sum((x - mx) * (y - my) for x, y in points) / var
    return my - b * mx, b


def report(label: str, rows: list[dict]) -> str:
    lines = [f"== {label}", "| --vram | host rows a layer | t/s | calls a token | MB a call | µs a call | GB/s in the call |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['vram']} | {r['split_rows']} | {r['tokens_per_s']:.2f} | {r['calls_per_token']:.0f} | "
                     f"{r['bytes_per_call'] / 1e6:.1f} | {r['seconds_per_call'] * 1e6:.0f} | "
                     f"{r['bytes_per_call'] / r['seconds_per_call'] / 1e9:.1f} |")
    if len(rows) >= 2:
        a, b = fit_line([(r["bytes_per_call"], r["seconds_per_call"]) for r in rows])
        lines.append(f"fixed cost a call {a * 1e6:.0f} µs; its bytes stream at {1 / b / 1e9:.1f} GB/s"
                     if b > 0 else f"no rate: the time does not grow with the bytes (intercept {a * 1e6:.0f} µs)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["_one"]:
        print(json.dumps(one(argv[1], argv[2], int(argv[3]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--vram", default="8GiB,12GiB,16GiB,20GiB", help="budgets, comma-separated")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for one set of runs (repeatable)")
    args = p.parse_args(argv)
    settings = [("defaults", {})] + [(e, dict([e.split("=", 1)])) for e in args.env]
    for label, env in settings:
        rows = []
        for vram in args.vram.split(","):
            done = subprocess.run([sys.executable, __file__, "_one", args.model, vram, str(args.tokens)],
                                  capture_output=True, text=True, env={**os.environ, **env})
            if done.returncode != 0:      # the error's own line, the traceback's last
                why = (done.stderr.strip().splitlines() or ["no message"])[-1]
                print(f"{label} --vram {vram}: exit {done.returncode}: {why}", file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        if rows:
            print(report(label, rows), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
