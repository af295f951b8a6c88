"""The HTTP application: routes, the model's loading and warm-up, the drain, on the translation core.

| route | access | what |
| --- | --- | --- |
| `POST /translate` | key | sentences (or paragraphs: `split_sentences`) in, translations out |
| `GET /health/live` | open | 200 while the process answers HTTP (loading, ready, stopping): liveness |
| `GET /health/ready`, `/health` | open | 200 once the model is loaded and warmed up; 503 loading, stopping, failed |
| `GET /languages` | open | the languages the model translates from and into, and the default target |
| `GET /metrics` | key | Prometheus text format (`metrics.py`) |
| `/libretranslate/...` | key / open | LibreTranslate's API: translate, languages (`libretranslate.py`) |
| `GET /` | open | a page to try the model in a browser (its script calls `POST /translate`) |
| `GET /openapi.json`, `/docs` | open | the OpenAPI schema and its Swagger page (assets served here, `docs.py`) |

Access, request ids, rate limits and the access log: `access.Guard`. Each translate request is read (its body
within `--body_timeout_s`, 413 as soon as it is over `--max_body_bytes`, 499 when the client leaves), made ready in a
preparation thread (`prepare.py`: parsed, checked, split, options resolved, every sentence tokenized once), queued in
the batcher (`batcher.py`) and answered with the core's results; a client that leaves while its request waits or
decodes withdraws it (499 in the access log). Every refusal is a JSON error naming the field or the limit.

Stopping (SIGTERM): the server answers new requests 503 (`stopping`), lets the queued and running ones finish for at
most `--graceful_timeout_s` (`drain`), then answers the rest 503 too and stops their batches at the next decoding
step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import FileResponse, HTMLResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..inference.requests import DecodeOptions, TranslationRequest
from ..inference.translator import Translator
from .access import Guard, KeyLimits, RateLimiter, default_allowed_hosts, is_loopback, key_digest
from .batcher import Batcher, EngineError, QueueFull, ShuttingDown, lane_translator
from .docs import ASSETS, assets_folder, docs_page
from .docs import PAGE_HEADERS as DOCS_HEADERS
from .libretranslate import add_libretranslate_routes
from .limits import ApiError, ServeLimits, check_content_type, limit_error
from .metrics import ServeMetrics
from .prepare import Prepared, Preparer, prepare_body, render
from .responses import client_closed, error_response, json_response, read_body, wait_for_disconnect
from .schema import ErrorResponse, Health, LanguagesResponse, Liveness, TranslateRequest, TranslateResponse
from .terms import ServerTerms

logger = logging.getLogger(__name__)

WARMUP_SENTENCE = "A man rides a bike."
PREPARE_THREADS = 2
PAGE_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
}
__all__ = ["ServeSettings", "create_app", "default_allowed_hosts", "is_loopback", "key_digest", "load_translator"]


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
    key_limits: dict = field(default_factory=dict)  # digest -> `access.KeyLimits` of the keys with their own
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] | None = None  # None: any Host header
    docs: bool = True
    access_log: bool = True
    terms: ServerTerms = field(default_factory=ServerTerms)  # the server's glossary and glossary matching


def load_translator(settings: ServeSettings) -> Translator:
    """The translation core's translator of `settings.model` on its engine (called once per worker, in the
    worker's own thread). `num_threads` also caps torch's own threads on every engine."""
    if settings.num_threads is not None:
        import torch

        torch.set_num_threads(settings.num_threads)
    return Translator.from_pretrained(
        settings.model, engine=settings.engine, precision=settings.precision, num_threads=settings.num_threads
    )


def page_html() -> str:
    return resources.files(__package__).joinpath("page.html").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------------ state
class ServerState:
    """The loaded engines, the batcher, the preparation threads and the server's status (loading -> ready ->
    stopping, or failed)."""

    def __init__(
        self,
        settings: ServeSettings,
        loader: Callable[[ServeSettings], Translator],
        on_failure: Callable[[BaseException], None] | None,
        on_ready: Callable[[], None] | None = None,
    ):
        self.settings = settings
        self.limits = limits = settings.limits
        self.loader = loader
        self.on_failure, self.on_ready = on_failure, on_ready
        self.metrics = ServeMetrics()
        self.status = "loading"
        self.error: BaseException | None = None
        self.batcher = Batcher(
            settings.workers,
            max_batch_tokens=limits.max_batch_tokens,
            max_wait_ms=limits.max_wait_ms,
            max_queue=limits.max_queue,
            concurrent_batches=limits.concurrent_batches,
            on_batch=self.metrics.on_batch,
        )
        self.metrics.watch(self.batcher)
        self.limiter = RateLimiter(
            KeyLimits(limits.requests_per_minute, limits.characters_per_minute), settings.key_limits
        )
        self.preparer: Preparer | None = None
        self.token_limit: int | None = None
        self.languages: dict = {"source": [], "target": []}
        self.default_target: str | None = None
        self.info: dict = {}
        self._drain: asyncio.Task | None = None

    async def load(self) -> None:
        """Load one translator per worker (in its thread), check the limits against the model, make the preparation
        threads' translators, run a warm-up batch on every worker, then answer as ready. A failure is logged and
        handed to `on_failure`."""
        start = time.monotonic()
        try:
            await self.batcher.start(lambda i: self.loader(self.settings))
            first = self.batcher.translators[0]
            loop = asyncio.get_running_loop()
            copies = [await loop.run_in_executor(None, lane_translator, first, False) for _ in range(PREPARE_THREADS)]
            self.preparer = Preparer(copies)
            self._describe(first)
            target = self.default_target or _first(self.languages["target"])
            source = None  # a model marking the source language with a token (M2M100 / NLLB-200) needs one
            if getattr(first.config, "target_language_token", False):
                source = next((lang for lang in self.languages["source"] if lang != target), None)
            warmup = TranslationRequest(WARMUP_SENTENCE, src_lang=source, tgt_lang=target)
            for i in range(self.settings.workers):
                await self.batcher.run_in_worker(i, _warm_up, warmup)
            if self.on_ready is not None:
                self.on_ready()
        except Exception as error:
            self.status, self.error = "failed", error
            logger.error("Loading %s failed: %s: %s", self.settings.model, type(error).__name__, error, exc_info=True)
            if self.on_failure is not None:
                self.on_failure(error)
            return
        if self.status == "loading":
            self.status = "ready"
            self.metrics.ready.set(1)
            settings = self.settings
            logger.info(
                "Ready: %s (%s, %s engine, %s, %d worker%s) loaded and warmed up in %.1f s",
                settings.model,
                self.info["model_type"],
                settings.engine,
                settings.precision,
                settings.workers,
                "s" if settings.workers > 1 else "",
                time.monotonic() - start,
            )

    def _describe(self, translator: Translator) -> None:
        """What /health, /languages and the metrics say of the model."""
        self.token_limit = self._token_limit(translator)
        self.languages = translator.languages
        self.default_target = translator.default_tgt_lang
        settings = self.settings
        self.info = {
            "model_type": getattr(translator.config, "model_type", None),
            "engine": settings.engine,
            "precision": settings.precision,
            "languages": self.languages,
            "max_sentence_tokens": self.token_limit,
            **({"weights": settings.weights} if settings.weights else {}),
        }
        self.metrics.model.info(
            {
                "model_type": str(self.info["model_type"]),
                "engine": settings.engine,
                "precision": settings.precision,
                "workers": str(settings.workers),
                "num_threads": str(settings.num_threads or "default"),
            }
        )

    @property
    def split_language(self) -> str | None:
        """The sentence splitter's language for a request that names none: the model's one source language."""
        sources = self.languages["source"]
        return sources[0] if len(sources) == 1 else None

    def _token_limit(self, translator: Translator) -> int | None:
        model_limit = translator.max_source_tokens
        flag = self.limits.max_sentence_tokens
        if flag is not None and model_limit is not None and flag > model_limit:
            raise ValueError(
                f"--max_sentence_tokens {flag} is above what the model accepts ({model_limit} tokens, "
                "config.max_position_embeddings)"
            )
        return flag if flag is not None else model_limit

    # ------------------------------------------------------------------------------------------------ stopping
    def begin_drain(self, timeout: float) -> None:
        """SIGTERM: answer new requests 503, let the queued and running ones finish for at most `timeout` seconds,
        then answer the rest 503 too (`drain`). Called on the event loop's thread."""
        if self.status in ("loading", "ready"):
            self.status = "stopping"
            self.metrics.ready.set(0)
        if self._drain is None:
            self._drain = asyncio.ensure_future(self.drain(timeout))

    async def drain(self, timeout: float) -> None:
        self.batcher.close()
        if self.batcher.idle:
            return
        queued, running = self.batcher.queued, self.batcher.running
        logger.info("Draining: %d sentences queued, %d batches decoding (at most %g s)", queued, running, timeout)
        if await self.batcher.drained(timeout):
            logger.info("Drained: every request in flight was answered")
            return
        logger.warning(
            "Drain timeout (--graceful_timeout_s %g): %d sentences queued and %d batches decoding are answered 503",
            timeout,
            self.batcher.queued,
            self.batcher.running,
        )
        await self.batcher.abort()

    async def stop(self) -> None:
        self.status = "stopping"
        self.metrics.ready.set(0)
        await self.batcher.stop()
        if self.preparer is not None:
            self.preparer.close()

    # -------------------------------------------------------------------------------------------- translate
    async def translate(self, request: Request) -> Response:
        self.check_ready()
        check_content_type(request.headers.get("content-type"))
        body = await read_body(request, self.limits)
        prepared = await self.preparer.run(
            prepare_body, body, self.limits, self.token_limit, self.split_language, self.settings.terms
        )
        results = await self.decode(request, prepared)
        return json_response(render(prepared, results))

    def check_ready(self) -> None:
        if self.status != "ready":
            raise self.not_ready()

    async def decode(self, request: Request, prepared: Prepared) -> list:
        """`prepared`'s sentences through the batcher (after the key's characters per minute); the results in
        order. The client leaving withdraws them (499); the limits and failures are JSON errors."""
        local = request.state
        local.sentences = len(prepared.requests)
        refusal = self.limiter.refusal(local.identity, "characters_per_minute", prepared.characters, "characters")
        if refusal is not None:
            raise refusal
        work = asyncio.ensure_future(
            self.batcher.translate(
                prepared.requests,
                prepared.lengths,
                prepared.options,
                prepared.key,
                timeout=self.limits.request_timeout_s,
                exclusive=prepared.exclusive,
                request_id=getattr(local, "request_id", None),
            )
        )
        gone = asyncio.ensure_future(wait_for_disconnect(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client left: its sentences leave the queue, its batch stops if nobody else waits
            work.cancel()
            with contextlib.suppress(BaseException):
                await work
            raise client_closed("before the answer")
        try:
            return work.result()
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
            raise self.not_ready("stopping") from None

    def not_ready(self, status: str | None = None) -> ApiError:
        status = status or self.status
        if status == "loading":
            return ApiError(503, "loading", "the model is still loading; retry shortly", headers={"Retry-After": "5"})
        if status == "failed":
            return ApiError(503, "failed", f"the model failed to load: {self.error}")
        return ApiError(503, "stopping", "the server is stopping", headers={"Connection": "close"})

    def health(self) -> Response:
        if self.status == "ready":
            return json_response({"status": "ready", **self.info})
        return json_response({"status": self.status}, 503, {"Retry-After": "5"} if self.status == "loading" else None)


def _first(items):
    return items[0] if items else None


def _warm_up(translator, request: TranslationRequest) -> None:
    """One decoding on the path requests take (`encode`, `resolve`, `decode_batch`)."""
    translator.decode_batch(translator.encode([request]), translator.resolve(DecodeOptions()))


# ------------------------------------------------------------------------------------------------------ the app
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "Invalid UTF-8 or JSON",
        401: "No or an invalid API key",
        403: "A cross-origin request from an origin not listed in --cors_origins",
        408: "The body did not arrive within body_timeout_s",
        413: "Over a size limit: max_body_bytes, max_sentences, max_sentence_tokens, characters_per_minute",
        415: "The body is not declared JSON",
        422: "A field of the wrong type or value, or over max_beams / max_new_tokens",
        429: "Over max_concurrent_requests, requests_per_minute or characters_per_minute (Retry-After)",
        500: "The engine failed on the batch that held this request",
        503: "Loading, stopping, or the queue is full (max_queue; Retry-After)",
        504: "Over request_timeout_s",
    }.items()
}


def _add_error_handlers(app: FastAPI, state: ServerState) -> None:
    def answer(request: Request, error: ApiError) -> Response:
        request.state.error = error.kind
        return error_response(error, state.metrics)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, error: ApiError):
        return answer(request, error)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException):
        kinds = {404: "not_found", 405: "method_not_allowed"}
        message = f"{request.method} {request.url.path}: {error.detail}"
        kind = kinds.get(error.status_code, "http_error")
        return answer(request, ApiError(error.status_code, kind, message, headers=dict(error.headers or {})))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, error: RequestValidationError):
        return answer(request, ApiError(422, "invalid_request", str(error)))

    @app.exception_handler(ClientDisconnect)
    async def disconnected(request: Request, error: ClientDisconnect):
        return answer(request, client_closed("before the answer"))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception):
        logger.exception("Internal error on %s %s", request.method, request.url.path)
        return answer(request, ApiError(500, "internal_error", f"internal error: {type(error).__name__}: {error}"))


def _add_routes(app: FastAPI, state: ServerState) -> None:
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
        summary="Translate one sentence or a list of sentences (or paragraphs, with split_sentences)",
    )
    async def translate(request: Request):
        return await state.translate(request)

    @app.get("/health", response_model=Health, responses={503: {"model": Health}}, summary="Readiness")
    async def health():
        return state.health()

    @app.get("/health/ready", response_model=Health, responses={503: {"model": Health}}, summary="Readiness probe")
    async def ready():
        return state.health()

    @app.get("/health/live", response_model=Liveness, summary="Liveness probe")
    async def live():
        return json_response({"status": "alive", "state": state.status})

    @app.get("/languages", response_model=LanguagesResponse, responses={503: {"model": ErrorResponse}})
    async def languages():
        """The languages the model translates from and into, and the target of a request without tgt_lang."""
        if state.status not in ("ready", "stopping"):
            raise state.not_ready()
        return json_response({**state.languages, "default_target": state.default_target})

    @app.get("/metrics", response_class=Response, summary="Prometheus metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page():
        return HTMLResponse(page_html(), headers=PAGE_HEADERS)


def _add_docs(app: FastAPI, title: str) -> None:
    folder = assets_folder()

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs():
        if folder is None:
            raise ApiError(
                404, "not_found", "the docs page needs the swagger-ui-bundle package: pip install 'hf-variants[serve]'"
            )
        return HTMLResponse(docs_page(title), headers=DOCS_HEADERS)

    @app.get("/docs/assets/{name}", include_in_schema=False)
    async def docs_asset(name: str):
        if folder is None or name not in ASSETS:
            raise ApiError(404, "not_found", f"no docs asset {name!r}")
        return FileResponse(folder / name, media_type=ASSETS[name], headers={"Cache-Control": "max-age=86400"})


def create_app(
    settings: ServeSettings,
    *,
    loader: Callable[[ServeSettings], Translator] | None = None,
    on_failure: Callable[[BaseException], None] | None = None,
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """The FastAPI application serving `settings.model`. Loading starts with the application (its lifespan) and
    runs in the background: `/health` answers 503 until the model is loaded and warmed up. `loader(settings)` builds
    one translator (per worker; default `load_translator`); `on_failure(error)` is called when loading fails,
    `on_ready()` (on the event loop) after the warm-up, before the server answers as ready. `app.state.serve` is the
    `ServerState` (`begin_drain` on SIGTERM)."""
    state = ServerState(settings, loader or load_translator, on_failure, on_ready)

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

    title = "hf-variants-serve"
    app = FastAPI(
        title=title,
        description="Translation with an hf_variants model, decoded in dynamic batches. Errors are "
        '`{"error": {"type", "message", "field"?, "limit"?, "value"?}}`.',
        version=_version(),
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.serve = state
    _add_error_handlers(app, state)
    _add_routes(app, state)
    add_libretranslate_routes(app, state)
    if settings.docs:
        _add_docs(app, title)
    app.add_middleware(
        Guard,
        state=state,
        error_response=lambda error: error_response(error, state.metrics),
        access_log=settings.access_log,
    )
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(settings.cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type", "X-Request-ID"],
            expose_headers=["X-Request-ID", "Retry-After"],
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
