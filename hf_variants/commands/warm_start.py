"""`hf-variants-warm-start` (`python -m hf_variants.warm_start`): build a variant from a pretrained baseline. What the
warm start copies and initialises: `hf_variants.convert.warm_start`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from ..configuration_transformer_nmt import parse_config_overrides
from ..convert import warm_start as library
from ..convert.warm_start import (
    COMMAND,
    PHRASE_HEADS_OUTPUTS,
    TIED_INITS,
    TOKENIZER_FILES,
    VARIANT_TYPES,
    warm_start,
)
from ..model_folders import load_config
from ..outputs import check_not_an_input, check_output_dir, int_in_range
from .common import UsageError, add_output_dir_flags, exits_on_refusal


def _overrides_flag(text: str) -> dict[str, Any]:
    try:
        return parse_config_overrides(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-warm-start",
        description=library.__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--base", required=True, help="folder (or Hub id) of a transformer_nmt or MarianMTModel")
    parser.add_argument("--model_type", required=True, choices=VARIANT_TYPES)
    parser.add_argument(
        "--config_overrides",
        action="append",
        default=[],
        type=_overrides_flag,
        help="key=value,... variant fields (repeatable)",
    )
    add_output_dir_flags(parser, "a warm start")
    parser.add_argument("--base_model_id", help="recorded as `warm_started_from` (default: --base)")
    parser.add_argument("--tied_init", choices=TIED_INITS, default="decoder")
    parser.add_argument("--phrase_heads_output", choices=PHRASE_HEADS_OUTPUTS, default="zero")
    parser.add_argument("--seed", type=int_in_range(0, 2**63 - 1), default=0)
    parser.add_argument(
        "--allow_large_model",
        action="store_true",
        help="build the variant even when its estimated size exceeds the available memory",
    )
    return parser


@exits_on_refusal("hf-variants-warm-start")
def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    overrides: dict[str, Any] = {}
    for parsed in args.config_overrides:
        overrides.update(parsed)
    try:
        # before anything loads: the output is no input, and can be written
        check_not_an_input(args.output_dir, {"--base": args.base})
        check_output_dir(args.output_dir, command=COMMAND, force=args.force)
        load_config(args.base, "--base")
        _, report = warm_start(
            args.base,
            args.model_type,
            overrides,
            output_dir=args.output_dir,
            base_model_id=args.base_model_id,
            tied_init=args.tied_init,
            phrase_heads_output=args.phrase_heads_output,
            seed=args.seed,
            return_report=True,
            force=args.force,
            allow_large_model=args.allow_large_model,
        )
    except (ValueError, FileExistsError) as error:  # OutputPathError and ModelTooLargeError are ValueErrors
        raise UsageError(str(error)) from None
    print(report.summary())
    tokenizer = [n for n in TOKENIZER_FILES if (Path(args.output_dir) / n).is_file()]
    print(
        f"Saved {args.output_dir}"
        + (
            f" (tokenizer: {', '.join(tokenizer)})"
            if tokenizer
            else " (no tokenizer files in --base: pass --tokenizer to train.py)"
        )
    )


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
