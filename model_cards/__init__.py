"""Model cards and Hub publishing for hf_variants models.

- `model_cards.card`: build a `huggingface_hub.ModelCard` for a trained model from its run folder
  (`results.json` + `model/`) or from explicit arguments, with Hub metadata (language, license, tags,
  datasets, metrics, base_model, model-index with BLEU/chrF and the sacreBLEU signatures) and one Jinja
  template per variant family (`model_cards/templates/<model_type>.md`, all extending `_base.md`).
- `model_cards.publish`: push a saved model folder (weights, tokenizer, remote code, card) to the Hub named
  by `HF_ENDPOINT`, with clear errors and without ever writing or logging the token.
"""

from .card import FAMILIES, build_model_card, card_from_run, load_results
from .publish import PublishError, push_to_hub

__all__ = ["FAMILIES", "PublishError", "build_model_card", "card_from_run", "load_results", "push_to_hub"]
