"""A training checkpoint as a model: the run's config with the checkpoint's weights, for translating, scoring,
serving and averaging a checkpoint of a run (finished or still training).

    model, weights, tokenizer_dir = load_checkpoint_model("runs/en-de/checkpoints/step_4000")   # weights="ema"|"raw"

A checkpoint (`run_dir/checkpoints/step_N`, marked by `checkpoint.json`) holds weights, not a config: the config is
the run's `model_config/` (written when the run starts), else its `model/`. Its weights are the trained ones
(`model.safetensors`: "raw") and, in a run trained with `--ema_decay`, their moving average (`ema.safetensors`:
"ema"). The default is what the run's `model/` holds: the weights the run validated (`--eval_weights`, recorded in the
checkpoint's settings), so `--model RUN/checkpoints/step_N` translates like `RUN/model` when that is step N.
"""

from __future__ import annotations

import os
from pathlib import Path

from . import checkpointing

WEIGHT_KINDS = ("raw", "ema")


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` is a training checkpoint folder (it holds `checkpoint.json`)."""
    return (Path(path) / checkpointing.MARKER).is_file()


def run_config_dir(checkpoint: str | os.PathLike) -> Path:
    """The folder with the config of a checkpoint's model: its run's `model_config/`, else its run's `model/`; a
    `CheckpointError` naming both when neither has a config.json."""
    run_dir = Path(checkpoint).parent.parent
    candidates = [run_dir / checkpointing.MODEL_CONFIG_DIR, run_dir / "model"]
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    raise checkpointing.CheckpointError(
        f"{checkpoint} is a checkpoint, but neither {candidates[0]}/config.json nor {candidates[1]}/config.json "
        "(the run's config) exists; pass the run's model folder instead."
    )


def run_tokenizer_dir(checkpoint: str | os.PathLike) -> Path:
    """The tokenizer of a checkpoint's run: the one saved with the checkpoint, else the run's `tokenizer/`."""
    folder, _ = checkpointing.checkpoint_tokenizer(checkpoint)
    return folder if folder is not None else Path(checkpoint).parent.parent / checkpointing.TOKENIZER_DIR


def validated_weights(checkpoint: str | os.PathLike) -> str:
    """The weights the checkpoint's run validated and saves as its model: "ema" or "raw" (`--eval_weights`)."""
    settings = checkpointing.checkpoint_info(checkpoint).get("settings") or {}
    weights = settings.get("eval_weights")
    return weights if weights in WEIGHT_KINDS else "raw"


def check_weights(checkpoint: str | os.PathLike, weights: str | None) -> str:
    """`weights` (None: `validated_weights`) checked against what the checkpoint holds; a `CheckpointError` naming
    the choice when it holds no moving average."""
    from .ema import EMA_WEIGHTS

    weights = weights or validated_weights(checkpoint)
    if weights not in WEIGHT_KINDS:
        raise checkpointing.CheckpointError(f"weights={weights!r}: expected one of {WEIGHT_KINDS}")
    if weights == "ema" and not (Path(checkpoint) / EMA_WEIGHTS).is_file():
        raise checkpointing.CheckpointError(
            f"--weights ema: {checkpoint} holds no moving average of the weights ({EMA_WEIGHTS}): its run was not "
            "trained with --ema_decay; use --weights raw."
        )
    return weights


def read_weights(checkpoint: str | os.PathLike, weights: str) -> dict:
    """A checkpoint's trained weights ("raw") or their moving average ("ema") as a state dict, each file read
    through the checks of stored files (`state_files`; a `CheckpointError` naming a refused one)."""
    from . import state_files
    from .ema import EMA_WEIGHTS

    if weights == "raw":
        return checkpointing.load_weights(checkpoint)
    try:
        return state_files.load_safetensors(Path(checkpoint) / EMA_WEIGHTS)
    except state_files.RefusedFileError as err:
        raise checkpointing.CheckpointError(str(err)) from None


def load_checkpoint_model(checkpoint: str | os.PathLike, weights: str | None = None):
    """(model in eval mode, the weights used: "ema" or "raw", the run's tokenizer folder) of a checkpoint: the
    run's config and generation config with the checkpoint's `weights` (None: `validated_weights`)."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, GenerationConfig

    weights = check_weights(checkpoint, weights)
    config_dir = run_config_dir(checkpoint)
    model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(config_dir))
    if (config_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(config_dir)
    checkpointing.load_model_weights(model, read_weights(checkpoint, weights))
    return model.eval(), weights, run_tokenizer_dir(checkpoint)


__all__ = [
    "WEIGHT_KINDS",
    "check_weights",
    "is_checkpoint",
    "load_checkpoint_model",
    "read_weights",
    "run_config_dir",
    "run_tokenizer_dir",
    "validated_weights",
]
