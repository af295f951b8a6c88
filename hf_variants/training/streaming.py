"""Streaming a corpus too large to cache: pairs read, checked and batched on the fly (`--streaming`)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from . import corpus
from .cache_store import _ann_col, _text_col
from .corpus import DataError, DropReport, Pair
from .measure import ANNOTATION_REASONS, MAP_BATCH_ROWS, REASONS, TOO_LONG, _measure
from .pairs import _fault, _report_from_dict, pair_reasons
from .sources import Locator, SplitSource, iter_row_blocks


# ------------------------------------------------------------------------------------------------ streaming
def _stream_examples(source: SplitSource, languages: tuple, annotations: tuple, start_row: int):
    """Rows of a split from `start_row` on, one dict a row (`row`, `text.<lang>`, `ann.<name>.<lang>`), with the
    structural checks of the cached path (the generator of the streaming `IterableDataset`); the lines before
    `start_row` are skipped unread."""
    row = start_row
    for block in iter_row_blocks(source, languages, annotations, {}, start_row):
        cols = list(block)
        for j in range(len(block[cols[0]])):
            example = {c: block[c][j] for c in cols}
            example["row"] = row
            row += 1
            yield example


def streaming_rows(
    source: SplitSource,
    languages: Sequence[str],
    annotations: Sequence[str],
    tokenizer,
    checks: Sequence[tuple[str, str]],
    start_row: int = 0,
):
    """The split as a `datasets.IterableDataset` from `start_row` on, token counts and annotation checks computed
    lazily by a batched `map` (the same function as the cached path), never stored."""
    import datasets

    languages, annotations = tuple(languages), tuple(annotations)
    if source.kind == "hub":
        hub = source.dataset
        if not isinstance(hub, datasets.IterableDataset):
            hub = hub.to_iterable_dataset()

        def with_rows(batch, indices):
            out = {_text_col(lang): [] for lang in languages}
            for row in source.hub_rows(batch, indices[0] + start_row if indices else start_row):
                for lang in languages:
                    out[_text_col(lang)].append(row.get(lang))
            out["row"] = [i + start_row for i in indices]
            return out

        ds = hub.skip(start_row).map(
            with_rows, batched=True, with_indices=True, remove_columns=list(hub.column_names or ["translation"])
        )
    else:
        features = {_text_col(lang): datasets.Value("string") for lang in languages}
        features.update({_ann_col(n, lang): datasets.Value("string") for n in annotations for lang in languages})
        features["row"] = datasets.Value("int64")
        ds = datasets.IterableDataset.from_generator(
            _stream_examples,
            features=datasets.Features(features),
            gen_kwargs={"source": source, "languages": languages, "annotations": annotations, "start_row": start_row},
        )
    return ds.map(
        _measure,
        batched=True,
        batch_size=MAP_BATCH_ROWS,
        fn_kwargs={"tokenizer": tokenizer, "languages": list(languages), "checks": list(checks)},
    )


class StreamingPairs:
    """Training batches read from a stream (`streaming_rows`) instead of the cache, for corpora larger than the
    disk cache should hold.

    The stream is cut into buffers of `buffer_rows` rows; each buffer's pairs are length-bucketed into batches of at
    most `max_tokens` (`corpus.TokenBatchSampler`, seeded by the run's seed, the epoch and the buffer's index) and
    grouped into optimizer steps (`corpus.StepPlan`: the last step of a buffer wraps around to its first batches).
    The position after each step is `{"epoch", "buffer", "row" (the buffer's first row), "step" (steps done in the
    buffer), "rows" (rows in an epoch, once known)}`: a resume reads the stream from `row`, rebuilds that buffer
    and skips `step` steps, which gives exactly the batches of an uninterrupted run. Bad pairs are counted while the
    first epoch is read (`report`, restored with the position) or stop the run (`on_bad_pairs="error"`)."""

    def __init__(
        self,
        source: SplitSource,
        languages: Sequence[str],
        directions: Sequence[tuple[str, str]],
        tokenizer,
        *,
        annotations: Sequence[str] = (),
        target_annotations: bool = False,
        tag: int = 0,
        max_length: int | None = None,
        on_bad_pairs: str = "skip",
        buffer_rows: int = 100_000,
        max_tokens: int = 4096,
        max_sentences: int | None = None,
        seed: int = 0,
        examples_per_item: int = 1,
        num_processes: int = 1,
        accumulation_steps: int = 1,
        skip_absent: bool = False,
    ):
        self.source, self.languages = source, list(languages)
        self.skip_absent = skip_absent
        self.directions = [tuple(d) for d in directions]
        self.tokenizer = tokenizer
        self.annotations, self.target_annotations = list(annotations), target_annotations
        self.tag, self.max_length, self.on_bad_pairs = tag, max_length, on_bad_pairs
        self.buffer_rows = buffer_rows
        self.sampler_args = dict(
            max_tokens=max_tokens, max_sentences=max_sentences, examples_per_item=examples_per_item
        )
        self.seed = seed
        self.num_processes, self.accumulation_steps = num_processes, accumulation_steps
        self.checks = [
            (n, lang)
            for n in self.annotations
            for lang in dict.fromkeys(x for d in self.directions for x in (d if target_annotations else d[:1]))
        ]
        self.report = DropReport("train")
        self.locate = Locator(
            {
                "kind": source.kind,
                "label": source.label,
                "files": source.files,
                "annotation_files": source.annotation_files,
                "path": source.path,
                "line_offset": 2 if source.kind == "tsv" else 1,
            }
        )
        self.rows_per_epoch: int | None = None
        self.reported_until = 0  # rows of the first epoch already counted in `report`
        self.kept_pairs = 0  # pairs kept in those rows

    # -------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        return {
            "report": {"counts": dict(self.report.counts), "locations": self.report.locations},
            "rows_per_epoch": self.rows_per_epoch,
            "reported_until": self.reported_until,
            "kept_pairs": self.kept_pairs,
        }

    def load_state_dict(self, state: dict) -> None:
        self.report = _report_from_dict("train", state["report"])
        self.rows_per_epoch = state.get("rows_per_epoch")
        self.reported_until = int(state.get("reported_until", 0))
        self.kept_pairs = int(state.get("kept_pairs", 0))

    # ------------------------------------------------------------------------------------------ buffers
    def _buffer_pairs(self, block: dict, epoch: int):
        """The kept pairs of a block of measured rows, their lengths, and the report of the others."""
        n = len(block["row"])
        rows = np.asarray(block["row"], dtype=np.int64)
        reason, src_len, tgt_len = pair_reasons(
            lambda name: np.asarray(block[name]),
            n,
            self.languages,
            self.directions,
            self.annotations,
            self.target_annotations,
            self.tag,
            self.max_length,
            self.skip_absent,
        )
        flat = reason.reshape(-1)
        first_time = epoch == 0 and int(rows[0]) >= self.reported_until
        bad = np.flatnonzero(flat > 0)
        if len(bad) and (self.on_bad_pairs == "error" or first_time):
            checked = self._block_checks(block, rows)
            if self.on_bad_pairs == "error":
                order = np.concatenate([bad[flat[bad] != TOO_LONG], bad[flat[bad] == TOO_LONG]])
                raise self._bad_pair_error(block, rows, int(order[0]), flat, src_len, tgt_len, checked)
            self._report_drops(rows, bad, flat, src_len, tgt_len, checked)
        kept = np.flatnonzero(flat == 0)
        if first_time:
            self.reported_until = int(rows[-1]) + 1
            self.kept_pairs += len(kept)
        return self._kept_pairs(block, rows, kept), src_len.reshape(-1)[kept], tgt_len.reshape(-1)[kept]

    def _block_checks(self, block: dict, rows: np.ndarray) -> Callable[[str, str, int], bool]:
        """`checked(name, lang, row)`: whether the `name` annotation of `lang` failed its check on `row` (a row of
        the block, numbered from the stream's start)."""
        check_cols = {f"{n_}.{lang}": np.asarray(block[f"check.{n_}.{lang}"]) for n_, lang in self.checks}

        def checked(name, lang, r):
            return check_cols[f"{name}.{lang}"][r - int(rows[0])] > 0

        return checked

    def _fault_of(self, i: int, rows, flat, src_len, tgt_len, checked):
        """(reason, row, direction, location, side at fault) of the block's pair `i` (row-major flat index)."""
        j, d = divmod(i, len(self.directions))
        s, t = self.directions[d]
        why = REASONS[flat[i] - 1]
        row = int(rows[j])
        where, side = _fault(
            why,
            row,
            s,
            t,
            self.annotations,
            self.target_annotations,
            checked,
            self.locate,
            int(src_len[j, d]),
            int(tgt_len[j, d]),
            self.max_length,
        )
        return why, row, (s, t), where, side

    def _bad_pair_error(self, block: dict, rows, i: int, flat, src_len, tgt_len, checked) -> DataError:
        """The `DataError` of `on_bad_pairs="error"` for the block's pair `i`, naming the file and line at fault."""
        why, row, (s, t), where, side = self._fault_of(i, rows, flat, src_len, tgt_len, checked)
        j, d = divmod(i, len(self.directions))
        if why == "too_long":
            return DataError(
                f"{where}: pair longer than --max_length {self.max_length} tokens (source "
                f"{int(src_len[j, d])}, target {int(tgt_len[j, d])})."
            )
        detail = ""
        if why in ANNOTATION_REASONS:
            name = next(n_ for n_ in self.annotations if checked(n_, side, row))
            value = block[_ann_col(name, side)][j]
            check = corpus.ANNOTATION_CHECKS.get(name)
            if value is None:
                detail = f"no {name!r} value"
            elif check is not None:
                problem = check(block[_text_col(side)][j].strip(), json.loads(value))
                detail = problem[1] if problem else ""
        return DataError(f"{where}: {why.replace('_', ' ')} ({s}-{t})" + (f": {detail}" if detail else "."))

    def _report_drops(self, rows, bad: np.ndarray, flat, src_len, tgt_len, checked) -> None:
        """Count the block's dropped pairs `bad` in `report`, with their locations up to the report's limit."""
        for i in bad.tolist():
            why = REASONS[flat[i] - 1]
            self.report.counts[why] += 1
            if len(self.report.locations.get(why, [])) < corpus.MAX_REPORTED_LOCATIONS:
                _, _, _, where, _ = self._fault_of(i, rows, flat, src_len, tgt_len, checked)
                self.report.locations.setdefault(why, []).append(where)

    def _kept_pairs(self, block: dict, rows, kept: np.ndarray) -> list[Pair]:
        """The `Pair`s of the block's kept pairs `kept` (row-major flat indices)."""
        D = len(self.directions)
        j, d = kept // D, kept % D
        pairs = []
        for jj, dd in zip(j.tolist(), d.tolist()):
            s, t = self.directions[dd]
            row = int(rows[jj])
            pairs.append(
                Pair(
                    s,
                    t,
                    block[_text_col(s)][jj].strip(),
                    block[_text_col(t)][jj].strip(),
                    self.locate(row, s),
                    {n_: json.loads(block[_ann_col(n_, s)][jj]) for n_ in self.annotations},
                    {n_: json.loads(block[_ann_col(n_, t)][jj]) for n_ in self.annotations}
                    if self.target_annotations
                    else {},
                    self.locate(row, t),
                )
            )
        return pairs

    def _plan(self, pairs, src_len, tgt_len, epoch: int, buffer: int) -> corpus.StepPlan:
        sampler = corpus.TokenBatchSampler(
            src_len, tgt_len, seed=(self.seed, epoch, buffer), shuffle=True, **self.sampler_args
        )
        return corpus.StepPlan(sampler.epoch(0), self.num_processes, self.accumulation_steps)

    def steps(self, position: dict | None = None) -> Iterator[tuple[list[list[Pair]], dict]]:
        """Optimizer steps of one epoch from `position` (default: the epoch's start): (the step's micro-batches as
        lists of `Pair`, the position after it). Ends with the epoch."""
        position = dict(position or {"epoch": 0, "buffer": 0, "row": 0, "step": 0})
        epoch, buffer, row, skip = (int(position[k]) for k in ("epoch", "buffer", "row", "step"))
        stream = streaming_rows(self.source, self.languages, self.annotations, self.tokenizer, self.checks, row)
        for block in stream.iter(batch_size=self.buffer_rows):
            if not block["row"]:
                continue
            pairs, src_len, tgt_len = self._buffer_pairs(block, epoch)
            next_row = int(block["row"][-1]) + 1
            if pairs:
                plan = self._plan(pairs, src_len, tgt_len, epoch, buffer)
                for k in range(skip, len(plan)):
                    after = {"epoch": epoch, "buffer": buffer, "row": row, "step": k + 1}
                    if k + 1 == len(plan):  # the buffer's last step: the next one starts the next buffer
                        after = {"epoch": epoch, "buffer": buffer + 1, "row": next_row, "step": 0}
                    yield [[pairs[i] for i in b.tolist()] for b in plan[k]], after
            skip = 0
            buffer += 1
            row = next_row
        if epoch == 0 or self.rows_per_epoch is None:
            self.rows_per_epoch = row


def stream_tokenizer_sample(source: SplitSource, languages: Sequence[str], max_lines: int | None):
    """The texts a tokenizer is trained on when the training split is streamed: the sentences of the first
    max_lines / len(languages) rows (all rows when max_lines is 0). Returns (lists of texts, one per language, rows
    used, None: the total is not known)."""
    limit = None if not max_lines else max(1, max_lines // max(len(languages), 1))
    texts: dict[str, list[str]] = {lang: [] for lang in languages}
    taken = 0
    for block in iter_row_blocks(source, languages, (), {}):
        size = len(block[_text_col(languages[0])])
        take = size if limit is None else min(size, limit - taken)
        for lang in languages:
            texts[lang].extend(t if t is not None else "" for t in block[_text_col(lang)][:take])
        taken += take
        if limit is not None and taken >= limit:
            break
    return [texts[lang] for lang in languages], taken, None
