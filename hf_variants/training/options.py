"""The command line of `hf_variants.training.train`: every option, its group and its checks at parse time
(before any data or model work). `parse_args()` returns the namespace the training stages read."""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path

from ..inference.flags import add_option_flags
from . import corpora, external, flag_checks, settings, threads
from .evaluation import BLEU_TOKENIZERS, DEFAULT_BLEU_TOKENIZE, check_bleu_tokenize

# A clone of the repository (this package imported from its checkout) bundles Multi30k en-de in training/data; an
# installed package has none: --data_dir (or --train_file, --dataset_name) is then required. Runs go to ./runs (the
# working directory's), in a clone or not.
_CHECKOUT = Path(__file__).resolve().parents[2]
CHECKOUT = _CHECKOUT if (_CHECKOUT / "pyproject.toml").is_file() and (_CHECKOUT / "training").is_dir() else None
DEFAULT_DATA_DIR = CHECKOUT / "training" / "data" / "multi30k" if CHECKOUT else None
RUNS_DIR = Path("runs")  # relative: the working directory of the run
EVAL_DECODING = {"num_beams": 4, "length_penalty": 0.6, "max_len_a": 1.2, "max_len_b": 10}
DESCRIPTION = "Train any hf_variants model type on parallel text with Accelerate: one loop for every variant."


def str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def parse_overrides(spec: str | None) -> dict:
    """`--config_overrides` -> dict (hf_variants.configuration_transformer_nmt.parse_config_overrides: values parsed
    as JSON/Python literals, else kept as strings)."""
    from ..configuration_transformer_nmt import parse_config_overrides

    return parse_config_overrides(spec)


def add_data_args(g) -> None:
    g.add_argument(
        "--data_dir",
        default=str(DEFAULT_DATA_DIR) if DEFAULT_DATA_DIR else None,
        help="folder of per-language text files {prefix}.{lang}[.gz] (multi-way parallel)",
    )
    g.add_argument("--train_prefix", default="train")
    g.add_argument("--valid_prefix", default="val")
    g.add_argument("--test_prefix", default="test_2016_flickr", help="the final evaluation split ('' for none)")
    g.add_argument(
        "--train_file",
        action="append",
        help="TSV (header = language codes) or JSONL ({'translation': {...}}) instead of --data_dir; repeat it for "
        "several corpora, mixed by --corpus_weights",
    )
    add_corpus_args(g)
    g.add_argument("--valid_file", "--validation_file")
    g.add_argument("--test_file")
    g.add_argument(
        "--dataset_name",
        help="a `datasets` dataset (Hub name or local path) with a 'translation' column, instead of --data_dir",
    )
    g.add_argument("--dataset_config_name")
    g.add_argument(
        "--source_column",
        help="--dataset_name with one text column per language: the source column (default: a 'translation' "
        "column of {lang: text}, else the columns named by language codes, e.g. 'en' and 'fr')",
    )
    g.add_argument("--target_column", help="the target column of such a dataset (with --source_column)")
    g.add_argument("--train_split", default="train")
    g.add_argument(
        "--valid_split",
        "--validation_split",
        help="default: the dataset's 'validation' split, or 'valid', 'val' or 'dev' (none: no validation)",
    )
    g.add_argument(
        "--test_split",
        help="default: the dataset's 'test' split (none: the final evaluation uses the validation split)",
    )
    g.add_argument("--source_lang", default="en")
    g.add_argument("--target_lang", default="de")
    g.add_argument(
        "--languages", nargs="+", help="many-to-many run over these languages (overrides --source_lang/--target_lang)"
    )
    g.add_argument("--directions", help="comma-separated src-tgt pairs of a multilingual run (default: all)")
    g.add_argument(
        "--bidirectional",
        action="store_true",
        help="every batch trains source→target and target→source (Tied's dual training)",
    )
    g.add_argument(
        "--on_bad_pairs",
        choices=["skip", "error"],
        default="skip",
        help="empty/missing/too-long pairs: skip and count them (reported in the log, results.json and "
        "the model card), or stop with the file and line",
    )
    g.add_argument(
        "--source_annotations",
        nargs="+",
        default=[],
        metavar="NAME",
        help="per-sentence inputs the model's prepare_translation_inputs takes for each source sentence, "
        "e.g. 'parses' for the syntactic MG-SA: files <prefix>.<lang>.<NAME>[.gz] beside the text "
        "files (one value a line), or a top-level {NAME: {lang: value}} in JSONL rows; 'parses' are "
        "checked against their sentences when the data loads (see --on_bad_pairs)",
    )
    g.add_argument("--max_length", type=int, default=128, help="longest sentence in tokens (longer: dropped)")
    g.add_argument(
        "--max_train_pairs", "--max_train_samples", type=int, help="use only the first N rows of the training data"
    )
    g.add_argument("--max_valid_pairs", "--max_eval_samples", type=int, help="use only the first N validation rows")
    g.add_argument("--max_test_pairs", "--max_predict_samples", type=int, help="use only the first N test rows")
    g.add_argument(
        "--data_cache_dir",
        help="the tokenized Arrow cache, shared by runs, relaunches and ranks "
        "(default: $HF_DATASETS_CACHE/hf_variants)",
    )
    g.add_argument(
        "--streaming",
        action="store_true",
        help="read the training split as a stream (a datasets IterableDataset, tokenized on the fly in "
        "buffers of --stream_buffer_rows rows, length-bucketed within each) instead of caching it: "
        "for corpora larger than the disk cache should hold; needs --max_steps",
    )
    g.add_argument(
        "--stream_buffer_rows",
        type=int,
        default=100_000,
        help="rows per streaming buffer (batches are length-bucketed and shuffled within a buffer)",
    )
    g.add_argument(
        "--preprocessing_num_workers",
        type=int,
        help="processes tokenizing a split when its cache is built (default: the CPU cores available)",
    )


def add_corpus_args(g) -> None:
    """Several training corpora: their weights and tags, or a spec file (`corpora.py`)."""
    g.add_argument(
        "--corpus_weights",
        nargs="+",
        type=float,
        metavar="W",
        help="one weight per --train_file: its share of the training examples (1 0.5: two thirds from the first "
        "corpus, one third from the second, whatever their sizes)",
    )
    g.add_argument(
        "--corpus_tags",
        nargs="+",
        metavar="TAG",
        help='one tag per --train_file, put before each of its source sentences as a special token ("" for none), '
        'e.g. "" "<BT>" for tagged back-translation',
    )
    g.add_argument(
        "--corpus_spec",
        metavar="FILE",
        help='a JSON file {"corpora": [{"train_file" | "data_dir" (+ "prefix") | "dataset_name" (+ "split", ...), '
        '"weight", "tag", "name"}, ...]} listing the training corpora instead of --train_file (training/README.md)',
    )


def add_tokenizer_args(g) -> None:
    g.add_argument(
        "--tokenizer",
        "--tokenizer_name",
        help="a saved tokenizer; default: train the shared one and save it with the run",
    )
    g.add_argument("--tokenizer_model", choices=["bpe", "unigram"], default="bpe")
    g.add_argument("--vocab_size", type=int, default=8000)
    g.add_argument("--tokenizer_min_frequency", type=int, default=2)
    g.add_argument(
        "--tokenizer_sample_lines",
        type=int,
        default=3_000_000,
        help="train the tokenizer on at most this many sentences (all languages together): a "
        "deterministic random sample of the training rows when the corpus has more (0: all)",
    )


def add_model_args(g) -> None:
    g.add_argument("--model_type", default="transformer_nmt")
    g.add_argument("--preset", default="small", help="a preset of the model's config (tiny, small, base, big)")
    g.add_argument("--config_overrides", help="key=value,... applied to the config")
    g.add_argument("--model_name_or_path", help="start from a saved model instead of a preset")
    g.add_argument(
        "--allow_large_model",
        action="store_true",
        help="build the model even when its estimated memory (weights, gradients, Adam moments, a batch's "
        "activations) exceeds the memory available",
    )
    g.add_argument("--dropout", type=float, help="default: the preset's")
    g.add_argument("--label_smoothing", "--label_smoothing_factor", type=float, default=0.1)
    g.add_argument(
        "--target_language_tags",
        choices=["auto", "true", "false"],
        default="auto",
        help="prepend <2xx> to sources; auto = when the run has more than one target language "
        "(never for tied_nmt: its direction embedding is the signal)",
    )


def add_optimisation_args(g) -> None:
    g.add_argument("--learning_rate", type=float, default=1e-3, help="peak learning rate (after warmup)")
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.98)
    g.add_argument("--adam_epsilon", type=float, default=1e-9)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--warmup_steps", type=int, default=50)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument(
        "--max_tokens",
        type=int,
        default=2048,
        help="tokens per micro-batch and process, padding included (4096 in the papers' recipes)",
    )
    g.add_argument("--max_sentences", type=int, help="sentences per micro-batch (cap)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--max_steps", type=int, default=200, help="optimizer steps (ignored with --num_epochs)")
    g.add_argument(
        "--num_epochs", "--num_train_epochs", type=float, help="train for this many epochs instead of --max_steps"
    )
    g.add_argument(
        "--mixed_precision", choices=["no", "fp16", "bf16"], help="default: Accelerate's config / launch option"
    )
    g.add_argument("--fp16", dest="mixed_precision", action="store_const", const="fp16", help="--mixed_precision fp16")
    g.add_argument("--bf16", dest="mixed_precision", action="store_const", const="bf16", help="--mixed_precision bf16")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument(
        "--ema_decay",
        type=float,
        help="keep an exponential moving average of the weights (float32, saved in every checkpoint): "
        "ema = D * ema + (1 - D) * weights after each step; validation and the final model use it "
        "(--eval_weights). E.g. 0.999",
    )
    g.add_argument(
        "--ema_start_step",
        type=int,
        default=0,
        help="the average equals the weights up to this step, then moves (leave out the first, fast-moving steps)",
    )
    g.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the model's encoder-decoder stacks for the training step (dynamic batch and length "
        "dimensions: one graph for every bucketed batch shape; the loss, validation and decoding stay eager)",
    )
    g.add_argument(
        "--num_threads",
        type=int,
        help="CPU threads per process (default on CPU: OMP_NUM_THREADS when you set it, else the cores available "
        "divided by the training processes on this machine, at least 1; `accelerate launch` would otherwise leave "
        "one). Recorded in the run: a resume keeps the recorded count unless this flag is given",
    )
    g.add_argument(
        "--threads_from_load",
        action="store_true",
        help="at each launch, fewer CPU threads when the 1-minute load average leaves fewer cores idle (faster on a "
        "busy machine; the weights then depend on the load, and the count used is recorded)",
    )
    g.add_argument(
        "--cpu",
        action="store_true",
        help="train on CPU even when an accelerator is available (without "
        "one, CPU and, under a multi-process launch, gloo are used)",
    )
    g.add_argument(
        "--on_nonfinite",
        choices=["stop", "skip"],
        default="stop",
        help="a non-finite training loss or gradient: stop (exit status 3, naming the step, the last "
        "losses and the last checkpoint; results.json says why; no final model), or skip the update "
        "and count it (log, results.json)",
    )
    g.add_argument(
        "--ddp_timeout",
        type=int,
        default=10800,
        help="seconds the other processes wait for the main one (e.g. while it builds the data cache "
        "of a large corpus at the first launch)",
    )


def add_evaluation_args(g) -> None:
    g.add_argument(
        "--eval_steps", type=int, default=100, help="validate every N steps (and at the end; 0: only at the end)"
    )
    g.add_argument(
        "--eval_bleu_pairs",
        type=int,
        default=200,
        help="validation pairs translated for BLEU/chrF during training (0: loss only)",
    )
    g.add_argument(
        "--best_metric",
        choices=["bleu", "loss"],
        default="bleu",
        help="how validated checkpoints rank (--keep_best, --patience, --final_model best): BLEU on the first "
        "--eval_bleu_pairs validation pairs (ties: the lower validation loss, then the earlier step), or the "
        "validation loss on every validation pair",
    )
    g.add_argument(
        "--patience",
        type=int,
        default=0,
        help="stop after this many validations in a row without an improvement of --best_metric by more than "
        "--min_delta (0: never stop early); the final model is then --final_model's",
    )
    g.add_argument(
        "--min_delta",
        type=float,
        default=0.0,
        help="the smallest change of --best_metric (BLEU points, or validation loss) that counts as an "
        "improvement for --patience",
    )
    g.add_argument(
        "--eval_weights",
        choices=["ema", "raw"],
        help="the weights validation and the final model use: the moving average (--ema_decay; the default with "
        "it) or the trained weights",
    )
    # the decoding of validation BLEU and of the test translations, saved as the model's generation config (the
    # defaults of the translate command and the server): DecodeOptions' flags, with the papers' settings
    add_option_flags(
        g,
        ["num_beams", "length_penalty", "max_len_a", "max_len_b"],
        defaults=EVAL_DECODING,
        aliases={"num_beams": ["--generation_num_beams"]},
    )
    g.add_argument(
        "--eval_batch_size",
        "--per_device_eval_batch_size",
        type=int,
        default=100,
        help="sentences per translation batch and process",
    )
    g.add_argument("--num_examples", type=int, default=5, help="test translations printed at the end")
    g.add_argument(
        "--bleu_tokenize",
        choices=BLEU_TOKENIZERS,
        default=DEFAULT_BLEU_TOKENIZE,
        help="sacreBLEU's tokenizer for BLEU (zh for Chinese, ja-mecab / ko-mecab for Japanese / Korean targets: "
        "the hf-variants[ja] / [ko] extras); recorded in the BLEU signature",
    )


def add_checkpoints_args(g) -> None:
    g.add_argument(
        "--save_steps",
        type=int,
        help="checkpoint every N steps (default: --eval_steps; 0: only at the end and the best)",
    )
    g.add_argument(
        "--keep_checkpoints",
        "--save_total_limit",
        type=int,
        default=5,
        help="newest checkpoints kept (plus the best, and --keep_best; 0: all)",
    )
    g.add_argument(
        "--keep_best",
        type=int,
        default=0,
        help="also keep the N best validated checkpoints by --best_metric (each saved when it ranks among them)",
    )
    g.add_argument(
        "--average_last",
        type=int,
        default=0,
        help="final model = mean weights of the last K checkpoints (the papers' averaging)",
    )
    g.add_argument(
        "--final_model",
        choices=["best", "last"],
        default="best",
        help="final model without --average_last: the best validated checkpoint or the last one",
    )
    g.add_argument(
        "--final_candidates",
        type=int,
        default=3,
        metavar="K",
        help="--final_model best with BLEU ranked on part of the validation set (--eval_bleu_pairs): keep the K best "
        "validated checkpoints and choose the final model among them by BLEU on the whole validation set at the end "
        "(ties: the lower validation loss, then the earlier step); 1: the ranking's best as it is",
    )
    g.add_argument(
        "--resume_from_checkpoint",
        help="a checkpoint folder, or 'latest' (the run's newest; starts fresh when there is none)",
    )
    g.add_argument(
        "--requeue_exit_code",
        type=int,
        default=143,
        help="exit status after SIGTERM or SIGUSR1 (preemption: `sbatch --signal=USR1@120`, Kubernetes): "
        "every process checkpoints at the next step boundary and exits with it; continue with "
        "--resume_from_checkpoint latest (Ctrl-C does the same but exits with 130; twice: stops at once)",
    )
    g.add_argument(
        "--allow_changed_settings",
        metavar="NAME[,NAME...]",
        nargs="+",
        action="extend",
        help="resume even though these settings differ from the checkpoint's (e.g. learning_rate,seed; data: the "
        "content of the training or validation data): "
        "the new values apply from the resumed step on and are recorded in results.json and the "
        "model card. Without it a resume with changed settings is refused, except for settings "
        "that do not change what is computed (max_steps, num_epochs, logging/eval/save cadence, "
        "final test, output)",
    )


def add_output_args(g) -> None:
    g.add_argument("--output_dir", help="run folder (default: runs/<run_name> in the working directory)")
    g.add_argument("--variant_name", help="a display name for the model card (default: the model family's name)")
    g.add_argument(
        "--license",
        help="the Hub license id of the trained weights, for the model card (e.g. apache-2.0, cc-by-nc-4.0); "
        "default: 'unknown' (choose one that the training data's terms allow)",
    )
    g.add_argument(
        "--dataset_label",
        help="the name of the training data in the model card (default: --dataset_name, the training file's "
        "name, or the --data_dir folder's name)",
    )
    g.add_argument("--run_name", help="default: <model_type>-<directions>[-bi][-<preset> unless small]")
    g.add_argument("--overwrite_output_dir", action="store_true")
    g.add_argument("--logging_steps", type=int, default=25)
    g.add_argument(
        "--progress_interval",
        type=float,
        default=30.0,
        help="when stderr is no terminal (nohup, a SLURM log, CI): a progress line every this many seconds "
        "instead of a progress bar (0: every step)",
    )
    g.add_argument("--no_progress", action="store_true", help="no progress bar or progress lines")
    g.add_argument(
        "--report_to",
        nargs="+",
        default=["none"],
        metavar="TRACKER",
        help="Accelerate trackers: none, all, or any of " + ", ".join(TRACKERS) + " (tensorboard logs in "
        "<run>/logs; wandb: project $WANDB_PROJECT or 'hf_variants', run named after the run; "
        "`pip install 'hf-variants[wandb]'`)",
    )
    g.add_argument("--push_to_hub", action="store_true")
    g.add_argument("--hub_model_id", help="ORG/NAME")
    g.add_argument("--hub_token", help="default: HF_TOKEN / the cached login")


class OneLineErrorParser(argparse.ArgumentParser):
    """Errors as one line, `prog: error: message` with exit status 2, without argparse's usage text (70 lines of
    options that would bury the message; `--help` prints them)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(description=DESCRIPTION, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_data_args(p.add_argument_group("data"))
    add_tokenizer_args(p.add_argument_group("tokenizer"))
    add_model_args(p.add_argument_group("model"))
    add_optimisation_args(p.add_argument_group("optimisation"))
    add_evaluation_args(p.add_argument_group("evaluation"))
    add_checkpoints_args(p.add_argument_group("checkpoints"))
    add_output_args(p.add_argument_group("output"))
    return p


# Accelerate's trackers (accelerate.utils.LoggerType)
TRACKERS = ("tensorboard", "wandb", "trackio", "comet_ml", "mlflow", "aim", "clearml", "dvclive", "swanlab")


def parse_report_to(values) -> list[str]:
    """`--report_to` values (several, or comma-separated) -> the trackers requested from Accelerate ([] for none).
    A named tracker whose package is missing is an error (Accelerate would silently leave it out)."""
    from accelerate.tracking import get_available_trackers

    names = [v.strip().lower() for item in (values or []) for v in str(item).split(",") if v.strip()]
    if names in ([], ["none"]):
        return []
    unknown = [n for n in names if n not in TRACKERS and n != "all"]
    if unknown or "none" in names:
        raise ValueError(
            f"--report_to: unknown tracker(s) {unknown or ['none']} (with others); choose none, all or "
            f"any of {', '.join(TRACKERS)}."
        )
    available = {str(t) for t in get_available_trackers()}
    missing = [n for n in names if n != "all" and n not in available]
    if missing:
        extra = " (pip install 'hf-variants[wandb]')" if "wandb" in missing else ""
        raise ValueError(f"--report_to {' '.join(missing)}: the package is not installed{extra}.")
    return list(dict.fromkeys(names))


def tracker_init_kwargs(trackers: list[str], run_name: str, run_dir: Path) -> tuple[str, dict]:
    """The project name and per-tracker `init_kwargs` of `accelerator.init_trackers`: TensorBoard writes to
    <run>/logs/<project>; Weights & Biases logs into project $WANDB_PROJECT (default 'hf_variants'), in a run named
    after this run, its files under <run>/logs."""
    from accelerate.tracking import get_available_trackers

    active = {str(t) for t in get_available_trackers()} if "all" in trackers else set(trackers)
    init_kwargs = {}
    project = run_name
    if "wandb" in active:
        project = os.environ.get("WANDB_PROJECT") or "hf_variants"
        init_kwargs["wandb"] = {"name": run_name, "dir": str(run_dir / "logs")}
    return project, init_kwargs


def parse_args(argv=None, data_required: bool = True) -> argparse.Namespace:
    """The checked options (`data_required=False`: the data come from elsewhere, `train_on_datasets`)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.corpora = corpora.parse_corpora(args)  # several training corpora, or None
        args.report_to = parse_report_to(args.report_to) or ["none"]
        args.allow_changed_settings = (
            sorted(
                settings.parse_allowed(
                    args.allow_changed_settings,
                    [a.dest for a in parser._actions if a.dest not in settings.NOT_STORED]
                    + list(settings.DERIVED)
                    + ["corpora"],
                    settings.option_names(parser),
                )
            )
            or None
        )
    except ValueError as err:
        parser.error(str(err))
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id ORG/NAME")
    if args.push_to_hub and args.model_type in external.EXTERNAL_MODEL_TYPES:
        parser.error(
            f"--push_to_hub publishes hf_variants models (with their card); --model_type "
            f"{args.model_type} is for comparisons only"
        )
    sources = [bool(args.train_file), bool(args.dataset_name)]
    if sum(sources) > 1:
        parser.error("give either --train_file or --dataset_name (or neither, for --data_dir)")
    if (args.source_column is None) != (args.target_column is None):
        parser.error("--source_column and --target_column name a dataset's two text columns: give both")
    if args.source_column is not None and args.languages:
        parser.error("--source_column/--target_column name the --source_lang/--target_lang columns, not --languages")
    if args.license is not None and not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", args.license):
        parser.error(f"--license {args.license!r} is no Hub license id (lowercase, e.g. apache-2.0, cc-by-nc-4.0)")
    if args.dataset_label is not None and not args.dataset_label.strip():
        parser.error("--dataset_label is empty")
    if args.save_steps is None:
        args.save_steps = args.eval_steps
    for message in numeric_flag_errors(args):
        parser.error(message)
    if args.num_threads and args.threads_from_load:
        parser.error("--num_threads N fixes the CPU threads, --threads_from_load picks them by the load: give one")
    try:
        threads.user_omp_threads(os.environ)
    except ValueError as error:
        parser.error(str(error))
    if args.streaming and args.num_epochs:
        parser.error("--streaming reads a corpus of unknown length: give --max_steps, not --num_epochs")
    if args.resume_from_checkpoint and args.overwrite_output_dir:
        parser.error(
            "--resume_from_checkpoint continues the run in --output_dir, --overwrite_output_dir deletes it: "
            "give one of them"
        )
    if args.max_len_a == 0 and args.max_len_b == 0:
        parser.error("--max_len_a 0 --max_len_b 0 leaves no tokens to generate: make one of them positive")
    for message in [*flag_checks.flag_errors(args, data_required), *run_length_errors(args)]:
        parser.error(message)
    try:
        check_bleu_tokenize(args.bleu_tokenize)
    except ValueError as error:
        parser.error(str(error))
    return args


def run_length_errors(args) -> list[str]:
    """Checks of the early stopping, best-checkpoint and moving-average flags (`--eval_weights` defaults here)."""
    errors = []
    if args.patience and not args.eval_steps:
        errors.append("--patience counts validations: it needs periodic validation (--eval_steps > 0)")
    if args.patience and args.best_metric == "bleu" and not args.eval_bleu_pairs:
        errors.append("--patience watches --best_metric bleu, which --eval_bleu_pairs 0 never computes")
    if args.keep_best and not args.eval_steps:
        errors.append("--keep_best ranks validated checkpoints: it needs periodic validation (--eval_steps > 0)")
    if args.ema_decay is not None and not 0 < args.ema_decay < 1:
        errors.append(f"--ema_decay must be in (0, 1), e.g. 0.999, got {args.ema_decay}")
    if args.ema_decay is None and (args.ema_start_step or args.eval_weights == "ema"):
        errors.append(f"--{'ema_start_step' if args.ema_start_step else 'eval_weights ema'} needs --ema_decay")
    if args.ema_decay is not None and os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true":
        errors.append("--ema_decay is not supported under FSDP (see hf_variants/training/ema.py): average checkpoints")
    args.eval_weights = args.eval_weights or ("ema" if args.ema_decay is not None else "raw")
    return errors


# The numeric flags and their valid ranges (checked at parse time, before any data work): (flags, lowest, lowest
# included, highest (excluded), what 0 means when 0 is allowed).
POSITIVE_INTS = (
    "max_length",
    "max_train_pairs",
    "max_valid_pairs",
    "max_test_pairs",
    "stream_buffer_rows",
    "preprocessing_num_workers",
    "vocab_size",
    "max_tokens",
    "max_sentences",
    "gradient_accumulation_steps",
    "max_steps",
    "num_threads",
    "ddp_timeout",
    "eval_batch_size",
    "logging_steps",
    "final_candidates",
)
NON_NEGATIVE = {
    "tokenizer_sample_lines": "all",
    "tokenizer_min_frequency": None,
    "warmup_steps": "no warmup",
    "eval_steps": "no periodic validation, only at the end",
    "save_steps": "checkpoints only at the end (and at the best validation)",
    "eval_bleu_pairs": "validation loss only",
    "num_examples": None,
    "keep_checkpoints": "keep all",
    "average_last": "no averaging",
    "weight_decay": None,
    "max_grad_norm": "no clipping",
    "adam_epsilon": None,
    "progress_interval": "every step",
    "patience": "never stop early",
    "min_delta": "any improvement counts",
    "keep_best": "only the best one",
    "ema_start_step": "from the first step",
}
FRACTIONS = ("dropout", "label_smoothing", "adam_beta1", "adam_beta2")  # in [0, 1)


def numeric_flag_errors(args) -> list[str]:
    """A message naming the flag for every numeric flag out of its range (or not finite)."""
    errors = []
    for name, value in sorted(vars(args).items()):
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(f"--{name} must be a finite number, got {value}")
    for name in POSITIVE_INTS:
        value = getattr(args, name)
        if value is not None and value < 1:
            errors.append(f"--{name} must be a positive integer, got {value}")
    for name, zero in NON_NEGATIVE.items():
        value = getattr(args, name)
        if value is not None and value < 0:
            errors.append(f"--{name} must be >= 0{f' (0: {zero})' if zero else ''}, got {value}")
    for name in FRACTIONS:
        value = getattr(args, name)
        if value is not None and not 0 <= value < 1:
            errors.append(f"--{name} must be in [0, 1), got {value}")
    if args.learning_rate <= 0:
        errors.append(f"--learning_rate must be positive, got {args.learning_rate}")
    if args.num_epochs is not None and args.num_epochs <= 0:
        errors.append(f"--num_epochs must be positive, got {args.num_epochs}")
    if not 1 <= args.requeue_exit_code <= 255:
        errors.append(f"--requeue_exit_code must be in 1..255 (an exit status), got {args.requeue_exit_code}")
    return errors
