#!/usr/bin/env python3
"""Can the GPU read host-resident weights over PCIe while the CPU streams others, and at what rate?

    python3 tools/device/pcie_share.py [--gib 2] [--expert-mib 2]

The routed experts of a MoE model (and a dense model's FFN) stay in host memory, and the CPU's
cores read them at the probe's rate. The GPU can read registered host memory too, straight from
a kernel (zero-copy, over PCIe), or with the copy engine. If the host's DRAM has bandwidth the
CPU's cores do not use, the two readers add up. This measures, with CUDA events and the CPU
probe (`cpu.bandwidth`):
  1. the CPU read rate alone;
  2. a kernel reading registered host memory alone (GB/s), and the time of one expert-sized
     read (the latency a hand-off would see);
  3. both at once: the CPU's rate while the GPU reads, and the GPU's while the CPU reads.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=2.0, help="size of each host buffer")
    p.add_argument("--expert-mib", type=float, default=2.0, help="one expert's bytes (35B-A3B Q4_K_M: ~2)")
    args = p.parse_args(argv)

    from cuda.bindings import driver as cu
    from numba import cuda

    from cpu.bandwidth import _parallel_sum, read_bandwidth
    from tools.gpu_bench_kernels import read_all
    import numba

    cuda.current_context()                     # the driver calls below need a context
    nbytes = int(args.gib * 2**30) // 16 * 16
    cpu_buf = np.ones(nbytes // 4, np.float32)
    host = np.ones(nbytes, np.uint8)
    flags = cu.CU_MEMHOSTREGISTER_READ_ONLY | cu.CU_MEMHOSTREGISTER_DEVICEMAP
    (err,) = cu.cuMemHostRegister(host.ctypes.data, host.nbytes, flags)
    if int(err):
        print("register failed:", cu.cuGetErrorName(err)[1].decode())
        return 1
    err, dptr = cu.cuMemHostGetDevicePointer(host.ctypes.data, 0)
    words = cuda.from_cuda_array_interface(
        {"shape": (nbytes // 16, 4), "typestr": "<u4", "data": (int(dptr), True), "version": 2},
        owner=host, sync=False)
    sink = cuda.device_array(1, np.uint32)
    s = cuda.stream()
    n_threads = numba.get_num_threads()
    print(f"{n_threads} CPU threads; host buffers {nbytes / 2**30:.1f} GiB; device pointer "
          f"{'= host pointer' if int(dptr) == host.ctypes.data else 'differs'}")

    def gpu_read(rows, blocks, threads=256, reps=1):
        start, end = cuda.event(timing=True), cuda.event(timing=True)
        start.record(s)
        for _ in range(reps):
            read_all[blocks, threads, s](rows, sink)
        end.record(s)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    read_all[132, 256, s](words[:1024], sink)
    s.synchronize()
    cpu_alone = read_bandwidth(1 << 30)
    print(f"1. CPU probe alone: {cpu_alone:.1f} GB/s")
    for blocks in (132, 264, 528, 1056):
        t = gpu_read(words, blocks)
        print(f"2. GPU zero-copy read, {blocks} blocks x 256: {nbytes / t / 1e9:.1f} GB/s")
    ew = int(args.expert_mib * 2**20) // 16
    for blocks in (16, 32, 64, 132, 264):
        t = gpu_read(words[:ew], blocks, reps=20)
        print(f"   one expert ({args.expert_mib} MiB), {blocks} blocks: {t * 1e6:.1f} us "
              f"({ew * 16 / t / 1e9:.1f} GB/s)")
    dev = cuda.device_array(nbytes, np.uint8)
    start, end = cuda.event(timing=True), cuda.event(timing=True)
    start.record(s)
    cu.cuMemcpyHtoDAsync(dev.device_ctypes_pointer.value, host.ctypes.data, nbytes, s.handle)
    end.record(s)
    end.synchronize()
    print(f"   copy engine, registered -> device: {nbytes / (start.elapsed_time(end) / 1e3) / 1e9:.1f} GB/s")
    for size in (2 << 20, 8 << 20):
        start.record(s)
        for _ in range(20):
            cu.cuMemcpyHtoDAsync(dev.device_ctypes_pointer.value, host.ctypes.data, size, s.handle)
        end.record(s)
        end.synchronize()
        t = start.elapsed_time(end) / 1e3 / 20
        print(f"   copy engine, {size >> 20} MiB: {t * 1e6:.1f} us ({size / t / 1e9:.1f} GB/s)")

    # 3. together: the GPU reads the buffer `passes` times while the CPU sums its own repeatedly
    n_chunks = 4 * n_threads
    blocks = 528
    t_gpu_alone = gpu_read(words, blocks, reps=3)
    for mode in ("kernel", "copy"):
        passes = 6
        start.record(s)
        for _ in range(passes):
            if mode == "kernel":
                read_all[blocks, 256, s](words, sink)
            else:
                cu.cuMemcpyHtoDAsync(dev.device_ctypes_pointer.value, host.ctypes.data, nbytes, s.handle)
        end.record(s)
        time.sleep(0.002)
        cpu_times = []
        t_begin = time.perf_counter()
        while not end.query():
            t0 = time.perf_counter()
            _parallel_sum(cpu_buf, n_chunks)
            cpu_times.append(time.perf_counter() - t0)
        t_cpu_window = time.perf_counter() - t_begin
        end.synchronize()
        t_gpu = start.elapsed_time(end) / 1e3
        cpu_rate = cpu_buf.nbytes / float(np.median(cpu_times)) / 1e9 if cpu_times else float("nan")
        print(f"3. together ({mode}): CPU {cpu_rate:.1f} GB/s over {len(cpu_times)} sums; GPU "
              f"{passes * nbytes / t_gpu / 1e9:.1f} GB/s (alone {nbytes / t_gpu_alone / 1e9:.1f} for the kernel); "
              f"CPU busy {t_cpu_window * 1e3:.0f} of {t_gpu * 1e3:.0f} ms")
    print(f"   CPU probe after: {read_bandwidth(1 << 30):.1f} GB/s")
    cu.cuMemHostUnregister(host.ctypes.data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
