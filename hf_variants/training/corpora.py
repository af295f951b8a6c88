"""Several training corpora, mixed by weight, with an optional source-side tag each: the data side of tagged
back-translation (Caswell et al. 2019), OpenNMT-py's weighted corpora, fairseq's upsampled bitext.

**Declaring them.** On the command line, one `--train_file` per corpus (TSV or JSONL), with one weight and one
tag each:

    --train_file clean.tsv --train_file bt.tsv --corpus_weights 1 0.5 --corpus_tags "" "<BT>"

or a corpus spec file (`--corpus_spec corpora.json`), which may also name per-language text files and `datasets`
datasets:

    {"corpora": [
        {"train_file": "data/clean.tsv"},
        {"name": "bt", "data_dir": "data", "prefix": "mono", "weight": 0.5, "tag": "<BT>"},
        {"dataset_name": "data/flat_en_fr", "split": "train", "source_column": "english", "target_column": "french"}
    ]}

Each entry names exactly one source: `train_file` (TSV/JSONL), `data_dir` with `prefix` (default `train`; the
files `{prefix}.{lang}[.gz]`) or `dataset_name` (with `dataset_config_name`, `split` (default `train`),
`source_column`/`target_column`); optional `name` (default: the file, folder or dataset name), `weight` (default
1) and `tag` (default none). Paths are read as on the command line (relative to the working directory). Validation
and test data come from `--valid_file` / `--test_file`.

**Sampling by weight.** A corpus's weight is its share of the training examples: with weights 1 and 0.5, two thirds
of the examples come from the first corpus and one third from the second, whatever their sizes. An epoch draws as
many examples as the corpora hold together (N); corpus c contributes round(N w_c / sum w) of them (largest
remainders), taken from a seeded permutation of its pairs that each epoch continues where the previous one stopped:
a corpus drawn more often than its size repeats pairs only after every pair was seen (upsampled); one drawn less
gets a different part of itself every epoch, and all of it over several epochs (downsampled). The epoch's examples
are then length-bucketed into token batches and shuffled as a single corpus's are (`corpus.TokenBatchSampler`), so
batches mix the corpora. Everything follows from the seed and the epoch: a resumed run draws the same examples.

**Tags.** A corpus's tag (e.g. `<BT>`) is put before each of its source sentences (`"<BT> " + source`); it is a
special token of the tokenizer (added when the tokenizer is trained or loaded, `add_tags`), so it is one token id
at the start of the source (after a target-language tag), never split and never in a decoded translation. It is
matched as a whole word only (`tag_token`: "obtenir" keeps its letters under the tag "bt"), and a tag that could be
text is refused naming it: a token of the tokenizer's vocabulary ("man": text encodes to it), or a word of any
sentence of the run's data (`check_tags_in_text`, naming the file and line). The pairs stage counts it in the
source length (`--max_length`, batching). A tag cannot be added to a resumed run's tokenizer or to the tokenizer of
a `--model_name_or_path` model (its embeddings have no row for it).

**The cache.** Each corpus has its own cached rows, token counts and pairs (`data_pipeline`), keyed by its source,
the tokenizer (whose added tokens include the tags) and the tag's length; the epochs' batches depend on the weights,
sizes and seed (`WeightedCorpusSampler.key`). `MixedPairSet.fingerprint` digests the whole spec.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from . import corpus, data_pipeline
from .cache_store import _digest
from .corpus import DataError, DropReport

SPEC_SOURCES = ("train_file", "data_dir", "dataset_name")
SPEC_KEYS = {
    "name",
    "weight",
    "tag",
    "prefix",
    "dataset_config_name",
    "split",
    "source_column",
    "target_column",
} | set(SPEC_SOURCES)
MAX_SPEC_BYTES = 1 << 20
RESERVED_TAGS = re.compile(r"<2[A-Za-z0-9_-]+>|<pad>|<s>|</s>|<unk>")


# ------------------------------------------------------------------------------------------- the command line
def _check_tag(tag, where: str) -> str:
    if not isinstance(tag, str):
        raise ValueError(f"{where}: a tag is a string, got {tag!r}")
    if tag and (len(tag) > 64 or any(c.isspace() for c in tag)):
        raise ValueError(f"{where}: tag {tag!r} must be one token: no whitespace, at most 64 characters")
    if tag and RESERVED_TAGS.fullmatch(tag):
        raise ValueError(f"{where}: tag {tag!r} is a special token of the tokenizer (or a <2xx> language tag)")
    return tag


def _check_weight(weight, where: str) -> float:
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not math.isfinite(weight) or weight <= 0:
        raise ValueError(f"{where}: a weight must be a positive number, got {weight!r}")
    return float(weight)


def _read_spec(path: str) -> list[dict]:
    """The entries of a corpus spec file, each checked (a `ValueError` naming the file, the entry and the key)."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--corpus_spec {path}: no such file")
    if file.stat().st_size > MAX_SPEC_BYTES:
        raise ValueError(f"--corpus_spec {path}: {file.stat().st_size} bytes, more than a corpus spec can be")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"--corpus_spec {path}: not valid JSON ({error})") from None
    entries = data.get("corpora") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f'--corpus_spec {path}: expected {{"corpora": [{{"train_file": ...}}, ...]}}')
    out = []
    for i, entry in enumerate(entries, 1):
        where = f"--corpus_spec {path}, corpus {i}"
        if not isinstance(entry, dict):
            raise ValueError(f"{where}: expected an object, got {type(entry).__name__}")
        unknown = sorted(set(entry) - SPEC_KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {', '.join(unknown)} (keys: {', '.join(sorted(SPEC_KEYS))})")
        sources = [k for k in SPEC_SOURCES if entry.get(k)]
        if len(sources) != 1:
            raise ValueError(f"{where}: name exactly one of {', '.join(SPEC_SOURCES)} (got {sources or 'none'})")
        for key, value in entry.items():
            if key not in ("weight", "tag") and not isinstance(value, str):
                raise ValueError(f"{where}: {key} must be a string, got {value!r}")
        if ("source_column" in entry) != ("target_column" in entry) or (
            "source_column" in entry and sources != ["dataset_name"]
        ):
            raise ValueError(f"{where}: source_column and target_column name a dataset's two text columns: give both")
        kind = sources[0]
        spec = {"name": entry.get("name") or _default_name(kind, entry), kind: entry[kind]}
        if kind == "data_dir":
            spec["prefix"] = entry.get("prefix", "train")
        if kind == "dataset_name":
            spec.update(
                {k: entry[k] for k in ("dataset_config_name", "source_column", "target_column") if k in entry},
                split=entry.get("split", "train"),
            )
        spec["weight"] = _check_weight(entry.get("weight", 1.0), where)
        spec["tag"] = _check_tag(entry.get("tag") or "", where)
        out.append(spec)
    return out


def _default_name(kind: str, spec: dict) -> str:
    if kind == "data_dir":
        return f"{Path(spec['data_dir']).name}/{spec.get('prefix', 'train')}"
    if kind == "dataset_name":
        return f"{spec['dataset_name']}[{spec.get('split', 'train')}]"
    return Path(spec["train_file"]).name


def parse_corpora(args) -> list[dict] | None:
    """The run's training corpora from `--train_file` (repeated), `--corpus_weights`, `--corpus_tags` or
    `--corpus_spec` (None: one source as before: one `--train_file`, `--dataset_name` or `--data_dir`). Leaves
    `args.train_file` the single file of a one-source run (None when there are corpora). A `ValueError` names the
    flag."""
    files = args.train_file if isinstance(args.train_file, list) else ([args.train_file] if args.train_file else [])
    weights, tags, spec = args.corpus_weights, args.corpus_tags, args.corpus_spec
    if spec:
        given = [flag for flag, v in (("--train_file", files), ("--dataset_name", args.dataset_name)) if v]
        given += [flag for flag, v in (("--corpus_weights", weights), ("--corpus_tags", tags)) if v is not None]
        if given:
            raise ValueError(f"--corpus_spec lists the training corpora (weights and tags included): drop {given[0]}")
        entries = _read_spec(spec)
    elif len(files) > 1 or weights is not None or tags is not None:
        if not files:
            flag = "--corpus_weights" if weights is not None else "--corpus_tags"
            raise ValueError(f"{flag} gives each --train_file its weight or tag: name the files with --train_file")
        if args.dataset_name:
            raise ValueError("give either --train_file or --dataset_name (or neither, for --data_dir)")
        for flag, values in (("--corpus_weights", weights), ("--corpus_tags", tags)):
            if values is not None and len(values) != len(files):
                raise ValueError(f"{flag}: {len(values)} value(s) for {len(files)} --train_file(s): give one each")
        entries = []
        for i, file in enumerate(files):
            entries.append(
                {
                    "name": Path(file).name,
                    "train_file": file,
                    "weight": _check_weight(weights[i], "--corpus_weights") if weights else 1.0,
                    "tag": _check_tag(tags[i], "--corpus_tags") if tags else "",
                }
            )
    else:
        args.train_file = files[0] if files else None
        return None
    names = [e["name"] for e in entries]
    for i, entry in enumerate(entries):
        if names.count(entry["name"]) > 1:
            entry["name"] = f"{entry['name']}#{names[: i + 1].count(entry['name'])}"
    if args.streaming:
        raise ValueError("--streaming reads one training corpus: several corpora are mixed from the cache")
    if args.bidirectional and any(e["tag"] for e in entries):
        raise ValueError("--corpus_tags mark the source side, which --bidirectional also trains as a target")
    if args.source_annotations and any(e["tag"] for e in entries):
        raise ValueError("--corpus_tags change the source sentences, which --source_annotations must spell exactly")
    args.train_file = None
    return entries


def input_paths(args) -> list[str]:
    """The local paths of the corpora (for the output checks)."""
    out = []
    for spec in args.corpora or []:
        value = spec.get("train_file") or spec.get("data_dir") or spec.get("dataset_name")
        if value and os.path.lexists(value):
            out.append(value)
    return out


def label(args) -> str | None:
    """The training data's name in results.json: the corpora's names joined (None without corpora)."""
    return " + ".join(spec["name"] for spec in args.corpora) if args.corpora else None


# -------------------------------------------------------------------------------------------------- the rows
class CorpusRows:
    """The rows of several corpora (`sources.Rows` each), read as one training split where that is what is asked:
    the tokenizer's sample (`__len__`, `texts`) and the language checks (`meta`, `languages_present`)."""

    def __init__(self, parts: list[tuple[dict, data_pipeline.Rows]]):
        self.parts = parts
        self.offsets = np.cumsum([0] + [len(r) for _, r in parts])
        present = [set(r.languages_present) for _, r in parts]
        annotations = [r.meta.get("annotations_present", {}) for _, r in parts]
        self.meta = {
            "label": " + ".join(spec["name"] for spec, _ in parts),
            "annotations_present": {
                name: sorted(set.intersection(*(set(a.get(name, [])) for a in annotations)))
                for name in set().union(*annotations)
            },
        }
        self.languages_present = [lang for lang in parts[0][1].languages_present if all(lang in p for p in present)]

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def texts(self, lang: str, rows: np.ndarray | None = None):
        """The `lang` sentences of the (sorted, global) `rows`, corpus after corpus."""
        for i, (_, part) in enumerate(self.parts):
            if rows is None:
                yield from part.texts(lang)
                continue
            lo, hi = np.searchsorted(rows, self.offsets[i]), np.searchsorted(rows, self.offsets[i + 1])
            if hi > lo:
                yield from part.texts(lang, rows[lo:hi] - self.offsets[i])


def corpus_source(spec: dict, args, languages: Sequence[str]) -> data_pipeline.SplitSource:
    """Where one corpus comes from (`sources.SplitSource`)."""
    annotations = args.source_annotations
    if spec.get("train_file"):
        return data_pipeline.SplitSource.from_file(spec["train_file"], annotations)
    if spec.get("data_dir"):
        return data_pipeline.SplitSource.from_dir(spec["data_dir"], spec["prefix"], languages, annotations)
    if annotations:
        raise DataError(f"corpus {spec['name']}: --source_annotations are read from files, not from datasets.")
    splits = corpus.load_hub_splits(spec["dataset_name"], spec.get("dataset_config_name"))
    split = corpus.resolve_split(list(splits), spec["split"], "train", spec["dataset_name"])
    columns = None
    if spec.get("source_column"):
        columns = {args.source_lang: spec["source_column"], args.target_lang: spec["target_column"]}
    return data_pipeline.SplitSource.from_hub(
        splits[split], spec["dataset_name"], split, spec.get("dataset_config_name"), columns=columns
    )


def sources_by_corpus(args, languages: Sequence[str]) -> dict:
    """{"train <name>": source} of every corpus, for the data fingerprint a resume compares
    (`data_fingerprint.check_resume`); a corpus that cannot be resolved here is left out (loading names it)."""
    out = {}
    for spec in args.corpora or []:
        try:
            out[f"train {spec['name']}"] = corpus_source(spec, args, languages)
        except Exception:  # noqa: BLE001 - reported where the data is loaded
            continue
    return out


def load_corpus_rows(args, languages: Sequence[str]) -> CorpusRows:
    """Every corpus's rows (stage 1 of the cache, each its own entry), the first --max_train_pairs of each; a
    corpus without a language of the run's directions is named."""
    directions = (
        corpus.parse_directions(args.directions, languages)
        if args.languages
        else [(args.source_lang, args.target_lang)]
    )
    parts = []
    for spec in args.corpora:
        source = corpus_source(spec, args, languages)
        rows = data_pipeline.load_rows(source, languages, args.source_annotations, args.data_cache_dir)
        rows = rows.head(args.max_train_pairs)
        try:
            data_pipeline.check_languages(rows, directions, args.source_annotations, args.bidirectional)
        except DataError as error:
            raise DataError(f"corpus {spec['name']}: {error}") from None
        parts.append((spec, rows))
    return CorpusRows(parts)


# -------------------------------------------------------------------------------------------------- the tags
def _tags(args) -> list[str]:
    return list(dict.fromkeys(spec["tag"] for spec in args.corpora or [] if spec["tag"]))


def tag_token(tag: str):
    """The added token of a corpus tag: special (dropped from decoded text), never normalized, and matched as a
    whole word only (`single_word`): never inside a word that contains its letters ("bt" in "obtenir")."""
    from tokenizers import AddedToken

    return AddedToken(tag, special=True, single_word=True, normalized=False, lstrip=False, rstrip=False)


def _check_not_in_vocabulary(tokenizer, tags: list[str], whose: str) -> None:
    """A tag that is a token of the tokenizer's own vocabulary (a piece of ordinary text, e.g. "man") is no tag: it
    would be that text's id, and decoding would drop the text. A `DataError` naming the tag."""
    added = set(tokenizer.added_tokens_encoder)
    vocab = tokenizer.get_vocab()
    for tag in tags:
        if tag in vocab and tag not in added:
            raise DataError(
                f"corpus tag {tag!r} is a token of the tokenizer's vocabulary ({whose}): text encodes to it, so it "
                f"cannot mark a corpus. Choose a tag that is no token of it and no word of the text, e.g. <BT>."
            )


def add_tags(tokenizer, args, resuming=None) -> bool:
    """Add the corpora's tags to `tokenizer` as special tokens (each at the end of its vocabulary, `tag_token`); True
    when it changed (then it is saved again). A tag that is a token of the vocabulary is refused; a resumed run's
    tokenizer or a `--model_name_or_path` model's must have the tags already: a `DataError` naming the tag."""
    tags = _tags(args)
    whose = (
        f"the tokenizer of {resuming}"
        if resuming
        else f"the tokenizer of {args.model_name_or_path}"
        if args.model_name_or_path
        else "the run's tokenizer"
    )
    _check_not_in_vocabulary(tokenizer, tags, whose)
    missing = [tag for tag in tags if tag not in tokenizer.get_vocab()]
    if not missing:
        return False
    if resuming or args.model_name_or_path:
        raise DataError(
            f"corpus tag {missing[0]} is not a token of {whose}, and a model's vocabulary cannot grow within a "
            f"run: train with the tags from the start (a new run), or tag with a token the tokenizer has."
        )
    with_tags(tokenizer, args)
    return True


def with_tags(tokenizer, args):
    """`tokenizer` with the corpora's tags added as special tokens (those it lacks, in the corpora's order; see
    `tag_token`)."""
    tags = _tags(args)
    _check_not_in_vocabulary(tokenizer, tags, "the run's tokenizer")
    missing = [tag for tag in tags if tag not in tokenizer.get_vocab()]
    if missing:
        extra = list(getattr(tokenizer, "extra_special_tokens", None) or [])
        tokenizer.add_special_tokens({"extra_special_tokens": extra + [tag_token(tag) for tag in missing]})
    return tokenizer


def tag_tokens(tokenizer, tag: str) -> int:
    """How many tokens `tag` adds to a source sentence (1 for a special token)."""
    return len(tokenizer(tag, add_special_tokens=False).input_ids) if tag else 0


def _tagged_sentence(tokenizer, part, lang: str, ids: dict) -> tuple[int, str] | None:
    """(row, tag) of the first `lang` sentence of `part` in which the tokenizer reads a tag (`ids`: {id: tag}), else
    None: a substring scan of the column, the tokenizer only on the sentences that hold a tag's letters."""
    import pyarrow.compute as pc

    from .cache_store import _text_col

    offset = 0
    for batch in part.batches([_text_col(lang)]):
        column = batch.column(0)
        hits = np.zeros(batch.num_rows, dtype=bool)
        for tag in ids.values():
            hits |= pc.fill_null(pc.match_substring(column, tag), False).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(hits).tolist():
            found = set(tokenizer(column[i].as_py(), add_special_tokens=False).input_ids) & set(ids)
            if found:
                return offset + i, ids[min(found)]
        offset += batch.num_rows
    return None


def check_tags_in_text(tokenizer, args, rows: dict) -> None:
    """No sentence of any split (`rows`: {split: rows}; every corpus, every language) holds a corpus tag where the
    tokenizer reads it (as a word): such a sentence would be marked as the tagged corpus's, and decoding would drop
    the word. A `DataError` naming the tag and the first such sentence (file:line)."""
    tags = _tags(args)
    if not tags:
        return
    ids = {tokenizer.convert_tokens_to_ids(tag): tag for tag in tags}
    for split, split_rows in rows.items():
        if split_rows is None:
            continue
        parts = split_rows.parts if isinstance(split_rows, CorpusRows) else [({"name": None}, split_rows)]
        for spec, part in parts:
            for lang in part.languages_present:
                found = _tagged_sentence(tokenizer, part, lang, ids)
                if found is not None:
                    what = f"corpus {spec['name']}" if spec["name"] else f"the {split} data"
                    raise DataError(
                        f"corpus tag {found[1]!r} occurs as a word in {what}, {part.locate(found[0], lang)} ({lang}): "
                        f"the tokenizer would read it as the tag (and decoding would drop it). Choose a tag that no "
                        f"sentence holds, e.g. <BT>."
                    )


# ------------------------------------------------------------------------------------------------- the pairs
class MixedPairSet:
    """The kept training pairs of several corpora (`pairs.PairSet` each) as one set: pair i of corpus c is global
    example `offsets[c] + i`; `pairs()` puts the corpus's tag before each source sentence."""

    def __init__(self, parts: list[data_pipeline.PairSet], specs: list[dict]):
        self.parts, self.specs = parts, specs
        self.sizes = np.array([len(p) for p in parts], dtype=np.int64)
        self.offsets = np.concatenate(([0], np.cumsum(self.sizes)))
        self.src_len = np.concatenate([np.asarray(p.src_len) for p in parts])
        self.tgt_len = np.concatenate([np.asarray(p.tgt_len) for p in parts])
        self.weights = np.array([spec["weight"] for spec in specs], dtype=np.float64)
        for spec, size in zip(specs, self.sizes):
            if not size:
                raise DataError(f"corpus {spec['name']} has no training pairs left (see the dropped pairs above).")
        self.report = DropReport("train")
        for part in parts:
            for reason, count in part.report.counts.items():
                self.report.counts[reason] += count
                where = self.report.locations.setdefault(reason, [])
                where.extend(part.report.locations.get(reason, [])[: corpus.MAX_REPORTED_LOCATIONS - len(where)])
        per_direction: dict[str, int] = {}
        for part in parts:
            for direction, n in (part.pairs_per_direction or {}).items():
                per_direction[direction] = per_direction.get(direction, 0) + n
        self.pairs_per_direction = per_direction
        self.fingerprint = _digest(
            {"parts": [p.fingerprint for p in parts], "weights": self.weights.tolist(), "specs": specs}
        )

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def corpus_of(self, indices) -> np.ndarray:
        """The corpus (index into the specs) of each global example index."""
        return np.searchsorted(self.offsets, np.asarray(indices, dtype=np.int64), side="right") - 1

    def pairs(self, indices) -> list[corpus.Pair]:
        idx = np.asarray(indices, dtype=np.int64)
        which = self.corpus_of(idx)
        out: list = [None] * len(idx)
        for c in np.unique(which).tolist():
            at = np.flatnonzero(which == c)
            tag = self.specs[c]["tag"]
            for j, pair in zip(at.tolist(), self.parts[c].pairs(idx[at] - self.offsets[c])):
                out[j] = dataclasses.replace(pair, src=f"{tag} {pair.src}") if tag else pair
        return out

    def to_pairs(self) -> list[corpus.Pair]:
        return self.pairs(np.arange(len(self)))

    def examples_per_epoch(self) -> np.ndarray:
        """Examples of each corpus in an epoch: round(N w_c / sum w), largest remainders (they sum to N)."""
        total = len(self)
        exact = total * self.weights / self.weights.sum()
        counts = np.floor(exact).astype(np.int64)
        remainder = total - int(counts.sum())
        counts[np.argsort(-(exact - counts), kind="stable")[:remainder]] += 1
        return counts

    def summary(self) -> list[dict]:
        """results.json's `corpora`: each corpus with its source, weight, tag, pairs and share of the examples."""
        per_epoch = self.examples_per_epoch()
        out = []
        for spec, size, count in zip(self.specs, self.sizes.tolist(), per_epoch.tolist()):
            source = {k: spec[k] for k in ("train_file", "data_dir", "prefix", "dataset_name", "split") if k in spec}
            out.append(
                {
                    "name": spec["name"],
                    **source,
                    "weight": spec["weight"],
                    "tag": spec["tag"] or None,
                    "pairs": size,
                    "share": float(spec["weight"] / self.weights.sum()),
                    "examples_per_epoch": count,
                }
            )
        return out


def pair_set(rows, build, tokenizer):
    """The pairs of `rows`: `build(rows, extra_source_tokens)` (a `pairs.PairSet`) for one corpus, a `MixedPairSet`
    of every corpus (each built with the length of its tag in `tokenizer`'s tokens) for `CorpusRows`."""
    if not isinstance(rows, CorpusRows):
        return build(rows, 0)
    parts = [build(part, tag_tokens(tokenizer, spec["tag"])) for spec, part in rows.parts]
    return MixedPairSet(parts, [spec for spec, _ in rows.parts])


def summary(train_set) -> list[dict] | None:
    return train_set.summary() if isinstance(train_set, MixedPairSet) else None


# ------------------------------------------------------------------------------------------------ the batches
class WeightedCorpusSampler:
    """`corpus.TokenBatchSampler`'s batches over each epoch's weighted draw of examples (see the module
    docstring); the same interface (`epoch`, `batches`, `key`, `len`), so `corpus.SharedEpochs` shares it."""

    def __init__(
        self,
        train_set: MixedPairSet,
        max_tokens: int,
        max_sentences: int | None = None,
        seed: int = 0,
        shuffle: bool = True,
        examples_per_item: int = 1,
    ):
        self.train_set = train_set
        self.sizes, self.offsets = train_set.sizes, train_set.offsets
        self.per_epoch = train_set.examples_per_epoch()
        self.src, self.tgt = np.asarray(train_set.src_len), np.asarray(train_set.tgt_len)
        self.max_tokens, self.max_sentences, self.seed = max_tokens, max_sentences, seed
        self.shuffle, self.examples_per_item = shuffle, examples_per_item
        self._cached = self._lengths = None
        corpus.TokenBatchSampler(self.src, self.tgt, max_tokens, max_sentences, examples_per_item=examples_per_item)

    def _permutation(self, c: int, cycle: int) -> np.ndarray:
        n = int(self.sizes[c])
        order = np.arange(n, dtype=np.int32 if n < 2**31 else np.int64)
        np.random.default_rng([self.seed, 7, c, cycle]).shuffle(order)
        return order

    def selection(self, epoch: int) -> np.ndarray:
        """The global example indices drawn for `epoch`, corpus after corpus."""
        chosen = []
        for c, (n, m) in enumerate(zip(self.sizes.tolist(), self.per_epoch.tolist())):
            start, stop = epoch * m, (epoch + 1) * m
            for cycle in range(start // n, (stop - 1) // n + 1 if m else 0):
                lo, hi = max(start, cycle * n) - cycle * n, min(stop, (cycle + 1) * n) - cycle * n
                chosen.append(self._permutation(c, cycle)[lo:hi].astype(np.int64) + int(self.offsets[c]))
        return np.concatenate(chosen) if chosen else np.zeros(0, dtype=np.int64)

    def epoch(self, epoch: int) -> corpus.EpochBatches:
        if self._cached is not None and self._cached[0] == epoch:
            return self._cached[1]
        chosen = self.selection(epoch)
        inner = corpus.TokenBatchSampler(
            self.src[chosen],
            self.tgt[chosen],
            self.max_tokens,
            self.max_sentences,
            seed=[self.seed, epoch],
            shuffle=self.shuffle,
            examples_per_item=self.examples_per_item,
        ).epoch(0)
        batches = corpus.EpochBatches(chosen[inner.order], inner.offsets, inner.perm)
        self._cached = (epoch, batches)
        return batches

    def batches(self, epoch: int) -> list[list[int]]:
        return self.epoch(epoch).tolist()

    def __len__(self) -> int:
        return len(self.epoch(0))

    def key(self) -> str:
        base = corpus.TokenBatchSampler(
            self.src, self.tgt, self.max_tokens, self.max_sentences, self.seed, self.shuffle, self.examples_per_item
        ).key()
        return _digest(["weighted", base, self.sizes.tolist(), self.per_epoch.tolist()])


def token_batch_sampler(train_set, max_tokens, max_sentences=None, seed=0, shuffle=True, examples_per_item=1):
    """The training batches: `corpus.TokenBatchSampler` over one corpus's pairs, `WeightedCorpusSampler` over
    several."""
    if isinstance(train_set, MixedPairSet):
        return WeightedCorpusSampler(train_set, max_tokens, max_sentences, seed, shuffle, examples_per_item)
    return corpus.TokenBatchSampler(
        train_set.src_len, train_set.tgt_len, max_tokens, max_sentences, seed, shuffle, examples_per_item
    )
