"""Sampler and stop strings. Oracles: float64 numpy written here from the definitions."""
from __future__ import annotations

import numpy as np
import pytest

from hybrid.errors import HybridError
from cpu.top_logits import top_logits
from hybrid.sampling import Sampler, SamplerConfig, StopChecker, TopLogits

ONLY_TEMPERATURE = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)


def softmax(x):
    e = np.exp(np.asarray(x, np.float64) - np.max(x))
    return e / e.sum()


def random_logits(n=200, seed=0):
    return (np.random.default_rng(seed).standard_normal(n) * 3).astype(np.float32)


def test_defaults_are_llama_cpps():
    c = SamplerConfig()
    assert (c.temperature, c.top_k, c.top_p, c.min_p, c.repeat_penalty, c.repeat_last_n, c.seed) == \
        (0.8, 40, 0.95, 0.05, 1.0, 64, None)


# --- greedy ---------------------------------------------------------------------------------

def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = np.array([0.0, 2.0, 5.0, 1.0, 5.0], np.float32)
    s = Sampler(SamplerConfig(temperature=0.0))
    assert s.sample(logits, []) == 2
    np.testing.assert_array_equal(s.probs(logits, []), [0, 0, 1, 0, 0])


def test_greedy_applies_the_repetition_penalty_first():
    logits = np.array([0.0, 4.0, 3.0], np.float32)
    assert Sampler(SamplerConfig(temperature=0.0, repeat_penalty=2.0)).sample(logits, [1]) == 2


# --- each filter against its definition -----------------------------------------------------

@pytest.mark.parametrize("k", [1, 5, 40, 199])
def test_top_k_keeps_exactly_the_k_largest(k):
    logits = random_logits()
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "top_k": k})).probs(logits, [])
    kept = np.flatnonzero(p)
    assert kept.size == k
    assert set(kept) == set(np.argsort(-logits.astype(np.float64))[:k])
    np.testing.assert_allclose(p[kept], softmax(logits[kept]), rtol=1e-6)


def test_top_k_ties_keep_lowest_ids():
    logits = np.array([1.0, 3.0, 2.0, 2.0, 2.0, 0.0], np.float32)
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "top_k": 3})).probs(logits, [])
    assert list(np.flatnonzero(p)) == [1, 2, 3]
    few_values = np.random.default_rng(0).integers(0, 3, 1000).astype(np.float32)
    twos, ones = np.flatnonzero(few_values == 2), np.flatnonzero(few_values == 1)
    k = twos.size + 50
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "top_k": k})).probs(few_values, [])
    assert set(np.flatnonzero(p)) == set(twos) | set(ones[:50])


def test_top_p_stops_as_soon_as_the_mass_is_reached():
    # four equal tokens: masses 0.25, 0.5, 0.75, 1.0 are exact in binary
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "top_p": 0.5})).probs(np.zeros(4, np.float32), [])
    np.testing.assert_array_equal(p, [0.5, 0.5, 0, 0])


@pytest.mark.parametrize("top_p", [0.0, 0.3, 0.5, 0.9, 0.99])
def test_top_p_keeps_the_smallest_set_reaching_p(top_p):
    logits = random_logits(seed=1)
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "top_p": top_p})).probs(logits, [])
    full = softmax(logits)
    order = np.argsort(-full)
    m = next(i + 1 for i, c in enumerate(np.cumsum(full[order])) if c >= top_p)
    kept = np.flatnonzero(p)
    assert set(kept) == set(order[:m])
    assert full[order[:m]].sum() >= top_p and (m == 1 or full[order[:m - 1]].sum() < top_p)
    np.testing.assert_allclose(p[kept], full[kept] / full[kept].sum(), rtol=1e-6)


@pytest.mark.parametrize("min_p", [0.01, 0.05, 0.3, 1.0])
def test_min_p_threshold_is_relative_to_the_top_token(min_p):
    logits = random_logits(seed=2)
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "min_p": min_p})).probs(logits, [])
    full = softmax(logits)
    expected = np.flatnonzero(full >= min_p * full.max())
    assert list(np.flatnonzero(p)) == list(expected)
    np.testing.assert_allclose(p[expected], full[expected] / full[expected].sum(), rtol=1e-6)


@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_temperature_scales_the_logits(temperature):
    logits = random_logits(seed=3)
    p = Sampler(SamplerConfig(**{**ONLY_TEMPERATURE, "temperature": temperature})).probs(logits, [])
    np.testing.assert_allclose(p, softmax(logits.astype(np.float64) / temperature), rtol=1e-5, atol=1e-12)


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -1.0, 0.5, 3.0, -2.0], np.float32)
    history = [0, 1, 1]  # tokens 0 (positive logit) and 1 (negative), 1 twice: counted once
    p = Sampler(SamplerConfig(**ONLY_TEMPERATURE, repeat_penalty=1.5)).probs(logits, history)
    expected = np.array([2.0 / 1.5, -1.0 * 1.5, 0.5, 3.0, -2.0])
    np.testing.assert_allclose(p, softmax(expected), rtol=1e-6)


def test_repetition_penalty_only_looks_at_the_last_n_tokens():
    logits = np.array([2.0, 2.0, 2.0], np.float32)
    history = [0, 1, 1, 1]
    windowed = Sampler(SamplerConfig(**ONLY_TEMPERATURE, repeat_penalty=2.0, repeat_last_n=2))
    everything = Sampler(SamplerConfig(**ONLY_TEMPERATURE, repeat_penalty=2.0, repeat_last_n=-1))
    off = Sampler(SamplerConfig(**ONLY_TEMPERATURE, repeat_penalty=2.0, repeat_last_n=0))
    np.testing.assert_allclose(windowed.probs(logits, history), softmax([2.0, 1.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(everything.probs(logits, history), softmax([1.0, 1.0, 2.0]), rtol=1e-6)
    np.testing.assert_allclose(off.probs(logits, history), softmax([2.0, 2.0, 2.0]), rtol=1e-6)


def test_frequency_and_presence_penalties():
    logits = np.zeros(3, np.float32)
    s = Sampler(SamplerConfig(**ONLY_TEMPERATURE, frequency_penalty=0.5, presence_penalty=0.25))
    np.testing.assert_allclose(s.probs(logits, [0, 0, 1]), softmax([-1.25, -0.75, 0.0]), rtol=1e-6)


def test_chain_order_filters_before_temperature():
    """top-k, then top-p on the top-k survivors' untempered softmax, then min-p, then temperature."""
    logits = random_logits(seed=4)
    cfg = SamplerConfig(temperature=2.0, top_k=20, top_p=0.8, min_p=0.05)
    p = Sampler(cfg).probs(logits, [])
    x = logits.astype(np.float64)
    ids = np.argsort(-x)[:20]
    m = int(np.searchsorted(np.cumsum(softmax(x[ids])), 0.8)) + 1
    ids = ids[:m]
    ids = ids[x[ids] >= x[ids].max() + np.log(0.05)]
    expected = np.zeros_like(x)
    expected[ids] = softmax(x[ids] / 2.0)
    np.testing.assert_allclose(p, expected, rtol=1e-6, atol=1e-12)


# --- drawing ----------------------------------------------------------------------------------

def at_positions(sampler, logits, n):
    """The draws at positions 0..n-1 of one row: each position has its own uniform. (A range as
    the history: only its length counts when no penalty is on.)"""
    assert not sampler.config.penalizes
    return [sampler.sample(logits, range(i)) for i in range(n)]


def test_same_seed_same_sequence():
    logits = random_logits(seed=5)

    def draw(seed):
        s = Sampler(SamplerConfig(seed=seed, temperature=1.5, top_k=0, top_p=1.0, min_p=0.0))
        return at_positions(s, logits, 50)

    assert draw(1234) == draw(1234)
    assert draw(1234) != draw(4321)


def test_samples_follow_probs_chi_square():
    logits = random_logits(n=50, seed=6)
    s = Sampler(SamplerConfig(seed=7, temperature=0.9, top_k=8, top_p=0.99, min_p=0.01))
    p = s.probs(logits, []).astype(np.float64)
    support = np.flatnonzero(p)
    assert support.size >= 4
    n = 20000
    counts = np.bincount(at_positions(s, logits, n), minlength=logits.size)
    assert counts[p == 0].sum() == 0, "sampled a token that probs() excludes"
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    # 99.9% quantiles of chi-square for df = 3..7
    critical = {3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}[support.size - 1]
    assert chi2 < critical, (chi2, critical)


def test_sample_does_not_modify_the_callers_logits():
    logits = random_logits(seed=8)
    before = logits.copy()
    Sampler(SamplerConfig(repeat_penalty=1.3, seed=0)).sample(logits, [0, 1, 2])
    np.testing.assert_array_equal(logits, before)


def test_bad_input_and_settings_are_user_errors():
    with pytest.raises(HybridError, match="NaN"):
        Sampler().sample(np.array([0.0, np.nan], np.float32), [])
    with pytest.raises(HybridError, match="-inf"):
        Sampler().sample(np.full(3, -np.inf, np.float32), [])
    with pytest.raises(HybridError, match="outside the vocabulary"):
        Sampler(SamplerConfig(repeat_penalty=1.1)).sample(np.zeros(3, np.float32), [5])
    with pytest.raises(HybridError, match="top_p"):
        SamplerConfig(top_p=1.5)
    with pytest.raises(HybridError, match="repeat_penalty"):
        SamplerConfig(repeat_penalty=0.0)


def test_masked_logits_are_never_drawn():
    logits = np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32)
    s = Sampler(SamplerConfig(seed=0, top_k=0, top_p=1.0, min_p=0.0))
    assert set(at_positions(s, logits, 200)) == {1, 3}


# --- sampling from a row's best logits (what the forward's top= sends back) --------------------

def top_of(logits, count):
    out = np.empty((1, 2 * TopLogits.count(count, logits.size)), np.uint32)
    top_logits(np.ascontiguousarray(logits[None], np.float32), out)
    return TopLogits.rows(out, logits.size)[0]


TOP_CONFIGS = {
    "defaults": SamplerConfig(seed=3),
    "narrow, tied": SamplerConfig(top_k=3, top_p=1.0, min_p=0.0, temperature=1.5, seed=3),
    "penalties": SamplerConfig(top_p=1.0, min_p=0.0, repeat_penalty=4.0, repeat_last_n=8,
                               frequency_penalty=0.4, presence_penalty=0.2, seed=3),
    "greedy, penalties": SamplerConfig(temperature=0.0, repeat_penalty=2.0, repeat_last_n=8, seed=3),
}


@pytest.mark.parametrize("name", TOP_CONFIGS)
def test_a_rows_best_logits_sample_exactly_as_the_whole_row(name):
    """Same seed, same draws and the same distribution from the row and from its
    `config.candidates` best logits, with the penalised tokens the row's very best (each can drop
    below the kth place), some in the window twice, and ties at the cut."""
    config = TOP_CONFIGS[name]
    row = np.round(random_logits(500, seed=5) * 2) / 2      # coarse: many ties
    best = np.argsort(-row, kind="stable")
    history = [int(best[0]), int(best[1]), 7, int(best[1]), int(best[2]), 499, int(best[40]), int(best[3])]
    top = top_of(row, config.candidates)
    for seed in range(40):
        s = Sampler(SamplerConfig(**{**config.__dict__, "seed": seed}))
        assert s.sample(row, history) == s.sample(top, history)
    whole, part = Sampler(config), Sampler(config)
    for a, b in zip(whole.distribution(row, history), part.distribution(top, history)):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(whole.probs(row, history), part.probs(top, history))


def test_the_candidates_a_config_needs():
    assert SamplerConfig().candidates == 40
    assert SamplerConfig(temperature=0.0, repeat_penalty=1.1).candidates == 1 + 64
    assert SamplerConfig(repeat_penalty=1.1, repeat_last_n=16).candidates == 40 + 16
    assert SamplerConfig(repeat_penalty=1.1, repeat_last_n=0).candidates == 40   # window off
    # any token may win: no top-k, a penalty that can raise a logit, or an unbounded window
    assert SamplerConfig(top_k=0).candidates is None
    assert SamplerConfig(repeat_penalty=0.9).candidates is None
    assert SamplerConfig(frequency_penalty=-0.5).candidates is None
    assert SamplerConfig(repeat_penalty=1.1, repeat_last_n=-1).candidates is None
    assert SamplerConfig(top_k=5000).candidates is None                          # > MAX_CANDIDATES


# --- stop strings -----------------------------------------------------------------------------

def feed(checker, chunks):
    shown, stopped = [], False
    for chunk in chunks:
        step = checker.push(chunk)
        shown.append(step.text)
        stopped = step.stopped
    return shown, stopped


def test_stop_string_split_across_chunks():
    checker = StopChecker(["</s>"])
    shown, stopped = feed(checker, ["Hello <", "/", "s", ">tail"])
    assert shown == ["Hello ", "", "", ""] and stopped and checker.matched == "</s>"
    assert checker.push("more") == ("", True)
    assert checker.flush() == ""


def test_false_alarm_is_released():
    checker = StopChecker(["</s>"])
    shown, stopped = feed(checker, ["a <", "/b", "c"])
    assert shown == ["a ", "</b", "c"] and not stopped


def test_held_text_comes_out_on_flush():
    checker = StopChecker(["\n\nUser:"])
    shown, stopped = feed(checker, ["answer\n", "\nUs"])
    assert "".join(shown) == "answer" and not stopped
    assert checker.flush() == "\n\nUs"


def test_earliest_stop_string_wins_and_text_before_it_is_kept():
    checker = StopChecker(["STOP", "END"])
    shown, stopped = feed(checker, ["one END two STOP"])
    assert shown == ["one "] and stopped and checker.matched == "END"


def test_stop_inside_one_chunk_and_no_stop_strings():
    assert StopChecker(["x"]).push("abxcd") == ("ab", True)
    checker = StopChecker([""])
    assert checker.push("abc") == ("abc", False) and checker.flush() == ""
