"""A small in-process Hugging Face Hub-protocol server for tests (stdlib only).

The real Hub cannot be reached from the test machines and no installable server accepts uploads, so the push
and load paths are tested against this server, driven by the real `huggingface_hub` client and by
`transformers`' `from_pretrained`. It implements the endpoints listed in `shared/docs/hub-protocol.md`:

=========================================================  ======================================================
`GET  /api/whoami-v2`                                       the token's user, organizations and token role
`POST /api/repos/create`                                    create a model repo (409 when it exists; 403 for a
                                                            read-only token or a namespace it may not write)
`POST /api/validate-yaml`                                   check a README's YAML metadata (400 + `errors`)
`POST /api/models/{ns}/{name}/preupload/{rev}`              `uploadMode` regular/lfs per file, remote `oid`
`POST /{ns}/{name}.git/info/lfs/objects/batch`              git-lfs batch API, `basic` transfer, upload hrefs
`PUT  /lfs-upload/{ns}/{name}/{oid}?sig=...`                the upload href (signed: the client sends no token)
`POST /api/models/{ns}/{name}/commit/{rev}`                 NDJSON: header, file (base64), lfsFile, deleted*
`GET  /api/models/{ns}/{name}[/revision/{rev}]`             model info: sha, siblings (+ sizes with `blobs`)
`GET  /api/models/{ns}/{name}/tree/{rev}[/{path}]`          files and folders (`recursive`), lfs info
`HEAD|GET /{ns}/{name}/resolve/{rev}/{path}`                file bytes; `X-Repo-Commit`, `ETag`,
                                                            `X-Linked-Etag`/`X-Linked-Size` for LFS files
=========================================================  ======================================================

Errors carry `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`) and `X-Error-Message`, as
the client maps them to its exception classes. Only model repos exist. Blobs live in a temporary directory
(content-addressed); commits, refs and trees live in memory.

Test switches:

- `require_token` (default True): every `/api/...` and `.git/...` request needs `Authorization: Bearer <t>`;
  `valid_tokens` (optional set) additionally restricts which tokens are accepted (401 otherwise).
- `refuse`: a dict `{operation: HTTP status}` that makes an operation fail, e.g. `server.refuse["commit"] = 403`.
  Operations: `whoami`, `create`, `validate`, `preupload`, `lfs`, `commit`, `info`, `tree`, `resolve`.
- `identities`: `{token: Identity(...)}`, who a token is (user name, organizations with the role in each, the
  token's role `write`/`read`/`fineGrained` and a fine-grained token's `repo.write` namespaces), as the Hub's
  `whoami-v2` reports it; creating a repo checks it. Any other accepted token is the `default_namespace` user with
  a write token allowed to create repos in every namespace (what the suite's uploads use).

The server binds 127.0.0.1 on an OS-chosen port. It never logs request headers (so no token reaches a log);
`server.requests` records `(method, path, status)` for assertions.

Usage::

    with HubServer() as hub:
        api = HfApi(endpoint=hub.url, token="x")   # and HF_HUB_DISABLE_XET=1 for uploads
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from fnmatch import fnmatch
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlsplit

LFS_THRESHOLD = 10 * 1024 * 1024  # the Hub stores files above 10 MB with LFS whatever their type
# The `.gitattributes` a new Hub repo starts with (abridged: the patterns relevant to model repos).
DEFAULT_GITATTRIBUTES = "".join(
    f"{pattern} filter=lfs diff=lfs merge=lfs -text\n"
    for pattern in (
        "*.7z",
        "*.arrow",
        "*.bin",
        "*.bz2",
        "*.ckpt",
        "*.ftz",
        "*.gz",
        "*.h5",
        "*.joblib",
        "*.lfs.*",
        "*.mlmodel",
        "*.model",
        "*.msgpack",
        "*.npy",
        "*.npz",
        "*.onnx",
        "*.ot",
        "*.parquet",
        "*.pb",
        "*.pickle",
        "*.pkl",
        "*.pt",
        "*.pth",
        "*.rar",
        "*.safetensors",
        "saved_model/**/*",
        "*.tar.*",
        "*.tar",
        "*.tflite",
        "*.tgz",
        "*.wasm",
        "*.xz",
        "*.zip",
        "*.zst",
        "*tfevents*",
    )
)
NAME_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9_])?$")
SHA1_RE = re.compile(r"^[0-9a-f]{40}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def git_blob_sha1(data: bytes) -> str:
    """The git object id of a blob (what the Hub reports as a regular file's oid/ETag)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def lfs_pointer(sha256: str, size: int) -> bytes:
    return f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()


def _now_iso() -> str:
    t = time.time()
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


@dataclass
class Entry:
    """One file of a commit's tree."""

    size: int
    git_oid: str  # sha1 of the git blob (for LFS files: of the pointer file)
    sha256: str | None = None  # set for LFS files
    blob_key: str = ""  # where the bytes are stored

    @property
    def is_lfs(self) -> bool:
        return self.sha256 is not None


@dataclass
class Commit:
    oid: str
    parent: str | None
    summary: str
    description: str
    date: str
    files: dict[str, Entry]


@dataclass
class Repo:
    repo_id: str
    private: bool
    created_at: str
    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, Commit] = field(default_factory=dict)


@dataclass
class Identity:
    """Who a token belongs to and what it may do (the fields of the Hub's `/api/whoami-v2`)."""

    name: str = "user"
    orgs: dict[str, str] = field(default_factory=dict)  # organization -> roleInOrg (admin, write, contributor, read)
    role: str = "write"  # the token's role: write, read or fineGrained
    scoped_write: tuple[str, ...] = ()  # fineGrained: the namespaces it holds `repo.write` on

    def can_write(self, namespace: str) -> bool:
        if self.role == "read":
            return False
        if self.role == "fineGrained":
            return namespace in self.scoped_write
        return namespace == self.name or self.orgs.get(namespace) in ("admin", "write", "contributor")

    def whoami(self) -> dict:
        token: dict = {"displayName": "test token", "role": self.role}
        if self.role == "fineGrained":
            token["fineGrained"] = {
                "global": [],
                "scoped": [
                    {
                        "entity": {"type": "user" if ns == self.name else "org", "name": ns},
                        "permissions": ["repo.content.read", "repo.write"],
                    }
                    for ns in self.scoped_write
                ],
            }
        return {
            "type": "user",
            "name": self.name,
            "fullname": self.name,
            "orgs": [{"type": "org", "name": org, "roleInOrg": role} for org, role in self.orgs.items()],
            "auth": {"type": "access_token", "accessToken": token},
        }


class HubError(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, extra: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.extra = status, message, code, extra or {}


class HubServer:
    """Threaded Hub-protocol server on 127.0.0.1 (see the module docstring)."""

    def __init__(
        self,
        root: str | None = None,
        *,
        require_token: bool = True,
        valid_tokens: set[str] | None = None,
        lfs_threshold: int = LFS_THRESHOLD,
        default_namespace: str = "user",
    ):
        self._own_root = root is None
        self.root = root or tempfile.mkdtemp(prefix="hub-server-")
        os.makedirs(os.path.join(self.root, "objects"), exist_ok=True)
        self.require_token = require_token
        self.valid_tokens = valid_tokens
        self.lfs_threshold = lfs_threshold
        self.default_namespace = default_namespace
        self.refuse: dict[str, int] = {}
        self.identities: dict[str, Identity] = {}
        self.requests: list[tuple[str, str, int]] = []
        self.repos: dict[str, Repo] = {}
        self.lfs_objects: dict[str, int] = {}  # sha256 -> size of uploaded LFS objects
        self._lock = threading.RLock()
        self._secret = secrets.token_bytes(16)
        self._counter = 0
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "HubServer":
        handler = type("BoundHubHandler", (_Handler,), {"hub": self})
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="hub-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "HubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        assert self._httpd is not None, "server not started"
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    # ------------------------------------------------------------------ storage helpers (also used by tests)
    def _store(self, data: bytes) -> str:
        key = hashlib.sha256(data).hexdigest()
        path = os.path.join(self.root, "objects", key)
        if not os.path.exists(path):
            tmp = f"{path}.{threading.get_ident()}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        return key

    def _read(self, key: str) -> bytes:
        with open(os.path.join(self.root, "objects", key), "rb") as f:
            return f.read()

    def get_repo(self, repo_id: str) -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None:
            raise HubError(404, f"Repository {repo_id} not found", "RepoNotFound")
        return repo

    def resolve_revision(self, repo: Repo, rev: str) -> Commit:
        rev = unquote(rev)
        oid = repo.refs.get(rev) or repo.refs.get(rev.removeprefix("refs/heads/"))
        if oid is None and SHA1_RE.match(rev) and rev in repo.commits:
            oid = rev
        if oid is None:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return repo.commits[oid]

    def files(self, repo_id: str, revision: str = "main") -> dict[str, bytes]:
        """All files of a revision, path -> bytes (for assertions in tests)."""
        with self._lock:
            commit = self.resolve_revision(self.get_repo(repo_id), revision)
            return {path: self._read(e.blob_key) for path, e in commit.files.items()}

    def _new_commit(
        self, repo: Repo, parent: Commit | None, files: dict[str, Entry], summary: str, description: str = ""
    ) -> Commit:
        self._counter += 1
        h = hashlib.sha1()
        h.update(f"{repo.repo_id}\n{parent.oid if parent else ''}\n{summary}\n{self._counter}\n".encode())
        for path in sorted(files):
            h.update(f"{path}\0{files[path].git_oid}\n".encode())
        commit = Commit(h.hexdigest(), parent.oid if parent else None, summary, description, _now_iso(), files)
        repo.commits[commit.oid] = commit
        return commit

    def _regular_entry(self, data: bytes) -> Entry:
        return Entry(size=len(data), git_oid=git_blob_sha1(data), blob_key=self._store(data))

    def _lfs_patterns(self, commit: Commit) -> list[str]:
        entry = commit.files.get(".gitattributes")
        if entry is None:
            return []
        patterns = []
        for line in self._read(entry.blob_key).decode("utf-8", "replace").splitlines():
            parts = line.split()
            if len(parts) >= 2 and "filter=lfs" in parts[1:]:
                patterns.append(parts[0])
        return patterns

    def _sign(self, repo_id: str, oid: str) -> str:
        return hmac.new(self._secret, f"{repo_id}:{oid}".encode(), hashlib.sha256).hexdigest()

    def _check_refused(self, operation: str) -> None:
        status = self.refuse.get(operation)
        if status:
            raise HubError(status, f"The server refused the {operation} request (test switch)")

    # ------------------------------------------------------------------ endpoint implementations
    def whoami(self, token: str | None) -> tuple[int, dict]:
        self._check_refused("whoami")
        if token is None:
            raise HubError(401, "Unauthorized")
        identity = self.identities.get(token) or Identity(name=self.default_namespace)
        return 200, identity.whoami()

    def create_repo(self, body: dict, token: str | None) -> tuple[int, dict]:
        self._check_refused("create")
        if body.get("type", "model") not in (None, "model"):
            raise HubError(400, "This test server only hosts model repos")
        identity = self.identities.get(token) if token is not None else None
        name = body.get("name")
        namespace = body.get("organization") or (identity.name if identity else self.default_namespace)
        if not isinstance(name, str) or not NAME_RE.match(name) or not NAME_RE.match(namespace):
            raise HubError(400, f"Invalid repo name {namespace}/{name}")
        if identity is not None and not identity.can_write(namespace):
            raise HubError(403, f'You don\'t have the rights to create a model under the namespace "{namespace}"')
        repo_id = f"{namespace}/{name}"
        url = f"{self.url}/{repo_id}"
        with self._lock:
            if repo_id in self.repos:
                raise HubError(409, "You already created this model repo", None, {"url": url})
            private = body.get("private")
            if private is None:
                private = body.get("visibility") == "private"
            repo = Repo(repo_id, bool(private), _now_iso())
            init = self._new_commit(
                repo, None, {".gitattributes": self._regular_entry(DEFAULT_GITATTRIBUTES.encode())}, "initial commit"
            )
            repo.refs["main"] = init.oid
            self.repos[repo_id] = repo
        return 200, {"url": url, "name": repo_id, "id": f"{len(self.repos):024x}"}

    def validate_yaml(self, body: dict) -> tuple[int, dict]:
        self._check_refused("validate")
        errors = validate_card_metadata(body.get("content", ""))
        if errors:
            return 400, {"errors": [{"message": e} for e in errors], "warnings": []}
        return 200, {"errors": [], "warnings": []}

    def preupload(self, repo_id: str, rev: str, body: dict) -> tuple[int, dict]:
        self._check_refused("preupload")
        with self._lock:
            repo = self.get_repo(repo_id)
            commit = self.resolve_revision(repo, rev)
            patterns = self._lfs_patterns(commit)
            out = []
            for f in body.get("files", []):
                path, size = f["path"], int(f["size"])
                sample = base64.b64decode(f.get("sample", ""))
                basename = path.rsplit("/", 1)[-1]
                lfs = (
                    size > self.lfs_threshold
                    or b"\0" in sample
                    or any(fnmatch(path, p) or fnmatch(basename, p) for p in patterns)
                )
                existing = commit.files.get(path)
                oid = None
                if existing is not None:
                    oid = existing.sha256 if existing.is_lfs else existing.git_oid
                out.append(
                    {"path": path, "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": oid}
                )
        return 200, {"files": out, "commitOid": commit.oid}

    def lfs_batch(self, repo_id: str, body: dict) -> tuple[int, dict]:
        self._check_refused("lfs")
        if body.get("operation") != "upload":
            raise HubError(400, "Only the upload operation is supported")
        with self._lock:
            self.get_repo(repo_id)
        objects = []
        for obj in body.get("objects", []):
            oid, size = obj.get("oid", ""), obj.get("size")
            if not SHA256_RE.match(oid) or not isinstance(size, int):
                objects.append(
                    {"oid": str(oid), "size": int(size or 0), "error": {"code": 422, "message": "invalid oid or size"}}
                )
            elif self.lfs_objects.get(oid) == size:
                objects.append({"oid": oid, "size": size})  # already stored: no actions
            else:
                href = f"{self.url}/lfs-upload/{repo_id}/{oid}?sig={self._sign(repo_id, oid)}"
                objects.append(
                    {
                        "oid": oid,
                        "size": size,
                        "authenticated": True,
                        "actions": {"upload": {"href": href, "expires_in": 3600}},
                    }
                )
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def lfs_put(self, repo_id: str, oid: str, query: dict, data: bytes) -> tuple[int, dict]:
        self._check_refused("lfs")
        sig = query.get("sig", [""])[0]
        if not hmac.compare_digest(sig, self._sign(repo_id, oid)):
            raise HubError(403, "Invalid upload signature")
        if hashlib.sha256(data).hexdigest() != oid:
            raise HubError(400, "Uploaded content does not match its sha256 oid")
        self._store(data)
        with self._lock:
            self.lfs_objects[oid] = len(data)
        return 200, {}

    def commit(self, repo_id: str, rev: str, query: dict, raw: bytes) -> tuple[int, dict]:
        self._check_refused("commit")
        if query.get("create_pr", ["0"])[0] == "1":
            raise HubError(400, "Pull requests are not supported by the test server")
        try:
            lines = [json.loads(line) for line in raw.decode("utf-8").splitlines() if line.strip()]
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise HubError(400, f"Malformed NDJSON commit payload: {err}")
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "The first NDJSON line must be the commit header")
        header = lines[0].get("value", {})
        with self._lock:
            repo = self.get_repo(repo_id)
            branch = unquote(rev).removeprefix("refs/heads/")
            if branch not in repo.refs:
                raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
            parent = repo.commits[repo.refs[branch]]
            if header.get("parentCommit") and header["parentCommit"] != parent.oid:
                raise HubError(412, "A commit has happened since. Please refresh and try again.")
            files = dict(parent.files)
            for line in lines[1:]:
                key, value = line.get("key"), line.get("value", {})
                path = value.get("path", "")
                if not path or path.startswith("/") or ".." in path.split("/"):
                    raise HubError(400, f"Invalid path {path!r}")
                if key == "file":
                    if value.get("encoding") != "base64":
                        raise HubError(400, "Only base64-encoded files are supported")
                    files[path] = self._regular_entry(base64.b64decode(value["content"]))
                elif key == "lfsFile":
                    oid, size = value.get("oid", ""), value.get("size")
                    if self.lfs_objects.get(oid) != size:
                        raise HubError(422, f"LFS object {oid} of {path} was not uploaded")
                    files[path] = Entry(
                        size=size, git_oid=git_blob_sha1(lfs_pointer(oid, size)), sha256=oid, blob_key=oid
                    )
                elif key == "deletedFile":
                    if files.pop(path, None) is None:
                        raise HubError(404, f"A file with this name doesn't exist: {path}", "EntryNotFound")
                elif key == "deletedFolder":
                    prefix = path.rstrip("/") + "/"
                    for p in [p for p in files if p.startswith(prefix)]:
                        del files[p]
                else:
                    raise HubError(400, f"Unsupported commit operation {key!r}")
            new = self._new_commit(repo, parent, files, header.get("summary", ""), header.get("description", ""))
            repo.refs[branch] = new.oid
        return 200, {
            "success": True,
            "commitOid": new.oid,
            "commitUrl": f"{self.url}/{repo_id}/commit/{new.oid}",
            "pullRequestUrl": None,
        }

    def model_info(self, repo_id: str, rev: str, query: dict) -> tuple[int, dict]:
        self._check_refused("info")
        with self._lock:
            repo = self.get_repo(repo_id)
            commit = self.resolve_revision(repo, rev)
            blobs = query.get("blobs", ["false"])[0].lower() in ("1", "true")
            siblings = []
            for path in sorted(commit.files):
                e = commit.files[path]
                sib: dict = {"rfilename": path}
                if blobs:
                    sib.update(size=e.size, blobId=e.git_oid)
                    if e.is_lfs:
                        sib["lfs"] = {
                            "size": e.size,
                            "sha256": e.sha256,
                            "pointerSize": len(lfs_pointer(e.sha256, e.size)),
                        }
                siblings.append(sib)
            meta = (
                _card_metadata(self._read(commit.files["README.md"].blob_key).decode("utf-8", "replace"))
                if "README.md" in commit.files
                else {}
            )
            config = {}
            if "config.json" in commit.files:
                try:
                    config = json.loads(self._read(commit.files["config.json"].blob_key))
                except ValueError:
                    config = {}
            tags = list(meta.get("tags") or []) if isinstance(meta, dict) else []
            if isinstance(config, dict) and config.get("auto_map"):
                tags.append("custom_code")
            ns = repo_id.split("/")[0]
            return 200, {
                "_id": hashlib.sha1(repo_id.encode()).hexdigest()[:24],
                "id": repo_id,
                "modelId": repo_id,
                "author": ns,
                "sha": commit.oid,
                "lastModified": commit.date,
                "createdAt": repo.created_at,
                "private": repo.private,
                "disabled": False,
                "gated": False,
                "downloads": 0,
                "likes": 0,
                "tags": tags,
                "library_name": meta.get("library_name") if isinstance(meta, dict) else None,
                "pipeline_tag": meta.get("pipeline_tag") if isinstance(meta, dict) else None,
                "cardData": meta or None,
                "config": {k: config[k] for k in ("architectures", "model_type", "auto_map") if k in config} or None,
                "siblings": siblings,
                "spaces": [],
                "usedStorage": sum(e.size for e in commit.files.values()),
            }

    def tree(self, repo_id: str, rev: str, path: str, query: dict) -> tuple[int, list]:
        self._check_refused("tree")
        recursive = query.get("recursive", ["false"])[0].lower() in ("1", "true")
        path = unquote(path).strip("/")
        with self._lock:
            commit = self.resolve_revision(self.get_repo(repo_id), rev)
            prefix = f"{path}/" if path else ""
            if path and path in commit.files:
                raise HubError(404, f"{path} is a file, not a folder", "EntryNotFound")
            below = {p: e for p, e in commit.files.items() if p.startswith(prefix)}
            if path and not below:
                raise HubError(404, f"{path} does not exist on {rev}", "EntryNotFound")
            items, folders = [], set()
            for p in sorted(below):
                rel = p[len(prefix) :]
                parts = rel.split("/")
                for depth in range(1, len(parts)):
                    if depth > 1 and not recursive:
                        break
                    folders.add(prefix + "/".join(parts[:depth]))
                if len(parts) == 1 or recursive:
                    e = below[p]
                    item = {"type": "file", "oid": e.git_oid, "size": e.size, "path": p}
                    if e.is_lfs:
                        item["lfs"] = {
                            "oid": e.sha256,
                            "size": e.size,
                            "pointerSize": len(lfs_pointer(e.sha256, e.size)),
                        }
                    items.append(item)
            for d in sorted(folders):
                oid = hashlib.sha1("".join(sorted(p for p in below if p.startswith(d + "/"))).encode()).hexdigest()
                items.append({"type": "directory", "oid": oid, "size": 0, "path": d})
        return 200, sorted(items, key=lambda i: i["path"])

    def resolve(self, repo_id: str, rev: str, path: str) -> tuple[Commit, Entry, str]:
        self._check_refused("resolve")
        with self._lock:
            commit = self.resolve_revision(self.get_repo(repo_id), rev)
            path = unquote(path)
            entry = commit.files.get(path)
            if entry is None:
                raise HubError(404, "Entry not found", "EntryNotFound")
            return commit, entry, path


def _card_metadata(content: str):
    """The YAML block of a README as a dict, `None` if there is none, or an error string."""
    m = re.match(r"^(\s*---(?:\r\n|\r|\n))([\S\s]*?)((?:\r\n|\r|\n)---[ \t]*(\r\n|\n|$))", content)
    if not m:
        return None
    try:
        import yaml  # PyYAML: a hard dependency of huggingface_hub, so present wherever the client is
    except ImportError:  # pragma: no cover - structural checks only
        return {}
    try:
        return yaml.safe_load(m.group(2)) or {}
    except yaml.YAMLError as err:
        return f"YAML parse error: {err}"


def validate_card_metadata(content: str) -> list[str]:
    """The subset of the Hub's model-card metadata validation the package's cards must pass."""
    meta = _card_metadata(content)
    if meta is None:
        return []  # the Hub accepts cards without metadata (with a warning)
    if isinstance(meta, str):
        return [meta]
    if not isinstance(meta, dict):
        return ["Metadata must be a YAML mapping"]
    errors = []

    def str_or_list(key: str) -> None:
        v = meta.get(key)
        if v is not None and not (isinstance(v, str) or (isinstance(v, list) and all(isinstance(x, str) for x in v))):
            errors.append(f'"{key}" must be a string or an array of strings')

    for key in ("language", "datasets", "metrics", "base_model", "tags", "license"):
        str_or_list(key)
    for key in ("pipeline_tag", "library_name"):
        if meta.get(key) is not None and not isinstance(meta[key], str):
            errors.append(f'"{key}" must be a string')
    for lang in [meta["language"]] if isinstance(meta.get("language"), str) else meta.get("language") or []:
        if isinstance(lang, str) and not re.match(r"^([a-z]{2,3}(?:[-_][A-Za-z0-9]+)*|multilingual|code)$", lang):
            errors.append(f'"language" entry {lang!r} is not an ISO 639 code')
    mi = meta.get("model-index")
    if mi is not None:
        if not isinstance(mi, list) or not mi:
            errors.append('"model-index" must be a non-empty array')
        else:
            for model in mi:
                if not isinstance(model, dict) or not isinstance(model.get("name"), str):
                    errors.append('"model-index[].name" is required')
                    continue
                for res in model.get("results") or []:
                    if not isinstance(res, dict):
                        errors.append('"model-index[].results[]" must be objects')
                        continue
                    if not isinstance((res.get("task") or {}).get("type"), str):
                        errors.append('"model-index[].results[].task.type" is required')
                    ds = res.get("dataset") or {}
                    if not isinstance(ds.get("type"), str) or not isinstance(ds.get("name"), str):
                        errors.append('"model-index[].results[].dataset" needs "type" and "name"')
                    metrics = res.get("metrics")
                    if not isinstance(metrics, list) or not metrics:
                        errors.append('"model-index[].results[].metrics" must be a non-empty array')
                        continue
                    for metric in metrics:
                        if (
                            not isinstance(metric, dict)
                            or not isinstance(metric.get("type"), str)
                            or "value" not in metric
                        ):
                            errors.append('"model-index[].results[].metrics[]" need "type" and "value"')
    return errors


class _Handler(BaseHTTPRequestHandler):
    hub: HubServer
    protocol_version = "HTTP/1.1"
    server_version = "hf-variants-test-hub/1.0"

    def log_message(self, format, *args):  # noqa: A002 - silence stderr logging (and never log headers)
        pass

    # ------------------------------------------------------------------ plumbing
    def _body(self) -> bytes:
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            chunks = []
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip() or b"0", 16)
                if size == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return b"".join(chunks)
                chunks.append(self.rfile.read(size))
                self.rfile.readline()
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length else b""

    def _send(self, status: int, payload=None, headers: dict | None = None, body: bytes | None = None) -> None:
        if body is None:
            body = b"" if payload is None else json.dumps(payload).encode()
        self.send_response(status)
        if payload is not None:
            self.send_header("Content-Type", "application/json")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self.hub.requests.append((self.command, urlsplit(self.path).path, status))

    def _error(self, err: HubError) -> None:
        headers = {"X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        self._send(err.status, {"error": err.message, **err.extra}, headers)

    def _token(self) -> str | None:
        auth = self.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return None
        return auth[len("Bearer ") :].strip() or None

    def _check_auth(self, path: str) -> None:
        if not self.hub.require_token or path.startswith("/lfs-upload/"):
            return  # LFS upload hrefs are pre-signed, like the Hub's S3 URLs
        token = self._token()
        if token is None:
            raise HubError(401, "Unauthorized: this server requires an `Authorization: Bearer` token")
        if self.hub.valid_tokens is not None and token not in self.hub.valid_tokens:
            raise HubError(401, "Invalid credentials in Authorization header")

    def _json(self, raw: bytes) -> dict:
        try:
            value = json.loads(raw or b"{}")
        except ValueError as err:
            raise HubError(400, f"Malformed JSON body: {err}")
        if not isinstance(value, dict):
            raise HubError(400, "JSON body must be an object")
        return value

    def _dispatch(self) -> None:
        split = urlsplit(self.path)
        raw_path, query = split.path, parse_qs(split.query)
        body = self._body() if self.command in ("POST", "PUT") else b""
        try:
            self._check_auth(raw_path)
            self._route(self.command, raw_path, query, body)
        except HubError as err:
            self._error(err)
        except Exception as err:  # noqa: BLE001 - report server bugs to the client as 500s
            self._error(HubError(500, f"Internal test-server error: {type(err).__name__}: {err}"))

    do_GET = do_HEAD = do_POST = do_PUT = lambda self: self._dispatch()  # noqa: E731

    # ------------------------------------------------------------------ routing
    def _route(self, method: str, path: str, query: dict, body: bytes) -> None:
        hub = self.hub
        parts = path.split("/")[1:]  # raw segments: a revision may contain %2F
        if method == "GET" and path == "/api/whoami-v2":
            return self._send(*hub.whoami(self._token()))
        if method == "POST" and path == "/api/repos/create":
            return self._send(*hub.create_repo(self._json(body), self._token()))
        if method == "POST" and path == "/api/validate-yaml":
            return self._send(*hub.validate_yaml(self._json(body)))
        if method == "PUT" and len(parts) == 4 and parts[0] == "lfs-upload":
            return self._send(*hub.lfs_put(f"{parts[1]}/{parts[2]}", parts[3], query, body))
        if len(parts) >= 4 and parts[:2] == ["api", "models"]:
            repo_id, rest = f"{parts[2]}/{parts[3]}", parts[4:]
            if method == "GET" and not rest:
                return self._send(*hub.model_info(repo_id, "main", query))
            if method == "GET" and len(rest) == 2 and rest[0] == "revision":
                return self._send(*hub.model_info(repo_id, rest[1], query))
            if method == "GET" and len(rest) >= 2 and rest[0] == "tree":
                return self._send(*hub.tree(repo_id, rest[1], "/".join(rest[2:]), query))
            if method == "POST" and len(rest) == 2 and rest[0] == "preupload":
                return self._send(*hub.preupload(repo_id, rest[1], self._json(body)))
            if method == "POST" and len(rest) == 2 and rest[0] == "commit":
                return self._send(*hub.commit(repo_id, rest[1], query, body))
        if (
            method == "POST"
            and len(parts) == 6
            and parts[1].endswith(".git")
            and parts[2:] == ["info", "lfs", "objects", "batch"]
        ):
            return self._send(*hub.lfs_batch(f"{parts[0]}/{parts[1][:-4]}", self._json(body)))
        if method in ("GET", "HEAD") and len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve(f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:]))
        raise HubError(404, f"No such endpoint: {method} {path}")

    def _resolve(self, repo_id: str, rev: str, path: str) -> None:
        commit, entry, path = self.hub.resolve(repo_id, rev, path)
        data = self.hub._read(entry.blob_key)
        headers = {
            "X-Repo-Commit": commit.oid,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "ETag": f'"{entry.sha256 or entry.git_oid}"',
        }
        if entry.is_lfs:
            headers["X-Linked-Etag"] = f'"{entry.sha256}"'
            headers["X-Linked-Size"] = str(entry.size)
        status = 200
        m = re.match(r"bytes=(\d+)-(\d*)$", self.headers.get("Range", ""))
        if m:
            start = int(m.group(1))
            end = int(m.group(2)) if m.group(2) else len(data) - 1
            headers["Content-Range"] = f"bytes {start}-{end}/{len(data)}"
            data, status = data[start : end + 1], 206
        self._send(status, None, headers, body=data)
