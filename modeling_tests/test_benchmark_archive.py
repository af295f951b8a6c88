"""benchmarks/quality.py keeps every finished run in the repository (benchmarks/results/runs/): the quality table,
and the paired tests between runs, must rebuild the same on a checkout that has none of the git-ignored run
folders."""

import argparse
import gzip
import importlib
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def quality(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = importlib.import_module("quality")
    monkeypatch.setattr(module, "RUNS_DIR", tmp_path / "runs")
    monkeypatch.setattr(module, "RESULTS_DIR", tmp_path / "results")
    monkeypatch.setattr(module, "ARCHIVE_DIR", tmp_path / "results" / "runs")
    sections = {}
    monkeypatch.setattr(module, "write_section", lambda name, text: sections.__setitem__(name, text))
    module.sections = sections
    yield module
    sys.modules.pop("quality", None)


def references() -> list[str]:
    with gzip.open(ROOT / "training/data/multi30k/test_2016_flickr.de.gz", "rt", encoding="utf-8") as f:
        return f.read().splitlines()


def finish_run(quality, name: str, translations: list[str], bleu: float) -> None:
    """What training/train.py leaves in a finished run folder (the fields the table reads)."""
    out = quality.RUNS_DIR / name
    out.mkdir(parents=True)
    results = {
        "model_type": "transformer_nmt",
        "params": 1000,
        "steps": 1100,
        "epochs": 9.6,
        "bleu": bleu,
        "chrf": bleu + 20,
        "validation": [{"valid_loss": 3.0}],
        "train_tokens_per_sec": 100.0,
        "train_time_sec": 60.0,
        "wall_time_sec": 61.0,
        "eval_split": "test_2016_flickr",
        "eval_pairs": len(translations),
        "sacrebleu_signature": "sig",
        "per_direction": None,
    }
    (out / "results.json").write_text(json.dumps(results))
    (out / "translations.test.txt").write_text("".join(t + "\n" for t in translations), encoding="utf-8")


def table(quality):
    args = argparse.Namespace(
        steps=240, max_tokens=2048, warmup=80, lr=1e-3, seed=1, vocab_size=8000, multi_test_pairs=100
    )
    text = quality.write_table(args)
    return text, json.loads((quality.RESULTS_DIR / "quality.json").read_text())


def test_table_rebuilds_from_the_archive_without_run_folders(quality):
    refs = references()
    finish_run(quality, "baseline_45min", [" ".join(r.split()[:-1]) for r in refs], 30.0)  # last word dropped
    finish_run(quality, "hysan_e1_45min", refs, 100.0)
    text, payload = table(quality)
    rows = {r["name"]: r for r in payload["rows"]}
    assert rows["hysan_e1_45min"]["p_bleu"] < 0.01 and rows["hysan_e1_45min"]["bleu_ci95"] >= 0
    assert (quality.ARCHIVE_DIR / "hysan_e1_45min.json").is_file()
    archived = gzip.decompress((quality.ARCHIVE_DIR / "hysan_e1_45min.test.txt.gz").read_bytes()).decode()
    assert archived.splitlines() == refs

    shutil.rmtree(quality.RUNS_DIR)  # a fresh checkout: only the committed archive
    text_again, payload_again = table(quality)
    assert payload_again == payload and text_again == text
    row = "| HySAN e1, gated sum, the 45-minute budget | 0.00M | 100.00 ± 0.0 | 120.00 | +66.00 | +70.00 |"
    assert row in quality.sections["45min"]  # vs the reference's 34.0 and vs our baseline run


def test_archived_run_is_not_trained_again(quality, monkeypatch):
    finish_run(quality, "tied_45min", ["x"], 1.0)
    quality.archive("tied_45min")
    shutil.rmtree(quality.RUNS_DIR)
    monkeypatch.setattr(quality.subprocess, "call", lambda *a, **k: pytest.fail("archived run trained again"))
    assert quality.run("tied_45min", None)["bleu"] == 1.0


@pytest.mark.parametrize(
    "against,against_bleu,kept",
    [
        ("baseline_45min", 30.0, "plain"),  # computed against the table's baseline run
        ("baseline_45min_run1", 29.5, "dagger"),  # against another baseline run that is in the table
        ("baseline_45min", 31.0, None),  # against an earlier baseline run that is gone: dropped
    ],
)
def test_stored_tests_only_against_a_run_in_the_table(quality, against, against_bleu, kept):
    """A run archived without translations keeps its p-values only while the baseline run they were computed
    against (recognised by its name and BLEU) is in the table; † marks those against another run than the
    table's baseline."""
    refs = references()
    finish_run(quality, "baseline_45min", refs, 30.0)
    quality.ARCHIVE_DIR.mkdir(parents=True)

    def legacy(bleu, stored):
        return {
            "model_type": "transformer_nmt",
            "params": 1100,
            "steps": 1100,
            "epochs": 9.6,
            "bleu": bleu,
            "chrf": 50.0,
            "validation": [],
            "train_tokens_per_sec": 90.0,
            "train_time_sec": 60.0,
            "wall_time_sec": 61.0,
            "eval_split": "test_2016_flickr",
            "eval_pairs": 1000,
            "sacrebleu_signature": "sig",
            "per_direction": None,
            "stored_tests": stored,
        }

    test = {"against": against, "against_bleu": against_bleu, "bleu_ci95": 1.4, "p_bleu": 0.02, "p_chrf": 0.08}
    (quality.ARCHIVE_DIR / "mgsa_ngram_45min.json").write_text(json.dumps(legacy(29.0, {"baseline": test})))
    (quality.ARCHIVE_DIR / "baseline_45min_run1.json").write_text(json.dumps(legacy(29.5, None)))
    text, payload = table(quality)
    row = {r["name"]: r for r in payload["rows"]}["mgsa_ngram_45min"]
    assert "stored_tests" not in row
    assert (row.get("p_bleu"), row.get("bleu_ci95")) == ((0.02, 1.4) if kept else (None, None))
    line = next(x for x in text.splitlines() if x.startswith("| MG-SA"))
    assert ("| 0.020 / 0.080 † |" in line) == (kept == "dagger")
    assert ("| 0.020 / 0.080 |" in line) == (kept == "plain")
    assert ('† p against "Transformer baseline, the 45-minute budget, first run" (29.50 BLEU)' in text) == (
        kept == "dagger"
    )


def test_inference_bleu_records(tmp_path, monkeypatch):
    """bench_inference's BLEU mode keeps one record per checkpoint (a rerun replaces it, others stay) and renders
    every record, the int8 - fp32 difference included, into its RESULTS.md section."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    bench = importlib.import_module("bench_inference")
    results_md = tmp_path / "RESULTS.md"
    results_md.write_text("intro\n<!-- inference_bleu:start -->\nold\n<!-- inference_bleu:end -->\nrest\n")
    path = tmp_path / "inference_bleu.json"

    def result(model, fp32, int8, **extra):
        return {
            "model": model,
            "label": None,
            "model_type": "transformer_nmt",
            "steps": 200,
            "sentences": 1000,
            "pair": "en-de",
            "bleu_fp32": fp32,
            "bleu_int8": int8,
            "chrf_fp32": 50.0,
            "chrf_int8": 49.5,
            "bleu_int8_minus_fp32": round(int8 - fp32, 2),
            **extra,
        }

    bench.record_bleu(result("runs/a/model", 30.0, 29.8), path, results_md)
    bench.record_bleu(result("runs/b/model", 20.0, 20.1, bleu_ct2_int8=19.9), path, results_md)
    bench.record_bleu(result("runs/a/model", 31.0, 30.5), path, results_md)  # a rerun of a
    bench.record_bleu(result("runs/c/model", 10.0, 10.0, bleu_ort_fp32=10.0, bleu_ort_int8=9.79), path, results_md)
    ort = dict(bleu_ort_fp32=12.0, bleu_ort_int8=12.1, ort_int8_weights="s8_reduce_range")
    bench.record_bleu(result("runs/d/model", 12.0, 12.0, **ort), path, results_md)
    records = json.loads(path.read_text())
    assert [(r["model"], r["bleu_fp32"]) for r in records] == [
        ("runs/b/model", 20.0),
        ("runs/a/model", 31.0),
        ("runs/c/model", 10.0),
        ("runs/d/model", 12.0),
    ]
    text = results_md.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "\nold\n" not in text
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| model ")]
    # an ORT record without `ort_int8_weights` predates the option: its int8 graphs had u8 weights
    assert rows == [
        "| b | transformer_nmt | 200 | 1000 | 20.00 | 20.10 | 19.90 | — | — | +0.10 | — | — | 50.00 | 49.50 |",
        "| a | transformer_nmt | 200 | 1000 | 31.00 | 30.50 | — | — | — | -0.50 | — | — | 50.00 | 49.50 |",
        "| c | transformer_nmt | 200 | 1000 | 10.00 | 10.00 | — | 10.00 | 9.79 | +0.00 | -0.21 | u8 | 50.00 | 49.50 |",
        "| d | transformer_nmt | 200 | 1000 | 12.00 | 12.00 | — | 12.00 | 12.10 | +0.00 | +0.10 | s8_reduce_range | "
        "50.00 | 49.50 |",
    ]
    sys.modules.pop("bench_inference", None)
