"""The CPU threads of a training run are a function of the machine and the launch, never of the load average: the
same command trains bit-identical weights on a quiet and on a busy machine, the count is recorded in every
checkpoint, and a resume keeps it (hf_variants/training/threads.py). Real runs of train.py's entry point, in this
process, with the machine's cores and load average replaced: the situation is made, not waited for."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, tiny_args, tokenizer_dir, train_losses  # noqa: E402,F401 (fixtures)

from hf_variants.training import checkpointing, train  # noqa: E402
from hf_variants.training import threads as thread_choice  # noqa: E402

QUICK = ["--eval_steps", "0", "--eval_bleu_pairs", "0", "--max_test_pairs", "4", "--num_examples", "0"]


@pytest.fixture
def machine(monkeypatch):
    """A 2-core machine (whatever this one has), no thread settings in the environment, a quiet load average;
    `machine(cores=..., load=...)` changes them. The test process's torch threads are restored afterwards."""
    for name in ("OMP_NUM_THREADS", *thread_choice.LAUNCHER_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()

    def set_machine(cores: int = 2, load: float = 0.0):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
        monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load), raising=False)

    set_machine()
    yield set_machine
    torch.set_num_threads(before)


def weights(run: Path) -> dict:
    return load_file(str(run / "model" / "model.safetensors"))


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name
    assert train_losses(a) == train_losses(b)


def recorded(run: Path) -> int:
    step, path = checkpointing.list_checkpoints(run / "checkpoints")[-1]
    return checkpointing.checkpoint_info(path)["settings"][thread_choice.SETTING]


def test_the_same_command_trains_the_same_weights_on_a_busy_machine(data_dir, tokenizer_dir, tmp_path, machine):
    """The same command on a quiet machine and under a load average of 64 on 2 cores: the same 2 threads (the cores
    per process), recorded, and bit-identical weights and losses. Only --threads_from_load adapts to the load."""
    runs = {}
    for name, load in (("quiet", 0.1), ("busy", 64.0)):
        machine(cores=2, load=load)
        train.main(tiny_args(data_dir, tmp_path / name, *QUICK, tokenizer=tokenizer_dir, steps=6))
        assert torch.get_num_threads() == 2 and recorded(tmp_path / name) == 2
        runs[name] = tmp_path / name
    assert_same_weights(runs["quiet"], runs["busy"])
    log = (runs["busy"] / "train.log").read_text()
    assert "2 CPU threads per process (2 core(s) / 1 process(es) on this machine)" in log
    assert "load average" not in log
    asked = tmp_path / "asked"
    train.main(tiny_args(data_dir, asked, *QUICK, "--threads_from_load", tokenizer=tokenizer_dir, steps=2))
    assert torch.get_num_threads() == 1 and recorded(asked) == 1
    assert "1 CPU thread(s) per process instead of 2: the load average 64.0" in (asked / "train.log").read_text()


def test_a_resume_keeps_the_recorded_thread_count(data_dir, tokenizer_dir, tmp_path, machine):
    """A run started with 1 thread, resumed on a launch whose default would be 4 threads: it keeps 1, says so, and
    ends bit-identical to the uninterrupted 1-thread run. An explicit --num_threads on a later resume overrides the
    recorded count, and the change is recorded in results.json."""
    one = ["--num_threads", "1"]
    train.main(tiny_args(data_dir, tmp_path / "ref", *QUICK, *one, tokenizer=tokenizer_dir, steps=8))
    out = tmp_path / "run"
    train.main(tiny_args(data_dir, out, *QUICK, *one, tokenizer=tokenizer_dir, steps=4))
    assert recorded(out) == 1
    machine(cores=4, load=0.0)
    resume = tiny_args(data_dir, out, *QUICK, "--resume_from_checkpoint", "latest", tokenizer=tokenizer_dir, steps=8)
    train.main(resume)
    assert torch.get_num_threads() == 1 and recorded(out) == 1
    log = (out / "train.log").read_text()
    assert (
        "Keeping the run's 1 CPU thread(s) per process (recorded in its checkpoint, so that the resumed steps compute "
        "what an uninterrupted run would) instead of this launch's 4 (4 core(s) / 1 process(es) on this machine): "
        "--num_threads 4 to change it (recorded)" in log
    )
    assert_same_weights(tmp_path / "ref", out)
    results = json.loads((out / "results.json").read_text())
    assert not [c for c in results["settings_changes"] if c["setting"] == thread_choice.SETTING]

    train.main(resume + ["--max_steps", "10", "--num_threads", "2"])
    assert torch.get_num_threads() == 2 and recorded(out) == 2
    changes = json.loads((out / "results.json").read_text())["settings_changes"]
    assert {"step": 8, "setting": thread_choice.SETTING, "from": 1, "to": 2, "free": True} in changes
