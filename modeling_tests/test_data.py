"""Tests of hf_variants.training.corpus: reading parallel data, clear errors for bad data, counted skips, batching."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hf_variants.training import corpus  # noqa: E402
from hf_variants.training.corpus import DataError, DropReport  # noqa: E402

MULTI30K = ROOT / "training" / "data" / "multi30k"


def write(path: Path, lines, gz=False):
    text = "".join(line + "\n" for line in lines)
    if gz:
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def test_bundled_multi30k_is_multiway_parallel():
    for split, n in (("train", 29000), ("val", 1014), ("test_2016_flickr", 1000)):
        data = corpus.load_split_from_dir(MULTI30K, split, ["en", "de", "fr", "cs"])
        assert len(data) == n
        assert all(row["en"].strip() and row["de"].strip() for row in data.rows[:50])
    assert (MULTI30K / "README.md").is_file()


def test_text_files_plain_and_gz(tmp_path):
    write(tmp_path / "train.en", ["a b", "c d"])
    write(tmp_path / "train.de.gz", ["x y", "z w"], gz=True)
    data = corpus.load_split_from_dir(tmp_path, "train", ["en", "de"])
    assert data.rows == [{"en": "a b", "de": "x y"}, {"en": "c d", "de": "z w"}]
    assert data.locations[1].endswith("train.en:2")


def test_mismatched_line_counts_name_file_and_line(tmp_path):
    write(tmp_path / "train.en", ["a", "b", "c"])
    write(tmp_path / "train.de", ["x", "y"])
    with pytest.raises(DataError, match=r"train\.en has 3 lines.*train\.de has 2 lines.*line 3"):
        corpus.load_split_from_dir(tmp_path, "train", ["en", "de"])


def test_missing_language_file(tmp_path):
    write(tmp_path / "train.en", ["a"])
    with pytest.raises(DataError, match=r"No file for language 'fr'.*train\.en"):
        corpus.load_split_from_dir(tmp_path, "train", ["en", "fr"])


def test_invalid_utf8_names_line(tmp_path):
    (tmp_path / "bad.en").write_bytes(b"ok\nstill ok\n\xff\xfe broken\n")
    with pytest.raises(DataError, match=r"bad\.en: line 3 is not valid UTF-8"):
        corpus.read_lines(tmp_path / "bad.en")


def test_tsv(tmp_path):
    path = write(tmp_path / "d.tsv", ["en\tde", "a\tx", "b\ty"])
    data = corpus.load_corpus_file(path)
    assert data.languages == ["en", "de"] and data.rows[1] == {"en": "b", "de": "y"}
    assert data.locations[0].endswith("d.tsv:2")
    bad = write(tmp_path / "bad.tsv", ["en\tde", "a\tx", "only one field"])
    with pytest.raises(DataError, match=r"bad\.tsv:3: expected 2 tab-separated fields"):
        corpus.load_corpus_file(bad)
    unknown = write(tmp_path / "unk.tsv", ["english\tde", "a\tx"])
    with pytest.raises(DataError, match=r"'english' in .*unk\.tsv:1"):
        corpus.load_corpus_file(unknown)


def test_jsonl(tmp_path):
    rows = [{"translation": {"en": "a", "de": "x"}}, {"en": "b", "de": "y"}]
    path = write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    data = corpus.load_corpus_file(path)
    assert data.rows == [{"en": "a", "de": "x"}, {"en": "b", "de": "y"}]
    bad = write(tmp_path / "bad.jsonl", [json.dumps(rows[0]), "{not json"])
    with pytest.raises(DataError, match=r"bad\.jsonl:2: invalid JSON"):
        corpus.load_corpus_file(bad)
    unknown = write(tmp_path / "unk.jsonl", [json.dumps({"translation": {"en": "a", "German": "x"}})])
    with pytest.raises(DataError, match=r"'German' in .*unk\.jsonl:1"):
        corpus.load_corpus_file(unknown)
    wrong_type = write(tmp_path / "wt.jsonl", [json.dumps({"translation": {"en": "a", "de": 3}})])
    with pytest.raises(DataError, match=r"wt\.jsonl:1: the 'de' side is a int"):
        corpus.load_corpus_file(wrong_type)


def test_hub_dataset_code_path(tmp_path):
    """`datasets.load_dataset` with the usual {"translation": {...}} rows (a local JSON builder stands in for a Hub
    name, which cannot be reached here)."""
    rows = [{"translation": {"en": f"sentence {i}", "de": f"Satz {i}"}} for i in range(5)]
    path = write(tmp_path / "hub.jsonl", [json.dumps(r) for r in rows])
    data = corpus.load_hub_dataset("json", "train", data_files=str(path))
    assert len(data) == 5 and data.rows[3] == {"en": "sentence 3", "de": "Satz 3"}
    assert set(data.languages) == {"en", "de"} and "row 3" in data.locations[3]


def test_build_pairs_counts_bad_pairs(tmp_path):
    write(tmp_path / "t.en", ["a", "", "c", "d"])
    write(tmp_path / "t.de", ["x", "y", "   ", "w"])
    data = corpus.load_split_from_dir(tmp_path, "t", ["en", "de"])
    report = DropReport("train")
    pairs = corpus.build_pairs(data, [("en", "de")], report)
    assert [(p.src, p.tgt) for p in pairs] == [("a", "x"), ("d", "w")]
    assert dict(report.counts) == {"empty_source": 1, "empty_target": 1}
    assert report.locations["empty_source"][0].endswith("t.en:2")
    assert report.total == 2 and "empty_target: 1" in report.summary()
    with pytest.raises(DataError, match=r"t\.en:2: empty source"):
        corpus.build_pairs(data, [("en", "de")], DropReport(), on_bad_pairs="error")
    with pytest.raises(DataError, match=r"Language 'fr' is not in"):
        corpus.build_pairs(data, [("en", "fr")], DropReport())


def test_missing_side_in_jsonl_counted(tmp_path):
    path = write(
        tmp_path / "d.jsonl",
        [json.dumps({"translation": {"en": "a", "de": "x"}}), json.dumps({"translation": {"en": "b"}})],
    )
    report = DropReport()
    pairs = corpus.build_pairs(corpus.load_corpus_file(path), [("en", "de")], report)
    assert len(pairs) == 1 and dict(report.counts) == {"missing_target": 1}


def test_filter_long_pairs():
    pairs = [corpus.Pair("en", "de", "s", "t", f"f:{i}") for i in range(3)]
    report = DropReport()
    kept, src, tgt = corpus.filter_long_pairs(pairs, [3, 10, 4], [2, 3, 9], 5, report)
    assert [p.location for p in kept] == ["f:0"] and src == [3] and tgt == [2]
    assert report.counts["too_long"] == 2 and report.locations["too_long"] == ["f:1", "f:2"]
    with pytest.raises(DataError, match="f:1: pair longer than"):
        corpus.filter_long_pairs(pairs, [3, 10, 4], [2, 3, 9], 5, DropReport(), on_bad_pairs="error")


def test_parse_directions():
    assert corpus.parse_directions(None, ["en", "de", "fr"]) == [
        ("en", "de"),
        ("en", "fr"),
        ("de", "en"),
        ("de", "fr"),
        ("fr", "en"),
        ("fr", "de"),
    ]
    assert corpus.parse_directions("en-de, fr-en", ["en", "de", "fr"]) == [("en", "de"), ("fr", "en")]
    with pytest.raises(DataError, match="not in the languages"):
        corpus.parse_directions("en-cs", ["en", "de"])
    with pytest.raises(DataError, match="Unknown or invalid language code"):
        corpus.parse_directions("en-DE!", ["en", "de"])
    # `*`: every other language of the run (English-centric many-to-many)
    assert corpus.parse_directions("en-*,*-en", ["en", "de", "fr"]) == [
        ("en", "de"),
        ("en", "fr"),
        ("de", "en"),
        ("fr", "en"),
    ]
    assert corpus.parse_directions("de-*", ["en", "de", "fr"]) == [("de", "en"), ("de", "fr")]
    with pytest.raises(DataError, match="'cs', which is not in the languages"):
        corpus.parse_directions("cs-*", ["en", "de", "fr"])
    with pytest.raises(DataError, match=r"invalid language code '\*' in --directions"):
        corpus.parse_directions("*-*", ["en", "de", "fr"])


def test_token_batches_cover_epoch_within_budget():
    rng = np.random.default_rng(0)
    src = rng.integers(3, 40, 500).tolist()
    tgt = rng.integers(3, 40, 500).tolist()
    sampler = corpus.TokenBatchSampler(src, tgt, max_tokens=300, seed=7)
    b0 = sampler.batches(0)
    flat = sorted(i for b in b0 for i in b)
    assert flat == list(range(500))  # every example exactly once
    for b in b0:
        longest = max(max(src[i], tgt[i]) for i in b)
        assert len(b) * longest <= 300
        # length bucketing: examples of a batch have similar lengths
        assert longest - min(max(src[i], tgt[i]) for i in b) <= 6
    assert sampler.batches(0) == b0  # deterministic for (seed, epoch): every process agrees
    b1 = sampler.batches(1)
    assert b1 != b0 and sorted(i for b in b1 for i in b) == flat  # reshuffled per epoch
    assert len(b1) == len(b0)  # same number of batches every epoch
    assert corpus.TokenBatchSampler(src, tgt, max_tokens=300, seed=8).batches(0) != b0
    doubled = corpus.TokenBatchSampler(src, tgt, max_tokens=300, seed=7, examples_per_item=2).batches(0)
    assert all(2 * len(b) * max(max(src[i], tgt[i]) for i in b) <= 300 for b in doubled)
    capped = corpus.TokenBatchSampler(src, tgt, max_tokens=10_000, max_sentences=16).batches(0)
    assert max(len(b) for b in capped) == 16
    with pytest.raises(ValueError, match="smaller than the longest example"):
        corpus.TokenBatchSampler(src, tgt, max_tokens=20)


def test_plan_epoch_same_global_batches_for_processes_and_accumulation():
    batches = [[i] for i in range(7)]
    one_proc = corpus.plan_epoch(batches, num_processes=1, accumulation_steps=2)
    two_proc = corpus.plan_epoch(batches, num_processes=2, accumulation_steps=1)
    assert one_proc == two_proc and len(one_proc) == 4
    assert all(len(step) == 2 for step in one_proc)
    assert one_proc[-1] == [[6], [0]]  # last step wraps around so every process has a micro-batch
    rank1 = [step[1:2] for step in two_proc]
    assert rank1 == [[[1]], [[3]], [[5]], [[0]]]


# ------------------------------------------------------------------------------------ locations of bad sides
def test_target_side_problems_name_the_target_file(tmp_path):
    """An empty line 3 of t.de is reported as t.de:3 (not t.en:3), in the counted report and in the error."""
    write(tmp_path / "t.en", ["a", "b", "c", "", "e"])
    write(tmp_path / "t.de", ["x", "y", "", "w", "v"])
    data = corpus.load_split_from_dir(tmp_path, "t", ["en", "de"])
    report = DropReport()
    pairs = corpus.build_pairs(data, [("en", "de")], report)
    assert [p.src for p in pairs] == ["a", "b", "e"]
    assert report.locations["empty_target"] == [f"{tmp_path / 't.de'}:3"]
    assert report.locations["empty_source"] == [f"{tmp_path / 't.en'}:4"]
    with pytest.raises(DataError, match=r"t\.de:3: empty target \(en-de\)"):
        corpus.build_pairs(data, [("en", "de")], DropReport(), on_bad_pairs="error")
    # the reverse direction: now de is the source side, so its empty line is an empty source at t.de:3
    report = DropReport()
    corpus.build_pairs(data, [("de", "en")], report)
    assert report.locations == {"empty_source": [f"{tmp_path / 't.de'}:3"], "empty_target": [f"{tmp_path / 't.en'}:4"]}
    # too long: the side that is too long
    pairs = corpus.build_pairs(data, [("en", "de")], DropReport())
    report = DropReport()
    corpus.filter_long_pairs(pairs, [1, 9, 1], [1, 1, 9], 5, report)
    assert report.locations["too_long"] == [f"{tmp_path / 't.en'}:2", f"{tmp_path / 't.de'}:5"]
    with pytest.raises(DataError, match=r"t\.de:5: pair longer than --max_length 5 tokens \(source 1, target 9\)"):
        corpus.filter_long_pairs(pairs[2:], [1], [9], 5, DropReport(), on_bad_pairs="error")
    # the first rows of a split keep the per-language files
    report = DropReport()
    corpus.build_pairs(data.head(3), [("en", "de")], report)
    assert report.locations == {"empty_target": [f"{tmp_path / 't.de'}:3"]}


# ---------------------------------------------------------------------------------------- parse annotations
def parse_of(words, top="S"):
    return f"(ROOT ({top} " + " ".join(f"(NN {w})" for w in words) + "))"


def test_parses_are_checked_at_load_time(tmp_path):
    """Source parses for the syntactic MG-SA are checked against their sentences when the data loads: a parse
    whose leaves do not spell the sentence, or with unbalanced brackets, is skipped and counted under the parse
    file's line, or stops the run naming it (before: a crash when its batch was built, up to an epoch later)."""
    en = ["A dog runs .", "Two cats (sleep) .", "A man sings .", "Kids play .", "Rain falls ."]
    write(tmp_path / "t.en", en)
    write(
        tmp_path / "t.de",
        ["Ein Hund rennt .", "Zwei Katzen schlafen .", "Ein Mann singt .", "Kinder spielen .", "Regen fällt ."],
    )
    parses = [parse_of(s.split()) for s in en]
    parses[1] = parse_of(["Two", "cats", "-LRB-", "sleep", "-RRB-", "."])  # escaped brackets: valid
    parses[2] = parse_of(["A", "woman", "sings", "."])  # leaves differ from the sentence
    parses[3] = parse_of(["Kids", "play", "."])[:-1]  # unbalanced: one ')' missing
    parses[4] = parse_of(["Rain", "falls"])  # a leaf missing at the end
    write(tmp_path / "t.en.parses", parses)
    data = corpus.load_split_from_dir(tmp_path, "t", ["en", "de"], annotations=["parses"])
    report = DropReport()
    pairs = corpus.build_pairs(data, [("en", "de")], report, annotations=["parses"])
    assert [p.src for p in pairs] == en[:2]
    assert pairs[1].src_extra == {"parses": parses[1]}
    parse_file = tmp_path / "t.en.parses"
    assert dict(report.counts) == {"parse_mismatch": 2, "malformed_parse": 1}
    assert report.locations == {
        "parse_mismatch": [f"{parse_file}:3", f"{parse_file}:5"],
        "malformed_parse": [f"{parse_file}:4"],
    }
    with pytest.raises(DataError, match=r"t\.en\.parses:3: parse mismatch \(en-de\): .*leaf 1 'woman'"):
        corpus.build_pairs(data, [("en", "de")], DropReport(), on_bad_pairs="error", annotations=["parses"])
    write(tmp_path / "u.en", en[:2] + en[3:4])
    write(tmp_path / "u.de", ["x", "y", "z"])
    write(tmp_path / "u.en.parses", parses[:2] + parses[3:4])
    unbalanced = corpus.load_split_from_dir(tmp_path, "u", ["en", "de"], annotations=["parses"])
    with pytest.raises(DataError, match=r"u\.en\.parses:3: malformed parse \(en-de\): Unbalanced '\('"):
        corpus.build_pairs(unbalanced, [("en", "de")], DropReport(), on_bad_pairs="error", annotations=["parses"])
    # what passes the check is what the model accepts when it builds a batch
    from hf_variants.phrases import PTB_TAG_LABELS, syntactic_phrase_inputs

    for pair in pairs:
        text = pair.src
        syntactic_phrase_inputs([text], [pair.src_extra["parses"]], [[(0, len(text))]], [[0]], 2, PTB_TAG_LABELS)


def test_target_parses_checked_for_bidirectional_training(tmp_path):
    """With target annotations (bidirectional training translates the targets back), a bad target-side parse is
    counted under its own file."""
    write(tmp_path / "t.en", ["a b", "c d"])
    write(tmp_path / "t.de", ["x y", "z w"])
    write(tmp_path / "t.en.parses", [parse_of(["a", "b"]), parse_of(["c", "d"])])
    write(tmp_path / "t.de.parses", [parse_of(["x", "y"]), parse_of(["z", "q"])])
    data = corpus.load_split_from_dir(tmp_path, "t", ["en", "de"], annotations=["parses"])
    report = DropReport()
    pairs = corpus.build_pairs(data, [("en", "de")], report, annotations=["parses"], target_annotations=True)
    assert len(pairs) == 1 and report.locations == {"parse_mismatch": [f"{tmp_path / 't.de.parses'}:2"]}
    # JSONL rows: the location is the row's line
    rows = [
        {"translation": {"en": "a b", "de": "x y"}, "parses": {"en": parse_of(["a", "b"])}},
        {"translation": {"en": "c d", "de": "z w"}, "parses": {"en": "(S (NN c) (NN d)"}},
        {"translation": {"en": "e f", "de": "v u"}, "parses": {"en": 7}},
    ]
    path = write(tmp_path / "d.jsonl", [json.dumps(r) for r in rows])
    report = DropReport()
    pairs = corpus.build_pairs(
        corpus.load_corpus_file(path, ["parses"]), [("en", "de")], report, annotations=["parses"]
    )
    assert len(pairs) == 1
    assert report.locations == {"malformed_parse": [f"{path}:2", f"{path}:3"]}


# --------------------------------------------------------------------------------------- dataset split names
def test_resolve_split_names():
    assert corpus.resolve_split(["train", "validation", "test"], None, "valid") == "validation"
    assert corpus.resolve_split(["train", "valid"], None, "valid") == "valid"
    assert corpus.resolve_split(["train", "dev"], None, "valid") == "dev"
    assert corpus.resolve_split(["train", "valid"], None, "test") is None
    assert corpus.resolve_split(["train", "valid", "newstest2014"], "newstest2014", "test") == "newstest2014"
    with pytest.raises(DataError, match=r"no split 'validation' \(its splits: train, valid\)"):
        corpus.resolve_split(["train", "valid"], "validation", "valid", "my/ds")
    with pytest.raises(DataError, match=r"no 'train' split.*--train_split"):
        corpus.resolve_split(["training", "valid"], None, "train", "my/ds")
