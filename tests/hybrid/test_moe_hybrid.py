"""A tiny qwen35moe model (with MTP) on the GPU backend in hybrid placement — routed experts in
host memory, router (and on a real GPU the trunk and shared expert) on the device: the forward
agrees with the CPU forward, hands each MoE layer to the host exactly once, keeps every row's
bits in a multi-row call, greedy drafting equals plain decoding, and once warm a drafting step
replays its graphs and hands each draft exactly one MoE row.

Under the CUDA simulator a device matvec costs ~1 s, so there only the routers are uploaded and
the model has one (attention) layer and no shared expert; the shared expert on the device is
covered op by op in tests/gpu/test_moe.py. On a real GPU the planner's placement is used."""
import numpy as np
import pytest

import gpu.runtime.memory
import gpu.ops
import hybrid.speculative as speculative
from gpu.runtime import graphs
from gpu import simulated
from hybrid.backend import GPUBackend
from hybrid.forward import Forward, MoEStats
from hybrid.generate import generate_tokens
from hybrid.model_file import open_model
from hybrid.mtp import MTPHead
from hybrid.placement import plan_placement
from hybrid.speculative import generate_speculative
from hybrid.synth import preset, write_model
from hybrid.synth.vocab import MIN_VOCAB
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)
from tests.hybrid.test_speculative import KnownFutureHead, LetterTokenizer, greedy

SIMULATED = simulated()
SHAPE = dict(n_embd=32, n_vocab=MIN_VOCAB + 8, n_head=2, n_head_kv=1, head_dim=16, n_rot=8, ssm_n_k_heads=1,
             ssm_n_v_heads=2, ssm_d_state=16, context_length=256, n_expert=4, n_expert_used=2, n_ff_exp=32)
SHAPE.update(dict(n_layer=1, full_attention_interval=1, n_ff_shexp=0) if SIMULATED else
             dict(n_layer=2, full_attention_interval=2, n_ff_shexp=32))
PROMPT = [3, 141, 59, 26, 53, 5]
N_TOKENS = 6 if SIMULATED else 24
LOGIT_TOL = 0.5            # the device router keeps float activations (tests/gpu/test_forward_gpu.py)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-hybrid") / "tiny-moe.gguf"
    write_model(path, preset("tiny", arch="qwen35moe", **SHAPE), types="Q8_0", seed=5)
    with open_model(path) as mf:
        yield mf


def hybrid_forward(model_file, cuda_graphs=True, expert_cache=None, pcie_share=0.0, backend="gpu",
                   stream_experts=False) -> Forward:
    if SIMULATED:
        placement = lambda name: "gpu" if name.endswith(".ffn_gate_inp.weight") else "cpu"  # noqa: E731
    else:
        placement = plan_placement(model_file, 1 << 30, n_ring=3).side
    fw = Forward(model_file, backend=backend, placement=placement, cuda_graphs=cuda_graphs, expert_cache=expert_cache,
                 pcie_share=pcie_share, stream_experts=stream_experts)
    for layer in (*fw.weights.layers, fw.weights.mtp.block):
        assert layer.ffn.router.location == "gpu" and layer.ffn.gate.location == "cpu"
    return fw


@pytest.fixture(scope="module")
def hybrid(model_file):
    return hybrid_forward(model_file)


def test_forward_matches_the_cpu_with_one_hand_off_per_moe_layer(hybrid, model_file, monkeypatch):
    ids = np.array(PROMPT[:3])
    cpu_fw = Forward(model_file)
    want, _ = cpu_fw.forward(cpu_fw.new_state(32), ids, logits="all")

    hand_offs, calls_in_moe = [], []
    real_host_call, real_moe = gpu.runtime.memory.host_call, gpu.ops.moe_ffn

    def counting_host_call(inputs, outputs, fn, meanwhile=None, bind=None):
        hand_offs.append(1)
        real_host_call(inputs, outputs, fn, meanwhile, bind)

    def counting_moe(moe, x, out, stats=None):
        before = len(hand_offs)
        real_moe(moe, x, out, stats)
        calls_in_moe.append(len(hand_offs) - before)

    monkeypatch.setattr(gpu.runtime.memory, "host_call", counting_host_call)
    monkeypatch.setattr(gpu.ops, "host_call", counting_host_call)
    monkeypatch.setattr(gpu.ops, "moe_ffn", counting_moe)
    got, _ = hybrid.forward(hybrid.new_state(32), ids, logits="all")
    assert calls_in_moe == [1] * SHAPE["n_layer"]
    assert np.abs(got - want).max() < LOGIT_TOL and (got.argmax(1) == want.argmax(1)).all()
    assert hybrid.last_moe_stats == cpu_fw.last_moe_stats        # the same experts were read


def test_rows_of_one_call_have_the_bits_of_token_by_token_calls(hybrid):
    ids = np.array(PROMPT[:3])
    whole, hidden = hybrid.forward(hybrid.new_state(32), ids, logits="all")
    state = hybrid.new_state(32)
    parts = [hybrid.forward(state, ids[t:t + 1], logits="all") for t in range(len(ids))]
    np.testing.assert_array_equal(np.concatenate([p[0] for p in parts]), whole)
    np.testing.assert_array_equal(np.concatenate([p[1] for p in parts]), hidden)


N_CTX = len(PROMPT) + N_TOKENS + 8


@pytest.fixture(scope="module")
def plain(hybrid):
    return [e.id for e in generate_tokens(hybrid, hybrid.new_state(N_CTX), LetterTokenizer(), PROMPT,
                                          max_tokens=N_TOKENS, sampler=greedy(), n_ctx=N_CTX, ignore_eos=True)
            if hasattr(e, "id")]


def drafting(fw, plain, state, n_tokens=N_TOKENS, prompt=PROMPT):
    """Greedy drafting at depth 2 with drafts that are right ~70% of the time (KnownFutureHead)."""
    head = KnownFutureHead(MTPHead(fw), prompt + plain, fw.config.n_vocab)
    return list(generate_speculative(fw, head, state, LetterTokenizer(), prompt, max_tokens=n_tokens,
                                     sampler=greedy(), depth=2, n_ctx=N_CTX, ignore_eos=True))


def test_greedy_drafting_equals_plain_decoding(hybrid, plain):
    events = drafting(hybrid, plain, hybrid.new_state(N_CTX, n_ring=3))
    assert [e.id for e in events if hasattr(e, "id")] == plain and len(plain) == N_TOKENS
    stats = events[-1].stats.draft
    assert 0 < stats["accepted"] < stats["drafted"]           # both outcomes happened


@pytest.mark.parametrize("slots, share", [(2, 0.0), (1, 0.5)], ids=["cache", "cache-and-pcie"])
def test_with_gpu_experts_the_forward_agrees_and_drafting_stays_lossless(model_file, slots, share):
    """Some of each layer's experts (the MTP block's too) cached on the GPU, and a share of the
    others read by it over PCIe: the logits agree with the CPU forward, rows keep their one-row
    bits, and greedy drafting equals plain decoding."""
    n_layer = SHAPE["n_layer"]
    fw = hybrid_forward(model_file, expert_cache={i: slots for i in range(n_layer + 1)}, pcie_share=share)
    caches = [layer.ffn.cache for layer in (*fw.weights.layers, fw.weights.mtp.block)]
    assert all(c is not None and c.pcie == ("mapped" if share else "off") for c in caches)
    ids = np.array(PROMPT[:3])
    cpu_fw = Forward(model_file)
    want, _ = cpu_fw.forward(cpu_fw.new_state(32), ids, logits="all")
    got, _ = fw.forward(fw.new_state(32), ids, logits="all")
    assert np.abs(got - want).max() < LOGIT_TOL and (got.argmax(1) == want.argmax(1)).all()
    state = fw.new_state(N_CTX)
    parts = [fw.forward(state, ids[t:t + 1], logits="all")[0] for t in range(len(ids))]
    np.testing.assert_array_equal(np.concatenate(parts), got)

    # plain greedy decoding of ids continues from that state (a prefill's bits, as just checked),
    # picking on the backend as generate_tokens does; drafting from ids must give its tokens
    n_tokens = 4 if SIMULATED else N_TOKENS
    cached_plain = [int(parts[-1][-1].argmax())]
    while len(cached_plain) < n_tokens:
        picks, _ = fw.forward(state, np.array(cached_plain[-1:]), logits="last", pick=True)
        cached_plain.append(int(picks.ids[-1]))
    events = drafting(fw, cached_plain, fw.new_state(N_CTX, n_ring=3), n_tokens, prompt=[int(t) for t in ids])
    assert [e.id for e in events if hasattr(e, "id")] == cached_plain
    assert events[-1].stats.draft["accepted"] > 0


@pytest.mark.parametrize("cached", [[], [2]], ids=["no-cache", "two-runs"])
def test_a_prompt_chunk_streams_the_uncached_experts_and_agrees_with_the_cpu(model_file, cached):
    """With expert streaming, a call of enough rows runs every routed expert on the GPU: the
    cached ones from the cache, the others copied in per layer (one copy per run of consecutive
    uncached experts); its logits agree with the CPU forward. Fewer rows hand off as before."""
    n_layer = SHAPE["n_layer"]
    backend = GPUBackend(stream_min_rows=4)
    fw = hybrid_forward(model_file, expert_cache={i: len(cached) for i in range(n_layer + 1)}, backend=backend,
                        stream_experts=True)
    try:
        check_streamed_chunk(fw, backend, model_file, cached)
    finally:
        # unpin the mapping now: a later test's uploads from the same mapping must not straddle
        # pages this one registered
        backend.streamer.close()


def check_streamed_chunk(fw, backend, model_file, cached):
    n_layer, n_expert = SHAPE["n_layer"], SHAPE["n_expert"]
    layers = [layer.ffn for layer in (*fw.weights.layers, fw.weights.mtp.block)]
    for ffn in layers:
        ffn.cache.load(ffn, cached)
        assert ffn.cache.streamer is backend.streamer and ffn.cache.streamable()
    uncached = [e for e in range(n_expert) if e not in cached]
    sources = layers[0].cache.stream_sources()
    assert [len(src.pieces) for src in sources] == [len(cached) + 1 if cached == [2] else 1] * 3
    for src, m in zip(sources, (layers[0].gate, layers[0].up, layers[0].down)):
        np.testing.assert_array_equal(np.concatenate(src.pieces), m.data[uncached])

    ids = np.array(PROMPT)
    cpu_fw = Forward(model_file)
    want, _ = cpu_fw.forward(cpu_fw.new_state(32), ids, logits="all")
    stats = backend.stream_stats
    stats.reset()
    got, _ = fw.forward(fw.new_state(32), ids, logits="all")
    assert np.abs(got - want).max() < LOGIT_TOL and (got.argmax(1) == want.argmax(1)).all()
    assert stats.calls == n_layer and stats.rows == n_layer * len(ids) and stats.cpu_ffn_calls == 0
    per_expert = sum(m.data[0].nbytes for m in (layers[0].gate, layers[0].up, layers[0].down))
    assert stats.bytes_copied == stats.copies * len(uncached) * per_expert

    stats.reset()
    fw.forward(fw.new_state(32), ids[:3], logits="all")       # under stream_min_rows: the host's
    assert stats.calls == 0


class Replayer:
    """A stand-in for a captured step under the simulator (which has no graphs): replaying it runs
    the step, so the cache's bookkeeping (eager, capture, replay) is the real one."""

    def __init__(self, body):
        self.replay = lambda seconds: body()

    def close(self):
        pass


def test_once_warm_a_drafting_step_replays_and_hands_each_draft_one_moe_row(model_file, plain, monkeypatch):
    """Issue 7 (a draft step cost ~15 ms more than its verify step on the 35B-A3B shape): after two
    generations have warmed the graphs, a third one over the same state captures nothing, runs no
    step eagerly, allocates no scratch, and per drafting step makes exactly these CPU hand-offs:
    one per draft (its MTP call runs the MoE FFN on that one row only: the pending rows before it
    only fill the head's KV cache), then one per trunk MoE layer with all verify rows; and each
    MTP call waits for the device once."""
    if SIMULATED:
        monkeypatch.setattr(graphs, "simulated", lambda: False)
        monkeypatch.setattr(graphs, "capture", Replayer)
    fw = hybrid_forward(model_file)
    state = fw.new_state(N_CTX, n_ring=3)
    n_tokens = 4                        # enough for a step with two drafts, and for both outcomes
    for _ in range(2):                  # warm-up: each step eager the first time, captured the second
        drafting(fw, plain, state, n_tokens)
        state.reset()

    log = []
    real_add, real_draft, real_to_host = MoEStats.add, speculative.draft_tokens, gpu.runtime.memory.to_host

    def add(stats, ffn, rows, *rest):       # every hand-off counts its rows, eager or replayed
        log.append(("moe rows", rows))
        return real_add(stats, ffn, rows, *rest)

    def draft_tokens(*args):
        log.append(("draft",))
        drafts = real_draft(*args)
        log.append(("verify", len(drafts)))
        return drafts

    def to_host(a):
        log.append(("to_host",))
        return real_to_host(a)

    monkeypatch.setattr(MoEStats, "add", add)
    monkeypatch.setattr(speculative, "draft_tokens", draft_tokens)
    monkeypatch.setattr(gpu.runtime.memory, "to_host", to_host)
    cache, scratch = fw.backend.graphs, {k: id(v) for k, v in gpu.runtime.memory._scratch.items()}
    captures, replays = cache.captures, cache.replays
    events = drafting(fw, plain, state, n_tokens)

    assert [e.id for e in events if hasattr(e, "id")] == plain[:n_tokens]
    assert cache.captures == captures and not cache._eager and cache.replays > replays
    assert {k: id(v) for k, v in gpu.runtime.memory._scratch.items()} == scratch
    steps = []                          # the log split at each step's draft (the prefill before it dropped)
    for entry in log:
        if entry == ("draft",):
            steps.append([])
        if steps:
            steps[-1].append(entry)
    n_layer = fw.config.n_layer
    for step in steps:
        k = next(e[1] for e in step if e[0] == "verify")
        cut = step.index(("verify", k))
        draft, verify = step[1:cut], step[cut + 1:]
        assert draft == [("moe rows", 1), ("to_host",)] * k, step
        assert verify == [("moe rows", k + 1)] * n_layer + [("to_host",)] * 2, step
    assert max(e[1] for step in steps for e in step if e[0] == "verify") == 2


@pytest.mark.skipif(SIMULATED, reason="CUDA graphs need a real GPU (the simulator has none)")
def test_hybrid_moe_steps_are_captured_and_replay_the_bits_of_eager_steps(model_file):
    eager, replayed = hybrid_forward(model_file, cuda_graphs=False), hybrid_forward(model_file)
    results = []
    for fw in (eager, replayed):
        state, steps = fw.new_state(32, n_ring=4), []
        steps.append(fw.forward(state, PROMPT[:2], logits="all"))
        for t in PROMPT[2:]:
            steps.append(fw.forward(state, [t], logits="all"))
        for _ in range(3):                            # a verify step, rolled back, three times
            steps.append(fw.forward(state, [7, 8, 9], logits="all", snapshot=True))
            state.rollback(1)
        results.append(steps)
    for (a, ha), (b, hb) in zip(*results):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(ha, hb)
    assert replayed.backend.graphs.captures == 3      # the decode step, the verify step, the rollback
    assert replayed.backend.graphs.replays >= len(PROMPT) - 2
