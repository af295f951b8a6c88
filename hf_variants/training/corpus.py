"""Parallel data for the training and translation scripts: reading, validation, and token-based batching.

Sources (every one becomes a `ParallelCorpus`: rows of `{lang: sentence}` with a location for each row):

- multi-way text files, one per language, one sentence a line, plain or `.gz` (`{prefix}.{lang}[.gz]` in a folder,
  the layout of the bundled Multi30k);
- TSV files whose header names the language of each column (`en<TAB>de`), or with the columns given;
- JSONL files with one `{"translation": {"en": ..., "de": ...}}` (or flat `{"en": ..., "de": ...}`) object a line;
- Hub datasets in the same `{"translation": {...}}` shape, through `datasets.load_dataset`.

Nothing is dropped silently. Structural problems raise `DataError` naming the file and line: text files of one
split with different line counts, a TSV line with the wrong number of fields, invalid JSON, a language that is not
in the data, an invalid language code. Bad pairs (an empty side, a side missing from a row, too long, a source
annotation that does not fit its sentence, such as a parse whose leaves do not spell it) are either skipped and
counted by reason in a `DropReport` (logged, and written to `results.json` and the model card by the training
script) or, with `on_bad_pairs="error"`, raise a `DataError` naming the file and line of the side at fault (the
target file for a target-side problem, the annotation file for a bad annotation).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import re
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

LANG_CODE = re.compile(r"^[a-z]{2,3}(?:[-_][A-Za-z0-9]{2,8})*$")
MAX_REPORTED_LOCATIONS = 5


class DataError(ValueError):
    """A problem in the input data that stops the run; the message names the file and line."""


def check_language_code(lang: str, where: str = "") -> str:
    if not isinstance(lang, str) or not LANG_CODE.match(lang):
        at = f" in {where}" if where else ""
        raise DataError(
            f"Unknown or invalid language code {lang!r}{at}: expected an ISO 639 code such as 'en', 'de' or 'pt_BR'."
        )
    return lang


# ----------------------------------------------------------------------------------------------------- reading
UTF8_BOM = b"\xef\xbb\xbf"  # the byte-order mark Windows editors (Notepad) write at the start of UTF-8 files
# a line of hf-variants-translate's n-best JSON Lines output: {"source": ..., "hypotheses": [...]}
NBEST_LINE = re.compile(r'^\{\s*"source"\s*:.*"hypotheses"\s*:\s*\[')


def nbest_error(where: str) -> DataError:
    """The `DataError` for a line of hf-variants-translate's n-best JSON Lines output found at `where` (file:line)
    where a sentence or a corpus row is expected."""
    return DataError(
        f'{where}: a line of hf-variants-translate\'s n-best JSON Lines output ({{"source": ..., "hypotheses": '
        "[...]}), not a sentence: translate with --output_format text or tsv_pairs to get text (tsv_pairs: "
        "source<TAB>translation pairs for training), or score its hypotheses with hf-variants-score --nbest_input."
    )


def check_not_nbest(line: str, where: str) -> None:
    """`nbest_error(where)` when `line` is a line of hf-variants-translate's n-best JSON Lines output: its JSON
    would otherwise become a sentence's text."""
    if line.startswith("{") and NBEST_LINE.match(line):
        raise nbest_error(where)


def open_text(path: str | os.PathLike):
    """A plain or gzip UTF-8 text file for reading; a byte-order mark at its start is dropped (utf-8-sig)."""
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")
    return open(path, encoding="utf-8-sig", newline="\n")


def read_lines(path: str | os.PathLike) -> list[str]:
    """All lines of a plain or gzip text file (UTF-8), without line terminators. A bad encoding names the line; a
    byte-order mark at the start of the file is dropped (it is no part of the first line's text)."""
    path = Path(path)
    lines = []
    try:
        with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
            for raw in f:
                try:
                    lines.append(raw.decode("utf-8-sig" if not lines else "utf-8").rstrip("\r\n"))
                except UnicodeDecodeError as err:
                    raise DataError(f"{path}: line {len(lines) + 1} is not valid UTF-8 ({err.reason}).") from err
                check_not_nbest(lines[-1], f"{path}:{len(lines)}")
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read ({err}).") from err
    return lines


@dataclass
class ParallelCorpus:
    """Aligned rows `{lang: text}`; `locations[i]` says where row i came from (for messages)."""

    name: str
    rows: list[dict[str, str]]
    locations: list[str]
    languages: list[str]
    # per-sentence source annotations a variant's `prepare_translation_inputs` takes (e.g. MG-SA's `parses`):
    # name -> language -> one value per row
    annotations: dict[str, dict[str, list]] = field(default_factory=dict)
    # line-aligned per-language files (row i = line i + 1): language -> path, and annotation -> language -> path;
    # empty for TSV/JSONL/datasets, whose rows hold every language (`locations` names them)
    files: dict[str, str] = field(default_factory=dict)
    annotation_files: dict[str, dict[str, str]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.rows)

    def head(self, n: int) -> "ParallelCorpus":
        """The first `n` rows."""
        annotations = {k: {lang: v[:n] for lang, v in by_lang.items()} for k, by_lang in self.annotations.items()}
        return ParallelCorpus(
            self.name,
            self.rows[:n],
            self.locations[:n],
            self.languages,
            annotations,
            dict(self.files),
            {k: dict(v) for k, v in self.annotation_files.items()},
        )

    def column(self, lang: str) -> list[str]:
        return [row.get(lang, "") for row in self.rows]

    def location(self, i: int, lang: str | None = None, annotation: str | None = None) -> str:
        """Where row i's `lang` sentence (or its `annotation`) comes from: `file:line` of that language's (or
        annotation's) own file when the split is per-language files, else the row's location."""
        path = (self.annotation_files.get(annotation, {}) if annotation else self.files).get(lang)
        return f"{path}:{i + 1}" if path else self.locations[i]


def find_split_file(data_dir: str | os.PathLike, prefix: str, lang: str) -> Path:
    """`{data_dir}/{prefix}.{lang}` or `{prefix}.{lang}.gz`."""
    data_dir = Path(data_dir)
    for name in (f"{prefix}.{lang}", f"{prefix}.{lang}.gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    available = sorted(p.name for p in data_dir.glob(f"{prefix}.*")) if data_dir.is_dir() else []
    hint = ""
    if not available and data_dir.is_dir():  # a prefix the folder does not use: name the ones it does
        prefixes = sorted({p.name.split(".")[0] for p in data_dir.iterdir() if p.is_file() and "." in p.name})
        hint = (
            f"; its files' prefixes: {', '.join(prefixes) or 'none'} (--train_prefix, --valid_prefix and "
            "--test_prefix name the splits' prefixes; '' for no validation or test split)"
        )
    raise DataError(
        f"No file for language {lang!r} of split {prefix!r} in {data_dir} (looked for {prefix}.{lang} "
        f"and {prefix}.{lang}.gz; found: {', '.join(available) or 'nothing'}){hint}."
    )


def load_text_files(files: dict[str, str | os.PathLike], name: str | None = None) -> ParallelCorpus:
    """Multi-way parallel text files `{lang: path}`; line i of every file is the same sentence."""
    if not files:
        raise DataError("No text files given.")
    for lang, path in files.items():
        check_language_code(lang, str(path))
    columns = {lang: read_lines(path) for lang, path in files.items()}
    counts = {lang: len(lines) for lang, lines in columns.items()}
    if len(set(counts.values())) > 1:
        shortest = min(counts, key=counts.get)
        longest = max(counts, key=counts.get)
        raise DataError(
            "Parallel files have different line counts: "
            + ", ".join(f"{files[lang]} has {n} lines" for lang, n in counts.items())
            + f". {files[longest]} line {counts[shortest] + 1} has no counterpart in {files[shortest]}."
        )
    langs = list(files)
    n = counts[langs[0]]
    rows = [{lang: columns[lang][i] for lang in langs} for i in range(n)]
    label = name or " + ".join(str(p) for p in files.values())
    first = str(files[langs[0]])
    locations = [f"{first}:{i + 1}" for i in range(n)]
    return ParallelCorpus(label, rows, locations, langs, files={lang: str(path) for lang, path in files.items()})


def load_split_from_dir(
    data_dir: str | os.PathLike, prefix: str, languages: Sequence[str], annotations: Sequence[str] = ()
) -> ParallelCorpus:
    """`{prefix}.{lang}[.gz]` for every language, plus each annotation `{prefix}.{lang}.{name}[.gz]` (one value a
    line, aligned with the sentences) where such a file exists."""
    files = {lang: find_split_file(data_dir, prefix, lang) for lang in languages}
    data = load_text_files(files, name=f"{Path(data_dir).name}/{prefix}")
    for name in annotations:
        for lang in languages:
            try:
                path = find_split_file(data_dir, f"{prefix}.{lang}", name)
            except DataError:
                continue
            values = read_lines(path)
            if len(values) != len(data):
                raise DataError(
                    f"{path} has {len(values)} lines but {files[lang]} has {len(data)}; line "
                    f"{min(len(values), len(data)) + 1} has no counterpart."
                )
            data.annotations.setdefault(name, {})[lang] = values
            data.annotation_files.setdefault(name, {})[lang] = str(path)
    return data


def load_tsv(path: str | os.PathLike, columns: Sequence[str] | None = None) -> ParallelCorpus:
    """A TSV file; the first line names the language of each column unless `columns` is given."""
    lines = read_lines(path)
    start = 0
    if columns is None:
        if not lines:
            raise DataError(f"{path}: empty TSV file (expected a header line such as 'en<TAB>de').")
        columns = lines[0].split("\t")
        for col in columns:
            check_language_code(col.strip(), f"{path}:1 (TSV header)")
        columns = [c.strip() for c in columns]
        start = 1
    else:
        for col in columns:
            check_language_code(col, f"columns of {path}")
    if len(set(columns)) != len(columns):
        raise DataError(f"{path}: duplicate language columns {columns}.")
    rows, locations = [], []
    for i in range(start, len(lines)):
        fields = lines[i].split("\t")
        if len(fields) != len(columns):
            raise DataError(
                f"{path}:{i + 1}: expected {len(columns)} tab-separated fields ({', '.join(columns)}), "
                f"found {len(fields)}."
            )
        rows.append(dict(zip(columns, fields)))
        locations.append(f"{path}:{i + 1}")
    return ParallelCorpus(str(path), rows, locations, list(columns))


def parse_jsonl_line(line: str, where: str) -> dict:
    """One line of a JSONL file as its object; `where` ("file:line") names it in the `DataError` for an empty line,
    invalid JSON or a value that is not an object. Shared by the training loaders and translate.py."""
    if not line.strip():
        raise DataError(f"{where}: empty line (expected one JSON object a line).")
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(f"{where}: invalid JSON ({err.msg}).") from err
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}.")
    return obj


def _translation_row(obj, where: str) -> dict[str, str]:
    if isinstance(obj, dict) and "source" in obj and isinstance(obj.get("hypotheses"), list):
        raise nbest_error(where)
    if isinstance(obj, dict) and "translation" in obj:
        obj = obj["translation"]
    if not isinstance(obj, dict):
        raise DataError(
            f'{where}: expected an object {{"translation": {{"en": ..., "de": ...}}}}, got {type(obj).__name__}.'
        )
    row = {}
    for lang, text in obj.items():
        check_language_code(lang, where)
        if text is None:
            continue  # a missing side: counted when the pair is built
        if not isinstance(text, str):
            raise DataError(f"{where}: the {lang!r} side is a {type(text).__name__}, expected a string.")
        row[lang] = text
    return row


def load_jsonl(path: str | os.PathLike, annotations: Sequence[str] = ()) -> ParallelCorpus:
    """One object a line: `{"translation": {"en": ..., "de": ...}}` or flat `{"en": ..., "de": ...}`; an
    annotation `name` is read from a top-level `{"name": {"en": value, ...}}` next to "translation"."""
    rows, locations, langs = [], [], {}
    found: dict[str, dict[str, dict[int, object]]] = {name: {} for name in annotations}
    for i, line in enumerate(read_lines(path)):
        obj = parse_jsonl_line(line, f"{path}:{i + 1}")
        row = _translation_row(obj, f"{path}:{i + 1}")
        for name in annotations:
            value = obj.get(name) if "translation" in obj else None
            if isinstance(value, dict):
                for lang, v in value.items():
                    found[name].setdefault(lang, {})[len(rows)] = v
        langs.update(dict.fromkeys(row))
        rows.append(row)
        locations.append(f"{path}:{i + 1}")
    corpus = ParallelCorpus(str(path), rows, locations, list(langs))
    for name, by_lang in found.items():
        for lang, values in by_lang.items():
            corpus.annotations.setdefault(name, {})[lang] = [values.get(i) for i in range(len(rows))]
    return corpus


# `datasets` names the validation split "validation"; datasets built by hand often say "valid", "val" or "dev".
SPLIT_NAMES = {"train": ("train",), "valid": ("validation", "valid", "val", "dev"), "test": ("test",)}


def resolve_split(available: Sequence[str], requested: str | None, role: str, dataset: str = "") -> str | None:
    """The split of a dataset to use as `role` ("train", "valid", "test"): `requested` when given (it must exist),
    else the first of `SPLIT_NAMES[role]` that the dataset has (None when it has none, except for "train")."""
    available = list(available)
    if requested:
        if requested not in available:
            raise DataError(f"Dataset {dataset!r} has no split {requested!r} (its splits: {', '.join(available)}).")
        return requested
    for name in SPLIT_NAMES[role]:
        if name in available:
            return name
    if role == "train":
        raise DataError(
            f"Dataset {dataset!r} has no 'train' split (its splits: {', '.join(available)}); name the "
            f"training split with --train_split."
        )
    return None


def load_hub_splits(name: str, config_name: str | None = None, **kwargs):
    """Every split of a `datasets` dataset as a `DatasetDict`, loaded once: a Hub name, a local folder of data
    files, or a folder written by `save_to_disk` (a `DatasetDict`'s, or a single `Dataset`'s, whose rows are then
    the "train" split)."""
    import datasets

    folder = Path(name)
    if folder.is_dir() and ((folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()):
        loaded = datasets.load_from_disk(str(folder))
        return loaded if isinstance(loaded, datasets.DatasetDict) else datasets.DatasetDict({"train": loaded})
    try:
        return datasets.load_dataset(name, config_name, **kwargs)
    except (OSError, ValueError, ConnectionError) as error:  # DatasetNotFoundError is a FileNotFoundError
        what = "" if folder.exists() else "no such folder, and on the Hub: "
        lines = str(error).strip().splitlines() or [type(error).__name__]
        config = f" --dataset_config_name {config_name}" if config_name else ""
        raise DataError(f"--dataset_name {name}{config}: {what}{lines[0]}") from None


def load_hub_dataset(name: str, split: str, config_name: str | None = None, dataset=None, **kwargs) -> ParallelCorpus:
    """A `datasets` dataset whose rows are `{"translation": {"en": ..., "de": ...}}` (Hub name or local path);
    `dataset`: the split already loaded (e.g. from `load_hub_splits`)."""
    import datasets

    ds = dataset if dataset is not None else datasets.load_dataset(name, config_name, split=split, **kwargs)
    if "translation" not in ds.column_names:
        raise DataError(f"Dataset {name!r} split {split!r} has no 'translation' column (columns: {ds.column_names}).")
    rows, locations, langs = [], [], {}
    label = f"{name}{'/' + config_name if config_name else ''}[{split}]"
    for i, obj in enumerate(ds["translation"]):
        row = _translation_row(obj, f"{label} row {i}")
        langs.update(dict.fromkeys(row))
        rows.append(row)
        locations.append(f"{label} row {i}")
    return ParallelCorpus(label, rows, locations, list(langs))


def load_corpus_file(path: str | os.PathLike, annotations: Sequence[str] = ()) -> ParallelCorpus:
    """A TSV (`.tsv`, `.tsv.gz`) or JSONL (`.jsonl`, `.json`, `.jsonl.gz`) file, chosen by extension."""
    name = Path(path).name.lower().removesuffix(".gz")
    if not Path(path).is_file():
        raise DataError(f"No such data file: {path}")
    if name.endswith(".tsv"):
        if annotations:
            raise DataError(
                f"{path}: TSV files carry no source annotations ({', '.join(annotations)}); use JSONL "
                f"or per-language files."
            )
        return load_tsv(path)
    if name.endswith((".jsonl", ".json")):
        return load_jsonl(path, annotations)
    raise DataError(
        f"{path}: unknown data file type; use .tsv or .jsonl (plain or .gz), or per-language text "
        f"files {{prefix}}.{{lang}}[.gz] with --data_dir."
    )


# ------------------------------------------------------------------------------------------------------ pairs
@dataclass
class DropReport:
    """Pairs left out of a split, counted by reason, with the first few locations of each reason."""

    split: str = "train"
    counts: Counter = field(default_factory=Counter)
    locations: dict[str, list[str]] = field(default_factory=dict)

    def add(self, reason: str, location: str) -> None:
        self.counts[reason] += 1
        where = self.locations.setdefault(reason, [])
        if len(where) < MAX_REPORTED_LOCATIONS:
            where.append(location)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        if not self.total:
            return f"{self.split}: no pairs dropped"
        parts = [
            f"{reason}: {n} (e.g. {', '.join(self.locations[reason])})" for reason, n in sorted(self.counts.items())
        ]
        return f"{self.split}: dropped {self.total} pairs; " + "; ".join(parts)

    def to_dict(self) -> dict:
        return {
            "total": self.total,
            "reasons": dict(sorted(self.counts.items())),
            "examples": {k: list(v) for k, v in sorted(self.locations.items())},
        }


@dataclass
class Pair:
    src_lang: str
    tgt_lang: str
    src: str
    tgt: str
    location: str  # of the source sentence
    src_extra: dict = field(default_factory=dict)  # annotations of the source sentence (name -> value)
    tgt_extra: dict = field(default_factory=dict)  # of the target sentence (used when it is translated back)
    tgt_location: str = ""  # of the target sentence (default: `location`, e.g. the same TSV/JSONL line)

    def __post_init__(self):
        if not self.tgt_location:
            self.tgt_location = self.location


# ------------------------------------------------------------------------------------------ annotation checks
def check_parse(sentence: str, parse) -> tuple[str, str] | None:
    """None when `parse` (a bracketed constituency parse, as the syntactic MG-SA reads it) is a well-formed tree
    whose leaves spell `sentence` (whitespace aside); else `(reason, message)`: `malformed_parse` (unbalanced
    brackets, text outside the tree, not a parse at all) or `parse_mismatch` (leaves that differ from the
    sentence). Uses the model's own reader and aligner (`hf_variants.phrases`), so what passes here is what the
    model accepts when it builds the batch."""
    from ..phrases import align_leaves, as_tree

    try:
        tree = as_tree(parse)
    except (ValueError, TypeError) as err:
        return "malformed_parse", str(err)
    try:
        align_leaves(sentence, tree.leaves())
    except ValueError as err:
        return "parse_mismatch", str(err)
    return None


# Annotation name -> check(sentence, value) -> None or (reason, message). Annotations of other names are passed
# to the model unchecked.
ANNOTATION_CHECKS = {"parses": check_parse}


def parse_directions(spec: str | Sequence[str] | None, languages: Sequence[str]) -> list[tuple[str, str]]:
    """`"en-de,de-en"` (or a list of such) → `[("en", "de"), ("de", "en")]`; None → every ordered pair. `*` stands
    for every other language of the run: `"en-*,*-en"` are the English-centric directions (in `languages` order)."""
    if spec is None or spec == "" or spec == "all":
        return [(s, t) for s in languages for t in languages if s != t]
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    expanded = []
    for item in items:
        parts = [p.strip() for p in item.strip().split("-")]
        if len(parts) == 2 and parts.count("*") == 1:
            fixed = parts[1] if parts[0] == "*" else parts[0]
            check_language_code(fixed, "--directions")
            if fixed not in languages:
                raise DataError(
                    f"Direction {item!r} uses language {fixed!r}, which is not in the languages of the "
                    f"run ({', '.join(languages)})."
                )
            others = [lang for lang in languages if lang != fixed]
            expanded += [f"{o}-{fixed}" if parts[0] == "*" else f"{fixed}-{o}" for o in others]
        else:
            expanded.append(item)
    directions = []
    for item in expanded:
        parts = item.strip().split("-")
        if len(parts) != 2:
            raise DataError(f"Invalid direction {item!r}: expected 'src-tgt', e.g. 'en-de'.")
        s, t = (check_language_code(p.strip(), "--directions") for p in parts)
        for lang in (s, t):
            if lang not in languages:
                raise DataError(
                    f"Direction {item!r} uses language {lang!r}, which is not in the languages of the "
                    f"run ({', '.join(languages)})."
                )
        if s == t:
            raise DataError(f"Invalid direction {item!r}: source and target are the same language.")
        directions.append((s, t))
    return directions


def build_pairs(
    corpus: ParallelCorpus,
    directions: Sequence[tuple[str, str]],
    report: DropReport,
    on_bad_pairs: str = "skip",
    annotations: Sequence[str] = (),
    target_annotations: bool = False,
) -> list[Pair]:
    """One `Pair` per row and direction. Empty or missing sides, and missing or ill-fitting annotations (see
    `ANNOTATION_CHECKS`), are counted in `report` under the location of the side at fault (or raise).

    `annotations` name per-sentence inputs the model needs for its source sentences (and, with
    `target_annotations`, for the targets too, which bidirectional training translates back)."""
    if on_bad_pairs not in ("skip", "error"):
        raise ValueError(f"on_bad_pairs must be 'skip' or 'error', got {on_bad_pairs!r}.")
    for s, t in directions:
        for lang in (s, t):
            if lang not in corpus.languages:
                raise DataError(
                    f"Language {lang!r} is not in {corpus.name} (it has: "
                    f"{', '.join(corpus.languages) or 'no languages'})."
                )
        for name in annotations:
            for lang in (s, t) if target_annotations else (s,):
                if lang not in corpus.annotations.get(name, {}):
                    raise DataError(
                        f"{corpus.name} has no {name!r} annotation for {lang!r} sentences (per-language "
                        f'files: <prefix>.{lang}.{name}[.gz]; JSONL: a top-level {{"{name}": '
                        f'{{"{lang}": ...}}}} on every line).'
                    )
    checked: dict[tuple[int, str, str], tuple[str, str] | None] = {}  # (row, lang, name) -> problem

    def annotation_problem(r: int, lang: str, name: str, sentence: str) -> tuple[str, str] | None:
        """(reason, message) when annotation `name` of row r's `lang` sentence is missing or does not fit it."""
        key = (r, lang, name)
        if key not in checked:
            value = corpus.annotations[name][lang][r]
            check = ANNOTATION_CHECKS.get(name)
            if value is None:
                checked[key] = ("missing_annotation", f"no {name!r} value")
            else:
                checked[key] = check(sentence, value) if check is not None else None
        return checked[key]

    pairs = []
    for r, row in enumerate(corpus.rows):
        for s, t in directions:
            src, tgt = row.get(s), row.get(t)
            reason, location, detail = None, corpus.location(r, s), ""
            if src is None:
                reason = "missing_source"
            elif tgt is None:
                reason, location = "missing_target", corpus.location(r, t)
            elif not src.strip():
                reason = "empty_source"
            elif not tgt.strip():
                reason, location = "empty_target", corpus.location(r, t)
            else:
                sides = ((s, src), (t, tgt)) if target_annotations else ((s, src),)
                for lang, sentence in sides:
                    for name in annotations:
                        problem = annotation_problem(r, lang, name, sentence.strip())
                        if problem is not None:
                            (reason, detail), location = problem, corpus.location(r, lang, name)
                            break
                    if reason is not None:
                        break
            if reason is not None:
                if on_bad_pairs == "error":
                    raise DataError(
                        f"{location}: {reason.replace('_', ' ')} ({s}-{t})" + (f": {detail}" if detail else ".")
                    )
                report.add(reason, location)
                continue
            src_extra = {name: corpus.annotations[name][s][r] for name in annotations}
            tgt_extra = {name: corpus.annotations[name][t][r] for name in annotations} if target_annotations else {}
            pairs.append(
                Pair(
                    s, t, src.strip(), tgt.strip(), corpus.location(r, s), src_extra, tgt_extra, corpus.location(r, t)
                )
            )
    return pairs


def filter_long_pairs(
    pairs: list[Pair],
    src_lens: Sequence[int],
    tgt_lens: Sequence[int],
    max_length: int,
    report: DropReport,
    on_bad_pairs: str = "skip",
):
    """Drop (count) pairs with a side longer than `max_length` tokens; returns the kept pairs and lengths."""
    keep_pairs, keep_src, keep_tgt = [], [], []
    for pair, ls, lt in zip(pairs, src_lens, tgt_lens):
        if ls > max_length or lt > max_length:
            location = pair.location if ls > max_length else pair.tgt_location  # the (first) side that is too long
            if on_bad_pairs == "error":
                raise DataError(
                    f"{location}: pair longer than --max_length {max_length} tokens (source {ls}, target {lt})."
                )
            report.add("too_long", location)
            continue
        keep_pairs.append(pair)
        keep_src.append(ls)
        keep_tgt.append(lt)
    return keep_pairs, keep_src, keep_tgt


# --------------------------------------------------------------------------------------------------- batching
class EpochBatches(Sequence):
    """One epoch's batches as numpy arrays, never as Python lists of all examples: `order` lists the examples
    sorted by length, batch j of the sorted cut is `order[offsets[j]:offsets[j + 1]]`, and batch k of the epoch
    is sorted batch `perm[k]`. `batches[k]` is an integer array of example indices."""

    def __init__(self, order: np.ndarray, offsets: np.ndarray, perm: np.ndarray):
        self.order, self.offsets, self.perm = order, offsets, perm

    def __len__(self) -> int:
        return len(self.perm)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        j = int(self.perm[k])
        return self.order[self.offsets[j] : self.offsets[j + 1]]

    def tolist(self) -> list[list[int]]:
        return [b.tolist() for b in self]


def _cut_sorted(
    sorted_lengths: np.ndarray, max_tokens: int, max_sentences: int | None, examples_per_item: int
) -> np.ndarray:
    """Start offsets (plus the end) of the greedy cut of length-sorted (ascending) examples into batches of at most
    `max_tokens` (n * examples_per_item * longest) and `max_sentences` examples: the batches of the loop
    "add the next example unless the batch would then exceed a limit", computed per run of equal lengths (a few
    hundred numpy operations, whatever the number of examples). Within a run of length L a batch holds at most
    k(L) = min(max_tokens // (L * examples_per_item), max_sentences) examples, and since lengths only grow, a batch
    started at s takes example j exactly when j - s < k(length of j)."""
    n = len(sorted_lengths)
    if n == 0:
        return np.zeros(1, dtype=np.int64)
    change = np.flatnonzero(sorted_lengths[1:] != sorted_lengths[:-1]) + 1
    run_starts = np.concatenate(([0], change))
    run_ends = np.concatenate((change, [n]))
    starts = [np.zeros(1, dtype=np.int64)]
    s = 0  # start of the open batch
    for a, b in zip(run_starts.tolist(), run_ends.tolist()):
        length = int(sorted_lengths[a]) * examples_per_item
        k = max_tokens // length if length > 0 else n
        if max_sentences is not None:
            k = min(k, max_sentences)
        if s < a:  # the open batch began in a shorter run: it takes this run's examples while it has room
            if s + k <= a:
                s = a
                starts.append(np.array([a], dtype=np.int64))
            elif s + k < b:
                s = s + k
                starts.append(np.array([s], dtype=np.int64))
            else:
                continue  # the whole run fits: the batch stays open into the next run
        new = np.arange(s + k, b, k, dtype=np.int64)
        if len(new):
            starts.append(new)
            s = int(new[-1])
    return np.concatenate(starts + [np.array([n], dtype=np.int64)])


class TokenBatchSampler:
    """Length-bucketed batches of at most `max_tokens` tokens, padding included.

    A batch of n examples costs `n * examples_per_item * max(longest source, longest target)`. Examples are sorted
    by length with a random tie-break, cut greedily into batches, and the batch order is shuffled; both random draws
    come from `seed + epoch`, so every process computes the same batches for an epoch, and a resumed run the same
    batches as the original one. Everything is numpy (the lengths may come from a memory-mapped cache): an epoch of
    40M examples costs a few arrays, never 40M Python objects (`epoch(e)`); `batches(e)` lists them for small data.
    """

    def __init__(
        self,
        src_lens: Sequence[int],
        tgt_lens: Sequence[int],
        max_tokens: int,
        max_sentences: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        examples_per_item: int = 1,
    ):
        if len(src_lens) != len(tgt_lens):
            raise ValueError("src_lens and tgt_lens differ in length.")
        src, tgt = np.asarray(src_lens), np.asarray(tgt_lens)
        if src.dtype.kind not in "iu" and len(src):
            src, tgt = src.astype(np.int64), tgt.astype(np.int64)
        self._src, self._tgt, self._lengths = src, tgt, None  # the lengths array is built by the first epoch
        longest = max(int(src.max()), int(tgt.max())) if len(src) else 0
        self._length_dtype = np.int16 if longest < 2**15 else np.int32
        self.max_tokens = int(max_tokens)
        self.max_sentences = max_sentences
        self.seed = seed
        self.shuffle = shuffle
        self.examples_per_item = examples_per_item
        self._cached: tuple[int, EpochBatches] | None = None
        if len(src) and longest * examples_per_item > self.max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest example "
                f"({longest * examples_per_item} tokens): raise --max_tokens or lower --max_length."
            )

    @property
    def lengths(self) -> np.ndarray:
        """max(source, target) length per example, as small integers (numpy's stable argsort is then a radix sort),
        built block by block (no temporary of the inputs' width)."""
        if self._lengths is None:
            n = len(self._src)
            lengths = np.empty(n, dtype=self._length_dtype)
            block = 1 << 22
            for a in range(0, n, block):
                np.maximum(
                    self._src[a : a + block], self._tgt[a : a + block], out=lengths[a : a + block], casting="unsafe"
                )
            self._lengths = lengths
        return self._lengths

    def key(self) -> str:
        """A digest of everything an epoch's batches depend on (the lengths, the limits, the seed), for
        `SharedEpochs`' file names."""
        import hashlib

        h = hashlib.sha256(
            json.dumps(
                [len(self._src), self.max_tokens, self.max_sentences, self.seed, self.shuffle, self.examples_per_item]
            ).encode()
        )
        block = 1 << 22
        for arr in (self._src, self._tgt):
            for a in range(0, len(arr), block):
                h.update(np.ascontiguousarray(arr[a : a + block]).tobytes())
        return h.hexdigest()[:24]

    def __len__(self) -> int:
        return len(self.epoch(0))

    def epoch(self, epoch: int) -> EpochBatches:
        """The batches of `epoch` (the last epoch asked for is kept)."""
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        n = len(self.lengths)
        seed = list(self.seed) if isinstance(self.seed, (tuple, list)) else [self.seed]
        rng = np.random.default_rng([*seed, epoch])
        # 4-byte example indices below 2**31 examples: every rank holds the epoch's order (160 MB instead of 320 MB
        # at 40M examples) and builds it with half the temporary memory
        index = np.int32 if n < 2**31 else np.int64
        if self.shuffle:
            # examples by length, ties in the order of a random permutation `tie` (np.lexsort((tie, lengths))):
            # visit the examples by increasing tie value, then a stable sort by length
            tie = np.arange(n, dtype=index)
            rng.shuffle(tie)  # the permutation (and generator state) of rng.permutation(n), in `index` integers
            by_tie = np.empty(n, dtype=index)
            by_tie[tie] = np.arange(n, dtype=index)
            del tie
            order = by_tie[np.argsort(self.lengths[by_tie], kind="stable")]
            del by_tie
        else:
            order = np.argsort(self.lengths, kind="stable").astype(index)
        offsets = _cut_sorted(self.lengths[order], self.max_tokens, self.max_sentences, self.examples_per_item)
        num = len(offsets) - 1
        perm = rng.permutation(num) if self.shuffle else np.arange(num)
        batches = EpochBatches(order, offsets, perm)
        self._cached = (epoch, batches)
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        """`epoch(epoch)` as lists of indices (for small data and tests)."""
        return self.epoch(epoch).tolist()


class SharedEpochs:
    """The epochs of a `TokenBatchSampler` computed once for all processes of a run: the main process computes epoch
    e's batches and writes them into `directory` (`order`, `offsets`, `perm` as .npy, in a folder renamed into
    place when complete); every process, the main one included, memory-maps them, so the pages are shared instead of
    every rank holding the epoch's order (160 MB at 40M examples) and building it (about 0.6 GB of temporary
    arrays). The other processes wait for the folder, up to `timeout` seconds. Folders are named by the sampler's
    `key()` (lengths, limits, seed) and the epoch, so a resume or another rank finds the same batches, and a
    change of data or settings never reads stale ones. `forget_before(e)` removes the folders of epochs before e
    (call it where every process is known to be past them)."""

    def __init__(
        self, sampler: TokenBatchSampler, directory: str | os.PathLike, is_main: bool, timeout: float = 3 * 3600.0
    ):
        self.sampler, self.directory, self.is_main, self.timeout = sampler, Path(directory), is_main, timeout
        self._key = sampler.key()
        self._cached: tuple[int, EpochBatches] | None = None

    def _folder(self, epoch: int) -> Path:
        return self.directory / f"{self._key}-epoch{epoch}"

    def __len__(self) -> int:
        return len(self.epoch(0))

    def epoch(self, epoch: int) -> EpochBatches:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        import time

        folder = self._folder(epoch)
        if self.is_main and not (folder / "perm.npy").is_file():
            batches = self.sampler.epoch(epoch)
            tmp = self.directory / f".tmp-{folder.name}-{os.getpid()}"
            tmp.mkdir(parents=True, exist_ok=True)
            for name in ("order", "offsets", "perm"):
                np.save(tmp / f"{name}.npy", getattr(batches, name))
            try:
                os.rename(tmp, folder)
            except OSError:  # already there (an earlier run, or another node's main process on a shared folder,
                # wrote it with the same key): the same batches
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
            self.sampler._cached = self.sampler._lengths = None  # the memory-mapped copy replaces them
        deadline = time.monotonic() + self.timeout
        while not (folder / "perm.npy").is_file():
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{folder} did not appear within {self.timeout:.0f} s (the main process computes "
                    "each epoch's batches for every process)."
                )
            time.sleep(0.05)
        batches = EpochBatches(
            *(np.load(folder / f"{name}.npy", mmap_mode="r") for name in ("order", "offsets", "perm"))
        )
        self._cached = (epoch, batches)
        return batches

    def forget_before(self, epoch: int) -> None:
        if not self.is_main or not self.directory.is_dir():
            return
        import shutil

        for folder in self.directory.glob(f"{self._key}-epoch*"):
            if int(folder.name.rsplit("epoch", 1)[1]) < epoch:
                shutil.rmtree(folder, ignore_errors=True)


class StepPlan(Sequence):
    """An epoch's batches grouped into optimizer steps of `num_processes * accumulation_steps` micro-batches,
    lazily (`plan_epoch` for arrays of batches of any size): `plan[i]` is the list of step i's micro-batches."""

    def __init__(self, batches: Sequence, num_processes: int, accumulation_steps: int):
        self.batches = batches
        self.per_step = num_processes * accumulation_steps
        self.num_steps = math.ceil(len(batches) / self.per_step) if len(batches) else 0

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        if not 0 <= i < self.num_steps:
            raise IndexError(i)
        n = len(self.batches)
        return [self.batches[(i * self.per_step + j) % n] for j in range(self.per_step)]


def plan_epoch(batches: Sequence, num_processes: int, accumulation_steps: int) -> list[list]:
    """Group an epoch's batches into optimizer steps of `num_processes * accumulation_steps` micro-batches.

    The last step is filled by wrapping around to the epoch's first batches, so every process gets the same number
    of micro-batches (DDP needs it). Process r takes `step[r * accumulation_steps:(r + 1) * accumulation_steps]`,
    so one process with accumulation k sees the same global batches as k processes without accumulation.
    """
    return list(StepPlan(batches, num_processes, accumulation_steps))


def iter_length_sorted(lengths: Sequence[int], batch_size: int) -> Iterator[list[int]]:
    """Indices in batches of `batch_size`, longest first (for generation; the caller restores the order)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    for i in range(0, len(order), batch_size):
        yield order[i : i + batch_size]
