#!/usr/bin/env python3
"""Simulate `--draft auto` against fixed depths: the depth controller (hybrid/draft_depth.py) driven
by scripted step costs and acceptance, as the benchmarks drive it (runs of one text, the controller
carried from run to run after two short warm-up runs), and auto ÷ the best fixed depth per scenario.
A machine's run-to-run noise hides differences of a few percent between controllers; this shows
them in seconds, for the shapes the benchmarks measured.

    python3 tools/depth_sim.py [--against REV ...] [--seeds 24] [--scenario NAME ...] [--fresh]

--against: also simulate the controller as it was at a git revision (e.g. HEAD). Each cell is
the mean ÷ the worst over seeds of auto's median run ÷ the best fixed depth's median run.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path
from statistics import median

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU = (0.511, 0.885, 1.219, 1.537, 1.855)     # bundled model, H200: ms per step at depth 0..4
CPU = (1.145, 1.94, 2.684, 3.419, 4.155)      # bundled model, dev box CPU
BIG = (70.0, 80.0, 95.0, 115.0, 157.0)        # a 27B at 12 GiB: verify k rows ≈ 1.14 / 1.36 / 1.64 / 2.25 steps
MOE = (8.4, 12.0, 15.0, 18.0, 21.0)           # the 35B-A3B at 12 GiB (its steps spread 8-21 ms on a noisy box)
OPENING = (0.7, 0.4, 0.4, 0.3)                # a text's first steps: deeper drafts miss more

# name: (costs, acceptance a_1..a_4 after the opening, opening steps, tokens a run[, noise])
SCENARIOS = {
    "gpu-text": (GPU, (0.9, 0.89, 0.8, 0.6), 8, 128),
    "gpu-flat": (GPU, (0.9, 0.89, 0.8, 0.6), 0, 128),
    "cpu-text": (CPU, (0.9, 0.89, 0.8, 0.6), 8, 128),
    "gpu-high": (GPU, (0.98, 0.96, 0.9, 0.72), 8, 128),
    "gpu-low": (GPU, (0.9, 0.5, 0.4, 0.3), 0, 128),
    "gpu-dies": (GPU, (0.2, 0.2, 0.2, 0.2), 0, 128),
    "big-dies": (BIG, (0.0, 0.0, 0.0, 0.0), 0, 32),
    "big-good": (BIG, (0.92, 0.84, 0.65, 0.5), 8, 32),
    "moe-dies": (MOE, (0.0, 0.0, 0.0, 0.0), 0, 32, 0.3),
}
NOISE = 0.03            # relative noise of a step's time (lognormal: a step is never faster than
                        # its depth's cost by more than the noise allows, and now and then far slower)
# What a change of depth adds, as a share of a depth-1 step: between drafting depths ~1.5% (the
# first step at the new depth, H200 and dev box, docs/MEASUREMENTS.md 2026-11-29 stop 53); away
# from depth 0 the MTP call also runs the rows plain steps left waiting (up to 7: ~0.3 of a step)
CHANGE, CATCH_UP = 0.015, 0.3


def controller_class(source: str):
    module = types.ModuleType("draft_depth_sim")
    exec(compile(source, "draft_depth", "exec"), module.__dict__)
    return module.DepthController


def run(controller, depth: int | None, scenario, rng) -> float:
    """One run of a scenario's text: tokens per simulated second."""
    costs, accept, opening, tokens = scenario[:4]
    noise = scenario[4] if len(scenario) > 4 else NOISE
    seconds, made, steps, previous = 0.0, 0, 0, None
    while made < tokens:
        d = controller.choose() if controller else depth
        a = OPENING if steps < opening else accept
        kept = 0
        while kept < d and rng.random() < a[kept]:
            kept += 1
        changed = previous is not None and d != previous
        caught_up = changed and previous == 0          # the engine's rule: such a step is not steady
        s = costs[d] * rng.lognormal(0.0, noise) + costs[1] * (CHANGE * changed + CATCH_UP * caught_up)
        if controller:
            controller.record(d, kept, s, steady=previous is not None and not caught_up)
        seconds += s
        made += kept + 1
        steps += 1
        previous = d
    return made / seconds


def auto_over_best(classes: dict, scenario, seeds: int, rounds: int = 5, fresh: bool = False) -> dict[str, list[float]]:
    """Per controller class, per seed: auto's median run ÷ the best fixed depth's. fresh: each of
    auto's runs with a new controller and no warm-up (a `hybrid decode` with no record of an
    earlier process, hybrid/draft_memory.py), else one controller warmed by two 16-token runs and
    carried through the rounds (a benchmark, a server, or one-shot runs resuming the record)."""
    out = {name: [] for name in classes}
    warm = (*scenario[:3], 16, *scenario[4:])
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        best = max(median(run(None, d, scenario, rng) for _ in range(rounds)) for d in range(5))
        for name, cls in classes.items():
            c = cls(4)
            for _ in range(0 if fresh else 2):
                run(c, None, warm, rng)
            out[name].append(median(run(cls(4) if fresh else c, None, scenario, rng) for _ in range(rounds)) / best)
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--against", action="append", default=[], metavar="REV", help="a git revision's controller too")
    p.add_argument("--seeds", type=int, default=24)
    p.add_argument("--scenario", action="append", choices=sorted(SCENARIOS), help="default: all")
    p.add_argument("--fresh", action="store_true", help="every auto run with a new controller, no warm-up")
    args = p.parse_args(argv)
    classes = {"working tree": controller_class((ROOT / "hybrid/draft_depth.py").read_text())}
    for rev in args.against:
        source = subprocess.run(["git", "show", f"{rev}:hybrid/draft_depth.py"], cwd=ROOT, check=True,
                                capture_output=True, text=True).stdout
        classes[rev] = controller_class(source)
    print(f"{'scenario':10}" + "".join(f"{name:>16}" for name in classes) + "   (mean / worst of auto ÷ best fixed)")
    for name in args.scenario or SCENARIOS:
        ratios = auto_over_best(classes, SCENARIOS[name], args.seeds, fresh=args.fresh)
        print(f"{name:10}" + "".join(f"{np.mean(v):>10.3f} / {min(v):.2f}" for v in ratios.values()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
