"""A training run that stops early loses nothing and says why: a non-finite loss (--on_nonfinite stop/skip) and
preemption (SIGTERM/SIGUSR1, on 1 and 2 processes), through the real entry point."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import (  # noqa: E402,F401 (fixtures)
    TRAIN_SCRIPT,
    data_dir,
    read_log,
    subprocess_env,
    tiny_args,
    tokenizer_dir,
    train_losses,
    two_process_launch,
)

from hf_variants.training import checkpointing, train  # noqa: E402

DIVERGING = [
    "--learning_rate",
    "1e6",
    "--warmup_steps",
    "1",
    "--logging_steps",
    "2",
    "--save_steps",
    "2",
    "--eval_steps",
    "20",
    "--eval_bleu_pairs",
    "0",
    "--max_valid_pairs",
    "8",
    "--max_test_pairs",
    "4",
]


def all_finite(weights: dict) -> bool:
    return all(torch.isfinite(t).all() for t in weights.values() if t.is_floating_point())


def assert_best_is_finite(results):
    """A validation with a non-finite loss is never the best."""
    for record in results["validation"]:
        if not math.isfinite(record["valid_loss"]):
            assert results["best_step"] != record["step"], results["validation"]


# ----------------------------------------------------------------------------------------------- non-finite loss
def test_diverging_run_stops_naming_the_step_and_the_last_finite_checkpoint(data_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(data_dir, out, *DIVERGING, tokenizer=tokenizer_dir, steps=30),
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert proc.returncode == 3, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    stopped = results["stopped"]
    assert stopped["reason"] == "nonfinite" and stopped["exit_code"] == 3
    assert f"train.py: Stopped at step {stopped['step']}: " in proc.stderr and "--on_nonfinite skip" in proc.stderr
    assert stopped["step"] <= stopped["detected_at_step"] < 30 and results["steps"] == stopped["detected_at_step"]
    losses = {int(s): v for s, v in stopped["last_losses"].items()}
    assert not math.isfinite(losses[stopped["step"]])
    assert all(math.isfinite(v) for s, v in losses.items() if s < stopped["step"])
    assert not (out / "model").exists()  # no final model
    checkpoints = checkpointing.list_checkpoints(out / "checkpoints")
    assert checkpoints and stopped["last_finite_checkpoint"] == str(checkpoints[-1][1])
    assert f"The last checkpoint, with finite weights, is {checkpoints[-1][1]}" in proc.stderr
    for _, path in checkpoints:
        assert all_finite(checkpointing.load_weights(path)), path
    assert_best_is_finite(results)


def test_nonfinite_validation_loss_stops_before_the_checkpoint(data_dir, tokenizer_dir, tmp_path):
    """Weights that overflow in validation (finite themselves, the training loss of their step finite) are not
    checkpointed: the run stops at that validation."""
    out = tmp_path / "run"
    with pytest.raises(train.TrainingStopped, match=r"Stopped at step 2: the validation loss is not finite \(nan\)"):
        train.main(tiny_args(data_dir, out, *DIVERGING, "--eval_steps", "2", tokenizer=tokenizer_dir, steps=8))
    results = json.loads((out / "results.json").read_text())
    assert results["stopped"]["reason"] == "nonfinite" and results["best_step"] is None
    assert results["stopped"]["last_finite_checkpoint"] is None
    assert not checkpointing.list_checkpoints(out / "checkpoints")
    assert "No checkpoint was saved before it" in results["stopped"]["message"]


def test_skip_mode_skips_and_counts_nonfinite_updates(data_dir, tokenizer_dir, tmp_path):
    out = tmp_path / "run"
    results = train.main(
        tiny_args(
            data_dir, out, *DIVERGING, "--on_nonfinite", "skip", "--eval_steps", "2", tokenizer=tokenizer_dir, steps=8
        )
    )
    assert results["stopped"] is None and results["steps"] == 8
    skipped = results["nonfinite_skipped"]
    assert skipped > 0
    assert sum(r.get("nonfinite_skipped", 0) for r in read_log(out) if "loss" in r) == skipped
    assert all_finite(load_file(str(out / "model" / "model.safetensors")))
    assert_best_is_finite(results)


# --------------------------------------------------------------------------------------------------- preemption
PREEMPT = [
    "--dropout",
    "0.1",
    "--logging_steps",
    "3",
    "--save_steps",
    "20",
    "--eval_steps",
    "20",
    "--eval_bleu_pairs",
    "4",
    "--max_valid_pairs",
    "8",
    "--max_test_pairs",
    "4",
    "--final_model",
    "last",
]


def wait_for_log(run_dir: Path, proc, timeout: float = 240) -> None:
    """Until the run has logged its first training record (its steps are under way)."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        log = run_dir / "log.jsonl"
        if log.is_file() and log.read_text().strip():
            return
        time.sleep(0.02)
    raise AssertionError(f"the run ended or hung before its first log record (rc {proc.poll()})")


def children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def assert_same_run(ref_dir: Path, got_dir: Path) -> None:
    """The resumed run ends with bit-identical weights and the same logged losses as the uninterrupted one."""
    ref_w = load_file(str(ref_dir / "model" / "model.safetensors"))
    got_w = load_file(str(got_dir / "model" / "model.safetensors"))
    assert ref_w.keys() == got_w.keys()
    for name in ref_w:
        assert torch.equal(ref_w[name], got_w[name]), name
    ref_losses, got_losses = train_losses(ref_dir), train_losses(got_dir)
    assert ref_losses.keys() == got_losses.keys()
    for step in ref_losses:
        assert got_losses[step] == pytest.approx(ref_losses[step], rel=1e-9), step


def test_sigterm_checkpoints_and_resume_is_exact(data_dir, tokenizer_dir, tmp_path):
    """SIGTERM, then SIGUSR1 while the checkpoint is being written: one checkpoint at the next step boundary, exit
    status 143; `--resume_from_checkpoint latest` ends exactly as an uninterrupted run."""
    steps = 30
    train.main(tiny_args(data_dir, tmp_path / "ref", *PREEMPT, tokenizer=tokenizer_dir, steps=steps))
    out = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
        data_dir, out, *PREEMPT, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=steps
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    wait_for_log(out, proc)
    os.kill(proc.pid, signal.SIGTERM)
    time.sleep(0.01)
    os.kill(proc.pid, signal.SIGUSR1)  # a second signal, during the save, changes nothing
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 143, stderr[-3000:]
    checkpoints = checkpointing.list_checkpoints(out / "checkpoints")
    step = checkpoints[-1][0]
    assert 3 <= step < steps, stderr[-2000:]
    assert "SIGTERM received: saving a checkpoint at the next step boundary" in stderr
    assert "SIGUSR1 received while stopping (after SIGTERM): ignored, the checkpoint is on its way" in stderr
    assert (
        f"train.py: Preempted (SIGTERM): checkpoint {out / 'checkpoints' / f'step_{step}'} saved at step {step}; "
        f"exiting with status 143. Continue with --resume_from_checkpoint latest."
    ) in stderr
    assert not (out / "results.json").exists() and not list((out / "checkpoints").glob(".tmp_*"))
    # the unfinished run's checkpoint translates (run_dir/model_config + tokenizer/, written when the run started)
    assert not (out / "model").exists()
    source = tmp_path / "src.en"
    source.write_text("A man is riding a bike.\nTwo dogs play.\n", encoding="utf-8")
    translated = subprocess.run(
        [
            sys.executable,
            str(ROOT / "training" / "translate.py"),
            "--model",
            str(checkpoints[-1][1]),
            "--input",
            str(source),
            "--output",
            str(tmp_path / "hyp.de"),
            "--num_beams",
            "1",
            "--max_len_b",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert translated.returncode == 0, translated.stderr[-3000:]
    assert len((tmp_path / "hyp.de").read_text(encoding="utf-8").splitlines()) == 2
    saved = json.loads((out / "model_config" / "generation_config.json").read_text())
    assert saved["num_beams"] == 2  # the run's decoding, its length rule (--max_len_a 1.0 --max_len_b 4) included
    assert saved["length_rule"] == {"max_len_a": 1.0, "max_len_b": 4, "max_new_tokens": 256}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {out / 'checkpoints' / f'step_{step}'}: step {step}" in (out / "train.log").read_text()
    assert_same_run(tmp_path / "ref", out)


def test_signal_to_one_of_two_processes_stops_both_and_resume_is_exact(data_dir, tokenizer_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): SIGUSR1 to one worker only; both agree
    at the same step boundary (the flag rides the step's all-reduce), save one checkpoint with both processes'
    random states and exit with --requeue_exit_code; the resumed 2-process run ends exactly as an uninterrupted
    one."""
    steps = 24

    def command(out, *extra):
        return two_process_launch(
            *tiny_args(
                data_dir, out, *PREEMPT, "--requeue_exit_code", "99", *extra, tokenizer=tokenizer_dir, steps=steps
            )
        )

    proc = subprocess.run(command(tmp_path / "ref"), capture_output=True, text=True, timeout=400, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(out, "--resume_from_checkpoint", "latest"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    )
    wait_for_log(out, proc)
    workers = [pid for pid in children(proc.pid) if "train.py" in Path(f"/proc/{pid}/cmdline").read_text()]
    assert len(workers) == 2, workers
    os.kill(workers[1], signal.SIGUSR1)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode != 0
    checkpoints = checkpointing.list_checkpoints(out / "checkpoints")
    step = checkpoints[-1][0]
    assert 3 <= step < steps, stderr[-2000:]
    assert {"rng_state_0.json", "rng_state_1.json"} <= {p.name for p in checkpoints[-1][1].iterdir()}
    assert "SIGUSR1 received: saving a checkpoint at the next step boundary" in stderr
    assert stderr.count(f"saved at step {step}; exiting with status 99") == 2, stderr[-3000:]  # both processes
    proc = subprocess.run(
        command(out, "--resume_from_checkpoint", "latest"),
        capture_output=True,
        text=True,
        timeout=400,
        env=subprocess_env(),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert_same_run(tmp_path / "ref", out)


# ---------------------------------------------------------------------------------- signals in every stage
FINAL = [
    "--save_steps",
    "2",
    "--eval_steps",
    "4",
    "--eval_bleu_pairs",
    "2",
    "--max_train_pairs",
    "120",
    "--max_valid_pairs",
    "8",
    "--max_test_pairs",
    "4",
    "--final_model",
    "last",
    "--requeue_exit_code",
    "99",
]


def signal_in(monkeypatch, module, name: str, when=lambda *a, **k: True) -> list:
    """Wrap `module.name` so that the process sends itself a real SIGTERM as the call starts (when `when(...)`)."""
    original, sent = getattr(module, name), []

    def wrapped(*args, **kwargs):
        if not sent and when(*args, **kwargs):
            sent.append(name)
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapped)
    return sent


STAGES = {
    # stage -> (module, function that runs in it, the stage the stop names)
    "last validation": ("trainer", "validation_loss", "training"),
    "final evaluation": ("train", "evaluate_pairs", "final evaluation"),
    "final save": ("train", "build_results", "final save"),
    "model card": ("train", "write_model_card", "model card"),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_signal_in_a_final_stage_requeues_and_resume_finishes(
    data_dir, tokenizer_dir, tmp_path, monkeypatch, capfd, stage
):
    """A real SIGTERM while the run validates its last step, evaluates the final model, saves it or writes its
    card: the last checkpoint is current, so it is kept; no final model or results are published and the run
    exits with the requeue status. The same command then finishes the job (model, results, card) without training
    another step."""
    from hf_variants.training import trainer as trainer_module

    module_name, function, named = STAGES[stage]
    module = trainer_module if module_name == "trainer" else train
    out = tmp_path / "run"
    args = tiny_args(data_dir, out, *FINAL, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=4)
    sent = signal_in(monkeypatch, module, function)
    with pytest.raises(train.TrainingStopped) as stopped:
        train.main(args)
    assert sent == [function]
    assert stopped.value.exit_code == 99 and stopped.value.details["stage"] == named
    during = "" if named == "training" else f" during the {named}"
    assert (
        f"Preempted (SIGTERM){during}: checkpoint {out / 'checkpoints' / 'step_4'} kept (current) at step 4; "
        f"exiting with status 99" in str(stopped.value)
    )
    assert "SIGTERM received" in capfd.readouterr().err
    assert not (out / "model").exists() and not (out / "results.json").exists()
    assert [s for s, _ in checkpointing.list_checkpoints(out / "checkpoints")] == [2, 4]
    logged = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    monkeypatch.undo()
    results = train.main(args)
    assert results["steps"] == 4 and results["stopped"] is None
    assert f"Resumed from {out / 'checkpoints' / 'step_4'}: step 4" in (out / "train.log").read_text()
    assert [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()] == logged  # no step trained
    assert (out / "model" / "README.md").is_file() and json.loads((out / "results.json").read_text())["steps"] == 4
    final = load_file(str(out / "model" / "model.safetensors"))
    last = checkpointing.load_weights(out / "checkpoints" / "step_4")
    assert all(torch.equal(final[k], last[k]) for k in final)


def test_sigterm_during_the_final_evaluation_of_a_real_process(data_dir, tokenizer_dir, tmp_path):
    """A real train.py process, signalled once its log says the final evaluation started (long generations of an
    untrained model): exit status 99 without a final model; the same command then finishes the job."""
    out = tmp_path / "run"
    cmd = [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
        data_dir,
        out,
        *FINAL,
        "--max_test_pairs",
        "30",
        "--num_beams",
        "4",
        "--max_len_b",
        "200",
        "--eval_batch_size",
        "1",  # 30 batches of up to 200 beam steps: the signal arrives while they run
        "--resume_from_checkpoint",
        "latest",
        tokenizer=tokenizer_dir,
        steps=2,
    )
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env())
    deadline = time.time() + 240
    while proc.poll() is None and time.time() < deadline:
        log = out / "train.log"
        if log.is_file() and "Final evaluation: 30 test pairs" in log.read_text():
            break
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()[1][-3000:]  # still evaluating
    os.kill(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 99, stderr[-3000:]
    assert "SIGTERM received during the final evaluation: stopping now" in stderr
    assert (
        f"during the final evaluation: checkpoint {out / 'checkpoints' / 'step_2'} kept (current) at step 2" in stderr
    )
    assert not (out / "model").exists() and not (out / "results.json").exists()
    proc = subprocess.run(
        cmd + ["--max_test_pairs", "2"], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "results.json").read_text())["steps"] == 2 and (out / "model" / "README.md").is_file()
