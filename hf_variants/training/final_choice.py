"""The checkpoint `--final_model best` publishes, and how it was chosen (stated in the log, results.json's
`best_checkpoint` and the model card).

**The ranking** (`best_checkpoints.ranking_rule`): validation BLEU on the first `--eval_bleu_pairs` validation pairs
(ties: the lower validation loss, computed on every validation pair; then the earlier step), or with `--best_metric
loss` the validation loss on every pair (ties: the earlier step). It decides `--keep_best`, `--patience` and the best
validated step (`best_step`).

**The final choice.** BLEU on a few pairs is noisy: on 20 pairs one sentence moves it by points, and the step it
ranks first can have a worse validation loss and chrF than another. So when the ranking's BLEU covers only part of
the validation set, the run keeps its best `--final_candidates` validated checkpoints (default 3; `kept_best`) and,
at the end, translates the whole validation set with each (the validation decoding: `--num_beams`, the length
rule); the final model is the one with the highest BLEU there, ties broken by the lower validation loss, then the
earlier step. With `--best_metric loss`, or BLEU on every validation pair, the ranking already uses the whole set
and its best is the final model. `--final_candidates 1` publishes the ranking's best as it is.

results.json's `best_checkpoint`: `metric`, `pairs`, `validation_pairs`, `tie_rule` and `statement` of the ranking,
`best_step` (the ranking's best), `rescored` (None, or the metric, pairs and tie rule of the final choice and each
candidate's `step`, `bleu`, `chrf` and `valid_loss`) and `final_step` (the published checkpoint's step; None when
`--final_model last` or `--average_last` made the final model).
"""

from __future__ import annotations

import copy
import logging

from . import checkpointing
from .best_checkpoints import ranked_steps, ranking_rule, rescores

logger = logging.getLogger("hf_variants.train")


def build_model_like(model):
    """A fresh (non-distributed) instance of `model`'s class and config, in float32 on CPU."""
    config = copy.deepcopy(model.config)
    return type(model)._from_config(config) if hasattr(type(model), "_from_config") else type(model)(config)


def rescore(trainer, candidates: list[int], kind: str) -> list[dict]:
    """Each candidate checkpoint's BLEU and chrF on the whole validation set, with its validation loss: the `kind`
    weights ("raw" / "ema") of `step_N`, translated as validation translates (collective: every process takes part;
    the main process's scores are the answer on every process)."""
    from .checkpoint_models import read_weights
    from .trainer import accelerator_broadcast, evaluate_pairs

    data, run, args, accelerator = trainer.data, trainer.run, trainer.args, trainer.accelerator
    losses = {record["step"]: record["valid_loss"] for record in trainer.state.evals}
    rows = []
    for step in candidates:
        model = build_model_like(trainer.job.unwrapped)
        checkpointing.load_model_weights(model, read_weights(run.checkpoint_dir / f"step_{step}", kind))
        model.to(accelerator.device).eval()
        scores = evaluate_pairs(
            accelerator, model, data.tokenizer, data.valid_pairs, run.eval_directions, args.bidirectional, args
        )
        del model
        if scores is not None:
            rows.append({"step": step, "bleu": scores["bleu"], "chrf": scores["chrf"], "valid_loss": losses[step]})
            logger.info(
                "Final choice: step_%d on all %d validation pairs: BLEU %.2f, chrF %.2f (validation loss %.4g)",
                step,
                len(data.valid_pairs),
                scores["bleu"],
                scores["chrf"],
                losses[step],
            )
    return accelerator_broadcast(accelerator, rows)


def choose(trainer, kind: str) -> int:
    """The step of the checkpoint `--final_model best` publishes (see the module docstring); its account is left in
    `trainer.best_choice` (results.json's `best_checkpoint`) and in the log."""
    args, state = trainer.args, trainer.state
    valid_pairs = len(trainer.data.valid_pairs or [])
    record = summary(trainer)
    step, record["rescored"] = state.best_step, None
    if rescores(args, valid_pairs):
        kept = [s for s, _ in checkpointing.list_checkpoints(trainer.run.checkpoint_dir)]
        candidates = ranked_steps(state.evals, record["metric"], kept)[: args.final_candidates]
        rows = rescore(trainer, candidates, kind) if len(candidates) > 1 else []
        if rows:
            step = max(rows, key=lambda r: (r["bleu"], -r["valid_loss"], -r["step"]))["step"]
            record["rescored"] = {
                "metric": "bleu",
                "pairs": valid_pairs,
                "tie_rule": "equal BLEU: the lower validation loss, then the earlier step",
                "candidates": rows,
            }
            record["statement"] = (
                f"step_{step}, the best by BLEU on all {valid_pairs} validation pairs (ties: the lower validation "
                f"loss, then the earlier step) of the {len(rows)} best by the ranking: {record['statement']}"
            )
    if record["rescored"] is None:
        record["statement"] = f"step_{step}, the best by {record['statement']}"
    record["final_step"] = step
    trainer.best_choice = record
    logger.info("Final model chosen: %s", record["statement"])
    return step


def summary(trainer) -> dict | None:
    """results.json's `best_checkpoint` (see the module docstring): the final choice once made, else (`--final_model
    last`, `--average_last`) the ranking alone; None for a run without validation data."""
    if getattr(trainer, "best_choice", None) is not None:
        return trainer.best_choice
    valid_pairs = len(trainer.data.valid_pairs or [])
    if not valid_pairs:
        return None
    rule = ranking_rule(trainer.args, valid_pairs)
    return {**rule, "best_step": trainer.state.best_step, "rescored": None, "final_step": None}


__all__ = ["build_model_like", "choose", "rescore", "summary"]
