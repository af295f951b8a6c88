"""What every command of the package does with the files and folders it writes.

- **An output is never an input.** `check_not_an_input` refuses an output that is, contains or lies inside one of
  the command's inputs (symlinks resolved, hard links and bind mounts compared with `os.path.samefile`), also when
  the output does not exist yet, before anything is loaded or written.
- **Checked before the work.** `check_output_dir` / `check_output_file` refuse a path that cannot be written (a
  regular file where a folder is needed, a folder where a file is needed, a parent that is a file or not writable)
  before the command loads or computes anything.
- **`--force` replaces only the command's own output.** A folder written through `atomic_output_dir` holds a
  manifest (`OUTPUT_MANIFEST`: the command and every file it wrote). `--force` replaces a folder only when its
  manifest names the same command and the folder holds no other file; it says what it deletes. Any other non-empty
  folder is refused, `--force` or not.
- **Atomic writes.** A folder is written into a hidden temporary sibling and swapped in when complete (the old
  output stays whole until then, and a failure removes only the temporary folder); a file goes through a hidden
  temporary sibling and `os.replace`.
- **Flags are checked at parse time**: `int_in_range` / `float_in_range` are `argparse` `type=` validators (argparse
  exits with status 2 naming the flag and the allowed range).

(Tooling: not shipped with saved models.)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

OUTPUT_MANIFEST = ".hf_variants_output.json"
_MANIFEST_FORMAT = 1


class OutputPathError(ValueError):
    """An output path the command refuses (an input, not writable, or a folder it did not write); nothing was
    written."""


# ------------------------------------------------------------------------------------------------ flag validators
def int_in_range(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse `type=`: an integer within [minimum, maximum] (either end open when None)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected an integer{_range_text(minimum, maximum)}, got {text!r}")
        if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"expected an integer{_range_text(minimum, maximum)}, got {text!r}")
        return value

    parse.__name__ = "integer"
    return parse


def float_in_range(minimum: float | None = None, maximum: float | None = None) -> Callable[[str], float]:
    """An argparse `type=`: a finite number within [minimum, maximum] (either end open when None)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except (TypeError, ValueError):
            raise argparse.ArgumentTypeError(f"expected a number{_range_text(minimum, maximum)}, got {text!r}")
        if not math.isfinite(value) or (
            (minimum is not None and value < minimum) or (maximum is not None and value > maximum)
        ):
            raise argparse.ArgumentTypeError(f"expected a finite number{_range_text(minimum, maximum)}, got {text!r}")
        return value

    parse.__name__ = "number"
    return parse


def _range_text(minimum, maximum) -> str:
    if minimum is not None and maximum is not None:
        return f" in [{minimum}, {maximum}]"
    if minimum is not None:
        return f" >= {minimum}"
    if maximum is not None:
        return f" <= {maximum}"
    return ""


# ------------------------------------------------------------------------------------------------ path relations
def _resolved(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(os.path.expanduser(os.fspath(path))))


def _existing_ancestors(path: Path) -> list[Path]:
    """`path` (when it exists) and its existing parents, nearest first."""
    return [p for p in (path, *path.parents) if os.path.lexists(p)]


def _same(a: Path, b: Path) -> bool:
    try:
        return a == b or os.path.samefile(a, b)
    except OSError:
        return False


def relation(output: str | os.PathLike, input_path: str | os.PathLike) -> str | None:
    """How `output` relates to the existing `input_path`: "is", "lies inside", "contains", or None (apart)."""
    out, inp = _resolved(output), _resolved(input_path)
    out_chain = _existing_ancestors(out)
    if out_chain and out_chain[0] == out and _same(out, inp):
        return "is"
    if any(_same(a, inp) for a in out_chain) or inp in out.parents:
        return "lies inside"
    if os.path.lexists(out) and any(_same(a, out) for a in _existing_ancestors(inp)[1:]):
        return "contains"
    if out in inp.parents:
        return "contains"
    return None


def check_not_an_input(
    output: str | os.PathLike,
    inputs: Mapping[str, str | os.PathLike | None | list],
    *,
    output_flag: str = "--output_dir",
) -> None:
    """Raise `OutputPathError` when `output` is, contains or lies inside one of `inputs` (flag -> path, or a list of
    paths; a value that is None or names no local path, e.g. a Hub id, is skipped)."""
    for flag, values in inputs.items():
        for value in values if isinstance(values, (list, tuple)) else [values]:
            if value is None or not os.path.lexists(os.path.expanduser(os.fspath(value))):
                continue
            found = relation(output, value)
            if found is not None:
                raise OutputPathError(
                    f"{output_flag} {os.fspath(output)!r} {found} {flag} {os.fspath(value)!r}: the command would "
                    f"overwrite its own input. Choose an {output_flag} outside every input (and not holding one). "
                    "Nothing was written."
                )


def _check_parent_writable(path: Path, flag: str) -> None:
    for ancestor in path.parents:
        if os.path.lexists(ancestor):
            if not ancestor.is_dir():
                raise OutputPathError(f"{flag} {str(path)!r} cannot be created: {str(ancestor)!r} is not a folder.")
            if not os.access(ancestor, os.W_OK | os.X_OK):
                raise OutputPathError(f"{flag} {str(path)!r} cannot be created: {str(ancestor)!r} is not writable.")
            return


def check_output_file(output: str | os.PathLike, *, flag: str = "--output") -> Path:
    """Raise `OutputPathError` unless `output` can be written as a file (it is no folder; its parent folder exists
    or can be created, and is writable)."""
    path = Path(os.path.expanduser(os.fspath(output)))
    if path.is_dir():
        raise OutputPathError(f"{flag} {str(path)!r} is a folder; give a file name.")
    _check_parent_writable(path.absolute(), flag)
    return path


def check_output_files(
    outputs: Mapping[str, str | os.PathLike | None], inputs: Mapping[str, str | os.PathLike | None | list]
) -> None:
    """A command's output files (flag -> path; None: not written): each can be written as a file and is not, does not
    hold and does not lie inside any input (flag -> path or paths), and no two are the same file or one inside the
    other. Raises `OutputPathError` naming the flags."""
    written = [(flag, path) for flag, path in outputs.items() if path is not None]
    for flag, path in written:
        check_output_file(path, flag=flag)
        check_not_an_input(path, inputs, output_flag=flag)
    for i, (flag, path) in enumerate(written):
        for other_flag, other in written[i + 1 :]:
            if (
                Path(os.path.expanduser(os.fspath(path))).absolute()
                == Path(os.path.expanduser(os.fspath(other))).absolute()
            ):
                raise OutputPathError(f"{other_flag} and {flag} name the same file.")
            check_not_an_input(other, {flag: path}, output_flag=other_flag)


def check_output_dir(
    output: str | os.PathLike, *, command: str, force: bool = False, flag: str = "--output_dir"
) -> list[str]:
    """Raise unless `command` may write the folder `output`: it is no file, its parent can be written, and it is
    absent, empty, or (with `force`) a folder `command` wrote before that holds nothing else. Returns the files
    `--force` would delete (empty when nothing is replaced). A non-empty folder without `force` raises
    `FileExistsError`; a folder `--force` may not replace raises `OutputPathError`."""
    path = Path(os.path.expanduser(os.fspath(output)))
    if path.is_symlink():  # replacing it would replace the link, not the folder it names
        raise OutputPathError(f"{flag} {str(path)!r} is a symbolic link; give the folder it points to.")
    if os.path.lexists(path) and not path.is_dir():
        raise OutputPathError(f"{flag} {str(path)!r} exists and is not a folder.")
    _check_parent_writable(path.absolute(), flag)
    if not path.is_dir() or not any(path.iterdir()):
        return []
    if not force:
        raise FileExistsError(
            f"{flag} {str(path)!r} exists and is not empty; pass --force to replace it (only a folder written "
            f"by {command} is replaced)."
        )
    manifest = read_output_manifest(path)
    if manifest is None or manifest["command"] != command:
        by = "no command of this package" if manifest is None else manifest["command"]
        raise OutputPathError(
            f"--force replaces only a folder that {command} wrote (it holds {OUTPUT_MANIFEST}); {str(path)!r} was "
            f"written by {by}. Nothing was deleted: remove it yourself or choose another {flag}."
        )
    present = _files_under(path)
    extra = sorted(set(present) - set(manifest["files"]) - {OUTPUT_MANIFEST})
    if extra:
        raise OutputPathError(
            f"--force replaces only what {command} wrote, and {str(path)!r} also holds {len(extra)} other file(s): "
            f"{', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}. Nothing was deleted: move them away or "
            f"choose another {flag}."
        )
    return sorted(present)


def _files_under(path: Path) -> list[str]:
    return sorted(str(p.relative_to(path)) for p in path.rglob("*") if p.is_file() or p.is_symlink() or not p.is_dir())


def claim_output_dir(folder: str | os.PathLike, command: str) -> None:
    """Mark `folder`, a folder `command` fills as it works (a training run), as that command's: its manifest names
    the command and no files. `check_clearable_dir` then lets the command clear it (e.g. --overwrite_output_dir);
    a folder already claimed is left as it is."""
    if read_output_manifest(folder) is None:
        atomic_write_file(
            Path(folder) / OUTPUT_MANIFEST,
            json.dumps({"format": _MANIFEST_FORMAT, "command": command, "files": []}, indent=1) + "\n",
        )


def check_clearable_dir(
    folder: str | os.PathLike, *, command: str, flag: str, keep: tuple[str, ...] = ()
) -> list[str]:
    """The entries of `folder` (not `keep`) that clearing it for `command` deletes; raises `OutputPathError` unless
    `command` wrote the folder (its manifest, see `claim_output_dir`)."""
    path = Path(folder)
    entries = sorted(p.name for p in path.iterdir() if p.name not in keep and p.name != OUTPUT_MANIFEST)
    manifest = read_output_manifest(path)
    if entries and (manifest is None or manifest["command"] != command):
        by = "no command of this package" if manifest is None else manifest["command"]
        raise OutputPathError(
            f"{flag} deletes only a folder that {command} wrote (it holds {OUTPUT_MANIFEST}); {str(path)!r} was "
            f"written by {by} (it holds {', '.join(entries[:5])}{' ...' if len(entries) > 5 else ''}). Nothing "
            "was deleted: remove it yourself or choose another folder."
        )
    return entries


def read_output_manifest(folder: str | os.PathLike) -> dict | None:
    """The manifest of a folder written through `atomic_output_dir` (`{"command": str, "files": [relative
    paths]}`), or None when there is none or it is not one (wrong JSON, types, or a path outside the folder)."""
    path = Path(folder) / OUTPUT_MANIFEST
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 16 * 1024 * 1024:
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("command"), str):
        return None
    files = data.get("files")
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return None
    if not all(is_inside_folder(folder, f) for f in files):
        return None
    return {"command": data["command"], "files": files}


def read_json_object(folder: str | os.PathLike, name: str, max_bytes: int, what: str, writer: str) -> dict:
    """The JSON object in `folder/name`, a file this project wrote, read back as untrusted input: a
    FileNotFoundError when it is missing (`writer`: the command that writes it), and a ValueError naming the file
    when it is a link leaving the folder, larger than `max_bytes` (`what` it should be), not JSON or not an
    object. Its fields are the caller's to check."""
    path = Path(folder) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: {folder} was not written by {writer}.")
    if not is_inside_folder(folder, name):
        raise ValueError(f"{path} points outside {folder}; refusing to read it.")
    if path.stat().st_size > max_bytes:
        raise ValueError(f"{path} is {path.stat().st_size} bytes: too large for {what}.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, ValueError) as error:
        raise ValueError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}.")
    return data


def is_inside_folder(folder: str | os.PathLike, relative: str) -> bool:
    """Whether the relative path `relative` (as read from a manifest) names something inside `folder`: no absolute
    path, no `..` leaving it, no symlink pointing out of it."""
    if not isinstance(relative, str) or not relative or "\x00" in relative or os.path.isabs(relative):
        return False
    root = _resolved(folder)
    target = _resolved(Path(folder) / relative)
    return target != root and root in target.parents


# ------------------------------------------------------------------------------------------------ atomic writes
def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def staging_path(output: str | os.PathLike, command: str) -> Path:
    """The hidden temporary sibling `command` writes `output` into (`.NAME.tmp-COMMAND`)."""
    output = Path(os.path.expanduser(os.fspath(output)))
    return output.with_name(f".{output.name}.tmp-{command}")


def start_output_dir(
    output: str | os.PathLike, *, command: str, force: bool = False, flag: str = "--output_dir"
) -> Path:
    """Check `output` (`check_output_dir`) and return an empty temporary sibling to write it into (a leftover of
    an interrupted run of `command` is removed first). `commit_output_dir` puts it in place; `discard_output_dir`
    removes it after a failure."""
    check_output_dir(output, command=command, force=force, flag=flag)
    staging = staging_path(output, command)
    staging.parent.mkdir(parents=True, exist_ok=True)
    if os.path.lexists(staging):
        if staging.is_dir() and not staging.is_symlink():
            shutil.rmtree(staging)
        else:
            staging.unlink()
    staging.mkdir()
    return staging


def discard_output_dir(output: str | os.PathLike, command: str) -> None:
    """Remove the temporary folder of an unfinished write of `output` by `command`, if any."""
    staging = staging_path(output, command)
    if staging.is_dir() and not staging.is_symlink():
        shutil.rmtree(staging, ignore_errors=True)


def commit_output_dir(
    staging: str | os.PathLike,
    output: str | os.PathLike,
    *,
    command: str,
    force: bool = False,
    flag: str = "--output_dir",
    log: Callable[[str], None] | None = print,
) -> Path:
    """Add the manifest to the complete folder `staging` and put it in place of `output` (checked again: absent,
    empty, or with `force` a folder `command` wrote, whose files are listed through `log` before they go). The old
    folder is swapped out in one step where the system can (Linux renameat2), else by two renames."""
    staging, output = Path(staging), Path(os.path.expanduser(os.fspath(output)))
    files = _files_under(staging)
    (staging / OUTPUT_MANIFEST).write_text(
        json.dumps({"format": _MANIFEST_FORMAT, "command": command, "files": files}, indent=1) + "\n"
    )
    # the folder may have changed while the command worked: check it again right before replacing it
    replaced = check_output_dir(output, command=command, force=force, flag=flag)
    if replaced and log is not None:
        log(f"--force: replacing {output} ({len(replaced)} file(s) {command} wrote before: {', '.join(replaced)})")
    if output.is_dir() and _exchange(staging, output):
        shutil.rmtree(staging)  # now the old output
    elif output.is_dir():
        old = output.with_name(f".{output.name}.old-{uuid.uuid4().hex[:8]}")
        output.rename(old)
        staging.rename(output)
        shutil.rmtree(old)
    else:
        staging.rename(output)
    return output


@contextlib.contextmanager
def atomic_output_dir(
    output: str | os.PathLike,
    *,
    command: str,
    force: bool = False,
    flag: str = "--output_dir",
    log: Callable[[str], None] | None = print,
) -> Iterator[Path]:
    """Write a folder atomically: yields a hidden temporary sibling of `output` to write into; when the block ends
    without an error, the manifest is added and the folder replaces `output` (checked with `check_output_dir`
    first: absent, empty, or with `force` a folder `command` wrote). On an error the temporary folder is removed
    and `output` is left as it was."""
    staging = start_output_dir(output, command=command, force=force, flag=flag)
    try:
        yield staging
        commit_output_dir(staging, output, command=command, force=force, flag=flag, log=log)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def atomic_write_file(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) through a hidden temporary sibling and `os.replace`: a reader sees the old file
    or the new one, never a part; on a failure the temporary file is removed."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
