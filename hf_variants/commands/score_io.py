"""What hf-variants-score scores and writes, shared by its one-process run (`score`) and its sharded run
(`score_units`): the pairs (line-aligned, or every hypothesis of n-best lines), their scores buffer after buffer,
the output lines (pairs, or n-best lines with each hypothesis' scores), the warnings and the summary."""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..outputs import atomic_write_file
from ..training.corpus import DataError, parse_jsonl_line
from .common import batching
from .inputs import STDIO
from .loading import ModelLocation, model_record

logger = logging.getLogger("hf_variants.score")


@dataclass
class Pairs:
    """What is scored: `sources`, `targets`, per-pair `annotations`; for n-best input `rows` holds each input line's
    source and hypotheses (its pairs are consecutive), None for line-aligned pairs."""

    sources: list[str]
    targets: list[str]
    annotations: dict[str, list] = field(default_factory=dict)
    rows: list[tuple[str, list[str]]] | None = None

    @property
    def lines(self) -> int:
        return len(self.rows) if self.rows is not None else len(self.sources)


def nbest_row(line: str, where: str) -> tuple[str, list[str]]:
    """(source, hypothesis texts) of one line of hf-variants-translate's n-best JSON Lines (`where`: file:line)."""
    obj = parse_jsonl_line(line, where)
    hypotheses = obj.get("hypotheses")
    ok = isinstance(obj.get("source"), str) and isinstance(hypotheses, list)
    ok = ok and all(isinstance(h, dict) and isinstance(h.get("text"), str) for h in hypotheses)
    if not ok:
        raise DataError(
            f'{where}: expected a line of hf-variants-translate\'s n-best JSON Lines, {{"source": "...", '
            f'"hypotheses": [{{"text": "...", ...}}, ...]}}, got the keys {sorted(obj)}.'
        )
    return obj["source"], [h["text"] for h in hypotheses]


def nbest_pairs(rows: list[tuple[str, list[str]]], annotations: dict[str, list], reverse: bool) -> Pairs:
    """The pairs of n-best rows: (source, hypothesis) for each hypothesis, or (hypothesis, source) with `reverse`;
    each pair with its row's annotations."""
    sources, targets = [], []
    per_pair: dict[str, list] = {name: [] for name in annotations}
    for r, (source, texts) in enumerate(rows):
        for text in texts:
            sources.append(text if reverse else source)
            targets.append(source if reverse else text)
            for name, values in annotations.items():
                per_pair[name].append(values[r])
    return Pairs(sources, targets, per_pair, list(rows))


@dataclass
class ScorePlan:
    """What the checks before loading decided: the model's location, the target language, the annotation files, the
    input's line count, whether the run is sharded (`work`) and, for a one-process run, the pairs (read whole)."""

    location: ModelLocation
    tgt_lang: str | None
    files: dict[str, str]
    lines: int
    work: bool = False
    pairs: Pairs | None = None


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


def output_lines(pairs: Pairs, scores, output_format: str, token_scores: bool) -> list[str]:
    """One line per input line: a pair's scores, or an n-best row with each hypothesis' scores."""
    if pairs.rows is None:
        return [format_line(s, output_format, token_scores) for s in scores]
    lines, k = [], 0
    for source, texts in pairs.rows:
        hypotheses = [{"text": text} | scores[k + j].to_dict(token_scores) for j, text in enumerate(texts)]
        lines.append(json.dumps({"source": source, "hypotheses": hypotheses}, ensure_ascii=False))
        k += len(texts)
    return lines


def buffers(pairs: Pairs, size: int) -> list[Pairs]:
    """`pairs` cut every `size` input lines (an n-best line's pairs stay together)."""
    if pairs.rows is None:
        spans = [(i, min(i + size, len(pairs.sources))) for i in range(0, len(pairs.sources), size)]
        rows = [None] * len(spans)
    else:
        offsets = list(itertools.accumulate((len(texts) for _, texts in pairs.rows), initial=0))
        firsts = range(0, len(pairs.rows), size)
        spans = [(offsets[r], offsets[min(r + size, len(pairs.rows))]) for r in firsts]
        rows = [pairs.rows[r : r + size] for r in firsts]
    return [
        Pairs(
            pairs.sources[a:b],
            pairs.targets[a:b],
            {name: values[a:b] for name, values in pairs.annotations.items()},
            part_rows,
        )
        for (a, b), part_rows in zip(spans, rows)
    ]


def score(translator, args: argparse.Namespace, plan: ScorePlan, pairs: Pairs, progress) -> list:
    """Every pair's `PairScore` (`score_pairs`), in input order, buffer after buffer (`--buffer_size` input lines:
    a sharded run's units hold whole buffers, so each pair is batched, and scored to the last digit, alike)."""
    from ..inference.scoring import score_pairs

    scores = []
    for part in buffers(pairs, args.buffer_size):
        scores += score_pairs(
            translator,
            part.sources,
            part.targets,
            src_lang=args.src_lang,
            tgt_lang=plan.tgt_lang,
            annotations=part.annotations,
            token_scores=args.token_scores,
            progress=progress,
            **batching(args),
        )
    return scores


def warn_too_long(pairs: Pairs, scores, limit, first_line: int = 1) -> list[int]:
    """A warning per pair not scored (longer than the model accepts), naming its line (and hypothesis); returns
    their 1-based positions among the pairs."""
    where = [(first_line + i, None) for i in range(len(pairs.sources))]
    if pairs.rows is not None:
        where = [(first_line + r, j + 1) for r, (_, texts) in enumerate(pairs.rows) for j in range(len(texts))]
    for (line, hypothesis), s in zip(where, scores):
        if s.too_long:
            logger.warning(
                "line %d%s: longer than this model accepts (%s tokens, config.max_position_embeddings): not scored",
                line,
                f" hypothesis {hypothesis}" if hypothesis is not None else "",
                limit,
            )
    return [i + 1 for i, s in enumerate(scores) if s.too_long]


def report(args: argparse.Namespace, plan: ScorePlan, scores, elapsed: float, extra=None) -> dict:
    """The summary, printed as JSON on stderr and written to `--results_json`; returns it."""
    from ..inference.scoring import summarize

    summary = summarize(scores)
    inputs = {"source": args.source, "target": args.target}
    if args.nbest_input is not None:
        inputs = {"nbest_input": args.nbest_input, "reverse": args.reverse, "lines": plan.lines}
    result = {
        **model_record(plan.location),
        "int8": plan.location.precision == "int8",
        **inputs,
        "output": "stdout" if args.output == STDIO else args.output,
        "tgt_lang": plan.tgt_lang,
        **summary.to_dict(),
        "seconds": round(elapsed, 3),
        "pairs_per_sec": round(summary.scored / max(elapsed, 1e-9), 2),
        **(extra or {}),
    }
    if result["ppl"] is not None and not math.isfinite(result["ppl"]):
        result["ppl"] = None  # JSON has no infinity
    if args.results_json:
        Path(args.results_json).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_file(args.results_json, json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2), file=sys.stderr)
    return result
