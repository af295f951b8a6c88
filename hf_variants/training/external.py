"""Models from outside hf_variants in the same training loop: transformers' `MarianMTModel` (`--model_type marian`).

hf_variants models carry the training interface themselves (`prepare_translation_inputs`, a `.loss` smoothed on request
and `after_optimizer_step`). A plain transformers seq2seq model has none of it; the three functions here give it the
same behaviour, so the one loop in `train.py` trains both and the benchmarks compare them on one code path:
the same tokenizer, batches, optimizer, schedule, label smoothing and beam search.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch

from ..loss_transformer_nmt import smoothed_cross_entropy

EXTERNAL_MODEL_TYPES = ("marian",)


def build_config(model_type: str, preset: str, fields: dict):
    """A transformers config of `model_type` with the dimensions of our baseline's `preset` (Marian's field names
    are ours: d_model, encoder_layers, ..., so a preset carries over unchanged) and the tokenizer's ids."""
    from transformers import MarianConfig

    from ..configuration_transformer_nmt import TransformerNmtConfig

    if model_type != "marian":
        raise ValueError(f"Unknown external --model_type {model_type!r}; supported: {EXTERNAL_MODEL_TYPES}")
    ours = TransformerNmtConfig.from_preset(preset)
    dims = {
        name: getattr(ours, name)
        for name in (
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "dropout",
            "attention_dropout",
            "activation_dropout",
            "max_position_embeddings",
        )
    }
    language_fields = ("label_smoothing", "languages", "source_languages", "target_languages", "target_language_tags")
    dims.update({k: v for k, v in fields.items() if k not in language_fields})
    if fields.get("target_language_tags"):
        raise ValueError("--model_type marian trains one direction here (no target-language tags).")
    vocab = dims["vocab_size"]
    return MarianConfig(
        **dims,
        decoder_vocab_size=vocab,
        share_encoder_decoder_embeddings=True,
        forced_eos_token_id=dims["eos_token_id"],
        scale_embedding=True,
    )


def has_training_interface(model) -> bool:
    return hasattr(model, "prepare_translation_inputs")


def prepare_translation_inputs(
    model,
    tokenizer,
    texts: Sequence[str],
    *,
    src_lang=None,
    tgt_lang=None,
    text_target: Sequence[str] | None = None,
    max_length: int | None = None,
    **variant_kwargs,
) -> dict[str, torch.Tensor]:
    """The model's own `prepare_translation_inputs`, or for a plain seq2seq model: source ids + mask, and labels
    (padding -100) when `text_target` is given."""
    if has_training_interface(model):
        return model.prepare_translation_inputs(
            tokenizer,
            texts,
            src_lang=src_lang,
            tgt_lang=tgt_lang,
            text_target=text_target,
            max_length=max_length,
            **variant_kwargs,
        )
    if variant_kwargs:
        raise ValueError(f"{type(model).__name__} takes no extra inputs, got {sorted(variant_kwargs)}.")
    encoded = tokenizer(
        list(texts),
        text_target=None if text_target is None else list(text_target),
        padding=True,
        truncation=max_length is not None,
        max_length=max_length,
        return_tensors="pt",
    )
    inputs = {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    if text_target is not None:
        inputs["labels"] = encoded["labels"].masked_fill(encoded["labels"] == tokenizer.pad_token_id, -100)
    return {key: value.to(model.device) for key, value in inputs.items()}


def loss_only_kwargs(model, label_smoothing: float = 0.0) -> dict:
    """Forward arguments for a forward whose logits nobody reads (training steps, the validation loss):
    `skip_logits=True` for a model whose forward takes it (hf_variants: the loss is computed from the decoder's
    hidden states chunk by chunk, and no [tokens, vocabulary] tensor is held), and `smoothing=label_smoothing`
    (hf_variants: `.loss` is the plain cross-entropy unless asked); nothing for other models."""
    try:
        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return {}
    kwargs = {"skip_logits": True} if "skip_logits" in parameters else {}
    if "smoothing" in parameters:
        kwargs["smoothing"] = label_smoothing
    return kwargs


def translation_loss(model, outputs, labels: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """`outputs.loss` of an hf_variants model (auxiliary losses included; label-smoothed when the forward got
    `loss_only_kwargs(model, label_smoothing)`, the plain cross-entropy otherwise); for a plain model,
    the token-mean label-smoothed cross-entropy of its logits (its own `.loss` has no smoothing), computed by
    the backbone's `smoothed_cross_entropy` (chunked: one [tokens, vocabulary] buffer, not F.cross_entropy's three)."""
    if has_training_interface(model):
        return outputs.loss
    return smoothed_cross_entropy(outputs.logits, labels, label_smoothing)


def after_optimizer_step(model) -> None:
    hook = getattr(model, "after_optimizer_step", None)
    if hook is not None:
        hook()
