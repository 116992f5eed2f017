"""llama-bench style measurements: prompt processing (pp) and token generation (tg) rates."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from .generate import PREFILL_CHUNK, prompt_chunks


@dataclass
class BenchRow:
    test: str           # "pp512", "tg128"
    n_tokens: int
    seconds: list[float]
    tokens_per_step: float | None = None     # speculative rows: mean tokens emitted per verify pass
    draft: dict | None = None                # speculative rows: the last run's draft statistics
    one_offs: int = 0                        # compilations, allocations, captures in the timed steps (should be 0)

    @property
    def rates(self) -> list[float]:
        return [self.n_tokens / s for s in self.seconds]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.rates)

    @property
    def stdev(self) -> float:
        return statistics.stdev(self.rates) if len(self.rates) > 1 else 0.0


def _random_tokens(n: int, n_vocab: int, rng: np.random.Generator) -> np.ndarray:
    return rng.integers(0, n_vocab, size=n, dtype=np.int32)


def _named(test: str, depth: int) -> str:
    """A row's test name, with llama-bench's context depth when there is one: tg128@d4096."""
    return test + (f"@d{depth}" if depth else "")


def _fresh(model, state, depth: int, rng: np.random.Generator) -> None:
    """Empty `state`, then `depth` random tokens of context in it, untimed (llama-bench's -d)."""
    state.reset()
    if depth:
        prefill_prompt(model, state, _random_tokens(depth, model.config.n_vocab, rng))


def _warm_prompt(model, state, n_prompt: int, rng: np.random.Generator) -> None:
    """One untimed prompt chunk, as llama-bench warms up: the first prompt-sized call compiles or
    loads the prompt kernels (on the GPU the chunk GEMMs and weight streaming), which would
    otherwise land in the first repetition."""
    model.forward.forward(state, _random_tokens(min(n_prompt, PREFILL_CHUNK), model.config.n_vocab, rng),
                          logits="last")


def _warm_steps(model, state, rng: np.random.Generator) -> None:
    """Two untimed decode steps: a step's first run and its CUDA-graph capture."""
    for _ in range(2):
        model.forward.forward(state, _random_tokens(1, model.config.n_vocab, rng), logits="last", pick=True)


def _greedy_steps(model, state, picks, n_gen: int):
    """`n_gen` decode steps, each feeding the last one's greedy pick (made on the device, as
    `hybrid decode --temp 0` does); returns the last picks."""
    for _ in range(n_gen):
        tok = np.array([picks.ids[-1]], dtype=np.int32)
        picks, _ = model.forward.forward(state, tok, logits="last", pick=True)
    return picks


def bench_prompt(model, n_prompt: int, reps: int, seed: int = 0, depth: int = 0) -> BenchRow:
    """Prefill `n_prompt` random tokens into a fresh state (after `depth` untimed tokens of
    context), in the engine's prefill chunks, after one untimed chunk."""
    rng = np.random.default_rng(seed)
    times = []
    state = model.new_state(depth + n_prompt + 1)
    _warm_prompt(model, state, n_prompt, rng)
    for _ in range(reps):
        _fresh(model, state, depth, rng)
        ids = _random_tokens(n_prompt, model.config.n_vocab, rng)
        t0 = time.perf_counter()
        prefill_prompt(model, state, ids)
        times.append(time.perf_counter() - t0)
    return BenchRow(_named(f"pp{n_prompt}", depth), n_prompt, times)


def prefill_prompt(model, state, ids: np.ndarray, pick: bool = False):
    """Append `ids` to `state` in the engine's prefill chunks, logits of the last token only;
    returns the last chunk's forward result (with pick: its greedy pick too)."""
    out = None
    for start, stop in prompt_chunks(len(ids), model.forward.min_prompt_rows):
        last = stop == len(ids)
        out = model.forward.forward(state, ids[start:stop], logits="last" if last else "none", pick=pick and last)
    return out


def bench_generate(model, n_gen: int, reps: int, seed: int = 0, depth: int = 0) -> BenchRow:
    """Generate `n_gen` tokens one at a time (greedy) after a one-token context, as llama-bench
    does, after two untimed steps (the decode step's first run and its CUDA-graph capture).
    depth: each repetition first prefills this many random tokens, untimed (llama-bench's -d), so
    the timed steps attend over that much context; the row is then named tgN@dD. row.one_offs
    counts the one-off work (compilations, allocations, graph captures: `one_off_work`) done
    during the timed steps: a figure with any is not a steady-state rate."""
    rng = np.random.default_rng(seed)
    times, one_offs = [], 0
    # one state, reset per repetition (as llama-bench reuses its context): steps captured as
    # CUDA graphs replay
    state = model.new_state(depth + n_gen + 2)
    _warm_steps(model, state, rng)
    for _ in range(reps):
        _fresh(model, state, depth, rng)
        picks, _ = model.forward.forward(state, _random_tokens(1, model.config.n_vocab, rng), logits="last",
                                         pick=True)
        work = model.forward.one_off_work()
        t0 = time.perf_counter()
        _greedy_steps(model, state, picks, n_gen)
        times.append(time.perf_counter() - t0)
        one_offs += model.forward.one_off_work() - work
    return BenchRow(_named(f"tg{n_gen}", depth), n_gen, times, one_offs=one_offs)


def bench_prompt_generate(model, n_prompt: int, n_gen: int, reps: int, seed: int = 0, depth: int = 0) -> BenchRow:
    """llama-bench's -pg test: prefill `n_prompt` random tokens, then generate `n_gen` (greedy),
    timed together; the rate counts both (ppP+tgG, in tokens a second). Warmed up as the pp and
    tg rows are."""
    rng = np.random.default_rng(seed)
    times, one_offs = [], 0
    state = model.new_state(depth + n_prompt + n_gen + 1)
    _warm_prompt(model, state, n_prompt, rng)
    state.reset()
    _warm_steps(model, state, rng)
    for _ in range(reps):
        _fresh(model, state, depth, rng)
        ids = _random_tokens(n_prompt, model.config.n_vocab, rng)
        work = model.forward.one_off_work()
        t0 = time.perf_counter()
        picks, _ = prefill_prompt(model, state, ids, pick=True)
        _greedy_steps(model, state, picks, n_gen)
        times.append(time.perf_counter() - t0)
        one_offs += model.forward.one_off_work() - work
    return BenchRow(_named(f"pp{n_prompt}+tg{n_gen}", depth), n_prompt + n_gen, times, one_offs=one_offs)


BENCH_PROMPT = "import os\nimport sys\n\n\ndef main(argv):\n"


def bench_draft(model, n_gen: int, depth, reps: int) -> BenchRow:
    """Greedy generation of `n_gen` tokens with MTP drafting at `depth` (0, N or "auto") from a
    code prompt: acceptance depends on real text, so random tokens would say nothing.

    One untimed generation first, as `bench_generate` skips two steps: the first run of each
    step shape (verify, draft, rollback) is eager and the second is captured as a CUDA graph;
    counted, they made 16-token drafting rows on the 27B shape 1.3-1.8x slower than the verify
    steps they are made of. The model keeps its state between generations, so the timed runs
    replay those graphs. row.draft holds the last run's draft statistics."""
    def run():
        stats = None
        for ev in model.generate(BENCH_PROMPT, max_tokens=n_gen, temperature=0, draft=depth, ignore_eos=True):
            stats = getattr(ev, "stats", stats)
        return stats

    run()
    times, per_step = [], []
    for _ in range(reps):
        stats = run()
        times.append(stats.decode_seconds * n_gen / max(stats.generated_tokens, 1))
        per_step.append((stats.draft or {}).get("tokens_per_step", 1.0))
    row = BenchRow(f"tg{n_gen} draft={depth}", n_gen, times)
    row.tokens_per_step = statistics.fmean(per_step)
    row.draft = stats.draft or {}
    return row
