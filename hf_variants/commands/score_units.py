"""hf-variants-score as a sharded, resumable job (`sharding`): the input lines (line-aligned pairs, or n-best rows)
scored in work units by the processes of a launch or the tasks of a job array, each unit kept in the work folder,
the output merged from them, byte-identical to one process (a pair's score does not depend on its batch).

Each unit's record keeps every pair's log-probability and token count, so the summary (total log-probability,
corpus perplexity) is the one-process run's, summed over the same numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import logging
import time
from collections.abc import Callable, Iterator

from ..inference.scoring import PairScore
from ..training.corpus import DataError, check_not_nbest
from . import sharding
from .inputs import iter_lines
from .loading import load_translator
from .progress import progress_bar
from .score_io import Pairs, ScorePlan, nbest_pairs, nbest_row, output_lines, report, score, warn_too_long

logger = logging.getLogger("hf_variants.score")
PROG = "hf-variants-score"


def job_manifest(args: argparse.Namespace, plan: ScorePlan) -> dict:
    """What the job is (compared at every rerun): the inputs, the model's files and engine, the settings."""
    files = {"--nbest_input": args.nbest_input} if args.nbest_input else {"--source": args.source}
    if not args.nbest_input:
        files["--target"] = args.target
    files.update({f"--source_annotation {name}": path for name, path in plan.files.items()})
    return {
        "command": PROG,
        "inputs": {flag: sharding.file_record(path) for flag, path in files.items()},
        "model": sharding.model_manifest(plan.location),
        "settings": {
            "output_format": args.output_format,
            "token_scores": args.token_scores,
            "reverse": args.reverse,
            "src_lang": args.src_lang,
            "tgt_lang": plan.tgt_lang,
        },
        "informational": {"batch_size": args.batch_size, "max_tokens": args.max_tokens},
    }


def unit_lines(args: argparse.Namespace, plan: ScorePlan, job: sharding.Job, units: list[int]) -> Iterator:
    """(line index, row) of this process' units' lines, in one pass: a row is (source, target, annotations) of the
    line-aligned files, or (source, hypotheses, annotations) of an n-best line."""
    mine = set(units)
    main = args.nbest_input or args.source
    streams = [iter_lines(main)] + ([] if args.nbest_input else [iter_lines(args.target)])
    names = list(plan.files)
    streams += [iter_lines(plan.files[name]) for name in names]
    for index, values in enumerate(zip(*streams)):
        if index // job.unit_lines not in mine:
            continue
        where = f"{main}:{index + 1}"
        annotations = dict(zip(names, values[len(values) - len(names) :]))
        if args.nbest_input:
            source, texts = nbest_row(values[0], where)
            yield index, (source, texts, annotations)
        else:
            check_not_nbest(values[0], where)
            check_not_nbest(values[1], f"{args.target}:{index + 1}")
            yield index, (values[0], values[1], annotations)


def unit_pairs(args: argparse.Namespace, rows: list) -> Pairs:
    """The pairs of a unit's rows."""
    names = sorted({name for _, _, annotations in rows for name in annotations})
    if args.nbest_input:
        per_row = {name: [a[name] for _, _, a in rows] for name in names}
        return nbest_pairs([(s, texts) for s, texts, _ in rows], per_row, args.reverse)
    annotations = {name: [a[name] for _, _, a in rows] for name in names}
    return Pairs([s for s, _, _ in rows], [t for _, t, _ in rows], annotations)


@contextlib.contextmanager
def unit_worker(args: argparse.Namespace, plan: ScorePlan, job: sharding.Job, launch: sharding.Launch, mine: list):
    """The `do_unit` of this process' units: the model loaded, the inputs opened."""
    translator = sharding.place(load_translator(sharding.process_location(plan.location, launch)), launch)
    lines = unit_lines(args, plan, job, mine)
    limit = getattr(translator.engine.config, "max_position_embeddings", None)
    total = sum(len(job.unit_range(u)) for u in mine)
    with progress_bar(total, args.no_progress or not launch.main, unit="line", desc="scoring", log_lines=False) as bar:

        def do_unit(unit: int, writer: sharding.UnitWriter, check: Callable[[], None]) -> dict:
            span = job.unit_range(unit)
            rows = [row for _, row in itertools.islice(lines, len(span))]
            if len(rows) != len(span):
                raise DataError(f"unit {unit}: the input ended before line {span.stop} (it changed during the run?).")
            pairs = unit_pairs(args, rows)
            scores = score(translator, args, plan, pairs, lambda n: check())
            too_long = warn_too_long(pairs, scores, limit, first_line=span.start + 1)
            for line in output_lines(pairs, scores, args.output_format, args.token_scores):
                writer.write(line)
            bar.update(len(span))
            return {"values": [[s.log_prob, s.tokens] for s in scores], "too_long": too_long}

        yield do_unit


def run_job(args: argparse.Namespace, plan: ScorePlan) -> dict | None:
    """The sharded run (see `sharding`): returns the summary in the process that merges, else None."""
    launch = sharding.join_launch()
    job = sharding.Job.from_args(args, PROG, plan.lines)
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
    records = sharding.merge(job)
    scores = [PairScore(lp, tokens) for record in records for lp, tokens in record["counts"]["values"]]
    work = {
        "work_dir": str(job.work_dir),
        "unit_lines": job.unit_lines,
        "units": job.units,
        "units_kept": state["kept"],
        "units_scored": sum(1 for r in records if r.get("run") == state["run"]),
        "processes": launch.world,
        "num_shards": job.num_shards,
    }
    return report(args, plan, scores, time.time() - start, {"work": work})


__all__ = ["job_manifest", "run_job"]
