"""The measured stage of the cache: per row and language the token count and the side's state, from batched
fast-tokenizer calls in worker processes.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import corpus
from .cache_store import (
    PIPELINE_VERSION,
    _ann_col,
    _digest,
    _new_tmp,
    _publish,
    _text_col,
    default_cache_dir,
    logger,
    map_arrow_file,
    open_entry,
    seal_entry,
    tokenizer_fingerprint,
)
from .progress import Every
from .sources import Rows

MAP_BATCH_ROWS = 2_000  # rows per batched tokenizer call


ROWS_PER_WORKER = 50_000  # fewer rows than this per worker: fewer workers (a process pool costs ~1 s)


STATE_OK, STATE_MISSING, STATE_EMPTY = 0, 1, 2


BASE_REASONS = ("missing_source", "missing_target", "empty_source", "empty_target")


ANNOTATION_REASONS = ("missing_annotation", "malformed_parse", "parse_mismatch")


# reason code of a pair = 1 + index in REASONS (0: kept)
REASONS = BASE_REASONS + ANNOTATION_REASONS + ("too_long",)


TOO_LONG = len(REASONS)


ABSENT = -1  # not a pair of the direction (skip_absent)


# ------------------------------------------------------------------------------------- stage 2: measured
def _measure(batch: dict, tokenizer, languages: Sequence[str], checks: Sequence[tuple[str, str]]) -> dict:
    """Token counts and states of a block of rows (the `Dataset.map` function of stage 2)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and (backend.truncation is not None or backend.padding is not None):
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    out = {}
    stripped_by_lang = {}
    for lang in languages:
        texts = batch[_text_col(lang)]
        stripped = [t.strip() if t is not None else None for t in texts]
        stripped_by_lang[lang] = stripped
        state = [STATE_MISSING if t is None else (STATE_OK if t else STATE_EMPTY) for t in stripped]
        todo = [t for t in stripped if t]
        if not todo:
            counts = []
        elif backend is not None:
            counts = [len(e) for e in backend.encode_batch_fast(todo, add_special_tokens=True)]
        else:
            counts = [len(ids) for ids in tokenizer(todo, add_special_tokens=True)["input_ids"]]
        it = iter(counts)
        out[f"len.{lang}"] = [next(it) if s == STATE_OK else 0 for s in state]
        out[f"state.{lang}"] = state
    for name, lang in checks:
        check = corpus.ANNOTATION_CHECKS.get(name)
        codes = []
        for sentence, value in zip(stripped_by_lang[lang], batch[_ann_col(name, lang)]):
            if not sentence:
                codes.append(0)  # the pair is dropped for its empty/missing side first
            elif value is None:
                codes.append(1 + ANNOTATION_REASONS.index("missing_annotation"))
            else:
                problem = check(sentence, json.loads(value)) if check is not None else None
                codes.append(0 if problem is None else 1 + ANNOTATION_REASONS.index(problem[0]))
        out[f"check.{name}.{lang}"] = codes
    return out


@dataclass
class Measured:
    """Stage 2: per row and language `len.<lang>` (tokens, special tokens included; int32), `state.<lang>`
    (STATE_*), and per checked annotation `check.<name>.<lang>` (0, or 1 + index in ANNOTATION_REASONS)."""

    files: list[str]  # the Arrow files (one per worker), in row order
    fingerprint: str
    built: bool = False
    _dataset: object = field(default=None, repr=False)

    @property
    def dataset(self):
        """The memory-mapped counts (`datasets.Dataset`), opened on first use: only building the pairs reads them,
        so a relaunch, a resume or another rank whose pairs are cached never opens them (opening costs every
        process Arrow and Python objects per record batch: about 155 MB of heap at 40M rows)."""
        if self._dataset is None:
            import datasets

            parts = [map_arrow_file(f, random_reads=False) for f in self.files]
            self._dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
        return self._dataset

    def column(self, name: str) -> np.ndarray:
        return self.dataset.data.table.column(name).to_numpy()


def measure(
    rows: Rows,
    tokenizer,
    languages: Sequence[str],
    checks: Sequence[tuple[str, str]] = (),
    cache_dir: str | os.PathLike | None = None,
    num_workers: int = 1,
    tokenizer_fp: str | None = None,
) -> Measured:
    """Stage 2 from the cache, or computed with `Dataset.map` (batched tokenizer calls in `num_workers`
    processes) and cached."""
    import datasets

    cache_dir = Path(cache_dir or default_cache_dir())
    tok_fp = tokenizer_fp or tokenizer_fingerprint(tokenizer)
    fp = _digest(
        {
            "version": PIPELINE_VERSION,
            "rows": rows.fingerprint,
            "n": len(rows),
            "tokenizer": tok_fp,
            "languages": list(languages),
            "checks": [list(c) for c in checks],
        }
    )
    final = cache_dir / f"measured-{fp}"
    cached = open_entry(final, lambda meta: Measured(_entry_files(final, meta), fp))  # damaged: built again
    if cached is not None:
        return cached
    t0 = time.time()
    workers = max(1, min(num_workers, math.ceil(len(rows) / ROWS_PER_WORKER)))
    tmp = _new_tmp(cache_dir, f"measured-{fp}")
    try:
        features = {f"len.{lang}": datasets.Value("int32") for lang in languages}
        features.update({f"state.{lang}": datasets.Value("int8") for lang in languages})
        features.update({f"check.{n}.{lang}": datasets.Value("int8") for n, lang in checks})
        needed = [_text_col(lang) for lang in languages] + [_ann_col(n, lang) for n, lang in checks]
        bounds = np.linspace(0, len(rows), workers + 1).astype(int).tolist()
        tasks = [(k, bounds[k], bounds[k + 1], str(tmp / f"measured-{k:05d}.arrow")) for k in range(workers)]
        global _JOB
        _JOB = dict(
            rows=rows,
            tokenizer=tokenizer,
            languages=list(languages),
            checks=list(checks),
            needed=needed,
            features=datasets.Features(features),
        )
        try:
            if workers == 1:
                files = [_measure_range(tasks[0])]
            else:
                import multiprocessing

                # forked workers inherit the job (no pickling of the tokenizer); tokenizers' own thread pool is
                # off in them (one process per core instead)
                previous = os.environ.get("TOKENIZERS_PARALLELISM")
                os.environ["TOKENIZERS_PARALLELISM"] = "false"
                try:
                    with multiprocessing.get_context("fork").Pool(workers) as pool:
                        files = pool.map(_measure_range, tasks, chunksize=1)
                finally:
                    if previous is None:
                        os.environ.pop("TOKENIZERS_PARALLELISM", None)
                    else:
                        os.environ["TOKENIZERS_PARALLELISM"] = previous
        finally:
            _JOB = None
        meta = {
            "files": [Path(f).name for f in files],
            "rows": len(rows),
            "tokenizer": tok_fp,
            "languages": list(languages),
            "checks": [list(c) for c in checks],
            "seconds": round(time.time() - t0, 2),
            "workers": workers,
        }
        seal_entry(tmp, meta)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    n_sent = len(rows) * len(languages)
    elapsed = time.time() - t0
    logger.info(
        "Tokenized %s: %d rows x %d languages in %.1f s (%.0f sentences/s, %d worker(s)); cached in %s",
        rows.meta["label"],
        len(rows),
        len(languages),
        elapsed,
        n_sent / max(elapsed, 1e-9),
        workers,
        final,
    )
    meta = json.loads((final / "meta.json").read_text())
    return Measured([str(final / f) for f in meta["files"]], fp, built=True)


def _entry_files(final: Path, meta: dict) -> list[str]:
    """The Arrow files a measured entry's meta lists: file names of the entry (a ValueError otherwise)."""
    files = meta["files"]
    if not isinstance(files, list) or not files:
        raise ValueError(f"meta.json: 'files' must be a non-empty list, got {files!r}")
    for name in files:
        if not isinstance(name, str) or Path(name).name != name or not (final / name).is_file():
            raise ValueError(f"meta.json lists {name!r}, not a file of the entry")
    return [str(final / name) for name in files]


_JOB: dict | None = None  # the stage-2 job, inherited by forked workers


def _measure_range(task) -> str:
    """Token counts of rows [start, stop) (read sequentially) into the Arrow file `path` (one worker's share)."""
    from datasets.arrow_writer import ArrowWriter

    k, start, stop, path = task
    job = _JOB
    report = Every()  # the first worker's share stands for every worker's (the rows are split evenly)
    done = 0
    with ArrowWriter(features=job["features"], path=path) as writer:
        for batch in job["rows"].batches(job["needed"], start, stop):
            for lo in range(0, batch.num_rows, MAP_BATCH_ROWS):
                block = batch.slice(lo, MAP_BATCH_ROWS).to_pydict()
                writer.write_batch(_measure(block, job["tokenizer"], job["languages"], job["checks"]))
                done += len(next(iter(block.values()), []))
                if k == 0 and report():
                    logger.info(
                        "progress: tokenizing %s: %.0f%% (%d of the first worker's %d rows), elapsed %s",
                        job["rows"].meta["label"],
                        100.0 * done / max(stop - start, 1),
                        done,
                        stop - start,
                        report.elapsed(),
                    )
        writer.finalize()
    return path
