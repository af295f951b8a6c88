"""One run per run folder (hf_variants/training/run_lock.py): a second train.py into a running run's --output_dir is
refused naming the first (also under a 2-process launch, whose ranks all exit), the lock of a process that died is
taken over with a message, as is the holder file of a copied folder (`cp -a` of a live run) and one of any shape."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from test_training import TRAIN_SCRIPT, data_dir, subprocess_env, tiny_args, tokenizer_dir, two_process_launch  # noqa: E402,F401

from hf_variants.training import run_lock  # noqa: E402
from hf_variants.training.run_lock import HOLDER_NAME, RunLock, RunLockedError  # noqa: E402


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_launch_is_refused_while_the_first_runs(data_dir, tokenizer_dir, tmp_path):
    """A real first train.py holds the lock (stopped with SIGSTOP right after taking it, so it holds it for as long
    as the test needs); a second train.py, launched as 2 processes (`accelerate launch`), exits non-zero on both
    ranks, naming the first's host and PID, without touching its files; the first then finishes normally."""
    run = tmp_path / "run"
    args = tiny_args(
        data_dir,
        run,
        "--max_train_pairs",
        "120",
        "--eval_bleu_pairs",
        "0",
        "--max_test_pairs",
        "4",
        "--data_cache_dir",
        str(tmp_path / "cache"),
        tokenizer=tokenizer_dir,
        steps=4,
    )
    env = subprocess_env()
    first = subprocess.Popen(
        [sys.executable, str(TRAIN_SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    try:
        wait_for(lambda: (run / HOLDER_NAME).is_file() or first.poll() is not None, 240, "the first run's lock")
        os.kill(first.pid, signal.SIGSTOP)
        assert first.poll() is None, first.stdout.read()
        holder = json.loads((run / HOLDER_NAME).read_text())
        assert holder["pid"] == first.pid and str(TRAIN_SCRIPT) in holder["command"]
        before = sorted(p.relative_to(run) for p in run.rglob("*"))
        t0 = time.time()
        launch = two_process_launch(*args)
        double = subprocess.Popen(launch, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        out_double, _ = double.communicate(timeout=240)
        elapsed = time.time() - t0
        refusal = f"{run} is in use by another training run: host {holder['host']}, PID {first.pid}, started "
        assert "Training a shared" not in out_double and "optimizer steps" not in out_double
        # both ranks of the 2-process launch stop (rank 1 told by rank 0), none waits for a collective
        assert double.returncode != 0, out_double[-3000:]
        assert f"[rank1]: hf_variants.training.run_lock.RunLockedError: {refusal}" in out_double, out_double[-3000:]
        assert f"[rank0]: hf_variants.training.run_lock.RunLockedError: {refusal}" in out_double, out_double[-3000:]
        assert elapsed < 200  # refused at startup: a hang would wait for --ddp_timeout
        assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # nothing of the first run touched
    finally:
        if first.poll() is None:
            os.kill(first.pid, signal.SIGCONT)
    out_first, _ = first.communicate(timeout=300)
    assert first.returncode == 0, out_first[-3000:]
    assert json.loads((run / "results.json").read_text())["steps"] == 4
    assert not (run / HOLDER_NAME).exists()  # released at the end; the lock file itself stays
    assert (run / run_lock.LOCK_NAME).exists()


HOLD = (
    "import sys, time; sys.path.insert(0, {root!r}); from hf_variants.training.run_lock import RunLock; "
    "RunLock({run!r}).acquire(); print('locked', flush=True); time.sleep(120)"
)


def test_lock_of_a_dead_process_is_taken_over(tmp_path, caplog):
    """A process holding the lock is SIGKILLed: the OS lock goes with it, its holder file stays (naming a dead PID
    on this host); the next launch takes the lock over with a warning naming that process. While it is alive, the
    same acquire is refused naming it."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(root=str(ROOT), run=str(run))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLockedError, match=rf"in use by another training run: host \S+, PID {holder.pid}, "):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()
    assert json.loads((run / HOLDER_NAME).read_text())["pid"] == holder.pid  # left behind by the killed process
    with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(run) as lock:
        assert lock.took_over["pid"] == holder.pid
        assert json.loads((run / HOLDER_NAME).read_text())["pid"] == os.getpid()
    assert (
        f"Taking over the lock of {run}: the run that held it is no longer running (PID {holder.pid} no longer "
        f"exists; it ended without releasing it): host " in caplog.text
    )
    assert not (run / HOLDER_NAME).exists()


def test_holder_file_checks(tmp_path, caplog):
    """When the OS lock is free but a holder file names another process: a live process on this host (a file system
    that does not enforce the lock) is refused; a reused PID or a restarted machine is taken over; on another host,
    a recent heartbeat is refused and an old one taken over."""
    run = tmp_path / "run"
    run.mkdir()
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = RunLock(run).acquire()
        me = dict(mine.holder)
        mine.release()

        def plant(**changes):
            (run / HOLDER_NAME).write_text(json.dumps({**me, **changes}))

        plant(pid=sleeper.pid, pid_start=run_lock._process_start_tick(sleeper.pid))
        with pytest.raises(RunLockedError, match=rf"PID {sleeper.pid}, .*its lock file is not locked"):
            RunLock(run).acquire()
        plant(pid=sleeper.pid, pid_start=run_lock._process_start_tick(sleeper.pid) + 1)  # PID reused since
        with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(run):
            pass
        assert f"PID {sleeper.pid} now belongs to another process" in caplog.text
        plant(pid=sleeper.pid, boot_id="another-boot")
        with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(run):
            pass
        assert "the machine has restarted since" in caplog.text
        plant(host="other-node", pid=sleeper.pid)  # fresh heartbeat on another host
        with pytest.raises(RunLockedError, match=r"host other-node, .*Its heartbeat is recent"):
            RunLock(run).acquire()
        old = time.time() - run_lock.STALE_AFTER_S - 60
        os.utime(run / HOLDER_NAME, (old, old))
        with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(run) as lock:
            assert lock.took_over["host"] == "other-node"
        assert "its heartbeat stopped 3.0 min ago" in caplog.text
    finally:
        sleeper.kill()
        sleeper.wait()


# HOLD loading run_lock.py alone (it needs only the standard library and filelock): a holder up in a second
HOLD_LIGHT = (
    "import importlib.util, time; spec = importlib.util.spec_from_file_location('run_lock', {path!r}); "
    "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); "
    "m.RunLock({run!r}).acquire(); print('locked', flush=True); time.sleep(120)"
)


def test_copied_folder_of_a_live_run_is_taken_over(tmp_path, caplog):
    """`cp -a` of a folder whose run is alive (its holder file names a live process on this host): the copy's holder
    file names the original folder's inode, so a launch into the copy takes the lock over with a message naming the
    copy, while the original stays refused."""
    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LIGHT.format(path=run_lock.__file__, run=str(run))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        copy = tmp_path / "copy"
        subprocess.run(["cp", "-a", str(run), str(copy)], check=True)
        copied = json.loads((copy / HOLDER_NAME).read_text())
        assert copied["pid"] == holder.pid and copied["folder"]["ino"] == os.stat(run).st_ino != os.stat(copy).st_ino
        with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(copy) as lock:
            assert lock.took_over["pid"] == holder.pid
            assert json.loads((copy / HOLDER_NAME).read_text())["folder"]["ino"] == os.stat(copy).st_ino
        assert f"Taking over the lock of {copy}: " in caplog.text
        assert (
            f"its holder file came with a copy of the folder: it names the folder with inode {os.stat(run).st_ino}"
            in (caplog.text)
        )
        with pytest.raises(RunLockedError, match=rf"PID {holder.pid}, "):
            RunLock(run).acquire()
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize(
    "content, why",
    [
        (b"\x00\xffgarbage{", "is not valid JSON"),
        (b"[1, 2, 3]", "holds a JSON list, not an object"),
        (b'{"pid": "12ab", "host": "%s"}', "names no valid PID ('12ab')"),
        (b'{"pid": 99999999999999999999999, "host": "%s"}', "names no valid PID (99999999999999999999999)"),
        (b'{"pid": -1, "host": "%s"}', "names no valid PID (-1)"),
        (b'{"pid": 0, "host": "%s"}', "names no valid PID (0)"),
        (b'{"pid": true, "host": "%s"}', "names no valid PID (True)"),
        (b'{"host": "%s", "pid": 1, "pid_start": "x", "command": "' + b"c" * 70000 + b'"}', "bytes (a holder file"),
    ],
    ids=["garbage", "list", "pid-text", "pid-huge", "pid-negative", "pid-zero", "pid-bool", "huge-file"],
)
def test_holder_file_of_any_shape_is_read_without_a_traceback(tmp_path, caplog, content, why):
    """A holder file of any shape (the OS lock being free) is taken over with a warning saying what is wrong with
    it; PID 0, -1 (process groups for os.kill) and a PID past any pid_max never count as a live holder."""
    import socket

    run = tmp_path / "run"
    run.mkdir()
    (run / HOLDER_NAME).write_bytes(content.replace(b"%s", socket.gethostname().encode()))
    with caplog.at_level(logging.WARNING, logger="hf_variants.training.run_lock"), RunLock(run) as lock:
        assert json.loads((run / HOLDER_NAME).read_text())["pid"] == os.getpid() == lock.holder["pid"]
    assert f"Taking over the lock of {run}" in caplog.text and why in caplog.text, caplog.text
