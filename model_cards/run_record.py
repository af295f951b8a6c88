"""The typed record of a training run: what training/train.py writes as `results.json` and the model card reads.

`RunRecord` holds one field per `results.json` key (the JSON keys are the field names). `RunRecord.from_dict`
reads any version of the file: missing keys take their defaults, keys this version does not know are kept in
`extra` and written back by `to_dict`, so nothing is lost. A field renamed here breaks its writer
(`RunRecord(name=...)` raises `TypeError`) and its reader (`record.name` raises `AttributeError`), never silently
empties a card field.

This module imports nothing beyond the standard library (cards are written from a run folder alone).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

# the JSON types a field's annotation admits (results.json is read back as untrusted input)
_JSON_TYPES = {"str": (str,), "int": (int,), "float": (int, float), "bool": (bool,), "list": (list,), "dict": (dict,)}


def _check_type(name: str, value) -> None:
    """A `TypeError` naming the field when `value` is not of the JSON type its annotation names."""
    annotation = str(next(f.type for f in dataclasses.fields(RunRecord) if f.name == name))
    kind = annotation.split("|")[0].split("[")[0].strip()
    allowed = _JSON_TYPES.get(kind)
    if allowed is None:  # Any
        return
    if not isinstance(value, allowed) or (kind in ("int", "float") and isinstance(value, bool)):
        raise TypeError(f"results.json field {name!r} must be a JSON {kind}, got {type(value).__name__} {value!r:.80}")


# fields written only when set (the card reads them when a user adds them to results.json by hand)
_OPTIONAL = {"omit_if_none": True}


@dataclass
class RunRecord:
    model_type: str | None = None
    variant: str | None = None  # display name for the card (default: the model family's name)
    preset: str | None = None
    source_lang: str | None = None  # set for single-direction runs
    target_lang: str | None = None
    languages: list[str] = field(default_factory=list)
    directions: list[str] = field(default_factory=list)  # evaluated directions, "src-tgt"
    bidirectional: bool = False
    dataset: str | None = None  # Hub name, file, or folder name
    eval_split: str | None = None
    eval_pairs: int | None = None
    bleu: float | None = None
    chrf: float | None = None
    chrfpp: float | None = None  # chrF++ (chrF with word bigrams)
    ter: float | None = None  # translation edit rate (lower is better)
    sacrebleu_signature: str | None = None  # BLEU's
    chrf_signature: str | None = None
    chrfpp_signature: str | None = None
    ter_signature: str | None = None
    params: int | None = None
    train_tokens_per_sec: float | None = None
    wall_time_sec: float | None = None
    train_time_sec: float | None = None
    train_pairs: int | None = None
    dropped_pairs: int | None = None
    dropped_reasons: dict[str, int] = field(default_factory=dict)
    dropped_examples: dict = field(default_factory=dict)
    eval_dropped_pairs: int | None = None
    eval_dropped_reasons: dict[str, int] = field(default_factory=dict)
    steps: int | None = None
    epochs: float | None = None
    final_model: str | None = None  # where the final weights came from
    best_step: int | None = None
    validation: list[dict] = field(default_factory=list)  # {"step", "valid_loss", "valid_bleu", "valid_chrf"}
    hyperparameters: dict[str, Any] = field(default_factory=dict)
    base_model: str | None = None
    per_direction: dict[str, dict] | None = None  # {"src-tgt": {"bleu", "chrf", "chrfpp", "ter", "pairs"}}
    num_processes: int | None = None
    # settings changed on resumes ({"step", "setting", "from", "to", "free"}); "hyperparameters" holds the values
    # of the last part of the run
    settings_changes: list[dict] = field(default_factory=list)
    # why the run stopped before its last step ({"reason", "step", "message", "exit_code", ...}); None: it finished
    stopped: dict | None = None
    # optimizer steps skipped for a non-finite loss or gradient (--on_nonfinite skip)
    nonfinite_skipped: int = 0
    license: str | None = field(default=None, metadata=_OPTIONAL)  # the Hub license id chosen for the weights
    dataset_id: str | None = field(default=None, metadata=_OPTIONAL)  # the Hub dataset, when `dataset` is not one
    dataset_label: str | None = field(default=None, metadata=_OPTIONAL)  # the data's name chosen by the user
    # what `base_model` and the config's `warm_started_from` are, resolved when the run ended (their folders may be
    # gone when the card is written again): {"name": ..., "hub_id": ...} (model_cards.card.model_identity)
    base_model_identity: dict | None = field(default=None, metadata=_OPTIONAL)
    warm_start_identity: dict | None = field(default=None, metadata=_OPTIONAL)
    # several training corpora (train.py --train_file ... --corpus_weights/--corpus_tags, --corpus_spec): each
    # {"name", "train_file" | "data_dir" + "prefix" | "dataset_name" + "split", "weight", "tag", "pairs", "share",
    # "examples_per_epoch"}
    corpora: list[dict] | None = field(default=None, metadata=_OPTIONAL)
    # --patience: {"patience", "min_delta", "metric", "best", "best_step", "validations_without_improvement",
    # "stopped_at_step" (None: the run did not stop early)}
    early_stopping: dict | None = field(default=None, metadata=_OPTIONAL)
    # how validated checkpoints ranked and the final one was chosen (hf_variants/training/final_choice.py):
    # {"metric", "pairs", "validation_pairs", "tie_rule", "statement", "best_step", "rescored", "final_step"}
    best_checkpoint: dict | None = field(default=None, metadata=_OPTIONAL)
    # the run's id (train.py: hf_variants/training/run_identity.py; kept on resume, in every checkpoint)
    run_id: str | None = field(default=None, metadata=_OPTIONAL)
    extra: dict[str, Any] = field(default_factory=dict, metadata={"extra": True})  # keys of other versions

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if not f.metadata.get("extra")]

    @classmethod
    def from_dict(cls, data: Mapping | None) -> RunRecord:
        """A record from `results.json`'s object: missing keys take their defaults (None, empty), unknown keys
        go to `extra`; a key whose value is null takes the field's default."""
        if data is None:
            return cls()
        if isinstance(data, RunRecord):
            return data
        if not isinstance(data, Mapping):
            raise TypeError(f"a run record must be a JSON object, got {type(data).__name__}")
        names = set(cls.field_names())
        known = {k: v for k, v in data.items() if k in names and v is not None}
        for name, value in known.items():
            _check_type(name, value)
        return cls(**known, extra={k: v for k, v in data.items() if k not in names})

    def to_dict(self) -> dict:
        """`results.json`'s object: every field in order (optional ones only when set), then `extra`."""
        out = {}
        for f in dataclasses.fields(self):
            if f.metadata.get("extra"):
                continue
            value = getattr(self, f.name)
            if value is None and f.metadata.get("omit_if_none"):
                continue
            out[f.name] = value
        out.update({k: v for k, v in self.extra.items() if k not in out})
        return out

    def get(self, key: str, default=None):
        """Mapping-style access for callers of the untyped dict (a known field, else an extra key)."""
        value = getattr(self, key) if key in self.field_names() else self.extra.get(key)
        return default if value is None else value
