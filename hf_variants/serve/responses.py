"""The server's answers and request bodies: JSON answers (non-finite floats as null), JSON errors, the body read
within its limits (`read_body`: 413, 408, 499), the client's disconnect."""

from __future__ import annotations

import asyncio
import json
import math
import time

from fastapi import Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from .limits import ApiError, ServeLimits, limit_error
from .metrics import ServeMetrics


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


# ------------------------------------------------------------------------------------------------------ the body
async def read_body(request: Request, limits: ServeLimits) -> bytes:
    """The body: 413 from its Content-Length or as soon as more than `--max_body_bytes` arrived, 408 when it takes
    longer than `--body_timeout_s`, 499 when the client leaves before it is in."""
    limit = limits.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise ApiError(400, "invalid_request", f"invalid Content-Length {declared!r}", field="Content-Length")
        if int(declared) > limit:
            raise _too_large(int(declared), limit)
    chunks, size = [], 0
    deadline = time.monotonic() + limits.body_timeout_s
    stream = request.stream().__aiter__()
    try:
        while True:
            try:
                chunk = await asyncio.wait_for(stream.__anext__(), max(0.0, deadline - time.monotonic()))
            except StopAsyncIteration:
                break
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, more=True)
            chunks.append(chunk)
    except asyncio.TimeoutError:
        raise limit_error(
            408,
            "body_timeout_s",
            limits.body_timeout_s,
            f"the body did not arrive in {limits.body_timeout_s:g} s (--body_timeout_s)",
            headers={"Connection": "close"},
        ) from None
    except ClientDisconnect:
        raise client_closed("while sending the body") from None
    return b"".join(chunks)


def client_closed(when: str) -> ApiError:
    return ApiError(499, "client_closed", f"the client closed the connection {when}")


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
