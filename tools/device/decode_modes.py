"""Greedy decode of one model on the CPU path and the hybrid (GPU) path, with and without MTP
drafting: tokens/s per mode and whether drafting changed any token (it must not).

    python3 tools/device/decode_modes.py [MODEL] [--tokens 64]
"""
from __future__ import annotations

import argparse
import time

import hybrid
from hybrid.bench import BENCH_PROMPT
from hybrid.events import Done, Token


def run(model, depth, n):
    tokens, stats = [], None
    t0 = time.perf_counter()
    for ev in model.generate(BENCH_PROMPT, max_tokens=n, temperature=0, draft=depth, ignore_eos=True):
        if isinstance(ev, Token):
            tokens.append(ev.id)
        elif isinstance(ev, Done):
            stats = ev.stats
    return tokens, stats, time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tokens", type=int, default=64)
    args = p.parse_args()
    print(f"{'device':7} {'draft':>5} {'decode t/s':>10} {'tok/step':>8} {'accept':>6}  same as draft 0")
    for device in ("cpu", "cuda"):
        model = hybrid.load(args.model, device=device)
        model.warmup()
        base = None
        for depth in (0, 1, 2, 3):
            run(model, depth, 8)                                   # compile this depth's shapes
            tokens, stats, _ = run(model, depth, args.tokens)
            base = tokens if base is None else base
            d = stats.draft or {}
            print(f"{model.device:7} {depth:>5} {stats.decode_tps:>10.1f} {d.get('tokens_per_step', 1.0):>8.2f} "
                  f"{d.get('acceptance', 0.0):>6.2f}  {'yes' if tokens == base else 'NO'}")


if __name__ == "__main__":
    main()
