"""Train the shared source/target subword tokenizer used by every hf_variants model.

One vocabulary for all languages of a run (the papers share source and target embeddings), trained with the
`tokenizers` library and wrapped as a stock `transformers.PreTrainedTokenizerFast`, so a saved tokenizer needs no
remote code: `AutoTokenizer.from_pretrained(dir)` reloads it.

Layout of the result:

- special tokens `<pad>`=0, `<s>`=1, `</s>`=2, `<unk>`=3, then one `<2xx>` target-language tag per language
  (special tokens, so `decode(..., skip_special_tokens=True)` drops them);
- NFKC normalizer, Metaspace pre-tokenizer and decoder (detokenization restores the original spacing, which
  sacreBLEU on detokenized text needs), and punctuation isolated by the pre-tokenizer (`split_punctuation`): a
  subword never joins a punctuation mark to a letter ("runs." is `▁r un s .`, never `s.`), as in the papers'
  Moses-tokenized setups and as a parser's leaves are (the syntactic MG-SA aligns them to tokens). The marks keep no
  `▁` of their own, so `decode(encode(x)) == x` still holds;
- a post-processor that appends `</s>` to every sequence and adds no BOS: encoder inputs are `tokens </s>`, and
  `tok(text, text_target=...)["labels"]` is `tokens </s>` (the model shifts it right behind `<s>`).

This module is a training utility: it is *not* imported by any modeling/configuration file and is not shipped
with models.

CLI::

    python -m hf_variants.tokenization --files train.en.gz train.de.gz --vocab_size 8000 \
        --languages en de --output_dir runs/tok
"""

from __future__ import annotations

import gzip
import io
import os
import string
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Union

from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from .configuration_transformer_nmt import language_tag

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN]  # ids 0, 1, 2, 3 in this order
METASPACE = "\u2581"
# Always in the vocabulary, seen in training or not: printable ASCII. Other characters never seen in training
# encode as <unk> (which decoding drops), so train on the run's full training text.
INITIAL_ALPHABET = sorted(set(string.printable) - set(string.whitespace))

TextSource = Union[str, os.PathLike, Iterable[str]]

__all__ = ["train_tokenizer", "language_tag", "language_tags", "read_lines", "SPECIAL_TOKENS"]


def language_tags(languages: Iterable[str]) -> list[str]:
    """`language_tag` of every language, in order, without duplicates."""
    tags: list[str] = []
    for lang in languages:
        tag = language_tag(lang)
        if tag not in tags:
            tags.append(tag)
    return tags


def _open_text(path: str | os.PathLike) -> io.TextIOBase:
    path = Path(path)
    if path.suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8-sig", newline="\n")  # utf-8-sig: a BOM is no text
    return open(path, encoding="utf-8-sig", newline="\n")


def read_lines(path: str | os.PathLike) -> Iterator[str]:
    """Lines of a plain or gzip-compressed UTF-8 text file, without their line terminators."""
    with _open_text(path) as f:
        for line in f:
            yield line.rstrip("\r\n")


def _is_file(item: object) -> bool:
    if isinstance(item, os.PathLike):
        return True
    return isinstance(item, str) and "\n" not in item and len(item) < 4096 and os.path.isfile(item)


def _iter_texts(files_or_texts: TextSource | Sequence[TextSource]) -> Iterator[str]:
    """Sentences from paths (plain or .gz), plain strings, or (nested) iterables of those.

    A string that names an existing file is read as a file; any other string is a sentence.
    """
    if isinstance(files_or_texts, (str, os.PathLike)):
        files_or_texts = [files_or_texts]
    for item in files_or_texts:
        if _is_file(item):
            yield from read_lines(item)
        elif isinstance(item, str):
            yield item
        elif isinstance(item, Iterable):
            yield from _iter_texts(item)
        else:
            raise TypeError(f"Expected a file path, a string or an iterable of strings, got {type(item).__name__}.")


def _build_backend(model: str, vocab_size: int, min_frequency: int, special_tokens: list[str]):
    model = model.lower()
    if model == "bpe":
        backend = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=min_frequency,
            special_tokens=special_tokens,
            initial_alphabet=INITIAL_ALPHABET,
            show_progress=False,
        )
    elif model == "unigram":
        backend = Tokenizer(models.Unigram())
        trainer = trainers.UnigramTrainer(
            vocab_size=vocab_size,
            special_tokens=special_tokens,
            unk_token=UNK_TOKEN,
            initial_alphabet=INITIAL_ALPHABET,
            show_progress=False,
        )
    else:
        raise ValueError(f"Unknown tokenizer model {model!r}: use 'bpe' or 'unigram'.")
    return backend, trainer


def train_tokenizer(
    files_or_texts: TextSource | Sequence[TextSource],
    vocab_size: int = 8000,
    model: str = "bpe",
    languages: Iterable[str] = (),
    min_frequency: int = 2,
    output_dir: str | os.PathLike | None = None,
    model_max_length: int = 1024,
    split_punctuation: bool = True,
) -> PreTrainedTokenizerFast:
    """Train one shared subword tokenizer on source+target text.

    Args:
        files_or_texts: file paths (plain or `.gz`, one sentence a line), sentences, or iterables of sentences;
            pass the training files of every language of the run.
        vocab_size: target vocabulary size, special tokens and language tags included.
        model: `"bpe"` (default) or `"unigram"`.
        languages: language codes; a `<2xx>` special token is added for each (ids 4, 5, ... in order).
        min_frequency: minimum pair frequency for a BPE merge (ignored by Unigram).
        output_dir: if given, `save_pretrained` the tokenizer there.
        model_max_length: the longest input (special tokens included) of the model this tokenizer serves: its
            `config.max_position_embeddings` (default 1024, `TransformerNmtConfig`'s default). `truncation=True`
            cuts to it; a tokenizer saved next to a model must carry that model's limit (`train.py` sets it when it
            saves `model/`).
        split_punctuation: isolate every punctuation character in pre-tokenization (default; tokenizers saved
            before this option have `False`'s behaviour and keep it: a saved tokenizer carries its pre-tokenizer).

    Printable ASCII is always in the vocabulary; any other character never seen in the training text encodes as
    `<unk>`, so train on the full training text of every language of the run.

    Returns:
        A `PreTrainedTokenizerFast` with pad/bos/eos/unk set and the language tags as extra special tokens.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must be larger than {len(SPECIAL_TOKENS)}, got {vocab_size}.")
    if not isinstance(model_max_length, int) or isinstance(model_max_length, bool) or model_max_length < 2:
        raise ValueError(
            f"model_max_length must be an integer >= 2 (the model's max_position_embeddings), got "
            f"{model_max_length!r}."
        )
    tags = language_tags(languages)
    backend, trainer = _build_backend(model, vocab_size, min_frequency, SPECIAL_TOKENS + tags)
    backend.normalizer = normalizers.NFKC()
    metaspace = pre_tokenizers.Metaspace(replacement=METASPACE, prepend_scheme="always")
    # Metaspace first (a word keeps its "▁"), then punctuation apart: "▁runs." -> "▁runs", "."
    backend.pre_tokenizer = (
        pre_tokenizers.Sequence([metaspace, pre_tokenizers.Punctuation("isolated")])
        if split_punctuation
        else metaspace
    )
    backend.decoder = decoders.Metaspace(replacement=METASPACE, prepend_scheme="always")

    count = 0

    def counted() -> Iterator[str]:
        nonlocal count
        for text in _iter_texts(files_or_texts):
            count += 1
            yield text

    backend.train_from_iterator(counted(), trainer=trainer)
    if count == 0:
        raise ValueError("No training text: files_or_texts yielded no lines.")

    for i, tok in enumerate(SPECIAL_TOKENS + tags):
        got = backend.token_to_id(tok)
        if got != i:  # the trainers put special tokens first, in order; guard against library changes
            raise RuntimeError(f"Special token {tok!r} got id {got}, expected {i}.")
    eos_id = backend.token_to_id(EOS_TOKEN)
    backend.post_processor = processors.TemplateProcessing(
        single=f"$A:0 {EOS_TOKEN}:0",
        pair=f"$A:0 {EOS_TOKEN}:0 $B:1 {EOS_TOKEN}:1",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=PAD_TOKEN,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        extra_special_tokens=tags,  # v5 name of `additional_special_tokens`
        model_max_length=model_max_length,
        padding_side="right",
        clean_up_tokenization_spaces=False,
    )
    if output_dir is not None:
        tokenizer.save_pretrained(str(output_dir))
    return tokenizer


if __name__ == "__main__":  # the command line: hf_variants.commands.train_tokenizer (hf-variants-train-tokenizer)
    import runpy

    runpy.run_module("hf_variants.commands.train_tokenizer", run_name="__main__", alter_sys=True)
