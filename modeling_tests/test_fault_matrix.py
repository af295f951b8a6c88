"""Every file training wrote is untrusted when read back: a matrix of real damage (truncated, torn, replaced by a
FIFO, a device file or a link, paths leaving their folder, planted files) × the code that reads it (the tokenized
data cache's three stages, a checkpoint resumed by path or as `latest`, the run log). Each cell damages a real file
written by the real code and checks what the reader does: a damaged cache entry is named and built again with the
same result; a checkpoint is refused naming the file (nothing outside its folder is opened) and `latest` falls
back past it to the newest intact one; a torn last log line is dropped with a warning, a damaged earlier one is an
error naming file and line."""

import json
import logging
import os
import shutil
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import MULTI30K, data_dir, head, tiny_args, tokenizer_dir, write_lines  # noqa: E402,F401

from hf_variants.training import checkpointing, data_pipeline, train  # noqa: E402
from hf_variants.training.checkpointing import CheckpointError  # noqa: E402
from hf_variants.training.trainer import RunLogError, read_run_log  # noqa: E402


@contextmanager
def deadline(seconds: int = 30):
    """Fail instead of hanging (a reader blocked on a FIFO or a device file)."""

    def expired(signum, frame):
        raise AssertionError(f"still reading after {seconds} s: blocked on a FIFO or a device file?")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def truncate(path: Path, keep: float = 0.5) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(int(size * keep))


def fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


# ------------------------------------------------------------------------------------------------- data cache
CACHE_FILES = {"rows": "data.arrow", "measured": "measured-00000.arrow", "pairs": "src_len.npy"}
CACHE_DAMAGE = {
    "truncated": lambda entry, name: truncate(entry / name),
    "emptied": lambda entry, name: (entry / name).write_bytes(b""),
    "fifo": lambda entry, name: fifo(entry / name),
    "torn meta.json": lambda entry, name: truncate(entry / "meta.json", 0.6),
}


@pytest.fixture(scope="module")
def cache_source(tmp_path_factory):
    from hf_variants.tokenization import train_tokenizer

    d = tmp_path_factory.mktemp("cache_data")
    write_lines(d / "t.en.gz", head(MULTI30K / "train.en.gz", 150))
    write_lines(d / "t.de.gz", head(MULTI30K / "train.de.gz", 150))
    tok = train_tokenizer(
        head(MULTI30K / "train.en.gz", 150) + head(MULTI30K / "train.de.gz", 150),
        vocab_size=300,
        languages=["en", "de"],
        output_dir=d / "tok",
    )
    source = data_pipeline.SplitSource.from_dir(d, "t", ["en", "de"])
    cache = d / "cache"
    reference = build_cache(source, tok, cache)
    return source, tok, cache, reference


def build_cache(source, tok, cache):
    rows = data_pipeline.load_rows(source, ["en", "de"], cache_dir=cache)
    measured = data_pipeline.measure(rows, tok, ["en", "de"], cache_dir=cache)
    pairs = data_pipeline.build_pair_set(rows, measured, [("en", "de")], max_length=40, cache_dir=cache)
    return rows, measured, pairs


@pytest.mark.parametrize("damage", list(CACHE_DAMAGE))
@pytest.mark.parametrize("stage", list(CACHE_FILES))
def test_damaged_cache_entry_is_named_and_built_again(cache_source, tmp_path, caplog, stage, damage):
    source, tok, original, (rows0, _, pairs0) = cache_source
    cache = tmp_path / "cache"
    shutil.copytree(original, cache)
    (entry,) = cache.glob(f"{stage}-*")
    CACHE_DAMAGE[damage](entry, CACHE_FILES[stage])
    with deadline(), caplog.at_level(logging.WARNING, logger="hf_variants.data"):
        rows, measured, pairs = build_cache(source, tok, cache)
    assert f"The data cache entry {entry} is damaged (" in caplog.text, caplog.text
    if damage != "torn meta.json":
        assert CACHE_FILES[stage] in caplog.text
    built = {"rows": rows.built, "measured": measured.built, "pairs": pairs.built}
    assert built[stage] and sum(built.values()) == 1  # only the damaged entry (the others keep their keys)
    assert list(rows.texts("de")) == list(rows0.texts("de"))
    for name in ("row_index", "dir_index", "src_len", "tgt_len"):
        assert np.array_equal(getattr(pairs, name), getattr(pairs0, name)), name
    # the rebuilt entry is whole: the next load reads it without a warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_variants.data"):
        again = build_cache(source, tok, cache)
    assert not any(part.built for part in again) and "damaged" not in caplog.text


# ------------------------------------------------------------------------------------------------ checkpoints
class Payload:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').close()",)


def list_file(ckpt: Path, name: str, size: int = 0) -> None:
    """Add `name` to the checkpoint's manifest (as a tampered or damaged checkpoint.json could)."""
    marker = ckpt / checkpointing.MARKER
    info = json.loads(marker.read_text())
    info["files"][name] = {"size": size, "sha256": "0" * 64}
    marker.write_text(json.dumps(info))


def plant_link(ckpt: Path, target: str) -> str:
    os.symlink(target, ckpt / "extra.bin")
    list_file(ckpt, "extra.bin")
    return str(ckpt / "extra.bin")


CHECKPOINT_DAMAGE = {
    # damage(ckpt, tmp_path) -> the text the refusal must name
    "absolute path": lambda c, t: (list_file(c, "/dev/zero"), "listed file '/dev/zero' is not a plain relative path")[
        1
    ],
    "dot-dot path": lambda c, t: (
        list_file(c, "../step_2/model.safetensors"),
        "listed file '../step_2/model.safetensors' is not a plain relative path",
    )[1],
    "link to a device": lambda c, t: plant_link(c, "/dev/zero") + ": resolves outside the checkpoint folder",
    "fifo": lambda c, t: (fifo(c / "trainer_state.json"), f"{c / 'trainer_state.json'}: not a regular file")[1],
    "planted pickle": lambda c, t: (
        torch.save(Payload(t / "executed"), c / "custom_checkpoint_0.pkl"),
        str(c / "custom_checkpoint_0.pkl"),
    )[1],
    "unlisted file": lambda c, t: (
        (c / "notes.bin").write_bytes(b"x"),
        f"{c / 'notes.bin'}: not listed in checkpoint.json",
    )[1],
    "truncated weights": lambda c, t: (truncate(c / "model.safetensors"), f"{c / 'model.safetensors'}: size")[1],
    "torn checkpoint.json": lambda c, t: (truncate(c / "checkpoint.json", 0.5), f"{c / 'checkpoint.json'} is not")[1],
    "size not a number": lambda c, t: (list_file(c, "rng_state_0.json", "big"), "is not an integer ('big')")[1],
}


@pytest.fixture(scope="module")
def short_run(data_dir, tokenizer_dir, tmp_path_factory):
    """A finished 4-step run (checkpoints at steps 2 and 4)."""
    base = tmp_path_factory.mktemp("faults")
    args = tiny_args(
        data_dir,
        base / "run",
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
        "--data_cache_dir",
        str(base / "cache"),
        tokenizer=tokenizer_dir,
        steps=4,
    )
    train.main(args)
    return base / "run", args


@pytest.mark.parametrize("reader", ["path", "latest"])
@pytest.mark.parametrize("damage", list(CHECKPOINT_DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file(short_run, tmp_path, caplog, damage, reader):
    src, _ = short_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    ckpt = run / "checkpoints" / "step_4"
    named = CHECKPOINT_DAMAGE[damage](ckpt, tmp_path)
    with deadline():
        if reader == "path":
            with pytest.raises(CheckpointError) as err:
                checkpointing.resolve_resume(str(ckpt), run / "checkpoints")
            assert named in str(err.value), str(err.value)
        else:
            skipped = []
            assert (
                checkpointing.resolve_resume("latest", run / "checkpoints", skipped) == run / "checkpoints" / "step_2"
            )
            assert len(skipped) == 1 and named in skipped[0] and "instead" in skipped[0], skipped
    assert not (tmp_path / "executed").exists()  # nothing was unpickled


def reseal(ckpt: Path, name: str) -> None:
    """Record `name`'s new size and SHA-256 in the manifest (as a tamperer who rewrites checkpoint.json would): only
    opening the file can tell it apart."""
    marker = ckpt / checkpointing.MARKER
    info = json.loads(marker.read_text())
    file = ckpt / name
    info["files"][name] = {"size": file.stat().st_size, "sha256": checkpointing.file_digest(file)}
    marker.write_text(json.dumps(info))


LIBRARY_ADVICE = ("weights_only", "Re-running", "add_safe_globals", "safe_globals", "trusted source")


def stored_files(ckpt: Path) -> list[str]:
    return sorted(p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file())


def test_a_planted_pickle_in_every_state_file_is_named_and_passed_over(short_run, tmp_path):
    """A pickle whose unpickling runs code, planted in place of each file of a checkpoint (the manifest rewritten to
    match, so only opening the file can tell): a resume by path is refused naming that file in our words, without
    any library's advice to load it unsafely; `latest` passes over it to the previous checkpoint, naming the file."""
    src, _ = short_run
    names = stored_files(src / "checkpoints" / "step_4")
    assert {"optimizer.bin", "model.safetensors", "trainer_state.json", "rng_state_0.json", "checkpoint.json"} <= set(
        names
    ) and any(n.startswith("tokenizer/") for n in names)
    for name in names:
        run = tmp_path / name.replace("/", "_")
        shutil.copytree(src, run)
        ckpt = run / "checkpoints" / "step_4"
        torch.save(Payload(tmp_path / "executed"), ckpt / name)
        if name != checkpointing.MARKER:
            reseal(ckpt, name)
        with deadline():
            with pytest.raises(CheckpointError) as err:
                checkpointing.resolve_resume(str(ckpt), run / "checkpoints")
            skipped = []
            resumed = checkpointing.resolve_resume("latest", run / "checkpoints", skipped)
        message = str(err.value)
        named = str(ckpt / name) if not name.startswith("tokenizer/") else str(ckpt / name.partition("/")[0])
        assert named in message, (name, message)
        assert not any(advice in message for advice in LIBRARY_ADVICE), (name, message)
        assert resumed == run / "checkpoints" / "step_2", (name, skipped)
        assert len(skipped) == 1 and named in skipped[0] and "instead" in skipped[0], (name, skipped)
        assert not any(advice in skipped[0] for advice in LIBRARY_ADVICE), skipped
    assert not (tmp_path / "executed").exists()  # nothing was unpickled


def test_a_refused_state_file_is_named_by_load_checkpoint_itself(short_run, tmp_path):
    """The loader names the refused file in our words too (a checkpoint that passed the resolution and was
    replaced afterwards), never chaining the library's exception, whose text advises loading it unsafely."""
    from accelerate import Accelerator

    src, _ = short_run
    ckpt = tmp_path / "step_4"
    shutil.copytree(src / "checkpoints" / "step_4", ckpt)
    torch.save(Payload(tmp_path / "executed"), ckpt / "optimizer.bin")
    model = torch.nn.Linear(2, 2)
    accelerator = Accelerator(cpu=True)
    accelerator.prepare(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(CheckpointError) as err:
        checkpointing.load_checkpoint(accelerator, ckpt)
    message = str(err.value)
    assert message.startswith(f"{ckpt / 'optimizer.bin'}: refused: it holds a pickle that calls exec (code, ")
    assert err.value.__cause__ is None and err.value.__suppress_context__
    assert not any(advice in message for advice in LIBRARY_ADVICE), message
    assert not (tmp_path / "executed").exists()


def test_planted_pickle_in_the_optimizer_state_of_real_resumes(short_run, tmp_path):
    """The issue's case through the command line: a pickle in `optimizer.bin` of the newest checkpoint; by path the
    resume stops with one line naming the file (exit status 2, nothing trained); with `latest` it resumes from the
    previous checkpoint, says so naming the file, and finishes. No output ever carries torch's advice."""
    import subprocess

    from test_training import TRAIN_SCRIPT, subprocess_env

    src, args = short_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    ckpt = run / "checkpoints" / "step_4"
    torch.save(Payload(tmp_path / "executed"), ckpt / "optimizer.bin")
    reseal(ckpt, "optimizer.bin")
    base = [a if a != str(src) else str(run) for a in args]
    by_path = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *base, "--resume_from_checkpoint", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert by_path.returncode == 2, by_path.stderr[-3000:]
    last = by_path.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: error: Checkpoint {ckpt} cannot be resumed: {ckpt / 'optimizer.bin'}: refused")
    assert "Traceback" not in by_path.stderr
    assert not any(advice in by_path.stdout + by_path.stderr for advice in LIBRARY_ADVICE), by_path.stderr
    latest = subprocess.run(
        [sys.executable, str(TRAIN_SCRIPT), *base, "--resume_from_checkpoint", "latest"],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
    )
    assert latest.returncode == 0, latest.stderr[-3000:]
    log = (run / "train.log").read_text()
    assert f"{ckpt / 'optimizer.bin'}: refused: it holds a pickle that calls" in log
    assert "resuming from the newest intact checkpoint, step_2, instead" in log
    assert f"Resumed from {run / 'checkpoints' / 'step_2'}: step 2" in log
    assert not any(advice in latest.stdout + latest.stderr + log for advice in LIBRARY_ADVICE)
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert not (tmp_path / "executed").exists()


# ------------------------------------------------------------------------------------------------ the run log
RECORDS = [{"step": 4, "loss": 6.9}, {"step": 8, "loss": 6.7}, {"step": 8, "valid_loss": 6.8}]
LOG_DAMAGE = {
    # damage -> (file content, the records read back, or the error naming the line)
    "torn last line": (b'{"step": 4, "loss": 6.9}\n{"step": 8, "loss": 6.7}\n{"step": 8, "loss": 6.6', RECORDS[:2]),
    "torn last line, bad UTF-8": (b'{"step": 4, "loss": 6.9}\n{"step": 8, "lo\xe2\x82', RECORDS[:1]),
    "damaged middle line": (b'{"step": 4, "loss": 6.9}\n{"step": 8, "lo\n{"step": 8, "valid_loss": 6.8}\n', "line 2"),
    "not a record": (b'{"step": 4, "loss": 6.9}\n[1, 2]\n{"step": 8, "valid_loss": 6.8}\n', "line 2: not a record"),
    "step not an integer": (b'{"step": "4"}\n{"step": 8, "loss": 6.7}\n', "line 1: not a record"),
    "intact": (b"".join(json.dumps(r).encode() + b"\n" for r in RECORDS), RECORDS),
}


@pytest.mark.parametrize("damage", list(LOG_DAMAGE))
def test_run_log_read_back(tmp_path, caplog, damage):
    content, expected = LOG_DAMAGE[damage]
    log = tmp_path / "log.jsonl"
    log.write_bytes(content)
    if isinstance(expected, str):
        with pytest.raises(RunLogError, match=rf"^{log}, {expected}"):
            read_run_log(log)
        return
    with caplog.at_level(logging.WARNING, logger="hf_variants.train"):
        assert read_run_log(log) == expected
    torn = damage.startswith("torn")
    last = content.count(b"\n") + 1
    assert (f"{log}: its last line ({last}) is torn" in caplog.text) == torn, caplog.text


def test_run_log_that_is_a_fifo_is_refused(tmp_path):
    log = tmp_path / "log.jsonl"
    os.mkfifo(log)
    with deadline(), pytest.raises(RunLogError, match=f"{log} is not a regular file"):
        read_run_log(log)


def test_resume_with_a_torn_last_log_line(short_run, tmp_path):
    """The crash of the issue: log.jsonl ending in a half-written record; the resume drops it with a warning naming
    the file, and the run continues (its log is whole again)."""
    src, args = short_run
    run = tmp_path / "run"
    shutil.copytree(src, run)
    log = run / "log.jsonl"
    with open(log, "ab") as f:
        f.write(b'{"step": 8, "loss": 6.6')
    resumed = [a if a != str(src) else str(run) for a in args]
    resumed[resumed.index("--max_steps") + 1] = "6"
    results = train.main(resumed + ["--resume_from_checkpoint", "latest"])
    assert results["steps"] == 6
    assert f"{log}: its last line (" in (run / "train.log").read_text()
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r][-1] == 6
