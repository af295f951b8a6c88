"""Score given translation pairs: the log-probability of each target line given its source line (forced decoding).

    hf-variants-score --model runs/transformer_nmt-en-de-small/model \\
        --source test.en --target test.de --output scores.jsonl

`--model` takes every model folder `hf-variants-translate` takes (a saved model, a training checkpoint, an ONNX or a
CTranslate2 export; the engine follows from it: `--engine`, `--precision int8`). Used to filter noisy parallel data, to
rerank n-best lists and to compare models on a reference (fairseq-generate --score-reference, marian-scorer,
OpenNMT-py's translate -tgt, CTranslate2's score_batch).

Input: `--source` and `--target`, text files (plain or .gz) with one sentence a line, line-aligned: files of
different line counts are refused, naming both counts, before anything loads. An empty target line scores its
end-of-sentence token alone; an empty source line is scored as the model sees it (its end-of-sentence token).

Output (`--output`, default `-`: stdout), one line per input pair, in input order:
  jsonl (default)  {"log_prob": -7.31, "tokens": 9, "ppl": 2.25}  (`--token_scores` adds "token_log_probs")
  tsv              log_prob<TAB>tokens<TAB>ppl  (`--token_scores` adds a column of space-separated token scores)
`log_prob` is the natural-log probability of the target given the source, summed over its tokens (subwords, the
end-of-sentence token included: `tokens` of them); `ppl` = exp(-log_prob / tokens). The number equals the
`log_prob` that `hf-variants-translate --nbest` reports for the same hypothesis, and the token-weighted mean of
-log_prob over a set is the model's cross-entropy on it. A pair longer than the model accepts
(`config.max_position_embeddings` tokens on either side) gets null scores (nan in TSV) and a warning naming its
line.

N-best lists (`--nbest_input FILE.jsonl`, hf-variants-translate's `--nbest` JSON Lines output): every hypothesis
is scored as the target of its line's source (`--reverse`: the line's source as the target of each hypothesis, for a
model of the reverse direction: the noisy channel of reranking, `hf-variants-rerank`), and the output keeps the
structure, one line per input line: `{"source": ..., "hypotheses": [{"text": ..., "log_prob": ..., "tokens": ...,
"ppl": ...}, ...]}` in the input's order (JSON Lines only).

A summary (sentences, scored pairs, target tokens, total and mean log-probability per token, corpus perplexity,
seconds, pairs/s) goes to stderr as JSON, and to `--results_json`. Large inputs are scored across processes
(`accelerate launch`), in job arrays and resumably as hf-variants-translate's (`--unit_lines`, `--num_shards`,
`--merge`: hf_variants/commands/sharding.py), byte-identical to one process.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from ..inference.translator import DEFAULT_BUFFER_SIZE
from ..outputs import atomic_write_file, check_output_files, int_in_range
from ..training.corpus import DataError, read_lines
from . import sharding
from .common import UsageError, add_batching_flags, as_flags, command_parser, exits_on_refusal
from .inputs import STDIO, count_lines, iter_lines
from .loading import ModelLocation, add_model_flags, load_translator, locate_model, read_configs
from .progress import progress_bar
from .score_io import (
    Pairs,
    ScorePlan,
    nbest_pairs,
    nbest_row,
    output_lines,
    report,
    score,
    warn_too_long,
)
from .score_units import run_job
from .sharding import add_sharding_flags

logger = logging.getLogger("hf_variants.score")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("hf-variants-score", __doc__, epilog_from=3)
    add_model_flags(p, what="score")
    g = p.add_argument_group("input and output")
    g.add_argument("--source", help="source sentences, one a line (plain or .gz)")
    g.add_argument("--target", help="target sentences, line-aligned with --source (plain or .gz)")
    g.add_argument(
        "--nbest_input",
        metavar="FILE.jsonl",
        help="instead of --source/--target: hf-variants-translate's n-best JSON Lines; every hypothesis scored, "
        "the output one line per input line with each hypothesis' scores",
    )
    g.add_argument(
        "--reverse",
        action="store_true",
        help="with --nbest_input: score each line's source given each hypothesis (a model of the reverse "
        "direction, the noisy channel of reranking)",
    )
    g.add_argument("--output", default=STDIO, help="the scores, one line per input line; '-' writes stdout")
    g.add_argument("--output_format", choices=["jsonl", "tsv"], default="jsonl")
    g.add_argument(
        "--token_scores",
        action="store_true",
        help="also write each target token's log-probability (fairseq's positional scores)",
    )
    g.add_argument(
        "--source_annotation",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a per-sentence model input aligned with --source (parses=test.en.parses for the syntactic MG-SA); "
        "repeatable",
    )
    g.add_argument("--src_lang", help="source language (checked against the model's languages)")
    g.add_argument("--tgt_lang", help="target language (needed by multilingual models)")
    g = add_batching_flags(p, unit="pairs")
    g.add_argument(
        "--buffer_size",
        type=int_in_range(1),
        default=DEFAULT_BUFFER_SIZE,
        help="input lines scored together (their pairs length-sorted into batches), buffer after buffer",
    )
    add_sharding_flags(p, what="scoring")
    g = p.add_argument_group("summary and progress")
    g.add_argument("--results_json", help="write the summary here")
    g.add_argument("--no_progress", action="store_true", help="no progress bar (shown only on a terminal)")
    return p


# ------------------------------------------------------------------------------------------------------- checks
def check_outputs(
    args: argparse.Namespace, location: ModelLocation, annotation_files: dict[str, str], work: bool = False
) -> None:
    """`--output` and `--results_json` can be written as files, are not the same file, and are not, hold or lie
    inside an input (`--source`, `--target`, `--nbest_input`, annotation files, the model folders); for a sharded
    run (`work`) the work folder neither. Raises `OutputPathError`."""
    inputs = {
        "--source": args.source,
        "--target": args.target,
        "--nbest_input": args.nbest_input,
        "--source_annotation": list(annotation_files.values()),
        "--onnx" if args.onnx else "--model": location.path,
        "--tokenizer": args.tokenizer,
    }
    check_output_files(
        {"--output": None if args.output == STDIO else args.output, "--results_json": args.results_json}, inputs
    )
    if work:
        sharding.check_work_dir(args, inputs)


def check_input_flags(args: argparse.Namespace, files: dict[str, str]) -> None:
    """--source with --target, or --nbest_input (JSON Lines output only; --reverse with it, and then no source
    annotations: its sources are the hypotheses)."""
    pairs = args.source is not None or args.target is not None
    if pairs == (args.nbest_input is not None) or (pairs and (args.source is None or args.target is None)):
        raise UsageError("give --source and --target (line-aligned pairs), or --nbest_input (n-best JSON Lines).")
    if args.reverse and args.nbest_input is None:
        raise UsageError("--reverse scores the hypotheses of --nbest_input in the reverse direction: give it.")
    if args.nbest_input is not None and args.output_format != "jsonl":
        raise UsageError("--nbest_input keeps the n-best structure: --output_format jsonl (the default).")
    if args.reverse and files:
        raise UsageError("--reverse scores the source given each hypothesis: --source_annotation has no source.")


def annotation_files(items: list[str]) -> dict[str, str]:
    files = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not name or not sep or not path:
            raise DataError(f"--source_annotation expects NAME=FILE, got {item!r}.")
        files[name] = path
    return files


def read_pairs(args: argparse.Namespace, files: dict[str, str]) -> Pairs:
    """The source and target lines and the annotation lines, refused (`DataError`) when their counts differ; or the
    pairs of an n-best file."""
    if args.nbest_input is not None:
        rows = [nbest_row(line, f"{args.nbest_input}:{i}") for i, line in enumerate(iter_lines(args.nbest_input), 1)]
        annotations = {name: read_lines(path) for name, path in files.items()}
        for name, path in files.items():
            if len(annotations[name]) != len(rows):
                raise DataError(
                    f"--nbest_input {args.nbest_input} has {len(rows)} lines but {path} ({name}) has "
                    f"{len(annotations[name])}."
                )
        return nbest_pairs(rows, annotations, args.reverse)
    if STDIO in (args.source, args.target):
        raise DataError("--source and --target must be files ('-' is not accepted: both are read whole).")
    sources, targets = read_lines(args.source), read_lines(args.target)
    if len(sources) != len(targets):
        raise DataError(
            f"--source {args.source} has {len(sources)} lines but --target {args.target} has {len(targets)}; "
            f"line {min(len(sources), len(targets)) + 1} has no counterpart."
        )
    annotations = {}
    for name, path in files.items():
        values = read_lines(path)
        if len(values) != len(sources):
            raise DataError(f"--source {args.source} has {len(sources)} lines but {path} ({name}) has {len(values)}.")
        annotations[name] = values
    return Pairs(sources, targets, annotations)


def check_languages(config, src_lang: str | None, tgt_lang: str | None) -> str | None:
    """`--src_lang` / `--tgt_lang` checked against the model's languages as the translate command checks them (the
    core's `check_request_languages`: a multilingual model needs --tgt_lang, an NLLB-200 / M2M100 model with several
    sources --src_lang; a UsageError naming the flag), and the target language to score in: `--tgt_lang`, else the
    model's one target (None: the model records none)."""
    from ..inference.translator import check_request_languages, default_target_language

    try:
        check_request_languages(config, src_lang, tgt_lang)
    except ValueError as error:
        raise UsageError(as_flags(str(error))) from None
    return tgt_lang or default_target_language(config)


def write_output(path: str, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path == STDIO:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(path, text)


def count_aligned(args: argparse.Namespace, files: dict[str, str]) -> int:
    """The input's line count (a sharded run reads its units lazily), the files aligned with it checked to have as
    many lines (a `DataError` naming both counts)."""
    main_flag, main_path = (
        ("--nbest_input", args.nbest_input) if args.nbest_input is not None else ("--source", args.source)
    )
    lines = count_lines(main_path)
    aligned = {} if args.nbest_input is not None else {f"--target {args.target}": args.target}
    aligned.update({f"{path} ({name})": path for name, path in files.items()})
    for name, path in aligned.items():
        count = count_lines(path)
        if count != lines:
            raise DataError(
                f"{main_flag} {main_path} has {lines} lines but {name} has {count}; line {min(lines, count) + 1} "
                "has no counterpart."
            )
    return lines


def preflight(args: argparse.Namespace) -> ScorePlan:
    """Before anything loads: the inputs (their line counts; a one-process run reads them), the model's folder,
    the outputs, the languages."""
    files = annotation_files(args.source_annotation)
    check_input_flags(args, files)
    work = sharding.wanted(args)
    if work:
        sharding.check_flags(
            args, {"--source": args.source, "--target": args.target, "--nbest_input": args.nbest_input}
        )
    try:
        pairs = None if work else read_pairs(args, files)
        lines = count_aligned(args, files) if work else pairs.lines
    except OSError as error:
        raise DataError(str(error)) from None
    location = locate_model(args)
    check_outputs(args, location, files, work)
    config, _ = read_configs(location)
    tgt_lang = check_languages(config, args.src_lang, args.tgt_lang)
    return ScorePlan(location, tgt_lang, files, lines, work, pairs)


@exits_on_refusal("hf-variants-score")
def main(argv=None) -> dict | None:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    plan = preflight(args)
    if plan.work:
        return run_job(args, plan)
    translator = load_translator(plan.location)
    pairs = plan.pairs
    start = time.time()
    with progress_bar(len(pairs.sources), args.no_progress, unit="pair", desc="scoring", log_lines=False) as bar:
        scores = score(translator, args, plan, pairs, bar.update)
    elapsed = time.time() - start
    warn_too_long(pairs, scores, getattr(translator.engine.config, "max_position_embeddings", None))
    write_output(args.output, output_lines(pairs, scores, args.output_format, args.token_scores))
    return report(args, plan, scores, elapsed)


def cli() -> None:
    """The command line (`hf-variants-score`, `python -m hf_variants.commands.score`): a refusal ends it with one
    line naming the flag or file and exit status 2, before the model loads."""
    import torch

    with torch.inference_mode():
        main()


if __name__ == "__main__":
    cli()
