"""The library API: `hybrid.load(path) -> Model`. These names are stable."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from cpu import threads as cpu_threads
from cpu.threads import ThreadPolicy

from .chat_template import ChatTemplate
from .draft_memory import recall, record_path
from .draft_policy import MAX_AUTO_DEPTH, DraftPolicy
from .errors import HybridError
from .events import Done, Prefill, Token
from .forward import Forward
from .generate import PREFILL_CHUNK, generate_tokens
from .grammar import Constraint
from .kernel_prep import prepare
from .model_file import default_model_path, open_model
from .mtp import MTPHead
from .placement import CPU, DEFAULT_PCIE_SHARE, check_pcie_share, plan_for
from .reasoning import ReasoningTagger, starts_inside
from .sampling import Sampler, SamplerConfig
from .session import ChatSession
from .speculative import PENDING_MAX, generate_speculative
from .state import DEFAULT_N_CTX, SessionState
from .tokenizer import Tokenizer

DEVICES = ("cpu", "cuda", "auto")


def set_threads(threads: int | None) -> int:
    """cpu.threads.set_threads, its error as a HybridError (0 is an error, not "all cores")."""
    try:
        return cpu_threads.set_threads(threads)
    except ValueError as e:
        raise HybridError(str(e)) from None


class Model:
    """A loaded GGUF model: tokenizer, chat template, and the forward on a backend."""

    def __init__(self, path: str | os.PathLike | None = None, *, device: str = "auto",
                 threads: int | None = None, n_ctx: int | None = None, vram: str | int | None = None,
                 overrides: Sequence[str] = (), cpu_only: bool = False, cuda_graphs: bool = True,
                 expert_cache: bool = True, pcie_share: float = DEFAULT_PCIE_SHARE, split_ffn: bool = False):

        if device not in DEVICES:
            raise HybridError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        pcie_share = check_pcie_share(pcie_share)
        self.path = Path(path) if path is not None else default_model_path()
        self.threads = set_threads(threads)
        self.file = open_model(self.path)
        self.config = self.file.config
        if n_ctx is not None and n_ctx < 1:
            raise HybridError(f"context size must be ≥ 1, got {n_ctx}")
        self.n_ctx = min(n_ctx or DEFAULT_N_CTX, self.config.context_length)
        self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.file.metadata)
        # What lives on the GPU (none without one): trunk, state and lm_head first, then FFN layers.
        # A MoE model's leftover VRAM caches routed experts (expert_cache=False leaves it free).
        # the snapshot ring the default draft policy needs: planned for, and what drafting states get
        self.planned_ring = DraftPolicy.parse(None, self.has_mtp).ring
        self.plan = plan_for(self.file, device, vram, cpu_only, overrides, self.n_ctx, self.planned_ring,
                             expert_cache=expert_cache, pcie_share=pcie_share, split_ffn=split_ffn)
        self.device = self.plan.device
        if self.device == "cuda":
            self.forward = Forward(self.file, backend="gpu", placement=self.plan.side, cuda_graphs=cuda_graphs,
                                   expert_cache=self.plan.expert_cache, pcie_share=self.plan.pcie_share,
                                   stream_experts=self.plan.streams_experts, ffn_split=self.plan.ffn_split)
        else:
            self.forward = Forward(self.file)
        # a small model's decode steps run on one thread unless the user chose a count (cpu/threads.py)
        self.forward.threads = (ThreadPolicy(self.threads, self.threads) if threads is not None else
                                ThreadPolicy.for_step_bytes(self.threads, self.plan.per_token(CPU)))
        self._mtp = None
        self._idle_state = None         # see with_fresh_state
        self._depth_controller = None
        self._warm_depth = -1           # the deepest draft whose call sizes warmup() built (-1: none)

    # --- state ----------------------------------------------------------------------------
    def new_state(self, n_ctx: int | None = None):
        return self.forward.new_state(n_ctx or self.n_ctx)

    def save_state(self, state, path) -> None:
        """Write `state` to `path`, tied to this model file (see `load_state`)."""
        state.save(path, model_id=self.file.identity)

    def load_state(self, path, n_ctx: int | None = None):
        """A state saved by `save_state` with this same model file (another file of the same
        shape is refused), checked and read with bounded memory."""
        return SessionState.load(path, self.config, n_ctx, 0, self.forward.backend, model_id=self.file.identity)

    def warmup(self, max_rows: int | None = None, progress=None, draft_depth: int = 0) -> int:
        """Compile (or load from the on-disk cache) the kernels of a prompt chunk and of a decode
        step, so the first real prompt does not stall on compilation.

        max_rows: the most token rows one forward call of the job will take (its prompt, a draft
        verify step), when known: a job below 16 never meets the many-row prompt kernels
        (`cpu.matmul`), so they are not compiled for it (None: not known yet, e.g. a chat's
        prompts; a chunk of 16 rows). draft_depth: the deepest draft the job may verify; the GPU
        builds kernels per call size, so each verify and MTP size is warmed too (an auto depth
        would otherwise compile mid-run as it tries each depth). The kernels missing from the
        disk cache compile first, spread over worker processes, calling progress(done, total)
        as they do (`hybrid.kernel_prep`; never when none is missing). With CUDA graphs, the
        steps are then captured on the state the next generation (or `claim_state`) gets, so it
        replays from its first step. Returns the number of kernels compiled."""
        chunk = min(16, PREFILL_CHUNK)           # long enough for the multi-threaded prompt kernels
        if max_rows is not None:
            chunk = max(1, min(chunk, max_rows))
        gpu = self.device != "cpu"
        depth = draft_depth if gpu and self.has_mtp else 0
        forward, zeros = self.forward.forward, np.zeros

        # positions for every call below: a chunk, 3 plain steps, the verify steps' kept rows
        # (1, then 1..depth, twice), the MTP calls 1 + 2 + … + PENDING_MAX, PENDING_MAX − 1 and a chunk
        n_ctx = 2 * chunk + 3 + 2 * (1 + depth * (depth + 1) // 2) + PENDING_MAX * (PENDING_MAX + 3) // 2 + PENDING_MAX

        ring = depth + 1 if depth else 0

        def run():
            calls(self.forward.new_state(n_ctx, n_ring=ring))

        def calls(state, chunks=True):
            if chunk > 1 and chunks:
                forward(state, zeros(chunk, np.int32), logits="last")
            forward(state, zeros(1, np.int32), logits="last")
            candidates = SamplerConfig().candidates or 1
            for how in ({"pick": True}, {"top": candidates}):    # plain decoding: greedy, sampled
                forward(state, zeros(1, np.int32), logits="last", **how)
            if not depth:
                return
            # the calls of a drafting run (hybrid/speculative.py): verify steps of 1..depth+1
            # rows, picked greedily or as top logits for a sampler, each rollback to a ring slot
            # (a step of its own: all but the last row kept, so the sizes meet every slot), and
            # MTP calls of 1..PENDING_MAX rows and of a prompt chunk
            hidden = zeros((max(chunk, PENDING_MAX), self.config.n_embd), np.float32)
            for how in ({"pick": True}, {"top": candidates}):
                for n in range(1, depth + 2):
                    forward(state, zeros(n, np.int32), logits="all", snapshot=n > 1, **how)
                    if n > 1:
                        state.rollback(n - 1)
            for n in range(1, PENDING_MAX + 1):
                self.mtp.forward(state, zeros(n, np.int32), hidden[:n], logits="last", pick=True)
            for n in (PENDING_MAX - 1, chunk) if chunks else (PENDING_MAX - 1,):
                self.mtp.forward(state, zeros(n, np.int32), hidden[:n], logits="none")

        if not gpu:
            return prepare(run, progress)
        # GPU: its kernels first (host calls skipped, see GPUBackend.planning), then the CPU
        # kernels of host calls, which need real device data to run on
        backend = self.forward.backend
        done = prepare(run, progress, cuda=True, plan_context=backend.planning)
        done += prepare(run, progress, done_before=done)
        if backend.graphs.enabled and self.n_ctx >= n_ctx:
            # A step's CUDA graph is bound to the state it steps, and made on the step's second
            # run (the first is eager). Run the calls twice more on the state the next generation
            # gets (`with_fresh_state`): that generation replays from its first step, rather than
            # paying an eager run and a capture in its own time for every call size it meets.
            # (Not the prompt chunk: a prompt of exactly its rows is rare, and a prompt runs once.)
            def capture(state):
                for _ in range(2):
                    state.reset()
                    calls(state, chunks=False)
                return iter(())
            for _ in self.with_fresh_state(capture, n_ring=ring):
                pass
        self._warm_depth = max(self._warm_depth, depth)     # only once built: an interrupted warm-up runs again
        return done

    def prepare_drafting(self, depth: int, max_rows: int | None = None) -> None:
        """Before drafting up to `depth` on a GPU model: build every call size such a run may
        meet (`warmup`), once. The GPU builds kernels and graphs per call size and a drafting
        run meets its verify and MTP sizes as it goes: one first met mid-run stalls that step
        for seconds (and an auto depth's trial then looks slow). The CLI and the server warm up
        at load; `generate` and `session` call this for library users. Nothing on the CPU."""
        if self.device != "cpu" and depth > self._warm_depth:
            self.warmup(max_rows=max_rows, draft_depth=depth)

    # --- evaluation -----------------------------------------------------------------------
    def logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced logits of every position, from a fresh session: float32 (len, n_vocab)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or len(ids) == 0:
            raise HybridError("logits() needs a non-empty 1-D sequence of token ids")
        state = self.new_state(max(self.n_ctx, len(ids) + 1))
        out, _ = self.forward.forward(state, ids, logits="all")      # checks the ids are in the vocabulary
        return out

    # --- generation -----------------------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int], *, chat: bool = False,
                      system: str | None = None, reasoning: bool | None = None) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]          # the forward rejects ids outside the vocabulary
        if chat:
            return self.encode_chat_text(self.chat_prompt(prompt, system, reasoning))
        return self.tokenizer.encode(prompt)

    def encode_chat_text(self, text: str) -> list[int]:
        """Ids of a rendered chat template (its special tokens written as text)."""
        return self.tokenizer.encode(text, add_special=False, parse_special=True)

    def chat_prompt(self, prompt: str, system: str | None = None, reasoning: bool | None = None) -> str:
        """The chat template's text for one user turn (and a system message). reasoning: the
        template's enable_thinking (None leaves the template's default)."""
        messages = ([{"role": "system", "content": system}] if system else []) + \
                   [{"role": "user", "content": prompt}]
        return self.chat_template.render(messages, add_generation_prompt=True, enable_thinking=reasoning)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
                 stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
                 draft: int | str | None = None, draft_p_min: float = 0.0, ignore_eos: bool = False,
                 reasoning: bool | None = None, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                 state=None, grammar: str | None = None, **samplers) -> Iterator[Prefill | Token | Done]:
        """Stream a continuation of `prompt` (text, or token ids). Yields `Prefill` progress,
        one `Token` per generated token, and a final `Done` with the stats.

        draft: MTP draft depth per step (0 = plain decoding, "auto" = chosen from measured
        acceptance and step cost; None, the default, = auto when the model has an MTP head, as
        the CLI); draft_p_min stops a draft below that confidence. On a GPU model the first
        drafting call builds every call size drafting may meet before its prompt
        (`prepare_drafting`).

        reasoning (chat only): a thinking model's enable_thinking — True, False, or None for the
        template's default. With chat=True each Token/Done says whether it is reasoning
        (`.reasoning`, `hybrid.reasoning`); raw prompts are never tagged.
        presence_penalty / frequency_penalty: llama.cpp's, over the last repeat_last_n tokens.
        samplers: llama.cpp's other filters (`sampler_options`): typical_p, xtc_probability,
        xtc_threshold, dry_multiplier, dry_base, dry_allowed_length, dry_penalty_last_n,
        dry_sequence_breakers (strings), logit_bias ({token id: bias}).
        grammar: only tokens it allows are sampled, from the first generated one (`hybrid.grammar`:
        `json_schema_grammar(schema)`, `gbnf_grammar(text)`); drafts are verified against it too
        (a chat on a thinking model wants reasoning=False: the grammar holds in the thinking too).
        """

        if max_tokens < 0:
            raise HybridError(f"max_tokens must be ≥ 0, got {max_tokens}")
        policy = DraftPolicy.parse(draft, self.has_mtp)
        if reasoning is not None and not chat:
            raise HybridError("reasoning= applies to chat prompts (chat=True): a raw prompt has no template")
        if system is not None and not chat:
            raise HybridError("system= applies to chat prompts (chat=True): a raw prompt has no template")
        if chat and isinstance(prompt, str):      # rendered once: the ids and the reasoning tagger use it
            chat_text = self.chat_prompt(prompt, system, reasoning)
            ids = self.encode_chat_text(chat_text)
        else:
            chat_text, ids = None, self.encode_prompt(prompt)
        sampler = Sampler(SamplerConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                        seed=seed, **self.sampler_options(**samplers)))

        def tagged(events):
            return ReasoningTagger(events, starts_inside(chat_text)) if chat_text is not None else events
        constraint = Constraint(self.tokenizer, grammar) if grammar is not None else None   # fails now
        if policy.depth == 0:
            def run(state):
                return generate_tokens(self.forward, state, self.tokenizer, ids, max_tokens=max_tokens,
                                       sampler=sampler, stop=stop, n_ctx=self.n_ctx, ignore_eos=ignore_eos,
                                       constraint=constraint)
            return tagged(run(state) if state is not None else self.with_fresh_state(run))
        ring = policy.ring
        self.prepare_drafting(policy.max_depth, max_rows=len(ids))
        if state is not None and state.n_ring < ring:
            raise HybridError(f"drafting {ring - 1} tokens per step needs a state with a snapshot ring of "
                              f"≥ {ring} slots (Forward.new_state(n_ctx, n_ring={ring})); this one has {state.n_ring}")

        def run_speculative(state):
            return generate_speculative(self.forward, self.mtp, state, self.tokenizer, ids, max_tokens=max_tokens,
                                        sampler=sampler, depth=policy.depth, p_min=draft_p_min, stop=stop,
                                        n_ctx=self.n_ctx, ignore_eos=ignore_eos,
                                        controller=self.depth_controller, constraint=constraint)
        return tagged(run_speculative(state) if state is not None else self.with_fresh_state(run_speculative, ring))

    def sampler_options(self, *, typical_p: float = 1.0, xtc_probability: float = 0.0, xtc_threshold: float = 0.1,
                        dry_multiplier: float = 0.0, dry_base: float = 1.75, dry_allowed_length: int = 2,
                        dry_penalty_last_n: int = -1, dry_sequence_breakers: Sequence[str] = ("\n", ":", "\"", "*"),
                        logit_bias=None) -> dict:
        """SamplerConfig fields for llama.cpp's typical-p, XTC, DRY and logit bias (its defaults).
        DRY's sequence breakers are text: a run cannot cross a token that is one of them."""
        breakers = ()
        if dry_multiplier > 0.0:
            found = set()
            for text in dry_sequence_breakers:
                ids = self.tokenizer.encode(text, add_special=False)
                if len(ids) == 1:
                    found.add(int(ids[0]))
            breakers = tuple(sorted(found))
        bias = tuple(sorted((int(t), float(b)) for t, b in dict(logit_bias or {}).items()))
        return dict(typical_p=typical_p, xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                    dry_multiplier=dry_multiplier, dry_base=dry_base, dry_allowed_length=dry_allowed_length,
                    dry_penalty_last_n=dry_penalty_last_n, dry_breakers=breakers, logit_bias=bias)

    @property
    def depth_controller(self):
        """The auto depth's controller, kept for the model's lifetime: step costs and acceptance
        learnt in one generation carry to the next (a chat, a server, a benchmark's rounds), and
        from one process to the next on the same model file and placement (hybrid/draft_memory.py)."""
        if self._depth_controller is None:
            # what the last process on this model file and placement learnt (hybrid/draft_memory.py)
            where = record_path(self.file.identity, self.device, self.plan.per_token(CPU), self.plan.vram_used,
                                self.forward.threads, MAX_AUTO_DEPTH)
            self._depth_controller = recall(where, MAX_AUTO_DEPTH)
        return self._depth_controller

    def claim_state(self, n_ctx: int, n_ring: int):
        """An empty state for a caller that keeps it (a chat session, the server's engine): the one
        `with_fresh_state` would hand out next, the warm-up's captured steps bound to it, where it
        has that context and at least that ring (the first turn then replays them), else a new one."""
        state = self._kept_state(n_ctx, n_ring)
        return state if state is not None else self.forward.new_state(n_ctx, n_ring=n_ring)

    def _kept_state(self, n_ctx: int, n_ring: int):
        """The state kept for reuse, reset and no longer kept, if it has that context and at least
        that ring; else None (and it stays kept)."""
        state = self._idle_state
        if state is None or state.n_ctx != n_ctx or state.n_ring < n_ring:
            return None
        self._idle_state = None
        state.reset()
        return state

    def with_fresh_state(self, run, n_ring: int = 0):
        """Iterate run(state) over an empty state of this model's context. The state is kept for
        the next call once the iteration ends (reset, not reallocated): its device buffers stay
        put, so the steps the GPU backend captured as CUDA graphs in one generation replay in
        the next instead of being launched and captured again. A state still in use by an
        unfinished iteration is never handed out twice. A kept state with a larger snapshot ring
        than asked serves too (a depth-0 run after a drafting one keeps the same buffers)."""
        state = self._kept_state(self.n_ctx, n_ring)
        if state is None:
            self._idle_state = None     # replaced: its buffers go before the new ones are made
            # a drafting state gets the ring the plan made room for (the default depth's), so
            # runs at other depths reuse it and the steps captured with it
            state = self.forward.new_state(self.n_ctx, n_ring=max(n_ring, self.planned_ring) if n_ring else 0)
        try:
            yield from run(state)
        finally:
            self._idle_state = state

    def session(self, system: str | None = None, n_ctx: int | None = None, draft: int | str | None = None,
                draft_p_min: float = 0.0, reasoning: bool | None = None):
        """A multi-turn chat that keeps its state between turns, so each `send` prefills only the
        new tokens (a `hybrid.session.ChatSession`). draft/draft_p_min/reasoning as for `generate`."""
        return ChatSession(self, system=system, n_ctx=n_ctx, draft=draft, draft_p_min=draft_p_min,
                           reasoning=reasoning)

    @property
    def has_mtp(self) -> bool:
        return self.config.n_nextn > 0

    @property
    def mtp(self):
        """The MTP draft head (HybridError if the model has none)."""
        if self._mtp is None:
            self._mtp = MTPHead(self.forward)
        return self._mtp

    def mtp_logits(self, token_ids: Sequence[int]) -> np.ndarray:
        """Teacher-forced MTP logits: row p = the head on (x_p at position p, trunk hidden h_{p−1},
        zeros for p = 0), so row p's argmax is the draft for x_{p+1}. float32 (len, n_vocab)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        if ids.ndim != 1 or len(ids) == 0:
            raise HybridError("mtp_logits() needs a non-empty 1-D sequence of token ids")
        mtp = self.mtp
        state = self.new_state(max(self.n_ctx, len(ids) + 1))
        _, hidden = self.forward.forward(state, ids, logits="none")
        h_prev = np.concatenate([np.zeros((1, self.config.n_embd), np.float32), hidden[:-1]])
        out, _ = mtp.forward(state, ids, h_prev, logits="all")
        return out


def load(path: str | os.PathLike | None = None, device: str = "auto", threads: int | None = None,
         n_ctx: int | None = None, vram: str | int | None = None, overrides: Sequence[str] = (),
         cpu_only: bool = False, cuda_graphs: bool = True, expert_cache: bool = True,
         pcie_share: float = DEFAULT_PCIE_SHARE, split_ffn: bool = False) -> Model:
    """Open a GGUF model (the bundled tiny model when `path` is None).

    device "auto" uses a GPU when one is present (trunk and lm_head there, FFN streamed on the
    CPU as the VRAM budget `vram` allows); `overrides` are llama.cpp-style "REGEX=CPU|GPU" rules.
    cuda_graphs=False launches every GPU kernel from Python instead of replaying captured steps.
    expert_cache: a MoE model copies as many routed experts per layer as the VRAM left over
    holds to the GPU, which runs those when a token selects them (False: all stay on the CPU).
    pcie_share: of the routed experts a token picks that are not cached, the share the GPU fetches
    from host memory over PCIe while the CPU runs the rest (0: the CPU runs them all).
    split_ffn: a dense model's FFN layers that do not all fit the VRAM are cut in two, the GPU
    computing each one's first hidden rows while the CPU computes the rest (False: whole layers).
    """
    return Model(path, device=device, threads=threads, n_ctx=n_ctx, vram=vram, overrides=overrides,
                 cpu_only=cpu_only, cuda_graphs=cuda_graphs, expert_cache=expert_cache, pcie_share=pcie_share,
                 split_ffn=split_ffn)
