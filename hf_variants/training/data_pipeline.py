"""WMT-size parallel data: one tokenized, memory-mapped Arrow cache per split, built once and shared by every rank.

`corpus` reads a split into Python objects, which is fine for a validation set and impossible for 40M
pairs. This module turns every source `corpus.py` knows (per-language text files, TSV, JSONL, a `datasets`
dataset) into `datasets` Arrow files and numpy arrays, in three cached stages (modules: `sources` reads,
`cache_store` stores, `measure` counts tokens, `pairs` checks and keeps pairs, `streaming` skips the cache):

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

from .cache_store import (  # noqa: F401
    PIPELINE_VERSION,
    RELEASE_EVERY_BYTES,
    TOKENIZATION_PARTS,
    default_cache_dir,
    map_arrow_file,
    release_mapped_pages,
    tokenizer_fingerprint,
)
from .measure import (  # noqa: F401
    ABSENT,
    ANNOTATION_REASONS,
    BASE_REASONS,
    MAP_BATCH_ROWS,
    REASONS,
    ROWS_PER_WORKER,
    STATE_OK,
    TOO_LONG,
    Measured,
    measure,
)
from .pairs import (  # noqa: F401
    PairSet,
    build_pair_set,
    check_languages,
    pair_reasons,
)
from .sources import (  # noqa: F401
    READ_BLOCK_BYTES,
    WRITE_BATCH_ROWS,
    LineCountMismatch,
    Locator,
    Rows,
    SplitSource,
    file_identity,
    iter_line_blocks,
    iter_parallel_blocks,
    iter_row_blocks,
    load_rows,
    mismatch_error,
    starts_with_bom,
    tokenizer_sample,
)
from .streaming import (  # noqa: F401
    StreamingPairs,
    stream_tokenizer_sample,
    streaming_rows,
)
