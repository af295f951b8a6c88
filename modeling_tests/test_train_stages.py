"""training/train.py's stages on their own: setup_run → load_data → build_job → Trainer → finish, each called
directly (no full run), and the TrainStats window."""

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, tiny_args, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.training import corpus, external, train  # noqa: E402
from hf_variants.training.trainer import Trainer, TrainStats  # noqa: E402


def test_stages_one_by_one(data_dir, tokenizer_dir, tmp_path):
    """Each stage's result is what the next one needs; one Trainer.train_step computes the loss of the batch it
    was given (the same value as a forward outside the trainer) and takes one optimizer step."""
    args = train.parse_args(
        tiny_args(
            data_dir, tmp_path / "run", "--dropout", "0", "--max_train_pairs", "64", tokenizer=tokenizer_dir, steps=3
        )
    )
    run = train.setup_run(args)
    assert run.run_dir.is_dir() and run.resume is None and run.directions == [("en", "de")]
    data = train.load_data(run)
    assert len(data.train_set) == 64 and len(data.valid_pairs) == 30 and data.max_steps == 3
    assert data.steps_per_epoch == len(corpus.StepPlan(data.sampler.epoch(0), 1, 1))
    job = train.build_job(run, data)
    assert job.state.step == 0 and job.params == train.count_parameters(job.unwrapped)
    assert job.hyperparameters["max_steps"] == 3
    assert job.unwrapped.config.target_languages == ["de"]  # recorded: generate needs no tgt_lang
    trainer = Trainer(run, data, job)
    assert trainer.loss_kwargs == {"skip_logits": True, "smoothing": args.label_smoothing}
    step_batches, _ = next(trainer.epoch_steps())
    batches = trainer.micro_batches(step_batches)
    with torch.no_grad():
        expected = float(
            external.translation_loss(
                job.unwrapped,
                job.model(**batches[0], **trainer.loss_kwargs),
                batches[0]["labels"],
                args.label_smoothing,
            )
        )
    loss, ntok, tokens, aux, grad_norm, nonfinite, skipped = trainer.train_step(batches)
    assert abs(float(loss) / float(ntok) - expected) < 1e-5
    assert int(ntok) == int((batches[0]["labels"] != -100).sum()) and int(tokens) > int(ntok)
    assert aux == {} and grad_norm is not None and int(nonfinite) == 0 and not skipped
    # one optimizer step taken (the warmup's first learning rate is 0: Adam's moments hold the gradient)
    assert job.scheduler.last_epoch == 1
    assert all(float(s["step"]) == 1 for s in job.optimizer.state.values())
    assert any(float(s["exp_avg"].abs().sum()) > 0 for s in job.optimizer.state.values())


def test_train_stats_window_sums_and_resets():
    from accelerate import Accelerator

    stats = TrainStats()
    stats.add(
        torch.tensor(6.0, dtype=torch.float64),
        torch.tensor(3),
        torch.tensor(5),
        0.5,
        {"x": torch.tensor(3.0, dtype=torch.float64)},
        torch.tensor(0),
        step=1,
    )
    stats.add(
        torch.tensor(float("nan"), dtype=torch.float64),
        torch.tensor(1),
        torch.tensor(3),
        1.5,
        {"x": torch.tensor(1.0, dtype=torch.float64)},
        torch.tensor(1),
        step=2,
    )
    accelerator = Accelerator(cpu=True)
    sums = stats.reduce(accelerator)
    assert sums["nonfinite"] == 1 and math.isnan(sums["loss"])
    assert {k: sums[k] for k in ("ntok", "tokens", "tokens_per_sec", "aux")} == {
        "ntok": 4.0,
        "tokens": 8.0,
        "tokens_per_sec": 4.0,
        "aux": {"x": 1.0},
    }
    losses = stats.step_losses(accelerator)
    assert losses[1] == 2.0 and math.isnan(losses[2])
    # a window carried through a checkpoint continues where it stopped
    carried = TrainStats()
    carried.load_state_dict(stats.state_dict(accelerator), torch.device("cpu"), main_process=True)
    carried.add(
        torch.tensor(4.0, dtype=torch.float64), torch.tensor(2), torch.tensor(2), 1.0, {"x": torch.tensor(0.0)}
    )
    assert carried.reduce(accelerator)["tokens"] == 10.0 and carried.time == 3.0
    stats.reset()
    assert (stats.loss, stats.ntok, stats.tokens, stats.time, stats.aux, stats.steps) == (0.0, 0, 0, 0.0, {}, [])
