"""Publish a trained hf_variants model (weights, tokenizer, remote code, model card) to the Hugging Face Hub.

The Hub is the one named by `HF_ENDPOINT` (read at call time; default https://huggingface.co), the token is the
`token` argument or the user's saved/`HF_TOKEN` token (`huggingface_hub.get_token()`). The token is only handed to
`huggingface_hub`: it is never written to the card or any file, never logged, and it is scrubbed from every error
message. Apart from (re)writing `README.md`, the model folder is never modified, also when the push fails.

CLI::

    hf-variants-publish RUN_DIR --repo_id ORG/NAME [--private] [--commit_message MSG]

(`hf_variants.commands.publish`; `python -m model_cards.publish` runs the same)

`RUN_DIR` is a run folder (`results.json` + `model/`) or a model folder. The flags and the folder are checked before
anything is read or sent (exit status 2 naming the flag); the card is written atomically (a temporary sibling, then
renamed), so an interrupted publish leaves the old README.md whole.

Inference Endpoints: the same commit adds `handler.py` (`model_cards/endpoint_handler.py`: Inference Endpoints'
custom handler, `EndpointHandler(path)` called with `{"inputs": ..., "parameters": ...}`, on transformers and the
repository's own code, without hf_variants) and `requirements.txt` (the transformers range the folder's model code
supports, read from its `compat_transformer_nmt.py`), unless the folder has files of those names, which are uploaded
as they are. Neither is written into the local folder.
"""

from __future__ import annotations

import ast
import contextlib
import json
import logging
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path

from huggingface_hub import HfApi, constants, get_token
from huggingface_hub.errors import HfHubHTTPError, HFValidationError
from huggingface_hub.utils import validate_repo_id

from .card import build_model_card, load_results

logger = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Training leftovers that never belong in a model repo.
IGNORE_PATTERNS = [
    ".git/*",
    ".cache/*",
    "__pycache__/*",
    "*.pyc",
    "*.tmp",
    "*.lock",
    "checkpoint-*/*",
    "optimizer.pt",
    "scheduler.pt",
    "rng_state*.pth",
    "trainer_state.json",
    "training_args.bin",
    "*.log",
    ".hf_variants_output.json",  # which command wrote the folder (hf_variants.outputs.OUTPUT_MANIFEST)
]
_SCAN_LIMIT = 64 * 1024 * 1024  # files scanned for the token before upload (weights are larger than this)


# HTTP client loggers that log every request at INFO ("HTTP Request: POST ... 200 OK"): httpx, and httpx2, which
# huggingface_hub uses from version 2 on
HTTP_LOGGERS = ("httpx", "httpx2", "httpcore", "httpcore2")


@contextlib.contextmanager
def quiet_http_logs(level: int = logging.WARNING):
    """Raise the HTTP client loggers to `level` (their warnings and errors still show) and restore them after."""
    loggers = [logging.getLogger(name) for name in HTTP_LOGGERS]
    before = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(max(level, log.getEffectiveLevel()))
    try:
        yield
    finally:
        for log, old in zip(loggers, before):
            log.setLevel(old)


class PublishError(RuntimeError):
    """Pushing to the Hub failed; the message says why and never contains the token."""


def _endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def check_repo_id(repo_id: object) -> str:
    if not isinstance(repo_id, str) or repo_id.count("/") != 1:
        raise ValueError(
            f"Invalid repo id {repo_id!r}: expected 'namespace/name' (your user or organization name, "
            "a slash, and the model name)."
        )
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"Invalid repo id {repo_id!r}: {err}") from None
    return repo_id


def check_model_dir(model_dir: Path) -> dict:
    """Check that `model_dir` holds a complete checkpoint; return its config."""
    if not model_dir.is_dir():
        raise ValueError(f"Model folder {str(model_dir)!r} does not exist.")
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(
            f"{str(model_dir)!r} is not a saved model: config.json is missing (save it with model.save_pretrained)."
        )
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    if not any((model_dir / name).is_file() for name in WEIGHT_FILES):
        raise ValueError(f"{str(model_dir)!r} holds no weights (expected one of {', '.join(WEIGHT_FILES)}).")
    if not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{str(model_dir)!r} holds no tokenizer (save it with tokenizer.save_pretrained).")
    # The remote code that `trust_remote_code` loads: every module named by auto_map / custom_pipelines.
    # ("repo--module.Class" references code in another repository: nothing to ship from here.)
    references = [v for v in (config.get("auto_map") or {}).values()]
    references += [p.get("impl") for p in (config.get("custom_pipelines") or {}).values() if isinstance(p, dict)]
    needed = {
        ref.rsplit(".", 1)[0] + ".py" for ref in references if isinstance(ref, str) and "." in ref and "--" not in ref
    }
    present = {p.name for p in model_dir.glob("*.py")}
    queue = sorted(needed & present)
    while queue:  # and every sibling module they import (`from .module import Name`), transitively
        for module in _relative_imports(model_dir / queue.pop()):
            name = module + ".py"
            if name not in needed:
                needed.add(name)
                if name in present:
                    queue.append(name)
    missing = sorted(needed - present)
    if missing:
        raise ValueError(
            f"{str(model_dir)!r} lacks the code files {missing} named in config.json (or imported by "
            "its code files); save the model "
            "with model.save_pretrained so that they are copied."
        )
    return config


def _write_atomically(path: Path, text: str) -> None:
    """`text` to `path` through a hidden temporary sibling and `os.replace` (this module imports no torch, hence
    not hf_variants.outputs): a reader sees the old file or the new one; a failure removes the temporary file."""
    tmp = path.with_name(f".{path.name}.tmp-publish")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _relative_imports(path: Path) -> list[str]:
    """The sibling modules a code file imports (`from .module import ...`, `import .module`), as transformers'
    `dynamic_module_utils.get_relative_imports` reads them when it loads remote code."""
    text = path.read_text(encoding="utf-8")
    names = re.findall(r"^\s*import\s+\.(\S+)\s*$", text, flags=re.MULTILINE)
    names += re.findall(r"^\s*from\s+\.(\S+)\s+import", text, flags=re.MULTILINE)
    return sorted(set(names))


ENDPOINT_HANDLER = Path(__file__).with_name("endpoint_handler.py")


def endpoint_files(model_dir: Path) -> dict[str, str]:
    """The files the Hub repository gets beside the folder's for Inference Endpoints (`handler.py`, and
    `requirements.txt` where the folder's model code names its transformers range), less those the folder has."""
    files = {"handler.py": ENDPOINT_HANDLER.read_text(encoding="utf-8")}
    compat = model_dir / "compat_transformer_nmt.py"
    match = (
        re.search(r"^SUPPORTED_RANGE = (\(.*?\))$", compat.read_text(encoding="utf-8"), re.M)
        if compat.is_file()
        else None
    )
    if match:
        bounds = ast.literal_eval(match.group(1))
        files["requirements.txt"] = (
            "# Inference Endpoints installs these before loading handler.py: the transformers versions the model's "
            f"code supports\ntransformers{','.join(bounds)}\n"
        )
    return {name: text for name, text in files.items() if not (model_dir / name).exists()}


@contextlib.contextmanager
def _upload_view(model_dir: Path, extra: Mapping[str, str]) -> Iterator[Path]:
    """`model_dir` as one folder to upload with `extra` files beside its own: a temporary folder of links to the
    model folder's files (their bytes are read from the model folder) and the extra files. The model folder is not
    touched."""
    if not extra:
        yield model_dir
        return
    with tempfile.TemporaryDirectory(prefix="hf-variants-publish-") as tmp:
        view = Path(tmp)
        for path in model_dir.rglob("*"):
            target = view / path.relative_to(model_dir)
            if path.is_dir() and not path.is_symlink():
                target.mkdir(parents=True, exist_ok=True)
            elif path.is_file():
                target.parent.mkdir(parents=True, exist_ok=True)
                target.symlink_to(path.resolve())
        for name, text in extra.items():
            (view / name).write_text(text, encoding="utf-8")
        yield view


def _find_results(model_dir: Path) -> dict | None:
    """results.json of the run folder that holds `model_dir` (run_dir/model), if any."""
    path = model_dir.parent / "results.json"
    return load_results(model_dir.parent) if path.is_file() else None


def _assert_token_absent(model_dir: Path, token: str) -> None:
    if len(token) < 8:  # a placeholder (test servers), not a secret: any README would "contain" it
        return
    needle = token.encode()
    for path in sorted(p for p in model_dir.rglob("*") if p.is_file()):
        if path.stat().st_size <= _SCAN_LIMIT and needle in path.read_bytes():
            raise PublishError(
                f"Refusing to publish: the access token appears in {path.name}. Remove it from "
                "the file (and revoke the token if the file was shared)."
            )


def _scrub(text: str, token: str) -> str:
    return text.replace(token, "***") if token else text


def _http_hint(status: int | None) -> str:
    if status == 401:
        return "the token was rejected: check that it is valid and has write access"
    if status == 403:
        return (
            "the server refused the request: the token has no write access to this namespace, or uploads are "
            "not allowed"
        )
    if status == 404:
        return "the repository or its namespace was not found"
    if status == 409:
        return "the repository is in a conflicting state; retry"
    if status is not None and status >= 500:
        return "server error; retry later"
    return "the server rejected the request"


def push_to_hub(
    model_dir: str | os.PathLike,
    repo_id: str,
    *,
    token: str | None = None,
    private: bool = False,
    commit_message: str | None = None,
    results: Mapping | None = None,
) -> str:
    """Push the model folder `model_dir` (weights, tokenizer, code files) and its card to `repo_id`.

    The card (`README.md`) is (re)built from `results`, or from the run folder's `results.json` when `model_dir`
    is `run_dir/model`; without either, an existing README.md is kept, otherwise a card is built from the config.

    Returns the URL of the commit. Raises `ValueError` for a bad repo id or an incomplete model folder (before any
    network access), `PublishError` (a `RuntimeError`) without a token or when the Hub refuses the push. The
    local checkpoint is left intact in every case.
    """
    model_dir = Path(model_dir)
    repo_id = check_repo_id(repo_id)
    config = check_model_dir(model_dir)
    token = token or get_token()
    if not token:
        raise PublishError(
            "No Hugging Face token: pass token=..., set the HF_TOKEN environment variable, or log in "
            "with `hf auth login`. Nothing was pushed."
        )
    endpoint = _endpoint()

    if results is None:
        results = _find_results(model_dir)
    readme = model_dir / "README.md"
    if results is not None or not readme.is_file():
        _write_atomically(readme, str(build_model_card(model_dir, results or {}, repo_id=repo_id)))
    _assert_token_absent(model_dir, token)

    api = HfApi(endpoint=endpoint, token=token, library_name="hf_variants")
    message = commit_message or f"Upload {config.get('model_type', 'model')} model, tokenizer and card"
    logger.info("Pushing %s to %s on %s", model_dir, repo_id, endpoint)
    try:
        with quiet_http_logs():
            api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
            with _upload_view(model_dir, endpoint_files(model_dir)) as folder:
                commit = api.upload_folder(
                    folder_path=str(folder),
                    repo_id=repo_id,
                    repo_type="model",
                    commit_message=message,
                    ignore_patterns=list(IGNORE_PATTERNS),
                )
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else None
        server = (err.server_message or "").strip()
        raise PublishError(
            _scrub(
                f"Pushing {model_dir} to {repo_id} on {endpoint} failed: HTTP {status}, {_http_hint(status)}"
                f"{f' (server: {server})' if server else ''}. The local checkpoint is unchanged.",
                token,
            )
        ) from None
    except ValueError as err:  # e.g. the Hub rejected the card metadata
        raise PublishError(
            _scrub(
                f"Pushing {model_dir} to {repo_id} on {endpoint} failed: {err}. The local checkpoint is unchanged.",
                token,
            )
        ) from None
    except OSError as err:  # connection errors (httpx errors are OSErrors or wrapped by the client)
        raise PublishError(
            _scrub(
                f"Could not reach {endpoint} to push {repo_id}: {type(err).__name__}: {err}. "
                "The local checkpoint is unchanged.",
                token,
            )
        ) from None
    except Exception as err:
        if type(err).__module__.startswith(("httpx", "httpcore")):
            raise PublishError(
                _scrub(
                    f"Could not reach {endpoint} to push {repo_id}: {type(err).__name__}: "
                    f"{err}. The local checkpoint is unchanged.",
                    token,
                )
            ) from None
        raise
    logger.info("Pushed %s: %s", repo_id, commit.commit_url)
    return commit.commit_url


if __name__ == "__main__":  # the command line lives in hf_variants.commands.publish (hf-variants-publish)
    import runpy

    runpy.run_module("hf_variants.commands.publish", run_name="__main__", alter_sys=True)
