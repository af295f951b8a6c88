"""Shared fixtures: a small real tokenizer (bundled Multi30k) and a child-process runner without hf_variants."""

from __future__ import annotations

import gzip
import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
DATA_DIR = REPO_ROOT / "training" / "data" / "multi30k"
LANGUAGES = ("en", "de", "fr", "cs")

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def read_sentences(lang: str, split: str = "train", n: int = 200, start: int = 0) -> list[str]:
    with gzip.open(DATA_DIR / f"{split}.{lang}.gz", "rt", encoding="utf-8") as f:
        return [line.rstrip("\n") for line in itertools.islice(f, start, start + n)]


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    """A shared BPE tokenizer (vocab ~500, <2xx> tags for en/de/fr/cs) trained on 400 real sentences a language."""
    from hf_variants.tokenization import train_tokenizer

    texts = [s for lang in LANGUAGES for s in read_sentences(lang, n=400)]
    return train_tokenizer(texts, vocab_size=500, languages=LANGUAGES,
                           output_dir=tmp_path_factory.mktemp("tokenizer"))


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
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                            env=child_env, cwd=workdir)
    if result.returncode != 0:
        raise AssertionError(f"child process failed ({result.returncode}):\n{result.stderr[-4000:]}")
    return result.stdout
