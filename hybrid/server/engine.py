"""One worker thread that owns the model and runs queued requests one at a time.

The model and its state are not thread-safe, so a single thread runs every generation; the
event loop only queues jobs and relays their events. A job's events cross to the loop with
call_soon_threadsafe. A cancelled job (its client went away) is dropped before it starts, or
stopped at the next event, i.e. within one forward step.

Each job starts from the longest cached prefix of its token ids: the live state when it holds
one (the previous request's conversation), else the best snapshot in the `StateCache`. Snapshots
are taken of the prompt's state (always exact; once the first token is sent), at the end of a
reply when the state holds a known prefix of prompt + reply (with MTP drafting, a reply can end
with the trunk having run drafted tokens that were never emitted, and then the end state is not
kept), and where a chat prompt's last message begins (`Job.boundary`): the prompt-end snapshot
never serves the same prompt again, since a snapshot must leave a token to prefill (its logits
start the reply), so a regenerated reply, or a new conversation under the same long system
prompt, starts from the boundary's.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..draft_policy import DraftPolicy
from ..errors import HybridError
from ..events import Done, Prefill, Stats, Token
from ..generate import generate_tokens, prefill
from ..grammar import Constraint
from ..sampling import Sampler, SamplerConfig
from ..speculative import generate_speculative, prefill_with_mtp
from .cache import StateCache

log = logging.getLogger("hybrid.server")

# A boundary snapshot splits the prompt's prefill in two forward calls, which costs up to one more
# pass over the weights (on the CPU, about a chunk's time); it is taken only when it keeps at least
# this many prompt tokens beyond where the job starts, so that one later hit repays it.
BOUNDARY_MIN_TOKENS = 64


class QueueFull(Exception):
    pass


@dataclass
class Job:
    ids: list[int]
    sampling: dict                 # SamplerConfig fields
    max_tokens: int
    stop: list[str]
    ignore_eos: bool = False
    logprobs: int | None = None    # top alternatives per token, None = no log-probabilities
    boundary: int = 0              # ids[:boundary] end where the prompt's last message begins; 0 = none
    constraint: Constraint | None = None    # the grammar the reply must follow (hybrid.grammar)
    loop: asyncio.AbstractEventLoop | None = None
    out: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)
    submitted: float = field(default_factory=time.perf_counter)

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, item) -> None:
        try:
            self.loop.call_soon_threadsafe(self.out.put_nowait, item)
        except RuntimeError:      # the loop is gone (server shutting down)
            self.cancel()


class Engine:
    def __init__(self, model, *, draft=None, draft_p_min: float = 0.0, cache_bytes: int = 0,
                 max_queue: int = 16):
        self.model = model
        policy = DraftPolicy.parse(draft, model.has_mtp)
        self.depth, self.draft_p_min = policy.depth, draft_p_min
        self.state = model.claim_state(model.n_ctx, policy.ring)
        self.cache = StateCache(cache_bytes)
        self.reuse = cache_bytes > 0     # off: every request prefills from scratch (benchmarks)
        self._live: list[int] | None = []   # the ids the live state holds; None = not known
        self._base = None                # a snapshot whose KV rows the live state holds (cache.put's base)
        self.max_queue = max_queue
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self.pending = 0                 # queued + running
        self.stats = {"served": 0, "cancelled": 0, "last": None}
        self._thread = threading.Thread(target=self._work, name="hybrid-engine", daemon=True)
        self._thread.start()

    # --- the loop's side -------------------------------------------------------------------------
    def submit(self, job: Job) -> Job:
        with self._lock:
            if self.pending >= self.max_queue + 1:      # one running, max_queue waiting
                raise QueueFull(f"the server is busy: {self.pending - 1} requests are waiting "
                                f"(the queue holds {self.max_queue}); try again shortly")
            self.pending += 1
        job.loop = asyncio.get_running_loop()
        job.out = asyncio.Queue()
        self._queue.put(job)
        return job

    def close(self) -> None:
        self._queue.put(None)

    # --- the worker --------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                if job.cancelled.is_set():
                    self.stats["cancelled"] += 1
                    continue
                self._run(job)
            except HybridError as e:
                job.emit(("error", 400, str(e)))
            except Exception as e:      # logged here; the client gets a one-line 500, never a traceback
                log.exception("generation failed")
                job.emit(("error", 500, f"internal error: {type(e).__name__}"))
            finally:
                with self._lock:
                    self.pending -= 1

    def _start(self, wanted: list[int]) -> int:
        """Put the state at the longest cached prefix of `wanted`; returns its length."""
        cached = 0
        live = self._live
        if self.reuse and live and len(live) < len(wanted) and wanted[:len(live)] == live:
            cached = len(live)
        ckpt = self.cache.longest_prefix(wanted) if self.reuse else None
        self._source = "live" if cached else "none"
        if ckpt is not None and len(ckpt.ids) > cached:
            ckpt.restore(self.state)
            cached = len(ckpt.ids)
            self._source, self._base = "snapshot", ckpt
        elif cached == 0:
            self.state.reset()
            self._base = None
        # The MTP head's KV rows must cover every trunk position before it drafts again (as in
        # ChatSession._stream): rows it wrote from its own hiddens only cost acceptance.
        self.state.mtp_n_past = self.state.n_past
        return cached

    def _snapshot(self, ids: list[int]) -> None:
        """Cache the live state, which holds `ids`; it shares the KV rows of the last snapshot
        the state was restored from or taken as (rows below n_past are only ever appended to)."""
        self._base = self.cache.put(self.state, ids, base=self._base) or self._base

    def _worth_a_boundary_snapshot(self, job: Job, cached: int) -> bool:
        # the rest after the boundary must be a prompt call of its own (min_prompt_rows): a shorter
        # one would run the decode kernels and change the last bits of a full prefill's
        rest = len(job.ids) - job.boundary
        return (self.reuse and job.boundary - cached >= BOUNDARY_MIN_TOKENS
                and rest >= self.model.forward.min_prompt_rows)

    def _prefill_to(self, ids: list[int], cached: int, job: Job, drafting: bool) -> bool:
        """Feed ids[cached:] into the state (which holds ids[:cached]) and snapshot it; False if
        the job was cancelled on the way (the state is then unknown). With drafting, the MTP
        head's KV rows are filled too, as the generator's own prefill does."""
        m = self.model
        rows = prefill_with_mtp(m.forward, m.mtp, self.state, ids[cached:], Stats()) if drafting \
            else prefill(m.forward, self.state, ids[cached:], Stats())
        for _ in rows:
            if job.cancelled.is_set():
                return False
        self._snapshot(ids)
        return True

    def _run(self, job: Job) -> None:
        m, wanted = self.model, list(job.ids)
        sampler = Sampler(SamplerConfig(**job.sampling))
        began = time.perf_counter()
        cached = self._start(wanted)
        timings = {"queued_s": began - job.submitted, "restore_s": time.perf_counter() - began}
        self._live = None            # until this job ends cleanly, the state's content is not known
        # log-probabilities are reported for every row of plain decoding's
        drafting = self.depth != 0 and job.logprobs is None
        start = cached
        if self._worth_a_boundary_snapshot(job, cached):
            taken = time.perf_counter()
            if not self._prefill_to(wanted[:job.boundary], cached, job, drafting):
                self.stats["cancelled"] += 1
                return
            start = job.boundary
            timings["boundary_s"] = time.perf_counter() - taken
        suffix = wanted[start:]
        run = dict(max_tokens=job.max_tokens, sampler=sampler, stop=job.stop, n_ctx=m.n_ctx,
                   ignore_eos=job.ignore_eos, context=wanted[:start])
        if not drafting:
            events = generate_tokens(m.forward, self.state, m.tokenizer, suffix, logprobs=job.logprobs,
                                     constraint=job.constraint, **run)
        else:
            events = generate_speculative(m.forward, m.mtp, self.state, m.tokenizer, suffix, depth=self.depth,
                                          p_min=self.draft_p_min, controller=m.depth_controller,
                                          constraint=job.constraint, **run)
        generated: list[int] = []
        stats, cancelled = None, False
        t0 = time.perf_counter()
        first = None
        prompt_done = False        # the prompt is in; its snapshot waits for the first token's send
        try:
            for ev in events:
                if job.cancelled.is_set():
                    cancelled = True
                    break
                if isinstance(ev, Prefill):
                    prompt_done = prompt_done or ev.done == ev.total
                    continue
                if isinstance(ev, Token):
                    generated.append(ev.id)
                    first = first or time.perf_counter()
                ev.stats.cached_tokens = cached
                if isinstance(ev, Done):
                    stats = ev.stats
                job.emit(("token", ev) if isinstance(ev, Token) else ("done", ev))
                # The generator yields a step's tokens before it runs the next step, so the state
                # still holds exactly the prompt here; taking the snapshot after the send keeps its
                # copy out of the time to first token.
                if prompt_done:
                    prompt_done = False
                    if self.reuse and self.state.n_past == len(wanted):
                        taken = time.perf_counter()
                        self._snapshot(wanted)
                        timings["prompt_snapshot_s"] = time.perf_counter() - taken
        finally:
            events.close()
        if cancelled or stats is None:
            self.stats["cancelled"] += 1
            self.stats["last"] = {"finish": "cancelled", "generated_tokens": len(generated),
                                  "cached_tokens": cached, "prompt_tokens": len(wanted)}
            return
        self.stats["served"] += 1
        self.stats["last"] = {"finish": stats.stop_reason, "generated_tokens": stats.generated_tokens,
                              "cached_tokens": cached, "prompt_tokens": len(wanted), "cached_from": self._source,
                              "ttft_s": round((first or time.perf_counter()) - t0, 6)}
        history = wanted + generated
        n = self.state.n_past
        if n <= len(history):
            self._live = history[:n]
            if self.reuse and n > len(wanted):
                taken = time.perf_counter()
                self._snapshot(self._live)
                timings["end_snapshot_s"] = time.perf_counter() - taken
        # where a request's time went, for /stats (the end snapshot delays the next request's start)
        self.stats["last"].update({k: round(v, 6) for k, v in timings.items()})
