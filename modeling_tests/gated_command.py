"""`python gated_command.py MODULE ARGS...` runs a sharded command (hf_variants.commands.translate or .score) that
holds still inside a work unit once `GATE_AFTER` unit records exist in `GATE_WORK`: from then on each of its batch
boundaries waits there, still checking for a stop signal (the command's own check, which drops the unit in progress),
after writing `GATE_DIR/blocked.<pid>`. A test that waits for that file knows a unit is in progress and how many are
done, so its signal or kill lands mid-unit whatever the machine's load."""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path

from hf_variants.commands import sharding

WORK, AFTER, GATE = Path(os.environ["GATE_WORK"]), int(os.environ["GATE_AFTER"]), Path(os.environ["GATE_DIR"])
GIVE_UP_SECONDS = 600  # a test that never sends its signal leaves no process behind
_run_units = sharding.run_units


def run_units(job, launch, plan, do_unit, stop):
    def gated_unit(unit, writer, check):
        def held_check():
            if len(list(WORK.glob("unit_*.json"))) >= AFTER:
                (GATE / f"blocked.{os.getpid()}").touch()
                give_up = time.monotonic() + GIVE_UP_SECONDS
                while time.monotonic() < give_up:  # until a stop signal makes check() raise
                    check()
                    time.sleep(0.02)
                sys.exit(f"gated_command.py: no stop signal within {GIVE_UP_SECONDS} s")
            check()

        return do_unit(unit, writer, held_check)

    return _run_units(job, launch, plan, gated_unit, stop)


if __name__ == "__main__":
    sharding.run_units = run_units
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
