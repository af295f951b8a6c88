"""The checkpoint `--final_model best` publishes (hf_variants/training/final_choice.py): the ranking's metric, its
number of validation pairs and its tie rule are stated in the log, results.json and the card; when BLEU ranks on
part of the validation set, the best `--final_candidates` checkpoints are kept and re-scored on the whole set, each
candidate's BLEU equal to what `hf-variants-translate` computes from its checkpoint, and the final model is the best
of them; a validation history whose few-pair BLEU ranks the worst candidate first (the noise, constructed) does not
choose the final model."""

import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, head, read_log, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.training import best_checkpoints, checkpointing, final_choice, train  # noqa: E402
from hf_variants.training.trainer import Trainer  # noqa: E402

VALID = 24  # validation pairs
BLEU_PAIRS = 3  # of them translated at each validation


@pytest.fixture(scope="module")
def copy_task(data_dir, tmp_path_factory):
    """A copy task (the target is the source) that a tiny model starts to learn within 120 steps, so that its
    checkpoints translate differently: 300 training pairs, 24 validation pairs (also as line files)."""
    folder = tmp_path_factory.mktemp("copy_task")
    train_en, valid_en = head(data_dir / "train.en.gz", 300), head(data_dir / "val.en.gz", VALID)
    for name, lines in (("train", train_en), ("valid", valid_en)):
        (folder / f"{name}.tsv").write_text("en\tde\n" + "".join(f"{s}\t{s}\n" for s in lines))
    for lang in ("en", "de"):
        (folder / f"valid.{lang}").write_text("".join(s + "\n" for s in valid_en))
    return folder


def copy_args(folder, tokenizer, out, *extra):
    return [
        *("--train_file", str(folder / "train.tsv"), "--valid_file", str(folder / "valid.tsv")),
        *("--source_lang", "en", "--target_lang", "de", "--tokenizer", str(tokenizer), "--preset", "tiny"),
        *("--max_steps", "120", "--max_tokens", "1024", "--warmup_steps", "4", "--learning_rate", "3e-3"),
        *("--eval_steps", "30", "--eval_bleu_pairs", str(BLEU_PAIRS), "--num_beams", "1"),
        *("--max_len_a", "1.2", "--max_len_b", "4", "--keep_checkpoints", "1", "--num_threads", "1"),
        *("--eval_batch_size", "32", "--num_examples", "0", "--output_dir", str(out), *extra),
    ]


@pytest.fixture(scope="module")
def copy_run(copy_task, tokenizer_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("final_choice") / "run"
    return out, train.main(copy_args(copy_task, tokenizer_dir, out))


def test_the_ranking_is_stated_and_the_final_model_is_the_best_candidate_on_all_pairs(copy_run, copy_task, tmp_path):
    from hf_variants.commands import translate

    out, results = copy_run
    choice = results["best_checkpoint"]
    assert (choice["metric"], choice["pairs"], choice["validation_pairs"]) == ("bleu", BLEU_PAIRS, VALID)
    assert choice["tie_rule"] == f"equal BLEU: the lower validation loss on all {VALID} pairs, then the earlier step"
    evals = [r for r in read_log(out) if "valid_loss" in r]
    assert [r["step"] for r in evals] == [30, 60, 90, 120]
    ranked = [r["step"] for r in sorted(evals, key=lambda r: (-r["valid_bleu"], r["valid_loss"], r["step"]))]
    assert choice["best_step"] == results["best_step"] == ranked[0]
    # the 3 best by the ranking were kept (--keep_checkpoints 1 alone keeps the last and the best) and re-scored
    assert set(ranked[:3]) <= {s for s, _ in checkpointing.list_checkpoints(out / "checkpoints")}
    rows = choice["rescored"]["candidates"]
    assert [r["step"] for r in rows] == ranked[:3] and choice["rescored"]["pairs"] == VALID
    losses = {r["step"]: r["valid_loss"] for r in evals}
    for row in rows:  # each as hf-variants-translate scores its checkpoint on the whole validation set
        checkpoint = out / "checkpoints" / f"step_{row['step']}"
        argv = ["--model", str(checkpoint), "--input", str(copy_task / "valid.en"), "--no_progress"]
        argv += ["--references", str(copy_task / "valid.de"), "--output", str(tmp_path / f"{row['step']}.de")]
        scored = translate.main(argv)
        assert (row["bleu"], row["chrf"], row["valid_loss"]) == (scored["bleu"], scored["chrf"], losses[row["step"]])
    final = max(rows, key=lambda r: (r["bleu"], -r["valid_loss"], -r["step"]))["step"]
    assert choice["final_step"] == final and results["final_model"] == f"best validated checkpoint step_{final}"
    published = load_file(str(out / "model" / "model.safetensors"))
    kept = checkpointing.load_weights(out / "checkpoints" / f"step_{final}")
    assert all(torch.equal(published[k], kept[k]) for k in kept)
    statement = (
        f"step_{final}, the best by BLEU on all {VALID} validation pairs (ties: the lower validation loss, then the "
        f"earlier step) of the 3 best by the ranking: validation BLEU on the first {BLEU_PAIRS} of {VALID} "
        f"validation pairs; equal BLEU: the lower validation loss on all {VALID} pairs, then the earlier step"
    )
    assert choice["statement"] == statement
    log = (out / "train.log").read_text()
    assert f"Checkpoints rank by validation BLEU on the first {BLEU_PAIRS} of {VALID} validation pairs;" in log
    assert f"Final model chosen: {statement}" in log
    assert f"| Checkpoint choice | {statement} |" in (out / "model" / "README.md").read_text()
    # an average of the run's checkpoints is no choice of the run's: its card says what it is, and whose
    from hf_variants.commands import average

    averaged = average.main([str(out), "--checkpoints", f"step_{final}", "--output_dir", str(tmp_path / "avg")])
    card = (averaged / "README.md").read_text()
    assert "Checkpoint choice" not in card and f"| Run id | `{results['run_id']}` |" in card


def test_a_noisy_few_pair_ranking_does_not_choose_the_final_model(copy_run, copy_task, tokenizer_dir, tmp_path):
    """The situation, constructed on the run's real checkpoints: a validation history whose BLEU on a few pairs
    ranks first the candidate that is the worst on the whole validation set. The final choice re-scores the
    candidates and publishes the best on the whole set; `--final_candidates 1` publishes the ranking's best."""
    out, results = copy_run
    rows = results["best_checkpoint"]["rescored"]["candidates"]
    order = sorted(rows, key=lambda r: (r["bleu"], -r["valid_loss"], -r["step"]))
    worst, best = order[0]["step"], order[-1]["step"]
    shutil.copytree(out, tmp_path / "run")  # the finished run, resumed without training: its trainer
    run = train.setup_run(
        train.parse_args(copy_args(copy_task, tokenizer_dir, tmp_path / "run", "--resume_from_checkpoint", "latest"))
    )
    try:
        data = train.load_data(run)
        trainer = Trainer(run, data, train.build_job(run, data))
        trainer.state.evals = [
            {"step": r["step"], "valid_loss": r["valid_loss"], "valid_bleu": 90.0 if r["step"] == worst else 10.0}
            for r in rows
        ]
        trainer.state.best_step = worst
        assert final_choice.choose(trainer, "raw") == best != worst
        assert trainer.best_choice["best_step"] == worst and trainer.best_choice["final_step"] == best
        trainer.args.final_candidates, trainer.best_choice = 1, None
        assert final_choice.choose(trainer, "raw") == worst and trainer.best_choice["rescored"] is None
    finally:
        if run.lock is not None:
            run.lock.release()


def args_of(**overrides):
    base = dict(best_metric="bleu", eval_bleu_pairs=3, final_model="best", average_last=0, final_candidates=3)
    return SimpleNamespace(**{**base, "keep_best": 0, **overrides})


@pytest.mark.parametrize(
    "overrides, metric, pairs, statement, rescored, kept",
    [
        ({}, "bleu", 3, "validation BLEU on the first 3 of 24 validation pairs; equal BLEU: the lower", True, 3),
        ({"keep_best": 5}, "bleu", 3, "validation BLEU on the first 3 of 24", True, 5),
        ({"eval_bleu_pairs": 200}, "bleu", 24, "validation BLEU on all 24 validation pairs;", False, 0),
        ({"best_metric": "loss"}, "loss", 24, "validation loss on all 24 validation pairs; equal loss:", False, 0),
        ({"eval_bleu_pairs": 0}, "loss", 24, "(--best_metric bleu, but --eval_bleu_pairs 0 computes no BLEU)", 0, 0),
        ({"final_model": "last"}, "bleu", 3, "validation BLEU on the first 3", False, 0),
        ({"average_last": 5}, "bleu", 3, "validation BLEU on the first 3", False, 0),
        ({"final_candidates": 1, "keep_best": 2}, "bleu", 3, "validation BLEU on the first 3", False, 2),
    ],
)
def test_the_ranking_rule_and_when_the_final_choice_rescores(overrides, metric, pairs, statement, rescored, kept):
    args = args_of(**overrides)
    rule = best_checkpoints.ranking_rule(args, VALID)
    assert (rule["metric"], rule["pairs"], rule["validation_pairs"]) == (metric, pairs, VALID)
    assert statement in rule["statement"]
    assert best_checkpoints.rescores(args, VALID) == bool(rescored) and best_checkpoints.kept_best(args, VALID) == kept


def test_the_default_is_three_candidates_and_a_bad_count_is_refused(capsys):
    assert train.parse_args(["--output_dir", "x"]).final_candidates == 3
    with pytest.raises(SystemExit) as exit_:
        train.parse_args(["--output_dir", "x", "--final_candidates", "0"])
    assert exit_.value.code == 2 and "--final_candidates must be a positive integer, got 0" in capsys.readouterr().err
