"""`hf-variants-score` (hf_variants/training/score.py) on a tiny trained baseline: JSON Lines and TSV in input order
equal to `score_pairs`, the summary (corpus perplexity = the model's cross-entropy), a real process writing stdout,
and the refusals before anything loads (line counts, languages, outputs that are inputs), each with exit status 2."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import LANGUAGES, REPO_ROOT, read_sentences
from trained_tiny import trained_baseline

from hf_variants import TiedTransformerConfig, TiedTransformerForConditionalGeneration
from hf_variants.commands import score
from hf_variants.inference.scoring import score_pairs

N = 8


def write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def model_dir(tokenizer, tmp_path_factory):
    model = trained_baseline(tokenizer, steps=150)
    folder = tmp_path_factory.mktemp("score_model")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("score_data")
    targets = read_sentences("de", "val", n=N)
    targets[2] = ""
    return {
        "sources": read_sentences("en", "val", n=N),
        "targets": targets,
        "source": write(folder / "src.en", read_sentences("en", "val", n=N)),
        "target": write(folder / "tgt.de", targets),
    }


def expected_scores(model_dir, tokenizer, files):
    from transformers import AutoModelForSeq2SeqLM

    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir).eval()
    return model, score_pairs(model, files["sources"], files["targets"], tokenizer=tokenizer)


def test_scores_on_stdout_in_a_real_process(model_dir, tokenizer, files):
    """`python -m hf_variants.training.score` with token batches: one JSON object a line on stdout, in input order,
    equal to `score_pairs`; the summary on stderr: the corpus perplexity is exp of the model's cross-entropy."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_variants.training.score",
            "--model",
            str(model_dir),
            "--source",
            str(files["source"]),
            "--target",
            str(files["target"]),
            "--max_tokens",
            "90",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO_ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    model, expected = expected_scores(model_dir, tokenizer, files)
    assert len(rows) == N and all(set(row) == {"log_prob", "tokens", "ppl"} for row in rows)
    assert [row["tokens"] for row in rows] == [s.tokens for s in expected] and rows[2]["tokens"] == 1
    assert [row["log_prob"] for row in rows] == pytest.approx([s.log_prob for s in expected], abs=1e-5)
    assert all(row["ppl"] == pytest.approx(math.exp(-row["log_prob"] / row["tokens"])) for row in rows)
    summary = json.loads(proc.stderr[proc.stderr.index("{\n") :])
    inputs = model.prepare_translation_inputs(tokenizer, files["sources"], text_target=files["targets"])
    with torch.no_grad():
        cross_entropy = float(model(**inputs).loss)
    assert summary["sentences"] == summary["scored"] == N and summary["tokens"] == sum(r["tokens"] for r in rows)
    assert summary["ppl"] == pytest.approx(math.exp(cross_entropy), rel=1e-5)
    assert summary["mean_log_prob"] == pytest.approx(-cross_entropy, abs=1e-5)
    assert summary["engine"] == "torch" and summary["output"] == "stdout"


def test_tsv_token_scores_results_json_and_too_long_lines(model_dir, tokenizer, files, tmp_path, caplog):
    """TSV (log_prob, tokens, ppl, token scores) to a file, the summary to --results_json; a target longer than the
    model's positions: nan scores and a warning naming its line, the other lines scored as without it."""
    long = " ".join(read_sentences("de", "train", n=40))
    sources = files["sources"] + [files["sources"][0]]
    targets = files["targets"] + [long]
    assert len(tokenizer(text_target=long)["input_ids"]) > 256  # the tiny preset's positions
    out, results = tmp_path / "scores.tsv", tmp_path / "summary.json"
    args = ["--model", str(model_dir), "--source", str(write(tmp_path / "s", sources))]
    args += ["--target", str(write(tmp_path / "t", targets)), "--output", str(out), "--output_format", "tsv"]
    score.main([*args, "--token_scores", "--results_json", str(results), "--batch_size", "3", "--no_progress"])
    rows = [line.split("\t") for line in out.read_text().splitlines()]
    _, expected = expected_scores(model_dir, tokenizer, files)
    assert len(rows) == N + 1 and all(len(row) == 4 for row in rows)
    for row, s in zip(rows, expected):
        assert float(row[0]) == pytest.approx(s.log_prob, abs=1e-5) and int(row[1]) == s.tokens
        assert float(row[2]) == pytest.approx(s.ppl, rel=1e-5)
        per_token = [float(v) for v in row[3].split()]
        assert len(per_token) == s.tokens and math.fsum(per_token) == pytest.approx(s.log_prob, abs=1e-4)
    assert math.isnan(float(rows[N][0])) and math.isnan(float(rows[N][2])) and rows[N][3] == ""
    assert f"line {N + 1}: longer than this model accepts" in caplog.text
    summary = json.loads(results.read_text())
    assert summary["scored"] == N and summary["too_long"] == 1 and summary["too_long_lines"] == [N + 1]
    assert summary["log_prob"] == pytest.approx(math.fsum(s.log_prob for s in expected), abs=1e-4)


def _refused(args, capsys, monkeypatch) -> str:
    """The error of a command refused with exit status 2 before any model loads."""

    def no_loading(*_, **__):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(score, "load_translator", no_loading)
    with pytest.raises(SystemExit) as exit_info:
        score.main(args)
    assert exit_info.value.code == 2
    return capsys.readouterr().err


def test_line_counts_differ(files, tmp_path, capsys, monkeypatch):
    short = write(tmp_path / "short.de", files["targets"][:5])
    err = _refused(
        ["--model", str(tmp_path / "absent"), "--source", str(files["source"]), "--target", str(short)],
        capsys,
        monkeypatch,
    )
    assert f"--source {files['source']} has {N} lines but --target {short} has 5" in err


def test_outputs_are_never_inputs(model_dir, files, tmp_path, capsys, monkeypatch):
    common = ["--model", str(model_dir), "--source", str(files["source"]), "--target", str(files["target"])]
    err = _refused([*common, "--output", str(files["target"])], capsys, monkeypatch)
    assert "--output" in err and "is --target" in err
    err = _refused([*common, "--output", str(model_dir / "scores.jsonl")], capsys, monkeypatch)
    assert "lies inside --model" in err
    same = str(tmp_path / "o.jsonl")
    err = _refused([*common, "--output", same, "--results_json", same], capsys, monkeypatch)
    assert "--results_json and --output name the same file" in err
    assert "error: pass exactly one of --model and --onnx" in _refused(common[2:], capsys, monkeypatch)


def test_languages_are_checked_before_loading(tokenizer, files, tmp_path, capsys, monkeypatch):
    """A multilingual model: an unknown --tgt_lang or --src_lang is refused naming the flag and the model's
    languages, and a missing --tgt_lang asks for it (the translate command's message), before the weights load."""
    torch.manual_seed(0)
    config = TiedTransformerConfig.from_preset("tiny", vocab_size=len(tokenizer), languages=list(LANGUAGES))
    folder = tmp_path / "tied"
    TiedTransformerForConditionalGeneration(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    common = ["--model", str(folder), "--source", str(files["source"]), "--target", str(files["target"])]
    err = _refused([*common, "--tgt_lang", "xx"], capsys, monkeypatch)
    assert "--tgt_lang 'xx'" in err and "de" in err
    err = _refused([*common, "--tgt_lang", "de", "--src_lang", "yy"], capsys, monkeypatch)
    assert "--src_lang 'yy'" in err
    assert "--tgt_lang: this model translates into several languages" in _refused(common, capsys, monkeypatch)


def test_scores_of_nbest_hypotheses_are_their_log_probs(model_dir, tokenizer, files, tmp_path):
    """`hf-variants-translate --nbest 3` then `hf-variants-score` of every hypothesis against its source: each score
    is the `log_prob` the n-best list reported (1e-4), wherever the hypothesis' text tokenizes back to its tokens."""
    from hf_variants.commands import translate

    sources = files["sources"][:4]
    out = tmp_path / "nbest.jsonl"
    translate.main(
        ["--model", str(model_dir), "--input", str(write(tmp_path / "in.en", sources)), "--output", str(out)]
        + ["--nbest", "3", "--num_beams", "3", "--no_progress"]
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    hyps = [(row["source"], hyp) for row in rows for hyp in row["hypotheses"]]
    assert len(hyps) == 12
    score.main(
        ["--model", str(model_dir), "--source", str(write(tmp_path / "s", [s for s, _ in hyps]))]
        + ["--target", str(write(tmp_path / "t", [h["text"] for _, h in hyps])), "--output", str(tmp_path / "o")]
        + ["--no_progress"]
    )
    scores = [json.loads(line) for line in (tmp_path / "o").read_text().splitlines()]
    ids = tokenizer(text_target=[h["text"] for _, h in hyps])["input_ids"]
    same = [k for k, (_, h) in enumerate(hyps) if tokenizer.convert_ids_to_tokens(ids[k]) == h["tokens"]]
    assert len(same) >= 8
    for k in same:
        assert scores[k]["log_prob"] == pytest.approx(hyps[k][1]["log_prob"], abs=1e-4)
        assert scores[k]["tokens"] == len(hyps[k][1]["tokens"])
