"""`hf-variants-train-tokenizer` (`python -m hf_variants.tokenization`): train the shared subword tokenizer of a run
on source and target text (`hf_variants.tokenization.train_tokenizer`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from ..tokenization import train_tokenizer


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="hf-variants-train-tokenizer",
        description="Train the shared subword tokenizer of an hf_variants run on source+target training text.",
    )
    parser.add_argument("--files", nargs="+", required=True, help="training text files (plain or .gz)")
    parser.add_argument("--vocab_size", type=int, default=8000)
    parser.add_argument("--model", choices=["bpe", "unigram"], default="bpe")
    parser.add_argument("--languages", nargs="*", default=[], help="language codes; adds <2xx> tags")
    parser.add_argument("--min_frequency", type=int, default=2)
    parser.add_argument(
        "--model_max_length",
        type=int,
        default=1024,
        help="the model's max_position_embeddings (the longest input, special tokens included)",
    )
    parser.add_argument(
        "--keep_punctuation_attached",
        action="store_true",
        help="let subwords join punctuation to letters (tokenizers before 0.3); default: isolated",
    )
    parser.add_argument("--output_dir", required=True)
    args = parser.parse_args(argv)
    for f in args.files:
        if not os.path.isfile(f):
            parser.error(f"--files: no such file: {f}")
    tok = train_tokenizer(
        [Path(f) for f in args.files],
        vocab_size=args.vocab_size,
        model=args.model,
        languages=args.languages,
        min_frequency=args.min_frequency,
        output_dir=args.output_dir,
        model_max_length=args.model_max_length,
        split_punctuation=not args.keep_punctuation_attached,
    )
    print(f"Trained a {args.model} tokenizer with {len(tok)} tokens; saved to {args.output_dir}")


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
