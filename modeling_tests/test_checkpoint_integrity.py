"""Damaged checkpoints and full disks (hf_variants/training/checkpointing.py): every checkpoint lists its files' sizes
and SHA-256; a resume names the damaged file and `latest` falls back to the newest intact checkpoint; checkpoints
without the list still resume; a save on a full file system (a real tmpfs) names the file and the space, leaves no
partial folder, and the previous checkpoint resumes."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import data_dir, read_log, tiny_args, tokenizer_dir  # noqa: E402,F401 (fixtures)

from hf_variants.training import checkpointing, train  # noqa: E402
from hf_variants.training.checkpointing import CheckpointError, DiskFullError  # noqa: E402

# checkpoints at steps 2 and 4
COMMON = [
    "--save_steps",
    "2",
    "--eval_steps",
    "4",
    "--eval_bleu_pairs",
    "0",
    "--max_train_pairs",
    "120",
    "--max_test_pairs",
    "4",
    "--final_model",
    "last",
]


def run_args(data_dir, run, tokenizer, cache, *extra, steps):
    return tiny_args(data_dir, run, *COMMON, "--data_cache_dir", str(cache), *extra, tokenizer=tokenizer, steps=steps)


@pytest.fixture(scope="module")
def short_run(data_dir, tokenizer_dir, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    base = tmp_path_factory.mktemp("integrity")
    train.main(run_args(data_dir, base / "run", tokenizer_dir, base / "cache", steps=4))
    return base / "run", base / "cache"


def truncate(path: Path, keep: float = 0.5) -> tuple[int, int]:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))
    return int(size * keep), size


def test_manifest_lists_every_file(short_run):
    run, _ = short_run
    for step in (2, 4):
        ckpt = run / "checkpoints" / f"step_{step}"
        files = checkpointing.checkpoint_info(ckpt)["files"]
        on_disk = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()} - {"checkpoint.json"}
        tokenizer = {f"tokenizer/{p.name}" for p in (run / "tokenizer").iterdir()}  # the run's, saved with it
        assert {"tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json"} <= tokenizer
        assert (
            set(files)
            == on_disk
            == {"model.safetensors", "optimizer.bin", "rng_state_0.json", "trainer_state.json"} | tokenizer
        )
        for name in tokenizer:
            assert (ckpt / name).read_bytes() == (run / name).read_bytes()
        for name, meta in files.items():
            assert meta == {"size": (ckpt / name).stat().st_size, "sha256": checkpointing.file_digest(ckpt / name)}
        assert checkpointing.damaged_files(ckpt) == []


def test_damaged_newest_checkpoint_falls_back(short_run, data_dir, tokenizer_dir, tmp_path):
    """The newest checkpoint's weights and optimizer state truncated: `latest` resumes from step_2 with a warning
    naming both files; an explicit path to step_4 is refused naming them; a same-size change is caught by the
    digest. step_2 is of the format before manifests (its list removed), which still resumes."""
    src, cache = short_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    step2, step4 = run / "checkpoints" / "step_2", run / "checkpoints" / "step_4"
    info = json.loads((step2 / "checkpoint.json").read_text())
    del info["files"]
    (step2 / "checkpoint.json").write_text(json.dumps(info))
    model_now, model_was = truncate(step4 / "model.safetensors")
    opt_now, opt_was = truncate(step4 / "optimizer.bin", 0.9)
    model_msg = f"{step4 / 'model.safetensors'}: size {model_now} bytes, expected {model_was} (truncated?)"
    opt_msg = f"{step4 / 'optimizer.bin'}: size {opt_now} bytes, expected {opt_was} (truncated?)"

    with pytest.raises(CheckpointError) as err:
        train.main(run_args(data_dir, run, tokenizer_dir, cache, "--resume_from_checkpoint", str(step4), steps=6))
    assert f"Checkpoint {step4} is damaged: {model_msg}; {opt_msg}" in str(err.value)

    results = train.main(run_args(data_dir, run, tokenizer_dir, cache, "--resume_from_checkpoint", "latest", steps=6))
    log = (run / "train.log").read_text()
    assert (
        f"WARNING Checkpoint {step4} is damaged: {model_msg}; {opt_msg}; resuming from the newest intact "
        f"checkpoint, step_2, instead." in log
    )
    assert f"Resumed from {step2}: step 2" in log
    assert results["steps"] == 6 and [r["step"] for r in read_log(run) if "loss" in r] == [2, 4, 6]
    # the resumed run wrote step_4 and step_6 anew, with manifests
    assert checkpointing.damaged_files(step4) == [] and "files" in checkpointing.checkpoint_info(step4)

    # same size, other content: only the digest tells
    rng = step4 / "rng_state_0.json"
    text = rng.read_text()
    rng.write_text(text.replace('"torch": "', '"torch": "A', 1)[: len(text)])
    assert rng.stat().st_size == len(text.encode())
    with pytest.raises(CheckpointError, match=rf"{rng}: SHA-256 differs from the one recorded at save"):
        checkpointing.resolve_resume(str(step4), run / "checkpoints")


def test_checkpoint_without_manifest_names_truncated_files(short_run, tmp_path):
    """Checkpoints written before manifests: a truncated safetensors file or torch archive is still named (their
    own structure is checked), and a state file that fails to load is named by load_checkpoint."""
    src, _ = short_run
    ckpt = tmp_path / "step_4"
    shutil.copytree(src / "checkpoints" / "step_4", ckpt)
    info = json.loads((ckpt / "checkpoint.json").read_text())
    del info["files"]
    (ckpt / "checkpoint.json").write_text(json.dumps(info))
    assert checkpointing.damaged_files(ckpt) == []
    now, was = truncate(ckpt / "model.safetensors")
    truncate(ckpt / "optimizer.bin")
    problems = checkpointing.damaged_files(ckpt)
    assert (
        problems[0] == f"{ckpt / 'model.safetensors'}: size {now} bytes, expected {was} from its header (truncated?)"
    )
    assert problems[1].startswith(f"{ckpt / 'optimizer.bin'}: not a complete torch archive (")
    assert len(problems) == 2
    refused = checkpointing._failing_state_file(ckpt)
    assert str(refused).startswith(f"{ckpt / 'model.safetensors'}: refused: it is shorter than its safetensors header")


# ---------------------------------------------------------------------------------------------- full disk
@pytest.fixture
def small_fs(tmp_path):
    """A real 1.3 MB tmpfs (needs root and CAP_SYS_ADMIN, else the test is skipped), unmounted afterwards."""
    mnt = tmp_path / "small_fs"
    mnt.mkdir()
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1300k", "tmpfs", str(mnt)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {proc.stderr.strip() or proc.returncode}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_during_save(small_fs, data_dir, tokenizer_dir, tmp_path, capsys):
    """A run on a 1.3 MB file system: step_2 (0.8 MB) fits, step_4 does not. The save warns beforehand, then fails
    naming the file and the space; no partial folder is left; step_2 is intact, and the run moved to a larger disk
    resumes from it."""
    run = small_fs / "run"
    cache = tmp_path / "cache"
    with pytest.raises(DiskFullError) as err:
        train.main(run_args(data_dir, run, tokenizer_dir, cache, steps=4))
    message = str(err.value)
    size = checkpointing.checkpoint_size(run / "checkpoints" / "step_2") / 2**20
    assert message.startswith(
        f"Checkpoint step_4 not saved: no space left on device while writing {run / 'checkpoints' / '.tmp_step_4'}/"
    ), message
    assert f" (needed ≈ {size:.1f} MB, free " in message
    assert message.endswith(
        "The partial checkpoint was removed; the previous checkpoint, step_2, is intact: free "
        "some space (or lower --keep_checkpoints, or move the run to a larger disk) and resume "
        "with --resume_from_checkpoint latest."
    ), message
    assert "Only " in capsys.readouterr().out.split("saving step 4 will probably fail")[0].rsplit("\n", 1)[-1]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_2"]
    assert checkpointing.verify_checkpoint(run / "checkpoints" / "step_2")["step"] == 2
    moved = shutil.copytree(run, tmp_path / "moved")
    results = train.main(
        run_args(data_dir, moved, tokenizer_dir, cache, "--resume_from_checkpoint", "latest", steps=4)
    )
    assert results["steps"] == 4
    assert f"Resumed from {moved / 'checkpoints' / 'step_2'}: step 2" in (moved / "train.log").read_text()
