"""Who may call the server and how much: the ASGI middleware in front of every route (`Guard`), API keys, per-key
rate limits (`RateLimiter`), request ids and the access log.

For every HTTP request, in this order:

1. a request id: the request's `X-Request-ID` (1 to 128 of `A-Z a-z 0-9 . _ : -`), else a new one; echoed in the
   answer's `X-Request-ID` and written in the access log and in the engine's error lines;
2. the Host check (a server bound to a loopback address answers only loopback names and `--allowed_hosts`: a page
   cannot reach it through a DNS name rebound to 127.0.0.1) and the cross-origin refusal (an `Origin` that is
   neither the server's own nor listed in `--cors_origins` gets 403);
3. with API keys (`--api_key_file`), `Authorization: Bearer KEY` on every route but the open ones (compared in
   constant time: SHA-256 digests through `hmac.compare_digest`, every key compared), else 401; the LibreTranslate
   mount's translate route checks its key itself (LibreTranslate clients send `api_key` in the body);
4. on the translate routes: `--max_concurrent_requests` (429 with `Retry-After` above it) and the key's requests per
   minute (`--requests_per_minute`, or the key's own in the key file; per client address without keys); the
   characters per minute are taken once the body is read (`RateLimiter.take_characters`);
5. the request metrics (count by route and status, latency, requests in flight) and one access-log line
   (`logs.log_access`) once it is answered: status 499 when the client left before the answer.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import math
import os
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from .limits import ApiError, limit_error
from .logs import log_access

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
OPEN_PATHS = frozenset(
    {
        "/",
        "/health",
        "/health/live",
        "/health/ready",
        "/languages",
        "/docs",
        "/openapi.json",
        "/libretranslate/languages",
        "/libretranslate/frontend/settings",
    }
)
OPEN_PREFIXES = ("/docs/assets/",)
KEY_IN_ROUTE = frozenset({"/libretranslate/translate"})  # the route checks the key (header or body)
TRANSLATE_PATHS = frozenset({"/translate", "/libretranslate/translate"})
ENDPOINTS = OPEN_PATHS | TRANSLATE_PATHS | {"/metrics"}
REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
# the ids the server gives requests without a valid X-Request-ID: 128 random bits as 32 hex digits (uuid4().hex's
# format) from a generator seeded once from the system's entropy. uuid4() reads os.urandom per call, a system call
# after which the event loop waits for the GIL behind the engine threads (a fifth of the event loop thread's
# samples at 64 clients on one core, py-spy). The ids need to be unique, not secret.
# A process forked from this one (a server manager preloading the app) seeds its own generator again, so that no
# two processes give the same ids.
_REQUEST_IDS = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _REQUEST_IDS.seed(os.urandom(32)))


def new_request_id() -> str:
    return f"{_REQUEST_IDS.getrandbits(128):032x}"


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


def match_key(keys: Sequence[bytes], token: str | None) -> bytes | None:
    """The digest of `keys` that `token` is (every key compared, each in constant time), or None."""
    if not token or not keys:
        return None
    given = key_digest(token.strip().encode("latin-1", "replace"))
    found = None
    for digest in keys:
        if hmac.compare_digest(given, digest):
            found = digest
    return found


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer TOKEN` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


# ------------------------------------------------------------------------------------------------- rate limits
@dataclass(frozen=True)
class KeyLimits:
    """Requests and characters per minute of one API key (None: no limit)."""

    requests_per_minute: int | None = None
    characters_per_minute: int | None = None


class RateLimiter:
    """Token buckets per identity (an API key's digest, or a client address without keys): each holds at most a
    minute's worth and refills continuously, so a client may burst up to its per-minute limit and then goes at the
    limit's pace. `limits` are the defaults (the flags), `per_key` an API key's own."""

    MAX_BUCKETS = 100_000  # idle full buckets are dropped beyond this

    def __init__(self, limits: KeyLimits, per_key: dict | None = None):
        self.limits, self.per_key = limits, dict(per_key or {})
        self._buckets: dict[tuple, list[float]] = {}

    def limit(self, identity, kind: str) -> int | None:
        own = self.per_key.get(identity)
        return getattr(own, kind) if own is not None and getattr(own, kind) is not None else getattr(self.limits, kind)

    def take(self, identity, kind: str, amount: int, now: float | None = None) -> float | None:
        """Take `amount` from `identity`'s `kind` bucket ("requests_per_minute" or "characters_per_minute"): None
        when it had them, else the seconds until it will (inf: more than a minute's worth)."""
        limit = self.limit(identity, kind)
        if limit is None:
            return None
        if amount > limit:
            return math.inf
        now = time.monotonic() if now is None else now
        rate = limit / 60.0
        tokens, last = self._buckets.get((identity, kind), (float(limit), now))
        tokens = min(float(limit), tokens + (now - last) * rate)
        if tokens < amount:
            self._buckets[(identity, kind)] = [tokens, now]
            return (amount - tokens) / rate
        self._buckets[(identity, kind)] = [tokens - amount, now]
        if len(self._buckets) > self.MAX_BUCKETS:
            self._prune(now)
        return None

    def _prune(self, now: float) -> None:
        for key, (tokens, last) in list(self._buckets.items()):
            if now - last > 60.0:
                del self._buckets[key]

    def refusal(self, identity, kind: str, amount: int, what: str) -> ApiError | None:
        """The 429 (413 above a minute's worth) of `take`, naming the limit; None when allowed."""
        wait = self.take(identity, kind, amount)
        if wait is None:
            return None
        limit = self.limit(identity, kind)
        if math.isinf(wait):
            return limit_error(
                413,
                kind,
                limit,
                f"{amount} {what} in one request; this server takes at most {limit} a minute (--{kind}): split it",
            )
        retry = max(1, math.ceil(wait))
        return limit_error(
            429,
            kind,
            limit,
            f"over {limit} {what} a minute (--{kind}): retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )


# ------------------------------------------------------------------------------------------------- the middleware
def _headers(scope) -> dict[str, str]:
    headers: dict[str, str] = {}
    for name, value in scope.get("headers", []):
        headers.setdefault(name.decode("latin-1").lower(), value.decode("latin-1"))
    return headers


class Guard:
    """ASGI middleware in front of the routes (see the module docstring). `state` is the app's `ServerState`
    (settings, metrics, batcher, rate limiter); `error_response(error)` builds a JSON error answer."""

    def __init__(self, app, state, error_response, access_log: bool = True):
        self.app, self.state, self.error_response, self.access_log = app, state, error_response, access_log
        settings = state.settings
        self.keys = settings.api_keys
        self.origins = set(settings.cors_origins)
        self.allowed_hosts = None if settings.allowed_hosts is None else {h.lower() for h in settings.allowed_hosts}
        self.translating = 0  # translate requests in flight

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        given = headers.get("x-request-id", "")
        request_id = given if REQUEST_ID.fullmatch(given) else new_request_id()
        local = scope.setdefault("state", {})
        local["request_id"] = request_id
        start, status = time.monotonic(), [None]

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", request_id.encode())]}
            await send(message)

        metrics = self.state.metrics
        metrics.in_flight.inc()
        try:
            await self._route(scope, receive, send_with_id, headers)
        finally:
            metrics.in_flight.dec()
            self._record(scope, status[0] if status[0] is not None else 500, start, headers)

    async def _route(self, scope, receive, send, headers) -> None:
        path = scope.get("path", "")
        refusal = self.refusal(scope, headers)
        translating = path in TRANSLATE_PATHS and scope.get("method") == "POST"
        if refusal is None and translating:
            refusal = self._over_limits(scope, path)
        if refusal is not None:
            scope["state"]["error"] = refusal.kind
            if _carries_a_body(headers):
                # refused before its body was read: the connection closes after the answer, so that a client
                # keeping it alive never sends its next request on a connection whose unread body the server drops
                refusal.headers = {**refusal.headers, "Connection": "close"}
            await self.error_response(refusal)(scope, receive, send)
            return
        if not translating:
            await self.app(scope, receive, send)
            return
        self.translating += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.translating -= 1

    def _over_limits(self, scope, path: str) -> ApiError | None:
        limits = self.state.limits
        if self.translating >= limits.max_concurrent_requests:
            retry = str(max(1, self.state.batcher.retry_after()))
            return limit_error(
                429,
                "max_concurrent_requests",
                limits.max_concurrent_requests,
                f"{self.translating} translate requests are in flight, the most this server takes "
                f"(--max_concurrent_requests): retry in {retry} s",
                headers={"Retry-After": retry},
            )
        if path in KEY_IN_ROUTE:
            return None  # the route knows the key: it takes the request itself
        return self.state.limiter.refusal(scope["state"]["identity"], "requests_per_minute", 1, "requests")

    def refusal(self, scope, headers: dict[str, str]) -> ApiError | None:
        """The Host, Origin and API-key checks; records the caller's identity (key digest or client address)."""
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
        digest = match_key(self.keys, bearer(headers.get("authorization")))
        client = scope.get("client") or ("unknown", 0)
        scope["state"]["identity"] = digest if self.keys else client[0]
        scope["state"]["key"] = digest.hex()[:8] if digest else None
        path = scope.get("path", "")
        if not self.keys or path in OPEN_PATHS or path.startswith(OPEN_PREFIXES) or path in KEY_IN_ROUTE:
            return None
        if scope.get("method") == "OPTIONS" and origin is not None and "access-control-request-method" in headers:
            return None  # a CORS preflight (no credentials by design) of a listed origin
        if digest is None:
            reason = "no API key" if not headers.get("authorization") else "an invalid API key"
            return ApiError(
                401, "unauthorized", f"{reason}: send `Authorization: Bearer KEY` with a key of --api_key_file"
            )
        return None

    def _record(self, scope, status: int, start: float, headers: dict[str, str]) -> None:
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/docs/assets" if path.startswith(OPEN_PREFIXES) else "other")
        seconds = time.monotonic() - start
        metrics = self.state.metrics
        metrics.requests.labels(endpoint, str(status)).inc()
        metrics.latency.labels(endpoint).observe(seconds)
        if not self.access_log:
            return
        local = scope.get("state", {})
        client = scope.get("client")
        log_access(
            {
                "request_id": local.get("request_id"),
                "client": f"{client[0]}:{client[1]}" if client else None,
                "method": scope.get("method"),
                "path": path,
                "status": status,
                "duration_ms": round(1000 * seconds, 1),
                "error": local.get("error"),
                "sentences": local.get("sentences"),
                "key": local.get("key"),
            }
        )


def _carries_a_body(headers: dict[str, str]) -> bool:
    """Whether a request announces a body (a Content-Length above 0, or a chunked one)."""
    length = headers.get("content-length", "0").strip()
    return (length.isdigit() and int(length) > 0) or "transfer-encoding" in headers
