"""Build the model card (README.md) of a trained hf_variants model.

A card is made of Hub metadata, built with `huggingface_hub.ModelCardData` / `EvalResult` (so that
`ModelCard.load`, `metadata_load` and `model_index_to_eval_results` read it back unchanged), and a Markdown
body rendered from the variant family's Jinja template through `ModelCard.from_template`. Every family template
(`templates/<model_type>.md`) extends the shared `templates/_base.md` and only fills the blocks that differ
(description, architecture notes, limitations, citation).

Inputs:

- `model_dir`: a `save_pretrained` folder (config.json, model.safetensors, tokenizer files, code files);
  the architecture numbers are read from its config.json (defensively: only the fields present are shown)
  and the parameter count, when `results` has none, from the safetensors headers.
- `results`: the run's record (`model_cards.run_record.RunRecord`, or `results.json`'s object, read with
  `RunRecord.from_dict`); every field is optional, sections without data are left out.

This module imports neither torch nor hf_variants: cards can be written from a run folder alone
(`python -m model_cards.card RUN_DIR`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from .run_record import RunRecord

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
# benchmarks/quality.py and benchmarks/efficiency.py write here (in a checkout of the repository)
BENCHMARK_RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
BENCHMARK_URL = "benchmarks/RESULTS.md"
# model type -> (its runs in benchmarks/quality.py, the baseline run it is compared with, efficiency.py model)
BENCHMARK_RUNS = {
    "transformer_nmt": (("baseline", "marian"), "baseline", "baseline"),
    "mute_nmt": (("baseline_rel", "mute", "mute_bias", "mute_bias_seq"), "baseline", "mute"),  # + its own baseline
    "hysan_nmt": (("hysan_e1",), "baseline", "hysan"),
    "mgsa_nmt": (("mgsa_ngram",), "baseline", "mgsa"),
    "tied_nmt": (("tied",), "baseline", "tied"),
    "mimo_nmt": (("ml_mimo",), "ml_baseline", "mimo"),
}
BASE_TEMPLATE = "_base.md"
PLACEHOLDER_REPO_ID = "ORG/NAME"
# The Hub's license id of weights whose license nobody chose (train.py --license, build_model_card(license=...)):
# the data's terms decide what the weights may be used for, so no license is claimed for them.
DEFAULT_LICENSE = "unknown"
CODE_LICENSE = "apache-2.0"  # the license of hf_variants' code files shipped with the model
PACKAGE_TAG = "hf-variants"

# Keys of results.json that the card reads (all optional).
# the run record's fields the card reads
RESULTS_KEYS = (
    "model_type",
    "variant",
    "source_lang",
    "target_lang",
    "languages",
    "dataset",
    "dataset_id",
    "eval_split",
    "bleu",
    "chrf",
    "chrfpp",
    "ter",
    "sacrebleu_signature",
    "chrf_signature",
    "chrfpp_signature",
    "ter_signature",
    "params",
    "train_tokens_per_sec",
    "wall_time_sec",
    "train_pairs",
    "dropped_pairs",
    "dropped_reasons",
    "steps",
    "epochs",
    "hyperparameters",
    "base_model",
    "per_direction",
    "license",
    "settings_changes",
    "directions",
    "dataset_label",
    "base_model_identity",
    "warm_start_identity",
    "bidirectional",
    "corpora",
    "final_model",
    "early_stopping",
    "run_id",
    "best_checkpoint",
)


@dataclass(frozen=True)
class Family:
    """A variant family: its names, Hub tag and the config fields that describe its architecture."""

    model_type: str
    name: str  # short name used in titles ("MUTE")
    long_name: str  # what the acronym stands for
    tag: str  # Hub tag of the variant
    fields: tuple[tuple[str, str], ...] = ()  # (config attribute, label) shown when present

    @property
    def template(self) -> Path:
        return TEMPLATES_DIR / f"{self.model_type}.md"


FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        Family("transformer_nmt", "Transformer", "Transformer (baseline)", "transformer"),
        Family(
            "mute_nmt",
            "MUTE",
            "Multi-Unit Transformer",
            "mute",
            (
                ("num_units", "Parallel units per encoder layer"),
                ("unit_types", "Unit types"),
                ("merge", "Unit merge"),
                ("use_bias_module", "Bias module (training only)"),
                ("mask_prob", "Bias module mask probability"),
                ("shuffle_penalty_weight", "AutoShuffle penalty weight"),
            ),
        ),
        Family(
            "hysan_nmt",
            "HySAN",
            "Hybrid Self-Attention Network",
            "hysan",
            (
                ("encoder_branches", "Encoder self-attention branches"),
                ("decoder_branches", "Decoder self-attention branches"),
                ("local_k", "Local window k"),
                ("fusion", "Branch fusion"),
                ("gate_reduction", "Squeeze-gate reduction r"),
            ),
        ),
        Family(
            "mgsa_nmt",
            "MG-SA",
            "Multi-Granularity Self-Attention",
            "mg-sa",
            (
                ("mgsa_layers", "Encoder layers with MG-SA (0-based)"),
                ("phrase_type", "Phrase type"),
                ("ngram_sizes", "n-gram sizes"),
                ("syntactic_levels", "Parse-tree levels"),
                ("mgsa_word_heads", "Word heads"),
                ("phrase_composition", "Phrase composition"),
                ("phrase_interaction", "Phrase interaction"),
                ("tag_loss_weight", "Phrase-tag loss weight"),
            ),
        ),
        Family(
            "mimo_nmt",
            "MIMO",
            "Task-aware MIMO cardinality Transformer",
            "mimo",
            (
                ("num_transformations", "Parallel transformations per block"),
                ("mimo", "MIMO links"),
                ("task_attention", "Task-aware mixing"),
                ("mimo_memory", "Encoder memory for cross-attention"),
            ),
        ),
        Family(
            "tied_nmt",
            "Tied Transformer",
            "Tied Transformer (shared encoder and decoder)",
            "tied-transformer",
            (
                ("direction_embedding", "Direction embedding"),
                ("num_directions", "Directions"),
            ),
        ),
    )
}

# Config keys of the baseline TransformerNmtConfig: every other non-standard key is a variant field.
BASELINE_CONFIG_KEYS = frozenset(
    {
        "vocab_size",
        "d_model",
        "encoder_layers",
        "decoder_layers",
        "encoder_attention_heads",
        "decoder_attention_heads",
        "encoder_ffn_dim",
        "decoder_ffn_dim",
        "activation_function",
        "dropout",
        "attention_dropout",
        "activation_dropout",
        "max_position_embeddings",
        "position_embedding_type",
        "max_relative_positions",
        "relative_position_values",
        "normalize_before",
        "scale_embedding",
        "share_encoder_decoder_embeddings",
        "tie_word_embeddings",
        "output_bias",
        "layer_norm_eps",
        "init_method",
        "init_std",
        "label_smoothing",
        "languages",
        "target_language_tags",
        "use_cache",
        "pad_token_id",
        "bos_token_id",
        "eos_token_id",
        "decoder_start_token_id",
        "forced_eos_token_id",
        "is_encoder_decoder",
        "custom_pipelines",
        "auto_map",
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "warm_started_from",  # the summary names the base model by its identity, not its recorded path
    }
)

DATASET_NAMES = {"multi30k": "Multi30k", "wmt14": "WMT14", "iwslt2017": "IWSLT 2017", "opus100": "OPUS-100"}
# Hub dataset ids, used only when they hold every language of the run.
DATASET_HUB_IDS = {"multi30k": ("bentrevett/multi30k", {"en", "de"})}
EXAMPLE_SENTENCES = {
    "en": "A man in a blue shirt is riding a bicycle down the street.",
    "de": "Ein Mann in einem blauen Hemd fährt mit dem Fahrrad die Straße entlang.",
    "fr": "Un homme en chemise bleue descend la rue à vélo.",
    "cs": "Muž v modré košili jede na kole po ulici.",
}
# Keys naming a secret (hub_token, use_auth_token, api_key, ...; not batch_tokens) and values that look like one.
_SECRET_KEY = re.compile(
    r"(^|[_\-.])(token|secret|password|passwd|api[_\-]?key|credentials?|authorization)($|[_\-.])", re.IGNORECASE
)
# Run bookkeeping that train.py records with its arguments but that does not describe the training.
NOT_HYPERPARAMETERS = frozenset(
    {
        "output_dir",
        "run_name",
        "overwrite_output_dir",
        "logging_steps",
        "report_to",
        "push_to_hub",
        "hub_model_id",
        "hub_private_repo",
        "num_examples",
        "save_steps",
        "keep_checkpoints",
        "resume_from_checkpoint",
        "data_dir",
        "train_file",
        "valid_file",
        "test_file",
        "tokenizer",
        "model_name_or_path",
        "num_processes",
        "license",
        "dataset_label",
        "dataset_name",
        "variant_name",
        "data_cache_dir",
        "preprocessing_num_workers",
        "ddp_timeout",
        "requeue_exit_code",
        "num_threads",
        "threads_from_load",
        "cpu_threads",
        "cpu",
        "allow_changed_settings",
        "allow_large_model",
        "progress_interval",
        "no_progress",
        "keep_best",
        "corpora",  # the card's table of corpora
        "corpus_weights",
        "corpus_tags",
        "corpus_spec",
    }
)
# train.py's settings that apply to one source of data, one way of building the model or the tokenizer: left off
# the card of a run that did not use it (`_applied_hyperparameters`).
DATA_DIR_SETTINGS = ("data_dir", "train_prefix", "valid_prefix", "test_prefix")
DATASET_SETTINGS = ("dataset_config_name", "train_split", "valid_split", "test_split")
PRESET_SETTINGS = ("preset", "model_type")  # a run from --model_name_or_path takes the saved model's
TOKENIZER_TRAINING_SETTINGS = ("tokenizer_model", "vocab_size", "tokenizer_min_frequency", "tokenizer_sample_lines")
STREAMING_SETTINGS = ("stream_buffer_rows",)
# file names of the data splits (hyperparameters train.py records; shown by name in the card)
DATA_FILE_SETTINGS = (("train_file", "training"), ("valid_file", "validation"), ("test_file", "test"))
# the side-by-side benchmark describes a model of its family only at about the same size (its rows' parameters)
BENCHMARK_SIZE_RATIO = (0.8, 1.25)
SMALL_MODEL_PARAMS = 1_000_000  # below: the card says the model is for tests and demonstrations
_SECRET_VALUE = re.compile(r"^(hf_|api_)[A-Za-z0-9]{16,}$")


# --------------------------------------------------------------------------------------------------- reading
RESULTS_MAX_BYTES = 64 << 20  # a run record is a few kB; a larger file is not one


def load_results(run_dir: str | os.PathLike) -> dict:
    """The run's `results.json` as a dict (`FileNotFoundError` with the path when it is missing)."""
    path = Path(run_dir) / "results.json"
    if not path.is_file():  # also refuses a FIFO or a device file named results.json (never opened)
        raise FileNotFoundError(f"No results.json (a regular file) in run folder {str(run_dir)!r}.")
    if path.stat().st_size > RESULTS_MAX_BYTES:
        raise ValueError(f"{path} is {path.stat().st_size:,} bytes: not a run record (at most {RESULTS_MAX_BYTES:,}).")
    try:
        with open(path, encoding="utf-8") as f:
            results = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        where = f" (line {err.lineno}, column {err.colno})" if isinstance(err, json.JSONDecodeError) else ""
        raise ValueError(f"{path} is not valid JSON{where}: {err}") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(results).__name__}.")
    return results


def _load_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        return {}
    with open(path, encoding="utf-8") as f:
        config = json.load(f)
    return config if isinstance(config, dict) else {}


def _tokenizer_model(model_dir: Path) -> str | None:
    """The subword model of tokenizer.json ("BPE", "Unigram", ...), if readable."""
    path = model_dir / "tokenizer.json"
    try:
        with open(path, encoding="utf-8") as f:
            model = json.load(f).get("model") or {}
    except (OSError, ValueError, AttributeError):
        return None
    return model.get("type") if isinstance(model, dict) else None


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index, encoding="utf-8") as f:
            shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        return [model_dir / shard for shard in shards]
    single = model_dir / "model.safetensors"
    return [single] if single.is_file() else []


def count_parameters(model_dir: str | os.PathLike) -> int | None:
    """Number of stored parameters, from the safetensors headers (shared tensors are stored once)."""
    files = _safetensors_files(Path(model_dir))
    if not files:
        return None
    total = 0
    for path in files:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


# --------------------------------------------------------------------------------------------------- helpers
def _fmt(value: Any) -> str:
    """A value as shown in Markdown tables."""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_fmt(v) for v in value) if value else "–"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_fmt(v)}" for k, v in value.items()) if value else "–"
    return str(value).replace("|", "\\|").replace("\n", " ")


def _fmt_params(n: int) -> str:
    return f"{n:,} ({n / 1e6:.2f} M)" if n >= 10_000 else f"{n:,}"


def _both(config: Mapping, enc: str, dec: str) -> str | None:
    e, d = config.get(enc), config.get(dec)
    if e is None and d is None:
        return None
    return _fmt(e) if e == d else f"{_fmt(e)} / {_fmt(d)}"


def redact_secrets(mapping: Mapping) -> dict:
    """Drop entries whose key names a secret (hub_token, api_key, ...) or whose value looks like an access token,
    at any depth."""
    out = {}
    for key, value in mapping.items():
        if _SECRET_KEY.search(str(key)) or (isinstance(value, str) and _SECRET_VALUE.match(value)):
            continue
        out[key] = redact_secrets(value) if isinstance(value, Mapping) else value
    return out


def _languages(results: RunRecord, config: Mapping) -> tuple[str | None, str | None, list[str]]:
    src, tgt = results.source_lang, results.target_lang
    langs = [lang for lang in (results.languages or config.get("languages") or []) if lang]
    if src and tgt:
        return src, tgt, list(dict.fromkeys([src, tgt] + ([] if len(langs) <= 2 else langs)))
    return None, None, list(dict.fromkeys(langs))


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")


def _is_hub_id(value: object) -> bool:
    """`org/name` that is not a local path (train.py passes local paths for files, folders and checkpoints)."""
    return (
        isinstance(value, str)
        and bool(_HUB_ID.match(value))
        and not os.path.exists(value)
        and not re.search(r"\.(gz|txt|tsv|json|jsonl|csv|parquet)$", value)
    )


def _is_data_file(value: str) -> bool:
    return bool(re.search(r"\.(gz|bz2|xz|txt|tsv|jsonl?|csv|parquet|arrow)$", value))


def _local_name(value: str) -> str:
    """A local file or folder by the name the user gave it: its last path component, a file with its extension."""
    return Path(value.rstrip("/" + os.sep)).name or value


def _split_name(value: str) -> str:
    """An evaluation split as named in the card: a file by its name (`test.tsv`), a prefix or split name as is."""
    return _local_name(value) if ("/" in value or os.sep in value or _is_data_file(value)) else value


def _slug(value: str) -> str:
    return re.sub(r"[^A-Za-z0-9._]+", "-", value).strip("-.") or "data"


@dataclass(frozen=True)
class DatasetNames:
    """How the card names the training data: `name` in the text, `index_type` as the model-index dataset type,
    `hub_id` (or None) in the `datasets` metadata and links."""

    name: str
    index_type: str
    hub_id: str | None


def _dataset(results: RunRecord, languages: list[str]) -> DatasetNames | None:
    """The data as the user named it: `dataset_label` (train.py --dataset_label), else the `datasets` name
    (--dataset_name: a Hub id, or a local folder by its name), else the training file by its file name
    (`train.tsv`, never the stem `train`), else the data folder's name (`multi30k` as `Multi30k`). Only a Hub
    dataset id is a `datasets` entry: `dataset_id`, a Hub `--dataset_name`, or a known corpus whose Hub copy holds
    every language of the run."""
    raw = str(results.dataset) if results.dataset else None
    label = str(results.dataset_label) if results.dataset_label else None
    if raw is None and label is None:
        return None
    hub_id = None
    if results.dataset_id:
        hub_id = str(results.dataset_id)
    elif raw is not None and _is_hub_id(raw):
        hub_id = raw
    elif raw is not None:
        known, hub_langs = DATASET_HUB_IDS.get(_local_name(raw).lower(), (None, set()))
        if known and languages and set(languages) <= hub_langs:
            hub_id = known
    if raw is None:
        local = None
    elif _is_hub_id(raw):
        local = raw.split("/")[-1]
    else:
        local = _local_name(raw)
    name = label or DATASET_NAMES.get((local or "").lower(), local)
    return DatasetNames(name=name, index_type=hub_id or label or local, hub_id=hub_id)


def _eval_results(
    results: RunRecord, dataset: DatasetNames | None, src: str | None, tgt: str | None
) -> list[EvalResult]:
    if dataset is None:
        return []
    split = _split_name(str(results.eval_split)) if results.eval_split else None
    out: list[EvalResult] = []
    overall = {"bleu": results.bleu, "chrf": results.chrf}

    def add(config: str | None, scores: Mapping, label: str) -> None:
        common = dict(
            task_type="translation",
            task_name="Translation",
            dataset_type=dataset.index_type,
            dataset_name=f"{dataset.name} ({label})",
            dataset_config=config,
            dataset_split=split,
        )
        for metric, metric_name, sig_key in (
            ("bleu", "BLEU", "sacrebleu_signature"),
            ("chrf", "chrF", "chrf_signature"),
        ):
            value = scores.get(metric)
            if value is None:
                continue
            signature = scores.get(sig_key) or getattr(results, sig_key)
            out.append(
                EvalResult(
                    **common,
                    metric_type=metric,
                    metric_name=metric_name,
                    metric_value=round(float(value), 2),
                    metric_args={"signature": signature} if signature else None,
                )
            )

    if src and tgt:
        add(f"{src}-{tgt}", overall, f"{src}-{tgt}")
    else:
        add(None, overall, "all directions")
    for direction, scores in (results.per_direction or {}).items():
        if isinstance(scores, Mapping) and direction != (f"{src}-{tgt}" if src and tgt else None):
            add(direction, scores, direction)
    return out


def _architecture_rows(config: Mapping, family: Family, params: int | None) -> list[tuple[str, str]]:
    rows: list[tuple[str, str | None]] = [
        ("Parameters", _fmt_params(params) if params is not None else None),
        ("Model width d_model", _fmt(config["d_model"]) if "d_model" in config else None),
        ("Encoder / decoder layers", _both(config, "encoder_layers", "decoder_layers")),
        ("Attention heads (encoder / decoder)", _both(config, "encoder_attention_heads", "decoder_attention_heads")),
        ("Feed-forward inner size (encoder / decoder)", _both(config, "encoder_ffn_dim", "decoder_ffn_dim")),
        ("Vocabulary (shared source/target)", _fmt(config["vocab_size"]) if "vocab_size" in config else None),
        (
            "Layer norm",
            None if "normalize_before" not in config else ("pre-norm" if config["normalize_before"] else "post-norm"),
        ),
        ("Position encoding", config.get("position_embedding_type")),
        (
            "Relative positions (Shaw et al.), max distance",
            _fmt(config["max_relative_positions"]) if config.get("max_relative_positions") else None,
        ),
        ("Activation", config.get("activation_function")),
        (
            "Encoder/decoder embeddings shared",
            _fmt(config["share_encoder_decoder_embeddings"]) if "share_encoder_decoder_embeddings" in config else None,
        ),
        (
            "Output projection tied to embeddings",
            _fmt(config["tie_word_embeddings"]) if "tie_word_embeddings" in config else None,
        ),
        ("Languages", _fmt(config["languages"]) if config.get("languages") else None),
        (
            "Target-language tags `<2xx>`",
            _fmt(config["target_language_tags"])
            if config.get("languages") and "target_language_tags" in config
            else None,
        ),
    ]
    shown = set()
    for key, label in family.fields:
        if key in config and config[key] is not None:
            rows.append((label, _fmt(config[key])))
            shown.add(key)
    # Variant fields the family table does not know yet: show them under their config name.
    standard = _standard_config_keys()
    for key, value in config.items():
        if key in shown or key in BASELINE_CONFIG_KEYS or key in standard or key.startswith("_") or value is None:
            continue
        scalar = (bool, int, float, str)
        if isinstance(value, scalar) or (
            isinstance(value, (list, tuple)) and len(value) <= 16 and all(isinstance(v, scalar) for v in value)
        ):
            rows.append((f"`{key}`", _fmt(value)))
    return [(label, value) for label, value in rows if value is not None]


_STANDARD_KEYS: frozenset | None = None


def _standard_config_keys() -> frozenset:
    """Keys every transformers config has (dtype, id2label, ...): not architecture facts."""
    global _STANDARD_KEYS
    if _STANDARD_KEYS is None:
        try:
            from transformers import PretrainedConfig

            _STANDARD_KEYS = frozenset(PretrainedConfig().to_dict())
        except Exception:  # noqa: BLE001 - transformers missing or changed: fall back to the baseline list
            _STANDARD_KEYS = frozenset()
    return _STANDARD_KEYS


def _duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = float(seconds)
    if seconds < 120:
        return f"{seconds:.1f} s"
    hours, rem = divmod(int(round(seconds)), 3600)
    return f"{hours} h {rem // 60:02d} min" if hours else f"{rem // 60} min {rem % 60:02d} s"


def _model_name(repo_id: str | None, model_type: str, dataset: DatasetNames | None, langs: list[str], src, tgt) -> str:
    """The model-index name: the repository's name, else `<model type>-<data>-<languages>`."""
    if repo_id:
        return repo_id.split("/")[-1]
    pair = f"{src}-{tgt}" if src and tgt else "-".join(langs) or None
    data = _slug(dataset.name) if dataset else None
    return "-".join(part for part in (model_type.replace("_", "-"), data, pair) if part)


# --------------------------------------------------------------------------------------------------- building
def _card_title(readme: Path) -> str | None:
    """The first `# ` heading of a model card (after its YAML front matter), if the file has one."""
    try:
        text = readme.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    text = re.sub(r"\A---\n.*?\n---\n", "", text, flags=re.S)
    match = re.search(r"^# (.+?)\s*$", text, re.M)
    return match.group(1) if match else None


def model_identity(ref: str | os.PathLike | None) -> dict | None:
    """What a model reference (train.py's `--model_name_or_path`, a warm-started config's `warm_started_from`) is,
    as a card names it: `{"name": text, "hub_id": Hub id or None}`.

    A Hub id is itself; a folder of the Hub cache (`models--ORG--NAME/snapshots/...`) is its Hub id; a local folder
    is named by its card's title (`"Transformer: en→fr translation on train.tsv"`) and its place (`run/model`: a
    run's model folder with the run folder's name), never by a bare folder name such as `model`."""
    if ref is None or str(ref) == "":
        return None
    ref = str(ref)
    if _is_hub_id(ref):
        return {"name": f"`{ref}`", "hub_id": ref}
    cached = re.search(r"models--([^/\\]+?)--([^/\\]+)[/\\]snapshots[/\\]", ref)
    if cached:
        hub_id = f"{cached.group(1)}/{cached.group(2)}"
        return {"name": f"`{hub_id}`", "hub_id": hub_id}
    path = Path(ref.rstrip("/" + os.sep))
    where = path.name or ref
    if path.parent.name and (
        where in ("model", "final", "checkpoint", "output") or where.startswith(("step_", "checkpoint-"))
    ):
        where = f"{path.parent.name}/{where}"
    title = _card_title(path / "README.md") if path.is_dir() else None
    name = f'"{title}" (local folder `{where}`)' if title else f"`{where}`"
    return {"name": name, "hub_id": None}


def _identity_field(value: object, key: str) -> dict | None:
    """A recorded identity (results.json `base_model_identity` / `warm_start_identity`), checked."""
    if value is None:
        return None
    if not (isinstance(value, Mapping) and isinstance(value.get("name"), str) and value["name"]):
        raise ValueError(f"results.json field {key!r} must be an object with a non-empty 'name', got {value!r}.")
    hub_id = value.get("hub_id")
    if hub_id is not None and not _is_hub_id(hub_id):
        raise ValueError(f"results.json field {key!r}: 'hub_id' must be a Hub model id (ORG/NAME), got {hub_id!r}.")
    return {"name": value["name"], "hub_id": hub_id}


def _base_models(results: RunRecord, config: Mapping) -> tuple[dict | None, str | None, dict | None]:
    """(the model the run started from, the Hub id of the card's `base_model` or None, the pretrained baseline a
    warm-started variant came from (config `warm_started_from`, hf_variants.warm_start) or None), the models as
    `model_identity` names them (recorded in results.json when the run ended, else resolved now). A variant
    fine-tuned from a local warm-started folder names that baseline's Hub id as its Hub base model."""
    base = _identity_field(results.base_model_identity, "base_model_identity") or model_identity(results.base_model)
    warm = _identity_field(results.warm_start_identity, "warm_start_identity") or model_identity(
        config.get("warm_started_from")
    )
    base_model_hub = base["hub_id"] if base else None
    if base_model_hub is None and warm is not None:
        base_model_hub = warm["hub_id"]
    return base, base_model_hub, warm


def _applied_hyperparameters(results: RunRecord) -> dict:
    """The recorded settings (train.py's arguments) that applied to this run: those of the data source it did not
    use (`--data_dir` prefixes for a file or `datasets` run, split names without `--dataset_name`), of the preset
    and the tokenizer training for a run from a saved model, of streaming for a cached run, bookkeeping, secrets
    and unset values are left out."""
    hyper = redact_secrets(results.hyperparameters or {})
    drop = set(NOT_HYPERPARAMETERS)
    if hyper.get("train_file") or hyper.get("dataset_name") or hyper.get("corpora"):
        drop.update(DATA_DIR_SETTINGS)
    if not hyper.get("patience"):
        drop.update(("patience", "min_delta"))
    if hyper.get("ema_decay") is None:
        drop.update(("ema_start_step", "eval_weights"))
    if not hyper.get("dataset_name"):
        drop.update(DATASET_SETTINGS)
    if hyper.get("model_name_or_path") or results.base_model:
        drop.update(PRESET_SETTINGS + TOKENIZER_TRAINING_SETTINGS)
    if hyper.get("tokenizer"):
        drop.update(TOKENIZER_TRAINING_SETTINGS)
    if not hyper.get("streaming"):
        drop.update(STREAMING_SETTINGS)
    if results.source_lang is None and results.target_lang is None and results.languages:
        drop.update(("source_lang", "target_lang"))  # a many-to-many run takes --languages
    return {k: v for k, v in hyper.items() if k not in drop and v is not None and v != [] and v != {}}


def _hyperparameter_rows(results: RunRecord) -> list[tuple[str, str]]:
    return [(k, _fmt(v)) for k, v in _applied_hyperparameters(results).items()]


def _data_files(results: RunRecord) -> list[tuple[str, str]]:
    """(role, file name) of the data files of a file run (train.py --train_file/--valid_file/--test_file)."""
    hyper = results.hyperparameters or {}
    return [(role, _local_name(str(hyper[key]))) for key, role in DATA_FILE_SETTINGS if hyper.get(key)]


def _training_rows(results: RunRecord) -> list[tuple[str, str]]:
    """Steps, epochs, time, throughput, and the settings changed when the run was resumed (train.py
    --allow_changed_settings, or max_steps and the like)."""
    rows = [
        (label, value)
        for label, value in (
            ("Optimizer steps", _fmt(results.steps) if results.steps is not None else None),
            ("Epochs", f"{float(results.epochs):.2f}" if results.epochs is not None else None),
            ("Wall time", _duration(results.wall_time_sec)),
            (
                "Training throughput",
                f"{float(results.train_tokens_per_sec):,.0f} tokens/s"
                if results.train_tokens_per_sec is not None
                else None,
            ),
        )
        if value is not None
    ]
    by_step: dict[int, list[str]] = {}
    for change in results.settings_changes or []:
        if isinstance(change, Mapping) and "setting" in change:
            by_step.setdefault(change.get("step"), []).append(
                f"`{change['setting']}` {_fmt(change.get('from'))} → {_fmt(change.get('to'))}"
            )
    if results.run_id:
        rows.append(("Run id", f"`{results.run_id}`"))
    if results.final_model:
        rows.append(("Final weights", str(results.final_model)))
    choice = results.best_checkpoint if isinstance(results.best_checkpoint, Mapping) else {}
    if choice.get("final_step") is not None and choice.get("statement"):
        rows.append(("Checkpoint choice", str(choice["statement"])))
    stop = results.early_stopping if isinstance(results.early_stopping, Mapping) else {}
    if stop.get("stopped_at_step") is not None:
        rows.append(
            (
                "Stopped early",
                f"at step {_fmt(stop['stopped_at_step'])}: validation {stop.get('metric')} did not improve by more "
                f"than {_fmt(stop.get('min_delta'))} in {_fmt(stop.get('patience'))} validations",
            )
        )
    return rows + [(f"Resumed at step {_fmt(step)} with", "; ".join(items)) for step, items in by_step.items()]


def _corpus_rows(results: RunRecord) -> list[dict]:
    """The training corpora of a run with several (name, source file or dataset, pairs, weight, share, tag)."""
    rows = []
    for spec in results.corpora or []:
        if not isinstance(spec, Mapping):
            continue
        source = spec.get("train_file") or spec.get("data_dir") or spec.get("dataset_name") or ""
        if spec.get("data_dir"):
            source = f"{_local_name(str(source))}/{spec.get('prefix', 'train')}.*"
        elif spec.get("train_file"):
            source = _local_name(str(source))
        rows.append(
            {
                "name": str(spec.get("name", source)),
                "source": str(source),
                "pairs": spec.get("pairs"),
                "weight": spec.get("weight"),
                "share": spec.get("share"),
                "tag": spec.get("tag"),
            }
        )
    return rows


def _example_languages(src, tgt, languages: list[str], config: Mapping) -> tuple[str, str | None]:
    """The usage example's source language and the `tgt_lang` it passes (None: the model takes none). Models that
    know their languages take (and multilingual ones need) `tgt_lang`; others reject it."""
    example_src = src or (languages[0] if languages else "en")
    example_tgt = tgt or next((lang for lang in languages if lang != example_src), None)
    needs_tgt_lang = example_tgt is not None and example_tgt in (config.get("languages") or [])
    return example_src, example_tgt if needs_tgt_lang else None


def _run_template_vars(results: RunRecord) -> dict:
    """The card's fields that come from the run's record alone: data, scores, hyperparameters, training rows."""
    return dict(
        dataset=results.dataset,
        data_files=_data_files(results),
        corpora=_corpus_rows(results),
        max_length=(results.hyperparameters or {}).get("max_length"),
        eval_split=_split_name(str(results.eval_split)) if results.eval_split else None,
        train_pairs=results.train_pairs,
        dropped_pairs=results.dropped_pairs,
        dropped_reasons={k: v for k, v in (results.dropped_reasons or {}).items() if v},
        hyperparameters=_hyperparameter_rows(results),
        training=_training_rows(results),
        bleu=results.bleu,
        chrf=results.chrf,
        chrfpp=results.chrfpp,
        ter=results.ter,
        bleu_signature=results.sacrebleu_signature,
        chrf_signature=results.chrf_signature,
        chrfpp_signature=results.chrfpp_signature,
        ter_signature=results.ter_signature,
        per_direction=[
            (direction, scores)
            for direction, scores in (results.per_direction or {}).items()
            if isinstance(scores, Mapping)
        ],
    )


def build_model_card(
    model_dir: str | os.PathLike,
    results: RunRecord | Mapping | None,
    repo_id: str | None = None,
    *,
    license: str | None = None,  # noqa: A002 - the Hub's metadata key
    benchmark_dir: str | os.PathLike | None = BENCHMARK_RESULTS,
) -> ModelCard:
    """Build the `ModelCard` of the model saved in `model_dir` from the run's record (a `RunRecord`, or
    results.json's object).

    `repo_id` ("ORG/NAME") goes into the usage snippet and the model-index name; without it the snippet shows a
    placeholder. The model type comes from the record's `model_type` or config.json. Raises `ValueError` for a
    model type without a template. The family's rows of the repository's side-by-side benchmark
    (`benchmark_dir`, see `benchmark_summary`) are cited when present.
    """
    model_dir = Path(model_dir)
    results = RunRecord.from_dict(results)
    config = _load_config(model_dir)
    model_type = results.model_type or config.get("model_type")
    if not model_type:
        raise ValueError(f"Unknown model type: neither results nor {model_dir / 'config.json'} name one.")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"No model card template for model type {model_type!r}; known: {sorted(FAMILIES)}.")

    src, tgt, languages = _languages(results, config)
    multilingual = not (src and tgt) and len(languages) > 2
    dataset = _dataset(results, languages)
    params = results.params
    if params is None:
        params = count_parameters(model_dir)
    model_name = _model_name(repo_id, model_type, dataset, languages, src, tgt)
    eval_results = _eval_results(results, dataset, src, tgt)
    base, base_model_hub, warm = _base_models(results, config)
    tags = ["translation", PACKAGE_TAG, model_type, family.tag] + (["multilingual"] if multilingual else [])
    license = license or results.license or DEFAULT_LICENSE  # noqa: A001
    benchmark = benchmark_summary(model_type, benchmark_dir)
    if not _benchmark_describes(benchmark, model_type, dataset, src, tgt, multilingual, params, base):
        benchmark = None

    card_data = ModelCardData(
        language=languages or None,
        license=license,
        library_name="transformers",
        pipeline_tag="translation",
        tags=tags,
        datasets=[dataset.hub_id] if dataset and dataset.hub_id else None,  # Hub dataset ids only
        metrics=sorted({r.metric_type for r in eval_results}) or None,
        base_model=base_model_hub,
        model_name=model_name if eval_results else None,
        eval_results=eval_results or None,
    )

    example_src, example_tgt = _example_languages(src, tgt, languages, config)

    directions = [str(d) for d in results.directions or []]
    if not directions and src and tgt:
        directions = [f"{src}-{tgt}"]
    template_vars = dict(
        family=family,
        model_type=model_type,
        variant=results.variant,
        directions=directions,
        base_model_hub=base_model_hub,
        fine_tuned=base is not None,
        base_name=base["name"] if base else None,
        warm_started_from=warm["name"] if warm else None,
        warm_started_hub=warm["hub_id"] if warm else None,
        model_id=repo_id or PLACEHOLDER_REPO_ID,
        has_repo_id=repo_id is not None,
        model_name=model_name,
        src=src,
        tgt=tgt,
        languages=languages,
        multilingual=multilingual,
        direction=f"{src}→{tgt}" if src and tgt else None,
        dataset_id=dataset.hub_id if dataset else None,
        dataset_pretty=dataset.name if dataset else None,
        multi30k=dataset is not None and dataset.name == "Multi30k",
        license=license,
        license_chosen=license != DEFAULT_LICENSE,
        code_license=CODE_LICENSE,
        small_model=params is not None and params < SMALL_MODEL_PARAMS,
        architecture=_architecture_rows(config, family, params),
        params=params,
        config=config,
        **_run_template_vars(results),
        example=EXAMPLE_SENTENCES.get(example_src, EXAMPLE_SENTENCES["en"]),
        example_tgt=example_tgt,
        tokenizer_model=_tokenizer_model(model_dir),
        benchmark=benchmark,
        fmt=_fmt,
    )
    card = ModelCard.from_template(
        card_data, template_path=str(family.template), base=_base_template(), **template_vars
    )
    card.text = re.sub(r"[ \t]+\n", "\n", re.sub(r"\n{3,}", "\n\n", card.text)).strip("\n")
    card.text = "\n" + card.text + "\n"
    return card


def _benchmark_describes(
    benchmark: dict | None,
    model_type: str,
    dataset: DatasetNames | None,
    src: str | None,
    tgt: str | None,
    multilingual: bool,
    params: int | None,
    base: dict | None,
) -> bool:
    """Whether the side-by-side benchmark describes this model: trained from scratch on Multi30k in the
    benchmark's direction(s) (en→de, or many-to-many for the multilingual rows), at about the size of its family's
    benchmark rows (`BENCHMARK_SIZE_RATIO` of their parameters)."""
    if benchmark is None or dataset is None or dataset.name != "Multi30k" or base is not None or params is None:
        return False
    if (not multilingual) if benchmark["multilingual"] else (src, tgt) != ("en", "de"):
        return False
    runs = BENCHMARK_RUNS[model_type][0]
    low, high = BENCHMARK_SIZE_RATIO
    return any(low <= params / row["params"] <= high for row in benchmark["rows"] if row["name"] in runs)


def benchmark_summary(model_type: str, results_dir: str | os.PathLike | None = BENCHMARK_RESULTS) -> dict | None:
    """This family's rows of the side-by-side benchmark (benchmarks/results/quality.json, efficiency.json), with
    the baseline row they are compared with; None when the benchmark files are not there (e.g. outside a
    checkout)."""
    if results_dir is None or model_type not in BENCHMARK_RUNS:
        return None
    path = Path(results_dir) / "quality.json"
    if not path.is_file():
        return None
    quality = json.loads(path.read_text(encoding="utf-8"))
    runs, baseline, eff_name = BENCHMARK_RUNS[model_type]
    by_name = {row["name"]: row for row in quality.get("rows", [])}
    names = [baseline] + [n for n in runs if n != baseline]
    rows = [by_name[n] for n in names if n in by_name]
    if not any(row["name"] in runs for row in rows):
        return None
    speed = None
    eff_path = Path(results_dir) / "efficiency.json"
    if eff_path.is_file():
        eff = json.loads(eff_path.read_text(encoding="utf-8")).get("results", {}).get("small", {})
        if eff_name in eff:
            speed = eff[eff_name].get("ratios_vs_baseline")
    multilingual = rows[0].get("group") == "multi"
    # the same runs at the 45-minute budget (`NAME_45min`), next to the baseline's run at that budget
    longer_names = [f"{baseline}_45min"] + [f"{n}_45min" for n in runs if n != baseline]
    longer_rows = [by_name[n] for n in longer_names if n in by_name]
    if len(longer_rows) < 2 or longer_rows[0]["name"] != f"{baseline}_45min" or not quality.get("reference_45min"):
        longer_rows = []
    return {
        "budget": quality.get("budget", {}),
        "rows": rows,
        "speed": speed,
        "multilingual": multilingual,
        "longer_rows": longer_rows,
        "reference_45min": quality.get("reference_45min"),
        "url": BENCHMARK_URL,
    }


def _base_template() -> jinja2.Template:
    """The shared body, passed to the family templates, which `{% extends base %}` it.

    `ModelCard.from_template` compiles a template without a loader, so the base is handed over as a compiled
    template object (Jinja accepts one in `extends`)."""
    source = (TEMPLATES_DIR / BASE_TEMPLATE).read_text(encoding="utf-8")
    return jinja2.Template(source, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)


def card_from_run(run_dir: str | os.PathLike, repo_id: str | None = None) -> ModelCard:
    """Build the card of a run folder (`results.json` + `model/`) and save it as `model/README.md`."""
    run_dir = Path(run_dir)
    results = load_results(run_dir)
    model_dir = run_dir / "model"
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"No saved model in {str(model_dir)!r} (config.json is missing).")
    card = build_model_card(model_dir, results, repo_id=repo_id)
    readme = model_dir / "README.md"
    tmp = readme.with_name(f".{readme.name}.tmp-card")  # written whole, then renamed: never a half-written card
    try:
        tmp.write_text(str(card), encoding="utf-8")
        os.replace(tmp, readme)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return card


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write RUN_DIR/model/README.md from RUN_DIR/results.json.")
    parser.add_argument("run_dir")
    parser.add_argument("--repo_id", default=None, help="ORG/NAME shown in the usage snippet")
    args = parser.parse_args(argv)
    card_from_run(args.run_dir, repo_id=args.repo_id)
    print(Path(args.run_dir) / "model" / "README.md")


if __name__ == "__main__":
    main()
