"""The identity of a training run: a random id created when a run starts, kept when it is resumed (also into another
folder: the same training goes on), recorded in every checkpoint's `checkpoint.json` (`run_id`), in `results.json`
and in the model card.

Checkpoints of two runs can hold the same tensors (the same config and tokenizer, another seed or other data), and
averaging them gives a model neither run trained; `hf-variants-average` refuses that, naming both runs
(`check_same_run`), unless `--allow_other_runs`, which the averaged model's card then records.

**Checkpoints written before run ids.** A checkpoint without `run_id` is taken as a checkpoint of the run whose
folder holds it (`run_dir/checkpoints/step_N`), with a warning: it averages with the checkpoints of that folder
(those of a run resumed from it included) and is refused with a checkpoint of any other folder. A run resumed from
such a checkpoint gets a new id from then on (logged).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from . import checkpointing
from .collectives import accelerator_broadcast

KEY = "run_id"  # in checkpoint.json and results.json

logger = logging.getLogger("hf_variants.train")


def new_run_id() -> str:
    """A random run id: 16 hexadecimal digits."""
    return uuid.uuid4().hex[:16]


def checkpoint_run_id(checkpoint: str | os.PathLike) -> str | None:
    """The id of the run that wrote `checkpoint` (None: written before run ids)."""
    value = checkpointing.checkpoint_info(checkpoint).get(KEY)
    return value if isinstance(value, str) and value else None


def resolve(accelerator, resume: Path | None) -> str:
    """The run's id: the resumed checkpoint's, else a new one (the main process's, the same on every process)."""
    run_id = checkpoint_run_id(resume) if resume is not None else None
    if run_id is not None:
        logger.info("Run id %s (resumed from %s)", run_id, resume.name)
        return run_id
    run_id = accelerator_broadcast(accelerator, new_run_id())
    if resume is not None:
        logger.warning("%s was written before run ids: the run goes on as run %s", resume, run_id)
    else:
        logger.info("Run id %s (recorded in every checkpoint and in results.json)", run_id)
    return run_id


def _label(run_id: str | None, folder: Path) -> str:
    return f"run {run_id}" if run_id else f"the run in {folder} (no run id: written before run ids)"


def check_same_run(
    checkpoints: Sequence[str | os.PathLike], allow_other_runs: bool = False, log: Callable[[str], None] = print
) -> tuple[list[str], bool]:
    """(the runs of `checkpoints`: their ids, or "(no id) FOLDER" for checkpoints written before run ids, each once
    in order; whether they are of several runs). Checkpoints of different runs raise `ValueError` naming the first
    two and both runs, unless `allow_other_runs` (then a warning names the runs). A checkpoint without an id belongs
    to the run of its folder (a warning says so)."""
    seen: list[tuple[Path, str | None, Path]] = []
    mixed = False
    for checkpoint in checkpoints:
        path = Path(checkpoint)
        run_id, folder = checkpoint_run_id(path), path.resolve().parent.parent
        if run_id is None:
            log(f"warning: {path} was written before run ids: taken as a checkpoint of the run in {folder}")
        for other, other_id, other_folder in seen:
            if (other_id == run_id) if other_id and run_id else (other_folder == folder):
                continue
            if not allow_other_runs:
                raise ValueError(
                    f"{other} and {path} are checkpoints of different runs ({_label(other_id, other_folder)} and "
                    f"{_label(run_id, folder)}): their mean is a model neither run trained. Average the checkpoints "
                    "of one run, or pass --allow_other_runs to average them anyway (recorded in the model card)."
                )
            mixed = True
        seen.append((path, run_id, folder))
    runs = list(dict.fromkeys(run_id or f"(no id) {folder}" for _, run_id, folder in seen))
    if mixed:
        log(f"warning: checkpoints of {len(runs)} runs ({', '.join(runs)}): averaged anyway (--allow_other_runs)")
    return runs, mixed


__all__ = ["KEY", "check_same_run", "checkpoint_run_id", "new_run_id", "resolve"]
