"""Every result file in benchmarks/results/ says where and on what it was measured (commit, date, CPU model, library
versions) and names no folder of the machine it ran on; the maintained scripts write that themselves through
`timing.write_result`."""

import importlib
import json
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
LIBRARIES = {"torch", "transformers", "onnxruntime", "ctranslate2"}


@pytest.fixture
def timing(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("timing")


def test_write_result_stamps_metadata_and_relative_paths(timing, tmp_path):
    record = {
        "settings": {"output": str(ROOT / "benchmarks" / "results" / "x"), "model": "/elsewhere/runs/base/model"},
        "command": f"python {ROOT / 'benchmarks' / 'scale.py'} --work_dir /scratch/corpora/450k",
        "ratio": "ort_int8/ct2_int8",
    }
    out = tmp_path / "result.json"
    written = timing.write_result(out, record)
    assert json.loads(out.read_text()) == written
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]  # the temporary file was renamed, none left
    meta = written["metadata"]
    head = subprocess.run(["git", "rev-parse", "--short=7", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    assert meta["commit"] == head.stdout.strip()
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", meta["date"])
    assert meta["cpu"] == timing.cpu_model() and meta["cpu"]
    assert set(meta["versions"]) == LIBRARIES
    assert meta["versions"]["torch"] == importlib.import_module("torch").__version__
    assert written["settings"] == {"output": "benchmarks/results/x", "model": "base/model"}
    assert written["command"] == "python benchmarks/scale.py --work_dir corpora/450k"
    assert written["ratio"] == "ort_int8/ct2_int8"  # not a path


def result_files():
    return sorted(RESULTS.glob("*.json"))


def absolute_paths(value) -> list[str]:
    if isinstance(value, dict):
        return [p for v in value.values() for p in absolute_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in absolute_paths(v)]
    return re.findall(r"(?:^|[\s=(:'\"`])(/[^\s'\"`]+)", value) if isinstance(value, str) else []


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.name)
def test_stored_results_carry_metadata(path):
    data = json.loads(path.read_text())
    records = data if isinstance(data, list) else [data]  # inference_bleu.json: one record per checkpoint
    for record in records:
        meta = record["metadata"]
        assert re.fullmatch(r"[0-9a-f]{7}", meta["commit"]), meta
        assert subprocess.run(["git", "cat-file", "-e", f"{meta['commit']}^{{commit}}"], cwd=ROOT).returncode == 0
        assert re.match(r"\d{4}-\d{2}-\d{2}", meta["date"])  # a day, or a day and a time
        assert "cpu" in meta and set(meta["versions"]) == LIBRARIES
    assert absolute_paths(data) == []


def test_result_names_are_plain():
    names = [p.name for p in RESULTS.iterdir()]
    assert len(names) > 20
    tagged = [n for n in names if re.search(r"_s\d+[a-z]?_|_second|_rerun|session|_bar\b|_bar\.", n)]
    assert tagged == []
