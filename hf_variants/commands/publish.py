"""`hf-variants-publish` (`python -m model_cards.publish`): push a run's model, its card and its code to the Hub.
What is pushed and how: `model_cards.publish`. Exit status 0 with the commit URL, 2 for a refused flag or folder
(nothing read or sent), 1 when the Hub refuses the push."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from huggingface_hub import get_token

from model_cards.publish import PublishError, check_model_dir, check_repo_id, push_to_hub


def _repo_id_flag(text: str) -> str:
    try:
        return check_repo_id(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _folder_flag(text: str) -> Path:
    path = Path(text)
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder (a run folder or a model folder)")
    return path


def _message_flag(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the commit message is empty")
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="hf-variants-publish",
        description="Push a trained hf_variants model and its card to the Hub "
        "(HF_ENDPOINT, token from HF_TOKEN or `hf auth login`).",
    )
    parser.add_argument("run_dir", type=_folder_flag, help="run folder (results.json + model/) or model folder")
    parser.add_argument("--repo_id", required=True, type=_repo_id_flag, help="namespace/name")
    parser.add_argument("--private", action="store_true")
    parser.add_argument("--commit_message", default=None, type=_message_flag)
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    model_dir = run_dir / "model" if (run_dir / "model" / "config.json").is_file() else run_dir
    try:  # what the command line can get wrong, before anything is read or sent: exit status 2
        check_model_dir(model_dir)
    except (ValueError, OSError) as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    if not get_token():
        parser.exit(
            2,
            f"{parser.prog}: error: No Hugging Face token: set the HF_TOKEN environment variable or log in with "
            "`hf auth login`. Nothing was pushed.\n",
        )
    try:
        url = push_to_hub(model_dir, args.repo_id, private=args.private, commit_message=args.commit_message)
    except (ValueError, PublishError, FileNotFoundError) as err:  # the Hub refused: exit status 1
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(url)
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
