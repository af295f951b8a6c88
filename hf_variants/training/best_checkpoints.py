"""Which checkpoints a run keeps: the newest `--keep_checkpoints`, the best `--keep_best` by the validation metric
(`--best_metric`), the best one, and the last `--average_last`; and the ranking of validated checkpoints that
`--keep_best`, `--final_model best` and `hf-variants-average --best K` share.

**The ranking.** A validation record (`{"step", "valid_loss", "valid_bleu"?, ...}`) ranks by BLEU then by the
negated validation loss (`--best_metric bleu`; BLEU ties, e.g. 0 early on, are broken by the loss) or by the loss
alone (`--best_metric loss`); a record whose loss is not finite never ranks. Equal keys rank the earlier step first,
as `Trainer.evaluate` names the first of equal validations the best. The loss is computed on the whole validation
set, BLEU on its first `--eval_bleu_pairs` pairs (`ranking_rule` states both, for the log and results.json).

**The final candidates.** When BLEU ranks on part of the validation set and `--final_model best` chooses the final
model, the best `--final_candidates` validated checkpoints are kept too (`kept_best`), so that the final choice can
re-score them on the whole validation set (hf_variants/training/final_choice.py).

**Rotation deletes only what the run wrote.** The run records the steps of the checkpoints it saved
(`TrainState.checkpoints`, saved in every checkpoint, so a resumed run knows the checkpoints of its earlier
sessions); rotation deletes only those, and only when the folder is still a complete checkpoint of that step
(`checkpoint.json` says so). Anything else under `checkpoints/` (a file or folder a user put there, a checkpoint
copied from another run) is never touched. A run resumed from a checkpoint written before this list existed adopts
the complete checkpoints up to its step.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path

from . import checkpointing

logger = logging.getLogger("hf_variants.train")


def validation_key(record: dict, metric: str) -> tuple[float, float] | None:
    """The ranking key of a validation record (larger is better), None when it never ranks (non-finite loss)."""
    loss = record.get("valid_loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return None
    bleu = record.get("valid_bleu", 0.0) if metric == "bleu" else 0.0
    return (float(bleu if bleu is not None else 0.0), -float(loss))


def ranked_steps(evals: Iterable[dict], metric: str, steps: Iterable[int] | None = None) -> list[int]:
    """The validated steps, best first (ties: the earlier step first); only those in `steps` when given."""
    allowed = None if steps is None else set(steps)
    keyed = {}
    for record in evals:
        key = validation_key(record, metric)
        step = record.get("step")
        if key is None or not isinstance(step, int) or (allowed is not None and step not in allowed):
            continue
        keyed[step] = key  # a step validated twice (a resumed run): the later record
    return sorted(keyed, key=lambda s: (tuple(-x for x in keyed[s]), s))


def ranking_rule(args, valid_pairs: int) -> dict:
    """How this run ranks its validated checkpoints: {"metric": "bleu" | "loss", "pairs": the validation pairs it is
    computed on, "validation_pairs": all of them, "tie_rule", "statement": one sentence for the log and the card}."""
    bleu_pairs = min(getattr(args, "eval_bleu_pairs", 0) or 0, valid_pairs)
    if args.best_metric == "bleu" and bleu_pairs:
        on = f"the first {bleu_pairs} of {valid_pairs}" if bleu_pairs < valid_pairs else f"all {valid_pairs}"
        tie = f"equal BLEU: the lower validation loss on all {valid_pairs} pairs, then the earlier step"
        return {
            "metric": "bleu",
            "pairs": bleu_pairs,
            "validation_pairs": valid_pairs,
            "tie_rule": tie,
            "statement": f"validation BLEU on {on} validation pairs; {tie}",
        }
    unused = " (--best_metric bleu, but --eval_bleu_pairs 0 computes no BLEU)" if args.best_metric == "bleu" else ""
    tie = "equal loss: the earlier step"
    return {
        "metric": "loss",
        "pairs": valid_pairs,
        "validation_pairs": valid_pairs,
        "tie_rule": tie,
        "statement": f"validation loss on all {valid_pairs} validation pairs{unused}; {tie}",
    }


def rescores(args, valid_pairs: int) -> bool:
    """Whether the final choice re-scores the best `--final_candidates` checkpoints on the whole validation set:
    `--final_model best` (no `--average_last`) ranking by BLEU on part of the validation set."""
    return (
        args.final_model == "best"
        and (args.average_last or 0) <= 1
        and args.best_metric == "bleu"
        and 0 < (args.eval_bleu_pairs or 0) < valid_pairs
        and (getattr(args, "final_candidates", 1) or 1) > 1
    )


def kept_best(args, valid_pairs: int) -> int:
    """How many best validated checkpoints the run keeps: `--keep_best`, or the final candidates when the final
    choice re-scores them (`rescores`)."""
    keep = getattr(args, "keep_best", 0) or 0
    return max(keep, args.final_candidates) if rescores(args, valid_pairs) else keep


def log_ranking(args, valid_pairs: int) -> int:
    """Say how validated checkpoints rank (and how the final one is chosen) when the run validates; returns
    `kept_best`."""
    if valid_pairs:
        logger.info("Checkpoints rank by %s", ranking_rule(args, valid_pairs)["statement"])
        if rescores(args, valid_pairs):
            logger.info(
                "Final model: of the %d best validated checkpoints (kept), the best by BLEU on all %d validation "
                "pairs, at the end (--final_candidates)",
                args.final_candidates,
                valid_pairs,
            )
    return kept_best(args, valid_pairs)


def in_top(evals: Sequence[dict], step: int, metric: str, n: int) -> bool:
    """Whether `step`'s validation is among the best `n` so far (`--keep_best`: its checkpoint is saved)."""
    return n > 0 and step in ranked_steps(evals, metric)[:n]


def adopt(state, checkpoint_dir: Path, resumed: bool) -> None:
    """Start the list of the run's own checkpoints: empty for a new run; for a run resumed from a checkpoint that
    predates the list, the complete checkpoints up to the resumed step."""
    if getattr(state, "checkpoints", None) is None:
        state.checkpoints = (
            [s for s, _ in checkpointing.list_checkpoints(checkpoint_dir) if s <= state.step] if resumed else []
        )


def record_save(state, step: int) -> None:
    """Note that the run saves checkpoint `step` (before the save, so the checkpoint lists itself)."""
    state.checkpoints = sorted(set(state.checkpoints or []) | {step})


def kept_steps(state, args, best: int | None = None) -> set[int]:
    """The steps of the run's own checkpoints that rotation keeps: the newest max(--keep_checkpoints,
    --average_last), the best `best` (default --keep_best; `kept_best`), the best validated one. Everything when
    --keep_checkpoints is 0."""
    own = sorted(state.checkpoints or [])
    newest = max(args.keep_checkpoints, args.average_last or 0)
    if args.keep_checkpoints <= 0:
        return set(own)
    keep = set(own[-newest:])
    best = (getattr(args, "keep_best", 0) or 0) if best is None else best
    keep.update(ranked_steps(state.evals, args.best_metric, own)[:best])
    if state.best_step is not None:
        keep.add(state.best_step)
    return keep


def _is_own_checkpoint(path: Path, step: int) -> bool:
    """A complete checkpoint folder (not a link) whose marker names `step`."""
    if path.is_symlink() or not path.is_dir():
        return False
    try:
        return checkpointing.checkpoint_info(path).get("step") == step
    except checkpointing.CheckpointError:
        return False


def rotate(checkpoint_dir: str | os.PathLike, state, args, best: int | None = None) -> list[Path]:
    """Delete the run's own checkpoints that `kept_steps` does not keep (main process); returns what was deleted.
    Each goes by a rename first, so a kill during the deletion never leaves a half-deleted complete checkpoint."""
    checkpoint_dir = Path(checkpoint_dir)
    keep = kept_steps(state, args, best)
    removed, still = [], []
    for step in sorted(state.checkpoints or []):
        path = checkpoint_dir / f"step_{step}"
        if step in keep:
            still.append(step)
            continue
        if not _is_own_checkpoint(path, step):
            continue  # gone, or replaced by something the run did not write: left alone, forgotten
        trash = path.with_name(f".del_{path.name}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    state.checkpoints = still
    return removed
