"""Early stopping (`--patience`, `--min_delta`) and the checkpoints a run keeps (`--keep_best`, rotation): a real
train.py process stopped by SIGTERM and resumed stops at the same step as an uninterrupted run, with the same final
model and one log line saying why; the best N checkpoints are kept exactly, and rotation never deletes a file,
folder or checkpoint the run did not write."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_train_stops import wait_for_log  # noqa: E402
from test_training import (  # noqa: E402,F401 (fixtures)
    TRAIN_SCRIPT,
    data_dir,
    read_log,
    subprocess_env,
    tiny_args,
    tokenizer_dir,
)

from hf_variants.training import best_checkpoints, checkpointing, early_stopping, train  # noqa: E402

STEPS = 60
PATIENT = [
    "--dropout",
    "0.1",
    "--eval_steps",
    "2",
    "--save_steps",
    "6",
    "--eval_bleu_pairs",
    "0",
    "--best_metric",
    "loss",
    "--patience",
    "2",
    "--min_delta",
    "0.2",
    "--keep_best",
    "3",
    "--keep_checkpoints",
    "1",
    "--logging_steps",
    "2",
    "--max_valid_pairs",
    "16",
    "--max_test_pairs",
    "4",
]


def expected_stop(losses: dict[int, float], patience: int, min_delta: float) -> tuple[int, float, int]:
    """(the step, the best loss, its step) of an early stop watching the validation loss, from the logged losses."""
    best, best_step, bad = None, None, 0
    for step in sorted(losses):
        if best is None or best - losses[step] > min_delta:
            best, best_step, bad = losses[step], step, 0
        else:
            bad += 1
        if bad >= patience:
            return step, best, best_step
    raise AssertionError(f"never stops: {losses}")


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("patience") / "ref"
    results = train.main(tiny_args(data_dir, out, *PATIENT, tokenizer=tokenizer_dir, steps=STEPS))
    return out, results


def test_run_stops_early_says_why_and_keeps_the_best(uninterrupted):
    out, results = uninterrupted
    losses = {r["step"]: r["valid_loss"] for r in read_log(out) if "valid_loss" in r}
    stop, watched, watched_step = expected_stop(losses, 2, 0.2)
    assert stop < STEPS and results["steps"] == stop == max(losses)
    assert results["early_stopping"] == {
        "patience": 2,
        "min_delta": 0.2,
        "metric": "loss",
        "best": pytest.approx(watched, rel=1e-12),
        "best_step": watched_step,
        "validations_without_improvement": 2,
        "stopped_at_step": stop,
    }
    log = (out / "train.log").read_text()
    assert log.count("Early stopping at step") == 1
    assert f"Early stopping at step {stop}: validation loss has not improved by more than 0.2 for 2 validations" in log
    # the final model is --final_model's default, the best validated checkpoint
    best = min(losses, key=lambda s: (losses[s], s))
    assert results["best_step"] == best and results["final_model"] == f"best validated checkpoint step_{best}"
    final = load_file(str(out / "model" / "model.safetensors"))
    kept = checkpointing.load_weights(out / "checkpoints" / f"step_{best}")
    assert all(torch.equal(final[k], kept[k]) for k in kept)
    # kept: the newest (the stopping step), the best 3 validated steps (each checkpointed when it ranked there)
    best3 = sorted(losses, key=lambda s: (losses[s], s))[:3]
    assert [s for s, _ in checkpointing.list_checkpoints(out / "checkpoints")] == sorted({stop, *best3})
    card = (out / "model" / "README.md").read_text()
    assert (
        f"| Stopped early | at step {stop}: validation loss did not improve by more than 0.2 in 2 validations |"
        in card
    )


def started_well_before(cmd: list[str], out: Path, stop_step: int, attempts: int = 5) -> subprocess.Popen:
    """The run of `cmd` (into `out`), stopped (SIGSTOP) once it has logged a step and checked to be at least 3 steps
    before `stop_step` (where it stops early: a signal sent now is seen at a step boundary before it). A run that got
    further before it was stopped (a busy machine) is killed and started again. Send the signal, then SIGCONT."""
    for _ in range(attempts):
        shutil.rmtree(out, ignore_errors=True)
        proc = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env()
        )
        wait_for_log(out, proc)
        os.kill(proc.pid, signal.SIGSTOP)
        logged = []
        for line in (out / "log.jsonl").read_text().splitlines():
            try:
                logged.append(json.loads(line)["step"])
            except ValueError:  # a line it was writing when it stopped
                pass
        # frozen before the next logging step (2 steps on) has written its record: the signal is seen by then
        if max(logged) + 3 < stop_step:
            return proc
        proc.kill()
        proc.communicate()
    raise AssertionError(
        f"the run got within 3 steps of step {stop_step} before it could be stopped, {attempts} times"
    )


def test_stop_step_is_the_same_after_sigterm_and_resume(uninterrupted, data_dir, tokenizer_dir, tmp_path):
    """A real SIGTERM to a real train.py process; the resumed run (into a folder holding a user's files and a
    checkpoint copied from another run) stops at the same step with the same weights and counter; rotation left
    the user's things alone."""
    ref, ref_results = uninterrupted
    out = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
        data_dir, out, *PATIENT, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=STEPS
    )
    proc = started_well_before(cmd, out, ref_results["steps"])
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGCONT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 143, stderr[-3000:]
    preempted = checkpointing.list_checkpoints(out / "checkpoints")[-1][0]
    assert preempted < ref_results["steps"], "the signal came after the run had stopped"
    # a user's things in checkpoints/: a note, a folder, a checkpoint copied from another run (a step this run
    # never saves)
    (out / "checkpoints" / "NOTES.txt").write_text("keep me")
    (out / "checkpoints" / "my_average").mkdir()
    (out / "checkpoints" / "my_average" / "model.safetensors").write_bytes(b"mine")
    foreign = out / "checkpoints" / "step_1"
    shutil.copytree(ref / "checkpoints" / f"step_{ref_results['steps']}", foreign)
    marker = json.loads((foreign / checkpointing.MARKER).read_text())
    (foreign / checkpointing.MARKER).write_text(json.dumps({**marker, "step": 1}))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["steps"] == ref_results["steps"] and results["early_stopping"] == ref_results["early_stopping"]
    assert results["best_step"] == ref_results["best_step"]
    ref_w, got_w = (load_file(str(d / "model" / "model.safetensors")) for d in (ref, out))
    assert ref_w.keys() == got_w.keys() and all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    assert (out / "train.log").read_text().count("Early stopping at step") == 1
    assert (out / "checkpoints" / "NOTES.txt").read_text() == "keep me"
    assert (out / "checkpoints" / "my_average" / "model.safetensors").read_bytes() == b"mine"
    assert foreign.is_dir() and (foreign / "model.safetensors").is_file()
    own = [s for s, _ in checkpointing.list_checkpoints(out / "checkpoints") if s != 1]
    assert own == [s for s, _ in checkpointing.list_checkpoints(ref / "checkpoints")]
    # a stopped run resumed with a larger patience trains on (patience may change on a resume)
    argv = cmd[2:] + ["--patience", "50", "--max_steps", str(ref_results["steps"] + 2)]
    assert train.main(argv)["steps"] == ref_results["steps"] + 2


def test_counter_and_ranking_units():
    args = type(
        "A", (), {"patience": 2, "min_delta": 0.5, "best_metric": "bleu", "average_last": 0, "final_model": "best"}
    )()
    state = type("S", (), {"early_stopping": None})()
    records = [(2, 10.0), (4, 10.4), (6, 10.6), (8, 11.0), (10, 10.9)]
    stops = [early_stopping.update(state, {"step": s, "valid_loss": 1.0, "valid_bleu": b}, args) for s, b in records]
    # 10.4 is within 0.5 of 10.0 (1 without improvement), 10.6 improves on it; 11.0 and 10.9 do not on 10.6
    assert stops == [False, False, False, False, True]
    assert state.early_stopping["best_step"] == 6 and early_stopping.stopped(state, args)
    args.patience = 3  # a larger patience on a resume: the run goes on
    assert not early_stopping.stopped(state, args)
    evals = [
        {"step": 2, "valid_loss": 3.0, "valid_bleu": 1.0},
        {"step": 4, "valid_loss": 2.0, "valid_bleu": 1.0},
        {"step": 6, "valid_loss": float("nan")},
        {"step": 8, "valid_loss": 2.5, "valid_bleu": 3.0},
    ]
    assert best_checkpoints.ranked_steps(evals, "bleu") == [8, 4, 2]  # BLEU, then the loss breaks the tie
    assert best_checkpoints.ranked_steps(evals, "loss") == [4, 8, 2]  # a non-finite loss never ranks
    assert best_checkpoints.in_top(evals, 4, "loss", 1) and not best_checkpoints.in_top(evals, 8, "loss", 1)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--patience", "-1"], "--patience must be >= 0"),
        (["--patience", "2", "--eval_steps", "0"], "--patience counts validations"),
        (["--patience", "2", "--eval_bleu_pairs", "0"], "--patience watches --best_metric bleu"),
        (["--min_delta", "-0.1"], "--min_delta must be >= 0"),
        (["--keep_best", "2", "--eval_steps", "0"], "--keep_best ranks validated checkpoints"),
        (["--keep_best", "-2"], "--keep_best must be >= 0"),
    ],
)
def test_flags_are_checked_when_parsed(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--output_dir", "x", *extra])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert message in err


def test_a_run_without_validation_data_is_refused(data_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    args = tiny_args(data_dir, out, "--valid_prefix", "", "--keep_best", "2", tokenizer=tokenizer_dir, steps=2)
    with pytest.raises(train.DataError, match="--keep_best ranks validations, and the run has no validation data"):
        train.main(args)
    assert not out.exists()  # a refused launch leaves no run folder behind
