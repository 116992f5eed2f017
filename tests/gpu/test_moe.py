"""gpu.ops.moe_ffn in hybrid placement (routed experts in host memory, router and shared expert on
the device): the same result and expert choice as the CPU op, in exactly ONE host hand-off, with
nothing that would stop a CUDA-graph capture, and every row with the bits of a one-row call.

Shapes are tiny (D 32, 4 experts) because the CUDA simulator runs a device matvec in ~1 s."""
import mmap

import numpy as np
import pytest
from numba import cuda

import cpu.ops
import gpu.runtime.graphs
import gpu.runtime.memory
import gpu.ops
from hybrid.forward import MoEStats
from cpu.ggml_types import F32
from hybrid.weights import DenseFFN, Experts, Matrix, MoEFFN
from tests.cpu.quant_data import random_rows, type_id
from tests.gpu.test_ops import quick_simulator  # noqa: F401 (autouse fixture)

D, F, E, K = 32, 32, 4, 2


class RecordingStats(MoEStats):
    """MoEStats that also keeps the experts each call chose."""

    def __init__(self):
        super().__init__()
        self.chosen = []

    def count(self, ffn, experts):
        super().count(ffn, experts)
        self.chosen.append(np.array(experts))


def page_backed(a: np.ndarray) -> np.ndarray:
    """a copied into pages of its own, as a tensor of the mapped GGUF file is: the PCIe share
    page-locks an expert stack's pages read-only for the GPU (gpu/runtime/host_mapping.py), and a heap
    array's pages would hold other arrays too (a later copy down into one of them fails)."""
    pages = np.frombuffer(mmap.mmap(-1, -(-a.nbytes // mmap.PAGESIZE) * mmap.PAGESIZE), np.uint8)
    out = pages[:a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def hybrid_moe(router_on_device=True, seed=40):
    """Q8_0 routed experts in host memory (the fused CPU kernel runs them); F32 router, shared
    expert and shared gate, uploaded unless told otherwise."""
    rng = np.random.default_rng(seed)

    def matrix(name, rows, cols, scale, device=True):
        data = np.ascontiguousarray(rng.standard_normal((rows, cols)) * scale, np.float32).view(np.uint8)
        return Matrix(name, F32.id, cuda.to_device(data) if device else data, rows, cols)

    def experts(name, rows, cols):
        data = page_backed(random_rows("Q8_0", E * rows, cols, rng).reshape(E, rows, -1))
        return Experts(name, type_id("Q8_0"), data, rows, cols)

    shared = DenseFFN(matrix("sg", F, D, 0.3), matrix("su", F, D, 0.3), matrix("sd", D, F, 0.3))
    return MoEFFN(router=matrix("router", E, D, 1.0, router_on_device), gate=experts("g", F, D),
                  up=experts("u", F, D), down=experts("d", D, F), n_used=K, shared=shared,
                  shared_gate=matrix("sgate", 1, D, 0.3))


def host_copy(moe):
    """The same FFN with every matrix in host memory (the CPU op's input)."""
    def host(m):
        return m if isinstance(m.data, np.ndarray) else Matrix(m.name, m.wtype, m.data.copy_to_host(), m.rows, m.cols)
    sh = moe.shared
    return MoEFFN(host(moe.router), moe.gate, moe.up, moe.down, moe.n_used,
                  DenseFFN(host(sh.gate), host(sh.up), host(sh.down)), host(moe.shared_gate))


@pytest.fixture
def hand_offs(monkeypatch):
    """Counts host hand-offs (through either name the GPU code calls them by) and fails a
    capture-blocking call: the hybrid path must stay capturable."""
    calls = []
    real = gpu.runtime.memory.host_call

    def counting(inputs, outputs, fn, meanwhile=None, bind=None):
        calls.append(1)
        real(inputs, outputs, fn, meanwhile, bind)

    def no_eager(why):
        raise AssertionError(f"the hybrid MoE path asked for eager execution: {why}")

    monkeypatch.setattr(gpu.runtime.memory, "host_call", counting)
    monkeypatch.setattr(gpu.ops, "host_call", counting)
    monkeypatch.setattr(gpu.runtime.graphs, "require_eager", no_eager)
    return calls


@pytest.mark.parametrize("router_on_device", [True, False], ids=["router-on-device", "router-on-host"])
def test_hybrid_moe_matches_the_cpu_op_in_one_hand_off(hand_offs, router_on_device):
    moe = hybrid_moe(router_on_device)
    x = np.random.default_rng(41).standard_normal((3, D)).astype(np.float32)
    want = np.empty_like(x)
    want_stats = RecordingStats()
    cpu.ops.moe_ffn(host_copy(moe), x, want, want_stats)

    out = cuda.to_device(np.full_like(x, np.nan))
    stats = RecordingStats()
    gpu.ops.moe_ffn(moe, cuda.to_device(x), out, stats)
    assert len(hand_offs) == 1
    assert len(stats.chosen) == 1 and np.array_equal(stats.chosen[0], want_stats.chosen[0])
    assert (stats.rows, stats.expert_bytes_read) == (want_stats.rows, want_stats.expert_bytes_read) == (
        3, len(np.unique(want_stats.chosen[0])) * moe.expert_bytes)
    # routed part: the same CPU kernel; shared expert and gate: device vs CPU float32 sums
    np.testing.assert_allclose(out.copy_to_host(), want, rtol=1e-4, atol=1e-5)
    assert np.abs(want).max() > 0.1


def test_hybrid_moe_rows_have_the_bits_of_one_row_calls(hand_offs):
    moe = hybrid_moe()
    x = np.random.default_rng(42).standard_normal((3, D)).astype(np.float32)
    x[1] = x[0]                                   # two rows in the same expert groups
    out = cuda.to_device(np.zeros_like(x))
    gpu.ops.moe_ffn(moe, cuda.to_device(x), out)
    one = cuda.to_device(np.zeros((1, D), np.float32))
    gpu.ops.moe_ffn(moe, cuda.to_device(x[2:]), one)
    assert len(hand_offs) == 2
    got = out.copy_to_host()
    assert np.array_equal(got[2].view(np.uint32), one.copy_to_host()[0].view(np.uint32))
    assert np.array_equal(got[0].view(np.uint32), got[1].view(np.uint32))
