"""What the commands take as a model or a tokenizer (`--model`, `--base`, `--model_name_or_path`, `--tokenizer`),
checked before anything loads, so a wrong path is one line naming the flag rather than a traceback after minutes of
work:

- a folder a training run wrote (`results.json`, `model/`, `checkpoints/`) where a model folder is expected: the
  message names the folder to pass (`RUN/model`, or `RUN/tokenizer` for a tokenizer);
- a folder without `config.json` (or tokenizer files), or a file: named as such;
- a path that does not exist: "no such folder" when it can only be a path (`runs/x/model`, `./x`, `/x`, `~/x`),
  otherwise (a Hub id such as `org/name`) the Hub's own answer, in one line (`load_config`).

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import os
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
RUN_MARKERS = ("results.json", "model", "checkpoints", "model_config", "tokenizer")


class ModelFolderError(ValueError):
    """A `--model`-like flag that names no model (or tokenizer) folder; nothing was loaded."""


def is_run_folder(path: Path) -> bool:
    """A folder `hf_variants.training.train` wrote (its final model in `model/`, or only checkpoints so far)."""
    return path.is_dir() and (
        (path / "model" / "config.json").is_file()
        or (path / "results.json").is_file()
        or (path / "checkpoints").is_dir()
    )


def can_only_be_a_path(value: str) -> bool:
    """Whether `value` cannot be a Hub repository id (`name` or `namespace/name`): it has more than one `/`, starts
    with `.`, `/` or `~`, ends with `/`, or holds characters a repo id cannot."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    if value.startswith((".", "/", "~")) or value.endswith("/") or value.count("/") > 1:
        return True
    if os.sep != "/" and os.sep in value:
        return True
    try:
        validate_repo_id(value)
    except HFValidationError:
        return True
    return False


def _run_hint(path: Path, what: str) -> str:
    if what == "tokenizer":
        for sub in ("tokenizer", "model"):
            if any((path / sub / name).is_file() for name in TOKENIZER_FILES):
                return f"pass {path / sub} (the run's tokenizer)"
        return "the run saved no tokenizer yet"
    if (path / "model" / "config.json").is_file():
        return f"pass {path / 'model'} (the run's final model)"
    return "the run has no final model yet (pass one of its checkpoints/step_N where the command takes checkpoints)"


def check_model_folder(value: str | os.PathLike, flag: str, *, what: str = "model") -> None:
    """Raise a `ModelFolderError` (one line naming `flag`) when `value` is a local path that holds no saved
    `what` ("model": `config.json`; "tokenizer": `tokenizer.json` or `tokenizer_config.json`): a training run's
    folder (naming the folder inside it to pass), another folder, a file, or a path that does not exist and cannot
    be a Hub id. A value that may be a Hub id and is no local path passes (`load_config` asks the Hub)."""
    text = os.fspath(value)
    path = Path(text).expanduser()
    files = ("config.json",) if what == "model" else TOKENIZER_FILES
    if path.is_dir():
        if any((path / name).is_file() for name in files):
            return
        if is_run_folder(path):
            raise ModelFolderError(
                f"{flag} {text} is a training run folder, not a {what} folder: {_run_hint(path, what)}."
            )
        raise ModelFolderError(
            f"{flag} {text} holds no {' or '.join(files)}: not a saved {what} folder (save_pretrained writes one)."
        )
    if path.exists():
        raise ModelFolderError(f"{flag} {text} is a file, not a {what} folder.")
    if can_only_be_a_path(text):
        raise ModelFolderError(f"{flag} {text}: no such folder.")


def check_tokenizer_source(tokenizer: str | None, model: str) -> None:
    """A command's `--tokenizer` (default: the `--model` folder) holds tokenizer files (`check_model_folder`)."""
    check_model_folder(tokenizer or model, "--tokenizer" if tokenizer else "--model", what="tokenizer")


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_config(value: str | os.PathLike, flag: str, **kwargs):
    """`AutoConfig.from_pretrained(value)` after `check_model_folder`: the config of a local model folder or a Hub
    id, or a `ModelFolderError` naming `flag` (a Hub id that cannot be found or reached, an unknown model type)."""
    from transformers import AutoConfig

    check_model_folder(value, flag)
    try:
        return AutoConfig.from_pretrained(os.fspath(value), **kwargs)
    except (OSError, ValueError) as error:
        where = "" if Path(os.fspath(value)).expanduser().exists() else "no such folder, and on the Hub: "
        raise ModelFolderError(f"{flag} {os.fspath(value)}: {where}{first_line(error)}") from None


def load_tokenizer_check(value: str | os.PathLike, flag: str, **kwargs) -> None:
    """A tokenizer flag checked as `check_model_folder(what="tokenizer")`; a possible Hub id is loaded once (then
    cached) so that one that cannot be found fails here, in one line."""
    check_model_folder(value, flag, what="tokenizer")
    if Path(os.fspath(value)).expanduser().exists():
        return
    from transformers import AutoTokenizer

    try:
        AutoTokenizer.from_pretrained(os.fspath(value), **kwargs)
    except (OSError, ValueError) as error:
        raise ModelFolderError(
            f"{flag} {os.fspath(value)}: no such folder, and on the Hub: {first_line(error)}"
        ) from None


__all__ = [
    "ModelFolderError",
    "check_model_folder",
    "check_tokenizer_source",
    "load_config",
    "load_tokenizer_check",
    "is_run_folder",
    "can_only_be_a_path",
]
