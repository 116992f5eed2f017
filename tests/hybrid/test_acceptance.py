"""Which drafts a verify pass keeps (hybrid/acceptance.py).

Sampling: a draft is kept iff it is the target's own seeded draw there, which must emit every
token with exactly the target sampler's distribution (`Sampler.probs`), whatever the draft.
Checked by counting over many trials, one seed each, on a 6-token vocabulary (chi-square
against the expected counts), and token for token against plain sequential sampling.
Greedy: drafts are kept while they are the argmax, so output equals plain greedy decoding.
"""
import numpy as np
import pytest

from hybrid.acceptance import accept_drafts, accept_greedy
from hybrid.sampling import Sampler, SamplerConfig

ROWS = np.array([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0],      # verifier row 0: decides position 1
                 [0.8, 1.5, -0.5, 1.0, 0.2, -2.0],      # row 1: position 2 (after draft 1)
                 [1.0, 1.0, 1.0, 0.0, 0.0, 0.0]],       # row 2: the bonus after two kept drafts
                np.float32)
CONFIGS = {
    "softmax": SamplerConfig(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0),
    # filters leave token 5 (and 4 in row 0) outside the support: a draft there is never kept
    "filtered": SamplerConfig(temperature=0.7, top_k=4, top_p=0.95, min_p=0.05),
}
TRIALS = 4_000
# Chi-square with ≤ 5 degrees of freedom exceeds 30 with probability < 2e-5; a wrong rule (e.g.
# redrawing from p, d included, on rejection) gives hundreds at these trial counts.
CHI2_LIMIT = 30.0


def chi_square(tokens, probs) -> float:
    counts = np.bincount(np.asarray(tokens), minlength=len(probs)).astype(np.float64)
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = n * probs[support].astype(np.float64)
    return float(((counts[support] - expected) ** 2 / expected).sum())


def sampler(name, seed=1, **over):
    cfg = CONFIGS[name]
    return Sampler(SamplerConfig(**{**cfg.__dict__, "seed": seed, **over}))


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("draft", [0, 3, 5], ids=["likely", "unlikely", "tail"])
def test_first_token_is_distributed_as_the_target(name, draft):
    p = sampler(name).probs(ROWS[0], [])
    first = [accept_drafts(ROWS[:2], [draft], sampler(name, seed), [])[0] for seed in range(TRIALS)]
    stat = chi_square(first, p)
    kept = np.mean(np.asarray(first) == draft)
    print(f"\n{name}, draft {draft} (p = {p[draft]:.3f}): kept {kept:.3f}, chi2 {stat:.1f}")
    assert stat < CHI2_LIMIT
    assert abs(kept - p[draft]) < 5 * np.sqrt(0.25 / TRIALS)


@pytest.mark.parametrize("name", CONFIGS)
@pytest.mark.parametrize("second", [1, 5], ids=["likely", "tail"])
def test_second_token_given_the_first_was_kept(name, second):
    """After draft 1 is kept, position 2 follows row 1's distribution — with the repetition
    penalty seeing draft 1 in the history, as plain decoding would have."""
    history = [2, 3]
    s = sampler(name, repeat_penalty=1.5)
    p0 = s.probs(ROWS[0], history)
    p1 = s.probs(ROWS[1], history + [0])
    assert not np.allclose(p1, s.probs(ROWS[1], history))        # the penalty matters here
    out = [accept_drafts(ROWS, [0, second], sampler(name, seed, repeat_penalty=1.5), history)
           for seed in range(TRIALS)]
    assert chi_square([o[0] for o in out], p0) < CHI2_LIMIT
    given_first = [o[1] for o in out if o[0] == 0]
    assert len(given_first) > TRIALS * p0[0] * 0.9
    assert chi_square(given_first, p1) < CHI2_LIMIT
    assert history == [2, 3]                                      # only read


def test_bonus_token_after_all_drafts_kept_follows_the_last_row():
    p2 = sampler("softmax").probs(ROWS[2], [0, 1])
    bonus = []
    for seed in range(TRIALS):
        out = accept_drafts(ROWS, [0, 1], sampler("softmax", seed), [])
        if len(out) == 3:
            bonus.append(out[2])
    assert len(bonus) > 500
    assert chi_square(bonus, p2) < CHI2_LIMIT


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    s = Sampler(SamplerConfig(temperature=0.0))
    assert accept_drafts(ROWS, [0, 1], s, []) == [0, 1, 0]         # both kept, bonus = argmax row 2
    assert accept_drafts(ROWS, [0, 3], s, []) == [0, 1]            # second rejected → row 1's argmax
    assert accept_drafts(ROWS, [4, 1], s, []) == [0]               # first rejected: nothing more
    assert accept_drafts(ROWS[:1], [], s, []) == [0]


def test_accept_greedy_on_picks_equals_accept_drafts_on_logits():
    rng = np.random.default_rng(5)
    sampler = Sampler(SamplerConfig(temperature=0.0))
    assert sampler.config.argmax_only
    for _ in range(50):
        logits = rng.standard_normal((4, 12)).astype(np.float32)
        best = logits.argmax(1)
        drafts = [int(b) if rng.random() < 0.7 else int(b + 1) % 12 for b in best[:3]]
        assert accept_greedy(best, drafts) == accept_drafts(logits, drafts, sampler, [1, 2])


def test_greedy_sees_kept_drafts_in_the_penalty_history():
    """The penalty sees the kept drafts: after keeping 0 and 1, row 2's three-way tie at 1.0
    loses 0 and 1 to the penalty, so the bonus token is 2."""
    s = Sampler(SamplerConfig(temperature=0.0, repeat_penalty=2.0))
    assert accept_drafts(ROWS, [0, 1], s, []) == [0, 1, 2]
    s_plain = Sampler(SamplerConfig(temperature=0.0))
    assert accept_drafts(ROWS, [0, 1], s_plain, []) == [0, 1, 0]
    # history penalises token 1 in row 1 (1.5 → 0.75 < 1.0): the argmax there becomes 3
    assert accept_drafts(ROWS, [0, 1], s, [1]) == [0, 3]


@pytest.mark.parametrize("name", CONFIGS)
def test_verifier_rows_as_top_logits_accept_exactly_as_whole_rows(name):
    """Same seed, same emitted tokens from the rows and from their best logits (the forward's
    top=): with top-k the count `candidates` says; without it, every entry."""
    from tests.hybrid.test_sampling import top_of
    config = CONFIGS[name]
    tops = [top_of(r, config.candidates or r.size) for r in ROWS]
    for drafts in ([0, 1], [1, 3], [5, 5], [0, 0]):
        for seed in range(30):
            s = sampler(name, seed)
            assert accept_drafts(ROWS, drafts, s, [2]) == accept_drafts(tops, drafts, s, [2])


@pytest.mark.parametrize("name", CONFIGS)
def test_sampled_accept_emits_plain_decodings_tokens(name):
    """Each emitted token is the one `sample` gives at its position after the tokens before it;
    the drafts only decide how many come from one call."""
    history = [2, 3, 1]
    for seed in range(200):
        s = sampler(name, seed, repeat_penalty=1.3)
        plain = []
        for row in ROWS:
            plain.append(s.sample(row, history + plain))
        drafts = [int(d) for d in np.random.default_rng(seed).integers(0, 6, 2)]
        if seed % 2:
            drafts[0] = plain[0]                            # the second draft gets judged too
        out = accept_drafts(ROWS, drafts, s, history)
        assert out == plain[:len(out)]
        kept = len(out) - 1
        assert drafts[:kept] == plain[:kept] and (kept == 2 or drafts[kept] != plain[kept])
