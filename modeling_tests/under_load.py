"""Run pytest beside CPU-bound jobs, to check that tests do not depend on a quiet machine (the suite must pass on a
loaded one: no test may depend on timing luck or the load average).

    python modeling_tests/under_load.py [--jobs N] [pytest arguments ...]
    python modeling_tests/under_load.py --jobs 2 modeling_tests/test_train_stops.py -k ctrl_c -p no:cacheprovider

Starts N busy loops (default: one per core this process may use), each a Python process that never sleeps, at
the same priority as the tests, runs `python -m pytest` with the arguments in this interpreter, then ends the loops
it started (by their process ids) and exits with pytest's status. The load average it printed before and after is
what the tests saw.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys


def busy_loops(count: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    parser.add_argument("--jobs", type=int, default=cores, help="busy loops to run beside the tests (default: cores)")
    args, pytest_args = parser.parse_known_args(argv)
    loops = busy_loops(max(args.jobs, 0))
    try:
        print(f"under_load: {len(loops)} busy loop(s) on {cores} core(s); load average {load_average()}", flush=True)
        status = subprocess.call([sys.executable, "-m", "pytest", *pytest_args])
        print(f"under_load: load average at the end {load_average()}", flush=True)
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    return status


if __name__ == "__main__":
    sys.exit(main())
