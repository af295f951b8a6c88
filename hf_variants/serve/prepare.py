"""A translate request made ready for the batcher, off the event loop, each step once.

`prepare_body` (the native route) and `prepare_parsed` (the LibreTranslate mount, which parses its own fields) run
in the preparation threads (`Preparer`: each with its own copy of the tokenizer), never on the event loop, so a large
body does not hold back `/health` or the other requests:

1. the body is decoded and checked (`limits.parse_json`, `parse_translate_request`: schema, limits, control
   characters by one regular expression);
2. with `split_sentences`, each item is split into sentences (`split_into_sentences`: sentencex, a maintained
   splitter of ~300 languages) and remembered as its pieces: the whitespace between sentences is kept as is;
3. the decoding options are resolved once (`Translator.resolve`), and their batch key computed;
4. every sentence is checked and tokenized once (`Translator.encode`): its token count and ids travel with it into
   the engine; a sentence over the token limit is refused (413 naming the item) or, with `--truncate`, cut there;
5. each sentence's constraints (its item's own `constraints`, then the terms of the request's glossary over the
   server's, `terms.py`) travel with it too, checked by the core before the request is queued
   (`Translator.check_constraints`: a 422 naming the item, never a failed batch); a request with constraints gets a
   batch key of its own (its sentences go to the constrained search, whose cost is not the plain search's).

`render` rebuilds each item from its sentences' results: the translation (or, with nbest / scores / alignments /
constraints / glossary, the object with its hypotheses, and its constraints and glossary terms), or for a split item
its sentences' best translations joined with the item's own whitespace; with constraints, `unmet_constraints` lists
the items whose translation misses one.
"""

from __future__ import annotations

import asyncio
import queue
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..inference.glossary import Glossary
from ..inference.requests import DecodeOptions, OptionError, TranslationRequest
from .limits import (
    ApiError,
    ParsedRequest,
    ServeLimits,
    check_beams,
    check_language_code,
    check_sentence,
    limit_error,
    parse_json,
    validation_error,
)
from .schema import TranslateRequest, server_options
from .terms import ServerTerms, core_refusal, item_record, parse_constraints, parse_glossary, sentence_constraints

DEFAULT_SPLIT_LANGUAGE = "en"  # sentencex's rules for a model that records no source language
_LINE_BREAKS = re.compile(r"\s*[\r\n\x85]+\s*")


def parse_translate_request(value, limits: ServeLimits) -> ParsedRequest:
    """Check a decoded JSON body against the schema and the limits that need no model (sentences, beams)."""
    if not isinstance(value, dict):
        raise ApiError(
            422,
            "invalid_request",
            f'the body must be a JSON object such as {{"text": "..."}}, got '
            f"{type(value).__name__ if not isinstance(value, list) else 'a list'}",
            field="body",
        )
    try:
        body = TranslateRequest.model_validate(value, strict=True)
    except ValidationError as error:
        raise validation_error(error) from None
    single = isinstance(body.text, str)
    texts = [body.text] if single else list(body.text)
    if not texts:
        raise ApiError(422, "invalid_request", "`text` is an empty list: send at least one sentence", field="text")
    if len(texts) > limits.max_sentences:
        raise limit_error(
            413,
            "max_sentences",
            limits.max_sentences,
            f"{len(texts)} sentences in one request; this server takes at most {limits.max_sentences} "
            "(--max_sentences): split the request",
            field="text",
        )
    for i, text in enumerate(texts):
        check_sentence(text, "text" if single else f"text[{i}]", paragraphs=body.split_sentences)
    for name in ("src_lang", "tgt_lang"):
        check_language_code(getattr(body, name), name)
    options = {name: getattr(body, name) for name in server_options() if getattr(body, name) is not None}
    check_beams(options, limits)
    if body.split_sentences:
        whole = [name for name in ("nbest", "scores", "alignments") if options.get(name)]
        if whole:
            raise ApiError(
                422,
                "invalid_request",
                f"`split_sentences` answers each item with its sentences' best translations joined: `{whole[0]}` "
                "is per sentence (send the sentences as items instead)",
                field=whole[0],
            )
    return ParsedRequest(
        texts=texts,
        single=single,
        src_lang=body.src_lang,
        tgt_lang=body.tgt_lang,
        options=options,
        fields=set(body.model_fields_set),
        split_sentences=body.split_sentences,
        constraints=parse_constraints(body.constraints, texts, single, body.split_sentences, limits),
        glossary=parse_glossary(body.glossary, limits),
    )


@dataclass
class Prepared:
    """A request ready for the batcher: per `text` item its `pieces` (text kept as is, or the index of a sentence in
    `requests`), the encoded sentences (`requests`, with `source_ids`), their token counts for batching
    (`lengths`, cut to the limit with --truncate), the items with a sentence cut (`truncated`), the resolved options
    and their batch `key`, the characters sent and whether its batches must decode alone (`exclusive`: sampling); the
    glossary that applied and whether some sentence has constraints."""

    parsed: ParsedRequest
    pieces: list[list[str | int]]
    requests: list[TranslationRequest]
    lengths: list[int]
    truncated: list[int]
    options: DecodeOptions
    key: tuple
    characters: int
    exclusive: bool = False
    extra: dict = field(default_factory=dict)
    glossary: Glossary | None = None  # the request's glossary over the server's (None: neither)
    constrained: bool = False  # some sentence has constraints


# ----------------------------------------------------------------------------------------------- sentences
def split_into_sentences(text: str, language: str | None) -> list[tuple[str, str, str]]:
    """(leading whitespace, sentence, trailing whitespace) of each sentence of `text`, by sentencex's rules for
    `language` (its generic rules for a language it does not know); whitespace between paragraphs is a piece of its
    own with an empty sentence. The pieces joined give `text` back."""
    from sentencex import segment

    parts = list(segment(language or DEFAULT_SPLIT_LANGUAGE, text))
    if "".join(parts) != text:  # never seen; a splitter that loses characters must not lose the user's text
        parts = [text]
    pieces = []
    for part in parts:
        core = part.strip()
        if not core:
            pieces.append((part, "", ""))
            continue
        lead = part[: len(part) - len(part.lstrip())]
        pieces.append((lead, core, part[len(lead) + len(core) :]))
    return pieces


def item_pieces(parsed: ParsedRequest, language: str | None) -> tuple[list[list[str | int]], list[str], list[int]]:
    """(per item its pieces, the sentences to translate, per sentence its item): one sentence per item, or with
    `split_sentences` each item's sentences (line breaks inside a sentence become spaces)."""
    pieces: list[list[str | int]] = []
    sentences: list[str] = []
    owners: list[int] = []
    for i, text in enumerate(parsed.texts):
        if not parsed.split_sentences:
            pieces.append([len(sentences)])
            sentences.append(text)
            owners.append(i)
            continue
        own: list[str | int] = []
        for lead, core, trail in split_into_sentences(text, language):
            own.append(lead)
            if core:
                own.append(len(sentences))
                sentences.append(_LINE_BREAKS.sub(" ", core))
                owners.append(i)
            own.append(trail)
        pieces.append([piece for piece in own if piece != ""])
    return pieces, sentences, owners


# ------------------------------------------------------------------------------------------------ the steps
def resolve(translator, parsed: ParsedRequest, limits: ServeLimits, token_limit: int | None):
    """The request's decoding options (those it sets, scores where it asks for objects), resolved against the
    model's saved choices, and their batch key; a 422 naming the option."""
    given = dict(parsed.options)
    given["scores"] = parsed.as_objects and not parsed.split_sentences
    given["nbest"] = given.get("nbest") or 1
    if limits.truncate:
        given["max_source_length"] = token_limit
    try:
        resolved = translator.resolve(DecodeOptions(**given))
    except OptionError as error:
        name = next((n for n in error.names if n in TranslateRequest.model_fields), None)
        raise ApiError(422, "invalid_request", str(error), field=name) from None
    return resolved, tuple(sorted(resolved.to_dict().items()))


def encode(translator, parsed: ParsedRequest, sentences: list[str], constraints: list) -> list[TranslationRequest]:
    """The sentences (with their constraints) checked against the model (languages) and tokenized once; a 422
    naming src_lang or tgt_lang."""
    requests = [
        TranslationRequest(s, src_lang=parsed.src_lang, tgt_lang=parsed.tgt_lang, constraints=c)
        for s, c in zip(sentences, constraints)
    ]
    try:
        translator.check_request(TranslationRequest("", src_lang=parsed.src_lang, tgt_lang=parsed.tgt_lang))
        return translator.encode(requests)
    except ValueError as error:
        message = re.sub(r"^requests\[\d+\]: ", "", str(error))
        name = next((n for n in ("src_lang", "tgt_lang") if message.startswith(n)), "tgt_lang")
        raise ApiError(422, "invalid_request", message, field=name) from None


def item_name(parsed: ParsedRequest, item: int) -> str:
    return "text" if parsed.single else f"text[{item}]"


def check_lengths(
    parsed: ParsedRequest, requests, owners: list[int], limits: ServeLimits, token_limit: int | None
) -> tuple[list[int], list[int]]:
    """(each sentence's token count for batching, the items with a sentence cut): 413 for a sentence over the token
    limit without `--truncate`, naming its item (and the sentence of a split item)."""
    counts = [len(r.source_ids) if r.source_ids is not None else 0 for r in requests]
    if token_limit is None:
        return counts, []
    for k, count in enumerate(counts):
        if count > token_limit and not limits.truncate:
            name = item_name(parsed, owners[k])
            which = f" (its sentence {owners[:k].count(owners[k]) + 1})" if parsed.split_sentences else ""
            raise limit_error(
                413,
                "max_sentence_tokens",
                token_limit,
                f"`{name}`{which} is {count} tokens long (special tokens included); this server translates at most "
                f"{token_limit} tokens a sentence (--max_sentence_tokens): split it",
                field=name,
            )
    truncated = sorted({owners[k] for k, count in enumerate(counts) if count > token_limit})
    return [min(count, token_limit) for count in counts], truncated


def check_constraints(translator, parsed: ParsedRequest, requests, options, owners: list[int], constraints) -> bool:
    """Whether some sentence has constraints; if so, the core's checks of them (a 422 naming the field)."""
    if not any(constraints):
        return False
    own = [len(parsed.constraints[owner]) if parsed.constraints is not None else 0 for owner in owners]
    try:
        translator.check_constraints(requests, options)
    except ValueError as error:  # OptionError included
        raise core_refusal(error, parsed, owners, own) from None
    return True


def prepare_parsed(
    translator,
    parsed: ParsedRequest,
    limits: ServeLimits,
    token_limit: int | None,
    language: str | None = None,
    terms: ServerTerms | None = None,
) -> Prepared:
    """Steps 2-5 of the module docstring on a checked request (`language`: the sentence splitter's, when the request
    names no `src_lang`; `terms`: the server's glossary)."""
    pieces, sentences, owners = item_pieces(parsed, parsed.src_lang or language)
    if len(sentences) > limits.max_sentences:
        raise limit_error(
            413,
            "max_sentences",
            limits.max_sentences,
            f"the request's items hold {len(sentences)} sentences; this server takes at most {limits.max_sentences} "
            "a request (--max_sentences): split the request",
            field="text",
        )
    options, key = resolve(translator, parsed, limits, token_limit)
    glossary = (terms or ServerTerms()).for_request(parsed.glossary)
    constraints = sentence_constraints(parsed, sentences, owners, glossary, limits)
    requests = encode(translator, parsed, sentences, constraints)
    lengths, truncated = check_lengths(parsed, requests, owners, limits, token_limit)
    constrained = check_constraints(translator, parsed, requests, options, owners, constraints)
    if constrained:  # the constrained search's batches: apart from the plain search's
        key = (*key, ("constraints", True))
    characters = sum(len(text) for text in parsed.texts)
    prepared = Prepared(
        parsed, pieces, requests, lengths, truncated, options, key, characters, bool(options.do_sample)
    )
    prepared.glossary, prepared.constrained = glossary, constrained
    return prepared


def prepare_body(
    translator, body: bytes, limits: ServeLimits, token_limit: int | None, language=None, terms=None
) -> Prepared:
    """A `POST /translate` body, parsed and checked (step 1), then `prepare_parsed`."""
    parsed = parse_translate_request(parse_json(body), limits)
    return prepare_parsed(translator, parsed, limits, token_limit, language, terms)


# ------------------------------------------------------------------------------------------------- answers
def joined(pieces: Sequence[str | int], texts: Sequence[str]) -> str:
    """An item rebuilt: its whitespace as sent, each sentence replaced by `texts[sentence]`."""
    return "".join(piece if isinstance(piece, str) else texts[piece] for piece in pieces)


def render(prepared: Prepared, results) -> dict:
    """The JSON answer of `POST /translate` (`schema.TranslateResponse`)."""
    parsed = prepared.parsed
    texts = [result.text for result in results]
    if not (parsed.as_objects or parsed.terms) or parsed.split_sentences:
        translations: list = [joined(pieces, texts) for pieces in prepared.pieces]
    else:
        alignments = bool(parsed.options.get("alignments"))
        scores = bool(prepared.options.scores)
        translations = [
            {
                "source": result.source,
                "hypotheses": [h.to_dict(scores=scores, alignments=alignments) for h in result.hypotheses],
                **item_record(result, prepared.glossary),
            }
            for result in results
        ]
    answer = {"translations": translations, "truncated": prepared.truncated}
    if prepared.constrained:
        answer["unmet_constraints"] = [
            i
            for i, pieces in enumerate(prepared.pieces)
            if any(isinstance(k, int) and results[k].unmet_constraints for k in pieces)
        ]
    return answer


# ------------------------------------------------------------------------------------------------- threads
class Preparer:
    """Runs the preparation steps in threads of their own, each call with one of `translators` (copies sharing the
    model, each with its own tokenizer: a fast tokenizer is not shared across threads)."""

    def __init__(self, translators: list):
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        for translator in translators:
            self._free.put(translator)
        self._pool = ThreadPoolExecutor(len(translators), thread_name_prefix="hf-variants-serve-prepare")

    async def run(self, function: Callable[..., Any], *args) -> Any:
        """`function(translator, *args)` in a preparation thread."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._call, function, args)

    def _call(self, function, args):
        translator = self._free.get()
        try:
            return function(translator, *args)
        finally:
            self._free.put(translator)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
