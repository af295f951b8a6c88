"""Atomic training checkpoints that never execute code on load, and resume resolution (rotation:
`best_checkpoints.py`; averaging: `averaging.py`).

A checkpoint is `run_dir/checkpoints/step_N/`:

- what `Accelerator.save_state` writes for the model and optimizer (`model.safetensors`, `optimizer.bin`, FSDP
  shards, the fp16 `scaler.pt`): tensors, loaded back with `torch.load(..., weights_only=True)` (safetensors for the
  model), so a tampered file is refused, never executed;
- `trainer_state.json`: the run's progress (step, epoch, position in the epoch, counters, validation history) and
  the learning-rate scheduler's state, as JSON;
- `rng_state_{rank}.json`: every process's random states (Python, NumPy, torch CPU and accelerator devices), as
  JSON;
- `tokenizer/`: the run's tokenizer, saved with every checkpoint (a resume, into the run folder or a new one, uses
  it: `checkpoint_tokenizer`), its fingerprint in `checkpoint.json`'s `tokenizer`;
- `checkpoint.json`: the step, the format version, the run's settings (`hf_variants/training/settings.py`) and the
  manifest `files`: the size and SHA-256 of every other file of the checkpoint, written last.

Every file is untrusted when read back: a manifest entry must name a regular file inside the checkpoint folder (no
absolute path, no `..`, no symbolic link, device or FIFO: nothing outside is ever opened), every file of the
folder must be listed, and the JSON files are read only when they are regular files of at most `MAX_JSON_BYTES`.

Accelerate's own pickles (`random_states_*.pkl`, and `custom_checkpoint_*.pkl` of objects registered for
checkpointing, which it unpickles with `weights_only=False`) are never written or read: the RNG files are deleted
before the checkpoint is published and nothing is registered. A checkpoint that depends on them (written by an
older train.py), or one where such files appear, is refused with a `CheckpointError` before anything is loaded.

A checkpoint is written into `checkpoints/.tmp_step_N/` and renamed when complete, so a run killed at any moment
leaves either a complete checkpoint or a temporary folder that is ignored (and removed on the next save). Every file
and folder of it is fsync'ed before that rename (and `checkpoints/` after it), so a machine crash does not publish a
checkpoint whose files are not on disk either.

A resume checks the manifest first (`verify_checkpoint`: sizes, then digests) and names the damaged file, then
opens every file as the resume will, without loading tensors (`refused_files`, hf_variants/training/state_files.py:
a torch archive whose pickle is not one of tensors, a JSON file that does not parse, another tokenizer), naming
the refused file in our words (never a library's advice to load it unsafely); `--resume_from_checkpoint latest`
falls back past either to the newest checkpoint that passes (`resolve_resume`). Checkpoints written before the
manifest existed still resume: their weights (safetensors header) and torch archives (zip directory) are checked
for truncation instead. Measured on a `small`-preset checkpoint (86.8 MB: weights and Adam state) on a
busy 2-core machine: `save_checkpoint` 0.57 s, of which the SHA-256 of every file 0.22 s (the files are read back
from the page cache; SHA-256 runs at ~1.7 GB/s on an idle core with SHA-NI, CRC32 was only 1.6x faster here, the
read dominating); the same again at resume. Every file is digested, weights and optimizer state included: a flipped
bit there would otherwise resume silently.

A save that runs out of disk space (ENOSPC, or the `RuntimeError` torch's zip writer raises then) raises
`DiskFullError` naming the file being written, the checkpoint's size and the free space; the partial checkpoint is
removed and the previous ones are untouched. A save also warns beforehand when the free space is smaller than the
last checkpoint.
"""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from pathlib import Path
from typing import NoReturn

import numpy as np
import torch

from . import state_files

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
MARKER = "checkpoint.json"
MODEL_CONFIG_DIR = "model_config"  # run_dir/model_config: the run's model config, written when the run starts
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state_{}.json"
FORMAT_VERSION = 2  # 1 (no "format" key): Accelerate's pickled RNG and registered-object states
PICKLED_STATE = ("random_states_*.pkl", "custom_checkpoint_*.pkl")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")
MANIFEST = "files"  # checkpoint.json: {relative path: {"size": bytes, "sha256": hex}}
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer, saved with the checkpoint
TOKENIZER_KEY = "tokenizer"  # checkpoint.json: the tokenizer's fingerprint (cache_store.tokenizer_fingerprint)
MB = 1024 * 1024
MAX_JSON_BYTES = 256 * MB  # checkpoint.json, trainer_state.json, rng_state_*.json (a few KB to a few MB)

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed safely: incomplete, damaged, tampered with or of an unsafe format."""


class DiskFullError(CheckpointError):
    """A checkpoint could not be written: no space left on the device (or the disk quota is exhausted)."""

    exit_code = 1  # of the command line (a refused checkpoint: 2)


def atomic_write(path: str | os.PathLike, data: bytes | str) -> None:
    """Write `data` (text as UTF-8) through a hidden temporary sibling and `os.replace`: a reader sees the old file
    or the new one, never a part."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    if isinstance(data, str):
        tmp.write_text(data, encoding="utf-8")
    else:
        tmp.write_bytes(data)
    os.replace(tmp, path)


def list_checkpoints(checkpoint_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints `(step, path)`, oldest first."""
    checkpoint_dir = Path(checkpoint_dir)
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for path in checkpoint_dir.iterdir():
        match = CHECKPOINT_RE.match(path.name)
        if match and path.is_dir() and (path / MARKER).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(checkpoint_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(checkpoint_dir)
    return found[-1][1] if found else None


def resolve_resume(
    value: str | None, checkpoint_dir: str | os.PathLike, skipped: list[str] | None = None
) -> Path | None:
    """`--resume_from_checkpoint`: None → no resume; "latest" → the newest intact checkpoint of the run (None when
    there is none yet, so a restart loop can always pass it), skipping damaged ones with a warning that names the
    damaged file (appended to `skipped` instead of logged when a list is given); a path → that checkpoint, which
    must be complete and intact (else a `CheckpointError` naming the file). train.py calls it on the main process
    only (it reads every file of the checkpoint)."""
    if not value:
        return None
    if value == "latest":
        damaged = []
        for _, path in reversed(list_checkpoints(checkpoint_dir)):
            try:
                check_resumable(path)
            except CheckpointError as err:  # an unreadable checkpoint.json, a refused (e.g. pickled) file
                damaged.append(str(err))
                continue
            problems = damaged_files(path)
            if problems:
                damaged.append(f"Checkpoint {path} is damaged: " + "; ".join(problems))
                continue
            problems = refused_files(path)
            if problems:  # a file that would be refused on load (a planted pickle): passed over the same way
                damaged.append(f"Checkpoint {path} cannot be resumed: " + "; ".join(problems))
                continue
            for message in damaged:
                message = f"{message}; resuming from the newest intact checkpoint, {path.name}, instead."
                logger.warning(message) if skipped is None else skipped.append(message)
            return path
        if damaged:
            raise CheckpointError("No intact checkpoint to resume from:\n" + "\n".join(damaged))
        return None
    path = Path(value)
    if not path.is_dir() and (Path(checkpoint_dir) / value).is_dir():
        path = Path(checkpoint_dir) / value
    if not (path / MARKER).is_file():
        raise FileNotFoundError(
            f"{path} is not a complete checkpoint (no {MARKER}); complete ones: "
            f"{[p.name for _, p in list_checkpoints(checkpoint_dir)]}"
        )
    verify_checkpoint(path)
    return path


# ------------------------------------------------------------------------------------------- integrity checks
def file_digest(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 * MB):
            h.update(chunk)
    return h.hexdigest()


def _structure_problem(path: Path) -> str | None:
    """A cheap check of a state file that has no manifest entry: a safetensors file must be as long as its header
    says, a torch archive (zip) must have its central directory. None when it looks whole (or is of another
    kind)."""
    import struct
    import zipfile

    size = path.stat().st_size
    if path.suffix == ".safetensors":
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > size - 8:
                    return f"{path}: its header is cut off ({size} bytes, header {n} bytes: truncated?)"
                header = json.loads(f.read(n))
            end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
        except (struct.error, ValueError, KeyError, TypeError, IndexError, MemoryError, OverflowError) as err:
            return f"{path}: not a valid safetensors file ({type(err).__name__}: {err}; {size} bytes: truncated?)"
        if size != 8 + n + end:
            return (
                f"{path}: size {size} bytes, expected {8 + n + end} from its header"
                f"{' (truncated?)' if size < 8 + n + end else ''}"
            )
    elif path.suffix in (".bin", ".pt"):
        try:
            with zipfile.ZipFile(path) as archive:
                archive.infolist()
        except (zipfile.BadZipFile, OSError, ValueError) as err:
            return f"{path}: not a complete torch archive ({err}; {size} bytes: truncated?)"
    return None


def _entry_problem(folder: Path, name) -> str | None:
    """Why manifest entry `name` of `folder` must not be opened: not a relative path inside the folder (absolute,
    `..`, through a symbolic link), or not a regular file (a link, device, FIFO, folder). None when it may be read
    (or is missing: the caller reports that)."""
    import stat

    if not isinstance(name, str) or not name or "\x00" in name:
        return f"{folder / MARKER}: a listed file name is not a path ({name!r})"
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts or name != rel.as_posix():
        return f"{folder / MARKER}: listed file {name!r} is not a plain relative path inside the checkpoint: refused"
    file = folder / rel
    try:
        inside = file.resolve(strict=False).is_relative_to(folder.resolve())
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        return f"{file}: resolves outside the checkpoint folder (a symbolic link?): refused, not opened"
    try:
        mode = os.lstat(file).st_mode
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"{file}: cannot be inspected ({err})"
    if not stat.S_ISREG(mode):
        kind = "a symbolic link" if stat.S_ISLNK(mode) else "a folder" if stat.S_ISDIR(mode) else "not a regular file"
        return f"{file}: {kind} (a checkpoint holds regular files only): refused, not opened"
    return None


def _unlisted_files(folder: Path, files: dict) -> list[str]:
    """Entries of `folder` that the manifest does not list (never written by `save_checkpoint`): each named."""
    import stat

    problems = []
    for entry in sorted(folder.rglob("*")):
        rel = entry.relative_to(folder).as_posix()
        try:
            mode = os.lstat(entry).st_mode
        except OSError:
            continue
        if stat.S_ISDIR(mode) or rel == MARKER or rel in files:
            continue
        problems.append(f"{entry}: not listed in {MARKER} (never written by a save): the checkpoint was tampered with")
    return problems


def damaged_files(path: str | os.PathLike) -> list[str]:
    """What is wrong with the files of a complete checkpoint, one line per file naming it ([] when intact): each
    file of the manifest must be a regular file inside the checkpoint folder (`_entry_problem`: nothing else is
    opened) with its recorded size and SHA-256, and every file of the folder must be listed; a checkpoint written
    before manifests existed gets `_structure_problem`'s checks (regular files only)."""
    import stat

    path = Path(path)
    files = checkpoint_info(path).get(MANIFEST)
    if files is None:
        problems = []
        for file in sorted(path.rglob("*")):
            mode = os.lstat(file).st_mode
            if file.name == MARKER or stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                problems.append(f"{file}: not a regular file (a checkpoint holds regular files only): refused")
            elif problem := _structure_problem(file):
                problems.append(problem)
        return problems
    if not isinstance(files, dict):
        return [f"{path / MARKER}: '{MANIFEST}' must be an object, got {type(files).__name__}"]
    problems = []
    for name, meta in files.items():
        refused = _entry_problem(path, name)
        if refused:
            problems.append(refused)
            continue
        file = path / name
        try:
            size = os.lstat(file).st_size
        except FileNotFoundError:
            problems.append(f"{file}: missing (listed in {MARKER})")
            continue
        expected = meta.get("size") if isinstance(meta, dict) else None
        if isinstance(expected, bool) or not isinstance(expected, int):
            problems.append(f"{path / MARKER}: the recorded size of {name!r} is not an integer ({expected!r})")
            continue
        if size != expected:
            problems.append(
                f"{file}: size {size} bytes, expected {expected}"
                f"{' (truncated?)' if isinstance(expected, int) and size < expected else ''}"
            )
        elif isinstance(meta, dict) and meta.get("sha256") and file_digest(file) != meta["sha256"]:
            problems.append(
                f"{file}: SHA-256 differs from the one recorded at save (the content changed: "
                f"damaged on disk or in a copy)"
            )
    return problems + _unlisted_files(path, files)


def refused_files(path: str | os.PathLike) -> list[str]:
    """One line per file of an intact checkpoint that a resume would refuse (`state_files.file_problems`: a torch
    archive whose pickle is not one of tensors, a safetensors or JSON file that does not parse, a tokenizer other
    than the recorded one), each naming the file; [] when every file loads."""
    info = checkpoint_info(path)
    recorded = info.get(TOKENIZER_KEY)
    return state_files.file_problems(path, TOKENIZER_DIR, recorded if isinstance(recorded, str) else None)


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """`check_resumable(path)`, then `damaged_files(path)` and `refused_files(path)`: a `CheckpointError` naming
    every damaged or refused file."""
    info = check_resumable(path)
    problems = damaged_files(path)
    if problems:
        raise CheckpointError(f"Checkpoint {path} is damaged: " + "; ".join(problems))
    problems = refused_files(path)
    if problems:
        raise CheckpointError(f"Checkpoint {path} cannot be resumed: " + "; ".join(problems))
    return info


def _manifest_and_flush(folder: Path) -> dict:
    """The manifest of every file under `folder` (sizes and SHA-256), each file fsync'ed, then every folder (the
    deepest first): nothing of it is published before it is on disk."""
    files = {}
    for file in sorted(folder.rglob("*")):
        if file.is_file():
            h = hashlib.sha256()
            with open(file, "rb") as f:
                while chunk := f.read(8 * MB):
                    h.update(chunk)
                os.fsync(f.fileno())
            files[file.relative_to(folder).as_posix()] = {"size": file.stat().st_size, "sha256": h.hexdigest()}
    for sub in sorted((d for d in folder.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts)):
        _fsync_dir(sub)
    return files


def _read_json(path: Path, what: str) -> dict:
    import stat

    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path} is not a regular file ({what}): refused, not opened.")
        if st.st_size > MAX_JSON_BYTES:
            raise CheckpointError(
                f"{path} is {st.st_size} bytes, more than a checkpoint's JSON file can be ({MAX_JSON_BYTES} bytes; "
                f"{what}): damaged or tampered with."
            )
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or damaged ({what}).") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise CheckpointError(
            f"{path} is not valid JSON ({err}): the checkpoint is damaged or was tampered with ({what})."
        ) from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path} must hold a JSON object ({what}), got {type(value).__name__}.")
    return value


def checkpoint_info(path: str | os.PathLike) -> dict:
    """The checkpoint's `checkpoint.json` (step, format, settings, ...)."""
    return _read_json(Path(path) / MARKER, "the checkpoint's marker")


def check_resumable(path: str | os.PathLike) -> dict:
    """`checkpoint_info` of a checkpoint written in the current, pickle-free format; a `CheckpointError` for one
    written by an older train.py (its state is pickled, and unpickling can run code)."""
    path = Path(path)
    info = checkpoint_info(path)
    if info.get("format") != FORMAT_VERSION:
        pickled = sorted(p.name for pattern in PICKLED_STATE for p in path.glob(pattern))
        raise CheckpointError(
            f"{path} is a checkpoint of format {info.get('format', 1)} (this train.py resumes format "
            f"{FORMAT_VERSION}){': its state is pickled (' + ', '.join(pickled) + ')' if pickled else ''}. It is "
            f"not resumed, because loading a pickle can execute code. Its model weights "
            f"({', '.join(n for n in WEIGHT_FILES if (path / n).is_file()) or 'none found'}) can still be "
            f"used, e.g. for translation (training/translate.py --model {path}) or checkpoint averaging."
        )
    planted = sorted(str(p) for pattern in PICKLED_STATE for p in path.glob(pattern))
    if planted:  # never written by save_checkpoint, and Accelerate would unpickle custom_checkpoint_* freely
        raise CheckpointError(
            f"{path} holds pickled state files that train.py never writes ({', '.join(planted)}): "
            f"the checkpoint was tampered with or mixed with another one. Nothing was loaded; "
            f"remove these files (unopened) to resume from it."
        )
    return info


def checkpoint_tokenizer(path: str | os.PathLike) -> tuple[Path | None, str | None]:
    """The tokenizer a checkpoint was trained with: (its folder, its recorded fingerprint). The folder is the one
    saved with the checkpoint, else (a checkpoint written before tokenizers were saved with them) its run folder's
    (`run/checkpoints/step_N` → `run/tokenizer`); None when neither exists. The fingerprint is None for a
    checkpoint that did not record it."""
    path = Path(path)
    fingerprint = checkpoint_info(path).get(TOKENIZER_KEY)
    fingerprint = fingerprint if isinstance(fingerprint, str) else None
    for folder in (path / TOKENIZER_DIR, path.parent.parent / TOKENIZER_DIR):
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            return folder, fingerprint
    return None, fingerprint


# ---------------------------------------------------------------------------------------------- random states
def _b64(tensor: torch.Tensor) -> str:
    return base64.b64encode(tensor.cpu().contiguous().numpy().tobytes()).decode("ascii")


def _unb64(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text.encode("ascii"), validate=True)), dtype=torch.uint8)


def _accelerator_rng():
    """(name, get_all, set_all) of the accelerator devices present (CUDA, XPU, MPS)."""
    found = []
    if torch.cuda.is_available():
        found.append(("cuda", torch.cuda.get_rng_state_all, torch.cuda.set_rng_state_all))
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        found.append(("xpu", torch.xpu.get_rng_state_all, torch.xpu.set_rng_state_all))
    if torch.backends.mps.is_available():
        found.append(("mps", lambda: [torch.mps.get_rng_state()], lambda states: torch.mps.set_rng_state(states[0])))
    return found


def rng_state() -> dict:
    """This process's random states as JSON-able data: Python's `random`, NumPy's global generator, torch's CPU
    generator and those of the accelerator devices present."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": {"version": version, "state": list(internal), "gauss_next": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": np_state["state"]["key"].tolist(),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": _b64(torch.get_rng_state()),
    }
    for name, get_all, _ in _accelerator_rng():
        state[name] = [_b64(s) for s in get_all()]
    return state


def set_rng_state(state: dict, where: str = "the RNG state") -> None:
    """Restore what `rng_state` returned; a `CheckpointError` naming `where` if any part is malformed."""
    try:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"]), py["gauss_next"]))
        nps = state["numpy"]
        np.random.set_state(
            {
                "bit_generator": str(nps["bit_generator"]),
                "state": {"key": np.asarray(nps["key"], dtype=np.uint32), "pos": int(nps["pos"])},
                "has_gauss": int(nps["has_gauss"]),
                "gauss": float(nps["gauss"]),
            }
        )
        torch.set_rng_state(_unb64(state["torch"]))
        for name, _, set_all in _accelerator_rng():
            if name in state:
                set_all([_unb64(s) for s in state[name]])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise CheckpointError(
            f"{where} is malformed ({type(err).__name__}: {err}): the checkpoint is damaged or was tampered with."
        ) from None


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def checkpoint_size(path: str | os.PathLike) -> int:
    """Bytes of a checkpoint's files (its manifest, else what is on disk)."""
    path = Path(path)
    try:
        files = checkpoint_info(path).get(MANIFEST)
    except CheckpointError:
        files = None
    if isinstance(files, dict):
        return sum(
            meta["size"] for meta in files.values() if isinstance(meta, dict) and isinstance(meta.get("size"), int)
        )
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _estimated_size(accelerator, checkpoint_dir: Path) -> int:
    """Bytes the next checkpoint will take: the last one's size, else this process's model and optimizer tensors."""
    last = latest_checkpoint(checkpoint_dir)
    if last is not None:
        return checkpoint_size(last)
    total = 0
    for model in accelerator._models:
        total += sum(t.numel() * t.element_size() for t in model.parameters())
    for optimizer in accelerator._optimizers:
        for state in optimizer.state.values():
            total += sum(t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor))
    return total


def _is_disk_full(err: BaseException, folder: Path, needed: int) -> bool:
    """ENOSPC/EDQUOT, or an error of a writer that hides the errno (torch's zip writer: "[enforce fail at
    inline_container.cc] unexpected pos", safetensors' "IoError(Os { code: 28 ... })") on a file system that now
    has less free space than the checkpoint needs."""
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(err)
    if "No space left on device" in text or "StorageFull" in text or "Disk quota exceeded" in text:
        return True
    if isinstance(err, RuntimeError) and any(s in text for s in ("unexpected pos", "enforce fail", "failed writing")):
        try:
            return shutil.disk_usage(folder if folder.exists() else folder.parent).free < needed
        except OSError:
            return False
    return False


def _file_being_written(err: BaseException, folder: Path) -> Path:
    name = getattr(err, "filename", None)
    if name:
        return Path(name)
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    return max(files, key=lambda f: f.stat().st_mtime_ns) if files else folder


def _any_failed(accelerator, failed: bool) -> bool:
    """Whether any process failed (a collective every process must reach)."""
    if accelerator.num_processes == 1:
        return failed
    flag = torch.tensor([1.0 if failed else 0.0], device=accelerator.device)
    return bool(accelerator.reduce(flag, "sum").item() > 0)


def _prepare_checkpoint_dir(accelerator, checkpoint_dir: Path, step: int, needed: int) -> None:
    """On the main process: create `checkpoint_dir`, remove the temporary folders of interrupted saves and warn
    when the free space is smaller than a checkpoint (`needed` bytes)."""
    if not accelerator.is_main_process:
        return
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    for stale in checkpoint_dir.glob(".tmp_step_*"):
        shutil.rmtree(stale, ignore_errors=True)
    free = shutil.disk_usage(checkpoint_dir).free
    if free < needed:
        logger.warning(
            "Only %.1f MB free on the file system of %s, and a checkpoint takes about %.1f MB: saving "
            "step %d will probably fail. Free some space (or lower --keep_checkpoints).",
            free / MB,
            checkpoint_dir,
            needed / MB,
            step,
        )


def _write_process_part(accelerator, tmp: Path) -> Exception | None:
    """This process's part of the checkpoint in `tmp`: `accelerator.save_state` and its random states (JSON). The
    error (None: written) is returned so that every process learns of it (`_any_failed`)."""
    try:
        accelerator.save_state(str(tmp))
        (tmp / RNG_STATE.format(accelerator.process_index)).write_text(json.dumps(rng_state()), encoding="utf-8")
    except Exception as err:  # noqa: BLE001 - every process learns in save_checkpoint that the save failed
        import traceback

        seen = err
        while seen is not None:  # drop the writers' frames: their files close (and their space is freed later)
            traceback.clear_frames(seen.__traceback__)
            seen = seen.__context__
        return err
    return None


def _seal_checkpoint(
    tmp: Path,
    step: int,
    info: dict | None,
    trainer_state: dict | None,
    tokenizer_dir: Path | None = None,
    extra_files: dict | None = None,
) -> None:
    """On the main process, once every part is in `tmp`: remove Accelerate's pickled RNG files, write the trainer
    state and `extra_files` ({name: tensors}, safetensors), copy the run's tokenizer (the files of `tokenizer_dir`),
    write the marker with the manifest, and fsync every file and folder."""
    for pattern in PICKLED_STATE:
        for file in tmp.glob(pattern):
            file.unlink()
    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state or {}, indent=1), encoding="utf-8")
    if extra_files:
        from safetensors.torch import save_file

        for name, tensors in extra_files.items():
            save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(tmp / name))
    if tokenizer_dir is not None:
        (tmp / TOKENIZER_DIR).mkdir()
        for file in sorted(tokenizer_dir.iterdir()):
            if file.is_file():
                shutil.copyfile(file, tmp / TOKENIZER_DIR / file.name)
    files = _manifest_and_flush(tmp)
    marker = tmp / MARKER
    marker.write_text(json.dumps({"step": step, "format": FORMAT_VERSION, **(info or {}), MANIFEST: files}, indent=2))
    with open(marker, "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _publish_checkpoint(tmp: Path, final: Path, checkpoint_dir: Path, step: int) -> None:
    """Rename the sealed `tmp` to `final` (replacing a checkpoint of this step from an earlier attempt) and fsync
    `checkpoint_dir`."""
    if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
        old = checkpoint_dir / f".old_step_{step}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(checkpoint_dir)


def _raise_save_failure(
    accelerator, error: BaseException | None, tmp: Path, checkpoint_dir: Path, step: int, needed: int
) -> NoReturn:
    """After a failed save (collective): remove the partial checkpoint and raise `DiskFullError` (this process ran
    out of space), or `CheckpointError` (`error` None: another process failed)."""
    full = error is not None and _is_disk_full(error, tmp if tmp.exists() else checkpoint_dir, needed)
    file = _file_being_written(error, tmp) if full else None
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    previous = latest_checkpoint(checkpoint_dir)
    kept = (
        f"the previous checkpoint, {previous.name}, is intact: free some space (or lower --keep_checkpoints, "
        f"or move the run to a larger disk) and resume with --resume_from_checkpoint latest"
        if previous is not None
        else "there is no earlier checkpoint"
    )
    if error is None:
        raise CheckpointError(
            f"Checkpoint step_{step} was not saved: another process failed to write its part (see "
            f"its error); the partial checkpoint was removed and {kept}."
        )
    if full:
        free = shutil.disk_usage(checkpoint_dir).free
        what = "disk quota exceeded" if getattr(error, "errno", None) == errno.EDQUOT else "no space left on device"
        raise DiskFullError(
            f"Checkpoint step_{step} not saved: {what} while writing {file} (needed ≈ "
            f"{needed / MB:.1f} MB, free {free / MB:.1f} MB). The partial checkpoint was removed; "
            f"{kept}."
        ) from error
    raise CheckpointError(
        f"Checkpoint step_{step} not saved ({type(error).__name__}: {error}); the partial "
        f"checkpoint was removed and {kept}."
    ) from error


def save_checkpoint(
    accelerator,
    checkpoint_dir: str | os.PathLike,
    step: int,
    info: dict | None = None,
    trainer_state: dict | None = None,
    tokenizer_dir: str | os.PathLike | None = None,
    extra_files: dict | None = None,
) -> Path:
    """`accelerator.save_state` (model, optimizer) plus `trainer_state` (JSON) and every process's random states
    (JSON) into a temporary folder; then the manifest (sizes, SHA-256) goes into `checkpoint.json`, every file and
    folder is fsync'ed and the folder is renamed to `step_{step}`. Accelerate's pickled RNG files are removed
    before the rename. `tokenizer_dir`: the run's saved tokenizer, copied into the checkpoint's `tokenizer/`;
    `extra_files`: {file name: {name: tensor}} written by the main process as safetensors (e.g. `ema.safetensors`).
    Collective: every process calls it; when any process fails to write its part (e.g. a full disk:
    `DiskFullError`), the temporary folder is removed and every process raises."""
    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step}"
    tmp = checkpoint_dir / f".tmp_step_{step}"
    needed = _estimated_size(accelerator, checkpoint_dir)
    _prepare_checkpoint_dir(accelerator, checkpoint_dir, step, needed)
    accelerator.wait_for_everyone()
    error = _write_process_part(accelerator, tmp)
    if not _any_failed(accelerator, error is not None) and accelerator.is_main_process:
        try:
            tokenizer = Path(tokenizer_dir) if tokenizer_dir else None
            _seal_checkpoint(tmp, step, info, trainer_state, tokenizer, extra_files)
        except Exception as err:  # noqa: BLE001 - every process learns below that the save failed
            error = err
        else:
            _publish_checkpoint(tmp, final, checkpoint_dir, step)
    if not _any_failed(accelerator, error is not None):
        return final
    _raise_save_failure(accelerator, error, tmp, checkpoint_dir, step, needed)


def load_checkpoint(accelerator, path: str | os.PathLike, missing_rng_ok: bool = False) -> dict:
    """Restore a checkpoint written by `save_checkpoint` and return its trainer state (the JSON dict).

    Model and optimizer states go through `accelerator.load_state` with `weights_only=True` (safetensors for the
    model); nothing is registered with Accelerate, so it unpickles no custom objects; the random states come from
    this process's JSON file. Any file that is missing, malformed or refused by `weights_only` raises a
    `CheckpointError` (nothing is skipped silently). `missing_rng_ok`: a process without an RNG file (the run now
    has more processes than when it was saved) keeps its current random state instead, with a warning."""
    import logging

    path = Path(path)
    check_resumable(path)
    trainer_state = _read_json(path / TRAINER_STATE, "the run's progress and scheduler state")
    rng_file = path / RNG_STATE.format(accelerator.process_index)
    rng = None
    if rng_file.is_file() or not missing_rng_ok:
        rng = _read_json(rng_file, f"the random states of process {accelerator.process_index}")
    try:
        with warnings.catch_warnings():  # torch's warnings about a pickle's protocol: the refusal below says it
            warnings.simplefilter("ignore")
            accelerator.load_state(str(path), load_kwargs={"weights_only": True})
    except Exception as err:  # noqa: BLE001 - any failure of a needed state file stops the resume, naming it
        # the file and our reason; never the library's text (torch advises weights_only=False: running the file)
        refused = _failing_state_file(path)
        if refused is not None:
            raise CheckpointError(str(refused)) from None
        raise CheckpointError(
            f"{path}: loading the model/optimizer state failed: {state_files.refusal_reason(err)}."
        ) from None
    if rng is not None:
        set_rng_state(rng, str(rng_file))
    else:
        logging.getLogger(__name__).warning(
            "%s has no random states of process %d; it keeps its own.", path, accelerator.process_index
        )
    return trainer_state


def _failing_state_file(path: Path) -> state_files.RefusedFileError | None:
    """After `load_state` failed: the refusal of the first state file that does not load on its own (safetensors,
    or torch.load with weights_only=True), naming it."""
    for file in sorted(path.rglob("*")):
        if file.suffix not in (state_files.SAFETENSORS_SUFFIX, *state_files.TORCH_SUFFIXES) or not file.is_file():
            continue
        try:
            if file.suffix == state_files.SAFETENSORS_SUFFIX:
                state_files.load_safetensors(file)
            else:
                state_files.load_torch_file(file)
        except state_files.RefusedFileError as err:  # this is the file that fails
            return err
    return None


def weights_file(checkpoint: str | os.PathLike) -> Path:
    for name in WEIGHT_FILES:
        if (Path(checkpoint) / name).is_file():
            return Path(checkpoint) / name
    raise FileNotFoundError(
        f"No model weights ({', '.join(WEIGHT_FILES)}) in {checkpoint}; checkpoint averaging "
        f"needs full (not sharded) model state: with FSDP use state_dict_type FULL_STATE_DICT."
    )


def load_weights(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The model weights of a checkpoint; a `CheckpointError` naming the file when it is refused."""
    path = weights_file(checkpoint)
    try:
        if path.suffix == state_files.SAFETENSORS_SUFFIX:
            return state_files.load_safetensors(path)
        return state_files.load_torch_file(path)
    except state_files.RefusedFileError as err:
        raise CheckpointError(str(err)) from None


def load_model_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Load a state dict saved by Accelerate into `model`. Keys left out of the file because they share storage with
    a saved tensor (tied embeddings) are accepted; anything else missing or unexpected raises."""
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"Unexpected weights: {result.unexpected_keys[:10]}")
    if result.missing_keys:
        params = dict(model.named_parameters(remove_duplicate=False))
        params.update(dict(model.named_buffers(remove_duplicate=False)))
        saved = {params[k].data_ptr() for k in weights if k in params}
        really_missing = [k for k in result.missing_keys if k not in params or params[k].data_ptr() not in saved]
        persistent = {k for k, _ in model.state_dict().items()}
        really_missing = [k for k in really_missing if k in persistent]
        if really_missing:
            raise ValueError(f"Weights missing from the checkpoint: {really_missing[:10]}")
    if hasattr(model, "tie_weights"):
        model.tie_weights()
