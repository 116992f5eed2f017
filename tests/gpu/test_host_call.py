"""gpu.runtime.memory.host_call with `meanwhile` GPU work, eager and replayed from a CUDA graph.

Everywhere: fn sees the inputs as they were when the call began, the outputs come back up, the
meanwhile work lands, and work queued after the call sees both. On a real GPU, also the point of
it: the host runs fn while the GPU still runs the meanwhile work (a flag that work sets last is
not set when fn starts), in an eager call and in a replayed graph.
"""
import numpy as np
import pytest
from numba import cuda

from gpu.runtime import graphs, memory
from gpu import simulated

real_gpu = pytest.mark.skipif(simulated(), reason="the simulator runs every launch to completion at once")


@cuda.jit
def _add_one(src, dst):
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] = src[i] + 1


@cuda.jit
def _add(dst, src):
    i = cuda.grid(1)
    if i < dst.size:
        dst[i] += src[i]


@cuda.jit
def _sleep_then_flag(ms, flag):
    for _ in range(ms):
        cuda.nanosleep(1000000)        # at most ~1 ms per call
    cuda.threadfence_system()
    flag[0] = 1


def _launch(kernel, *args):
    kernel[1, 32, memory.stream()](*args)


def _step(x, out, side, total, seen, meanwhile_extra=None, check=None):
    """One hand-off: fn doubles x on the host into out (calling check first); meanwhile side =
    x + 1 on the GPU (then meanwhile_extra); then total = out + side on the GPU."""
    def fn(x_host, out_host):
        if check is not None:
            check()
        seen.append(x_host.copy())
        out_host[:] = 2 * x_host

    def meanwhile():
        _launch(_add_one, x, side)
        if meanwhile_extra is not None:
            meanwhile_extra()
    memory.host_call((x,), (out,), fn, meanwhile)
    memory.copy(total, out)
    _launch(_add, total, side)


def _buffers(n=32):
    x = memory.upload(np.arange(n, dtype=np.float32))
    return x, *(memory.zeros(n) for _ in range(3))


def test_meanwhile_work_lands_and_later_work_sees_both_outputs():
    x, out, side, total = _buffers()
    seen = []
    _step(x, out, side, total, seen)
    want = np.arange(32, dtype=np.float32)
    np.testing.assert_array_equal(seen[0], want)
    np.testing.assert_array_equal(memory.to_host(out), 2 * want)
    np.testing.assert_array_equal(memory.to_host(side), want + 1)
    np.testing.assert_array_equal(memory.to_host(total), 3 * want + 1)


def _overlap_probe():
    """(meanwhile_extra, fn_check, fired, clear): the extra work sleeps ~50 ms on the GPU, then
    sets a flag in mapped host memory (readable by the host at any time, and a fixed address for
    a graph); the check records whether the flag was set when fn ran. The flag is set after fn
    has run, so it must be cleared (once the GPU is done) before the next step."""
    flag = cuda.mapped_array(1, np.int32)
    flag[0] = 0
    fired = []

    def clear():
        flag[0] = 0
    return lambda: _launch(_sleep_then_flag, 50, flag), lambda: fired.append(bool(flag[0])), fired, clear


@real_gpu
def test_the_host_runs_fn_while_the_gpu_runs_the_meanwhile_work():
    x, out, side, total = _buffers()
    extra, check, fired, _ = _overlap_probe()
    _step(x, out, side, total, [], extra, check)
    memory.synchronize()
    assert fired == [False]
    np.testing.assert_array_equal(memory.to_host(total), 3 * np.arange(32, dtype=np.float32) + 1)


@real_gpu
def test_a_replayed_hand_off_overlaps_too():
    x, out, side, total = _buffers()
    extra, check, fired, clear = _overlap_probe()
    cache = graphs.StepGraphs()
    for _ in range(3):                     # eager, captured + replayed, replayed
        memory.fill_zero(total)
        cache.run("step", lambda: _step(x, out, side, total, [], extra, check))
        memory.synchronize()
        clear()
    assert cache.captures == 1 and cache.replays == 2
    assert fired == [False, False, False]
    np.testing.assert_array_equal(memory.to_host(total), 3 * np.arange(32, dtype=np.float32) + 1)



@real_gpu
def test_a_replay_runs_the_bound_form_of_fn_on_the_staging_buffers():
    """host_call(..., bind=): an eager call runs fn; the capture binds once, and each replay runs
    the bound call on the staging buffers its copies refilled."""
    x, out, _, _ = _buffers()
    ran = []

    def fn(x_host, out_host):
        ran.append("fn")
        out_host[:] = 2 * x_host

    def bind(x_host, out_host):
        ran.append("bind")

        def call():
            ran.append("bound")
            out_host[:] = 2 * x_host
        return call
    cache = graphs.StepGraphs()
    for step in range(4):                  # eager, captured + replayed, replayed, replayed
        x.copy_to_device(np.arange(32, dtype=np.float32) + step)
        cache.run("step", lambda: memory.host_call((x,), (out,), fn, bind=bind))
        np.testing.assert_array_equal(memory.to_host(out), 2 * (np.arange(32, dtype=np.float32) + step))
    assert ran == ["fn", "bind", "bound", "bound", "bound"]


@real_gpu
def test_a_replay_whose_host_call_fails_raises_and_the_next_replay_is_whole():
    """Three hand-offs per step; the second one's fn raises in one replay. The error reaches the
    caller with nothing of the step left queued, and the next replay runs every hand-off on its
    own step's inputs again."""
    x = memory.upload(np.arange(32, dtype=np.float32))
    outs = [memory.zeros(32) for _ in range(3)]
    fail = []

    def fn(k):
        def run(x_host, out_host):
            if k == 1 and fail:
                raise ValueError("host call failed")
            out_host[:] = x_host + k
        return run

    def step():
        memory.host_call((x,), (outs[0],), fn(0))
        memory.host_call((outs[0],), (outs[1],), fn(1))
        memory.host_call((outs[1],), (outs[2],), fn(2))
    cache = graphs.StepGraphs()
    for _ in range(2):                     # eager, captured + replayed
        cache.run("step", step)
    fail.append(True)
    with pytest.raises(ValueError, match="host call failed"):
        cache.run("step", step)
    fail.clear()
    x.copy_to_device(np.full(32, 5, np.float32))
    cache.run("step", step)
    np.testing.assert_array_equal(memory.to_host(outs[2]), np.full(32, 8, np.float32))
    assert cache.captures == 1 and cache.replays == 2          # the failed replay is not counted


def _mapped_step(x, src, dst, total, seen):
    """One hand-off through mapped buffers: a kernel writes x + 1 into src's device side; fn reads
    src's host side and writes its triple into dst's host side; a kernel reads dst's device side
    into total. No copy moves either."""
    def fn(src_host, dst_host):
        seen.append(src_host.copy())
        dst_host[:] = 3 * src_host
    _launch(_add_one, x, src.device)
    memory.host_call((src,), (dst,), fn)
    memory.fill_zero(total)
    _launch(_add, total, dst.device)


@pytest.mark.parametrize("replayed", [False, pytest.param(True, marks=real_gpu)])
def test_mapped_inputs_and_outputs_go_without_copies(replayed, monkeypatch):
    """The data makes the round trip, and neither the eager call nor the capture queued a copy
    (`copied_pairs`, which both ask, named none)."""
    copies = []
    real_copied_pairs = memory.copied_pairs

    def recording_copied_pairs(arrays, hosts):
        pairs = real_copied_pairs(arrays, hosts)
        copies.extend(pairs)
        return pairs
    monkeypatch.setattr(memory, "copied_pairs", recording_copied_pairs)
    x = memory.upload(np.arange(32, dtype=np.float32))
    src, dst = memory.mapped("test.src", (32,)), memory.mapped("test.dst", (32,))
    total, seen = memory.zeros(32), []
    cache = graphs.StepGraphs(enabled=replayed)
    for step in range(3):                  # eager, then (replayed) captured + replayed, replayed
        memory.copy(x, np.arange(32, dtype=np.float32) + step)
        copies.clear()
        cache.run("step", lambda: _mapped_step(x, src, dst, total, seen))
        want = np.arange(32, dtype=np.float32) + step + 1
        np.testing.assert_array_equal(seen[-1], want)
        np.testing.assert_array_equal(memory.to_host(total), 3 * want)
        assert copies == []
    assert cache.replays == (2 if replayed else 0)
