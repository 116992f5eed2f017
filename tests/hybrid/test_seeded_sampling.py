"""Position-seeded sampling: the token at position n is the inverse CDF, in the distribution's
fixed token order, of a uniform that depends on (seed, n) only — so a verify pass that keeps a
draft iff it equals the target's own draw emits exactly plain decoding's text, whatever the
draft depth. Oracles: numpy written here from the definitions; counts against `Sampler.probs`.
"""
import numpy as np
import pytest

import hybrid
from hybrid.acceptance import accept_drafts
from hybrid.events import Token
from hybrid.sampling import Sampler, SamplerConfig, position_uniform

CONFIG = SamplerConfig(temperature=0.7, top_k=6, top_p=0.97, min_p=0.02)
# Chi-square with ≤ 7 degrees of freedom exceeds 35 with probability < 2e-5.
CHI2_LIMIT = 35.0


def row(seed=0, n=40):
    return (np.random.default_rng(seed).standard_normal(n) * 2).astype(np.float32)


def with_seed(seed, config=CONFIG):
    return Sampler(SamplerConfig(**{**config.__dict__, "seed": seed}))


def reference_draw(logits, config, u):
    """The filtered distribution from its definition — tokens by falling logit, lowest id first
    on ties; top-k, top-p on the top-k's untempered softmax, min-p, then temperature — and the
    first token whose cumulative mass exceeds u."""
    x = logits.astype(np.float64)
    order = np.lexsort((np.arange(x.size), -x))[:config.top_k]
    v = x[order]
    e = np.exp(v - v[0])
    m = int(np.argmax(np.cumsum(e / e.sum()) >= config.top_p)) + 1
    m = min(m, int(np.sum(v[:m] >= v[0] + np.log(config.min_p))))
    ids, p = order[:m], np.exp((v[:m] - v[0]) / config.temperature)
    cdf = np.cumsum(p / p.sum())
    return int(ids[min(int(np.sum(cdf <= u * cdf[-1])), m - 1)])


def chi_square(tokens, probs) -> float:
    counts = np.bincount(np.asarray(tokens), minlength=len(probs)).astype(np.float64)
    support = probs > 0
    assert counts[~support].sum() == 0, f"drew tokens outside the support: {counts}"
    expected = counts.sum() * probs[support].astype(np.float64)
    return float(((counts[support] - expected) ** 2 / expected).sum())


# --- the draw --------------------------------------------------------------------------------

def test_position_uniform_is_the_spawned_childs_first_53_bits():
    for seed, position in [(0, 0), (42, 7), (2**100 + 3, 123456)]:
        child = np.random.SeedSequence(seed).spawn(position + 1)[position]
        word = int(child.generate_state(1, np.uint64)[0])
        assert position_uniform(seed, position) == (word >> 11) / 2.0**53
    u = np.array([position_uniform(5, n) for n in range(4000)])
    assert 0.0 <= u.min() and u.max() < 1.0
    # uniform: each tenth holds 400 ± 5 sd (sd = sqrt(4000 * 0.1 * 0.9) ≈ 19)
    assert np.all(np.abs(np.bincount((u * 10).astype(int), minlength=10) - 400) < 95)
    assert position_uniform(5, 0) != position_uniform(6, 0)


def test_sample_is_the_inverse_cdf_at_its_position_whatever_the_call_order():
    """A shared stream would make a draw depend on the draws before it: here positions are
    visited in a shuffled order, twice, and each must still be the reference draw."""
    logits = row()
    rng = np.random.default_rng(1)
    for seed in (0, 42, 2**70 + 1):
        s = with_seed(seed)
        positions = rng.permutation(300)
        for n in np.concatenate([positions, positions[::-1]]):
            want = reference_draw(logits, CONFIG, position_uniform(seed, int(n)))
            assert s.sample(logits, range(n)) == want, (seed, n)


def test_draws_over_positions_follow_the_distribution():
    logits = row(seed=2)
    s = with_seed(9)
    p = s.probs(logits, []).astype(np.float64)
    n = 2000
    assert np.count_nonzero(p) >= 3 and p[p > 0].min() * n >= 20     # chi-square is fair here
    draws = [s.sample(logits, range(i)) for i in range(n)]
    assert chi_square(draws, p) < CHI2_LIMIT


def test_no_seed_picks_one_seed_per_sampler():
    a, b = Sampler(CONFIG), Sampler(CONFIG)
    assert a.seed != b.seed
    logits = row(seed=3)
    same = with_seed(a.seed)
    assert [a.sample(logits, range(i)) for i in range(50)] == [same.sample(logits, range(i)) for i in range(50)]


# --- accepting drafts -------------------------------------------------------------------------

# row 0 (position n): p ≈ [.20 .06 .41 .11 0 .17 0 .05] — tokens 4 and 6 fall to top-k
ROWS = np.array([[1.0, 0.2, 1.5, 0.6, -0.3, 0.9, -2.0, 0.0],
                 [0.0, 1.0, 0.5, -1.0, 0.3, 0.0, 0.8, 0.2]], np.float32)
TRIALS = 4000


@pytest.mark.parametrize("draft", [2, 0, 1, 6], ids=["likely", "second", "unlikely", "outside"])
def test_accept_rule_is_exact_over_seeds_and_positions(draft):
    """Draft d at position n: kept with probability p(d); the first emitted token follows p
    whatever d is; a rejection emits p conditioned on ≠ d."""
    p = Sampler(CONFIG).probs(ROWS[0], []).astype(np.float64)
    first = []
    for t in range(TRIALS):
        history = range(t % 97)         # many (seed, position) pairs; no penalty: only len counts
        first.append(accept_drafts(ROWS, [draft], with_seed(t), history)[0])
    first = np.asarray(first)
    kept = np.mean(first == draft)
    print(f"\ndraft {draft} (p = {p[draft]:.3f}): kept {kept:.3f}")
    assert abs(kept - p[draft]) < 5 * np.sqrt(0.25 / TRIALS)
    assert chi_square(first, p) < CHI2_LIMIT
    rest = p.copy()
    rest[draft] = 0.0
    assert chi_square(first[first != draft], rest / rest.sum()) < CHI2_LIMIT


# --- end to end --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def bundled():
    return hybrid.load(device="cpu", threads=1)


def sampled(model, seed, draft):
    events = model.generate("def add(a, b):", max_tokens=30, temperature=0.8, seed=seed, draft=draft)
    return [e.id for e in events if isinstance(e, Token)]


def test_same_seed_same_tokens_whatever_the_draft_depth(bundled):
    plain = sampled(bundled, 42, 0)
    assert len(plain) > 10
    assert sampled(bundled, 42, 0) == plain
    for draft in (1, 2, 3, "auto"):
        assert sampled(bundled, 42, draft) == plain, f"draft {draft}"
    assert sampled(bundled, 43, 0) != plain
    assert sampled(bundled, 43, 2) == sampled(bundled, 43, 0)
