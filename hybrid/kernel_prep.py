"""Compile the kernels a warm-up needs up front (CPU ones, and CUDA ones on the GPU path):
counted, spread over the cores, and not at all when Numba's disk cache already holds them.

Numba compiles a kernel (`@njit(cache=True)`) at its first call with new argument types and then
keeps it in its disk cache (NUMBA_CACHE_DIR, else `__pycache__` next to the source). A model's
warm-up (`hybrid.api.Model.warmup`) calls every kernel a job needs once, so on a fresh machine
that is where the compiling happens (one kernel after another, with no way to say how many
were left). `prepare(run)` does it in
three steps:

1. Plan: run the warm-up with deferral on. A call of a disk-cached kernel whose signature is
   compiled neither in this process nor in the disk cache is recorded and skipped: the kernel
   does not run, its outputs keep what they held (a warm-up's inputs and results are throwaway).
   Numba tries its disk cache before it compiles and fires a "numba:compile" event only when it
   compiles, so a warm run finds nothing missing: then this pass was the real warm-up and
   `prepare` returns 0, having reported nothing. A kernel whose source returns a value cannot be
   skipped (the caller would get None): before any skip it compiles on the spot and counts as
   done; after one, the pass stops there (its inputs may hold what a skipped kernel left, e.g.
   garbage expert ids it would index with), and once what was found is compiled another pass
   goes further (the MoE FFN's kernels; the dense forward has none).
2. Compile the recorded (kernel, signature) pairs, reporting progress(done, total): with several
   cores, this process and one worker process per other core take kernels from one queue (Numba
   compiles under one global lock, so threads would not help; with CUDA kernels only the workers
   take from it, see `compile_all`). A worker writes what it compiles
   to the disk cache; all variants of one kernel go to one process, so no two processes write one
   cache index file at once.
3. Run the warm-up again, for real: every kernel loads from memory or the disk cache now.

CUDA kernels (`prepare(..., cuda=True)`) go the same way, with two differences: numba-cuda fires no
compile event, so a plan pass forbids compiling for the call and records the refusal; and a
worker does not write the disk cache (kernels of one template share an index file): it sends each
compiled kernel back and this process saves it.

Skipping is safe where a kernel's garbage output can only become another kernel's garbage input
values, never its indices: in the forward, positions, token and row ids come from Python; the MoE
router's expert ids come from a kernel a pass may skip, but the expert kernels that index with
them return values, so a pass stops before them. Only a call Numba cannot dispatch by itself
reaches this module, though: a kernel this process has run before with the same argument types
runs at once, skip or no skip (a GPU model's warm-up, then a CPU model's, in one process). The
expert kernels therefore check the ids before they index with any (`cpu.moe_kernel`), and raise.
If a plan pass fails anyway (garbage tripped a check), what it found is compiled as above and the
warm-up then runs as a plain one, compiling whatever is left uncounted.
"""
from __future__ import annotations

import ast
import base64
import collections
import contextlib
import importlib
import inspect
import logging
import os
import pickle
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import numpy as np
from numba.core import event
from numba.core.caching import NullCache
from numba.core.compiler_lock import global_compiler_lock
from numba.core.dispatcher import Dispatcher

from cpu.variants import Variants

log = logging.getLogger("hybrid.kernel_prep")   # where a cold start's seconds go (tools/device/compile_profile.py)
Progress = Callable[[int, "int | None"], None]   # progress(done, total); total None: not known yet

# Processes compiling CUDA kernels at once: each holds a CUDA context (a few hundred MB of the
# GPU's memory, which the loaded model may leave little of).
CUDA_WORKERS = 12
# below this many kernels a worker process's start (~0.5-1 s: Python, NumPy, Numba, our modules)
# costs more than it saves
MIN_PARALLEL_KERNELS = 4


class _Deferred(Exception):
    def __init__(self, sig):
        super().__init__("deferred compilation")
        self.sig = sig


class _Stop(Exception):
    """Ends a plan pass: a kernel that must run (it returns a value) has inputs that a skipped
    kernel should have written."""


class Plan(event.Listener):
    """What a plan pass found (`find_missing`): `missing`, the (dispatcher, signature) pairs in
    call order; `compiled_now`, kernels compiled during the pass (they could not be skipped);
    `stopped`, whether it ended at such a kernel after a skip (a next pass goes further);
    `failure`, the exception that ended it, if one did."""

    def __init__(self, progress: Progress | None = None, done_before: int = 0):
        self.progress, self.done_before = progress, done_before
        self.thread = threading.get_ident()
        self.resolving = None          # the kernel whose call Numba is resolving
        self.defer = False             # ... and whether that call may be skipped
        self._missing: dict[tuple, tuple] = {}      # (id(dispatcher), sig) → (dispatcher, sig)
        self.compiled_now = 0
        self.stopped = False
        self.failure: BaseException | None = None

    @property
    def missing(self) -> list[tuple]:
        return list(self._missing.values())

    @property
    def complete(self) -> bool:
        """The warm-up ran to its end (skipping what `missing` lists)."""
        return not self.stopped and self.failure is None

    def on_start(self, ev) -> None:
        if threading.get_ident() != self.thread or (ev.data or {}).get("dispatcher") is not self.resolving:
            return                     # another thread, or a compilation nested in one
        if self.defer:
            raise _Deferred(tuple(ev.data["args"]))
        if self.progress is not None:
            self.progress(self.done_before + self.compiled_now, None)    # the total is not known yet
        self.compiled_now += 1

    def on_end(self, ev) -> None:
        pass


_active: Plan | None = None
_original_compile_for_args = Dispatcher._compile_for_args


def _compile_for_args(self, *args, **kws):
    """Dispatcher._compile_for_args during a plan pass: Numba calls it when no compiled overload
    of the kernel matches the arguments."""
    plan = _active
    if plan is None or threading.get_ident() != plan.thread or plan.resolving is not None \
            or isinstance(self._cache, NullCache):
        return _original_compile_for_args(self, *args, **kws)
    returns = _returns_value(self)
    if returns and plan._missing:
        # its inputs may hold what a skipped kernel left (e.g. expert ids, used as indices):
        # running it could read out of bounds, and it cannot be skipped
        raise _Stop()
    plan.resolving, plan.defer = self, not returns
    try:
        return _original_compile_for_args(self, *args, **kws)
    except _Deferred as d:
        plan._missing.setdefault((id(self), d.sig), (self, d.sig))
        return _skipped           # Numba calls what this returns with the call's arguments
    finally:
        plan.resolving, plan.defer = None, False


def _skipped(*args, **kws) -> None:
    return None


class _SkippedLaunch:
    """What a plan pass gives numba-cuda in place of a kernel missing from the disk cache: its
    launch does nothing (a CUDA kernel returns no value, so any launch may be skipped)."""
    launch_config_sensitive = False

    def launch(self, *args, **kws) -> None:
        pass


_SKIPPED_LAUNCH = _SkippedLaunch()


def _cuda_compile_for_args(original):
    """CUDADispatcher._compile_for_args during a plan pass. numba-cuda fires no compile event, so
    the pass forbids compiling for the call: a signature in memory or in the disk cache loads
    as usual, a missing one raises numba-cuda's "Compilation disabled", and is recorded."""
    def compile_for_args(self, *args, **kws):
        plan = _active
        if plan is None or threading.get_ident() != plan.thread or isinstance(self._cache, NullCache):
            return original(self, *args, **kws)
        could, self._can_compile = self._can_compile, False
        try:
            return original(self, *args, **kws)
        except RuntimeError as e:
            if "Compilation disabled" not in str(e):
                raise
            sig = tuple(self.typeof_pyval(a) for a in args)
            plan._missing.setdefault((id(self), sig), (self, sig))
            return _SKIPPED_LAUNCH
        finally:
            self._can_compile = could
    return compile_for_args


# keyed by the code object itself, not its id(): a collected function's id is reused by the next one
_returns: dict[object, bool] = {}


def _returns_value(dispatcher) -> bool:
    """Whether the kernel's source has a `return <value>` (a call of it cannot be skipped)."""
    key = dispatcher.py_func.__code__
    if key not in _returns:
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(dispatcher.py_func)))
            fn = tree.body[0]
            _returns[key] = any(isinstance(n, ast.Return) and n.value is not None for n in ast.walk(fn))
        except (OSError, TypeError, SyntaxError, IndexError):
            _returns[key] = True           # unknown: never skip it
    return _returns[key]


def find_missing(run: Callable[[], object], progress: Progress | None = None, done_before: int = 0,
                 cuda: bool = False) -> "Plan":
    """Run `run` with deferral on (step 1) and return what it found; progress(done_before + i,
    None) as the i-th kernel that cannot be skipped starts compiling. cuda: CUDA kernels are
    deferred too."""
    global _active
    if _active is not None:
        raise RuntimeError("kernel_prep: one plan pass at a time")
    plan = Plan(progress, done_before)
    _active = plan
    event.register("numba:compile", plan)
    Dispatcher._compile_for_args = _compile_for_args
    if cuda:
        # the CUDA dispatcher is patched only when a GPU model warms up; a CPU warm-up leaves it alone
        from numba.cuda.dispatcher import CUDADispatcher
        cuda_original = CUDADispatcher._compile_for_args
        CUDADispatcher._compile_for_args = _cuda_compile_for_args(cuda_original)
    try:
        with np.errstate(all="ignore"):         # skipped kernels leave garbage in their outputs
            run()
    except _Stop:
        plan.stopped = True
    except Exception as e:                      # noqa: BLE001 - see the module docstring
        plan.failure = e
    finally:
        Dispatcher._compile_for_args = _original_compile_for_args
        if cuda:
            CUDADispatcher._compile_for_args = cuda_original
        event.unregister("numba:compile", plan)
        _active = None
    return plan


def _locate(dispatcher):
    """(module, attribute, variant key or None) naming the dispatcher so that another process
    can find it (`cpu.variants.Variants` for the kernels made per weight type); None if it
    cannot be named."""
    kernel_source = sys.modules.get("gpu.matmul.kernel_source")     # loaded whenever a GPU kernel exists
    made = kernel_source.made_by(dispatcher) if kernel_source is not None else None
    if made is not None:
        return made
    module = sys.modules.get(dispatcher.py_func.__module__)
    if module is None or module.__name__ == "__main__":     # another process's __main__ is not this one
        return None
    for name, value in list(vars(module).items()):
        if value is dispatcher:
            return module.__name__, name, None
        if isinstance(value, Variants):
            for key, made in value.made().items():
                if made is dispatcher:
                    return module.__name__, name, key
    return None


def _resolve(module: str, name: str, key):
    value = getattr(importlib.import_module(module), name)
    return value if key is None else value(*key)


def default_workers() -> int:
    """Processes compiling at once: one per core this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _is_cuda(dispatcher) -> bool:
    module = sys.modules.get("numba.cuda.dispatcher")
    return module is not None and isinstance(dispatcher, module.CUDADispatcher)


class _Job:
    """The missing signatures of one kernel's code: its variants (`cpu.variants`) share one cache
    index file, so they compile in one process, one after another (two processes saving entries
    of one index at once could lose one). `parts`: (dispatcher, signatures, name for a worker
    process or None); `here`: this process must compile it (a variant that cannot be named).

    A CUDA kernel is a job of its own: the specialised kernels of one template also share an
    index file, but a worker does not write it: it sends the compiled kernel back (PTX and cubin,
    as numba-cuda's disk cache stores it), and this process saves it (`save`), one at a time."""

    def __init__(self, cuda: bool = False):
        self.parts: list[tuple] = []
        self.size = 0                          # a guess at the compile time: the source's size
        self.cuda = cuda

    def add(self, dispatcher, sig) -> None:
        for d, sigs, _ in self.parts:
            if d is dispatcher:
                sigs.append(sig)
                return
        self.parts.append((dispatcher, [sig], _locate(dispatcher)))
        self.size += _source_size(dispatcher.py_func)

    @property
    def count(self) -> int:
        return sum(len(sigs) for _, sigs, _ in self.parts)

    @property
    def here(self) -> bool:
        return any(where is None for _, _, where in self.parts)

    def compile(self) -> None:
        for dispatcher, sigs, _ in self.parts:
            for sig in sigs:
                dispatcher.compile(sig)

    def message(self) -> str:
        return base64.b64encode(pickle.dumps((self.cuda, [(*where, sigs) for _, sigs, where in self.parts]))).decode()

    def save(self, reply: str) -> None:
        """Store in the disk cache the CUDA kernels a worker sent back ("ok <payload>")."""
        if not self.cuda:
            return
        from numba.cuda.dispatcher import _Kernel    # numba.cuda: loaded only when a GPU model warms up
        states = iter(pickle.loads(base64.b64decode(reply.split(" ", 1)[1])))
        with global_compiler_lock:              # one writer of the cache index at a time
            for dispatcher, sigs, _ in self.parts:
                dispatcher._configure_cache_for_launch_config(None)
                for sig in sigs:
                    kernel = _Kernel._rebuild(**next(states))
                    kernel.target_context = dispatcher.targetctx     # the cache keys on its codegen
                    dispatcher._cache.save_overload(sig, kernel)


def _source_size(fn, seen: set | None = None) -> int:
    """Characters of fn's source and of every compiled function it calls by a global name: device
    functions are inlined into a kernel, so they are part of its compile work (a CUDA matvec's own
    source is a few lines around the type's unit functions)."""
    seen = set() if seen is None else seen
    if fn.__code__ in seen:
        return 0
    seen.add(fn.__code__)
    try:
        size = len(inspect.getsource(fn))
    except (OSError, TypeError):
        size = 0
    for name in fn.__code__.co_names:
        inner = getattr(fn.__globals__.get(name), "py_func", None)
        if inner is not None and hasattr(inner, "__code__"):
            size += _source_size(inner, seen)
    return size


def compile_all(missing: list[tuple], progress: Progress | None = None, done: int = 0,
                workers: int | None = None) -> None:
    """Compile each (dispatcher, signature) pair (step 2), reporting progress(done, total) as
    kernels finish; `done` kernels were compiled before (they count towards the total).

    With several cores, worker processes (`python -m hybrid.kernel_prep`, one per core but this
    one) take kernels from the same queue as this process, the biggest first; each writes what it
    compiles to the disk cache, where the warm-up then finds it. A kernel a worker cannot compile
    is compiled here. CUDA kernels: one worker per core up to CUDA_WORKERS, and this process only
    saves what they send and compiles what they cannot."""
    total = done + len(missing)
    report = progress or (lambda d, t: None)
    report(done, total)
    by_code: dict[object, _Job] = {}
    for dispatcher, sig in missing:
        cuda = _is_cuda(dispatcher)
        key = (id(dispatcher), sig) if cuda else dispatcher.py_func.__code__
        by_code.setdefault(key, _Job(cuda)).add(dispatcher, sig)
    jobs = sorted(by_code.values(), key=lambda j: j.size, reverse=True)
    workers = default_workers() if workers is None else workers
    # A CUDA kernel from a worker is saved here under Numba's compiler lock, which a compilation
    # in this process holds throughout: while this process compiled, finished workers waited to
    # hand their kernels over instead of taking the next. So with CUDA kernels this process
    # compiles only what no worker can (and what they all leave), and the workers take a core each.
    cuda = any(j.cuda for j in jobs)
    if cuda:
        workers = min(workers, CUDA_WORKERS)
    n_procs = min(workers, len(jobs)) - (0 if cuda else 1) if len(jobs) >= MIN_PARALLEL_KERNELS else 0
    lock = threading.Lock()
    state = {"done": done}
    queue = collections.deque(j for j in jobs if not j.here)    # workers take from the left
    here = [j for j in jobs if j.here]                          # only this process

    def finished(job: _Job) -> None:
        with lock:
            state["done"] += job.count
            report(state["done"], total)

    def take() -> _Job | None:
        with lock:
            return queue.popleft() if queue else None

    def give_back(job: _Job) -> None:
        with lock:
            here.append(job)

    started, here_count = time.perf_counter(), 0
    feeders = [threading.Thread(target=_feed_worker, args=(take, finished, give_back), daemon=True)
               for _ in range(n_procs)]
    for t in feeders:
        t.start()
    while True:
        with lock:
            working = any(t.is_alive() for t in feeders)
            shares = queue and not (cuda and working)
            job = here.pop() if here else (queue.pop() if shares else None)   # from the small end
            idle = job is None and not working
        if job is not None:
            job.compile()
            finished(job)
            here_count += job.count
        elif idle:
            break                               # nothing queued, nothing running elsewhere
        else:
            time.sleep(0.01)                    # a worker may still hand its job back
    log.info("compiled %d kernels in %.1f s: %d worker processes, %d kernels in this process",
             len(missing), time.perf_counter() - started, n_procs, here_count)


def _feed_worker(take, finished, give_back) -> None:
    """Run one worker process and feed it kernels from the queue until the queue is empty; a
    kernel it fails on goes back to this process (`give_back`)."""
    try:
        proc = subprocess.Popen([sys.executable, "-m", "hybrid.kernel_prep"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=_worker_env(),
                                text=True, bufsize=1)
    except OSError:
        return
    began, kernels, saving = time.perf_counter(), 0, 0.0
    try:
        while (job := take()) is not None:
            try:
                proc.stdin.write(job.message() + "\n")
                proc.stdin.flush()
                reply = proc.stdout.readline()
            except (OSError, ValueError):
                reply = ""
            if reply.startswith("ok"):
                saved = time.perf_counter()
                try:
                    job.save(reply)
                except Exception:               # noqa: BLE001 - the warm-up compiles it instead
                    pass
                saving += time.perf_counter() - saved
                kernels += job.count
                finished(job)
                continue
            give_back(job)
            if not reply:                       # the worker is gone
                return
    finally:
        log.info("worker %d: %d kernels, %.1f s from its start, %.1f s of it saving them here",
                 proc.pid, kernels, time.perf_counter() - began, saving)
        try:
            proc.stdin.close()
        except OSError:
            pass
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()


def _worker_env() -> dict:
    """This process's environment, with its module search path, so the worker imports the same
    kernels (Numba's settings such as NUMBA_CACHE_DIR come with the environment)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}


def _worker() -> None:
    """A worker process: for each job line on stdin, compile the kernels' signatures (Numba
    writes them to its disk cache) and answer "ok", or "err" and the reason."""
    answers, sys.stdout = sys.stdout, sys.stderr        # whatever else prints goes to stderr
    for line in sys.stdin:
        try:
            cuda, parts = pickle.loads(base64.b64decode(line))
            states = []
            for module, name, key, sigs in parts:
                dispatcher = _resolve(module, name, key)
                if cuda:
                    dispatcher._cache = NullCache()       # the parent saves it (_Job.save)
                for sig in sigs:
                    kernel = dispatcher.compile(sig)
                    if cuda:
                        states.append(kernel._reduce_states())
            answer = "ok " + base64.b64encode(pickle.dumps(states)).decode() if cuda else "ok"
        except Exception as e:                  # noqa: BLE001 - reported, compiled by the parent
            answer = "err " + repr(e).replace("\n", " ")
        answers.write(answer + "\n")
        answers.flush()


MAX_PASSES = 8


def prepare(run: Callable[[], object], progress: Progress | None = None, workers: int | None = None,
            cuda: bool = False, plan_context: Callable[[], contextlib.AbstractContextManager] | None = None,
            done_before: int = 0) -> int:
    """Warm up with `run`, compiling first what it needs that the disk cache lacks, with
    progress(done, total) reports (none at all when nothing compiles). Returns the number of
    kernels compiled (counting from done_before, kernels an earlier call compiled).

    A pass that stopped at a kernel it could not run (see `_compile_for_args`) is followed by
    another once what it found is compiled; each gets further, and the total grows. cuda: CUDA
    kernels are planned too; plan_context(): what each plan pass runs in (the GPU backend's
    `planning`: no graph captures of steps whose kernels were skipped)."""
    done = done_before
    for pass_no in range(1, MAX_PASSES + 1):
        started = time.perf_counter()
        with plan_context() if plan_context is not None else contextlib.nullcontext():
            plan = find_missing(run, progress, done, cuda)
        log.info("plan pass %d: %d kernels missing, %d compiled on the spot, %.1f s", pass_no,
                 len(plan.missing), plan.compiled_now, time.perf_counter() - started)
        done += plan.compiled_now
        if not plan.missing and plan.complete:
            if done > done_before and progress is not None:
                progress(done, done)            # the plan pass was the warm-up
            return done - done_before
        compile_all(plan.missing, progress, done, workers)
        done += len(plan.missing)
        if not plan.stopped:
            break                               # complete, or failed: the real warm-up says why
    started = time.perf_counter()
    run()
    log.info("warm-up run %.1f s", time.perf_counter() - started)
    return done - done_before


if __name__ == "__main__":
    _worker()
