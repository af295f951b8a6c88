"""WMT-size parallel data: one tokenized, memory-mapped Arrow cache per split, built once and shared by every rank.

`training/corpus.py` reads a split into Python objects, which is fine for a validation set and impossible for 40M
pairs. This module turns every source `corpus.py` knows (per-language text files, TSV, JSONL, a `datasets`
dataset) into `datasets` Arrow files and numpy arrays, in three cached stages:

1. **rows** (`rows-<fingerprint>/`): the split's text as an Arrow table, one string column per language of the run
   (`text.<lang>`) and one per source annotation (`ann.<name>.<lang>`, JSON), read block by block with the same
   structural checks as `corpus.py` (line counts, UTF-8, TSV fields, JSON, language codes: `DataError` naming the
   file and line). A `datasets` dataset needs no copy: its own Arrow cache is used through a flattened view.
   Fingerprint: the files (path, size, modification time, first and last MiB) or the dataset's fingerprint.
2. **measured** (`measured-<fingerprint>/`): `Dataset.map` in parallel worker processes
   (`--preprocessing_num_workers`) with batched fast-tokenizer calls: per row and language the token count
   (special tokens included) and whether the side is missing or empty, and per source annotation whether it fits
   its sentence (MG-SA parses: `corpus.ANNOTATION_CHECKS`). Fingerprint: rows + tokenizer + languages,
   annotations, `--max_train_pairs`.
3. **pairs** (`pairs-<fingerprint>/`): numpy arrays (row, direction, source and target length) of the kept pairs,
   in row-major order (row, then direction), and the `DropReport` of the rest (empty/missing sides, bad
   annotations, too long; the location of the side at fault, as `corpus.build_pairs` reports it). Fingerprint:
   measured + directions, `--max_length`, target tags, bidirectional annotations, `--on_bad_pairs`.

Every stage is written into a temporary folder and renamed when complete, so concurrent or killed builders never
leave a half-written cache; a relaunch, a resume or another rank finds it and memory-maps it (`Dataset.from_file`,
`np.load(mmap_mode="r")`). Under several processes the main process builds first and the others load
(`prepare_on_main_first`). Batches read their sentences from the memory-mapped rows by index (`PairSet.pairs`), so
no process ever holds the corpus as Python objects; batching reads the length arrays (`corpus.TokenBatchSampler`).

The token counts are all the cache keeps of the tokenization: batches are built by the model's own
`prepare_translation_inputs` (language tags, variant inputs such as MG-SA's phrases), which tokenizes a batch's
sentences in a few milliseconds.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from . import corpus
from .corpus import DataError, DropReport, Pair

logger = logging.getLogger("hf_variants.data")

PIPELINE_VERSION = 1
READ_BLOCK_BYTES = 8 << 20  # text read per block (bytes)
WRITE_BATCH_ROWS = 50_000  # rows per Arrow record batch of the rows stage
MAP_BATCH_ROWS = 2_000  # rows per batched tokenizer call
ROWS_PER_WORKER = 50_000  # fewer rows than this per worker: fewer workers (a process pool costs ~1 s)
STATE_OK, STATE_MISSING, STATE_EMPTY = 0, 1, 2
BASE_REASONS = ("missing_source", "missing_target", "empty_source", "empty_target")
ANNOTATION_REASONS = ("missing_annotation", "malformed_parse", "parse_mismatch")
# reason code of a pair = 1 + index in REASONS (0: kept)
REASONS = BASE_REASONS + ANNOTATION_REASONS + ("too_long",)
TOO_LONG = len(REASONS)
ABSENT = -1  # not a pair of the direction (skip_absent)


def default_cache_dir() -> Path:
    """`$HF_DATASETS_CACHE/hf_variants` (datasets' cache, ~/.cache/huggingface/datasets by default)."""
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE) / "hf_variants"


def _text_col(lang: str) -> str:
    return f"text.{lang}"


def _ann_col(name: str, lang: str) -> str:
    return f"ann.{name}.{lang}"


def _digest(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


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


# The parts of a `tokenizers` definition (tokenizer.json) that decide the token ids. Padding and truncation do not
# (the cache keeps unpadded, untruncated counts), nor does the decoder; a tokenizer saved with a model (padding
# settings, `model_max_length`) or copied to another folder keeps its key.
TOKENIZATION_PARTS = ("model", "normalizer", "pre_tokenizer", "post_processor", "added_tokens")


def tokenizer_fingerprint(tokenizer) -> str:
    """A hash of what decides the token ids: for a fast tokenizer the backend's model (vocabulary, merges),
    normalizer, pre-tokenizer, post-processor and added tokens (`TOKENIZATION_PARTS`), never its padding or
    truncation state, the folder it was loaded from or its class's name; else the vocabulary and init arguments."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        definition = json.loads(backend.to_str())
        text = json.dumps({part: definition.get(part) for part in TOKENIZATION_PARTS}, sort_keys=True)
        return hashlib.sha256(f"tokenizers\n{text}".encode()).hexdigest()[:24]
    init_kwargs = {
        k: v
        for k, v in getattr(tokenizer, "init_kwargs", {}).items()
        if k not in ("name_or_path", "model_max_length", "padding_side", "truncation_side")
    }
    text = json.dumps([sorted(tokenizer.get_vocab().items()), repr(sorted(init_kwargs.items(), key=str))], default=str)
    return hashlib.sha256(f"{type(tokenizer).__name__}\n{text}".encode()).hexdigest()[:24]


def _publish(tmp: Path, final: Path) -> None:
    """Rename a completed build folder into place; when another builder got there first, keep theirs."""
    try:
        os.replace(tmp, final)
    except OSError:
        if (final / "meta.json").is_file():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            raise


def _new_tmp(cache_dir: Path, name: str) -> Path:
    cache_dir.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.glob(".tmp-*"):  # left by builders killed more than a day ago
        try:
            if time.time() - stale.stat().st_mtime > 86400:
                shutil.rmtree(stale, ignore_errors=True)
        except OSError:
            pass
    tmp = cache_dir / f".tmp-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


# ----------------------------------------------------------------------------------------------- sources
@dataclass
class SplitSource:
    """Where a split comes from: `kind` "files" (`files` {lang: path}, `annotation_files` {name: {lang: path}}),
    "tsv" or "jsonl" (`path`), or "hub" (`dataset`, a `datasets.Dataset` with a `translation` column)."""

    kind: str
    label: str
    files: dict[str, str] = field(default_factory=dict)
    annotation_files: dict[str, dict[str, str]] = field(default_factory=dict)
    path: str | None = None
    dataset: object = None

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
    def from_hub(cls, dataset, name: str, split: str, config_name: str | None = None):
        label = f"{name}{'/' + config_name if config_name else ''}[{split}]"
        if "translation" not in dataset.column_names:
            raise DataError(
                f"Dataset {name!r} split {split!r} has no 'translation' column (columns: {dataset.column_names})."
            )
        return cls("hub", label, dataset=dataset)

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
        column = source.dataset.select_columns(["translation"])
        for start in range(start_row, len(column), WRITE_BATCH_ROWS):
            out = {_text_col(lang): [] for lang in languages}
            for i, obj in enumerate(column[start : start + WRITE_BATCH_ROWS]["translation"], start):
                row = corpus._translation_row(obj, f"{source.label} row {i}")
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


RELEASE_EVERY_BYTES = 64 << 20  # map_arrow_file: parsed pages are released every 64 MB of the file
_MAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # map_arrow_file's datasets -> their mmap


def map_arrow_file(path: str | os.PathLike, random_reads: bool = True):
    """An Arrow file of the cache (the rows; the measured token counts) as a memory-mapped `datasets.Dataset` (what
    `Dataset.from_file` gives), without the mapped pages that opening it leaves resident.

    Opening reads every record batch's header through the map, and each page fault maps up to 64 KiB of cached
    neighbours (the kernel's fault-around): 22% of the rows file then counts in the process's resident memory
    (283 MB of a 1.24 GB file at 4.5M rows; 2.5 GB at 40M), and all of the measured files, in every process. The
    headers are parsed once, so those pages are released (MADV_DONTNEED: a shared read-only file mapping only drops
    its page-table entries; the data stays valid and comes back from the page cache when a batch reads it), every
    `RELEASE_EVERY_BYTES` as the parsing goes (released only at the end, the 40M rows file had 2.8 GB resident for a
    moment). `random_reads`: the map is advised random (MADV_RANDOM: no read-ahead for a batch's scattered rows;
    whole passes over the rows read the file sequentially without the map, `Rows.batches`). Falls back to
    `Dataset.from_file` without `mmap.madvise`."""
    import mmap

    import datasets
    import pyarrow as pa
    from datasets.table import MemoryMappedTable

    if not (hasattr(mmap.mmap, "madvise") and hasattr(mmap, "MADV_DONTNEED") and hasattr(mmap, "MADV_RANDOM")):
        return datasets.Dataset.from_file(str(path))
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    source = pa.BufferReader(pa.py_buffer(mapped))  # zero-copy: the batches' buffers keep the map open
    reader = pa.ipc.open_stream(source)
    batches, released = [], 0
    for batch in reader:
        batches.append(batch)
        parsed = source.tell() // mmap.PAGESIZE * mmap.PAGESIZE
        if parsed - released >= RELEASE_EVERY_BYTES:  # release while parsing: the transient stays one window
            mapped.madvise(mmap.MADV_DONTNEED, released, parsed - released)
            released = parsed
    table = pa.Table.from_batches(batches, schema=reader.schema)
    mapped.madvise(mmap.MADV_DONTNEED)
    if random_reads:
        mapped.madvise(mmap.MADV_RANDOM)
    # pickled (worker processes), a MemoryMappedTable is mapped again from `path`, as from_file's is
    dataset = datasets.Dataset(MemoryMappedTable(table, str(path)))
    _MAPS[dataset] = mapped
    return dataset


def release_mapped_pages(dataset) -> None:
    """Drop the pages a `map_arrow_file` dataset's reads mapped from this process's resident memory (a no-op for
    any other dataset). A random read maps up to 64 KiB around each page it touches (fault-around, which
    MADV_RANDOM does not turn off): 80 random rows of the 4.5M rows file left 16 MB resident, so without a release
    every rank's resident memory grows by that much a batch, towards the whole file. The pages stay in the page
    cache; releasing an almost empty map takes about a millisecond (10 GB map)."""
    import mmap

    mapped = _MAPS.get(dataset)
    if mapped is not None:
        mapped.madvise(mmap.MADV_DONTNEED)


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
    if (final / "meta.json").is_file():
        meta = json.loads((final / "meta.json").read_text())
        return Rows(map_arrow_file(final / "data.arrow"), meta, fp, path=str(final / "data.arrow"))
    t0 = time.time()
    tmp = _new_tmp(cache_dir, f"rows-{fp}")
    try:
        import pyarrow as pa
        from datasets.arrow_writer import ArrowWriter

        cols = [_text_col(lang) for lang in languages] + [_ann_col(n, lang) for n in annotations for lang in languages]
        features = datasets.Features({c: datasets.Value("string") for c in cols})
        info: dict = {}
        rows = 0
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
            writer.finalize()
        meta = {
            "kind": source.kind,
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
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        _publish(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("Read %s: %d rows in %.1f s (cached in %s)", source.label, rows, time.time() - t0, final)
    return Rows(map_arrow_file(final / "data.arrow"), meta, fp, built=True, path=str(final / "data.arrow"))


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
    if (final / "meta.json").is_file():
        meta = json.loads((final / "meta.json").read_text())
        return Measured([str(final / f) for f in meta["files"]], fp)
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
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
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


_JOB: dict | None = None  # the stage-2 job, inherited by forked workers


def _measure_range(task) -> str:
    """Token counts of rows [start, stop) (read sequentially) into the Arrow file `path` (one worker's share)."""
    from datasets.arrow_writer import ArrowWriter

    _, start, stop, path = task
    job = _JOB
    with ArrowWriter(features=job["features"], path=path) as writer:
        for batch in job["rows"].batches(job["needed"], start, stop):
            for lo in range(0, batch.num_rows, MAP_BATCH_ROWS):
                block = batch.slice(lo, MAP_BATCH_ROWS).to_pydict()
                writer.write_batch(_measure(block, job["tokenizer"], job["languages"], job["checks"]))
        writer.finalize()
    return path


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
                    f"Language {lang!r} is not in {label} (it has: {', '.join(present) or 'no languages'})."
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
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
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
    if (final / "meta.json").is_file():
        meta = json.loads((final / "meta.json").read_text())
        report = _report_from_dict(split, meta["report"])
        return _open_pair_set(final, report, meta.get("pairs_per_direction"), False, **common)
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
        label = source.label

        def with_rows(batch, indices):
            out = {_text_col(lang): [] for lang in languages}
            for i, obj in zip(indices, batch["translation"]):
                row = corpus._translation_row(obj, f"{label} row {i + start_row}")
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
