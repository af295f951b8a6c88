#!/usr/bin/env python
"""Train any hf_variants model type on parallel text with Accelerate: one loop for every variant.

The defaults are the embedded main job: the bundled Multi30k en→de, the `small` preset of the baseline, a few
minutes on 2 CPU cores, ending with `runs/<name>/model` (loads with `from_pretrained`), BLEU/chrF on
test_2016_flickr and a few translations printed:

    accelerate launch training/train.py                 # or: python training/train.py
    accelerate launch training/train.py --model_type mute_nmt --preset small
    accelerate launch --multi_gpu --num_processes 2 training/train.py   # 2 CPU processes (gloo) without GPUs

Variants plug in through the model's interface only (no per-variant branches here): `prepare_translation_inputs`
builds every batch, `.loss` already holds the auxiliary losses that `.aux_losses` lists (logged separately), and
`after_optimizer_step()` runs after every optimizer step. `--model_type marian` trains transformers' MarianMTModel
through the same loop (training/external.py) for side-by-side comparisons. See training/README.md for every option.
"""

from __future__ import annotations

import argparse
import ast
import json
import logging
import math
import os
import re
import shutil
import sys
import time
from contextlib import nullcontext
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from training import checkpointing, corpus, data_pipeline, evaluation, external, run_lock, settings  # noqa: E402
from training.corpus import DataError, DropReport  # noqa: E402

logger = logging.getLogger("hf_variants.train")

DEFAULT_DATA_DIR = ROOT / "training" / "data" / "multi30k"


# ------------------------------------------------------------------------------------------------------ arguments
def str2bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "y", "on"):
        return True
    if value.lower() in ("0", "false", "no", "n", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def parse_overrides(spec: str | None) -> dict:
    """`"d_model=128,languages=['en','de'],normalize_before=true"` → dict (values parsed as JSON/Python
    literals, else kept as strings)."""
    if not spec:
        return {}
    out = {}
    for item in re.split(r",(?=\s*[A-Za-z_][A-Za-z0-9_]*\s*=)", spec):
        if "=" not in item:
            raise ValueError(f"--config_overrides: expected key=value, got {item!r}")
        key, value = (x.strip() for x in item.split("=", 1))
        lowered = value.lower()
        if lowered in ("true", "false"):
            out[key] = lowered == "true"
        elif lowered in ("none", "null"):
            out[key] = None
        else:
            try:
                out[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                out[key] = value
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--data_dir", default=str(DEFAULT_DATA_DIR),
                   help="folder of per-language text files {prefix}.{lang}[.gz] (multi-way parallel)")
    g.add_argument("--train_prefix", default="train")
    g.add_argument("--valid_prefix", default="val")
    g.add_argument("--test_prefix", default="test_2016_flickr", help="the final evaluation split ('' for none)")
    g.add_argument("--train_file", help="TSV (header = language codes) or JSONL ({'translation': {...}}) instead "
                                        "of --data_dir")
    g.add_argument("--valid_file", "--validation_file")
    g.add_argument("--test_file")
    g.add_argument("--dataset_name", help="a `datasets` dataset (Hub name or local path) with a 'translation' "
                                          "column, instead of --data_dir")
    g.add_argument("--dataset_config_name")
    g.add_argument("--train_split", default="train")
    g.add_argument("--valid_split", "--validation_split",
                   help="default: the dataset's 'validation' split, or 'valid', 'val' or 'dev' (none: no validation)")
    g.add_argument("--test_split", help="default: the dataset's 'test' split (none: the final evaluation uses the "
                                        "validation split)")
    g.add_argument("--source_lang", default="en")
    g.add_argument("--target_lang", default="de")
    g.add_argument("--languages", nargs="+", help="many-to-many run over these languages (overrides "
                                                   "--source_lang/--target_lang)")
    g.add_argument("--directions", help="comma-separated src-tgt pairs of a multilingual run (default: all)")
    g.add_argument("--bidirectional", action="store_true",
                   help="every batch trains source→target and target→source (Tied's dual training)")
    g.add_argument("--on_bad_pairs", choices=["skip", "error"], default="skip",
                   help="empty/missing/too-long pairs: skip and count them (reported in the log, results.json and "
                        "the model card), or stop with the file and line")
    g.add_argument("--source_annotations", nargs="+", default=[], metavar="NAME",
                   help="per-sentence inputs the model's prepare_translation_inputs takes for each source sentence, "
                        "e.g. 'parses' for the syntactic MG-SA: files <prefix>.<lang>.<NAME>[.gz] beside the text "
                        "files (one value a line), or a top-level {NAME: {lang: value}} in JSONL rows; 'parses' are "
                        "checked against their sentences when the data loads (see --on_bad_pairs)")
    g.add_argument("--max_length", type=int, default=128, help="longest sentence in tokens (longer: dropped)")
    g.add_argument("--max_train_pairs", "--max_train_samples", type=int,
                   help="use only the first N rows of the training data")
    g.add_argument("--max_valid_pairs", "--max_eval_samples", type=int, help="use only the first N validation rows")
    g.add_argument("--max_test_pairs", "--max_predict_samples", type=int, help="use only the first N test rows")
    g.add_argument("--data_cache_dir", help="the tokenized Arrow cache, shared by runs, relaunches and ranks "
                                            "(default: $HF_DATASETS_CACHE/hf_variants)")
    g.add_argument("--streaming", action="store_true",
                   help="read the training split as a stream (a datasets IterableDataset, tokenized on the fly in "
                        "buffers of --stream_buffer_rows rows, length-bucketed within each) instead of caching it: "
                        "for corpora larger than the disk cache should hold; needs --max_steps")
    g.add_argument("--stream_buffer_rows", type=int, default=100_000,
                   help="rows per streaming buffer (batches are length-bucketed and shuffled within a buffer)")
    g.add_argument("--preprocessing_num_workers", type=int,
                   help="processes tokenizing a split when its cache is built (default: the CPU cores available)")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer", "--tokenizer_name",
                   help="a saved tokenizer; default: train the shared one and save it with the run")
    g.add_argument("--tokenizer_model", choices=["bpe", "unigram"], default="bpe")
    g.add_argument("--vocab_size", type=int, default=8000)
    g.add_argument("--tokenizer_min_frequency", type=int, default=2)
    g.add_argument("--tokenizer_sample_lines", type=int, default=3_000_000,
                   help="train the tokenizer on at most this many sentences (all languages together): a "
                        "deterministic random sample of the training rows when the corpus has more (0: all)")

    g = p.add_argument_group("model")
    g.add_argument("--model_type", default="transformer_nmt")
    g.add_argument("--preset", default="small", help="a preset of the model's config (tiny, small, base, big)")
    g.add_argument("--config_overrides", help="key=value,... applied to the config")
    g.add_argument("--model_name_or_path", help="start from a saved model instead of a preset")
    g.add_argument("--dropout", type=float, help="default: the preset's")
    g.add_argument("--label_smoothing", "--label_smoothing_factor", type=float, default=0.1)
    g.add_argument("--target_language_tags", choices=["auto", "true", "false"], default="auto",
                   help="prepend <2xx> to sources; auto = when the run has more than one target language "
                        "(never for tied_nmt: its direction embedding is the signal)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--learning_rate", type=float, default=1e-3, help="peak learning rate (after warmup)")
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.98)
    g.add_argument("--adam_epsilon", type=float, default=1e-9)
    g.add_argument("--weight_decay", type=float, default=0.0)
    g.add_argument("--warmup_steps", type=int, default=50)
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (0: off)")
    g.add_argument("--max_tokens", type=int, default=2048, help="tokens per micro-batch and process, padding "
                                                                  "included (4096 in the papers' recipes)")
    g.add_argument("--max_sentences", type=int, help="sentences per micro-batch (cap)")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--max_steps", type=int, default=200, help="optimizer steps (ignored with --num_epochs)")
    g.add_argument("--num_epochs", "--num_train_epochs", type=float,
                   help="train for this many epochs instead of --max_steps")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"],
                   help="default: Accelerate's config / launch option")
    g.add_argument("--fp16", dest="mixed_precision", action="store_const", const="fp16",
                   help="--mixed_precision fp16")
    g.add_argument("--bf16", dest="mixed_precision", action="store_const", const="bf16",
                   help="--mixed_precision bf16")
    g.add_argument("--seed", type=int, default=1)
    g.add_argument("--num_threads", type=int, help="CPU threads per process (default on CPU: the cores available "
                                                   "divided by the processes on this machine; `accelerate launch` "
                                                   "would otherwise leave one)")
    g.add_argument("--cpu", action="store_true", help="train on CPU even when an accelerator is available (without "
                                                      "one, CPU and, under a multi-process launch, gloo are used)")
    g.add_argument("--ddp_timeout", type=int, default=10800,
                   help="seconds the other processes wait for the main one (e.g. while it builds the data cache "
                        "of a large corpus at the first launch)")

    g = p.add_argument_group("evaluation")
    g.add_argument("--eval_steps", type=int, default=100, help="validate every N steps (and at the end)")
    g.add_argument("--eval_bleu_pairs", type=int, default=200,
                   help="validation pairs translated for BLEU/chrF during training (0: loss only)")
    g.add_argument("--best_metric", choices=["bleu", "loss"], default="bleu")
    g.add_argument("--num_beams", "--generation_num_beams", type=int, default=4)
    g.add_argument("--length_penalty", type=float, default=0.6)
    g.add_argument("--max_len_a", type=float, default=1.2, help="max new tokens = a * source length + b")
    g.add_argument("--max_len_b", type=int, default=10)
    g.add_argument("--eval_batch_size", "--per_device_eval_batch_size", type=int, default=100,
                   help="sentences per translation batch and process")
    g.add_argument("--num_examples", type=int, default=5, help="test translations printed at the end")

    g = p.add_argument_group("checkpoints")
    g.add_argument("--save_steps", type=int, help="checkpoint every N steps (default: --eval_steps)")
    g.add_argument("--keep_checkpoints", "--save_total_limit", type=int, default=5,
                   help="newest checkpoints kept (plus the best; 0: all)")
    g.add_argument("--average_last", type=int, default=0,
                   help="final model = mean weights of the last K checkpoints (the papers' averaging)")
    g.add_argument("--final_model", choices=["best", "last"], default="best",
                   help="final model without --average_last: the best validated checkpoint or the last one")
    g.add_argument("--resume_from_checkpoint", help="a checkpoint folder, or 'latest' (the run's newest; starts "
                                                    "fresh when there is none)")
    g.add_argument("--allow_changed_settings", metavar="NAME[,NAME...]", nargs="+", action="extend",
                   help="resume even though these settings differ from the checkpoint's (e.g. learning_rate,seed): "
                        "the new values apply from the resumed step on and are recorded in results.json and the "
                        "model card. Without it a resume with changed settings is refused, except for settings "
                        "that do not change what is computed (max_steps, num_epochs, logging/eval/save cadence, "
                        "final test, output)")

    g = p.add_argument_group("output")
    g.add_argument("--output_dir", help="run folder (default: runs/<run_name> in the repository)")
    g.add_argument("--variant_name", help="a display name for the model card (default: the model family's name)")
    g.add_argument("--run_name", help="default: <model_type>-<directions>[-bi][-<preset> unless small]")
    g.add_argument("--overwrite_output_dir", action="store_true")
    g.add_argument("--logging_steps", type=int, default=25)
    g.add_argument("--report_to", nargs="+", default=["none"], metavar="TRACKER",
                   help="Accelerate trackers: none, all, or any of " + ", ".join(TRACKERS) + " (tensorboard logs in "
                        "<run>/logs; wandb: project $WANDB_PROJECT or 'hf_variants', run named after the run; "
                        "`pip install 'hf-variants[wandb]'`)")
    g.add_argument("--push_to_hub", action="store_true")
    g.add_argument("--hub_model_id", help="ORG/NAME")
    g.add_argument("--hub_token", help="default: HF_TOKEN / the cached login")
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
        raise ValueError(f"--report_to: unknown tracker(s) {unknown or ['none']} (with others); choose none, all or "
                         f"any of {', '.join(TRACKERS)}.")
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


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.report_to = parse_report_to(args.report_to) or ["none"]
        args.allow_changed_settings = sorted(settings.parse_allowed(
            args.allow_changed_settings, [a.dest for a in parser._actions if a.dest not in settings.NOT_STORED]
            + ["num_processes", "mixed_precision", "device"], settings.option_names(parser))) or None
    except ValueError as err:
        parser.error(str(err))
    if args.push_to_hub and not args.hub_model_id:
        parser.error("--push_to_hub needs --hub_model_id ORG/NAME")
    if args.push_to_hub and args.model_type in external.EXTERNAL_MODEL_TYPES:
        parser.error(f"--push_to_hub publishes hf_variants models (with their card); --model_type "
                     f"{args.model_type} is for comparisons only")
    sources = [bool(args.train_file), bool(args.dataset_name)]
    if sum(sources) > 1:
        parser.error("give either --train_file or --dataset_name (or neither, for --data_dir)")
    if args.gradient_accumulation_steps < 1 or args.max_tokens < 1:
        parser.error("--gradient_accumulation_steps and --max_tokens must be positive")
    if args.save_steps is None:
        args.save_steps = args.eval_steps
    if args.streaming and args.num_epochs:
        parser.error("--streaming reads a corpus of unknown length: give --max_steps, not --num_epochs")
    if args.stream_buffer_rows < 1:
        parser.error("--stream_buffer_rows must be positive")
    return args


# ----------------------------------------------------------------------------------------------------- the run
class TrainState:
    """Everything about the run's progress that a checkpoint must restore besides the model, optimizer and random
    states (saved as JSON in the checkpoint's trainer_state.json)."""

    def __init__(self):
        self.step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.train_tokens = 0
        self.train_time = 0.0
        self.wall_time = 0.0
        self.best_metric = None
        self.best_step = None
        self.evals: list[dict] = []
        # settings changed on a resume, in order: {"step", "setting", "from", "to", "free"}
        self.settings_changes: list[dict] = []
        # --streaming: the position after the last step ({"epoch", "buffer", "row", "step"}) and the stream's own
        # state (the first epoch's drop report, rows per epoch)
        self.stream: dict | None = None
        self.stream_state: dict | None = None

    def state_dict(self) -> dict:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict) -> None:
        self.__dict__.update(state)


def setup_logging(accelerator, run_dir: Path) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    handlers = [logging.StreamHandler(sys.stdout)]
    if accelerator.is_main_process:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=level,
                        handlers=handlers, force=True)
    for noisy in ("transformers", "datasets", "evaluate", "accelerate"):
        logging.getLogger(noisy).setLevel(logging.WARNING if accelerator.is_main_process else logging.ERROR)
    # Accelerate's safetensors save leaves out tied copies of the embeddings and says so at every checkpoint;
    # `checkpointing.load_model_weights` checks on load that only such tied copies are missing.
    logging.getLogger("accelerate.utils.other").addFilter(lambda record: "Removed shared tensor" not in
                                                          record.getMessage())


def resolve_languages(args) -> tuple[list[str], list[tuple[str, str]]]:
    if args.languages:
        languages = [corpus.check_language_code(x, "--languages") for x in args.languages]
        if len(set(languages)) != len(languages) or len(languages) < 2:
            raise DataError(f"--languages needs at least two distinct codes, got {languages}.")
        directions = corpus.parse_directions(args.directions, languages)
    else:
        s = corpus.check_language_code(args.source_lang, "--source_lang")
        t = corpus.check_language_code(args.target_lang, "--target_lang")
        if s == t:
            raise DataError("--source_lang and --target_lang are the same.")
        languages, directions = [s, t], [(s, t)]
    if args.bidirectional:
        reverse = [(t, s) for s, t in directions]
        if any(d in directions for d in reverse):
            raise DataError("--bidirectional trains both directions of each pair: list each pair once in "
                            "--directions (e.g. en-de, not en-de,de-en).")
    return languages, directions


def split_source(args, split: str, languages: list[str], hub_splits=None) -> data_pipeline.SplitSource | None:
    """Where one split comes from (the configured files, folder or `datasets` dataset); None when the split is not
    configured (or, for a `datasets` dataset, when it has no such split and none was named). `hub_splits`: the
    dataset's `DatasetDict`."""
    file_arg = getattr(args, f"{split}_file")
    if args.train_file or file_arg:
        if not file_arg:
            return None
        return data_pipeline.SplitSource.from_file(file_arg, args.source_annotations)
    if args.dataset_name:
        if args.source_annotations:
            raise DataError("--source_annotations are read from per-language files or JSONL, not from "
                            "--dataset_name.")
        if hub_splits is None:
            hub_splits = corpus.load_hub_splits(args.dataset_name, args.dataset_config_name)
        split_name = corpus.resolve_split(list(hub_splits), getattr(args, f"{split}_split"), split,
                                          args.dataset_name)
        if split_name is None:
            logger.info("%s has no %s split (splits: %s)", args.dataset_name, split, ", ".join(hub_splits))
            return None
        setattr(args, f"{split}_split", split_name)  # the split actually used (results.json, model card)
        return data_pipeline.SplitSource.from_hub(hub_splits[split_name], args.dataset_name, split_name,
                                                  args.dataset_config_name)
    prefix = getattr(args, f"{split}_prefix")
    if not prefix:
        return None
    return data_pipeline.SplitSource.from_dir(args.data_dir, prefix, languages, args.source_annotations)


def load_rows(args, split: str, languages: list[str], hub_splits=None) -> data_pipeline.Rows | None:
    """One split's rows (stage 1 of training/data_pipeline.py: read once, then memory-mapped from the cache),
    limited to the first --max_{split}_pairs rows."""
    source = split_source(args, split, languages, hub_splits)
    if source is None:
        return None
    limit = {"train": args.max_train_pairs, "valid": args.max_valid_pairs, "test": args.max_test_pairs}[split]
    rows = data_pipeline.load_rows(source, languages, args.source_annotations, args.data_cache_dir)
    return rows.head(limit)


def pair_directions(directions, bidirectional: bool) -> list[tuple[str, str]]:
    """Directions evaluated: with --bidirectional, each listed pair in both directions."""
    return directions + [(t, s) for s, t in directions] if bidirectional else list(directions)


def batch_texts(pairs: list[corpus.Pair], bidirectional: bool):
    """Sources, targets, target languages, the common source language (or None) and the variant inputs of a
    batch; with `bidirectional`, every pair also appears reversed."""
    src = [p.src for p in pairs]
    tgt = [p.tgt for p in pairs]
    tgt_langs = [p.tgt_lang for p in pairs]
    src_langs = [p.src_lang for p in pairs]
    extra = {name: [p.src_extra[name] for p in pairs] for name in (pairs[0].src_extra if pairs else {})}
    if bidirectional:
        src, tgt, tgt_langs, src_langs = src + tgt, tgt + src, tgt_langs + src_langs, src_langs + tgt_langs
        extra = {name: values + [p.tgt_extra[name] for p in pairs] for name, values in extra.items()}
    src_lang = src_langs[0] if len(set(src_langs)) == 1 else None
    return src, tgt, tgt_langs, src_lang, extra


def make_batch(model, tokenizer, pairs, bidirectional: bool, max_length: int) -> dict:
    src, tgt, tgt_langs, src_lang, extra = batch_texts(pairs, bidirectional)
    # length filtering already dropped longer pairs; the margin leaves room for a language tag
    return external.prepare_translation_inputs(model, tokenizer, src, src_lang=src_lang, tgt_lang=tgt_langs,
                                               text_target=tgt, max_length=max_length + 2, **extra)


def build_tokenizer(args, accelerator, run_dir: Path, train_rows, languages: list[str], resuming: bool = False):
    """The run's tokenizer: --tokenizer, the model's, the resumed run's, or a shared one trained (by the main
    process, which calls this first; the others then load what it saved) on the training text, or on a
    deterministic sample of it when it has more than --tokenizer_sample_lines sentences (`train_rows`: the cached
    rows, or with --streaming the split's source, whose first rows are the sample)."""
    from transformers import AutoTokenizer

    saved = run_dir / "tokenizer"
    if args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    elif (resuming or not accelerator.is_main_process) and (saved / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(saved)  # resumed run, or the main process trained it
    else:
        from hf_variants.tokenization import train_tokenizer

        if isinstance(train_rows, data_pipeline.SplitSource):
            texts, used, total = data_pipeline.stream_tokenizer_sample(train_rows, languages,
                                                                       args.tokenizer_sample_lines)
            label = train_rows.label
        else:
            texts, used, total = data_pipeline.tokenizer_sample(train_rows, languages, args.tokenizer_sample_lines)
            label = train_rows.meta["label"]
        if total is None:
            what = (f"the first {used:,} rows of the streamed {label} ({used * len(languages):,} sentences; "
                    f"--tokenizer_sample_lines {args.tokenizer_sample_lines})")
        elif used < total:
            what = (f"a deterministic sample of {used:,} of the {total:,} training rows of {label} "
                    f"({used * len(languages):,} sentences; --tokenizer_sample_lines {args.tokenizer_sample_lines})")
        else:
            what = f"all {total:,} training rows of {label} ({total * len(languages):,} sentences)"
        logger.info("Training a shared %s tokenizer (vocab %d) on %s [%s]", args.tokenizer_model, args.vocab_size,
                    what, ", ".join(languages))
        t0 = time.time()
        tmp = run_dir / ".tmp_tokenizer"
        shutil.rmtree(tmp, ignore_errors=True)
        train_tokenizer(texts, vocab_size=args.vocab_size, model=args.tokenizer_model, languages=languages,
                        min_frequency=args.tokenizer_min_frequency, output_dir=tmp)
        shutil.rmtree(saved, ignore_errors=True)  # left by an earlier attempt that never checkpointed
        os.replace(tmp, saved)
        logger.info("Tokenizer trained in %.1f s", time.time() - t0)
        tokenizer = AutoTokenizer.from_pretrained(saved)
    if accelerator.is_main_process and not (saved / "tokenizer.json").is_file():
        tokenizer.save_pretrained(saved)
    for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if getattr(tokenizer, name) is None:
            raise ValueError(f"The tokenizer has no {name.removesuffix('_id')}.")
    return tokenizer


def resolve_target_language_tags(args, num_target_languages: int) -> bool:
    """`--target_language_tags`; "auto" asks the model type (`default_target_language_tags`: tags when the run has
    several target languages, never for tied_nmt, whose direction embedding is the signal)."""
    if args.target_language_tags != "auto":
        return args.target_language_tags == "true"
    import hf_variants

    config_class = hf_variants.CONFIG_CLASSES.get(args.model_type)
    if config_class is None:  # --model_type marian and other comparisons
        return num_target_languages > 1
    return config_class.default_target_language_tags(num_target_languages)


def main_process_first(accelerator, build):
    """`build()` on the main process, then on the others (which then find its results in the cache and the run
    folder). An error on the main process is raised on every process, instead of leaving the others waiting."""
    if accelerator.num_processes == 1:
        return build()
    result, error = None, None
    if accelerator.is_main_process:
        try:
            result = build()
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other processes
            error = err
    accelerator.wait_for_everyone()
    failed = accelerator_broadcast(accelerator, None if error is None else f"{type(error).__name__}: {error}")
    if error is not None:
        raise error
    if failed is not None:
        raise DataError(f"The main process failed while preparing the data: {failed}")
    if not accelerator.is_main_process:
        result = build()
    accelerator.wait_for_everyone()
    return result


def prepare_data(args, accelerator, run_dir: Path, languages, directions, eval_directions, resuming: bool):
    """Rows, tokenizer, token counts and pairs of every split (training/data_pipeline.py), built on the first
    launch (main process first) and memory-mapped from the cache afterwards."""
    workers = args.preprocessing_num_workers or (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
                                                 else (os.cpu_count() or 1))
    hub_splits = corpus.load_hub_splits(args.dataset_name, args.dataset_config_name) if args.dataset_name else None
    stream_source = split_source(args, "train", languages, hub_splits) if args.streaming else None
    rows = {split: load_rows(args, split, languages, hub_splits) if split != "train" or not args.streaming else None
            for split in ("train", "valid", "test")}
    if rows["train"] is None and stream_source is None:
        raise DataError("No training data.")
    for split, r in rows.items():
        if r is not None:
            data_pipeline.check_languages(r, directions, args.source_annotations, args.bidirectional)
    tokenizer = build_tokenizer(args, accelerator, run_dir, stream_source or rows["train"], languages,
                                resuming=resuming)
    target_tags = resolve_target_language_tags(args, len({t for _, t in eval_directions}))
    checks = [(name, lang) for name in args.source_annotations
              for lang in dict.fromkeys(x for d in directions for x in (d if args.bidirectional else d[:1]))]
    tok_fp = data_pipeline.tokenizer_fingerprint(tokenizer)
    sets, reports = {}, {"train": DropReport("train"), "eval": DropReport("eval")}
    sets["stream"] = stream_source
    for split, r in rows.items():
        if r is None:
            sets[split] = None
            continue
        measured = data_pipeline.measure(r, tokenizer, languages, checks, args.data_cache_dir, workers, tok_fp)
        report = reports["train" if split == "train" else "eval"]
        pair_set = data_pipeline.build_pair_set(
            r, measured, directions, annotations=args.source_annotations, target_annotations=args.bidirectional,
            tag=int(target_tags), max_length=None if split == "test" else args.max_length,
            on_bad_pairs=args.on_bad_pairs, split=report.split, cache_dir=args.data_cache_dir,
            skip_absent=len(languages) > 2)
        for reason, count in pair_set.report.counts.items():
            report.counts[reason] += count
            where = report.locations.setdefault(reason, [])
            where.extend(pair_set.report.locations.get(reason, [])[:corpus.MAX_REPORTED_LOCATIONS - len(where)])
        sets[split] = pair_set
    return tokenizer, target_tags, sets, reports


def build_model(args, tokenizer, languages: list[str], target_tags: bool):
    import hf_variants  # registers every model type
    from hf_variants.configuration_transformer_nmt import apply_config_overrides
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    overrides = parse_overrides(args.config_overrides)
    fields = dict(label_smoothing=args.label_smoothing)
    if args.dropout is not None:
        fields["dropout"] = args.dropout
    if args.model_name_or_path:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        known = list(getattr(config, "languages", []) or [])
        missing = [lang for lang in languages if known and lang not in known]
        if missing:
            raise DataError(f"{args.model_name_or_path} does not know the languages {missing} (it has {known}).")
        # names checked and values validated as when building a config (`label_smoothing` is no Marian field)
        config = apply_config_overrides(config, {**{k: v for k, v in fields.items() if hasattr(config, k)},
                                                 **overrides})
        model = AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path, config=config)
        return model
    known = sorted(hf_variants.CONFIG_CLASSES) + list(external.EXTERNAL_MODEL_TYPES)
    if args.model_type not in known:
        raise ValueError(f"Unknown --model_type {args.model_type!r}; registered: {known}")
    fields.update(
        vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, decoder_start_token_id=tokenizer.bos_token_id,
        languages=list(languages), target_language_tags=target_tags,
    )
    fields.update(overrides)
    if args.model_type in external.EXTERNAL_MODEL_TYPES:  # e.g. transformers' MarianMTModel, for comparisons
        config = external.build_config(args.model_type, args.preset, fields)
    else:
        config = hf_variants.CONFIG_CLASSES[args.model_type].from_preset(args.preset, **fields)
    return AutoModelForSeq2SeqLM.from_config(config)


def apply_optimizer_settings(optimizer, scheduler, args) -> None:
    """Write this invocation's optimizer and schedule settings into the state restored from a checkpoint (which
    holds the saved ones): Adam's betas, epsilon and weight decay, the peak learning rate, and the current learning
    rate recomputed from the schedule (with the new warmup) at the restored step."""
    for group in optimizer.param_groups:
        group.update(betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                     weight_decay=args.weight_decay, initial_lr=args.learning_rate)
    scheduler.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def build_model_like(model):
    """A fresh (non-distributed) instance of `model`'s class and config, in float32 on CPU."""
    import copy

    config = copy.deepcopy(model.config)
    return type(model)._from_config(config) if hasattr(type(model), "_from_config") else type(model)(config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


def atomic_write_json(path: Path, data) -> None:
    checkpointing.atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def evaluate_pairs(accelerator, model, tokenizer, pairs: list[corpus.Pair], directions, bidirectional: bool,
                   args) -> dict | None:
    """Translate `pairs` (each evaluated direction) and score them: overall and per direction. Main process only
    gets the scores (others get None)."""
    rows = [((p.src_lang, p.tgt_lang), p.src, p.tgt, p.src_extra) for p in pairs]  # (direction, src, ref, extra)
    if bidirectional:
        rows += [((p.tgt_lang, p.src_lang), p.tgt, p.src, p.tgt_extra) for p in pairs]
    hyps_all: dict[int, str] = {}
    for direction in directions:
        idx = [i for i, r in enumerate(rows) if r[0] == direction]
        if not idx:
            continue
        hyps = evaluation.translate_distributed(
            accelerator, model, tokenizer, [rows[i][1] for i in idx], [direction[1]] * len(idx),
            src_lang=direction[0], batch_size=args.eval_batch_size, num_beams=args.num_beams,
            length_penalty=args.length_penalty, max_len_a=args.max_len_a, max_len_b=args.max_len_b,
            max_length=None,  # evaluation sources are never truncated
            variant_inputs={name: [rows[i][3][name] for i in idx] for name in args.source_annotations})
        if hyps is not None:
            hyps_all.update(zip(idx, hyps))
    if not accelerator.is_main_process:
        return None
    order = sorted(hyps_all)
    result = evaluation.score([hyps_all[i] for i in order], [rows[i][2] for i in order])
    result["per_direction"] = {}
    if len(directions) > 1:
        for direction in directions:
            idx = [i for i in order if rows[i][0] == direction]
            if idx:
                s = evaluation.score([hyps_all[i] for i in idx], [rows[i][2] for i in idx])
                result["per_direction"][f"{direction[0]}-{direction[1]}"] = {
                    "bleu": s["bleu"], "chrf": s["chrf"], "pairs": len(idx)}
    result["examples"] = [{"direction": f"{rows[i][0][0]}-{rows[i][0][1]}", "source": rows[i][1],
                           "reference": rows[i][2], "translation": hyps_all[i]} for i in order]
    return result


@torch.no_grad()
def validation_loss(accelerator, model, tokenizer, pairs, batches, bidirectional, max_length,
                    label_smoothing) -> float:
    """Token-weighted mean cross-entropy (label-smoothed, as trained, without the auxiliary losses) on `pairs`."""
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=accelerator.device)
    world = accelerator.num_processes
    # every process runs the same number of forwards (sharded models need them in lockstep); the padding repeats
    # a batch and is not counted
    padded = batches + batches[:(-len(batches)) % world] if batches else []
    loss_kwargs = external.loss_only_kwargs(model)
    for j in range(accelerator.process_index, len(padded), world):
        batch = make_batch(model, tokenizer, [pairs[i] for i in padded[j]], bidirectional, max_length)
        out = model(**batch, **loss_kwargs)
        if j >= len(batches):
            continue
        aux = sum(float(v) for v in (getattr(out, "aux_losses", None) or {}).values())
        loss = external.translation_loss(model, out, batch["labels"], label_smoothing)
        ntok = int((batch["labels"] != -100).sum())
        total += torch.tensor([(float(loss) - aux) * ntok, ntok], dtype=torch.float64, device=total.device)
    model.train(was_training)
    total = accelerator.reduce(total, "sum")
    return float(total[0] / total[1].clamp(min=1))


def main(argv=None) -> dict | None:
    held = []  # the run folder's lock, released however the run ends
    try:
        return _main(argv, held)
    finally:
        for lock in held:
            if lock is not None:
                lock.release()


def _main(argv, held: list) -> dict | None:
    args = parse_args(argv)
    import datetime

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs, set_seed
    from transformers import get_scheduler

    languages, directions = resolve_languages(args)
    eval_directions = pair_directions(directions, args.bidirectional)
    trackers = [t for t in args.report_to if t != "none"]
    dir_label = "_".join(f"{s}-{t}" for s, t in directions) if len(directions) <= 3 else "multi"
    preset_label = "" if args.preset == "small" or args.model_name_or_path else f"-{args.preset}"
    run_name = args.run_name or f"{args.model_type}-{dir_label}{'-bi' if args.bidirectional else ''}{preset_label}"
    run_dir = Path(args.output_dir) if args.output_dir else ROOT / "runs" / run_name
    checkpoint_dir = run_dir / "checkpoints"

    accelerator = Accelerator(
        # Without cpu=True, accelerate 1.15 leaves a multi-process launch on a machine without accelerators as
        # separate DistributedType.NO processes; with it, they form a MULTI_CPU (gloo) group.
        cpu=use_cpu(args),
        mixed_precision=args.mixed_precision,
        log_with=trackers or None,
        project_dir=str(run_dir / "logs"),
        step_scheduler_with_optimizer=False,  # the scheduler steps once per optimizer step, whatever the world size
        # the other processes wait for the main one while it builds the data cache (first launch on a new corpus)
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=args.ddp_timeout))],
    )
    found = {}

    def prepare_run_dir():  # the main process, holding the run folder's lock
        found["resume"] = resume = checkpointing.resolve_resume(args.resume_from_checkpoint, checkpoint_dir,
                                                                skipped=found.setdefault("damaged", []))
        if resume is None and any(p.name not in run_lock.LOCK_FILES for p in run_dir.iterdir()):
            if args.overwrite_output_dir:
                run_lock.clear_run_dir(run_dir)
            elif checkpointing.list_checkpoints(checkpoint_dir) or (run_dir / "results.json").exists():
                raise FileExistsError(f"{run_dir} holds an earlier run: pass --resume_from_checkpoint latest to "
                                      f"continue it or --overwrite_output_dir to start over.")

    # one run per folder (training/run_lock.py); every process stops when the main one does
    held.append(run_lock.lock_run(accelerator, run_dir, then=prepare_run_dir))
    resume = accelerator_broadcast(accelerator, found.get("resume"))
    setup_logging(accelerator, run_dir)
    for message in found.get("damaged", []):  # checkpoints `latest` skipped
        logger.warning(message)
    # the run's settings, stored in every checkpoint; a resume compares them before anything is loaded
    run_settings = settings.run_settings(args, num_processes=accelerator.num_processes,
                                         mixed_precision=str(accelerator.mixed_precision),
                                         device=accelerator.device.type)
    settings_changes = []
    if resume is not None:
        saved = checkpointing.check_resumable(resume)
        settings_changes = settings.resume_changes(saved.get("settings", {}), run_settings,
                                                   set(args.allow_changed_settings or ()), where=str(resume))
        for change in settings_changes:
            logger.log(logging.INFO if change["free"] else logging.WARNING, "Resuming %s with %s changed: %s -> %s%s",
                       resume.name, change["setting"], json.dumps(change["from"]), json.dumps(change["to"]),
                       "" if change["free"] else " (allowed by --allow_changed_settings; recorded)")
    if accelerator.device.type == "cpu":
        local_processes = int(os.environ.get("LOCAL_WORLD_SIZE") or accelerator.num_processes)
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(args.num_threads or max(1, cores // max(local_processes, 1)))
    logger.info("Run %s: %d process(es), %s, mixed precision %s, %d CPU threads per process", run_dir,
                accelerator.num_processes, accelerator.distributed_type, accelerator.mixed_precision,
                torch.get_num_threads())
    session_start = time.time()

    # ---------------------------------------------------------------------------------------------------- data
    t_data = time.time()
    tokenizer, target_tags, sets, reports = main_process_first(
        accelerator, lambda: prepare_data(args, accelerator, run_dir, languages, directions, eval_directions,
                                          resuming=resume is not None))
    train_set, train_report, eval_report = sets["train"], reports["train"], reports["eval"]
    # seeded after the data: building a cache or finding it must not change the random states of the run
    set_seed(args.seed)
    valid_pairs = sets["valid"].to_pairs() if sets["valid"] is not None else []
    test_pairs = sets["test"].to_pairs() if sets["test"] is not None else []
    per_item = 2 if args.bidirectional else 1
    stream = None
    if args.streaming:
        stream = data_pipeline.StreamingPairs(
            sets["stream"], languages, directions, tokenizer, annotations=args.source_annotations,
            target_annotations=args.bidirectional, tag=int(target_tags), max_length=args.max_length,
            on_bad_pairs=args.on_bad_pairs, buffer_rows=args.stream_buffer_rows, max_tokens=args.max_tokens,
            max_sentences=args.max_sentences, seed=args.seed, examples_per_item=per_item,
            num_processes=accelerator.num_processes, accumulation_steps=args.gradient_accumulation_steps,
            skip_absent=len(languages) > 2)
        train_report = stream.report
        logger.info("Data: %s streamed in buffers of %d rows (%s), %d validation, %d test; %s (ready in %.1f s)",
                    sets["stream"].label, args.stream_buffer_rows,
                    ", ".join(f"{s}-{t}" for s, t in directions) + (" both ways" if args.bidirectional else ""),
                    len(valid_pairs), len(test_pairs), eval_report.summary(), time.time() - t_data)
    else:
        if not len(train_set):
            raise DataError(f"No training pairs left ({train_report.summary()}).")
        logger.info("Data: %d training pairs (%s), %d validation, %d test; %s; %s (ready in %.1f s)", len(train_set),
                    ", ".join(f"{s}-{t}" for s, t in directions) + (" both ways" if args.bidirectional else ""),
                    len(valid_pairs), len(test_pairs), train_report.summary(), eval_report.summary(),
                    time.time() - t_data)
    if train_set is not None and len(directions) > 1 and train_set.pairs_per_direction:
        logger.info("Training pairs per direction: %s", ", ".join(
            f"{d} {n:,}" for d, n in train_set.pairs_per_direction.items()))
    sampler = None
    if train_set is not None:
        sampler = corpus.TokenBatchSampler(train_set.src_len, train_set.tgt_len, args.max_tokens,
                                           args.max_sentences, seed=args.seed, shuffle=True,
                                           examples_per_item=per_item)
        if accelerator.num_processes > 1:  # one copy of each epoch's batches, computed by each node's main process
            # (the local one: a run folder on a node's own disk works too; on a shared one they write the same files)
            sampler = corpus.SharedEpochs(sampler, run_dir / "epoch_batches", accelerator.is_local_main_process,
                                          timeout=args.ddp_timeout)
    valid_set = sets["valid"]
    valid_batches = corpus.TokenBatchSampler(
        valid_set.src_len if valid_set is not None else [], valid_set.tgt_len if valid_set is not None else [],
        args.max_tokens, args.max_sentences, shuffle=False, examples_per_item=per_item).batches(0)
    steps_per_epoch = None
    if sampler is not None:
        steps_per_epoch = len(corpus.StepPlan(sampler.epoch(0), accelerator.num_processes,
                                              args.gradient_accumulation_steps))
        max_steps = math.ceil(args.num_epochs * steps_per_epoch) if args.num_epochs else args.max_steps
        logger.info("%d optimizer steps (%d per epoch: %d micro-batches of <= %d tokens x %d processes x %d "
                    "accumulation)", max_steps, steps_per_epoch, len(sampler.epoch(0)), args.max_tokens,
                    accelerator.num_processes, args.gradient_accumulation_steps)
    else:
        max_steps = args.max_steps
        logger.info("%d optimizer steps of micro-batches of <= %d tokens x %d processes x %d accumulation",
                    max_steps, args.max_tokens, accelerator.num_processes, args.gradient_accumulation_steps)

    # --------------------------------------------------------------------------------------------------- model
    model = build_model(args, tokenizer, languages, target_tags)
    required = dict(getattr(model.config, "required_source_annotations", None) or {})
    missing = {name: hint for name, hint in required.items() if name not in args.source_annotations}
    if missing:
        name, hint = next(iter(missing.items()))
        raise DataError(f"{model.config.model_type} with this config reads the source annotation {name!r} of every "
                        f"sentence: pass --source_annotations {' '.join(missing)} (files <prefix>.<lang>.{name}[.gz] "
                        f"beside the text files, one a line, or a top-level {{\"{name}\": {{lang: value}}}} in JSONL "
                        f"rows), {hint}.")
    params = count_parameters(model)
    logger.info("Model %s (%s preset): %.2fM parameters", model.config.model_type, args.preset, params / 1e6)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                 eps=args.adam_epsilon, weight_decay=args.weight_decay)
    scheduler = get_scheduler("inverse_sqrt", optimizer, num_warmup_steps=args.warmup_steps)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = TrainState()
    unwrapped = accelerator.unwrap_model(model)
    loss_kwargs = external.loss_only_kwargs(unwrapped)

    if resume is not None:
        changed = {c["setting"] for c in settings_changes}
        saved_state = checkpointing.load_checkpoint(accelerator, resume, missing_rng_ok="num_processes" in changed)
        try:
            state.load_state_dict(saved_state["train_state"])
            scheduler.load_state_dict(saved_state["scheduler"])
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise checkpointing.CheckpointError(
                f"{resume / checkpointing.TRAINER_STATE} is malformed ({type(err).__name__}: {err}).") from None
        if changed & settings.OPTIMIZER_SETTINGS:
            apply_optimizer_settings(optimizer, scheduler, args)
        state.settings_changes += [{"step": state.step, **c} for c in settings_changes]
        logger.info("Resumed from %s: step %d, epoch %d (+%d steps)", resume, state.step, state.epoch,
                    state.step_in_epoch)
    elif args.resume_from_checkpoint:
        logger.info("No checkpoint to resume from in %s: starting from scratch", checkpoint_dir)

    hyperparameters = {k: v for k, v in vars(args).items() if k not in ("hub_token", "allow_changed_settings")}
    hyperparameters.update(max_steps=max_steps, steps_per_epoch=steps_per_epoch,
                           num_processes=accelerator.num_processes, target_language_tags=target_tags,
                           languages=languages, directions=[f"{s}-{t}" for s, t in directions])
    if trackers:
        project, init_kwargs = tracker_init_kwargs(trackers, run_name, run_dir)
        accelerator.init_trackers(project, config={k: v for k, v in hyperparameters.items()
                                                   if isinstance(v, (int, float, str, bool))},
                                  init_kwargs=init_kwargs)
    log_path = run_dir / "log.jsonl"
    if accelerator.is_main_process and log_path.exists():  # drop entries past the resumed step
        kept = [line for line in log_path.read_text().splitlines() if line and json.loads(line)["step"] <= state.step]
        log_path.write_text("".join(line + "\n" for line in kept))

    def log(record: dict) -> None:
        if accelerator.is_main_process:
            with open(log_path, "a") as f:
                f.write(json.dumps(record) + "\n")
        if trackers:
            accelerator.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def save(step: int) -> None:
        state.wall_time = wall_time_base + time.time() - session_start
        checkpointing.save_checkpoint(
            accelerator, checkpoint_dir, step,
            {"epoch": state.epoch, "best_step": state.best_step, "settings": run_settings},
            {"train_state": state.state_dict(), "scheduler": scheduler.state_dict()})
        if accelerator.is_main_process:
            keep = max(args.keep_checkpoints, args.average_last)
            protect = {state.best_step} if state.best_step is not None else set()
            checkpointing.rotate_checkpoints(checkpoint_dir, keep, protect)
        accelerator.wait_for_everyone()

    def run_eval(step: int) -> bool:
        """Validation loss and BLEU/chrF; returns True when this step is the best so far."""
        if not valid_pairs:
            return False
        record = {"step": step, "valid_loss": validation_loss(accelerator, unwrapped, tokenizer, valid_pairs,
                                                              valid_batches, args.bidirectional, args.max_length,
                                                              args.label_smoothing)}
        if args.eval_bleu_pairs:
            scores = evaluate_pairs(accelerator, unwrapped, tokenizer, valid_pairs[:args.eval_bleu_pairs],
                                    eval_directions, args.bidirectional, args)
            if scores is not None:
                record.update(valid_bleu=scores["bleu"], valid_chrf=scores["chrf"])
        record = accelerator_broadcast(accelerator, record)
        # higher is better; BLEU ties (e.g. 0 early on) are broken by the validation loss
        value = [record.get("valid_bleu", 0.0) if args.best_metric == "bleu" else 0.0, -record["valid_loss"]]
        best = state.best_metric is None or value > list(state.best_metric)
        if best:
            state.best_metric, state.best_step = value, step
        state.evals.append(record)
        log(record)
        logger.info("step %d: %s%s", step, ", ".join(f"{k} {v:.4g}" for k, v in record.items() if k != "step"),
                    " (best)" if best else "")
        return best

    # ------------------------------------------------------------------------------------------------ training
    wall_time_base = state.wall_time
    model.train()
    from tqdm.auto import tqdm

    progress = tqdm(total=max_steps, initial=state.step, disable=not accelerator.is_main_process,
                    desc="training", dynamic_ncols=True, mininterval=1.0)
    window = {"loss": 0.0, "tokens": 0, "ntok": 0, "time": 0.0, "aux": {}}
    rank, acc = accelerator.process_index, args.gradient_accumulation_steps
    if stream is not None and state.stream_state is not None:
        stream.load_state_dict(state.stream_state)  # the first epoch's drop report so far

    def epoch_progress() -> float:
        if stream is None:
            return state.epoch + state.step_in_epoch / max(steps_per_epoch, 1)
        rows = stream.rows_per_epoch
        return state.epoch + ((state.stream or {}).get("row", 0) / rows if rows else 0.0)

    while state.step < max_steps:
        # the epoch's optimizer steps from the current position: (micro-batches, the stream position after it)
        if stream is not None:
            epoch_steps = stream.steps(state.stream or {"epoch": state.epoch, "buffer": 0, "row": 0, "step": 0})
        else:
            plan = corpus.StepPlan(sampler.epoch(state.epoch), accelerator.num_processes, acc)
            if isinstance(sampler, corpus.SharedEpochs):
                # epochs before the previous one: every process opened them before the collectives of the previous
                # epoch's steps (the previous epoch itself may have had no step left, after a resume at its end)
                sampler.forget_before(state.epoch - 1)
            epoch_steps = ((plan[i], None) for i in range(state.step_in_epoch, len(plan)))
        while state.step < max_steps:
            t0 = time.time()
            step_batches, position = next(epoch_steps, (None, None))
            if step_batches is None:  # the end of the epoch
                state.epoch += 1
                state.step_in_epoch = 0
                state.stream = None
                break
            micro = step_batches[rank * acc:(rank + 1) * acc]
            batches = [make_batch(unwrapped, tokenizer, b if stream is not None else train_set.pairs(b),
                                  args.bidirectional, args.max_length) for b in micro]
            # Token counts, losses and throughput stay on the device: no host sync in the step (the only ones are
            # at logging and evaluation steps), so a GPU can run ahead of Python.
            ntoks = [(b["labels"] != -100).sum() for b in batches]
            local_ntok = torch.stack(ntoks).sum()
            local_tokens = local_ntok + sum(b["attention_mask"].sum() for b in batches)
            total_ntok = accelerator.reduce(local_ntok.clone(), "sum")
            step_loss = torch.zeros((), dtype=torch.float64, device=accelerator.device)
            step_aux: dict[str, torch.Tensor] = {}
            for i, (batch, ntok) in enumerate(zip(batches, ntoks)):
                # token-weighted over the global batch: sum(loss_i * ntok_i) / total tokens, with DDP's gradient
                # mean over processes undone by the world-size factor
                weight = ntok * accelerator.num_processes / total_ntok
                sync = accelerator.no_sync(model) if i < len(batches) - 1 else nullcontext()
                with sync:
                    out = model(**batch, **loss_kwargs)  # hf_variants: no logits, see external.loss_only_kwargs
                    loss = external.translation_loss(unwrapped, out, batch["labels"], args.label_smoothing)
                    aux = getattr(out, "aux_losses", None) or {}
                    del out  # other models' logits ([tokens, vocabulary]): the loss's backward does not need them
                    accelerator.backward(loss * weight)
                step_loss += loss.detach().double() * ntok
                for name, value in aux.items():
                    step_aux[name] = step_aux.get(name, 0.0) + value.detach().double() * ntok
            grad_norm = None
            if args.max_grad_norm > 0:
                grad_norm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            external.after_optimizer_step(unwrapped)
            state.step += 1
            state.step_in_epoch += 1
            if stream is not None:
                state.stream, state.stream_state = position, stream.state_dict()
            dt = time.time() - t0
            state.train_time += dt
            window["loss"] = window["loss"] + step_loss
            window["ntok"] = window["ntok"] + local_ntok
            window["tokens"] = window["tokens"] + local_tokens
            window["time"] += dt
            for name, value in step_aux.items():
                window["aux"][name] = window["aux"].get(name, 0.0) + value
            lr = scheduler.get_last_lr()[0]
            progress.update(1)
            last = state.step == max_steps
            evaluating = state.step % args.eval_steps == 0 or last
            if state.step % args.logging_steps == 0 or last or evaluating or state.step % args.save_steps == 0:
                # one reduce of the window's device sums (and the host sync) per logging step; also before every
                # evaluation and checkpoint, so the saved token count is exact
                sums = accelerator.reduce(torch.stack([torch.as_tensor(v, device=accelerator.device).double() for v in
                                                       [window["loss"], window["ntok"], window["tokens"],
                                                        *window["aux"].values()]]), "sum").tolist()
                state.train_tokens += int(sums[2])
                record = {"step": state.step, "epoch": epoch_progress(),
                          "loss": float(sums[0] / sums[1]), "lr": lr,
                          "tokens_per_sec": sums[2] / max(window["time"], 1e-9)}
                for j, name in enumerate(window["aux"]):
                    record[f"aux/{name}"] = float(sums[3 + j] / sums[1])
                if grad_norm is not None:
                    record["grad_norm"] = float(grad_norm)
                log(record)
                progress.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_sec']:.0f}",
                                     lr=f"{lr:.2e}", refresh=False)
                window = {"loss": 0.0, "tokens": 0, "ntok": 0, "time": 0.0, "aux": {}}
            is_best = False
            if evaluating:
                is_best = run_eval(state.step)
            if state.step % args.save_steps == 0 or last or is_best:
                save(state.step)
    progress.close()
    accelerator.wait_for_everyone()
    if isinstance(sampler, corpus.SharedEpochs) and accelerator.is_local_main_process:
        shutil.rmtree(sampler.directory, ignore_errors=True)

    # --------------------------------------------------------------------------------------------- final model
    # The final model is built from checkpoint weights (the last step is always checkpointed), as a plain module on
    # every process: the same code path for DDP, FSDP (full state dict checkpoints) and single-process runs.
    checkpoints = checkpointing.list_checkpoints(checkpoint_dir)
    if args.average_last and args.average_last > 1:
        chosen = [p for _, p in checkpoints[-args.average_last:]]
        if len(chosen) < args.average_last:
            logger.warning("--average_last %d: only %d checkpoints exist; averaging those", args.average_last,
                           len(chosen))
        weights = checkpointing.average_checkpoints(chosen)
        final_source = f"average of {', '.join(p.name for p in chosen)}"
    elif args.final_model == "best" and state.best_step is not None:
        weights = checkpointing.load_weights(checkpoint_dir / f"step_{state.best_step}")
        final_source = f"best validated checkpoint step_{state.best_step}"
    else:
        weights = checkpointing.load_weights(checkpoint_dir / f"step_{state.step}")
        final_source = f"last step {state.step}"
    logger.info("Final model: %s", final_source)
    final_model = build_model_like(unwrapped)
    checkpointing.load_model_weights(final_model, weights)
    final_model.to(accelerator.device).eval()

    eval_split, eval_pairs = "test", test_pairs
    if not eval_pairs:
        eval_split, eval_pairs = "valid", valid_pairs
    scores = None
    if eval_pairs:
        scores = evaluate_pairs(accelerator, final_model, tokenizer, eval_pairs, eval_directions, args.bidirectional,
                                args)
    wall_time = wall_time_base + time.time() - session_start

    results = None
    if accelerator.is_main_process:
        model_dir = run_dir / "model"
        split_label = {"test": args.test_file or args.test_prefix or args.test_split,
                       "valid": args.valid_file or args.valid_prefix or args.valid_split}[eval_split]
        if args.dataset_name:
            split_label = {"test": args.test_split, "valid": args.valid_split}[eval_split]
        dataset = (args.dataset_name or args.train_file or Path(args.data_dir).name)
        results = {
            "model_type": final_model.config.model_type,
            "variant": args.variant_name,  # the card falls back to the model family's name
            "preset": None if args.model_name_or_path else args.preset,
            "source_lang": directions[0][0] if len(directions) == 1 else None,
            "target_lang": directions[0][1] if len(directions) == 1 else None,
            "languages": languages,
            "directions": [f"{s}-{t}" for s, t in eval_directions],
            "bidirectional": args.bidirectional,
            "dataset": dataset,
            "eval_split": str(split_label),
            "eval_pairs": len(eval_pairs),
            "bleu": scores["bleu"] if scores else None,
            "chrf": scores["chrf"] if scores else None,
            "sacrebleu_signature": scores["sacrebleu_signature"] if scores else None,
            "chrf_signature": scores["chrf_signature"] if scores else None,
            "params": params,
            "train_tokens_per_sec": state.train_tokens / max(state.train_time, 1e-9),
            "wall_time_sec": wall_time,
            "train_time_sec": state.train_time,
            "train_pairs": len(train_set) if stream is None else stream.kept_pairs,
            "dropped_pairs": train_report.total,
            "dropped_reasons": dict(sorted(train_report.counts.items())),
            "dropped_examples": train_report.to_dict()["examples"],
            "eval_dropped_pairs": eval_report.total,
            "eval_dropped_reasons": dict(sorted(eval_report.counts.items())),
            "steps": state.step,
            "epochs": round(epoch_progress(), 3),
            "final_model": final_source,
            "best_step": state.best_step,
            "validation": state.evals,
            "hyperparameters": hyperparameters,
            "base_model": args.model_name_or_path,
            "per_direction": scores["per_direction"] if scores and scores["per_direction"] else None,
            "num_processes": accelerator.num_processes,
            # settings changed on resumes ({"step", "setting", "from", "to", "free"}): "hyperparameters" holds
            # the values of the last part of the run
            "settings_changes": state.settings_changes,
        }
        # the model folder, complete with its card, replaces the previous one in one rename
        tmp = run_dir / ".tmp_model"
        shutil.rmtree(tmp, ignore_errors=True)
        # the decoding the run evaluated with (the papers': beam 4, length penalty 0.6) becomes the model's default
        final_model.generation_config.num_beams = args.num_beams
        if args.num_beams > 1:  # a length penalty only applies to beam search
            final_model.generation_config.length_penalty = args.length_penalty
        final_model.save_pretrained(tmp)
        tokenizer.model_max_length = final_model.config.max_position_embeddings  # the model's limit, saved with it
        tokenizer.save_pretrained(tmp)
        write_model_card(tmp, results, args.hub_model_id)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        os.replace(tmp, model_dir)
        if scores:
            (run_dir / f"translations.{eval_split}.txt").write_text(
                "".join(e["translation"] + "\n" for e in scores["examples"]), encoding="utf-8")
        atomic_write_json(run_dir / "results.json", results)
        print(f"\n{'=' * 80}\n{final_model.config.model_type} on {dataset} "
              f"({', '.join(results['directions'])}), {state.step} steps, {wall_time / 60:.1f} min")
        if scores:
            print(f"{eval_split} ({split_label}, {len(eval_pairs)} pairs): BLEU {scores['bleu']:.2f}  "
                  f"chrF {scores['chrf']:.2f}\n  {scores['sacrebleu_signature']}\n  {scores['chrf_signature']}")
            for e in scores["examples"][:args.num_examples]:
                print(f"\n[{e['direction']}] SRC: {e['source']}\n         REF: {e['reference']}\n"
                      f"         HYP: {e['translation']}")
        print(f"\nTrain pairs {results['train_pairs']}, dropped {train_report.total} "
              f"{dict(train_report.counts) if train_report.total else ''}; "
              f"{results['train_tokens_per_sec']:.0f} tokens/s")
        print(f"Model: {model_dir}  (AutoModelForSeq2SeqLM.from_pretrained after `import hf_variants`)\n"
              f"Results: {run_dir / 'results.json'}\n{'=' * 80}")
        if args.push_to_hub:
            push(run_dir, args)
    if trackers:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    return results


def use_cpu(args) -> bool:
    """CPU when asked (`--cpu`, `accelerate launch --cpu`) or when no accelerator device exists."""
    from accelerate.utils import is_mlu_available, is_mps_available, is_npu_available, is_xpu_available

    if args.cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    return not (torch.cuda.is_available() or is_mps_available() or is_xpu_available() or is_npu_available()
                or is_mlu_available())


def accelerator_broadcast(accelerator, obj):
    """The main process's `obj` on every process."""
    if accelerator.num_processes == 1:
        return obj
    from accelerate.utils import broadcast_object_list

    box = [obj if accelerator.is_main_process else None]
    broadcast_object_list(box, from_process=0)
    return box[0]


def write_model_card(model_dir: Path, results: dict, repo_id: str | None) -> None:
    """The model card (model_cards.card) as `model_dir/README.md`, so the saved model carries it however it is
    uploaded later (`hf upload`, `push_to_hub`). Models from outside hf_variants (`--model_type marian`) have no
    card template: none is written. A failure is logged, never fatal: the trained model is saved regardless."""
    from model_cards.card import FAMILIES, build_model_card

    if results["model_type"] not in FAMILIES:
        logger.info("No model card for %s (not an hf_variants model type)", results["model_type"])
        return
    try:
        build_model_card(model_dir, results, repo_id=repo_id).save(model_dir / "README.md")
    except Exception:  # noqa: BLE001 - reported, and `python -m model_cards.card RUN_DIR` rewrites it
        logger.exception("Could not write the model card into %s/README.md (rerun `python -m model_cards.card "
                         "RUN_DIR` once fixed)", model_dir)


def push(run_dir: Path, args) -> None:
    """Upload of run_dir/model with its card (model_cards.publish; the card is rebuilt from results.json with the
    repository id)."""
    from model_cards.publish import push_to_hub

    url = push_to_hub(run_dir / "model", args.hub_model_id, token=args.hub_token)
    logger.info("Pushed to %s", url)


if __name__ == "__main__":
    main()
