"""cpu.moe_kernel: the one-call routed-expert kernel against the expert-by-expert path, bit for
bit, for every row count a decode / verify step uses (1..9), for a prompt-sized call (parallel
quantisation and sum), and with its reused workspace shrinking and growing between calls.
Also `cpu.moe.routed_ffn`, the hand-off half the GPU backend calls."""
import numpy as np
import pytest

import cpu.moe
import cpu.moe_kernel
from cpu.moe import route, routed_ffn, router_logits

from .test_moe import D, K, make_ffn

CASES = [("Q4_K", "Q6_K", True), ("Q8_0", "Q4_0", False), ("Q5_K", "Q8_0", True), ("IQ4_NL", "Q5_0", False),
         ("MXFP4", "IQ4_NL", True)]


@pytest.fixture(scope="module")
def ffns():
    rng = np.random.default_rng(21)
    return [make_ffn(gate_up, down, fused, shared=False, rng=rng) for gate_up, down, fused in CASES]


def both_paths(ffn, x):
    """(fused kernel, expert-by-expert) outputs for rows x, routed alike."""
    experts, weights = route(router_logits(ffn, x), K)
    want = np.full(x.shape, np.nan, np.float32)
    cpu.moe._run_expert_by_expert(ffn, x, experts, weights, want)
    got = np.full(x.shape, np.nan, np.float32)
    assert cpu.moe._run_fused(ffn, x, experts, weights, got)
    return got, want


def same_bits(a, b):
    return np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_one_to_nine_rows_have_the_bits_of_the_expert_by_expert_path(ffns, case):
    ffn = ffns[case]
    x = np.random.default_rng(case).standard_normal((9, D)).astype(np.float32)
    for n in (9, 1, 2, 3, 4, 5, 6, 7, 8):        # the workspace shrinks, then grows again
        got, want = both_paths(ffn, x[:n])
        assert same_bits(got, want), n
        assert np.abs(got).max() > 0


def test_a_prompt_sized_call_takes_the_parallel_branches_and_keeps_the_bits(ffns):
    ffn = ffns[0]
    n = cpu.moe_kernel._PARALLEL_MIN // D + 3     # x quantised and rows summed in parallel regions
    x = np.random.default_rng(5).standard_normal((n, D)).astype(np.float32)
    got, want = both_paths(ffn, x)
    assert same_bits(got, want)
    one, _ = both_paths(ffn, x[n - 1:])
    assert same_bits(one[0], got[n - 1])


def test_routed_ffn_is_the_routed_part_of_moe_ffn():
    rng = np.random.default_rng(8)
    ffn = make_ffn("Q4_K", "Q4_K", fused=False, shared=False, rng=rng)
    x = rng.standard_normal((4, D)).astype(np.float32)
    want = np.empty_like(x)
    want_experts = cpu.moe.moe_ffn(ffn, x, want)
    got = np.empty_like(x)
    experts = routed_ffn(ffn, x, router_logits(ffn, x), got)
    assert np.array_equal(experts, want_experts) and same_bits(got, want)
    with pytest.raises(ValueError, match="logits"):
        routed_ffn(ffn, x, np.zeros((4, 3), np.float32), got)


@pytest.mark.parametrize("case", range(len(CASES)), ids=["-".join(map(str, c)) for c in CASES])
def test_pairs_marked_for_the_gpu_are_left_out_of_the_sum(ffns, case):
    """run_routed with some pairs marked ~e (the GPU runs those: its expert cache, or its reads over
    PCIe): the sum of the other pairs, with the bits of the expert-by-expert path given zero
    weight for the left-out ranks (adding 0 · y changes no bits but a zero's sign), and every
    pair still counted."""
    from hybrid.forward import MoEStats
    ffn = ffns[case]
    x = np.random.default_rng(30 + case).standard_normal((5, D)).astype(np.float32)
    experts, weights = route(router_logits(ffn, x), K)

    def check(on_gpu):
        want = np.empty_like(x)
        cpu.moe._run_expert_by_expert(ffn, x, experts, np.where(on_gpu, 0, weights).astype(np.float32), want)
        got, stats, want_stats = np.full_like(x, np.nan), MoEStats(), MoEStats()
        cpu.moe.run_routed(ffn, x, np.where(on_gpu, ~experts, experts), weights, got, stats)
        assert on_gpu.any() and not on_gpu.all()
        assert same_bits(got + 0.0, want + 0.0)       # + 0.0: -0.0 → 0.0
        assert np.abs(got).max() > 0
        want_stats.count(ffn, experts)
        assert stats == want_stats

    check(np.isin(experts, [experts[0, 0], experts[3, 1]]))        # by expert, as the cache splits
    # one expert left here: a single group, shared out row by row
    check(experts != experts[2, 0])
    check(np.arange(experts.size).reshape(experts.shape) % 3 == 1)  # by pair, as the PCIe share splits

    nothing = np.full_like(x, np.nan)
    cpu.moe.run_routed(ffn, x, ~experts, weights, nothing)
    assert np.array_equal(nothing, np.zeros_like(x))


@pytest.fixture(scope="module")
def wide_ffn():
    """Experts of 2.5 activation blocks of h rows: runs can hold some blocks whole and split others."""
    return make_ffn("Q4_K", "Q8_0", False, shared=False, rng=np.random.default_rng(22), n_ff=640)


@pytest.mark.parametrize("n_workers", [1, 3, 7, 16])
def test_chunks_claimed_by_any_number_of_workers_keep_the_bits(wide_ffn, n_workers):
    """However many workers claim the chunks (chunks then start and end inside activation blocks
    of h, and down chunks may wait for their group's gate/up), the result has the
    expert-by-expert path's bits."""
    ffn = wide_ffn
    x = np.random.default_rng(40 + n_workers).standard_normal((3, D)).astype(np.float32)
    experts, weights = route(router_logits(ffn, x), K)
    want = np.empty_like(x)
    cpu.moe._run_expert_by_expert(ffn, x, experts, weights, want)
    for _ in range(3):          # the counters are reset by each call
        got = np.full_like(x, np.nan)
        cpu.moe_kernel.routed_experts(*cpu.moe._fused_weights(ffn), ffn.gate.rows, x, experts, weights, got,
                                      n_workers, 0)
        assert same_bits(got, want)


@pytest.mark.parametrize("sizes", [[1] * 5, [4, 1, 2, 9, 1, 1], [3], [40, 1], []])
@pytest.mark.parametrize("goal", [1, 4, 64])
def test_plan_chunks_cuts_each_group_into_chunks_of_about_equal_cost(sizes, goal):
    n_rows = 64
    group_start = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    bound = cpu.moe_kernel._max_chunks(int(group_start[-1]), -(-goal // cpu.moe_kernel.CHUNKS_PER_WORKER))
    bounds = np.full(bound + 1, -1, np.int64)
    n = cpu.moe_kernel._plan_chunks(group_start, len(sizes), n_rows, goal, bounds)
    assert 0 <= n <= bound
    starts = bounds[:n + 1]
    assert starts[0] == 0 and starts[-1] == len(sizes) * n_rows and (np.diff(starts) > 0).all()
    # every group starts a chunk, so no chunk crosses one
    assert set(range(0, len(sizes) * n_rows, n_rows)) <= set(starts[:-1].tolist())
    # a pair (g, r) costs m_g + _ROW_READ; a chunk of more than one row costs at most the target
    pair_cost = np.repeat(np.array(sizes, np.int64) + cpu.moe_kernel._ROW_READ, n_rows)
    target = -(-pair_cost.sum() // goal) if sizes else 1
    for a, b in zip(starts[:-1], starts[1:]):
        assert b - a == 1 or pair_cost[a:b].sum() <= target


@pytest.mark.parametrize("case", [0, 1])
def test_a_bound_call_runs_on_whatever_its_arrays_hold_when_called(ffns, case):
    """bind_routed (a captured step's hand-off): bound once to buffers that are rewritten in place
    before each call, it gives run_routed's bits and counts, for each content in turn."""
    from hybrid.forward import MoEStats
    ffn = ffns[case]
    n = 3
    x, out = np.zeros((n, D), np.float32), np.zeros((n, D), np.float32)
    experts, weights = np.zeros((n, K), np.int64), np.zeros((n, K), np.float32)
    bound_stats = MoEStats()
    call = cpu.moe.bind_routed(ffn, x, experts, weights, out, bound_stats)
    rng = np.random.default_rng(50 + case)
    for _ in range(2):
        x[...] = rng.standard_normal((n, D)).astype(np.float32)
        experts[...], weights[...] = route(router_logits(ffn, x), K)
        experts[1, K - 1] = ~experts[1, K - 1]          # a pair the GPU would run
        call()
        want, want_stats = np.empty_like(x), MoEStats()
        cpu.moe.run_routed(ffn, x.copy(), experts.copy(), weights.copy(), want, want_stats)
        assert same_bits(out, want)
        assert bound_stats.expert_bytes_read == want_stats.expert_bytes_read > 0
        assert bound_stats.rows == want_stats.rows and bound_stats.saving == want_stats.saving
        bound_stats.reset()


@pytest.mark.parametrize("bad", [lambda e: e, lambda e: ~e, lambda e: 1 << 40])
def test_routing_naming_an_expert_the_layer_lacks_is_an_error_not_an_index(ffns, bad):
    """Garbage routing (a warm-up's plan pass that skipped the router, while this kernel, compiled
    in memory already, still runs: hybrid/kernel_prep.py) raises before any expert is indexed by
    it, in the kernel, its bound call and the grouping of the decoded path, and writes nothing."""
    ffn = ffns[0]
    n_expert = ffn.gate.data.shape[0]
    x = np.random.default_rng(3).standard_normal((2, D)).astype(np.float32)
    experts, weights = route(router_logits(ffn, x), K)
    experts[1, 0] = bad(n_expert)
    out = np.full(x.shape, 7.0, np.float32)
    with pytest.raises(ValueError, match="an expert the layer does not have"):
        cpu.moe.run_routed(ffn, x, experts, weights, out)
    call = cpu.moe.bind_routed(ffn, x, experts, weights, out)
    with pytest.raises(ValueError, match="an expert the layer does not have"):
        call()
    with pytest.raises(ValueError, match="an expert the layer does not have"):
        cpu.moe_kernel.group_slots(experts, n_expert)
    assert (out == 7.0).all()
    experts[1, 0] = n_expert - 1                    # the last expert is fine
    assert cpu.moe_kernel.group_slots(experts, n_expert)[3][-1] == n_expert - 1
