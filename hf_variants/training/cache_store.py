"""Files of the tokenized-data cache: where it lives, fingerprints, atomic publication of a stage's folder, and
memory-mapped Arrow files (the stages: `data_pipeline`).

A cache entry (`rows-*`, `measured-*`, `pairs-*`) is untrusted when read back: `read_entry` accepts it only when
its `meta.json` is a JSON object of at most `MAX_META_BYTES`, every file it records (`sizes`, written by
`seal_entry`) is a regular file of that size, every Arrow stream ends with its end-of-stream marker and every
`.npy` array is as long as its header says (cheap checks: a stat, 8 bytes, a header). A damaged entry (a truncated
file, a torn `meta.json`) is named in a warning, removed and built again: a cache is never the only copy of
anything. Opening an entry (`open_entry`) treats a failure of the same kind the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
import uuid
import weakref
from pathlib import Path

logger = logging.getLogger("hf_variants.data")


PIPELINE_VERSION = 1


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


META = "meta.json"
MAX_META_BYTES = 64 << 20  # a meta.json holds counts and a drop report's examples: far less
ARROW_EOS = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # the end-of-stream marker of an Arrow IPC stream
DAMAGE_ERRORS = (OSError, ValueError, KeyError, TypeError, IndexError, EOFError)  # pyarrow's derive from these


def seal_entry(tmp: Path, meta: dict) -> dict:
    """Write `tmp/meta.json`: `meta` with `sizes`, the size of every file of the entry (checked by `read_entry`)."""
    sizes = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.is_file() and f.name != META}
    meta = {**meta, "sizes": sizes}
    (tmp / META).write_text(json.dumps(meta, indent=1))
    return meta


def _npy_problem(path: Path, size: int) -> str | None:
    """A `.npy` file shorter or longer than its header says (`np.load(mmap_mode="r")` fails on it)."""
    import numpy as np

    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read_header(f)
        expected = f.tell() + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size != expected:
        return f"{path.name} is {size} bytes, its header says {expected}{' (truncated)' if size < expected else ''}"
    return None


def entry_problem(final: Path) -> tuple[dict | None, str | None]:
    """(meta, None) for a sound cache entry, (None, what is wrong) for a damaged one (see the module docstring)."""
    import stat

    path = final / META
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{META} is not a regular file"
        if st.st_size > MAX_META_BYTES:
            return None, f"{META} is {st.st_size} bytes (at most {MAX_META_BYTES})"
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:
        return None, f"{META} cannot be read ({type(err).__name__}: {err})"
    if not isinstance(meta, dict):
        return None, f"{META} holds a JSON {type(meta).__name__}, not an object"
    sizes = meta.get("sizes")
    if sizes is not None and not isinstance(sizes, dict):
        return None, f"{META}: 'sizes' is not an object"
    names = set(sizes or {}) | {f.name for f in final.iterdir() if f.name != META}
    for name in sorted(names):
        file = final / name
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            return None, f"{META} lists {name!r}, not a file name of the entry"
        try:
            st = os.lstat(file)
        except FileNotFoundError:
            return None, f"{name} is missing"
        if not stat.S_ISREG(st.st_mode):
            return None, f"{name} is not a regular file"
        expected = (sizes or {}).get(name)
        if sizes is not None and expected != st.st_size:
            return None, f"{name} is {st.st_size} bytes, {expected} when it was written" + (
                " (truncated)" if isinstance(expected, int) and st.st_size < expected else ""
            )
        try:
            if name.endswith(".arrow"):
                with open(file, "rb") as f:
                    f.seek(max(st.st_size - len(ARROW_EOS), 0))
                    if st.st_size < len(ARROW_EOS) or f.read() != ARROW_EOS:
                        return None, f"{name} ({st.st_size} bytes) does not end an Arrow stream (truncated)"
            elif name.endswith(".npy"):
                problem = _npy_problem(file, st.st_size)
                if problem:
                    return None, problem
        except DAMAGE_ERRORS as err:
            return None, f"{name} cannot be read ({type(err).__name__}: {err})"
    return meta, None


def discard_entry(final: Path, problem: str) -> None:
    """Warn that the cache entry `final` is damaged (naming it and `problem`) and remove it (renamed first, so
    that no reader finds half of it)."""
    logger.warning("The data cache entry %s is damaged (%s): building it again (it is only a cache).", final, problem)
    trash = final.with_name(f".tmp-damaged-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        os.replace(final, trash)
    except FileNotFoundError:  # another process removed it first
        return
    shutil.rmtree(trash, ignore_errors=True)


def read_entry(final: Path) -> dict | None:
    """The meta of the complete, sound cache entry `final`; None when there is none, or when it was damaged (then
    named and removed: `discard_entry`), so that the caller builds it."""
    if not final.is_dir() or not (final / META).exists():
        return None
    meta, problem = entry_problem(final)
    if problem is not None:
        discard_entry(final, problem)
        return None
    return meta


def open_entry(final: Path, open_fn):
    """`open_fn(meta)` on the sound cache entry `final`; None when there is none, or when it is damaged or opening
    it fails with an error of a damaged file (`DAMAGE_ERRORS`: then named and removed, so that the caller builds
    it)."""
    meta = read_entry(final)
    if meta is None:
        return None
    try:
        return open_fn(meta)
    except DAMAGE_ERRORS as err:
        discard_entry(final, f"opening it failed: {type(err).__name__}: {err}")
        return None


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
