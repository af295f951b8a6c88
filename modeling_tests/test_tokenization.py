"""Tests of hf_variants.tokenization: the shared subword tokenizer trained on real Multi30k sentences."""

import gzip
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from transformers import AutoTokenizer  # noqa: E402

from hf_variants.tokenization import language_tag, read_lines, train_tokenizer  # noqa: E402

DATA = ROOT / "training" / "data" / "multi30k"
N = 400


def _head(path, n=N):
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for _, line in zip(range(n), f)]


@pytest.fixture(scope="module")
def sentences():
    return {lang: _head(DATA / f"train.{lang}.gz") for lang in ("en", "de")}


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def tok(request, sentences):
    return train_tokenizer(
        [sentences["en"], sentences["de"]], vocab_size=1000, model=request.param, languages=["en", "de"]
    )


def test_language_tag():
    assert language_tag("de") == "<2de>"
    with pytest.raises(ValueError):
        language_tag("d e")
    with pytest.raises(ValueError):
        language_tag("")


def test_special_token_ids(tok):
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert tok.convert_tokens_to_ids(["<pad>", "<s>", "</s>", "<unk>"]) == [0, 1, 2, 3]
    assert tok.convert_tokens_to_ids(["<2en>", "<2de>"]) == [4, 5]
    assert {"<2en>", "<2de>"} <= set(tok.all_special_tokens)
    assert len(tok) <= 1000


def test_roundtrip_decode(tok, sentences):
    texts = sentences["en"][:200] + sentences["de"][:200]
    for text in texts:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text
    # also text never seen in training (still Latin script): spacing and punctuation survive
    unseen = 'Zwei Hunde spielen, während ein Mann (42) "Hallo!" ruft.'
    assert tok.decode(tok(unseen)["input_ids"], skip_special_tokens=True) == unseen


def test_encoder_inputs_end_with_eos_without_bos(tok, sentences):
    ids = tok(sentences["en"][0])["input_ids"]
    assert ids[-1] == tok.eos_token_id
    assert tok.bos_token_id not in ids
    assert ids.count(tok.eos_token_id) == 1


def test_language_tags_single_tokens_and_skipped(tok, sentences):
    text = sentences["en"][1]
    plain = tok(text)["input_ids"]
    tagged = tok(f"{language_tag('de')} {text}")["input_ids"]
    assert tagged[0] == tok.convert_tokens_to_ids("<2de>")
    assert tagged[1:] == plain  # one token, and the rest is tokenized exactly as without the tag
    assert tok.decode(tagged, skip_special_tokens=True) == text
    assert "<2de>" in tok.decode(tagged, skip_special_tokens=False)


def test_text_target_labels(tok, sentences):
    enc = tok(sentences["en"][:3], text_target=sentences["de"][:3])
    assert set(enc) >= {"input_ids", "attention_mask", "labels"}
    for src, labels, de in zip(enc["input_ids"], enc["labels"], sentences["de"][:3]):
        assert labels[-1] == tok.eos_token_id and src[-1] == tok.eos_token_id
        assert tok.bos_token_id not in labels
        assert labels == tok(de)["input_ids"]
        assert tok.decode(labels, skip_special_tokens=True) == de


def test_batch_padding_uses_pad_id(tok, sentences):
    enc = tok(sentences["en"][:4], padding=True, return_tensors="pt")
    lengths = enc["attention_mask"].sum(1)
    assert (enc["input_ids"][enc["attention_mask"] == 0] == 0).all()
    assert lengths.max() == enc["input_ids"].shape[1] and lengths.min() < lengths.max()


def test_reload_through_autotokenizer(tok, sentences, tmp_path):
    tok.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").is_file()
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    texts, targets = sentences["en"][:20], sentences["de"][:20]
    assert reloaded(texts, text_target=targets) == tok(texts, text_target=targets)
    tagged = f"<2en> {targets[0]}"
    assert reloaded(tagged)["input_ids"] == tok(tagged)["input_ids"]
    assert reloaded.convert_tokens_to_ids("<2de>") == 5
    assert reloaded.decode(reloaded(tagged)["input_ids"], skip_special_tokens=True) == targets[0]


def test_inputs_files_gz_and_plain(tmp_path, sentences):
    plain = tmp_path / "a.txt"
    plain.write_text("\n".join(sentences["en"]) + "\n", encoding="utf-8")
    gz = DATA / "train.de.gz"
    assert list(read_lines(plain)) == sentences["en"]
    t_files = train_tokenizer([str(plain), gz], vocab_size=600, output_dir=tmp_path / "tok")
    assert (tmp_path / "tok" / "tokenizer.json").is_file()
    assert len(t_files) == 600
    t_texts = train_tokenizer(sentences["en"] + list(read_lines(gz)), vocab_size=600)
    s = sentences["de"][5]
    assert t_files(s)["input_ids"] == t_texts(s)["input_ids"]  # same text, whichever way it was given


def test_bad_arguments(sentences):
    with pytest.raises(ValueError, match="bpe"):
        train_tokenizer(sentences["en"], model="wordpiece")
    with pytest.raises(ValueError, match="No training text"):
        train_tokenizer([], vocab_size=100)


def test_cli(tmp_path):
    out = tmp_path / "cli_tok"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_variants.tokenization",
            "--files",
            str(DATA / "val.en.gz"),
            str(DATA / "val.fr.gz"),
            "--vocab_size",
            "700",
            "--languages",
            "en",
            "fr",
            "--output_dir",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.convert_tokens_to_ids(["<2en>", "<2fr>"]) == [4, 5]
    fr = _head(DATA / "val.fr.gz", 1)[0]
    assert tok.decode(tok(fr)["input_ids"], skip_special_tokens=True) == fr


def test_model_max_length_is_the_models_limit(sentences, tmp_path):
    """A tokenizer declares the limit of the model it serves (`max_position_embeddings`): `truncation=True` cuts
    to it, keeping `</s>`, and the value survives save/reload and the CLI."""
    tok = train_tokenizer(sentences["en"], vocab_size=600, output_dir=tmp_path / "tok", model_max_length=12)
    reloaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert tok.model_max_length == reloaded.model_max_length == 12
    long = " ".join(sentences["en"][:3])
    ids = reloaded(long, truncation=True)["input_ids"]
    assert len(reloaded(long)["input_ids"]) > 12 and len(ids) == 12 and ids[-1] == reloaded.eos_token_id
    assert train_tokenizer(sentences["en"][:50], vocab_size=300).model_max_length == 1024  # the config default
    with pytest.raises(ValueError, match="model_max_length"):
        train_tokenizer(sentences["en"][:50], vocab_size=300, model_max_length=0)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_variants.tokenization",
            "--files",
            str(DATA / "val.en.gz"),
            "--vocab_size",
            "300",
            "--model_max_length",
            "256",
            "--output_dir",
            str(tmp_path / "cli"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert AutoTokenizer.from_pretrained(tmp_path / "cli").model_max_length == 256


def _is_punctuation(char):
    import unicodedata

    return unicodedata.category(char).startswith("P") or (
        char.isascii() and not char.isalnum() and char.isprintable() and not char.isspace()
    )


def test_punctuation_isolated_and_the_bundled_data_round_trips():
    """No subword joins a punctuation mark to anything ("runs." is `▁r un s .`, as in the papers'
    Moses-tokenized setups and a parser's leaves), and detokenization stays exact on the bundled data: every
    line (as training reads it: stripped) of every Multi30k split and language, for BPE and Unigram."""
    import unicodedata

    langs = ("en", "de", "fr", "cs")
    texts = {
        lang: [
            line.strip()
            for split, n in (("train", 3000), ("val", 5000), ("test_2016_flickr", 5000))
            for line in _head(DATA / f"{split}.{lang}.gz", n)
        ]
        for lang in langs
    }
    for model in ("bpe", "unigram"):
        tok = train_tokenizer(
            [t for lang in langs for t in texts[lang]], vocab_size=3000, model=model, languages=langs
        )
        special = set(tok.all_special_tokens)
        for lang in langs:
            ids = tok(texts[lang])["input_ids"]
            for text, decoded in zip(texts[lang], tok.batch_decode(ids, skip_special_tokens=True)):
                # NFKC (the normalizer) changes one line of the data: a no-break space in "120\xa0cm" (de)
                assert decoded == unicodedata.normalize("NFKC", text)
            for row in ids:
                for piece in tok.convert_ids_to_tokens(row):
                    core = piece.replace("\u2581", "")
                    assert piece in special or len(core) <= 1 or not any(map(_is_punctuation, core)), piece
        assert sum(unicodedata.normalize("NFKC", t) != t for lang in langs for t in texts[lang]) == 1
        assert tok.convert_ids_to_tokens(tok("A man runs.")["input_ids"])[-2:] == [".", "</s>"]


def test_tokenizer_with_attached_punctuation_still_loads_and_round_trips(sentences, tmp_path):
    """A tokenizer saved before punctuation was isolated (its pre-tokenizer is Metaspace alone) keeps working:
    it reloads with its own pre-tokenizer and detokenizes exactly."""
    old = train_tokenizer(
        [sentences["en"], sentences["de"]],
        vocab_size=1000,
        languages=["en", "de"],
        split_punctuation=False,
        output_dir=tmp_path,
    )
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert reloaded.backend_tokenizer.pre_tokenizer.__class__.__name__ == "Metaspace"
    texts = sentences["en"][:100] + sentences["de"][:100]
    assert reloaded(texts)["input_ids"] == old(texts)["input_ids"]
    assert reloaded.batch_decode(reloaded(texts)["input_ids"], skip_special_tokens=True) == texts
    assert any(piece.endswith(".") and len(piece) > 1 for t in texts for piece in reloaded.tokenize(t))  # glued
