#!/usr/bin/env python
"""Translate a file with a trained model (beam search, n-best lists, sampling, prefixes, alignments), streaming, and
score it against references.

    python training/translate.py --model runs/transformer_nmt-en-de-small/model \\
        --input training/data/multi30k/test_2016_flickr.en.gz --output hyp.de \\
        --references training/data/multi30k/test_2016_flickr.de.gz --tgt_lang de

`--model` is a saved model folder (`run_dir/model`, or a Hub id with `--trust_remote_code`) or a training checkpoint
folder (`run_dir/checkpoints/step_N`, loaded into the run's model config); `--onnx DIR` an ONNX Runtime export.
Every sentence goes through the translation core (`hf_variants.inference.Translator`), as in the pipeline, the
server and evaluation during training: the decoding defaults are the model's saved ones (its generation config:
beam size, length penalty and the length rule the run evaluated with), and a translation does not depend on its
batch (the length rule is applied per sentence).

Input (`--input`, `-` for stdin): a text file with one sentence a line (plain or .gz), or JSONL (`.jsonl`,
`.jsonl.gz`, or `--input_format jsonl`) with one object a line: `{"translation": {"en": ..., "de": ...}}` (the
source side is `--src_lang`, or the row's one language other than the target), `{"text": ...}` or
`{"source": ...}` (optionally with `"target": ...`). When every JSONL row carries the target side
(`translation[tgt_lang]` or `target`) and `--references` is not given, the translations are scored against it.
The input is read and translated in buffers of `--buffer_size` lines, never whole: a pipe gets each answer as soon as
its line is translated, and a file of millions of lines is translated in bounded memory.

Output (`--output`, `-` for stdout), line-aligned with the input. `--output_format text`: one translation a line
(with `--alignments`: `translation ||| 0-0 1-2 ...`). `--output_format jsonl` (chosen automatically with `--nbest`
or `--scores`): one object a line, `{"source": ..., "hypotheses": [{"text", "score", "log_prob", "tokens"}, ...]}`,
best first; `score` is what the search ranked by (log_prob / length ** length_penalty, beam search's
sequences_scores), `log_prob` the sum of the returned tokens' log-probabilities (`</s>` included; what
`hf-variants-score` gives the same pair), `tokens` the subwords; with `--alignments` an `"alignment"` per hypothesis.
An empty input line gives an empty output line (`"hypotheses": []`); so does a source longer than the model
accepts (`config.max_position_embeddings` tokens, special tokens included), with a warning naming its line;
`--max_source_length` truncates sources instead, with a warning per line and the count in the summary. With
references, BLEU and chrF (sacreBLEU, signatures included) are printed as JSON (to stderr when the translations go
to stdout) and written to `--results_json`. A progress bar goes to stderr when it is a terminal; elsewhere (nohup, a
SLURM log, CI) a line `progress: D/T sentences (P%), R sentences/s, elapsed H:MM:SS, ETA H:MM:SS` every
`--progress_interval` seconds (`--no_progress` turns both off).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import logging
import os
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..inference import DecodeOptions, OptionError, TranslationRequest, Translator
from ..inference.batching import LineReader
from ..inference.translator import (
    DEFAULT_BUFFER_SIZE,
    check_request_languages,
    default_target_language,
    resolve_options,
)
from ..outputs import (
    OutputPathError,
    atomic_write_file,
    check_output_files,
    float_in_range,
    int_in_range,
)
from . import checkpointing, evaluation
from .corpus import DataError, parse_jsonl_line

logger = logging.getLogger("hf_variants.translate")

STDIO = "-"
TEXT_KEYS = ("text", "source")  # JSONL rows without "translation": the source text
TARGET_KEY = "target"  # ... and an optional reference next to it
DEFAULT_BATCH_SIZE = 64


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
        help="translations, aligned with the input; '-' writes stdout (the JSON summary then goes to stderr)",
    )
    p.add_argument(
        "--output_format",
        choices=["auto", "text", "jsonl"],
        default="auto",
        help="text: one translation a line; jsonl: one object a line with the n-best hypotheses, their scores, "
        "log-probabilities and tokens; auto: jsonl with --nbest > 1 or --scores, else text",
    )
    p.add_argument(
        "--references",
        nargs="+",
        metavar="FILE",
        help="reference translations (plain or .gz), one file per reference set (several: multi-reference scores); "
        "default for JSONL input: the rows' target side, when every row has one",
    )
    p.add_argument(
        "--bleu_tokenize",
        default="13a",
        help="sacreBLEU's BLEU tokenizer: 13a, intl, zh, char, none, ja-mecab, ko-mecab",
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
    p.add_argument("--src_lang", help="source language (checked against the model's)")
    p.add_argument("--tgt_lang", help="target language (needed by models translating into several)")
    p.add_argument(
        "--prefix",
        metavar="FILE",
        help="target prefixes, one a line aligned with --input (a line may be empty): each translation begins "
        "with its prefix's tokens",
    )
    add_decoding_args(p)
    p.add_argument("--results_json", help="write the summary (and scores) here")
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


# ------------------------------------------------------------------------------------------------------- model


def add_decoding_args(p: argparse.ArgumentParser) -> None:
    """The decoding, length and batching flags (each default: the model's saved generation config)."""
    g = p.add_argument_group("decoding (default: the model's saved generation config)")
    g.add_argument("--num_beams", type=int_in_range(1), help="beam size (1: greedy); default: the model's")
    g.add_argument("--nbest", type=int_in_range(1), default=1, help="hypotheses per sentence (at most --num_beams)")
    g.add_argument("--length_penalty", type=float_in_range(), help="default: the model's")
    g.add_argument(
        "--do_sample",
        action="store_true",
        help="sample instead of searching (back-translation): --nbest independent samples per sentence",
    )
    g.add_argument("--top_k", type=int_in_range(0), help="sample among the k most likely tokens (0: all)")
    g.add_argument("--top_p", type=float_in_range(0.0, 1.0), help="nucleus sampling: the smallest set of mass p")
    g.add_argument("--temperature", type=float_in_range(0.0), help="sampling temperature")
    g.add_argument("--seed", type=int_in_range(0), help="random seed of sampling: the same seed, the same samples")
    g.add_argument("--no_repeat_ngram_size", type=int_in_range(0), help="no n-gram of this size twice")
    g.add_argument("--repetition_penalty", type=float_in_range(0.0), help="CTRL's repetition penalty (1: none)")
    g.add_argument(
        "--scores", action="store_true", help="add each hypothesis' score and log-probability (JSON Lines output)"
    )
    g.add_argument(
        "--alignments",
        action="store_true",
        help="add word alignments (Pharaoh `0-0 1-2`, source word - target word over whitespace words) from the "
        "last decoder layer's cross-attention averaged over heads (PyTorch only)",
    )
    g = p.add_argument_group("lengths")
    g.add_argument(
        "--max_len_a",
        type=float_in_range(0.0),
        help="length rule per sentence: at most a * (its source length in tokens) + b new tokens; default: the "
        "rule saved with the model (the run's --max_len_a/--max_len_b)",
    )
    g.add_argument("--max_len_b", type=int_in_range(0), help="see --max_len_a")
    g.add_argument(
        "--max_length",
        type=int_in_range(1),
        help="a fixed output limit instead of the length rule: tokens of the whole output (the decoder's start "
        "token included), as in generate() and the pipeline",
    )
    g.add_argument("--max_new_tokens", type=int_in_range(1), help="a fixed limit of generated tokens")
    g.add_argument(
        "--max_source_length",
        type=int_in_range(1),
        help="truncate sources to this many tokens (special tokens included), with a warning per line "
        "(default: never; a source longer than the model accepts gets an empty line and a warning)",
    )
    g = p.add_argument_group("batches and streaming")
    g.add_argument(
        "--batch_size",
        type=int_in_range(1),
        help=f"sentences per batch (default {DEFAULT_BATCH_SIZE} without --max_tokens)",
    )
    g.add_argument("--max_tokens", type=int_in_range(1), help="source tokens per batch (sentences x longest source)")
    g.add_argument(
        "--buffer_size",
        type=int_in_range(1),
        default=DEFAULT_BUFFER_SIZE,
        help="input lines read ahead and sorted into batches; a pipe's lines are translated as they arrive",
    )


def check_model_location(args: argparse.Namespace) -> None:
    """Exactly one of `--model` / `--onnx`, naming a folder that holds what it should: a training run folder given
    for its model folder, or a folder without a model, is refused saying what to pass."""
    if (args.model is None) == (args.onnx is None):
        raise DataError("pass exactly one of --model and --onnx.")
    if args.onnx is not None:
        folder = Path(args.onnx)
        if not folder.is_dir():
            raise DataError(
                f"--onnx {args.onnx}: no such folder (a folder written by python -m hf_variants.export_onnx)."
            )
        if not (folder / "config.json").is_file():
            raise DataError(
                f"--onnx {args.onnx}: no config.json, not an ONNX export (python -m hf_variants.export_onnx "
                "writes one)."
            )
        return
    folder = Path(args.model)
    if not folder.is_dir():
        if folder.exists() or args.model.startswith((".", "/")) or args.model.count("/") > 1:
            raise DataError(f"--model {args.model}: no such model folder.")
        return  # a Hub id
    if (folder / "config.json").is_file() or (folder / checkpointing.MARKER).is_file():
        return
    if (folder / "model" / "config.json").is_file():
        raise DataError(
            f"--model {args.model} is a training run folder: pass its saved model, --model {folder / 'model'} "
            f"(or one of its checkpoints, {folder / 'checkpoints'}/step_N)."
        )
    raise DataError(
        f"--model {args.model}: no config.json; pass a saved model folder (a run's model/), a checkpoint folder "
        "(a run's checkpoints/step_N) or a Hub id."
    )


def checkpoint_config_dir(path: Path) -> Path:
    """The run's model config of a training checkpoint folder (`run_dir/checkpoints/step_N`)."""
    from .trainer import MODEL_CONFIG_DIR

    run_dir = path.parent.parent
    # written when the run starts (a run still training has it), else the finished run's model folder
    candidates = [run_dir / MODEL_CONFIG_DIR, run_dir / "model"]
    config_dir = next((d for d in candidates if (d / "config.json").is_file()), None)
    if config_dir is None:
        raise DataError(
            f"{path} is a checkpoint, but neither {candidates[0]}/config.json nor "
            f"{candidates[1]}/config.json (the run's config) exists; pass the run's model "
            f"folder instead."
        )
    return config_dir


def load_configs(args: argparse.Namespace):
    """The model's config and generation config, without its weights (cheap: checks run on them before loading)."""
    from transformers import AutoConfig, GenerationConfig

    location = args.onnx or args.model
    path = Path(location)
    if args.model is not None and (path / checkpointing.MARKER).is_file():
        path = checkpoint_config_dir(path)
    trust = args.trust_remote_code and args.onnx is None
    config = AutoConfig.from_pretrained(str(path) if path.is_dir() else location, trust_remote_code=trust)
    try:
        generation = GenerationConfig.from_pretrained(str(path) if path.is_dir() else location)
    except OSError:
        generation = GenerationConfig.from_model_config(config)
    return config, generation


def load_model_and_tokenizer(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False):
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer

    from ..pipeline_translation import check_tokenizer_fits_model

    path = Path(model_path)
    if (path / checkpointing.MARKER).is_file():  # run_dir/checkpoints/step_N: the run's config + these weights
        run_dir = path.parent.parent
        config_dir = checkpoint_config_dir(path)
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


def load_translation_model(args: argparse.Namespace):
    """The model and tokenizer of `--model` or `--onnx`, the PyTorch model quantized for the CPU with `--int8` (an
    ONNX model then loads its int8 export)."""
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


def target_language(tgt_lang: str | None, config) -> str | None:
    """`--tgt_lang`, or when it is not given the model's one target language (`config.target_languages`, recorded
    by train.py; for a two-language model saved without it and without tags, its second language)."""
    return tgt_lang or default_target_language(config)


# ------------------------------------------------------------------------------------------------------- input
def _decode_line(raw: bytes, label: str, number: int) -> str:
    try:
        return raw.decode("utf-8-sig" if number == 1 else "utf-8").rstrip("\r\n")
    except UnicodeDecodeError as err:
        raise DataError(f"{label}: line {number} is not valid UTF-8 ({err.reason}).") from err


def _open_binary(path: str):
    try:
        return gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")
    except OSError as err:
        raise DataError(f"cannot read {path}: {err.strerror or err}") from err


def iter_lines(path: str) -> Iterator[str]:
    """The lines of a text file (plain or .gz) or of stdin (`-`), read lazily, without terminators; bad UTF-8 names
    the line; a byte-order mark at the start is dropped."""
    if path == STDIO:
        try:
            yield from LineReader(sys.stdin.buffer, "stdin")
        except ValueError as err:
            raise DataError(str(err)) from None
        return
    with _open_binary(path) as f:
        try:
            for number, raw in enumerate(f, 1):
                yield _decode_line(raw, path, number)
        except (OSError, EOFError) as err:
            raise DataError(f"cannot read {path}: {err}") from err


def count_lines(path: str) -> int:
    """The number of lines of a text file (plain or .gz), counted without holding them."""
    count, last = 0, b"\n"
    with _open_binary(path) as f:
        try:
            while chunk := f.read(1 << 20):
                count += chunk.count(b"\n")
                last = chunk[-1:]
        except (OSError, EOFError) as err:
            raise DataError(f"cannot read {path}: {err}") from err
    return count + (last != b"\n")


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


def read_annotation_files(items: list[str], jsonl: bool) -> tuple[dict[str, str], list[str]]:
    """`--source_annotation` values: NAME=FILE pairs, and (JSONL input only) NAMEs read from the rows."""
    files, from_rows = {}, []
    for item in items:
        name, sep, path = item.partition("=")
        if not name:
            raise DataError(f"--source_annotation expects NAME=FILE, got {item!r}")
        if sep:
            files[name] = path
        elif jsonl:
            from_rows.append(name)
        else:
            raise DataError(f"--source_annotation expects NAME=FILE (NAME alone reads JSONL rows), got {item!r}")
    return files, from_rows


@dataclass
class InputLine:
    """One input line: its source, and what goes with it (the JSONL row's target side, its annotations, the
    reference of each --references file, the --prefix line)."""

    source: str
    row_reference: str | None = None
    annotations: dict = field(default_factory=dict)
    references: list[str] = field(default_factory=list)
    prefix: str | None = None


_END = object()


def _zip_aligned(label: str, main: Iterator, others: dict[str, Iterator]) -> Iterator[tuple]:
    """(item of `main`, {name: line of each other file}) pairs; a file with fewer or more lines than `main` raises a
    DataError naming both (the counts were compared before the model loaded where the input is a file)."""
    count = 0
    for item in main:
        values = {}
        for name, lines in others.items():
            value = next(lines, _END)
            if value is _END:
                raise DataError(f"{label} has more lines than {name} ({count}); line {count + 1} has no counterpart.")
            values[name] = value
        count += 1
        yield item, values
    for name, lines in others.items():
        if next(lines, _END) is not _END:
            raise DataError(f"{label} has {count} lines but {name} has more; line {count + 1} has no counterpart.")


def iter_input(args: argparse.Namespace, plan: Plan, lines: Iterator[str]) -> Iterator[InputLine]:
    """The input lines with their references, annotations and prefixes, read lazily (see the module docstring)."""
    others = {f"--prefix {args.prefix}": iter_lines(args.prefix)} if args.prefix else {}
    for path in args.references or []:
        others[f"--references {path}"] = iter_lines(path)
    for name, path in plan.annotation_files.items():
        others[f"--source_annotation {name}={path}"] = iter_lines(path)
    for number, (line, values) in enumerate(_zip_aligned(plan.input_label, lines, others), 1):
        if plan.jsonl:
            where = f"{plan.input_label}:{number}"
            obj = parse_jsonl_line(line, where)
            source, lang, reference = _row_source(obj, where, args.src_lang, plan.tgt_lang)
            if lang is not None:
                plan.source_langs.add(lang)
            item = InputLine(source, reference)
            for name in plan.annotations_from_rows:
                value = obj.get(name)
                if isinstance(value, dict):
                    value = value.get(lang) if lang is not None else None
                if value is None and source.strip():
                    raise DataError(
                        f'{where}: no {name!r} for the source (expected "{name}": value or '
                        f'{{"{lang or "lang"}": value}}).'
                    )
                item.annotations[name] = value
        else:
            item = InputLine(line)
        for name, path in plan.annotation_files.items():
            item.annotations[name] = values[f"--source_annotation {name}={path}"]
        item.references = [values[f"--references {path}"] for path in args.references or []]
        if args.prefix:
            item.prefix = values[f"--prefix {args.prefix}"]
        yield item


# ------------------------------------------------------------------------------------------------------ output
class StreamOutput:
    """Output lines written as they come: to stdout (flushed after each line), or to a hidden temporary sibling of
    the file, renamed over it by `commit()` when complete (a reader sees the old file or the whole new one; `discard()`
    removes the part on a failure)."""

    def __init__(self, path: str):
        self.path = path
        if path == STDIO:
            self.stream, self.tmp = sys.stdout.buffer, None
        else:
            target = Path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = target.with_name(f".{target.name}.tmp-{uuid.uuid4().hex[:8]}")
            self.stream = open(self.tmp, "wb")

    def write(self, line: str) -> None:
        self.stream.write((line + "\n").encode("utf-8"))
        if self.tmp is None:
            self.stream.flush()

    def commit(self) -> None:
        if self.tmp is None:
            self.stream.flush()
            return
        self.stream.close()
        os.replace(self.tmp, self.path)

    def discard(self) -> None:
        if self.tmp is not None:
            self.stream.close()
            with contextlib.suppress(OSError):
                self.tmp.unlink()


def format_result(result, output_format: str, alignments: bool) -> str:
    """One output line: the best translation (text; ` ||| ` and its alignment with `alignments`), or the JSON object
    with every hypothesis (jsonl)."""
    if output_format == "text":
        text = result.text.replace("\n", " ")
        if alignments:
            return f"{text} ||| {result.hypotheses[0].pharaoh() if result.hypotheses else ''}"
        return text
    record: dict = {
        "source": result.source,
        "hypotheses": [h.to_dict(scores=True, alignments=alignments) for h in result.hypotheses],
    }
    for hypothesis in record["hypotheses"]:
        hypothesis["text"] = hypothesis["text"].replace("\n", " ")
    if result.skipped:
        record["skipped"] = result.skipped
    if result.truncated:
        record["truncated"] = True
    return json.dumps(record, ensure_ascii=False)


def check_outputs(args: argparse.Namespace, annotation_files: dict[str, str]) -> None:
    """Before anything loads: `--output` and `--results_json` can be written as files (no folder, a parent that is
    a writable folder or can be made), are not the same file, and are not, do not hold and do not lie inside any
    input (`--input`, `--references`, `--prefix`, `--source_annotation` files, the `--model` / `--onnx` /
    `--tokenizer` folders). Raises `OutputPathError` naming the flags."""
    inputs = {
        "--input": None if args.input == STDIO else args.input,
        "--references": list(args.references or []),
        "--prefix": args.prefix,
        "--source_annotation": list(annotation_files.values()),
        "--model": args.model,
        "--onnx": args.onnx,
        "--tokenizer": args.tokenizer,
    }
    check_output_files(
        {"--output": None if args.output == STDIO else args.output, "--results_json": args.results_json}, inputs
    )


# ------------------------------------------------------------------------------------------------------ checks
@dataclass
class Plan:
    """What the checks before loading decided: the input's kind and name, the annotations, the decoding options
    (resolved against the saved generation config), the output format, the target language and the line count
    (None for stdin)."""

    jsonl: bool
    input_label: str
    annotation_files: dict[str, str]
    annotations_from_rows: list[str]
    options: DecodeOptions
    output_format: str
    tgt_lang: str | None
    lines: int | None
    max_source_tokens: int | None
    source_langs: set = field(default_factory=set)


OPTION_FLAGS = tuple(DecodeOptions.__dataclass_fields__)


def _as_flags(message: str) -> str:
    """A core message naming options (`nbest=5 > num_beams=4`, `tgt_lang: ...`) as the command's flags
    (`--nbest 5 > --num_beams 4`, `--tgt_lang: ...`)."""
    import re

    names = "|".join(sorted(OPTION_FLAGS + ("src_lang", "tgt_lang", "prefix"), key=len, reverse=True))
    message = re.sub(rf"(?<![\w-])({names})=", r"--\1 ", message)
    return re.sub(rf"^({names}):", r"--\1:", message)


def decode_options(args: argparse.Namespace, scores: bool) -> DecodeOptions:
    return DecodeOptions(
        num_beams=args.num_beams,
        nbest=args.nbest,
        length_penalty=args.length_penalty,
        do_sample=args.do_sample,
        top_k=args.top_k,
        top_p=args.top_p,
        temperature=args.temperature,
        seed=args.seed,
        max_length=args.max_length,
        max_new_tokens=args.max_new_tokens,
        max_len_a=args.max_len_a,
        max_len_b=args.max_len_b,
        no_repeat_ngram_size=args.no_repeat_ngram_size,
        repetition_penalty=args.repetition_penalty,
        scores=scores,
        alignments=args.alignments,
        max_source_length=args.max_source_length,
    )


def output_format(args: argparse.Namespace) -> str:
    """`--output_format`, auto resolved: jsonl with --nbest > 1 or --scores; text refused with them."""
    wants_json = args.nbest > 1 or args.scores
    if args.output_format == "text" and wants_json:
        flag = f"--nbest {args.nbest}" if args.nbest > 1 else "--scores"
        raise DataError(f"{flag} writes JSON Lines: pass --output_format jsonl (or leave it out).")
    if args.output_format == "auto":
        return "jsonl" if wants_json else "text"
    return args.output_format


def preflight(args: argparse.Namespace) -> Plan:
    """Every check that needs no model weights, before they load: flags and their combinations, output paths,
    the languages against the model's config, the decoding options against its saved generation config, and the
    line counts of the input and its aligned files. Raises DataError / OptionError / OutputPathError."""
    if args.references and STDIO in args.references:
        raise DataError("--references cannot be stdin ('-'); give a file.")
    if args.prefix == STDIO:
        raise DataError("--prefix cannot be stdin ('-'); give a file.")
    jsonl = is_jsonl(args.input, args.input_format)
    annotation_files, annotations_from_rows = read_annotation_files(args.source_annotation, jsonl)
    check_model_location(args)
    if args.alignments and args.onnx:
        raise DataError(
            "--alignments needs the decoder's cross-attention, which ONNX Runtime graphs do not return: "
            "translate with --model (PyTorch) for alignments."
        )
    fmt = output_format(args)
    options = decode_options(args, scores=fmt == "jsonl")
    try:
        options.check(flags=True)
    except OptionError as error:
        raise DataError(str(error)) from None
    try:
        evaluation.check_bleu_tokenize(args.bleu_tokenize)
    except ValueError as error:
        raise DataError(str(error)) from None
    try:
        check_outputs(args, annotation_files)
    except OutputPathError as error:
        build_parser().exit(2, f"error: {error}\n")
    config, generation_config = load_configs(args)
    tgt_lang = target_language(args.tgt_lang, config)
    try:
        check_request_languages(config, args.src_lang, tgt_lang)
    except ValueError as error:
        raise DataError(_as_flags(str(error))) from None
    positions = getattr(config, "max_position_embeddings", None)
    try:
        options = resolve_options(options, generation_config, positions=positions)
    except OptionError as error:
        raise DataError(_as_flags(str(error))) from None
    label = "stdin" if args.input == STDIO else args.input
    lines = None
    if args.input != STDIO:
        lines = count_lines(args.input)
        aligned = {f"--prefix {args.prefix}": args.prefix} if args.prefix else {}
        aligned.update({f"--references {path}": path for path in args.references or []})
        aligned.update({f"--source_annotation {n}={path}": path for n, path in annotation_files.items()})
        for name, path in aligned.items():
            count = count_lines(path)
            if count != lines:
                raise DataError(
                    f"{label} has {lines} lines but {name} has {count}; line {min(lines, count) + 1} has no "
                    "counterpart."
                )
    return Plan(jsonl, label, annotation_files, annotations_from_rows, options, fmt, tgt_lang, lines, positions)


# ------------------------------------------------------------------------------------------------------- run
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
        done = self.total is not None and self.done >= self.total
        if now - self.last >= self.interval or (self.lines and done):
            self.last = now
            self.write(now)

    def write(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        if self.total is None:  # a stream (stdin): no total, no ETA
            print(
                f"progress: {self.done} sentences, {rate:.1f} sentences/s, elapsed {_duration(elapsed)}",
                file=self.stream,
                flush=True,
            )
            self.lines += 1
            return
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


@dataclass
class Tally:
    """What the run met, for the summary and the warnings."""

    sentences: int = 0
    empty: list[int] = field(default_factory=list)
    too_long: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    translated: int = 0


def translate_stream(args: argparse.Namespace, plan: Plan, translator: Translator, out: StreamOutput) -> tuple:
    """Read, translate and write the input in buffers; returns (tally, hypotheses and references when the
    translations are scored, else None)."""
    if args.input == STDIO:
        reader = LineReader(sys.stdin.buffer, "stdin")
        lines, ready = _stdin_lines(reader), reader.ready
    else:
        lines, ready = iter_lines(args.input), None
    pending: dict[int, InputLine] = {}
    tally = Tally()
    keep_file_refs = bool(args.references)
    keep_row_refs = plan.jsonl and not args.references
    hyps: list[str] = []
    file_refs: list[list[str]] = []
    row_refs: list[str] = []
    first_without_target: list[int] = []

    def requests():
        for index, item in enumerate(iter_input(args, plan, lines)):
            pending[index] = item
            yield TranslationRequest(
                item.source,
                src_lang=args.src_lang,
                tgt_lang=plan.tgt_lang,
                prefix=item.prefix or None,
                annotations=item.annotations,
            )

    batching = {"batch_size": args.batch_size, "max_tokens": args.max_tokens}
    if args.batch_size is None and args.max_tokens is None:
        batching["batch_size"] = DEFAULT_BATCH_SIZE
    with progress_bar(plan.lines, args.no_progress, args.progress_interval) as bar:
        results = translator.translate_stream(
            requests(), plan.options, buffer_size=args.buffer_size, ready=ready, progress=bar.update, **batching
        )
        for result in results:
            item = pending.pop(result.index)
            line = result.index + 1
            tally.sentences += 1
            if result.skipped == "empty":
                tally.empty.append(line)
            elif result.skipped:
                tally.too_long.append(line)
                logger.warning(
                    "line %d: %d tokens (special tokens included), more than this model accepts (%d, "
                    "config.max_position_embeddings); its output line is empty",
                    line,
                    result.source_tokens,
                    plan.max_source_tokens,
                )
            else:
                tally.translated += 1
            if result.truncated:
                tally.truncated.append(line)
                logger.warning(
                    "line %d: truncated from %d to %d tokens (--max_source_length)",
                    line,
                    result.source_tokens,
                    args.max_source_length,
                )
            out.write(format_result(result, plan.output_format, args.alignments))
            if keep_file_refs or keep_row_refs:
                hyps.append(result.text)
            if keep_file_refs:
                file_refs.append(item.references)
            if keep_row_refs:
                if item.row_reference is None:
                    if not first_without_target:
                        first_without_target.append(line)
                    keep_row_refs = keep_file_refs  # not every row has a target side: nothing to score against
                    row_refs.clear()
                    if not keep_file_refs:
                        hyps.clear()
                else:
                    row_refs.append(item.row_reference)
    if args.references:
        sets = [list(refs) for refs in zip(*file_refs)] if file_refs else [[] for _ in args.references]
        return tally, (hyps, sets, " ".join(args.references))
    if plan.jsonl and first_without_target:
        logger.warning(
            "not every row of %s has a target side (line %d has none): not scoring against them",
            plan.input_label,
            first_without_target[0],
        )
    if keep_row_refs and tally.sentences:
        return tally, (hyps, [row_refs], f"{plan.input_label} (target side)")
    return tally, None


def _stdin_lines(reader: LineReader) -> Iterator[str]:
    try:
        yield from reader
    except ValueError as err:
        raise DataError(str(err)) from None


def build_result(args: argparse.Namespace, plan: Plan, tally: Tally, elapsed: float, engine: str) -> dict:
    """The run's summary (printed as JSON and written to `--results_json`)."""
    options = plan.options
    result = {
        "model": args.model or args.onnx,
        "onnx": bool(args.onnx),
        "engine": engine,
        "input": plan.input_label,
        "output": "stdout" if args.output == STDIO else args.output,
        "output_format": plan.output_format,
        "sentences": tally.sentences,
        "empty_inputs": len(tally.empty),
        "too_long_inputs": len(tally.too_long),
        "too_long_lines": tally.too_long,
        "truncated_inputs": len(tally.truncated),
        "truncated_lines": tally.truncated,
        "max_source_tokens": plan.max_source_tokens,
        "max_source_length": options.max_source_length,
        "src_lang": args.src_lang,
        "tgt_lang": plan.tgt_lang,
        "num_beams": options.num_beams,
        "nbest": options.nbest,
        "length_penalty": options.length_penalty,
    }
    if options.max_length is not None or options.max_new_tokens is not None:
        result.update(max_length=options.max_length, max_new_tokens=options.max_new_tokens)
    else:
        result["length_rule"] = {"max_len_a": options.max_len_a, "max_len_b": options.max_len_b}
    if options.do_sample:
        result.update(
            do_sample=True,
            top_k=options.top_k,
            top_p=options.top_p,
            temperature=options.temperature,
            seed=options.seed,
        )
    for name in ("no_repeat_ngram_size", "repetition_penalty", "prefix"):
        value = getattr(args, name)
        if value is not None:
            result[name] = value
    if options.alignments:
        result["alignments"] = True
    result.update(
        int8=args.int8,
        seconds=round(elapsed, 2),
        sentences_per_sec=round(tally.translated / max(elapsed, 1e-9), 2),
    )
    return result


def add_scores(result: dict, scored, bleu_tokenize: str) -> None:
    """BLEU, chrF, chrF++ and TER (`evaluation.score`, sacreBLEU with signatures) of the translations against one
    reference set or several."""
    hyps, sets, label = scored
    if not hyps:
        return
    references = sets[0] if len(sets) == 1 else sets
    scores = evaluation.score(hyps, references, tokenize=bleu_tokenize)
    result["references"] = label
    result.update(scores)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    plan = preflight(args)
    model, tokenizer = load_translation_model(args)
    translator = Translator(model, tokenizer)
    start = time.time()
    out = StreamOutput(args.output)
    try:
        tally, scored = translate_stream(args, plan, translator, out)
    except BaseException:
        out.discard()
        raise
    out.commit()
    elapsed = time.time() - start
    if plan.source_langs:
        logger.info("%s: source side %s", plan.input_label, ", ".join(sorted(plan.source_langs)))
    if tally.empty:
        logger.warning(
            "%d empty input lines (e.g. line %d): their output lines are empty", len(tally.empty), tally.empty[0]
        )
    result = build_result(args, plan, tally, elapsed, translator.engine.name)
    if scored is not None:
        add_scores(result, scored, args.bleu_tokenize)
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_file(args.results_json, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), file=sys.stderr if args.output == STDIO else sys.stdout)
    return result


def cli() -> None:
    """The command line (`python -m hf_variants.training.translate`, `hf-variants-translate`). Bad input ends it
    with one line naming the flag, file or line (exit status 2), before the model loads where it can."""
    prog = Path(sys.argv[0]).name or "translate.py"
    try:
        with torch.inference_mode():
            main()
    except (DataError, OptionError, OutputPathError) as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    cli()
