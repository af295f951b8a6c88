"""Hugging Face Inference Endpoints handler of an hf_variants translation model (`handler.py` in the repository,
written by hf-variants-publish).

Inference Endpoints loads it from the repository's folder and calls:

    handler = EndpointHandler(path)   # the repository's folder
    handler({"inputs": "A dog runs.", "parameters": {"num_beams": 4}})
    # -> [{"translation_text": "..."}], one per input (a list of them per input with num_return_sequences > 1)

It needs transformers and torch only: the model, its tokenizer and the translation pipeline load from the
repository's own code (`trust_remote_code`), not from an installed hf_variants. `inputs` is a sentence or a list of
sentences; `parameters` may hold the languages (`src_lang`, `tgt_lang`), `truncation`, `batch_size` and the
generation settings below, each type-checked; anything else is refused with a ValueError naming it (the endpoint
answers it as an error), never passed on: no parameter names a file, a path or a model.
"""

from __future__ import annotations

import unicodedata

import torch
from transformers import pipeline

MAX_INPUTS = 256
# parameter -> the JSON types it takes (bool is no int; an int is a float)
PARAMETERS = {
    "src_lang": (str,),
    "tgt_lang": (str,),
    "truncation": (bool,),
    "batch_size": (int,),
    "num_beams": (int,),
    "num_return_sequences": (int,),
    "max_new_tokens": (int,),
    "max_length": (int,),
    "min_new_tokens": (int,),
    "length_penalty": (int, float),
    "early_stopping": (bool,),
    "do_sample": (bool,),
    "top_k": (int,),
    "top_p": (int, float),
    "temperature": (int, float),
    "no_repeat_ngram_size": (int,),
    "repetition_penalty": (int, float),
}
POSITIVE = {"batch_size", "num_beams", "num_return_sequences", "max_new_tokens", "max_length"}


def _check_text(text, name: str) -> str:
    if not isinstance(text, str):
        raise ValueError(f"`{name}` must be a string, got {type(text).__name__}")
    for position, char in enumerate(text):
        if unicodedata.category(char) in ("Cc", "Cs") and char != "\t":
            raise ValueError(f"`{name}` holds the control character U+{ord(char):04X} at position {position}")
    return text


def check_request(data) -> tuple[str | list[str], dict]:
    """(inputs, parameters) of a request body, or a ValueError naming the field at fault."""
    if not isinstance(data, dict):
        raise ValueError(
            f'the request must be a JSON object {{"inputs": ..., "parameters": ...}}, got {type(data).__name__}'
        )
    unknown = sorted(set(data) - {"inputs", "parameters"})
    if unknown:
        raise ValueError(f"unknown field(s) {unknown}: a request holds `inputs` and optionally `parameters`")
    if "inputs" not in data:
        raise ValueError("`inputs` is required: a sentence or a list of sentences")
    inputs = data["inputs"]
    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("`inputs` is an empty list")
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"`inputs` holds {len(inputs)} sentences; send at most {MAX_INPUTS} a request")
        inputs = [_check_text(text, f"inputs[{i}]") for i, text in enumerate(inputs)]
    else:
        inputs = _check_text(inputs, "inputs")
    parameters = data.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise ValueError(f"`parameters` must be an object, got {type(parameters).__name__}")
    for name, value in parameters.items():
        if name not in PARAMETERS:
            raise ValueError(f"unknown parameter `{name}` (known: {', '.join(sorted(PARAMETERS))})")
        kinds = PARAMETERS[name]
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join(k.__name__ for k in kinds)
            raise ValueError(f"parameter `{name}` must be {expected}, got {value!r}")
        if name in POSITIVE and value < 1:
            raise ValueError(f"parameter `{name}` must be at least 1, got {value}")
    return inputs, dict(parameters)


class EndpointHandler:
    """Inference Endpoints' custom handler: the repository's translation pipeline (see the module docstring)."""

    def __init__(self, path: str = ""):
        device = 0 if torch.cuda.is_available() else -1
        self.pipeline = pipeline("translation", model=path or ".", trust_remote_code=True, device=device)

    def __call__(self, data: dict) -> list:
        inputs, parameters = check_request(data)
        return self.pipeline(inputs, **parameters)
