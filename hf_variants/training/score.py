"""Score given translation pairs: the log-probability of each target line given its source line (forced decoding).

    hf-variants-score --model runs/transformer_nmt-en-de-small/model \\
        --source test.en --target test.de --output scores.jsonl

Used to filter noisy parallel data, to rerank n-best lists and to compare models on a reference (fairseq-generate
--score-reference, marian-scorer, OpenNMT-py's translate -tgt, CTranslate2's score_batch).

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

from ..outputs import OutputPathError, atomic_write_file, check_output_files, int_in_range
from .corpus import DataError, read_lines

logger = logging.getLogger("hf_variants.score")

STDIO = "-"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help; the epilog (the docstring's input/output paragraphs) as written."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-variants-score",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[3:]),
        formatter_class=_HelpFormatter,
    )
    p.add_argument("--model", help="saved model folder, Hub id, or a training checkpoint folder (or --onnx)")
    p.add_argument(
        "--onnx",
        metavar="DIR",
        help="score with ONNX Runtime: a folder written by `hf-variants-export-onnx` (instead of --model; with "
        "--int8: its int8 graphs)",
    )
    p.add_argument(
        "--int8",
        action="store_true",
        help="int8 CPU inference: the PyTorch model's linear layers quantized (hf_variants.quantize_for_cpu); "
        "with --onnx, the export's int8 graphs",
    )
    p.add_argument("--tokenizer", help="default: the model folder (or the run's tokenizer for a checkpoint)")
    p.add_argument("--source", required=True, help="source sentences, one a line (plain or .gz)")
    p.add_argument("--target", required=True, help="target sentences, line-aligned with --source (plain or .gz)")
    p.add_argument("--output", default=STDIO, help="the scores, one line per pair; '-' writes stdout")
    p.add_argument("--output_format", choices=["jsonl", "tsv"], default="jsonl")
    p.add_argument(
        "--token_scores",
        action="store_true",
        help="also write each target token's log-probability (fairseq's positional scores)",
    )
    p.add_argument(
        "--source_annotation",
        action="append",
        default=[],
        metavar="NAME=FILE",
        help="a per-sentence model input aligned with --source (parses=test.en.parses for the syntactic MG-SA); "
        "repeatable",
    )
    p.add_argument("--src_lang", help="source language (checked against the model's languages)")
    p.add_argument("--tgt_lang", help="target language (needed by multilingual models)")
    p.add_argument(
        "--batch_size", type=int_in_range(1), help="pairs a batch (default: 64 without --max_tokens, else no limit)"
    )
    p.add_argument(
        "--max_tokens",
        type=int_in_range(1),
        help="tokens a batch: pairs x the longest of their longer sides (fairseq's --max-tokens)",
    )
    p.add_argument("--num_threads", type=int_in_range(1), help="CPU threads (default: the library's)")
    p.add_argument("--results_json", help="write the summary here")
    p.add_argument("--no_progress", action="store_true", help="no progress bar (shown only on a terminal)")
    p.add_argument("--trust_remote_code", action="store_true", help="for Hub ids whose code is not installed")
    return p


# ------------------------------------------------------------------------------------------------------- checks
def check_outputs(args: argparse.Namespace, annotation_files: dict[str, str]) -> None:
    """`--output` and `--results_json` can be written as files, are not the same file, and are not, hold or lie
    inside an input (`--source`, `--target`, annotation files, the model folders). Raises `OutputPathError`."""
    inputs = {
        "--source": args.source,
        "--target": args.target,
        "--source_annotation": list(annotation_files.values()),
        "--model": args.model,
        "--onnx": args.onnx,
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


def model_config(args: argparse.Namespace):
    """The config of `--model` / `--onnx` without loading weights (a checkpoint folder: its run's config), or None
    where it cannot be read cheaply."""
    from transformers import AutoConfig

    from . import checkpointing

    folder = Path(args.onnx or args.model)
    candidates = [folder]
    if (folder / checkpointing.MARKER).is_file():
        from .trainer import MODEL_CONFIG_DIR

        candidates = [folder.parent.parent / MODEL_CONFIG_DIR, folder.parent.parent / "model"]
    for candidate in candidates:
        if (candidate / "config.json").is_file():
            return AutoConfig.from_pretrained(candidate, trust_remote_code=args.trust_remote_code)
    if not folder.exists():
        return AutoConfig.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)  # a Hub id
    return None


def check_languages(config, src_lang: str | None, tgt_lang: str | None) -> str | None:
    """`--src_lang` / `--tgt_lang` checked against the model's languages (a ValueError naming the flag), and the
    target language to score in: `--tgt_lang`, else the model's one target (None: the model records none)."""
    from ..inference.translator import check_languages as check
    from ..inference.translator import default_target_language, model_languages

    if config is None:
        return tgt_lang
    try:
        check(config, src_lang=src_lang, tgt_lang=tgt_lang)
    except ValueError as error:
        message = str(error).replace("tgt_lang=", "--tgt_lang ").replace("src_lang=", "--src_lang ")
        raise ValueError(message) from error
    if tgt_lang is None:
        tgt_lang = default_target_language(config)
        _, targets = model_languages(config)
        if tgt_lang is None and len(targets) > 1:
            raise ValueError(f"This model translates into several languages ({', '.join(targets)}): pass --tgt_lang.")
    return tgt_lang


# ------------------------------------------------------------------------------------------------------ loading
def load_translator(args: argparse.Namespace):
    """The `Translator` of `--model` (torch; a training checkpoint folder loads into its run's config) or `--onnx`
    (ONNX Runtime), int8 with `--int8`."""
    from ..inference import Translator
    from . import checkpointing

    if args.onnx:
        return Translator.from_pretrained(
            args.onnx,
            engine="onnx",
            precision="int8" if args.int8 else "fp32",
            num_threads=args.num_threads,
            tokenizer=args.tokenizer,
        )
    if (Path(args.model) / checkpointing.MARKER).is_file():
        from .translate import load_model_and_tokenizer

        if args.num_threads:
            import torch

            torch.set_num_threads(args.num_threads)
        model, tokenizer = load_model_and_tokenizer(args.model, args.tokenizer, args.trust_remote_code)
        if args.int8:
            from ..deploy.int8 import quantize_for_cpu

            quantize_for_cpu(model)
        return Translator(model, tokenizer)
    return Translator.from_pretrained(
        args.model,
        engine="torch",
        precision="int8" if args.int8 else "fp32",
        num_threads=args.num_threads,
        trust_remote_code=args.trust_remote_code,
        tokenizer=args.tokenizer,
    )


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


def progress_bar(total: int, disable: bool):
    """A tqdm bar on stderr when it is a terminal (none elsewhere or with `disable`)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, unit="pair", desc="scoring", file=sys.stderr, disable=disable or not sys.stderr.isatty())


def main(argv=None) -> dict:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    if (args.model is None) == (args.onnx is None):
        parser.exit(2, "error: pass exactly one of --model and --onnx.\n")
    # before anything loads: the outputs, the inputs (their line counts), the languages
    try:
        files = annotation_files(args.source_annotation)
        check_outputs(args, files)
        sources, targets, annotations = read_pairs(args, files)
        tgt_lang = check_languages(model_config(args), args.src_lang, args.tgt_lang)
    except (OutputPathError, DataError, ValueError, OSError) as error:
        parser.exit(2, f"error: {error}\n")

    from ..inference.batching import DEFAULT_BATCH_SIZE
    from ..inference.scoring import score_pairs, summarize

    translator = load_translator(args)
    batch_size = args.batch_size if args.batch_size or args.max_tokens else DEFAULT_BATCH_SIZE
    start = time.time()
    with progress_bar(len(sources), args.no_progress) as bar:
        scores = score_pairs(
            translator,
            sources,
            targets,
            src_lang=args.src_lang,
            tgt_lang=tgt_lang,
            annotations=annotations,
            batch_size=batch_size,
            max_tokens=args.max_tokens,
            token_scores=args.token_scores,
            progress=bar.update,
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
        "model": args.model or args.onnx,
        "engine": translator.engine.name,
        "int8": args.int8,
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
    """The command line (`python -m hf_variants.training.score`, `hf-variants-score`)."""
    import torch

    with torch.inference_mode():
        main()


if __name__ == "__main__":
    cli()
