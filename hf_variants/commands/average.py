"""`hf-variants-average`: average the checkpoints of a training run (finished or still training) into a model folder.

    hf-variants-average runs/en-de --last 5 --output_dir runs/en-de-avg5
    hf-variants-average runs/en-de --best 5 --output_dir runs/en-de-best5      # by the run's --best_metric
    hf-variants-average runs/en-de --checkpoints step_9000 step_10000 --output_dir runs/en-de-avg2

The output is a model folder as a run's `model/` is: `model.safetensors` (the float32 mean of the checkpoints'
weights, `hf_variants/training/averaging.py`), `config.json`, `generation_config.json`, the modeling code, the run's
tokenizer and a model card whose "Final weights" row names the averaged checkpoints (and no scores: translate a
test set with `hf-variants-translate` to score it). The same code averages `--average_last K` at the end of a run.

- `--last K`: the newest K checkpoints; `--best K`: the K best validated ones by the run's `--best_metric`
  (`--metric` to choose), read from the validation history in the newest checkpoint (train with `--keep_best K`
  so that they are kept); `--checkpoints A B ...`: checkpoint folders, or names of the run's (`step_N`).
- `--weights ema|raw`: the checkpoints' moving averages (a run trained with `--ema_decay`) or their model weights;
  default: those the run validated (`--eval_weights`).
- Refused before anything is written, naming what is wrong: checkpoints of models with different configs or
  tokenizers, checkpoints of different runs (their run ids, `hf_variants/training/run_identity.py`: the same
  config and tokenizer with another seed or other data; `--allow_other_runs` averages them anyway and the model
  card says so; a checkpoint written before run ids belongs to the run of its folder), a weights file that differs
  from its checkpoint's manifest, fewer checkpoints than asked for, an `--output_dir` that is, holds or lies inside
  an input (the run folder included), a non-empty `--output_dir` (`--force` replaces only a folder this command
  wrote). Exit status 2, one line.

Peak memory: about two models (the float32 sum, then the model it is loaded into), whatever K is
(`benchmarks/average_memory.py`). fairseq's `scripts/average_checkpoints.py`, OpenNMT-py's `average_models` and
`sockeye-average` do the same job; this one also writes a loadable, documented model folder and checks that the
checkpoints belong together.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..outputs import OutputPathError, int_in_range
from ..training import averaging, checkpointing, progress
from ..training.checkpoint_models import validated_weights
from ..training.run_identity import check_same_run
from .common import add_output_dir_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-average",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (train.py --output_dir)")
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--last", type=int_in_range(1), metavar="K", help="the newest K checkpoints")
    which.add_argument("--best", type=int_in_range(1), metavar="K", help="the K best validated checkpoints")
    which.add_argument("--checkpoints", nargs="+", metavar="CKPT", help="checkpoint folders or names (step_N)")
    parser.add_argument("--metric", choices=["bleu", "loss"], help="--best: the ranking (default: the run's)")
    parser.add_argument(
        "--weights",
        choices=averaging.WEIGHT_KINDS,
        help="the checkpoints' moving averages (--ema_decay runs) or model weights (default: what the run validated)",
    )
    parser.add_argument(
        "--allow_other_runs",
        action="store_true",
        help="average checkpoints of different runs (refused by default: their mean is a model neither run "
        "trained); the model card records it",
    )
    add_output_dir_flags(parser, "hf-variants-average", "the averaged model folder")
    return parser


def choose(args: argparse.Namespace, run_dir: Path) -> tuple[list[Path], str]:
    """The checkpoints to average and how they were chosen (for the log and the model card)."""
    if args.last:
        return averaging.select_last(run_dir, args.last), f"the last {args.last}"
    if args.best:
        chosen, metric = averaging.select_best(run_dir, args.best, args.metric)
        return chosen, f"the best {args.best} by validation {metric}"
    return averaging.resolve_checkpoints(run_dir, args.checkpoints), "chosen checkpoints"


def main(argv=None) -> Path:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.metric and not args.best:
        parser.error("--metric ranks the checkpoints of --best")
    run_dir = Path(args.run_dir)
    if not sys.stderr.isatty():  # a log: no carriage-return progress bars of the libraries
        progress.quiet_library_bars()
    try:
        if not run_dir.is_dir():
            raise averaging.AveragingError(f"RUN_DIR {run_dir}: no such folder")
        chosen, how = choose(args, run_dir)
        weights = args.weights or validated_weights(chosen[-1])
        out = averaging.write_average(
            run_dir,
            chosen,
            args.output_dir,
            weights=weights,
            how=how,
            force=args.force,
            allow_other_runs=args.allow_other_runs,
            log=print,
        )
    except (averaging.AveragingError, OutputPathError, FileExistsError, checkpointing.CheckpointError) as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    except FileNotFoundError as error:  # e.g. a checkpoint rotated away by the run still training
        parser.exit(2, f"{parser.prog}: error: {error} (was it deleted while averaging?)\n")
    names = ", ".join(p.name for p in chosen)
    of = "moving averages" if weights == "ema" else "weights"
    runs, mixed = check_same_run(chosen, allow_other_runs=True, log=lambda message: None)
    whose = f"of {len(runs)} runs ({', '.join(runs)})" if mixed else f"of run {runs[0]} in {run_dir}"
    print(f"Averaged the {of} of {len(chosen)} checkpoint(s) {whose} ({how}: {names}) into {out}")
    return out


def cli() -> None:
    main(sys.argv[1:])


if __name__ == "__main__":
    cli()
