"""Model cards and Hub publishing for hf_variants models.

- `model_cards.card`: build a `huggingface_hub.ModelCard` for a trained model from its run folder
  (`results.json` + `model/`) or from explicit arguments, with Hub metadata (language, license, tags,
  datasets, metrics, base_model, model-index with BLEU/chrF and the sacreBLEU signatures) and one Jinja
  template per variant family (`model_cards/templates/<model_type>.md`, all extending `_base.md`).
- `model_cards.publish`: push a saved model folder (weights, tokenizer, remote code, card) to the Hub named
  by `HF_ENDPOINT`, with clear errors and without ever writing or logging the token.

The names below are imported on first use, so that `python -m model_cards.publish` (or `.card`) runs its module
once, as `__main__`, without importing it first (runpy's "found in sys.modules" RuntimeWarning).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FAMILIES": "card",
    "build_model_card": "card",
    "card_from_run": "card",
    "load_results": "card",
    "PublishError": "publish",
    "push_to_hub": "publish",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
