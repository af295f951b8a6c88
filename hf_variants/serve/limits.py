"""What the server accepts: its limits, and the checks of a request body, each refusal a JSON error naming the field
or the limit.

| limit (flag) | default | refusal |
| --- | --- | --- |
| `--max_body_bytes` | 1 MiB | 413 (from Content-Length before reading, or while reading) |
| `--max_sentences` per request | 128 | 413 |
| `--max_sentence_tokens` | the model's positions | 413, or the sentence is cut with `--truncate` |
| `--max_beams` | 8 | 422 (and `nbest` at most `num_beams`) |
| `--max_constraints` per sentence (its own and its glossary terms') | 8 | 422 |
| `--max_constraint_chars` per constraint phrase, form or glossary term | 200 | 422 |
| `--max_glossary_terms` of a request's `glossary` | 256 | 413 |
| `max_new_tokens` of a request | the model's positions | 422 |
| `--max_queue` sentences waiting | 2048 | 503 with `Retry-After` |
| `--request_timeout_s` | 60 | 504 (the request's sentences leave the queue; its batch stops if nobody else waits) |
| `--max_concurrent_requests` translate requests in flight | 256 | 429 with `Retry-After` |
| `--requests_per_minute` per API key (per client address without keys) | none | 429 with `Retry-After` |
| `--characters_per_minute` per API key (idem) | none | 429 with `Retry-After` (413 above a minute's worth) |
| `--body_timeout_s` for the whole body | 30 | 408 |
| `--header_timeout_s` for the headers | 10 | 408, and the connection is closed |
| `--idle_timeout_s` without a request | 5 | the connection is closed |
| `--max_connections` open connections | 512 | 503, and the connection is closed |

Each refusal's `type` and `limit` are the limit's name (the flag without `--`); tokens count special tokens (the
language tag and `</s>`); a sentence cut by `--truncate` is listed in the answer's `truncated`. An API key's own
limits (`KEY requests_per_minute=N characters_per_minute=N` in `--api_key_file`) replace the flags' for that key.

Malformed bodies: a Content-Type other than JSON 415; invalid UTF-8 or invalid JSON 400 (`invalid_json`, with the
byte or line and column); wrong types, unknown fields, an empty list, control characters (C0 and C1, line breaks
included, tab allowed; line breaks allowed with `split_sentences`) or unpaired surrogates in a sentence 422
(`invalid_request`, naming the field, e.g. `text[3]`). None of these ever reaches the engine.
"""

from __future__ import annotations

import json
import math
import re
import unicodedata
from dataclasses import dataclass, field

from pydantic import ValidationError

from .schema import TranslateRequest


@dataclass(frozen=True)
class ServeLimits:
    """The server's limits and batching settings (the flags of `hf-variants-serve`, same names)."""

    max_body_bytes: int = 1 << 20
    max_sentences: int = 128
    max_sentence_tokens: int | None = None  # None: the model's positions
    truncate: bool = False
    max_beams: int = 8
    max_constraints: int = 8
    max_constraint_chars: int = 200
    max_glossary_terms: int = 256
    max_queue: int = 2048
    request_timeout_s: float = 60.0
    max_batch_tokens: int = 4096
    max_wait_ms: float = 10.0
    concurrent_batches: int = 2
    max_concurrent_requests: int = 256
    requests_per_minute: int | None = None
    characters_per_minute: int | None = None
    max_connections: int = 512
    idle_timeout_s: float = 5.0
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0

    def __post_init__(self):
        integers = ("max_body_bytes", "max_sentences", "max_beams", "max_queue", "max_batch_tokens")
        integers += ("concurrent_batches", "max_concurrent_requests", "max_connections")
        integers += ("max_constraints", "max_constraint_chars", "max_glossary_terms")
        optional = ("max_sentence_tokens", "requests_per_minute", "characters_per_minute")
        for name in integers + optional:
            value = getattr(self, name)
            if value is None and name in optional:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"`{name}` must be an integer >= 1, got {value!r}")
        for name in ("request_timeout_s", "idle_timeout_s", "header_timeout_s", "body_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and 0 < value < math.inf):
                raise ValueError(f"`{name}` must be a positive number, got {value!r}")
        if not (isinstance(self.max_wait_ms, (int, float)) and 0 <= self.max_wait_ms < math.inf):
            raise ValueError(f"`max_wait_ms` must be a number >= 0, got {self.max_wait_ms!r}")
        if self.max_sentences > self.max_queue:
            raise ValueError(
                f"`max_sentences` ({self.max_sentences}) is above `max_queue` ({self.max_queue}): a full request "
                "could never be queued"
            )


class ApiError(Exception):
    """A refused or failed request: HTTP `status`, an error `kind`, a one-line `message`, and the `field` or the
    `limit` (with its `value`) it names."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        field: str | None = None,
        limit: str | None = None,
        value: int | float | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.field, self.limit, self.value = field, limit, value
        self.headers = headers or {}

    def body(self) -> dict:
        error = {"type": self.kind, "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        if self.limit is not None:
            error["limit"] = self.limit
            error["value"] = self.value
        return {"error": error}


def limit_error(status: int, limit: str, value, message: str, **kwargs) -> ApiError:
    """A refusal against the limit `limit` (kind and limit are its name)."""
    return ApiError(status, limit, message, limit=limit, value=value, **kwargs)


# ----------------------------------------------------------------------------------------------------- the body
JSON_TYPES = re.compile(r"^application/(?:[\w.+-]+\+)?json$")


def check_content_type(content_type: str | None) -> None:
    """415 unless the body is declared JSON (`application/json`, `application/*+json`). Requiring it also makes a
    cross-origin browser request a non-simple one, which the browser must clear with a preflight first."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if not JSON_TYPES.match(media):
        raise ApiError(
            415,
            "unsupported_media_type",
            f"the body must be JSON sent with `Content-Type: application/json`, got {content_type!r}"
            if content_type
            else "the body must be JSON sent with `Content-Type: application/json` (the request has no Content-Type)",
            field="Content-Type",
        )


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def parse_json(body: bytes):
    """The JSON value of `body`: 400 `invalid_json` for invalid UTF-8 (naming the byte), invalid JSON (line and
    column), NaN/Infinity, or nesting too deep to parse."""
    if not body.strip():
        raise ApiError(400, "invalid_json", 'the body is empty: send a JSON object such as {"text": "..."}')
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(
            400, "invalid_json", f"the body is not valid UTF-8: byte {error.start} (0x{body[error.start]:02x})"
        ) from None
    if text.startswith("\ufeff"):
        text = text[1:]
    try:
        return json.loads(text, parse_constant=_no_constants)
    except json.JSONDecodeError as error:
        raise ApiError(
            400, "invalid_json", f"the body is not valid JSON: {error.msg} (line {error.lineno}, column {error.colno})"
        ) from None
    except ValueError as error:  # NaN / Infinity
        raise ApiError(400, "invalid_json", f"the body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "invalid_json", "the body is not valid JSON: nested too deeply") from None


def _field_name(location) -> str:
    name = ""
    for part in location:
        if isinstance(part, int):
            name += f"[{part}]"
        elif part in ("str", "list[str]"):  # the union's branch names
            continue
        else:
            name += ("." if name else "") + str(part)
    return name or "body"


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_from_float": "an integer",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
}


def _describe(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validation_error(error: ValidationError) -> ApiError:
    """The first problem pydantic found, as a 422 naming the field."""
    problems = error.errors(include_url=False)
    # `text` is a union: report the list branch for a list (the item at fault), the string branch otherwise
    first = next((p for p in problems if "list[str]" in p["loc"] and len(p["loc"]) > 2), problems[0])
    name = _field_name(first["loc"])
    kind = first["type"]
    if kind == "extra_forbidden":
        fields = ", ".join(TranslateRequest.model_fields)
        message = f"unknown field `{name}` (the fields are {fields})"
    elif kind == "missing":
        message = f"`{name}` is required"
    elif name == "text" and kind in ("string_type", "list_type"):
        message = f"`text` must be a string or a list of strings, got {_describe(first.get('input'))}"
    elif kind in _TYPE_WORDS:
        message = f"`{name}` must be {_TYPE_WORDS[kind]}, got {_describe(first.get('input'))}"
    elif kind == "greater_than_equal":
        message = f"`{name}` must be >= {first['ctx']['ge']}, got {_describe(first.get('input'))}"
    else:
        message = f"`{name}`: {first['msg']}"
    return ApiError(422, "invalid_request", message, field=name)


# control characters (unicodedata category Cc: C0, DEL, C1) but tab, and unpaired surrogates (Cs); with
# `split_sentences` line feeds and carriage returns are text too
_REFUSED = re.compile("[\x00-\x08\x0a-\x1f\x7f-\x9f\ud800-\udfff]")
_REFUSED_IN_PARAGRAPHS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\ud800-\udfff]")


def check_sentence(text: str, name: str, paragraphs: bool = False) -> None:
    """422 for control characters (C0, DEL, C1; tab allowed, line breaks too with `paragraphs`) and unpaired
    surrogates (from `\\ud800` escapes). One regular expression over the text (a 1 MB body is checked in
    milliseconds)."""
    found = (_REFUSED_IN_PARAGRAPHS if paragraphs else _REFUSED).search(text)
    if found is None:
        return
    char, position = found.group(), found.start()
    if unicodedata.category(char) == "Cs":
        raise ApiError(
            422,
            "invalid_request",
            f"`{name}` holds an unpaired surrogate (U+{ord(char):04X}) at position {position}: not a character",
            field=name,
        )
    what = "a line break" if char in "\n\r\x85\x0b\x0c" else "a control character"
    hint = "" if paragraphs else " (or set `split_sentences` to send paragraphs)"
    raise ApiError(
        422,
        "invalid_request",
        f"`{name}` holds {what} (U+{ord(char):04X}) at position {position}: send one sentence per item, "
        f"without control characters{hint}",
        field=name,
    )


@dataclass
class ParsedRequest:
    """A validated `POST /translate` body: the sentences as a list (and whether one string was sent), the languages,
    the decoding options it sets (`options`: DecodeOptions field -> value, those not null), its own `constraints` per
    item and its `glossary`'s (source, target forms) pairs (`terms.py`; None: the field was not sent)."""

    texts: list[str]
    single: bool
    src_lang: str | None = None
    tgt_lang: str | None = None
    options: dict = field(default_factory=dict)
    fields: set = field(default_factory=set)
    split_sentences: bool = False
    constraints: list | None = None
    glossary: list | None = None

    @property
    def as_objects(self) -> bool:
        """Whether each translation is answered as an object with its hypotheses (`nbest`, `scores`, `alignments`)
        rather than as a string."""
        return any(self.options.get(name) for name in ("nbest", "scores", "alignments"))

    @property
    def terms(self) -> bool:
        """Whether the request sent `constraints` or `glossary` (its items then answer as objects with their
        constraints and glossary terms)."""
        return self.constraints is not None or self.glossary is not None


def check_beams(options: dict, limits: ServeLimits) -> None:
    """`num_beams` at most --max_beams, `nbest` at most `num_beams` (or --max_beams when it is left out)."""
    beams, nbest = options.get("num_beams"), options.get("nbest")
    if beams is not None and beams > limits.max_beams:
        raise limit_error(
            422,
            "max_beams",
            limits.max_beams,
            f"num_beams={beams}: this server decodes with at most {limits.max_beams} beams (--max_beams)",
            field="num_beams",
        )
    if nbest is not None and nbest > (beams or limits.max_beams):
        raise ApiError(
            422,
            "invalid_request",
            f"nbest={nbest} is above num_beams={beams or limits.max_beams}"
            f"{'' if beams else ' (--max_beams)'}: a beam search returns at most num_beams hypotheses",
            field="nbest",
        )


def check_language_code(code: str | None, name: str) -> None:
    """422 for a language code that is no code (letters, digits, `_`, `-`; at most 32)."""
    if code is not None and not re.fullmatch(r"[A-Za-z0-9_-]{1,32}", code):
        raise ApiError(422, "invalid_request", f"`{name}` is not a language code: {_describe(code)}", field=name)
