"""Atomic training checkpoints that never execute code on load, resume resolution, rotation and checkpoint averaging.

A checkpoint is `run_dir/checkpoints/step_N/`:

- what `Accelerator.save_state` writes for the model and optimizer (`model.safetensors`, `optimizer.bin`, FSDP
  shards, the fp16 `scaler.pt`): tensors, loaded back with `torch.load(..., weights_only=True)` (safetensors for the
  model), so a tampered file is refused, never executed;
- `trainer_state.json`: the run's progress (step, epoch, position in the epoch, counters, validation history) and
  the learning-rate scheduler's state, as JSON;
- `rng_state_{rank}.json`: every process's random states (Python, NumPy, torch CPU and accelerator devices), as
  JSON;
- `checkpoint.json`: the step, the format version and the run's settings (`training/settings.py`), written last.

Accelerate's own pickles (`random_states_*.pkl`, and `custom_checkpoint_*.pkl` of objects registered for
checkpointing, which it unpickles with `weights_only=False`) are never written or read: the RNG files are deleted
before the checkpoint is published and nothing is registered. A checkpoint that depends on them (written by an
older train.py), or one where such files appear, is refused with a `CheckpointError` before anything is loaded.

A checkpoint is written into `checkpoints/.tmp_step_N/` and renamed when complete, so a run killed at any moment
leaves either a complete checkpoint or a temporary folder that is ignored (and removed on the next save).
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
MARKER = "checkpoint.json"
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state_{}.json"
FORMAT_VERSION = 2  # 1 (no "format" key): Accelerate's pickled RNG and registered-object states
PICKLED_STATE = ("random_states_*.pkl", "custom_checkpoint_*.pkl")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed safely: incomplete, damaged, tampered with or of an unsafe format."""


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


def resolve_resume(value: str | None, checkpoint_dir: str | os.PathLike) -> Path | None:
    """`--resume_from_checkpoint`: None → no resume; "latest" → the newest complete checkpoint of the run (None when
    there is none yet, so a restart loop can always pass it); a path → that checkpoint, which must be complete."""
    if not value:
        return None
    if value == "latest":
        return latest_checkpoint(checkpoint_dir)
    path = Path(value)
    if not path.is_dir() and (Path(checkpoint_dir) / value).is_dir():
        path = Path(checkpoint_dir) / value
    if not (path / MARKER).is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no {MARKER}); complete ones: "
                                f"{[p.name for _, p in list_checkpoints(checkpoint_dir)]}")
    return path


def _read_json(path: Path, what: str) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing: the checkpoint is incomplete or damaged ({what}).") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path} is not valid JSON ({err}): the checkpoint is damaged or was tampered "
                              f"with ({what}).") from None
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
            f"used, e.g. for translation (training/translate.py --model {path}) or checkpoint averaging.")
    planted = sorted(p.name for pattern in PICKLED_STATE for p in path.glob(pattern))
    if planted:  # never written by save_checkpoint, and Accelerate would unpickle custom_checkpoint_* freely
        raise CheckpointError(f"{path} holds pickled state files that train.py never writes ({', '.join(planted)}): "
                              f"the checkpoint was tampered with or mixed with another one. Nothing was loaded; "
                              f"remove these files (unopened) to resume from it.")
    return info


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
        "numpy": {"bit_generator": np_state["bit_generator"], "key": np_state["state"]["key"].tolist(),
                  "pos": int(np_state["state"]["pos"]), "has_gauss": int(np_state["has_gauss"]),
                  "gauss": float(np_state["gauss"])},
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
        np.random.set_state({"bit_generator": str(nps["bit_generator"]),
                             "state": {"key": np.asarray(nps["key"], dtype=np.uint32), "pos": int(nps["pos"])},
                             "has_gauss": int(nps["has_gauss"]), "gauss": float(nps["gauss"])})
        torch.set_rng_state(_unb64(state["torch"]))
        for name, _, set_all in _accelerator_rng():
            if name in state:
                set_all([_unb64(s) for s in state[name]])
    except (KeyError, TypeError, ValueError, RuntimeError, OverflowError) as err:
        raise CheckpointError(f"{where} is malformed ({type(err).__name__}: {err}): the checkpoint is damaged or "
                              f"was tampered with.") from None


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


def save_checkpoint(accelerator, checkpoint_dir: str | os.PathLike, step: int, info: dict | None = None,
                    trainer_state: dict | None = None) -> Path:
    """`accelerator.save_state` (model, optimizer) plus `trainer_state` (JSON) and every process's random states
    (JSON) into a temporary folder, then an atomic rename to `step_{step}`. Accelerate's pickled RNG files are
    removed before the rename. Collective: every process calls it."""
    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step}"
    tmp = checkpoint_dir / f".tmp_step_{step}"
    if accelerator.is_main_process:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in checkpoint_dir.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    (tmp / RNG_STATE.format(accelerator.process_index)).write_text(json.dumps(rng_state()), encoding="utf-8")
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for pattern in PICKLED_STATE:
            for file in tmp.glob(pattern):
                file.unlink()
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state or {}, indent=1), encoding="utf-8")
        for file in tmp.rglob("*"):  # flush the state files before the rename makes the checkpoint visible
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        marker = tmp / MARKER
        marker.write_text(json.dumps({"step": step, "format": FORMAT_VERSION, **(info or {})}, indent=2))
        with open(marker, "rb") as f:
            os.fsync(f.fileno())
        if final.exists():  # a checkpoint of this step from an earlier attempt: replace it
            old = checkpoint_dir / f".old_step_{step}"
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(checkpoint_dir)
    accelerator.wait_for_everyone()
    return final


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
        accelerator.load_state(str(path), load_kwargs={"weights_only": True})
    except pickle.UnpicklingError as err:
        raise CheckpointError(f"{path}: a state file was refused by torch.load(weights_only=True) ({err}); the "
                              f"checkpoint is damaged or was tampered with. Nothing in it was executed.") from None
    except Exception as err:  # noqa: BLE001 - any failure of a needed state file stops the resume, naming it
        raise CheckpointError(f"{path}: loading the model/optimizer state failed ({type(err).__name__}: "
                              f"{err}).") from err
    if rng is not None:
        set_rng_state(rng, str(rng_file))
    else:
        logging.getLogger(__name__).warning("%s has no random states of process %d; it keeps its own.", path,
                                            accelerator.process_index)
    return trainer_state


def rotate_checkpoints(checkpoint_dir: str | os.PathLike, keep_last: int,
                       protect: set[int] = frozenset()) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (and those whose step is in `protect`)."""
    if keep_last <= 0:
        return []
    found = list_checkpoints(checkpoint_dir)
    removed = []
    for step, path in found[:-keep_last]:
        if step in protect:
            continue
        # rename first so a kill during rmtree never leaves a half-deleted "complete" checkpoint
        trash = path.with_name(f".del_{path.name}")
        os.replace(path, trash)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(path)
    return removed


def weights_file(checkpoint: str | os.PathLike) -> Path:
    for name in WEIGHT_FILES:
        if (Path(checkpoint) / name).is_file():
            return Path(checkpoint) / name
    raise FileNotFoundError(f"No model weights ({', '.join(WEIGHT_FILES)}) in {checkpoint}; checkpoint averaging "
                            f"needs full (not sharded) model state: with FSDP use state_dict_type FULL_STATE_DICT.")


def load_weights(checkpoint: str | os.PathLike) -> dict[str, torch.Tensor]:
    path = weights_file(checkpoint)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    return torch.load(path, map_location="cpu", weights_only=True)


def average_checkpoints(checkpoints: list[str | os.PathLike]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the model weights of `checkpoints` (fairseq's average_checkpoints). Floating-point
    tensors are averaged in float64 and cast back; other tensors are taken from the last checkpoint."""
    if not checkpoints:
        raise ValueError("No checkpoints to average.")
    total: dict[str, torch.Tensor] = {}
    last: dict[str, torch.Tensor] = {}
    keys = None
    for checkpoint in checkpoints:
        weights = load_weights(checkpoint)
        if keys is None:
            keys = set(weights)
        elif set(weights) != keys:
            raise ValueError(f"{checkpoint} has different parameter names from {checkpoints[0]}.")
        for name, tensor in weights.items():
            if tensor.is_floating_point():
                total[name] = total[name] + tensor.double() if name in total else tensor.double().clone()
            last[name] = tensor
    return {name: (total[name] / len(checkpoints)).to(last[name].dtype) if name in total else last[name]
            for name in last}


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
