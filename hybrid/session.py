"""Multi-turn sessions with a prompt cache: each turn prefills only what the state has not seen.

A `ChatSession` owns one SessionState and remembers exactly which token ids it has consumed.
Each `send` renders the whole conversation with the chat template and tokenizes it; when those
ids start with the consumed ids, only the new suffix is prefilled. A GDN layer's recurrent state
folds in every token it has seen and cannot be truncated back to a shorter prefix, so reuse is
all or nothing per saved state. Two are kept: the live one (prompt + reply so far) and a
checkpoint copied when the last prompt finished prefilling. The checkpoint is what makes reuse
work with Qwen's templates, which rewrite the previous reply in the history (they drop its
<think> block): the live state then no longer matches, the checkpoint does, and only the
rewritten reply and the new turn are prefilled. When neither matches, the state is reset and
everything is prefilled.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import numpy as np

from .draft_policy import DraftPolicy
from .errors import HybridError
from .events import Done, Prefill, Token
from .generate import generate_tokens
from .grammar import Constraint
from .reasoning import ReasoningTagger, starts_inside
from .sampling import Sampler, SamplerConfig
from .speculative import generate_speculative

SAMPLING_DEFAULTS = dict(max_tokens=128, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05,
                         repeat_penalty=1.0, repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0,
                         seed=None, stop=(), ignore_eos=False, grammar=None)
SAMPLER_EXTRAS = ("typical_p", "xtc_probability", "xtc_threshold", "dry_multiplier", "dry_base", "dry_allowed_length",
                  "dry_penalty_last_n", "dry_sequence_breakers", "logit_bias")   # Model.sampler_options


class ChatSession:
    """A conversation with a model that keeps its state between turns.

    send(text) adds a user turn and streams the reply (Prefill / Token / Done events, as
    Model.generate); the reply is added to the conversation. generate(prompt) continues the same
    token sequence with raw text or ids (no template). Done.stats.cached_tokens counts the reused
    tokens, stats.prompt_tokens the newly prefilled ones. Both take Model.generate's sampling
    options, grammar= included (each reply starts the grammar afresh; a thinking model wants
    reasoning=False). Not thread-safe: one turn at a time.
    """

    def __init__(self, model, *, system: str | None = None, n_ctx: int | None = None,
                 draft: int | str | None = None, draft_p_min: float = 0.0, reasoning: bool | None = None):
        self.model = model
        self.system = system
        self.reasoning = reasoning      # the template's enable_thinking (None: its default)
        policy = DraftPolicy.parse(draft, model.has_mtp)
        self.depth = policy.depth
        self.draft_p_min = draft_p_min
        self.n_ctx = min(n_ctx or model.n_ctx, model.config.context_length)
        if self.n_ctx < 2:
            raise HybridError(f"context size must be ≥ 2, got {self.n_ctx}")
        model.prepare_drafting(policy.max_depth)                  # first: it captures on the state claimed next
        self.state = model.claim_state(self.n_ctx, policy.ring)
        self.messages: list[dict] = []
        self._history: list[int] = []          # every token of the sequence, the last reply's included
        self._consumed: list[int] | None = []  # the ids the state holds, in order; None = not known
        self._checkpoint: _Checkpoint | None = None   # the state right after the last prompt
        self.last_stats = None

    # --- public -------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """The token ids the state has consumed (its prompt cache)."""
        return list(self._consumed or [])

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the state."""
        self.messages = []
        self._history = []
        self._consumed = []
        self._checkpoint = None
        self.state.reset()

    def render(self, user_text: str | None = None) -> list[int]:
        """The conversation so far (plus a user turn, if given) as the template renders it,
        ending with the assistant prompt: the ids a fresh prefill would consume."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        if user_text is not None:
            messages = messages + [{"role": "user", "content": user_text}]
        text = self.model.chat_template.render(messages, add_generation_prompt=True, enable_thinking=self.reasoning)
        self._rendered = text
        return self.model.encode_chat_text(text)

    def send(self, user_text: str, **sampling) -> Iterator[Prefill | Token | Done]:
        """Add a user turn and stream the assistant's reply (prefilling only the new tokens).
        The reply joins the conversation when the turn ends, also when Ctrl-C cut it short."""
        if not isinstance(user_text, str):
            raise HybridError("a chat message must be text")

        def add_turn(reply: str) -> None:
            self.messages += [{"role": "user", "content": user_text}, {"role": "assistant", "content": reply}]
        wanted = self.render(user_text)
        return ReasoningTagger(self._turn(wanted, sampling, add_turn), starts_inside(self._rendered))

    def generate(self, prompt: str | Sequence[int], **sampling) -> Iterator[Prefill | Token | Done]:
        """Continue the session's token sequence with `prompt` (raw text, or token ids) and stream
        the continuation. Mixing this with `send` makes the next `send` start over (its rendered
        conversation no longer starts with these tokens)."""
        if isinstance(prompt, str):
            # BOS (if the model wants one) only at the very start of a sequence
            ids = self.model.tokenizer.encode(prompt, add_special=None if not self._history else False)
        else:
            ids = [int(t) for t in prompt]
            self.model.forward.check_tokens(ids)
        if not ids:
            raise HybridError("the prompt is empty")
        return self._turn(self._history + ids, sampling, None)

    # --- the shared turn ----------------------------------------------------------------------
    def _turn(self, wanted: list[int], sampling: dict, on_reply) -> Iterator[Prefill | Token | Done]:
        """Checks (now, not at the first event), then the generator that runs the turn."""
        extras = {k: sampling.pop(k) for k in list(sampling) if k in SAMPLER_EXTRAS}
        unknown = set(sampling) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise HybridError(f"unknown sampling option(s): {', '.join(sorted(unknown))}")
        opts = {**SAMPLING_DEFAULTS, **sampling}
        if opts["max_tokens"] < 0:
            raise HybridError(f"max_tokens must be ≥ 0, got {opts['max_tokens']}")
        if len(wanted) >= self.n_ctx:
            raise HybridError(f"the conversation has {len(wanted)} tokens and no longer fits the context of "
                              f"{self.n_ctx}: start over (/reset) or use a larger context")
        sampler = Sampler(SamplerConfig(temperature=opts["temperature"], top_k=opts["top_k"], top_p=opts["top_p"],
                                        min_p=opts["min_p"], repeat_penalty=opts["repeat_penalty"],
                                        repeat_last_n=opts["repeat_last_n"], presence_penalty=opts["presence_penalty"],
                                        frequency_penalty=opts["frequency_penalty"], seed=opts["seed"],
                                        **self.model.sampler_options(**extras)))
        run = dict(max_tokens=opts["max_tokens"], sampler=sampler, stop=list(opts["stop"]),
                   n_ctx=self.n_ctx, ignore_eos=opts["ignore_eos"])
        if opts["grammar"] is not None:         # Model.generate's grammar
            run["constraint"] = Constraint(self.model.tokenizer, opts["grammar"])
        return self._stream(wanted, run, on_reply)

    def _stream(self, wanted: list[int], run: dict, on_reply) -> Iterator[Prefill | Token | Done]:
        cached = self._reusable(wanted, self._consumed)
        ckpt = self._checkpoint
        if ckpt is not None and self._reusable(wanted, ckpt.ids) > cached:
            ckpt.restore(self.state)
            cached = len(ckpt.ids)
        elif cached == 0:
            self.state.reset()
        # The MTP head's KV rows must cover every trunk position before it drafts again. Rows of
        # drafts accepted in the last turn were written from the head's own hiddens (generation
        # ends before they are redone), and they stand in for the true rows, as the zero hidden
        # paired with the first new token does for the trunk's last one: that can only cost
        # acceptance, never change the output, since every drafted token is verified by the trunk.
        self.state.mtp_n_past = self.state.n_past
        m, suffix = self.model, wanted[cached:]
        run = {**run, "context": wanted[:cached]}
        if self.depth == 0:
            events = generate_tokens(m.forward, self.state, m.tokenizer, suffix, **run)
        else:
            events = generate_speculative(m.forward, m.mtp, self.state, m.tokenizer, suffix, depth=self.depth,
                                          p_min=self.draft_p_min, controller=m.depth_controller, **run)
        generated: list[int] = []
        reply: list[str] = []
        stats = None
        it = iter(events)
        try:
            ev = next(it, None)
            while ev is not None:
                if isinstance(ev, Prefill) and ev.done == ev.total and self.state.n_past == len(wanted):
                    self._checkpoint = _Checkpoint.take(self.state, wanted)
                if isinstance(ev, Token):
                    generated.append(ev.id)
                if isinstance(ev, (Token, Done)):
                    reply.append(ev.text)
                    ev.stats.cached_tokens = cached
                    stats = ev.stats
                try:
                    yield ev
                except KeyboardInterrupt as e:
                    # display.drive throws a Ctrl-C that hit the consumer back in here: pass it on
                    # to the generation loop, which ends the turn with its own Done
                    try:
                        ev = it.throw(e)
                    except StopIteration:
                        ev = None
                    continue
                ev = next(it, None)
        finally:
            it.close()
            self.last_stats = stats
            self._remember(wanted + generated, interrupted=stats is None or stats.stop_reason == "interrupted")
            if on_reply is not None and stats is not None and stats.stop_reason:
                on_reply("".join(reply))

    @staticmethod
    def _reusable(wanted: list[int], held: list[int] | None) -> int:
        """len(held) if a state holding `held` can continue into `wanted` (a proper prefix), else 0."""
        if held is None or not held or len(held) >= len(wanted) or wanted[:len(held)] != held:
            return 0
        return len(held)

    def _remember(self, history: list[int], interrupted: bool) -> None:
        """After a turn, which ids the state holds. Normally a prefix of the sequence: n_past of
        them. Not known (the next turn starts over) when speculative decoding stopped in the middle
        of accepted drafts, so the trunk ran tokens that were never emitted (n_past runs past the
        sequence), or when the turn was interrupted: a Ctrl-C can land inside a forward pass, after
        some layers had already advanced their recurrent state."""
        self._history = history
        n = self.state.n_past
        self._consumed = None if interrupted or n > len(history) else history[:n]


class _Checkpoint:
    """A copy of what a state holds after `ids`: GDN and conv states, the used KV rows (trunk and
    MTP), kept where the state keeps its arrays, or in host memory with `on_host` (the server's
    cache: VRAM the placement did not plan for is not spent on it). The snapshot ring is not
    kept: it is only valid inside one speculative step.

    A trunk layer's KV rows are kept as consecutive segments of positions. A snapshot taken with
    a `base` shares the base's segments and copies only the rows after them: a turn of a long
    conversation then copies its own rows, not the whole history again. The caller guarantees
    that the state's rows below `base.n_past` are the base's, bit for bit (it restored the base,
    or took it, and has only appended since: trunk rows below n_past are never rewritten)."""

    def __init__(self, ids, n_past, mtp_n_past, ssm, conv, kv, mtp_kv):
        self.ids, self.n_past, self.mtp_n_past = ids, n_past, mtp_n_past
        self.ssm, self.conv = ssm, conv
        self.kv = kv            # layer → ((k segments), (v segments)), rows 0..n_past in order
        self.mtp_kv = mtp_kv    # layer → ((k,), (v,)): the MTP head's rows are copied whole

    @classmethod
    def take(cls, state, ids: list[int], on_host: bool = False, base: "_Checkpoint | None" = None) -> "_Checkpoint":
        def clone(a):
            if on_host:
                return _host_copy(state, a)
            out = _zeros(state, a.shape, a.dtype)
            _copy(state, out, a)
            return out

        def rows(kv, n, shared):
            out = {}
            for i, (k, v) in kv.items():
                ks, vs = shared[i] if shared else ((), ())
                start = sum(seg.shape[1] for seg in ks)
                if n > start:
                    ks, vs = (*ks, clone(k[:, start:n])), (*vs, clone(v[:, start:n]))
                out[i] = (ks, vs)
            return out
        shared = base.kv if base is not None and base.n_past <= state.n_past else None
        return cls(list(ids), state.n_past, state.mtp_n_past,
                   {i: clone(a) for i, a in state.ssm.items()}, {i: clone(a) for i, a in state.conv.items()},
                   rows(state.kv, state.n_past, shared), rows(state.mtp_kv, state.mtp_n_past, None))

    def arrays(self):
        """Every array this snapshot holds (segments shared with other snapshots included)."""
        yield from self.ssm.values()
        yield from self.conv.values()
        for kv in (self.kv, self.mtp_kv):
            for ks, vs in kv.values():
                yield from ks
                yield from vs

    def restore(self, state) -> None:
        state.reset()
        state.n_past, state.mtp_n_past = self.n_past, self.mtp_n_past
        for i in state.ssm:
            _copy(state, state.ssm[i], self.ssm[i])
            _copy(state, state.conv[i], self.conv[i])
        for saved, live in ((self.kv, state.kv), (self.mtp_kv, state.mtp_kv)):
            for i, (ks, vs) in saved.items():
                start = 0
                for k, v in zip(ks, vs):
                    stop = start + k.shape[1]
                    _copy(state, live[i][0][:, start:stop], k)
                    _copy(state, live[i][1][:, start:stop], v)
                    start = stop


# A state's arrays live on its backend (numpy arrays on the CPU, device arrays on a GPU); a state
# without one holds numpy arrays.
def _zeros(state, shape, dtype):
    backend = getattr(state, "backend", None)
    return backend.zeros(shape, dtype) if backend is not None else np.zeros(shape, dtype)


def _host_copy(state, a) -> np.ndarray:
    backend = getattr(state, "backend", None)
    if backend is None or isinstance(a, np.ndarray):
        return np.array(a)
    return backend.to_host(a)           # a device array comes down into a fresh host array


def _copy(state, dst, src) -> None:
    backend = getattr(state, "backend", None)
    if backend is not None:
        backend.copy(dst, src)
    else:
        dst[...] = src
