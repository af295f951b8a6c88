"""The settings of a training run, stored in every checkpoint and compared when the run is resumed.

A resume is exact (bit-identical to an uninterrupted run) only with the settings the checkpoint was written with.
`train.py` stores `run_settings(args, ...)` in each checkpoint's `checkpoint.json`; on resume, `resume_changes`
compares them with the new invocation's settings:

- `FREE` settings may change on a resume: they decide how long the run goes on and what it logs, saves, evaluates at
  the end or publishes, never the weights of a step (`max_steps`/`num_epochs` extend or shorten the run; the
  inverse-sqrt schedule does not depend on them). Their changes are logged and recorded.
- `FIXED` settings can never change on a resume: the model and its tokenizer were built from them (a resumed run
  loads the run's saved tokenizer and the checkpoint's weights, so a new value could not take effect).
- `data`: the content fingerprint of the training and validation data (hf_variants/training/data_fingerprint.py),
  compared by that module (naming each changed source), not by `resume_changes`.
- every other setting (seed, data, batching, optimizer, schedule, dropout, validation, number of processes, mixed
  precision, device, ...) changes what the run computes from the checkpoint on. A resume with such a change is
  refused with a message naming every changed field (old -> new), unless `--allow_changed_settings NAME,...` names
  each of them; then the new values are used from the resumed step on and recorded (results.json, model card).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping

# Per-invocation flags: not settings of the run (where it lives, how this invocation starts, secrets).
NOT_STORED = frozenset(
    {"resume_from_checkpoint", "overwrite_output_dir", "allow_changed_settings", "hub_token", "output_dir", "cpu"}
)  # `cpu` is stored as the device the run actually used ("device")

FREE = frozenset(
    {
        "max_steps",
        "num_epochs",  # the length of the run
        "logging_steps",
        "eval_steps",
        "save_steps",
        "keep_checkpoints",  # cadence of logs, validation, checkpoints
        "keep_best",
        "average_last",
        "final_model",  # which checkpoints make the final model
        "final_candidates",
        "patience",
        "min_delta",  # when the run stops early (it may train on with a larger patience)
        "test_prefix",
        "test_file",
        "test_split",
        "max_test_pairs",
        "num_examples",
        "eval_batch_size",  # final test
        "report_to",
        "push_to_hub",
        "hub_model_id",
        "variant_name",
        "license",
        "dataset_label",
        "run_name",  # output only
        # the CPU threads (`cpu_threads`, derived: hf_variants/training/threads.py): a resume keeps the recorded
        # count; a new one given on purpose (--num_threads, --threads_from_load) is allowed and recorded, although
        # the low bits of the steps after it differ from an uninterrupted run's
        "num_threads",
        "threads_from_load",
        "cpu_threads",
        "progress_interval",
        "no_progress",  # how progress is shown
        "preprocessing_num_workers",
        "ddp_timeout",  # speed and waiting
        "data_cache_dir",  # where the tokenized data is cached (its content is keyed by the data and settings)
        "corpus_spec",  # the file's path; its content is the setting `corpora`
        "requeue_exit_code",  # how a preempted invocation exits
        # what happens to a step whose loss is not finite, which a run with `stop` (the default) never trains through
        "on_nonfinite",
    }
)

FIXED = frozenset(
    {
        "model_type",
        "preset",
        "config_overrides",
        "model_name_or_path",  # the architecture
        "tokenizer",
        "tokenizer_model",
        "vocab_size",
        "tokenizer_min_frequency",
        "tokenizer_sample_lines",  # tokenizer
        "source_lang",
        "target_lang",
        "languages",
        "bidirectional",
        "target_language_tags",  # config.languages/tags
    }
)

# Settings fixed at run time rather than given as options (accepted by --allow_changed_settings as well); `data`
# is compared by hf_variants/training/data_fingerprint.py
DERIVED = ("num_processes", "mixed_precision", "device", "data", "cpu_threads")
COMPARED_ELSEWHERE = frozenset({"data"})

# Settings whose new value must be written into the restored optimizer/scheduler state to take effect.
OPTIMIZER_SETTINGS = frozenset(
    {"learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "warmup_steps"}
)


class SettingsChangedError(ValueError):
    """A resume whose settings differ from the checkpoint's in ways that are not allowed."""


def _jsonable(value):
    """The value as it round-trips through JSON (tuples become lists), so stored and new values compare equal."""
    return json.loads(json.dumps(value, default=str))


def run_settings(args: argparse.Namespace, **derived) -> dict:
    """The run's settings: every argument except the per-invocation ones, plus `derived` values fixed at run time
    (number of processes, the mixed precision and device actually used)."""
    settings = {k: v for k, v in vars(args).items() if k not in NOT_STORED}
    settings.update(derived)
    return _jsonable(settings)


def option_names(parser: argparse.ArgumentParser) -> dict[str, str]:
    """Every option name (without dashes, aliases included) -> the setting (dest) it sets."""
    names = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--"):
                names[option[2:]] = action.dest
    return names


def parse_allowed(
    spec: Iterable[str] | str | None, known: Iterable[str], aliases: Mapping[str, str] | None = None
) -> set[str]:
    """`--allow_changed_settings seed,learning_rate` (names with or without dashes, commas and/or spaces; option
    aliases accepted) -> the set of settings; an unknown name raises `ValueError` listing the known ones."""
    if spec is None:
        return set()
    items = [spec] if isinstance(spec, str) else list(spec)
    names = [n.strip().lstrip("-") for item in items for n in item.split(",") if n.strip()]
    known, aliases = set(known), dict(aliases or {})
    out = set()
    for name in names:
        dest = aliases.get(name, name)
        if dest not in known:
            raise ValueError(
                f"--allow_changed_settings: unknown setting {name!r}; settings: {', '.join(sorted(known))}."
            )
        out.add(dest)
    return out


def diff(old: Mapping, new: Mapping) -> list[tuple[str, object, object]]:
    """`(name, old value, new value)` of every setting present in both and different, sorted by name. A setting
    missing from `old` (written by a version without it) is not compared."""
    return [
        (k, old[k], new[k])
        for k in sorted(new)
        if k in old and k not in COMPARED_ELSEWHERE and _jsonable(old[k]) != _jsonable(new[k])
    ]


def _fmt(value) -> str:
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def resume_changes(old: Mapping, new: Mapping, allowed: set[str], where: str = "the checkpoint") -> list[dict]:
    """Compare the checkpoint's settings `old` with this invocation's `new`.

    Returns the changes to apply and record, `{"setting", "from", "to", "free"}` each. Raises
    `SettingsChangedError` naming every changed field that may not change: the `FIXED` ones always, the others
    unless named in `allowed`."""
    changes = diff(old, new)
    fixed = [(k, a, b) for k, a, b in changes if k in FIXED]
    refused = [(k, a, b) for k, a, b in changes if k not in FIXED and k not in FREE and k not in allowed]
    if fixed or refused:
        lines = [f"Cannot resume {where} with these changed settings (saved -> now):"]
        lines += [
            f"  --{k}: {_fmt(a)} -> {_fmt(b)}  (fixed: the model and tokenizer were built from it)"
            for k, a, b in fixed
        ]
        lines += [f"  --{k}: {_fmt(a)} -> {_fmt(b)}" for k, a, b in refused]
        if fixed:
            lines.append(
                "Fixed settings cannot change within a run: resume with the saved values, or start a new "
                "run (--overwrite_output_dir or another --output_dir)."
            )
        if refused:
            lines.append(
                "Each of them changes what the run computes from the checkpoint on (a resume is exact only with the "
                "saved settings). Resume with the saved values, or pass --allow_changed_settings "
                f"{','.join(k for k, _, _ in refused)} to use the new values from the resumed step on (the change "
                "is recorded in results.json and the model card)."
            )
        raise SettingsChangedError("\n".join(lines))
    return [{"setting": k, "from": a, "to": b, "free": k in FREE} for k, a, b in changes]
