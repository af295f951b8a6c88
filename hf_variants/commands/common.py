"""What the command-line front ends share: the one error that ends a command with status 2, the help layout, the
output-folder flags, the batching flags, and core messages rewritten as flags.

A command refuses bad input before it loads or writes anything, with one line naming the flag, file or line and exit
status 2 (`UsageError`, or the library's own errors listed in `REFUSALS`); `run_command` does that for every
command.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys
from collections.abc import Callable

from ..inference.requests import OptionError, option_specs
from ..outputs import OutputPathError, int_in_range

DEFAULT_BATCH_SIZE = 64  # sentences per batch without --max_tokens


class UsageError(ValueError):
    """A flag, or a file or folder a flag names, that a command refuses before doing any work (exit status 2)."""


def refusals() -> tuple[type[BaseException], ...]:
    """The errors a command reports as one line with exit status 2: its own `UsageError`, a decoding option out of
    range (`OptionError`), an output path it may not write (`OutputPathError`), a data file it cannot read
    (`DataError`)."""
    from ..training.corpus import DataError

    return UsageError, OptionError, OutputPathError, DataError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults in the option help; the description and epilog as written."""


def command_parser(prog: str, doc: str, epilog_from: int | None = None) -> argparse.ArgumentParser:
    """A parser whose description is the first paragraph of `doc` (a module docstring) and whose epilog is its
    paragraphs from `epilog_from` on (None: no epilog)."""
    paragraphs = doc.split("\n\n")
    return argparse.ArgumentParser(
        prog=prog,
        description=paragraphs[0],
        epilog="\n\n".join(paragraphs[epilog_from:]) if epilog_from is not None else None,
        formatter_class=HelpFormatter,
    )


def add_output_dir_flags(parser: argparse.ArgumentParser, command: str, what: str = "the output folder") -> None:
    """`--output_dir` (required) and `--force` (replace only a folder this same command wrote before)."""
    parser.add_argument("--output_dir", required=True, help=what)
    parser.add_argument(
        "--force", action="store_true", help=f"replace a non-empty --output_dir that {command} wrote before"
    )


def add_model_folder_flags(parser: argparse.ArgumentParser, what: str, tokenizer: bool = True) -> None:
    """`--model` (required: a saved model folder, `what`) and `--tokenizer` (default: the model's folder), the
    inputs of the commands that read a model folder as it is (exports, conversions)."""
    parser.add_argument("--model", required=True, help=what)
    if tokenizer:
        parser.add_argument("--tokenizer", help="tokenizer folder (default: --model)")


def add_batching_flags(
    parser: argparse.ArgumentParser, unit: str = "sentences", max_tokens: bool = True
) -> argparse._ArgumentGroup:
    """`--batch_size` and (`max_tokens`) `--max_tokens` (fairseq's), in a group the caller may add to."""
    g = parser.add_argument_group("batches")
    g.add_argument(
        "--batch_size",
        type=int_in_range(1),
        help=f"{unit} per batch (default {DEFAULT_BATCH_SIZE}" + (" without --max_tokens)" if max_tokens else ")"),
    )
    if max_tokens:
        g.add_argument(
            "--max_tokens",
            type=int_in_range(1),
            help=f"tokens per batch: {unit} x the longest of them (fairseq's --max-tokens)",
        )
    return g


def batching(args: argparse.Namespace) -> dict:
    """{"batch_size", "max_tokens"} of the flags: `DEFAULT_BATCH_SIZE` sentences when neither is given."""
    if args.batch_size is None and args.max_tokens is None:
        return {"batch_size": DEFAULT_BATCH_SIZE, "max_tokens": None}
    return {"batch_size": args.batch_size, "max_tokens": args.max_tokens}


def as_flags(message: str) -> str:
    """A core message naming options (`nbest=5 > num_beams=4`, `tgt_lang: ...`) as the command's flags
    (`--nbest 5 > --num_beams 4`, `--tgt_lang: ...`)."""
    names = "|".join(sorted((*option_specs(), "src_lang", "tgt_lang", "prefix"), key=len, reverse=True))
    message = re.sub(rf"(?<![\w-])({names})=", r"--\1 ", message)
    return re.sub(rf"^({names}):", r"--\1:", message)


def run_command(main: Callable[[], object], prog: str | None = None):
    """Run a command's `main()` and return what it returns; a refusal (`refusals()`) ends it with `PROG: error:
    MESSAGE` on stderr and exit status 2."""
    prog = prog or (sys.argv[0].rsplit("/", 1)[-1] if sys.argv and sys.argv[0] else "hf-variants")
    try:
        return main()
    except refusals() as error:
        print(f"{prog}: error: {error}", file=sys.stderr)
        sys.exit(2)


def exits_on_refusal(prog: str):
    """Decorate a command's `main(argv)` so that a refusal ends it as on the command line (`run_command`): a
    caller of `main([...])` gets `SystemExit(2)` and the one-line message, as the console script does."""

    def decorate(main):
        @functools.wraps(main)
        def run(argv=None):
            return run_command(lambda: main(argv), prog)

        return run

    return decorate


__all__ = [
    "DEFAULT_BATCH_SIZE",
    "HelpFormatter",
    "UsageError",
    "add_batching_flags",
    "add_model_folder_flags",
    "add_output_dir_flags",
    "as_flags",
    "batching",
    "command_parser",
    "exits_on_refusal",
    "refusals",
    "run_command",
]
