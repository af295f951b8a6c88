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


def stderr_until(proc, prefix: str) -> str:
    """The process's stderr up to and including its first line that starts with `prefix`."""
    seen = []
    while not seen or not seen[-1].startswith(prefix):
        seen.append(proc.stderr.readline())
        assert seen[-1], "".join(seen)[-3000:]  # the process ended first
    return "".join(seen)


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


PREEMPT_STEPS = 30
# An interrupted run is launched with this many steps: it cannot end before the signal lands, however long this
# process takes to send it. The resumed run sets the real length (--max_steps may change on a resume).
UNREACHABLE_STEPS = 100_000


@pytest.fixture(scope="module")
def uninterrupted(data_dir, tokenizer_dir, tmp_path_factory):
    """The preemption tests' run without an interruption (PREEMPT, 30 steps)."""
    ref = tmp_path_factory.mktemp("uninterrupted") / "ref"
    train.main(tiny_args(data_dir, ref, *PREEMPT, tokenizer=tokenizer_dir, steps=PREEMPT_STEPS))
    return ref


def preempt_reference(data_dir, tokenizer_dir, tmp_path: Path):
    """A function of n that trains the PREEMPT run uninterrupted for n steps (in this process) and returns its
    folder."""

    def trained(steps: int) -> Path:
        ref = tmp_path / f"reference_{steps}"
        train.main(tiny_args(data_dir, ref, *PREEMPT, tokenizer=tokenizer_dir, steps=steps))
        return ref

    return trained


def reference_past(step: int, uninterrupted: Path, steps: int, train_reference) -> tuple[Path, int]:
    """The uninterrupted run and its length to compare a run interrupted at `step` with: `uninterrupted` (`steps`
    long) when `step` is a few steps before its end, else `train_reference(n)`'s run of n = step + 4 steps (a signal
    that landed late, on a busy machine)."""
    if step + 4 <= steps:
        return uninterrupted, steps
    return train_reference(step + 4), step + 4


def test_sigterm_checkpoints_and_resume_is_exact(data_dir, tokenizer_dir, tmp_path, uninterrupted):
    """SIGUSR1 and SIGTERM together (the second arrives while the run stops, and changes nothing): one checkpoint at
    the next step boundary, exit status 143; `--resume_from_checkpoint latest` ends exactly as an uninterrupted
    run."""
    out = tmp_path / "run"

    def command(steps):
        return [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
            data_dir, out, *PREEMPT, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=steps
        )

    proc = subprocess.Popen(
        command(UNREACHABLE_STEPS), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=subprocess_env()
    )
    wait_for_log(out, proc)
    # both signals while the process is stopped: on SIGCONT they arrive together, the lower number first (the
    # kernel and Python deliver pending signals in signal order), so the second one surely comes while it stops
    os.kill(proc.pid, signal.SIGSTOP)
    os.kill(proc.pid, signal.SIGTERM)
    os.kill(proc.pid, signal.SIGUSR1)
    os.kill(proc.pid, signal.SIGCONT)
    stderr = proc.communicate(timeout=240)[1]
    assert proc.returncode == 143, stderr[-3000:]
    checkpoints = checkpointing.list_checkpoints(out / "checkpoints")
    step = checkpoints[-1][0]
    assert step >= 3, stderr[-2000:]
    assert "SIGUSR1 received: saving a checkpoint at the next step boundary" in stderr
    assert "SIGTERM received while stopping (after SIGUSR1): ignored, the checkpoint is on its way" in stderr
    assert (
        f"train.py: Preempted (SIGUSR1): checkpoint {out / 'checkpoints' / f'step_{step}'} saved at step {step}; "
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
    ref, steps = reference_past(
        step, uninterrupted, PREEMPT_STEPS, preempt_reference(data_dir, tokenizer_dir, tmp_path)
    )
    proc = subprocess.run(command(steps), capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {out / 'checkpoints' / f'step_{step}'}: step {step}" in (out / "train.log").read_text()
    assert_same_run(ref, out)


def sigint_as_at_a_terminal() -> None:
    """`preexec_fn` of a process the test sends Ctrl-C: SIGINT's default action, as a program started at a terminal
    has it. A test run started in the background (`&` in a script, `nohup`) passes SIGINT on ignored, and train.py
    then leaves it alone, as it should: the signal would never reach the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_checkpoints_exits_130_and_resume_is_exact(data_dir, tokenizer_dir, tmp_path, uninterrupted):
    """A real SIGINT (Ctrl-C) to a training process is handled like SIGTERM: one line, a checkpoint at the next step
    boundary, exit status 130 (128 + SIGINT) without a traceback; the resume ends exactly as an uninterrupted run.
    A second Ctrl-C while it stops ends the process at once, by SIGINT."""
    out = tmp_path / "run"

    def command(steps):
        return [sys.executable, str(TRAIN_SCRIPT)] + tiny_args(
            data_dir, out, *PREEMPT, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=steps
        )

    proc = subprocess.Popen(
        command(UNREACHABLE_STEPS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        preexec_fn=sigint_as_at_a_terminal,
    )
    wait_for_log(out, proc)  # step 3 logged; the run cannot end before the signal lands
    os.kill(proc.pid, signal.SIGINT)
    _, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 130, stderr[-3000:]
    step = checkpointing.list_checkpoints(out / "checkpoints")[-1][0]
    assert step >= 3, stderr[-2000:]
    assert (
        "SIGINT received: saving a checkpoint at the next step boundary, then exiting (Ctrl-C again: stop at once, "
        "without it)" in stderr
    )
    assert stderr.strip().splitlines()[-1] == (
        f"train.py: Interrupted (SIGINT): checkpoint {out / 'checkpoints' / f'step_{step}'} saved at step {step}; "
        f"exiting with status 130. Continue with --resume_from_checkpoint latest."
    )
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    ref, steps = reference_past(
        step, uninterrupted, PREEMPT_STEPS, preempt_reference(data_dir, tokenizer_dir, tmp_path)
    )
    proc = subprocess.run(command(steps), capture_output=True, text=True, timeout=300, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Resumed from {out / 'checkpoints' / f'step_{step}'}: step {step}" in (out / "train.log").read_text()
    assert_same_run(ref, out)

    # Ctrl-C twice: the second one must come while the run stops. The first lands during a long validation of step
    # 1 (30 pairs decoded one at a time, beam 4, up to 200 tokens of a nearly untrained model), which the run
    # finishes before its next step boundary: the second one comes while thousands of decoding steps are left.
    again = tmp_path / "again"
    long_validation = ["--logging_steps", "1", "--eval_steps", "1", "--max_valid_pairs", "30", "--eval_bleu_pairs"]
    long_validation += ["30", "--num_beams", "4", "--max_len_b", "200", "--eval_batch_size", "1"]
    proc = subprocess.Popen(
        [sys.executable, str(TRAIN_SCRIPT)]
        + tiny_args(data_dir, again, *PREEMPT, *long_validation, tokenizer=tokenizer_dir, steps=UNREACHABLE_STEPS),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
        preexec_fn=sigint_as_at_a_terminal,
    )
    wait_for_log(again, proc)  # step 1 logged: its validation starts
    os.kill(proc.pid, signal.SIGINT)
    seen = stderr_until(proc, "SIGINT received:")  # the first one is being handled
    os.kill(proc.pid, signal.SIGINT)
    stderr = seen + proc.communicate(timeout=240)[1]
    assert proc.returncode == -signal.SIGINT, stderr[-3000:]  # ended by the signal itself
    assert "SIGINT received again while stopping (after SIGINT): stopping at once" in stderr
    assert "Traceback" not in stderr and "Interrupted (SIGINT)" not in stderr
    assert not checkpointing.list_checkpoints(again / "checkpoints")  # stopped during step 1's validation


def test_signal_to_one_of_two_processes_stops_both_and_resume_is_exact(data_dir, tokenizer_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo on CPU): SIGUSR1 to one worker only; both agree
    at the same step boundary (the flag rides the step's all-reduce), save one checkpoint with both processes'
    random states and exit with --requeue_exit_code; the resumed 2-process run ends exactly as an uninterrupted
    one."""

    def command(out, steps, *extra):
        return two_process_launch(
            *tiny_args(
                data_dir, out, *PREEMPT, "--requeue_exit_code", "99", *extra, tokenizer=tokenizer_dir, steps=steps
            )
        )

    out = tmp_path / "run"
    proc = subprocess.Popen(
        command(out, UNREACHABLE_STEPS, "--resume_from_checkpoint", "latest"),  # it cannot end before the signal
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
    assert step >= 3, stderr[-2000:]
    assert {"rng_state_0.json", "rng_state_1.json"} <= {p.name for p in checkpoints[-1][1].iterdir()}
    assert "SIGUSR1 received: saving a checkpoint at the next step boundary" in stderr
    assert stderr.count(f"saved at step {step}; exiting with status 99") == 2, stderr[-3000:]  # both processes
    steps = max(24, step + 4)  # the uninterrupted run to compare with: a few steps past the checkpoint at least
    proc = subprocess.run(
        command(tmp_path / "ref", steps), capture_output=True, text=True, timeout=400, env=subprocess_env()
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run(
        command(out, steps, "--resume_from_checkpoint", "latest"),
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
