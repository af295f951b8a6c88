"""Model cards: Hub metadata that round-trips through huggingface_hub's parsers, and a complete body per family.

Run folders are built here from the contract the training script follows (results.json + model/config.json,
model.safetensors, tokenizer.json); no model is trained, so these tests need neither torch nor hf_variants.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from hub_server import validate_card_metadata
from huggingface_hub import EvalResult, ModelCard, metadata_load
from huggingface_hub.repocard_data import model_index_to_eval_results
from safetensors.numpy import save_file

from model_cards import card as card_module
from model_cards.card import FAMILIES, PLACEHOLDER_REPO_ID, build_model_card, card_from_run, count_parameters

# Variant config fields per family, as the configs store them (values are arbitrary but distinct).
VARIANT_FIELDS = {
    "transformer_nmt": {},
    "mute_nmt": {
        "num_units": 4,
        "unit_types": ["identity", "swap", "mask", "disorder"],
        "merge": "seq",
        "swap_range": 3,
    },
    "hysan_nmt": {
        "encoder_branches": ["global", "forward", "backward", "local"],
        "decoder_branches": ["forward", "local"],
        "local_k": 5,
        "fusion": "gated_sum",
    },
    "mgsa_nmt": {
        "mgsa_layers": [0],
        "phrase_type": "ngram",
        "ngram_sizes": [2, 3, 4],
        "phrase_composition": "san",
        "phrase_interaction": "on_lstm",
    },
    "mimo_nmt": {"num_transformations": 3, "task_attention": True},
    "tied_nmt": {"direction_embedding": True, "num_directions": 1},
}
# Title fragment of each family's paper, which must appear in the card's BibTeX.
PAPER_TITLES = {
    "transformer_nmt": "Attention Is All You Need",
    "mute_nmt": "Multi-Unit Transformers for Neural Machine Translation",
    "hysan_nmt": "Hybrid Self-Attention Network for Machine Translation",
    "mgsa_nmt": "Multi-Granularity Self-Attention for Neural Machine Translation",
    "mimo_nmt": "Modeling Task-Aware {MIMO} Cardinality",
    "tied_nmt": "Tied Transformers: Neural Machine Translation with Shared Encoder and Decoder",
}
SECRET = "hf_abcdefghijklmnopqrstuvwxyz012345"


def make_results(model_type: str, **overrides) -> dict:
    results = {
        "model_type": model_type,
        "variant": f"{FAMILIES[model_type].name} test run",
        "source_lang": "en",
        "target_lang": "de",
        "languages": ["en", "de"],
        "dataset": "multi30k",
        "eval_split": "test_2016_flickr",
        "bleu": 12.3456,
        "chrf": 40.987,
        "sacrebleu_signature": "nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:2.6.0",
        "chrf_signature": "nrefs:1|case:mixed|eff:yes|nc:6|nw:0|space:no|version:2.6.0",
        "params": 123_457,
        "train_tokens_per_sec": 2345.5,
        "wall_time_sec": 321.0,
        "train_pairs": 28_911,
        "dropped_pairs": 89,
        "dropped_reasons": {"too_long": 80, "length_ratio": 9},
        "steps": 1500,
        "epochs": 2.25,
        "hyperparameters": {
            "learning_rate": 0.0007,
            "warmup_steps": 4000,
            "max_tokens": 4096,
            "hub_token": SECRET,
            "label_smoothing": 0.1,
        },
        "base_model": None,
    }
    results.update(overrides)
    return results


def make_run(
    tmp_path: Path,
    model_type: str,
    results: dict | None = None,
    config_extra: dict | None = None,
    tensors: dict | None = None,
) -> Path:
    """A run folder in the training script's layout, with a real safetensors file and tokenizer.json."""
    run = tmp_path / f"run-{model_type}"
    model_dir = run / "model"
    model_dir.mkdir(parents=True)
    config = {
        "model_type": model_type,
        "d_model": 48,
        "encoder_layers": 3,
        "decoder_layers": 2,
        "encoder_attention_heads": 6,
        "decoder_attention_heads": 3,
        "encoder_ffn_dim": 96,
        "decoder_ffn_dim": 80,
        "vocab_size": 517,
        "normalize_before": True,
        "position_embedding_type": "sinusoidal",
        "languages": [],
        "dtype": "float32",
        "auto_map": {"AutoConfig": f"configuration_{model_type}.Config"},
        **VARIANT_FIELDS[model_type],
        **(config_extra or {}),
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    tensors = tensors or {"a.weight": np.zeros((7, 5), np.float32), "b.bias": np.zeros((11,), np.float32)}
    save_file(tensors, str(model_dir / "model.safetensors"))
    (model_dir / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE", "vocab": {}}}))
    (run / "results.json").write_text(json.dumps(make_results(model_type) if results is None else results))
    return run


def expected_eval_results(results: dict, dataset_type: str) -> list[EvalResult]:
    """What the model-index must hold for `results`, derived from the inputs."""
    out = []
    pair = f"{results['source_lang']}-{results['target_lang']}" if results.get("source_lang") else None
    entries = [(pair, results, pair or "all directions")]
    entries += [(d, s, d) for d, s in (results.get("per_direction") or {}).items() if d != pair]
    for config, scores, label in entries:
        for metric, name, sig in (("bleu", "BLEU", "sacrebleu_signature"), ("chrf", "chrF", "chrf_signature")):
            out.append(
                EvalResult(
                    task_type="translation",
                    task_name="Translation",
                    dataset_type=dataset_type,
                    dataset_name=f"Multi30k ({label})",
                    dataset_config=config,
                    dataset_split=results["eval_split"],
                    metric_type=metric,
                    metric_name=name,
                    metric_value=round(scores[metric], 2),
                    metric_args={"signature": scores.get(sig) or results[sig]},
                )
            )
    return out


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_card_from_run_metadata_round_trips(tmp_path, model_type):
    run = make_run(tmp_path, model_type)
    results = json.loads((run / "results.json").read_text())
    card = card_from_run(run, repo_id="org/demo-model")
    readme = run / "model" / "README.md"
    assert readme.is_file()

    loaded = ModelCard.load(readme)
    assert loaded.data.to_dict() == card.data.to_dict()
    data = loaded.data
    assert data.language == ["en", "de"]
    assert data.license == "unknown"  # no license chosen: none claimed
    assert data.library_name == "transformers"
    assert data.pipeline_tag == "translation"
    assert {"translation", "hf-variants", model_type, FAMILIES[model_type].tag} <= set(data.tags)
    assert data.datasets == ["bentrevett/multi30k"]  # the Hub id holds en-de: used
    assert data.metrics == ["bleu", "chrf"]
    assert data.base_model is None
    assert data.model_name == "demo-model"
    assert data.eval_results == expected_eval_results(results, "bentrevett/multi30k")

    meta = metadata_load(readme)
    name, eval_results = model_index_to_eval_results(meta["model-index"])
    assert name == "demo-model"
    assert eval_results == data.eval_results
    assert [r.metric_args["signature"] for r in eval_results] == [
        results["sacrebleu_signature"],
        results["chrf_signature"],
    ]
    assert validate_card_metadata(readme.read_text()) == []  # what the Hub test server checks


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_card_body_has_every_section(tmp_path, model_type):
    run = make_run(tmp_path, model_type)
    results = json.loads((run / "results.json").read_text())
    text = card_from_run(run, repo_id="org/demo-model").text
    config = json.loads((run / "model" / "config.json").read_text())

    # The paper as BibTeX, inside a bibtex code block.
    bibtex = re.findall(r"```bibtex\n(.*?)```", text, re.S)
    assert any(PAPER_TITLES[model_type] in entry and entry.lstrip().startswith("@") for entry in bibtex)
    # Architecture numbers from config.json and results.
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M))
    assert rows["Parameters"].startswith(f"{results['params']:,}")
    assert rows["Model width d_model"] == str(config["d_model"])
    assert rows["Encoder / decoder layers"] == f"{config['encoder_layers']} / {config['decoder_layers']}"
    assert (
        rows["Attention heads (encoder / decoder)"]
        == f"{config['encoder_attention_heads']} / {config['decoder_attention_heads']}"
    )
    assert rows["Vocabulary (shared source/target)"] == str(config["vocab_size"])
    assert rows["Layer norm"] == "pre-norm"
    labels = dict(FAMILIES[model_type].fields)
    for key, value in VARIANT_FIELDS[model_type].items():
        shown = card_module._fmt(value)
        assert rows[labels.get(key, f"`{key}`")] == shown, key
    # Training data, with the dropped pairs and why.
    assert f"**{results['train_pairs']:,}**" in text and f"**{results['dropped_pairs']}**" in text
    for reason, count in results["dropped_reasons"].items():
        assert rows[reason] == str(count)
    # Hyperparameters (secrets left out) and results.
    assert rows["`learning_rate`"] == "0.0007" and rows["`max_tokens`"] == "4,096"
    assert "hub_token" not in text and SECRET not in str(card_from_run(run))
    assert re.search(rf"^\| en→de \| {results['bleu']:.2f} \| {results['chrf']:.2f} \|$", text, re.M)
    assert results["sacrebleu_signature"] in text and results["chrf_signature"] in text
    # Usage: one-line trust_remote_code loads and the translation pipeline, with the repo id.
    assert 'AutoModelForSeq2SeqLM.from_pretrained("org/demo-model", trust_remote_code=True)' in text
    assert 'AutoTokenizer.from_pretrained("org/demo-model", trust_remote_code=True)' in text
    assert 'pipeline("translation", model="org/demo-model", trust_remote_code=True)' in text
    for heading in (
        "## Model description",
        "## Usage",
        "## Training data",
        "## Training procedure",
        "## Evaluation",
        "## Limitations",
        "## Citation",
    ):
        assert heading in text


def test_multilingual_card_has_per_direction_results(tmp_path):
    per_direction = {
        "en-de": {"bleu": 20.111, "chrf": 45.0},
        "de-en": {"bleu": 24.5, "chrf": 48.25},
        "en-fr": {"bleu": 30.0, "chrf": 55.0},
    }
    results = make_results(
        "mimo_nmt",
        source_lang=None,
        target_lang=None,
        languages=["en", "de", "fr"],
        per_direction=per_direction,
        bleu=24.87,
        chrf=49.4,
    )
    run = make_run(
        tmp_path,
        "mimo_nmt",
        results=results,
        config_extra={"languages": ["en", "de", "fr"], "target_language_tags": True},
    )
    card_from_run(run, repo_id="org/mimo-multi")
    loaded = ModelCard.load(run / "model" / "README.md")
    assert loaded.data.language == ["en", "de", "fr"]
    assert "multilingual" in loaded.data.tags
    assert loaded.data.datasets is None  # bentrevett/multi30k has no French: not claimed, and no other Hub id
    assert loaded.data.eval_results == expected_eval_results(results, "multi30k")
    assert {r.dataset_config for r in loaded.data.eval_results} == {None, "en-de", "de-en", "en-fr"}
    text = loaded.text
    for direction, scores in per_direction.items():
        assert re.search(rf"^\| {direction} \| {scores['bleu']:.2f} \| {scores['chrf']:.2f} \|$", text, re.M)
    assert 'tgt_lang="' in text  # the multilingual usage names the target language


def test_base_model_and_license(tmp_path):
    run = make_run(tmp_path, "transformer_nmt", results=make_results("transformer_nmt", base_model="org/parent"))
    card = build_model_card(run / "model", json.loads((run / "results.json").read_text()), license="mit")
    data = ModelCard(str(card)).data
    assert data.base_model == "org/parent" and data.license == "mit"
    assert "fine-tuned from [`org/parent`]" in card.text


def test_card_without_results_uses_config_and_weights(tmp_path):
    tensors = {"x": np.zeros((3, 4, 5), np.float32), "y": np.zeros((6,), np.float16)}
    run = make_run(tmp_path, "tied_nmt", results={}, tensors=tensors)
    assert count_parameters(run / "model") == 3 * 4 * 5 + 6
    card = build_model_card(run / "model", {})  # model type from config.json, no repo id
    data = ModelCard(str(card)).data
    assert data.eval_results is None and "model-index" not in data.to_dict()
    assert "tied_nmt" in data.tags
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", card.text, re.M))
    assert rows["Parameters"] == "66"
    assert f'from_pretrained("{PLACEHOLDER_REPO_ID}", trust_remote_code=True)' in card.text
    assert "No evaluation results were recorded" in card.text


def test_unknown_model_type_is_rejected(tmp_path):
    run = make_run(tmp_path, "transformer_nmt")
    with pytest.raises(ValueError, match="No model card template for model type 'bart'"):
        build_model_card(run / "model", {"model_type": "bart"})
    with pytest.raises(FileNotFoundError, match="results.json"):
        card_from_run(tmp_path / "missing")


def test_secret_keys_are_redacted_but_token_counts_are_kept():
    redacted = card_module.redact_secrets(
        {
            "hub_token": "x",
            "use_auth_token": True,
            "api_key": "k",
            "nested": {"password": "p", "lr": 1},
            "max_tokens": 4096,
            "batch_tokens": 10,
            "label": SECRET,
            "tokenizer": "bpe",
        }
    )
    assert redacted == {"nested": {"lr": 1}, "max_tokens": 4096, "batch_tokens": 10, "tokenizer": "bpe"}


def test_family_templates_share_one_base():
    base = (card_module.TEMPLATES_DIR / card_module.BASE_TEMPLATE).read_text()
    for model_type, family in FAMILIES.items():
        source = family.template.read_text()
        assert source.startswith("{% extends base %}"), model_type
        assert "## Usage" not in source and "model-index" not in source  # shared sections live in the base only
        assert len(source) < len(base) / 2, model_type


def test_training_script_results_with_local_paths(tmp_path):
    """results.json as training/train.py writes it: dataset/split/base model may be local paths, `variant` is the
    preset, hyperparameters are the script's arguments (bookkeeping and None values left out of the card)."""
    local_parent = tmp_path / "runs" / "parent" / "model"
    local_parent.mkdir(parents=True)
    results = make_results(
        "hysan_nmt",
        source_lang=None,
        target_lang=None,
        languages=["en", "de"],
        directions=["en-de", "de-en"],
        dataset=str(tmp_path / "corpora" / "my_corpus"),
        eval_split=str(tmp_path / "test.en-de.tsv.gz"),
        variant="tiny",
        base_model=str(local_parent),
        per_direction={
            "en-de": {"bleu": 10.0, "chrf": 30.0, "pairs": 8},
            "de-en": {"bleu": 12.0, "chrf": 33.0, "pairs": 8},
        },
        hyperparameters={
            "learning_rate": 0.003,
            "output_dir": str(tmp_path / "runs" / "x"),
            "dropout": None,
            "push_to_hub": True,
            "hub_model_id": "org/x",
            "preset": "tiny",
        },
    )
    run = make_run(tmp_path, "hysan_nmt", results=results)
    card = card_from_run(run, repo_id="org/x")
    data = ModelCard.load(run / "model" / "README.md").data
    assert data.base_model is None  # a local checkpoint is no Hub model id
    assert data.datasets is None  # a local folder is no Hub dataset
    assert {r.dataset_type for r in data.eval_results} == {"my_corpus"}
    assert {r.dataset_split for r in data.eval_results} == {"test.en-de.tsv.gz"}  # the file by its name
    assert {r.dataset_config for r in data.eval_results} == {None, "en-de", "de-en"}
    assert str(tmp_path) not in card.text  # no local path in the card
    assert "fine-tuned from the local checkpoint `parent/model`" in card.text and "configuration `tiny`" in card.text
    assert "translation en-de, de-en" in card.text.splitlines()[1]  # the title
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", card.text, re.M))
    assert rows["`learning_rate`"] == "0.003"
    # bookkeeping, unset values, and the preset of a run that started from a saved model are left out
    assert not {"`output_dir`", "`dropout`", "`push_to_hub`", "`hub_model_id`", "`preset`"} & set(rows)
    assert validate_card_metadata(str(card)) == []


def test_card_cites_the_side_by_side_benchmark(tmp_path):
    """With benchmark results present, the card shows its family's rows next to the baseline they are compared
    with, and the speed ratios at the same dims; without them, no such section."""
    run = make_run(tmp_path, "mute_nmt", results=make_results("mute_nmt", params=7_400_000))  # the rows' size
    results = json.loads((run / "results.json").read_text())
    bench = tmp_path / "bench"
    bench.mkdir()

    def row(name, label, bleu):
        return {
            "name": name,
            "label": label,
            "group": "en-de",
            "params": 7_500_000,
            "bleu": bleu,
            "chrf": bleu + 20,
            "en_de_bleu": bleu,
        }

    (bench / "quality.json").write_text(
        json.dumps(
            {
                "budget": {"steps": 240, "max_tokens": 2048},
                "rows": [
                    row("baseline", "Baseline X", 20.5),
                    row("mute", "MUTE X", 21.25),
                    row("hysan_e1", "HySAN X", 19.0),
                    row("mute_bias_seq", "MUTE+bias+seq X", 22.0),
                ],
                "reference_45min": {"bleu": 34.0, "steps": 1100, "max_tokens": 4096, "epochs": 9},
            }
        )
    )
    (bench / "efficiency.json").write_text(
        json.dumps(
            {
                "results": {
                    "small": {
                        "mute": {
                            "ratios_vs_baseline": {
                                "train_tokens_per_sec": 0.55,
                                "greedy_tokens_per_sec": 0.65,
                                "beam4_tokens_per_sec": 0.84,
                            }
                        }
                    }
                }
            }
        )
    )
    text = build_model_card(run / "model", results, benchmark_dir=bench).text
    assert "### Side-by-side benchmark" in text
    table = re.findall(r"^\| ([^|]+?) \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [(label, bleu) for label, _, bleu, _ in table] == [
        ("Baseline X", "20.50"),
        ("MUTE X", "21.25"),
        ("MUTE+bias+seq X", "22.00"),
    ]  # no HySAN row
    assert "training 0.55x" in text and "beam-4 decoding 0.84x" in text
    assert "240 steps of <= 2048 tokens" in text
    assert "longer budget" not in text  # no 45-minute runs in this file
    # with the family's runs at the 45-minute budget (and the baseline's), a second table lists them
    quality = json.loads((bench / "quality.json").read_text())
    quality["rows"] += [
        row("baseline_45min", "Baseline X, 45 min", 33.5),
        row("mute_45min", "MUTE X, 45 min", 34.75),
        row("hysan_e1_45min", "HySAN X, 45 min", 33.0),
    ]
    (bench / "quality.json").write_text(json.dumps(quality))
    text = build_model_card(run / "model", results, benchmark_dir=bench).text
    table = re.findall(r"^\| ([^|]+?) \| ([\d.]+)M \| ([\d.]+) \| ([\d.]+) \|$", text, re.M)
    assert [(label, bleu) for label, _, bleu, _ in table][3:] == [
        ("Baseline X, 45 min", "33.50"),
        ("MUTE X, 45 min", "34.75"),
    ]
    assert "1100 steps of <= 4096 tokens" in text and "reached 34.0 BLEU" in text
    plain = build_model_card(run / "model", results, benchmark_dir=tmp_path / "missing").text
    assert "Side-by-side benchmark" not in plain
    # the benchmark describes Multi30k en→de models of its size trained from scratch: no section for any other
    for other in (
        {"params": 56_000},  # a tiny model
        {"params": 60_000_000},  # a base-size model
        {"source_lang": "en", "target_lang": "fr", "languages": ["en", "fr"]},
        {"dataset": "data/train.tsv"},
        {"base_model": "org/parent"},  # fine-tuned from another model
    ):
        text = build_model_card(run / "model", {**results, **other}, benchmark_dir=bench).text
        assert "Side-by-side benchmark" not in text and "Baseline X" not in text, other


# ------------------------------------------------------------------------------------------------ the run record
def test_run_record_reads_old_and_new_results_files():
    """results.json of another version loads: missing keys take defaults, unknown keys are kept and written back;
    the keys train.py writes are the record's fields, in order."""
    from model_cards.run_record import RunRecord

    old = {"model_type": "mute_nmt", "bleu": 1.5, "steps": 7, "an_old_key": {"x": 1}, "per_direction": None}
    record = RunRecord.from_dict(old)
    assert (record.model_type, record.bleu, record.steps) == ("mute_nmt", 1.5, 7)
    assert record.languages == [] and record.params is None and record.per_direction is None
    assert record.extra == {"an_old_key": {"x": 1}}
    written = record.to_dict()
    assert written["an_old_key"] == {"x": 1} and "license" not in written and "dataset_id" not in written
    assert RunRecord.from_dict(written) == record
    full = make_results("transformer_nmt", license="mit", dataset_id="org/data")
    assert RunRecord.from_dict(full).to_dict() == {**RunRecord().to_dict(), **full}
    with pytest.raises(TypeError, match="JSON object"):
        RunRecord.from_dict(["not", "an", "object"])


def test_card_reads_every_record_field_it_shows(tmp_path):
    """Each field the card reads (card.RESULTS_KEYS) is a RunRecord field, and a distinct value given to it shows
    up in the card: a field renamed on one side fails here instead of silently emptying a card field."""
    from model_cards.run_record import RunRecord

    assert set(card_module.RESULTS_KEYS) <= set(RunRecord.field_names())
    record = RunRecord.from_dict(
        make_results(
            "transformer_nmt",
            variant="Variant-XYZ",
            params=987_654,
            train_pairs=31_337,
            dropped_pairs=4_242,
            steps=2_718,
            epochs=3.14159,
            wall_time_sec=7_265.0,
            train_tokens_per_sec=6_543.0,
            license="apache-2.0",
            base_model="org/parent-model",
            directions=["en-de"],
            dataset="wmt16",
            dataset_id="org/wmt16-copy",
            settings_changes=[{"step": 99, "setting": "learning_rate", "from": 0.1, "to": 0.2, "free": False}],
            run_id="0123456789abcdef",
        )
    )
    run = make_run(tmp_path, "transformer_nmt", results=record.to_dict())
    card = build_model_card(run / "model", record)
    text, data = card.text, ModelCard(str(card)).data
    for shown in (
        "Variant-XYZ",
        "987,654",
        "31,337",
        "4,242",
        "2,718",
        "3.14",
        "6,543 tokens/s",
        "12.35",
        "40.99",
        record.sacrebleu_signature,
        "Resumed at step 99",
        "`learning_rate`",
        "| Run id | `0123456789abcdef` |",
    ):
        assert shown in text, shown
    assert data.license == "apache-2.0" and data.base_model == "org/parent-model"
    assert data.datasets == ["org/wmt16-copy"] and data.language == ["en", "de"]
    assert build_model_card(run / "model", record.to_dict()).text == text  # a dict and the record agree


def test_model_identity_names_base_models(tmp_path):
    """A base model is named by what it is: a Hub id, the Hub id of a Hub-cache folder, a run's model folder by its
    card's title and run folder; a malformed recorded identity is an error naming the field."""
    from model_cards.card import model_identity

    assert model_identity("org/opus-mt-en-fr") == {"name": "`org/opus-mt-en-fr`", "hub_id": "org/opus-mt-en-fr"}
    snapshot = tmp_path / "hub" / "models--Helsinki-NLP--opus-mt-en-fr" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert model_identity(snapshot)["hub_id"] == "Helsinki-NLP/opus-mt-en-fr"
    run = make_run(tmp_path, "transformer_nmt", results=make_results("transformer_nmt", dataset="data/train.tsv"))
    card_from_run(run)
    assert model_identity(run / "model") == {
        "name": '"Transformer: en→de translation on train.tsv" (local folder `run-transformer_nmt/model`)',
        "hub_id": None,
    }
    bare = tmp_path / "base"
    bare.mkdir()
    assert model_identity(bare) == {"name": "`base`", "hub_id": None} and model_identity(None) is None
    results = make_results("transformer_nmt", base_model=str(run / "model"), base_model_identity={"hub_id": None})
    with pytest.raises(ValueError, match="'base_model_identity'"):
        build_model_card(run / "model", results)


def test_card_from_run_writes_the_card_atomically(tmp_path, monkeypatch):
    """The card is written whole and renamed into place: a failure leaves the previous README.md and no temporary
    file."""
    run = make_run(tmp_path, "transformer_nmt")
    readme = run / "model" / "README.md"
    readme.write_text("previous card\n")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(card_module.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        card_from_run(run)
    assert readme.read_text() == "previous card\n"
    assert sorted(p.name for p in readme.parent.iterdir() if "README" in p.name) == ["README.md"]
    monkeypatch.undo()
    card_from_run(run)
    assert ModelCard.load(readme).data.license == "unknown"


@pytest.mark.parametrize(
    "damage, message",
    [
        ("torn", r"results\.json is not valid JSON \(line 1, column \d+\)"),
        ("array", r"results\.json must hold a JSON object, got list"),
        ("field_type", r"results\.json field 'bleu' must be a JSON float, got str"),
        ("bool_as_int", r"results\.json field 'steps' must be a JSON int, got bool"),
        ("fifo", r"No results\.json \(a regular file\)"),
        ("huge", r"is 67,108,865 bytes: not a run record"),
    ],
)
def test_a_damaged_results_json_is_refused_naming_the_file(tmp_path, damage, message):
    """results.json is read back as untrusted input: a torn or oversized file, a FIFO (never opened: reading it
    would block) and a field of the wrong JSON type each raise an error naming the file or the field."""
    import os

    from model_cards.card import load_results
    from model_cards.run_record import RunRecord

    path = tmp_path / "results.json"
    good = {"model_type": "transformer_nmt", "bleu": 30.5, "steps": 10}
    if damage == "torn":
        path.write_text(json.dumps(good)[:-9])
    elif damage == "array":
        path.write_text("[1, 2]")
    elif damage == "field_type":
        path.write_text(json.dumps({**good, "bleu": "30.5"}))
    elif damage == "bool_as_int":
        path.write_text(json.dumps({**good, "steps": True}))
    elif damage == "fifo":
        os.mkfifo(path)
    else:
        with open(path, "wb") as f:
            f.truncate(64 * 2**20 + 1)
    with pytest.raises((ValueError, TypeError, FileNotFoundError), match=message):
        RunRecord.from_dict(load_results(tmp_path))
    assert RunRecord.from_dict(good).bleu == 30.5 and RunRecord.from_dict({**good, "bleu": 30}).bleu == 30
