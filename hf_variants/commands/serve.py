"""`hf-variants-serve` (`python -m hf_variants.serve`): serve one model over HTTP, decoding the sentences of concurrent
requests in shared batches.

    hf-variants-serve --model runs/en-fr/model                                   # torch, http://127.0.0.1:8000
    hf-variants-serve --model runs/en-fr-onnx --precision int8 --num_threads 2    # an ONNX export: onnx engine
    hf-variants-serve --model runs/en-fr-ct2 --host 0.0.0.0 --api_key_file keys.txt  # CTranslate2
    hf-variants-serve --model runs/en-fr/checkpoints/step_4000 --weights raw     # a checkpoint, as translate takes

The flags are checked before anything loads (exit status 2 naming the flag); the port is bound next, so a port in
use stops the command before the model loads too. The model then loads in the background: `GET /health/ready`
answers 503 until it is loaded and a warm-up batch ran, then 200 (`GET /health/live` answers 200 all along). A model
that fails to load stops the server with exit status 1. SIGTERM (or Ctrl+C) stops accepting connections, answers new
requests 503, finishes the requests in flight for at most --graceful_timeout_s, answers the rest with a JSON 503 and
exits 0; a second Ctrl+C exits at once. Routes, limits and metrics: `serve/app.py`, `serve/limits.py`,
`serve/metrics.py`; docs/serving.md is the operator's page.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from ..serve.logs import LOG_FORMATS
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
        help="a file of API keys, one a line (blank lines and # comments skipped; at least 16 characters each), "
        "each optionally followed by its own limits (KEY requests_per_minute=N characters_per_minute=N): every "
        "route but the probes, /languages, / and the docs then needs `Authorization: Bearer KEY`",
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
    add_glossary_args(parser)
    server = parser.add_argument_group("server")
    server.add_argument(
        "--graceful_timeout_s",
        type=float_in_range(0),
        default=None,
        help="on SIGTERM, how long the requests in flight may still take; the rest are answered 503 (default: "
        "--request_timeout_s + 10)",
    )
    for flag, fast, other, what in (
        ("--http", "httptools", "h11", "the HTTP parser: httptools (C, the faster) or h11 (pure Python)"),
        ("--loop", "uvloop", "asyncio", "the event loop: uvloop (libuv, the faster) or asyncio's own"),
    ):
        server.add_argument(
            flag,
            choices=("auto", fast, other),
            default="auto",
            help=f"{what}; auto: {fast} when installed (default auto)",
        )
    server.add_argument("--log_level", choices=("debug", "info", "warning", "error"), default="info")
    server.add_argument(
        "--log_format",
        choices=LOG_FORMATS,
        default="text",
        help="text lines, or one JSON object a line (default text)",
    )
    server.add_argument("--no_access_log", action="store_true", help="do not log every request")
    server.add_argument("--no_docs", action="store_true", help="no Swagger page at /docs (/openapi.json stays)")
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
        help=f"seconds a request may wait and decode (504; its batch stops when nobody else waits for it; default "
        f"{defaults.request_timeout_s:g})",
    )
    for name, help_text, status in (
        ("max_constraints", "constraints per sentence, its own and its glossary terms'", 422),
        ("max_constraint_chars", "characters of a constraint phrase, form or glossary term", 422),
        ("max_glossary_terms", "terms of a request's own glossary", 413),
    ):
        limits.add_argument(
            f"--{name}",
            type=int_in_range(1),
            default=getattr(defaults, name),
            help=f"{help_text} ({status}; default {getattr(defaults, name)})",
        )
    add_traffic_args(limits, defaults)
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
        help="how long a batch waits for more sentences after its first one arrived and after its settings' last "
        f"batch ended (default {defaults.max_wait_ms:g})",
    )
    batching.add_argument(
        "--concurrent_batches",
        type=int_in_range(1, 16),
        default=defaults.concurrent_batches,
        help="batches one worker decodes at once, each of other decoding settings: a request of other settings "
        f"starts beside a long batch instead of waiting for it (1: one at a time; default "
        f"{defaults.concurrent_batches})",
    )


def add_glossary_args(parser: argparse.ArgumentParser) -> None:
    """The server's glossary and how every glossary matches."""
    terms = parser.add_argument_group("terminology")
    terms.add_argument(
        "--glossary",
        metavar="FILE",
        help="a glossary applied to every request, LibreTranslate's included (UTF-8 TSV: source term<TAB>target "
        "term, forms separated by |): the terms found in a sentence become its constraints; a request's own "
        "`glossary` adds to it (torch and onnx engines)",
    )
    terms.add_argument(
        "--glossary_ignore_case", action="store_true", help="glossaries (the server's and requests') ignore case"
    )
    terms.add_argument(
        "--glossary_substring",
        action="store_true",
        help="glossary terms match inside words too (compounding languages); default: whole words only",
    )


def read_glossary(args: argparse.Namespace, engine: str):
    """The server's `ServerTerms`: `--glossary` read (a UsageError naming the file and line; refused for an engine
    without constrained decoding) and the matching flags."""
    from ..inference.decode import engine_class
    from ..inference.glossary import Glossary, GlossaryError
    from ..serve.terms import ServerTerms

    ignore_case, whole_word = args.glossary_ignore_case, not args.glossary_substring
    if not args.glossary:
        return ServerTerms(None, ignore_case, whole_word)
    if not engine_class(engine).supports_constraints:
        raise UsageError(
            f"--glossary: the {engine} engine has no lexically constrained decoding: serve the torch or onnx engine"
        )
    try:
        glossary = Glossary.load(args.glossary, ignore_case=ignore_case, whole_word=whole_word)
    except GlossaryError as error:
        raise UsageError(f"--glossary {error}") from None
    except OSError as error:
        raise UsageError(f"--glossary {args.glossary}: cannot read it ({error.strerror or error})") from None
    return ServerTerms(glossary, ignore_case, whole_word)


def add_traffic_args(limits, defaults: ServeLimits) -> None:
    """The per-client limits and the connection limits."""
    limits.add_argument(
        "--max_concurrent_requests",
        type=int_in_range(1),
        default=defaults.max_concurrent_requests,
        help=f"translate requests in flight (429 with Retry-After; default {defaults.max_concurrent_requests})",
    )
    limits.add_argument(
        "--requests_per_minute",
        type=int_in_range(1),
        default=None,
        help="translate requests a minute per API key, per client address without keys (429; default: none)",
    )
    limits.add_argument(
        "--characters_per_minute",
        type=int_in_range(1),
        default=None,
        help="characters of text a minute per API key, per client address without keys (429; default: none)",
    )
    limits.add_argument(
        "--max_connections",
        type=int_in_range(1),
        default=defaults.max_connections,
        help=f"open connections (one more gets a 503 and is closed; default {defaults.max_connections}; keep it "
        "under the process's open-file limit)",
    )
    for name, what in (
        ("idle_timeout_s", "a connection without a request in progress is closed after"),
        ("header_timeout_s", "a request's headers must arrive in full within (408)"),
        ("body_timeout_s", "a request's body must arrive in full within (408)"),
    ):
        limits.add_argument(
            f"--{name}",
            type=float_in_range(0.001),
            default=getattr(defaults, name),
            help=f"{what} this many seconds (default {getattr(defaults, name):g})",
        )


# ----------------------------------------------------------------------------------------------------- checks
KEY_LIMITS = ("requests_per_minute", "characters_per_minute")


def key_limits(path: str, number: int, fields: list[str]):
    """A key's own limits from the `name=N` fields after it on its line."""
    from ..serve.access import KeyLimits

    values = {}
    for item in fields:
        name, _, value = item.partition("=")
        if name not in KEY_LIMITS or not value.isdigit() or int(value) < 1 or name in values:
            raise UsageError(
                f"--api_key_file {path}:{number}: {item!r}: after the key, {' or '.join(KEY_LIMITS)}=N (N >= 1), "
                "each at most once"
            )
        values[name] = int(value)
    return KeyLimits(**values)


def read_api_keys(path: str) -> tuple[tuple[bytes, ...], dict]:
    """(the SHA-256 digests of the keys in `path`, {digest: its own `KeyLimits`}): one key a line, optionally
    followed by `requests_per_minute=N characters_per_minute=N`; blank lines and `#` comments skipped."""
    from ..serve.access import key_digest

    file = Path(path)
    if not file.is_file():
        raise UsageError(f"--api_key_file {path}: no such file")
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"--api_key_file {path}: cannot read it ({error})") from None
    keys, limits = [], {}
    for number, line in enumerate(lines, 1):
        if not line.strip() or line.strip().startswith("#"):
            continue
        key, *fields = line.split()
        if not all(33 <= ord(c) < 127 for c in key):
            raise UsageError(f"--api_key_file {path}:{number}: a key is printable ASCII without spaces")
        if len(key) < MIN_KEY_LENGTH:
            raise UsageError(
                f"--api_key_file {path}:{number}: a key of {len(key)} characters is too easy to guess "
                f"(at least {MIN_KEY_LENGTH}; e.g. python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        keys.append(key_digest(key))
        if fields:
            limits[keys[-1]] = key_limits(path, number, fields)
    if not keys:
        raise UsageError(f"--api_key_file {path}: holds no key")
    return tuple(keys), limits


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
    from dataclasses import fields as dataclass_fields

    from ..serve.access import default_allowed_hosts
    from ..serve.app import ServeSettings, cpu_count

    location = locate_model(args)
    check_model(location, args.max_sentence_tokens)
    try:
        limits = ServeLimits(**{f.name: getattr(args, f.name) for f in dataclass_fields(ServeLimits)})
    except ValueError as error:
        raise UsageError(f"--{str(error).split('`')[1]}: {error}" if "`" in str(error) else str(error)) from None
    num_threads = args.num_threads
    if num_threads is None and args.workers > 1:
        num_threads = max(1, cpu_count() // args.workers)
    for name in args.allowed_hosts:
        if not name or any(c in name for c in "/:@ ") and not name.startswith("["):
            raise UsageError(f"--allowed_hosts {name!r}: a host name or address, without scheme or port")
    keys, own_limits = read_api_keys(args.api_key_file) if args.api_key_file else ((), {})
    return location, ServeSettings(
        model=location.path,
        engine=location.engine,
        precision=location.precision,
        weights=location.weights,
        num_threads=num_threads,
        workers=args.workers,
        limits=limits,
        api_keys=keys,
        key_limits=own_limits,
        cors_origins=tuple(check_origin(o) for o in args.cors_origins),
        allowed_hosts=default_allowed_hosts(args.host, [h.strip("[]").lower() for h in args.allowed_hosts]),
        docs=not args.no_docs,
        access_log=not args.no_access_log,
        terms=read_glossary(args, location.engine),
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
        check_installed(args)
        sock = bind(args.host, args.port)
    except refusals() as error:
        parser.exit(2, f"hf-variants-serve: error: {error}\n")
    from ..serve.logs import configure_logging

    configure_logging(args.log_level, args.log_format)
    try:
        import uvicorn  # noqa: F401
    except ImportError as error:
        sock.close()
        parser.exit(
            2, f"hf-variants-serve: error: serving needs the serve extra: pip install 'hf-variants[serve]' ({error})\n"
        )
    from transformers.utils import logging as transformers_logging

    from ..serve.protocol import resolve_parser

    transformers_logging.disable_progress_bar()  # a server's log is no terminal
    graceful = args.graceful_timeout_s if args.graceful_timeout_s is not None else args.request_timeout_s + 10
    failures: list[BaseException] = []
    server = make_server(args, location, settings, graceful, failures)
    # uvicorn re-raises a caught SIGTERM / SIGINT after its graceful shutdown (with the handler it found at start):
    # with these no-op handlers the process then ends normally, with exit status 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    print(
        f"hf-variants-serve: listening on {url_of(sock)} (pid {os.getpid()}); loading {settings.model} "
        f"({settings.engine}, {settings.precision}; HTTP: {resolve_parser(args.http)}, event loop: "
        f"{event_loop_name(args.loop)})",
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


def check_installed(args) -> None:
    """A UsageError naming the flag when `--http httptools` or `--loop uvloop` names a library not installed."""
    for flag, name in (("--http", args.http), ("--loop", args.loop)):
        if name in ("httptools", "uvloop") and importlib.util.find_spec(name) is None:
            raise UsageError(f"{flag} {name}: {name} is not installed (pip install {name})")


def event_loop_name(loop: str) -> str:
    """The event loop uvicorn runs for `--loop` ("auto": uvloop when installed, as uvicorn's own choice)."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


def connection_refused(state, kind: str, client: str | None) -> None:
    """A connection closed by a limit (`serve.protocol`): counted, and (but for idle ones) in the access log."""
    from ..serve.logs import log_access

    state.metrics.errors.labels(kind).inc()
    if kind != "idle_timeout_s":
        status = {"max_connections": 503, "header_timeout_s": 408, "header_bytes": 431}.get(kind, 408)
        log_access({"client": client, "status": status, "error": kind}, f"connection closed: {kind} ({status})")


def freeze_loaded() -> None:
    """Once the model is loaded and warmed up: everything the process holds then lives as long as the server, so it
    leaves the garbage collector's reach (`gc.freeze`, after a last full collection), and a full collection scans
    only what requests make. With the model's objects in it, one full collection took 212-225 ms (the small
    baseline, ONNX Runtime int8), holding back every request and batch in flight: in `benchmarks/bench_serve.py`'s
    first 8-client run after a 1-client run, the p99 was that pause (255-415 ms where the median was 60 ms; 125-160
    ms frozen)."""
    import gc

    gc.collect()
    gc.freeze()
    logger.info(
        "%d objects of the loaded model and libraries frozen out of the garbage collector's scans",
        gc.get_freeze_count(),
    )


def make_server(args, location: ModelLocation, settings, graceful: float, failures: list):
    """The uvicorn server of the app: the server's connection handling (`serve.protocol`), its own access log,
    and a SIGTERM that drains (`ServerState.begin_drain`) for `graceful` seconds before uvicorn's own shutdown
    (given 10 s more, which the drain never needs)."""
    import asyncio

    import uvicorn

    from ..serve.app import create_app
    from ..serve.protocol import H11_INCOMPLETE_EVENT_BYTES, protocol_class

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            if not self.should_exit:
                logger.info(
                    "Stopping (%s): no new connections; finishing the requests in flight (at most %g s)",
                    signal.Signals(sig).name,
                    graceful,
                )
                state = getattr(app.state, "serve", None)
                loop = getattr(self, "loop", None)
                if state is not None and loop is not None:
                    loop.call_soon_threadsafe(state.begin_drain, graceful)
            super().handle_exit(sig, frame)

        async def serve(self, sockets=None):
            self.loop = asyncio.get_running_loop()
            await super().serve(sockets)

    def failed(error: BaseException) -> None:
        failures.append(error)
        server.should_exit = True

    app = create_app(settings, loader=partial(server_translator, location), on_failure=failed, on_ready=freeze_loaded)
    limits = settings.limits
    state = app.state.serve
    config = uvicorn.Config(
        app,
        http=protocol_class(
            idle_timeout_s=limits.idle_timeout_s,
            header_timeout_s=limits.header_timeout_s,
            body_timeout_s=limits.body_timeout_s,
            max_connections=limits.max_connections,
            on_refusal=partial(connection_refused, state),
            parser=args.http,
        ),
        loop=args.loop,
        h11_max_incomplete_event_size=H11_INCOMPLETE_EVENT_BYTES,
        log_config=None,
        log_level=args.log_level,
        access_log=False,  # the server writes its own (serve.access): request ids, 499s, JSON
        timeout_keep_alive=max(1, round(limits.idle_timeout_s)),
        timeout_graceful_shutdown=graceful + 10,
        lifespan="on",
        server_header=False,
        ws="none",
        proxy_headers=False,
    )
    server = Server(config)
    return server


def cli() -> None:
    sys.exit(main())


if __name__ == "__main__":
    sys.exit(main())
