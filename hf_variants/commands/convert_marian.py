"""`hf-variants-convert-marian` (`python -m hf_variants.convert_marian`): convert a `MarianMTModel` folder (opus-mt)
into the baseline `transformer_nmt`. What the conversion does: `hf_variants.convert.marian`."""

from __future__ import annotations

import argparse

from ..convert import marian as library
from ..convert.marian import COMMAND, convert_marian
from ..model_folders import load_config
from ..outputs import atomic_output_dir, check_not_an_input, check_output_dir
from .common import UsageError, add_output_dir_flags, exits_on_refusal


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-convert-marian",
        description=library.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--marian", required=True, help="MarianMTModel folder (or Hub id, when online)")
    add_output_dir_flags(parser, COMMAND)
    return parser


def check_paths(args: argparse.Namespace) -> None:
    """Before anything loads: the output is no input and can be written; --marian holds a MarianMTModel."""
    try:
        check_not_an_input(args.output_dir, {"--marian": args.marian})
        check_output_dir(args.output_dir, command=COMMAND, force=args.force)
        model_type = load_config(args.marian, "--marian").model_type
    except (ValueError, FileExistsError) as error:  # ModelFolderError is a ValueError
        raise UsageError(str(error)) from None
    if model_type != "marian":  # MarianMTModel.from_pretrained would load it with a warning, weights lost
        raise UsageError(
            f"--marian {args.marian} holds a {model_type!r} model, not a MarianMTModel"
            + (": it needs no conversion." if model_type == "transformer_nmt" else ".")
        )


@exits_on_refusal("hf-variants-convert-marian")
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    check_paths(args)
    from transformers import AutoTokenizer, MarianMTModel

    model = convert_marian(MarianMTModel.from_pretrained(args.marian))
    with atomic_output_dir(args.output_dir, command=COMMAND, force=args.force) as staging:
        model.save_pretrained(staging)
        try:
            AutoTokenizer.from_pretrained(args.marian).save_pretrained(staging)
        except (OSError, ValueError) as error:  # tokenizer needs sentencepiece, or none was saved
            print(f"Tokenizer not copied: {error}")
    print(f"Saved {args.output_dir}")


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
