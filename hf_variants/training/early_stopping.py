"""Early stopping (`--patience N`, `--min_delta D`): fairseq's `--patience`, OpenNMT-py's `-early_stopping`, Marian's
`--early-stopping` with `--early-stopping-epsilon`, Sockeye's `--max-num-checkpoint-not-improved`.

The run watches `--best_metric` at every validation: BLEU (higher is better) or the validation loss (lower is
better). A validation improves on the best value so far when it is better by more than `--min_delta` (BLEU points,
or loss); after N validations in a row without such an improvement the run stops: it checkpoints that step, logs one
line saying why, publishes its final model by `--final_model` (the best validated checkpoint by default) and exits
with status 0. A validation whose loss is not finite counts as no improvement.

The counter lives in the run's state (`TrainState.early_stopping`: the best value, its step, the validations
without improvement since), saved in every checkpoint: a run interrupted and resumed stops at the same step as an
uninterrupted one. `--patience` and `--min_delta` may change on a resume (they decide how long the run goes on, as
`--max_steps` does): a stopped run resumed with a larger patience trains on.
"""

from __future__ import annotations

import logging
import math

logger = logging.getLogger("hf_variants.train")


def metric_value(record: dict, metric: str) -> float | None:
    """The watched value of a validation record, larger is better (BLEU, or the negated loss); None when the loss is
    not finite (or BLEU was not computed)."""
    loss = record.get("valid_loss")
    if not isinstance(loss, (int, float)) or not math.isfinite(loss):
        return None
    if metric == "bleu":
        bleu = record.get("valid_bleu")
        return float(bleu) if isinstance(bleu, (int, float)) else None
    return -float(loss)


def check_validation_data(args, valid_pairs) -> None:
    """--patience and --keep_best rank validations: a run without validation data is refused (a `DataError`)."""
    from .corpus import DataError

    flags = [flag for flag in ("patience", "keep_best") if getattr(args, flag, 0)]
    if flags and not valid_pairs:
        raise DataError(
            f"--{flags[0]} ranks validations, and the run has no validation data: give --valid_file, a "
            f"--valid_prefix file in --data_dir or a dataset with a validation split (--valid_split)."
        )


def update(state, record: dict, args) -> bool:
    """Count validation `record` (after `Trainer.evaluate`); True when the run stops here (logged once)."""
    patience = getattr(args, "patience", 0) or 0
    if not patience:
        return False
    tracked = state.early_stopping or {"best": None, "best_step": None, "bad": 0, "stopped_at": None}
    value = metric_value(record, args.best_metric)
    if value is not None and (tracked["best"] is None or value - tracked["best"] > args.min_delta):
        tracked.update(best=value, best_step=record["step"], bad=0)
    else:
        tracked["bad"] += 1
    state.early_stopping = tracked
    if tracked["bad"] < patience:
        return False
    tracked["stopped_at"] = record["step"]
    best = tracked["best"]
    shown = "none" if best is None else f"{best:.4g}" if args.best_metric == "bleu" else f"{-best:.4g}"
    logger.info(
        "Early stopping at step %d: validation %s has not improved by more than %g for %d validations (--patience "
        "%d; best %s at step %s); final model: %s",
        record["step"],
        args.best_metric,
        args.min_delta,
        tracked["bad"],
        patience,
        shown,
        tracked["best_step"],
        "average of the last checkpoints" if args.average_last > 1 else f"the {args.final_model} checkpoint",
    )
    return True


def stopped(state, args) -> bool:
    """Whether the run has stopped early (also after a resume: the counter is in the checkpoint)."""
    tracked = getattr(state, "early_stopping", None)
    patience = getattr(args, "patience", 0) or 0
    return bool(patience and tracked and tracked["bad"] >= patience)


def summary(state, args) -> dict | None:
    """results.json's `early_stopping`: None without --patience; else patience, min_delta, the metric, the best
    value and step, the validations without improvement, and the step the run stopped at (None: it did not)."""
    patience = getattr(args, "patience", 0) or 0
    if not patience:
        return None
    tracked = getattr(state, "early_stopping", None) or {"best": None, "best_step": None, "bad": 0}
    best = tracked["best"]
    return {
        "patience": patience,
        "min_delta": args.min_delta,
        "metric": args.best_metric,
        "best": None if best is None else best if args.best_metric == "bleu" else -best,
        "best_step": tracked["best_step"],
        "validations_without_improvement": tracked["bad"],
        "stopped_at_step": tracked.get("stopped_at") if stopped(state, args) else None,
    }
