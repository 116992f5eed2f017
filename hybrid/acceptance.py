"""Which drafted tokens a verify pass keeps.

The verifier's logits at row i (after [last, d1..di]) decide position i+1. A draft d_{i+1}
is kept iff it equals the token the target's sampler emits there itself — its greedy choice,
or its seeded draw at that position (`Sampler.sample`, whose randomness is a function of the
seed and the position only). On a mismatch that token is emitted instead and the step ends.

Why this is exact when sampling: the draft is deterministic (argmax), so q = one-hot(d). The
target's draw s at a position is distributed as p; the draft is kept iff s == d, with
probability p(d), and a rejection emits s given s != d, i.e. p with d removed and renormalised
— the law of the standard speculative-sampling rule. More than that, every emitted token is
the very token plain decoding emits at that position with that seed, so the text does not
depend on how many drafts each step made.

Each verify pass emits accepted + 1 tokens: the kept drafts, then the target's own token
(the correction, or the bonus after a full accept).
"""
from __future__ import annotations

from typing import Sequence


def accept_drafts(logits, drafts: Sequence[int], sampler, history: list[int], constraint=None) -> list[int]:
    """Tokens to emit from one verify pass: the kept drafts, then one target token.

    logits: the len(drafts) + 1 verifier rows ((n, n_vocab) floats, or a `TopLogits` per row);
    `history` (the tokens so far) is only read — the caller appends what it emits.
    constraint (`hybrid.grammar.Constraint`, whole rows): each row is masked by the grammar's
    state after the tokens emitted before it, and told the token drawn there, so the grammar sees
    exactly the emitted tokens, as in plain decoding; nothing follows the token that ends it.
    """
    emitted: list[int] = []
    seen = list(history)
    for i in range(len(drafts) + 1):
        if constraint is None:
            choice = sampler.sample(logits[i], seen)
        else:
            choice = constraint.sample(sampler, logits[i], seen)
        emitted.append(choice)
        if constraint is not None and constraint.stopped:
            break
        if i == len(drafts) or choice != drafts[i]:
            break
        seen.append(choice)
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

