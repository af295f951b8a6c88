"""Several training corpora with weights and source-side tags (hf_variants/training/corpora.py): examples are drawn
by weight (exact shares per epoch, within tolerance over part of one), a downsampled corpus is covered over the
epochs and an upsampled one repeats only after a full pass; the tag is a special token that reaches the source ids;
the cache is keyed by the whole spec; the card lists every corpus; a resumed run is exact; the flags and the spec
file are checked when parsed."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, head, tiny_args, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.training import corpora, corpus, train  # noqa: E402
from hf_variants.training.trainer import Trainer  # noqa: E402


class LengthsOnly(SimpleNamespace):
    """A corpus's pair set with lengths only (what the sampler reads)."""

    def __len__(self):
        return len(self.src_len)


def fake_set(sizes, weights, seed=0) -> corpora.MixedPairSet:
    rng = np.random.default_rng(seed)
    parts = []
    for n in sizes:
        lengths = rng.integers(3, 30, size=n)
        parts.append(
            LengthsOnly(
                src_len=lengths,
                tgt_len=lengths + 1,
                report=corpus.DropReport("train"),
                pairs_per_direction={},
                fingerprint=str(n),
            )
        )
    return corpora.MixedPairSet(parts, [{"name": f"c{i}", "weight": w, "tag": ""} for i, w in enumerate(weights)])


def test_weighted_draw_shares_coverage_and_determinism():
    mixed = fake_set([3000, 600], [1, 0.5])
    assert mixed.examples_per_epoch().tolist() == [2400, 1200]  # 2/3 and 1/3 of the 3,600 examples
    sampler = corpora.WeightedCorpusSampler(mixed, max_tokens=400, seed=3)
    seen = [[], []]
    for epoch in range(5):
        batches = sampler.epoch(epoch)
        flat = np.concatenate([np.asarray(b) for b in batches])
        which = mixed.corpus_of(flat)
        assert np.bincount(which).tolist() == [2400, 1200]  # exact shares in every epoch
        first = mixed.corpus_of(np.concatenate([np.asarray(b) for b in batches[: len(batches) // 5]]))
        assert abs(np.mean(first == 0) - 2 / 3) < 0.06  # and within tolerance over a fifth of the epoch's batches
        for c in (0, 1):
            seen[c].append(flat[which == c] - mixed.offsets[c])
    # corpus 0 (3,000 pairs, 2,400 a epoch) is downsampled: no pair twice before all 3,000 were drawn
    assert len(np.unique(seen[0][0])) == 2400 and len(np.unique(np.concatenate(seen[0][:2]))) == 3000
    assert np.bincount(np.concatenate(seen[0])).tolist() == [4] * 3000  # 5 epochs of 2,400: 4 full passes
    # corpus 1 (600 pairs, 1,200 a epoch) is upsampled: every pair exactly twice per epoch
    assert all(np.bincount(s, minlength=600).tolist() == [2] * 600 for s in seen[1])
    again = corpora.WeightedCorpusSampler(mixed, max_tokens=400, seed=3)  # a resumed run draws the same
    assert again.epoch(3).tolist() == sampler.epoch(3).tolist()
    assert corpora.WeightedCorpusSampler(mixed, max_tokens=400, seed=4).epoch(3).tolist() != again.epoch(3).tolist()
    other = corpora.WeightedCorpusSampler(fake_set([3000, 600], [1, 1]), max_tokens=400, seed=3)
    assert other.key() != sampler.key()  # the epochs' batches are keyed by the weights too


def test_several_processes_share_the_weighted_epochs(tmp_path):
    """With several processes the main one computes each epoch's draw and batches once (`corpus.SharedEpochs`);
    another process maps the same batches from the files."""
    mixed = fake_set([500, 200], [2, 1])
    main = corpus.SharedEpochs(corpora.WeightedCorpusSampler(mixed, max_tokens=300, seed=5), tmp_path, True)
    other = corpus.SharedEpochs(corpora.WeightedCorpusSampler(mixed, max_tokens=300, seed=5), tmp_path, False)
    alone = corpora.WeightedCorpusSampler(mixed, max_tokens=300, seed=5)
    for epoch in (0, 1):
        assert main.epoch(epoch).tolist() == other.epoch(epoch).tolist() == alone.epoch(epoch).tolist()


@pytest.fixture(scope="module")
def two_corpora(data_dir, tmp_path_factory):
    """clean.tsv (the first 200 training pairs) and bt.tsv (the other 100), and a validation TSV."""
    folder = tmp_path_factory.mktemp("corpora")
    en, de = (head(data_dir / f"train.{lang}.gz", 300) for lang in ("en", "de"))
    for name, rows in (("clean", range(200)), ("bt", range(200, 300))):
        (folder / f"{name}.tsv").write_text("en\tde\n" + "".join(f"{en[i]}\t{de[i]}\n" for i in rows))
    ven, vde = (head(data_dir / f"val.{lang}.gz", 16) for lang in ("en", "de"))
    (folder / "valid.tsv").write_text("en\tde\n" + "".join(f"{a}\t{b}\n" for a, b in zip(ven, vde)))
    return folder


def corpus_args(folder, tokenizer_dir, out, *extra, steps=8, tags=("", "<BT>"), weights=("1", "0.5")):
    files = ["--train_file", str(folder / "clean.tsv"), "--train_file", str(folder / "bt.tsv")]
    mixing = ["--corpus_weights", *weights, "--corpus_tags", *tags]
    args = tiny_args(folder, out, *extra, tokenizer=tokenizer_dir, steps=steps)
    args[args.index("--data_dir") : args.index("--data_dir") + 2] = files + mixing
    return args + ["--valid_file", str(folder / "valid.tsv"), "--eval_bleu_pairs", "0", "--max_test_pairs", "4"]


def test_tags_reach_the_source_ids_and_the_cache_follows_the_spec(two_corpora, tokenizer_dir, tmp_path):
    args = train.parse_args(corpus_args(two_corpora, tokenizer_dir, tmp_path / "a"))
    run = train.setup_run(args)
    data = train.load_data(run)
    mixed, tokenizer = data.train_set, data.tokenizer
    assert isinstance(mixed, corpora.MixedPairSet) and mixed.sizes.tolist() == [200, 100]
    tag_id = tokenizer.convert_tokens_to_ids("<BT>")
    assert "<BT>" in tokenizer.all_special_tokens and tag_id == len(tokenizer) - 1
    assert (run.run_dir / "tokenizer" / "tokenizer.json").read_text().count('"<BT>"') >= 1  # saved with the run
    trainer = Trainer(run, data, train.build_job(run, data))
    steps = 0
    for step_batches, _ in trainer.epoch_steps():
        for indices, batch in zip(step_batches, trainer.micro_batches(step_batches)):
            which = mixed.corpus_of(indices)
            ids = batch["input_ids"]
            assert (ids[torch.as_tensor(which == 1), 0] == tag_id).all()  # every bt source starts with the tag
            assert not (ids[torch.as_tensor(which == 0)] == tag_id).any()  # no clean source has it
            assert not (batch["labels"] == tag_id).any()  # nor any target
        steps += 1
        if steps == 3:
            break
    pair = mixed.pairs([250])[0]
    assert pair.src.startswith("<BT> ") and tokenizer(pair.src).input_ids[0] == tag_id
    assert tokenizer.decode(tokenizer(pair.src).input_ids, skip_special_tokens=True) == pair.src[len("<BT> ") :]
    # another tag, or no tags: other tokenizer, other pair caches, another fingerprint of the mix
    for name, tags in (("other_tag", ("", "<bt2>")), ("untagged", ("", ""))):
        args = train.parse_args(corpus_args(two_corpora, tokenizer_dir, tmp_path / name, tags=tags))
        other = train.load_data(train.setup_run(args)).train_set
        assert other.fingerprint != mixed.fingerprint and other.parts[1].fingerprint != mixed.parts[1].fingerprint
    # the pairs stage counts the tag in the source length (one token), and nothing else changes
    assert np.array_equal(np.asarray(mixed.parts[1].src_len), np.asarray(other.parts[1].src_len) + 1)
    assert np.array_equal(np.asarray(mixed.parts[0].src_len), np.asarray(other.parts[0].src_len))
    reweighted = train.load_data(
        train.setup_run(train.parse_args(corpus_args(two_corpora, tokenizer_dir, tmp_path / "w", weights=("1", "2"))))
    )
    assert reweighted.train_set.fingerprint != mixed.fingerprint
    assert reweighted.sampler.key() != data.sampler.key()


def test_run_card_and_exact_resume(two_corpora, tokenizer_dir, tmp_path):
    results = train.main(corpus_args(two_corpora, tokenizer_dir, tmp_path / "run", "--dropout", "0.1"))
    assert results["dataset"] == "clean.tsv + bt.tsv" and results["train_pairs"] == 300
    assert [(c["name"], c["weight"], c["tag"], c["pairs"], c["examples_per_epoch"]) for c in results["corpora"]] == [
        ("clean.tsv", 1.0, None, 200, 200),
        ("bt.tsv", 0.5, "<BT>", 100, 100),
    ]
    card = (tmp_path / "run" / "model" / "README.md").read_text()
    assert "| clean.tsv | `clean.tsv` | 200 | 1 | 66.7 % | none |" in card
    assert "| bt.tsv | `bt.tsv` | 100 | 0.5 | 33.3 % | `<BT>` |" in card
    half = corpus_args(two_corpora, tokenizer_dir, tmp_path / "resumed", "--dropout", "0.1", steps=4)
    train.main(half)
    train.main(
        corpus_args(
            two_corpora, tokenizer_dir, tmp_path / "resumed", "--dropout", "0.1", "--resume_from_checkpoint", "latest"
        )
    )
    a, b = (load_file(str(tmp_path / run / "model" / "model.safetensors")) for run in ("run", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a corpus whose content changed at the same path is refused on a resume, named
    bt = two_corpora / "bt.tsv"
    saved = bt.read_text()
    bt.write_text(saved.replace("\t", "\t ", 1))
    try:
        with pytest.raises(train.settings.SettingsChangedError, match=r"train bt\.tsv \(.*bt\.tsv\): "):
            train.main(
                corpus_args(
                    two_corpora,
                    tokenizer_dir,
                    tmp_path / "resumed",
                    "--dropout",
                    "0.1",
                    "--resume_from_checkpoint",
                    "latest",
                    steps=10,
                )
            )
    finally:
        bt.write_text(saved)
    # the weights and tags are settings of the run: a resume with others is refused, naming them
    with pytest.raises(train.settings.SettingsChangedError, match="--corpora: "):
        train.main(
            corpus_args(
                two_corpora,
                tokenizer_dir,
                tmp_path / "resumed",
                "--dropout",
                "0.1",
                "--resume_from_checkpoint",
                "latest",
                weights=("1", "1"),
                steps=10,
            )
        )


def test_spec_file_with_text_files_and_a_dataset(two_corpora, data_dir, tokenizer_dir, tmp_path):
    import datasets

    en, de = (head(data_dir / f"train.{lang}.gz", 40) for lang in ("en", "de"))
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"english": en, "german": de})}).save_to_disk(
        str(tmp_path / "flat")
    )
    spec = {
        "corpora": [
            {"name": "text", "data_dir": str(data_dir), "prefix": "train", "weight": 2},
            {
                "dataset_name": str(tmp_path / "flat"),
                "source_column": "english",
                "target_column": "german",
                "tag": "<DS>",
            },
        ]
    }
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    args = tiny_args(data_dir, tmp_path / "run", tokenizer=tokenizer_dir, steps=2)
    args[args.index("--data_dir") : args.index("--data_dir") + 2] = ["--corpus_spec", str(tmp_path / "spec.json")]
    args += ["--valid_file", str(two_corpora / "valid.tsv"), "--eval_bleu_pairs", "0", "--max_test_pairs", "4"]
    parsed = train.parse_args(args)
    assert [c["name"] for c in parsed.corpora] == ["text", f"{tmp_path / 'flat'}[train]"]
    assert [c["weight"] for c in parsed.corpora] == [2.0, 1.0] and parsed.train_file is None
    data = train.load_data(train.setup_run(parsed))
    assert data.train_set.sizes.tolist() == [300, 40]
    assert data.train_set.pairs([300])[0].src == "<DS> " + en[0].strip()


@pytest.mark.parametrize(
    "argv, spec, message",
    [
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--corpus_weights", "1"],
            None,
            "--corpus_weights: 1 value(s) for 2 --train_file(s)",
        ),
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--corpus_weights", "1", "0"],
            None,
            "--corpus_weights: a weight must be a positive number, got 0.0",
        ),
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--corpus_tags", "", "<2de>"],
            None,
            "tag '<2de>' is a special token",
        ),
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--corpus_tags", "", "two words"],
            None,
            "must be one token",
        ),
        (["--corpus_tags", "<BT>"], None, "--corpus_tags gives each --train_file"),
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--streaming", "--max_steps", "5"],
            None,
            "--streaming reads one training corpus",
        ),
        (
            ["--train_file", "a.tsv", "--train_file", "b.tsv", "--corpus_tags", "<BT>", "", "--bidirectional"],
            None,
            "--corpus_tags mark the source side",
        ),
        (
            ["--train_file", "a.tsv", "--corpus_tags", "<BT>", "--source_annotations", "parses"],
            None,
            "--corpus_tags change the source sentences",
        ),
        (["--train_file", "a.tsv"], {"corpora": [{"train_file": "x.tsv"}]}, "--corpus_spec lists the training"),
        ([], {"corpora": [{"train_file": "x.tsv", "wieght": 2}]}, "corpus 1: unknown key(s) wieght"),
        ([], {"corpora": [{"train_file": "x.tsv", "data_dir": "d"}]}, "corpus 1: name exactly one of"),
        ([], {"corpora": []}, 'expected {"corpora": [{"train_file": ...}, ...]}'),
        ([], "{not json", "not valid JSON"),
    ],
)
def test_flags_and_spec_are_checked_when_parsed(argv, spec, message, tmp_path, capsys):
    if spec is not None:
        (tmp_path / "spec.json").write_text(spec if isinstance(spec, str) else json.dumps(spec))
        argv = argv + ["--corpus_spec", str(tmp_path / "spec.json")]
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--output_dir", "x", *argv])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


# ------------------------------------------------------------------------------------------ tags that could collide
TAGGED = SimpleNamespace(corpora=[{"name": "clean", "tag": ""}, {"name": "bt", "tag": "bt"}], model_name_or_path=None)


def test_a_tag_is_one_id_read_as_a_whole_word_only(tokenizer_dir):
    """A tag whose letters occur inside words ("bt" in "obtenir", "subtle") leaves those words alone: the text
    round-trips unchanged and holds no tag id; a tagged source starts with the tag's one id, dropped when decoded."""
    from transformers import AutoTokenizer

    tokenizer = corpora.with_tags(AutoTokenizer.from_pretrained(tokenizer_dir), TAGGED)
    tag_id = tokenizer.convert_tokens_to_ids("bt")
    assert "bt" in tokenizer.all_special_tokens and tag_id == len(tokenizer) - 1
    for text in ("Il veut obtenir un prix. A subtle man", "Obtuse abt-bt_x btbt 1bt"):
        ids = tokenizer(text).input_ids
        assert tag_id not in ids and tokenizer.decode(ids, skip_special_tokens=True) == text
        tagged = tokenizer(f"bt {text}").input_ids
        assert tagged[0] == tag_id and tagged.count(tag_id) == 1
        assert tokenizer.decode(tagged, skip_special_tokens=True) == text
    assert corpora.tag_tokens(tokenizer, "bt") == 1  # the pairs stage counts one token for it


@pytest.fixture(scope="module")
def word_corpora(two_corpora, tmp_path_factory):
    """two_corpora with one more clean pair whose words hold the letters of the tag "bt" (obtains, subtle)."""
    folder = tmp_path_factory.mktemp("word_corpora")
    for name in ("clean.tsv", "bt.tsv", "valid.tsv"):
        (folder / name).write_text((two_corpora / name).read_text())
    with open(folder / "clean.tsv", "a") as f:
        f.write("A subtle man obtains a prize.\tEin subtiler Mann erhält einen Preis.\n")
    return folder


def test_tagged_training_data_with_the_tag_letters_inside_words(word_corpora, tokenizer_dir, tmp_path):
    args = train.parse_args(corpus_args(word_corpora, tokenizer_dir, tmp_path / "a", tags=("", "bt")))
    data = train.load_data(train.setup_run(args))
    mixed, tokenizer = data.train_set, data.tokenizer
    tag_id = tokenizer.convert_tokens_to_ids("bt")
    subtle = mixed.pairs([200])[0]  # the last clean pair
    assert subtle.src == "A subtle man obtains a prize."
    assert tag_id not in tokenizer(subtle.src).input_ids
    tagged = mixed.pairs([201])[0]  # the first bt pair
    ids = tokenizer(tagged.src).input_ids
    assert tagged.src.startswith("bt ") and ids[0] == tag_id and ids.count(tag_id) == 1


def test_a_tag_that_is_a_vocabulary_token_or_a_word_of_the_text_is_refused(
    word_corpora, tokenizer_dir, tmp_path, monkeypatch, capsys
):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    vocab, added = tokenizer.get_vocab(), set(tokenizer.added_tokens_encoder)
    word = next(t for t in ("en", "er", "es", "an", "in", "un") if t in vocab and t not in added)
    argv = corpus_args(word_corpora, tokenizer_dir, tmp_path / "vocab", tags=("", word))
    monkeypatch.setattr(sys, "argv", ["hf-variants-train", *argv])
    with pytest.raises(SystemExit) as exit_:
        train.cli()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1, err
    assert f"corpus tag {word!r} is a token of the tokenizer's vocabulary" in err
    assert not (tmp_path / "vocab").exists()  # a refused launch leaves no run folder
    # "bt" as a word of a sentence (of any corpus or split) would be read as the tag: refused, naming the line
    folder = tmp_path / "text"
    folder.mkdir()
    for name in ("clean.tsv", "bt.tsv", "valid.tsv"):
        (folder / name).write_text((word_corpora / name).read_text())
    lines = (folder / "clean.tsv").read_text().splitlines(keepends=True)
    lines[3] = "He said bt, and left.\tEr sagte bt und ging.\n"
    (folder / "clean.tsv").write_text("".join(lines))
    with pytest.raises(corpus.DataError, match=r"corpus tag 'bt' occurs as a word in .*clean\.tsv:4 \(en\)"):
        train.main(corpus_args(folder, tokenizer_dir, tmp_path / "word", tags=("", "bt")))
    (folder / "clean.tsv").write_text((word_corpora / "clean.tsv").read_text())  # and in the validation data
    lines = (folder / "valid.tsv").read_text().splitlines(keepends=True)
    lines[2] = "A man (bt) runs.\tEin Mann (bt) rennt.\n"
    (folder / "valid.tsv").write_text("".join(lines))
    with pytest.raises(corpus.DataError, match=r"'bt' occurs as a word in the valid data, .*valid\.tsv:3 \(en\)"):
        train.main(corpus_args(folder, tokenizer_dir, tmp_path / "word", tags=("", "bt")))
