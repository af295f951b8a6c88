"""Checks of the training command's flags that need more than argparse, run when the command line is parsed (before
the run folder, the data, the tokenizer or the model exist), each refusal one line naming the flag:

- `--model_type` and `--preset`: the valid values, and the closest one (`mute` -> `mute_nmt`, `Tiny` -> `tiny`);
- `--config_overrides`: the syntax, every name a field of the model type's config (with the closest field), every
  value of the field's type (values that depend on other fields are checked when the config is built);
- the data: one source (`--train_file`, `--data_dir` or `--dataset_name`) named when there is none (an installed
  package has no bundled corpus);
- `--push_to_hub`: what needs no network (offline mode, a token, a `--hub_model_id` of the form namespace/name:
  `hub_preflight.check_push_flags`), before the training rather than after it;
- `--model_name_or_path` / `--tokenizer`: a model / tokenizer folder (a training run folder names the folder to
  pass; a Hub id is looked up once), `--resume_from_checkpoint`: a folder that exists (`check_inputs`, when the
  launch starts: parsing reads nothing).
"""

from __future__ import annotations

import contextlib
import difflib
from pathlib import Path

from ..model_folders import ModelFolderError, can_only_be_a_path, load_config, load_tokenizer_check
from . import external


def closest(value: str, choices) -> str | None:
    """The choice closest to `value` (case-insensitive first, then by spelling), or None."""
    by_case = [c for c in choices if c.lower() == value.lower()]
    if by_case:
        return by_case[0]
    prefixed = [c for c in choices if c.startswith(value.lower()) or value.lower().startswith(c.split("_")[0])]
    if len(prefixed) == 1:
        return prefixed[0]
    found = difflib.get_close_matches(value.lower(), list(choices), n=1, cutoff=0.5)
    return found[0] if found else None


def choice_message(flag: str, value: str, choices) -> str:
    near = closest(value, choices)
    return f"{flag} {value!r} is not one of {', '.join(choices)}" + (f": did you mean {near}?" if near else ".")


def model_types() -> list[str]:
    from ..model_classes import CONFIG_CLASSES

    return list(CONFIG_CLASSES) + list(external.EXTERNAL_MODEL_TYPES)


def config_class(model_type: str):
    from ..configuration_transformer_nmt import TransformerNmtConfig
    from ..model_classes import CONFIG_CLASSES

    return CONFIG_CLASSES.get(model_type, TransformerNmtConfig)  # external types take the baseline's presets


def model_flag_errors(args) -> list[str]:
    """`--model_type`, `--preset` and `--config_overrides` of a new model (with `--model_name_or_path` the
    overrides are checked against the saved config when it loads)."""
    from ..configuration_transformer_nmt import check_config_field_names, check_field_type, parse_config_overrides

    types = model_types()
    if args.model_type not in types:
        return [choice_message("--model_type", args.model_type, types)]
    klass = config_class(args.model_type)
    errors = []
    if args.preset not in klass.PRESETS:
        errors.append(choice_message("--preset", args.preset, list(klass.PRESETS)))
    try:
        overrides = parse_config_overrides(args.config_overrides)
        if not args.model_name_or_path and args.model_type not in external.EXTERNAL_MODEL_TYPES:
            check_config_field_names(klass, overrides)
            for name, value in overrides.items():
                check_field_type(klass, klass.attribute_map.get(name, name), value)
    except ValueError as error:
        errors.append(f"--config_overrides: {str(error).removeprefix('--config_overrides: ')}")
    return errors


def data_flag_errors(args) -> list[str]:
    """No data source at all (an installed package has no bundled corpus, so `--data_dir` has no default)."""
    if args.train_file or args.dataset_name or args.data_dir or getattr(args, "corpora", None):
        return []
    return [
        "no training data: pass --train_file FILE (TSV with a header of language codes, or JSONL), --data_dir DIR "
        "(per-language text files {prefix}.{lang}), --dataset_name NAME (a datasets dataset: Hub id or folder) or "
        "--corpus_spec FILE (several corpora)"
    ]


def hub_flag_errors(args) -> list[str]:
    """`--push_to_hub`: what can be checked without the network (offline mode, a token, `--hub_model_id`), now
    rather than after the training; the run checks the Hub itself when it starts (`hub_preflight`)."""
    if not args.push_to_hub or not args.hub_model_id:
        return []
    from huggingface_hub import get_token

    from .hub_preflight import HubPushError, check_push_flags

    try:
        check_push_flags(args.hub_model_id, args.hub_token or get_token())
    except HubPushError as error:
        return [str(error)]
    return []


def path_flag_errors(args, in_memory: bool = False) -> list[str]:
    """`--model_name_or_path` (its config loads), `--tokenizer`, `--resume_from_checkpoint`, `--dataset_name` (a
    folder that exists, unless it may be a Hub id; `in_memory`: the name of `train_on_datasets`' data)."""
    errors = []
    try:
        if args.model_name_or_path:
            load_config(args.model_name_or_path, "--model_name_or_path")
        if args.tokenizer:
            load_tokenizer_check(args.tokenizer, "--tokenizer")
    except ModelFolderError as error:
        errors.append(str(error))
    name = None if in_memory else args.dataset_name
    if name and can_only_be_a_path(name) and not Path(name).exists():
        errors.append(f"--dataset_name {args.dataset_name}: no such folder (nor a Hub dataset id)")
    resume = args.resume_from_checkpoint
    if resume and resume != "latest" and not Path(resume).is_dir():
        inside = Path(args.output_dir) / "checkpoints" / resume if args.output_dir else None
        if (inside is None and "/" in resume) or (inside is not None and not inside.is_dir()):
            errors.append(
                f"--resume_from_checkpoint {resume}: no such checkpoint folder (a run's checkpoints/step_N, or "
                "latest for the newest checkpoint of --output_dir)"
            )
    return errors


@contextlib.contextmanager
def config_values():
    """Building the run's config: a `ValueError` of its values (fields that only fail together, e.g. heads that do
    not divide `d_model`) becomes a `DataError` naming --config_overrides: one line, and no run folder left."""
    from .corpus import DataError

    try:
        yield
    except DataError:
        raise
    except ValueError as error:
        raise DataError(f"--config_overrides: {error}") from None


def flag_errors(args, data_required: bool = True) -> list[str]:
    """The checks of the command line itself, without reading anything (model flags first: a wrong model type
    makes the others moot)."""
    return model_flag_errors(args) or (data_flag_errors(args) if data_required else []) + hub_flag_errors(args)


def check_inputs(args, in_memory: bool = False) -> None:
    """The model, tokenizer, checkpoint and dataset a launch names exist (`path_flag_errors`): a `DataError` with the
    first message otherwise, before the run folder or the data are touched."""
    from .corpus import DataError

    errors = path_flag_errors(args, in_memory)
    if errors:
        raise DataError(errors[0])


__all__ = ["flag_errors", "check_inputs", "config_values", "closest", "choice_message"]
