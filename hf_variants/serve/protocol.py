"""The HTTP connection handling: uvicorn's HTTP protocols (httptools' C parser, or h11 in pure Python) with the
server's connection hygiene.

uvicorn keeps a connection that sends nothing open for ever (its keep-alive timer starts after a first answer, and
any byte restarts it), never times out headers sent a byte at a time, has no connection cap, bounds a request's
headers only with h11 (a plain-text 400) and closes a connection at once after an answer sent before the request's
body was read: a client still sending the body (urllib sends it all before reading) gets a connection reset instead
of the answer. `protocol_class` gives either protocol, per connection:

- `idle_timeout_s`: a connection with no request in progress (a new one, or between keep-alive requests) is closed;
- `header_timeout_s`: a request's headers must arrive in full this long after its first byte, else a 408 JSON
  error and the connection closes;
- `MAX_HEADER_BYTES`: a request's headers over 16 KiB get a 431 JSON error and the connection closes;
- `body_timeout_s`: the body must arrive in full this long after the headers (the route answers 408 itself when it
  reads the body; this closes a connection whose unread body is still trickling in a second later);
- `max_connections`: a connection over the cap gets a 503 JSON error (`Retry-After: 1`) and is closed;
- a lingering close: when the connection closes while the request's body is still arriving (an early 413, 401,
  408) the server sends its answer, shuts its side (FIN), then reads and drops what the client still sends for at
  most `LINGER_S` seconds or `LINGER_BYTES` bytes before closing, so the client reads the answer instead of a reset
  (what nginx's `lingering_close` does); an answer given while the body is unread closes the connection so.

Refusals are counted in the server's metrics (`errors_total{kind}`: idle_timeout_s, header_timeout_s,
header_bytes, body_timeout_s, max_connections) and, but for idle connections, written in the access log with the
client's address (they never reached a route).

httptools is the default where it is installed (the serve extra installs it): with uvloop, the event loop's CPU time
a request is 20-30% lower than h11's on asyncio (benchmarks/RESULTS.md, section 14).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
from collections.abc import Callable

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools is not installed: the h11 protocol only

    class HttpToolsProtocol:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError("the httptools HTTP parser is not installed: pip install httptools")


LINGER_S = 5.0
LINGER_BYTES = 64 << 20
MAX_HEADER_BYTES = 16 << 10  # a request's header section (h11's and nginx's default are 16 KiB and 4 x 8 KiB)
# h11's own cap (a plain-text 400), set so far above MAX_HEADER_BYTES that the module's 431 comes first: it is
# checked after every read of the socket, and a read is at most 256 KiB
H11_INCOMPLETE_EVENT_BYTES = 4 << 20
PARSERS = ("auto", "httptools", "h11")


def raw_error(status: int, reason: str, kind: str, message: str, extra_headers: str = "") -> bytes:
    """A complete HTTP/1.1 JSON error answer that closes the connection, written outside h11 (which answers only
    requests it has parsed)."""
    body = json.dumps({"error": {"type": kind, "message": message, "limit": kind}}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        f"connection: close\r\n{extra_headers}\r\n"
    )
    return head.encode("latin-1") + body


class _Discard(asyncio.Protocol):
    """Reads and drops what a client still sends after the answer, until it closes its side, `LINGER_S` pass or
    `LINGER_BYTES` arrived; then closes and tells the HTTP protocol the connection is gone."""

    def __init__(self, transport, owner: _Hygiene):
        self.transport, self.owner, self.received = transport, owner, 0
        self.timer = asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.received > LINGER_BYTES:
            self.close()

    def eof_received(self) -> bool:
        self.close()
        return False

    def close(self) -> None:
        self.timer.cancel()
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self.timer.cancel()
        self.owner.connection_lost(exc)


class _Transport:
    """The connection's transport as the HTTP protocol sees it: `close()` lingers while the client may still be
    sending (see the module docstring)."""

    def __init__(self, transport, owner: _Hygiene):
        self._transport, self._owner, self._closed = transport, owner, False

    def __getattr__(self, name):
        return getattr(self._transport, name)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        transport = self._transport
        if transport.is_closing():
            return
        if not self._owner.client_may_send() or not transport.can_write_eof():
            transport.close()
            return
        transport.write_eof()
        transport.set_protocol(_Discard(transport, self._owner))
        transport.resume_reading()

    def is_closing(self) -> bool:
        return self._closed or self._transport.is_closing()


def protocol_class(
    *,
    idle_timeout_s: float,
    header_timeout_s: float,
    body_timeout_s: float,
    max_connections: int,
    on_refusal: Callable[[str], None] | None = None,
    parser: str = "auto",
) -> type[asyncio.Protocol]:
    """The protocol class of `uvicorn.Config(http=...)` with these settings (see the module docstring), on `parser`
    ("httptools", "h11", or "auto": httptools when installed); `on_refusal(kind, client)` is called for every
    connection closed by a limit (`client`: "host:port")."""
    base = {"httptools": HttpToolsServeProtocol, "h11": H11ServeProtocol}[resolve_parser(parser)]
    return type(
        base.__name__,
        (base,),
        {
            "idle_timeout_s": idle_timeout_s,
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "max_connections": max_connections,
            "on_refusal": staticmethod(on_refusal or (lambda kind, client: None)),
        },
    )


def resolve_parser(parser: str) -> str:
    """ "httptools" or "h11" for `parser` ("auto": httptools when it is installed, as uvicorn's own choice)."""
    if parser == "auto":
        return "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    if parser not in PARSERS:
        raise ValueError(f"unknown HTTP parser {parser!r}: one of {', '.join(PARSERS)}")
    return parser


class _Hygiene:
    """The timeouts, the header cap, the connection cap and the lingering close (module docstring), over either of
    uvicorn's HTTP protocols: a subclass says where the request being read stands (`_reading`)."""

    idle_timeout_s = 5.0
    header_timeout_s = 10.0
    body_timeout_s = 30.0
    max_connections = 512
    on_refusal = staticmethod(lambda kind, client: None)

    def _reading(self) -> str:
        """Where the request being read stands: "none" (no request, or the first bytes of its headers), "body"
        (its headers in, its body not yet in full) or "done" (read in full)."""
        raise NotImplementedError

    def _answered_early(self) -> bool:
        """Whether the request just answered had its body not yet read in full."""
        return self._reading() == "body"

    def _refused_by(self, kind: str) -> None:
        client = f"{self.client[0]}:{self.client[1]}" if self.client else None
        self.on_refusal(kind, client)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.transport = _Transport(transport, self)
        self._timer: asyncio.TimerHandle | None = None
        self._phase = "idle"  # idle -> headers -> body -> answering -> idle ...
        self._header_bytes = 0
        self._refused = False
        self.timeout_keep_alive = self.idle_timeout_s
        if len(self.connections) > self.max_connections:
            self._refused = True
            self._refused_by("max_connections")
            self.transport.write(
                raw_error(
                    503,
                    "Service Unavailable",
                    "max_connections",
                    f"the server holds {self.max_connections} connections, its most (--max_connections): retry",
                    "retry-after: 1\r\n",
                )
            )
            self.transport.close()
            return
        self._arm(self.idle_timeout_s, self._idle_expired)

    def client_may_send(self) -> bool:
        """Whether the client may still be sending (a request body not read in full, or a refused connection)."""
        return self._refused or self._reading() == "body"

    def _arm(self, seconds: float, callback) -> None:
        self._disarm()
        self._timer = self.loop.call_later(seconds, callback)

    def _disarm(self) -> None:
        if getattr(self, "_timer", None) is not None:
            self._timer.cancel()
            self._timer = None

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if self._phase == "idle":
            self._phase = "headers"
            self._header_bytes = 0
            self._arm(self.header_timeout_s, self._headers_expired)
        if self._phase == "headers":
            self._header_bytes += len(data)
        super().data_received(data)
        self._follow()
        if self._phase == "headers" and self._header_bytes > MAX_HEADER_BYTES and not self.transport.is_closing():
            self._headers_too_large()

    def _follow(self) -> None:
        """Move the timers along with the request: headers in -> the body's timer; the body in -> none."""
        reading = self._reading()
        if self._phase == "headers" and reading != "none":
            self._phase = "body"
            self._arm(self.body_timeout_s + 1.0, self._body_expired)
        if self._phase == "body" and reading != "body":
            self._phase = "answering"
            self._disarm()

    def on_response_complete(self) -> None:
        body_unread = self._answered_early()
        super().on_response_complete()
        if self.transport.is_closing():
            return
        if body_unread:  # the answer came before the body: close, lingering (never wait for an unbounded body)
            self.transport.close()
            return
        if self._reading() == "none":
            self._phase = "idle"
            self._arm(self.idle_timeout_s, self._idle_expired)
        else:  # a pipelined request already under way
            self._phase = "headers"
            self._header_bytes = 0
            self._follow()

    def _idle_expired(self) -> None:
        if self._phase == "idle" and not self.transport.is_closing():
            self._refused_by("idle_timeout_s")
            self.transport.close()

    def _headers_expired(self) -> None:
        if self._phase != "headers" or self.transport.is_closing():
            return
        self._refused_by("header_timeout_s")
        message = f"the request's headers did not arrive in {self.header_timeout_s:g} s (--header_timeout_s)"
        self.transport.write(raw_error(408, "Request Timeout", "header_timeout_s", message))
        self.transport.close()

    def _headers_too_large(self) -> None:
        self._disarm()
        self._refused_by("header_bytes")
        message = f"the request's headers are over {MAX_HEADER_BYTES} bytes"
        self.transport.write(raw_error(431, "Request Header Fields Too Large", "header_bytes", message))
        self._refused = True  # what still comes is dropped (the lingering close reads it)
        self.transport.close()

    def _body_expired(self) -> None:
        if self._phase != "body" or self.transport.is_closing():
            return
        self._refused_by("body_timeout_s")
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class H11ServeProtocol(_Hygiene, H11Protocol):
    """uvicorn's h11 protocol (pure Python) with the server's connection handling."""

    def _reading(self) -> str:
        state = self.conn.their_state
        return "none" if state is h11.IDLE else "body" if state is h11.SEND_BODY else "done"


class HttpToolsServeProtocol(_Hygiene, HttpToolsProtocol):
    """uvicorn's httptools protocol (the C parser of Node.js, llhttp) with the server's connection handling: the
    parser's callbacks say where the request being read stands."""

    _parsed = "none"

    def on_message_begin(self) -> None:
        self._parsed = "none"
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._parsed = "body"
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._parsed = "done"
        # the read's bytes counted as headers were this request's: a pipelined request begun in the same read is
        # counted from the next read on (so a read holding a request with its body never counts as headers)
        self._header_bytes = 0
        super().on_message_complete()

    def _answered_early(self) -> bool:
        # a request waiting in the pipeline began after the answered one was read in full
        return self._parsed == "body" and not self.pipeline

    def _reading(self) -> str:
        if self._parsed == "done" and not self.pipeline and (self.cycle is None or self.cycle.response_complete):
            return "none"  # the last request read is answered
        return self._parsed
