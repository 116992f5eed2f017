"""gpu.runtime.weight_stream: host FFN weights copied to the device per call, double-buffered.

* The streamer alone: FFNs with weights in host memory, run in and out of the expected order,
  against a float64 SwiGLU; which calls copied and which found their weights already there.
* The hybrid forward: a prompt chunk of 130 rows with the FFNs streamed equals the same chunk
  with the CPU hand-off (float weights: tight); a short call after it takes the hand-off.

On the CUDA simulator the trunk's kernels would take minutes over 130 rows, so there the
forward's trunk ops (norms, mixers, residual adds) run as their CPU twins on copies of the
device arrays (`host_trunk_ops`); the FFN path under test (streamer, slots, GEMMs) is the real
device code either way. On a real GPU the real op set runs, and the copies take both routes:
straight from registered (page-locked) host memory and through the pinned staging buffers.
"""
import types

import numpy as np
import pytest
from numba import cuda

import cpu.ops
import gpu.ops
from gpu.runtime import memory
from gpu import available, simulated
from gpu.ffn import dense_ffn
from gpu.runtime.weight_stream import StreamStats, WeightStreamer
from cpu import ggml_types as gt
from hybrid.backend import GPUBackend
from hybrid.forward import Forward
from hybrid.model_file import open_model
from hybrid.synth import preset, write_model
from hybrid.synth.vocab import MIN_VOCAB
from hybrid.weights import DenseFFN, Matrix
from tests.gpu.test_matvec import random_weights, reference
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

REAL_GPU = available() and not simulated()
REGISTER = [False, True] if REAL_GPU else [False]      # the simulator cannot page-lock memory


def host_ffn(rng, D: int, F: int, t=gt.Q8_0) -> DenseFFN:
    def matrix(name, rows, cols):
        return Matrix(name, t.id, random_weights(t, rows, cols, rng), rows, cols)
    return DenseFFN(matrix("gate", F, D), matrix("up", F, D), matrix("down", D, F))


def ffn_reference(ffn: DenseFFN, x: np.ndarray) -> np.ndarray:
    t = gt.SUPPORTED[ffn.gate.wtype]
    g, _ = reference(t, ffn.gate.data, x)
    u, _ = reference(t, ffn.up.data, x)
    return reference(t, ffn.down.data, g / (1 + np.exp(-g)) * u)[0]


@pytest.mark.parametrize("register", REGISTER, ids=lambda r: "registered" if r else "staged")
def test_streamed_ffns_match_float64_in_and_out_of_order(register):
    rng = np.random.default_rng(1)
    D, F, n = 32, 32, 2
    # F32: the float kernel, so float64 is tight (quantised types round x to int8: test_matvec_q8)
    ffns = [host_ffn(rng, D, F, gt.F32) for _ in range(3)]
    # staging buffers smaller than a matrix, and not a divisor of its size: several pieces
    streamer = WeightStreamer(dense_ffn, min_rows=1, register=register, stage_bytes=1000)
    streamer.set_order(ffns)
    x = rng.standard_normal((n, D)).astype(np.float32)
    x_dev = cuda.to_device(x)
    h, out = cuda.device_array((n, F), np.float32), cuda.device_array((n, D), np.float32)

    def run(ffn):
        before = streamer.stats.copies
        streamer.run(ffn, x_dev, h, out)
        got, want = out.copy_to_host(), ffn_reference(ffn, x)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
        return streamer.stats.copies - before

    # in order: the first call copies its own layer, every call prefetches the next one (f2's
    # next is f0: the slots now hold f2 and f0)
    assert [run(f) for f in ffns] == [2, 1, 1]
    # out of order: f1 is copied on the spot (over f0), f2 is still there ...
    assert run(ffns[1]) == 1
    # ... and f2 now prefetches f1, its successor last time, not f0: nothing more to copy
    assert [run(ffns[2]), run(ffns[1])] == [0, 0]
    stats = streamer.stats
    assert stats.calls == 6 and stats.rows == 6 * n
    assert stats.bytes_copied == stats.copies * sum(m.data.nbytes for m in (ffns[0].gate, ffns[0].up, ffns[0].down))
    assert stats.pinning == "registered" if register else stats.pinning.startswith("staged"), stats.pinning
    streamer.close()


def test_only_dense_host_ffns_of_enough_rows_are_streamed():
    from hybrid.backend import streamable_ffn
    rng = np.random.default_rng(2)
    ffn = host_ffn(rng, 32, 32)
    on_device = DenseFFN(ffn.gate, ffn.up, Matrix("down", ffn.down.wtype, memory.upload(ffn.down.data), 32, 32))
    assert streamable_ffn(ffn, memory.is_device) and not streamable_ffn(on_device, memory.is_device)
    streamer = WeightStreamer(dense_ffn, min_rows=16)
    assert not streamer.wants(ffn, 64)              # only the FFNs the backend named
    streamer.set_order([ffn])
    assert streamer.wants(ffn, 16) and not streamer.wants(ffn, 15)
    assert not streamer.wants(on_device, 64)
    none = WeightStreamer(dense_ffn, min_rows=None)
    none.set_order([ffn])
    assert not none.wants(ffn, 1 << 20)


def test_stats_reset_keeps_the_pinning_facts():
    stats = StreamStats(timing=True, calls=3, pinning="registered", pin_seconds=1.5)
    stats.reset()
    assert (stats.calls, stats.timing, stats.pinning, stats.pin_seconds) == (0, True, "registered", 1.5)


# --- the hybrid forward ---------------------------------------------------------------------------

SHAPE = dict(n_layer=2, full_attention_interval=2, n_embd=16, n_vocab=MIN_VOCAB + 8, n_head=2, n_head_kv=1,
             head_dim=16, n_rot=8, ssm_n_k_heads=1, ssm_n_v_heads=2, n_ff=16, context_length=512)
CHUNK = 130
TOL = 2e-4          # float weights: the GEMM's float32 sums vs the CPU's, over a 2-layer model


def host_trunk_ops():
    """gpu.ops with the trunk's kernels replaced by their CPU twins on host copies of the device
    arrays (each device argument is copied down, the CPU op runs, every one is copied back up).
    The matrix ops stay gpu.ops' own: with every weight in host memory they hand off to the CPU."""
    def twin(name):
        host_op = getattr(cpu.ops, name)

        def op(*args):
            seen, pairs = {}, []           # (device array, its host copy), each once

            def down(a):
                if isinstance(a, tuple):   # gdn_mixer's (weights, state, rings)
                    return tuple(down(e) for e in a)
                if not memory.is_device(a):
                    return a
                if id(a) not in seen:
                    seen[id(a)] = a.copy_to_host()
                    pairs.append((a, seen[id(a)]))
                return seen[id(a)]
            result = host_op(*(down(a) for a in args))
            for dev, h in pairs:
                if dev.size:
                    dev.copy_to_device(h)
            return result
        return op

    keep = {"NAME", "matvec", "matvecs", "swiglu", "moe_ffn", "dequantize_rows", "rope_inv_freq"}
    ops = {name: getattr(gpu.ops, name) if name in keep else twin(name) for name in gpu.ops.__all__}
    ops["KV_DTYPE"] = cpu.ops.KV_DTYPE      # the cache the CPU twins of the attention ops can read
    return types.SimpleNamespace(**ops)


@pytest.fixture(scope="module")
def float_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "tiny-F32.gguf"
    write_model(path, preset("tiny", arch="qwen35", ssm_d_state=8, **SHAPE), types="F32", seed=11)
    with open_model(path) as mf:
        yield mf


class QuickZerosBackend(GPUBackend):
    """Zeroed buffers made on the host and uploaded: the simulator would spend most of this
    test filling the forward's 130-row scratch one simulated thread per element."""

    def zeros(self, shape, dtype=np.float32):
        return cuda.to_device(np.zeros(shape, dtype))


def forward(mf, register: bool, stream: bool) -> Forward:
    ops, backend_class = (None, GPUBackend) if REAL_GPU else (host_trunk_ops(), QuickZerosBackend)
    backend = backend_class(ops, stream_weights=stream, stream_min_rows=CHUNK, register_host_memory=register)
    return Forward(mf, backend=backend, placement=lambda name: "cpu")


@pytest.mark.parametrize("register", REGISTER, ids=lambda r: "registered" if r else "staged")
def test_a_prompt_chunk_with_streamed_ffns_matches_the_cpu_hand_off(float_model, register):
    ids = np.random.default_rng(3).integers(0, float_model.config.n_vocab, CHUNK + 3)
    handed, streamed = forward(float_model, register, stream=False), forward(float_model, register, stream=True)
    want, want_hidden = handed.forward(handed.new_state(CHUNK + 8), ids[:CHUNK], logits="all")
    state = streamed.new_state(CHUNK + 8)
    got, hidden = streamed.forward(state, ids[:CHUNK], logits="all")
    assert np.abs(got - want).max() < TOL and np.abs(hidden - want_hidden).max() < TOL
    stats = streamed.backend.stream_stats
    assert stats.calls == 2 and stats.rows == 2 * CHUNK and stats.cpu_ffn_calls == 0
    # two layers, two slots: layer 0 copied on the spot, layer 1 prefetched, and layer 0 (the
    # next chunk's first) found still in place
    assert stats.copies == 2
    assert handed.backend.stream_stats.calls == 0 and handed.backend.stream_stats.cpu_ffn_calls == 2
    # fewer rows than the threshold: the CPU hand-off
    streamed.forward(state, ids[CHUNK:], logits="none")
    assert stats.calls == 2 and stats.cpu_ffn_calls == 2
