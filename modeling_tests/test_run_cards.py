"""The model cards of real training runs (train.py, tiny models, 2 steps): a run on the user's own TSV files and a
warm-started run fine-tuned from it. Each card is read back with huggingface_hub's `ModelCard` and checked against
the run's results.json: the data named as the user named it, only the settings that applied, no benchmark section
that describes other models, intended use, the license chosen, the warm-start base by its identity."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import read_sentences
from hub_server import validate_card_metadata
from huggingface_hub import ModelCard, ModelCardData

from hf_variants.training import train
from model_cards.card import BENCHMARK_RESULTS

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TINY_RUN = [
    "--max_steps", "2", "--max_tokens", "512", "--warmup_steps", "1",
    "--eval_steps", "2", "--eval_bleu_pairs", "4", "--num_beams", "1", "--max_len_a", "0", "--max_len_b", "4",
    "--eval_batch_size", "8", "--num_examples", "0", "--source_lang", "en", "--target_lang", "fr",
]  # fmt: skip


def rows(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\| (.+?) \| (.+?) \|$", text, re.M))


def write_tsv(path: Path, split: str, n: int, start: int = 0) -> Path:
    pairs = zip(read_sentences("en", split, n=n, start=start), read_sentences("fr", split, n=n, start=start))
    path.write_text("en\tfr\n" + "".join(f"{en}\t{fr}\n" for en, fr in pairs), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tsv_run(tmp_path_factory):
    """`train.py --train_file data/train.tsv --valid_file data/valid.tsv --test_file data/test.tsv` (en→fr)."""
    root = tmp_path_factory.mktemp("cards")
    data = root / "data"
    data.mkdir()
    files = [
        write_tsv(data / "train.tsv", "train", 64),
        write_tsv(data / "valid.tsv", "train", 4, start=64),
        write_tsv(data / "test.tsv", "test_2016_flickr", 4),
    ]
    run_dir = root / "tsv-run"
    train.main(
        TINY_RUN
        + ["--preset", "tiny", "--vocab_size", "200"]
        + ["--train_file", str(files[0]), "--valid_file", str(files[1]), "--test_file", str(files[2])]
        + ["--license", "cc-by-4.0", "--output_dir", str(run_dir)]
    )
    return root, run_dir, json.loads((run_dir / "results.json").read_text())


def test_card_of_a_tsv_run(tsv_run):
    root, run_dir, results = tsv_run
    readme = run_dir / "model" / "README.md"
    card = ModelCard.load(readme)
    data: ModelCardData = card.data
    # metadata, as the Hub reads it, and as results.json says
    assert data.language == ["en", "fr"] and data.license == "cc-by-4.0" == results["license"]
    assert data.datasets is None  # local files are no Hub dataset (not `[train]`)
    assert data.model_name == "transformer-nmt-train.tsv-en-fr"
    scores = [
        (r.metric_type, r.metric_value, r.dataset_split, r.dataset_type, r.dataset_config) for r in data.eval_results
    ]
    assert scores == [
        ("bleu", round(results["bleu"], 2), "test.tsv", "train.tsv", "en-fr"),
        ("chrf", round(results["chrf"], 2), "test.tsv", "train.tsv", "en-fr"),
    ]
    assert [r.metric_args["signature"] for r in data.eval_results] == [
        results["sacrebleu_signature"],
        results["chrf_signature"],
    ]
    assert validate_card_metadata(readme.read_text(encoding="utf-8")) == []
    # the body: the title names the files, the files listed, scores and size from results.json
    text = card.text
    assert text.lstrip().splitlines()[0] == "# Transformer: en→fr translation on train.tsv"
    for line in ("- Training file: `train.tsv`.", "- Validation file: `valid.tsv`.", "- Test file: `test.tsv`."):
        assert line in text
    row = " | ".join(f"{results[k]:.2f}" for k in ("bleu", "chrf", "chrfpp", "ter"))
    assert re.search(rf"^\| en→fr \| {re.escape(row)} \|$", text, re.M)
    for signature in ("sacrebleu_signature", "chrf_signature", "chrfpp_signature", "ter_signature"):
        assert f"`{results[signature]}`" in text
    assert rows(text)["Parameters"].startswith(f"{results['params']:,}")
    assert f"**{results['train_pairs']}**" in text
    # only the settings that applied: no --data_dir prefixes of the bundled data
    table = rows(text)
    assert table["`preset`"] == "tiny" and table["`learning_rate`"] == "0.001"
    assert not {"`data_dir`", "`train_prefix`", "`valid_prefix`", "`test_prefix`", "`train_split`"} & set(table)
    assert not {"`output_dir`", "`num_examples`", "`license`", "`progress_interval`"} & set(table)  # bookkeeping
    assert "test_2016_flickr" not in text and "Multi30k" not in text
    # the repository's benchmark (Multi30k en→de, 7.6M parameters) does not describe a 2-step en→fr tiny model
    assert (BENCHMARK_RESULTS / "quality.json").is_file()
    assert "Side-by-side benchmark" not in text and "7.58M" not in text
    assert "## Intended use" in text and "**Out of scope**" in text and "very small model" in text
    assert "License of the weights: `cc-by-4.0`" in text
    assert str(root) not in text  # no local path


def test_card_of_a_warm_started_run(tsv_run, tmp_path):
    """A variant warm-started from the TSV run's model and fine-tuned with --model_name_or_path: its card names the
    base by its card title and run folder (not `model`), has no preset/tokenizer rows (the saved model's dims and
    tokenizer were used) and uses --dataset_label."""
    from hf_variants.convert.warm_start import warm_start

    root, base_run, base_results = tsv_run
    warm_dir = tmp_path / "warm"
    warm_start(base_run / "model", "hysan_nmt", output_dir=warm_dir)
    run_dir = tmp_path / "warm-run"
    train.main(
        TINY_RUN
        + ["--model_name_or_path", str(warm_dir), "--dataset_label", "Flickr captions en-fr"]
        + ["--train_file", str(root / "data" / "train.tsv"), "--test_file", str(root / "data" / "test.tsv")]
        + ["--output_dir", str(run_dir)]
    )
    results = json.loads((run_dir / "results.json").read_text())
    base_title = "Transformer: en→fr translation on train.tsv"
    assert results["warm_start_identity"] == {"name": f'"{base_title}" (local folder `tsv-run/model`)', "hub_id": None}
    # train.py's defaults, which did not apply: the saved model's dims and tokenizer were used
    assert (results["hyperparameters"]["preset"], results["hyperparameters"]["vocab_size"]) == ("small", 8000)
    card = ModelCard.load(run_dir / "model" / "README.md")
    text = card.text
    assert card.data.base_model is None  # a local base is no Hub id
    assert card.data.license == "unknown" and "No license was chosen" in text
    assert text.lstrip().splitlines()[0] == "# HySAN: en→fr translation on Flickr captions en-fr"
    assert f'warm-started from the pretrained Transformer "{base_title}" (local folder `tsv-run/model`)' in text
    assert "`model`" not in text
    table = rows(text)
    assert not {"`preset`", "`model_type`", "`vocab_size`", "`tokenizer_model`", "`data_dir`"} & set(table)
    assert "`warm_started_from`" not in table and "tsv-run/model |" not in text  # no raw path row
    config = json.loads((run_dir / "model" / "config.json").read_text())
    assert table["Model width d_model"] == str(config["d_model"]) == "32"  # the tiny dims, as saved
    assert {r.dataset_type for r in card.data.eval_results} == {"Flickr captions en-fr"}
    assert [r.metric_value for r in card.data.eval_results] == [round(results["bleu"], 2), round(results["chrf"], 2)]
    assert "Side-by-side benchmark" not in text
    # the identity was recorded: the card written again after the base folder is gone still names it
    import shutil

    from model_cards.card import build_model_card

    moved = tmp_path / "moved"
    shutil.copytree(run_dir, moved)
    shutil.rmtree(warm_dir)
    again = build_model_card(moved / "model", json.loads((moved / "results.json").read_text())).text
    assert f'the pretrained Transformer "{base_title}"' in again


def test_license_flag_is_checked():
    with pytest.raises(SystemExit):
        train.parse_args(["--license", "Apache 2.0"])
    assert train.parse_args(["--license", "cc-by-nc-sa-4.0"]).license == "cc-by-nc-sa-4.0"
    assert train.parse_args([]).license is None
