"""A LibreTranslate-compatible mount under `/libretranslate/`: the clients and plugins written for LibreTranslate's
API work against this server unchanged (their base URL `http://HOST:PORT/libretranslate`).

| route | what |
| --- | --- |
| `POST /libretranslate/translate` | `q` (a text or a list), `source`, `target`, `format`, `alternatives`, `api_key` |
| `GET /libretranslate/languages` | `[{"code", "name", "targets"}]` |
| `GET /libretranslate/frontend/settings` | what LibreTranslate's web page asks first (limits, keys) |

As LibreTranslate takes them: a JSON body, a form (`application/x-www-form-urlencoded` or `multipart/form-data`), or
query parameters; the answer `{"translatedText": ...}` (a string, or a list for a list of texts), with
`"alternatives"` (per text, up to `alternatives` other translations: the n-best list's next hypotheses, joined
sentence by sentence, duplicates dropped) and `"detectedLanguage"` for `source: "auto"`; errors
`{"error": "message"}` with LibreTranslate's statuses (400 for a bad request or a limit, 403 for an invalid key, 429
"Slowdown: ..." over a rate limit, 500, and this server's 503 / 504). Texts are documents: each is split into
sentences (sentencex), translated in the server's batches with the other requests, and joined with its whitespace.

What differs: `source: "auto"` is accepted for a model with one source language (that language, reported as
`detectedLanguage` with confidence 100: nothing is detected); `format: "html"` is refused (400, markup is not
translated); the language `name` is its code (the model records codes only). The API key is `api_key` in the body
or `Authorization: Bearer KEY`; it has the native API's per-key limits.
"""

from __future__ import annotations

import io
import json
from urllib.parse import parse_qsl

from fastapi import FastAPI, Request

from .access import bearer, match_key
from .limits import ApiError, ParsedRequest, ServeLimits, check_beams, check_language_code, check_sentence
from .prepare import Prepared, joined, prepare_parsed
from .responses import json_response, read_body

PREFIX = "/libretranslate"
FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"


class LtError(Exception):
    """A refusal in LibreTranslate's form: `{"error": message}` with `status`."""

    def __init__(self, status: int, message: str, headers: dict | None = None, kind: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.headers, self.kind = status, message, headers or {}, kind

    @classmethod
    def of(cls, error: ApiError) -> LtError:
        status = 400 if error.status in (413, 422, 415) else error.status
        message = f"Slowdown: {error.message}" if error.status == 429 else error.message
        return cls(status, message, error.headers, error.kind)


def missing(name: str) -> LtError:
    return LtError(400, f"Invalid request: missing {name} parameter")


# ------------------------------------------------------------------------------------------------------ fields
def read_fields(body: bytes, content_type: str | None, query: dict) -> dict:
    """The request's fields: a JSON object, or a form / query parameters (values as strings; `q` with its line
    endings made `\\n`, as LibreTranslate does)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media.endswith("json"):
        try:
            value = json.loads(body.decode("utf-8")) if body.strip() else None
        except (UnicodeDecodeError, ValueError):
            raise LtError(400, "Invalid JSON format") from None
        if not isinstance(value, dict):
            raise LtError(400, "Invalid JSON format")
        return value
    fields = dict(query)
    if media == FORM:
        try:
            fields.update(parse_qsl(body.decode("utf-8"), keep_blank_values=True))
        except UnicodeDecodeError:
            raise LtError(400, "Invalid request: the form is not UTF-8") from None
    elif media == MULTIPART:
        fields.update(multipart_fields(body, content_type))
    if isinstance(fields.get("q"), str):
        fields["q"] = "\n".join(fields["q"].splitlines())
    return fields


def multipart_fields(body: bytes, content_type: str) -> dict:
    """The text fields of a multipart/form-data body (python-multipart, what Starlette parses forms with); a file
    is refused."""
    from python_multipart import parse_form
    from python_multipart.exceptions import FormParserError

    fields: dict[str, str] = {}

    def on_field(part) -> None:
        fields[part.field_name.decode("utf-8", "replace")] = (part.value or b"").decode("utf-8", "replace")

    def on_file(part) -> None:
        raise LtError(400, "Invalid request: files are not translated here (send the text as q)")

    headers = {"Content-Type": content_type, "Content-Length": str(len(body))}
    try:
        parse_form(headers, io.BytesIO(body), on_field, on_file)
    except FormParserError as error:
        raise LtError(400, f"Invalid request: {error}") from None
    return fields


# ------------------------------------------------------------------------------------------------ the request
def texts_of(fields: dict) -> tuple[list[str], bool]:
    q = fields.get("q")
    if q is None or q == "" or q == []:
        raise missing("q")
    if isinstance(q, str):
        return [q], True
    if not isinstance(q, list) or not all(isinstance(item, str) for item in q):
        raise LtError(400, "Invalid request: q must be a text or a list of texts")
    return list(q), False


def alternatives_of(fields: dict, limits: ServeLimits) -> int:
    value = fields.get("alternatives", 0)
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().lstrip("-").isdigit():
        raise LtError(400, "Invalid request: alternatives parameter is not a number")
    count = max(0, int(value))
    if count > limits.max_beams - 1:
        raise LtError(400, f"Invalid request: alternatives parameter must be <= {limits.max_beams - 1}")
    return count


def languages_of(fields: dict, languages: dict) -> tuple[str | None, str | None, bool]:
    """(src_lang, tgt_lang, whether source was "auto") checked against the model's languages (a model recording
    none gets neither)."""
    source, target = fields.get("source"), fields.get("target")
    if not source:
        raise missing("source")
    if not target:
        raise missing("target")
    if not isinstance(source, str) or not isinstance(target, str):
        raise LtError(400, "Invalid request: source and target are language codes")
    sources, targets = languages["source"], languages["target"]
    auto = source == "auto"
    if auto:
        if len(sources) != 1:
            raise LtError(400, f"auto is not supported: pass source (one of {', '.join(sources) or 'the model'}'s)")
        source = sources[0]
    for name, code in (("source", source), ("target", target)):
        try:
            check_language_code(code, name)
        except ApiError:
            raise LtError(400, f"{code} is not supported") from None
    if sources and source not in sources:
        raise LtError(400, f"{source} is not supported")
    if targets and target not in targets:
        raise LtError(400, f"{target} is not supported")
    if not sources and not targets:
        return None, None, auto
    return source, target, auto


def parse_libretranslate(translator, fields: dict, limits: ServeLimits, languages: dict):
    """(the request as the native API's `ParsedRequest`, with `split_sentences`; alternatives; whether source was
    "auto"), or an `LtError`."""
    texts, single = texts_of(fields)
    text_format = fields.get("format") or "text"
    if text_format != "text":
        raise LtError(400, f"{text_format} format is not supported")
    alternatives = alternatives_of(fields, limits)
    src_lang, tgt_lang, auto = languages_of(fields, languages)
    if len(texts) > limits.max_sentences:
        raise LtError(
            400,
            f"Invalid request: request ({len(texts)}) exceeds text limit ({limits.max_sentences}, --max_sentences)",
        )
    options = {}
    if alternatives:
        saved = int(getattr(translator.generation_config, "num_beams", None) or 1)
        options = {"nbest": alternatives + 1, "num_beams": max(alternatives + 1, saved)}
    try:
        check_beams(options, limits)
        for i, text in enumerate(texts):
            check_sentence(text, "q" if single else f"q[{i}]", paragraphs=True)
    except ApiError as error:
        raise LtError.of(error) from None
    parsed = ParsedRequest(texts, single, src_lang, tgt_lang, options, set(fields), split_sentences=True)
    return parsed, alternatives, auto


def prepare_libretranslate(translator, fields, limits, token_limit, languages, language, terms=None):
    """`parse_libretranslate`, then the native preparation (split, resolve, tokenize once; the server's glossary
    `terms` applied); errors as `LtError`."""
    parsed, alternatives, auto = parse_libretranslate(translator, fields, limits, languages)
    try:
        prepared = prepare_parsed(translator, parsed, limits, token_limit, language, terms)
    except ApiError as error:
        raise LtError.of(error) from None
    prepared.extra.update(alternatives=alternatives, auto=auto)
    return prepared


def answer(prepared: Prepared, results) -> dict:
    """LibreTranslate's answer: translatedText, alternatives, detectedLanguage."""
    parsed, count = prepared.parsed, prepared.extra["alternatives"]
    best = [joined(pieces, [r.text for r in results]) for pieces in prepared.pieces]
    body: dict = {"translatedText": best[0] if parsed.single else best}
    if count:
        others = []
        for item, pieces in enumerate(prepared.pieces):
            found: list[str] = []
            for k in range(1, count + 1):
                texts = [r.hypotheses[k].text if len(r.hypotheses) > k else r.text for r in results]
                text = joined(pieces, texts)
                if text != best[item] and text not in found:
                    found.append(text)
            others.append(found)
        body["alternatives"] = others[0] if parsed.single else others
    if prepared.extra["auto"]:
        detected = {"confidence": 100.0, "language": parsed.src_lang}
        body["detectedLanguage"] = detected if parsed.single else [detected] * len(parsed.texts)
    return body


# ------------------------------------------------------------------------------------------------------- routes
def add_libretranslate_routes(app: FastAPI, state) -> None:
    """The mount's routes on `app`, on the server's `ServerState` (its batcher, limits and keys)."""

    def lt_response(request: Request, error: LtError):
        request.state.error = error.kind
        state.metrics.errors.labels(error.kind).inc()
        return json_response({"error": error.message}, error.status, error.headers)

    @app.post(f"{PREFIX}/translate", summary="LibreTranslate: translate texts", tags=["libretranslate"])
    async def lt_translate(request: Request):
        try:
            state.check_ready()
            body = await read_body(request, state.limits)
            query = dict(request.query_params)
            fields = await state.preparer.run(lambda _t: read_fields(body, request.headers.get("content-type"), query))
            authorize(request, state, fields)
            prepared = await state.preparer.run(
                prepare_libretranslate,
                fields,
                state.limits,
                state.token_limit,
                state.languages,
                state.split_language,
                state.settings.terms,
            )
            results = await state.decode(request, prepared)
        except ApiError as error:
            return lt_response(request, LtError.of(error))
        except LtError as error:
            return lt_response(request, error)
        return json_response(answer(prepared, results))

    @app.get(f"{PREFIX}/languages", summary="LibreTranslate: the languages", tags=["libretranslate"])
    async def lt_languages(request: Request):
        if state.status not in ("ready", "stopping"):
            return lt_response(request, LtError.of(state.not_ready()))
        sources, targets = state.languages["source"], state.languages["target"]
        codes = list(dict.fromkeys([*sources, *targets]))
        return json_response(
            [
                {"code": code, "name": code, "targets": [t for t in targets if t != code] if code in sources else []}
                for code in codes
            ]
        )

    @app.get(f"{PREFIX}/frontend/settings", summary="LibreTranslate: the page's settings", tags=["libretranslate"])
    async def lt_settings():
        sources, targets = state.languages["source"], state.languages["target"]
        first_source, first_target = (sources or ["auto"])[0], state.default_target or (targets or [""])[0]
        keys = bool(state.settings.api_keys)
        return json_response(
            {
                "charLimit": -1,
                "frontendTimeout": 500,
                "apiKeys": keys,
                "keyRequired": keys,
                "suggestions": False,
                "filesTranslation": False,
                "supportedFilesFormat": [],
                "language": {
                    "source": {"code": first_source, "name": first_source},
                    "target": {"code": first_target, "name": first_target},
                },
            }
        )


def authorize(request: Request, state, fields: dict) -> None:
    """The key (`api_key` or `Authorization: Bearer`): 400 missing, 403 invalid (LibreTranslate's statuses); then
    the key's requests per minute."""
    keys = state.settings.api_keys
    local = request.state
    if keys:
        given = fields.get("api_key") or bearer(request.headers.get("authorization"))
        if not given:
            raise LtError(400, "Please contact the server operator to get an API key", kind="unauthorized")
        digest = match_key(keys, str(given))
        if digest is None:
            raise LtError(403, "Invalid API key", kind="unauthorized")
        local.identity, local.key = digest, digest.hex()[:8]
    refusal = state.limiter.refusal(local.identity, "requests_per_minute", 1, "requests")
    if refusal is not None:
        raise LtError.of(refusal)
