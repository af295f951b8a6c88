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
through the same loop (hf_variants/training/external.py) for side-by-side comparisons. See training/README.md for
every option.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import math
import os
import shutil
import sys
import time
from pathlib import Path

import torch  # noqa: E402

from model_cards.run_record import RunRecord  # noqa: E402

from ..outputs import (  # noqa: E402
    OutputPathError,
    check_clearable_dir,
    check_not_an_input,
    claim_output_dir,
    relation,
)
from ..sizing import ModelTooLargeError, check_fits  # noqa: E402
from . import (  # noqa: E402
    averaging,
    checkpointing,
    corpora,
    corpus,
    data_pipeline,
    external,
    final_choice,
    flag_checks,
    progress,
    run_lock,
    settings,
    threads,
)
from .corpus import DataError, DropReport  # noqa: E402
from .data_fingerprint import check_resume as check_resume_data  # noqa: E402
from .early_stopping import summary as early_stopping_summary  # noqa: E402
from .fast_step import adam, compile_body  # noqa: E402
from .hub_preflight import preflight, push_trained_model  # noqa: E402
from .options import (  # noqa: E402,F401 (the command line; re-exported for callers of train)
    CHECKOUT,
    DEFAULT_DATA_DIR,
    FRACTIONS,
    NON_NEGATIVE,
    POSITIVE_INTS,
    RUNS_DIR,
    TRACKERS,
    add_checkpoints_args,
    add_data_args,
    add_evaluation_args,
    add_model_args,
    add_optimisation_args,
    add_output_args,
    add_tokenizer_args,
    build_parser,
    numeric_flag_errors,
    parse_args,
    parse_overrides,
    parse_report_to,
    str2bool,
    tracker_init_kwargs,
)
from .trainer import (  # noqa: E402,F401 (batch helpers re-exported)
    EXIT_NONFINITE,
    MODEL_CONFIG_DIR,
    Job,
    RunContext,
    RunData,
    StopRequested,
    Trainer,
    TrainingStopped,
    TrainState,
    accelerator_broadcast,
    batch_texts,
    evaluate_pairs,
    make_batch,
    validation_loss,
)

logger = logging.getLogger("hf_variants.train")

# The splits of `train_on_datasets` ({"train", "valid", "test": datasets.Dataset or None}) while it runs; None for
# the command line (kept out of `args`, whose values are the run's settings and go into checkpoints as JSON).
IN_MEMORY_SPLITS: contextvars.ContextVar[dict | None] = contextvars.ContextVar("IN_MEMORY_SPLITS", default=None)


# ----------------------------------------------------------------------------------------------------- the run
def setup_logging(accelerator, run_dir: Path) -> None:
    level = logging.INFO if accelerator.is_main_process else logging.WARNING
    handlers = [logging.StreamHandler(sys.stdout)]
    if accelerator.is_main_process:
        handlers.append(logging.FileHandler(run_dir / "train.log"))
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=level, handlers=handlers, force=True
    )
    # libraries' INFO records are not the run's log (httpx logs every HTTP request of a --push_to_hub upload)
    for noisy in ("transformers", "datasets", "evaluate", "accelerate", "huggingface_hub", "httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING if accelerator.is_main_process else logging.ERROR)
    # Accelerate's safetensors save leaves out tied copies of the embeddings and says so at every checkpoint;
    # `checkpointing.load_model_weights` checks on load that only such tied copies are missing.
    logging.getLogger("accelerate.utils.other").addFilter(
        lambda record: "Removed shared tensor" not in record.getMessage()
    )


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
            raise DataError(
                "--bidirectional trains both directions of each pair: list each pair once in "
                "--directions (e.g. en-de, not en-de,de-en)."
            )
    return languages, directions


def split_source(args, split: str, languages: list[str], hub_splits=None) -> data_pipeline.SplitSource | None:
    """Where one split comes from (the configured files, folder or `datasets` dataset); None when the split is not
    configured (or, for a `datasets` dataset, when it has no such split and none was named). `hub_splits`: the
    dataset's `DatasetDict`."""
    file_arg = getattr(args, f"{split}_file")
    in_memory = IN_MEMORY_SPLITS.get()
    columns = None
    if args.source_column is not None:
        columns = {args.source_lang: args.source_column, args.target_lang: args.target_column}
    if columns and in_memory is None and not args.dataset_name:
        raise DataError("--source_column/--target_column name the text columns of a --dataset_name dataset.")
    if in_memory is not None:  # train_on_datasets
        if in_memory.get(split) is None:
            return None
        return data_pipeline.SplitSource.from_hub(in_memory[split], args.dataset_name, split, columns=columns)
    if args.train_file or args.corpora or file_arg:
        if not file_arg:
            return None
        return data_pipeline.SplitSource.from_file(file_arg, args.source_annotations)
    if args.dataset_name:
        if args.source_annotations:
            raise DataError("--source_annotations are read from per-language files or JSONL, not from --dataset_name.")
        if hub_splits is None:
            hub_splits = corpus.load_hub_splits(args.dataset_name, args.dataset_config_name)
        split_name = corpus.resolve_split(list(hub_splits), getattr(args, f"{split}_split"), split, args.dataset_name)
        if split_name is None:
            logger.info("%s has no %s split (splits: %s)", args.dataset_name, split, ", ".join(hub_splits))
            return None
        setattr(args, f"{split}_split", split_name)  # the split actually used (results.json, model card)
        return data_pipeline.SplitSource.from_hub(
            hub_splits[split_name], args.dataset_name, split_name, args.dataset_config_name, columns=columns
        )
    prefix = getattr(args, f"{split}_prefix")
    if not prefix:
        return None
    return data_pipeline.SplitSource.from_dir(args.data_dir, prefix, languages, args.source_annotations)


def load_rows(args, split: str, languages: list[str], hub_splits=None) -> data_pipeline.Rows | None:
    """One split's rows (stage 1 of hf_variants/training/data_pipeline.py: read once, then memory-mapped from the
    cache), limited to the first --max_{split}_pairs rows; several training corpora: `corpora.CorpusRows`."""
    if split == "train" and args.corpora:
        return corpora.load_corpus_rows(args, languages)
    source = split_source(args, split, languages, hub_splits)
    if source is None:
        return None
    limit = {"train": args.max_train_pairs, "valid": args.max_valid_pairs, "test": args.max_test_pairs}[split]
    rows = data_pipeline.load_rows(source, languages, args.source_annotations, args.data_cache_dir)
    return rows.head(limit)


def pair_directions(directions, bidirectional: bool) -> list[tuple[str, str]]:
    """Directions evaluated: with --bidirectional, each listed pair in both directions."""
    return directions + [(t, s) for s, t in directions] if bidirectional else list(directions)


def resumed_tokenizer(args, resume: Path, saved: Path):
    """The tokenizer of the checkpoint `resume` (saved with it, or its run's: `checkpointing.checkpoint_tokenizer`),
    never a newly trained one, into the run folder or a new one. Its fingerprint must be the one the checkpoint
    recorded, and --tokenizer / --model_name_or_path and a tokenizer already in the run folder (`saved`) must be the
    same tokenizer: else a `SettingsChangedError` naming both folders."""
    from transformers import AutoTokenizer

    folder, recorded = checkpointing.checkpoint_tokenizer(resume)
    given = args.tokenizer or args.model_name_or_path
    flag = "--tokenizer" if args.tokenizer else "--model_name_or_path"
    if folder is None and not given:
        raise settings.SettingsChangedError(
            f"{resume} has no tokenizer saved with it and its run folder has none "
            f"({resume.parent.parent / checkpointing.TOKENIZER_DIR}): a resume never trains a new one. Pass the "
            f"tokenizer the run was trained with (--tokenizer)."
        )
    source = folder or Path(given)
    tokenizer = AutoTokenizer.from_pretrained(source)
    fingerprint = data_pipeline.tokenizer_fingerprint(tokenizer)
    if recorded is not None and fingerprint != recorded:
        raise settings.SettingsChangedError(
            f"The tokenizer in {source} is not the one {resume} was trained with (its fingerprint differs from the "
            f"one recorded in {resume / checkpointing.MARKER}): it was replaced or damaged."
        )
    others = [(Path(given), flag)] if given and folder is not None else []
    if (saved / "tokenizer.json").is_file() or (saved / "tokenizer_config.json").is_file():
        others.append((saved, "the run folder's tokenizer"))
    for other, what in others:
        if other.resolve() == source.resolve():
            continue
        made = corpora.with_tags(AutoTokenizer.from_pretrained(other), args)  # with the run's --corpus_tags
        if data_pipeline.tokenizer_fingerprint(made) != fingerprint:
            raise settings.SettingsChangedError(
                f"The tokenizer changed: {resume} was trained with the tokenizer in {source}, and {what} ({other}) "
                f"is another one (other token ids). A run's tokenizer never changes: resume with the checkpoint's "
                f"tokenizer (into a run folder without another one), or start a new run."
            )
    logger.info("Resuming with the tokenizer of %s (%s)", resume.name, source)
    return tokenizer


def build_tokenizer(args, accelerator, run_dir: Path, train_rows, languages: list[str], resuming: Path | None = None):
    """The run's tokenizer: --tokenizer, the model's, the resumed run's, or a shared one trained (by the main
    process, which calls this first; the others then load what it saved) on the training text, or on a
    deterministic sample of it when it has more than --tokenizer_sample_lines sentences (`train_rows`: the cached
    rows, or with --streaming the split's source, whose first rows are the sample)."""
    from transformers import AutoTokenizer

    saved = run_dir / "tokenizer"
    if resuming:  # the checkpoint's tokenizer, never a new one
        tokenizer = resumed_tokenizer(args, Path(resuming), saved)
    elif args.tokenizer:
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    elif args.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    elif (resuming or not accelerator.is_main_process) and (saved / "tokenizer.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(saved)  # resumed run, or the main process trained it
    else:
        from ..tokenization import train_tokenizer

        if isinstance(train_rows, data_pipeline.SplitSource):
            texts, used, total = data_pipeline.stream_tokenizer_sample(
                train_rows, languages, args.tokenizer_sample_lines
            )
            label = train_rows.label
        else:
            texts, used, total = data_pipeline.tokenizer_sample(train_rows, languages, args.tokenizer_sample_lines)
            label = train_rows.meta["label"]
        if total is None:
            what = (
                f"the first {used:,} rows of the streamed {label} ({used * len(languages):,} sentences; "
                f"--tokenizer_sample_lines {args.tokenizer_sample_lines})"
            )
        elif used < total:
            what = (
                f"a deterministic sample of {used:,} of the {total:,} training rows of {label} "
                f"({used * len(languages):,} sentences; --tokenizer_sample_lines {args.tokenizer_sample_lines})"
            )
        else:
            what = f"all {total:,} training rows of {label} ({total * len(languages):,} sentences)"
        logger.info(
            "Training a shared %s tokenizer (vocab %d) on %s [%s]",
            args.tokenizer_model,
            args.vocab_size,
            what,
            ", ".join(languages),
        )
        t0 = time.time()
        tmp = run_dir / ".tmp_tokenizer"
        shutil.rmtree(tmp, ignore_errors=True)
        train_tokenizer(
            texts,
            vocab_size=args.vocab_size,
            model=args.tokenizer_model,
            languages=languages,
            min_frequency=args.tokenizer_min_frequency,
            output_dir=tmp,
        )
        shutil.rmtree(saved, ignore_errors=True)  # left by an earlier attempt that never checkpointed
        os.replace(tmp, saved)
        logger.info("Tokenizer trained in %.1f s", time.time() - t0)
        tokenizer = AutoTokenizer.from_pretrained(saved)
    # the corpora's tags (--corpus_tags) are special tokens of the run's tokenizer
    if (
        corpora.add_tags(tokenizer, args, resuming) or not (saved / "tokenizer.json").is_file()
    ) and accelerator.is_main_process:
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
    from ..model_classes import CONFIG_CLASSES

    config_class = CONFIG_CLASSES.get(args.model_type)
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


def prepare_data(args, accelerator, run_dir: Path, languages, directions, eval_directions, resuming: Path | None):
    """Rows, tokenizer, token counts and pairs of every split (hf_variants/training/data_pipeline.py), built on the
    first launch (main process first) and memory-mapped from the cache afterwards. `resuming`: the checkpoint to
    resume, whose tokenizer the run keeps."""
    workers = args.preprocessing_num_workers or (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    hub_splits = None
    if args.dataset_name and IN_MEMORY_SPLITS.get() is None:
        hub_splits = corpus.load_hub_splits(args.dataset_name, args.dataset_config_name)
    stream_source = split_source(args, "train", languages, hub_splits) if args.streaming else None
    rows = {
        split: load_rows(args, split, languages, hub_splits) if split != "train" or not args.streaming else None
        for split in ("train", "valid", "test")
    }
    if rows["train"] is None and stream_source is None:
        raise DataError("No training data.")
    for split, r in rows.items():
        if r is not None:
            data_pipeline.check_languages(r, directions, args.source_annotations, args.bidirectional)
    tokenizer = build_tokenizer(args, accelerator, run_dir, stream_source or rows["train"], languages, resuming)
    corpora.check_tags_in_text(tokenizer, args, rows)  # a tag is no word of any sentence
    target_tags = resolve_target_language_tags(args, len({t for _, t in eval_directions}))
    checks = [
        (name, lang)
        for name in args.source_annotations
        for lang in dict.fromkeys(x for d in directions for x in (d if args.bidirectional else d[:1]))
    ]
    tok_fp = data_pipeline.tokenizer_fingerprint(tokenizer)
    sets, reports = {}, {"train": DropReport("train"), "eval": DropReport("eval")}
    sets["stream"] = stream_source
    for split, r in rows.items():
        if r is None:
            sets[split] = None
            continue
        report = reports["train" if split == "train" else "eval"]
        pair_set = corpora.pair_set(
            r,
            lambda rows, extra_tokens: data_pipeline.build_pair_set(
                rows,
                data_pipeline.measure(rows, tokenizer, languages, checks, args.data_cache_dir, workers, tok_fp),
                directions,
                annotations=args.source_annotations,
                target_annotations=args.bidirectional,
                tag=int(target_tags) + extra_tokens,
                max_length=None if split == "test" else args.max_length,
                on_bad_pairs=args.on_bad_pairs,
                split=report.split,
                cache_dir=args.data_cache_dir,
                skip_absent=len(languages) > 2,
            ),
            tokenizer,
        )
        for reason, count in pair_set.report.counts.items():
            report.counts[reason] += count
            where = report.locations.setdefault(reason, [])
            where.extend(pair_set.report.locations.get(reason, [])[: corpus.MAX_REPORTED_LOCATIONS - len(where)])
        sets[split] = pair_set
    return tokenizer, target_tags, sets, reports


def build_model(args, tokenizer, languages: list[str], target_tags: bool, directions: list[tuple[str, str]] = ()):
    """The run's model; its config records the run's label smoothing and its source and target languages (from the
    run's `directions`: a model with one target translates without `tgt_lang`, and refuses other languages)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM

    from ..configuration_transformer_nmt import apply_config_overrides
    from ..model_classes import CONFIG_CLASSES

    overrides = parse_overrides(args.config_overrides)
    fields = dict(label_smoothing=args.label_smoothing)
    if directions:
        fields["source_languages"] = list(dict.fromkeys(s for s, _ in directions))
        fields["target_languages"] = list(dict.fromkeys(t for _, t in directions))
    if args.dropout is not None:
        fields["dropout"] = args.dropout
    if args.model_name_or_path:
        config = AutoConfig.from_pretrained(args.model_name_or_path)
        known = list(getattr(config, "languages", []) or [])
        missing = [lang for lang in languages if known and lang not in known]
        if missing:
            raise DataError(f"{args.model_name_or_path} does not know the languages {missing} (it has {known}).")
        # names checked and values validated as when building a config (`label_smoothing` is no Marian field)
        for name in ("source_languages", "target_languages"):  # a model without a language list (bilingual)
            if not set(fields.get(name, [])) <= set(getattr(config, "languages", None) or []):
                fields.pop(name)
        with flag_checks.config_values():
            config = apply_config_overrides(
                config, {**{k: v for k, v in fields.items() if hasattr(config, k)}, **overrides}
            )
        check_model_fits(config, args)
        return AutoModelForSeq2SeqLM.from_pretrained(args.model_name_or_path, config=config)
    fields.update(
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        decoder_start_token_id=tokenizer.bos_token_id,
        languages=list(languages),
        target_language_tags=target_tags,
    )
    fields.update(overrides)
    with flag_checks.config_values():  # type, preset and override names were checked at parse time
        if args.model_type in external.EXTERNAL_MODEL_TYPES:  # e.g. transformers' MarianMTModel, for comparisons
            config = external.build_config(args.model_type, args.preset, fields)
        else:
            config = CONFIG_CLASSES[args.model_type].from_preset(args.preset, **fields)
    check_model_fits(config, args)
    return AutoModelForSeq2SeqLM.from_config(config)


def check_model_fits(config, args) -> None:
    """Before the model is built: its weights, gradients, Adam moments and a batch's activations (`--max_tokens`),
    estimated from the config (`hf_variants.sizing`), must fit the available memory, unless
    `--allow_large_model`; a `DataError` naming the fields otherwise."""
    if getattr(args, "allow_large_model", False):
        return
    try:
        check_fits(config, training=True, tokens=args.max_tokens, override_flag="--allow_large_model")
    except ModelTooLargeError as error:
        raise DataError(str(error)) from None


def check_run_inputs(args, run_dir: Path) -> None:
    """Before anything is written: the run folder is not, and does not lie inside, any input (data files and
    folders, the starting model, the tokenizer, a checkpoint to resume), and holds none of them (the run's own
    checkpoints excepted); a `DataError` naming both flags otherwise."""
    inputs = {
        "--data_dir": args.data_dir if not (args.train_file or args.corpora or args.dataset_name) else None,
        "--train_file": args.train_file or corpora.input_paths(args),
        "--valid_file": args.valid_file,
        "--test_file": args.test_file,
        "--dataset_name": args.dataset_name,
        "--model_name_or_path": args.model_name_or_path,
        "--tokenizer": getattr(args, "tokenizer", None),
    }
    try:
        check_not_an_input(run_dir, inputs)
        resume = args.resume_from_checkpoint
        if resume and resume != "latest" and os.path.lexists(resume):
            # the run's own checkpoints lie inside the run folder; the run folder inside a checkpoint does not
            found = relation(run_dir, resume)
            if found in ("is", "lies inside"):
                raise OutputPathError(
                    f"--output_dir {str(run_dir)!r} {found} --resume_from_checkpoint {resume!r}: the run would "
                    "write into the checkpoint it reads. Choose another --output_dir."
                )
    except OutputPathError as error:
        raise DataError(str(error)) from None


def apply_optimizer_settings(optimizer, scheduler, args) -> None:
    """Write this invocation's optimizer and schedule settings into the state restored from a checkpoint (which
    holds the saved ones): Adam's betas, epsilon and weight decay, the peak learning rate, and the current learning
    rate recomputed from the schedule (with the new warmup) at the restored step."""
    for group in optimizer.param_groups:
        group.update(
            betas=(args.adam_beta1, args.adam_beta2),
            eps=args.adam_epsilon,
            weight_decay=args.weight_decay,
            initial_lr=args.learning_rate,
        )
    scheduler.base_lrs = [args.learning_rate for _ in optimizer.param_groups]
    for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * factor(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


def atomic_write_json(path: Path, data) -> None:
    checkpointing.atomic_write(path, json.dumps(data, indent=2, ensure_ascii=False, default=str) + "\n")


def use_cpu(args) -> bool:
    """CPU when asked (`--cpu`, `accelerate launch --cpu`) or when no accelerator device exists."""
    from accelerate.utils import is_mlu_available, is_mps_available, is_npu_available, is_xpu_available

    if args.cpu or os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes"):
        return True
    return not (
        torch.cuda.is_available()
        or is_mps_available()
        or is_xpu_available()
        or is_npu_available()
        or is_mlu_available()
    )


def write_model_card(model_dir: Path, results: RunRecord, repo_id: str | None) -> None:
    """The model card (model_cards.card) as `model_dir/README.md`, so the saved model carries it however it is
    uploaded later (`hf upload`, `push_to_hub`). Models from outside hf_variants (`--model_type marian`) have no
    card template: none is written. A failure is logged, never fatal: the trained model is saved regardless."""
    from model_cards.card import FAMILIES, build_model_card

    if results.model_type not in FAMILIES:
        logger.info("No model card for %s (not an hf_variants model type)", results.model_type)
        return
    try:
        build_model_card(model_dir, results, repo_id=repo_id).save(model_dir / "README.md")
    except Exception:  # noqa: BLE001 - reported, and `python -m model_cards.card RUN_DIR` rewrites it
        logger.exception(
            "Could not write the model card into %s/README.md (rerun `python -m model_cards.card RUN_DIR` once fixed)",
            model_dir,
        )


# ------------------------------------------------------------------------------------------------------ stages
def run_name_for(args, directions) -> str:
    """--run_name, or <model_type>-<directions>[-bi][-<preset> unless small]."""
    dir_label = "_".join(f"{s}-{t}" for s, t in directions) if len(directions) <= 3 else "multi"
    preset_label = "" if args.preset == "small" or args.model_name_or_path else f"-{args.preset}"
    return args.run_name or f"{args.model_type}-{dir_label}{'-bi' if args.bidirectional else ''}{preset_label}"


def prepare_run_dir(accelerator, run_dir: Path, args) -> tuple[Path | None, list[str], run_lock.RunLock | None]:
    """Lock the run folder (hf_variants/training/run_lock.py: one run per folder), resolve the checkpoint to resume
    and refuse an earlier run in the folder unless resumed or overwritten, on the main process; every process stops
    when it refuses. Returns the checkpoint to resume, the warnings about damaged checkpoints `latest` skipped
    (logged once logging is set up) and the lock (None on the other processes)."""
    found = {"skipped": []}

    def prepare():  # the main process, holding the lock
        found["resume"] = resume = checkpointing.resolve_resume(
            args.resume_from_checkpoint, run_dir / "checkpoints", skipped=found["skipped"]
        )
        if resume is None and any(p.name not in run_lock.LOCK_FILES for p in run_dir.iterdir()):
            if args.overwrite_output_dir:  # only a run folder train wrote; it says what it deletes
                deleted = check_clearable_dir(
                    run_dir, command="train", flag="--overwrite_output_dir", keep=run_lock.LOCK_FILES
                )
                print(f"--overwrite_output_dir: deleting {run_dir}: {', '.join(deleted)}", file=sys.stderr)
                run_lock.clear_run_dir(run_dir)
            elif checkpointing.list_checkpoints(run_dir / "checkpoints") or (run_dir / "results.json").exists():
                raise DataError(
                    f"{run_dir} holds an earlier run: pass --overwrite_output_dir to start over, another "
                    f"--output_dir for a new run, or --resume_from_checkpoint latest to continue it (with a larger "
                    f"--max_steps or --num_epochs when it finished)."
                )
        if not any(p.name not in run_lock.LOCK_FILES for p in run_dir.iterdir()):  # a new (or cleared) run folder
            claim_output_dir(run_dir, "train")  # which --overwrite_output_dir may clear later

    lock = run_lock.lock_run(accelerator, run_dir, then=prepare)
    return accelerator_broadcast(accelerator, found.get("resume")), found["skipped"], lock


def resume_settings_changes(args, resume: Path | None, run_settings: dict) -> list[dict]:
    """The settings this invocation changes against the checkpoint to resume (refused unless allowed)."""
    if resume is None:
        return []
    saved = checkpointing.check_resumable(resume)
    changes = settings.resume_changes(
        saved.get("settings", {}), run_settings, set(args.allow_changed_settings or ()), where=str(resume)
    )
    for change in changes:
        logger.log(
            logging.INFO if change["free"] else logging.WARNING,
            "Resuming %s with %s changed: %s -> %s%s",
            resume.name,
            change["setting"],
            json.dumps(change["from"]),
            json.dumps(change["to"]),
            "" if change["free"] else " (allowed by --allow_changed_settings; recorded)",
        )
    return changes


def set_cpu_threads(args, accelerator, resume: Path | None = None) -> threads.ThreadChoice | None:
    """On CPU: the threads per process of this launch (hf_variants/training/threads.py: --num_threads, else
    --threads_from_load's load-fitted count, else the count recorded in the checkpoint `resume`, else the user's
    OMP_NUM_THREADS or the cores per process; not on a resume with another number of processes), set in torch and
    logged when it is worth a line. None on an accelerator."""
    if accelerator.device.type != "cpu":
        return None
    saved = checkpointing.checkpoint_info(resume).get("settings") if resume else None
    recorded = threads.recorded_threads(saved)
    if saved and saved.get("num_processes") not in (None, accelerator.num_processes):
        recorded = None  # resumed on another number of processes (allowed): this launch's share of the cores
    choice = threads.choose(
        args.num_threads,
        args.threads_from_load,
        recorded,
        cores=threads.available_cores(),
        local_processes=int(os.environ.get("LOCAL_WORLD_SIZE") or accelerator.num_processes),
        env=os.environ,
        load=threads.load_average() if args.threads_from_load else None,
    )
    torch.set_num_threads(choice.threads)
    if choice.note:
        logger.info(choice.note)
    return choice


def setup_run(args) -> RunContext:
    """Stage 1: languages and directions, the Accelerator, the run folder, logging, the checkpoint to resume and
    the settings it changes (checked before anything is loaded)."""
    import datetime

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    languages, directions = resolve_languages(args)
    trackers = [t for t in args.report_to if t != "none"]
    run_name = run_name_for(args, directions)
    run_dir = Path(args.output_dir) if args.output_dir else RUNS_DIR / run_name
    check_run_inputs(args, run_dir)  # before anything is written
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
    resume, skipped, lock = prepare_run_dir(accelerator, run_dir, args)
    try:
        setup_logging(accelerator, run_dir)
        for message in skipped:  # damaged checkpoints `latest` passed over
            logger.warning(message)
        cpu_threads = set_cpu_threads(args, accelerator, resume)
        # the run's settings, stored in every checkpoint; a resume compares them before anything is loaded
        run_settings = settings.run_settings(
            args,
            num_processes=accelerator.num_processes,
            mixed_precision=str(accelerator.mixed_precision),
            device=accelerator.device.type,
            cpu_threads=cpu_threads.threads if cpu_threads else None,
        )
        settings_changes = resume_settings_changes(args, resume, run_settings) + check_resume_data(
            args, accelerator, resume, run_settings, languages, split_source, IN_MEMORY_SPLITS.get() is not None
        )
    except BaseException:  # a refused resume: the run folder is free again
        if lock is not None:
            lock.release()
        raise
    logger.info(
        "Run %s: %d process(es), %s, mixed precision %s, %d CPU threads per process%s",
        run_dir,
        accelerator.num_processes,
        accelerator.distributed_type,
        accelerator.mixed_precision,
        torch.get_num_threads(),
        f" ({cpu_threads.reason})" if cpu_threads else "",
    )
    return RunContext(
        args=args,
        accelerator=accelerator,
        run_name=run_name,
        run_dir=run_dir,
        languages=languages,
        directions=directions,
        eval_directions=pair_directions(directions, args.bidirectional),
        trackers=trackers,
        resume=resume,
        run_settings=run_settings,
        settings_changes=settings_changes,
        session_start=time.time(),
        lock=lock,
    )


def direction_label(directions, bidirectional: bool) -> str:
    return ", ".join(f"{s}-{t}" for s, t in directions) + (" both ways" if bidirectional else "")


def build_stream(run: RunContext, sets: dict, tokenizer, target_tags: bool):
    """--streaming: the training split read as a stream, tokenized and length-bucketed in buffers."""
    args, accelerator = run.args, run.accelerator
    return data_pipeline.StreamingPairs(
        sets["stream"],
        run.languages,
        run.directions,
        tokenizer,
        annotations=args.source_annotations,
        target_annotations=args.bidirectional,
        tag=int(target_tags),
        max_length=args.max_length,
        on_bad_pairs=args.on_bad_pairs,
        buffer_rows=args.stream_buffer_rows,
        max_tokens=args.max_tokens,
        max_sentences=args.max_sentences,
        seed=args.seed,
        examples_per_item=2 if args.bidirectional else 1,
        num_processes=accelerator.num_processes,
        accumulation_steps=args.gradient_accumulation_steps,
        skip_absent=len(run.languages) > 2,
    )


def build_sampler(run: RunContext, train_set):
    """The token-batch sampler of the cached training pairs (one copy of each epoch's batches per node in a
    multi-process run)."""
    args, accelerator = run.args, run.accelerator
    sampler = corpora.token_batch_sampler(  # several corpora: weighted (hf_variants/training/corpora.py)
        train_set,
        args.max_tokens,
        args.max_sentences,
        seed=args.seed,
        shuffle=True,
        examples_per_item=2 if args.bidirectional else 1,
    )
    if accelerator.num_processes > 1:  # one copy of each epoch's batches, computed by each node's main process
        # (the local one: a run folder on a node's own disk works too; on a shared one they write the same files)
        sampler = corpus.SharedEpochs(
            sampler, run.run_dir / "epoch_batches", accelerator.is_local_main_process, timeout=args.ddp_timeout
        )
    return sampler


def count_steps(run: RunContext, sampler) -> tuple[int | None, int]:
    """(optimizer steps per epoch or None for a stream, the run's optimizer steps), logged."""
    args, accelerator = run.args, run.accelerator
    if sampler is None:
        logger.info(
            "%d optimizer steps of micro-batches of <= %d tokens x %d processes x %d accumulation",
            args.max_steps,
            args.max_tokens,
            accelerator.num_processes,
            args.gradient_accumulation_steps,
        )
        return None, args.max_steps
    steps_per_epoch = len(
        corpus.StepPlan(sampler.epoch(0), accelerator.num_processes, args.gradient_accumulation_steps)
    )
    max_steps = math.ceil(args.num_epochs * steps_per_epoch) if args.num_epochs else args.max_steps
    logger.info(
        "%d optimizer steps (%d per epoch: %d micro-batches of <= %d tokens x %d processes x %d accumulation)",
        max_steps,
        steps_per_epoch,
        len(sampler.epoch(0)),
        args.max_tokens,
        accelerator.num_processes,
        args.gradient_accumulation_steps,
    )
    return steps_per_epoch, max_steps


def load_data(run: RunContext) -> RunData:
    """Stage 2: rows, tokenizer and pairs of every split (built by the main process first, memory-mapped from the
    cache afterwards), the training batches and the run's length in optimizer steps. Seeds the run afterwards."""
    from accelerate.utils import set_seed

    args, accelerator = run.args, run.accelerator
    t_data = time.time()
    tokenizer, target_tags, sets, reports = main_process_first(
        accelerator,
        lambda: prepare_data(
            args,
            accelerator,
            run.run_dir,
            run.languages,
            run.directions,
            run.eval_directions,
            resuming=run.resume,
        ),
    )
    train_set, train_report, eval_report = sets["train"], reports["train"], reports["eval"]
    # seeded after the data: building a cache or finding it must not change the random states of the run
    set_seed(args.seed)
    valid_pairs = sets["valid"].to_pairs() if sets["valid"] is not None else []
    test_pairs = sets["test"].to_pairs() if sets["test"] is not None else []
    stream = build_stream(run, sets, tokenizer, target_tags) if args.streaming else None
    label = direction_label(run.directions, args.bidirectional)
    if stream is not None:
        train_report = stream.report
        logger.info(
            "Data: %s streamed in buffers of %d rows (%s), %d validation, %d test; %s (ready in %.1f s)",
            sets["stream"].label,
            args.stream_buffer_rows,
            label,
            len(valid_pairs),
            len(test_pairs),
            eval_report.summary(),
            time.time() - t_data,
        )
    else:
        if not len(train_set):
            raise DataError(f"No training pairs left ({train_report.summary()}).")
        logger.info(
            "Data: %d training pairs (%s), %d validation, %d test; %s; %s (ready in %.1f s)",
            len(train_set),
            label,
            len(valid_pairs),
            len(test_pairs),
            train_report.summary(),
            eval_report.summary(),
            time.time() - t_data,
        )
    if train_set is not None and len(run.directions) > 1 and train_set.pairs_per_direction:
        logger.info(
            "Training pairs per direction: %s",
            ", ".join(f"{d} {n:,}" for d, n in train_set.pairs_per_direction.items()),
        )
    sampler = build_sampler(run, train_set) if train_set is not None else None
    valid_set = sets["valid"]
    valid_batches = corpus.TokenBatchSampler(
        valid_set.src_len if valid_set is not None else [],
        valid_set.tgt_len if valid_set is not None else [],
        args.max_tokens,
        args.max_sentences,
        shuffle=False,
        examples_per_item=2 if args.bidirectional else 1,
    ).batches(0)
    steps_per_epoch, max_steps = count_steps(run, sampler)
    return RunData(
        tokenizer=tokenizer,
        target_tags=target_tags,
        train_set=train_set,
        stream=stream,
        sampler=sampler,
        valid_pairs=valid_pairs,
        valid_batches=valid_batches,
        test_pairs=test_pairs,
        train_report=train_report,
        eval_report=eval_report,
        steps_per_epoch=steps_per_epoch,
        max_steps=max_steps,
    )


def check_source_annotations(model, args) -> None:
    """A model that reads per-sentence source annotations (e.g. the syntactic MG-SA's parses) needs them passed."""
    required = dict(getattr(model.config, "required_source_annotations", None) or {})
    missing = {name: hint for name, hint in required.items() if name not in args.source_annotations}
    if missing:
        name, hint = next(iter(missing.items()))
        raise DataError(
            f"{model.config.model_type} with this config reads the source annotation {name!r} of every "
            f"sentence: pass --source_annotations {' '.join(missing)} (files <prefix>.<lang>.{name}[.gz] "
            f'beside the text files, one a line, or a top-level {{"{name}": {{lang: value}}}} in JSONL '
            f"rows), {hint}."
        )


def resume_job(run: RunContext, job: Job) -> None:
    """Load the checkpoint to resume into the prepared job: model, optimizer, random states, progress and the
    scheduler; settings allowed to change take their new values."""
    args, resume = run.args, run.resume
    changed = {c["setting"] for c in run.settings_changes}
    saved_state = checkpointing.load_checkpoint(run.accelerator, resume, missing_rng_ok="num_processes" in changed)
    try:
        job.state.load_state_dict(saved_state["train_state"])
        job.scheduler.load_state_dict(saved_state["scheduler"])
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        raise checkpointing.CheckpointError(
            f"{resume / checkpointing.TRAINER_STATE} is malformed ({type(err).__name__}: {err})."
        ) from None
    if changed & settings.OPTIMIZER_SETTINGS:
        apply_optimizer_settings(job.optimizer, job.scheduler, args)
    job.state.settings_changes += [{"step": job.state.step, **c} for c in run.settings_changes]
    logger.info(
        "Resumed from %s: step %d, epoch %d (+%d steps)",
        resume,
        job.state.step,
        job.state.epoch,
        job.state.step_in_epoch,
    )


def generation_defaults(generation_config, args):
    """The decoding the run evaluates with (the papers': beam 4, length penalty 0.6, and its length rule
    `--max_len_a`/`--max_len_b`), as the model's default: the pipeline, generate() and the translate command then
    decode as evaluation did."""
    generation_config.num_beams = args.num_beams
    if args.num_beams > 1:  # a length penalty only applies to beam search
        generation_config.length_penalty = args.length_penalty
    from ..inference.translator import saved_length_rule

    cap = saved_length_rule(generation_config)[2]
    generation_config.length_rule = {"max_len_a": args.max_len_a, "max_len_b": args.max_len_b, "max_new_tokens": cap}
    return generation_config


def save_model_config(run_dir: Path, model, args) -> None:
    """run_dir/model_config (config.json, generation_config.json), written when the run starts: with the run's
    tokenizer/ it lets `translate.py --model RUN/checkpoints/step_N` load a checkpoint of a run still training."""
    import copy

    target = run_dir / MODEL_CONFIG_DIR
    tmp = run_dir / f".tmp_{MODEL_CONFIG_DIR}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.config.save_pretrained(tmp)
    generation_defaults(copy.deepcopy(model.generation_config), args).save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def build_job(run: RunContext, data: RunData) -> Job:
    """Stage 3: model, optimizer and schedule, prepared by the Accelerator; the checkpoint to resume loaded into
    them; the trackers started with the run's hyperparameters."""
    from transformers import get_scheduler

    args, accelerator = run.args, run.accelerator
    model = build_model(args, data.tokenizer, run.languages, data.target_tags, list(run.eval_directions))
    check_source_annotations(model, args)
    params = count_parameters(model)
    logger.info("Model %s (%s preset): %.2fM parameters", model.config.model_type, args.preset, params / 1e6)
    # fused on CUDA (fast_step.adam); --compile: the model body compiled for the training step
    optimizer = adam(
        model.parameters(),
        accelerator.device,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
    )
    scheduler = get_scheduler("inverse_sqrt", optimizer, num_warmup_steps=args.warmup_steps)
    if args.compile:
        compile_body(model)
    model, optimizer = accelerator.prepare(model, optimizer)
    job = Job(
        model=model,
        unwrapped=accelerator.unwrap_model(model),
        optimizer=optimizer,
        scheduler=scheduler,
        state=TrainState(),
        params=params,
    )
    if accelerator.is_main_process:
        save_model_config(run.run_dir, job.unwrapped, args)
    if run.resume is not None:
        resume_job(run, job)
    elif args.resume_from_checkpoint:
        logger.info("No checkpoint to resume from in %s: starting from scratch", run.checkpoint_dir)
    job.hyperparameters = {k: v for k, v in vars(args).items() if k not in ("hub_token", "allow_changed_settings")}
    job.hyperparameters.update(
        max_steps=data.max_steps,
        steps_per_epoch=data.steps_per_epoch,
        num_processes=accelerator.num_processes,
        target_language_tags=data.target_tags,
        languages=run.languages,
        directions=[f"{s}-{t}" for s, t in run.directions],
    )
    if run.trackers:
        project, init_kwargs = tracker_init_kwargs(run.trackers, run.run_name, run.run_dir)
        accelerator.init_trackers(
            project,
            config={k: v for k, v in job.hyperparameters.items() if isinstance(v, (int, float, str, bool))},
            init_kwargs=init_kwargs,
        )
    return job


def load_final_model(trainer: Trainer):
    """The final model, built from checkpoint weights (the last step is always checkpointed) as a plain module on
    every process: the same code path for DDP, FSDP (full state dict checkpoints) and single-process runs. Returns
    (model, where its weights came from)."""
    state = trainer.state
    weights, final_source = averaging.final_weights(trainer)  # --average_last, --final_model, --eval_weights
    logger.info("Final model: %s", final_source)
    bad = [name for name, tensor in weights.items() if tensor.is_floating_point() and not torch.isfinite(tensor).all()]
    if bad:
        raise TrainingStopped(
            f"The final model ({final_source}) holds non-finite values in {len(bad)} tensor(s) "
            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}): not saved.",
            EXIT_NONFINITE,
            {"reason": "nonfinite_final_model", "step": state.step, "final_model": final_source},
        )
    final_model = final_choice.build_model_like(trainer.job.unwrapped)
    checkpointing.load_model_weights(final_model, weights)
    final_model.to(trainer.accelerator.device).eval()
    return final_model, final_source


def final_eval_split(args, data: RunData) -> tuple[str, list, str]:
    """(split name, pairs, label) of the final evaluation: the test split, else the validation split."""
    eval_split, eval_pairs = "test", data.test_pairs
    if not eval_pairs:
        eval_split, eval_pairs = "valid", data.valid_pairs
    split_label = {
        "test": args.test_file or args.test_prefix or args.test_split,
        "valid": args.valid_file or args.valid_prefix or args.valid_split,
    }[eval_split]
    if args.dataset_name:
        split_label = {"test": args.test_split, "valid": args.valid_split}[eval_split]
    return eval_split, eval_pairs, str(split_label)


def build_results(
    trainer: Trainer,
    final_model,
    final_source: str | None,
    scores: dict | None,
    eval_split_label: str | None,
    eval_pairs: list,
    wall_time: float,
) -> RunRecord:
    """The run record written as results.json (and read by the model card)."""
    from model_cards.card import model_identity

    args, run, data, state = trainer.args, trainer.run, trainer.data, trainer.state
    directions, train_report, eval_report = run.directions, data.train_report, data.eval_report
    return RunRecord(
        **{
            "model_type": final_model.config.model_type,
            "variant": args.variant_name,  # the card falls back to the model family's name
            "preset": None if args.model_name_or_path else args.preset,
            "source_lang": directions[0][0] if len(directions) == 1 else None,
            "target_lang": directions[0][1] if len(directions) == 1 else None,
            "languages": run.languages,
            "directions": [f"{s}-{t}" for s, t in run.eval_directions],
            "bidirectional": args.bidirectional,
            "dataset": args.dataset_name or args.train_file or corpora.label(args) or Path(args.data_dir).name,
            "eval_split": eval_split_label if eval_pairs else None,  # no evaluation: no split
            "eval_pairs": len(eval_pairs),
            **{
                key: scores.get(key) if scores else None
                for key in (
                    "bleu",
                    "chrf",
                    "chrfpp",
                    "ter",
                    "sacrebleu_signature",
                    "chrf_signature",
                    "chrfpp_signature",
                    "ter_signature",
                )
            },
            "params": trainer.job.params,
            "train_tokens_per_sec": state.train_tokens / max(state.train_time, 1e-9),
            "wall_time_sec": wall_time,
            "train_time_sec": state.train_time,
            "train_pairs": len(data.train_set) if data.stream is None else data.stream.kept_pairs,
            "dropped_pairs": train_report.total,
            "dropped_reasons": dict(sorted(train_report.counts.items())),
            "dropped_examples": train_report.to_dict()["examples"],
            "eval_dropped_pairs": eval_report.total,
            "eval_dropped_reasons": dict(sorted(eval_report.counts.items())),
            "steps": state.step,
            "epochs": round(trainer.epoch_progress(), 3),
            "final_model": final_source,
            "best_step": state.best_step,
            "validation": state.evals,
            "hyperparameters": trainer.job.hyperparameters,
            "base_model": args.model_name_or_path,
            # what the base models are, named while their folders are at hand (the card is written again later)
            "base_model_identity": model_identity(args.model_name_or_path),
            "warm_start_identity": model_identity(getattr(final_model.config, "warm_started_from", None)),
            "license": args.license,
            "dataset_label": args.dataset_label,
            "per_direction": scores["per_direction"] if scores and scores["per_direction"] else None,
            "num_processes": trainer.accelerator.num_processes,
            # settings changed on resumes ({"step", "setting", "from", "to", "free"}): "hyperparameters" holds
            # the values of the last part of the run
            "settings_changes": state.settings_changes,
            "nonfinite_skipped": state.nonfinite_skipped,
            "run_id": trainer.run_id,  # hf_variants/training/run_identity.py
            "best_checkpoint": final_choice.summary(trainer),  # the ranking and how the final model was chosen
            "corpora": corpora.summary(data.train_set),
            "early_stopping": early_stopping_summary(state, args),
        }
    )


def save_final_model(run_dir: Path, args, final_model, tokenizer, results: RunRecord, signals=None) -> Path:
    """run_dir/model, complete with its card, replacing the previous one in one rename (`signals`: the run's
    `StopSignals`, told the stage: the model card, then the rename, which a signal does not interrupt)."""
    model_dir = run_dir / "model"
    tmp = run_dir / ".tmp_model"
    shutil.rmtree(tmp, ignore_errors=True)
    generation_defaults(final_model.generation_config, args)
    final_model.save_pretrained(tmp)
    tokenizer.model_max_length = final_model.config.max_position_embeddings  # the model's limit, saved with it
    tokenizer.save_pretrained(tmp)
    if signals is not None:
        signals.stage = "model card"
    write_model_card(tmp, results, args.hub_model_id)
    interrupt = signals is not None and signals.interrupt
    if interrupt:
        signals.interrupt = False  # the old model goes and the new one comes in together
    if model_dir.exists():
        shutil.rmtree(model_dir)
    os.replace(tmp, model_dir)
    if interrupt:
        signals.interrupt = True
        if signals.received:
            raise StopRequested(signals.received)
    return model_dir


def print_summary(
    run_dir: Path, args, results: RunRecord, scores: dict | None, eval_split: str, model_dir: Path, train_report
) -> None:
    print(
        f"\n{'=' * 80}\n{results.model_type} on {results.dataset} "
        f"({', '.join(results.directions)}), {results.steps} steps, {results.wall_time_sec / 60:.1f} min"
    )
    if scores:
        print(
            f"{eval_split} ({results.eval_split}, {results.eval_pairs} pairs): BLEU {scores['bleu']:.2f}  "
            f"chrF {scores['chrf']:.2f}  chrF++ {scores['chrfpp']:.2f}  TER {scores['ter']:.2f}\n"
            + "".join(f"  {scores[key]}\n" for key in ("sacrebleu_signature", "chrf_signature", "chrfpp_signature"))
            + f"  {scores['ter_signature']}"
        )
        for e in scores["examples"][: args.num_examples]:
            print(
                f"\n[{e['direction']}] SRC: {e['source']}\n         REF: {e['reference']}\n"
                f"         HYP: {e['translation']}"
            )
    print(
        f"\nTrain pairs {results.train_pairs}, dropped {train_report.total} "
        f"{dict(train_report.counts) if train_report.total else ''}; "
        f"{results.train_tokens_per_sec:.0f} tokens/s"
    )
    print(
        f"Model: {model_dir}  (AutoModelForSeq2SeqLM.from_pretrained after `import hf_variants`)\n"
        f"Results: {run_dir / 'results.json'}\n{'=' * 80}"
    )


@contextlib.contextmanager
def final_stage(trainer: Trainer, stage: str):
    """A final stage (after training: the last checkpoint is current). A stop signal stops it: a single process
    at once (the handler raises `StopRequested`), several at the next stage boundary (`Trainer.stop_point`, a
    collective); the run then exits with the requeue status, and a resume finishes the job without training."""
    signals = trainer.signals
    signals.stage, signals.interrupt = stage, trainer.accelerator.num_processes == 1
    try:
        yield
    except StopRequested:
        signals.interrupt = False
        trainer.stop_preempted(signals.received_stage or stage)
    finally:
        signals.interrupt = False


def finish(trainer: Trainer) -> dict | None:
    """Stage 5: the final model (best, last or averaged checkpoint), its evaluation on the test split (else the
    validation split), results.json, run_dir/model with its card, the summary, and the upload. Returns the results
    on the main process (None on the others)."""
    args, run, data, accelerator = trainer.args, trainer.run, trainer.data, trainer.accelerator
    # a signal during the last step's validation or checkpoint: that checkpoint is current, nothing more is done
    trainer.stop_point("training")
    eval_split, eval_pairs, split_label = final_eval_split(args, data)
    scores = None
    with final_stage(trainer, "final evaluation"):
        final_model, final_source = load_final_model(trainer)
        if eval_pairs:
            logger.info("Final evaluation: %d %s pairs", len(eval_pairs), eval_split)
            scores = evaluate_pairs(
                accelerator, final_model, data.tokenizer, eval_pairs, run.eval_directions, args.bidirectional, args
            )
    trainer.stop_point("final evaluation")
    wall_time = trainer.wall_time()
    results = upload_failed = None
    with final_stage(trainer, "final save"):
        if accelerator.is_main_process:
            results = build_results(trainer, final_model, final_source, scores, split_label, eval_pairs, wall_time)
            model_dir = save_final_model(run.run_dir, args, final_model, data.tokenizer, results, trainer.signals)
            trainer.signals.stage = "final save"
            if scores:
                checkpointing.atomic_write(
                    run.run_dir / f"translations.{eval_split}.txt",
                    "".join(e["translation"] + "\n" for e in scores["examples"]),
                )
            atomic_write_json(run.run_dir / "results.json", results.to_dict())
            print_summary(run.run_dir, args, results, scores, eval_split, model_dir, data.train_report)
            if args.push_to_hub:  # a failed upload keeps the model and ends the run with the command that finishes it
                trainer.signals.stage = "upload"
                upload_failed = push_trained_model(run.run_dir, args)
    trainer.stop_point(trainer.signals.received_stage or "final save")
    if run.trackers:
        accelerator.end_training()
    accelerator.wait_for_everyone()
    if upload_failed:
        raise upload_failed
    return results.to_dict() if results is not None else None


def record_stop(trainer: Trainer, stop: TrainingStopped) -> None:
    """A run stopped before its end: a non-finite loss or model writes results.json with `stopped` (why, the step,
    the last losses and the last finite checkpoint) and no final model; a preempted one writes nothing more (its
    checkpoint is the record)."""
    run, accelerator = trainer.run, trainer.accelerator
    if accelerator.is_main_process and stop.details["reason"] != "preempted":
        record = build_results(trainer, trainer.job.unwrapped, None, None, None, [], trainer.wall_time())
        record.stopped = stop.details
        atomic_write_json(run.run_dir / "results.json", record.to_dict())
    logger.error("%s", stop)
    if run.trackers:
        accelerator.end_training()


def main(argv=None) -> dict | None:
    """setup_run → load_data → build_job → Trainer.train → finish. A run stopped early (a non-finite loss, a
    preemption signal) raises `TrainingStopped`, whose `exit_code` the command line exits with."""
    return run_training(parse_args(argv))


def run_training(args) -> dict | None:
    """`main` on parsed arguments. A launch refused for its data (a `DataError` before training starts) leaves no
    run folder behind when it created that folder."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":  # set by a DeepSpeed launch
        raise UnsupportedLaunchError(
            "DeepSpeed is not supported: this training loop's checkpoints, averaging and resume read the DDP/FSDP "
            "layout. Launch with an FSDP config instead (training/accelerate_configs/fsdp.yaml; FULL_SHARD ~ "
            "ZeRO-3, SHARD_GRAD_OP ~ ZeRO-2)."
        )
    flag_checks.check_inputs(args, in_memory=IN_MEMORY_SPLITS.get() is not None)  # what the flags name exists
    progress.DATA_PROGRESS_SECONDS = args.progress_interval
    if not sys.stderr.isatty():  # a log file: progress lines (progress.py), no library progress bars
        progress.quiet_library_bars()
    _, directions = resolve_languages(args)
    new_folder = not (Path(args.output_dir) if args.output_dir else RUNS_DIR / run_name_for(args, directions)).exists()
    run = setup_run(args)
    refused = False
    try:
        try:
            preflight(run)  # --push_to_hub: token, repo id, the Hub and write access, before any work
            data = load_data(run)
            job = build_job(run, data)
            trainer = Trainer(run, data, job)
        except DataError:
            refused = new_folder
            raise
        trainer.signals.install()  # SIGTERM/SIGUSR1/SIGINT mean "checkpoint and stop" in every stage from here on
        try:
            try:
                trainer.train()
                return finish(trainer)
            except StopRequested:  # a signal at the edge of a final stage
                trainer.signals.interrupt = False
                trainer.stop_preempted(trainer.signals.received_stage or trainer.signals.stage)
        except TrainingStopped as stop:
            record_stop(trainer, stop)
            raise
        finally:
            trainer.signals.restore()
    finally:
        if run.lock is not None:  # the run folder's lock, released however the run ends
            run.lock.release()
        if refused and run.accelerator.is_main_process:
            for handler in list(logging.getLogger().handlers):
                if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).parent == run.run_dir:
                    logging.getLogger().removeHandler(handler)  # its train.log goes with the folder
                    handler.close()
            shutil.rmtree(run.run_dir, ignore_errors=True)


class UnsupportedLaunchError(ValueError):
    """A launch this training loop does not support (Accelerate's DeepSpeed plugin)."""


def options_argv(options: dict) -> list[str]:
    """Keyword options as command-line arguments: `name=value` → `--name value`, `True` → `--name`, a list →
    `--name v1 v2`; None and False leave the option out."""
    argv = []
    for name, value in options.items():
        flag = f"--{name}"
        if value is None or value is False:
            continue
        if value is True:
            argv.append(flag)
        elif isinstance(value, (list, tuple)):
            argv += [flag, *map(str, value)]
        else:
            argv += [flag, str(value)]
    return argv


def train_on_datasets(train, validation=None, test=None, **options) -> dict | None:
    """Train on `datasets.Dataset` objects, exactly as the command line trains on files, and return the run's
    `results.json` as a dict.

    Each dataset has a `translation` column of `{lang: text}` or one text column per language (found by their
    language-code names, or named by `source_column=` / `target_column=`). `validation`: the validation split
    (None: no validation); `test`: the final evaluation (None: the validation split). Every other keyword is a
    command-line option without its `--` (`source_lang="en", target_lang="fr", model_type="mute_nmt",
    max_steps=1000, output_dir=...`; `True` for a switch, a list for several values); `dataset_name` names the
    data in results.json and the model card (default: the training dataset's `info.dataset_name`, else
    "in-memory dataset"). Bad data raises `DataError` (a `ValueError`) naming the split, row and column; a bad
    option raises a `ValueError` with the command line's message."""
    import contextlib
    import io

    import datasets

    splits = {"train": train, "valid": validation, "test": test}
    for role, dataset in splits.items():
        if dataset is not None and not isinstance(dataset, datasets.Dataset):
            raise TypeError(
                f"train_on_datasets: the {role} split must be a datasets.Dataset, got {type(dataset).__name__}"
                + (" (pass dataset_dict['train'], ...)" if isinstance(dataset, datasets.DatasetDict) else "")
            )
    sources = [
        name for name in ("data_dir", "train_file", "corpus_spec", "valid_file", "test_file") if options.get(name)
    ]
    if sources:
        raise ValueError(f"train_on_datasets reads the datasets it is given, not {', '.join(sources)}.")
    label = options.pop("dataset_name", None) or getattr(train.info, "dataset_name", None) or "in-memory dataset"
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            args = parse_args(options_argv(options), data_required=False)
    except SystemExit as error:
        message = stderr.getvalue().strip().splitlines()
        message = message[-1].partition(" error: ")[2] or message[-1] if message else str(error)
        raise ValueError(f"train_on_datasets: {message}") from None
    args.dataset_name, args.data_dir = label, None
    token = IN_MEMORY_SPLITS.set(splits)
    try:
        return run_training(args)
    finally:
        IN_MEMORY_SPLITS.reset(token)


def cli() -> None:
    """The command line (`python -m hf_variants.training.train`, `hf-variants-train`, `training/train.py`). Data
    problems end it with one line naming the file or column (exit status 2), not a traceback."""
    prog = Path(sys.argv[0]).name or "train.py"
    try:
        main()
    except TrainingStopped as stopped:
        print(f"{prog}: {stopped}", file=sys.stderr)
        sys.exit(stopped.exit_code)
    except (DataError, UnsupportedLaunchError, settings.SettingsChangedError, checkpointing.CheckpointError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)  # a refused resume names the setting or the file
        sys.exit(getattr(error, "exit_code", 2))  # a full disk: 1; a failed upload (the model is saved): 4


if __name__ == "__main__":
    cli()
