"""How many CPU threads each training process uses: a function of the machine and the launch, recorded in the run and
kept when it is resumed, so that the same command with the same seed trains the same weights on a busy machine as
on a quiet one (torch's CPU kernels split their reductions by thread, so the thread count changes the low bits of
every step, and with them the weights).

The count of a new run, in order of precedence:

1. `--num_threads N`;
2. `OMP_NUM_THREADS` from the user's environment (not under `accelerate launch` or `torchrun`, which set it to 1
   for their processes unless told otherwise: there `--num_threads` chooses);
3. the cores this process may run on (its CPU affinity) divided by the training processes on this machine, at
   least 1.

A resumed run keeps the count recorded in its checkpoint (setting `cpu_threads`) and says so when this launch would
have chosen another one; `--num_threads` overrides it, and the change is recorded as a settings change (so is the
new count of a resume on another number of processes, `--allow_changed_settings num_processes`, which takes this
launch's share of the cores).
`--threads_from_load` asks for fewer threads when the 1-minute load average leaves fewer cores idle, at each launch:
faster on a busy machine, but a run trained that way is not reproducible (its counts are recorded)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

SETTING = "cpu_threads"  # the derived setting every checkpoint records
# Environment variables that only a launcher sets: under one, OMP_NUM_THREADS is the launcher's, not the user's
LAUNCHER_VARIABLES = ("ACCELERATE_DYNAMO_BACKEND", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE")


@dataclass(frozen=True)
class ThreadChoice:
    """The threads per process, where the number came from (`flag`, `OMP_NUM_THREADS`, `cores`, `checkpoint`,
    `load`) and a sentence for the log."""

    threads: int
    source: str
    reason: str
    note: str | None = None  # a line worth a log record of its own (a kept or a load-lowered count)

    @property
    def key(self) -> tuple[int, str]:
        return self.threads, self.source


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity where the platform has one, else the machine's count."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def load_average() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def per_process(cores: int, local_processes: int) -> int:
    """The cores divided by the training processes on this machine, at least 1."""
    return max(1, cores // max(local_processes, 1))


def user_omp_threads(env: Mapping[str, str]) -> int | None:
    """`OMP_NUM_THREADS` when the user set it (a positive integer, and no launcher that sets it runs this process);
    else None. A value that is not a positive integer raises ValueError naming it."""
    value = env.get("OMP_NUM_THREADS", "").strip()
    if not value or any(name in env for name in LAUNCHER_VARIABLES):
        return None
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"OMP_NUM_THREADS={value!r} is not a positive integer: unset it, or pass --num_threads N")
    return int(value)


def load_fitted(cores: int, local_processes: int, load: float | None) -> tuple[int, str | None]:
    """`--threads_from_load`: the per-process share of the cores the 1-minute load average leaves idle (threads
    that wait for cores other processes hold slow every step down: the tiny preset on a busy 2-core machine trained
    at 2,487 tokens/s with 2 threads and at 21,245 with 1), at most `per_process`, at least 1. Returns the threads
    and, when the load lowered them, why."""
    local_processes = max(local_processes, 1)
    threads = per_process(cores, local_processes)
    if load is None:
        return threads, None
    idle = max(cores - load, 0.0)
    fitting = max(1, int(idle / local_processes + 0.5))
    if fitting >= threads:
        return threads, None
    return fitting, (
        f"{fitting} CPU thread(s) per process instead of {threads}: the load average {load:.1f} leaves {idle:.1f} "
        f"of this machine's {cores} cores idle (--threads_from_load; --num_threads N to choose)"
    )


def launch_default(cores: int, local_processes: int, env: Mapping[str, str]) -> ThreadChoice:
    """The count of a new run without `--num_threads`: the user's OMP_NUM_THREADS, else the cores per process."""
    omp = user_omp_threads(env)
    if omp is not None:
        return ThreadChoice(omp, "OMP_NUM_THREADS", f"OMP_NUM_THREADS={omp}")
    threads = per_process(cores, local_processes)
    return ThreadChoice(threads, "cores", f"{cores} core(s) / {max(local_processes, 1)} process(es) on this machine")


def choose(
    num_threads: int | None,
    from_load: bool,
    recorded: int | None,
    cores: int,
    local_processes: int,
    env: Mapping[str, str],
    load: float | None = None,
) -> ThreadChoice:
    """The threads per process of this launch: `num_threads` (the flag) when given; else with `from_load` the
    load-fitted count; else the count `recorded` in the checkpoint being resumed; else `launch_default`."""
    if num_threads:
        return ThreadChoice(num_threads, "flag", f"--num_threads {num_threads}")
    if from_load:
        threads, lowered = load_fitted(cores, local_processes, load)
        return ThreadChoice(threads, "load", "--threads_from_load", lowered)
    default = launch_default(cores, local_processes, env)
    if recorded is None:
        return default
    note = None
    if recorded != default.threads:
        note = (
            f"Keeping the run's {recorded} CPU thread(s) per process (recorded in its checkpoint, so that the "
            f"resumed steps compute what an uninterrupted run would) instead of this launch's {default.threads} "
            f"({default.reason}): --num_threads {default.threads} to change it (recorded)"
        )
    return ThreadChoice(recorded, "checkpoint", "recorded in the checkpoint", note)


def recorded_threads(saved_settings: Mapping | None) -> int | None:
    """The count a checkpoint's settings record (None for a checkpoint written before it was recorded)."""
    value = (saved_settings or {}).get(SETTING)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else None
