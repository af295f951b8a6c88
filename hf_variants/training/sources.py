"""Reading a split's sources (per-language text files, TSV, JSONL, a `datasets` dataset) block by block into the
cache's rows stage, with the structural checks of `corpus` (`DataError` naming the file and line).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
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
)
from .corpus import DataError
from .progress import Every

READ_BLOCK_BYTES = 8 << 20  # text read per block (bytes)


WRITE_BATCH_ROWS = 50_000  # rows per Arrow record batch of the rows stage


def file_identity(path: str | os.PathLike) -> dict:
    """What identifies a data file's content for the cache: its absolute path (messages name it), size,
    modification time and a hash of its first and last MiB."""
    path = Path(path).resolve()
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(1 << 20))
        if st.st_size > 2 << 20:
            f.seek(-(1 << 20), os.SEEK_END)
            h.update(f.read(1 << 20))
    ident = {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sample_sha256": h.hexdigest()}
    if starts_with_bom(path):  # rows cached before the reader dropped byte-order marks kept it: not reused
        ident["utf8_bom"] = "dropped"
    return ident


def starts_with_bom(path: str | os.PathLike) -> bool:
    """Whether a plain or gzip file's text starts with a UTF-8 byte-order mark."""
    import gzip

    path = Path(path)
    with gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb") as f:
        try:
            return f.read(len(corpus.UTF8_BOM)) == corpus.UTF8_BOM
        except (OSError, EOFError):
            return False  # a damaged .gz: the reader names it


# ----------------------------------------------------------------------------------------------- sources
@dataclass
class SplitSource:
    """Where a split comes from: `kind` "files" (`files` {lang: path}, `annotation_files` {name: {lang: path}}),
    "tsv" or "jsonl" (`path`), or "hub" (`dataset`, a `datasets.Dataset` with a `translation` column, or with one
    text column per language: `columns` {lang: column name})."""

    kind: str
    label: str
    files: dict[str, str] = field(default_factory=dict)
    annotation_files: dict[str, dict[str, str]] = field(default_factory=dict)
    path: str | None = None
    dataset: object = None
    columns: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_dir(cls, data_dir, prefix: str, languages: Sequence[str], annotations: Sequence[str] = ()):
        """`{prefix}.{lang}[.gz]` per language and, where they exist, `{prefix}.{lang}.{name}[.gz]` annotations."""
        files = {lang: str(corpus.find_split_file(data_dir, prefix, lang)) for lang in languages}
        for lang, path in files.items():
            corpus.check_language_code(lang, path)
        ann = {}
        for name in annotations:
            for lang in languages:
                try:
                    ann.setdefault(name, {})[lang] = str(corpus.find_split_file(data_dir, f"{prefix}.{lang}", name))
                except DataError:
                    continue
        return cls("files", f"{Path(data_dir).name}/{prefix}", files=files, annotation_files=ann)

    @classmethod
    def from_file(cls, path, annotations: Sequence[str] = ()):
        """A TSV or JSONL file, chosen by extension (as `corpus.load_corpus_file`)."""
        name = Path(path).name.lower().removesuffix(".gz")
        if not Path(path).is_file():
            raise DataError(f"No such data file: {path}")
        if name.endswith(".tsv"):
            if annotations:
                raise DataError(
                    f"{path}: TSV files carry no source annotations ({', '.join(annotations)}); use "
                    f"JSONL or per-language files."
                )
            return cls("tsv", str(path), path=str(path))
        if name.endswith((".jsonl", ".json")):
            return cls("jsonl", str(path), path=str(path))
        raise DataError(
            f"{path}: unknown data file type; use .tsv or .jsonl (plain or .gz), or per-language text "
            f"files {{prefix}}.{{lang}}[.gz] with --data_dir."
        )

    @classmethod
    def from_hub(
        cls, dataset, name: str, split: str, config_name: str | None = None, columns: dict[str, str] | None = None
    ):
        """A split of a `datasets` dataset. Its layout: `columns` {lang: column} when given (the command line's
        --source_column/--target_column), else a `translation` column of {lang: text}, else the columns whose
        names are language codes (flat `en`, `fr` columns, a common layout on the Hub)."""
        label = f"{name}{'/' + config_name if config_name else ''}[{split}]"
        names = list(dataset.column_names or [])
        if columns:
            for lang, column in columns.items():
                if column not in names:
                    raise DataError(
                        f"Dataset {label} has no column {column!r} (the {lang!r} side, given by --source_column/"
                        f"--target_column); its columns: {', '.join(names)}."
                    )
            return cls("hub", label, dataset=dataset, columns=dict(columns))
        if "translation" in names:
            return cls("hub", label, dataset=dataset)
        by_code = {column: column for column in names if corpus.LANG_CODE.match(column)}
        if len(by_code) >= 2:
            return cls("hub", label, dataset=dataset, columns=by_code)
        raise DataError(
            f"Dataset {label} has no 'translation' column and no two columns named by language codes (its columns: "
            f"{', '.join(names)}): name the text columns with --source_column COLUMN --target_column COLUMN."
        )

    def hub_rows(self, batch: dict, first_row: int) -> Iterator[dict[str, str]]:
        """The rows {lang: text} of a batch of this dataset's columns (`batch[column]` lists; row numbers from
        `first_row`, for messages); a missing side (None) is left out, a value that is no string is a `DataError`
        naming the row and column."""
        if not self.columns:
            for i, obj in enumerate(batch["translation"], first_row):
                yield corpus._translation_row(obj, f"{self.label} row {i}")
            return
        values = {lang: batch[column] for lang, column in self.columns.items()}
        for j in range(len(next(iter(values.values()), []))):
            row = {}
            for lang, column in self.columns.items():
                text = values[lang][j]
                if text is None:
                    continue
                if not isinstance(text, str):
                    raise DataError(
                        f"{self.label} row {first_row + j}: column {column!r} holds a {type(text).__name__}, "
                        f"expected a string."
                    )
                row[lang] = text
            yield row

    def identity(self, languages: Sequence[str], annotations: Sequence[str]) -> dict:
        ident = {
            "version": PIPELINE_VERSION,
            "kind": self.kind,
            "label": self.label,
            "languages": list(languages),
            "annotations": list(annotations),
        }
        if self.kind == "files":
            ident["files"] = {lang: file_identity(p) for lang, p in self.files.items()}
            ident["annotation_files"] = {
                n: {lang: file_identity(p) for lang, p in by.items()}
                for n, by in self.annotation_files.items()
                if n in annotations
            }
        elif self.kind == "hub":
            ident["dataset"] = getattr(self.dataset, "_fingerprint", None) or repr(self.dataset)
            if self.columns:
                ident["columns"] = self.columns
        else:
            ident["file"] = file_identity(self.path)
        return ident


class Locator:
    """`file:line` (or `dataset[split] row i`) of a row's sentence in a language, or of its annotation: the file of
    that language (per-language files), else the row's line."""

    def __init__(self, meta: dict):
        self.kind = meta["kind"]
        self.label = meta["label"]
        self.files = meta.get("files", {})
        self.annotation_files = meta.get("annotation_files", {})
        self.path = meta.get("path")
        self.offset = meta.get("line_offset", 1)

    def __call__(self, row: int, lang: str | None = None, annotation: str | None = None) -> str:
        if self.kind == "files":
            path = (self.annotation_files.get(annotation, {}) if annotation else self.files).get(lang)
            return f"{path or next(iter(self.files.values()))}:{row + 1}"
        if self.kind == "hub":
            return f"{self.label} row {row}"
        return f"{self.path}:{row + self.offset}"


# ------------------------------------------------------------------------------------------------ reading
def iter_line_blocks(path: str | os.PathLike, skip: int = 0) -> Iterator[list[str]]:
    """The lines of a plain or gzip UTF-8 file in blocks (lists of lines without terminators, split on "\\n" only,
    trailing "\\r" removed: `corpus.read_lines` block by block). A bad encoding names the line. The first `skip`
    lines are passed over at the byte level (neither decoded nor checked). A byte-order mark at the start of the
    file is dropped."""
    import gzip

    path = Path(path)
    seen = skip
    carry = b""
    first = True
    try:
        f = gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")
        with f:
            while True:
                chunk = f.read(READ_BLOCK_BYTES)
                if not chunk:
                    break
                if first:
                    first = False
                    chunk = chunk.removeprefix(corpus.UTF8_BOM)
                data = carry + chunk
                if skip:
                    newlines = data.count(b"\n")
                    if newlines <= skip:
                        skip -= newlines
                        carry = data[data.rfind(b"\n") + 1 :] if newlines else data
                        continue
                    pos = -1
                    for _ in range(skip):
                        pos = data.find(b"\n", pos + 1)
                    data, skip = data[pos + 1 :], 0
                cut = data.rfind(b"\n")
                if cut < 0:
                    carry = data
                    continue
                carry = data[cut + 1 :]
                lines = _decode(data[:cut], path, seen)
                seen += len(lines)
                yield lines
    except (OSError, EOFError) as err:
        raise DataError(f"{path}: cannot read ({err}).") from err
    if carry and not skip:
        yield _decode(carry, path, seen)


def _decode(data: bytes, path: Path, seen: int) -> list[str]:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = seen + data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}: line {line} is not valid UTF-8 ({err.reason}).") from err
    lines = text.split("\n")
    if "\r" in text:
        lines = [line.rstrip("\r") for line in lines]
    if '"hypotheses"' in text:  # an n-best JSON Lines output given as a corpus: named by its line
        for i, line in enumerate(lines):
            corpus.check_not_nbest(line, f"{path}:{seen + i + 1}")
    return lines


class LineCountMismatch(Exception):
    """Raised by `iter_parallel_blocks` with every file's line count (the caller words the `DataError`)."""

    def __init__(self, counts: dict[str, int]):
        super().__init__(counts)
        self.counts = counts


def iter_parallel_blocks(files: dict[str, str], skip: int = 0) -> Iterator[dict[str, list[str]]]:
    """Blocks of aligned lines of line-parallel files `{key: path}` (after the first `skip` lines); files of
    different line counts raise `LineCountMismatch` (with every file's count) once the shortest ends."""
    readers = {k: iter_line_blocks(p, skip) for k, p in files.items()}
    buffers: dict[str, list[str]] = {k: [] for k in files}
    done = {k: False for k in files}
    yielded = skip
    while True:
        for k in files:
            while not done[k] and len(buffers[k]) < WRITE_BATCH_ROWS:
                block = next(readers[k], None)
                if block is None:
                    done[k] = True
                else:
                    buffers[k].extend(block)
        take = min(min(len(b) for b in buffers.values()), WRITE_BATCH_ROWS)
        if take == 0:
            if any(buffers.values()):
                counts = {k: yielded + len(buffers[k]) + sum(len(b) for b in readers[k]) for k in files}
                raise LineCountMismatch(counts)
            return
        yield {k: buf[:take] for k, buf in buffers.items()}
        buffers = {k: buf[take:] for k, buf in buffers.items()}
        yielded += take


def mismatch_error(counts: dict[str, int], text_files: dict[str, str], annotation_files: dict[str, str]) -> DataError:
    """The `DataError` of `corpus.load_split_from_dir` for files of different line counts: the text files
    first, then an annotation file against its language's text file. Keys: `text.<lang>` / `ann.<name>.<lang>`."""
    text = {k: counts[k] for k in text_files}
    if len(set(text.values())) > 1:
        shortest, longest = min(text, key=text.get), max(text, key=text.get)
        return DataError(
            "Parallel files have different line counts: "
            + ", ".join(f"{text_files[k]} has {n} lines" for k, n in text.items())
            + f". {text_files[longest]} line {text[shortest] + 1} has no counterpart in "
            f"{text_files[shortest]}."
        )
    n = next(iter(text.values()))
    for key, path in annotation_files.items():
        m = counts[key]
        if m != n:
            lang = key.rsplit(".", 1)[1]
            ref = text_files.get(_text_col(lang), next(iter(text_files.values())))
            return DataError(f"{path} has {m} lines but {ref} has {n}; line {min(m, n) + 1} has no counterpart.")
    return DataError(f"Line-parallel files of different lengths: {counts}")


def _jsonable_value(value) -> str | None:
    return None if value is None else json.dumps(value, ensure_ascii=False)


def iter_row_blocks(
    source: SplitSource, languages: Sequence[str], annotations: Sequence[str], info: dict, start_row: int = 0
) -> Iterator[dict[str, list]]:
    """Blocks of rows as columns `text.<lang>` (None: the side is missing) and `ann.<name>.<lang>` (JSON text,
    None: missing), for `languages`, from row `start_row` on (earlier lines of text files are skipped unread).
    `info` collects `languages_present` and `annotations_present` (of the rows read)."""
    present: dict[str, None] = {}
    ann_present: dict[str, set] = {name: set() for name in annotations}
    info["languages_present"] = present
    info["annotations_present"] = ann_present
    if source.kind == "files":
        present.update(dict.fromkeys(source.files))
        text_files = {_text_col(lang): p for lang, p in source.files.items()}
        ann_files = {
            _ann_col(n, lang): p
            for n, by in source.annotation_files.items()
            if n in annotations
            for lang, p in by.items()
            if lang in languages
        }
        for key in ann_files:
            ann_present[key.split(".")[1]].add(key.rsplit(".", 1)[1])
        try:
            for block in iter_parallel_blocks({**text_files, **ann_files}, start_row):
                size = len(next(iter(block.values())))
                out = {_text_col(lang): block.get(_text_col(lang), [None] * size) for lang in languages}
                for name in annotations:
                    for lang in languages:
                        col = _ann_col(name, lang)
                        out[col] = (
                            [json.dumps(v, ensure_ascii=False) for v in block[col]] if col in block else [None] * size
                        )
                yield out
        except LineCountMismatch as err:
            raise mismatch_error(err.counts, text_files, ann_files) from None
        return
    if source.kind == "tsv":
        yield from _tsv_blocks(source.path, languages, present, start_row)
        return
    if source.kind == "hub":
        column = source.dataset.select_columns(list(source.columns.values()) or ["translation"])
        present.update(dict.fromkeys(source.columns))
        for start in range(start_row, len(column), WRITE_BATCH_ROWS):
            out = {_text_col(lang): [] for lang in languages}
            for row in source.hub_rows(column[start : start + WRITE_BATCH_ROWS], start):
                present.update(dict.fromkeys(lang for lang in row if lang not in present))
                for lang in languages:
                    out[_text_col(lang)].append(row.get(lang))
            yield out
        return
    if source.kind == "jsonl":
        yield from _jsonl_blocks(source.path, languages, annotations, present, ann_present, start_row)
        return
    raise ValueError(f"iter_row_blocks: no reader for {source.kind!r}")


def _tsv_blocks(path, languages, present, start_row: int = 0) -> Iterator[dict[str, list]]:
    columns = None
    line_no = 0
    if start_row:  # the header, then the lines after the first start_row rows
        header = next(iter_line_blocks(path), [])[:1]
        blocks = iter_line_blocks(path, start_row + 1)
        line_no = start_row
        blocks = _prepend(header, blocks)
    else:
        blocks = iter_line_blocks(path)
    for lines in blocks:
        start = 0
        if columns is None:
            if not lines:
                continue
            columns = [c.strip() for c in lines[0].split("\t")]
            for col in columns:
                corpus.check_language_code(col, f"{path}:1 (TSV header)")
            if len(set(columns)) != len(columns):
                raise DataError(f"{path}: duplicate language columns {columns}.")
            present.update(dict.fromkeys(columns))
            start = 1
        width = len(columns)
        where = {lang: columns.index(lang) for lang in languages if lang in columns}
        out = {_text_col(lang): [] for lang in languages}
        for i in range(start, len(lines)):
            fields = lines[i].split("\t")
            if len(fields) != width:
                raise DataError(
                    f"{path}:{line_no + i + 1}: expected {width} tab-separated fields "
                    f"({', '.join(columns)}), found {len(fields)}."
                )
            for lang in languages:
                out[_text_col(lang)].append(fields[where[lang]] if lang in where else None)
        line_no += len(lines)
        yield out
    if columns is None:
        raise DataError(f"{path}: empty TSV file (expected a header line such as 'en<TAB>de').")


def _prepend(first: list[str], blocks: Iterator[list[str]]) -> Iterator[list[str]]:
    """`first` + the first block, then the other blocks."""
    block = next(blocks, [])
    yield first + block
    yield from blocks


def _jsonl_blocks(path, languages, annotations, present, ann_present, start_row: int = 0) -> Iterator[dict[str, list]]:
    line_no = start_row
    for lines in iter_line_blocks(path, start_row):
        out = {_text_col(lang): [] for lang in languages}
        out.update({_ann_col(n, lang): [] for n in annotations for lang in languages})
        for line in lines:
            line_no += 1
            where = f"{path}:{line_no}"
            obj = corpus.parse_jsonl_line(line, where)
            row = corpus._translation_row(obj, where)
            for lang in row:
                if lang not in present:
                    present[lang] = None
            for lang in languages:
                out[_text_col(lang)].append(row.get(lang))
            for name in annotations:
                value = obj.get(name) if "translation" in obj else None
                value = value if isinstance(value, dict) else {}
                for lang in languages:
                    v = value.get(lang)
                    if v is not None:
                        ann_present[name].add(lang)
                    out[_ann_col(name, lang)].append(_jsonable_value(v))
        yield out


# ----------------------------------------------------------------------------------------- stage 1: rows
@dataclass
class Rows:
    """A split's rows: `dataset` (memory-mapped `datasets.Dataset` with `text.<lang>` / `ann.<name>.<lang>`
    columns), its `meta` (source, languages and annotations present) and `locate` (row -> file:line).

    Random access (a batch's sentences) goes through the memory map; whole passes (`batches`: the tokenizer's
    sample, the token counts) read the Arrow file sequentially instead, so that they do not map the whole corpus
    into the process (mapped pages count in its resident memory)."""

    dataset: object
    meta: dict
    fingerprint: str
    built: bool = False
    path: str | None = None  # the Arrow file (None: a view of a `datasets` dataset's own cache)
    limit: int | None = None

    @property
    def locate(self) -> Locator:
        return Locator(self.meta)

    @property
    def languages_present(self) -> list[str]:
        return list(self.meta["languages_present"])

    def __len__(self) -> int:
        return len(self.dataset)

    def head(self, n: int | None) -> "Rows":
        if not n or n >= len(self.dataset):
            return self
        return Rows(self.dataset.select(range(n)), self.meta, f"{self.fingerprint}-head{n}", self.built, self.path, n)

    def batches(self, columns: Sequence[str], start: int = 0, stop: int | None = None):
        """Record batches (`pyarrow.RecordBatch`, `columns` only) covering rows [start, stop), in order: read from
        the Arrow file sequentially (no memory map), or sliced from the dataset's table."""
        import pyarrow as pa

        stop = len(self) if stop is None else min(stop, len(self))
        if self.path is None:
            ds = self.dataset if self.dataset._indices is None else self.dataset.flatten_indices()
            yield from ds.data.table.select(list(columns)).slice(start, max(stop - start, 0)).to_batches()
            return
        offset = 0
        with pa.OSFile(self.path) as f:
            for batch in pa.ipc.open_stream(f):
                end = offset + batch.num_rows
                if end > start and offset < stop:
                    lo, hi = max(start - offset, 0), min(stop, end) - offset
                    yield batch.select(list(columns)).slice(lo, hi - lo)
                offset = end
                if offset >= stop:
                    return

    def texts(self, lang: str, rows: np.ndarray | None = None) -> Iterator[str]:
        """The `lang` sentences of `rows` (sorted row numbers; default: all), in order, in one sequential pass
        ("" for a missing one)."""
        import pyarrow as pa

        offset, k = 0, 0
        for batch in self.batches([_text_col(lang)]):
            col = batch.column(0)
            end = offset + batch.num_rows
            if rows is not None:
                j = int(np.searchsorted(rows, end, side="left"))
                if j == k:
                    offset = end
                    continue
                col = col.take(pa.array(rows[k:j] - offset))
                k = j
            yield from (t if t is not None else "" for t in col.to_pylist())
            offset = end


def _hub_rows(source: SplitSource, languages: Sequence[str]) -> Rows:
    """A view of the dataset's own Arrow table when `translation` is a struct (or `Translation`) of strings;
    None when it is not (e.g. rows with different languages, which datasets stores as JSON): then the rows are
    read and checked one by one into the cache."""
    import datasets

    ds = source.dataset
    if source.columns:
        return _flat_hub_rows(source, languages)
    feature = ds.features["translation"]
    if isinstance(feature, datasets.Translation):
        fields = list(feature.languages)
    elif isinstance(feature, dict) and all(
        getattr(v, "dtype", None) in ("string", "large_string") for v in feature.values()
    ):
        fields = list(feature)
    else:
        return None
    for lang in fields:
        corpus.check_language_code(lang, f"{source.label} (translation column)")
    flat = ds.select_columns(["translation"]).flatten()
    keep = [f"translation.{lang}" for lang in languages if lang in fields]
    flat = flat.select_columns(keep).rename_columns(
        {f"translation.{lang}": _text_col(lang) for lang in languages if lang in fields}
    )
    # a language of the run that the dataset lacks: `check_languages` names it before any column is read
    meta = {
        "kind": "hub",
        "label": source.label,
        "rows": len(flat),
        "languages_present": fields,
        "annotations_present": {},
    }
    fp = _digest(source.identity(languages, ()))
    return Rows(flat, meta, fp)


def _flat_hub_rows(source: SplitSource, languages: Sequence[str]) -> Rows | None:
    """`_hub_rows` of a dataset with one text column per language: a view of the run's languages' columns when
    they are strings (None otherwise: then the rows are read and checked into the cache)."""
    ds, columns = source.dataset, source.columns
    used = {lang: columns[lang] for lang in languages if lang in columns}
    if not all(getattr(ds.features[c], "dtype", None) in ("string", "large_string") for c in used.values()):
        return None
    flat = ds.select_columns(list(used.values())).rename_columns({c: _text_col(lang) for lang, c in used.items()})
    meta = {
        "kind": "hub",
        "layout": "columns",
        "label": source.label,
        "rows": len(flat),
        "languages_present": list(columns),
        "annotations_present": {},
    }
    return Rows(flat, meta, _digest(source.identity(languages, ())))


def load_rows(
    source: SplitSource,
    languages: Sequence[str],
    annotations: Sequence[str] = (),
    cache_dir: str | os.PathLike | None = None,
) -> Rows:
    """Stage 1: the split's rows from the cache, or read (with every structural check) and cached."""
    import datasets

    languages = list(languages)
    if source.kind == "hub":
        rows = _hub_rows(source, languages)
        if rows is not None:
            return rows
    cache_dir = Path(cache_dir or default_cache_dir())
    fp = _digest(source.identity(languages, annotations))
    final = cache_dir / f"rows-{fp}"
    cached = open_entry(  # a damaged entry is named, removed and built again
        final, lambda meta: Rows(map_arrow_file(final / "data.arrow"), meta, fp, path=str(final / "data.arrow"))
    )
    if cached is not None:
        return cached
    t0 = time.time()
    tmp = _new_tmp(cache_dir, f"rows-{fp}")
    try:
        import pyarrow as pa
        from datasets.arrow_writer import ArrowWriter

        cols = [_text_col(lang) for lang in languages] + [_ann_col(n, lang) for n in annotations for lang in languages]
        features = datasets.Features({c: datasets.Value("string") for c in cols})
        info: dict = {}
        rows = 0
        report = Every()  # a progress record every DATA_PROGRESS_SECONDS while a large corpus is read
        with ArrowWriter(features=features, path=str(tmp / "data.arrow")) as writer:
            for block in iter_row_blocks(source, languages, annotations, info):
                if not block[cols[0]]:
                    continue
                # one record batch a block (datasets' default splits it into batches of 1000 rows: at 40M rows, 40k
                # batches whose Arrow and Python objects cost every process that opens the file ~100 MB of heap)
                writer.write_table(
                    pa.table({c: pa.array(block[c], type=pa.string()) for c in cols}),
                    writer_batch_size=WRITE_BATCH_ROWS,
                )
                rows += len(block[cols[0]])
                if report():
                    logger.info("progress: reading %s: %d rows, elapsed %s", source.label, rows, report.elapsed())
            writer.finalize()
        meta = {
            "kind": source.kind,
            "layout": "columns" if source.columns else None,  # a dataset's text columns (language_hint)
            "label": source.label,
            "files": source.files,
            "annotation_files": {
                n: {lang: p for lang, p in by.items()} for n, by in source.annotation_files.items() if n in annotations
            },
            "path": source.path,
            "line_offset": 2 if source.kind == "tsv" else 1,
            "rows": rows,
            "languages_present": list(info["languages_present"]),
            "annotations_present": {n: sorted(v) for n, v in info["annotations_present"].items()},
            "languages": languages,
            "annotations": list(annotations),
            "version": PIPELINE_VERSION,
        }
        meta = seal_entry(tmp, meta)
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Read %s: %d rows in %.1f s (cached in %s)", source.label, rows, time.time() - t0, final)
    return Rows(map_arrow_file(final / "data.arrow"), meta, fp, built=True, path=str(final / "data.arrow"))


# ---------------------------------------------------------------------------------- tokenizer training
def tokenizer_sample(rows: Rows, languages: Sequence[str], max_lines: int | None, seed: int = 0):
    """The texts a tokenizer is trained on: every language's sentences of all rows, or, when that is more than
    `max_lines` sentences, of a deterministic random sample of max_lines / len(languages) rows (seeded, sorted).
    Returns (iterables of texts, one per language, rows used, rows in total)."""
    n = len(rows)
    per_lang = n if not max_lines else max(1, max_lines // max(len(languages), 1))
    if per_lang >= n:
        return [rows.texts(lang) for lang in languages], n, n
    chosen = np.sort(np.random.default_rng(seed).choice(n, size=per_lang, replace=False))
    return [rows.texts(lang, chosen) for lang in languages], per_lang, n
