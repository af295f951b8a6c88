"""The JSON bodies of the API, as pydantic models: they validate requests (strictly: no type is coerced, unknown
fields are refused) and give the OpenAPI schema (`GET /openapi.json`, `GET /docs`).

No field names a file, a path, a model or an engine: those are the server's flags, never a client's choice.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, create_model

from ..inference.requests import OptionSpec, option_specs

EXAMPLE = {"text": ["A man rides a bike.", "Two dogs play in the snow."], "num_beams": 4}

# what the server adds to an option's own help (its type, range and help come from DecodeOptions' field metadata)
SERVER_NOTES = {
    "num_beams": "at most --max_beams",
    "nbest": "at most num_beams (samples: at most --max_beams); each translation becomes an object with its "
    "hypotheses",
    "scores": "each translation becomes an object with its hypotheses' scores, as nbest does",
    "alignments": "each translation becomes an object; engines that return attentions only (torch)",
    "max_length": "at most the model's positions",
    "max_new_tokens": "at most the model's positions",
}


CONSTRAINTS_HELP = (
    "Target phrases the translation must contain (lexically constrained decoding). For one sentence: a list of "
    'constraints, each a phrase or a list of alternative forms of which one must appear (["Kasse", ["Warenkorb", '
    '"Einkaufswagen"]]); for a list of sentences: one such list per sentence ([] or null: none). At most '
    "--max_constraints per sentence (glossary terms included), --max_constraint_chars characters a phrase. Not with "
    "split_sentences. Each translation becomes an object with its constraints and unmet_constraints."
)
GLOSSARY_HELP = (
    'Source term -> target term for every sentence: a list of {"source": ..., "target": ...} or an object '
    "{source: target}; a target is a string (alternative forms separated by |) or a list of forms. A term found in "
    "a sentence adds its target term to the sentence's constraints. Adds to the server's --glossary (the request's "
    "target wins for a term both give); matched as the server's flags say. At most --max_glossary_terms terms. Each "
    "translation becomes an object listing the terms that applied and whether each was found (send [] to see the "
    "server glossary's terms)."
)
_PHRASE = {"type": "string", "minLength": 1}
_CONSTRAINT = {"anyOf": [_PHRASE, {"type": "array", "items": _PHRASE, "minItems": 1}]}
_TARGET = {"anyOf": [_PHRASE, {"type": "array", "items": _PHRASE, "minItems": 1}]}
CONSTRAINTS_SCHEMA = {
    "anyOf": [
        {"type": "array", "items": _CONSTRAINT},
        {"type": "array", "items": {"anyOf": [{"type": "array", "items": _CONSTRAINT}, {"type": "null"}]}},
        {"type": "null"},
    ],
    "description": CONSTRAINTS_HELP,
    "examples": [["Kasse", ["Warenkorb", "Einkaufswagen"]]],
}
GLOSSARY_SCHEMA = {
    "anyOf": [
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"source": _PHRASE, "target": _TARGET},
                "required": ["source", "target"],
                "additionalProperties": False,
            },
        },
        {"type": "object", "additionalProperties": _TARGET},
        {"type": "null"},
    ],
    "description": GLOSSARY_HELP,
    "examples": [[{"source": "checkout", "target": "Kasse|Kassenbereich"}], {"checkout": "Kasse"}],
}


class TranslateRequestBase(BaseModel):
    """`POST /translate`: one sentence or a list of them, with optional languages and decoding settings. Settings
    left out take the model's saved generation config (the decoding the model was evaluated with)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [EXAMPLE]})

    text: str | list[str] = Field(
        description="A sentence, or a non-empty list of sentences (at most --max_sentences). One sentence per item: "
        'control characters (line breaks included) are refused; an empty or blank item translates to "".'
    )
    src_lang: str | None = Field(None, description="Source language code, for models with several (GET /languages).")
    tgt_lang: str | None = Field(None, description="Target language code, for models with several (GET /languages).")
    split_sentences: bool = Field(
        False,
        description="Each item is a paragraph or a document: line breaks allowed, split into sentences (sentencex), "
        "translated in the same batches and joined with their whitespace (each sentence counts against "
        "--max_sentences and --max_sentence_tokens). Not with nbest, scores or alignments.",
    )
    # checked by `terms.parse_constraints` / `terms.parse_glossary` (messages naming the item, the limits)
    constraints: Annotated[Any, WithJsonSchema(CONSTRAINTS_SCHEMA)] = Field(None, description=CONSTRAINTS_HELP)
    glossary: Annotated[Any, WithJsonSchema(GLOSSARY_SCHEMA)] = Field(None, description=GLOSSARY_HELP)


def option_field(name: str, spec: OptionSpec) -> tuple[Any, Any]:
    """The request field of a decoding option: its type (or null: the model's choice), range and help."""
    bounds = {}
    if spec.minimum is not None:
        bounds["ge"] = spec.kind(spec.minimum)
    if spec.above is not None:
        bounds["gt"] = spec.kind(spec.above)
    if spec.maximum is not None:
        bounds["le"] = spec.kind(spec.maximum)
    if spec.kind is float:
        bounds["allow_inf_nan"] = False
    help_text = spec.help[0].upper() + spec.help[1:]
    note = f" ({SERVER_NOTES[name]})" if name in SERVER_NOTES else ""
    return spec.kind | None, Field(None, description=f"{help_text}{note}.", **bounds)


def server_options() -> dict[str, OptionSpec]:
    """The decoding options a request may set (`OptionSpec.server`): every `DecodeOptions` field but those the
    server's flags decide (`max_source_length`: `--max_sentence_tokens` with `--truncate`)."""
    return {name: spec for name, spec in option_specs().items() if spec.server}


TranslateRequest = create_model(
    "TranslateRequest",
    __base__=TranslateRequestBase,
    __doc__=TranslateRequestBase.__doc__,
    **{name: option_field(name, spec) for name, spec in server_options().items()},
)


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(None, description="What the beam ranked by (length-normalized log-probability).")
    log_prob: float | None = Field(None, description="Sum of the token log-probabilities, end of sentence included.")
    tokens: list[str] | int | None = Field(None, description="The hypothesis' tokens.")
    alignment: str | None = Field(None, description="With `alignments`: Pharaoh `source-target` word index pairs.")
    constraints_met: list[bool] | None = Field(
        None, description="With constraints: per constraint of the sentence, whether this hypothesis contains it."
    )


class TermFound(BaseModel):
    source: str = Field(description="The glossary's source term found in the sentence.")
    target: list[str] = Field(description="Its target term's forms.")
    found: bool = Field(description="Whether the translation contains one of them.")


class Scored(BaseModel):
    source: str
    hypotheses: list[Hypothesis]
    constraints: list[list[str]] | None = Field(
        None,
        description="The sentence's constraints (its own, then its glossary terms'), each as its forms: with "
        "`constraints` or a glossary, when it has any.",
    )
    unmet_constraints: list[list[str]] | None = Field(
        None, description="Those the best hypothesis misses: they could not be placed within the length limit."
    )
    glossary: list[TermFound] | None = Field(
        None, description="With a glossary (the request's or the server's): the terms that applied to the sentence."
    )


class TranslateResponse(BaseModel):
    translations: list[str] | list[Scored] = Field(
        description="One item per input sentence, in order: the translation, or with `nbest` / `scores` / "
        "`alignments` / `constraints` / `glossary` an object holding the source and its hypotheses, best first (and "
        "its constraints and glossary terms)."
    )
    truncated: list[int] = Field(
        default_factory=list,
        description="Indexes of the sentences cut to the token limit before translating (only with --truncate).",
    )
    unmet_constraints: list[int] | None = Field(
        None,
        description="When some sentence had constraints (its own or a glossary's): the indexes of the items whose "
        "translation misses one (split items included).",
    )


class ErrorDetail(BaseModel):
    type: str = Field(description="The error's kind: invalid_json, invalid_request, a limit's name, ...")
    message: str
    field: str | None = Field(None, description="The request field at fault, e.g. text[3].")
    limit: str | None = Field(None, description="The server limit refused against (its flag without --).")
    value: int | float | None = Field(None, description="That limit's value.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Languages(BaseModel):
    """`GET /languages`, and `languages` in `GET /health`: the language codes the model translates from and into
    (empty lists: the model records none)."""

    source: list[str] = Field(description="Source language codes (`src_lang`).")
    target: list[str] = Field(description="Target language codes (`tgt_lang`).")


class LanguagesResponse(Languages):
    default_target: str | None = Field(None, description="The target language a request without `tgt_lang` gets.")


class Health(BaseModel):
    status: str = Field(description="ready, loading, stopping or failed")
    model_type: str | None = None
    engine: str | None = None
    precision: str | None = None
    languages: Languages | None = None
    max_sentence_tokens: int | None = None
    weights: str | None = Field(None, description="A training checkpoint's weights: ema (moving average) or raw.")


class Liveness(BaseModel):
    status: str = Field(description="alive: the process answers HTTP (loading, ready or stopping)")
    state: str = Field(description="loading, ready, stopping or failed (what /health/ready answers)")
