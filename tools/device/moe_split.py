#!/usr/bin/env python3
"""Where the time of a MoE model's CPU hand-offs and drafting steps goes.

    python3 tools/device/moe_split.py MODEL.gguf [--steps 8] [--vram 12GiB] [--draft 1]
    python3 tools/device/moe_split.py MODEL.gguf --cpu-only      # no GPU: the CPU path's MoE calls

On the GPU machine (hybrid placement: routed experts in host memory, one hand-off per MoE layer
per step) it prints, per hand-off of a plain decode step: the time the host waited for the GPU
(the layer's kernels up to the routing, which writes the hand-off's inputs to mapped host
memory), the routing, the MoE counters, the fused expert kernel split into its steps, Python,
and the graph launches. With --draft D it then splits a drafting step (MTP draft, verify,
accept, rollback) the same way and says whether any step was captured anew or ran eagerly
while measured (issue 7: a draft step cost ~15 ms more than its verify step).

How: every piece is wrapped by a timer that records its exclusive time (its own time minus
that of the wrapped pieces it called), keyed by the phase it ran in (decode, draft, verify…).
Graph replays are re-run by a copy of StepGraph.replay that times each segment. The expert
kernel's steps are timed afterwards on the hand-offs' own inputs (`stages` cuts the kernel
after a step). Nothing of the engine is changed; the wrappers cost ~1 µs per call.

A small synthetic MoE for --cpu-only:
    python tools/make_model.py /tmp/moe.gguf --arch qwen35moe --preset small --layers 4 --vocab 8192
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from hybrid.placement import DEFAULT_PCIE_SHARE  # noqa: E402

perf = time.perf_counter


class Profile:
    """Exclusive time per (phase, label): a phase is the outermost wrapped call running."""

    def __init__(self):
        self.stack: list[tuple[str, list[float]]] = []
        self.excl: dict[tuple[str, str], float] = defaultdict(float)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.phase_total: dict[str, float] = defaultdict(float)
        self.phase_calls: dict[str, int] = defaultdict(int)
        self.on = False

    def wrap(self, label, fn, pick=None):
        """fn timed under `label` (or under pick(*args, **kw) when given)."""
        def timed(*a, **kw):
            if not self.on:
                return fn(*a, **kw)
            name = pick(*a, **kw) if pick else label
            frame = [perf(), 0.0]
            self.stack.append((name, frame))
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                total = perf() - frame[0]
                phase = self.stack[0][0] if self.stack else name
                self.excl[(phase, name)] += total - frame[1]
                self.calls[(phase, name)] += 1
                if self.stack:
                    self.stack[-1][1][1] += total
                else:
                    self.phase_total[name] += total
                    self.phase_calls[name] += 1
        return timed

    def reset(self):
        self.__init__()

    def labels(self, phase):
        return sorted(((label, t, self.calls[(p, label)]) for (p, label), t in self.excl.items() if p == phase),
                      key=lambda r: -r[1])


GPU_PAIRS = [0, 0]       # (row, rank) pairs the GPU ran (cached or over PCIe), of all pairs split


def patch(obj, name, wrapper):
    setattr(obj, name, wrapper(getattr(obj, name)))


def instrument(prof: Profile, gpu: bool, samples: list):
    """Wrap the engine's pieces with the profiler's timers."""
    import cpu.moe
    import cpu.moe_kernel
    import cpu.ops
    import hybrid.speculative as spec
    from hybrid.forward import Forward, MoEStats
    from hybrid.mtp import MTPHead
    from hybrid.state import SessionState

    def forward_kind(self, state, token_ids, logits="last", snapshot=False, **_):
        return "verify" if snapshot else ("decode" if len(token_ids) == 1 else "prefill")

    patch(Forward, "forward", lambda f: prof.wrap("forward", f, pick=forward_kind))
    patch(MTPHead, "forward", lambda f: prof.wrap("MTP call (rest)", f))
    patch(spec, "draft_tokens", lambda f: prof.wrap("draft", f))
    patch(spec, "accept_drafts", lambda f: prof.wrap("accept", f))
    patch(spec, "accept_greedy", lambda f: prof.wrap("accept", f))
    patch(SessionState, "rollback", lambda f: prof.wrap("rollback", f))
    patch(MoEStats, "add", lambda f: prof.wrap("MoE counters", f))
    patch(cpu.moe, "route", lambda f: prof.wrap("routing", f))

    def sample(arguments):
        """Keep a kernel call's arguments (`_routed_experts`'), to time its steps apart: copies of
        its inputs and output (x, experts, weights, out), the weights and scratch as they are."""
        if prof.on and len(samples) < 64:
            samples.append(arguments[:6] + tuple(np.copy(v) for v in arguments[6:10]) + arguments[10:])

    def sampled(f):                     # eager hand-offs and the CPU backend
        def kernel(*a, stages=len(cpu.moe_kernel.STAGES)):
            sample(cpu.moe_kernel._arguments(*a, stages))
            return f(*a, stages=stages)
        return prof.wrap("expert kernel", kernel)

    def bound(f):                       # replayed hand-offs
        def kernel(self):
            sample(self.args)
            return f(self)
        return prof.wrap("expert kernel", kernel)
    patch(cpu.moe, "routed_experts", sampled)
    patch(cpu.moe_kernel.BoundCall, "__call__", bound)
    patch(cpu.moe, "run_routed", lambda f: prof.wrap("hand-off python", f))
    patch(cpu.moe, "router_logits", lambda f: prof.wrap("router (cpu)", f))
    patch(cpu.ops, "moe_ffn", lambda f: prof.wrap("hand-off (cpu moe_ffn)", f))
    if not gpu:
        return
    import gpu.moe
    import gpu.runtime.graphs as graphs
    import gpu.runtime.memory as memory

    def count_gpu_pairs(experts):        # over the sampled calls: the pairs marked ~e ran on the GPU
        if prof.on and len(samples) < 64:
            GPU_PAIRS[0] += int((experts < 0).sum())
            GPU_PAIRS[1] += experts.size

    def counted(f):
        def run_routed(ffn, x, experts, weights, out, stats=None):
            count_gpu_pairs(experts)
            return f(ffn, x, experts, weights, out, stats)
        return run_routed

    def counted_bound(f):
        def bind_routed(ffn, x, experts, weights, out, stats=None):
            call = prof.wrap("hand-off python", f(ffn, x, experts, weights, out, stats))

            def replayed():
                count_gpu_pairs(experts)
                call()
            return replayed
        return bind_routed
    patch(gpu.moe, "run_routed", counted)
    patch(gpu.moe, "bind_routed", counted_bound)
    patch(gpu.moe, "router_logits", lambda f: prof.wrap("router (cpu)", f))
    patch(memory, "synchronize", lambda f: prof.wrap("GPU wait", f))
    patch(memory, "to_host", lambda f: prof.wrap("to host", f))
    patch(memory, "upload", lambda f: prof.wrap("upload", f))
    patch(memory, "copy", lambda f: prof.wrap("copy (python)", f))
    patch(memory, "host_call", lambda f: prof.wrap("hand-off (eager)", f))
    patch(memory, "wait_for", lambda f: prof.wrap("GPU wait", f))
    patch(graphs, "launch", lambda f: prof.wrap("graph launch", f))


# --- the runs ---------------------------------------------------------------------------------------

def plain_steps(model, prof: Profile, steps: int) -> float:
    """`steps` one-token greedy decode steps after three warm-up steps (eager, captured,
    replayed), each fed the token the last one picked (on the device), as decoding does: the
    same token every step would route to the same experts, which then stay in the CPU's L3."""
    fw = model.forward
    state = fw.new_state(steps + 16)
    fw.forward(state, np.arange(1, 5, dtype=np.int32) % model.config.n_vocab, logits="last")
    tok = np.array([5], np.int32)

    def step():
        picks, _ = fw.forward(state, tok, logits="last", pick=True)
        tok[0] = picks.ids[-1]
    for _ in range(3):
        step()
    prof.reset()
    prof.on = True
    t0 = perf()
    for _ in range(steps):
        step()
    prof.on = False
    return (perf() - t0) / steps


def drafting_steps(model, prof: Profile, steps: int, depth: int):
    """Greedy drafting at `depth` for `steps` steps, measured on the third run of the same prompt
    (the first two capture every step's graphs). Returns (seconds per step, steps, draft stats)."""
    from hybrid.bench import BENCH_PROMPT
    from hybrid.events import Done

    def run(measure):
        prof.reset()
        prof.on = measure
        stats, n_steps = None, 0
        for ev in model.generate(BENCH_PROMPT, max_tokens=steps * (depth + 1), temperature=0, draft=depth,
                                 ignore_eos=True):
            if isinstance(ev, Done):
                stats = ev.stats
        prof.on = False
        return stats
    run(False)
    run(False)
    graphs = getattr(model.forward.backend, "graphs", None)
    before = (graphs.captures, graphs.replays) if graphs else (0, 0)
    stats = run(True)
    after = (graphs.captures, graphs.replays, sorted(map(str, graphs._eager))) if graphs else (0, 0, [])
    n_steps = max(prof.phase_calls["draft"], 1)
    loop = stats.decode_seconds - sum(prof.phase_total[p] for p in ("draft", "verify", "accept", "rollback"))
    return n_steps, stats, loop, (after[0] - before[0], after[1] - before[1], after[2])


# --- apart: kernel steps, parallel regions ----------------------------------------------------

def kernel_stages(samples: list, reps: int = 5) -> tuple[list[float], float] | None:
    """Mean µs of each of the expert kernel's steps over the sampled calls, and of the whole call."""
    from cpu.moe_kernel import STAGES, _routed_experts
    if not samples:
        return None
    per_stage, whole = np.zeros(len(STAGES)), 0.0
    for args in samples:
        cum = []
        for stages in range(1, len(STAGES) + 1):
            times = []
            for _ in range(reps):
                t0 = perf()
                _routed_experts(*args[:-1], stages - 1)     # the last argument: the last step run
                times.append(perf() - t0)
            cum.append(min(times))          # the least disturbed run: differences stay meaningful
        per_stage += np.diff([0.0, *cum])
        whole += cum[-1]
    return list(1e6 * per_stage / len(samples)), 1e6 * whole / len(samples)


def region_cost(reps: int = 2000) -> tuple[float, float]:
    """µs of one empty Numba call, and of one empty parallel region on all threads."""
    import numba
    from numba import njit, prange

    @njit(nogil=True)
    def serial(a):
        a[0] += 1.0

    @njit(nogil=True, parallel=True)
    def region(a):
        for i in prange(a.shape[0]):
            a[i] += 1.0
    a = np.zeros(4 * numba.get_num_threads())
    out = []
    for fn in (serial, region):
        fn(a)
        t0 = perf()
        for _ in range(reps):
            fn(a)
        out.append(1e6 * (perf() - t0) / reps)
    return out[0], out[1]


# --- report --------------------------------------------------------------------------------------

HAND_OFF_PARTS = ("GPU wait", "routing", "MoE counters", "expert kernel", "hand-off python", "router (cpu)",
                  "hand-off (cpu moe_ffn)", "hand-off (eager)", "graph launch")


def print_phase(prof: Profile, phase: str, per: int, unit: str = "ms") -> None:
    scale = 1e3 if unit == "ms" else 1e6
    total = prof.phase_total[phase]
    print(f"  {phase:8s} {scale * total / per:8.2f} {unit}  ({prof.phase_calls[phase] / per:.1f} calls)")
    for label, t, calls in prof.labels(phase):
        if label == phase:
            label = "rest (unsplit ops, python)"
        print(f"      {label:26s} {scale * t / per:8.3f} {unit}  {calls / per:6.1f} calls  "
              f"{1e6 * t / max(calls, 1):8.1f} µs/call")


def print_hand_offs(prof: Profile, phase: str, hand_offs: int, stages, regions) -> None:
    if not hand_offs:
        print("  no MoE hand-offs ran (no MoE layer with host experts?)")
        return
    rows = {label: t for label, t, _ in prof.labels(phase)}
    print(f"  per hand-off ({hand_offs} measured), µs:")
    for label in HAND_OFF_PARTS:
        if label in rows:
            print(f"      {label:24s} {1e6 * rows[label] / hand_offs:8.1f}")
    if stages:
        from cpu.moe_kernel import STAGES
        per_stage, whole = stages
        kernel = 1e6 * rows.get("expert kernel", 0.0) / hand_offs
        print(f"      expert kernel, timed apart on the same inputs: {whole:.1f} µs = "
              + ", ".join(f"{n} {t:.1f}" for n, t in zip(STAGES, per_stage)))
        print(f"        (in the run: {kernel:.1f} µs; the call's Python (layout, workspace, dispatch) is part "
              f"of the first step; an empty Numba call costs {regions[0]:.1f} µs, an empty parallel region "
              f"{regions[1]:.1f} µs: A and B share one region)")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--steps", type=int, default=8, help="measured steps per mode")
    p.add_argument("--vram", default="12GiB", help="GPU budget of the placement plan")
    p.add_argument("--draft", type=int, default=1, help="drafting depth to split (0: skip drafting)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cpu-only", action="store_true", help="no GPU: the CPU backend's MoE calls")
    p.add_argument("--no-expert-cache", action="store_true",
                   help="no GPU expert cache in the leftover VRAM")
    p.add_argument("--pcie-share", type=float, default=DEFAULT_PCIE_SHARE,
                   help="of each token's uncached experts, the share the GPU reads over PCIe (0: none)")
    args = p.parse_args(argv)

    import hybrid
    gpu = not args.cpu_only
    model = hybrid.load(args.model, device="cpu" if args.cpu_only else "cuda", vram=None if args.cpu_only else args.vram,
                        threads=args.threads, cpu_only=args.cpu_only, expert_cache=not args.no_expert_cache,
                        pcie_share=args.pcie_share)
    c = model.config
    if not c.is_moe:
        print(f"{args.model} is not a MoE model ({c.arch}); nothing to split")
        return 1
    model.warmup()
    prof, samples = Profile(), []
    instrument(prof, gpu, samples)
    import numba
    print(f"{args.model.name}: {c.n_layer} layers, {c.n_expert} experts (top {c.n_expert_used}), D {c.n_embd}; "
          f"{'CPU only' if args.cpu_only else 'hybrid @ ' + args.vram}; {numba.get_num_threads()} CPU threads "
          f"({numba.threading_layer()})")

    step = plain_steps(model, prof, args.steps)
    hand_offs = prof.calls[("decode", "hand-off python")]
    regions = region_cost()
    stages = kernel_stages(samples)
    print(f"\nplain decode: {1e3 * step:.2f} ms per step, {hand_offs / args.steps:.0f} hand-offs per step")
    slots = model.plan.expert_cache
    if gpu:
        share = GPU_PAIRS[0] / max(GPU_PAIRS[1], 1)
        cached = (f"{next(iter(slots.values()))} of {c.n_expert} experts cached in each of {len(slots)} layers "
                  f"({model.plan.vram.get('expert_cache', 0) / 2**30:.2f} GiB)" if slots else "no expert cache")
        print(f"  GPU experts: {cached}, PCIe share {args.pcie_share}; the GPU ran {share:.1%} of the selected "
              f"(row, expert) pairs")
    print_phase(prof, "decode", args.steps)
    print_hand_offs(prof, "decode", hand_offs, stages, regions)

    if args.draft > 0 and model.has_mtp:
        n_steps, stats, loop, graph_counts = drafting_steps(model, prof, args.steps, args.draft)
        d = stats.draft
        print(f"\ndrafting at depth {args.draft}: {n_steps} steps, {1e3 * stats.decode_seconds / n_steps:.2f} ms per "
              f"step, {d['tokens_per_step']:.2f} tokens per step, acceptance {d['acceptance']:.2f}")
        captures, replays, eager = graph_counts
        if gpu:
            print(f"  while measured: {captures} graph captures, {replays} replays; steps kept eager: "
                  f"{', '.join(eager) if eager else 'none'}")
        for phase in ("draft", "verify", "accept", "rollback"):
            print_phase(prof, phase, n_steps)
        print(f"  loop rest {1e3 * loop / n_steps:8.2f} ms  (sampling, stop checks, events between the phases)")
        mtp_hand_offs = prof.calls[("draft", "hand-off python")]
        print(f"  MTP hand-offs per step: {mtp_hand_offs / n_steps:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
