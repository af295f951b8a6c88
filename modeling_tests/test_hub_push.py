"""Publishing to the Hub, for real, against the in-process Hub-protocol server (`hub_server.py`).

1. The server speaks the protocol the real `huggingface_hub` client uses (plain-file upload/download, LFS,
   revisions, errors with X-Error-Code, token checks, the refuse switch).
2. `model_cards.publish.push_to_hub`: what gets uploaded, and clear errors (no token, bad repo id, refused push)
   that leave the local checkpoint intact and never show the token. `train.py --push_to_hub`, checked before any
   work (no token, offline mode, an unreachable Hub, a rejected or read-only token, a namespace without write
   access), and a late upload failure that keeps the model and names the command that publishes it.
3. The round trip: a tiny model of every available variant is trained for a few steps, saved with its tokenizer and
   card, pushed; then a fresh process with an empty HF_HOME and without hf_variants importable loads it with the
   Auto classes and `pipeline("translation", ...)` from the server and must translate exactly like the local model.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import read_sentences, run_without_package
from conftest_hub import hub, module_hub  # noqa: F401  (fixtures)
from hub_server import git_blob_sha1
from huggingface_hub import (
    HfApi,
    ModelCard,
    constants,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from safetensors.numpy import save_file

from model_cards import publish
from model_cards.publish import PublishError, push_to_hub

pytestmark = pytest.mark.filterwarnings("ignore:Use .content=:DeprecationWarning")  # inside huggingface_hub

TOKEN = "hf_testTOKEN0123456789abcdefghijklmnop"


def tree_digest(folder: Path, skip=("README.md",)) -> dict[str, str]:
    """sha256 of every file under `folder` (the local checkpoint), except `skip`."""
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file() and p.name not in skip
    }


# ======================================================================================= 1. the server itself
def test_server_binds_localhost_on_an_os_chosen_port(hub):
    host, port = hub._httpd.server_address[:2]
    assert host == "127.0.0.1" and port > 0 and hub.url == f"http://127.0.0.1:{port}"


def test_server_upload_and_download_plain_files(hub, tmp_path):
    api = HfApi(endpoint=hub.url, token="t")
    assert api.create_repo("org/files") == f"{hub.url}/org/files"
    assert api.create_repo("org/files", exist_ok=True) == f"{hub.url}/org/files"  # 409 handled by the client
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo("org/files")
    assert err.value.response.status_code == 409

    folder = tmp_path / "up"
    (folder / "sub").mkdir(parents=True)
    files = {
        "notes.txt": b"hello hub\n",
        "sub/data.json": b'{"a": 1}',
        "weights.safetensors": os.urandom(4096),
        "blob.bin": bytes(range(256)) * 4,
    }
    for name, data in files.items():
        (folder / name).write_bytes(data)
    commit = api.upload_folder(folder_path=folder, repo_id="org/files", commit_message="add files")
    info = api.model_info("org/files", files_metadata=True)
    assert info.sha == commit.oid and commit.commit_url == f"{hub.url}/org/files/commit/{commit.oid}"
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == set(files) | {".gitattributes"}
    # Binary files went through the LFS batch API + PUT, text files inline (base64) in the NDJSON commit.
    assert {name for name, s in siblings.items() if s.lfs} == {"weights.safetensors", "blob.bin"}
    assert siblings["weights.safetensors"].lfs.sha256 == hashlib.sha256(files["weights.safetensors"]).hexdigest()
    assert siblings["notes.txt"].blob_id == git_blob_sha1(files["notes.txt"]) and siblings["notes.txt"].size == 10
    assert ("POST", "/org/files.git/info/lfs/objects/batch", 200) in hub.requests
    assert sum(1 for m, p, s in hub.requests if m == "PUT" and s == 200) == 2

    tree = {item.path: item for item in api.list_repo_tree("org/files", recursive=True)}
    assert set(tree) == set(siblings) | {"sub"}
    assert [item.path for item in api.list_repo_tree("org/files", path_in_repo="sub")] == ["sub/data.json"]

    cache = tmp_path / "cache"
    for name, data in files.items():
        path = hf_hub_download("org/files", name, cache_dir=cache, endpoint=hub.url, token="t")
        assert Path(path).read_bytes() == data
    meta = get_hf_file_metadata(hf_hub_url("org/files", "weights.safetensors", endpoint=hub.url), token="t")
    assert meta.commit_hash == commit.oid and meta.size == 4096
    assert meta.etag == hashlib.sha256(files["weights.safetensors"]).hexdigest()
    snapshot = Path(snapshot_download("org/files", cache_dir=tmp_path / "snap", endpoint=hub.url, token="t"))
    assert {n: (snapshot / n).read_bytes() for n in files} == files

    # A second commit changes one file; the first revision stays downloadable.
    (folder / "notes.txt").write_bytes(b"changed\n")
    second = api.upload_folder(folder_path=folder, repo_id="org/files")
    assert second.oid != commit.oid
    assert hub.files("org/files")["notes.txt"] == b"changed\n"
    old = hf_hub_download("org/files", "notes.txt", revision=commit.oid, cache_dir=cache, endpoint=hub.url, token="t")
    assert Path(old).read_bytes() == b"hello hub\n"
    api.delete_file("sub/data.json", repo_id="org/files")
    assert "sub/data.json" not in hub.files("org/files")


def test_server_errors_carry_hub_error_codes(hub, tmp_path):
    api = HfApi(endpoint=hub.url, token="t")
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    api.create_repo("org/errs")
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/errs", revision="no-such-branch")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/errs", "nope.json", cache_dir=tmp_path, endpoint=hub.url, token="t")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "config.json", cache_dir=tmp_path, endpoint=hub.url, token="t")


def test_server_checks_tokens_and_can_refuse_commits(hub, tmp_path):
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(endpoint=hub.url, token=False).create_repo("org/anon")  # no Authorization header at all
    assert err.value.response.status_code == 401
    hub.valid_tokens = {"good"}
    with pytest.raises(HfHubHTTPError) as err:
        HfApi(endpoint=hub.url, token="bad").create_repo("org/anon")
    assert err.value.response.status_code == 401
    api = HfApi(endpoint=hub.url, token="good")
    api.create_repo("org/refused")
    head = api.model_info("org/refused").sha
    for status in (403, 500):
        hub.refuse["commit"] = status
        with pytest.raises(HfHubHTTPError) as err:
            api.upload_file(path_or_fileobj=tmp_path / "f.txt", path_in_repo="f.txt", repo_id="org/refused")
        assert err.value.response.status_code == status
    assert api.model_info("org/refused").sha == head  # nothing was committed
    hub.refuse.clear()
    api.upload_file(path_or_fileobj=tmp_path / "f.txt", path_in_repo="f.txt", repo_id="org/refused")
    assert hub.files("org/refused")["f.txt"] == b"x"


def test_server_validates_card_metadata(hub, tmp_path):
    api = HfApi(endpoint=hub.url, token="t")
    api.create_repo("org/card")
    bad = (
        "---\nlicense: mit\nmodel-index:\n- name: m\n  results:\n  - task: {type: translation}\n"
        "    dataset: {type: d, name: D}\n---\n# card\n"
    )
    (tmp_path / "README.md").write_text(bad)
    with pytest.raises(ValueError, match="metrics"):
        api.upload_file(path_or_fileobj=tmp_path / "README.md", path_in_repo="README.md", repo_id="org/card")
    assert "README.md" not in hub.files("org/card")


# ======================================================================================= 2. push_to_hub
def fake_checkpoint(root: Path, model_type: str = "transformer_nmt") -> Path:
    """A run folder with a complete (untrained, torch-free) checkpoint: enough for push and error tests."""
    model_dir = root / "run" / "model"
    model_dir.mkdir(parents=True)
    config = {
        "model_type": model_type,
        "d_model": 8,
        "encoder_layers": 1,
        "decoder_layers": 1,
        "vocab_size": 16,
        "auto_map": {
            "AutoConfig": f"configuration_{model_type}.Config",
            "AutoModelForSeq2SeqLM": f"modeling_{model_type}.Model",
        },
        "custom_pipelines": {"translation": {"impl": "pipeline_translation.TranslationPipeline"}},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    for module in (f"configuration_{model_type}", f"modeling_{model_type}", "pipeline_translation"):
        (model_dir / f"{module}.py").write_text(f"# {module}\n")
    save_file({"w": np.arange(128, dtype=np.float32).reshape(16, 8)}, str(model_dir / "model.safetensors"))
    (model_dir / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (model_dir / "tokenizer_config.json").write_text("{}")
    (model_dir.parent / "results.json").write_text(
        json.dumps(
            {
                "model_type": model_type,
                "source_lang": "en",
                "target_lang": "de",
                "dataset": "multi30k",
                "eval_split": "test_2016_flickr",
                "bleu": 1.5,
                "chrf": 10.25,
                "sacrebleu_signature": "sig-b",
                "chrf_signature": "sig-c",
                "hyperparameters": {"lr": 0.01, "hub_token": TOKEN},
            }
        )
    )
    return model_dir


def test_push_uploads_model_tokenizer_code_and_card(hub, tmp_path, caplog, capfd):
    model_dir = fake_checkpoint(tmp_path)
    before = tree_digest(model_dir)
    with caplog.at_level(logging.DEBUG):
        url = push_to_hub(model_dir, "org/tiny-push", token=TOKEN)
    head = HfApi(endpoint=hub.url, token="t").model_info("org/tiny-push").sha
    assert url == f"{hub.url}/org/tiny-push/commit/{head}"
    remote = hub.files("org/tiny-push")
    local = {str(p.relative_to(model_dir)): p.read_bytes() for p in model_dir.rglob("*") if p.is_file()}
    assert {k: v for k, v in remote.items() if k not in (".gitattributes", "handler.py")} == local
    # Inference Endpoints' handler beside them (this folder's code names no transformers range: no requirements)
    assert remote["handler.py"] == publish.ENDPOINT_HANDLER.read_bytes() and "requirements.txt" not in remote
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "README.md",
        "modeling_transformer_nmt.py",
        "pipeline_translation.py",
    } <= set(remote)
    card = ModelCard(remote["README.md"].decode())
    assert card.data.eval_results[0].metric_value == 1.5 and "org/tiny-push" in card.text  # built from results.json
    assert ("POST", "/api/validate-yaml", 200) in hub.requests
    assert tree_digest(model_dir) == before  # only README.md was written
    # The token is nowhere: not in the repo, the folder, the logs or the console.
    out, errout = capfd.readouterr()
    assert all(TOKEN.encode() not in data for data in list(remote.values()) + list(local.values()))
    assert TOKEN not in caplog.text and TOKEN not in out + errout
    # Pushing again updates the repo in a new commit.
    (model_dir / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    url2 = push_to_hub(model_dir, "org/tiny-push", token=TOKEN, commit_message="retokenize")
    assert url2 != url and hub.files("org/tiny-push")["tokenizer_config.json"] == b'{"model_max_length": 64}'


def test_a_folder_with_its_own_handler_keeps_it(hub, tmp_path):
    model_dir = fake_checkpoint(tmp_path)
    (model_dir / "handler.py").write_text("# my own handler\n")
    (model_dir / "compat_transformer_nmt.py").write_text('SUPPORTED_RANGE = (">=5.23", "<5.25")\n')
    push_to_hub(model_dir, "org/own-handler", token=TOKEN)
    remote = hub.files("org/own-handler")
    assert remote["handler.py"] == b"# my own handler\n"
    assert remote["requirements.txt"].decode().splitlines()[-1] == "transformers>=5.23,<5.25"
    assert not (model_dir / "requirements.txt").exists()  # uploaded, never written into the folder


def test_push_without_token_fails_before_any_request(hub, tmp_path, monkeypatch):
    model_dir = fake_checkpoint(tmp_path)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_OIDC_RESOURCE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "no-stored-tokens"))
    before = tree_digest(model_dir, skip=())
    with pytest.raises(PublishError, match="No Hugging Face token"):
        push_to_hub(model_dir, "org/no-token")
    assert hub.requests == [] and tree_digest(model_dir, skip=()) == before


@pytest.mark.parametrize("repo_id", ["no-namespace", "a/b/c", "org/bad name", "org/-dash-", "org/x..y", ""])
def test_push_to_a_bad_repo_id_is_a_value_error(hub, tmp_path, repo_id):
    model_dir = fake_checkpoint(tmp_path)
    before = tree_digest(model_dir, skip=())
    with pytest.raises(ValueError, match="Invalid repo id"):
        push_to_hub(model_dir, repo_id, token=TOKEN)
    assert hub.requests == [] and tree_digest(model_dir, skip=()) == before


def test_push_of_an_incomplete_folder_names_what_is_missing(hub, tmp_path):
    model_dir = fake_checkpoint(tmp_path)
    (model_dir / "pipeline_translation.py").unlink()
    with pytest.raises(ValueError, match="pipeline_translation.py"):
        push_to_hub(model_dir, "org/x", token=TOKEN)
    (model_dir / "pipeline_translation.py").write_text("# pipeline_translation\n")
    (model_dir / "modeling_transformer_nmt.py").write_text("from .generation_transformer_nmt import Mixin\n")
    with pytest.raises(ValueError, match="generation_transformer_nmt.py"):  # a sibling the modeling code imports
        push_to_hub(model_dir, "org/x", token=TOKEN)
    (model_dir / "generation_transformer_nmt.py").write_text("from .loss_transformer_nmt import loss\n")
    with pytest.raises(ValueError, match="loss_transformer_nmt.py"):  # transitively
        push_to_hub(model_dir, "org/x", token=TOKEN)
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no weights"):
        push_to_hub(model_dir, "org/x", token=TOKEN)
    assert hub.requests == []


@pytest.mark.parametrize("refusal", [("commit", 403), ("commit", 500), ("lfs", 403), ("create", 403)])
def test_refused_push_is_clear_and_leaves_the_checkpoint_intact(hub, tmp_path, refusal):
    model_dir = fake_checkpoint(tmp_path)
    before = tree_digest(model_dir)
    operation, status = refusal
    hub.refuse[operation] = status
    with pytest.raises(PublishError) as err:
        push_to_hub(model_dir, "org/refused", token=TOKEN)
    message = str(err.value)
    assert f"HTTP {status}" in message and "org/refused" in message and "local checkpoint is unchanged" in message
    assert TOKEN not in message and err.value.__cause__ is None
    assert tree_digest(model_dir) == before
    if operation != "create":
        assert "model.safetensors" not in hub.files("org/refused")  # nothing committed


def test_rejected_token_is_reported_without_the_token(hub, tmp_path):
    hub.valid_tokens = {"some-other-token"}
    with pytest.raises(PublishError, match="HTTP 401, the token was rejected") as err:
        push_to_hub(fake_checkpoint(tmp_path), "org/x", token=TOKEN)
    assert TOKEN not in str(err.value)


def test_unreachable_hub_is_reported(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(PublishError, match=f"Could not reach http://127.0.0.1:{port}"):
        push_to_hub(fake_checkpoint(tmp_path), "org/x", token=TOKEN)


def test_cli(hub, tmp_path, monkeypatch, capsys):
    model_dir = fake_checkpoint(tmp_path)
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    from hf_variants.commands import publish as command

    assert command.main([str(model_dir.parent), "--repo_id", "org/cli"]) == 0
    out = capsys.readouterr().out.strip()
    assert out.startswith(f"{hub.url}/org/cli/commit/") and "config.json" in hub.files("org/cli")
    with pytest.raises(SystemExit) as exit_info:  # checked at parse time, before anything is read or sent
        command.main([str(model_dir.parent), "--repo_id", "bad id"])
    assert exit_info.value.code == 2 and "argument --repo_id: Invalid repo id" in capsys.readouterr().err


def test_training_script_push_to_hub(hub, tmp_path, monkeypatch):
    """`training/train.py --push_to_hub`: its real results.json becomes the card, everything is uploaded."""
    import gzip

    root = Path(__file__).resolve().parents[1]
    monkeypatch.syspath_prepend(str(root))
    from hf_variants.training import train

    data = tmp_path / "multi30k"
    data.mkdir()
    for split, n in (("train", 64), ("val", 4), ("test_2016_flickr", 4)):
        for lang in ("en", "de"):
            with gzip.open(data / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in read_sentences(lang, split, n=n)))
    monkeypatch.setenv("HF_TOKEN", TOKEN)
    run_dir = tmp_path / "run"
    train.main(
        [
            "--data_dir",
            str(data),
            "--preset",
            "tiny",
            "--vocab_size",
            "200",
            "--max_steps",
            "2",
            "--max_tokens",
            "512",
            "--warmup_steps",
            "1",
            "--eval_steps",
            "2",
            "--eval_bleu_pairs",
            "4",
            "--num_beams",
            "1",
            "--max_len_a",
            "0",
            "--max_len_b",
            "4",
            "--eval_batch_size",
            "8",
            "--num_examples",
            "0",
            "--output_dir",
            str(run_dir),
            "--push_to_hub",
            "--hub_model_id",
            "org/trained-by-script",
        ]
    )
    results = json.loads((run_dir / "results.json").read_text())
    remote = hub.files("org/trained-by-script")
    for path in (run_dir / "model").iterdir():
        assert remote[path.name] == path.read_bytes(), path.name
    card = ModelCard(remote["README.md"].decode())
    assert card.data.datasets == ["bentrevett/multi30k"] and card.data.language == ["en", "de"]
    assert [
        (r.metric_type, r.metric_value, r.dataset_split, r.metric_args["signature"]) for r in card.data.eval_results
    ] == [
        ("bleu", round(results["bleu"], 2), results["eval_split"], results["sacrebleu_signature"]),
        ("chrf", round(results["chrf"], 2), results["eval_split"], results["chrf_signature"]),
    ]
    assert f"{results['params']:,}" in card.text and f"**{results['train_pairs']}**" in card.text
    assert all(TOKEN.encode() not in blob for blob in remote.values())
    assert all(TOKEN.encode() not in p.read_bytes() for p in run_dir.rglob("*") if p.is_file())


# ====================================================================== --push_to_hub checked before training
@pytest.fixture(scope="module")
def push_data(tmp_path_factory):
    """64 training, 4 validation and 4 test pairs of Multi30k en-de (gzip files, the --data_dir layout)."""
    import gzip

    data = tmp_path_factory.mktemp("push_data")
    for split, n in (("train", 64), ("val", 4), ("test_2016_flickr", 4)):
        for lang in ("en", "de"):
            with gzip.open(data / f"{split}.{lang}.gz", "wt", encoding="utf-8") as f:
                f.write("".join(line + "\n" for line in read_sentences(lang, split, n=n)))
    return data


def push_args(data: Path, run_dir: Path, repo_id: str) -> list[str]:
    """A 2-step tiny run that trains its own tokenizer and pushes to `repo_id`."""
    return [
        "--data_dir",
        str(data),
        "--preset",
        "tiny",
        "--vocab_size",
        "200",
        "--max_steps",
        "2",
        "--max_tokens",
        "512",
        "--warmup_steps",
        "1",
        "--eval_steps",
        "2",
        "--eval_bleu_pairs",
        "0",
        "--num_beams",
        "1",
        "--max_len_b",
        "4",
        "--num_examples",
        "0",
        "--output_dir",
        str(run_dir),
        "--push_to_hub",
        "--hub_model_id",
        repo_id,
    ]


def train_process(args: list[str], env: dict, timeout: float = 300):
    """training/train.py in a new process, with `env` over this process's environment (HF_ENDPOINT: the server)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    child = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN")}
    child.update(
        {"PYTHONPATH": str(root), "HF_HUB_OFFLINE": "0", "TRANSFORMERS_OFFLINE": "0", "HF_HUB_DISABLE_XET": "1"}
    )
    child.update(env)
    return subprocess.run(
        [sys.executable, str(root / "training" / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={k: v for k, v in child.items() if v is not None},
    )


def assert_refused_before_any_work(proc, run_dir: Path, expected: str) -> None:
    """Exit status 2 with one line naming the problem; no data read, no tokenizer trained, no model built, and the
    run folder the launch created is gone."""
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: error: {expected}"), last
    assert "hf-variants-publish RUN_DIR --repo_id ID" in last and "Traceback" not in proc.stderr
    for work in ("Data: ", "Training a shared", "Model transformer_nmt"):
        assert work not in proc.stdout + proc.stderr, work
    assert not run_dir.exists()
    assert TOKEN not in proc.stdout + proc.stderr


@pytest.mark.parametrize("case", ["no token", "HF_HUB_OFFLINE=1"])
def test_push_to_hub_without_a_token_or_offline_is_refused_before_any_work(hub, push_data, tmp_path, case):
    """Real processes: --push_to_hub without a token, or in huggingface_hub's offline mode, stops within the launch
    (before the data, the tokenizer and the model), naming what is missing; no request reaches the Hub."""
    run_dir = tmp_path / "run"
    if case == "no token":
        env = {"HF_HOME": str(tmp_path / "empty_home")}  # no saved login either
        expected = "--push_to_hub: no Hugging Face token (--hub_token, the HF_TOKEN environment variable"
    else:
        env = {"HF_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}
        expected = "--push_to_hub: HF_HUB_OFFLINE=1 is set (huggingface_hub's offline mode)"
    started = time.time()
    proc = train_process(push_args(push_data, run_dir, "org/never"), env)
    seconds = time.time() - started
    assert_refused_before_any_work(proc, run_dir, expected)
    assert hub.requests == [] and "org/never" not in hub.repos
    print(f"{case}: refused in {seconds:.1f} s (the whole process)")


def test_push_to_hub_refusals_name_the_hub_and_the_token(hub, push_data, tmp_path, monkeypatch):
    """An unreachable Hub, a rejected token, a read-only token, and namespaces the token may not write to (a write
    token of an organization's reader, a fine-grained token without repo.write there) are refused before any work;
    the token never appears in the message."""
    import socket

    from hub_server import Identity

    from hf_variants.training import train
    from hf_variants.training.hub_preflight import HubPushError

    monkeypatch.setenv("HF_TOKEN", TOKEN)
    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    cases = {
        "unreachable": (lambda: monkeypatch.setenv("HF_ENDPOINT", closed), f"org/x: cannot reach {closed} ("),
        "rejected token": (
            lambda: setattr(hub, "valid_tokens", {"another-token"}),
            f"org/x: {hub.url} rejected the token (HTTP 401",
        ),
        "read-only token": (
            lambda: hub.identities.update({TOKEN: Identity(name="alice", role="read")}),
            "org/x: the token of alice is read-only",
        ),
        "an organization's reader": (
            lambda: hub.identities.update({TOKEN: Identity(name="alice", orgs={"org": "read"})}),
            "org/x: the token may not create or write repositories in the namespace org (HTTP 403)",
        ),
        "fine-grained, other namespace": (
            lambda: hub.identities.update(
                {TOKEN: Identity(name="alice", role="fineGrained", scoped_write=("alice",))}
            ),
            "org/x: the fine-grained token of alice has no write access (repo.write) to org",
        ),
    }
    for case, (arrange, expected) in cases.items():
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        hub.valid_tokens, hub.identities = None, {}
        arrange()
        run_dir = tmp_path / case.replace(" ", "_")
        with pytest.raises(HubPushError) as err:
            train.main(push_args(push_data, run_dir, "org/x"))
        message = str(err.value)
        assert message.startswith(f"--push_to_hub {expected}"), (case, message)
        assert TOKEN not in message and "Nothing was trained" in message
        assert not run_dir.exists(), case  # nothing was read, trained or built in it
        assert "org/x" not in hub.repos, case
    # a token that may write there passes, and the repository is created when the run starts
    hub.identities = {TOKEN: Identity(name="alice", role="fineGrained", scoped_write=("org",))}
    from hf_variants.training.hub_preflight import check_push_target

    check_push_target("org/x", TOKEN, hub.url)
    assert "org/x" in hub.repos
    # whoami's strict rate limit (HTTP 429) is no refusal: creating the repository checks the token instead
    hub.refuse["whoami"] = 429
    check_push_target("org/y", TOKEN, hub.url)
    hub.identities = {TOKEN: Identity(name="alice", orgs={"org": "read"})}
    with pytest.raises(HubPushError, match="may not create or write repositories in the namespace org"):
        check_push_target("org/z", TOKEN, hub.url)
    assert "org/y" in hub.repos and "org/z" not in hub.repos


def test_a_late_upload_failure_keeps_the_model_and_names_the_command_that_finishes_it(hub, push_data, tmp_path):
    """The Hub refuses the upload at the end of a real run: the model, its card and results.json stay, the exit
    status is 4 and the message is the exact hf-variants-publish command, which then publishes the model."""
    import shlex
    import sys

    run_dir = tmp_path / "run dir"  # a space: the command quotes the path
    hub.refuse["commit"] = 500
    proc = train_process(push_args(push_data, run_dir, "org/late"), {"HF_TOKEN": TOKEN})
    assert proc.returncode == 4, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"train.py: error: The model is saved in {run_dir / 'model'} (results in ")
    assert "HTTP 500" in last and TOKEN not in proc.stdout + proc.stderr
    command = last.split("Finish the job with: ")[1]
    assert shlex.split(command) == ["hf-variants-publish", str(run_dir), "--repo_id", "org/late"]
    assert (run_dir / "model" / "model.safetensors").is_file() and (run_dir / "model" / "README.md").is_file()
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 2
    assert "model.safetensors" not in hub.files("org/late")  # created when the run started, nothing committed
    del hub.refuse["commit"]
    from test_user_guide import run_command

    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setattr(sys, "argv", sys.argv)
        run_command(shlex.split(command), monkeypatch, written=set(), machines={})
    remote = hub.files("org/late")
    assert remote["model.safetensors"] == (run_dir / "model" / "model.safetensors").read_bytes()


# ======================================================================================= 3. the round trip
# Every variant, one line each: (tiny-config overrides, translation kwargs). Variants that hf_variants does not
# provide yet are skipped.
VARIANTS = {
    "transformer_nmt": ({}, {}),
    "mute_nmt": ({}, {}),
    "hysan_nmt": ({}, {}),
    "mgsa_nmt": ({"phrase_type": "ngram"}, {}),  # the syntactic default needs parses of every sentence
    "mimo_nmt": ({"languages": ["en", "de"], "target_language_tags": True}, {"tgt_lang": "de"}),
    "tied_nmt": ({}, {}),
}
TRAIN_STEPS = 5
TRAIN_PAIRS = 8
GENERATION = {"num_beams": 2, "max_new_tokens": 8, "min_new_tokens": 4}


def generation_kwargs(tokenizer) -> dict:
    """A few training steps may favour `</s>` or `<s>` everywhere: keep the compared outputs non-empty."""
    specials = sorted(set(tokenizer.all_special_ids) - {tokenizer.eos_token_id})
    return {**GENERATION, "suppress_tokens": specials}


def train_and_save(model_type: str, tokenizer, run_dir: Path) -> dict:
    """Train a tiny model a few steps on real Multi30k pairs, save it + tokenizer + results.json + card."""
    import sacrebleu
    import torch

    import hf_variants

    overrides, translate = VARIANTS[model_type]
    torch.manual_seed(0)
    config = hf_variants.CONFIG_CLASSES[model_type].from_preset(
        "tiny", vocab_size=len(tokenizer), dropout=0.0, **overrides
    )
    model = hf_variants.MODEL_CLASSES[model_type][2](config)
    pairs = sorted(zip(read_sentences("en", n=64), read_sentences("de", n=64)), key=lambda p: len(p[0]) + len(p[1]))
    src, tgt = map(list, zip(*pairs[:TRAIN_PAIRS]))  # the shortest real pairs: a cheap batch
    batch = model.prepare_translation_inputs(tokenizer, src, text_target=tgt, **translate)
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    losses, start = [], time.perf_counter()
    for _ in range(TRAIN_STEPS):
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        model.after_optimizer_step()
        losses.append(loss.item())
    wall = time.perf_counter() - start
    model.eval()
    assert losses[-1] < losses[0], f"{model_type} did not learn: {losses}"
    generation = generation_kwargs(tokenizer)
    model.generation_config.update(**generation)  # saved defaults: what the card's usage snippet runs with

    model_dir = run_dir / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)

    sentences, references = read_sentences("en", "val", n=3), read_sentences("de", "val", n=3)
    inputs = model.prepare_translation_inputs(tokenizer, sentences, **translate)
    with torch.no_grad():
        ids = model.generate(**inputs, **generation).tolist()
    # The local model's translations, decoded as the translation pipeline does.
    hypotheses = [tokenizer.decode(row, skip_special_tokens=True, clean_up_tokenization_spaces=False) for row in ids]
    texts = [{"translation_text": text} for text in hypotheses]
    bleu, chrf = sacrebleu.metrics.BLEU(), sacrebleu.metrics.CHRF()
    results = {
        "model_type": model_type,
        "variant": type(model).__name__,
        "source_lang": "en",
        "target_lang": "de",
        "languages": ["en", "de"],
        "dataset": "multi30k",
        "eval_split": "val",
        "bleu": bleu.corpus_score(hypotheses, [references]).score,
        "chrf": chrf.corpus_score(hypotheses, [references]).score,
        "sacrebleu_signature": str(bleu.get_signature()),
        "chrf_signature": str(chrf.get_signature()),
        "params": sum(p.numel() for p in model.parameters()),
        "train_tokens_per_sec": TRAIN_STEPS * int(batch["attention_mask"].sum()) / wall,
        "wall_time_sec": wall,
        "train_pairs": len(src),
        "dropped_pairs": 0,
        "dropped_reasons": {},
        "steps": TRAIN_STEPS,
        "epochs": float(TRAIN_STEPS),
        "hyperparameters": {"learning_rate": 3e-3, "batch_size": len(src)},
        "base_model": None,
    }
    (run_dir / "results.json").write_text(json.dumps(results))
    return {
        "sentences": sentences,
        "translate": translate,
        "generation": generation,
        "ids": ids,
        "texts": texts,
        "results": results,
    }


def usage_snippet(readme: str) -> str:
    """The Python code of the card's usage section."""
    match = re.search(r"^## Usage\n\n```python\n(.*?)^```", readme, re.S | re.M)
    assert match, "no usage snippet in the card"
    return match.group(1)


def run_snippet(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(code, {"__name__": "__snippet__"})
    return out.getvalue()


@pytest.fixture(scope="module")
def published(module_hub, tokenizer, tmp_path_factory):
    """Train, save, card and push every available variant; then load them all in one fresh process."""
    import hf_variants

    available = [mt for mt in VARIANTS if mt in hf_variants.MODEL_CLASSES]
    local, urls = {}, {}
    for model_type in available:
        run_dir = tmp_path_factory.mktemp(f"run-{model_type}")
        local[model_type] = train_and_save(model_type, tokenizer, run_dir)
        repo_id = f"hf-variants-test/{model_type.replace('_', '-')}-tiny"
        local[model_type]["repo_id"] = repo_id
        local[model_type]["model_dir"] = run_dir / "model"
        urls[model_type] = push_to_hub(run_dir / "model", repo_id, token=TOKEN)  # card from run_dir/results.json
        # The card's usage snippet, run here on the local folder (the fresh process runs it on the Hub repo).
        snippet = usage_snippet(module_hub.files(repo_id)["README.md"].decode())
        local[model_type]["snippet"] = snippet
        local[model_type]["snippet_output"] = run_snippet(
            snippet.replace(f'"{repo_id}"', repr(str(run_dir / "model")))
        )

    hf_home = tmp_path_factory.mktemp("fresh-hf-home")
    jobs = [
        (
            local[mt]["repo_id"],
            local[mt]["sentences"],
            local[mt]["translate"],
            local[mt]["generation"],
            local[mt]["snippet"],
        )
        for mt in available
    ]
    code = f"""
        import contextlib, io, json
        from pathlib import Path
        home = Path(os.environ["HF_HOME"])
        assert not any(home.iterdir()), "HF_HOME is not empty"
        from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, pipeline
        from huggingface_hub import snapshot_download
        out = {{}}
        for repo, sentences, translate, generation, snippet in {jobs!r}:
            model = AutoModelForSeq2SeqLM.from_pretrained(repo, trust_remote_code=True).eval()
            tokenizer = AutoTokenizer.from_pretrained(repo, trust_remote_code=True)
            inputs = model.prepare_translation_inputs(tokenizer, sentences, **translate)
            ids = model.generate(**inputs, **generation).tolist()
            translator = pipeline("translation", model=repo, trust_remote_code=True)
            texts = translator(sentences, **translate, **generation)
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                exec(snippet, {{"__name__": "__snippet__"}})  # the model card's usage section, verbatim
            # Inference Endpoints: the repository's handler.py, imported from a downloaded copy and called
            folder = snapshot_download(repo)
            spec = importlib.util.spec_from_file_location("handler", os.path.join(folder, "handler.py"))
            handler_module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(handler_module)
            handler = handler_module.EndpointHandler(folder)
            # (the saved generation config holds `generation`: the request names the beam size only)
            endpoint = handler({{"inputs": sentences, "parameters": {{**translate, "num_beams": 2}}}})
            try:
                handler({{"inputs": sentences, "parameters": {{"model": "/etc/passwd"}}}})
                refused = ""
            except ValueError as error:
                refused = str(error)
            out[repo] = {{"ids": ids, "texts": texts, "module": type(model).__module__,
                         "pipeline": type(translator).__module__, "snippet_output": printed.getvalue(),
                         "endpoint": endpoint, "refused": refused,
                         "handler_pipeline": type(handler.pipeline).__module__}}
        out["cached_repos"] = sorted(p.name for p in (home / "hub").iterdir() if p.name.startswith("models--"))
        print(json.dumps(out))
    """
    env = {
        "HF_ENDPOINT": module_hub.url,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HOME": str(hf_home),
        "HF_TOKEN": "x",
        "HF_HUB_OFFLINE": "0",
        "TRANSFORMERS_OFFLINE": "0",
        "TMPDIR": str(tmp_path_factory.mktemp("cwd")),
    }
    remote = json.loads(run_without_package(code, env=env).strip().splitlines()[-1])
    return {"local": local, "remote": remote, "urls": urls, "hub": module_hub}


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_pushed_model_translates_like_the_local_model_in_a_fresh_process(published, model_type):
    if model_type not in published["local"]:
        pytest.skip(f"hf_variants does not provide {model_type} yet")
    local = published["local"][model_type]
    repo_id = local["repo_id"]
    remote = published["remote"][repo_id]
    assert remote["module"].startswith("transformers_modules"), remote["module"]  # the Hub's code, not ours
    assert remote["pipeline"].startswith("transformers_modules"), remote["pipeline"]
    assert remote["ids"] == local["ids"]
    assert remote["texts"] == local["texts"]
    # Inference Endpoints' handler (handler.py of a downloaded copy, in the same fresh process) answers the same
    assert remote["endpoint"] == local["texts"] and remote["handler_pipeline"].startswith("transformers_modules")
    assert remote["refused"].startswith("unknown parameter `model`")
    assert all(t["translation_text"].strip() for t in local["texts"])  # non-trivial outputs were compared
    # The card's usage snippet runs as written and prints the local model's translation.
    assert remote["snippet_output"] == local["snippet_output"] and local["snippet_output"].strip()
    # Everything came from the server into the empty HF_HOME.
    assert f"models--{repo_id.replace('/', '--')}" in published["remote"]["cached_repos"]
    assert (
        "GET",
        f"/{repo_id}/resolve/{published['urls'][model_type].rsplit('/', 1)[-1]}/model.safetensors",
        200,
    ) in published["hub"].requests


@pytest.mark.parametrize("model_type", list(VARIANTS))
def test_pushed_repo_has_card_code_and_weights(published, model_type):
    if model_type not in published["local"]:
        pytest.skip(f"hf_variants does not provide {model_type} yet")
    local = published["local"][model_type]
    files = published["hub"].files(local["repo_id"])
    model_dir = local["model_dir"]
    for path in model_dir.iterdir():
        assert files[path.name] == path.read_bytes(), path.name  # every file pushed byte for byte
    config = json.loads(files["config.json"])
    code = {ref.split(".")[0] + ".py" for ref in config["auto_map"].values()}
    code.add(config["custom_pipelines"]["translation"]["impl"].split(".")[0] + ".py")
    assert code <= set(files)
    card = ModelCard(files["README.md"].decode())
    results = local["results"]
    assert card.data.tags[:3] == ["translation", "hf-variants", model_type]
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [
        ("bleu", round(results["bleu"], 2)),
        ("chrf", round(results["chrf"], 2)),
    ]
    assert f'from_pretrained("{local["repo_id"]}", trust_remote_code=True)' in card.text
    assert f"{results['params']:,}" in card.text
    assert TOKEN.encode() not in b"".join(files.values())


# ======================================================================= 4. transformers' own push_to_hub
def saved_run_with_card(root: Path):
    """A tiny real model saved as a training run saves it (run/model + results.json) with its generated card."""
    from hf_variants import TransformerNmtConfig, TransformerNmtForConditionalGeneration
    from model_cards.card import card_from_run

    config = TransformerNmtConfig.from_preset(
        "tiny", vocab_size=32, pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1
    )
    model_dir = root / "run" / "model"
    TransformerNmtForConditionalGeneration(config).save_pretrained(model_dir)
    results = {
        "model_type": "transformer_nmt",
        "source_lang": "en",
        "target_lang": "fr",
        "languages": ["en", "fr"],
        "dataset": "data/train.tsv",
        "eval_split": "data/test.tsv",
        "bleu": 3.25,
        "chrf": 21.5,
        "hyperparameters": {"train_file": "data/train.tsv", "test_file": "data/test.tsv", "learning_rate": 0.002},
    }
    (model_dir.parent / "results.json").write_text(json.dumps(results))
    card_from_run(model_dir.parent)  # as train.py does at the end of a run (no --hub_model_id: a placeholder id)
    return model_dir, results


@pytest.fixture
def transformers_hub(hub, monkeypatch):
    """`hub`, also for transformers' push_to_hub (its shared HfApi and huggingface_hub's endpoint are fixed at
    import time)."""
    import transformers.utils.hub as transformers_hub_utils

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", hub.url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(transformers_hub_utils, "_hf_api", HfApi(endpoint=hub.url, library_name="transformers"))
    return hub


def test_model_push_to_hub_uploads_the_run_card(transformers_hub, tmp_path):
    """`AutoModelForSeq2SeqLM.from_pretrained(run/model).push_to_hub(repo)` uploads the run's card (with the repo id in
    its usage snippet), not transformers' placeholder card; a model whose weights changed since does not claim it."""
    from transformers import AutoModelForSeq2SeqLM

    hub = transformers_hub
    model_dir, results = saved_run_with_card(tmp_path)
    local_card = (model_dir / "README.md").read_text(encoding="utf-8")
    assert '"ORG/NAME"' in local_card
    model = AutoModelForSeq2SeqLM.from_pretrained(model_dir)
    model.push_to_hub("org/pushed-by-transformers", token=TOKEN)
    remote = hub.files("org/pushed-by-transformers")
    uploaded = remote["README.md"].decode()
    assert uploaded == "\n".join(
        line
        for line in local_card.replace('"ORG/NAME"', '"org/pushed-by-transformers"').split("\n")
        if not line.startswith("Replace `ORG/NAME`")
    )
    card = ModelCard(uploaded)
    assert [(r.metric_type, r.metric_value) for r in card.data.eval_results] == [("bleu", 3.25), ("chrf", 21.5)]
    assert "automatically generated" not in uploaded and "ORG/NAME" not in uploaded
    assert 'from_pretrained("org/pushed-by-transformers", trust_remote_code=True)' in uploaded
    assert remote["model.safetensors"] == (model_dir / "model.safetensors").read_bytes()
    # save_pretrained(push_to_hub=True) into another folder: the same card
    model.save_pretrained(tmp_path / "copy", push_to_hub=True, repo_id="org/saved-and-pushed", token=TOKEN)
    assert (
        ModelCard(hub.files("org/saved-and-pushed")["README.md"].decode()).data.eval_results == card.data.eval_results
    )
    # fine-tuned weights: the run's card no longer describes them
    with torch_no_grad():
        next(model.parameters()).add_(1.0)
    model.push_to_hub("org/changed", token=TOKEN)
    changed = hub.files("org/changed")["README.md"].decode()
    assert "automatically generated" in changed and "3.25" not in changed


def torch_no_grad():
    import torch

    return torch.no_grad()


def test_push_logs_no_http_requests(hub, tmp_path, caplog):
    """A push at INFO logs what it does, not each HTTP request of the client (httpx2 logs them at INFO); the
    client's loggers are as before afterwards."""
    model_dir = fake_checkpoint(tmp_path)
    levels = {name: logging.getLogger(name).level for name in publish.HTTP_LOGGERS}
    with caplog.at_level(logging.INFO):
        push_to_hub(model_dir, "org/quiet", token=TOKEN)
    assert ("POST", "/api/repos/create", 200) in hub.requests  # requests were made
    assert [r.getMessage() for r in caplog.records if r.name.startswith(("httpx", "httpcore"))] == []
    assert any("Pushed org/quiet" in r.getMessage() for r in caplog.records)
    assert {name: logging.getLogger(name).level for name in publish.HTTP_LOGGERS} == levels


def test_publish_module_runs_without_runpy_warning():
    """`python -m model_cards.publish` (and `.card`): the package does not import the module before runpy runs it."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    for module in ("model_cards.publish", "model_cards.card"):
        proc = subprocess.run(
            [sys.executable, "-W", "error::RuntimeWarning", "-m", module, "--help"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0 and "RuntimeWarning" not in proc.stderr, (module, proc.stderr[-500:])
        assert "usage:" in proc.stdout
