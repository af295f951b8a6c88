#!/usr/bin/env python
"""Translate a file with a trained checkpoint (batched beam search), and score it against references.

    python training/translate.py --model runs/transformer_nmt-en-de-small/model \\
        --input training/data/multi30k/test_2016_flickr.en.gz --output hyp.de \\
        --references training/data/multi30k/test_2016_flickr.de.gz --tgt_lang de

`--model` is a saved model folder (`run_dir/model`, or a Hub id with `--trust_remote_code`) or a training checkpoint
folder (`run_dir/checkpoints/step_N`, loaded into the run's model config).

Input (`--input`, `-` for stdin): a text file with one sentence a line (plain or .gz), or JSONL (`.jsonl`,
`.jsonl.gz`, or `--input_format jsonl`) with one object a line: `{"translation": {"en": ..., "de": ...}}` (the
source side is `--src_lang`, or the row's one language other than the target), `{"text": ...}` or
`{"source": ...}` (optionally with `"target": ...`). When every JSONL row carries the target side
(`translation[tgt_lang]` or `target`) and `--references` is not given, the translations are scored against it.

Output (`--output`, `-` for stdout): one translation a line, line-aligned with the input. An empty input line gives
an empty output line; so does a source longer than the model accepts (`config.max_position_embeddings` tokens,
special tokens included), with a warning naming its line. With references, BLEU and chrF (sacreBLEU, signatures
included) are printed as JSON (to stderr when the translations go to stdout) and written to `--results_json`.
A progress bar goes to stderr when it is a terminal; elsewhere (nohup, a SLURM log, CI) a line
`progress: D/T sentences (P%), R sentences/s, elapsed H:MM:SS, ETA H:MM:SS` every `--progress_interval` seconds
(`--no_progress` turns both off).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch  # noqa: E402

from ..outputs import (  # noqa: E402
    OutputPathError,
    atomic_write_file,
    check_not_an_input,
    check_output_file,
    float_in_range,
    int_in_range,
)
from . import checkpointing, evaluation, external  # noqa: E402
from .corpus import DataError, parse_jsonl_line, read_lines  # noqa: E402

logger = logging.getLogger("hf_variants.translate")

STDIO = "-"
TEXT_KEYS = ("text", "source")  # JSONL rows without "translation": the source text
TARGET_KEY = "target"  # ... and an optional reference next to it


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help; the epilog (the docstring's input/output paragraphs) as written."""


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[3:]),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", help="saved model folder, Hub id, or a training checkpoint folder (or --onnx)")
    p.add_argument(
        "--onnx",
        metavar="DIR",
        help="translate with ONNX Runtime: a folder written by `python -m "
        "hf_variants.export_onnx` (instead of --model; with --int8: its int8 graphs)",
    )
    p.add_argument("--tokenizer", help="default: the model folder (or the run's tokenizer for a checkpoint)")
    p.add_argument(
        "--input",
        required=True,
        help="source sentences: a text file, one a line (plain or .gz), or JSONL (see --input_format); "
        "'-' reads stdin",
    )
    p.add_argument(
        "--input_format",
        choices=["auto", "text", "jsonl"],
        default="auto",
        help="auto: JSONL for names ending in .jsonl / .jsonl.gz, else text. JSONL rows: "
        '{"translation": {"en": ..., "de": ...}} (the source side is --src_lang, or the '
        'row\'s one language other than the target), {"text": ...} or {"source": ...} '
        '(optionally with "target": ...)',
    )
    p.add_argument(
        "--output",
        required=True,
        help="translations, one a line, aligned with the input; '-' writes "
        "stdout (the JSON summary then goes to stderr)",
    )
    p.add_argument(
        "--references",
        help="reference translations (plain or .gz) to score against; default for "
        "JSONL input: the rows' target side, when every row has one",
    )
    p.add_argument(
        "--source_annotation",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a per-sentence model input aligned with --input (e.g. parses=test.en.parses for the "
        "syntactic MG-SA); with JSONL input, NAME alone reads each row's NAME (a value, or "
        "{lang: value}); repeatable",
    )
    p.add_argument("--src_lang")
    p.add_argument("--tgt_lang", help="target language (needed by multilingual models)")
    p.add_argument("--num_beams", type=int_in_range(1), default=4)
    p.add_argument("--length_penalty", type=float_in_range(), default=0.6)
    p.add_argument(
        "--max_len_a",
        type=float_in_range(0.0),
        default=1.2,
        help="max new tokens = a * source length + b (at most the model's positions - 1)",
    )
    p.add_argument("--max_len_b", type=int_in_range(0), default=10)
    p.add_argument(
        "--max_length",
        type=int_in_range(1),
        help="truncate source sentences to this many tokens (default: never; "
        "longer than the model accepts: an empty line and a warning)",
    )
    p.add_argument("--batch_size", type=int_in_range(1), default=64)
    p.add_argument("--results_json", help="write the scores here")
    p.add_argument("--no_progress", action="store_true", help="no progress bar or progress lines")
    p.add_argument(
        "--progress_interval",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="when stderr is no terminal (nohup, a SLURM log, CI): a progress line (sentences done / "
        "total, rate, ETA) every SECONDS seconds, in place of the progress bar (0: after every batch)",
    )
    p.add_argument("--trust_remote_code", action="store_true", help="for Hub ids whose code is not installed")
    p.add_argument(
        "--int8",
        action="store_true",
        help="int8 CPU inference: every linear layer gets int8 weights and dynamically quantized int8 "
        "activations (hf_variants.quantize_for_cpu); with --onnx, the export's int8 graphs",
    )
    return p


def load_model_and_tokenizer(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    from ..pipeline_translation import check_tokenizer_fits_model

    path = Path(model_path)
    if (path / checkpointing.MARKER).is_file():  # run_dir/checkpoints/step_N: the run's config + these weights
        from .trainer import MODEL_CONFIG_DIR

        run_dir = path.parent.parent
        # written when the run starts (a run still training has it), else the finished run's model folder
        candidates = [run_dir / MODEL_CONFIG_DIR, run_dir / "model"]
        config_dir = next((d for d in candidates if (d / "config.json").is_file()), None)
        if config_dir is None:
            raise FileNotFoundError(
                f"{path} is a checkpoint, but neither {candidates[0]}/config.json nor "
                f"{candidates[1]}/config.json (the run's config) exists; pass the run's model "
                f"folder instead."
            )
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(config_dir))
        if (config_dir / "generation_config.json").is_file():
            from transformers import GenerationConfig

            model.generation_config = GenerationConfig.from_pretrained(config_dir)
        checkpointing.load_model_weights(model, checkpointing.load_weights(path))
        tokenizer_path = tokenizer_path or str(run_dir / "tokenizer")
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path or model_path, trust_remote_code=trust_remote_code)
    check_tokenizer_fits_model(tokenizer, model.config, tokenizer_path or model_path, model_path)
    model.eval()
    return model, tokenizer


# ------------------------------------------------------------------------------------------------------- input
def read_input_lines(path: str) -> list[str]:
    """Lines of a text file (plain or .gz) or of stdin (`-`), without terminators; bad UTF-8 names the line; a
    byte-order mark at the start is dropped."""
    if path != STDIO:
        return read_lines(path)
    lines = []
    for raw in sys.stdin.buffer:
        try:
            lines.append(raw.decode("utf-8-sig" if not lines else "utf-8").rstrip("\r\n"))  # a BOM is no text
        except UnicodeDecodeError as err:
            raise DataError(f"stdin: line {len(lines) + 1} is not valid UTF-8 ({err.reason}).") from err
    return lines


def is_jsonl(path: str, input_format: str) -> bool:
    if input_format != "auto":
        return input_format == "jsonl"
    return path != STDIO and path.lower().removesuffix(".gz").endswith(".jsonl")


def _row_source(obj: dict, where: str, src_lang: str | None, tgt_lang: str | None):
    """(source, its language or None, reference or None) of one JSONL row."""
    if "translation" in obj:
        sides = obj["translation"]
        if not isinstance(sides, dict):
            raise DataError(f'{where}: "translation" must be an object {{lang: text}}, got {type(sides).__name__}.')
        lang = src_lang
        if lang is None:
            others = [code for code in sides if code != tgt_lang]
            if len(others) != 1:
                raise DataError(
                    f"{where}: cannot tell the source side among {sorted(sides)}: pass --src_lang"
                    f"{'' if tgt_lang else ' and --tgt_lang'}."
                )
            lang = others[0]
        if sides.get(lang) is None:
            raise DataError(f'{where}: no {lang!r} side in "translation" (it has {sorted(sides)}).')
        source, reference = sides[lang], sides.get(tgt_lang) if tgt_lang else None
    else:
        keys = [key for key in TEXT_KEYS if key in obj]
        if len(keys) != 1:
            found = 'both "text" and "source"' if keys else f"the keys {sorted(obj)}"
            raise DataError(
                f'{where}: expected {{"translation": {{lang: text}}}}, {{"text": ...}} or '
                f'{{"source": ...}}, found {found}.'
            )
        source, reference, lang = obj[keys[0]], obj.get(TARGET_KEY), src_lang
    for name, value in (("source", source), ("target", reference)):
        if value is not None and not isinstance(value, str):
            raise DataError(f"{where}: the {name} is a {type(value).__name__}, expected a string.")
    if source is None:
        raise DataError(f"{where}: the source is null.")
    return source, lang, reference


def read_jsonl_input(path: str, src_lang: str | None, tgt_lang: str | None, annotation_names: list[str]):
    """Sources, references (a list when every row has a target side, else None), per-row annotations and the
    source languages found, from JSONL rows (see the module docstring)."""
    label = "stdin" if path == STDIO else path
    sources, references, source_langs = [], [], set()
    annotations: dict[str, list] = {name: [] for name in annotation_names}
    for i, line in enumerate(read_input_lines(path)):
        where = f"{label}:{i + 1}"
        obj = parse_jsonl_line(line, where)
        source, lang, reference = _row_source(obj, where, src_lang, tgt_lang)
        sources.append(source)
        references.append(reference)
        source_langs.add(lang)
        for name in annotation_names:
            value = obj.get(name)
            if isinstance(value, dict):
                value = value.get(lang) if lang is not None else None
            if value is None and source.strip():
                raise DataError(
                    f'{where}: no {name!r} for the source (expected "{name}": value or {{"{lang or "lang"}": value}}).'
                )
            annotations[name].append(value)
    with_target = sum(ref is not None for ref in references)
    if 0 < with_target < len(references):
        first = next(i for i, ref in enumerate(references) if ref is None)
        logger.warning(
            "%d of %d rows of %s have a target side (%s:%d has none): not scoring against them",
            with_target,
            len(references),
            label,
            label,
            first + 1,
        )
    return (
        sources,
        (references if with_target == len(references) and references else None),
        annotations,
        source_langs - {None},
    )


def read_annotation_files(items: list[str], jsonl: bool) -> tuple[dict[str, str], list[str]]:
    """`--source_annotation` values: NAME=FILE pairs, and (JSONL input only) NAMEs read from the rows."""
    files, from_rows = {}, []
    for item in items:
        name, sep, path = item.partition("=")
        if not name:
            raise SystemExit(f"--source_annotation expects NAME=FILE, got {item!r}")
        if sep:
            files[name] = path
        elif jsonl:
            from_rows.append(name)
        else:
            raise SystemExit(f"--source_annotation expects NAME=FILE (NAME alone reads JSONL rows), got {item!r}")
    return files, from_rows


# ------------------------------------------------------------------------------------------------- translation
def model_input_lengths(model, tokenizer, texts: list[str], batch_size: int, **kwargs) -> list[int]:
    """Each text's length in tokens as the model receives it (language tags, `</s>`, truncation included)."""
    variant_inputs = kwargs.pop("variant_inputs")
    lengths: list[int] = []
    for start in range(0, len(texts), batch_size):
        chunk = {name: values[start : start + batch_size] for name, values in variant_inputs.items()}
        inputs = external.prepare_translation_inputs(
            model, tokenizer, texts[start : start + batch_size], **kwargs, **chunk
        )
        mask = inputs.get("attention_mask")
        if mask is None:
            lengths += [inputs["input_ids"].shape[-1]] * inputs["input_ids"].shape[0]
        else:
            lengths += mask.sum(-1).tolist()
    return lengths


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLines:
    """The progress bar of a log file: a line `progress: D/T sentences (P%), R sentences/s, ETA H:MM:SS` on stderr
    at most every `interval` seconds (nohup, SLURM, CI: where a bar's carriage returns would be lost), and a last
    line when done if any was written. Same interface as the tqdm bar (`update`, context manager)."""

    def __init__(self, total: int, interval: float, stream=None, clock=time.monotonic):
        self.total, self.interval, self.stream, self.clock = total, interval, stream or sys.stderr, clock
        self.done = 0
        self.start = self.last = clock()
        self.lines = 0

    def update(self, n: int) -> None:
        self.done += n
        now = self.clock()
        if now - self.last >= self.interval or (self.lines and self.done >= self.total):
            self.last = now
            self.write(now)

    def write(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = _duration((self.total - self.done) / rate) if rate > 0 else "?"
        percent = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"progress: {self.done}/{self.total} sentences ({percent:.0f}%), {rate:.1f} sentences/s, "
            f"elapsed {_duration(elapsed)}, ETA {eta}",
            file=self.stream,
            flush=True,
        )
        self.lines += 1

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


def progress_bar(total: int, disable: bool, interval: float = 10.0):
    """A tqdm bar when stderr is a terminal, else `ProgressLines` every `interval` seconds (none with `disable`)."""
    from tqdm.auto import tqdm

    if not disable and not sys.stderr.isatty():
        return ProgressLines(total, interval)
    return tqdm(total=total, unit="sent", desc="translating", file=sys.stderr, disable=disable, dynamic_ncols=True)


def write_output(path: str, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path == STDIO:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(path, text)


def check_outputs(args: argparse.Namespace, annotation_files: dict[str, str]) -> None:
    """Before anything loads: `--output` and `--results_json` can be written as files (no folder, a parent that is
    a writable folder or can be made), are not the same file, and are not, do not hold and do not lie inside any
    input (`--input`, `--references`, `--source_annotation` files, the `--model` / `--onnx` / `--tokenizer`
    folders). Raises `OutputPathError` naming the flags."""
    inputs = {
        "--input": None if args.input == STDIO else args.input,
        "--references": args.references,
        "--source_annotation": list(annotation_files.values()),
        "--model": args.model,
        "--onnx": args.onnx,
        "--tokenizer": args.tokenizer,
    }
    outputs = {"--output": None if args.output == STDIO else args.output, "--results_json": args.results_json}
    for flag, path in outputs.items():
        if path is not None:
            check_output_file(path, flag=flag)
            check_not_an_input(path, inputs, output_flag=flag)
    if None not in outputs.values():
        check_not_an_input(outputs["--results_json"], {"--output": outputs["--output"]}, output_flag="--results_json")
        if Path(outputs["--results_json"]).absolute() == Path(outputs["--output"]).absolute():
            raise OutputPathError("--results_json and --output name the same file.")


def load_translation_model(args: argparse.Namespace):
    """The model and tokenizer of `--model` or `--onnx` (exactly one), the PyTorch model quantized for the CPU with
    `--int8` (an ONNX model then loads its int8 export)."""
    if (args.model is None) == (args.onnx is None):
        raise SystemExit("Pass exactly one of --model and --onnx.")
    if args.onnx:
        from transformers import AutoTokenizer

        from ..onnx.modeling import OrtModelForSeq2SeqLM

        model = OrtModelForSeq2SeqLM.from_pretrained(args.onnx, precision="int8" if args.int8 else "fp32")
        tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or args.onnx)
    else:
        model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, args.trust_remote_code)
    if args.int8 and not args.onnx:
        from ..deploy.int8 import quantize_for_cpu

        quantize_for_cpu(model)
    return model, tokenizer


def target_language(tgt_lang: str | None, model) -> str | None:
    """`--tgt_lang`, or when it is not given the model's one target language (`config.target_languages`, recorded
    by train.py), or for a model saved without it the second language of a two-language model without
    target-language tags; a model translating into several languages needs it."""
    languages = list(getattr(model.config, "languages", None) or [])
    targets = list(getattr(model.config, "target_languages", None) or [])
    if tgt_lang is None and languages:
        if len(targets) == 1:
            tgt_lang = targets[0]
        elif not targets and len(languages) == 2 and not getattr(model.config, "target_language_tags", False):
            tgt_lang = languages[1]
            logger.info("--tgt_lang not given: using %s (the model's languages are %s)", tgt_lang, languages)
        else:
            raise SystemExit(
                f"This model translates into several languages ({', '.join(targets or languages)}): pass --tgt_lang."
            )
    return tgt_lang


@dataclass
class TranslationInput:
    """The input sentences (one a line), the references they are scored against (None: not scored) and the
    variant inputs (annotations), line-aligned with them."""

    sources: list[str]
    label: str  # the input's name in messages ("stdin" for `-`)
    references: list[str] | None
    references_label: str | None
    variant_inputs: dict[str, list[str]]


def read_translation_input(
    args: argparse.Namespace,
    jsonl: bool,
    tgt_lang: str | None,
    annotation_files: dict[str, str],
    annotations_from_rows: list[str],
) -> TranslationInput:
    """`--input` (text or JSONL), the references (`--references`, else the target side of JSONL rows) and the
    annotation files, each checked to have as many lines as the input."""
    input_label = "stdin" if args.input == STDIO else args.input
    references, references_label, variant_inputs = None, args.references, {}
    if jsonl:
        sources, row_references, variant_inputs, source_langs = read_jsonl_input(
            args.input, args.src_lang, tgt_lang, annotations_from_rows
        )
        if source_langs:
            logger.info("%s: source side %s", input_label, ", ".join(sorted(source_langs)))
        if args.references is None and row_references is not None:
            references, references_label = row_references, f"{input_label} (target side)"
            logger.info("Scoring against the target side of the rows of %s", input_label)
    else:
        sources = read_input_lines(args.input)
    if args.references:
        references = read_lines(args.references)
        if len(references) != len(sources):
            raise DataError(
                f"{input_label} has {len(sources)} lines but {args.references} has {len(references)}; "
                f"line {min(len(sources), len(references)) + 1} has no counterpart."
            )
    for name, path in annotation_files.items():
        values = read_lines(path)
        if len(values) != len(sources):
            raise DataError(f"{input_label} has {len(sources)} lines but {path} has {len(values)}.")
        variant_inputs[name] = values
    return TranslationInput(sources, input_label, references, references_label, variant_inputs)


@dataclass
class LinePlan:
    """Which input lines are translated, and in which order."""

    keep: list[int]  # the non-empty lines (0-based)
    texts: dict[int, str]  # their stripped text
    lengths: dict[int, int]  # their model input lengths, special tokens included
    limit: int | None  # config.max_position_embeddings
    too_long: list[int]  # lines longer than `limit`: an empty output line
    order: list[int]  # the lines translated, longest first


def plan_lines(model, tokenizer, args: argparse.Namespace, inputs: TranslationInput, tgt_lang: str | None) -> LinePlan:
    """Warn about empty input lines and sources longer than the model's positions (both give an empty output
    line), and order the others as evaluation.translate would batch them: longest first."""
    sources, variant_inputs = inputs.sources, inputs.variant_inputs
    keep = [i for i, s in enumerate(sources) if s.strip()]
    if len(keep) < len(sources):
        logger.warning(
            "%d empty input lines (e.g. line %d): their output lines are empty",
            len(sources) - len(keep),
            next(i for i, s in enumerate(sources) if not s.strip()) + 1,
        )
    texts = {i: sources[i].strip() for i in keep}
    common = dict(src_lang=args.src_lang, max_length=args.max_length)
    if tgt_lang is not None:
        common["tgt_lang"] = tgt_lang
    # a source longer than the model's positions: a warning naming its line and an empty output line
    limit = getattr(model.config, "max_position_embeddings", None)
    lengths = dict(
        zip(
            keep,
            model_input_lengths(
                model,
                tokenizer,
                [texts[i] for i in keep],
                args.batch_size,
                variant_inputs={k: [v[i] for i in keep] for k, v in variant_inputs.items()},
                **common,
            ),
        )
    )
    too_long = [i for i in keep if limit is not None and lengths[i] > limit]
    for i in too_long:
        logger.warning(
            "line %d: %d tokens (special tokens included), more than this model accepts (%d, "
            "config.max_position_embeddings); its output line is empty",
            i + 1,
            lengths[i],
            limit,
        )
    skipped = set(too_long)
    todo = [i for i in keep if i not in skipped]
    # the batches evaluation.translate would form: longest first, `batch_size` sentences each
    token_counts = tokenizer([texts[i] for i in todo], add_special_tokens=True)["input_ids"] if todo else []
    order = [todo[j] for j in sorted(range(len(todo)), key=lambda j: -len(token_counts[j]))]
    return LinePlan(keep, texts, lengths, limit, too_long, order)


def translate_lines(
    model, tokenizer, args: argparse.Namespace, inputs: TranslationInput, plan: LinePlan, tgt_lang: str | None
) -> tuple[list[str], float]:
    """The output lines (one per input line; empty where nothing was translated) and the seconds taken: beam search
    over the planned lines, `--batch_size` a batch, with a progress bar."""
    outputs = [""] * len(inputs.sources)
    order, lengths, texts, limit = plan.order, plan.lengths, plan.texts, plan.limit
    start = time.time()
    with progress_bar(len(order), args.no_progress, args.progress_interval) as bar:
        for first in range(0, len(order), args.batch_size):
            idx = order[first : first + args.batch_size]
            # fairseq's max_len_a/b over the batch's longest source, within the model's positions
            budget = max(1, int(args.max_len_a * max(lengths[i] for i in idx) + args.max_len_b))
            if limit is not None:
                budget = min(budget, max(1, limit - 1))
            hyps = evaluation.translate(
                model,
                tokenizer,
                [texts[i] for i in idx],
                tgt_lang,
                src_lang=args.src_lang,
                batch_size=len(idx),
                num_beams=args.num_beams,
                length_penalty=args.length_penalty,
                max_len_a=0.0,
                max_len_b=budget,
                max_length=args.max_length,
                variant_inputs={k: [v[i] for i in idx] for k, v in inputs.variant_inputs.items()},
            )
            for i, hyp in zip(idx, hyps):
                outputs[i] = hyp.replace("\n", " ")
            bar.update(len(idx))
    return outputs, time.time() - start


def build_result(
    args: argparse.Namespace,
    inputs: TranslationInput,
    plan: LinePlan,
    outputs: list[str],
    elapsed: float,
    tgt_lang: str | None,
) -> dict:
    """The run's summary (printed as JSON and written to `--results_json`), with BLEU and chrF when there are
    references."""
    sources = inputs.sources
    result = {
        "model": args.model or args.onnx,
        "onnx": bool(args.onnx),
        "input": inputs.label,
        "output": "stdout" if args.output == STDIO else args.output,
        "sentences": len(sources),
        "empty_inputs": len(sources) - len(plan.keep),
        "too_long_inputs": len(plan.too_long),
        "too_long_lines": [i + 1 for i in plan.too_long],
        "max_source_tokens": plan.limit,
        "tgt_lang": tgt_lang,
        "num_beams": args.num_beams,
        "length_penalty": args.length_penalty,
        "int8": args.int8,
        "seconds": round(elapsed, 2),
        "sentences_per_sec": round(len(plan.order) / max(elapsed, 1e-9), 2),
    }
    if inputs.references is not None:
        scores = evaluation.score(outputs, inputs.references)
        result.update(
            references=inputs.references_label,
            bleu=scores["bleu"],
            chrf=scores["chrf"],
            sacrebleu_signature=scores["sacrebleu_signature"],
            chrf_signature=scores["chrf_signature"],
        )
    return result


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if args.references == STDIO:
        raise SystemExit("--references cannot be stdin ('-'); give a file.")
    jsonl = is_jsonl(args.input, args.input_format)
    annotation_files, annotations_from_rows = read_annotation_files(args.source_annotation, jsonl)
    try:
        check_outputs(args, annotation_files)
    except OutputPathError as error:
        build_parser().exit(2, f"error: {error}\n")
    model, tokenizer = load_translation_model(args)
    tgt_lang = target_language(args.tgt_lang, model)
    inputs = read_translation_input(args, jsonl, tgt_lang, annotation_files, annotations_from_rows)
    plan = plan_lines(model, tokenizer, args, inputs, tgt_lang)
    outputs, elapsed = translate_lines(model, tokenizer, args, inputs, plan, tgt_lang)
    write_output(args.output, outputs)
    result = build_result(args, inputs, plan, outputs, elapsed, tgt_lang)
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_file(args.results_json, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), file=sys.stderr if args.output == STDIO else sys.stdout)
    return result


def cli() -> None:
    """The command line (`python -m hf_variants.training.translate`, `hf-variants-translate`)."""
    with torch.inference_mode():
        main()


if __name__ == "__main__":
    cli()
