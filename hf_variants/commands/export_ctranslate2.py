"""`hf-variants-export-ctranslate2` (`python -m hf_variants.export_ctranslate2`): export a saved `transformer_nmt`
model to CTranslate2. What the export writes: `hf_variants.deploy.ctranslate2`."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..deploy import ctranslate2 as library
from ..deploy.ctranslate2 import COMMAND, QUANTIZATIONS, check_exportable, export
from .common import UsageError, add_model_folder_flags, add_output_dir_flags, exits_on_refusal
from .loading import check_export_paths, load_model_folder


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-export-ctranslate2",
        description=library.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_folder_flags(parser, "saved transformer_nmt model folder")
    add_output_dir_flags(parser, COMMAND)
    parser.add_argument("--quantization", choices=QUANTIZATIONS, help="store the weights quantized (default: float32)")
    return parser


@exits_on_refusal("hf-variants-export-ctranslate2")
def main(argv=None) -> Path:
    args = build_parser().parse_args(argv)
    config = check_export_paths(args.model, args.tokenizer, args.output_dir, COMMAND, args.force)
    try:
        check_exportable(config)
    except ValueError as error:
        raise UsageError(str(error)) from None
    try:
        import ctranslate2  # noqa: F401
    except ImportError as error:
        raise SystemExit(
            f"The CTranslate2 export needs the ctranslate2 package: pip install 'hf-variants[deploy]' ({error})."
        ) from error
    model, tokenizer = load_model_folder(args.model, args.tokenizer)
    try:
        out = export(model, tokenizer, args.output_dir, args.quantization, args.force)
    except (ValueError, FileExistsError) as error:
        raise UsageError(str(error)) from None
    print(f"Saved the CTranslate2 model to {out}")
    return out


def cli() -> None:
    main()


if __name__ == "__main__":
    cli()
