#!/usr/bin/env python3
"""Plain decode and a k-token verify step of two source trees of hybrid, alternating, in one call:
the speed check of a behaviour-preserving change (issue 30: new within 3 % of old).

    python3 tools/device/old_new.py --old .old MODEL.gguf [MODEL2.gguf] [--vram 12GiB] [--rounds 3]
                                    [--tokens 32] [--k 4] [--device cuda|cpu] [--json OUT.json]

--old is a tree holding hybrid/, cpu/, gpu/ and tools/device/bench_27b.py of the old commit (e.g.
`git archive b00af78 hybrid cpu gpu tools | tar x -C .old`); --new defaults to this checkout.
Each tree gets one worker process per model, which loads the model once (both stay loaded, so the
second never waits on the first's page cache) and measures on request: tokens/s of greedy
one-token decode (hybrid.bench.bench_generate) and the median seconds of one k-token verify
forward (bench_27b.time_verify). Rounds alternate which tree goes first; the table shows each
tree's best round and the speed ratio new : old (≥ 1: new is faster).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))        # vs_llama_cpp, beside this file

from vs_llama_cpp import JsonWorker  # noqa: E402

# Runs inside a worker, with the tree under test first on sys.path: only APIs both trees have.
WORKER = r"""
import json, sys, time
sys.path.insert(0, sys.argv[1] + "/tools/device")
import hybrid
from hybrid.bench import bench_generate
from bench_27b import time_verify
spec = json.loads(sys.argv[2])
t0 = time.time()
model = hybrid.load(spec["path"], device=spec["device"], vram=spec["vram"])
bench_generate(model, 4, 1); time_verify(model, spec["k"], 2)          # compile, size, capture
print(json.dumps({"ready": time.time() - t0}), flush=True)
for line in sys.stdin:
    if line.strip() != "rep":
        break
    tps = bench_generate(model, spec["tokens"], 1).mean                  # tokens/s
    verify = time_verify(model, spec["k"], 5)
    print(json.dumps({"tps": tps, "verify_s": verify}), flush=True)
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="+")
    p.add_argument("--old", type=Path, required=True)
    p.add_argument("--new", type=Path, default=ROOT)
    p.add_argument("--device", default="cuda")
    p.add_argument("--vram", default="12GiB")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--timeout", type=float, default=400, help="seconds for a worker to load and warm up")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    trees = {"old": args.old.resolve(), "new": args.new.resolve()}
    results = []
    for path in args.models:
        spec = {"path": str(Path(path).resolve()), "device": args.device,
                "vram": args.vram if args.device != "cpu" else None, "tokens": args.tokens, "k": args.k}
        workers = {}
        for name, tree in trees.items():
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")]))
            workers[name] = JsonWorker([sys.executable, "-c", WORKER, str(tree), json.dumps(spec)], args.timeout,
                                       env=env, cwd=tree)
            print(f"[{Path(path).name}] {name}: loaded and warm in {workers[name].ready['ready']:.0f} s",
                  file=sys.stderr, flush=True)
        samples = {name: [] for name in trees}
        for r in range(args.rounds):
            for name in (("old", "new") if r % 2 == 0 else ("new", "old")):
                samples[name].append(workers[name].rep(args.timeout))
                print(f"[{Path(path).name}] round {r + 1} {name}: {samples[name][-1]}", file=sys.stderr, flush=True)
        for w in workers.values():
            w.close()
        best = {name: {"tps": max(s["tps"] for s in rows), "verify_s": min(s["verify_s"] for s in rows)}
                for name, rows in samples.items()}
        results.append({"model": path, "samples": samples, "best": best})
        print(f"{Path(path).name} ({args.device}{', ' + args.vram if args.device != 'cpu' else ''}): "
              f"plain decode old {best['old']['tps']:.2f} / new {best['new']['tps']:.2f} t/s "
              f"(new/old {best['new']['tps'] / best['old']['tps']:.3f}); "
              f"k={args.k} verify old {best['old']['verify_s'] * 1e3:.1f} / new {best['new']['verify_s'] * 1e3:.1f} ms "
              f"(old/new {best['old']['verify_s'] / best['new']['verify_s']:.3f})", flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
