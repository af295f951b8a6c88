"""Timing helpers shared by the benchmark scripts (run as `python benchmarks/<script>.py`, so this folder is on
`sys.path`): interleaved runs, median kept, with a CPU-time or wall clock."""

from __future__ import annotations

import statistics
import time

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
