#!/usr/bin/env python3
"""Is a change to the CPU kernels faster? The working tree's matvec against a git revision's, in one
process, calls alternating, type by type.

    python3 tools/ab_cpu_kernels.py --base HEAD [--types IQ3_S,IQ1_M] [--shape 256x5120]
                                    [--inputs 1] [--threads 1] [--calls 400]

On a shared machine two processes timing the same code differ by 20-50%, even as the minimum of
hundreds of calls: the machine's pace changes between them. Inside one process both kernels meet
the same moments. The revision's cpu/ is copied into a temporary package `cpu_base` (its imports
of `cpu` renamed), both trees compile their kernels into a temporary Numba cache (nothing is
written to the engine's cache), the two outputs on the same weights are compared (a speed change
should not change bits: a difference is reported), then the calls alternate, the first of a pair
taking turns. Per type: each tree's minimum time a call, and tree ÷ base for the minimum and for
the sum of the calls. A type that did not change reads 1.00 within a percent or so. The default
shape is cache-resident and one thread: the kernels' compute, not the machine's memory.
"""
from __future__ import annotations

import argparse
import importlib
import io
import os
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASE_PACKAGE = "cpu_base"
_CPU_IMPORT = re.compile(r"^(\s*)(from|import) cpu(?=[\s.])", re.MULTILINE)


def copy_base(rev: str, folder: Path) -> Path:
    """cpu/ at git revision `rev`, written as the package folder/cpu_base with its imports of `cpu`
    renamed; its __init__ leaves the Numba cache directory to the caller (the working tree's)."""
    try:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "cpu"], check=True, capture_output=True).stdout
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: git archive {rev}: {e.stderr.decode(errors='replace').strip()}")
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(folder, filter="data")
    package = folder / BASE_PACKAGE
    (folder / "cpu").rename(package)
    for path in package.rglob("*.py"):
        text = _CPU_IMPORT.sub(rf"\1\2 {BASE_PACKAGE}", path.read_text())
        if path.name == "__init__.py" and path.parent == package:
            text = text.replace("kernel_cache.use()", "pass  # the cache directory: the working tree's")
        path.write_text(text)
    return package


def compare(name: str, rows: int, cols: int, calls: int, matvecs: dict, inputs: int = 1) -> dict:
    """Both trees' matvec on the same weights: outputs equal?, minimum seconds, summed seconds."""
    import numpy as np

    from cpu.ggml_types import BY_NAME
    from hybrid.kernel_bench import random_weights

    t = BY_NAME[name]
    rng = np.random.default_rng(7)
    w = random_weights(t, rows, cols, rng)
    x = rng.standard_normal((inputs, cols), dtype=np.float32)
    outs = {tree: np.empty((inputs, rows), np.float32) for tree in matvecs}
    for tree, matvec in matvecs.items():
        matvec(t.id, w, x, outs[tree])                      # compiles
    equal = np.array_equal(outs["base"], outs["tree"])
    best = dict.fromkeys(matvecs, float("inf"))
    total = dict.fromkeys(matvecs, 0.0)
    order = list(matvecs)
    for i in range(calls):
        for tree in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            matvecs[tree](t.id, w, x, outs[tree])
            dt = time.perf_counter() - t0
            best[tree] = min(best[tree], dt)
            total[tree] += dt
    return {"equal": equal, "best": best, "total": total}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base", default="HEAD", help="git revision to compare the working tree with (default HEAD)")
    p.add_argument("--types", default="IQ3_S", help="comma-separated ggml type names (default IQ3_S)")
    p.add_argument("--shape", default="256x5120", help="ROWSxCOLS of the weights (default 256x5120: cache-resident)")
    p.add_argument("--inputs", type=int, default=1, help="input vectors a call (default 1; a verify step's k)")
    p.add_argument("--threads", type=int, default=1, help="threads (default 1)")
    p.add_argument("--calls", type=int, default=400, help="calls of each tree per type (default 400)")
    a = p.parse_args(argv)
    try:
        rows, cols = (int(v) for v in a.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must be ROWSxCOLS, e.g. 256x5120 (got {a.shape!r})")
    if rows < 1 or cols < 256 or cols % 256:
        p.error(f"--shape: ROWS ≥ 1 and COLS a multiple of 256 (a super-block), got {a.shape}")
    if a.calls < 1 or a.inputs < 1:
        p.error("--calls and --inputs must be at least 1")
    with tempfile.TemporaryDirectory(prefix="ab_cpu_") as tmp:
        os.environ["NUMBA_CACHE_DIR"] = str(Path(tmp) / "numba")     # before cpu is imported
        sys.path.insert(0, str(ROOT))
        from cpu.threads import set_threads
        from hybrid.kernel_bench import parse_types
        try:
            names = parse_types(a.types.split(","))
            threads = set_threads(a.threads)
        except ValueError as e:
            p.error(str(e))
        copy_base(a.base, Path(tmp))
        sys.path.insert(0, tmp)
        matvecs = {"base": importlib.import_module(f"{BASE_PACKAGE}.matvec").matvec,
                   "tree": importlib.import_module("cpu.matvec").matvec}
        print(f"working tree against {a.base}: {rows}x{cols}, {a.inputs} input(s), {threads} thread(s), {a.calls} calls "
              "each, alternating (compiling both trees' kernels first)", flush=True)
        print(f"{'type':8} {'base µs':>9} {'tree µs':>9} {'tree ÷ base':>12} {'(sums)':>7}  outputs", flush=True)
        for name in names:
            r = compare(name, rows, cols, a.calls, matvecs, a.inputs)
            b, t = r["best"]["base"], r["best"]["tree"]
            print(f"{name:8} {b * 1e6:9.1f} {t * 1e6:9.1f} {t / b:12.3f} {r['total']['tree'] / r['total']['base']:7.3f}  "
                  f"{'equal' if r['equal'] else 'DIFFER'}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
