"""What hf-variants-translate writes, shared by its one-process run (`translate`) and its sharded run
(`translate_units`): the plan the checks made, the output lines of each result (text, JSON Lines, tsv_pairs) and the
counts behind the summary, the references kept for scoring, and the summary itself."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from ..inference import TranslationRequest
from ..inference.glossary import Glossary
from ..inference.requests import DecodeOptions
from ..outputs import atomic_write_file
from ..training import evaluation
from . import translate_terms
from .inputs import STDIO, InputLine
from .loading import ModelLocation, model_record

logger = logging.getLogger("hf_variants.translate")
TSV_PAIRS = "tsv_pairs"


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


def format_result(result, output_format: str, alignments: bool, extra: dict | None = None) -> str:
    """One output line: the best translation (text; ` ||| ` and its alignment with `alignments`), or the JSON object
    with every hypothesis (jsonl), and `extra` fields (the line's constraints and glossary terms)."""
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
    record.update(extra or {})
    return json.dumps(record, ensure_ascii=False)


# ------------------------------------------------------------------------------------------------------- plan
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
    glossary: Glossary | None = None  # --glossary (`translate_terms`)


# ------------------------------------------------------------------------------------------------------ lines
@dataclass
class Tally:
    """What the run met, for the summary and the warnings (line numbers 1-based); with `tsv_pairs` also the pairs
    written, the lines that gave none (an empty source or translation) and those whose text held a tab; with
    constraints (`--constraints`, `--glossary`) the sentences that had some, those whose best translation met
    them all, the lines where some were not met and the beam sizes the constrained search used; with a glossary
    the terms that applied, those found and the sentences with terms."""

    sentences: int = 0
    empty: list[int] = field(default_factory=list)
    too_long: list[int] = field(default_factory=list)
    truncated: list[int] = field(default_factory=list)
    translated: int = 0
    pairs: int = 0
    unpaired: list[int] = field(default_factory=list)
    tabs: list[int] = field(default_factory=list)
    constrained: int = 0
    constraints_met: int = 0
    unmet_constraints: list[int] = field(default_factory=list)
    constrained_beams: list[int] = field(default_factory=list)
    terms: int = 0
    terms_found: int = 0
    sentences_with_terms: int = 0

    def counts(self) -> dict:
        """The tally as a JSON object (a work unit's record)."""
        return dict(self.__dict__)

    def add(self, counts: dict) -> None:
        """Add a work unit's counts (`counts()`), in input order."""
        for name, value in counts.items():
            setattr(self, name, getattr(self, name) + value)
        self.constrained_beams = sorted(set(self.constrained_beams))


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
        extra, checks = translate_terms.line_record(result, plan.glossary)
        translate_terms.count_line(tally, result, checks, plan.options.num_beams, line)
        if plan.output_format == "jsonl":
            return [format_result(result, plan.output_format, self.args.alignments, extra)]
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
    """The request of input line `index` (0-based: it seeds the line's samples, `sampling.sentence_seed`); its
    constraints the --constraints line's, then its --glossary terms'."""
    request = TranslationRequest(
        item.source,
        src_lang=args.src_lang,
        tgt_lang=plan.tgt_lang,
        prefix=item.prefix or None,
        annotations=item.annotations,
        constraints=item.constraints,
        index=index,
    )
    return translate_terms.with_terms(request, plan.glossary)


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
    result.update(translate_terms.summary(args, plan.glossary, tally))
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
    translate_terms.warn_unmet(tally)
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
