"""The translation core: requests -> hypotheses, for every entry point (the translate and score commands, evaluation
during training, the HTTP server) and every engine (PyTorch, ONNX Runtime, CTranslate2).

- `requests`: `TranslationRequest`, `DecodeOptions`, `Hypothesis`, `TranslationResult`;
- `batching`: length-sorted batches by sentences or tokens (order restored), buffered streaming;
- `decode`: the engine layer (`Engine`, `ENGINES`; `TorchEngine`, `OnnxEngine`): one batch -> hypotheses with
  scores, log-probabilities and alignments; teacher-forced token log-probabilities;
- `translator`: `Translator`, which checks, batches and orders;
- `constraints`, `constrained`: lexically constrained decoding (a request's `constraints`: target phrases the
  translation must contain): the phrases and their token-level tracking, and the constrained beam search (dynamic
  beam allocation) that every engine with `supports_constraints` runs through a small step interface;
- `glossary`: `Glossary`, source terms -> target terms as constraints, and the per-sentence check of the terms.

Above the runtime subpackages (`onnx`, `deploy`), whose engines it drives; below `training` and `serve`.
"""

from .batching import buffered, length_sorted_batches
from .constraints import normalize_constraints, parse_constraints
from .decode import ENGINES, Engine, GenerateEngine, OnnxEngine, TorchEngine, engine_class
from .glossary import Glossary, GlossaryError, TermCheck
from .requests import DecodeOptions, Hypothesis, OptionError, TranslationRequest, TranslationResult
from .translator import Translator, check_languages, model_languages

__all__ = [
    "DecodeOptions",
    "ENGINES",
    "Engine",
    "GenerateEngine",
    "Glossary",
    "GlossaryError",
    "Hypothesis",
    "OnnxEngine",
    "OptionError",
    "TermCheck",
    "TorchEngine",
    "TranslationRequest",
    "TranslationResult",
    "Translator",
    "buffered",
    "check_languages",
    "engine_class",
    "length_sorted_batches",
    "model_languages",
    "normalize_constraints",
    "parse_constraints",
]
