"""Shared fixtures: a small real tokenizer (bundled Multi30k) and a child-process runner without hf_variants."""

from __future__ import annotations

import atexit
import gzip
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
import torch

# ----------------------------------------------------------------------------------------- the user's caches
# The suite never writes to the user's Hugging Face caches (one run used to leave ~90 tokenized-data folders in
# ~/.cache/huggingface/datasets/hf_variants): before any Hugging Face library is imported, HF_HOME points at a
# temporary folder and the per-library cache variables are dropped, so datasets, transformers (remote-code
# modules), huggingface_hub and evaluate all cache there; child processes (training runs, translate.py) inherit
# the environment. An audit hook records any write this process makes under the user's cache folders, and the
# session fails naming them (`pytest_sessionfinish`); `test_tests_use_temporary_caches` checks the redirection in a
# child process.
CACHE_VARIABLES = (
    "HF_DATASETS_CACHE",
    "HF_HUB_CACHE",
    "HUGGINGFACE_HUB_CACHE",
    "HF_MODULES_CACHE",
    "TRANSFORMERS_CACHE",
    "HF_METRICS_CACHE",
    "HF_EVALUATE_CACHE",
    "HF_XET_CACHE",
    "HF_ASSETS_CACHE",
)
_user_home = os.path.expanduser(
    os.environ.get("HF_HOME")
    or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
)
USER_CACHE_DIRS = tuple(
    dict.fromkeys(
        os.path.abspath(os.path.expanduser(path))
        for path in (_user_home, *(os.environ[name] for name in CACHE_VARIABLES if os.environ.get(name)))
    )
)
TEST_HF_HOME = tempfile.mkdtemp(prefix="hf_variants-tests-hf_home-")
atexit.register(shutil.rmtree, TEST_HF_HOME, ignore_errors=True)
for _name in CACHE_VARIABLES:
    os.environ.pop(_name, None)
os.environ["HF_HOME"] = TEST_HF_HOME
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
USER_CACHE_WRITES: list[str] = []


def user_cache_write(event: str, args: tuple) -> str | None:
    """`event: path` when an audit event writes under one of `USER_CACHE_DIRS`, else None."""
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writes = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS
        )
        paths = (path,) if writes else ()
    elif event in (
        "os.mkdir",
        "os.remove",
        "os.rmdir",
        "os.truncate",
        "os.symlink",
        "os.link",
        "shutil.rmtree",
        "shutil.copyfile",
        "shutil.copytree",
        "shutil.move",
    ):
        paths = (
            args[:1]
            if event not in ("os.symlink", "os.link", "shutil.copyfile", "shutil.copytree", "shutil.move")
            else args[1:2]
        )
    elif event in ("os.rename", "os.replace"):
        paths = args[:2]
    else:
        return None
    for path in paths:
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.fsdecode(path)
            full = os.path.abspath(path)
            if any(full == d or full.startswith(d + os.sep) for d in USER_CACHE_DIRS):
                return f"{event}: {full}"
    return None


def _audit(event: str, args: tuple) -> None:
    if event == "open" or event.startswith(("os.", "shutil.")):
        found = user_cache_write(event, args)
        if found is not None and len(USER_CACHE_WRITES) < 20:
            USER_CACHE_WRITES.append(found)


sys.addaudithook(_audit)


# the files that take longest, first: with pytest-xdist (`-n auto --dist loadfile`, the README's command) each file
# runs on one worker, in collection order, and a long file started last would finish alone
LONGEST_FIRST = ("test_peer_suite.py", "test_onnx.py", "test_train_stops.py", "test_user_guide.py")


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else 99)


def pytest_sessionfinish(session, exitstatus):
    if USER_CACHE_WRITES:
        sys.stderr.write(
            "\nTests wrote to the user's Hugging Face caches (they must use the temporary HF_HOME "
            f"{TEST_HF_HOME}):\n  " + "\n  ".join(USER_CACHE_WRITES) + "\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "training" / "data" / "multi30k"
LANGUAGES = ("en", "de", "fr", "cs")

# the cores shared by the suite's processes: pytest-xdist's workers (the README's `-n auto`) split them
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // WORKERS)))


def read_sentences(lang: str, split: str = "train", n: int = 200, start: int = 0) -> list[str]:
    with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in itertools.islice(f, start, start + n)]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A shared BPE tokenizer (vocab ~500, <2xx> tags for en/de/fr/cs) trained on 400 real sentences a language."""
    from hf_variants.tokenization import train_tokenizer

    texts = [s for lang in LANGUAGES for s in read_sentences(lang, n=400)]
    return train_tokenizer(texts, vocab_size=500, languages=LANGUAGES, output_dir=tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def checkout_wheel(tmp_path_factory) -> Path:
    """One wheel built from the checkout (no dependencies, no build isolation) for every test that inspects or
    installs it."""
    out = tmp_path_factory.mktemp("wheel")
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out)]
    subprocess.run(pip + [str(REPO_ROOT)], check=True, capture_output=True)
    (wheel,) = out.glob("hf_variants-*.whl")
    return wheel


def environment_with_running_packages(path: Path) -> Path:
    """A new virtual environment at `path` that sees every package of the running interpreter (torch and the other
    dependencies) behind its own site-packages, whichever kind the running one is: the system interpreter, a
    virtual environment or a conda environment. Returns its python.

    `venv --system-site-packages` would not do: from inside a virtual environment it exposes the BASE
    interpreter's site-packages, not the running environment's. Here a `.pth` file of the new environment adds the
    running interpreter's site directories with `site.addsitedir` (which also runs their own `.pth` files:
    editable installs), after the new environment's own site-packages, so what is installed into the new
    environment wins."""
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    python = path / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    running = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    if site.ENABLE_USER_SITE and os.path.isdir(site.getusersitepackages()):
        running.append(site.getusersitepackages())
    running = [d for d in dict.fromkeys(os.path.realpath(d) for d in running) if os.path.isdir(d)]
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in running)
    Path(purelib, "_hf_variants_running_environment.pth").write_text(lines)
    return python


# A child process must prove that saved code is self-contained: it drops the editable-install finder and the repo
# from its import path, and asserts that `hf_variants` cannot be imported, before it imports anything else.
_ISOLATION_PRELUDE = """
import importlib.util, os, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in str(getattr(f, "__module__", ""))
                    and "__editable__" not in getattr(type(f), "__module__", "")]
sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
_repo = os.path.realpath({repo!r})
sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != _repo]
sys.path_importer_cache.clear()
assert importlib.util.find_spec("hf_variants") is None, "hf_variants is importable in the isolated child"
"""


def run_without_package(code: str, env: dict | None = None, timeout: float = 300) -> str:
    """Run `code` in a fresh Python process that cannot import hf_variants; return its stdout (raise on error)."""
    script = _ISOLATION_PRELUDE.format(repo=str(REPO_ROOT)) + textwrap.dedent(code)
    child_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    child_env.setdefault("HF_HUB_OFFLINE", "1")
    child_env.update(env or {})
    workdir = Path(child_env.get("TMPDIR", "/tmp"))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout, env=child_env, cwd=workdir
    )
    if result.returncode != 0:
        raise AssertionError(f"child process failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout
