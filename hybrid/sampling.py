"""Next-token sampling as llama.cpp's default chain, and stop-string handling for streamed text.

Order (llama.cpp common sampler): logit bias -> penalties -> DRY -> top-k -> typical-p -> top-p ->
min-p -> XTC -> temperature -> draw. Typical-p, top-p, min-p and XTC therefore see the untempered
logits, and their probabilities are taken over the top-k survivors only. `probs` returns the distribution the draw uses, so speculative decoding can
compare a draft against exactly what `sample` would do.

The draw is seeded by position: the token at position n (n tokens before it: context, prompt and
what was generated) takes the uniform `position_uniform(seed, n)` and inverts the distribution's
CDF in its fixed token order. No state is carried from one draw to the next, so a token depends
only on the seed, its position and its logits: the same seed gives the same text however the
tokens were produced (plain decoding, or drafts verified several at a time).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import numpy as np

from cpu.argmax import MAX_EXACT_ID, PICK_ID, PICK_MAX, PICK_P
from cpu.top_logits import MAX_CANDIDATES

from .errors import HybridError


@dataclass(frozen=True)
class SamplerConfig:
    """llama.cpp's defaults. temperature <= 0 means greedy (argmax after the penalties);
    top_k <= 0, top_p >= 1 and min_p <= 0 switch those filters off; repeat_last_n = -1 penalises
    the whole history and 0 none of it."""
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    frequency_penalty: float = 0.0   # llama.cpp's, off by default: minus count * this
    presence_penalty: float = 0.0    # minus this once for any token seen
    seed: int | None = None
    typical_p: float = 1.0           # locally typical sampling (1.0 = off)
    xtc_probability: float = 0.0     # XTC: chance of cutting the most likely tokens (0 = off)
    xtc_threshold: float = 0.1       # XTC: the tokens at or above this probability, all but the least likely
    dry_multiplier: float = 0.0      # DRY: penalty scale for tokens that extend a repeated run (0 = off)
    dry_base: float = 1.75
    dry_allowed_length: int = 2      # runs up to this long go unpunished
    dry_penalty_last_n: int = -1     # how far back DRY looks (-1 = the whole history)
    dry_breakers: tuple = ()         # token ids a repeated run cannot cross
    logit_bias: tuple = ()           # ((token id, added to its logit), …); -inf bans a token

    def __post_init__(self):
        problems = []
        if not math.isfinite(self.temperature):
            problems.append(f"temperature must be a finite number, not {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:
            problems.append(f"top_p must be in [0, 1], not {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            problems.append(f"min_p must be in [0, 1], not {self.min_p}")
        if not self.repeat_penalty > 0.0:
            problems.append(f"repeat_penalty must be > 0, not {self.repeat_penalty}")
        if self.repeat_last_n < -1:
            problems.append(f"repeat_last_n must be -1 (all), 0 (off) or positive, not {self.repeat_last_n}")
        if self.seed is not None and self.seed < 0:
            problems.append(f"seed must be >= 0, not {self.seed}")
        if not 0.0 <= self.typical_p <= 1.0:
            problems.append(f"typical_p must be in [0, 1], not {self.typical_p}")
        if not 0.0 <= self.xtc_probability <= 1.0:
            problems.append(f"xtc_probability must be in [0, 1], not {self.xtc_probability}")
        if self.dry_multiplier < 0 or self.dry_base < 1.0 or self.dry_allowed_length < 1 or self.dry_penalty_last_n < -1:
            problems.append("DRY needs multiplier ≥ 0, base ≥ 1, allowed length ≥ 1 and last-n ≥ -1")
        if problems:
            raise HybridError("bad sampling settings: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def argmax_only(self) -> bool:
        """Greedy with no penalty: the sample is the first maximum of the raw logits, so the
        forward's on-device picks (`Picks`) serve and the logits need not come to the host."""
        return self.greedy and not self.penalizes and not self.rewrites_logits

    @property
    def rewrites_logits(self) -> bool:
        """Logit bias or DRY: they may move any token's logit, so the whole row matters."""
        return bool(self.logit_bias) or self.dry_multiplier > 0.0

    @property
    def penalizes(self) -> bool:
        return self.repeat_last_n != 0 and not (
            self.repeat_penalty == 1.0 and self.frequency_penalty == 0.0 and self.presence_penalty == 0.0)

    @property
    def candidates(self) -> int | None:
        """How many of a row's best logits decide a sample (the forward's `top=`, so the row
        need not come to the host), or None when the whole row may matter.

        Top-k keeps top_k of them (1 when greedy). A penalty that can only lower logits, over a
        window of at most repeat_last_n distinct tokens, can push at most that many of the best
        below the kth place, so top_k + repeat_last_n of the raw row cover the penalised top_k.
        Without top-k, or with a penalty that may raise a logit or spans the whole history,
        any token may win."""
        keep = 1 if self.greedy else self.top_k
        if keep <= 0 or self.rewrites_logits:
            return None
        if self.penalizes:
            lowers_only = (self.repeat_penalty >= 1.0 and self.frequency_penalty >= 0.0
                           and self.presence_penalty >= 0.0)
            if not lowers_only or self.repeat_last_n < 0:
                return None
            keep += self.repeat_last_n
        return keep if keep <= MAX_CANDIDATES else None


class Picks(NamedTuple):
    """Greedy picks of logit rows (`ops.argmax_rows`): the first maximum of each row and its
    softmax probability (a draft's confidence)."""
    ids: np.ndarray          # int64 (n,)
    top_p: np.ndarray        # float32 (n,)

    @classmethod
    def of(cls, picks: np.ndarray) -> "Picks":
        """From argmax_rows' (n, 3) array; raises where the sampler would on those logits."""
        best = picks[:, PICK_MAX]
        if np.isnan(best).any():
            raise HybridError("the logits contain NaN: the model produced invalid numbers")
        if np.isneginf(best).any():
            raise HybridError("every token is masked out (all logits are -inf)")
        return cls(picks[:, PICK_ID].astype(np.int64), picks[:, PICK_P].copy())

    @staticmethod
    def check_vocab(n_vocab: int) -> None:
        if n_vocab >= MAX_EXACT_ID:
            raise HybridError(f"a vocabulary of {n_vocab} tokens is too large for on-device picks "
                              f"(ids are carried as float32): ask for logits instead")


class TopLogits(NamedTuple):
    """A row's best logits (`ops.top_logits`), the rest of the row left out; ids ascending.
    The sampler takes it wherever it takes a row, when `SamplerConfig.candidates` says those
    entries decide the sample."""
    ids: np.ndarray          # int64 (C,)
    logits: np.ndarray       # float32 (C,)
    n_vocab: int

    @staticmethod
    def count(candidates: int, n_vocab: int) -> int:
        return min(candidates, n_vocab)

    @classmethod
    def rows(cls, got: np.ndarray, n_vocab: int) -> list["TopLogits"]:
        """From top_logits' (n, 2C) output (ids, then float32 bits; read as float32 here)."""
        words = np.ascontiguousarray(got).view(np.uint32)
        C = words.shape[1] // 2
        rows = []
        for r in words:
            ids = r[:C].astype(np.int64)
            order = np.argsort(ids)
            rows.append(cls(ids[order], r[C:].view(np.float32)[order], n_vocab))
        return rows


def position_uniform(seed: int, position: int) -> float:
    """The uniform in [0, 1) that the draw at `position` inverts: the first 53 bits of the
    position-th child of SeedSequence(seed) (numpy's hash for independent streams from one
    seed), so draws at different positions are independent and none depends on another."""
    word = np.random.SeedSequence(seed, spawn_key=(position,)).generate_state(1, np.uint64)[0]
    return float(word >> np.uint64(11)) * 2.0 ** -53


class Sampler:
    """Draws token ids from logits, the token at position n with `position_uniform(seed, n)`:
    same seed and logits -> same tokens, however many are sampled per call or step."""

    def __init__(self, config: SamplerConfig | None = None):
        self.config = config or SamplerConfig()
        # No seed: one random seed for this sampler's whole sequence, so it stays consistent
        # across drafting steps like a given seed does.
        self.seed = self.config.seed if self.config.seed is not None else np.random.SeedSequence().entropy

    def sample(self, logits, history: Sequence[int] = ()) -> int:
        """A token id from a logit row (float32 (n_vocab,)) or its `TopLogits`, for the position
        after `history` (len(history) tokens before it)."""
        ids, x = self._penalized(logits, history)
        if self.config.greedy:
            return _id(ids, int(np.argmax(x)))  # first maximum: lowest id on ties
        ids, p = self._distribution(ids, x, len(history))
        cdf = np.cumsum(p)
        u = position_uniform(self.seed, len(history))
        k = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
        return int(ids[min(k, len(ids) - 1)])

    def distribution(self, logits, history: Sequence[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) that `sample` draws from, ids by falling logit: the tokens it can
        emit, one with probability 1 when greedy."""
        ids, x = self._penalized(logits, history)
        if self.config.greedy:
            return np.array([_id(ids, int(np.argmax(x)))]), np.ones(1)
        return self._distribution(ids, x, len(history))

    def probs(self, logits, history: Sequence[int] = ()) -> np.ndarray:
        """float32[n_vocab]: `distribution` spread over the vocabulary."""
        n_vocab = logits.n_vocab if isinstance(logits, TopLogits) else np.asarray(logits).size
        ids, p = self.distribution(logits, history)
        out = np.zeros(n_vocab, dtype=np.float32)
        out[ids] = p
        return out

    # --- the chain ----------------------------------------------------------------------
    def _penalized(self, logits, history: Sequence[int]) -> tuple[np.ndarray | None, np.ndarray]:
        """(ids, x): x a float64 copy of the row's logits after the penalties (the caller's stay),
        ids the vocabulary id of each entry of x (None: x is the whole row, entry i is id i)."""
        if isinstance(logits, TopLogits):
            ids, n_vocab = logits.ids, logits.n_vocab
            x = np.array(logits.logits, dtype=np.float64)
        else:
            x = np.array(logits, dtype=np.float64).reshape(-1)
            ids, n_vocab = None, x.size
        if x.size == 0:
            raise HybridError("cannot sample from empty logits")
        if np.isnan(x).any():
            raise HybridError("the logits contain NaN: the model produced invalid numbers")
        if np.isneginf(x).all():
            raise HybridError("every token is masked out (all logits are -inf)")
        c = self.config
        if c.logit_bias:
            for tok, bias in c.logit_bias:
                if not 0 <= tok < n_vocab:
                    raise HybridError(f"logit bias for token {tok}, outside the vocabulary of {n_vocab}")
                at = tok if ids is None else int(np.searchsorted(ids, tok))
                if ids is None or (at < ids.size and ids[at] == tok):
                    x[at] += bias
            if np.isneginf(x).all():
                raise HybridError("every token is masked out (the logit bias bans them all)")
        if c.dry_multiplier > 0.0 and len(history) > 0:
            for tok, penalty in dry_penalties(history, c).items():
                at = tok if ids is None else int(np.searchsorted(ids, tok))
                if 0 <= tok < n_vocab and (ids is None or (at < ids.size and ids[at] == tok)):
                    x[at] -= penalty
        if len(history) == 0 or not c.penalizes:        # penalizes: a window of at least one token
            return ids, x
        n_last = len(history) if c.repeat_last_n == -1 else c.repeat_last_n
        seen, counts = np.unique(np.asarray(history[-n_last:], dtype=np.int64), return_counts=True)
        if seen[0] < 0 or seen[-1] >= n_vocab:
            raise HybridError(f"history holds a token id outside the vocabulary of {n_vocab}")
        at = seen
        if ids is not None:    # the seen tokens among the entries; the others cannot win anyway
            at = np.minimum(np.searchsorted(ids, seen), ids.size - 1)
            present = ids[at] == seen
            at, counts = at[present], counts[present]
        v = x[at]
        # Dividing a negative logit would raise its probability: llama.cpp multiplies those.
        v = np.where(v <= 0.0, v * c.repeat_penalty, v / c.repeat_penalty)
        x[at] = v - counts * c.frequency_penalty - c.presence_penalty
        return ids, x

    def _distribution(self, ids: np.ndarray | None, x: np.ndarray,
                      position: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(ids, probabilities) after top-k, typical-p, top-p, min-p, XTC and temperature, ids by
        falling logit. XTC's coin is drawn from (seed, position), apart from the token's own draw."""
        c = self.config
        at = _top_k(x, c.top_k)
        at = at[:max(1, int(np.count_nonzero(x[at] > -np.inf)))]   # banned (-inf) tokens: last, and out
        v = x[at]
        if c.typical_p < 1.0 and v.size > 1:
            keep = _typical(v, c.typical_p)
            at, v = at[keep], v[keep]
        if c.top_p < 1.0:
            cum = np.cumsum(_softmax(v))
            # The smallest prefix whose mass reaches top_p (at least one token).
            v = v[:min(int(np.searchsorted(cum, c.top_p, side="left")) + 1, v.size)]
        if c.min_p > 0.0:
            # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p); v is sorted, so a prefix.
            v = v[:max(1, int(np.count_nonzero(v >= v[0] + math.log(c.min_p))))]
        at = at[:v.size]
        if c.xtc_probability > 0.0 and c.xtc_threshold <= 0.5 and v.size > 1 \
                and xtc_uniform(self.seed, position) < c.xtc_probability:
            cut = _xtc_cut(v, c.xtc_threshold)
            at, v = at[cut:], v[cut:]
        return (at if ids is None else ids[at]), _softmax(v / c.temperature)


def xtc_uniform(seed: int, position: int) -> float:
    """XTC's coin at `position`: a stream apart from the draw's (`position_uniform`)."""
    word = np.random.SeedSequence(seed, spawn_key=(position, 1)).generate_state(1, np.uint64)[0]
    return float(word >> np.uint64(11)) * 2.0 ** -53


def _typical(v: np.ndarray, mass: float) -> np.ndarray:
    """Locally typical sampling (llama.cpp's typical_p): order the tokens by how far their
    surprise -log p is from the entropy, keep the closest until their mass exceeds `mass`.
    Returns the kept indices of v in v's order (falling logit)."""
    p = _softmax(v)
    logp = np.log(np.maximum(p, 1e-300))
    entropy = -np.sum(p * logp)
    order = np.argsort(np.abs(-logp - entropy), kind="stable")
    cum = np.cumsum(p[order])
    n = min(int(np.searchsorted(cum, mass, side="right")) + 1, v.size)
    return np.sort(order[:n])


def _xtc_cut(v: np.ndarray, threshold: float) -> int:
    """XTC: how many of the most likely tokens to drop: all of those at or above `threshold`
    probability but the least likely of them (none when fewer than two reach it)."""
    above = int(np.count_nonzero(_softmax(v) >= threshold))
    return above - 1 if above >= 2 else 0


def dry_penalties(history: Sequence[int], c: SamplerConfig) -> dict[int, float]:
    """DRY (llama.cpp's "don't repeat yourself"): for each earlier place the text's last tokens
    already occurred, the token that followed them there would extend the repeat. Its run length
    is how many tokens before it match the end of the history (not crossing a breaker token); a
    run at least `dry_allowed_length` long costs multiplier × base^(length − allowed_length),
    the longest run per token counting."""
    h = list(history if c.dry_penalty_last_n == -1 else history[-c.dry_penalty_last_n:]) \
        if c.dry_penalty_last_n != 0 else []
    n = len(h)
    breakers = set(c.dry_breakers)
    if n < 2 or h[-1] in breakers:
        return {}
    longest: dict[int, int] = {}
    for j in range(1, n):            # h[j] followed h[:j]; does h[:j] end like h does?
        k = 0
        while k < j and h[j - 1 - k] == h[n - 1 - k] and h[j - 1 - k] not in breakers:
            k += 1
        if k and h[j] not in breakers:
            longest[h[j]] = max(longest.get(h[j], 0), k)
    return {tok: c.dry_multiplier * c.dry_base ** (k - c.dry_allowed_length)
            for tok, k in longest.items() if k >= c.dry_allowed_length}


def _id(ids: np.ndarray | None, at: int) -> int:
    return at if ids is None else int(ids[at])


def _top_k(x: np.ndarray, k: int) -> np.ndarray:
    """Indices of the k largest logits (all ids when k <= 0), sorted by falling logit, lowest id first
    among equals — so the kth place is decided deterministically on ties."""
    n = x.size
    if 0 < k < n:
        kth_largest = np.partition(x, n - k)[n - k]
        candidates = np.flatnonzero(x >= kth_largest)
    else:
        candidates = np.arange(n)
    order = np.argsort(-x[candidates], kind="stable")  # stable: candidates are in id order
    return candidates[order][:k] if k > 0 else candidates[order]


def _softmax(v: np.ndarray) -> np.ndarray:
    e = np.exp(v - v.max())
    return e / e.sum()


class StopStep(NamedTuple):
    text: str        # safe to show now
    stopped: bool    # a stop string was hit: generation should end


class StopChecker:
    """Watches streamed text for stop strings. Text that could still become the start of a stop
    string is held back; on a hit, the text before the stop string is released and the stop
    string itself never is."""

    def __init__(self, stop_strings: Iterable[str]):
        self.stop_strings = tuple(s for s in stop_strings if s)  # "" would stop at once
        self.stopped = False
        self.matched: str | None = None  # the stop string that was hit
        self._held = ""

    def push(self, text: str) -> StopStep:
        if self.stopped:
            return StopStep("", True)
        buffer = self._held + text
        hit = min(((buffer.find(s), s) for s in self.stop_strings if s in buffer), default=None)
        if hit is not None:
            at, self.matched = hit
            self.stopped, self._held = True, ""
            return StopStep(buffer[:at], True)
        keep = max((_overlap(buffer, s) for s in self.stop_strings), default=0)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return StopStep(buffer[:len(buffer) - keep], False)

    def flush(self) -> str:
        """The held-back text, once generation ended without a stop string."""
        held, self._held = ("" if self.stopped else self._held), ""
        return held


def _overlap(text: str, stop: str) -> int:
    """Length of the longest proper prefix of `stop` that `text` ends with."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
