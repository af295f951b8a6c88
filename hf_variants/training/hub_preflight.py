"""`--push_to_hub`: checked when the run starts, before any data is read or a model is built, and the upload at its
end never loses the trained model.

transformers' Trainer creates the repository when it is built; a run that only finds out at its end that it cannot
publish has spent its hours for nothing. `preflight` checks, on the main process, in order (the first failure is
refused with a `HubPushError`, a `DataError`: one line, exit status 2, the run folder removed when the launch
created it, on every process):

1. the Hub can be asked: `HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is not set (it is named when it is);
2. a token: `--hub_token`, `HF_TOKEN` or the `hf auth login` token (`huggingface_hub.get_token`);
3. `--hub_model_id` is a valid repository id (`namespace/name`);
4. the Hub (`HF_ENDPOINT`) answers, and accepts the token: `whoami` (a connection error, a rejected token and a
   read-only token are named; a fine-grained token needs `repo.write` on the namespace);
5. the repository exists or can be created with this token: `create_repo(exist_ok=True)` creates it now, as the
   Trainer does (it stays empty until the upload), and a namespace the token may not write to is refused.

`push_trained_model` uploads `run_dir/model` at the end (`model_cards.publish.push_to_hub`). When that still fails
(the network, the Hub, a token revoked meanwhile) the model, its card and results.json stay where they are, and it
returns an `UploadFailedError` (exit status `EXIT_UPLOAD_FAILED`, 4) whose message is the exact `hf-variants-publish`
command that finishes the job. The token never appears in a message (`model_cards.publish` scrubs it).
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

from .corpus import DataError

EXIT_UPLOAD_FAILED = 4
OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
WRITE_ROLES_IN_ORG = ("admin", "write", "contributor")


class HubPushError(DataError):
    """`--push_to_hub` cannot succeed: refused before the run reads data or builds a model."""


class UploadFailedError(DataError):
    """The trained model is saved, but its upload failed; the message says how to finish it (a `DataError` raised
    after training: the command line prints it as one line and exits with `exit_code`)."""

    exit_code = EXIT_UPLOAD_FAILED


def _offline_variable() -> str | None:
    from huggingface_hub import constants

    for name in OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return OFFLINE_VARIABLES[0] if constants.is_offline_mode() else None


def publish_command(run_dir: Path, repo_id: str) -> str:
    return f"hf-variants-publish {shlex.quote(str(run_dir))} --repo_id {shlex.quote(repo_id)}"


def _http_status(err: BaseException) -> int | None:
    response = getattr(err, "response", None)
    return getattr(response, "status_code", None)


def _unreachable(err: BaseException) -> bool:
    """A connection-level failure (no HTTP answer): httpx's errors, or OSErrors of the socket."""
    return _http_status(err) is None and (
        isinstance(err, OSError) or type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2")
    )


def _token_problem(identity: dict, namespace: str) -> str | None:
    """Why the token of `identity` (`whoami`'s answer) cannot write to `namespace`; None when it may (or when
    only the Hub can tell: a write token's organization rights are checked by creating the repository)."""
    token = ((identity.get("auth") or {}).get("accessToken")) or {}
    role = token.get("role")
    if role == "read":
        return f"the token of {identity.get('name')} is read-only: create a token with write access"
    if role == "fineGrained":
        scoped = (token.get("fineGrained") or {}).get("scoped") or []
        if not any(
            (entry.get("entity") or {}).get("name") == namespace and "repo.write" in (entry.get("permissions") or [])
            for entry in scoped
            if isinstance(entry, dict)
        ):
            return f"the fine-grained token of {identity.get('name')} has no write access (repo.write) to {namespace}"
    return None


_AFTER = (
    "Nothing was trained. Fix it, or train without --push_to_hub and publish the model afterwards with "
    "hf-variants-publish RUN_DIR --repo_id ID."
)


def check_push_flags(repo_id: str, token: str | None) -> None:
    """The checks that need no network (the repo id, offline mode, a token), also run when the command line is
    parsed; a `HubPushError` naming what fails."""
    from model_cards.publish import check_repo_id

    after = _AFTER
    try:
        check_repo_id(repo_id)
    except ValueError as err:
        raise HubPushError(f"--hub_model_id: {err}") from None
    offline = _offline_variable()
    if offline:
        raise HubPushError(
            f"--push_to_hub: {offline}={os.environ.get(offline, '1')} is set (huggingface_hub's offline mode): "
            f"nothing can be uploaded at the end of the run. Unset it for this run. {after}"
        )
    if not token:
        raise HubPushError(
            "--push_to_hub: no Hugging Face token (--hub_token, the HF_TOKEN environment variable or `hf auth "
            f"login`): nothing could be uploaded at the end of the run. {after}"
        )


def check_push_target(repo_id: str, token: str | None, endpoint: str) -> None:
    """The checks of the module docstring; a `HubPushError` naming what fails."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError

    from model_cards.publish import _scrub, quiet_http_logs

    after = _AFTER
    check_push_flags(repo_id, token)
    namespace = repo_id.split("/")[0]
    api = HfApi(endpoint=endpoint, token=token, library_name="hf_variants")
    step = "reach"
    try:
        with quiet_http_logs():
            try:
                identity = api.whoami()
            except HfHubHTTPError as err:
                if _http_status(err) != 429:
                    raise
                identity = {}  # whoami's strict rate limit: creating the repository below checks the token
            problem = _token_problem(identity if isinstance(identity, dict) else {}, namespace)
            if problem:
                raise HubPushError(f"--push_to_hub {repo_id}: {problem}. {after}")
            step = "create"
            api.create_repo(repo_id, exist_ok=True, repo_type="model")
    except HubPushError:
        raise
    except Exception as err:  # noqa: BLE001 - each failure is named below, in our words
        status = _http_status(err)
        if _unreachable(err):
            reason = f"cannot reach {endpoint} ({type(err).__name__}: {err})"
        elif status == 401:
            reason = f"{endpoint} rejected the token (HTTP 401: invalid or expired)"
        elif status == 403 and step == "create":
            reason = f"the token may not create or write repositories in the namespace {namespace} (HTTP 403)"
        elif isinstance(err, HfHubHTTPError):
            reason = f"{endpoint} answered HTTP {status} ({(err.server_message or '').strip() or 'no message'})"
        else:
            reason = f"{type(err).__name__}: {err}"
        raise HubPushError(_scrub(f"--push_to_hub {repo_id}: {reason}. {after}", token)) from None


def preflight(run) -> None:
    """`check_push_target` for a run with `--push_to_hub` (`run`: the `RunContext`), on the main process; the
    outcome is shared, so every process raises the same `HubPushError`. Collective: every process calls it."""
    args, accelerator = run.args, run.accelerator
    if not args.push_to_hub:
        return
    from huggingface_hub import get_token

    from model_cards.publish import _endpoint

    from .trainer import accelerator_broadcast

    refused = None
    if accelerator.is_main_process:
        try:
            check_push_target(args.hub_model_id, args.hub_token or get_token(), _endpoint())
        except HubPushError as err:
            refused = str(err)
    refused = accelerator_broadcast(accelerator, refused)
    if refused:
        raise HubPushError(refused)


def push_trained_model(run_dir: Path, args) -> UploadFailedError | None:
    """Upload `run_dir/model` to `--hub_model_id`; an `UploadFailedError` to raise once every process is done (the
    model stays saved) when the upload fails, None when it succeeded."""
    import logging

    from model_cards.publish import PublishError, push_to_hub

    logger = logging.getLogger("hf_variants.train")
    try:
        url = push_to_hub(run_dir / "model", args.hub_model_id, token=args.hub_token)
    except (PublishError, ValueError) as err:
        token_note = " (with the token in HF_TOKEN or from `hf auth login`)" if args.hub_token else ""
        message = (
            f"The model is saved in {run_dir / 'model'} (results in {run_dir / 'results.json'}), but its upload "
            f"failed: {err} Finish the job with: {publish_command(run_dir, args.hub_model_id)}{token_note}"
        )
        logger.error("%s", message)
        return UploadFailedError(message)
    logger.info("Pushed to %s", url)
    return None
