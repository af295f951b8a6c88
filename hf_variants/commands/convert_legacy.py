"""`python -m hf_variants.convert_legacy`: convert a MUTE or MIMO folder saved by hf_variants 0.1 to today's
layout. What the conversion does: `hf_variants.convert.legacy`."""

from __future__ import annotations

import argparse

from ..convert import legacy as library
from ..convert.legacy import COMMAND, convert_checkpoint
from ..outputs import check_not_an_input, check_output_dir
from .common import UsageError, add_model_folder_flags, add_output_dir_flags, exits_on_refusal


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hf-variants-convert-legacy", description=library.__doc__.split("\n\n")[0])
    add_model_folder_flags(parser, "folder saved by hf_variants 0.1", tokenizer=False)
    add_output_dir_flags(parser, COMMAND)
    return parser


@exits_on_refusal("hf-variants-convert-legacy")
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    try:  # before anything loads: the output is no input, and can be written
        check_not_an_input(args.output_dir, {"--model": args.model})
        check_output_dir(args.output_dir, command=COMMAND, force=args.force)
    except (ValueError, FileExistsError) as error:
        raise UsageError(str(error)) from None
    model = convert_checkpoint(args.model, args.output_dir, force=args.force)
    print(f"converted {type(model).__name__} to {args.output_dir}")


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
