#!/usr/bin/env python3
"""Where a drafting step's host time goes: cProfile of the draft, the verify call and the commit
of warm drafting steps, each part in a run of its own (MoE hybrid @ 12 GiB, PCIe share 0.375).

    python3 tools/device/draft_profile.py MODEL.gguf [--depth 1] [--tokens 64] [--device cuda]

First the step's split from the engine's own counters (DraftStats, unprofiled), then per part
the functions with the most time of their own: driver calls, Python around them, the CPU
expert kernel. moe_split.py splits the same step by timers instead.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def profiled(prof: cProfile.Profile, f, when):
    """f with the profiler on during the calls when(*args, **kw) picks."""
    def g(*a, **kw):
        if not when(*a, **kw):
            return f(*a, **kw)
        prof.enable()
        try:
            return f(*a, **kw)
        finally:
            prof.disable()
    return g


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--depth", type=int, default=1)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--device", default="cuda", help="cuda, or cpu (the same profile of the CPU engine)")
    args = p.parse_args(argv)
    import hybrid
    import hybrid.speculative as spec
    from hybrid.bench import BENCH_PROMPT
    from hybrid.events import Done
    from hybrid.state import SessionState
    model = hybrid.load(args.model, device=args.device, vram="12GiB", pcie_share=0.375)
    model.warmup()

    def run():
        for ev in model.generate(BENCH_PROMPT, max_tokens=args.tokens, temperature=0, draft=args.depth,
                                 ignore_eos=True):
            if isinstance(ev, Done):
                return ev.stats
    for _ in range(3):                   # the first two capture every step
        stats = run()
    d, steps = stats.draft, max(stats.draft["steps"], 1)
    print(f"depth {args.depth}: {1e3 * stats.decode_seconds / steps:.2f} ms per step; draft "
          f"{1e3 * d['draft_seconds'] / steps:.3f}, verify {1e3 * d['verify_seconds'] / steps:.3f}, commit "
          f"{1e3 * d['commit_seconds'] / steps:.3f} ms per step")

    always = lambda *a, **kw: True       # noqa: E731
    parts = {"draft": (spec, "draft_tokens", always),
             "verify": (model.forward, "forward", lambda *a, **kw: kw.get("snapshot", False)),
             "commit": (SessionState, "rollback", always)}
    for part, (owner, name, when) in parts.items():
        prof, real = cProfile.Profile(), getattr(owner, name)
        setattr(owner, name, profiled(prof, real, when))
        try:
            stats = run()
        finally:
            setattr(owner, name, real)
        print(f"== {part}, {stats.draft['steps']} steps")
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
