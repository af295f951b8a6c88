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

Terminology: `--constraints FILE` (aligned with the input: per line its target phrases, separated by tabs, the
alternative forms of one by `|`; an empty line: none) and `--glossary FILE` (source term<TAB>target term; matching
case-sensitive and on whole words unless `--glossary_ignore_case` / `--glossary_substring`) make the translation
contain those phrases (lexically constrained beam search; greedy search becomes beam search for those sentences, the
summary's `constrained_num_beams` says with how many beams; not on the ctranslate2 engine). JSON Lines output adds
per line `constraints`, `unmet_constraints` (those its best translation misses within the length limit) and with a
glossary `glossary` (`[{"source", "target", "found"}]`); the summary counts the sentences with constraints, those
with all met and the lines with some unmet, and with a glossary gives term accuracy (`commands/translate_terms.py`).

Large jobs (file input and output): `accelerate launch --multi_gpu --num_processes N -m hf_variants.commands.translate
...` splits the input into work units of `--unit_lines` lines among N processes (each on its own GPU, or with
`--num_threads` CPU threads), `--num_shards N --shard_index i` among the tasks of a job array (then `--merge`); each
finished unit is kept in `--work_dir` (default OUTPUT.work), a rerun of the same command does only the others, and
the output is merged at the end, byte-identical to one process (hf_variants/commands/sharding.py). Without these
flags (and one process) a file's output appears atomically when its last line is done, and stdin streams.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

import torch

from ..inference import OptionError, Translator
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
from ..outputs import check_output_files, int_in_range
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
from .loading import ModelLocation, add_model_flags, load_translator, locate_model, read_configs
from .progress import progress_bar
from .sharding import add_sharding_flags
from .translate_io import (
    TSV_PAIRS,
    Plan,
    ReferenceSets,
    ResultLines,
    StreamOutput,
    Tally,
    report,
    request_of,
)
from .translate_terms import add_terms_flags, check_terms, line_error
from .translate_units import run_job

logger = logging.getLogger("hf_variants.translate")


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
    add_terms_flags(p)
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
        "--constraints": args.constraints,
        "--glossary": args.glossary,
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
    """The input's line count, each file aligned with it (prefixes, constraints, references, annotations) checked to
    have as many lines (None: stdin, counted as it is read)."""
    if args.input == STDIO:
        return None
    lines = count_lines(args.input)
    aligned = {f"--prefix {args.prefix}": args.prefix} if args.prefix else {}
    if args.constraints:
        aligned[f"--constraints {args.constraints}"] = args.constraints
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
    for flag, path in (("--constraints", args.constraints), ("--glossary", args.glossary)):
        if path == STDIO:
            raise DataError(f"{flag} cannot be stdin ('-'); give a file.")
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
    glossary = check_terms(args, location.engine, options)
    plan = Plan(
        location, jsonl, label, annotation_files, annotations_from_rows, options, fmt, tgt_lang, lines, positions
    )
    plan.glossary = glossary
    if fmt == TSV_PAIRS:
        plan.header = pairs_header(args, config, tgt_lang)
    plan.work = work
    return plan


def target_language(tgt_lang: str | None, config) -> str | None:
    """`--tgt_lang`, or when it is not given the model's one target language (`config.target_languages`, recorded
    by train.py; for a two-language model saved without it and without tags, its second language)."""
    return tgt_lang or default_target_language(config)


# ------------------------------------------------------------------------------------------------------- run
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
        try:
            for result in results:
                item = pending.pop(result.index)
                for line in output_lines(result, result.index + 1):
                    out.write(line)
                references.add(result.text, item, result.index + 1)
        except ValueError as error:
            refused = line_error(error, args, plan.input_label, 1)
            if refused is None:
                raise
            raise refused from None
    return tally, references.scored(tally.sentences)


def main(argv=None) -> dict | None:
    """The command (see the module docstring); returns its summary (None in the processes of a launch but the
    main one, and in a shard that does not merge)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    plan = preflight(args)
    if plan.work:
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
