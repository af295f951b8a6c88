"""Checkpoint averaging (hf_variants/training/averaging.py) and the `hf-variants-average` command: the float32 mean
equals the hand-computed one exactly, one tensor in memory at a time per checkpoint; a real run's last/best/named
checkpoints become a loadable model folder with a card naming them, equal to what `--average_last` publishes;
checkpoints of other models or tokenizers, damaged weights and outputs over an input are refused naming them."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, subprocess_env, tiny_args, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.commands import average  # noqa: E402
from hf_variants.training import averaging, checkpointing, train  # noqa: E402


def fake_checkpoint(folder: Path, tensors: dict, step: int) -> Path:
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / checkpointing.MARKER).write_text(json.dumps({"step": step, "format": checkpointing.FORMAT_VERSION}))
    return folder


def test_mean_is_the_hand_computed_float32_mean(tmp_path):
    torch.manual_seed(0)
    weights = [
        {"a": torch.randn(64, 33), "b": torch.randn(7, dtype=torch.float16), "n": torch.tensor([i, 5])}
        for i in range(3)
    ]
    folders = [fake_checkpoint(tmp_path / f"step_{i}", w, i) for i, w in enumerate(weights)]
    mean = averaging.average_checkpoints(folders)
    a = [w["a"] for w in weights]
    assert mean["a"].dtype == torch.float32 and torch.equal(mean["a"], (a[0] + a[1] + a[2]) / 3)
    b = [w["b"].float() for w in weights]  # half-precision weights are averaged in float32 too
    assert mean["b"].dtype == torch.float32 and torch.equal(mean["b"], (b[0] + b[1] + b[2]) / 3)
    assert torch.equal(mean["n"], weights[-1]["n"])  # integer tensors: the last checkpoint's
    # one checkpoint: itself; the result does not depend on the tensors' order in the files
    assert torch.equal(averaging.average_checkpoints(folders[:1])["a"], a[0])
    other = fake_checkpoint(tmp_path / "step_9", {"a": torch.randn(64, 34), "b": b[0].half(), "n": weights[0]["n"]}, 9)
    with pytest.raises(averaging.AveragingError, match=r"a has shape \(64, 34\) in .*step_9 and \(64, 33\)"):
        averaging.average_checkpoints([folders[0], other])
    renamed = fake_checkpoint(tmp_path / "step_8", {"x": a[0], "b": b[0].half(), "n": weights[0]["n"]}, 8)
    with pytest.raises(averaging.AveragingError, match="step_8 and .*step_0 hold different tensors"):
        averaging.average_checkpoints([folders[0], renamed])


def test_reading_holds_one_tensor_at_a_time(tmp_path, monkeypatch):
    """A checkpoint is opened, not loaded: `safe_open` hands out one tensor at a time and the file's other tensors
    are never all in memory (`load_file`, which reads a whole file, is never called)."""
    import safetensors.torch

    folders = [
        fake_checkpoint(tmp_path / f"step_{i}", {f"t{j}": torch.full((4,), float(i + j)) for j in range(5)}, i)
        for i in range(4)
    ]
    monkeypatch.setattr(safetensors.torch, "load_file", lambda *a, **k: pytest.fail("a whole file was loaded"))
    mean = averaging.average_checkpoints(folders)
    assert all(torch.equal(mean[f"t{j}"], torch.full((4,), (0 + 1 + 2 + 3) / 4 + j)) for j in range(5))


# ------------------------------------------------------------------------------------------------- a real run
@pytest.fixture(scope="module")
def run(data_dir, tokenizer_dir, tmp_path_factory):
    """A 12-step run validated and checkpointed every 2 steps (all kept), its final model the mean of the last 3."""
    out = tmp_path_factory.mktemp("averaging") / "run"
    extra = ["--save_steps", "2", "--eval_steps", "2", "--eval_bleu_pairs", "0", "--best_metric", "loss"]
    results = train.main(
        tiny_args(
            data_dir,
            out,
            *extra,
            "--keep_checkpoints",
            "0",
            "--average_last",
            "3",
            "--max_test_pairs",
            "4",
            tokenizer=tokenizer_dir,
            steps=12,
        )
    )
    return out, results


def test_command_equals_average_last_and_writes_a_loadable_card(run, tmp_path, capsys):
    from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

    run_dir, results = run
    assert results["final_model"] == "average of step_8, step_10, step_12"
    out = average.main([str(run_dir), "--last", "3", "--output_dir", str(tmp_path / "avg")])
    assert "Averaged the weights of 3 checkpoint(s)" in capsys.readouterr().out
    published = load_file(str(run_dir / "model" / "model.safetensors"))
    averaged = load_file(str(out / "model.safetensors"))
    assert published.keys() == averaged.keys() and all(torch.equal(published[k], averaged[k]) for k in published)
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    trained = AutoModelForSeq2SeqLM.from_pretrained(run_dir / "model").config.to_dict()
    assert {**model.config.to_dict(), "_name_or_path": None} == {**trained, "_name_or_path": None}
    assert len(tokenizer) == model.config.vocab_size and (out / "generation_config.json").is_file()
    ids = model.generate(**tokenizer(["A man rides a bike."], return_tensors="pt"), max_new_tokens=3)
    assert ids.shape[0] == 1
    card = (out / "README.md").read_text()
    assert "| Final weights | average of step_8, step_10, step_12 (the last 3; hf-variants-average) |" in card
    assert "No evaluation results were recorded" in card  # the run's own test scores are not this model's


def test_best_and_named_checkpoints(run, tmp_path):
    run_dir, results = run
    losses = {r["step"]: r["valid_loss"] for r in results["validation"]}
    best = sorted(sorted(losses, key=lambda s: (losses[s], s))[:2])
    out = average.main([str(run_dir), "--best", "2", "--output_dir", str(tmp_path / "best")])
    got = load_file(str(out / "model.safetensors"))
    a, b = (checkpointing.load_weights(run_dir / "checkpoints" / f"step_{s}") for s in best)
    assert all(torch.equal(got[k], (a[k] + b[k]) / 2) for k in a)
    assert (
        f"average of step_{best[0]}, step_{best[1]} (the best 2 by validation loss" in (out / "README.md").read_text()
    )
    named = average.main(
        [
            str(run_dir),
            "--checkpoints",
            "step_2",
            str(run_dir / "checkpoints" / "step_4"),
            "--output_dir",
            str(tmp_path / "named"),
        ]
    )
    a, b = (checkpointing.load_weights(run_dir / "checkpoints" / f"step_{s}") for s in (2, 4))
    got = load_file(str(named / "model.safetensors"))
    assert all(torch.equal(got[k], (a[k] + b[k]) / 2) for k in a)


def test_refusals_name_what_is_wrong(run, tmp_path, capsys):
    run_dir, _ = run

    def refused(*argv) -> str:
        with pytest.raises(SystemExit) as exit_:
            average.main([str(a) for a in argv])
        assert exit_.value.code == 2
        return capsys.readouterr().err

    assert "--last 9: " in refused(run_dir, "--last", "9", "--output_dir", tmp_path / "o")
    err = refused(run_dir, "--last", "2", "--output_dir", run_dir / "avg")
    assert "lies inside RUN_DIR" in err and not (run_dir / "avg").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "mine.txt").write_text("a user's file")
    assert "exists and is not empty" in refused(run_dir, "--last", "2", "--output_dir", tmp_path / "full")
    assert "only a folder that average wrote" in refused(
        run_dir, "--last", "2", "--output_dir", tmp_path / "full", "--force"
    )
    assert (tmp_path / "full" / "mine.txt").read_text() == "a user's file"
    assert "holds no moving average" in refused(
        run_dir, "--last", "2", "--weights", "ema", "--output_dir", tmp_path / "e"
    )
    # a checkpoint of another model (its run's config differs), and one of another tokenizer
    other = tmp_path / "other"
    shutil.copytree(run_dir, other, ignore=shutil.ignore_patterns("step_2", "step_4", "step_6", "step_8", "step_10"))
    config = json.loads((other / "model_config" / "config.json").read_text())
    (other / "model_config" / "config.json").write_text(json.dumps({**config, "dropout": 0.3}))
    err = refused(
        run_dir, "--checkpoints", "step_12", other / "checkpoints" / "step_12", "--output_dir", tmp_path / "m"
    )
    assert "are checkpoints of different models (config dropout: 0.0 vs 0.3)" in err
    assert str(run_dir / "checkpoints" / "step_12") in err and str(other / "checkpoints" / "step_12") in err
    (other / "model_config" / "config.json").write_text(json.dumps(config))
    marker = other / "checkpoints" / "step_12" / checkpointing.MARKER
    marker.write_text(json.dumps({**json.loads(marker.read_text()), checkpointing.TOKENIZER_KEY: "another"}))
    err = refused(
        run_dir, "--checkpoints", "step_12", other / "checkpoints" / "step_12", "--output_dir", tmp_path / "m"
    )
    assert "were trained with different tokenizers" in err
    # damaged weights are named; nothing was written by any refusal
    damaged = tmp_path / "damaged"
    shutil.copytree(run_dir, damaged)
    weights = damaged / "checkpoints" / "step_12" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert f"{weights}: its size or SHA-256 differs" in refused(damaged, "--last", "2", "--output_dir", tmp_path / "d")
    assert not any((tmp_path / name).exists() for name in ("o", "e", "m", "d"))


def test_console_script_exits_2_with_one_line(run, tmp_path):
    run_dir, _ = run
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "hf_variants.training.average",
            str(run_dir),
            "--best",
            "50",
            "--output_dir",
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("hf-variants-average: error: --best 50: ")
