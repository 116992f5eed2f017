"""The library API: `hybrid.load(path) -> Model`. These names are stable."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator, Sequence

import numpy as np

from .errors import HybridError
from .events import Done, Prefill, Token
from .model_file import default_model_path, open_model
from .placement import DEFAULT_PCIE_SHARE, check_pcie_share
from .sampling import Sampler, SamplerConfig

DEVICES = ("cpu", "cuda", "auto")


def default_threads() -> int:
    """All cores this process may use: the CPU FFN is bandwidth-bound and wants every one."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def set_threads(threads: int | None) -> int:
    import numba
    n = threads or default_threads()
    if n < 1:
        raise HybridError(f"threads must be ≥ 1, got {n}")
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    numba.set_num_threads(n)
    return n


class Model:
    """A loaded GGUF model: tokenizer, chat template, and the forward on a backend."""

    def __init__(self, path: str | os.PathLike | None = None, *, device: str = "auto",
                 threads: int | None = None, n_ctx: int | None = None, vram: str | int | None = None,
                 overrides: Sequence[str] = (), cpu_only: bool = False, cuda_graphs: bool = True,
                 expert_cache: bool = True, pcie_share: float = DEFAULT_PCIE_SHARE):
        from .chat_template import ChatTemplate
        from .forward import Forward
        from .placement import plan_for, ring_for_draft
        from .tokenizer import Tokenizer

        if device not in DEVICES:
            raise HybridError(f"unknown device {device!r}; choose one of {', '.join(DEVICES)}")
        pcie_share = check_pcie_share(pcie_share)
        self.path = Path(path) if path is not None else default_model_path()
        self.threads = set_threads(threads)
        self.file = open_model(self.path)
        self.config = self.file.config
        if n_ctx is not None and n_ctx < 1:
            raise HybridError(f"context size must be ≥ 1, got {n_ctx}")
        self.n_ctx = min(n_ctx or 4096, self.config.context_length)
        self.tokenizer = Tokenizer.from_metadata(self.file.metadata)
        self.chat_template = ChatTemplate.from_metadata(self.file.metadata)
        # What lives on the GPU (none without one): trunk, state and lm_head first, then FFN layers.
        # A MoE model's leftover VRAM caches routed experts (expert_cache=False leaves it free).
        self.plan = plan_for(self.file, device, vram, cpu_only, overrides, self.n_ctx,
                             ring_for_draft(None, self.has_mtp), expert_cache=expert_cache, pcie_share=pcie_share)
        self.device = self.plan.device
        if self.device == "cuda":
            self.forward = Forward(self.file, backend="gpu", placement=self.plan.side, cuda_graphs=cuda_graphs,
                                   expert_cache=self.plan.expert_cache, pcie_share=self.plan.pcie_share)
        else:
            self.forward = Forward(self.file)
        self._mtp = None
        self._idle_state = None         # see with_fresh_state

    # --- state ----------------------------------------------------------------------------
    def new_state(self, n_ctx: int | None = None):
        return self.forward.new_state(n_ctx or self.n_ctx)

    def warmup(self) -> None:
        """Compile (or load from the on-disk cache) the kernels of a prompt chunk and of a decode
        step, so the first real prompt does not stall on compilation."""
        from .generate import PREFILL_CHUNK
        chunk = min(16, PREFILL_CHUNK)           # long enough for the multi-threaded prompt kernels
        state = self.new_state(chunk + 2)
        self.forward.forward(state, np.zeros(chunk, dtype=np.int32), logits="last")
        self.forward.forward(state, np.zeros(1, dtype=np.int32), logits="last")

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
                      system: str | None = None) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]          # the forward rejects ids outside the vocabulary
        if chat:
            messages = ([{"role": "system", "content": system}] if system else []) + \
                       [{"role": "user", "content": prompt}]
            text = self.chat_template.render(messages, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special=False, parse_special=True)
        return self.tokenizer.encode(prompt)

    def generate(self, prompt: str | Sequence[int], *, max_tokens: int = 128,
                 temperature: float = 0.8, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05,
                 repeat_penalty: float = 1.0, repeat_last_n: int = 64, seed: int | None = None,
                 stop: Sequence[str] = (), chat: bool = False, system: str | None = None,
                 draft: int | str = 0, draft_p_min: float = 0.0, ignore_eos: bool = False,
                 state=None) -> Iterator[Prefill | Token | Done]:
        """Stream a continuation of `prompt` (text, or token ids). Yields `Prefill` progress,
        one `Token` per generated token, and a final `Done` with the stats.

        draft: MTP draft depth per step (0 = plain decoding, "auto" = chosen from measured
        acceptance and step cost); draft_p_min stops a draft below that confidence.
        """
        from .generate import generate_tokens
        from .speculative import AUTO, MAX_AUTO_DEPTH, generate_speculative

        if max_tokens < 0:
            raise HybridError(f"max_tokens must be ≥ 0, got {max_tokens}")
        depth = parse_draft(draft)
        ids = self.encode_prompt(prompt, chat=chat, system=system)
        sampler = Sampler(SamplerConfig(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                        repeat_penalty=repeat_penalty, repeat_last_n=repeat_last_n,
                                        seed=seed))
        if depth == 0:
            def run(state):
                return generate_tokens(self.forward, state, self.tokenizer, ids, max_tokens=max_tokens,
                                       sampler=sampler, stop=stop, n_ctx=self.n_ctx, ignore_eos=ignore_eos)
            return run(state) if state is not None else self.with_fresh_state(run)
        ring = (MAX_AUTO_DEPTH if depth == AUTO else depth) + 1
        if state is not None and state.n_ring < ring:
            raise HybridError(f"drafting {ring - 1} tokens per step needs a state with a snapshot ring of "
                              f"≥ {ring} slots (Forward.new_state(n_ctx, n_ring={ring})); this one has {state.n_ring}")

        def run_speculative(state):
            return generate_speculative(self.forward, self.mtp, state, self.tokenizer, ids, max_tokens=max_tokens,
                                        sampler=sampler, depth=depth, p_min=draft_p_min, stop=stop,
                                        n_ctx=self.n_ctx, ignore_eos=ignore_eos)
        return run_speculative(state) if state is not None else self.with_fresh_state(run_speculative, ring)

    def with_fresh_state(self, run, n_ring: int = 0):
        """Iterate run(state) over an empty state of this model's context. The state is kept for
        the next call once the iteration ends (reset, not reallocated): its device buffers stay
        put, so the steps the GPU backend captured as CUDA graphs in one generation replay in
        the next instead of being launched and captured again. A state still in use by an
        unfinished iteration is never handed out twice."""
        state, self._idle_state = self._idle_state, None
        if state is None or state.n_ring != n_ring:
            state = self.forward.new_state(self.n_ctx, n_ring=n_ring)
        else:
            state.reset()
        try:
            yield from run(state)
        finally:
            self._idle_state = state

    def session(self, system: str | None = None, n_ctx: int | None = None, draft: int | str = 0,
                draft_p_min: float = 0.0):
        """A multi-turn chat that keeps its state between turns, so each `send` prefills only the
        new tokens (a `hybrid.session.ChatSession`). draft/draft_p_min as for `generate`."""
        from .session import ChatSession
        return ChatSession(self, system=system, n_ctx=n_ctx, draft=draft, draft_p_min=draft_p_min)

    @property
    def has_mtp(self) -> bool:
        return self.config.n_nextn > 0

    @property
    def mtp(self):
        """The MTP draft head (HybridError if the model has none)."""
        if self._mtp is None:
            from .mtp import MTPHead
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


def parse_draft(draft: int | str) -> int:
    """Draft depth from an int or "auto" (→ speculative.AUTO)."""
    from .speculative import AUTO
    if isinstance(draft, str):
        if draft.strip().lower() == "auto":
            return AUTO
        try:
            draft = int(draft)
        except ValueError:
            raise HybridError(f"draft depth must be a number ≥ 0 or 'auto', got {draft!r}") from None
    if draft < 0 or draft > 16:
        raise HybridError(f"draft depth must be between 0 and 16 (or 'auto'), got {draft}")
    return int(draft)


def load(path: str | os.PathLike | None = None, device: str = "auto", threads: int | None = None,
         n_ctx: int | None = None, vram: str | int | None = None, overrides: Sequence[str] = (),
         cpu_only: bool = False, cuda_graphs: bool = True, expert_cache: bool = True,
         pcie_share: float = DEFAULT_PCIE_SHARE) -> Model:
    """Open a GGUF model (the bundled tiny model when `path` is None).

    device "auto" uses a GPU when one is present (trunk and lm_head there, FFN streamed on the
    CPU as the VRAM budget `vram` allows); `overrides` are llama.cpp-style "REGEX=CPU|GPU" rules.
    cuda_graphs=False launches every GPU kernel from Python instead of replaying captured steps.
    expert_cache: a MoE model copies as many routed experts per layer as the VRAM left over
    holds to the GPU, which runs those when a token selects them (False: all stay on the CPU).
    pcie_share: of the routed experts a token picks that are not cached, the share the GPU fetches
    from host memory over PCIe while the CPU runs the rest (0: the CPU runs them all).
    """
    return Model(path, device=device, threads=threads, n_ctx=n_ctx, vram=vram, overrides=overrides,
                 cpu_only=cpu_only, cuda_graphs=cuda_graphs, expert_cache=expert_cache, pcie_share=pcie_share)
