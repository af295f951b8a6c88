"""The JSON bodies of the API, as pydantic models: they validate requests (strictly: no type is coerced, unknown
fields are refused) and give the OpenAPI schema (`GET /openapi.json`, `GET /docs`).

No field names a file, a path, a model or an engine: those are the server's flags, never a client's choice.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

EXAMPLE = {"text": ["A man rides a bike.", "Two dogs play in the snow."], "num_beams": 4}


class TranslateRequest(BaseModel):
    """`POST /translate`: one sentence or a list of them, with optional languages and decoding settings. Settings
    left out take the model's saved generation config (the decoding the model was evaluated with)."""

    model_config = ConfigDict(extra="forbid", strict=True, json_schema_extra={"examples": [EXAMPLE]})

    text: str | list[str] = Field(
        description="A sentence, or a non-empty list of sentences (at most --max_sentences). One sentence per item: "
        'control characters (line breaks included) are refused; an empty or blank item translates to "".'
    )
    src_lang: str | None = Field(None, description="Source language code, for models with several (GET /health).")
    tgt_lang: str | None = Field(None, description="Target language code, for models with several (GET /health).")
    num_beams: int | None = Field(None, ge=1, description="Beam size (at most --max_beams; 1 is greedy).")
    nbest: int | None = Field(
        None, ge=1, description="Hypotheses per sentence (at most num_beams): each translation becomes an object."
    )
    max_new_tokens: int | None = Field(
        None, ge=1, description="Most tokens to generate per sentence (at most the model's positions)."
    )
    scores: bool = Field(
        False, description="Return each translation as an object with its hypotheses' scores, as nbest does."
    )


class Hypothesis(BaseModel):
    text: str
    score: float | None = Field(None, description="What the beam ranked by (length-normalized log-probability).")
    log_prob: float | None = Field(None, description="Sum of the token log-probabilities, end of sentence included.")
    tokens: list[str] | int | None = Field(None, description="The hypothesis' tokens.")


class Scored(BaseModel):
    source: str
    hypotheses: list[Hypothesis]


class TranslateResponse(BaseModel):
    translations: list[str] | list[Scored] = Field(
        description="One item per input sentence, in order: the translation, or with `nbest` / `scores` an object "
        "holding the source and its hypotheses, best first."
    )
    truncated: list[int] = Field(
        default_factory=list,
        description="Indexes of the sentences cut to the token limit before translating (only with --truncate).",
    )


class ErrorDetail(BaseModel):
    type: str = Field(description="The error's kind: invalid_json, invalid_request, a limit's name, ...")
    message: str
    field: str | None = Field(None, description="The request field at fault, e.g. text[3].")
    limit: str | None = Field(None, description="The server limit refused against (its flag without --).")
    value: int | float | None = Field(None, description="That limit's value.")


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: str = Field(description="ready, loading, stopping or failed")
    model_type: str | None = None
    engine: str | None = None
    precision: str | None = None
    languages: list[str] | None = None
    max_sentence_tokens: int | None = None
