"""`hf-variants-convert-m2m100`: an M2M100 or NLLB-200 checkpoint (`M2M100ForConditionalGeneration`) as the
package's baseline (`transformer_nmt`), with its own tokenizer and language codes.

    hf-variants-convert-m2m100 --m2m100 facebook/nllb-200-distilled-600M --output_dir nllb-600M
    hf-variants-convert-m2m100 --m2m100 facebook/m2m100_418M --output_dir m2m100-418M --ignore_layerdrop

The output folder holds the converted model (same logits, same `generate()` outputs), its generation config and
the original tokenizer files; `config.languages` lists the model's language codes (`eng_Latn`, ... or `en`, ...).
What is carried over and what is refused: `hf_variants.convert.m2m100`. The folder is written atomically and is
never the input; `--force` replaces only a folder an earlier conversion wrote. M2M100's tokenizer needs
`sentencepiece` (`pip install "hf-variants[m2m]"`).
"""

from __future__ import annotations

import argparse

from ..convert.m2m100 import COMMAND, LAYERDROP_FIELDS, check_convertible, convert_m2m100
from ..model_folders import load_config
from ..outputs import atomic_output_dir, check_not_an_input, check_output_dir
from .common import add_output_dir_flags


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-convert-m2m100",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--m2m100",
        "--nllb",
        dest="m2m100",
        required=True,
        help="folder (or Hub id, when online) of an M2M100ForConditionalGeneration: M2M100 or a dense NLLB-200",
    )
    add_output_dir_flags(parser, "this command")
    parser.add_argument(
        "--ignore_layerdrop",
        action="store_true",
        help=f"convert a model with {' / '.join(LAYERDROP_FIELDS)} > 0 (M2M100-418M): LayerDrop acts in training "
        "only, the converted model is the same at inference and fine-tunes without it",
    )
    return parser


def load_source(path: str):
    """The M2M100 model and its tokenizer (a ValueError naming what is missing)."""
    from transformers import AutoTokenizer, M2M100ForConditionalGeneration

    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except ImportError as error:  # M2M100Tokenizer: sentencepiece
        raise ValueError(f"--m2m100 {path}: its tokenizer needs {error} (pip install 'hf-variants[m2m]').") from error
    except (OSError, ValueError) as error:
        raise ValueError(f"--m2m100 {path}: no tokenizer could be loaded ({error}).") from error
    return M2M100ForConditionalGeneration.from_pretrained(path), tokenizer


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:  # before anything loads: the output is no input, and can be written; the config is one we convert
        check_not_an_input(args.output_dir, {"--m2m100": args.m2m100})
        check_output_dir(args.output_dir, command=COMMAND, force=args.force)
        config = load_config(args.m2m100, "--m2m100")
        if config.model_type == "transformer_nmt":
            raise ValueError(f"--m2m100 {args.m2m100} holds a 'transformer_nmt' model: it needs no conversion.")
        notes = check_convertible(config, args.ignore_layerdrop)
        source, tokenizer = load_source(args.m2m100)
        model = convert_m2m100(source, tokenizer, ignore_layerdrop=args.ignore_layerdrop)
    except (ValueError, FileExistsError) as error:  # OutputPathError and ModelFolderError are ValueErrors
        parser.exit(2, f"error: {error}\n")
    for note in notes:
        print(f"note: {note}")
    with atomic_output_dir(args.output_dir, command=COMMAND, force=args.force) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
    languages = model.config.languages
    shown = ", ".join(languages[:6]) + (f", ... ({len(languages)} in all)" if len(languages) > 6 else "")
    print(f"Saved {args.output_dir}: transformer_nmt, vocabulary {model.config.vocab_size}, languages {shown}")


def cli() -> None:
    main()


if __name__ == "__main__":
    main()
