"""The server's logs: one line per event on stderr, as text or as JSON (`--log_format json`), and the access log.

Every record may carry `fields` (`logger.info(message, extra={"fields": {...}})`): in JSON they are keys of the
object, in text `key=value` pairs after the message. The access log (`hf_variants.serve.access`, one line per
request, written by the server itself once the answer is sent or the client gone) carries: `request_id` (the
request's `X-Request-ID`, echoed in the answer), `client`, `method`, `path`, `status` (499: the client closed the
connection before the answer), `duration_ms`, and where they apply `error` (the error's type), `sentences` and `key`
(the first 8 hex digits of the API key's SHA-256, never the key).

    {"time": "2025-01-01T12:00:00.123Z", "level": "INFO", "logger": "hf_variants.serve.access",
     "message": "POST /translate 200", "request_id": "4f1c...", "client": "10.0.0.7:53210", "method": "POST",
     "path": "/translate", "status": 200, "duration_ms": 41.2, "sentences": 3}
"""

from __future__ import annotations

import json
import logging
import sys
import time

ACCESS_LOGGER = "hf_variants.serve.access"
LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601 with milliseconds), level, logger, message, the record's
    `fields`, and `exception` (the formatted traceback) where there is one."""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        line = {
            "time": f"{stamp}.{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "fields", None) or {})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    """`TEXT_FORMAT`, then the record's `fields` as `key=value`."""

    def __init__(self):
        super().__init__(TEXT_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, "fields", None)
        if not fields:
            return text
        head, newline, tail = text.partition("\n")  # a traceback stays after the fields
        pairs = " ".join(f"{key}={value}" for key, value in fields.items() if value is not None)
        return f"{head} {pairs}{newline}{tail}"


def configure_logging(level: str, log_format: str = "text") -> None:
    """The root logger at `level` with one stderr handler in `log_format` ("text" or "json"); uvicorn's loggers
    write through it."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))


def log_access(fields: dict, message: str | None = None) -> None:
    """One access-log line (see the module docstring); `message` default: method, path and status."""
    message = message or f"{fields.get('method')} {fields.get('path')} {fields.get('status')}"
    present = {key: value for key, value in fields.items() if value is not None}
    logging.getLogger(ACCESS_LOGGER).info(message, extra={"fields": present})
