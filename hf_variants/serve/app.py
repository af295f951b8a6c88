"""The HTTP application: routes, access control, the model's loading and warm-up, on the translation core.

| route | access | what |
| --- | --- | --- |
| `POST /translate` | key | sentences in, translations out (`schema.TranslateRequest` / `TranslateResponse`) |
| `GET /health` | open | 200 once the model is loaded and a warm-up batch ran; 503 loading, stopping, failed |
| `GET /metrics` | key | Prometheus text format (`metrics.py`) |
| `GET /` | open | a page to try the model in a browser (its script calls `POST /translate`) |
| `GET /openapi.json`, `/docs` | open | the API's OpenAPI schema and its Swagger page |

Access: with API keys (`--api_key_file`), every route marked "key" needs `Authorization: Bearer KEY` (compared
in constant time: SHA-256 digests through `hmac.compare_digest`, every key compared), else 401. A request carrying
an `Origin` that is neither the server's own nor listed in `--cors_origins` gets 403 (a browser page elsewhere
cannot make the server work, whatever the browser does with the answer); listed origins get CORS headers and
preflight answers. A server bound to a loopback address answers only requests whose `Host` is a loopback name (or
listed in `--allowed_hosts`): a page cannot reach it through a DNS name rebound to 127.0.0.1.

Each translate request is checked (`limits.py`), its sentences counted in tokens (on the event loop's thread, with
a tokenizer of its own: a fast tokenizer is not shared across threads), queued in the batcher (`batcher.py`) and
answered with the core's results. Every refusal is a JSON error naming the field or the limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import resources
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..inference.requests import DecodeOptions, OptionError, TranslationRequest
from ..inference.translator import Translator
from .batcher import Batcher, EngineError, QueueFull, ShuttingDown
from .limits import ApiError, ServeLimits, check_content_type, limit_error, parse_json, parse_translate_request
from .metrics import ServeMetrics
from .schema import ErrorResponse, Health, TranslateRequest, TranslateResponse

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/", "/health", "/docs", "/openapi.json"})
ENDPOINTS = frozenset({"/", "/health", "/metrics", "/translate", "/docs", "/openapi.json"})
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WARMUP_SENTENCE = "A man rides a bike."
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}


@dataclass(frozen=True)
class ServeSettings:
    """What `hf-variants-serve` serves and how (its flags)."""

    model: str
    engine: str = "torch"
    precision: str = "fp32"
    weights: str | None = None  # a training checkpoint's: "ema" or "raw" (`--weights`); None for a model folder
    num_threads: int | None = None
    workers: int = 1
    limits: ServeLimits = field(default_factory=ServeLimits)
    api_keys: tuple[bytes, ...] = ()  # SHA-256 digests of the accepted keys (`key_digest`)
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header


def key_digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key.encode("utf-8") if isinstance(key, str) else key).digest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str, extra: Sequence[str] = ()) -> tuple[str, ...] | None:
    """The Host names a server bound to `bind_host` answers: loopback names for a loopback address (plus `extra`),
    any for another address unless `extra` lists some."""
    if is_loopback(bind_host):
        return tuple(dict.fromkeys([*LOOPBACK_NAMES, bind_host.strip("[]"), *extra]))
    return tuple(extra) or None


def load_translator(settings: ServeSettings) -> Translator:
    """The translation core's translator of `settings.model` on its engine (called once per worker, in the
    worker's own thread). `num_threads` also caps torch's own threads on every engine: the ONNX Runtime engine runs
    transformers' generation loop, whose torch operations would otherwise take every core beside the engine's."""
    if settings.num_threads is not None:
        import torch

        torch.set_num_threads(settings.num_threads)
    return Translator.from_pretrained(
        settings.model, engine=settings.engine, precision=settings.precision, num_threads=settings.num_threads
    )


def counting_translator(translator: Translator) -> Translator:
    """A translator sharing `translator`'s model but with its own copy of the tokenizer, to count tokens in another
    thread while the worker decodes (a fast tokenizer refuses concurrent calls that change its padding or
    truncation: "Already borrowed")."""
    engine = copy.copy(translator.engine)
    engine.tokenizer = copy.deepcopy(translator.engine.tokenizer)
    return Translator(engine=engine)


# ---------------------------------------------------------------------------------------------------- responses
def json_response(content, status: int = 200, headers: dict | None = None) -> Response:
    """JSON with non-finite floats as null (a log-probability of -inf is no JSON number)."""

    def clean(value):
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(v) for v in value]
        return value

    body = json.dumps(clean(content), ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return Response(body.encode("utf-8"), status_code=status, headers=headers, media_type="application/json")


def error_response(error: ApiError, metrics: ServeMetrics | None) -> Response:
    if metrics is not None:
        metrics.errors.labels(error.kind).inc()
    headers = dict(error.headers)
    if error.status == 401:
        headers.setdefault("WWW-Authenticate", 'Bearer realm="hf-variants-serve"')
    return json_response(error.body(), error.status, headers)


def page_html() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------------ state
class ServerState:
    """The loaded engines, the batcher and the server's status (loading -> ready -> stopping, or failed)."""

    def __init__(
        self,
        settings: ServeSettings,
        loader: Callable[[ServeSettings], Translator],
        on_failure: Callable[[BaseException], None] | None,
    ):
        self.settings = settings
        self.limits = settings.limits
        self.loader = loader
        self.on_failure = on_failure
        self.metrics = ServeMetrics()
        self.status = "loading"
        self.error: BaseException | None = None
        self.batcher = Batcher(
            settings.workers,
            max_batch_tokens=settings.limits.max_batch_tokens,
            max_wait_ms=settings.limits.max_wait_ms,
            max_queue=settings.limits.max_queue,
            on_batch=self.metrics.on_batch,
        )
        self.metrics.watch(self.batcher)
        self.counter: Translator | None = None
        self.token_limit: int | None = None
        self.info: dict = {}

    async def load(self) -> None:
        """Load one translator per worker (in its thread), check the limits against the model, run a warm-up batch
        on every worker, then answer as ready. A failure is logged and handed to `on_failure`."""
        start = time.monotonic()
        try:
            await self.batcher.start(lambda i: self.loader(self.settings))
            loop = asyncio.get_running_loop()
            first = self.batcher.translators[0]
            self.counter = await loop.run_in_executor(None, counting_translator, first)
            self.token_limit = self._token_limit(first)
            languages = first.languages
            self.info = {
                "model_type": getattr(first.config, "model_type", None),
                "engine": self.settings.engine,
                "precision": self.settings.precision,
                "languages": languages,
                "max_sentence_tokens": self.token_limit,
                **({"weights": self.settings.weights} if self.settings.weights else {}),
            }
            self.metrics.model.info(
                {
                    "model_type": str(self.info["model_type"]),
                    "engine": self.settings.engine,
                    "precision": self.settings.precision,
                    "workers": str(self.settings.workers),
                    "num_threads": str(self.settings.num_threads or "default"),
                }
            )
            target = first.default_tgt_lang or _first(languages["target"])
            source = None  # a model marking the source language with a token (M2M100 / NLLB-200) needs one
            if getattr(first.config, "target_language_token", False):
                source = next((lang for lang in languages["source"] if lang != target), None)
            warmup = TranslationRequest(WARMUP_SENTENCE, src_lang=source, tgt_lang=target)
            for i in range(self.settings.workers):
                await self.batcher.run_in_worker(i, lambda translator: translator.translate([warmup], DecodeOptions()))
        except Exception as error:
            self.status, self.error = "failed", error
            logger.error("Loading %s failed: %s: %s", self.settings.model, type(error).__name__, error, exc_info=True)
            if self.on_failure is not None:
                self.on_failure(error)
            return
        if self.status == "loading":
            self.status = "ready"
            self.metrics.ready.set(1)
            logger.info(
                "Ready: %s (%s, %s engine, %s, %d worker%s) loaded and warmed up in %.1f s",
                self.settings.model,
                self.info["model_type"],
                self.settings.engine,
                self.settings.precision,
                self.settings.workers,
                "s" if self.settings.workers > 1 else "",
                time.monotonic() - start,
            )

    def _token_limit(self, translator: Translator) -> int | None:
        model_limit = translator.max_source_tokens
        flag = self.limits.max_sentence_tokens
        if flag is not None and model_limit is not None and flag > model_limit:
            raise ValueError(
                f"--max_sentence_tokens {flag} is above what the model accepts ({model_limit} tokens, "
                "config.max_position_embeddings)"
            )
        return flag if flag is not None else model_limit

    async def stop(self) -> None:
        self.status = "stopping"
        self.metrics.ready.set(0)
        await self.batcher.stop()

    # -------------------------------------------------------------------------------------------- translate
    async def translate(self, request: Request) -> Response:
        if self.status != "ready":
            raise self.not_ready()
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, self.limits.max_body_bytes)
        parsed = parse_translate_request(parse_json(body), self.limits)
        requests = [
            TranslationRequest(text, src_lang=parsed.src_lang, tgt_lang=parsed.tgt_lang) for text in parsed.texts
        ]
        options, key = self.options(parsed)
        try:
            self.counter.check_request(requests[0], options)
        except ValueError as error:
            message = str(error)
            name = next((n for n in ("src_lang", "tgt_lang") if message.startswith(n)), "tgt_lang")
            raise ApiError(422, "invalid_request", message, field=name) from None
        # counted here, on the event loop's thread, the only one using this tokenizer (a thread hop would cost more
        # than tokenizing a request's sentences)
        lengths = self.check_lengths(parsed, self.counter.count_tokens(requests))
        work = asyncio.ensure_future(
            self.batcher.translate(requests, lengths, options, key, timeout=self.limits.request_timeout_s)
        )
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left: its sentences leave the queue
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise ApiError(499, "client_closed", "the client closed the connection before the answer")
        try:
            results = work.result()
        except QueueFull as full:
            raise limit_error(
                503,
                "max_queue",
                self.limits.max_queue,
                f"the server is busy: {full.queued} sentences are waiting and its queue holds "
                f"{self.limits.max_queue} (--max_queue); retry in {full.retry_after} s",
                headers={"Retry-After": str(full.retry_after)},
            ) from None
        except asyncio.TimeoutError:
            raise limit_error(
                504,
                "request_timeout_s",
                self.limits.request_timeout_s,
                f"the translation took longer than {self.limits.request_timeout_s:g} s (--request_timeout_s); "
                "its sentences not yet decoded left the queue",
            ) from None
        except EngineError as error:
            raise ApiError(500, "engine_error", f"the engine failed on this request's batch: {error}") from None
        except ShuttingDown:
            raise self.not_ready() from None
        return json_response(self.render(parsed, results))

    def options(self, parsed) -> tuple[DecodeOptions, tuple]:
        """The request's decoding options (those it sets, objects with scores where it asks for them), resolved
        against the model's saved choices, and their batch key."""
        given = dict(parsed.options)
        given["scores"] = parsed.as_objects
        given["nbest"] = given.get("nbest") or 1
        if self.limits.truncate:
            given["max_source_length"] = self.token_limit
        try:
            resolved = self.counter.resolve(DecodeOptions(**given))
        except OptionError as error:
            name = next((n for n in error.names if n in TranslateRequest.model_fields), None)
            raise ApiError(422, "invalid_request", str(error), field=name) from None
        return resolved, tuple(sorted(resolved.to_dict().items()))

    def check_lengths(self, parsed, lengths: list[int]) -> list[int]:
        """413 for a sentence over the token limit (without `--truncate`); the lengths the batcher packs by."""
        limit = self.token_limit
        if limit is None:
            return lengths
        if not self.limits.truncate:
            for i, length in enumerate(lengths):
                if length > limit and parsed.texts[i].strip():
                    name = "text" if parsed.single else f"text[{i}]"
                    raise limit_error(
                        413,
                        "max_sentence_tokens",
                        limit,
                        f"`{name}` is {length} tokens long (special tokens included); this server translates at "
                        f"most {limit} tokens a sentence (--max_sentence_tokens): split it",
                        field=name,
                    )
        return [min(length, limit) for length in lengths]

    @staticmethod
    def render(parsed, results) -> dict:
        if not parsed.as_objects:
            translations = [result.text for result in results]
        else:
            alignments = bool(parsed.options.get("alignments"))
            translations = [
                {
                    "source": result.source,
                    "hypotheses": [h.to_dict(scores=True, alignments=alignments) for h in result.hypotheses],
                }
                for result in results
            ]
        return {"translations": translations, "truncated": [i for i, r in enumerate(results) if r.truncated]}

    def not_ready(self) -> ApiError:
        if self.status == "loading":
            return ApiError(503, "loading", "the model is still loading; retry shortly", headers={"Retry-After": "5"})
        if self.status == "failed":
            return ApiError(503, "failed", f"the model failed to load: {self.error}")
        return ApiError(503, "stopping", "the server is stopping", headers={"Connection": "close"})

    def health(self) -> Response:
        if self.status == "ready":
            return json_response({"status": "ready", **self.info})
        return json_response({"status": self.status}, 503, {"Retry-After": "5"} if self.status == "loading" else None)


def _first(items):
    return items[0] if items else None


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 from its Content-Length or as soon as more than `limit` bytes arrived."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid_request", f"invalid Content-Length {declared!r}", field="Content-Length")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(size, limit, more=True)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(size: int, limit: int, more: bool = False) -> ApiError:
    return limit_error(
        413,
        "max_body_bytes",
        limit,
        f"the body is {'more than ' if more else ''}{size} bytes; this server takes at most {limit} "
        "(--max_body_bytes): send fewer sentences a request",
        headers={"Connection": "close"},
    )


async def wait_for_disconnect(request: Request) -> None:
    """Return when the client disconnects (after its body was read, the next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ----------------------------------------------------------------------------------------------- access control
class Guard:
    """ASGI middleware in front of the routes: the Host check, the cross-origin refusal, the API key, and the
    request metrics (count by route and status, latency, requests in flight)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state
        settings = state.settings
        self.keys = settings.api_keys
        self.origins = set(settings.cors_origins)
        self.allowed_hosts = None if settings.allowed_hosts is None else {h.lower() for h in settings.allowed_hosts}

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        metrics = self.state.metrics
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        start = time.monotonic()
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            refusal = self.refusal(scope)
            if refusal is not None:
                await error_response(refusal, metrics)(scope, receive, send_status)
            else:
                await self.app(scope, receive, send_status)
        finally:
            metrics.in_flight.dec()
            metrics.requests.labels(endpoint, str(status[0])).inc()
            metrics.latency.labels(endpoint).observe(time.monotonic() - start)

    def refusal(self, scope) -> ApiError | None:
        headers = {}
        for name, value in scope.get("headers", []):
            headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
        host = headers.get("host", "")
        if self.allowed_hosts is not None:
            hostname = (urlsplit(f"//{host}").hostname or "").lower()
            if hostname not in self.allowed_hosts:
                return ApiError(
                    400,
                    "host_not_allowed",
                    f"Host {host!r} is not one this server answers (--allowed_hosts): "
                    f"{', '.join(sorted(self.allowed_hosts))}",
                    field="Host",
                )
        origin = headers.get("origin")
        if origin is not None and origin not in self.origins and "*" not in self.origins:
            parts = urlsplit(origin)
            if not (parts.scheme in ("http", "https") and parts.netloc.lower() == host.lower()):
                return limit_error(
                    403,
                    "cors_origins",
                    None,
                    f"cross-origin requests from {origin!r} are refused: the server's --cors_origins does not list it",
                )
        if not self.keys or scope.get("path") in OPEN_PATHS:
            return None
        if scope.get("method") == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            return None  # a CORS preflight (no credentials by design) of a listed origin
        if not self.authorized(headers.get("authorization")):
            reason = "no API key" if not headers.get("authorization") else "an invalid API key"
            return ApiError(
                401, "unauthorized", f"{reason}: send `Authorization: Bearer KEY` with a key of --api_key_file"
            )
        return None

    def authorized(self, header: str | None) -> bool:
        if not header:
            return False
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = key_digest(token.strip().encode("latin-1"))
        match = False
        for digest in self.keys:  # every key compared, each in constant time
            match |= hmac.compare_digest(given, digest)
        return match


# ------------------------------------------------------------------------------------------------------ the app
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid UTF-8 or JSON",
        401: "No or an invalid API key",
        403: "A cross-origin request from an origin not listed in --cors_origins",
        413: "Over a size limit: max_body_bytes, max_sentences, max_sentence_tokens",
        415: "The body is not declared JSON",
        422: "A field of the wrong type or value, or over max_beams / max_new_tokens",
        500: "The engine failed on the batch that held this request",
        503: "Loading, stopping, or the queue is full (max_queue; Retry-After)",
        504: "Over request_timeout_s",
    }.items()
}


def create_app(
    settings: ServeSettings,
    *,
    loader: Callable[[ServeSettings], Translator] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
) -> FastAPI:
    """The FastAPI application serving `settings.model`. Loading starts with the application (its lifespan) and
    runs in the background: `/health` answers 503 until the model is loaded and warmed up. `loader(settings)` builds
    one translator (per worker; default `load_translator`); `on_failure(error)` is called when loading fails."""
    state = ServerState(settings, loader or load_translator, on_failure)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loading = asyncio.create_task(state.load(), name="load-model")
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
                with contextlib.suppress(BaseException):
                    await loading
            await state.stop()

    app = FastAPI(
        title="hf-variants-serve",
        description="Translation with an hf_variants model, decoded in dynamic batches. Errors are "
        '`{"error": {"type", "message", "field"?, "limit"?, "value"?}}`.',
        version=_version(),
        lifespan=lifespan,
        redoc_url=None,
    )
    app.state.serve = state

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return error_response(error, state.metrics)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        return error_response(
            ApiError(
                error.status_code,
                kinds.get(error.status_code, "http_error"),
                f"{request.method} {request.url.path}: {error.detail}",
                headers=dict(error.headers or {}),
            ),
            state.metrics,
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return error_response(ApiError(422, "invalid_request", str(error)), state.metrics)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("Internal error on %s %s", request.method, request.url.path)
        return error_response(
            ApiError(500, "internal_error", f"internal error: {type(error).__name__}: {error}"), state.metrics
        )

    @app.post(
        "/translate",
        response_model=TranslateResponse,
        responses=ERROR_RESPONSES,
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": TranslateRequest.model_json_schema()}},
            }
        },
        summary="Translate one sentence or a list of sentences",
    )
    async def translate(request: Request):
        return await state.translate(request)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}}, summary="Readiness")
    async def health():
        return state.health()

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(page_html(), headers=PAGE_HEADERS)

    app.add_middleware(Guard, state=state)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
            max_age=600,
        )
    return app


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hf-variants")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        return "unknown"


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
