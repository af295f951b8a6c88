"""Tests of hf_variants.training.data_pipeline: the cached, memory-mapped Arrow pipeline gives exactly what the
in-memory reader (hf_variants.training.corpus) gives, is reused and invalidated as it should be, and batches from
numpy arrays."""

import argparse
import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_variants.training import cache_store, corpus, data_pipeline, measure, sources  # noqa: E402
from hf_variants.training.corpus import DataError, DropReport  # noqa: E402

MULTI30K = ROOT / "training" / "data" / "multi30k"


def head(path, n):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


def write(path: Path, lines, gz=False, end="\n"):
    text = "".join(line + end for line in lines)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from hf_variants.tokenization import train_tokenizer

    texts = head(MULTI30K / "train.en.gz", 400) + head(MULTI30K / "train.de.gz", 400)
    return train_tokenizer(
        texts, vocab_size=500, languages=["en", "de", "fr"], output_dir=tmp_path_factory.mktemp("tok")
    )


def parse_of(words):
    return "(ROOT (S " + " ".join(f"(NN {w})" for w in words) + "))"


def pipeline(
    source,
    tokenizer,
    directions,
    cache,
    *,
    languages=None,
    annotations=(),
    target_annotations=False,
    tag=0,
    max_length=None,
    on_bad_pairs="skip",
    limit=None,
    workers=1,
):
    languages = languages or list(dict.fromkeys(x for d in directions for x in d))
    rows = data_pipeline.load_rows(source, languages, annotations, cache).head(limit)
    checks = [
        (n, lang)
        for n in annotations
        for lang in dict.fromkeys(x for d in directions for x in (d if target_annotations else d[:1]))
    ]
    measured = data_pipeline.measure(rows, tokenizer, languages, checks, cache, workers)
    pair_set = data_pipeline.build_pair_set(
        rows,
        measured,
        directions,
        annotations=annotations,
        target_annotations=target_annotations,
        tag=tag,
        max_length=max_length,
        on_bad_pairs=on_bad_pairs,
        cache_dir=cache,
    )
    return rows, measured, pair_set


def in_memory(
    data,
    tokenizer,
    directions,
    *,
    annotations=(),
    target_annotations=False,
    tag=0,
    max_length=None,
    on_bad_pairs="skip",
):
    """What train.py computed before the Arrow pipeline: corpus.build_pairs, token counts, filter_long_pairs."""
    report = DropReport("train")
    pairs = corpus.build_pairs(data, directions, report, on_bad_pairs, annotations, target_annotations)

    def count(text):
        return len(tokenizer(text, add_special_tokens=True)["input_ids"])

    src = [count(p.src) + tag for p in pairs]
    tgt = [count(p.tgt) for p in pairs]
    if max_length is not None:
        pairs, src, tgt = corpus.filter_long_pairs(pairs, src, tgt, max_length, report, on_bad_pairs)
    return pairs, src, tgt, report


def assert_same(pair_set, expected):
    pairs, src, tgt, report = expected
    got = pair_set.to_pairs()
    assert [vars(p) for p in got] == [vars(p) for p in pairs]
    assert pair_set.src_len.tolist() == src and pair_set.tgt_len.tolist() == tgt
    assert dict(pair_set.report.counts) == dict(report.counts)
    assert pair_set.report.locations == report.locations


# ------------------------------------------------------------------------------- the same as corpus.py
@pytest.fixture()
def bad_dir(tmp_path):
    """Per-language files with empty sides on both sides, a too long line, and source parses (some bad)."""
    en = head(MULTI30K / "train.en.gz", 60)
    de = head(MULTI30K / "train.de.gz", 60)
    fr = head(MULTI30K / "train.fr.gz", 60)
    en[3], de[7], fr[9], en[11] = "", "  ", "", " ".join(["word"] * 80)
    write(tmp_path / "t.en", en)
    write(tmp_path / "t.de.gz", de, gz=True)
    write(tmp_path / "t.fr", fr)
    parses = [parse_of(s.replace("(", "-LRB-").replace(")", "-RRB-").split()) for s in en]
    parses[5] = parse_of(["wrong", "words"])
    parses[8] = parses[8][:-1]
    write(tmp_path / "t.en.parses", parses)
    write(tmp_path / "t.de.parses", [parse_of(s.split()) for s in de])
    return tmp_path


def test_same_pairs_lengths_and_report_as_the_in_memory_reader(bad_dir, tok, tmp_path):
    """Pairs (texts, languages, annotations, locations), token counts and the drop report (counts and the first
    locations of each reason, named by the side at fault) equal those of corpus.build_pairs + filter_long_pairs,
    for one direction, many-to-many, with source annotations (MG-SA parses) and with target annotations."""
    cache = tmp_path / "cache"
    cases = [
        dict(directions=[("en", "de")], max_length=40),
        dict(directions=[("en", "de"), ("de", "fr"), ("fr", "en"), ("en", "fr")], tag=1, max_length=30),
        dict(directions=[("en", "de")], annotations=["parses"], max_length=60),
        dict(directions=[("en", "de")], annotations=["parses"], target_annotations=True, max_length=60),
    ]
    for case in cases:
        langs = list(dict.fromkeys(x for d in case["directions"] for x in d))
        annotations = case.get("annotations", [])
        data = corpus.load_split_from_dir(bad_dir, "t", langs, annotations)
        source = data_pipeline.SplitSource.from_dir(bad_dir, "t", langs, annotations)
        _, _, pair_set = pipeline(
            source, tok, case["directions"], cache, **{k: v for k, v in case.items() if k != "directions"}
        )
        expected = in_memory(data, tok, case["directions"], **{k: v for k, v in case.items() if k != "directions"})
        assert pair_set.report.total > 0
        assert_same(pair_set, expected)
    # the parse checks found both bad parses, under the parse file's lines
    assert pair_set.report.locations["parse_mismatch"] == [f"{bad_dir / 't.en.parses'}:6"]
    assert pair_set.report.locations["malformed_parse"] == [f"{bad_dir / 't.en.parses'}:9"]
    assert pair_set.report.locations["empty_target"] == [f"{bad_dir / 't.de.gz'}:8"]


def test_errors_name_the_same_file_and_line(bad_dir, tok, tmp_path):
    """--on_bad_pairs error: the first bad pair stops the build with corpus.py's message (and nothing is cached)."""
    cache = tmp_path / "cache"
    cases = [
        dict(directions=[("de", "en")]),
        dict(directions=[("en", "de")], annotations=["parses"]),
        dict(directions=[("fr", "de")], max_length=30),
    ]
    messages = []
    for case in cases:
        langs = list(dict.fromkeys(x for d in case["directions"] for x in d))
        annotations = case.get("annotations", [])
        source = data_pipeline.SplitSource.from_dir(bad_dir, "t", langs, annotations)
        data = corpus.load_split_from_dir(bad_dir, "t", langs, annotations)
        kwargs = {k: v for k, v in case.items() if k != "directions"}
        with pytest.raises(DataError) as expected:
            in_memory(data, tok, case["directions"], on_bad_pairs="error", **kwargs)
        with pytest.raises(DataError) as got:
            pipeline(source, tok, case["directions"], cache, on_bad_pairs="error", **kwargs)
        assert str(got.value) == str(expected.value)
        messages.append(str(got.value))
    assert not list(cache.glob("pairs-*"))
    assert messages[0].endswith("t.en:4: empty target (de-en).") and messages[1].endswith(
        "t.en:4: empty source (en-de)."
    )
    assert (
        messages[2].endswith(
            f"t.en:12: pair longer than --max_length 30 tokens (source {messages[2].split()[-3]}"
            f" target {messages[2].split()[-1]}"
        )
        or "pair longer" not in messages[2]
    )
    # a bad parse first: the parse file's line, with the reader's explanation
    write(bad_dir / "p.en", ["A dog runs .", "Kids play ."])
    write(bad_dir / "p.de", ["Ein Hund rennt .", "Kinder spielen ."])
    write(bad_dir / "p.en.parses", [parse_of(["A", "cat", "runs", "."]), parse_of(["Kids", "play", "."])])
    data = corpus.load_split_from_dir(bad_dir, "p", ["en", "de"], ["parses"])
    with pytest.raises(DataError) as expected:
        in_memory(data, tok, [("en", "de")], annotations=["parses"], on_bad_pairs="error")
    with pytest.raises(DataError, match=r"p\.en\.parses:1: parse mismatch \(en-de\): .*'cat'") as got:
        pipeline(
            data_pipeline.SplitSource.from_dir(bad_dir, "p", ["en", "de"], ["parses"]),
            tok,
            [("en", "de")],
            cache,
            annotations=["parses"],
            on_bad_pairs="error",
        )
    assert str(got.value) == str(expected.value)


def test_tsv_jsonl_and_datasets_sources(tok, tmp_path):
    en = head(MULTI30K / "val.en.gz", 30)
    de = head(MULTI30K / "val.de.gz", 30)
    en[4], de[9] = "", " "
    cache = tmp_path / "cache"
    tsv = write(tmp_path / "d.tsv", ["de\ten"] + [f"{b}\t{a}" for a, b in zip(en, de)])
    rows = [{"translation": {"en": a, "de": b}, "parses": {"en": parse_of(a.split())}} for a, b in zip(en, de)]
    rows[12]["translation"].pop("de")  # a missing side
    rows[14]["parses"]["en"] = 7  # not a parse
    jsonl = write(tmp_path / "d.jsonl", [json.dumps(r, ensure_ascii=False) for r in rows], gz=False)
    for path, annotations in ((tsv, []), (jsonl, []), (jsonl, ["parses"])):
        data = corpus.load_corpus_file(path, annotations)
        source = data_pipeline.SplitSource.from_file(path, annotations)
        _, _, pair_set = pipeline(source, tok, [("en", "de")], cache, annotations=annotations, max_length=25)
        assert_same(pair_set, in_memory(data, tok, [("en", "de")], annotations=annotations, max_length=25))
    assert pair_set.report.locations["malformed_parse"] == [f"{jsonl}:15"]
    import datasets

    hub = datasets.load_dataset("json", data_files=str(jsonl), split="train")
    data = corpus.load_hub_dataset("json", "train", dataset=hub)
    source = data_pipeline.SplitSource.from_hub(hub, "json", "train")
    _, _, pair_set = pipeline(source, tok, [("en", "de")], cache, max_length=25)
    assert_same(pair_set, in_memory(data, tok, [("en", "de")], max_length=25))
    assert pair_set.report.locations["missing_target"] == ["json[train] row 12"]


def test_structural_errors_name_file_and_line(tmp_path, monkeypatch):
    """Block-wise reading keeps corpus.py's errors: different line counts (also of an annotation file), invalid
    UTF-8 (the line, across read blocks), TSV field counts, invalid JSON; CRLF and a last line without newline
    read as corpus.read_lines reads them."""
    monkeypatch.setattr(sources, "READ_BLOCK_BYTES", 7)  # many tiny blocks
    monkeypatch.setattr(sources, "WRITE_BATCH_ROWS", 3)
    cache = tmp_path / "cache"
    write(tmp_path / "a.en", ["one", "two", "three", "four"])
    write(tmp_path / "a.de", ["eins", "zwei", "drei"])
    src = data_pipeline.SplitSource.from_dir(tmp_path, "a", ["en", "de"])
    with pytest.raises(DataError) as got:
        data_pipeline.load_rows(src, ["en", "de"], cache_dir=cache)
    with pytest.raises(DataError) as expected:
        corpus.load_split_from_dir(tmp_path, "a", ["en", "de"])
    assert str(got.value) == str(expected.value)
    write(tmp_path / "b.en", ["one", "two", "three"])
    write(tmp_path / "b.de", ["eins", "zwei", "drei"])
    write(tmp_path / "b.en.parses", [parse_of(["one"]), parse_of(["two"])])
    with pytest.raises(DataError) as got:
        data_pipeline.load_rows(
            data_pipeline.SplitSource.from_dir(tmp_path, "b", ["en", "de"], ["parses"]),
            ["en", "de"],
            ["parses"],
            cache,
        )
    with pytest.raises(DataError) as expected:
        corpus.load_split_from_dir(tmp_path, "b", ["en", "de"], ["parses"])
    assert str(got.value) == str(expected.value)
    (tmp_path / "c.en").write_bytes("ok\nstill ok\nnäh\n".encode() + b"\xff broken\nlast\n")
    write(tmp_path / "c.de", ["a", "b", "c", "d", "e"])
    with pytest.raises(DataError, match=r"c\.en: line 4 is not valid UTF-8"):
        data_pipeline.load_rows(
            data_pipeline.SplitSource.from_dir(tmp_path, "c", ["en", "de"]), ["en", "de"], cache_dir=cache
        )
    (tmp_path / "d.en").write_bytes(b"one\r\ntwo \r\n\r\nfour")
    (tmp_path / "d.de").write_bytes(b"eins\nzwei\ndrei\nvier\n")
    rows = data_pipeline.load_rows(
        data_pipeline.SplitSource.from_dir(tmp_path, "d", ["en", "de"]), ["en", "de"], cache_dir=cache
    )
    assert list(rows.texts("en")) == list(corpus.read_lines(tmp_path / "d.en")) == ["one", "two ", "", "four"]
    bad_tsv = write(tmp_path / "bad.tsv", ["en\tde", "a\tx", "b\ty", "only one field"])
    with pytest.raises(DataError, match=r"bad\.tsv:4: expected 2 tab-separated fields"):
        data_pipeline.load_rows(data_pipeline.SplitSource.from_file(bad_tsv), ["en", "de"], cache_dir=cache)
    bad_json = write(tmp_path / "bad.jsonl", [json.dumps({"en": "a", "de": "x"})] * 4 + ["{not json"])
    with pytest.raises(DataError, match=r"bad\.jsonl:5: invalid JSON"):
        data_pipeline.load_rows(data_pipeline.SplitSource.from_file(bad_json), ["en", "de"], cache_dir=cache)
    assert not [p for p in cache.iterdir() if p.name.startswith(".tmp")]  # failed builds leave nothing behind


@pytest.mark.parametrize(
    "line,message",
    [
        ("", r"bad\.jsonl:2: empty line \(expected one JSON object a line\)"),
        ("{not json", r"bad\.jsonl:2: invalid JSON"),
        ('["a list"]', r"bad\.jsonl:2: expected a JSON object, got list"),
    ],
)
def test_jsonl_line_errors_are_the_same_in_every_reader(tmp_path, line, message):
    """One JSONL line parser (corpus.parse_jsonl_line) for the in-memory loader, the Arrow pipeline and
    translate.py: each names the file and line with the same message."""
    from hf_variants.commands import inputs, translate

    path = write(tmp_path / "bad.jsonl", [json.dumps({"translation": {"en": "a", "de": "x"}}), line, "{}"])
    errors = []
    for read in (
        lambda: corpus.load_jsonl(path),
        lambda: data_pipeline.load_rows(
            data_pipeline.SplitSource.from_file(path), ["en", "de"], cache_dir=tmp_path / "cache"
        ),
        lambda: list(  # hf-variants-translate's reader of JSONL input
            inputs.iter_input(
                argparse.Namespace(prefix=None, references=None, src_lang="en"),
                translate.Plan(None, True, str(path), {}, [], None, "text", "de", None, None),
                inputs.iter_lines(str(path)),
            )
        ),
    ):
        with pytest.raises(DataError, match=message) as err:
            read()
        errors.append(str(err.value))
    assert len(set(errors)) == 1, errors


def test_many_to_many_rows_without_a_language_are_no_pairs_of_its_directions(tok, tmp_path):
    """OPUS-100 style (one language pair a row): with skip_absent (train.py: more than two languages) a row lacking
    a direction's language is no pair of it, neither kept nor counted as bad; an empty sentence is still counted.
    Without it, every absent side is a bad pair (two-language runs keep reporting a row's missing side). The
    cached and the streamed pipeline agree."""
    en, de, fr = (head(MULTI30K / f"val.{lang}.gz", 12) for lang in ("en", "de", "fr"))
    rows = [{"translation": {"en": en[i], "de": de[i]}} for i in range(6)]
    rows += [{"translation": {"fr": fr[i], "en": en[i]}} for i in range(6, 12)]
    rows[2]["translation"]["de"] = ""  # an empty sentence: a bad pair of en-de and de-en
    rows[8]["translation"]["fr"] = None  # null: no French side at all
    path = write(tmp_path / "m.jsonl", [json.dumps(r, ensure_ascii=False) for r in rows])
    languages = ["en", "de", "fr"]
    directions = corpus.parse_directions("en-*,*-en", languages)
    source = data_pipeline.SplitSource.from_file(path)
    rows_, measured, _ = pipeline(source, tok, directions, tmp_path / "cache", languages=languages)
    pair_set = data_pipeline.build_pair_set(
        rows_, measured, directions, cache_dir=tmp_path / "cache", skip_absent=True
    )
    assert pair_set.pairs_per_direction == {"en-de": 5, "en-fr": 5, "de-en": 5, "fr-en": 5}
    assert dict(pair_set.report.counts) == {"empty_target": 1, "empty_source": 1}
    assert pair_set.report.locations["empty_target"] == [f"{path}:3"]
    got = pair_set.to_pairs()
    assert mapped_resident_kb(rows_.path) == 0  # a batch's reads leave no page of the rows' map resident
    assert {(p.src_lang, p.tgt_lang, p.location) for p in got} == (
        {(s, t, f"{path}:{i + 1}") for i in (0, 1, 3, 4, 5) for s, t in (("en", "de"), ("de", "en"))}
        | {(s, t, f"{path}:{i + 1}") for i in (6, 7, 9, 10, 11) for s, t in (("en", "fr"), ("fr", "en"))}
    )
    cached_again = data_pipeline.build_pair_set(
        rows_, measured, directions, cache_dir=tmp_path / "cache", skip_absent=True
    )
    assert not cached_again.built and cached_again.pairs_per_direction == pair_set.pairs_per_direction
    every = data_pipeline.build_pair_set(rows_, measured, directions, cache_dir=tmp_path / "cache")
    assert len(every) == len(pair_set) and every.report.counts["missing_target"] == 12 + 1
    stream = data_pipeline.StreamingPairs(
        source, languages, directions, tok, buffer_rows=5, max_tokens=400, skip_absent=True
    )
    streamed = [p for step, _ in stream.steps() for b in step for p in b]
    assert sorted((p.src_lang, p.tgt_lang, p.location) for p in streamed) == sorted(
        (p.src_lang, p.tgt_lang, p.location) for p in got
    )
    assert dict(stream.report.counts) == dict(pair_set.report.counts)


# ------------------------------------------------------------------------------------------- the cache
def test_cache_is_reused_and_invalidated(tok, tmp_path, monkeypatch):
    """A second load tokenizes nothing and returns the same arrays; changing the data, the tokenizer or a
    setting builds only the stages that depend on it."""
    from hf_variants.tokenization import train_tokenizer

    cache = tmp_path / "cache"
    write(tmp_path / "t.en", head(MULTI30K / "train.en.gz", 200))
    write(tmp_path / "t.de", head(MULTI30K / "train.de.gz", 200))
    source = data_pipeline.SplitSource.from_dir(tmp_path, "t", ["en", "de"])
    rows, measured, first = pipeline(source, tok, [("en", "de")], cache, max_length=30)
    assert rows.built and measured.built and first.built
    assert set(p.name.split("-")[0] for p in cache.iterdir()) == {"rows", "measured", "pairs"}

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(measure, "_measure", no_tokenizing)
    monkeypatch.setattr(sources, "iter_row_blocks", no_tokenizing)
    rows2, measured2, again = pipeline(source, tok, [("en", "de")], cache, max_length=30)
    assert not (rows2.built or measured2.built or again.built)
    assert isinstance(again.src_len, np.memmap)  # memory-mapped, not read into memory
    for name in ("row_index", "dir_index", "src_len", "tgt_len"):
        assert np.array_equal(getattr(first, name), getattr(again, name)), name
    assert [vars(p) for p in again.to_pairs()] == [vars(p) for p in first.to_pairs()]
    # identical batches from the cached and the freshly built arrays
    for a, b in ((first, again),):
        sa = corpus.TokenBatchSampler(a.src_len, a.tgt_len, 300, seed=3).batches(1)
        sb = corpus.TokenBatchSampler(b.src_len, b.tgt_len, 300, seed=3).batches(1)
        assert sa == sb and len(sa) > 3
    # a setting of the pairs stage: only that stage is built
    _, m3, p3 = pipeline(source, tok, [("en", "de")], cache, max_length=12)
    assert not m3.built and p3.built and len(p3) < len(first)
    _, m4, p4 = pipeline(source, tok, [("de", "en")], cache, max_length=30, languages=["en", "de"])
    assert not m4.built and p4.built and p4.report.total == first.report.total
    monkeypatch.undo()
    # another tokenizer: counted again
    other = train_tokenizer(head(MULTI30K / "train.en.gz", 300), vocab_size=300, languages=["en", "de"])
    _, m5, p5 = pipeline(source, other, [("en", "de")], cache, max_length=30)
    assert m5.built and p5.built and not np.array_equal(np.asarray(p5.src_len), np.asarray(first.src_len))
    # changed data, even of the same size and modification time (the words of line 1 reversed): read again
    import os

    lines = head(MULTI30K / "train.de.gz", 200)
    lines[0] = " ".join(lines[0].split()[::-1])
    stat = (tmp_path / "t.de").stat()
    write(tmp_path / "t.de", lines)
    os.utime(tmp_path / "t.de", ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert (tmp_path / "t.de").stat().st_size == stat.st_size
    r6, m6, p6 = pipeline(source, tok, [("en", "de")], cache, max_length=30)
    assert r6.built and m6.built and p6.built and next(iter(r6.texts("de"))) == lines[0]
    # the first rows only (--max_train_pairs): counted for those rows
    r7, m7, p7 = pipeline(source, tok, [("en", "de")], cache, max_length=30, limit=50)
    assert not r7.built and m7.built and len(p7) <= 50


def test_parallel_workers_give_the_same_counts(tok, tmp_path, monkeypatch):
    """`Dataset.map` in 2 worker processes counts exactly what one process counts."""
    monkeypatch.setattr(measure, "ROWS_PER_WORKER", 100)
    write(tmp_path / "t.en", head(MULTI30K / "train.en.gz", 500))
    write(tmp_path / "t.de", head(MULTI30K / "train.de.gz", 500))
    source = data_pipeline.SplitSource.from_dir(tmp_path, "t", ["en", "de"])
    _, one, p1 = pipeline(source, tok, [("en", "de")], tmp_path / "c1", max_length=30)
    _, two, p2 = pipeline(source, tok, [("en", "de")], tmp_path / "c2", max_length=30, workers=2)
    assert len(two.dataset.cache_files) == 2  # one file per worker
    for name in ("len.en", "len.de", "state.en"):
        assert np.array_equal(one.column(name), two.column(name))
    assert np.array_equal(p1.src_len, p2.src_len) and np.array_equal(p1.row_index, p2.row_index)


def test_tokenizer_sample_is_deterministic(tmp_path):
    write(tmp_path / "t.en", [f"sentence {i}" for i in range(1000)])
    write(tmp_path / "t.de", [f"Satz {i}" for i in range(1000)])
    rows = data_pipeline.load_rows(
        data_pipeline.SplitSource.from_dir(tmp_path, "t", ["en", "de"]), ["en", "de"], cache_dir=tmp_path / "cache"
    )
    texts, used, total = data_pipeline.tokenizer_sample(rows, ["en", "de"], 300)
    en, de = (list(t) for t in texts)
    assert (used, total, len(en), len(de)) == (150, 1000, 150, 150)
    assert [s.split()[1] for s in en] == [s.split()[1] for s in de]  # the same rows in both languages
    assert sorted(int(s.split()[1]) for s in en) == [int(s.split()[1]) for s in en]  # in corpus order
    again, _, _ = data_pipeline.tokenizer_sample(rows, ["en", "de"], 300)
    assert list(again[0]) == en
    everything, used, _ = data_pipeline.tokenizer_sample(rows, ["en", "de"], 0)
    assert used == 1000 and list(everything[1]) == [f"Satz {i}" for i in range(1000)]


# -------------------------------------------------------------------------------------------- batching
def reference_batches(lengths, max_tokens, max_sentences, seed, epoch, shuffle, per_item):
    """The greedy loop TokenBatchSampler implemented before it worked on numpy arrays only."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    rng = np.random.default_rng([seed, epoch])
    tie = rng.permutation(n) if shuffle else np.arange(n)
    batches, current, longest = [], [], 0
    for idx in np.lexsort((tie, lengths)).tolist():
        new_longest = max(longest, int(lengths[idx]))
        full = (len(current) + 1) * new_longest * per_item > max_tokens
        full |= max_sentences is not None and len(current) + 1 > max_sentences
        if current and full:
            batches.append(current)
            current, new_longest = [], int(lengths[idx])
        current.append(idx)
        longest = new_longest
    if current:
        batches.append(current)
    if shuffle:
        batches = [batches[i] for i in rng.permutation(len(batches))]
    return batches


def test_numpy_batches_equal_the_greedy_loop():
    rng = np.random.default_rng(0)
    for trial in range(150):
        n = int(rng.integers(1, 300))
        low = int(rng.integers(1, 5))
        src, tgt = rng.integers(low, low + 50, n), rng.integers(low, low + 50, n)
        per_item = int(rng.integers(1, 3))
        max_tokens = int(rng.integers((low + 49) * per_item, 700))
        max_sentences = None if trial % 2 else int(rng.integers(1, 20))
        shuffle, seed, epoch = bool(trial % 3), trial % 4, trial % 2
        got = corpus.TokenBatchSampler(
            src, tgt, max_tokens, max_sentences, seed=seed, shuffle=shuffle, examples_per_item=per_item
        )
        assert got.batches(epoch) == reference_batches(
            np.maximum(src, tgt), max_tokens, max_sentences, seed, epoch, shuffle, per_item
        ), trial
        assert isinstance(got.epoch(epoch)[0], np.ndarray)
        assert got.epoch(epoch).order.dtype == np.int32  # 4-byte indices below 2**31 examples


def test_ranks_take_disjoint_shares_of_every_step():
    """2 processes: within an epoch the micro-batches of rank 0 and rank 1 never share an example (apart from the
    last step's wrap-around to the epoch's first batches), and together they cover the epoch."""
    rng = np.random.default_rng(1)
    lengths = rng.integers(3, 60, 5000)
    epoch = corpus.TokenBatchSampler(lengths, lengths, 600, seed=5).epoch(2)
    plan = corpus.StepPlan(epoch, num_processes=2, accumulation_steps=3)
    assert len(plan) == -(-len(epoch) // 6)
    shares = {0: [], 1: []}
    for i in range(len(plan) - 1):
        for rank in (0, 1):
            shares[rank] += [x for b in plan[i][rank * 3 : (rank + 1) * 3] for x in b.tolist()]
    assert not set(shares[0]) & set(shares[1])
    last = [x for b in plan[len(plan) - 1] for x in b.tolist()]
    assert sorted(set(shares[0]) | set(shares[1]) | set(last)) == list(range(5000))
    assert corpus.plan_epoch(epoch, 2, 3)[4][1].tolist() == plan[4][1].tolist()


# ------------------------------------------------------------------------------------------------ streaming
def test_streaming_4_5M_pairs_exact_positions(tok, tmp_path):
    """A synthetic corpus of 4.5M distinct pairs streamed in buffers of 50k rows: the first steps need only the
    first buffer; a position deep in the stream (what a checkpoint stores) resumes with exactly the steps the
    uninterrupted stream gives from there, reading the rows the files hold at those lines; the epoch ends after the
    last row. (The benchmark, benchmarks/scale.py, times training on the WMT-like 4.5M corpus.)"""
    import time

    n = 4_500_000
    for lang, word in (("en", "dog"), ("de", "Hund")):
        with open(tmp_path / f"big.{lang}", "w", encoding="utf-8") as f:
            for start in range(0, n, 500_000):
                f.write("".join(f"{word} {i % 1009} {i // 1009}\n" for i in range(start, start + 500_000)))
    source = data_pipeline.SplitSource.from_dir(tmp_path, "big", ["en", "de"])

    def stream():
        return data_pipeline.StreamingPairs(
            source,
            ["en", "de"],
            [("en", "de")],
            tok,
            max_length=64,
            buffer_rows=50_000,
            max_tokens=4000,
            seed=3,
            num_processes=2,
        )

    t0 = time.time()
    first = stream().steps()
    steps = [next(first) for _ in range(3)]
    assert time.time() - t0 < 120
    assert all(
        p.location.endswith(f"big.en:{int(p.location.rsplit(':', 1)[1])}") for s, _ in steps for b in s for p in b
    )
    assert max(int(p.location.rsplit(":", 1)[1]) for s, _ in steps for b in s for p in b) <= 50_000
    assert [pos for _, pos in steps] == [{"epoch": 0, "buffer": 0, "row": 0, "step": k} for k in (1, 2, 3)]
    # resuming after step 2 gives step 3 again
    again = next(stream().steps(steps[1][1]))
    assert [[vars(p) for p in b] for b in again[0]] == [[vars(p) for p in b] for b in steps[2][0]]
    # deep in the stream: buffer 88 (rows 4,400,000-4,449,999), after its step 4
    deep = {"epoch": 0, "buffer": 88, "row": 4_400_000, "step": 4}
    fresh = stream().steps({**deep, "step": 0})
    reference = [next(fresh) for _ in range(6)]
    resumed = stream().steps(deep)
    got = next(resumed)
    assert [[vars(p) for p in b] for b in got[0]] == [[vars(p) for p in b] for b in reference[4][0]]
    assert got[1] == reference[4][1] == {**deep, "step": 5}
    for batch in got[0]:
        for p in batch:
            i = int(p.location.rsplit(":", 1)[1]) - 1
            assert 4_400_000 <= i < 4_450_000
            assert (p.src, p.tgt, p.tgt_location) == (
                f"dog {i % 1009} {i // 1009}",
                f"Hund {i % 1009} {i // 1009}",
                f"{tmp_path / 'big.de'}:{i + 1}",
            )
    # the last buffer ends the epoch, and the position before it is the next buffer's start
    tail = stream()
    last = list(tail.steps({"epoch": 0, "buffer": 89, "row": 4_450_000, "step": 0}))
    assert last[-1][1] == {"epoch": 0, "buffer": 90, "row": n, "step": 0}
    assert tail.rows_per_epoch == n
    seen = sorted(int(p.location.rsplit(":", 1)[1]) for s, _ in last for b in s for p in b)
    assert set(seen) == set(range(4_450_001, n + 1))  # every pair of the buffer (some twice: the wrap-around)


def test_streaming_counts_bad_pairs_once_and_stops_on_error(bad_dir, tok):
    """Bad pairs of a stream are counted while the first epoch is read (as the cached pipeline counts them), not
    again in later epochs, and the count survives a resume (state_dict); --on_bad_pairs error names the line."""
    source = data_pipeline.SplitSource.from_dir(bad_dir, "t", ["en", "de"])
    _, _, cached = pipeline(source, tok, [("en", "de")], bad_dir / "cache", max_length=40)
    stream = data_pipeline.StreamingPairs(
        source, ["en", "de"], [("en", "de")], tok, max_length=40, buffer_rows=25, max_tokens=400
    )
    first = list(stream.steps())
    assert dict(stream.report.counts) == dict(cached.report.counts) and stream.rows_per_epoch == 60
    assert stream.report.locations == cached.report.locations and stream.kept_pairs == len(cached)
    list(stream.steps({"epoch": 1, "buffer": 0, "row": 0, "step": 0}))
    assert dict(stream.report.counts) == dict(cached.report.counts)
    # resumed mid-epoch 0 from a checkpoint's state: the count goes on from there
    partial = data_pipeline.StreamingPairs(
        source, ["en", "de"], [("en", "de")], tok, max_length=40, buffer_rows=25, max_tokens=400
    )
    it = partial.steps()
    next(it)
    position, state = next(it)[1], partial.state_dict()
    resumed = data_pipeline.StreamingPairs(
        source, ["en", "de"], [("en", "de")], tok, max_length=40, buffer_rows=25, max_tokens=400
    )
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = list(resumed.steps(position))
    assert dict(resumed.report.counts) == dict(cached.report.counts)
    assert [[vars(p) for p in b] for s, _ in rest for b in s] == [
        [vars(p) for p in b] for s, _ in first[2:] for b in s
    ]
    failing = data_pipeline.StreamingPairs(
        source, ["en", "de"], [("en", "de")], tok, max_length=40, buffer_rows=25, max_tokens=400, on_bad_pairs="error"
    )
    with pytest.raises(DataError, match=r"t\.en:4: empty source \(en-de\)\."):
        list(failing.steps())


def mapped_resident_kb(path) -> int:
    """Resident kB of this process's mappings of `path` (/proc/self/smaps)."""
    total, current = 0, None
    for line in open("/proc/self/smaps"):
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" in fields[3]:
            current = fields[5] if len(fields) > 5 else None
        elif fields[0] == "Rss:" and current == str(path):
            total += int(fields[1])
    return total


def test_rows_file_mapped_without_resident_headers_equals_from_file(tmp_path, monkeypatch):
    """`map_arrow_file` (the rows' Arrow file mapped, the pages read while opening it released as it goes: none
    stays resident, where from_file leaves the whole small file resident) gives the dataset
    `Dataset.from_file` gives: the same features, rows, random reads and pickling (by path, as worker processes
    receive it); load_rows returns it, fresh and cached."""
    import pickle

    import datasets

    monkeypatch.setattr(sources, "WRITE_BATCH_ROWS", 7)  # many record batches
    monkeypatch.setattr(cache_store, "RELEASE_EVERY_BYTES", 4096)  # released page by page while parsing
    write(tmp_path / "t.en", head(MULTI30K / "train.en.gz", 300))
    write(tmp_path / "t.de", head(MULTI30K / "train.de.gz", 300))
    source = data_pipeline.SplitSource.from_dir(tmp_path, "t", ["en", "de"])
    built = data_pipeline.load_rows(source, ["en", "de"], cache_dir=tmp_path / "cache")
    cached = data_pipeline.load_rows(source, ["en", "de"], cache_dir=tmp_path / "cache")
    fresh = data_pipeline.map_arrow_file(built.path)
    released = mapped_resident_kb(built.path)  # three maps of the file: built, cached and fresh
    reference = datasets.Dataset.from_file(built.path)
    size_kb = Path(built.path).stat().st_size // 1024
    assert released == 0 and mapped_resident_kb(built.path) >= size_kb // 2  # from_file's headers stay resident
    assert fresh[:] == reference[:]
    for rows in (built, cached):
        ds = rows.dataset
        assert ds.features == reference.features and len(ds) == len(reference) == 300
        assert ds.cache_files == reference.cache_files
        assert ds[:] == reference[:]
        picks = [299, 0, 150, 7, 8, 151]
        assert ds.select_columns(["text.de"])[picks] == reference.select_columns(["text.de"])[picks]
        assert pickle.loads(pickle.dumps(ds))[:] == reference[:]
        assert ds[3]["text.en"] == head(MULTI30K / "train.en.gz", 4)[3]
    data_pipeline.release_mapped_pages(fresh)  # fresh[:] above read the whole file through it
    before = mapped_resident_kb(built.path)
    assert fresh.select_columns(["text.en"])[[5, 280]] == {
        "text.en": [head(MULTI30K / "train.en.gz", 281)[i] for i in (5, 280)]
    }
    assert mapped_resident_kb(built.path) > before  # the random reads mapped pages of fresh's map...
    data_pipeline.release_mapped_pages(fresh)
    assert mapped_resident_kb(built.path) == before  # ...released, and the data is still read from the file
    assert fresh[[5]]["text.de"] == [head(MULTI30K / "train.de.gz", 6)[5]]


def test_rows_file_has_a_record_batch_per_block(tmp_path, monkeypatch):
    """The rows' Arrow file holds one record batch per block of WRITE_BATCH_ROWS rows (not datasets' default of
    1000-row batches, whose per-batch objects cost every process ~100 MB of heap at 40M rows)."""
    monkeypatch.setattr(sources, "WRITE_BATCH_ROWS", 2500)
    write(tmp_path / "t.en", head(MULTI30K / "train.en.gz", 2600))
    write(tmp_path / "t.de", head(MULTI30K / "train.de.gz", 2600))
    source = data_pipeline.SplitSource.from_dir(tmp_path, "t", ["en", "de"])
    rows = data_pipeline.load_rows(source, ["en", "de"], cache_dir=tmp_path / "cache")
    assert [len(b) for b in rows.dataset.data.to_batches()] == [2500, 100]
    assert rows.dataset[2550]["text.de"] == head(MULTI30K / "train.de.gz", 2551)[2550]


def test_shared_epochs_one_copy_for_every_process(tmp_path):
    """SharedEpochs: a waiting non-main process gets the batches the main process computed (equal to the plain
    sampler's, for epochs 0 and 3) from memory-mapped files, without building the lengths array itself; another
    seed or max_tokens names other files; forget_before removes earlier epochs; a missing main process times out."""
    import threading

    rng = np.random.default_rng(4)
    src, tgt = rng.integers(1, 60, 3000).astype(np.int32), rng.integers(1, 60, 3000).astype(np.int32)

    def sampler(**kw):
        return corpus.TokenBatchSampler(src, tgt, kw.pop("max_tokens", 400), seed=kw.pop("seed", 2), **kw)

    reference = sampler()
    main = corpus.SharedEpochs(sampler(), tmp_path, is_main=True)
    other = corpus.SharedEpochs(sampler(), tmp_path, is_main=False, timeout=60)
    got = {}
    waiting = threading.Thread(target=lambda: got.update(e3=other.epoch(3)))
    waiting.start()  # waits for the main process's files
    for epoch in (0, 3):
        assert main.epoch(epoch).tolist() == reference.epoch(epoch).tolist()
    waiting.join()
    assert got["e3"].tolist() == reference.epoch(3).tolist()
    assert isinstance(got["e3"].order, np.memmap) and other.sampler._lengths is None
    assert other.epoch(0).tolist() == reference.epoch(0).tolist()
    assert len(main) == len(reference)
    # another node's main process on the same (shared) folder: finds the files, writes nothing
    second = corpus.SharedEpochs(sampler(), tmp_path, is_main=True)
    assert second.epoch(3).tolist() == reference.epoch(3).tolist() and second.sampler._lengths is None
    assert sampler(seed=3).key() != main._key != sampler(max_tokens=500).key()
    assert sampler().key() == main._key
    main.forget_before(3)
    assert sorted(p.name.rsplit("-", 1)[1] for p in tmp_path.iterdir()) == ["epoch3"]
    lonely = corpus.SharedEpochs(sampler(seed=9), tmp_path, is_main=False, timeout=0.2)
    with pytest.raises(TimeoutError, match="main process computes"):
        lonely.epoch(0)
