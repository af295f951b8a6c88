"""Pair checks and the pairs stage of the cache: which rows make training pairs for the run's directions, why the rest
is dropped (`DropReport`), and the kept pairs as memory-mapped arrays (`PairSet`).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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
    open_entry,
    release_mapped_pages,
    seal_entry,
)
from .corpus import DataError, DropReport, Pair
from .measure import ABSENT, ANNOTATION_REASONS, BASE_REASONS, REASONS, STATE_EMPTY, STATE_MISSING, TOO_LONG, Measured
from .sources import Locator, Rows


# ---------------------------------------------------------------------------------------- stage 3: pairs
def pair_reasons(
    columns: Callable[[str], np.ndarray],
    n: int,
    languages: Sequence[str],
    directions: Sequence[tuple[str, str]],
    annotations: Sequence[str],
    target_annotations: bool,
    tag: int,
    max_length: int | None,
    skip_absent: bool = False,
):
    """Reason codes [n, D] (0: kept), and source/target lengths [n, D], of every (row, direction), from the
    measured columns (`columns(name)`); the first reason in `corpus.build_pairs`' order applies (missing source,
    missing target, empty source, empty target, each annotation of the source then of the target side), then
    too long (`corpus.filter_long_pairs`). `skip_absent`: a row that lacks a direction's language (not an empty
    sentence: no sentence at all) is no pair of that direction (code ABSENT, neither kept nor counted): a
    many-to-many corpus such as OPUS-100 holds one language pair a row."""
    D = len(directions)
    reason = np.zeros((n, D), dtype=np.int8)
    src_len = np.zeros((n, D), dtype=np.int32)
    tgt_len = np.zeros((n, D), dtype=np.int32)
    cache: dict[str, np.ndarray] = {}

    def col(name):
        if name not in cache:
            cache[name] = columns(name)
        return cache[name]

    for d, (s, t) in enumerate(directions):
        r = reason[:, d]
        ss, ts = col(f"state.{s}"), col(f"state.{t}")

        def assign(mask, code):
            m = mask & (r == 0)
            r[m] = code

        if skip_absent:
            r[(ss == STATE_MISSING) | (ts == STATE_MISSING)] = ABSENT
        assign(ss == STATE_MISSING, 1 + REASONS.index("missing_source"))
        assign(ts == STATE_MISSING, 1 + REASONS.index("missing_target"))
        assign(ss == STATE_EMPTY, 1 + REASONS.index("empty_source"))
        assign(ts == STATE_EMPTY, 1 + REASONS.index("empty_target"))
        for lang in (s, t) if target_annotations else (s,):
            for name in annotations:
                codes = col(f"check.{name}.{lang}")
                bad = codes > 0
                m = bad & (r == 0)
                r[m] = (1 + len(BASE_REASONS) + codes[m] - 1).astype(np.int8)
        src_len[:, d] = col(f"len.{s}") + tag
        tgt_len[:, d] = col(f"len.{t}")
        if max_length is not None:
            assign((src_len[:, d] > max_length) | (tgt_len[:, d] > max_length), TOO_LONG)
    return reason, src_len, tgt_len


def _fault(
    reason: str,
    row: int,
    s: str,
    t: str,
    annotations,
    target_annotations,
    checked,
    locate,
    src_len=0,
    tgt_len=0,
    max_length=None,
) -> tuple[str, str]:
    """(location, side) of a dropped pair's side at fault."""
    if reason in ("missing_source", "empty_source"):
        return locate(row, s), s
    if reason in ("missing_target", "empty_target"):
        return locate(row, t), t
    if reason == "too_long":
        side = s if src_len > max_length else t
        return locate(row, side), side
    for lang in (s, t) if target_annotations else (s,):
        for name in annotations:
            if checked(name, lang, row):
                return locate(row, lang, name), lang
    return locate(row, s), s


@dataclass
class PairSet:
    """The kept pairs of a split: numpy arrays `rows`, `dirs` (index into `directions`), `src_len`, `tgt_len`
    (memory-mapped from the cache), the drop `report`, and the rows they come from (`pairs(indices)` builds the
    `corpus.Pair`s of a batch from the memory-mapped text)."""

    rows: Rows
    directions: list[tuple[str, str]]
    row_index: np.ndarray
    dir_index: np.ndarray
    src_len: np.ndarray
    tgt_len: np.ndarray
    report: DropReport
    annotations: list[str]
    target_annotations: bool
    fingerprint: str = ""
    built: bool = False
    pairs_per_direction: dict | None = None
    _columns: object = None

    def __len__(self) -> int:
        return len(self.row_index)

    def _table(self):
        if self._columns is None:
            cols = [_text_col(lang) for lang in dict.fromkeys(x for d in self.directions for x in d)]
            cols += [
                _ann_col(n, lang)
                for n in self.annotations
                for lang in dict.fromkeys(
                    x for d in self.directions for x in (d if self.target_annotations else d[:1])
                )
            ]
            self._columns = self.rows.dataset.select_columns(cols)
        return self._columns

    def pairs(self, indices) -> list[Pair]:
        """The `corpus.Pair`s of these pair indices, in order, read from the memory-mapped rows."""
        idx = np.asarray(indices, dtype=np.int64)
        if not len(idx):
            return []
        rows = self.row_index[idx].astype(np.int64)
        dirs = self.dir_index[idx]
        data = self._table()[rows.tolist()]
        locate = self.rows.locate
        out = []
        for j, (row, d) in enumerate(zip(rows.tolist(), dirs.tolist())):
            s, t = self.directions[d]
            src_extra = {n: json.loads(data[_ann_col(n, s)][j]) for n in self.annotations}
            tgt_extra = (
                {n: json.loads(data[_ann_col(n, t)][j]) for n in self.annotations} if self.target_annotations else {}
            )
            out.append(
                Pair(
                    s,
                    t,
                    data[_text_col(s)][j].strip(),
                    data[_text_col(t)][j].strip(),
                    locate(row, s),
                    src_extra,
                    tgt_extra,
                    locate(row, t),
                )
            )
        release_mapped_pages(self.rows.dataset)
        return out

    def to_pairs(self) -> list[Pair]:
        """Every pair as `corpus.Pair` (for validation and test sets)."""
        return self.pairs(np.arange(len(self)))


# Names of text columns that are no language (though "src" and "tgt" pass for ISO 639-3 codes): never advised as
# --source_lang/--target_lang, whose values the model's config and card record as its languages.
COLUMN_NAMES = frozenset({"src", "tgt", "trg", "source", "target", "inp", "input", "out", "output", "ref", "hyp"})


def language_hint(rows: Rows, multilingual: bool = False) -> str:
    """What to pass when a language of the run is not in `rows`: only flags that make the intended model. The codes
    found are advised as languages only when they are language codes; columns of a `datasets` dataset named
    otherwise (`src`, `tgt`) are named with --source_column/--target_column beside the languages' own codes."""
    present = rows.languages_present
    not_languages = [name for name in present if name.lower() in COLUMN_NAMES]
    if rows.meta.get("layout") == "columns" and (not_languages or len(present) != 2):
        columns = present if len(present) == 2 else ["COLUMN", "COLUMN"]
        return (
            f": name its text columns and their languages, --source_column {columns[0]} --target_column "
            f"{columns[1]} --source_lang CODE --target_lang CODE (the ISO codes of the languages in those columns, "
            "e.g. en and fr: the model's config and card record them)"
        )
    if not_languages:
        where = {"tsv": "its header line", "jsonl": "the keys of its rows", "files": "the file names"}
        return (
            f": {', '.join(not_languages)} name no language; write the languages' ISO codes (e.g. en, fr) in "
            f"{where.get(rows.meta.get('kind'), 'its language keys')} (the model's config and card record them)"
        )
    if len(present) == 2:
        if multilingual:
            return f": pass --languages {present[0]} {present[1]}"
        return f": pass --source_lang {present[0]} --target_lang {present[1]} (or the reverse)"
    if len(present) > 2:
        return ": choose with --source_lang/--target_lang, or --languages for a multilingual run"
    return ""


def check_languages(
    rows: Rows,
    directions: Sequence[tuple[str, str]],
    annotations: Sequence[str] = (),
    target_annotations: bool = False,
) -> None:
    """A `DataError` when a direction's language, or a needed annotation, is not in the split at all."""
    label = rows.meta["label"]
    present = rows.languages_present
    for s, t in directions:
        for lang in (s, t):
            if lang not in present:
                raise DataError(
                    f"Language {lang!r} is not in {label} (it has: {', '.join(present) or 'no languages'})"
                    f"{language_hint(rows, multilingual=len(directions) > 1)}."
                )
        for name in annotations:
            for lang in (s, t) if target_annotations else (s,):
                if lang not in rows.meta.get("annotations_present", {}).get(name, []):
                    raise DataError(
                        f"{label} has no {name!r} annotation for {lang!r} sentences (per-language "
                        f'files: <prefix>.{lang}.{name}[.gz]; JSONL: a top-level {{"{name}": '
                        f'{{"{lang}": ...}}}} on every line).'
                    )


_PAIR_ARRAYS = ("rows", "dirs", "src_len", "tgt_len")  # a pair set's cached arrays, `{name}.npy`


@dataclass
class _PairScan:
    """The reason codes of every (row, direction), summed up one direction at a time by `_scan_pairs`."""

    counts: np.ndarray  # pairs per reason code (index 0: kept)
    examples: list[tuple[int, int, int, int, int]]  # (row, direction, code, source length, target length)
    first_bad: tuple[int, int] | None  # (row, direction) of the first pair dropped for a reason other than too long
    first_long: tuple[int, int] | None  # ... of the first too long pair
    per_direction: dict[str, int]  # kept pairs per "src-tgt"
    kept: dict[str, list[np.ndarray]]  # _PAIR_ARRAYS of the kept pairs, one array per direction


def _measured_checks(measured: Measured) -> Callable[[str, str, int], bool]:
    """`checked(name, lang, row)`: whether the `name` annotation of `lang` failed its check on `row`."""

    def checked(name, lang, row):
        return measured.column(f"check.{name}.{lang}")[row] > 0

    return checked


def _scan_pairs(
    measured: Measured,
    n: int,
    directions: list[tuple[str, str]],
    annotations: list[str],
    target_annotations: bool,
    tag: int,
    max_length: int | None,
    skip_absent: bool,
) -> _PairScan:
    """`pair_reasons` of the `n` measured rows, one direction at a time (memory: a few arrays of n entries, whatever
    the number of directions); the report's examples and the first error are then picked in row-major order over
    (row, direction), as `corpus.build_pairs` does."""
    langs = list(dict.fromkeys(x for d in directions for x in d))
    row_dtype = np.int32 if n < 2**31 else np.int64
    scan = _PairScan(np.zeros(len(REASONS) + 1, dtype=np.int64), [], None, None, {}, {k: [] for k in _PAIR_ARRAYS})
    for d, direction in enumerate(directions):
        reason, src_len, tgt_len = pair_reasons(
            measured.column, n, langs, [direction], annotations, target_annotations, tag, max_length, skip_absent
        )
        r, sl, tl = reason[:, 0], src_len[:, 0], tgt_len[:, 0]
        scan.counts += np.bincount(r[r >= 0], minlength=len(REASONS) + 1)
        for code in np.unique(r[r > 0]).tolist():
            for row in np.flatnonzero(r == code)[: corpus.MAX_REPORTED_LOCATIONS].tolist():
                scan.examples.append((row, d, code, int(sl[row]), int(tl[row])))
        bad = np.flatnonzero((r > 0) & (r != TOO_LONG))
        if len(bad) and (scan.first_bad is None or (int(bad[0]), d) < scan.first_bad[:2]):
            scan.first_bad = (int(bad[0]), d)
        long_ = np.flatnonzero(r == TOO_LONG)
        if len(long_) and (scan.first_long is None or (int(long_[0]), d) < scan.first_long[:2]):
            scan.first_long = (int(long_[0]), d)
        keep = np.flatnonzero(r == 0)
        scan.per_direction[f"{direction[0]}-{direction[1]}"] = len(keep)
        scan.kept["rows"].append(keep.astype(row_dtype))
        scan.kept["dirs"].append(np.full(len(keep), d, dtype=np.int16))
        scan.kept["src_len"].append(sl[keep])
        scan.kept["tgt_len"].append(tl[keep])
        del reason, src_len, tgt_len, r, sl, tl, keep
    return scan


def _first_bad_pair_error(
    scan: _PairScan,
    rows: Rows,
    directions: list[tuple[str, str]],
    annotations: list[str],
    target_annotations: bool,
    max_length: int | None,
    checked,
) -> DataError:
    """The `DataError` of `on_bad_pairs="error"`: the first bad pair (too long pairs after the others), naming the
    file and line of the side at fault."""
    locate = rows.locate
    row, d = scan.first_bad or scan.first_long
    s, t = directions[d]
    code = next(c for (r_, d_, c, _, _) in scan.examples if (r_, d_) == (row, d))
    ls, lt = next((a, b) for (r_, d_, _, a, b) in scan.examples if (r_, d_) == (row, d))
    why = REASONS[code - 1]
    if why == "too_long":
        where, _ = _fault(why, row, s, t, annotations, target_annotations, checked, locate, ls, lt, max_length)
        return DataError(f"{where}: pair longer than --max_length {max_length} tokens (source {ls}, target {lt}).")
    where, side = _fault(why, row, s, t, annotations, target_annotations, checked, locate)
    detail = ""
    if why in ANNOTATION_REASONS:
        detail = _annotation_detail(rows, row, side, annotations, checked)
    return DataError(f"{where}: {why.replace('_', ' ')} ({s}-{t})" + (f": {detail}" if detail else "."))


def _scan_report(
    split: str,
    scan: _PairScan,
    directions: list[tuple[str, str]],
    annotations: list[str],
    target_annotations: bool,
    max_length: int | None,
    checked,
    locate: Locator,
) -> DropReport:
    """The drop report of a scan: the count of every reason and the first locations of each, in row-major order."""
    report = DropReport(split)
    for code in np.flatnonzero(scan.counts[1:]) + 1:
        report.counts[REASONS[code - 1]] = int(scan.counts[code])
    for row, d, code, ls, lt in sorted(scan.examples):
        why = REASONS[code - 1]
        if len(report.locations.get(why, [])) < corpus.MAX_REPORTED_LOCATIONS:
            s, t = directions[d]
            where, _ = _fault(why, row, s, t, annotations, target_annotations, checked, locate, ls, lt, max_length)
            report.locations.setdefault(why, []).append(where)
    return report


def _kept_pair_arrays(kept: dict[str, list[np.ndarray]], several_directions: bool) -> dict[str, np.ndarray]:
    """The _PAIR_ARRAYS of the kept pairs in row-major order (row, then direction), the lengths in the smallest dtype
    that holds them. `kept` (per-direction parts) is emptied as the parts are joined, to free them."""
    rows_a, dirs_a = np.concatenate(kept.pop("rows")), np.concatenate(kept.pop("dirs"))
    src_a, tgt_a = np.concatenate(kept.pop("src_len")), np.concatenate(kept.pop("tgt_len"))
    if several_directions:  # row-major: row, then direction
        order = np.lexsort((dirs_a, rows_a))
        rows_a, dirs_a, src_a, tgt_a = rows_a[order], dirs_a[order], src_a[order], tgt_a[order]
        del order
    longest = int(max(src_a.max(initial=0), tgt_a.max(initial=0)))
    len_dtype = np.int16 if longest < 2**15 else np.int32
    return {"rows": rows_a, "dirs": dirs_a, "src_len": src_a.astype(len_dtype), "tgt_len": tgt_a.astype(len_dtype)}


def _write_pair_cache(cache_dir: Path, fp: str, arrays: dict[str, np.ndarray], meta: dict) -> None:
    """`{name}.npy` of each array and `meta.json` into a temporary folder, published as `pairs-{fp}`."""
    tmp = _new_tmp(cache_dir, f"pairs-{fp}")
    try:
        for k, v in arrays.items():
            np.save(tmp / f"{k}.npy", v)
        seal_entry(tmp, meta)
        _publish(tmp, cache_dir / f"pairs-{fp}")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _open_pair_set(final: Path, report: DropReport, pairs_per_direction: dict | None, built: bool, **common):
    """The `PairSet` over the arrays cached in `final` (memory-mapped)."""
    arrays = {k: np.load(final / f"{k}.npy", mmap_mode="r") for k in _PAIR_ARRAYS}
    return PairSet(
        row_index=arrays["rows"],
        dir_index=arrays["dirs"],
        src_len=arrays["src_len"],
        tgt_len=arrays["tgt_len"],
        report=report,
        built=built,
        pairs_per_direction=pairs_per_direction,
        **common,
    )


def build_pair_set(
    rows: Rows,
    measured: Measured,
    directions: Sequence[tuple[str, str]],
    *,
    annotations: Sequence[str] = (),
    target_annotations: bool = False,
    tag: int = 0,
    max_length: int | None = None,
    on_bad_pairs: str = "skip",
    split: str = "train",
    cache_dir: str | os.PathLike | None = None,
    skip_absent: bool = False,
) -> PairSet:
    """Stage 3 from the cache, or computed (vectorized over the measured columns) and cached. With
    `on_bad_pairs="error"` the first bad pair (in `corpus.build_pairs` order; too long pairs after the others)
    raises a `DataError` naming the file and line of the side at fault; nothing is cached then."""
    if on_bad_pairs not in ("skip", "error"):
        raise ValueError(f"on_bad_pairs must be 'skip' or 'error', got {on_bad_pairs!r}.")
    directions = [tuple(d) for d in directions]
    annotations = list(annotations)
    check_languages(rows, directions, annotations, target_annotations)
    cache_dir = Path(cache_dir or default_cache_dir())
    fp = _digest(
        {
            "version": PIPELINE_VERSION,
            "measured": measured.fingerprint,
            "directions": directions,
            "annotations": annotations,
            "target_annotations": target_annotations,
            "tag": tag,
            "max_length": max_length,
            "on_bad_pairs": on_bad_pairs,
            "skip_absent": skip_absent,
        }
    )
    final = cache_dir / f"pairs-{fp}"
    common = dict(
        rows=rows,
        directions=list(directions),
        annotations=annotations,
        target_annotations=target_annotations,
        fingerprint=fp,
    )
    cached = open_entry(  # a damaged entry is named, removed and built again
        final,
        lambda meta: _open_pair_set(
            final, _report_from_dict(split, meta["report"]), meta.get("pairs_per_direction"), False, **common
        ),
    )
    if cached is not None:
        return cached
    n = len(rows)
    checked = _measured_checks(measured)
    scan = _scan_pairs(measured, n, directions, annotations, target_annotations, tag, max_length, skip_absent)
    if on_bad_pairs == "error" and (scan.first_bad or scan.first_long):
        raise _first_bad_pair_error(scan, rows, directions, annotations, target_annotations, max_length, checked)
    locate = rows.locate
    report = _scan_report(split, scan, directions, annotations, target_annotations, max_length, checked, locate)
    arrays = _kept_pair_arrays(scan.kept, len(directions) > 1)
    meta = {
        "pairs": len(arrays["rows"]),
        "rows": n,
        "report": {"counts": dict(report.counts), "locations": report.locations},
        "directions": directions,
        "pairs_per_direction": scan.per_direction,
    }
    _write_pair_cache(cache_dir, fp, arrays, meta)
    del arrays
    return _open_pair_set(final, report, scan.per_direction, True, **common)


def _report_from_dict(split: str, data: dict) -> DropReport:
    report = DropReport(split)
    report.counts.update({k: int(v) for k, v in data["counts"].items()})
    report.locations = {k: list(v) for k, v in data["locations"].items()}
    return report


def _annotation_detail(rows: Rows, row: int, lang: str, annotations, checked) -> str:
    """The check's message for row's `lang` annotation (re-run on that one row for the error)."""
    data = rows.dataset[row]
    sentence = (data[_text_col(lang)] or "").strip()
    for name in annotations:
        if checked(name, lang, row):
            value = data[_ann_col(name, lang)]
            if value is None:
                return f"no {name!r} value"
            check = corpus.ANNOTATION_CHECKS.get(name)
            problem = check(sentence, json.loads(value)) if check is not None else None
            return problem[1] if problem else ""
    return ""
