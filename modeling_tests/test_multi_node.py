"""Several machines, for real on one host: the user guide's rehearsal block (docs/user-guide.md, "Several machines")
is two `accelerate launch` invocations of `training/accelerate_configs/multi_node.yaml`, machine ranks 0 and 1,
talking through 127.0.0.1 (one CPU process each, gloo). The test runs exactly those two commands, with these
changes only: a free `--main_process_port` instead of 29500, the config file's path made absolute (the guide runs
from the clone, the test from a scratch folder holding `data/` as the guide describes it) and a tiny model's
settings appended. A SIGTERM to one machine's launcher stops both machines at the same step, with one checkpoint
holding both processes' random states; the same commands with `--resume_from_checkpoint latest` then end exactly as
an uninterrupted run (weights bit-identical, the same logged losses)."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from conftest import REPO_ROOT
from test_training import free_port, subprocess_env
from test_user_guide import GUIDE, TRAIN_MODULE, code_blocks, shell_commands, write_data

from hf_variants.training import checkpointing

STEPS = 10
TINY = [  # a tiny model for a handful of steps, logging every 2; dropout on, so the random states matter
    "--preset",
    "tiny",
    "--max_steps",
    str(STEPS),
    "--max_tokens",
    "256",
    "--warmup_steps",
    "2",
    "--dropout",
    "0.1",
    "--logging_steps",
    "2",
    "--eval_steps",
    "0",
    "--save_steps",
    "0",
    "--eval_bleu_pairs",
    "0",
    "--max_test_pairs",
    "4",
    "--num_beams",
    "1",
    "--max_len_b",
    "4",
    "--num_examples",
    "0",
    "--final_model",
    "last",
    "--num_threads",
    "1",
    "--no_progress",
]


def guide_blocks() -> tuple[list[list[str]], list[list[str]]]:
    """The guide's two multi-machine blocks: (the cluster's commands, the one-host rehearsal's commands)."""
    found = [
        commands
        for lang, code in code_blocks(GUIDE.read_text(encoding="utf-8"))
        if lang == "bash" and "multi_node.yaml" in code
        for commands in [shell_commands(code)]
    ]
    assert len(found) == 2, found
    return found[0], found[1]


def option(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def without(argv: list[str], *names: str) -> list[str]:
    out, it = [], iter(argv)
    for arg in it:
        if arg in names:
            next(it)
        else:
            out.append(arg)
    return out


def test_the_guide_shows_both_machines_of_the_documented_config():
    """The cluster block and the rehearsal block are the documented config's two machines; the rehearsal differs
    from the cluster only in the address (127.0.0.1), the processes (one per machine), the precision (CPU) and the
    run folder."""
    cluster, rehearsal = guide_blocks()
    for commands in (cluster, rehearsal):
        assert [option(c, "--machine_rank") for c in commands] == ["0", "1"]
        assert [without(c, "--machine_rank") for c in commands[1:]] == [without(commands[0], "--machine_rank")]
        assert option(commands[0], "--config_file") == "training/accelerate_configs/multi_node.yaml"
        assert option(commands[0], "--num_machines") == "2" and commands[0][:2] == ["accelerate", "launch"]
        assert commands[0][commands[0].index("-m") + 1] == TRAIN_MODULE
    assert option(rehearsal[0], "--main_process_ip") == "127.0.0.1"
    assert option(rehearsal[0], "--num_processes") == "2" and option(rehearsal[0], "--mixed_precision") == "no"

    def launcher(c):
        return without(c[: c.index("-m")], "--main_process_ip", "--num_processes", "--mixed_precision")

    def training(c):
        return without(c[c.index("-m") + 2 :], "--output_dir", "--valid_file")

    assert launcher(rehearsal[0]) == launcher(cluster[0]) and training(rehearsal[0]) == training(cluster[0])


def launch(argv: list[str], port: int, cwd: Path, *extra: str) -> subprocess.Popen:
    """One machine's launcher: the guide's command with a free port, the config's absolute path and `extra`."""
    assert argv[:2] == ["accelerate", "launch"]
    args = argv[2:]
    args[args.index("--main_process_port") + 1] = str(port)
    config = args.index("--config_file") + 1
    args[config] = str(REPO_ROOT / args[config])
    cmd = [sys.executable, "-m", "accelerate.commands.launch", *args, *TINY, *extra]
    log = open(cwd / f"machine_{option(argv, '--machine_rank')}.log", "w")  # noqa: SIM115 - closed by the caller
    return subprocess.Popen(cmd, cwd=cwd, stdout=log, stderr=subprocess.STDOUT, env=subprocess_env())


def run_machines(commands: list[list[str]], cwd: Path, *extra: str) -> list[subprocess.Popen]:
    port = free_port()
    return [launch(argv, port, cwd, *extra) for argv in commands]


def wait(procs: list[subprocess.Popen], timeout: float = 420) -> list[int]:
    deadline = time.time() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(deadline - time.time(), 1)))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        finally:
            proc.stdout and proc.stdout.close()
    return codes


def machine_log(cwd: Path, rank: int) -> str:
    return (cwd / f"machine_{rank}.log").read_text(errors="replace")


def test_sigterm_to_one_machine_stops_both_and_the_resume_is_exact(tmp_path):
    from test_train_stops import assert_same_run

    _, rehearsal = guide_blocks()
    run_dir = Path(option(rehearsal[0], "--output_dir"))
    folders = {}
    for name in ("ref", "run"):
        folders[name] = tmp_path / name
        folders[name].mkdir()
        write_data(folders[name] / "data")
    # the uninterrupted run and the interrupted one side by side
    ref = run_machines(rehearsal, folders["ref"])
    run = run_machines(rehearsal, folders["run"])
    log = folders["run"] / run_dir / "log.jsonl"
    deadline = time.time() + 400
    while time.time() < deadline and not (log.is_file() and log.read_text().strip()):
        assert all(p.poll() is None for p in run), [machine_log(folders["run"], r)[-3000:] for r in (0, 1)]
        time.sleep(0.05)
    os.kill(run[1].pid, signal.SIGTERM)  # machine 1's launcher; it passes the signal to its worker
    codes = wait(run)
    logs = [machine_log(folders["run"], rank) for rank in (0, 1)]
    assert all(code != 0 for code in codes), (codes, logs[0][-3000:], logs[1][-3000:])
    checkpoints = checkpointing.list_checkpoints(folders["run"] / run_dir / "checkpoints")
    assert len(checkpoints) == 1, checkpoints
    step, ckpt = checkpoints[0]
    assert 2 <= step < STEPS, logs[1][-3000:]
    assert {"rng_state_0.json", "rng_state_1.json"} <= {p.name for p in ckpt.iterdir()}
    saved = f"checkpoint {run_dir / 'checkpoints' / f'step_{step}'} saved at step {step}; exiting with status 143"
    assert "SIGTERM received: saving a checkpoint at the next step boundary" in logs[1]
    assert f"train.py: Preempted (SIGTERM): {saved}" in logs[1]  # machine 1's worker got the signal
    assert f"train.py: Preempted (a stop signal in another process): {saved}" in logs[0]  # machine 0 agreed
    assert not (folders["run"] / run_dir / "model").exists()
    assert wait(ref) == [0, 0], [machine_log(folders["ref"], r)[-3000:] for r in (0, 1)]
    # the same two commands, resumed
    codes = wait(run_machines(rehearsal, folders["run"], "--resume_from_checkpoint", "latest"))
    assert codes == [0, 0], [machine_log(folders["run"], r)[-3000:] for r in (0, 1)]
    train_log = (folders["run"] / run_dir / "train.log").read_text()
    assert f"Resumed from {run_dir / 'checkpoints' / f'step_{step}'}: step {step}" in train_log
    assert re.search(r"Run \S+: 2 process\(es\), DistributedType.MULTI_CPU", train_log)
    assert_same_run(folders["ref"] / run_dir, folders["run"] / run_dir)
    shutil.rmtree(tmp_path, ignore_errors=True)
