#!/usr/bin/env python3
"""The 27B-shape decode benchmark (tools/device/bench_27b.sh runs it on the GPU test machine).

    PYTHONPATH=$PWD python3 tools/device/bench_27b.py MODEL.gguf [--vram 12GiB] [--n-gen 8] [--reps 2]
                                                      [--threads N] [--json OUT.json]

1. CPU read bandwidth (cpu.bandwidth: the kernels' own thread pool and kind of read);
2. the placement plan for the VRAM budget (`hybrid info MODEL --plan --vram …`);
3. CPU-only: plain decode, one verify step of k = 1..4 tokens, drafting decode at depth 1..3,
   and where one verify step's time goes (FFN, GDN, attention, lm_head, the rest);
4. HYBRID (GPU) rows: the same measurements on the GPU backend, skipped while it does not exist;
5. one table last, every figure also as a % of the roofline.

Roofline: the CPU-side weight bytes one token (or one verify step) reads / measured bandwidth.
Two are shown: FFN bytes only (DEVICE.md's figure, the CPU's share in the hybrid design) and all
CPU bytes (the true bound of CPU-only decode, which also streams trunk and lm_head). A k-token
verify step reads the same bytes as one token, so its roofline is the same time.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from hybrid.errors import HybridError  # noqa: E402
from hybrid.placement import CPU, cpu_plan, plan_placement  # noqa: E402
from hybrid.units import format_size, parse_size  # noqa: E402

VERIFY_KS = (1, 2, 3, 4)
DRAFT_DEPTHS = (1, 2, 3)           # k = depth + 1 = 2, 3, 4 tokens per verify step
HYBRID_RING = max(VERIFY_KS) + 1


@dataclass
class Row:
    mode: str                      # "cpu" or "hybrid"
    test: str                      # "plain tg8", "verify k=3", "draft d=2 tg8"
    seconds: float                 # per token (plain, draft) or per step (verify)
    tokens_per_s: float
    roofline_ffn_pct: float        # FFN-bytes roofline time / measured time, %
    roofline_all_pct: float        # all-CPU-bytes roofline time / measured time, %
    note: str = ""


# --- measurements (any loaded hybrid.Model) ------------------------------------------------------

def time_plain(model, n_gen: int, reps: int) -> float:
    """Seconds per token of greedy one-token decode (hybrid.bench's tg test)."""
    from hybrid.bench import bench_generate
    return 1.0 / bench_generate(model, n_gen, reps).mean


def time_verify(model, k: int, reps: int) -> float:
    """Median seconds of one k-token verify forward (greedy picks of all rows, snapshotting), as
    greedy speculative decoding runs it; each step is rolled back to one kept token, so positions
    barely move."""
    state = model.forward.new_state(reps + k + 9, n_ring=max(k, 1))
    model.forward.forward(state, np.zeros(1, np.int32), logits="last")
    ids = np.arange(1, k + 1, dtype=np.int32) % model.config.n_vocab
    times = []
    for _ in range(reps + 2):      # the first call sizes the scratch, the second captures a graph
        t0 = time.perf_counter()
        model.forward.forward(state, ids, logits="all", snapshot=True, pick=True)
        times.append(time.perf_counter() - t0)
        state.rollback(1)
    return statistics.median(times[2:])


def time_draft(model, n_gen: int, depth: int, reps: int) -> tuple[float, float, dict]:
    """(seconds per token, tokens per step, last run's draft stats) of greedy MTP drafting."""
    from hybrid.bench import bench_draft
    row = bench_draft(model, n_gen, depth, reps)
    return 1.0 / row.mean, row.tokens_per_step, row.draft


@contextmanager
def _timed_parts(forward, totals: dict[str, float]):
    """Wrap the layer loop's parts on this Forward instance (and the lm_head) with timers."""
    import hybrid.forward as fwd_module

    def timer(name, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                totals[name] = totals.get(name, 0.0) + time.perf_counter() - t0
        return run

    parts = {"ffn": "_ffn", "gdn": "_gdn", "attention": "_attention"}
    for name, attr in parts.items():
        setattr(forward, attr, timer(name, getattr(forward, attr)))
    original_lm_head = fwd_module.lm_head
    fwd_module.lm_head = timer("lm_head", original_lm_head)
    try:
        yield
    finally:
        fwd_module.lm_head = original_lm_head
        for attr in parts.values():
            delattr(forward, attr)                 # back to the class's methods


def time_split(model, k: int, reps: int) -> dict[str, float]:
    """Share of one k-token verify step spent in FFN, GDN, attention, lm_head and the rest; for
    steps replayed as CUDA graphs (their layer loop does not run in Python): waiting for the GPU
    (kernels + hand-off copies), the CPU FFN host calls, and the rest (Python, embedding, logits)."""
    state = model.forward.new_state(reps + k + 8, n_ring=k)
    ids = np.arange(1, k + 1, dtype=np.int32) % model.config.n_vocab
    for _ in range(2):                 # scratch sized, kernels warm, the step captured if it can be
        model.forward.forward(state, ids, logits="all", snapshot=True, pick=True)
        state.rollback(1)
    graphs = getattr(model.forward.backend, "graphs", None)
    replayed = graphs is not None and graphs.enabled and graphs.replays > 0
    totals: dict[str, float] = {}
    before = dict(graphs.seconds) if replayed else {}
    wall = 0.0
    with (contextlib.nullcontext() if replayed else _timed_parts(model.forward, totals)):
        for _ in range(reps):
            t0 = time.perf_counter()
            model.forward.forward(state, ids, logits="all", snapshot=True, pick=True)
            wall += time.perf_counter() - t0
            state.rollback(1)
    if replayed:
        totals = {"gpu+copies": graphs.seconds["gpu"] - before["gpu"],
                  "cpu ffn": graphs.seconds["cpu"] - before["cpu"]}
    totals["other"] = max(wall - sum(totals.values()), 0.0)
    return {name: t / wall for name, t in totals.items()}


def measure(model, mode: str, roof_ffn: float, roof_all: float, args) -> tuple[list[Row], dict]:
    def row(test, seconds, tokens, note=""):
        """seconds: per token, or per verify step of `tokens` tokens (whose roofline is one
        token's bytes: the weights are read once for all of them)."""
        return Row(mode, test, seconds, tokens / seconds, 100 * roof_ffn / seconds, 100 * roof_all / seconds, note)

    rows = [row(f"plain tg{args.n_gen}", time_plain(model, args.n_gen, args.reps), 1)]
    graphs = getattr(model.forward.backend, "graphs", None)
    if graphs is not None and graphs.enabled:          # the same decode launching every kernel from Python
        graphs.enabled = False
        rows.append(row(f"no-graphs tg{args.n_gen}", time_plain(model, args.n_gen, args.reps), 1,
                        "--no-cuda-graphs"))
        graphs.enabled = True
    step1 = None
    for k in VERIFY_KS:
        step = time_verify(model, k, args.reps)
        step1 = step1 or step
        rows.append(row(f"verify k={k}", step, k, f"{step / step1:.2f}x the k=1 step"))
    if model.has_mtp:
        for d in DRAFT_DEPTHS:
            s, per_step, ds = time_draft(model, args.n_gen, d, args.reps)
            verify = ds.get("verify_seconds", 0.0)
            busy = verify + ds.get("draft_seconds", 0.0) + ds.get("commit_seconds", 0.0)
            rows.append(row(f"draft d={d} tg{args.n_gen}", s, 1,
                            f"{per_step:.2f} tok/step, verify {100 * verify / max(busy, 1e-12):.0f}% of step"))
    split = time_split(model, max(VERIFY_KS), args.reps)
    return rows, split


# --- the hybrid (GPU) backend --------------------------------------------------------------------

def load_hybrid(path: Path, vram: str, threads: int | None):
    """==== HYBRID (GPU) ROWS ====
    The GPU backend is another engineer's work. When `hybrid.load(path, device="cuda", vram=…)`
    works, the same measurements run on it and its rows join the table; until then this returns
    (None, reason) and the script says it skipped them."""
    import hybrid
    try:
        return hybrid.load(path, device="cuda", threads=threads, n_ctx=4096, vram=vram), None
    except TypeError as e:                       # load() has no vram parameter yet
        return None, f"hybrid.load has no GPU placement yet ({e})"
    except HybridError as e:
        return None, str(e)


# --- output --------------------------------------------------------------------------------------

def print_table(bandwidth: float, threads: int, rows: list[Row], splits: dict[str, dict[str, float]],
                info: dict) -> None:
    print()
    print(f"== {info['model']}: {info['size']}, CPU read bandwidth {bandwidth / 1e9:.1f} GB/s "
          f"({threads} threads) ==")
    print(f"roofline per token: CPU-only {1e3 * info['roof_all_cpu']:.1f} ms (all {info['bytes_all_cpu']}), "
          f"FFN {1e3 * info['roof_ffn_cpu']:.1f} ms (FFN {info['bytes_ffn_cpu']}); "
          f"hybrid @ {info['vram']}: CPU FFN {info['bytes_ffn_hybrid']} → {1e3 * info['roof_ffn_hybrid']:.1f} ms")
    head = f"{'mode':6s} {'test':16s} {'time':>15s} {'t/s':>8s} {'%FFN roof':>9s} {'%all roof':>9s}  note"
    print(head)
    print("-" * len(head))
    for r in rows:
        unit = "s/step" if r.test.startswith("verify") else "s/tok"
        print(f"{r.mode:6s} {r.test:16s} {r.seconds:8.4f} {unit:6s} {r.tokens_per_s:8.2f} "
              f"{r.roofline_ffn_pct:8.0f}% {r.roofline_all_pct:8.0f}%  {r.note}")
    for mode, split in splits.items():
        parts = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(split.items(), key=lambda kv: -kv[1]))
        print(f"time split of a k={max(VERIFY_KS)} verify step ({mode}): {parts}")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", default="12GiB", help="VRAM budget of the hybrid plan (default 12GiB)")
    p.add_argument("--n-gen", type=int, default=8, help="tokens per decode test (default 8)")
    p.add_argument("--reps", type=int, default=2, help="repetitions per test (default 2)")
    p.add_argument("--threads", "-t", type=int, default=None)
    p.add_argument("--bandwidth-bytes", default=None, help="probe buffer (default max(1GiB, 8x LLC))")
    p.add_argument("--json", type=Path, default=None, help="also write every figure to this JSON file")
    p.add_argument("--hybrid-only", action="store_true", help="skip the CPU-only rows")
    args = p.parse_args(argv)

    import hybrid
    from cpu.bandwidth import read_bandwidth
    from hybrid.api import set_threads
    from hybrid.cli import app
    from hybrid.kernel_bench import last_level_cache_bytes

    threads = set_threads(args.threads)
    probe = parse_size(args.bandwidth_bytes) if args.bandwidth_bytes else max(1 << 30, 8 * last_level_cache_bytes())
    bw = read_bandwidth(probe) * 1e9
    print(f"CPU read bandwidth: {bw / 1e9:.1f} GB/s over {format_size(probe)}, {threads} threads", flush=True)

    # the plan as `hybrid info` prints it (standalone_mode=False: errors come back as exceptions)
    app(["info", str(args.model), "--plan", "--vram", args.vram, "--cpu-bandwidth", f"{bw / 1e9:.3f}GB/s"],
        standalone_mode=False)

    model = hybrid.load(args.model, device="cpu", threads=threads, n_ctx=4096)
    model.warmup()
    every_cpu = cpu_plan(model.file)
    hybrid_plan = plan_placement(model.file, parse_size(args.vram), n_ring=HYBRID_RING)
    info = {"model": args.model.name, "size": format_size(args.model.stat().st_size), "vram": args.vram,
            "bytes_all_cpu": format_size(every_cpu.per_token(CPU)),
            "bytes_ffn_cpu": format_size(every_cpu.ffn_per_token(CPU)),
            "bytes_ffn_hybrid": format_size(hybrid_plan.ffn_per_token(CPU)),
            "roof_all_cpu": every_cpu.per_token(CPU) / bw, "roof_ffn_cpu": every_cpu.ffn_per_token(CPU) / bw,
            "roof_ffn_hybrid": hybrid_plan.ffn_per_token(CPU) / bw}
    rows, splits = [], {}
    if not args.hybrid_only:
        print("measuring CPU-only decode…", flush=True)
        rows, splits["cpu"] = measure(model, "cpu", info["roof_ffn_cpu"], info["roof_all_cpu"], args)
    del model

    # ==== HYBRID (GPU) ROWS: filled in by the GPU backend; skipped while it is missing ====
    gpu_model, why = load_hybrid(args.model, args.vram, threads)
    if gpu_model is None:
        print(f"hybrid rows skipped: {why}", flush=True)
    else:
        print("measuring hybrid decode…", flush=True)
        gpu_model.warmup()
        roof = hybrid_plan.ffn_per_token(CPU) / bw
        hybrid_rows, hybrid_split = measure(gpu_model, "hybrid", roof, hybrid_plan.per_token(CPU) / bw, args)
        rows += hybrid_rows
        splits["hybrid"] = hybrid_split

    print_table(bw, threads, rows, splits, info)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"bandwidth": bw, "threads": threads, "info": info,
                                         "rows": [asdict(r) for r in rows], "splits": splits,
                                         "hybrid_skipped": why}, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except HybridError as e:
        sys.exit(f"error: {e}")
