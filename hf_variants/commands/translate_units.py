"""hf-variants-translate as a sharded, resumable job (`sharding`): the input translated in work units by the
processes of a launch or the tasks of a job array, each unit kept in the work folder, the output merged from them.

What a unit holds is what the one-process run writes for its lines (`translate.ResultLines`), so the merged output
is byte-identical to it: the same requests (each line's index seeds its samples: `sampling.sentence_seed`), the
same decoding (a translation does not depend on its batch), the same formatting. The summary adds up the units'
counts; scores against references are computed at the merge from the merged output and the references.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import time
from collections.abc import Callable, Iterator

from ..inference import Translator
from ..training.corpus import DataError
from . import sharding
from .common import batching
from .inputs import InputLine, iter_input, iter_lines
from .loading import load_translator
from .progress import progress_bar
from .translate_io import TSV_PAIRS, Plan, ReferenceSets, ResultLines, Tally, report, request_of
from .translate_terms import line_error

logger = logging.getLogger("hf_variants.translate")
PROG = "hf-variants-translate"


def job_manifest(args: argparse.Namespace, plan: Plan) -> dict:
    """What the job is (compared at every rerun): the input and the files aligned with it or applied to it (prefixes,
    constraints, the glossary, annotations), the model's files and engine, the output format, the languages and
    every decoding setting (resolved; the glossary's matching)."""
    aligned = {"--prefix": args.prefix} if args.prefix else {}
    terms = {"--constraints": args.constraints, "--glossary": args.glossary}
    aligned.update({flag: path for flag, path in terms.items() if path})
    aligned.update({f"--source_annotation {name}": path for name, path in plan.annotation_files.items()})
    inputs = {"--input": sharding.file_record(args.input, lines=plan.lines)}
    inputs.update({flag: sharding.file_record(path) for flag, path in aligned.items()})
    location = plan.location
    return {
        "command": PROG,
        "inputs": inputs,
        "model": sharding.model_manifest(location),
        "settings": {
            "input_format": "jsonl" if plan.jsonl else "text",
            "output_format": plan.output_format,
            "src_lang": args.src_lang,
            "tgt_lang": plan.tgt_lang,
            "annotations_from_rows": plan.annotations_from_rows,
            "decoding": plan.options.to_dict(),
            **glossary_settings(plan),
        },
        "informational": {
            "batch_size": args.batch_size,
            "max_tokens": args.max_tokens,
            "buffer_size": args.buffer_size,
        },
    }


def glossary_settings(plan: Plan) -> dict:
    """The glossary's matching options (none without a glossary, so that a job without one keeps its manifest)."""
    glossary = plan.glossary
    if glossary is None:
        return {}
    return {"glossary_ignore_case": glossary.ignore_case, "glossary_whole_word": glossary.whole_word}


def load_for(location, launch: sharding.Launch) -> Translator:
    """The translator of this process: its CPU threads and device (`sharding.process_location`, `sharding.place`)."""
    return sharding.place(load_translator(sharding.process_location(location, launch)), launch)


class UnitReader:
    """This process' units' input lines, read in one pass over the input (the other lines read past unparsed)."""

    def __init__(self, args: argparse.Namespace, plan: Plan, job: sharding.Job, units: list[int]):
        mine = set(units)
        self.items = iter_input(
            args, plan, iter_lines(args.input), select=lambda i: i // job.unit_lines in mine, references=False
        )
        self.pending = None

    def lines(self, span: range) -> Iterator[tuple[int, InputLine]]:
        while True:
            item, self.pending = self.pending or next(self.items, None), None
            if item is None:
                return
            if item[0] >= span.stop:
                self.pending = item
                return
            yield item


def unit_translator(args: argparse.Namespace, plan: Plan, job: sharding.Job, translator: Translator, reader, bar):
    """`do_unit(unit, writer, check)` for `sharding.run_units`: the unit's lines translated and written as the
    one-process run writes them; returns the unit's `Tally` counts."""

    def do_unit(unit: int, writer: sharding.UnitWriter, check: Callable[[], None]) -> dict:
        span = job.unit_range(unit)
        tally = Tally()
        output_lines = ResultLines(args, plan, tally)
        requests = (request_of(args, plan, item, index) for index, item in reader.lines(span))

        def progress(n: int) -> None:
            bar.update(n)
            check()

        results = translator.translate_stream(
            requests, plan.options, buffer_size=args.buffer_size, progress=progress, **batching(args)
        )
        try:
            for result in results:
                for line in output_lines(result, span.start + result.index + 1):
                    writer.write(line)
        except ValueError as error:
            refused = line_error(error, args, plan.input_label, span.start + 1)
            if refused is None:
                raise
            raise refused from None
        if tally.sentences != len(span):
            raise DataError(
                f"{args.input}: unit {unit} should hold lines {span.start + 1}-{span.stop}, but the input ended "
                f"after {span.start + tally.sentences} lines (it changed during the run?)."
            )
        return tally.counts()

    return do_unit


def merged_scores(args: argparse.Namespace, plan: Plan, sentences: int):
    """(hypotheses, reference sets, label) of the merged output against the references (None: not scored), read
    back from the output: the 1-best of each line."""
    references = ReferenceSets(args, plan)
    if not (references.keep_file_refs or references.keep_row_refs):
        return None
    items = iter_input(args, plan, iter_lines(args.input))
    for number, (line, item) in enumerate(zip(iter_lines(args.output), items), 1):
        if plan.output_format == "jsonl":
            hypotheses = json.loads(line)["hypotheses"]
            text = hypotheses[0]["text"] if hypotheses else ""
        else:
            text = line.rpartition(" ||| ")[0] if args.alignments else line
        references.add(text, item, number)
    return references.scored(sentences)


@contextlib.contextmanager
def unit_worker(args: argparse.Namespace, plan: Plan, job: sharding.Job, launch: sharding.Launch, mine: list[int]):
    """The `do_unit` of this process' units `mine`: the model loaded, the input opened, a progress bar (the main
    process only)."""
    translator = load_for(plan.location, launch)
    reader = UnitReader(args, plan, job, mine)
    total = sum(len(job.unit_range(u)) for u in mine)
    with progress_bar(total, args.no_progress or not launch.main, args.progress_interval) as bar:
        yield unit_translator(args, plan, job, translator, reader, bar)


def run_job(args: argparse.Namespace, plan: Plan) -> dict | None:
    """The sharded run (see `sharding`): returns the summary in the process that merges, else None."""
    launch = sharding.join_launch()
    job = sharding.Job.from_args(args, PROG, plan.lines, header=plan.header)
    start = time.time()
    state = sharding.drive(
        job,
        launch,
        lambda: job_manifest(args, plan),
        PROG,
        lambda mine: unit_worker(args, plan, job, launch, mine),
        merge_only=args.merge,
    )
    if state is None:
        return None
    return finish(args, plan, job, launch, state, start)


def finish(args: argparse.Namespace, plan: Plan, job: sharding.Job, launch, state: dict, start: float) -> dict:
    """Merge the units into --output, then the summary: the units' counts added up, the work done by this run."""
    records = sharding.merge(job)
    tally = Tally()
    for record in records:
        tally.add(record["counts"])
    scored = merged_scores(args, plan, tally.sentences)
    this_run = [r for r in records if r.get("run") == state["run"]]
    elapsed = time.time() - start
    work = {
        "work_dir": str(job.work_dir),
        "unit_lines": job.unit_lines,
        "units": job.units,
        "units_kept": state["kept"],
        "units_translated": len(this_run),
        "processes": launch.world,
        "num_shards": job.num_shards,
    }
    translated = sum(r["counts"]["translated"] for r in this_run)
    extra = {"work": work, "sentences_per_sec": round(translated / max(elapsed, 1e-9), 2)}
    if plan.output_format == TSV_PAIRS:
        extra["pairs"] = tally.pairs
    return report(args, plan, tally, scored, elapsed, extra)


__all__ = ["job_manifest", "run_job"]
