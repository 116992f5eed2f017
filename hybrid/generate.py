"""The generation loop: chunked prefill, then sample-decode until a stop condition.

Written against the Forward/SessionState interface, so it runs the same on every backend.
"""
from __future__ import annotations

import time
from typing import Iterator, Sequence

import numpy as np

from .errors import HybridError
from .events import Done, Prefill, Stats, Token
from .sampling import Sampler, StopChecker

# Prompt tokens per forward call (llama.cpp's default micro-batch): bounds scratch memory and gives
# progress ticks. A call reads every weight once, so where FFN weights are streamed to the GPU for a
# chunk, a longer chunk halves the bytes a prompt moves over PCIe.
PREFILL_CHUNK = 512


def prompt_chunks(n: int, min_rows: int = 1) -> list[tuple[int, int]]:
    """(start, stop) of the forward calls that feed a prompt of n tokens: PREFILL_CHUNK rows each,
    except that a last chunk shorter than `min_rows` (the backend's `min_prompt_rows`) takes rows
    from the one before it. A backend may compute calls of fewer rows with its decode kernels,
    whose last bits differ from its prompt kernels'; this way every position of a prompt of at
    least min_rows tokens gets the prompt kernels' bits wherever the chunks fall, so a state cached
    after one prompt and extended by the next continues exactly as a full prefill of both."""
    bounds = [*range(0, n, PREFILL_CHUNK), n]
    if len(bounds) > 2 and n - bounds[-2] < min_rows:
        bounds[-2] = n - min_rows
    return list(zip(bounds[:-1], bounds[1:]))


def check_fits(n_prompt: int, n_ctx: int) -> None:
    if n_prompt == 0:
        raise HybridError("the prompt is empty: give some text with -p/--prompt or -f/--file")
    if n_prompt >= n_ctx:
        raise HybridError(
            f"the prompt has {n_prompt} tokens and does not fit the context of {n_ctx} "
            f"(raise -c/--ctx-size or shorten the prompt)")


def ends_reply(tokenizer, tok: int, ignore_eos: bool, constraint) -> bool:
    """An end-of-generation token ends the reply unless ignore_eos; under a grammar always (the
    grammar allowed it as its last token: nothing may follow)."""
    return tokenizer.is_eog(tok) and (not ignore_eos or constraint is not None)


def prefill(forward, state, prompt: Sequence[int], stats: Stats) -> Iterator[Prefill | np.ndarray]:
    """Feed the prompt in chunks; yields progress events, and last the logits of the final row."""
    t0 = time.perf_counter()
    ids = np.asarray(prompt, dtype=np.int32)
    logits = None
    for start, stop in prompt_chunks(len(ids), forward.min_prompt_rows):
        logits, _ = forward.forward(state, ids[start:stop], logits="last" if stop == len(ids) else "none")
        # counted per chunk, with the time, so that a Ctrl-C mid-prompt reports what was done
        # ("prompt 512 tokens in 3.1 s", not 0 tokens in 3.1 s)
        stats.prefill_seconds = time.perf_counter() - t0
        stats.prompt_tokens = stop
        yield Prefill(stop, len(ids), stats.prefill_seconds)
    yield logits[-1]


def generate_tokens(forward, state, tokenizer, prompt: Sequence[int], *, max_tokens: int,
                    sampler: Sampler, stop: Sequence[str] = (), n_ctx: int,
                    ignore_eos: bool = False, context: Sequence[int] = (),
                    logprobs: int | None = None, constraint=None) -> Iterator[Prefill | Token | Done]:
    """Plain decoding, one token per forward call. `context`: tokens already in the state before
    `prompt` (a session's cached turns), seen by the repeat penalty as a fresh prefill's would be.
    logprobs=K (≥ 0): every Token carries `logprobs` = (its log-probability, its K most likely
    alternatives as (id, log-probability)) under the model's own distribution (log-softmax of the
    raw logits, as OpenAI reports them); whole logit rows then come to the host each step.
    constraint (`hybrid.grammar.Constraint`): only tokens its grammar allows are sampled (whole
    rows too), and the reply ends at the end-of-generation token it allows last, ignore_eos or not."""
    check_fits(len(prompt), n_ctx)
    stats = Stats()
    history = list(context) + list(prompt)
    decoder, stopper = tokenizer.stream_decoder(), StopChecker(list(stop))
    logits = None
    try:
        for item in prefill(forward, state, prompt, stats):
            if isinstance(item, Prefill):
                yield item
            else:
                logits = item
        t0 = time.perf_counter()
        argmax_only, candidates = sampler.config.argmax_only, sampler.config.candidates or 0
        if logprobs is not None or constraint is not None:   # the whole row decides: no device-side pick
            argmax_only, candidates = False, 0
        picked = None        # the next token, when the last forward call picked it on the device
        while True:
            if stats.generated_tokens >= max_tokens:
                stats.stop_reason = "length"
                break
            if picked is not None:
                tok = picked
            elif constraint is not None:
                tok = constraint.sample(sampler, logits, history)
            else:
                tok = sampler.sample(logits, history)
            lp = _logprobs(logits, tok, logprobs) if logprobs is not None else None
            history.append(tok)
            stats.generated_tokens += 1
            if ends_reply(tokenizer, tok, ignore_eos, constraint):
                stats.decode_seconds = time.perf_counter() - t0
                stats.stop_reason = "eog"
                break
            step = stopper.push(decoder.push(tok))
            stats.decode_seconds = time.perf_counter() - t0
            yield Token(tok, step.text, stats, logprobs=lp)
            if step.stopped:
                stats.stop_reason = "stop_string"
                break
            if state.n_past + 1 >= n_ctx:
                stats.stop_reason = "context"
                break
            ids = np.array([tok], dtype=np.int32)
            if argmax_only:
                picks, _ = forward.forward(state, ids, logits="last", pick=True)
                picked = int(picks.ids[-1])
            else:   # the row's best logits when they decide the sample, else the whole row
                logits, _ = forward.forward(state, ids, logits="last", top=candidates)
                logits = logits[-1]
            stats.decode_seconds = time.perf_counter() - t0
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    tail = "" if stats.stop_reason == "stop_string" else stopper.push(decoder.flush()).text + stopper.flush()
    yield Done(stats, tail)


def _logprobs(logits, tok: int, k: int) -> tuple[float, list[tuple[int, float]]]:
    """(log p(tok), the k most likely tokens with their log p) from a full logit row."""
    row = np.asarray(logits, dtype=np.float64).reshape(-1)
    m = row.max()
    lse = m + np.log(np.exp(row - m).sum())
    top = np.argsort(-row, kind="stable")[:k] if k > 0 else []
    return float(row[tok] - lse), [(int(i), float(row[i] - lse)) for i in top]
