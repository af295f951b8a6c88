"""`hf-variants-prune-vocabulary`: a baseline model (a converted NLLB-200 or M2M100 above all) with its vocabulary cut
to the languages and the text you need, the model and its tokenizer together.

    hf-variants-prune-vocabulary --model nllb-600M --output_dir nllb-600M-en-fr-de \\
        --keep_languages eng_Latn,fra_Latn,deu_Latn \\
        --keep_tokens_from train.eng_Latn train.fra_Latn train.deu_Latn [--with_translations]

Kept: every token of the files' lines, the special tokens and the kept languages' tokens (BPE: and the tokens they
are merged from); `--with_translations` also keeps the tokens of the full model's translations of each file
(named PREFIX.LANG[.gz]) into the other kept languages, then translates them again with the pruned model and
counts the lines that differ. The output folder holds the pruned model, its tokenizer and `prune.json` (what was
kept and checked); it is written atomically and is never the input. How tokens outside the kept set are handled,
and why beam search may differ on a few lines: `hf_variants.convert.prune`.
"""

from __future__ import annotations

import argparse

from ..convert.prune import COMMAND, prune_vocabulary, write_report
from ..inference.flags import add_option_flags
from ..model_folders import load_config
from ..outputs import atomic_output_dir, check_not_an_input, check_output_dir
from .common import DEFAULT_BATCH_SIZE, add_batching_flags, add_model_folder_flags, add_output_dir_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-prune-vocabulary",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_folder_flags(parser, "a transformer_nmt folder (e.g. hf-variants-convert-m2m100's)", tokenizer=False)
    add_output_dir_flags(parser, "this command")
    parser.add_argument(
        "--keep_languages",
        required=True,
        type=lambda text: [lang.strip() for lang in text.split(",") if lang.strip()],
        help="comma-separated language codes of the model to keep (eng_Latn,fra_Latn,... or en,fr,...)",
    )
    parser.add_argument(
        "--keep_tokens_from",
        nargs="+",
        required=True,
        metavar="FILE",
        help="text files (plain or .gz, one sentence a line) whose tokens are kept",
    )
    parser.add_argument(
        "--with_translations",
        action="store_true",
        help="also keep the tokens of the full model's translations of each file (PREFIX.LANG[.gz]) into the other "
        "kept languages, and count the lines the pruned model translates otherwise",
    )
    with_translations = parser.add_argument_group("--with_translations: decoding (default: the model's)")
    add_option_flags(with_translations, ["num_beams", "max_new_tokens"])
    add_batching_flags(parser, max_tokens=False)
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    inputs = {"--model": args.model, **{f"--keep_tokens_from {p}": p for p in args.keep_tokens_from}}
    try:  # before anything loads: the output is no input, and can be written; the model is a baseline
        check_not_an_input(args.output_dir, inputs)
        check_output_dir(args.output_dir, command=COMMAND, force=args.force)
        config = load_config(args.model, "--model")
        if config.model_type != "transformer_nmt":
            raise ValueError(
                f"--model {args.model} holds a {config.model_type!r} model: prune the baseline (transformer_nmt; "
                "convert an M2M100 / NLLB-200 checkpoint with hf-variants-convert-m2m100 first)."
            )
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

        model = AutoModelForSeq2SeqLM.from_pretrained(args.model).eval()
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        generate_kwargs = {k: v for k, v in (("num_beams", args.num_beams), ("max_new_tokens", args.max_new_tokens))}
        pruned, pruned_tokenizer, report = prune_vocabulary(
            model,
            tokenizer,
            args.keep_languages,
            args.keep_tokens_from,
            with_translations=args.with_translations,
            batch_size=args.batch_size or DEFAULT_BATCH_SIZE,
            generate_kwargs={k: v for k, v in generate_kwargs.items() if v is not None},
        )
    except (ValueError, FileExistsError, OSError) as error:  # OutputPathError, ModelFolderError: ValueErrors
        parser.exit(2, f"error: {error}\n")
    with atomic_output_dir(args.output_dir, command=COMMAND, force=args.force) as staging:
        pruned.save_pretrained(staging)
        pruned_tokenizer.save_pretrained(staging)
        write_report(staging, report)
    print(report.summary())
    print(f"Saved {args.output_dir}")


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
