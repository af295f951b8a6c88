"""benchmarks/gpu_check.py runs on a GPU machine, rarely: its checks must still work on the day one is at hand, and
RESULTS.md's GPU tables must be what the stored reports say. Here the script runs on the CPU with tiny models."""

import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def gpu_check(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("gpu_check")


def test_checks_run_on_cpu(gpu_check, tmp_path):
    out = tmp_path / "checks.json"
    report = gpu_check.main(
        ["--size", "tiny", "--device", "cpu", "--models", "mimo", "--batch", "4", "--src_len", "10"]
        + ["--tgt_len", "8", "--check_new_tokens", "6", "--fit_steps", "6", "--output", str(out)]
        + ["--sections", "agreement", "bf16_training", "bf16_decoding"]
    )
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))  # written as measured
    row = report["models"]["mimo"]  # the model with the most inputs (target-language ids) and parts
    assert row["errors"] == {}, row["errors"]
    assert row["logits_max_diff_sdpa_vs_eager"] < 1e-4
    assert row["logits_max_diff_flex_attention_vs_eager"] < 1e-4
    assert row["greedy_cached_vs_uncached_equal"] == row["beam4_cached_vs_uncached_equal"] == 1.0
    assert row["greedy_flex_vs_sdpa_equal"] == 1.0
    assert row["bf16_grads_finite"] and row["bf16_fit_all_finite"] and row["bf16_fit_trains"]
    assert row["bf16_loss_rel_diff"] < 1e-2 and row["bf16_grad_cosine"] > 0.99
    assert 0 < row["bf16_logits_max_err_over_range"] < 0.05  # bf16 rounds, and not by much
    table = gpu_check.checks_table(report)
    assert table.count("\n| ") == 2  # header + the model
    assert "| MIMO (n=4) | " in table


def section(name: str) -> str:
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    match = re.search(rf"<!-- {name}:start -->\n(.*?)\n<!-- {name}:end -->", text, re.S)
    assert match, name
    return match.group(1)


@pytest.mark.parametrize("stem", ["gpu_speed_base", "gpu_speed_base_shared_compile"])
def test_results_tables_are_the_stored_reports(gpu_check, stem):
    results = ROOT / "benchmarks" / "results"
    assert section("gpu_checks") == gpu_check.checks_table(json.loads((results / "gpu_check_base.json").read_text()))
    report = json.loads((results / f"{stem}.json").read_text())
    assert section(stem) == gpu_check.speed_table(report)
    baseline = report["models"]["baseline"]
    assert f"| {baseline['train_tok_s_sdpa']} (1.00x) |" in section(stem)
