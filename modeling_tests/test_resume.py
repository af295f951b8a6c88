"""Resume safety of training/train.py: the run's settings are stored in every checkpoint and a resume with changed
settings is refused (or, when allowed, applied and recorded); checkpoints hold no pickles and loading one never
executes code, while an exact resume stays bit-identical."""

import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, read_log, tiny_args, tokenizer_dir, train_losses  # noqa: E402,F401 (fixtures)

from hf_variants.training import checkpointing, train  # noqa: E402
from hf_variants.training.checkpointing import CheckpointError  # noqa: E402
from hf_variants.training.settings import SettingsChangedError  # noqa: E402

# dropout on, so an exact resume needs the random states too; checkpoints at steps 2 and 4
COMMON = [
    "--dropout",
    "0.1",
    "--save_steps",
    "2",
    "--eval_steps",
    "4",
    "--eval_bleu_pairs",
    "4",
    "--final_model",
    "last",
    "--max_test_pairs",
    "8",
]


class Payload:
    """Unpickling this object creates `marker` (a stand-in for arbitrary code run by a planted pickle)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def plant(path: Path, marker: Path) -> None:
    torch.save(Payload(marker), path)


@pytest.fixture(scope="module")
def short_run(data_dir, tokenizer_dir, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("resume") / "short"
    train.main(tiny_args(data_dir, out, *COMMON, tokenizer=tokenizer_dir, steps=4))
    return out


@pytest.fixture(scope="module")
def long_run(data_dir, tokenizer_dir, tmp_path_factory):
    """The same run, 6 steps without interruption."""
    out = tmp_path_factory.mktemp("resume") / "long"
    return out, train.main(tiny_args(data_dir, out, *COMMON, tokenizer=tokenizer_dir, steps=6))


def copy_run(run: Path, dst: Path) -> Path:
    shutil.copytree(run, dst)
    return dst


def resume_args(data_dir, run, *extra, tokenizer, steps):
    return tiny_args(
        data_dir, run, *COMMON, *extra, "--resume_from_checkpoint", "latest", tokenizer=tokenizer, steps=steps
    )


# --------------------------------------------------------------------------------------- changed settings
def test_resume_with_changed_settings_is_refused_naming_each(short_run, data_dir, tokenizer_dir, tmp_path):
    run = copy_run(short_run, tmp_path / "run")
    before = {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*")}
    changed = resume_args(
        data_dir,
        run,
        "--seed",
        "2",
        "--learning_rate",
        "0.005",
        "--max_tokens",
        "900",
        tokenizer=tokenizer_dir,
        steps=6,
    )
    with pytest.raises(SettingsChangedError) as err:
        train.main(changed)
    message = str(err.value)
    for line in ("--learning_rate: 0.003 -> 0.005", "--max_tokens: 1024 -> 900", "--seed: 1 -> 2"):
        assert line in message, message
    assert "--allow_changed_settings learning_rate,max_tokens,seed" in message
    assert "max_steps" not in message  # extending the run (4 -> 6 steps) is not a refused change
    # allowing some of them still refuses the others
    with pytest.raises(SettingsChangedError) as err:
        train.main(changed + ["--allow_changed_settings", "seed,learning_rate"])
    assert "--max_tokens: 1024 -> 900" in str(err.value) and "--seed" not in str(err.value)
    # settings the model and tokenizer were built from cannot change, even when named
    with pytest.raises(SettingsChangedError, match=r"--preset: 'tiny' -> 'small'  \(fixed"):
        train.main(
            resume_args(
                data_dir,
                run,
                "--preset",
                "small",
                "--allow_changed_settings",
                "preset",
                tokenizer=tokenizer_dir,
                steps=6,
            )
        )
    with pytest.raises(SystemExit):  # an unknown name is an argument error
        train.parse_args(["--allow_changed_settings", "learning_rat"])
    # nothing in the run folder was touched by the refused resumes
    assert {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_extension_is_exact_and_planted_pickles_never_run(short_run, long_run, data_dir, tokenizer_dir, tmp_path):
    """Pickles planted in the checkpoint (accelerate's custom_checkpoint_*.pkl / random_states_*.pkl, which it
    would unpickle) are never executed: the resume stops naming them. Without them, resuming the 4-step run to 6
    steps (a free change) gives bit-identical losses and weights to the uninterrupted 6-step run."""
    run = copy_run(short_run, tmp_path / "run")
    assert not list(run.rglob("*.pkl"))  # our checkpoints hold no pickles
    ckpt = run / "checkpoints" / "step_4"
    assert {"trainer_state.json", "rng_state_0.json", "checkpoint.json"} <= {p.name for p in ckpt.iterdir()}
    marker = tmp_path / "PWNED"
    planted = ("custom_checkpoint_0.pkl", "custom_checkpoint_1.pkl", "random_states_0.pkl")
    for name in planted:
        plant(ckpt / name, marker)
    torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=False)  # the payload is live:
    assert marker.exists()
    marker.unlink()
    explicit = tiny_args(
        data_dir, run, *COMMON, "--resume_from_checkpoint", str(ckpt), tokenizer=tokenizer_dir, steps=6
    )
    named = ", ".join(str(ckpt / name) for name in sorted(planted))
    with pytest.raises(CheckpointError, match=re.escape(f"never writes ({named})")):
        train.main(explicit)
    assert not marker.exists()
    # `latest` falls back past it to the newest intact checkpoint, naming the files, as past a damaged one
    skipped = []
    assert checkpointing.resolve_resume("latest", run / "checkpoints", skipped) == run / "checkpoints" / "step_2"
    assert (
        len(skipped) == 1
        and named in skipped[0]
        and "resuming from the newest intact checkpoint, step_2" in (skipped[0])
    )
    for name in planted[:2]:
        (ckpt / name).unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "random_states_0.pkl"))):  # one is enough
        train.main(explicit)
    assert not marker.exists()
    for name in planted[2:]:
        (ckpt / name).unlink()

    results = train.main(resume_args(data_dir, run, tokenizer=tokenizer_dir, steps=6))
    assert not marker.exists()
    ref_dir, reference = long_run
    assert train_losses(run) == train_losses(ref_dir)  # exact float equality, every logged step
    assert [r for r in read_log(run) if "valid_loss" in r] == [r for r in read_log(ref_dir) if "valid_loss" in r]
    ref_w = load_file(str(ref_dir / "model" / "model.safetensors"))
    got_w = load_file(str(run / "model" / "model.safetensors"))
    assert ref_w.keys() == got_w.keys() and all(torch.equal(ref_w[k], got_w[k]) for k in ref_w)
    assert results["bleu"] == reference["bleu"] and results["steps"] == 6
    assert results["settings_changes"] == [{"step": 4, "setting": "max_steps", "from": 4, "to": 6, "free": True}]
    assert reference["settings_changes"] == []


def test_allowed_changes_take_effect_and_are_recorded(short_run, data_dir, tokenizer_dir, tmp_path):
    """With --allow_changed_settings, the new optimizer and schedule settings are used from the resumed step on
    (the checkpoint's optimizer/scheduler state would otherwise keep the old ones) and recorded in results.json
    and the model card."""
    from transformers import get_scheduler

    run = copy_run(short_run, tmp_path / "run")
    results = train.main(
        resume_args(
            data_dir,
            run,
            "--learning_rate",
            "0.006",
            "--adam_beta2",
            "0.99",
            "--warmup_steps",
            "2",
            "--allow_changed_settings",
            "learning_rate,adam_beta2",
            "--allow_changed_settings",
            "warmup_steps",
            tokenizer=tokenizer_dir,
            steps=6,
        )
    )
    # the learning rate at step 6 is that of a fresh schedule with the new peak and warmup
    probe = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=0.006)
    schedule = get_scheduler("inverse_sqrt", probe, num_warmup_steps=2)
    lrs = {}
    for step in range(1, 7):
        probe.step()
        schedule.step()
        lrs[step] = schedule.get_last_lr()[0]
    logged = {r["step"]: r["lr"] for r in read_log(run) if "lr" in r}
    assert logged[6] == pytest.approx(lrs[6], rel=1e-12) and logged[4] != pytest.approx(lrs[4])
    saved = torch.load(run / "checkpoints" / "step_6" / "optimizer.bin", weights_only=True)["param_groups"][0]
    assert tuple(saved["betas"]) == (0.9, 0.99) and saved["initial_lr"] == 0.006
    assert saved["lr"] == pytest.approx(lrs[6], rel=1e-12)
    assert results["settings_changes"] == [
        {"step": 4, "setting": "adam_beta2", "from": 0.98, "to": 0.99, "free": False},
        {"step": 4, "setting": "learning_rate", "from": 0.003, "to": 0.006, "free": False},
        {"step": 4, "setting": "max_steps", "from": 4, "to": 6, "free": True},
        {"step": 4, "setting": "warmup_steps", "from": 4, "to": 2, "free": False},
    ]
    assert json.loads((run / "results.json").read_text())["settings_changes"] == results["settings_changes"]
    assert results["hyperparameters"]["learning_rate"] == 0.006
    card = (run / "model" / "README.md").read_text(encoding="utf-8")
    assert (
        "| Resumed at step 4 with | `adam_beta2` 0.98 → 0.99; `learning_rate` 0.003 → 0.006; `max_steps` 4 → 6; "
        "`warmup_steps` 4 → 2 |"
    ) in card
    # the changes stay recorded through later resumes, and the new values are now the checkpoint's settings
    results = train.main(
        resume_args(
            data_dir,
            run,
            "--learning_rate",
            "0.006",
            "--adam_beta2",
            "0.99",
            "--warmup_steps",
            "2",
            tokenizer=tokenizer_dir,
            steps=8,
        )
    )
    assert [c["step"] for c in results["settings_changes"]] == [4, 4, 4, 4, 6]
    assert results["settings_changes"][-1] == {"step": 6, "setting": "max_steps", "from": 6, "to": 8, "free": True}


# ------------------------------------------------------------------------------------------- changed data
def sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_resume_on_data_replaced_at_the_same_path_is_refused_naming_it(data_dir, tokenizer_dir, tmp_path):
    """A run, then its training files replaced by other pairs at the same path: a resume in a second process is
    refused (exit status 2, nothing written) naming each changed file with both fingerprints and the flag that
    accepts the change; with `--allow_changed_settings data` it resumes, and the change is in train.log,
    results.json and the model card."""
    import subprocess

    from test_training import MULTI30K, TRAIN_SCRIPT, head, subprocess_env, write_lines

    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    run = tmp_path / "run"
    args = tiny_args(data, run, *COMMON, "--max_valid_pairs", "8", tokenizer=tokenizer_dir, steps=4)
    train.main(args)
    saved = {
        lang: (sha256(data / f"train.{lang}.gz"), (data / f"train.{lang}.gz").stat().st_size) for lang in ("en", "de")
    }
    for lang in ("en", "de"):  # other pairs, written to a new file renamed over the old one
        write_lines(tmp_path / "new.gz", head(MULTI30K / f"train.{lang}.gz", 600)[300:])
        os.replace(tmp_path / "new.gz", data / f"train.{lang}.gz")
    before = {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*")}
    resume = args + ["--resume_from_checkpoint", "latest"]
    proc = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *resume], capture_output=True, text=True, timeout=300, env=subprocess_env()
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("train.py: error: ") :]
    ckpt = run / "checkpoints" / "step_4"
    assert message.startswith(f"train.py: error: Cannot resume {ckpt}: the data changed since it was written")
    for lang in ("en", "de"):
        new = data / f"train.{lang}.gz"
        old_digest, old_size = saved[lang]
        assert (
            f"  train {lang} ({new}): sha256 {old_digest} ({old_size:,} bytes) -> sha256 {sha256(new)} "
            f"({new.stat().st_size:,} bytes)"
        ) in message, message
    assert "valid" not in message.split("\n", 1)[1].split("The run")[0]  # the validation files did not change
    assert "pass --allow_changed_settings data to train on the new data from step 4 on" in message
    assert "Traceback" not in proc.stderr
    assert {p.relative_to(run): p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written

    results = train.main(resume + ["--allow_changed_settings", "data", "--max_steps", "6"])
    assert results["steps"] == 6
    changes = [c for c in results["settings_changes"] if c["setting"] == "data"]
    assert [c["from"].split(":")[0] for c in changes] == ["train de (train.de.gz)", "train en (train.en.gz)"]
    assert all(c["step"] == 4 and not c["free"] for c in changes)
    assert (
        changes[1]["to"] == f"sha256 {sha256(data / 'train.en.gz')} ({(data / 'train.en.gz').stat().st_size:,} bytes)"
    )
    assert "Resuming step_4 with the data changed: train en" in (run / "train.log").read_text()
    card = (run / "model" / "README.md").read_text(encoding="utf-8")
    assert "| Resumed at step 4 with | `max_steps` 4 → 6; `data` train de (train.de.gz): sha256 " in card
    assert str(tmp_path) not in card  # no machine paths
    # the new data is now the checkpoint's: the next resume goes on without a word
    again = train.main(args + ["--resume_from_checkpoint", "latest", "--max_steps", "7"])
    assert [c["step"] for c in again["settings_changes"] if c["setting"] == "data"] == [4, 4]


def test_data_fingerprint_follows_the_content(tmp_path):
    """A file's digest is reused only for the version it was computed for: the same bytes written again keep the
    fingerprint; other bytes of the same size with the old modification time set back are still noticed (the
    status-change time moved). A `save_to_disk` folder replaced by another dataset changes its fingerprint."""
    import datasets

    from hf_variants.training import data_fingerprint
    from hf_variants.training.sources import SplitSource

    memo = tmp_path / "memo"
    file = tmp_path / "train.en"
    file.write_bytes(b"one\ntwo\n")
    first = data_fingerprint.file_fingerprint(file, memo)
    assert first["sha256"] == sha256(file) and first["size"] == 8 and len(list(memo.iterdir())) == 1
    assert data_fingerprint.file_fingerprint(file, memo) == first  # from the memo
    mtime = file.stat().st_mtime_ns
    file.write_bytes(b"one\ntwo\n")
    assert data_fingerprint.file_fingerprint(file, memo) == first
    file.write_bytes(b"one\nTWO\n")
    os.utime(file, ns=(mtime, mtime))
    changed = data_fingerprint.file_fingerprint(file, memo)
    assert changed["sha256"] == sha256(file) != first["sha256"]
    (next(memo.iterdir())).write_text("not json")  # a damaged memo is ignored
    assert data_fingerprint.file_fingerprint(file, memo) == changed

    def folder_fingerprint(rows):
        folder = tmp_path / "ds"
        shutil.rmtree(folder, ignore_errors=True)
        datasets.Dataset.from_dict({"en": rows, "fr": rows}).save_to_disk(str(folder))
        source = SplitSource.from_hub(datasets.load_from_disk(str(folder)), str(folder), "train")
        return data_fingerprint.split_fingerprints({"train": source})

    a, b = folder_fingerprint(["a", "b"]), folder_fingerprint(["a", "c"])
    assert a == folder_fingerprint(["a", "b"]) and a != b
    (change,) = data_fingerprint.changes(a, b)
    assert change["source"] == f"train ({tmp_path / 'ds'}[train])" and change["from"].endswith("(2 rows)")


# ----------------------------------------------------------------------------------- the checkpoint format
def test_rng_state_round_trips_through_json():
    state = json.loads(json.dumps(checkpointing.rng_state()))
    first = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4), torch.randn(2))
    checkpointing.set_rng_state(state)
    again = (random.random(), np.random.rand(3).tolist(), np.random.randn(), torch.rand(4), torch.randn(2))
    assert first[:3] == again[:3] and torch.equal(first[3], again[3]) and torch.equal(first[4], again[4])
    broken = dict(state, torch="not base64!")
    with pytest.raises(CheckpointError, match="malformed"):
        checkpointing.set_rng_state(broken, "rng_state_0.json")


def tiny_training_objects():
    from accelerate import Accelerator
    from transformers import get_scheduler

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = get_scheduler("inverse_sqrt", optimizer, num_warmup_steps=2)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    return accelerator, model, optimizer, scheduler


def test_tampered_checkpoint_files_are_refused(tmp_path):
    """Every file a resume needs is checked: a planted pickle in place of the optimizer state or the weights, a
    damaged or missing JSON state, or a checkpoint of the old pickled format raise `CheckpointError` (nothing is
    skipped silently) and no payload ever runs."""
    accelerator, model, optimizer, scheduler = tiny_training_objects()
    trainer_state = {"train_state": {"step": 1}, "scheduler": scheduler.state_dict()}
    good = checkpointing.save_checkpoint(accelerator, tmp_path / "ckpts", 1, {"settings": {}}, trainer_state)
    assert sorted(p.name for p in good.iterdir()) == [
        "checkpoint.json",
        "model.safetensors",
        "optimizer.bin",
        "rng_state_0.json",
        "trainer_state.json",
    ]
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    adam_state = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
    draw = torch.rand(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    optimizer.step()
    loaded = checkpointing.load_checkpoint(accelerator, good)
    assert loaded == json.loads(json.dumps(trainer_state))
    assert all(torch.equal(model.state_dict()[k], weights[k]) for k in weights)
    assert all(torch.equal(optimizer.state_dict()["state"][0][k], adam_state[k]) for k in adam_state)
    assert torch.equal(torch.rand(3), draw)  # the random state of the save

    marker = tmp_path / "PWNED"
    cases = {
        "optimizer.bin": (lambda f: plant(f, marker), r"optimizer.bin: refused: it holds a pickle that calls exec"),
        "model.safetensors": (lambda f: plant(f, marker), r"model.safetensors: refused: it is not a safetensors file"),
        "rng_state_0.json": (lambda f: f.write_text("{not json"), r"rng_state_0.json is not valid JSON"),
        "trainer_state.json": (lambda f: f.unlink(), r"trainer_state.json is missing"),
    }
    for name, (tamper, message) in cases.items():
        bad = tmp_path / f"bad_{name}"
        shutil.copytree(good, bad)
        tamper(bad / name)
        with pytest.raises(CheckpointError, match=message):
            checkpointing.load_checkpoint(accelerator, bad)
    missing_rng = tmp_path / "no_rng"
    shutil.copytree(good, missing_rng)
    (missing_rng / "rng_state_0.json").unlink()
    with pytest.raises(CheckpointError, match=r"rng_state_0.json is missing"):
        checkpointing.load_checkpoint(accelerator, missing_rng)
    # a checkpoint of the old format (accelerate's pickles) is refused before anything is unpickled
    old = tmp_path / "old_format"
    shutil.copytree(good, old)
    (old / "checkpoint.json").write_text(json.dumps({"step": 1}))
    plant(old / "custom_checkpoint_0.pkl", marker)
    plant(old / "random_states_0.pkl", marker)
    with pytest.raises(CheckpointError, match=r"format 1.*pickled \(custom_checkpoint_0.pkl, random_states_0.pkl\)"):
        checkpointing.load_checkpoint(accelerator, old)
    assert not marker.exists()


def test_settings_diff_classes():
    from hf_variants.training import settings

    args = train.parse_args(["--max_steps", "10"])
    saved = settings.run_settings(args, num_processes=1, mixed_precision="no", device="cpu")
    assert "hub_token" not in saved and "resume_from_checkpoint" not in saved and "output_dir" not in saved
    again = train.parse_args(
        ["--max_steps", "20", "--eval_steps", "5", "--hub_token", "hf_x", "--resume_from_checkpoint", "latest"]
    )
    now = settings.run_settings(again, num_processes=1, mixed_precision="no", device="cpu")
    assert [c["setting"] for c in settings.resume_changes(saved, now, set())] == [
        "eval_steps",
        "max_steps",
        "save_steps",
    ]
    two = settings.run_settings(args, num_processes=2, mixed_precision="bf16", device="cpu")
    with pytest.raises(SettingsChangedError, match=r"--mixed_precision: 'no' -> 'bf16'[\s\S]*--num_processes: 1 -> 2"):
        settings.resume_changes(saved, two, set())
    assert len(settings.resume_changes(saved, two, {"num_processes", "mixed_precision"})) == 2


# ------------------------------------------------------------------------------------------- the run's tokenizer
@pytest.fixture(scope="module")
def own_tokenizer_run(data_dir, tmp_path_factory):
    """A finished 4-step run that trained its own tokenizer (no --tokenizer; checkpoints at steps 2 and 4)."""
    out = tmp_path_factory.mktemp("own_tok") / "run"
    train.main(tiny_args(data_dir, out, *COMMON, "--vocab_size", "400", steps=4))
    return out


def fingerprint(folder) -> str:
    from transformers import AutoTokenizer

    from hf_variants.training.cache_store import tokenizer_fingerprint

    return tokenizer_fingerprint(AutoTokenizer.from_pretrained(folder))


def test_resume_into_a_new_folder_with_other_data_keeps_the_tokenizer(own_tokenizer_run, data_dir, tmp_path):
    """Resuming R/checkpoints/step_4 into a new --output_dir with other training data uses the checkpoint's
    tokenizer (saved with it), never one trained on the new data."""
    from test_training import MULTI30K, head, write_lines

    other = tmp_path / "other_data"
    other.mkdir()
    for lang in ("en", "de", "fr"):
        write_lines(other / f"train.{lang}.gz", head(MULTI30K / f"train.{lang}.gz", 600)[300:])
        for split in ("val", "test_2016_flickr"):
            shutil.copy(data_dir / f"{split}.{lang}.gz", other / f"{split}.{lang}.gz")
    ckpt = own_tokenizer_run / "checkpoints" / "step_4"
    new = tmp_path / "new"
    args = tiny_args(other, new, *COMMON, "--vocab_size", "400", steps=6)
    results = train.main(args + ["--resume_from_checkpoint", str(ckpt), "--allow_changed_settings", "data_dir,data"])
    assert results["steps"] == 6
    log = (new / "train.log").read_text()
    assert "Training a shared" not in log
    assert f"Resuming with the tokenizer of step_4 ({ckpt / 'tokenizer'})" in log
    assert (
        fingerprint(new / "tokenizer")
        == fingerprint(own_tokenizer_run / "tokenizer")
        == fingerprint(ckpt / "tokenizer")
    )
    assert fingerprint(new / "model") == fingerprint(ckpt / "tokenizer")  # the final model ships it


def test_resume_with_another_tokenizer_is_refused_naming_both(own_tokenizer_run, data_dir, tokenizer_dir, tmp_path):
    """The run folder's tokenizer replaced by another one: the resume is refused naming the checkpoint's tokenizer
    and the other one, before anything is trained or written."""
    run = copy_run(own_tokenizer_run, tmp_path / "run")
    shutil.rmtree(run / "tokenizer")
    shutil.copytree(tokenizer_dir, run / "tokenizer")
    with pytest.raises(SettingsChangedError) as err:
        train.main(resume_args(data_dir, run, "--vocab_size", "400", tokenizer=None, steps=6))
    message = str(err.value)
    assert f"the tokenizer in {run / 'checkpoints' / 'step_4' / 'tokenizer'}" in message
    assert f"the run folder's tokenizer ({run / 'tokenizer'}) is another one" in message
    assert not (run / "checkpoints" / "step_6").exists()
