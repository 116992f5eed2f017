"""`hybrid.kernel_prep`: a warm-up's missing CPU kernels are found without compiling them, compiled
with a count (here or in worker processes), and a warm run reports nothing; the CLI shows the
count on a cold cache and no compile line on a warm one."""
import importlib
import inspect
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import hybrid
from hybrid import compiles, kernel_prep

KERNELS = '''
import numpy as np
from numba import njit


@njit(cache=True)
def fill(out, v):
    for i in range(out.shape[0]):
        out[i] = v


@njit(cache=True)
def fill_twice(out, v):
    for i in range(out.shape[0]):
        out[i] = 2 * v


@njit(cache=True)
def total(x):
    return x.sum()


@njit(cache=True)
def total_plus_one(x):
    return total(x) + 1.0


@njit(cache=True)
def pick_ids(ids):
    for i in range(ids.shape[0]):
        ids[i] = i % 3


@njit(cache=True)
def gather_sum(x, ids):
    s = 0.0
    for i in range(ids.shape[0]):
        s += x[ids[i]]        # no bounds check: a garbage id would read anywhere
    return s
'''


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    """A fresh module of disk-cached kernels (its own source file, so its own cache entries)."""
    name = f"prep_kernels_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(KERNELS))
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module(name)
    yield module
    sys.modules.pop(name, None)


def _run(module, out, x):
    def run():
        s = module.total(x)         # returns a value: compiles during the plan pass, before any skip
        module.fill(out, 3.0)
        module.fill_twice(out[:2], 1.0)
        out[-1] = s
    return run


def _nothing_missing(module, out, x) -> bool:
    plan = kernel_prep.find_missing(_run(module, out, x))
    return plan.complete and plan.missing == [] and plan.compiled_now == 0


def test_plan_pass_skips_missing_void_kernels_and_compiles_those_returning_values(kernels):
    out, x = np.zeros(4), np.arange(3.0)
    plan = kernel_prep.find_missing(_run(kernels, out, x))
    assert plan.complete
    assert [d.py_func.__name__ for d, _ in plan.missing] == ["fill", "fill_twice"]
    assert plan.compiled_now == 1               # total() returns a value: compiled, not skipped
    assert list(out) == [0.0, 0.0, 0.0, 3.0]    # fill and fill_twice did not run, total() did


def test_prepare_reports_every_kernel_then_a_warm_process_reports_none(kernels):
    out, x = np.zeros(4), np.arange(3.0)
    seen = []
    assert kernel_prep.prepare(_run(kernels, out, x), lambda d, t: seen.append((d, t)), workers=1) == 3
    # total() compiles during the plan pass, before the total is known; then the other two
    assert seen[0] == (0, None) and seen[1] == (1, 3) and seen[-1] == (3, 3)
    assert list(out) == [2.0, 2.0, 3.0, 3.0]            # the real warm-up ran
    assert _nothing_missing(kernels, out, x)
    # a new process (here: the module imported again, fresh dispatchers) finds all in the disk cache
    fresh = importlib.reload(kernels)
    out[:] = 0
    seen.clear()
    assert kernel_prep.prepare(_run(fresh, out, x), lambda d, t: seen.append((d, t))) == 0
    assert seen == [] and list(out) == [2.0, 2.0, 3.0, 3.0]


def test_a_pass_stops_before_a_kernel_that_would_index_with_what_a_skipped_one_left(kernels):
    x = np.arange(3.0)
    ids = np.full(4, 1 << 40, np.int64)          # what pick_ids would overwrite
    result = []

    def run():
        kernels.pick_ids(ids)
        result.append(kernels.gather_sum(x, ids))

    plan = kernel_prep.find_missing(run)
    assert plan.stopped and [d.py_func.__name__ for d, _ in plan.missing] == ["pick_ids"]
    assert result == [] and plan.compiled_now == 0          # gather_sum neither compiled nor ran
    seen = []
    assert kernel_prep.prepare(run, lambda d, t: seen.append((d, t)), workers=1) == 2
    assert seen[-1] == (2, 2) and result[-1] == 0.0 + 1.0 + 2.0 + 0.0


def test_a_worker_process_fills_the_disk_cache(kernels):
    out, x = np.zeros(4), np.arange(3.0)
    missing = kernel_prep.find_missing(_run(kernels, out, x)).missing
    jobs = []
    for dispatcher, sig in missing:
        jobs.append(kernel_prep._Job())
        jobs[-1].add(dispatcher, sig)
    queue, done, back = list(jobs), [], []
    kernel_prep._feed_worker(lambda: queue.pop() if queue else None, done.append, back.append)
    assert len(done) == 2 and back == []
    fresh = importlib.reload(kernels)           # no overloads in memory: each must come from the disk
    assert _nothing_missing(fresh, out, x)
    assert list(out) == [2.0, 2.0, 3.0, 3.0]
    assert all(sum(d.stats.cache_hits.values()) == 1 for d in (fresh.fill, fresh.fill_twice))


def test_compile_all_with_workers_counts_every_kernel(kernels, monkeypatch):
    monkeypatch.setattr(kernel_prep, "MIN_PARALLEL_KERNELS", 1)
    out, x = np.zeros(4), np.arange(3.0)
    missing = kernel_prep.find_missing(_run(kernels, out, x)).missing
    seen = []
    kernel_prep.compile_all(missing, lambda d, t: seen.append((d, t)), workers=2)   # a worker and this process
    assert seen[0] == (0, 2) and seen[-1] == (2, 2)
    fresh = importlib.reload(kernels)
    assert _nothing_missing(fresh, out, x)


def _fake_workers(monkeypatch, take_jobs: bool) -> tuple[list, list]:
    """compile_all with CUDA-like jobs and stand-in workers: returns (jobs compiled in this
    process, jobs the workers took)."""
    monkeypatch.setattr(kernel_prep, "MIN_PARALLEL_KERNELS", 1)
    monkeypatch.setattr(kernel_prep, "_is_cuda", lambda dispatcher: True)
    here, taken = [], []
    monkeypatch.setattr(kernel_prep._Job, "compile", lambda job: here.append(job))

    def worker(take, finished, give_back):
        while take_jobs and (job := take()) is not None:
            time.sleep(0.05)                    # compiling: this process's loop runs meanwhile
            taken.append(job)
            finished(job)
    monkeypatch.setattr(kernel_prep, "_feed_worker", worker)
    return here, taken


def test_with_cuda_kernels_this_process_leaves_the_queue_to_the_workers(kernels, monkeypatch):
    """Saving a worker's CUDA kernel needs the compiler lock that a compilation here holds
    throughout, so this process compiling would stall every finished worker."""
    here, taken = _fake_workers(monkeypatch, take_jobs=True)
    missing = kernel_prep.find_missing(_run(kernels, np.zeros(4), np.arange(3.0))).missing
    seen = []
    kernel_prep.compile_all(missing, lambda d, t: seen.append((d, t)), workers=2)
    assert here == [] and len(taken) == 2 and seen[-1] == (2, 2)


def test_with_cuda_kernels_and_no_worker_left_this_process_compiles_them(kernels, monkeypatch):
    here, taken = _fake_workers(monkeypatch, take_jobs=False)
    missing = kernel_prep.find_missing(_run(kernels, np.zeros(4), np.arange(3.0))).missing
    kernel_prep.compile_all(missing, workers=2)
    assert len(here) == 2 and taken == []


def test_a_kernels_size_counts_the_compiled_functions_it_calls(kernels):
    """Jobs go biggest first; a kernel's own source may be a few lines around inlined calls."""
    size = kernel_prep._source_size
    assert size(kernels.total_plus_one.py_func) == \
        len(inspect.getsource(kernels.total_plus_one.py_func)) + size(kernels.total.py_func)


def test_warmup_compiles_everything_a_short_greedy_generation_needs():
    m = hybrid.load(device="cpu", threads=2)
    seen = []
    m.warmup(8, progress=lambda d, t: seen.append((d, t)))
    if seen:                                    # a cold cache: the count went up to its total
        assert seen[-1][0] == seen[-1][1] > 0
    before = compiles.count()
    events = list(m.generate("def fibonacci(n):", max_tokens=16, temperature=0))
    assert events and compiles.count() == before


def _decode(cache_dir):
    env = {**os.environ, "NUMBA_CACHE_DIR": str(cache_dir)}
    return subprocess.run([sys.executable, "-c", "from hybrid.cli import main; main()", "decode",
                           "-p", "def fibonacci(n):", "-n", "4", "--temp", "0", "--cpu-only"],
                          capture_output=True, text=True, timeout=600, env=env)


def test_cli_counts_kernels_on_a_cold_cache_and_prints_nothing_on_a_warm_one(tmp_path):
    cold = _decode(tmp_path)
    assert cold.returncode == 0, cold.stderr
    first = [line for line in cold.stderr.splitlines() if line.startswith("compiling CPU kernels")]
    last = [line for line in cold.stderr.splitlines() if line.startswith("compiled CPU kernels")]
    assert len(first) == 1 and len(last) == 1, cold.stderr
    total = int(first[0].split()[3].split("/")[1])
    assert first[0].split()[3] == f"0/{total}" and total > 0
    assert last[0].split()[3] == f"{total}/{total}"     # the count reaches its total
    warm = _decode(tmp_path)
    assert warm.returncode == 0, warm.stderr
    assert "compil" not in warm.stderr and "preparing" not in warm.stderr, warm.stderr
    assert warm.stdout == cold.stdout


def test_compile_count_sees_cuda_compiler_passes():
    """numba-cuda compiles kernels without numba's compile event; its pass events are counted."""
    cuda_event = pytest.importorskip("numba.cuda.core.event")
    before = compiles.count()
    with cuda_event.trigger_event("numba-cuda:run_pass", data={}):
        pass
    assert compiles.count() == before + 1


def test_library_drafting_on_a_gpu_model_builds_its_call_sizes_once(monkeypatch):
    """generate() and session() on a GPU model warm every drafting call size before drafting
    (a size first met mid-run stalls that step), once per deeper depth; never on the CPU.
    The warm-up itself is faked here (a real one needs a GPU: tests/gpu/test_kernel_prep_gpu.py)."""
    from hybrid.draft_policy import MAX_AUTO_DEPTH
    m = hybrid.load(device="cpu")
    calls = []

    def warmup(max_rows=None, progress=None, draft_depth=0):
        calls.append(draft_depth)
        m._warm_depth = max(m._warm_depth, draft_depth)
    monkeypatch.setattr(m, "warmup", warmup)
    m.generate("def f():", draft="auto")
    m.session(draft="auto")
    assert calls == []                                  # the CPU builds no kernel per call size
    monkeypatch.setattr(m, "device", "cuda")
    m.generate("def f():", draft=0)
    assert calls == []
    m.generate("def f():", draft=2)
    assert calls == [2]
    m.session(draft="auto")
    assert calls == [2, MAX_AUTO_DEPTH]
    m.generate("def f():", draft="auto")
    m.session(draft=3)
    assert calls == [2, MAX_AUTO_DEPTH]                 # already built
