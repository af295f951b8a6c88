"""training/train.py for run_translation.py users: its flag names, `datasets` split names, trackers (wandb)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, head, read_log, tiny_args, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.training import train  # noqa: E402
from hf_variants.training.corpus import DataError  # noqa: E402


def test_run_translation_flag_names_are_aliases():
    """run_translation.py's names for the same settings set the same arguments."""
    ours = train.parse_args(
        [
            "--valid_file",
            "v.jsonl",
            "--num_epochs",
            "2.5",
            "--max_train_pairs",
            "100",
            "--max_valid_pairs",
            "10",
            "--max_test_pairs",
            "5",
            "--keep_checkpoints",
            "3",
            "--mixed_precision",
            "bf16",
            "--label_smoothing",
            "0.2",
            "--tokenizer",
            "tok",
            "--num_beams",
            "5",
            "--eval_batch_size",
            "16",
            "--valid_split",
            "dev",
        ]
    )
    theirs = train.parse_args(
        [
            "--validation_file",
            "v.jsonl",
            "--num_train_epochs",
            "2.5",
            "--max_train_samples",
            "100",
            "--max_eval_samples",
            "10",
            "--max_predict_samples",
            "5",
            "--save_total_limit",
            "3",
            "--bf16",
            "--label_smoothing_factor",
            "0.2",
            "--tokenizer_name",
            "tok",
            "--generation_num_beams",
            "5",
            "--per_device_eval_batch_size",
            "16",
            "--validation_split",
            "dev",
        ]
    )
    assert vars(ours) == vars(theirs)
    assert (
        theirs.valid_file,
        theirs.num_epochs,
        theirs.max_train_pairs,
        theirs.max_valid_pairs,
        theirs.keep_checkpoints,
        theirs.mixed_precision,
    ) == ("v.jsonl", 2.5, 100, 10, 3, "bf16")
    assert train.parse_args(["--fp16"]).mixed_precision == "fp16"


def test_report_to_values():
    assert train.parse_args([]).report_to == ["none"]
    assert train.parse_args(["--report_to", "tensorboard"]).report_to == ["tensorboard"]
    with pytest.raises(SystemExit):
        train.parse_args(["--report_to", "tensorbored"])
    with pytest.raises(SystemExit):
        train.parse_args(["--report_to", "none", "tensorboard"])
    project, kwargs = train.tracker_init_kwargs(["tensorboard"], "my-run", Path("/r"))
    assert (project, kwargs) == ("my-run", {})


def test_report_to_missing_tracker_package_is_an_error(monkeypatch):
    """Accelerate leaves out a tracker whose package is missing without a word; train.py says so."""
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: ["tensorboard"])
    with pytest.raises(SystemExit):
        train.parse_args(["--report_to", "wandb"])
    with pytest.raises(
        ValueError,
        match=r"--report_to wandb: the package is not installed \(pip install "
        r"'hf-variants\[wandb\]'\)",
    ):
        train.parse_report_to(["wandb"])


def test_report_to_wandb_offline(data_dir, tokenizer_dir, tmp_path, monkeypatch):
    """`--report_to wandb` through Accelerate's tracker: the real wandb (offline) gets the run's project and name,
    its hyperparameters and exactly the records of log.jsonl, under <run>/logs."""
    wandb = pytest.importorskip("wandb")  # the `wandb` extra (installed with `dev`)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_PROJECT", "nmt-tests")
    monkeypatch.setenv("WANDB_SILENT", "true")
    inits, logged = [], []
    real_init, real_log = wandb.init, wandb.sdk.wandb_run.Run.log

    def init(*args, **kwargs):
        inits.append(kwargs)
        return real_init(*args, **kwargs)

    def log(self, data, *args, **kwargs):
        logged.append((kwargs.get("step"), dict(data)))
        return real_log(self, data, *args, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", log)
    out = tmp_path / "run"
    train.main(
        tiny_args(
            data_dir,
            out,
            "--report_to",
            "wandb",
            "--run_name",
            "wandb-probe",
            "--eval_bleu_pairs",
            "4",
            "--max_test_pairs",
            "4",
            tokenizer=tokenizer_dir,
            steps=8,
        )
    )
    assert len(inits) == 1
    assert (inits[0]["project"], inits[0]["name"], inits[0]["dir"]) == ("nmt-tests", "wandb-probe", str(out / "logs"))
    assert logged == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in read_log(out)]
    assert list((out / "logs" / "wandb").glob("offline-run-*/run-*.wandb"))


def write_jsonl(path: Path, src, tgt):
    path.write_text(
        "".join(json.dumps({"translation": {"en": a, "de": b}}) + "\n" for a, b in zip(src, tgt)), encoding="utf-8"
    )


def test_dataset_with_valid_split_and_no_test_split(data_dir, tokenizer_dir, tmp_path):
    """A `datasets` dataset whose validation split is called "valid" and that has no test split: the default
    split names find it, and the final evaluation falls back to it (before: `Unknown split "validation"`)."""
    ds = tmp_path / "ds"
    ds.mkdir()
    write_jsonl(ds / "train.jsonl", head(data_dir / "train.en.gz", 120), head(data_dir / "train.de.gz", 120))
    write_jsonl(ds / "valid.jsonl", head(data_dir / "val.en.gz", 8), head(data_dir / "val.de.gz", 8))
    (ds / "README.md").write_text(
        "---\nconfigs:\n- config_name: default\n  data_files:\n  - split: train\n"
        "    path: train.jsonl\n  - split: valid\n    path: valid.jsonl\n---\n"
    )
    args = [
        "--dataset_name",
        str(ds),
        "--preset",
        "tiny",
        "--max_steps",
        "2",
        "--warmup_steps",
        "1",
        "--eval_steps",
        "2",
        "--eval_bleu_pairs",
        "4",
        "--num_beams",
        "1",
        "--max_len_b",
        "4",
        "--tokenizer",
        str(tokenizer_dir),
        "--num_examples",
        "0",
    ]
    results = train.main(args + ["--output_dir", str(tmp_path / "run")])
    assert results["eval_split"] == "valid" and results["eval_pairs"] == 8 and results["train_pairs"] == 120
    assert [r["step"] for r in read_log(tmp_path / "run") if "valid_loss" in r] == [2]
    assert results["hyperparameters"]["valid_split"] == "valid" and results["hyperparameters"]["test_split"] is None
    with pytest.raises(DataError, match=r"has no split 'test' \(its splits: train, valid\)"):
        train.main(args + ["--output_dir", str(tmp_path / "run2"), "--test_split", "test"])


BAD_FLAGS = [
    (["--eval_steps", "-1"], "--eval_steps must be >= 0 (0: no periodic validation, only at the end), got -1"),
    (["--save_steps", "-5"], "--save_steps must be >= 0"),
    (["--logging_steps", "0"], "--logging_steps must be a positive integer, got 0"),
    (["--max_steps", "0"], "--max_steps must be a positive integer, got 0"),
    (["--max_tokens", "-3"], "--max_tokens must be a positive integer, got -3"),
    (["--gradient_accumulation_steps", "0"], "--gradient_accumulation_steps must be a positive integer"),
    (["--max_sentences", "0"], "--max_sentences must be a positive integer"),
    (["--max_length", "0"], "--max_length must be a positive integer"),
    (["--max_train_pairs", "0"], "--max_train_pairs must be a positive integer"),
    (["--num_beams", "0"], "argument --num_beams/--generation_num_beams: expected an integer >= 1, got '0'"),
    (["--eval_batch_size", "0"], "--eval_batch_size must be a positive integer"),
    (["--vocab_size", "-8000"], "--vocab_size must be a positive integer"),
    (["--stream_buffer_rows", "0"], "--stream_buffer_rows must be a positive integer"),
    (["--ddp_timeout", "0"], "--ddp_timeout must be a positive integer"),
    (["--warmup_steps", "-1"], "--warmup_steps must be >= 0 (0: no warmup), got -1"),
    (["--keep_checkpoints", "-1"], "--keep_checkpoints must be >= 0 (0: keep all)"),
    (["--average_last", "-2"], "--average_last must be >= 0"),
    (["--eval_bleu_pairs", "-1"], "--eval_bleu_pairs must be >= 0"),
    (["--max_grad_norm", "-1"], "--max_grad_norm must be >= 0 (0: no clipping)"),
    (["--weight_decay", "-0.1"], "--weight_decay must be >= 0"),
    (["--learning_rate", "0"], "--learning_rate must be positive, got 0.0"),
    (["--learning_rate", "nan"], "--learning_rate must be a finite number, got nan"),
    (["--length_penalty", "inf"], "argument --length_penalty: expected a finite number, got 'inf'"),
    (["--dropout", "1.5"], "--dropout must be in [0, 1), got 1.5"),
    (["--label_smoothing", "-0.1"], "--label_smoothing must be in [0, 1)"),
    (["--adam_beta2", "1"], "--adam_beta2 must be in [0, 1), got 1.0"),
    (["--num_epochs", "0"], "--num_epochs must be positive, got 0.0"),
    (["--max_len_a", "0", "--max_len_b", "0"], "--max_len_a 0 --max_len_b 0 leaves no tokens to generate"),
    (
        ["--resume_from_checkpoint", "latest", "--overwrite_output_dir"],
        "--resume_from_checkpoint continues the run in --output_dir, --overwrite_output_dir deletes it",
    ),
    (["--streaming", "--num_epochs", "1"], "--streaming reads a corpus of unknown length"),
]


@pytest.mark.parametrize("flags,message", BAD_FLAGS, ids=[" ".join(f) for f, _ in BAD_FLAGS])
def test_bad_numeric_flags_are_refused_at_parse_time(flags, message, capsys):
    """Every numeric flag is range-checked when parsed (exit status 2, the message names the flag), before any
    data is read."""
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(flags)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_zero_cadences_mean_only_at_the_end():
    args = train.parse_args(["--eval_steps", "0"])
    assert (args.eval_steps, args.save_steps) == (0, 0)  # --save_steps follows --eval_steps
    from hf_variants.training.trainer import every

    assert [s for s in range(1, 10) if every(s, 0)] == [] and [s for s in range(1, 10) if every(s, 4)] == [4, 8]


def test_eval_steps_zero_validates_only_at_the_end(data_dir, tokenizer_dir, tmp_path):
    """`--eval_steps 0` (documented: no periodic validation) trains, validates and checkpoints at the last step
    only (it used to stop with ZeroDivisionError after the first step)."""
    results = train.main(
        tiny_args(
            data_dir, tmp_path / "run", "--eval_steps", "0", "--logging_steps", "1", tokenizer=tokenizer_dir, steps=3
        )
    )
    assert [r["step"] for r in results["validation"]] == [3]
    assert [p.name for p in (tmp_path / "run" / "checkpoints").iterdir()] == ["step_3"]
