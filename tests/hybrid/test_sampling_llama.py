"""llama.cpp's typical-p, XTC, DRY and logit bias in `Sampler`, each checked against a plain
statement of its rule written here with loops over a sorted candidate list, as llama.cpp does."""
import math

import numpy as np
import pytest

from hybrid.errors import HybridError
from hybrid.sampling import Sampler, SamplerConfig, TopLogits, dry_penalties, xtc_uniform

OFF = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0, seed=3)


def softmax(x):
    e = np.exp(np.asarray(x, dtype=np.float64) - np.max(x))
    return e / e.sum()


def dist(config, logits, history=()):
    ids, p = Sampler(config).distribution(np.asarray(logits, dtype=np.float32), history)
    return dict(zip(ids.tolist(), p.tolist()))


def ref_typical(logits, mass):
    """llama.cpp llama_sampler_typical_apply: sort by |surprise − entropy|, keep until the
    cumulative probability first exceeds `mass`; renormalise."""
    p = softmax(logits)
    h = -sum(q * math.log(q) for q in p)
    order = sorted(range(len(p)), key=lambda i: abs(-math.log(p[i]) - h))
    kept, cum = [], 0.0
    for i in order:
        kept.append(i)
        cum += p[i]
        if cum > mass:
            break
    total = sum(p[i] for i in kept)
    return {i: p[i] / total for i in kept}


@pytest.mark.parametrize("mass", [0.2, 0.5, 0.9])
def test_typical_p_matches_the_rule(mass):
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 2, 32).astype(np.float32)
    got = dist(SamplerConfig(typical_p=mass, **OFF), logits)
    want = ref_typical(logits.astype(np.float64), mass)
    assert set(got) == set(want) and len(want) < 32
    for i in want:
        assert got[i] == pytest.approx(want[i], rel=1e-6)


def ref_xtc(logits, threshold):
    """Sorted by falling probability: drop every token at or above `threshold` but the last of them."""
    p = softmax(logits)
    order = sorted(range(len(p)), key=lambda i: -p[i])
    above = [i for i in order if p[i] >= threshold]
    kept = order[len(above) - 1:] if len(above) >= 2 else order
    total = sum(p[i] for i in kept)
    return {i: p[i] / total for i in kept}


def test_xtc_cuts_the_likeliest_when_its_coin_says_so():
    logits = np.log(np.array([0.3, 0.25, 0.2, 0.15, 0.05, 0.05]))
    config = SamplerConfig(xtc_probability=0.5, xtc_threshold=0.18, **OFF)
    for position in range(40):
        got = Sampler(config).distribution(logits.astype(np.float32), [0] * position)
        got = dict(zip(got[0].tolist(), got[1].tolist()))
        cut = xtc_uniform(config.seed, position) < 0.5
        want = ref_xtc(logits, 0.18) if cut else {i: q for i, q in enumerate(softmax(logits))}
        assert set(got) == set(want), position
        if cut:
            assert set(got) == {2, 3, 4, 5}      # 0.3 and 0.25 went; 0.2, the last above 0.18, stays
    coins = [xtc_uniform(config.seed, n) < 0.5 for n in range(40)]
    assert any(coins) and not all(coins)
    # a threshold above 0.5 can never have two tokens above it: XTC is off
    assert len(dist(SamplerConfig(xtc_probability=1.0, xtc_threshold=0.6, **OFF), logits)) == 6


def ref_dry(history, multiplier, base, allowed, breakers=()):
    """For each earlier occurrence of the history's tail, the token that came next gets the
    length of the tail it would repeat; penalty multiplier·base^(len − allowed) for len ≥ allowed."""
    n, best = len(history), {}
    if n and history[-1] in breakers:
        return {}
    for j in range(1, n):
        k = 0
        while k < j and history[j - 1 - k] == history[n - 1 - k] and history[n - 1 - k] not in breakers:
            k += 1
        if k and history[j] not in breakers:
            best[history[j]] = max(best.get(history[j], 0), k)
    return {t: multiplier * base ** (k - allowed) for t, k in best.items() if k >= allowed}


def test_dry_penalises_the_token_that_would_extend_a_repeat():
    #          a  b  c  d  a  b  c  → d would repeat "a b c" (3 long)
    history = [1, 2, 3, 4, 1, 2, 3]
    config = SamplerConfig(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, **OFF)
    assert dry_penalties(history, config) == pytest.approx({4: 0.8 * 1.75 ** 1})
    assert ref_dry(history, 0.8, 1.75, 2) == pytest.approx({4: 0.8 * 1.75})
    logits = np.zeros(8, dtype=np.float32)
    got = dist(config, logits, history)
    want = softmax(np.array([0, 0, 0, 0, -1.4, 0, 0, 0]))
    assert [got[i] for i in range(8)] == pytest.approx(list(want))
    # a breaker inside the run cuts it short: "c" breaks, the run is only 0 long
    breaking = SamplerConfig(dry_multiplier=0.8, dry_breakers=(3,), **OFF)
    assert dry_penalties(history, breaking) == {}


def test_dry_random_histories_match_the_rule():
    rng = np.random.default_rng(7)
    for _ in range(50):
        history = rng.integers(0, 4, rng.integers(2, 40)).tolist()
        config = SamplerConfig(dry_multiplier=1.0, dry_base=2.0, dry_allowed_length=2, dry_breakers=(3,), **OFF)
        assert dry_penalties(history, config) == pytest.approx(ref_dry(history, 1.0, 2.0, 2, breakers=(3,)))


def test_logit_bias_adds_and_bans():
    logits = np.array([1.0, 2.0, 3.0, 0.5], dtype=np.float32)
    got = dist(SamplerConfig(logit_bias=((0, 2.5), (2, -math.inf)), **OFF), logits)
    want = softmax([3.5, 2.0, 0.5])
    assert 2 not in got
    assert [got[0], got[1], got[3]] == pytest.approx(list(want))
    greedy = SamplerConfig(temperature=0, logit_bias=((3, 10.0),))
    assert Sampler(greedy).sample(logits) == 3
    assert not greedy.argmax_only and greedy.candidates is None     # the whole row must come to the host
    with pytest.raises(HybridError, match="outside the vocabulary"):
        Sampler(SamplerConfig(logit_bias=((9, 1.0),), **OFF)).sample(logits)


def test_chain_order_bias_before_top_k():
    # the bias lifts token 0 into the top-1 that top-k keeps: bias comes before top-k
    logits = np.array([0.0, 5.0, 1.0], dtype=np.float32)
    got = dist(SamplerConfig(logit_bias=((0, 10.0),), top_k=1, top_p=1.0, min_p=0.0, seed=1), logits)
    assert got == {0: 1.0}


def test_top_logits_rows_agree_with_full_rows_for_typical_and_xtc():
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 2, 64).astype(np.float32)
    config = SamplerConfig(top_k=16, top_p=1.0, min_p=0.0, typical_p=0.7, xtc_probability=1.0, xtc_threshold=0.05,
                           seed=5)
    top = np.sort(np.argsort(-logits)[:config.candidates])
    row = TopLogits(top.astype(np.int64), logits[top], 64)
    a = Sampler(config).distribution(logits)
    b = Sampler(config).distribution(row)
    assert a[0].tolist() == b[0].tolist() and np.allclose(a[1], b[1])
