"""Speculative decoding with the model's own MTP head: draft, verify k tokens at once, commit.

State between steps (n = trunk positions done):
* `t`, the last emitted token, sits at position n and is not yet in the trunk;
* the MTP KV cache holds true rows for the positions before `pending`: the rows of the m
  drafts the last step accepted were computed from the MTP head's own hiddens, so they are
  recomputed, with the trunk's verified hiddens, in the same MTP call that seeds the next
  draft; steps that draft nothing add their token's row to `pending` (flush_pending).
One step:
  draft   MTP rows [pending…, seed (t, h_{n−1})] → d1, then chain (d_i, ĥ_i) → d_{i+1}
  verify  trunk over [t, d1..dD] in one pass (every weight read serves D+1 rows), GDN
          states after each token written to the snapshot ring
  commit  keep the longest agreeing prefix (acceptance.py), emit accepted + 1 tokens,
          GDN/conv state ← ring slot of the last kept token, KV truncated by n_past.
With greedy sampling the output equals plain decoding token for token, because every
batched kernel gives each row the bits of a one-row call.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np

from .acceptance import accept_drafts, accept_greedy
from .draft_depth import DepthController
from .draft_policy import AUTO, MAX_AUTO_DEPTH
from .events import Done, Prefill, Stats, Token
from .generate import check_fits, ends_reply, prompt_chunks
from .sampling import Sampler, StopChecker

PENDING_MAX = 8     # MTP rows left waiting by steps that draft nothing (flush_pending)


@dataclass
class DraftStats:
    depth: int | str = 0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    commit_seconds: float = 0.0
    accepted_at: list[int] = field(default_factory=list)   # accepted_at[i]: steps that kept draft i+1
    offered_at: list[int] = field(default_factory=list)    # offered_at[i]: steps that drafted ≥ i+1

    def record(self, drafted: int, accepted: int) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += accepted + 1
        for lst, k in ((self.offered_at, drafted), (self.accepted_at, accepted)):
            while len(lst) < k:
                lst.append(0)
            for i in range(k):
                lst[i] += 1

    def to_dict(self) -> dict:
        return {
            "depth": self.depth, "steps": self.steps, "drafted": self.drafted, "accepted": self.accepted,
            "acceptance": self.accepted / self.drafted if self.drafted else 0.0,
            "tokens_per_step": self.emitted / self.steps if self.steps else 0.0,
            "acceptance_by_position": [a / o if o else 0.0 for a, o in zip(self.accepted_at, self.offered_at)],
            "draft_seconds": round(self.draft_seconds, 6), "verify_seconds": round(self.verify_seconds, 6),
            "commit_seconds": round(self.commit_seconds, 6),
        }


def prefill_with_mtp(forward, mtp, state, prompt: Sequence[int], stats: Stats) -> Iterator[Prefill | tuple]:
    """Prompt chunks through the trunk and, row for row, through the MTP head (its KV cache
    must cover the prompt). Yields progress, then (last logits row, last hidden row)."""
    t0 = time.perf_counter()
    ids = np.asarray(prompt, dtype=np.int32)
    h_last = np.zeros((1, forward.config.n_embd), np.float32)     # h_{−1} = 0
    logits = None
    for start, stop in prompt_chunks(len(ids), forward.min_prompt_rows):
        chunk = ids[start:stop]
        logits, hidden = forward.forward(state, chunk, logits="last" if stop == len(ids) else "none")
        mtp.forward(state, chunk, np.concatenate([h_last, hidden[:-1]]), logits="none")
        h_last = hidden[-1:]
        stats.prefill_seconds = time.perf_counter() - t0
        stats.prompt_tokens = stop                  # per chunk: a Ctrl-C reports what was done
        yield Prefill(stop, len(ids), stats.prefill_seconds)
    yield logits[-1], h_last


def draft_tokens(mtp, state, pending_ids, pending_h, depth: int, p_min: float) -> list[int]:
    """Run the pending MTP rows, then chain up to `depth` ≥ 1 greedy MTP drafts from the last;
    stop early below confidence p_min."""
    drafts: list[int] = []
    ids, hs = pending_ids, pending_h
    while len(drafts) < depth:
        picks, hidden = mtp.forward(state, ids, hs, logits="last", pick=True)
        if p_min > 0.0 and picks.top_p[-1] < p_min:
            break
        drafts.append(int(picks.ids[-1]))
        ids, hs = np.array([drafts[-1]], np.int32), hidden[-1:]
    return drafts


def flush_pending(mtp, state, pending_ids, pending_h, drop: bool = False):
    """A step that drafts nothing runs the trunk alone: its MTP rows wait, and run with the next
    draft in one call. Once PENDING_MAX rows wait, all but the last (the next draft's seed) run
    now, in a call of that fixed size, so a run that settles on depth 0 costs what plain
    decoding costs, with one MTP call every PENDING_MAX − 1 tokens. With `drop` (the depth
    controller expects no draft to pay) the oldest row's position is skipped instead, at no
    cost, so the next draft still runs the newest PENDING_MAX rows (a call of that size).
    Returns the rows still waiting."""
    if len(pending_ids) < PENDING_MAX:
        return pending_ids, pending_h
    if drop:
        state.mtp_n_past += len(pending_ids) - PENDING_MAX + 1
        return pending_ids[-(PENDING_MAX - 1):], pending_h[-(PENDING_MAX - 1):]
    mtp.forward(state, pending_ids[:-1], pending_h[:-1], logits="none")
    return pending_ids[-1:], pending_h[-1:]


def generate_speculative(forward, mtp, state, tokenizer, prompt: Sequence[int], *, max_tokens: int,
                         sampler: Sampler, depth: int, p_min: float = 0.0, stop: Sequence[str] = (),
                         n_ctx: int, ignore_eos: bool = False, context: Sequence[int] = (),
                         controller: DepthController | None = None,
                         constraint=None) -> Iterator[Prefill | Token | Done]:
    """`context` as for generate.generate_tokens. controller: the auto depth's DepthController,
    to carry what earlier generations on the same forward learnt (a fresh one if None).
    constraint (`hybrid.grammar.Constraint`): as for generate_tokens. Drafts past the first one
    the grammar would refuse are not verified, and every verify row is masked by the grammar
    (`acceptance.accept_drafts`), so the text is plain constrained decoding's."""
    check_fits(len(prompt), n_ctx)
    stats, ds = Stats(), DraftStats(depth="auto" if depth == AUTO else depth)
    stats.draft = ds.to_dict()
    auto = (controller or DepthController(MAX_AUTO_DEPTH)) if depth == AUTO else None
    history = list(context) + list(prompt)
    decoder, stopper = tokenizer.stream_decoder(), StopChecker(list(stop))
    try:
        for item in prefill_with_mtp(forward, mtp, state, prompt, stats):
            if isinstance(item, Prefill):
                yield item
            else:
                logits, h_last = item
        t0 = time.perf_counter()
        emit_queue = accept_drafts([logits], [], sampler, history, constraint) if max_tokens > 0 else []
        if not emit_queue:
            stats.stop_reason = "length"
        pending_ids = np.array(emit_queue, np.int32)
        pending_h = h_last
        argmax_only, candidates = sampler.config.argmax_only, sampler.config.candidates or 0
        if constraint is not None:      # the grammar masks whole rows: no device-side pick
            argmax_only, candidates = False, 0
        last = None             # the last step, for the controller: (drafted, kept, start, one-off count, caught up)
        was_plain = False       # the step before drafted nothing, leaving its MTP row waiting
        while True:
            # emit what the last step produced, checking every stop condition per token
            for tok in emit_queue:
                history.append(tok)
                stats.generated_tokens += 1
                if ends_reply(tokenizer, tok, ignore_eos, constraint):
                    stats.stop_reason = "eog"
                    break
                step = stopper.push(decoder.push(tok))
                stats.decode_seconds = time.perf_counter() - t0
                yield Token(tok, step.text, stats)
                if step.stopped:
                    stats.stop_reason = "stop_string"
                    break
                if stats.generated_tokens >= max_tokens:
                    stats.stop_reason = "length"
                    break
            if stats.stop_reason:
                break
            if state.n_past + 1 >= n_ctx:
                stats.stop_reason = "context"
                break
            t = emit_queue[-1]
            t_step, one_offs = time.perf_counter(), forward.one_off_work()
            if auto and last is not None:
                # A step's cost is the whole cycle to the next step's start: its tokens' emission
                # (detokenising, stop checks, the caller's own work per token) belongs to it too.
                # A step that did once-only work says nothing of its depth's cost, nor does the
                # first drafting step after plain ones: its MTP call runs every row those left
                # waiting, a cost that belongs to the depth before. (After a drafting step the
                # MTP call redoes only the rows that step kept, as a steady step's does: a change
                # between drafting depths is steady, docs/MEASUREMENTS.md.)
                drafted, kept, t_last, work_last, caught_up = last
                auto.record(drafted, kept, t_step - t_last, steady=one_offs == work_last and not caught_up)
                ds.depth = f"auto({auto.choice})"     # where it settled, not a probe's depth
            want = auto.choose() if auto else depth
            # The last token a step emits sits at n_past + k + 1 unprocessed; plain decoding's last
            # token sits at most at n_ctx − 1, so drafting never runs past that (−2, not −1).
            k = max(0, min(want, max_tokens - stats.generated_tokens - 1, n_ctx - state.n_past - 2,
                           state.n_ring - 1))
            plain = k == 0
            if plain:
                drafts = []
                pending_ids, pending_h = flush_pending(mtp, state, pending_ids, pending_h,
                                                       drop=auto is not None and auto.mtp_idle)
            else:
                drafts = draft_tokens(mtp, state, pending_ids, pending_h, k, p_min)
                if constraint is not None:
                    drafts = constraint.allowed_prefix(drafts)
            t_verify = time.perf_counter()
            n0 = state.n_past
            verified, vhidden = forward.forward(state, np.array([t, *drafts], np.int32), logits="all",
                                                snapshot=not plain, pick=argmax_only,
                                                top=0 if argmax_only else candidates)
            t_commit = time.perf_counter()
            emit_queue = (accept_greedy(verified.ids, drafts) if argmax_only
                          else accept_drafts(verified, drafts, sampler, history, constraint))
            m = len(emit_queue) - 1
            if plain:       # the new token and its hidden join the rows the MTP head has yet to run
                pending_ids = np.append(pending_ids, np.int32(emit_queue[0]))
                pending_h = np.concatenate([pending_h, vhidden[:1]])
            else:
                state.rollback(m + 1)
                state.mtp_n_past = n0 + 1                      # the seed row (t, h_{n0−1}) was a true row
                pending_ids = np.array(emit_queue, np.int32)   # d1..dm (rows to redo) + the new token
                pending_h = vhidden[:m + 1]
            t_end = time.perf_counter()
            ds.draft_seconds += t_verify - t_step
            ds.verify_seconds += t_commit - t_verify
            ds.commit_seconds += t_end - t_commit
            ds.record(len(drafts), m)
            last = (len(drafts), m, t_step, one_offs, was_plain and not plain)
            was_plain = plain
            stats.decode_seconds = t_end - t0
            stats.draft = ds.to_dict()
    except KeyboardInterrupt:
        stats.stop_reason = "interrupted"
    stats.draft = ds.to_dict()
    tail = "" if stats.stop_reason == "stop_string" else stopper.push(decoder.flush()).text + stopper.flush()
    yield Done(stats, tail)
