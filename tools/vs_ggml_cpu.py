#!/usr/bin/env python3
"""hybrid's CPU matvec against ggml's (llama.cpp's CPU backend), type by type, on this machine:
the same weight bytes, one input, the two engines alternating in every round.

    python3 tools/vs_ggml_cpu.py --src ../shared/bench/llama.cpp-0c1e570-src.tar.xz
                                 [--types IQ2_XXS,Q4_K] [--shape 17408x5120] [--threads N]
                                 [--rounds 2] [--build /tmp/ggml-cpu]

Builds ggml's CPU library from the llama.cpp sources (once per --build folder; cmake and ninja,
minutes on 2 cores) and tools/ggml_matvec.c against it, writes each type's weights as
`hybrid bench-kernels` makes them, then times both, each pass reading its weights from memory.
Per type: each engine's best round (a shared machine slows rounds, never speeds them up), hybrid's
speed over ggml's, and each as a share of the read bandwidth measured first. On x86 ggml is built
without its AMX kernels (they crash on the GPU machine's Xeon).
"""
from __future__ import annotations

import argparse
import os
import platform
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS", "MXFP4", "IQ3_XXS",
                 "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M")
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avx512fp16"


def sources(src: Path, build: Path) -> Path:
    """The llama.cpp source tree: src itself, or src (a tarball) unpacked into build once."""
    if src.is_dir():
        return src
    tree = build / "src"
    if not tree.exists():
        with tarfile.open(src) as tar:
            tar.extractall(tree, filter="data")
    found = [h.parents[2] for h in tree.glob("*/ggml/include/ggml.h")]
    if not found:
        sys.exit(f"error: no llama.cpp tree in {src} (no */ggml/include/ggml.h)")
    return found[0]


def build_ggml(src: Path, build: Path) -> Path:
    """ggml's static CPU libraries and the timing program against them; returns the program."""
    program = build / "ggml_matvec"
    if program.exists():
        return program
    for tool in ("cmake", "ninja", "cc", "c++"):
        if shutil.which(tool) is None:
            sys.exit(f"error: {tool} is needed to build ggml")
    tree = sources(src, build)
    out = build / "cmake"
    flags = NO_AMX if platform.machine() in ("x86_64", "AMD64") else ""
    print(f"building ggml's CPU library from {tree} in {out} …", file=sys.stderr, flush=True)
    subprocess.run(["cmake", "-S", str(tree), "-B", str(out), "-G", "Ninja", "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_TOOLS=OFF",
                    f"-DCMAKE_C_FLAGS={flags}", f"-DCMAKE_CXX_FLAGS={flags}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(out), "--target", "ggml", f"-j{os.cpu_count() or 1}"],
                   check=True, stdout=subprocess.DEVNULL)
    libs = out / "ggml" / "src"
    subprocess.run(["c++", "-O2", "-x", "c", str(ROOT / "tools" / "ggml_matvec.c"), "-x", "none",
                    f"-I{tree / 'ggml' / 'include'}", "-o", str(program),
                    *(str(libs / f"libggml{part}.a") for part in ("", "-cpu", "-base")), "-fopenmp", "-lpthread", "-lm"],
                   check=True)
    return program


def ggml_seconds(program: Path, name: str, rows: int, cols: int, threads: int, weights: Path, plan) -> float:
    out = subprocess.run([str(program), name, str(rows), str(cols), str(threads), str(weights),
                          str(plan.stream_bytes), str(plan.min_seconds)], check=True, capture_output=True, text=True)
    return float(out.stdout.split()[0])


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, required=True, help="llama.cpp sources: a folder or a .tar.xz")
    p.add_argument("--build", type=Path, default=Path("/tmp/ggml-cpu"), help="where ggml is built (kept)")
    p.add_argument("--types", default=",".join(DEFAULT_TYPES), help="comma-separated ggml type names")
    p.add_argument("--shape", default="17408x5120", help="ROWSxCOLS of W (default: a 27B's FFN gate/up)")
    p.add_argument("--threads", type=int, help="threads for both engines (default: every available core)")
    p.add_argument("--rounds", type=int, default=2)
    a = p.parse_args(argv)
    import numba
    import numpy as np

    from cpu.bandwidth import read_bandwidth
    from cpu.ggml_types import BY_NAME
    from cpu.threads import set_threads
    from hybrid.kernel_bench import BenchPlan, parse_types, pass_seconds, random_weights, warm_up

    if not a.src.exists():
        p.error(f"--src: no such file or folder: {a.src}")
    try:
        names = parse_types(a.types.split(","))
        threads = set_threads(a.threads)
    except ValueError as e:
        p.error(str(e))
    try:
        rows, cols = (int(v) for v in a.shape.lower().split("x"))
    except ValueError:
        p.error(f"--shape must be ROWSxCOLS, e.g. 17408x5120 (got {a.shape!r})")
    try:
        program = build_ggml(a.src, a.build)
    except subprocess.CalledProcessError as e:
        sys.exit(f"error: building ggml failed ({' '.join(e.cmd[:2])} exited with {e.returncode})")
    plan = BenchPlan.make(names)
    warm_up(names)
    read = read_bandwidth(plan.bandwidth_bytes)
    weights, files = {}, {name: a.build / f"{name}_{rows}x{cols}.bin" for name in names}
    for name in names:
        weights[name] = random_weights(BY_NAME[name], rows, cols, np.random.default_rng(1234))
        weights[name].tofile(files[name])
    print(f"{rows}x{cols}, one input, {threads} threads (Numba: {numba.get_num_threads()}), read {read:.1f} GB/s; "
          f"best of {a.rounds} rounds")
    best: dict[str, dict[str, float]] = {name: {} for name in names}
    for _ in range(a.rounds):
        for name in names:
            times = {"ggml": ggml_seconds(program, name, rows, cols, threads, files[name], plan),
                     "hybrid": pass_seconds(BY_NAME[name], weights[name], plan)}
            for engine, sec in times.items():
                best[name][engine] = min(best[name].get(engine, sec), sec)
    print(f"{'type':8} {'ggml ms':>9} {'hybrid ms':>10} {'hybrid ÷ ggml':>14} {'ggml % read':>12} {'hybrid % read':>14}")
    for name in names:
        g, h = best[name]["ggml"], best[name]["hybrid"]
        gb = weights[name].nbytes / 1e9
        print(f"{name:8} {1e3 * g:9.3f} {1e3 * h:10.3f} {g / h:13.2f}× {100 * gb / g / read:11.0f}% "
              f"{100 * gb / h / read:13.0f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
