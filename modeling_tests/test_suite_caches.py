"""The suite leaves the user's Hugging Face caches alone (conftest.py): every cache resolves into the session's
temporary HF_HOME, in this process and in the child processes the tests launch (training runs, translate.py), and
the audit hook that fails the session recognises writes under the user's cache folders."""

import os
import subprocess
import sys
from pathlib import Path

import conftest

ROOT = Path(__file__).resolve().parents[1]

CACHES = """
import datasets, evaluate, huggingface_hub.constants, transformers.utils.hub
from hf_variants.training import data_pipeline
print(data_pipeline.default_cache_dir())
print(datasets.config.HF_DATASETS_CACHE)
print(transformers.utils.hub.HF_MODULES_CACHE)
print(huggingface_hub.constants.HF_HUB_CACHE)
print(evaluate.config.HF_MODULES_CACHE)
"""


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.realpath(path), os.path.realpath(folder)
    return path == folder or path.startswith(folder + os.sep)


def test_tests_use_temporary_caches():
    home = conftest.TEST_HF_HOME
    assert os.environ["HF_HOME"] == home and not any(os.environ.get(v) for v in conftest.CACHE_VARIABLES)
    assert not any(_inside(home, d) for d in conftest.USER_CACHE_DIRS)
    in_process = {}
    exec(CACHES.replace("print(", "in_process.setdefault(len(in_process), "), {"in_process": in_process})
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}  # what the tests' launches pass
    child = subprocess.run(
        [sys.executable, "-c", CACHES], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert child.returncode == 0, child.stderr[-3000:]
    paths = [str(p) for p in in_process.values()] + child.stdout.split()
    assert len(paths) == 10
    for path in paths:
        assert _inside(path, home), path
        assert not any(_inside(path, d) for d in conftest.USER_CACHE_DIRS), path


def test_writes_under_the_users_cache_are_recognised():
    user = os.path.join(conftest.USER_CACHE_DIRS[0], "datasets", "hf_variants", "rows-x")
    mine = os.path.join(conftest.TEST_HF_HOME, "datasets", "hf_variants", "rows-x")
    write = conftest.user_cache_write
    assert write("os.mkdir", (user, 0o777, -1)) == f"os.mkdir: {user}"
    assert write("open", (user + "/data.arrow", "wb", os.O_WRONLY | os.O_CREAT)) is not None
    assert write("open", (user + "/data.arrow", None, os.O_RDWR)) is not None  # os.open
    assert write("os.replace", (mine, user, -1, -1)) is not None
    assert write("shutil.rmtree", (user, None)) is not None
    assert write("open", (user + "/meta.json", "r", os.O_RDONLY)) is None  # reading is fine
    assert write("os.mkdir", (mine, 0o777, -1)) is None
    assert write("open", (3, "w", os.O_WRONLY)) is None  # a file descriptor
