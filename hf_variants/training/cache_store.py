"""Files of the tokenized-data cache: where it lives, fingerprints, atomic publication of a stage's folder, and
memory-mapped Arrow files (the stages: `data_pipeline`).
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
