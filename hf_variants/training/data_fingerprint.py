"""The content fingerprint of a run's training and validation data, stored in every checkpoint and compared when the
run resumes: a resume on data that changed at the same path is refused, or, with `--allow_changed_settings data`,
accepted and recorded.

A run's settings (hf_variants/training/settings.py) name its data by path; this module says what the data was:

- a data file (per-language text files and their annotation files, a TSV or JSONL file): its size and the SHA-256
  of its bytes (of a `.gz` file, the compressed bytes). Hashing a multi-GB corpus is a full read (a 500 MB file
  from the page cache hashed at 347 MB/s on a 2-core AMD EPYC at load average 11.6; SHA-256 with SHA-NI reaches
  ~1.7 GB/s on an idle core; a disk is often slower), so it happens once per file version: the digest is kept in
  `<data cache>/fingerprints/` keyed by the file's path, device, inode, size, modification and status-change times,
  and reused while all of them match (any write, `cp` or rename over the file changes its status-change time, which
  no tool can set back). A run's first launch and a launch after the file changed hash it (files in parallel
  threads: hashlib releases the GIL); every other launch reads only the memo (0.2 ms a file). The data
  cache (hf_variants/training/data_pipeline.py) keys its entries by the cheaper `sources.file_identity` (size,
  modification time, first and last MiB): enough to find a cached copy, not to prove two versions the same;
- a `datasets` dataset (`--dataset_name`: a Hub dataset, whose fingerprint follows its revision, or a `save_to_disk`
  folder, whose fingerprint follows its content; `train_on_datasets`' in-memory datasets): its `_fingerprint` and
  number of rows.

Paths are recorded but not compared (a data folder moved elsewhere is the same data; moving it is the `data_dir`
setting's change). The test split is not fingerprinted: it decides only the final evaluation, a free setting.

`check_resume` runs on the main process before any data is read: it stores the fingerprints in the run's settings
(so every checkpoint records them) and, on a resume, compares them with the checkpoint's. A change is refused with a
`DataChangedError` naming each changed source with both fingerprints and the flag that accepts it; an accepted
change is logged (train.log) and returned as a settings change (`results.json`'s `settings_changes`, the model
card's "Resumed at step N with" row).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .corpus import DataError
from .settings import SettingsChangedError

logger = logging.getLogger("hf_variants.train")

SETTING = "data"  # the key in the run's settings, and the name --allow_changed_settings accepts
SPLITS = ("train", "valid")
MEMO_DIR = "fingerprints"
MAX_MEMO_BYTES = 64 * 1024
HASH_BLOCK = 8 << 20


class DataChangedError(SettingsChangedError, DataError):
    """The data of a resumed run differs from the data its checkpoint was trained on."""


# ------------------------------------------------------------------------------------------------- one file
def _stat_key(path: Path) -> dict:
    st = os.stat(path)
    return {
        "path": str(path),
        "dev": st.st_dev,
        "ino": st.st_ino,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
    }


def _memo_file(memo_dir: Path, path: Path) -> Path:
    return memo_dir / f"{hashlib.sha256(str(path).encode()).hexdigest()[:32]}.json"


def _read_memo(file: Path, key: dict) -> str | None:
    """The digest stored for `key` (None: no memo, another version of the file, or a memo file of any other
    shape: it is untrusted input, read only as a small regular file of JSON)."""
    try:
        st = os.lstat(file)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MEMO_BYTES:
            return None
        memo = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(memo, dict) or memo.get("key") != key:
        return None
    digest = memo.get("sha256")
    return digest if isinstance(digest, str) and len(digest) == 64 else None


def _write_memo(file: Path, key: dict, digest: str) -> None:
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
        tmp = file.with_name(f".{file.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"key": key, "sha256": digest}), encoding="utf-8")
        os.replace(tmp, file)
    except OSError as err:  # a read-only cache: the digest is computed again next time
        logger.debug("could not store the fingerprint of %s: %s", key["path"], err)


def file_fingerprint(path: str | os.PathLike, memo_dir: str | os.PathLike | None = None) -> dict:
    """`{"path", "size", "sha256"}` of a data file; the digest comes from `memo_dir` when the file is the version
    it was computed for (same path, device, inode, size, modification and status-change times)."""
    path = Path(path).resolve()
    key = _stat_key(path)
    memo = _memo_file(Path(memo_dir), path) if memo_dir is not None else None
    digest = _read_memo(memo, key) if memo is not None else None
    if digest is None:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while block := f.read(HASH_BLOCK):
                h.update(block)
        digest = h.hexdigest()
        if _stat_key(path) == key and memo is not None:  # not written to while it was read
            _write_memo(memo, key, digest)
    return {"path": str(path), "size": key["size"], "sha256": digest}


# ------------------------------------------------------------------------------------------------- a split
def _files_of(source, annotations) -> dict[str, str]:
    """{role: path} of a file source's files (role: the language, `lang.annotation`, or `file`)."""
    if source.kind == "files":
        files = dict(source.files)
        for name, by_lang in source.annotation_files.items():
            if name in annotations:
                files.update({f"{lang}.{name}": p for lang, p in by_lang.items()})
        return files
    return {"file": source.path}


def split_fingerprints(sources: dict, annotations=(), memo_dir: str | os.PathLike | None = None) -> dict:
    """{split: fingerprint or None} of the splits' sources (`sources.SplitSource` or None). A file source's
    fingerprint is {"kind", "label", "files": {role: file_fingerprint}}, a dataset's {"kind", "label", "dataset":
    its fingerprint, "rows"}. The files of every split are hashed in parallel threads."""
    out, jobs = {}, {}
    for split, source in sources.items():
        if source is None:
            out[split] = None
        elif source.kind == "hub":
            dataset = source.dataset
            out[split] = {
                "kind": "hub",
                "label": source.label,
                "dataset": str(getattr(dataset, "_fingerprint", None) or ""),
                "rows": len(dataset) if hasattr(dataset, "__len__") else None,
            }
        else:
            out[split] = {"kind": source.kind, "label": source.label, "files": {}}
            for role, path in _files_of(source, annotations).items():
                jobs[(split, role)] = path
    if jobs:
        t0 = time.time()
        workers = min(len(jobs), len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 2)
        with ThreadPoolExecutor(max(workers, 1)) as pool:
            done = dict(zip(jobs, pool.map(lambda p: file_fingerprint(p, memo_dir), jobs.values())))
        for (split, role), fingerprint in done.items():
            out[split]["files"][role] = fingerprint
        seconds = time.time() - t0
        if seconds > 2:
            size = sum(f["size"] for f in done.values())
            logger.info("Data fingerprints: %d files (%.2f GB) in %.1f s", len(done), size / 1e9, seconds)
    return out


# ------------------------------------------------------------------------------------------------- comparing
def _content(fingerprint: dict | None) -> dict:
    """{what: comparable value} of a split's fingerprint: each file's size and digest, or the dataset's."""
    if not isinstance(fingerprint, dict):
        return {}
    if fingerprint.get("kind") == "hub":
        return {"dataset": (fingerprint.get("dataset"), fingerprint.get("rows"))}
    files = fingerprint.get("files")
    if not isinstance(files, dict):
        return {}
    return {
        role: (f.get("size"), f.get("sha256")) if isinstance(f, dict) else None for role, f in sorted(files.items())
    }


def _describe(fingerprint: dict | None, role: str) -> str:
    """One side of a change, as the message and the settings change record it."""
    if not isinstance(fingerprint, dict):
        return "none"
    if fingerprint.get("kind") == "hub":
        return f"dataset fingerprint {fingerprint.get('dataset')} ({fingerprint.get('rows')} rows)"
    file = (fingerprint.get("files") or {}).get(role)
    if not isinstance(file, dict):
        return "no such file"
    size = file.get("size")
    return f"sha256 {file.get('sha256')} ({size:,} bytes)" if isinstance(size, int) else f"sha256 {file.get('sha256')}"


def _where(saved: dict | None, now: dict | None, role: str) -> str:
    for fingerprint in (now, saved):
        if isinstance(fingerprint, dict):
            if fingerprint.get("kind") == "hub":
                return str(fingerprint.get("label"))
            file = (fingerprint.get("files") or {}).get(role)
            if isinstance(file, dict) and file.get("path"):
                return str(file["path"])
    return "?"


def _short(where: str) -> str:
    """A local path by its last component (what results.json and the model card record: no machine paths)."""
    return Path(where).name if os.path.isabs(where) else where


def changes(saved: dict, now: dict) -> list[dict]:
    """The sources whose content differs: `{"split", "source", "name", "from", "to"}` each (`source`: the split,
    its role and where it is now, e.g. "train en (/data/train.en)"; `name`: the same with the file's name only). A
    split the checkpoint did not record is not compared (written before fingerprints existed, or a split added
    since, which its own setting's change names)."""
    found = []
    for split in now:
        if split not in saved:
            continue
        old, new = _content(saved[split]), _content(now[split])
        for role in sorted(set(old) | set(new)):
            if old.get(role) != new.get(role):
                label = split if role in ("file", "dataset") else f"{split} {role}"
                where = _where(saved[split], now[split], role)
                found.append(
                    {
                        "split": split,
                        "source": f"{label} ({where})",
                        "name": f"{label} ({_short(where)})",
                        "from": _describe(saved[split], role),
                        "to": _describe(now[split], role),
                    }
                )
    return found


def refusal(where: str, found: list[dict], step) -> str:
    lines = [f"Cannot resume {where}: the data changed since it was written (saved -> now):"]
    lines += [f"  {c['source']}: {c['from']} -> {c['to']}" for c in found]
    lines.append(
        "The run's data order, epoch position and reports describe the data it was trained on. Restore that data, "
        f"or pass --allow_changed_settings {SETTING} to train on the new data from step {step} on (the change is "
        "recorded in train.log, results.json and the model card)."
    )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- the run
def _resolve_sources(args, languages, split_source, in_memory: bool) -> dict:
    """{split: SplitSource or None} (`split_source`: train.split_source); a split whose source cannot be resolved here
    is left out (loading the data names the problem, with the run folder's clean-up of a refused launch)."""
    from . import corpus

    hub_splits = None
    if args.dataset_name and not in_memory:
        try:
            hub_splits = corpus.load_hub_splits(args.dataset_name, args.dataset_config_name)
        except Exception as err:  # noqa: BLE001 - reported where the data is loaded
            logger.debug("no data fingerprint of %s: %s", args.dataset_name, err)
            return dict.fromkeys(SPLITS)
    sources = {}
    for split in SPLITS:
        try:
            sources[split] = split_source(args, split, languages, hub_splits)
        except Exception as err:  # noqa: BLE001 - reported where the data is loaded
            logger.debug("no data fingerprint of the %s split: %s", split, err)
            sources[split] = None
    if getattr(args, "corpora", None):  # several training corpora: each its own (corpora.py)
        from .corpora import sources_by_corpus

        sources.update(sources_by_corpus(args, languages))
    return sources


def check_resume(
    args, accelerator, resume: Path | None, run_settings: dict, languages, split_source, in_memory: bool = False
) -> list[dict]:
    """On the main process: the fingerprints of the run's training and validation sources (`split_source`:
    train.split_source; `in_memory`: train_on_datasets' datasets) into `run_settings[SETTING]` and, when resuming
    from `resume`, compared with the checkpoint's. Returns the accepted changes as settings changes
    (`--allow_changed_settings data`); raises `DataChangedError` on every process otherwise. Collective: every
    process calls it."""
    from . import checkpointing
    from .cache_store import default_cache_dir
    from .trainer import accelerator_broadcast

    outcome: dict = {}
    if accelerator.is_main_process:
        try:
            memo_dir = Path(args.data_cache_dir or default_cache_dir()) / MEMO_DIR
            annotations = list(args.source_annotations or [])
            sources = _resolve_sources(args, languages, split_source, in_memory)
            now = split_fingerprints(sources, annotations, memo_dir)
            run_settings[SETTING] = now
            saved = (checkpointing.checkpoint_info(resume).get("settings") or {}).get(SETTING) if resume else None
            found = changes(saved, now) if isinstance(saved, dict) else []
            if found and SETTING not in set(args.allow_changed_settings or ()):
                step = checkpointing.checkpoint_info(resume).get("step")
                outcome["refused"] = refusal(str(resume), found, step)
            outcome["changes"] = [
                {"setting": SETTING, "from": f"{c['name']}: {c['from']}", "to": c["to"], "free": False} for c in found
            ]
        except Exception as err:  # noqa: BLE001 - every process stops, not only the main one
            outcome["refused"] = f"{type(err).__name__}: {err}" if not isinstance(err, DataError) else str(err)
    outcome = accelerator_broadcast(accelerator, outcome)
    if "refused" in outcome:
        raise DataChangedError(outcome["refused"])
    for change in outcome["changes"]:
        logger.warning(
            "Resuming %s with the data changed: %s -> %s (allowed by --allow_changed_settings %s; recorded)",
            resume.name,
            change["from"],
            change["to"],
            SETTING,
        )
    return outcome["changes"]
