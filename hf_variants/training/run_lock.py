"""One training run per run folder: the main process holds a lock on `run_dir/.run.lock` for the whole run.

How it works:

- The lock is an OS lock (`filelock.FileLock`: `fcntl.flock` on Linux/macOS) on `run_dir/.run.lock`. The kernel
  (or the file server) releases it when the holding process exits, however it exits (SIGKILL, OOM kill, crash).
  The lock file itself is never deleted: every launcher must lock the same inode.
- Next to it, `run_dir/.run.lock.json` names the holder: host, PID, boot id, the process's start time (the PID's
  `/proc` start tick on Linux, so a reused PID is recognised), the run's start time and command line, a random run
  id (also kept in memory) and the identity of the folder it locks (the run folder's inode and device). It is
  written atomically after the lock is taken and removed before the lock is released; while the run lives a
  background thread refreshes its modification time every `HEARTBEAT_S` seconds.
- The holder file is untrusted input: it is read only when it is a regular file of at most `MAX_HOLDER_BYTES`, and
  a file of any other shape (not JSON, not an object, a PID that is not a positive integer up to `MAX_PID`)
  counts as "no live holder named" instead of raising.
- A second launch whose `flock` fails is refused with a `RunLockedError` naming the holder from that file.
- A launch that gets the lock but finds a holder file from another process decides whether that process is gone
  (it ended without removing the file, e.g. killed):
    * same host (same host name and boot id): gone when its PID no longer exists or now belongs to a process
      started at another time; a live holder means the file system did not enforce the lock: refused.
    * same host name, other boot id: the machine restarted since, so the holder is gone.
    * another host (a shared file system): its PID cannot be checked. It is taken as gone when its heartbeat is
      older than `STALE_AFTER_S` seconds, measured against the file system's own clock (the lock file's
      modification time, touched just before), so the hosts' clocks need not agree; otherwise refused, with the
      heartbeat's age. This also covers file systems where `flock` is local to each client (e.g. Lustre mounted
      with `localflock`): two hosts cannot run at once as long as the holder's heartbeat runs.
    * a holder file that names another folder (its recorded inode, and on the same host its device, differ from
      the run folder's) was copied with the folder (`cp -a`, rsync of a live run): the run it names locks the
      original folder, not this copy, so it is taken over.
  A gone holder's lock is taken over with a warning naming it.
- File systems without `flock` at all make `filelock` fall back to its own soft lock; the holder file checks above
  still apply.

Multi-process and multi-node runs: only the global main process (rank 0) takes the lock; `lock_run` tells every
other process whether it did (a broadcast), so when the main process refuses, every process raises instead of
waiting for it in a collective.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shlex
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import filelock

logger = logging.getLogger(__name__)

LOCK_NAME = ".run.lock"
HOLDER_NAME = ".run.lock.json"
LOCK_FILES = (LOCK_NAME, HOLDER_NAME)
HEARTBEAT_S = 30.0
STALE_AFTER_S = 120.0
MAX_HOLDER_BYTES = 64 * 1024  # a holder file is a few hundred bytes
MAX_PID = 1 << 22  # Linux's largest pid_max (PID_MAX_LIMIT)


class RunLockedError(RuntimeError):
    """The run folder is in use by another training run."""


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def _process_start_tick(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux `/proc/PID/stat` field 22), None elsewhere or
    when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[19])  # fields after "(comm)": state is field 3


def _pid_exists(pid: int) -> bool:
    """Whether process `pid` (a positive integer: `os.kill` of 0 or a negative number would probe a process group)
    exists."""
    if not _valid_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user
        return True
    except (OverflowError, OSError):
        return False
    return True


def _valid_pid(pid) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= MAX_PID


def folder_identity(path: str | os.PathLike) -> dict | None:
    """The run folder's inode and device (a copy of the folder has other ones), None when it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"ino": st.st_ino, "dev": st.st_dev}


def describe(holder: dict | None) -> str:
    """`host H, PID P, started 2026-11-26 00:40:12 UTC (2.5 min ago), command: ...`"""
    if not holder:
        return "an unknown process (the lock has no readable holder file)"
    started = holder.get("started")
    try:
        ago = time.time() - float(started)
        when = (
            f"{datetime.datetime.fromtimestamp(float(started), datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC "
            f"({_duration(ago)} ago)"
        )
    except (TypeError, ValueError, OverflowError, OSError):
        when = "at an unknown time"
    return (
        f"host {_short(holder.get('host', '?'))}, PID {_short(holder.get('pid', '?'))}, started {when}, command: "
        f"{_short(holder.get('command', '?'), 300)}"
    )


def _short(value, limit: int = 80) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.1f} min"
    return f"{seconds / 3600:.1f} h"


class RunLock:
    """The lock of one run folder (see the module docstring). `acquire()` raises `RunLockedError` naming the
    holder; `release()` (also called at interpreter exit) removes the holder file and releases the lock."""

    def __init__(self, run_dir: str | os.PathLike):
        self.run_dir = Path(run_dir)
        self.lock_path = self.run_dir / LOCK_NAME
        self.holder_path = self.run_dir / HOLDER_NAME
        self._lock: filelock.BaseFileLock | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.holder: dict | None = None
        self.took_over: dict | None = None  # the gone holder whose lock was taken over
        self.unreadable: str | None = None  # why the holder file last read could not be used

    # ------------------------------------------------------------------------------------------- holder file
    def _read_holder(self) -> dict | None:
        """The holder file's object; None when there is none or it is unusable (`self.unreadable` says why): not
        a regular file, larger than `MAX_HOLDER_BYTES`, not a JSON object."""
        import stat

        self.unreadable = None
        try:
            st = os.lstat(self.holder_path)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            self.unreadable = f"{self.holder_path} is not a regular file"
            return None
        if st.st_size > MAX_HOLDER_BYTES:
            self.unreadable = f"{self.holder_path} is {st.st_size} bytes (a holder file is under {MAX_HOLDER_BYTES})"
            return None
        try:
            with open(self.holder_path, "rb") as f:
                holder = json.loads(f.read(MAX_HOLDER_BYTES + 1).decode("utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError, RecursionError) as err:
            self.unreadable = f"{self.holder_path} is not valid JSON ({type(err).__name__})"
            return None
        if not isinstance(holder, dict):
            self.unreadable = f"{self.holder_path} holds a JSON {type(holder).__name__}, not an object"
            return None
        return holder

    def _write_holder(self) -> None:
        tmp = self.holder_path.with_name(f".{HOLDER_NAME}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.holder, indent=1), encoding="utf-8")
        os.replace(tmp, self.holder_path)

    def _is_us(self, holder: dict) -> bool:
        return holder.get("run_id") == self.holder["run_id"] and (
            holder.get("host") == self.holder["host"]
            and holder.get("boot_id") == self.holder["boot_id"]
            and holder.get("pid") == self.holder["pid"]
            and holder.get("pid_start") == self.holder["pid_start"]
        )

    def _copied(self, holder: dict) -> str | None:
        """Why `holder` describes the lock of another folder (the file came with a copy of it), or None."""
        recorded, current = holder.get("folder"), self.holder.get("folder")
        if not isinstance(recorded, dict) or current is None:
            return None  # written before folders were recorded, or unreadable: the other checks decide
        same_host = holder.get("host") == self.holder["host"]
        # the inode number is the file server's on a shared file system; the device number is each client's own
        keys = ("ino", "dev") if same_host else ("ino",)
        if all(recorded.get(k) == current[k] for k in keys):
            return None
        device = f" on device {_short(recorded.get('dev'))}" if same_host else ""
        return (
            f"its holder file came with a copy of the folder: it names the folder with inode "
            f"{_short(recorded.get('ino'))}{device}, this one is inode {current['ino']} on device {current['dev']}"
        )

    def _gone(self, holder: dict) -> str | None:
        """Why the process named by `holder` is no longer running (or holds another folder's lock), or None when it
        is (or may be)."""
        copied = self._copied(holder)
        if copied:
            return copied
        pid = holder.get("pid")
        if holder.get("host") == self.holder["host"]:
            if holder.get("boot_id") and self.holder["boot_id"] and holder["boot_id"] != self.holder["boot_id"]:
                return "the machine has restarted since"
            if not _valid_pid(pid):
                return f"its holder file names no valid PID ({_short(repr(pid))})"
            if not _pid_exists(pid):
                return f"PID {pid} no longer exists"
            tick = _process_start_tick(pid)
            start = holder.get("pid_start")
            if tick is not None and start is not None and tick != start:
                return f"PID {pid} now belongs to another process"
            return None
        # another host: its PID cannot be checked; its heartbeat is compared with the file system's clock
        try:
            os.utime(self.lock_path)
            age = self.lock_path.stat().st_mtime - self.holder_path.stat().st_mtime
        except OSError:
            return None
        if age > STALE_AFTER_S:
            return f"its heartbeat stopped {_duration(age)} ago (it is refreshed every {HEARTBEAT_S:.0f} s)"
        return None

    # ---------------------------------------------------------------------------------------------- acquire
    def acquire(self) -> RunLock:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.holder = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "boot_id": _boot_id(),
            "pid_start": _process_start_tick(os.getpid()),
            "started": time.time(),
            "command": shlex.join([sys.executable, *sys.argv]),
            "run_id": uuid.uuid4().hex,
            "folder": folder_identity(self.run_dir),
        }
        lock = filelock.FileLock(str(self.lock_path), thread_local=False)
        try:
            lock.acquire(timeout=0)
        except filelock.Timeout:
            holder = None
            for _ in range(40):  # the holder writes its file just after taking the lock
                holder = self._read_holder()
                if holder is not None:
                    break
                time.sleep(0.05)
            extra = ""
            if holder and holder.get("host") == self.holder["host"] and self._gone(holder):
                extra = (
                    f" That process ({self._gone(holder)}) is gone, but the lock is still held by a process "
                    f"that inherited it (find it with `fuser -v {self.lock_path}`)."
                )
            raise RunLockedError(
                f"{self.run_dir} is in use by another training run: {describe(holder)}.{extra} "
                f"Wait for it to finish, stop it, or train into another --output_dir."
            ) from None
        try:
            previous = self._read_holder()
            if previous is None and self.unreadable:
                logger.warning(
                    "Taking over the lock of %s: its holder file cannot be used (%s); the lock itself was free.",
                    self.run_dir,
                    self.unreadable,
                )
            if previous is not None and not self._is_us(previous):
                reason = self._gone(previous)
                if reason is None:
                    age = ""
                    if previous.get("host") != self.holder["host"]:
                        age = (
                            f" Its heartbeat is recent; if that run has ended, launch again after "
                            f"{STALE_AFTER_S:.0f} s, or delete {self.holder_path}."
                        )
                    raise RunLockedError(
                        f"{self.run_dir} is in use by another training run: {describe(previous)} (its lock file is "
                        f"not locked: a file system without working locks across processes or hosts?).{age} "
                        f"Wait for it to finish, stop it, or train into another --output_dir."
                    )
                logger.warning(
                    "Taking over the lock of %s: the run that held it is no longer running (%s; it "
                    "ended without releasing it): %s",
                    self.run_dir,
                    reason,
                    describe(previous),
                )
                self.took_over = previous
            self._write_holder()
        except BaseException:
            lock.release()
            raise
        self._lock = lock
        self._stop.clear()
        self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()
        import atexit

        atexit.register(self.release)
        return self

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.holder_path)
            except FileNotFoundError:
                try:
                    self._write_holder()
                except OSError:
                    pass
            except OSError:
                pass

    @property
    def is_held(self) -> bool:
        return self._lock is not None

    def release(self) -> None:
        if self._lock is None:
            return
        import atexit

        atexit.unregister(self.release)
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        try:
            current = self._read_holder()
            if current is not None and self._is_us(current):
                self.holder_path.unlink()
        except OSError:
            pass
        finally:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def clear_run_dir(run_dir: str | os.PathLike) -> None:
    """Remove everything in `run_dir` but its lock (--overwrite_output_dir while holding it)."""
    import shutil

    for path in Path(run_dir).iterdir():
        if path.name in LOCK_FILES:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()


def lock_run(accelerator, run_dir: str | os.PathLike, then=None) -> RunLock | None:
    """Take the run folder's lock on the global main process, then run `then()` there (e.g. clearing the folder for
    --overwrite_output_dir), and make every process agree: when the main process fails (the folder is locked by
    another run, or `then` raised), every process raises, the others a `RunLockedError` (or `RuntimeError`) with
    the main process's message, instead of waiting for it in a collective. Returns the lock on the main process
    (release it when the run ends; it is also released at exit), None on the others."""
    lock, error = None, None
    if accelerator.is_main_process:
        try:
            lock = RunLock(run_dir).acquire()
            if then is not None:
                then()
        except Exception as err:  # noqa: BLE001 - re-raised below, after telling the other processes
            error = err
            if lock is not None:
                lock.release()
                lock = None
    if accelerator.num_processes > 1:
        from accelerate.utils import broadcast_object_list

        box = [None if error is None else (type(error).__name__, str(error))]
        broadcast_object_list(box, from_process=0)
        if error is None and box[0] is not None:
            name, message = box[0]
            cls = RunLockedError if name == RunLockedError.__name__ else RuntimeError
            raise cls(message if cls is RunLockedError else f"The main process stopped the run ({name}: {message})")
    if error is not None:
        raise error
    return lock
