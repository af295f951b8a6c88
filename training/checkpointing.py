"""Atomic training checkpoints (Accelerate state), resume resolution, rotation and checkpoint averaging.

A checkpoint is `run_dir/checkpoints/step_N/`: everything `Accelerator.save_state` writes (model weights, optimizer,
scheduler, every process's RNG states, registered objects such as the data position) plus `checkpoint.json`. It is
written into `checkpoints/.tmp_step_N/` and renamed when complete, so a run killed at any moment leaves either a
complete checkpoint or a temporary folder that is ignored (and removed on the next save).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch

CHECKPOINT_RE = re.compile(r"^step_(\d+)$")
MARKER = "checkpoint.json"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp.bin")


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


def checkpoint_info(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / MARKER).read_text())


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


def save_checkpoint(accelerator, checkpoint_dir: str | os.PathLike, step: int, info: dict | None = None) -> Path:
    """`accelerator.save_state` into a temporary folder, then an atomic rename to `step_{step}`. Collective: every
    process calls it."""
    checkpoint_dir = Path(checkpoint_dir)
    final = checkpoint_dir / f"step_{step}"
    tmp = checkpoint_dir / f".tmp_step_{step}"
    if accelerator.is_main_process:
        checkpoint_dir.mkdir(parents=True, exist_ok=True)
        for stale in checkpoint_dir.glob(".tmp_step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        for file in tmp.iterdir():  # flush the state files before the rename makes the checkpoint visible
            if file.is_file():
                with open(file, "rb") as f:
                    os.fsync(f.fileno())
        marker = tmp / MARKER
        marker.write_text(json.dumps({"step": step, **(info or {})}, indent=2))
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
