#!/usr/bin/env python3
"""MoE hybrid decode at several PCIe shares, in one process, against the routed-expert roofline.

    python3 tools/device/moe_pcie_sweep.py MODEL.gguf [--vram 12GiB] [--shares 0,0.25,0.5,0.75]
        [--rounds 3] [--steps 32] [--draft 1,2]

On the GPU machine: the model loads once with its host experts mapped for the device; each
round runs every share in turn (`ExpertCache.set_pcie_share` rewrites the routing's table in
place, so the captured steps stay), `steps` greedy one-token steps each, every step fed the token
the last one picked (a fixed token would route to the same experts, which then sit in the L3).
The CPU's read bandwidth is probed before and after; a step is reported as a fraction of the
routed roofline: every routed expert byte a token selects, read at the probe's rate (issue 7).
With --draft D[,D…] it then times drafting steps at each depth D and share, and
models tokens/s at the reference acceptance (1.92 tokens per depth-1 step: the synthetic model's
own drafts are never accepted).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

REFERENCE_TOKENS_PER_STEP = {1: 1.92, 2: 2.69, 3: 3.19}     # acceptance 0.92 / 0.84 / 0.65


def caches(model):
    w = model.forward.weights
    blocks = (*w.layers, *((w.mtp.block,) if w.mtp else ()))
    return [b.ffn.cache for b in blocks if getattr(b.ffn, "cache", None) is not None]


def set_share(model, share: float) -> None:
    for cache in caches(model):
        cache.set_pcie_share(share)


def plain_ms(model, state, tok, steps: int) -> float:
    fw = model.forward
    for _ in range(2):                                   # the new table's first steps
        tok[0] = fw.forward(state, tok, logits="last", pick=True)[0].ids[-1]
    t0 = time.perf_counter()
    for _ in range(steps):
        tok[0] = fw.forward(state, tok, logits="last", pick=True)[0].ids[-1]
    return 1e3 * (time.perf_counter() - t0) / steps


def drafting_ms(model, depth: int, steps: int) -> float:
    """ms per drafting step at `depth`, measured on the third run of one prompt (the first two
    capture every step)."""
    from hybrid.bench import BENCH_PROMPT
    from hybrid.events import Done
    result = 0.0
    for _ in range(3):
        for ev in model.generate(BENCH_PROMPT, max_tokens=steps * (depth + 1), temperature=0, draft=depth,
                                 ignore_eos=True):
            if isinstance(ev, Done):
                result = 1e3 * ev.stats.decode_seconds / max(ev.stats.draft["steps"], 1)
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--vram", default="12GiB")
    p.add_argument("--shares", default="0,0.25,0.5,0.75")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--draft", default="1", help="drafting depths to time, comma-separated (0: none)")
    p.add_argument("--no-expert-cache", action="store_true")
    args = p.parse_args(argv)
    shares = [float(s) for s in args.shares.split(",")]

    import hybrid
    from cpu.bandwidth import read_bandwidth
    probe_before = read_bandwidth(1 << 30)
    t0 = time.perf_counter()
    model = hybrid.load(args.model, device="cuda", vram=args.vram, expert_cache=not args.no_expert_cache,
                        pcie_share=max(shares))
    c = model.config
    mapped = caches(model)
    if not c.is_moe or not mapped or mapped[0].mapped is None:
        print(f"nothing to sweep: {'not a MoE model' if not c.is_moe else mapped[0].pcie if mapped else 'no GPU experts'}")
        return 1
    loaded = time.perf_counter() - t0
    model.warmup()
    w = model.forward.weights
    routed = sum(layer.ffn.n_used * layer.ffn.expert_bytes for layer in w.layers)   # bytes per token
    print(f"{args.model.name}: {c.n_layer} layers, {c.n_expert} experts (top {c.n_expert_used}); hybrid @ "
          f"{args.vram}, {mapped[0].n_slots} experts cached per layer; routed bytes per token "
          f"{routed / 1e6:.1f} MB; loaded in {loaded:.1f} s (host experts {mapped[0].pcie})")

    fw = model.forward
    state = fw.new_state(args.rounds * len(shares) * (args.steps + 2) + 64)
    fw.forward(state, np.arange(1, 5, dtype=np.int32) % c.n_vocab, logits="last")
    tok = np.array([5], np.int32)
    for share in shares:                                  # capture every step once
        set_share(model, share)
        plain_ms(model, state, tok, 2)
    times: dict[float, list[float]] = {s: [] for s in shares}
    for _ in range(args.rounds):
        for share in shares:
            set_share(model, share)
            times[share].append(plain_ms(model, state, tok, args.steps))
    probe_after = read_bandwidth(1 << 30)
    probe = statistics.mean((probe_before, probe_after))
    roofline_ms = 1e3 * routed / (probe * 1e9)
    print(f"CPU read probe {probe_before:.1f} / {probe_after:.1f} GB/s (before / after): routed roofline "
          f"{roofline_ms:.2f} ms per token")
    print(f"{'share':>6}  {'ms per step, by round':>28}  {'best':>7}  {'% roofline':>10}  {'vs share ' + str(shares[0]):>12}")
    base = min(times[shares[0]])
    for share in shares:
        best = min(times[share])
        print(f"{share:6.2f}  {' '.join(f'{t:8.2f}' for t in times[share]):>28}  {best:7.2f}  "
              f"{100 * roofline_ms / best:9.0f}%  {base / best:11.2f}x")

    depths = [d for d in (int(v) for v in args.draft.split(",")) if d > 0] if model.has_mtp else []
    for depth in depths:
        ref = REFERENCE_TOKENS_PER_STEP.get(depth)
        for share in shares:
            set_share(model, share)
            step = drafting_ms(model, depth, args.steps)
            plain = min(times[share])
            line = f"drafting depth {depth} at share {share:.2f}: {step:.2f} ms per step"
            if ref:
                line += (f"; at the reference {ref} tokens per step {ref * 1e3 / step:.1f} t/s, "
                         f"{ref * plain / step:.2f}x plain ({1e3 / plain:.1f} t/s)")
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
