"""Which drafted tokens a verify pass keeps.

The verifier's logits at row i (after [last, d1..di]) decide position i+1. A draft d_{i+1}
is kept while it is what the target itself would emit there:
* greedy: d_{i+1} == the sampler's greedy choice at row i (lossless by construction);
* sampling: the standard speculative-sampling rule with a deterministic (argmax) draft, so
  q = one-hot(d): keep d with probability p_i(d); on rejection draw from p_i with d removed
  and renormalised. Every emitted token is then distributed as the target's sampler says.
Either way the step ends with one token drawn from the target (the correction, or the
bonus after a full accept), so each verify pass emits accepted + 1 tokens.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np


def accept_drafts(logits, drafts: Sequence[int], sampler, history: list[int]) -> list[int]:
    """Tokens to emit from one verify pass: the kept drafts, then one target token.

    logits: the len(drafts) + 1 verifier rows ((n, n_vocab) floats, or a `TopLogits` per row);
    `history` (the tokens so far) is only read — the caller appends what it emits. Uses
    `sampler.config.greedy` to pick the rule.
    """
    emitted: list[int] = []
    seen = list(history)
    greedy = sampler.config.greedy
    for i, d in enumerate(drafts):
        if greedy:
            choice = sampler.sample(logits[i], seen)
            if choice != d:
                emitted.append(choice)
                return emitted
        else:
            ids, p = sampler.distribution(logits[i], seen)
            if sampler.rng.random() >= p[ids == d].sum():
                emitted.append(_draw_without(ids, p, d, sampler.rng))
                return emitted
        emitted.append(int(d))
        seen.append(int(d))
    emitted.append(sampler.sample(logits[len(drafts)], seen))
    return emitted


def accept_greedy(picked: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """`accept_drafts` for an argmax-only sampler, from the verifier rows' greedy picks
    (`Picks.ids`): the drafts that equal the pick before them, then the next pick."""
    emitted: list[int] = []
    for i, d in enumerate(drafts):
        if int(picked[i]) != d:
            break
        emitted.append(int(d))
    emitted.append(int(picked[len(emitted)]))
    return emitted


def _draw_without(ids: np.ndarray, p: np.ndarray, d: int, rng: np.random.Generator) -> int:
    """Draw from the distribution (ids, p) with token d removed (the residual
    max(0, p − one_hot(d)), renormalised), over the ids in ascending order."""
    order = np.argsort(ids)
    ids, r = ids[order], p[order].astype(np.float64)
    r[ids == d] = 0.0
    total = r.sum()
    if total <= 0.0:          # p was one-hot on d yet d was rejected: only possible through rounding
        return int(d)
    return int(ids[rng.choice(len(r), p=r / total)])
