"""Measurement helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this folder is on
`sys.path`): interleaved runs, median kept, with a CPU-time or wall clock; peak memory of one call."""

from __future__ import annotations

import os
import resource
import statistics
import time

import torch

# process CPU time: robust on a shared machine (measures the work, not the waiting); wall: elapsed time
CLOCKS = {"cpu": time.process_time, "wall": time.perf_counter}


def interleaved(fns: dict, reps: int, clock="cpu") -> dict:
    """Median seconds of each zero-argument function, runs interleaved (A, B, C, A, B, C, ...) after one warm-up
    each. `clock` is a name of CLOCKS or a clock function."""
    timer = CLOCKS[clock] if isinstance(clock, str) else clock
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            start = timer()
            fn()
            times[name].append(timer() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_self_timed(fn_a, fn_b, reps: int) -> tuple[float, float]:
    """Medians of two functions that return their own measured seconds, interleaved after one warm-up each."""
    fn_a(), fn_b()
    a, b = [], []
    for _ in range(reps):
        a.append(fn_a())
        b.append(fn_b())
    return statistics.median(a), statistics.median(b)


def peak_memory_mb(fn) -> float:
    """Peak memory growth of `fn()` in MiB: CUDA allocator peak, or on the CPU the resident-set high-water mark of a
    forked child running `fn` minus its resident set at the start."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read)
        try:
            with open("/proc/self/statm") as f:
                rss0 = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            fn()
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            os.write(write, str((peak - rss0) / 2**20).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        value = f.read()
    os.waitpid(pid, 0)
    return float(value) if value else float("nan")
