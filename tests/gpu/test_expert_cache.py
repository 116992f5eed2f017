"""gpu/expert_cache.py: routing on the device as cpu.moe.route does it; each cached (row, rank)
pair with the bits of a one-slot matvec on its expert; and the hybrid MoE FFN with a cache (the
GPU runs the cached experts, the host the rest) against the CPU op, in one hand-off, with
every row keeping the bits of a one-row call. Tiny shapes: the simulator runs every thread."""
import dataclasses

import numpy as np
import pytest
from numba import cuda

import cpu.moe
import cpu.ops
import gpu.expert_cache as ec
import gpu.matvec_q8 as mq
import gpu.ops
from tests.cpu.quant_data import random_rows, type_id
from tests.gpu.test_moe import D, E, K, RecordingStats, hand_offs, host_copy, hybrid_moe  # noqa: F401
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)


def test_device_routing_picks_what_the_cpu_picks():
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((4, 40)), 1).astype(np.float32)   # many ties
    logits[2, :] = 0.5                                                     # all tied
    logits[3, 7] = -0.0
    want_experts, want_weights = cpu.moe.route(logits, 5)
    experts = cuda.to_device(np.full((4, 5), -7, np.int64))
    weights = cuda.to_device(np.full((4, 5), np.nan, np.float32))
    ec.route(cuda.to_device(logits), experts, weights)
    assert np.array_equal(experts.copy_to_host(), want_experts)
    np.testing.assert_allclose(weights.copy_to_host(), want_weights, rtol=1e-6)


@pytest.mark.parametrize("n_expert, k", [(256, 8), (ec.MAX_EXPERTS, ec.MAX_TOP_K)])
def test_device_routing_at_the_model_sizes_and_the_limits(n_expert, k):
    rng = np.random.default_rng(n_expert)
    logits = np.round(rng.standard_normal((2, n_expert)), 2).astype(np.float32)   # ties across lanes
    logits[1, ::3] = logits[1, 0]
    want_experts, want_weights = cpu.moe.route(logits, k)
    experts = cuda.to_device(np.full((2, k), -7, np.int64))
    weights = cuda.to_device(np.full((2, k), np.nan, np.float32))
    ec.route(cuda.to_device(logits), experts, weights)
    assert np.array_equal(experts.copy_to_host(), want_experts)
    np.testing.assert_allclose(weights.copy_to_host(), want_weights, rtol=1e-6)


def test_device_routing_of_a_nan_row_still_picks_distinct_experts():
    logits = np.zeros((1, 8), np.float32)
    logits[0, [0, 3]] = np.nan
    experts = cuda.to_device(np.full((1, 4), -1, np.int64))
    weights = cuda.to_device(np.zeros((1, 4), np.float32))
    ec.route(cuda.to_device(logits), experts, weights)
    got = experts.copy_to_host()[0]
    assert len(set(got.tolist())) == 4 and got.min() >= 0 and got.max() < 8
    assert 0 not in got and 3 not in got                 # numbers rank above NaN


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K"])
def test_each_cached_pair_has_the_bits_of_a_one_slot_matvec(kind):
    rng = np.random.default_rng(5)
    rows, cols, slots, n, k = 8, 256, 3, 2, 2
    stack = random_rows(kind, slots * rows, cols, rng).reshape(slots, rows, -1)
    slot_of = np.array([2, -1, 0, -1, 1], np.int32)       # experts 0, 2, 4 cached; 1, 3 not
    experts = np.array([[0, 1], [3, 4]], np.int64)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    t = type_id(kind)
    stack_dev, x_dev = cuda.to_device(stack), cuda.to_device(x)
    out = cuda.to_device(np.full((n * k, rows), np.nan, np.float32))
    s = gpu.memory.stream()
    mq.experts_matvec(t, stack_dev, cuda.to_device(slot_of), cuda.to_device(experts),
                      mq.quantize(x_dev, s, mq.UNITS[t].x_layout), out, False, s)
    got = out.copy_to_host()
    for a in range(n * k):
        i, e = divmod(a, k)[0], experts[a // k, a % k]
        if slot_of[e] < 0:
            assert np.isnan(got[a]).all(), a                # left as it was
            continue
        one = cuda.to_device(np.zeros((1, rows), np.float32))
        mq.matvec(t, cuda.to_device(np.ascontiguousarray(stack[slot_of[e]])), x_dev[i:i + 1], one, rows, cols, 1, s)
        assert np.array_equal(got[a].view(np.uint32), one.copy_to_host()[0].view(np.uint32)), a
        assert np.abs(got[a]).max() > 0


@pytest.mark.parametrize("slots", [1, E], ids=["some-cached", "all-cached"])
def test_hybrid_moe_with_a_cache_matches_the_cpu_op_in_one_hand_off(hand_offs, monkeypatch, slots):  # noqa: F811
    moe = hybrid_moe(seed=44)
    cache = ec.ExpertCache(moe, slots)
    cached_moe = dataclasses.replace(moe, cache=cache)
    x = np.random.default_rng(45).standard_normal((3, D)).astype(np.float32)
    want, want_stats = np.empty_like(x), RecordingStats()
    cpu.ops.moe_ffn(host_copy(moe), x, want, want_stats)

    ran_on_host = []
    real = cpu.moe.run_routed

    def recording(ffn, x, experts, weights, out, stats=None, skip=None):
        ran_on_host.append(np.where(skip[experts] >= 0, -1, experts))
        real(ffn, x, experts, weights, out, stats, skip)
    monkeypatch.setattr(gpu.ffn, "run_routed", recording)

    out, stats = cuda.to_device(np.full_like(x, np.nan)), RecordingStats()
    gpu.ops.moe_ffn(cached_moe, cuda.to_device(x), out, stats)
    assert len(hand_offs) == 1
    chosen = want_stats.chosen[0]
    assert np.array_equal(stats.chosen[0], chosen)                  # every pair counted, cached or not
    in_cache = cache.host_slot_of[chosen] >= 0
    assert in_cache.any()
    assert np.array_equal(ran_on_host[0], np.where(in_cache, -1, chosen))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-5)

    # every row has the bits of a one-row call
    one = cuda.to_device(np.zeros((1, D), np.float32))
    gpu.ops.moe_ffn(cached_moe, cuda.to_device(x[1:2]), one)
    assert np.array_equal(out.copy_to_host()[1].view(np.uint32), one.copy_to_host()[0].view(np.uint32))


def test_loading_other_experts_moves_them_in_and_keeps_the_rest():
    moe = hybrid_moe(seed=46)
    cache = ec.ExpertCache(moe, 2)
    assert cache.host_slot_of.tolist() == [0, 1, -1, -1]
    cache.load(moe, [3, 1])
    assert cache.host_slot_of.tolist() == [-1, 1, -1, 0]
    assert np.array_equal(cache.slot_of.copy_to_host(), cache.host_slot_of)
    for kind, stack in zip((moe.gate, moe.up, moe.down), cache.stacks):
        assert np.array_equal(stack.copy_to_host()[0], kind.data[3])
        assert np.array_equal(stack.copy_to_host()[1], kind.data[1])
