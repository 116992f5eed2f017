#!/usr/bin/env python
"""hybrid (CPU) vs llama.cpp on one GGUF, in one run: decode and prompt speed, and peak memory.

    python tools/compare_llama_cpp.py MODEL [--threads 2] [--tokens 64] [--prompt-tokens 512] [--reps 3]

Each engine lives in its own worker subprocess, so each peak RSS (`ru_maxrss`) is that engine's
alone. The parent interleaves the two, one measurement at a time with the same random tokens,
so both share whatever else loads the machine. Measurements:
* ppN: prefill N random tokens into a fresh state (hybrid in its prefill chunks, llama.cpp in
  one batch), logits of the last token only, as llama-bench does.
* tgN: after a short random prompt (untimed), N greedy tokens one at a time: a forward of one
  token, then the argmax of its logits (llama.cpp: `Llama.eval` of one token and its logits).
* memory: hybrid's peak RSS against the target "RSS < mapped weights + KV/state + 500 MB", and
  its RSS right after `hybrid.load` against the file size (a load must not read the weights).
Needs llama-cpp-python (`pip install .[parity]`). Exits 1 when a memory check fails.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from hybrid.errors import HybridError

MiB = 2**20
RSS_SLACK = 500 * 10**6         # the allowance on top of weights + KV/state
# RSS growth at load must stay far below the file size: a quarter of it, plus room for the
# metadata and tokenizer (measured on a 248k vocabulary: 25 MiB parsed header + 72 MiB tokenizer)
LOAD_RSS_FRACTION, LOAD_RSS_FIXED = 0.25, 128 * MiB
SHORT_PROMPT = 8                # tokens before a tg run
ENGINES = ("hybrid", "llama.cpp")


# --- worker side: one engine per process ------------------------------------------------------

def rss_now() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # Linux reports KiB


class HybridEngine:
    @staticmethod
    def import_modules() -> None:
        # everything hybrid.load and the forward import lazily: numba alone is ~60 MB of RSS
        import cpu.ops  # noqa: F401
        import hybrid.api  # noqa: F401
        import hybrid.bench  # noqa: F401
        import hybrid.chat_template  # noqa: F401
        import hybrid.forward  # noqa: F401
        import hybrid.tokenizer  # noqa: F401
        import jinja2  # noqa: F401
        import numba  # noqa: F401
        import tokenizers  # noqa: F401

    def __init__(self, path: str, threads: int, n_ctx: int):
        import hybrid
        from hybrid.placement import gdn_state_bytes, kv_bytes

        self.model = m = hybrid.load(path, device="cpu", threads=threads, n_ctx=n_ctx)
        self.rss_after_load = rss_now()
        c = m.config
        n_kv_layers = sum(not c.is_recurrent(i) for i in range(c.n_layer)) + c.n_nextn  # MTP has a KV too
        self.info = {"n_vocab": c.n_vocab, "threads": m.threads, "n_ctx": n_ctx,
                     "weights_bytes": sum(t.nbytes for t in m.file.tensors.values()),
                     "state_bytes": kv_bytes(c, n_ctx, n_kv_layers) + gdn_state_bytes(c, 0)}
        m.warmup()

    def prefill(self, ids: list[int]) -> float:
        from hybrid.bench import prefill_prompt
        tokens = np.asarray(ids, dtype=np.int32)
        state = self.model.new_state(len(tokens) + 1)
        t0 = time.perf_counter()
        prefill_prompt(self.model, state, tokens)
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        fwd = self.model.forward
        state = self.model.new_state(len(prompt) + n + 1)
        logits, _ = fwd.forward(state, np.asarray(prompt, dtype=np.int32), logits="last")
        out = []
        t0 = time.perf_counter()
        for _ in range(n):
            out.append(int(np.argmax(logits[-1])))
            logits, _ = fwd.forward(state, np.array(out[-1:], dtype=np.int32), logits="last")
        return time.perf_counter() - t0, out


class LlamaCppEngine:
    @staticmethod
    def import_modules() -> None:
        import llama_cpp  # noqa: F401  (loads libllama)

    def __init__(self, path: str, threads: int, n_ctx: int):
        import llama_cpp
        self.capi = llama_cpp
        # n_batch = the whole prompt: one llama_decode per pp run, llama-bench's default shape
        self.llm = llama_cpp.Llama(model_path=path, n_ctx=n_ctx, n_batch=n_ctx, n_threads=threads,
                                   n_threads_batch=threads, logits_all=False, verbose=False)
        self.rss_after_load = rss_now()
        self.n_vocab = self.llm.n_vocab()
        self.info = {"threads": threads, "n_ctx": n_ctx}
        self.decode([0] * SHORT_PROMPT, 2)        # warm-up: first-call allocations

    def _last_logits(self) -> np.ndarray:
        ptr = self.capi.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def prefill(self, ids: list[int]) -> float:
        self.llm.reset()                           # clears KV and recurrent state
        t0 = time.perf_counter()
        self.llm.eval(ids)
        self._last_logits().argmax()               # as hybrid, the last logits are ready here
        return time.perf_counter() - t0

    def decode(self, prompt: list[int], n: int) -> tuple[float, list[int]]:
        self.llm.reset()
        self.llm.eval(prompt)
        out = []
        t0 = time.perf_counter()
        for _ in range(n):
            out.append(int(self._last_logits().argmax()))
            self.llm.eval(out[-1:])
        return time.perf_counter() - t0, out


def worker(engine: str, path: str, threads: int, n_ctx: int) -> int:
    """Answer one JSON request per stdin line on the original stdout; libraries print to stderr."""
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    kind = HybridEngine if engine == "hybrid" else LlamaCppEngine
    kind.import_modules()           # so that the RSS growth at load is the load's own
    rss_start = rss_now()
    t0 = time.perf_counter()
    try:
        e = kind(path, threads, n_ctx)
    except (HybridError, ValueError) as err:   # ValueError: llama-cpp-python's "Failed to load model"
        print(f"error: {engine} cannot run {path}: {err}", file=sys.stderr)
        return 2
    reply.write(json.dumps({**e.info, "rss_start": rss_start, "rss_after_load": e.rss_after_load,
                            "ready_seconds": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "pp":
            answer = {"seconds": e.prefill(req["ids"])}
        elif req["op"] == "tg":
            seconds, ids = e.decode(req["prompt"], req["n"])
            answer = {"seconds": seconds, "ids": ids}
        else:                                      # "finish": the peak, then exit
            reply.write(json.dumps({"rss_peak": rss_peak(), "rss_now": rss_now()}) + "\n")
            return 0
        reply.write(json.dumps(answer) + "\n")
    return 0


# --- parent side --------------------------------------------------------------------------------

class Worker:
    def __init__(self, engine: str, args):
        env = dict(os.environ)
        env["NUMBA_NUM_THREADS"] = str(args.threads)    # numba's pool size; hybrid.load uses all of it
        cmd = [sys.executable, __file__, str(args.model), "--worker", engine, "--threads", str(args.threads),
               "--n-ctx", str(args.n_ctx)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.engine = engine
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise SystemExit(f"error: the {self.engine} worker stopped (exit code {code}); see its message above")
        return json.loads(line)

    def ask(self, **req) -> dict:
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        return self._read()


def median_range(rates: list[float]) -> str:
    """The median resists a neighbour's burst on a shared machine better than the mean."""
    return f"{statistics.median(rates):7.2f} ({min(rates):.1f}–{max(rates):.1f})"


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def measure(workers: dict[str, Worker], args) -> dict:
    """Interleaved runs, the same random tokens for both engines: {rates, same_tokens, final}."""
    n_vocab = workers["hybrid"].info["n_vocab"]
    rng = np.random.default_rng(0)
    pp = {name: [] for name in ENGINES}
    tg = {name: [] for name in ENGINES}
    same_tokens = []
    for rep in range(args.reps):
        order = ENGINES if rep % 2 == 0 else ENGINES[::-1]    # neither engine always goes first
        ids = rng.integers(n_vocab, size=args.prompt_tokens).tolist()
        for name in order:
            pp[name].append(args.prompt_tokens / workers[name].ask(op="pp", ids=ids)["seconds"])
        prompt = rng.integers(n_vocab, size=SHORT_PROMPT).tolist()
        streams = {}
        for name in order:
            r = workers[name].ask(op="tg", prompt=prompt, n=args.tokens)
            tg[name].append(args.tokens / r["seconds"])
            streams[name] = r["ids"]
        a, b = streams.values()
        same_tokens.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)))
    final = {name: w.ask(op="finish") for name, w in workers.items()}
    for w in workers.values():
        w.proc.wait()
    rates = {f"pp{args.prompt_tokens} tokens/s": pp, f"tg{args.tokens} tokens/s": tg}
    return {"rates": rates, "same_tokens": same_tokens, "final": final}


def print_table(workers: dict[str, Worker], result: dict) -> None:
    print("rates: median (min–max) over the reps; ratios of medians\n")
    print(f"| {'measure':<20} | {'hybrid':>25} | {'llama.cpp':>25} | hybrid/llama.cpp |")
    print(f"|{'-' * 22}|{'-' * 27}|{'-' * 27}|{'-' * 18}|")
    for label, rates in result["rates"].items():
        h, l_ = rates["hybrid"], rates["llama.cpp"]
        ratio = statistics.median(h) / statistics.median(l_)
        print(f"| {label:<20} | {median_range(h):>25} | {median_range(l_):>25} | {ratio:16.2f} |")
    # "before load" is after the engine's imports, so "after load" minus it is the load's own growth
    memory = {"peak RSS MiB": {n: result["final"][n]["rss_peak"] for n in ENGINES},
              "RSS after load MiB": {n: workers[n].info["rss_after_load"] for n in ENGINES},
              "RSS before load MiB": {n: workers[n].info["rss_start"] for n in ENGINES}}
    for label, of in memory.items():
        h, l_ = of["hybrid"], of["llama.cpp"]
        print(f"| {label:<20} | {h / MiB:25.0f} | {l_ / MiB:25.0f} | {h / l_:16.2f} |")


def check_memory(hy: dict, peak: int, file_size: int) -> bool:
    """The issue's targets for hybrid: peak RSS, and a load that does not read the weights."""
    weights, state = hy["weights_bytes"], hy["state_bytes"]
    target = weights + state + RSS_SLACK
    load_growth = hy["rss_after_load"] - hy["rss_start"]
    limit = LOAD_RSS_FRACTION * file_size + LOAD_RSS_FIXED
    ok_peak, ok_load = peak < target, load_growth < limit
    print(f"\nhybrid memory: mapped weights {weights / MiB:.0f} MiB + KV/state {state / MiB:.1f} MiB "
          f"(n_ctx {hy['n_ctx']}) + 500 MB = target {target / MiB:.0f} MiB; peak RSS {peak / MiB:.0f} MiB: "
          f"{'OK' if ok_peak else 'OVER TARGET'}")
    print(f"hybrid.load grew RSS by {load_growth / MiB:.0f} MiB for a {file_size / MiB:.0f} MiB file "
          f"(limit {limit / MiB:.0f} MiB): "
          f"{'OK (weights not read at load)' if ok_load else 'TOO MUCH (load reads the weights?)'}")
    return ok_peak and ok_load


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2, help="threads for both engines")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens per tg run")
    ap.add_argument("--prompt-tokens", type=int, default=512, help="tokens per pp run")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each measurement per engine")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--n-ctx", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, str(args.model), args.threads, args.n_ctx)

    if not args.model.is_file():
        raise SystemExit(f"error: no model file at {args.model}")
    if min(args.threads, args.tokens, args.prompt_tokens, args.reps) < 1:
        raise SystemExit("error: --threads, --tokens, --prompt-tokens and --reps must all be ≥ 1")
    try:
        import llama_cpp  # noqa: F401  (only checked here: the workers import it)
    except ImportError:
        raise SystemExit("error: llama-cpp-python is not installed: pip install .[parity]") from None
    args.n_ctx = max(args.prompt_tokens, SHORT_PROMPT + args.tokens) + 8
    load_before = loadavg()

    workers = {name: Worker(name, args) for name in ENGINES}   # one after the other: loads do not overlap
    result = measure(workers, args)
    file_size = args.model.stat().st_size
    print(f"model {args.model} ({file_size / MiB:.0f} MiB), threads {args.threads}, reps {args.reps}; "
          f"loadavg before {load_before}, after {loadavg()}")
    print(f"greedy tg streams identical for the first {result['same_tokens']} of {args.tokens} tokens per rep "
          "(random prompt: near-ties split them early on a synthetic model)")
    print_table(workers, result)
    return 0 if check_memory(workers["hybrid"].info, result["final"]["hybrid"]["rss_peak"], file_size) else 1


if __name__ == "__main__":
    sys.exit(main())
