"""Checkpoint averaging and the choice of a run's final weights.

`average_checkpoints` is the one implementation behind `hf-variants-average` and train.py's `--average_last`: the
element-wise arithmetic mean of the model weights of K checkpoints (fairseq's `average_checkpoints.py`,
OpenNMT-py's `average_models`, `sockeye-average`), computed in float32 and reading one tensor at a time (a
safetensors file is opened, not loaded; a torch archive is memory-mapped), so the peak memory is the float32 sum (one
model) plus one tensor, whatever K is. The mean is `(w_1 + w_2 + ... + w_K) / K` evaluated left to right in float32:
exactly what that expression gives on float32 tensors. Integer tensors (none in these models) are taken from the last
checkpoint.

A checkpoint's weights are its model weights (`model.safetensors`) or, in a run trained with `--ema_decay`, its
exponential moving average of them (`ema.safetensors`, `hf_variants/training/ema.py`): `weights="raw"` or `"ema"`.

`final_weights` picks the final model of a run from its checkpoints: `--average_last K`, else `--final_model best`
(the best validated checkpoint: hf_variants/training/final_choice.py) or `last`, each in the weights `--eval_weights`
names.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from . import checkpointing
from .checkpoint_models import run_config_dir
from .ema import EMA_WEIGHTS

WEIGHT_KINDS = ("raw", "ema")
COMMAND = "average"  # recorded in the output folder's manifest: what `--force` may replace


class AveragingError(ValueError):
    """Checkpoints that cannot be averaged (other parameter names or shapes, no such weights, ...)."""


def weights_file(checkpoint: str | os.PathLike, weights: str = "raw") -> Path:
    """The file of a checkpoint's model weights (`raw`) or of its moving average (`ema`)."""
    if weights == "ema":
        path = Path(checkpoint) / EMA_WEIGHTS
        if not path.is_file():
            raise AveragingError(
                f"{checkpoint} holds no moving average of the weights ({EMA_WEIGHTS}): its run was not trained with "
                f"--ema_decay. Use its model weights (--weights raw)."
            )
        return path
    try:
        return checkpointing.weights_file(checkpoint)
    except FileNotFoundError as error:
        raise AveragingError(str(error)) from None


@contextlib.contextmanager
def open_weights(path: Path) -> Iterator[tuple[list[str], callable]]:
    """(tensor names, get(name) -> tensor) of a weights file, reading one tensor at a time: safetensors through
    `safe_open`, a torch archive memory-mapped with `weights_only=True`."""
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            yield list(f.keys()), f.get_tensor
        return
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    try:
        yield list(state), state.__getitem__
    finally:
        del state


def load_weights(checkpoint: str | os.PathLike, weights: str = "raw") -> dict[str, torch.Tensor]:
    """A checkpoint's model weights or moving average, as a state dict."""
    path = weights_file(checkpoint, weights)
    with open_weights(path) as (names, get):
        return {name: get(name) for name in names}


def average_checkpoints(checkpoints: Sequence[str | os.PathLike], weights: str = "raw") -> dict[str, torch.Tensor]:
    """The float32 mean of the `weights` of `checkpoints` (see the module docstring); an `AveragingError` naming
    both checkpoints when they differ in parameter names or shapes."""
    if not checkpoints:
        raise AveragingError("No checkpoints to average.")
    total: dict[str, torch.Tensor] = {}
    first_names, first = None, Path(checkpoints[0])
    for checkpoint in checkpoints:
        path = weights_file(checkpoint, weights)
        with open_weights(path) as (names, get):
            if first_names is None:
                first_names = set(names)
            elif set(names) != first_names:
                extra, missing = sorted(set(names) - first_names), sorted(first_names - set(names))
                raise AveragingError(
                    f"{checkpoint} and {first} hold different tensors (only in {Path(checkpoint).name}: "
                    f"{extra[:3]}; only in {first.name}: {missing[:3]}): they are not checkpoints of one model."
                )
            for name in names:
                tensor = get(name)
                if name not in total:
                    total[name] = tensor.to(torch.float32, copy=True) if tensor.is_floating_point() else tensor
                    continue
                if tensor.shape != total[name].shape:
                    raise AveragingError(
                        f"{name} has shape {tuple(tensor.shape)} in {checkpoint} and {tuple(total[name].shape)} in "
                        f"{first}: they are not checkpoints of one model."
                    )
                if tensor.is_floating_point():
                    total[name] += tensor.to(torch.float32)
                else:
                    total[name] = tensor  # integer tensors: the last checkpoint's
                del tensor
    count = len(checkpoints)
    for value in total.values():
        if value.is_floating_point():
            value /= count
    return total


# ------------------------------------------------------------------------------------------- the final model
def final_weights(trainer) -> tuple[dict[str, torch.Tensor], str]:
    """(weights, what they are) of the run's final model, from its checkpoints (the last step is always
    checkpointed): `--average_last K`, else `--final_model best` (when a validation ranked one) or `last`, in
    the weights `--eval_weights` names (the moving average with `--ema_decay`, by default)."""
    import logging

    args, state, checkpoint_dir = trainer.args, trainer.state, trainer.run.checkpoint_dir
    kind = getattr(args, "eval_weights", None) or "raw"
    of = "EMA weights of " if kind == "ema" else ""
    if args.average_last and args.average_last > 1:
        chosen = own_checkpoints(checkpoint_dir, trainer.run_id)[-args.average_last :]
        if len(chosen) < args.average_last:
            logging.getLogger("hf_variants.train").warning(
                "--average_last %d: only %d checkpoints exist; averaging those", args.average_last, len(chosen)
            )
        return average_checkpoints(chosen, kind), f"average of {of}{', '.join(p.name for p in chosen)}"
    if args.final_model == "best" and state.best_step is not None:
        from .final_choice import choose  # the ranking's best, or the best candidate on the whole validation set

        step = choose(trainer, kind)
        what = f"best validated checkpoint step_{step}"
    else:
        step, what = state.step, f"last step {state.step}"
    return load_weights(checkpoint_dir / f"step_{step}", kind), f"{of}{what}"


def own_checkpoints(checkpoint_dir: Path, run_id: str | None) -> list[Path]:
    """The complete checkpoints in `checkpoint_dir` of the run `run_id` (and those written before run ids), oldest
    first: a checkpoint of another run put there is left out, with a warning."""
    import logging

    from .run_identity import checkpoint_run_id

    own = []
    for _, path in checkpointing.list_checkpoints(checkpoint_dir):
        other = checkpoint_run_id(path)
        if run_id is not None and other not in (None, run_id):
            logging.getLogger("hf_variants.train").warning("%s is a checkpoint of run %s: not averaged", path, other)
            continue
        own.append(path)
    return own


# ---------------------------------------------------------------------------------- averaging a run's checkpoints
def run_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints of a run folder, oldest first (an `AveragingError` when it has none)."""
    found = checkpointing.list_checkpoints(Path(run_dir) / "checkpoints")
    if not found:
        raise AveragingError(f"{run_dir} holds no complete checkpoint (checkpoints/step_N with checkpoint.json).")
    return found


def newest_state(run_dir: Path) -> tuple[dict, dict]:
    """(checkpoint.json, trainer_state.json's run state) of the run's newest checkpoint: its settings and its
    validation history."""
    _, newest = run_checkpoints(run_dir)[-1]
    info = checkpointing.checkpoint_info(newest)
    state = checkpointing._read_json(newest / checkpointing.TRAINER_STATE, "the run's progress")
    return info, state.get("train_state") or {}


def select_last(run_dir: Path, k: int) -> list[Path]:
    found = run_checkpoints(run_dir)
    if len(found) < k:
        raise AveragingError(
            f"--last {k}: {run_dir} has {len(found)} checkpoint(s) ({', '.join(p.name for _, p in found)})."
        )
    return [p for _, p in found[-k:]]


def select_best(run_dir: Path, k: int, metric: str | None = None) -> tuple[list[Path], str]:
    """The `k` best validated checkpoints of the run by `metric` (default: the run's --best_metric), in step order,
    ranked with the validation history of its newest checkpoint; (checkpoints, metric)."""
    from .best_checkpoints import ranked_steps

    info, state = newest_state(run_dir)
    metric = metric or (info.get("settings") or {}).get("best_metric") or "bleu"
    found = dict(run_checkpoints(run_dir))
    ranked = ranked_steps(state.get("evals") or [], metric, found)
    if len(ranked) < k:
        raise AveragingError(
            f"--best {k}: {run_dir} keeps {len(ranked)} validated checkpoint(s) "
            f"({', '.join(f'step_{s}' for s in sorted(ranked)) or 'none'}); train with --keep_best {k} to keep them."
        )
    return [found[s] for s in sorted(ranked[:k])], metric


def resolve_checkpoints(run_dir: Path, names: Sequence[str]) -> list[Path]:
    """`--checkpoints`: paths, or names of the run's checkpoints (`step_600`); each must be complete."""
    out = []
    for name in names:
        path = Path(name)
        if not path.is_dir() and (Path(run_dir) / "checkpoints" / name).is_dir():
            path = Path(run_dir) / "checkpoints" / name
        if not (path / checkpointing.MARKER).is_file():
            raise AveragingError(f"--checkpoints {name}: not a complete checkpoint (no {checkpointing.MARKER}).")
        out.append(path)
    if len({p.resolve() for p in out}) != len(out):
        raise AveragingError("--checkpoints names a checkpoint twice.")
    return out


def check_weights_intact(checkpoint: Path, weights: str) -> None:
    """The weights file of `checkpoint` has the size and SHA-256 its manifest recorded (a checkpoint without a
    manifest: the safetensors header's length); an `AveragingError` naming the file otherwise."""
    path = weights_file(checkpoint, weights)
    files = checkpointing.checkpoint_info(checkpoint).get(checkpointing.MANIFEST)
    meta = files.get(path.name) if isinstance(files, dict) else None
    if isinstance(meta, dict):
        if path.stat().st_size != meta.get("size") or checkpointing.file_digest(path) != meta.get("sha256"):
            raise AveragingError(f"{path}: its size or SHA-256 differs from the checkpoint's manifest (damaged).")
    elif problem := checkpointing._structure_problem(path):
        raise AveragingError(problem)


def checkpoint_config_dir(checkpoint: Path) -> Path:
    """The folder with the config of a checkpoint's model (`checkpoint_models.run_config_dir`), an
    `AveragingError` when its run folder has none."""
    try:
        return run_config_dir(checkpoint)
    except checkpointing.CheckpointError as error:
        raise AveragingError(str(error)) from None


def _config_dict(folder: Path) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder).to_dict()
    return {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}


def _tokenizer_identity(checkpoint: Path, computed: dict) -> tuple[str | None, Path | None]:
    """(the fingerprint of a checkpoint's tokenizer: recorded, else computed once per folder, its folder)."""
    from transformers import AutoTokenizer

    from .cache_store import tokenizer_fingerprint

    folder, recorded = checkpointing.checkpoint_tokenizer(checkpoint)
    if folder is None or recorded:
        return recorded, folder
    key = folder.resolve()
    if key not in computed:
        computed[key] = tokenizer_fingerprint(AutoTokenizer.from_pretrained(folder))
    return computed[key], folder


def check_same_model(checkpoints: Sequence[Path]) -> tuple[Path, Path]:
    """Every checkpoint has the same config and tokenizer (an `AveragingError` naming two that differ and the
    differing fields); returns (the config folder, the tokenizer folder) of the last one."""
    configs = [(c, checkpoint_config_dir(c)) for c in checkpoints]
    first_c, first_dir = configs[0]
    first = _config_dict(first_dir)
    for c, folder in configs[1:]:
        if folder.resolve() == first_dir.resolve():
            continue
        other = _config_dict(folder)
        differ = sorted(k for k in set(first) | set(other) if first.get(k) != other.get(k))
        if differ:
            shown = ", ".join(f"{k}: {first.get(k)!r} vs {other.get(k)!r}" for k in differ[:4])
            raise AveragingError(f"{first_c} and {c} are checkpoints of different models (config {shown}).")
    computed: dict = {}
    tokenizers = [(c, *_tokenizer_identity(c, computed)) for c in checkpoints]
    first_c, first_fp, _ = tokenizers[0]
    for c, fp, _ in tokenizers[1:]:
        if fp != first_fp:
            raise AveragingError(f"{first_c} and {c} were trained with different tokenizers (other token ids).")
    tokenizer_dir = tokenizers[-1][2]
    if tokenizer_dir is None:
        raise AveragingError(f"{checkpoints[-1]} has no tokenizer saved with it or in its run folder.")
    return configs[-1][1], tokenizer_dir


def average_record(run_dir: Path, checkpoints: Sequence[Path], weights: str, how: str, runs=((), False)):
    """The model card's run record of an averaged model: the run's results.json (or, for a run still training, its
    settings) without the scores of the run's own final model, with `final_model` naming the checkpoints, and
    `run_id` their run's (`runs`: `run_identity.check_same_run`'s answer; checkpoints of several runs, averaged with
    --allow_other_runs, are named in `final_model` and have no `run_id`)."""
    from model_cards.card import load_results
    from model_cards.run_record import RunRecord

    try:
        record = RunRecord.from_dict(load_results(run_dir))
    except (FileNotFoundError, ValueError, TypeError):  # a run still training: its settings
        settings = checkpointing.checkpoint_info(run_checkpoints(run_dir)[-1][1]).get("settings") or {}
        record = RunRecord(
            model_type=settings.get("model_type"),
            source_lang=None if settings.get("languages") else settings.get("source_lang"),
            target_lang=None if settings.get("languages") else settings.get("target_lang"),
            languages=list(settings.get("languages") or []),
            dataset=settings.get("dataset_name") or settings.get("train_file") or settings.get("data_dir"),
            hyperparameters={k: v for k, v in settings.items() if k != "hub_token"},
            license=settings.get("license"),
            dataset_label=settings.get("dataset_label"),
        )
    for name in ("bleu", "chrf", "sacrebleu_signature", "chrf_signature", "per_direction", "eval_split"):
        setattr(record, name, None)
    record.eval_pairs, record.validation, record.best_step, record.stopped = None, [], None, None
    record.best_checkpoint = None  # the run's choice of its own final model, not this one's
    record.steps = max(int(checkpointing.checkpoint_info(c).get("step", 0)) for c in checkpoints)
    of = "EMA weights of " if weights == "ema" else ""
    names = ", ".join(c.name if c.parent.parent == Path(run_dir) else str(c) for c in checkpoints)
    ids, mixed = runs
    if mixed:
        how = f"{how}; checkpoints of {len(ids)} runs: {', '.join(ids)}, averaged with --allow_other_runs"
    record.run_id = None if mixed else next((i for i in ids if not i.startswith("(no id)")), None)
    record.final_model = f"average of {of}{names} ({how}; hf-variants-average)"
    return record


def write_average(
    run_dir: str | os.PathLike,
    checkpoints: Sequence[Path],
    output_dir: str | os.PathLike,
    *,
    weights: str = "raw",
    how: str = "",
    force: bool = False,
    allow_other_runs: bool = False,
    log=print,
) -> Path:
    """Average `checkpoints` into a model folder `output_dir` (weights, config, generation config, tokenizer,
    model card), written atomically (`outputs.atomic_output_dir`; `force` replaces only a folder this command
    wrote); the checks (same model, one run unless `allow_other_runs`, intact weights) run before anything is
    written."""
    from transformers import AutoConfig, AutoModelForSeq2SeqLM, AutoTokenizer, GenerationConfig

    from ..outputs import atomic_output_dir, check_not_an_input, check_output_dir
    from .run_identity import check_same_run

    run_dir = Path(run_dir)
    check_not_an_input(output_dir, {"RUN_DIR": str(run_dir), "--checkpoints": [str(c) for c in checkpoints]})
    check_output_dir(output_dir, command=COMMAND, force=force)
    config_dir, tokenizer_dir = check_same_model(checkpoints)
    try:
        runs = check_same_run(checkpoints, allow_other_runs, log)
    except ValueError as error:
        raise AveragingError(str(error)) from None
    for checkpoint in checkpoints:
        check_weights_intact(checkpoint, weights)
    with atomic_output_dir(output_dir, command=COMMAND, force=force, log=log) as staging:
        averaged = average_checkpoints(checkpoints, weights)
        model = AutoModelForSeq2SeqLM.from_config(AutoConfig.from_pretrained(config_dir))
        checkpointing.load_model_weights(model, averaged)
        del averaged
        if (config_dir / "generation_config.json").is_file():
            model.generation_config = GenerationConfig.from_pretrained(config_dir)
        model.save_pretrained(staging)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        tokenizer.model_max_length = model.config.max_position_embeddings
        tokenizer.save_pretrained(staging)
        record = average_record(run_dir, checkpoints, weights, how, runs)
        try:
            from model_cards.card import FAMILIES, build_model_card

            if (record.model_type or model.config.model_type) in FAMILIES:
                build_model_card(staging, record).save(staging / "README.md")
        except Exception as error:  # noqa: BLE001 - the averaged model is written regardless, the card named
            log(f"warning: no model card written ({type(error).__name__}: {error})")
    return Path(output_dir)
