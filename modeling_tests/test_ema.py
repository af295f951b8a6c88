"""The moving average of the weights (`--ema_decay`, hf_variants/training/ema.py): the update is the formula, the
swap for validation restores the weights bit for bit, the average never changes what is trained, it is saved in
every checkpoint and a resumed run's average is bit-identical to an uninterrupted one's, on one process and on two
(DDP over gloo); validation and the final model use it (`--eval_weights`)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import (  # noqa: E402,F401 (fixtures)
    data_dir,
    read_log,
    subprocess_env,
    tiny_args,
    tokenizer_dir,
    two_process_launch,
)

from hf_variants.training import checkpointing, ema, train  # noqa: E402

COMMON = [
    "--dropout",
    "0.1",
    "--save_steps",
    "4",
    "--eval_steps",
    "4",
    "--eval_bleu_pairs",
    "0",
    "--keep_checkpoints",
    "0",
    "--final_model",
    "last",
    "--max_valid_pairs",
    "16",
    "--max_test_pairs",
    "4",
    "--max_train_pairs",
    "160",
]
EMA = ["--ema_decay", "0.8", "--ema_start_step", "2"]


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_update_swap_and_saved_weights():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[1].register_buffer("counter", torch.tensor([7.0]))
    average = ema.ExponentialMovingAverage(model, decay=0.75, start_step=1)
    expected = {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(1, 5):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        average.update(step)
        for n, p in model.named_parameters():  # up to start_step a copy, then 0.75 * ema + 0.25 * weights
            expected[n] = p.detach().clone() if step <= 1 else torch.lerp(expected[n], p.detach(), 0.25)
    assert same(average.state_dict(), expected)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    with average.swapped_in():
        assert same({n: p.detach() for n, p in model.named_parameters()}, expected)
    assert same({n: p.detach() for n, p in model.named_parameters()}, weights)  # bit for bit back
    assert same(average.state_dict(), expected)
    saved = average.checkpoint_weights()  # the average and the buffers, loadable as the model's weights
    assert torch.equal(saved["1.counter"], torch.tensor([7.0]))
    clone = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    clone[1].register_buffer("counter", torch.tensor([0.0]))
    checkpointing.load_model_weights(clone, saved)
    assert same(dict(clone.state_dict()), {**expected, "1.counter": torch.tensor([7.0])})
    with pytest.raises(ValueError, match="decay must be in"):
        ema.ExponentialMovingAverage(model, decay=1.0)


@pytest.fixture(scope="module")
def runs(data_dir, tokenizer_dir, tmp_path_factory):
    base = tmp_path_factory.mktemp("ema")

    def run(name, *extra, steps=8):
        return train.main(tiny_args(data_dir, base / name, *COMMON, *extra, tokenizer=tokenizer_dir, steps=steps))

    plain = run("plain")
    swaps = []  # the average is swapped in for each validation, and only then
    original = ema.ExponentialMovingAverage.swapped_in
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ema.ExponentialMovingAverage, "swapped_in", lambda self: swaps.append(1) or original(self))
        averaged = run("ema", *EMA)
    averaged["swaps"] = len(swaps)
    run("resumed", *EMA, steps=4)
    run("resumed", *EMA, "--resume_from_checkpoint", "latest")
    return base, plain, averaged


def test_average_leaves_training_alone_and_is_used(runs):
    base, plain, averaged = runs
    for step in (4, 8):  # the trained weights are those of a run without the average
        raw = [checkpointing.load_weights(base / name / "checkpoints" / f"step_{step}") for name in ("plain", "ema")]
        assert same(*raw)
    assert [r["loss"] for r in read_log(base / "plain") if "loss" in r] == [
        r["loss"] for r in read_log(base / "ema") if "loss" in r
    ]
    average = load_file(str(base / "ema" / "checkpoints" / "step_8" / ema.EMA_WEIGHTS))
    assert not same(average, {k: v for k, v in raw[1].items() if k in average})
    assert averaged["final_model"] == "EMA weights of last step 8"
    final = load_file(str(base / "ema" / "model" / "model.safetensors"))
    assert same({k: final[k] for k in average if k in final}, {k: average[k] for k in average if k in final})
    # validation used the average (--eval_weights ema, the default with --ema_decay)
    assert [r["valid_loss"] for r in averaged["validation"]] != [r["valid_loss"] for r in plain["validation"]]
    assert averaged["hyperparameters"]["eval_weights"] == "ema"
    assert averaged["swaps"] == len(averaged["validation"]) == 2
    assert "| `ema_decay` | 0.8 |" in (base / "ema" / "model" / "README.md").read_text()


def test_resumed_average_is_bit_identical(runs):
    base, _, _ = runs
    for name in (ema.EMA_WEIGHTS, "model.safetensors"):
        assert same(*(load_file(str(base / run / "checkpoints" / "step_8" / name)) for run in ("ema", "resumed")))
    assert same(*(load_file(str(base / run / "model" / "model.safetensors")) for run in ("ema", "resumed")))


def test_two_processes_equal_themselves_across_a_resume(data_dir, tokenizer_dir, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2` (gloo): each process keeps the average of the same
    weights; a 2-process run resumed from its step-4 checkpoint (into a new folder) ends with the uninterrupted
    run's average and weights at step 8, bit for bit."""

    def launch(out, *extra):
        cmd = two_process_launch(*tiny_args(data_dir, out, *COMMON, *EMA, *extra, tokenizer=tokenizer_dir, steps=8))
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=subprocess_env())
        assert proc.returncode == 0, proc.stderr[-4000:]

    launch(tmp_path / "ref")
    launch(tmp_path / "resumed", "--resume_from_checkpoint", str(tmp_path / "ref" / "checkpoints" / "step_4"))
    results = json.loads((tmp_path / "resumed" / "results.json").read_text())
    assert results["num_processes"] == 2 and results["steps"] == 8
    for name in (ema.EMA_WEIGHTS, "model.safetensors"):
        ref, got = (load_file(str(tmp_path / run / "checkpoints" / "step_8" / name)) for run in ("ref", "resumed"))
        assert same(ref, got), name


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ema_decay", "1"], "--ema_decay must be in (0, 1)"),
        (["--ema_decay", "0"], "--ema_decay must be in (0, 1)"),
        (["--ema_start_step", "5"], "--ema_start_step needs --ema_decay"),
        (["--ema_decay", "0.9", "--ema_start_step", "-1"], "--ema_start_step must be >= 0"),
        (["--eval_weights", "ema"], "--eval_weights ema needs --ema_decay"),
    ],
)
def test_flags_are_checked_when_parsed(extra, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--output_dir", "x", *extra])
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_fsdp_is_refused_when_parsed(monkeypatch, capsys):
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    with pytest.raises(SystemExit):
        train.parse_args(["--output_dir", "x", "--ema_decay", "0.99"])
    assert "--ema_decay is not supported under FSDP" in capsys.readouterr().err
