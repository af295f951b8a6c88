"""Translate a file with a trained model (beam search, n-best lists, sampling, prefixes, alignments), streaming, and
score it against references.

    hf-variants-translate --model runs/transformer_nmt-en-de-small/model \\
        --input training/data/multi30k/test_2016_flickr.en.gz --output hyp.de \\
        --references training/data/multi30k/test_2016_flickr.de.gz --tgt_lang de

`--model` is a saved model folder (`run_dir/model`, or a Hub id with `--trust_remote_code`), a training checkpoint
folder (`run_dir/checkpoints/step_N`, loaded into the run's model config; `--weights ema|raw`), or a folder written by
`hf-variants-export-onnx` or `hf-variants-export-ctranslate2`: the engine follows from the folder (`--engine`,
`--precision int8`; `commands/loading.py`). Every sentence goes through the translation core
(`hf_variants.inference.Translator`), as in the pipeline, the server and evaluation during training: the decoding
defaults are the model's saved ones (its generation config: beam size, length penalty and the length rule the run
evaluated with), and a translation does not depend on its batch (the length rule is applied per sentence).

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
`--output_format tsv_pairs`: a training corpus for `hf-variants-train --train_file` (back-translation, distillation):
a header naming the languages (`--src_lang`, else the model's source language, then the target language), then
`source<TAB>translation` per line and hypothesis (with `--nbest`, every hypothesis); a line with an empty source or
translation gives no pair (counted in the summary's `unpaired_lines`, with a warning naming the first); a tab in a
text becomes a space (counted). A corpus tag is training's (`--corpus_tags`), not written into the text.
An empty input line gives an empty output line (`"hypotheses": []`); so does a source longer than the model
accepts (`config.max_position_embeddings` tokens, special tokens included), with a warning naming its line;
`--max_source_length` truncates sources instead, with a warning per line and the count in the summary. With
references, BLEU and chrF (sacreBLEU, signatures included) are printed as JSON (to stderr when the translations go
to stdout) and written to `--results_json`. A progress bar goes to stderr when it is a terminal; elsewhere (nohup, a
SLURM log, CI) a line `progress: D/T sentences (P%), R sentences/s, elapsed H:MM:SS, ETA H:MM:SS` every
`--progress_interval` seconds (`--no_progress` turns both off).

Sampling (`--do_sample`, `--nbest` samples per line, best first by score): with `--seed S` the samples of input line
L come from a generator seeded with `sentence_seed(S, L - 1)` (hf_variants/inference/sampling.py: the first 8 bytes of
SHA-256 of "hf_variants.sample:S:L-1", big-endian, shifted right by one bit), so they do not depend on the batch
size, the buffers, a pipe's timing or the number of processes.

Large jobs (file input and output): `accelerate launch --multi_gpu --num_processes N -m hf_variants.commands.translate
...` splits the input into work units of `--unit_lines` lines among N processes (each on its own GPU, or with
`--num_threads` CPU threads), `--num_shards N --shard_index i` among the tasks of a job array (then `--merge`); each
finished unit is kept in `--work_dir` (default OUTPUT.work), a rerun of the same command does only the others, and
the output is merged at the end, byte-identical to one process (hf_variants/commands/sharding.py). Without these
flags (and one process) a file's output appears atomically when its last line is done, and stdin streams.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..inference import OptionError, TranslationRequest, Translator
from ..inference.batching import LineReader
from ..inference.decode import engine_class
from ..inference.flags import add_option_flags, options_from_args
from ..inference.requests import DecodeOptions
from ..inference.translator import (
    DEFAULT_BUFFER_SIZE,
    check_request_languages,
    default_target_language,
    resolve_options,
)
from ..outputs import atomic_write_file, check_output_files, int_in_range
from ..training import evaluation
from ..training.corpus import DataError
from . import sharding
from .common import add_batching_flags, as_flags, batching, command_parser, run_command
from .inputs import (
    STDIO,
    InputLine,
    count_lines,
    is_jsonl,
    iter_input,
    iter_lines,
    read_annotation_files,
    stdin_lines,
)
from .loading import ModelLocation, add_model_flags, load_translator, locate_model, model_record, read_configs
from .progress import progress_bar
from .sharding import add_sharding_flags

logger = logging.getLogger("hf_variants.translate")
TSV_PAIRS = "tsv_pairs"


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("hf-variants-translate", __doc__, epilog_from=3)
    add_model_flags(p)
    add_io_flags(p)
    add_option_flags(p)
    g = add_batching_flags(p)
    g.add_argument(
        "--buffer_size",
        type=int_in_range(1),
        default=DEFAULT_BUFFER_SIZE,
        help="input lines read ahead and sorted into batches; a pipe's lines are translated as they arrive",
    )
    add_sharding_flags(p)
    g = p.add_argument_group("summary and progress")
    g.add_argument("--results_json", help="write the summary (and scores) here")
    g.add_argument("--no_progress", action="store_true", help="no progress bar or progress lines")
    g.add_argument(
        "--progress_interval",
        type=_non_negative_float,
        default=10.0,
        metavar="SECONDS",
        help="when stderr is no terminal (nohup, a SLURM log, CI): a progress line (sentences done / "
        "total, rate, ETA) every SECONDS seconds, in place of the progress bar (0: after every batch)",
    )
    return p


def add_io_flags(p: argparse.ArgumentParser) -> None:
    """The input, output, reference, language and prefix flags."""
    g = p.add_argument_group("input and output")
    g.add_argument(
        "--input",
        required=True,
        help="source sentences: a text file, one a line (plain or .gz), or JSONL (see --input_format); "
        "'-' reads stdin",
    )
    g.add_argument(
        "--input_format",
        choices=["auto", "text", "jsonl"],
        default="auto",
        help="auto: JSONL for names ending in .jsonl / .jsonl.gz, else text. JSONL rows: "
        '{"translation": {"en": ..., "de": ...}} (the source side is --src_lang, or the '
        'row\'s one language other than the target), {"text": ...} or {"source": ...} '
        '(optionally with "target": ...)',
    )
    g.add_argument(
        "--output",
        required=True,
        help="translations, aligned with the input; '-' writes stdout (the JSON summary then goes to stderr)",
    )
    g.add_argument(
        "--output_format",
        choices=["auto", "text", "jsonl", TSV_PAIRS],
        default="auto",
        help="text: one translation a line; jsonl: one object a line with the n-best hypotheses, their scores, "
        "log-probabilities and tokens; tsv_pairs: a training corpus for hf-variants-train --train_file (a header "
        "SRC<TAB>TGT naming the languages, then source<TAB>translation per line and hypothesis; lines with an "
        "empty source or translation left out and counted); auto: jsonl with --nbest > 1 or --scores, else text",
    )
    g.add_argument(
        "--references",
        nargs="+",
        metavar="FILE",
        help="reference translations (plain or .gz), one file per reference set (several: multi-reference scores); "
        "default for JSONL input: the rows' target side, when every row has one",
    )
    g.add_argument(
        "--bleu_tokenize",
        default="13a",
        help="sacreBLEU's BLEU tokenizer: 13a, intl, zh, char, none, ja-mecab, ko-mecab",
    )
    g.add_argument(
        "--source_annotation",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a per-sentence model input aligned with --input (e.g. parses=test.en.parses for the "
        "syntactic MG-SA); with JSONL input, NAME alone reads each row's NAME (a value, or "
        "{lang: value}); repeatable",
    )
    g.add_argument("--src_lang", help="source language (checked against the model's)")
    g.add_argument("--tgt_lang", help="target language (needed by models translating into several)")
    g.add_argument(
        "--prefix",
        metavar="FILE",
        help="target prefixes, one a line aligned with --input (a line may be empty): each translation begins "
        "with its prefix's tokens",
    )


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


def check_outputs(
    args: argparse.Namespace, location: ModelLocation, annotation_files: dict[str, str], work: bool = False
) -> None:
    """Before anything loads: `--output` and `--results_json` can be written as files (no folder, a parent that is
    a writable folder or can be made), are not the same file, and are not, do not hold and do not lie inside any
    input (`--input`, `--references`, `--prefix`, `--source_annotation` files, the model and tokenizer folders);
    for a sharded run (`work`) the work folder neither. Raises `OutputPathError` naming the flags."""
    inputs = {
        "--input": None if args.input == STDIO else args.input,
        "--references": list(args.references or []),
        "--prefix": args.prefix,
        "--source_annotation": list(annotation_files.values()),
        "--onnx" if args.onnx else "--model": location.path,
        "--tokenizer": args.tokenizer,
    }
    check_output_files(
        {"--output": None if args.output == STDIO else args.output, "--results_json": args.results_json}, inputs
    )
    if work:
        sharding.check_work_dir(args, inputs)


# ------------------------------------------------------------------------------------------------------ checks
@dataclass
class Plan:
    """What the checks before loading decided: the model's location, the input's kind and name, the annotations,
    the decoding options (resolved against the saved generation config), the output format, the target language
    and the line count (None for stdin)."""

    location: ModelLocation
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
    header: str | None = None  # the output's first line (tsv_pairs: the languages of its columns)
    work: bool = False  # a sharded, resumable run (`sharding`)


def output_format(args: argparse.Namespace) -> str:
    """`--output_format`, auto resolved: jsonl with --nbest > 1 or --scores; text refused with them; tsv_pairs
    refused with what it cannot hold (scores, alignments) and with --references (its lines are not the input's)."""
    wants_json = args.nbest > 1 or args.scores
    if args.output_format == "text" and wants_json:
        flag = f"--nbest {args.nbest}" if args.nbest > 1 else "--scores"
        raise DataError(f"{flag} writes JSON Lines: pass --output_format jsonl (or leave it out).")
    if args.output_format == TSV_PAIRS:
        unfit = [flag for flag, on in (("--scores", args.scores), ("--alignments", args.alignments)) if on]
        if unfit:
            raise DataError(f"--output_format tsv_pairs writes source<TAB>translation pairs only: drop {unfit[0]}.")
        if args.references:
            raise DataError(
                "--output_format tsv_pairs leaves out the lines without a pair, so its lines are not the input's: "
                "score against --references with --output_format text (or jsonl)."
            )
    if args.output_format == "auto":
        return "jsonl" if wants_json else "text"
    return args.output_format


def pairs_header(args: argparse.Namespace, config, tgt_lang: str | None) -> str:
    """The header of a tsv_pairs output: the source and target languages (`--src_lang`, else the model's one source
    language; the target language), as hf-variants-train's TSV reader expects them."""
    from ..inference.translator import model_languages

    sources, _ = model_languages(config)
    src_lang = args.src_lang or (sources[0] if len(sources) == 1 else None)
    missing = [flag for flag, lang in (("--src_lang", src_lang), ("--tgt_lang", tgt_lang)) if lang is None]
    if missing:
        raise DataError(
            f"--output_format tsv_pairs names the languages of its columns in its header: pass {missing[0]} "
            "(the model does not record a single one)."
        )
    if src_lang == tgt_lang:
        raise DataError(f"--output_format tsv_pairs: the source and target languages are both {src_lang!r}.")
    return f"{src_lang}\t{tgt_lang}"


def check_options(args: argparse.Namespace, location: ModelLocation, output_format: str) -> DecodeOptions:
    """The decoding flags as options, checked on their own and against the engine (a DataError naming the flag)."""
    try:
        options = options_from_args(args, scores=output_format == "jsonl").check(flags=True)
    except OptionError as error:
        raise DataError(str(error)) from None
    why = engine_class(location.engine).unsupported(options)
    if why:
        name, _, reason = why.partition(":")
        raise DataError(f"--{name}:{reason}")
    return options


def check_aligned_files(args: argparse.Namespace, label: str, annotation_files: dict[str, str]) -> int | None:
    """The input's line count, each file aligned with it (prefixes, references, annotations) checked to have as many
    lines (None: stdin, counted as it is read)."""
    if args.input == STDIO:
        return None
    lines = count_lines(args.input)
    aligned = {f"--prefix {args.prefix}": args.prefix} if args.prefix else {}
    aligned.update({f"--references {path}": path for path in args.references or []})
    aligned.update({f"--source_annotation {n}={path}": path for n, path in annotation_files.items()})
    for name, path in aligned.items():
        count = count_lines(path)
        if count != lines:
            raise DataError(
                f"{label} has {lines} lines but {name} has {count}; line {min(lines, count) + 1} has no counterpart."
            )
    return lines


def preflight(args: argparse.Namespace) -> Plan:
    """Every check that needs no model weights, before they load: flags and their combinations, output paths,
    the model's folder against its engine, the languages against the model's config, the decoding options against
    its saved generation config and its engine, and the line counts of the input and its aligned files. Raises
    DataError / OptionError / OutputPathError / UsageError."""
    if args.references and STDIO in args.references:
        raise DataError("--references cannot be stdin ('-'); give a file.")
    if args.prefix == STDIO:
        raise DataError("--prefix cannot be stdin ('-'); give a file.")
    jsonl = is_jsonl(args.input, args.input_format)
    annotation_files, annotations_from_rows = read_annotation_files(args.source_annotation, jsonl)
    location = locate_model(args)
    fmt = output_format(args)
    options = check_options(args, location, fmt)
    try:
        evaluation.check_bleu_tokenize(args.bleu_tokenize)
    except ValueError as error:
        raise DataError(str(error)) from None
    work = sharding.wanted(args)
    if work:
        sharding.check_flags(args, {"--input": args.input})
    check_outputs(args, location, annotation_files, work)
    config, generation_config = read_configs(location)
    tgt_lang = target_language(args.tgt_lang, config)
    try:
        check_request_languages(config, args.src_lang, tgt_lang)
    except ValueError as error:
        raise DataError(as_flags(str(error))) from None
    positions = getattr(config, "max_position_embeddings", None)
    try:
        options = resolve_options(options, generation_config, positions=positions)
    except OptionError as error:
        raise DataError(as_flags(str(error))) from None
    label = "stdin" if args.input == STDIO else args.input
    lines = check_aligned_files(args, label, annotation_files)
    plan = Plan(
        location, jsonl, label, annotation_files, annotations_from_rows, options, fmt, tgt_lang, lines, positions
    )
    if fmt == TSV_PAIRS:
        plan.header = pairs_header(args, config, tgt_lang)
    plan.work = work
    return plan


def target_language(tgt_lang: str | None, config) -> str | None:
    """`--tgt_lang`, or when it is not given the model's one target language (`config.target_languages`, recorded
    by train.py; for a two-language model saved without it and without tags, its second language)."""
    return tgt_lang or default_target_language(config)


# ------------------------------------------------------------------------------------------------------- run
@dataclass
class Tally:
    """What the run met, for the summary and the warnings (line numbers 1-based); with `tsv_pairs` also the pairs
    written, the lines that gave none (an empty source or translation) and those whose text held a tab."""

    sentences: int = 0
    empty: list[int] = field(default_factory=list)
    too_long: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    translated: int = 0
    pairs: int = 0
    unpaired: list[int] = field(default_factory=list)
    tabs: list[int] = field(default_factory=list)

    def counts(self) -> dict:
        """The tally as a JSON object (a work unit's record)."""
        return dict(self.__dict__)

    def add(self, counts: dict) -> None:
        """Add a work unit's counts (`counts()`), in input order."""
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + value)


class ResultLines:
    """Translation results as output lines (`format_result`; with `tsv_pairs` one `source<TAB>translation` line per
    non-empty hypothesis), counting what the run met in `tally` and warning per line about sources longer than the
    model accepts and truncated sources."""

    def __init__(self, args: argparse.Namespace, plan: Plan, tally: Tally):
        self.args, self.plan, self.tally = args, plan, tally

    def __call__(self, result, line: int) -> list[str]:
        tally, plan = self.tally, self.plan
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
                self.args.max_source_length,
            )
        if plan.output_format != TSV_PAIRS:
            return [format_result(result, plan.output_format, self.args.alignments)]
        return self.pairs(result, line)

    def pairs(self, result, line: int) -> list[str]:
        """`source<TAB>translation` per non-empty hypothesis (a tab in either replaced by a space, counted)."""
        source = result.source
        out = []
        for hypothesis in result.hypotheses if source.strip() else []:
            text = hypothesis.text.replace("\n", " ")
            if not text.strip():
                continue
            if "\t" in source or "\t" in text:
                if not self.tally.tabs or self.tally.tabs[-1] != line:
                    self.tally.tabs.append(line)
                source, text = source.replace("\t", " "), text.replace("\t", " ")
            out.append(f"{source}\t{text}")
        if not out:
            self.tally.unpaired.append(line)
        self.tally.pairs += len(out)
        return out


class ReferenceSets:
    """The 1-best translations and their references, kept when the run is scored: against `--references` (one list
    per file), or a JSONL input's target side when every row has one (with a warning naming the first row without
    one, and then no scores)."""

    def __init__(self, args: argparse.Namespace, plan: Plan):
        self.args, self.plan = args, plan
        self.keep_file_refs = bool(args.references)
        self.keep_row_refs = plan.jsonl and not args.references and plan.output_format != TSV_PAIRS
        self.hyps: list[str] = []
        self.file_refs: list[list[str]] = []
        self.row_refs: list[str] = []
        self.first_without_target: int | None = None

    def add(self, text: str, item: InputLine, line: int) -> None:
        if self.keep_file_refs or self.keep_row_refs:
            self.hyps.append(text)
        if self.keep_file_refs:
            self.file_refs.append(item.references)
        if not self.keep_row_refs:
            return
        if item.row_reference is None:
            self.first_without_target = self.first_without_target or line
            self.keep_row_refs = False  # not every row has a target side: nothing to score against
            self.row_refs.clear()
            if not self.keep_file_refs:
                self.hyps.clear()
        else:
            self.row_refs.append(item.row_reference)

    def scored(self, sentences: int) -> tuple | None:
        """(hypotheses, reference sets, label) to score, or None."""
        args, plan = self.args, self.plan
        if args.references:
            refs = self.file_refs
            sets = [list(r) for r in zip(*refs)] if refs else [[] for _ in args.references]
            return self.hyps, sets, " ".join(args.references)
        if plan.jsonl and self.first_without_target is not None:
            logger.warning(
                "not every row of %s has a target side (line %d has none): not scoring against them",
                plan.input_label,
                self.first_without_target,
            )
        if self.keep_row_refs and sentences:
            return self.hyps, [self.row_refs], f"{plan.input_label} (target side)"
        return None


def request_of(args: argparse.Namespace, plan: Plan, item: InputLine, index: int) -> TranslationRequest:
    """The request of input line `index` (0-based: it seeds the line's samples, `sampling.sentence_seed`)."""
    return TranslationRequest(
        item.source,
        src_lang=args.src_lang,
        tgt_lang=plan.tgt_lang,
        prefix=item.prefix or None,
        annotations=item.annotations,
        index=index,
    )


def translate_stream(args: argparse.Namespace, plan: Plan, translator: Translator, out: StreamOutput) -> tuple:
    """Read, translate and write the input in buffers; returns (tally, hypotheses and references when the
    translations are scored, else None)."""
    if args.input == STDIO:
        reader = LineReader(sys.stdin.buffer, "stdin")
        lines, ready = stdin_lines(reader), reader.ready
    else:
        lines, ready = iter_lines(args.input), None
    pending: dict[int, InputLine] = {}
    tally = Tally()
    output_lines = ResultLines(args, plan, tally)
    references = ReferenceSets(args, plan)

    def requests():
        for index, item in enumerate(iter_input(args, plan, lines)):
            pending[index] = item
            yield request_of(args, plan, item, index)

    if plan.header is not None:
        out.write(plan.header)
    with progress_bar(plan.lines, args.no_progress, args.progress_interval) as bar:
        results = translator.translate_stream(
            requests(), plan.options, buffer_size=args.buffer_size, ready=ready, progress=bar.update, **batching(args)
        )
        for result in results:
            item = pending.pop(result.index)
            for line in output_lines(result, result.index + 1):
                out.write(line)
            references.add(result.text, item, result.index + 1)
    return tally, references.scored(tally.sentences)


def build_result(args: argparse.Namespace, plan: Plan, tally: Tally, elapsed: float) -> dict:
    """The run's summary (printed as JSON and written to `--results_json`)."""
    options = plan.options
    result = {
        **model_record(plan.location),
        "onnx": plan.location.engine == "onnx",
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
    if plan.output_format == TSV_PAIRS:
        result.update(pairs=tally.pairs, unpaired_lines=len(tally.unpaired), tab_lines=len(tally.tabs))
    result.update(
        int8=plan.location.precision == "int8",
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


def report(args: argparse.Namespace, plan: Plan, tally: Tally, scored, elapsed: float, extra=None) -> dict:
    """The end of a run: the warnings about what it met, the summary (with `extra`) printed as JSON and written to
    `--results_json`; returns the summary."""
    if plan.source_langs:
        logger.info("%s: source side %s", plan.input_label, ", ".join(sorted(plan.source_langs)))
    if tally.empty:
        logger.warning(
            "%d empty input lines (e.g. line %d): their output lines are empty", len(tally.empty), tally.empty[0]
        )
    if tally.unpaired:
        logger.warning(
            "%d input lines gave no pair (an empty source or translation; e.g. line %d): left out of %s",
            len(tally.unpaired),
            tally.unpaired[0],
            args.output,
        )
    if tally.tabs:
        logger.warning(
            "%d lines held a tab in the source or translation (e.g. line %d): replaced by a space in %s",
            len(tally.tabs),
            tally.tabs[0],
            args.output,
        )
    result = build_result(args, plan, tally, elapsed)
    result.update(extra or {})
    if scored is not None:
        add_scores(result, scored, args.bleu_tokenize)
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_file(args.results_json, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), file=sys.stderr if args.output == STDIO else sys.stdout)
    return result


def main(argv=None) -> dict | None:
    """The command (see the module docstring); returns its summary (None in the processes of a launch but the
    main one, and in a shard that does not merge)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    plan = preflight(args)
    if plan.work:
        from .translate_units import run_job

        return run_job(args, plan)
    translator = load_translator(plan.location)
    start = time.time()
    out = StreamOutput(args.output)
    try:
        tally, scored = translate_stream(args, plan, translator, out)
    except BaseException:
        out.discard()
        raise
    out.commit()
    return report(args, plan, tally, scored, time.time() - start)


def cli() -> None:
    """The command line (`hf-variants-translate`, `python -m hf_variants.commands.translate`). Bad input ends it
    with one line naming the flag, file or line (exit status 2), before the model loads where it can."""

    def run() -> None:
        with torch.inference_mode():
            main()

    run_command(run, Path(sys.argv[0]).name or "translate.py")


if __name__ == "__main__":
    cli()
