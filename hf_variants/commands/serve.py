"""`hf-variants-serve` (`python -m hf_variants.serve`): serve one model over HTTP, decoding the sentences of concurrent
requests in shared batches.

    hf-variants-serve --model runs/en-fr/model                                   # torch, http://127.0.0.1:8000
    hf-variants-serve --model runs/en-fr-onnx --precision int8 --num_threads 2    # an ONNX export: onnx engine
    hf-variants-serve --model runs/en-fr-ct2 --host 0.0.0.0 --api_key_file keys.txt  # CTranslate2
    hf-variants-serve --model runs/en-fr/checkpoints/step_4000 --weights raw     # a checkpoint, as translate takes

The flags are checked before anything loads (exit status 2 naming the flag); the port is bound next, so a port in
use stops the command before the model loads too. The model then loads in the background: `GET /health` answers
503 until it is loaded and a warm-up batch ran, then 200. A model that fails to load stops the server with exit
status 1. SIGTERM (or Ctrl+C) stops accepting connections, finishes the requests in flight and exits 0; a second
Ctrl+C exits at once. Routes, limits and metrics: `serve/app.py`, `serve/limits.py`, `serve/metrics.py`;
docs/user-guide.md ("Serving") walks through them.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path
from urllib.parse import urlsplit

from ..inference.translator import Translator
from ..outputs import float_in_range, int_in_range
from ..serve.limits import ServeLimits
from .common import UsageError, refusals
from .loading import ModelLocation, add_model_flags, load_translator, locate_model, read_configs

logger = logging.getLogger("hf_variants.serve")

MIN_KEY_LENGTH = 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hf-variants-serve", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    model = add_model_flags(parser, what="decode")
    model.add_argument(
        "--workers",
        type=int_in_range(1, 64),
        default=1,
        help="engine workers: each loads its own copy of the model and decodes one batch at a time, in parallel "
        "with the others (default: 1)",
    )
    net = parser.add_argument_group("network and access")
    net.add_argument("--host", default="127.0.0.1", help="the address to bind (default: 127.0.0.1, this machine only)")
    net.add_argument(
        "--port", type=int_in_range(0, 65535), default=8000, help="the port (0: any free one; default 8000)"
    )
    net.add_argument(
        "--api_key_file",
        help="a file of API keys, one a line (blank lines and # comments skipped; at least 16 characters each): "
        "every route but /health, / and the OpenAPI docs then needs `Authorization: Bearer KEY`",
    )
    net.add_argument(
        "--cors_origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="origins whose browser pages may call the API (e.g. https://app.example.com; * for any); other "
        "cross-origin requests are refused (default: none)",
    )
    net.add_argument(
        "--allowed_hosts",
        nargs="+",
        default=[],
        metavar="NAME",
        help="Host header names the server answers besides the loopback names (a server bound to a loopback "
        "address answers only those by default; another address answers any unless this lists some)",
    )
    add_limit_args(parser, ServeLimits())
    server = parser.add_argument_group("server")
    server.add_argument(
        "--graceful_timeout_s",
        type=float_in_range(0),
        default=None,
        help="on SIGTERM, how long to wait for requests in flight (default: --request_timeout_s + 10)",
    )
    server.add_argument("--log_level", choices=("debug", "info", "warning", "error"), default="info")
    server.add_argument("--no_access_log", action="store_true", help="do not log every request")
    return parser


def add_limit_args(parser: argparse.ArgumentParser, defaults: ServeLimits) -> None:
    """The request limits and the dynamic batching flags, with `ServeLimits`' defaults."""
    limits = parser.add_argument_group("limits (a refusal is a JSON error naming the limit)")
    limits.add_argument(
        "--max_body_bytes",
        type=int_in_range(1),
        default=defaults.max_body_bytes,
        help=f"largest request body (413; default {defaults.max_body_bytes})",
    )
    limits.add_argument(
        "--max_sentences",
        type=int_in_range(1),
        default=defaults.max_sentences,
        help=f"sentences per request (413; default {defaults.max_sentences})",
    )
    limits.add_argument(
        "--max_sentence_tokens",
        type=int_in_range(1),
        default=None,
        help="tokens per sentence, special tokens included (413, or cut with --truncate; default: "
        "the model's positions)",
    )
    limits.add_argument(
        "--truncate",
        action="store_true",
        help="cut a sentence over --max_sentence_tokens instead of refusing it (the answer lists it in `truncated`)",
    )
    limits.add_argument(
        "--max_beams",
        type=int_in_range(1),
        default=defaults.max_beams,
        help=f"largest num_beams a request may ask for (422; default {defaults.max_beams})",
    )
    limits.add_argument(
        "--max_queue",
        type=int_in_range(1),
        default=defaults.max_queue,
        help=f"sentences waiting for a batch (503 with Retry-After; default {defaults.max_queue})",
    )
    limits.add_argument(
        "--request_timeout_s",
        type=float_in_range(0.001),
        default=defaults.request_timeout_s,
        help=f"seconds a request may wait and decode (504; default {defaults.request_timeout_s:g})",
    )
    batching = parser.add_argument_group("dynamic batching")
    batching.add_argument(
        "--max_batch_tokens",
        type=int_in_range(1),
        default=defaults.max_batch_tokens,
        help=f"padded source tokens (longest sentence x sentences) of one batch (default {defaults.max_batch_tokens})",
    )
    batching.add_argument(
        "--max_wait_ms",
        type=float_in_range(0),
        default=defaults.max_wait_ms,
        help=f"how long an idle worker waits for more sentences to join a batch (default {defaults.max_wait_ms:g})",
    )


# ----------------------------------------------------------------------------------------------------- checks
def read_api_keys(path: str) -> tuple[bytes, ...]:
    """The SHA-256 digests of the keys in `path` (one a line; blank lines and `#` comments skipped)."""
    from ..serve.app import key_digest

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--api_key_file {path}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--api_key_file {path}: cannot read it ({error})") from None
    keys = []
    for number, line in enumerate(lines, 1):
        key = line.strip()
        if not key or key.startswith("#"):
            continue
        if not all(33 <= ord(c) < 127 for c in key):
            raise UsageError(f"--api_key_file {path}:{number}: a key is printable ASCII without spaces")
        if len(key) < MIN_KEY_LENGTH:
            raise UsageError(
                f"--api_key_file {path}:{number}: a key of {len(key)} characters is too easy to guess "
                f"(at least {MIN_KEY_LENGTH}; e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        keys.append(key_digest(key))
    if not keys:
        raise UsageError(f"--api_key_file {path}: holds no key")
    return tuple(keys)


def check_origin(origin: str) -> str:
    if origin == "*":
        return origin
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.path not in ("", "/") or parts.query:
        raise UsageError(f"--cors_origins {origin!r}: an origin is scheme://host[:port] (or *)")
    return f"{parts.scheme}://{parts.netloc}"


def check_model(location: ModelLocation, max_sentence_tokens: int | None) -> None:
    """`--max_sentence_tokens` within the model's positions (the folder itself was checked by `locate_model`)."""
    if max_sentence_tokens is None:
        return
    config, _ = read_configs(location)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and max_sentence_tokens > positions:
        raise UsageError(
            f"--max_sentence_tokens {max_sentence_tokens}: the model accepts at most {positions} tokens "
            "(max_position_embeddings)"
        )


def server_translator(location: ModelLocation, settings) -> Translator:
    """The translator of one worker (called in the worker's own thread): the model of `location` on its engine."""
    return load_translator(replace(location, num_threads=settings.num_threads))


def settings_from_args(args: argparse.Namespace):
    """(the model's location, the server's settings) from the parsed flags; a `UsageError` naming the flag for
    anything refused."""
    from ..serve.app import ServeSettings, cpu_count, default_allowed_hosts

    location = locate_model(args)
    check_model(location, args.max_sentence_tokens)
    try:
        limits = ServeLimits(
            max_body_bytes=args.max_body_bytes,
            max_sentences=args.max_sentences,
            max_sentence_tokens=args.max_sentence_tokens,
            truncate=args.truncate,
            max_beams=args.max_beams,
            max_queue=args.max_queue,
            request_timeout_s=args.request_timeout_s,
            max_batch_tokens=args.max_batch_tokens,
            max_wait_ms=args.max_wait_ms,
        )
    except ValueError as error:
        raise UsageError(f"--{str(error).split('`')[1]}: {error}" if "`" in str(error) else str(error)) from None
    num_threads = args.num_threads
    if num_threads is None and args.workers > 1:
        num_threads = max(1, cpu_count() // args.workers)
    for name in args.allowed_hosts:
        if not name or any(c in name for c in "/:@ ") and not name.startswith("["):
            raise UsageError(f"--allowed_hosts {name!r}: a host name or address, without scheme or port")
    return location, ServeSettings(
        model=location.path,
        engine=location.engine,
        precision=location.precision,
        weights=location.weights,
        num_threads=num_threads,
        workers=args.workers,
        limits=limits,
        api_keys=read_api_keys(args.api_key_file) if args.api_key_file else (),
        cors_origins=tuple(check_origin(o) for o in args.cors_origins),
        allowed_hosts=default_allowed_hosts(args.host, [h.strip("[]").lower() for h in args.allowed_hosts]),
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port (what uvicorn would bind), or a UsageError naming the flag."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as error:
        raise UsageError(f"--host {host}: {error.strerror}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
        sock.listen(2048)
    except OSError as error:
        sock.close()
        raise UsageError(f"--host {host} --port {port}: cannot listen there ({error.strerror})") from None
    sock.set_inheritable(True)
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ------------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Parse the flags, bind, serve until SIGTERM / Ctrl+C; the exit status (0, 1 when the model failed to load, 2
    for a refused flag)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        location, settings = settings_from_args(args)
        sock = bind(args.host, args.port)
    except refusals() as error:
        parser.exit(2, f"hf-variants-serve: error: {error}\n")
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    try:
        import uvicorn
    except ImportError as error:
        sock.close()
        parser.exit(
            2, f"hf-variants-serve: error: serving needs the serve extra: pip install 'hf-variants[serve]' ({error})\n"
        )
    from transformers.utils import logging as transformers_logging

    from ..serve.app import create_app

    transformers_logging.disable_progress_bar()  # a server's log is no terminal
    failures: list[BaseException] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                logger.info(
                    "Stopping (%s): no new connections; finishing the requests in flight", signal.Signals(sig).name
                )
                state = getattr(app.state, "serve", None)
                if state is not None and state.status in ("loading", "ready"):
                    state.status = "stopping"
                    state.metrics.ready.set(0)
            super().handle_exit(sig, frame)

    def failed(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(settings, loader=partial(server_translator, location), on_failure=failed)
    config = uvicorn.Config(
        app,
        log_config=None,
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=args.graceful_timeout_s
        if args.graceful_timeout_s is not None
        else args.request_timeout_s + 10,
        lifespan="on",
        server_header=False,
        ws="none",
        proxy_headers=False,
    )
    server = Server(config)
    # uvicorn re-raises a caught SIGTERM / SIGINT after its graceful shutdown (with the handler it found at start):
    # with these no-op handlers the process then ends normally, with exit status 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(
        f"hf-variants-serve: listening on {url_of(sock)} (pid {os.getpid()}); loading {settings.model} "
        f"({settings.engine}, {settings.precision})",
        file=sys.stderr,
        flush=True,
    )
    server.run(sockets=[sock])
    if failures:
        print(
            f"hf-variants-serve: error: the model failed to load: {type(failures[0]).__name__}: {failures[0]}",
            file=sys.stderr,
        )
        return 1
    return 0


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    cli()
