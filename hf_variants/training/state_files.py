"""A checkpoint's stored files read as untrusted input: each refusal names the file and says why in our words.

A checkpoint holds torch archives (`optimizer.bin`, FSDP's `pytorch_model_fsdp.bin`, the fp16 `scaler.pt`), the
weights as safetensors, JSON files (the marker, the run's progress, the random states, the tokenizer's) and the
run's tokenizer. `file_problems(path)` opens every one of them the way a resume will, without loading tensors:

- a torch archive must be a zip archive (what `torch.save` writes; a bare pickle is refused unopened) whose pickle
  passes torch's weights-only unpickler (memory-mapped: only the small pickle is read, not the tensors);
- a safetensors file must have a valid header; a JSON file must parse (within `checkpointing.MAX_JSON_BYTES`);
- the saved tokenizer must load and be the one recorded in `checkpoint.json` (its fingerprint).

`checkpointing.resolve_resume` runs it, so `--resume_from_checkpoint latest` passes over a checkpoint with any
refused file to the newest one whose files all load, and a resume by path stops before anything is loaded. On a
`small`-preset checkpoint (85.9 MB) it took 0.25 s, beside 0.20 s for the manifest's digests (2-core AMD EPYC at
load average 13.8).

The libraries' own messages never reach the user: torch's refusal advises re-running `torch.load` with
`weights_only=False` (which would execute the payload) or allowlisting the refused global; `refusal_reason` says
what the file holds instead ("a pickle that calls builtins.exec"), and the errors raised here are never chained to
the library's exception.
"""

from __future__ import annotations

import json
import os
import re
import stat
import warnings
import zipfile
from pathlib import Path

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
SAFETENSORS_SUFFIX = ".safetensors"
MAX_JSON_BYTES = 256 * 1024 * 1024
TAMPERED = "the checkpoint was damaged, tampered with or mixed with another one; nothing in it was run"


class RefusedFileError(RuntimeError):
    """A stored file that is not loaded: `file` names it, the message says why (never the library's advice)."""

    def __init__(self, file: str | os.PathLike, reason: str):
        super().__init__(f"{file}: refused: {reason}")
        self.file = Path(file)
        self.reason = reason


def refusal_reason(err: BaseException) -> str:
    """Why torch's weights-only unpickler (or safetensors) refused a file, in our words: what the file holds, never
    the library's advice (torch suggests `weights_only=False`, which would run the file's code)."""
    text = str(err)
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", text)
    if found:
        return f"it holds a pickle that calls {found.group(1)} (code, where a state file holds only tensors)"
    found = re.search(r"Unsupported operand (\d+)", text)
    if found:
        return f"it holds pickle instructions a state file never has (opcode {found.group(1)})"
    if "mmap can only be used" in text or "zip archive" in text or "central directory" in text:
        return "it is not a torch archive (torch.save writes zip archives)"
    if "safetensors" in type(err).__module__.lower():
        if "not fully covered" in text or "incomplete" in text:
            return "it is shorter than its safetensors header says (truncated?)"
        return "it is not a safetensors file (its header does not parse)"
    if "pickle" in type(err).__module__ or "Unpickl" in type(err).__name__:
        return "its pickle is not one of tensors (refused by the weights-only unpickler)"
    return f"it does not load as a state file ({type(err).__name__})"


def load_torch_file(file: str | os.PathLike, mmap: bool = False):
    """`torch.load(file, weights_only=True)` on CPU, or a `RefusedFileError` naming the file: a file that is no zip
    archive is refused before anything reads it as a pickle; torch's warnings about the pickle are not shown."""
    import torch

    file = Path(file)
    if not zipfile.is_zipfile(file):
        raise RefusedFileError(file, f"it is not a torch archive (torch.save writes zip archives); {TAMPERED}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as err:  # noqa: BLE001 - every failure is a refusal naming the file, in our words
        reason = refusal_reason(err)
    raise RefusedFileError(file, f"{reason}; {TAMPERED}")


def load_safetensors(file: str | os.PathLike) -> dict:
    """The tensors of a safetensors file, or a `RefusedFileError` naming it."""
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as err:  # noqa: BLE001 - a refusal naming the file
        reason = refusal_reason(err)
    raise RefusedFileError(file, f"{reason}; {TAMPERED}")


def _check_safetensors_header(file: Path) -> None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as f:
            f.keys()
    except Exception as err:  # noqa: BLE001 - a refusal naming the file
        reason = refusal_reason(err)
    else:
        return
    raise RefusedFileError(file, f"{reason}; {TAMPERED}")


def _check_json(file: Path) -> None:
    size = os.lstat(file).st_size
    if size > MAX_JSON_BYTES:
        raise RefusedFileError(file, f"{size} bytes, more than a checkpoint's JSON file can be; {TAMPERED}")
    try:
        json.loads(file.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise RefusedFileError(file, f"binary content where a JSON file was written; {TAMPERED}") from None
    except (ValueError, RecursionError) as err:
        raise RefusedFileError(file, f"not valid JSON ({type(err).__name__}); {TAMPERED}") from None


def _check_tokenizer(folder: Path, recorded: str | None) -> None:
    """The tokenizer saved with a checkpoint loads and is the one its marker recorded."""
    from transformers import AutoTokenizer

    from .cache_store import tokenizer_fingerprint

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(folder)
    except Exception as err:  # noqa: BLE001 - a refusal naming the folder
        reason = f"the tokenizer saved with the checkpoint does not load ({type(err).__name__})"
    else:
        if recorded is None or tokenizer_fingerprint(tokenizer) == recorded:
            return
        reason = "the tokenizer saved with the checkpoint is not the one recorded in checkpoint.json (other token ids)"
    raise RefusedFileError(folder, f"{reason}; {TAMPERED}")


def check_file(file: Path) -> None:
    """Open one stored file of a checkpoint as a resume will (tensors not loaded); a `RefusedFileError` naming it."""
    if file.suffix in TORCH_SUFFIXES:
        load_torch_file(file, mmap=True)
    elif file.suffix == SAFETENSORS_SUFFIX:
        _check_safetensors_header(file)
    elif file.suffix == ".json":
        _check_json(file)


def file_problems(
    path: str | os.PathLike, tokenizer_dir: str | None = None, tokenizer: str | None = None
) -> list[str]:
    """One line per refused file of the checkpoint folder `path` ([] when every file loads): its torch archives,
    safetensors and JSON files (`check_file`), then the tokenizer saved in `path/tokenizer_dir` against the
    fingerprint `tokenizer` its marker recorded. Only regular files are opened (the manifest check refuses links,
    devices and FIFOs before this runs)."""
    path = Path(path)
    problems = []
    for file in sorted(path.rglob("*")):
        if not stat.S_ISREG(os.lstat(file).st_mode):
            continue
        try:
            check_file(file)
        except RefusedFileError as err:
            problems.append(str(err))
    folder = path / tokenizer_dir if tokenizer_dir else None
    if not problems and folder is not None and folder.is_dir():
        try:
            _check_tokenizer(folder, tokenizer)
        except RefusedFileError as err:
            problems.append(str(err))
    return problems
