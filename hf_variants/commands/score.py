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

A summary (sentences, scored pairs, target tokens, total and mean log-probability per token, corpus perplexity,
seconds, pairs/s) goes to stderr as JSON, and to `--results_json`.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import sys
import time
from pathlib import Path

from ..outputs import atomic_write_file, check_output_files
from ..training.corpus import DataError, read_lines
from .common import UsageError, add_batching_flags, as_flags, batching, command_parser, exits_on_refusal
from .inputs import STDIO
from .loading import ModelLocation, add_model_flags, load_translator, locate_model, model_record, read_configs
from .progress import progress_bar

logger = logging.getLogger("hf_variants.score")


def build_parser() -> argparse.ArgumentParser:
    p = command_parser("hf-variants-score", __doc__, epilog_from=3)
    add_model_flags(p, what="score")
    g = p.add_argument_group("input and output")
    g.add_argument("--source", required=True, help="source sentences, one a line (plain or .gz)")
    g.add_argument("--target", required=True, help="target sentences, line-aligned with --source (plain or .gz)")
    g.add_argument("--output", default=STDIO, help="the scores, one line per pair; '-' writes stdout")
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
    add_batching_flags(p, unit="pairs")
    g = p.add_argument_group("summary and progress")
    g.add_argument("--results_json", help="write the summary here")
    g.add_argument("--no_progress", action="store_true", help="no progress bar (shown only on a terminal)")
    return p


# ------------------------------------------------------------------------------------------------------- checks
def check_outputs(args: argparse.Namespace, location: ModelLocation, annotation_files: dict[str, str]) -> None:
    """`--output` and `--results_json` can be written as files, are not the same file, and are not, hold or lie
    inside an input (`--source`, `--target`, annotation files, the model folders). Raises `OutputPathError`."""
    inputs = {
        "--source": args.source,
        "--target": args.target,
        "--source_annotation": list(annotation_files.values()),
        "--onnx" if args.onnx else "--model": location.path,
        "--tokenizer": args.tokenizer,
    }
    check_output_files(
        {"--output": None if args.output == STDIO else args.output, "--results_json": args.results_json}, inputs
    )


def annotation_files(items: list[str]) -> dict[str, str]:
    files = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not name or not sep or not path:
            raise DataError(f"--source_annotation expects NAME=FILE, got {item!r}.")
        files[name] = path
    return files


def read_pairs(args: argparse.Namespace, files: dict[str, str]) -> tuple[list[str], list[str], dict[str, list]]:
    """The source and target lines and the annotation lines, refused (`DataError`) when their counts differ."""
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
    return sources, targets, annotations


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


# ------------------------------------------------------------------------------------------------------- output
def format_line(score, output_format: str, token_scores: bool) -> str:
    """One output line (without its newline) of a `PairScore`."""
    if output_format == "jsonl":
        return json.dumps(score.to_dict(token_scores), ensure_ascii=False)
    values = [score.log_prob, score.tokens, score.ppl]
    fields = [repr(float("nan")) if v is None else (str(v) if isinstance(v, int) else f"{v:.6f}") for v in values]
    if token_scores:
        fields.append(" ".join(f"{v:.6f}" for v in score.token_log_probs or []))
    return "\t".join(fields)


def write_output(path: str, lines: list[str]) -> None:
    text = "".join(line + "\n" for line in lines)
    if path == STDIO:
        sys.stdout.buffer.write(text.encode("utf-8"))
        sys.stdout.flush()
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_file(path, text)


def preflight(args: argparse.Namespace):
    """Before anything loads: the model's folder, the outputs, the inputs (their line counts), the languages.
    Returns (location, sources, targets, annotations, target language)."""
    files = annotation_files(args.source_annotation)
    try:
        sources, targets, annotations = read_pairs(args, files)
    except OSError as error:
        raise DataError(str(error)) from None
    location = locate_model(args)
    check_outputs(args, location, files)
    config, _ = read_configs(location)
    tgt_lang = check_languages(config, args.src_lang, args.tgt_lang)
    return location, sources, targets, annotations, tgt_lang


@exits_on_refusal("hf-variants-score")
def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    location, sources, targets, annotations, tgt_lang = preflight(args)

    from ..inference.scoring import score_pairs, summarize

    translator = load_translator(location)
    start = time.time()
    with progress_bar(len(sources), args.no_progress, unit="pair", desc="scoring", log_lines=False) as bar:
        scores = score_pairs(
            translator,
            sources,
            targets,
            src_lang=args.src_lang,
            tgt_lang=tgt_lang,
            annotations=annotations,
            token_scores=args.token_scores,
            progress=bar.update,
            **batching(args),
        )
    elapsed = time.time() - start
    limit = getattr(translator.engine.config, "max_position_embeddings", None)
    for i, s in enumerate(scores):
        if s.too_long:
            logger.warning(
                "line %d: longer than this model accepts (%s tokens, config.max_position_embeddings): not scored",
                i + 1,
                limit,
            )
    write_output(args.output, [format_line(s, args.output_format, args.token_scores) for s in scores])
    summary = summarize(scores)
    result = {
        **model_record(location),
        "int8": location.precision == "int8",
        "source": args.source,
        "target": args.target,
        "output": "stdout" if args.output == STDIO else args.output,
        "tgt_lang": tgt_lang,
        **summary.to_dict(),
        "seconds": round(elapsed, 3),
        "pairs_per_sec": round(summary.scored / max(elapsed, 1e-9), 2),
    }
    if result["ppl"] is not None and not math.isfinite(result["ppl"]):
        result["ppl"] = None  # JSON has no infinity
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_file(args.results_json, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), file=sys.stderr)
    return result


def cli() -> None:
    """The command line (`hf-variants-score`, `python -m hf_variants.commands.score`): a refusal ends it with one
    line naming the flag or file and exit status 2, before the model loads."""
    import torch

    with torch.inference_mode():
        main()


if __name__ == "__main__":
    cli()
