"""The translation core: requests -> hypotheses, for every entry point (the translate and score commands, evaluation
during training, the HTTP server) and every engine (PyTorch, ONNX Runtime, CTranslate2).

- `requests`: `TranslationRequest`, `DecodeOptions`, `Hypothesis`, `TranslationResult`;
- `batching`: length-sorted batches by sentences or tokens (order restored), buffered streaming;
- `decode`: the engine layer (`Engine`, `ENGINES`; `TorchEngine`, `OnnxEngine`): one batch -> hypotheses with
  scores, log-probabilities and alignments; teacher-forced token log-probabilities;
- `translator`: `Translator`, which checks, batches and orders.

Above the runtime subpackages (`onnx`, `deploy`), whose engines it drives; below `training` and `serve`.
"""

from .batching import buffered, length_sorted_batches
from .decode import ENGINES, Engine, GenerateEngine, OnnxEngine, TorchEngine, engine_class
from .requests import DecodeOptions, Hypothesis, OptionError, TranslationRequest, TranslationResult
from .translator import Translator, check_languages, model_languages

__all__ = [
    "DecodeOptions",
    "ENGINES",
    "Engine",
    "GenerateEngine",
    "Hypothesis",
    "OnnxEngine",
    "OptionError",
    "TorchEngine",
    "TranslationRequest",
    "TranslationResult",
    "Translator",
    "buffered",
    "check_languages",
    "engine_class",
    "length_sorted_batches",
    "model_languages",
]
