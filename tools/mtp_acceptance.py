#!/usr/bin/env python
"""MTP draft acceptance on greedy code continuations, per draft depth, vs the model README.

    python tools/mtp_acceptance.py [MODEL.gguf] [--tokens 64] [--depths 1,2,3] [--threads 1]

For each depth, every prompt is continued greedily with drafting on; the draft counters of
all prompts are summed. Acceptance = kept drafts / offered drafts; tokens per verify pass =
emitted tokens / verify passes. Each continuation is also checked against plain greedy
decoding (it must be identical). A benchmark, not a test: the numbers depend on the prompts
and on how soon this small model starts repeating itself.
"""
from __future__ import annotations

import argparse
import sys

import hybrid
from hybrid.events import Done, Token

# The model README: "acceptance ≈ 0.90 at draft depth 1 (1.9 tokens per verify pass), ≈ 0.81
# at depth 2 (2.6), ≈ 0.73 at depth 3 (3.2)".
README = {1: (0.90, 1.9), 2: (0.81, 2.6), 3: (0.73, 3.2)}

PROMPTS = [
    "import os\nimport sys\nimport json\nfrom pathlib import Path\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "def read_config(path):\n    with open(path) as f:\n",
    "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(description=",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n\n    def __repr__(self):\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n",
    "from typing import List, Optional\n\n\ndef find_index(items: List[int], target: int) -> Optional[int]:\n",
    "import numpy as np\n\n\ndef normalize(x):\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
]


def continuation(model, prompt: str, tokens: int, draft: int):
    ids, done = [], None
    for event in model.generate(prompt, max_tokens=tokens, temperature=0.0, draft=draft):
        if isinstance(event, Token):
            ids.append(event.id)
        elif isinstance(event, Done):
            done = event
    return ids, done.stats


def measure(model, depth: int, tokens: int, plain: list[list[int]]) -> dict:
    steps = drafted = accepted = emitted = 0
    offered_at, kept_at = [0] * depth, [0] * depth
    identical = True
    for prompt, expect in zip(PROMPTS, plain):
        ids, stats = continuation(model, prompt, tokens, depth)
        identical &= ids == expect
        d = stats.draft
        steps += d["steps"]
        drafted += d["drafted"]
        accepted += d["accepted"]
        emitted += round(d["tokens_per_step"] * d["steps"])
        # acceptance_by_position[i] = kept / offered at position i+1; weight it back by steps
        for i, rate in enumerate(d["acceptance_by_position"]):
            offered_at[i] += d["steps"]
            kept_at[i] += rate * d["steps"]
    return {"acceptance": accepted / drafted if drafted else 0.0,
            "tokens_per_step": emitted / steps if steps else 0.0,
            "by_position": [k / o if o else 0.0 for k, o in zip(kept_at, offered_at)],
            "steps": steps, "identical": identical}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", default=None, help="GGUF with an MTP head (default: the bundled one)")
    ap.add_argument("--tokens", type=int, default=64, help="tokens per continuation")
    ap.add_argument("--depths", default="1,2,3", help="comma-separated draft depths")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args(argv)
    depths = [int(d) for d in args.depths.split(",")]

    model = hybrid.load(args.model, threads=args.threads)
    plain = [continuation(model, p, args.tokens, 0)[0] for p in PROMPTS]
    print(f"{model.path.name}: {len(PROMPTS)} code prompts × {args.tokens} greedy tokens")
    print(f"{'depth':>5}  {'acceptance':>10}  {'tokens/pass':>11}  {'README':>13}  {'by position':<22} same as plain")
    for depth in depths:
        r = measure(model, depth, args.tokens, plain)
        ref = README.get(depth)
        ref_text = f"{ref[0]:.2f} ({ref[1]:.1f})" if ref else "-"
        by_pos = " ".join(f"{a:.2f}" for a in r["by_position"])
        print(f"{depth:>5}  {r['acceptance']:>10.3f}  {r['tokens_per_step']:>11.2f}  {ref_text:>13}  "
              f"{by_pos:<22} {'yes' if r['identical'] else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
