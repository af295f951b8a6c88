"""Sharded, resumable runs of the translate and score commands: work units in a work folder, shared by the
processes of an Accelerate launch, by the tasks of a job array, and by the reruns of an interrupted job.

    accelerate launch --multi_gpu --num_processes 2 -m hf_variants.commands.translate --model M --input a.fr ...
    hf-variants-translate --model M --input a.fr --output a.en --unit_lines 10000      # one process, resumable
    hf-variants-translate ... --num_shards 8 --shard_index $SLURM_ARRAY_TASK_ID         # job arrays, no launcher
    hf-variants-translate ... --num_shards 8 --merge                                    # then: the output

**Units.** The input's lines are cut into work units of `--unit_lines` lines: unit u holds lines u*U+1 to (u+1)*U
(1-based). Shard s of `--num_shards N` owns the units u with u mod N = s (without shards: every unit). The processes
of a launch (`accelerate launch`, torchrun: their RANK and WORLD_SIZE) take the owned units that are not done yet in
turn (`todo[rank::world]`, after the main process listed them). Each process reads the input once, front to back,
parsing only its units' lines, and holds at most one unit's buffer of results: memory does not grow with the input.

**The work folder** (`--work_dir`, default `OUTPUT.work` beside the output; on a shared file system for several
machines) holds `manifest.json` (what the job is: `Manifest`), and per finished unit `unit_NNNNNN.part` (its output
lines) and `unit_NNNNNN.json` (its record: the input lines it covers, its output lines, bytes and SHA-256, the
command's counts, the process and the seconds it took). Both are written to temporary names, flushed to disk and
renamed, the record after the part: a unit is done when its record exists and its part has the recorded size and
SHA-256 (checked at every start and at the merge). A process killed at any moment leaves complete units and at most
temporary files, which the merge removes.

**A rerun** of the same command (after SIGTERM, Ctrl-C, SIGKILL, a lost machine) compares the manifest with the job
it is asked to do: the input's size and SHA-256, the aligned files', the model folder's files' SHA-256 (weights,
config, tokenizer), the engine, the precision, the weights, the output format and every decoding setting (the
batching flags are recorded, not compared: like the thread count, they can change the last digits of scores, and
with ONNX Runtime int8, which quantizes activations per batch, tokens). A difference is refused naming what changed,
then and now; `--allow_changed` keeps the finished units anyway and records the change in the manifest's
`overrides` (the unit size and the output format cannot change). Otherwise it says how many units it kept and
translates only the others.

**Signals.** SIGTERM (and SIGUSR1, what SLURM sends before a preemption) and SIGINT (Ctrl-C) stop a process at the
next batch boundary: the unit in progress is dropped (its temporary file removed), every finished unit stays, and the
process exits with 143 (130 after Ctrl-C) and one line saying how to resume. Under a launcher the other processes
get the signal too (torchrun passes it on, and stops the others when one fails).

**The merge.** When every unit of the job is done, the main process checks each part against its record while it
copies the parts, in order, into a temporary file beside `--output`, renamed over it at the end (streaming, atomic);
the work folder is then removed unless `--keep_work_dir`. Missing or inconsistent units are named and nothing is
written. With shards (job arrays) no shard merges: `--merge` (the same flags, no model loaded) does, once every
shard is done. The output is byte-identical to a one-process run of the command without these flags.
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..training.corpus import DataError
from .common import UsageError

logger = logging.getLogger("hf_variants.sharding")

DEFAULT_UNIT_LINES = 10_000
MANIFEST = "manifest.json"
FORMAT = 1
WORK_SUFFIX = ".work"
POLL_SECONDS = 0.5
LAUNCH_TIMEOUT = datetime.timedelta(hours=6)  # the main process hashes the input and the model before the others go
EXIT_SIGNALS = {"SIGTERM": 143, "SIGUSR1": 143, "SIGINT": 130}
# what `--allow_changed` cannot keep: the units would not fit together
FIXED = ("command", "unit_lines", "settings.output_format")


# --------------------------------------------------------------------------------------------------- flags
def add_sharding_flags(parser, what: str = "translation") -> None:
    """--unit_lines, --work_dir, --keep_work_dir, --num_shards, --shard_index, --merge, --allow_changed."""
    from ..outputs import int_in_range

    g = parser.add_argument_group(
        "several processes, shards and resuming (file input and output; see hf_variants/commands/sharding.py)"
    )
    g.add_argument(
        "--unit_lines",
        type=int_in_range(1),
        help=f"input lines per work unit, a multiple of --buffer_size (default: the work folder's, else "
        f"{DEFAULT_UNIT_LINES:,} rounded up to whole buffers): each finished unit is kept in --work_dir, and a "
        "rerun of the same command does only the others",
    )
    g.add_argument("--work_dir", help="the work folder (default: OUTPUT.work beside --output)")
    g.add_argument("--keep_work_dir", action="store_true", help="keep the work folder after the merge")
    g.add_argument(
        "--num_shards",
        type=int_in_range(1),
        default=1,
        help="job arrays without a launcher: the units are split into N shards, shard i owning the units u with "
        "u mod N = i; each task runs with its --shard_index, then --merge writes the output",
    )
    g.add_argument("--shard_index", type=int_in_range(0), help="this task's shard (0 to --num_shards - 1)")
    g.add_argument(
        "--merge",
        action="store_true",
        help=f"check that every unit of the work folder is done and write --output (no model loaded, no {what})",
    )
    g.add_argument(
        "--allow_changed",
        action="store_true",
        help="keep the finished units of a work folder made with another input, model or setting (the change is "
        "recorded in its manifest); without it such a rerun is refused, naming what changed",
    )


def launched_processes() -> int:
    """The processes of this launch (Accelerate's and torchrun's WORLD_SIZE; 1 without a launcher)."""
    try:
        return max(1, int(os.environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


def default_work_dir(output: str) -> Path:
    path = Path(output)
    return path.with_name(path.name + WORK_SUFFIX)


def wanted(args) -> bool:
    """Whether the command runs as a sharded, resumable job: a flag asks for it, several processes were launched, or
    the default work folder of --output holds an earlier run's manifest (a resumed job)."""
    asked = (
        args.unit_lines is not None
        or args.work_dir is not None
        or args.num_shards > 1
        or args.shard_index is not None
        or args.merge
        or args.keep_work_dir
        or args.allow_changed
    )
    if asked or launched_processes() > 1:
        return True
    return args.output != "-" and (default_work_dir(args.output) / MANIFEST).is_file()


def check_flags(args, input_flags: dict[str, str | None]) -> None:
    """The sharding flags on their own and against the input, the output and the buffers (a UsageError naming the
    flag)."""
    stdio = [flag for flag, value in input_flags.items() if value == "-"]
    if stdio or args.output == "-":
        flag = stdio[0] if stdio else "--output"
        raise UsageError(
            f"{flag} -: sharded and resumable runs read and write files (the input's size and hash are recorded, "
            "the output is merged from its units); give a file"
        )
    if args.num_shards > 1 and args.shard_index is None and not args.merge:
        raise UsageError(
            f"--num_shards {args.num_shards}: give this task's --shard_index (0 to {args.num_shards - 1})"
        )
    if args.shard_index is not None and args.shard_index >= args.num_shards:
        raise UsageError(f"--shard_index {args.shard_index}: expected 0 to {args.num_shards - 1} (--num_shards)")
    if args.merge and args.shard_index is not None:
        raise UsageError("--merge writes the output of every shard: drop --shard_index")
    check_unit_lines(args)


def work_dir_of(args) -> Path:
    return Path(args.work_dir) if args.work_dir else default_work_dir(args.output)


def unit_lines_of(args) -> int:
    """--unit_lines, else the work folder's (a rerun need not repeat it), else `DEFAULT_UNIT_LINES` rounded up to a
    whole number of --buffer_size buffers."""
    if args.unit_lines is not None:
        return args.unit_lines
    with contextlib.suppress(DataError):
        manifest = WorkFolder(work_dir_of(args)).manifest()
        if manifest and isinstance(manifest.get("unit_lines"), int) and manifest["unit_lines"] > 0:
            return manifest["unit_lines"]
    return -(-DEFAULT_UNIT_LINES // args.buffer_size) * args.buffer_size


def check_unit_lines(args) -> None:
    """A unit holds whole buffers of --buffer_size lines: a sentence is then batched with the same sentences as in a
    one-process run (whose buffers start every --buffer_size lines), so even its scores, whose last digits depend on
    the batch, are the same (a UsageError otherwise)."""
    unit = unit_lines_of(args)
    if unit % args.buffer_size:
        lower = max(args.buffer_size, unit // args.buffer_size * args.buffer_size)
        raise UsageError(
            f"--unit_lines {unit} is not a multiple of --buffer_size {args.buffer_size}: a unit holds whole buffers, "
            f"so that every sentence is batched as in a one-process run (pass --unit_lines {lower}, or a "
            "--buffer_size dividing it)"
        )


def check_work_dir(args, inputs: dict) -> None:
    """The work folder is no input and holds none, and neither holds nor is the output or the results file (the
    merge removes it): an `OutputPathError` naming the flags."""
    from ..outputs import OutputPathError, check_not_an_input

    folder = work_dir_of(args)
    outputs = {"--output": args.output, "--results_json": getattr(args, "results_json", None)}
    check_not_an_input(folder, {**inputs, **outputs}, output_flag="--work_dir")
    for flag, path in outputs.items():  # an output not written yet, inside the folder the merge removes
        if path is not None and Path(path).resolve().is_relative_to(folder.resolve()):
            raise OutputPathError(f"{flag} {path} lies inside --work_dir {folder}, which is removed after the merge.")
    if folder.exists() and not folder.is_dir():
        raise OutputPathError(f"--work_dir {folder}: a file, not a folder.")


# -------------------------------------------------------------------------------------------------- hashing
def file_record(path: str | os.PathLike, **extra) -> dict:
    """{"path", "bytes", "sha256", **extra} of a file, read in blocks."""
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            size += len(block)
    return {"path": os.path.abspath(path), "bytes": size, "sha256": digest.hexdigest(), **extra}


def folder_digest(folders: Iterable[str | os.PathLike]) -> dict:
    """{"sha256", "files", "bytes"} of every regular file under `folders` (names, sizes and contents, in sorted
    order; temporary files of an atomic write left out): a model folder's weights, config and tokenizer."""
    digest, files, size = hashlib.sha256(), 0, 0
    for folder in dict.fromkeys(os.fspath(f) for f in folders if f is not None):
        root = Path(folder)
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            if ".tmp-" in path.name:
                continue
            name = path.name if path == root else path.relative_to(root).as_posix()
            record = file_record(path)
            digest.update(f"{name}\0{record['bytes']}\0{record['sha256']}\n".encode())
            files += 1
            size += record["bytes"]
    return {"sha256": digest.hexdigest(), "files": files, "bytes": size}


def model_files(location) -> list[str]:
    """The folders whose files make a model (`loading.ModelLocation`): its folder (a checkpoint's run config folder
    too) and a separate tokenizer folder; for a Hub id its cached snapshot, where there is one."""
    if location.kind == "hub":
        try:
            from huggingface_hub import snapshot_download

            return [snapshot_download(location.path, local_files_only=True)]
        except Exception:  # noqa: BLE001 - not cached: the id alone is recorded
            return []
    return [p for p in (location.path, location.config_dir, location.tokenizer) if p]


def model_manifest(location) -> dict:
    """The model part of a manifest: where it is, its engine, precision and weights, and its files' digest."""
    return {
        "path": location.path,
        "kind": location.kind,
        "engine": location.engine,
        "precision": location.precision,
        "weights": location.weights,
        "files": folder_digest(model_files(location)),
    }


# --------------------------------------------------------------------------------------------------- launch
@dataclass
class Launch:
    """This process in its launch: `rank` of `world` processes (`local_rank` on its machine); `state`:
    Accelerate's `PartialState` when several processes were launched (its device: Accelerate's placement)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    state: object = None

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def device(self):
        return getattr(self.state, "device", None)

    def share(self, value):
        """The main process' `value`, in every process."""
        if self.world == 1:
            return value
        from accelerate.utils import broadcast_object_list

        box = [value]
        broadcast_object_list(box, from_process=0)
        return box[0]


def join_launch() -> Launch:
    """This process' `Launch`: Accelerate's process group when several processes were launched (gloo on CPUs,
    NCCL on GPUs), else a launch of one."""
    if launched_processes() == 1:
        return Launch()
    import torch
    from accelerate import PartialState

    state = PartialState(cpu=not torch.cuda.is_available(), timeout=LAUNCH_TIMEOUT)
    return Launch(state.process_index, state.num_processes, state.local_process_index, state)


# -------------------------------------------------------------------------------------------------- signals
class Stopped(Exception):
    """A stop signal arrived: the unit in progress is dropped."""

    def __init__(self, name: str):
        super().__init__(name)
        self.name = name
        self.exit_code = EXIT_SIGNALS.get(name, 143)


class StopSignals:
    """SIGTERM, SIGUSR1 and SIGINT set a flag (`check()` raises `Stopped` at the next batch boundary) instead of
    ending the process; a second Ctrl-C stops it at once. SIGINT is left alone where it was ignored (nohup, &)."""

    def __init__(self):
        self.received: str | None = None
        self.previous: dict = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for name in EXIT_SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and not (name == "SIGINT" and signal.getsignal(sig) == signal.SIG_IGN):
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.received == "SIGINT" and name == "SIGINT":
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.received is None:
            os.write(2, f"{name} received: dropping the unit in progress at the next batch, then stopping\n".encode())
        self.received = self.received or name

    def check(self) -> None:
        if self.received is not None:
            raise Stopped(self.received)


# -------------------------------------------------------------------------------------------------- manifest
def _flatten(value, prefix: str = "") -> dict:
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
        return out
    return {prefix: value}


def compared(manifest: dict) -> dict:
    """The fields of a manifest that define the job (paths, times and overrides left out)."""
    flat = _flatten({k: v for k, v in manifest.items() if k not in ("format", "overrides", "created", "units")})
    return {k: v for k, v in flat.items() if not k.endswith(".path") and not k.startswith("informational")}


@dataclass
class Change:
    field: str
    then: object
    now: object

    @property
    def fixed(self) -> bool:
        return self.field in FIXED

    def describe(self, manifest: dict) -> str:
        """`--input data/mono.fr (sha256): sha256 3f2a… then, sha256 9c1e… now`: the flag, file or setting the field
        stands for (the paths of `manifest`, the new job's), its value then and now."""
        parts = self.field.split(".")
        if parts[0] == "inputs" and len(parts) > 2:
            path = manifest.get("inputs", {}).get(parts[1], {}).get("path")
            subject = f"{parts[1]} {path} ({parts[-1]})"
        elif parts[0] == "model" and parts[1] == "files":
            subject = f"the model's files ({manifest.get('model', {}).get('path')}: {parts[-1]})"
        elif parts[0] in ("model", "settings") or parts[0] == "unit_lines":
            subject = f"--{parts[-1]}"
        else:
            subject = self.field
        return f"{subject}: {_short(self.then)} then, {_short(self.now)} now"


def _short(value) -> str:
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return f"sha256 {value[:12]}…"
    return json.dumps(value)


def manifest_changes(old: dict, new: dict) -> list[Change]:
    a, b = compared(old), compared(new)
    return [Change(key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]


# ----------------------------------------------------------------------------------------------- work folder
def unit_name(unit: int) -> str:
    return f"unit_{unit:06d}"


class UnitWriter:
    """A unit's output lines, written to a temporary file as they come (hashed and counted); `commit(fields)`
    flushes it to disk, renames it to the unit's part and writes its record (`fields` with the part's lines, bytes
    and SHA-256) beside it the same way."""

    def __init__(self, folder: Path, unit: int):
        self.folder, self.unit = folder, unit
        self.tmp = folder / f".{unit_name(unit)}.part.tmp-{uuid.uuid4().hex[:8]}"
        self.file = open(self.tmp, "wb")  # noqa: SIM115 - closed by commit() or discard()
        self.digest, self.lines, self.bytes = hashlib.sha256(), 0, 0

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        self.file.write(data)
        self.digest.update(data)
        self.lines += 1
        self.bytes += len(data)

    def commit(self, fields: dict) -> dict:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.replace(self.tmp, self.folder / f"{unit_name(self.unit)}.part")
        record = {"unit": self.unit, **fields, "lines": self.lines, "bytes": self.bytes}
        record["sha256"] = self.digest.hexdigest()
        write_durably(self.folder / f"{unit_name(self.unit)}.json", json.dumps(record, indent=1) + "\n")
        return record

    def discard(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            self.tmp.unlink()


def write_durably(path: Path, text: str) -> None:
    """`text` written through a temporary sibling, flushed to disk and renamed over `path`."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            f.write(text.encode("utf-8"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


class WorkFolder:
    """The work folder of a job (see the module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def manifest(self) -> dict | None:
        path = self.path / MANIFEST
        if not path.is_file():
            return None
        try:
            manifest = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise DataError(f"{path}: not a readable work folder manifest ({error}).") from None
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise DataError(f"{path}: not a work folder manifest of this version (format {FORMAT}).")
        return manifest

    def write_manifest(self, manifest: dict) -> None:
        self.path.mkdir(parents=True, exist_ok=True)
        write_durably(self.path / MANIFEST, json.dumps(manifest, indent=1) + "\n")

    def record(self, unit: int) -> dict | None:
        path = self.path / f"{unit_name(unit)}.json"
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) and record.get("unit") == unit else None

    def problem(self, unit: int, expected_input_lines: int, deep: bool = True) -> str | None:
        """Why unit `unit` is not done (None: it is): no record, no part, a part unlike its record."""
        record = self.record(unit)
        if record is None:
            return "missing"
        if record.get("input_lines") != expected_input_lines:
            return f"its record covers {record.get('input_lines')} input lines, not {expected_input_lines}"
        part = self.path / f"{unit_name(unit)}.part"
        if not part.is_file():
            return "its record is there but not its part"
        if part.stat().st_size != record.get("bytes"):
            return f"its part has {part.stat().st_size} bytes, its record says {record.get('bytes')}"
        if deep and file_record(part)["sha256"] != record.get("sha256"):
            return "its part's SHA-256 differs from its record's"
        return None

    def writer(self, unit: int) -> UnitWriter:
        return UnitWriter(self.path, unit)

    def remove_temporary(self) -> None:
        for path in self.path.glob(".*.tmp-*"):
            with contextlib.suppress(OSError):
                path.unlink()


# ------------------------------------------------------------------------------------------------------- job
@dataclass
class Job:
    """A command's sharded job: `command` (its name), `output`, the work folder, the input's `lines`, `unit_lines`,
    the shards and the merged output's first line (`header`, or None)."""

    command: str
    output: str
    work_dir: Path
    lines: int
    unit_lines: int
    num_shards: int = 1
    shard_index: int | None = None
    header: str | None = None
    keep_work_dir: bool = False
    allow_changed: bool = False

    @classmethod
    def from_args(cls, args, command: str, lines: int, header: str | None = None) -> Job:
        """The job of a command's parsed sharding flags (`add_sharding_flags`: --output, --work_dir, --unit_lines,
        --num_shards, --shard_index, --keep_work_dir, --allow_changed) over an input of `lines` lines."""
        return cls(
            command=command,
            output=args.output,
            work_dir=work_dir_of(args),
            lines=lines,
            unit_lines=unit_lines_of(args),
            num_shards=args.num_shards,
            shard_index=args.shard_index,
            header=header,
            keep_work_dir=args.keep_work_dir,
            allow_changed=args.allow_changed,
        )

    @property
    def units(self) -> int:
        return -(-self.lines // self.unit_lines)

    def unit_range(self, unit: int) -> range:
        return range(unit * self.unit_lines, min(self.lines, (unit + 1) * self.unit_lines))

    def owned(self) -> list[int]:
        """The units of this shard (every unit without shards, and for the merge)."""
        if self.shard_index is None:
            return list(range(self.units))
        return [u for u in range(self.units) if u % self.num_shards == self.shard_index]


def start(job: Job, launch: Launch, manifest: Callable[[], dict], merge: bool = False) -> dict:
    """The main process checks the work folder against `manifest()` (see the module docstring), records it and lists
    the units of this shard that are done; every process gets {"todo", "kept", "run", "units"} (a refusal is raised
    in the main process and ends the others with status 2). `merge`: the folder must exist already."""
    plan: dict = {}
    if launch.main:
        try:
            if merge and WorkFolder(job.work_dir).manifest() is None:
                raise DataError(f"{job.work_dir}: no work folder here (no {MANIFEST}): nothing to merge.")
            plan = _main_start(job, manifest())
        except BaseException as error:  # the others must not wait for a plan that never comes
            launch.share({"error": str(error)})
            raise
    plan = launch.share(plan)
    if "error" in plan:
        raise SystemExit(2)  # the main process says why
    return plan


def _main_start(job: Job, manifest: dict) -> dict:
    folder = WorkFolder(job.work_dir)
    old = folder.manifest()
    manifest = dict(manifest, format=FORMAT, unit_lines=job.unit_lines, units=job.units)
    if old is None:
        manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        folder.write_manifest(manifest)
    else:
        changes = manifest_changes(old, manifest)
        if changes:
            manifest = _overridden(job, folder, old, manifest, changes)
    owned = job.owned()
    done = [u for u in owned if folder.problem(u, len(job.unit_range(u))) is None]
    todo = [u for u in owned if u not in set(done)]
    if done:
        logger.info(
            "%s: %d of the %d units%s were done before and are kept; %d to do",
            job.work_dir,
            len(done),
            len(owned),
            f" of shard {job.shard_index}" if job.shard_index is not None else "",
            len(todo),
        )
    return {"todo": todo, "kept": len(done), "run": uuid.uuid4().hex[:12], "units": job.units}


def _overridden(job: Job, folder: WorkFolder, old: dict, manifest: dict, changes: list[Change]) -> dict:
    said = "; ".join(c.describe(manifest) for c in changes)
    done = sum(1 for u in range(job.units) if folder.record(u) is not None)
    fixed = [c for c in changes if c.fixed]
    if fixed or not job.allow_changed:
        how = (
            f"Remove {job.work_dir} to start over, or give another --work_dir"
            if fixed
            else f"Remove {job.work_dir} to start over, or pass --allow_changed to keep its {done} finished units "
            "(recorded in its manifest)"
        )
        raise DataError(f"{job.work_dir} holds the units of another job: {said}. {how}.")
    logger.warning("%s: kept although %s (--allow_changed: recorded in its manifest)", job.work_dir, said)
    manifest["created"] = old.get("created")
    manifest["overrides"] = [
        *old.get("overrides", []),
        {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "changes": [c.__dict__ for c in changes]},
    ]
    folder.write_manifest(manifest)
    return manifest


def run_units(
    job: Job,
    launch: Launch,
    plan: dict,
    do_unit: Callable[[int, UnitWriter, Callable[[], None]], dict],
    stop: StopSignals,
) -> list[int]:
    """This process' share of the units to do (`todo[rank::world]`): for each, `do_unit(unit, writer, check)` writes
    its output lines with `writer.write` (calling `check()` at its batch boundaries: a stop signal raises
    `Stopped` there) and returns its counts; the unit is then committed. Returns the units done."""
    folder = WorkFolder(job.work_dir)
    done = []
    for unit in plan["todo"][launch.rank :: launch.world]:
        stop.check()
        start_time = time.time()
        extra = {
            "first_line": job.unit_range(unit).start + 1,
            "input_lines": len(job.unit_range(unit)),
            "run": plan["run"],
            "process": launch.rank,
            "host": socket.gethostname(),
        }
        writer = folder.writer(unit)
        try:
            counts = do_unit(unit, writer, stop.check)
        except BaseException:
            writer.discard()
            raise
        writer.commit(dict(extra, counts=counts, seconds=round(time.time() - start_time, 3)))
        done.append(unit)
    return done


def drive(
    job: Job,
    launch: Launch,
    manifest: Callable[[], dict],
    prog: str,
    worker: Callable[[list[int]], contextlib.AbstractContextManager],
    merge_only: bool = False,
) -> dict | None:
    """A process' part of a job: `start`, then its share of the units to do (`worker(units)` is a context manager
    giving the `do_unit` of `run_units`: the model loaded, the input opened), then in the main process the wait for
    the others' units. Returns the start state in the main process when the output is to be merged (None in the
    other processes and in a shard). A stop signal ends the process (`exit_stopped`)."""
    state = start(job, launch, manifest, merge=merge_only)
    if merge_only:
        return state if launch.main else None
    mine = state["todo"][launch.rank :: launch.world]
    with StopSignals() as stop:
        try:
            if mine:
                with worker(mine) as do_unit:
                    run_units(job, launch, state, do_unit, stop)
            if launch.main:
                wait_for_units(job, state["todo"], stop)
        except Stopped as error:
            exit_stopped(prog, job, error)
    if not launch.main:
        return None
    if job.shard_index is not None:
        logger.info("shard %d of %d: %s", job.shard_index, job.num_shards, status_line(job))
        return None
    return state


def place(translator, launch: Launch):
    """`translator` on this process' device where it has one (Accelerate's placement; the torch engine)."""
    device = launch.device
    if device is not None and getattr(device, "type", "cpu") != "cpu" and translator.engine.name == "torch":
        translator.engine.model.to(device)
    return translator


def process_location(location, launch: Launch):
    """The model's location for this process: without --num_threads, the CPU threads of a process of a launch are
    this machine's cores divided by its processes (a deterministic function of the machine and the launch)."""
    import dataclasses

    if launch.world == 1 or location.num_threads is not None:
        return location
    device = launch.device
    if device is not None and getattr(device, "type", "cpu") != "cpu":
        return location
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or launch.world)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return dataclasses.replace(location, num_threads=max(1, cores // max(local, 1)))


def wait_for_units(job: Job, units: list[int], stop: StopSignals) -> None:
    """Until every unit of `units` has a record (the other processes' share), checking for a stop signal."""
    folder = WorkFolder(job.work_dir)
    waiting = list(units)
    while waiting:
        waiting = [u for u in waiting if folder.record(u) is None]
        if not waiting:
            return
        stop.check()
        time.sleep(POLL_SECONDS)


def merge(job: Job) -> list[dict]:
    """Check every unit and write `job.output` from their parts (see the module docstring); returns the records in
    unit order. Missing or inconsistent units raise a DataError naming them (nothing is written)."""
    folder = WorkFolder(job.work_dir)
    problems = {}
    for unit in range(job.units):
        problem = folder.problem(unit, len(job.unit_range(unit)), deep=False)
        if problem:
            problems[unit] = problem
    if problems:
        raise DataError(_problems_text(job, problems))
    output = Path(job.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{uuid.uuid4().hex[:8]}")
    records = []
    try:
        with open(tmp, "wb") as out:
            if job.header is not None:
                out.write((job.header + "\n").encode("utf-8"))
            for unit in range(job.units):
                records.append(folder.record(unit))
                digest = _copy_part(folder.path / f"{unit_name(unit)}.part", out)
                if digest != records[-1]["sha256"]:
                    problems[unit] = "its part's SHA-256 differs from its record's"
            if problems:
                raise DataError(_problems_text(job, problems))
        os.replace(tmp, output)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if job.keep_work_dir:
        folder.remove_temporary()
    else:
        shutil.rmtree(job.work_dir, ignore_errors=True)
    return records


def _copy_part(path: Path, out) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
            out.write(block)
    return digest.hexdigest()


def _problems_text(job: Job, problems: dict[int, str]) -> str:
    shown = [
        f"unit {u} (lines {job.unit_range(u).start + 1}-{job.unit_range(u).stop}): {why}"
        for u, why in list(problems.items())[:10]
    ]
    more = f"; and {len(problems) - 10} more" if len(problems) > 10 else ""
    return (
        f"{job.work_dir}: {len(problems)} of the {job.units} units are not done: {'; '.join(shown)}{more}. Nothing "
        "was written; run the missing units (the same command, or the shards that own them) and merge again."
    )


def status_line(job: Job) -> str:
    """How far the whole job is (every shard), and what to run next."""
    folder = WorkFolder(job.work_dir)
    done = sum(1 for u in range(job.units) if folder.record(u) is not None)
    if done == job.units:
        return f"all {job.units} units of the job are done: write {job.output} with the same command and --merge"
    return (
        f"{done} of the job's {job.units} units are done; once every shard is, merge with the same command and --merge"
    )


def stopped_line(job: Job, error: Stopped) -> str:
    """The one line a stopped process prints: what stays, how to resume."""
    folder = WorkFolder(job.work_dir)
    done = sum(1 for u in range(job.units) if folder.record(u) is not None)
    return (
        f"stopped by {error.name}: {done} of the {job.units} units are done in {job.work_dir} (a unit in progress "
        "was dropped); run the same command again to resume: the finished units are kept"
    )


def exit_stopped(prog: str, job: Job, error: Stopped) -> None:
    print(f"{prog}: {stopped_line(job, error)}", file=sys.stderr, flush=True)
    sys.exit(error.exit_code)


__all__ = [
    "DEFAULT_UNIT_LINES",
    "Job",
    "Launch",
    "StopSignals",
    "Stopped",
    "UnitWriter",
    "WorkFolder",
    "add_sharding_flags",
    "check_flags",
    "default_work_dir",
    "file_record",
    "folder_digest",
    "join_launch",
    "launched_processes",
    "merge",
    "run_units",
    "start",
    "status_line",
    "wait_for_units",
    "wanted",
]
