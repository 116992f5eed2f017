"""gpu/expert_cache.py: routing on the device as cpu.moe.route does it, and where it places each
pair (cache slot, PCIe, CPU) by the rule the module states; each pair the GPU runs with the bits
of a one-slot matvec on its expert, from a cache slot or from the mapped host stack; and the
hybrid MoE FFN with a cache and a PCIe share (the GPU runs its pairs, the host the rest) against
the CPU op, in one hand-off, with every row keeping the bits of a one-row call. Tiny shapes: the
simulator runs every thread (there the mapped host stacks are device copies)."""
import dataclasses

import numpy as np
import pytest
from numba import cuda

import cpu.moe
import cpu.moe_kernel
import cpu.ops
import gpu.expert_cache as ec
from gpu.runtime import memory
import gpu.matmul.matvec_q8 as mq
import gpu.moe
import gpu.ops
from gpu.runtime.pcie import PCIE_MAX_ROWS, pcie_counts
from tests.cpu.quant_data import random_rows, type_id
from tests.gpu.test_moe import D, E, F, K, RecordingStats, hand_offs, host_copy, hybrid_moe  # noqa: F401
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


def test_device_routing_writes_the_rows_and_the_routing_to_mapped_host_memory():
    """route(..., to_host=): the host's copies (mapped buffers: no copy node) equal the device's."""
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((3, 40)).astype(np.float32)
    x = rng.standard_normal((3, 2 * ec.X_COPY + 44)).astype(np.float32)      # three copy blocks, one partial
    experts, weights = memory.scratch("t.e", (3, 5), np.int64), memory.scratch("t.w", (3, 5))
    host = (memory.mapped("t.x", x.shape), memory.mapped("t.e", (3, 5), np.int64), memory.mapped("t.w", (3, 5)))
    for m in host:
        m.host[...] = -1
    ec.route(cuda.to_device(logits), experts, weights, to_host=(cuda.to_device(x), *(m.device for m in host)))
    memory.synchronize()
    want_experts, want_weights = cpu.moe.route(logits, 5)
    np.testing.assert_array_equal(host[0].host, x)
    np.testing.assert_array_equal(host[1].host, want_experts)
    np.testing.assert_array_equal(host[1].host, experts.copy_to_host())
    np.testing.assert_array_equal(host[2].host, weights.copy_to_host())


def test_device_routing_of_a_nan_row_still_picks_distinct_experts():
    logits = np.zeros((1, 8), np.float32)
    logits[0, [0, 3]] = np.nan
    experts = cuda.to_device(np.full((1, 4), -1, np.int64))
    weights = cuda.to_device(np.zeros((1, 4), np.float32))
    ec.route(cuda.to_device(logits), experts, weights)
    got = experts.copy_to_host()[0]
    assert len(set(got.tolist())) == 4 and got.min() >= 0 and got.max() < 8
    assert 0 not in got and 3 not in got                 # numbers rank above NaN


def place_like_the_module_says(experts, slot_of, counts):
    """The placement rule, written out: (where codes, the host's experts)."""
    where = np.full(experts.shape, ec.ON_CPU, np.int32)
    per_row = counts[-1]
    for i, row in enumerate(experts):
        uncached = [r for r, e in enumerate(row) if slot_of[e] < 0]
        fetched = uncached[::-1][:counts[len(uncached)]]          # from the last rank down
        for r, e in enumerate(row):
            if slot_of[e] >= 0:
                where[i, r] = slot_of[e]
            elif r in fetched:
                where[i, r] = -2 - (i * per_row + fetched.index(r))
    return where, np.where(where == ec.ON_CPU, experts, ~experts)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_device_routing_places_each_pair_by_the_rule(share):
    rng = np.random.default_rng(7)
    n, n_expert, k = 5, 16, 4
    logits = rng.standard_normal((n, n_expert)).astype(np.float32)
    want_experts, want_weights = cpu.moe.route(logits, k)
    slot_of = np.full(n_expert, -1, np.int32)
    slot_of[[1, 4, 6, 9, 12, 13]] = np.arange(6)
    counts = pcie_counts(share, k)
    experts = cuda.to_device(np.full((n, k), 99, np.int64))
    weights = cuda.to_device(np.full((n, k), np.nan, np.float32))
    where = cuda.to_device(np.full((n, k), 99, np.int32))
    ec.route(cuda.to_device(logits), experts, weights, where, (cuda.to_device(slot_of), cuda.to_device(counts)))
    want_where, want_host = place_like_the_module_says(want_experts, slot_of, counts)
    assert np.array_equal(where.copy_to_host(), want_where)
    assert np.array_equal(experts.copy_to_host(), want_host)
    np.testing.assert_allclose(weights.copy_to_host(), want_weights, rtol=1e-6)
    got = where.copy_to_host()
    assert (got <= -2).any() == (share > 0) and (got >= 0).any() and (got == ec.ON_CPU).any() == (share < 1)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q5_1", "IQ4_NL", "Q3_K", "Q2_K", "IQ2_S", "IQ1_M", "MXFP4",
                                  "IQ3_S"])
def test_each_gpu_pair_has_the_bits_of_a_one_slot_matvec_wherever_it_reads_from(kind):
    """Cached pairs read their cache slot, fetched pairs their staging slot, CPU pairs are
    skipped."""
    rng = np.random.default_rng(5)
    rows, cols, slots, n, k = 8, 256, 3, 2, 3
    stack = random_rows(kind, slots * rows, cols, rng).reshape(slots, rows, -1)
    staged = random_rows(kind, 4 * rows, cols, rng).reshape(4, rows, -1)
    where = np.array([[2, -1, -2 - 3], [-2 - 0, 0, -1]], np.int32)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    t = type_id(kind)
    x_dev = cuda.to_device(x)
    out = cuda.to_device(np.full((n * k, rows), np.nan, np.float32))
    s = gpu.runtime.memory.stream()
    mq.experts_matvec(t, cuda.to_device(stack), cuda.to_device(staged), cuda.to_device(where),
                      mq.quantize(x_dev, s, mq.UNITS[t].x_layout), out, False, s)
    got = out.copy_to_host()
    for a in range(n * k):
        i, code = a // k, where[a // k, a % k]
        if code == ec.ON_CPU:
            assert np.isnan(got[a]).all(), a                # left as it was
            continue
        matrix = stack[code] if code >= 0 else staged[-2 - code]
        one = cuda.to_device(np.zeros((1, rows), np.float32))
        mq.matvec(t, cuda.to_device(np.ascontiguousarray(matrix)), x_dev[i:i + 1], one, rows, cols, 1, s)
        assert np.array_equal(got[a].view(np.uint32), one.copy_to_host()[0].view(np.uint32)), a
        assert np.abs(got[a]).max() > 0


def test_fetch_copies_each_pcie_pair_into_its_staging_slot():
    """A fused gate_up tensor (the halves step over each other) and a plain down stack: every
    fetched pair's slot holds its expert's matrices, the other slots stay as they were."""
    moe = hybrid_moe(seed=49)
    rng = np.random.default_rng(9)
    fused = random_rows("Q8_0", E * 2 * F, D, rng).reshape(E, 2 * F, -1)
    moe = dataclasses.replace(moe, gate=dataclasses.replace(moe.gate, data=fused[:, :F]),
                              up=dataclasses.replace(moe.up, data=fused[:, F:]))
    cache = ec.ExpertCache(moe, 0, 1.0)
    assert cache.pcie == "mapped" and cache.steps == (2, 2, 1) and cache.per_row == K
    experts = np.array([[3, 0], [1, 2]], np.int64)
    where = np.array([[-2 - 1, ec.ON_CPU], [-2 - 2, -2 - 3]], np.int32)
    staged = cache.staging()
    for stage in staged:
        stage.copy_to_device(np.full(stage.shape, 7, np.uint8))
    host_experts = cuda.to_device(np.where(where == ec.ON_CPU, experts, ~experts))
    ec.fetch(cache, cuda.to_device(where), host_experts, staged, gpu.runtime.memory.stream(), kinds=(2,))
    got = [stage.copy_to_host() for stage in staged]
    assert (got[0] == 7).all() and (got[1] == 7).all()                # down only: as the second part of `run`
    assert np.array_equal(got[2][1], moe.down.data[3])
    ec.fetch(cache, cuda.to_device(where), host_experts, staged, gpu.runtime.memory.stream())
    got = [stage.copy_to_host() for stage in staged]
    for (i, r), slot in {(0, 0): 1, (1, 0): 2, (1, 1): 3}.items():
        for kind, m in enumerate((moe.gate, moe.up, moe.down)):
            assert np.array_equal(got[kind][slot], m.data[experts[i, r]]), (i, r, kind)
    assert all((g[0] == 7).all() for g in got) and all((g[4:] == 7).all() for g in got)


def test_host_stacks_of_a_fused_tensor_step_over_the_other_half():
    fused = np.arange(3 * 4 * 2, dtype=np.uint8).reshape(3, 4, 2)     # 3 experts, gate rows 0-1, up rows 2-3
    gate, up = fused[:, :2], fused[:, 2:]
    for half in (gate, up):
        stack, step = ec._host_stack(half)
        assert step == 2 and stack.flags.c_contiguous and stack.shape == (5, 2, 2)
        for e in range(3):
            assert np.array_equal(stack[e * step], half[e])
    stack, step = ec._host_stack(np.ascontiguousarray(gate))
    assert step == 1 and stack.shape == (3, 2, 2)


@pytest.mark.parametrize("slots, share", [(1, 0.0), (E, 0.0), (1, 1.0), (0, 0.5)],
                         ids=["some-cached", "all-cached", "cached-and-pcie", "pcie-only"])
def test_hybrid_moe_with_gpu_experts_matches_the_cpu_op_in_one_hand_off(hand_offs, monkeypatch, slots, share):  # noqa: F811
    moe = hybrid_moe(seed=44)
    cache = ec.ExpertCache(moe, slots, share)
    assert cache.pcie == ("mapped" if share else "off")
    gpu_moe = dataclasses.replace(moe, cache=cache)
    x = np.random.default_rng(45).standard_normal((3, D)).astype(np.float32)
    want, want_stats = np.empty_like(x), RecordingStats()
    cpu.ops.moe_ffn(host_copy(moe), x, want, want_stats)

    ran_on_host = []
    real = cpu.moe.run_routed

    def recording(ffn, x, experts, weights, out, stats=None):
        ran_on_host.append(np.where(experts >= 0, experts, -1))
        real(ffn, x, experts, weights, out, stats)
    monkeypatch.setattr(gpu.moe, "run_routed", recording)

    out, stats = cuda.to_device(np.full_like(x, np.nan)), RecordingStats()
    gpu.ops.moe_ffn(gpu_moe, cuda.to_device(x), out, stats)
    assert len(hand_offs) == 1
    chosen = want_stats.chosen[0]
    assert np.array_equal(cpu.moe_kernel.expert_ids(stats.chosen[0]), chosen)   # every pair counted
    want_where, want_host = place_like_the_module_says(chosen, cache.host_slot_of,
                                                       pcie_counts(share, K))
    assert (want_where != ec.ON_CPU).any()
    assert np.array_equal(ran_on_host[0], np.where(want_where == ec.ON_CPU, chosen, -1))
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-5)

    # every row has the bits of a one-row call
    one = cuda.to_device(np.zeros((1, D), np.float32))
    gpu.ops.moe_ffn(gpu_moe, cuda.to_device(x[1:2]), one)
    assert np.array_equal(out.copy_to_host()[1].view(np.uint32), one.copy_to_host()[0].view(np.uint32))


def test_prompt_sized_calls_fetch_nothing_over_pcie():
    moe = hybrid_moe(seed=47)
    fetching, caching = ec.ExpertCache(moe, 0, 1.0), ec.ExpertCache(moe, 1)
    for n, fetched in ((1, True), (PCIE_MAX_ROWS, True), (PCIE_MAX_ROWS + 1, False)):
        assert fetching.tables(n)[1].copy_to_host().any() == fetched
        assert fetching.fetches(n) == fetching.runs(n) == fetched
        assert caching.runs(n) and not caching.fetches(n)
    assert not caching.runs(ec.MAX_PAIRS // K + 1)


def test_a_share_outside_zero_to_one_is_refused():
    with pytest.raises(ValueError, match="0..1"):
        ec.ExpertCache(hybrid_moe(seed=48), 1, 1.5)


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
